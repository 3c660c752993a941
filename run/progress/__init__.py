"""The run's log and what it cost: where the run stands and how fast it goes (progress), the end of each log
window (window), its records (run_log: metrics.jsonl, TensorBoard, W&B, config.yaml), where its hours went
across launches (goodput), its curves (curves) and a profiler on demand (profiler). It imports common/
alone: what other owners add to a log window (the stragglers', the live prediction's figures) it is handed,
and reads as fields of the record. goodput is standard library only: the job (run/job/)
records its recoveries with it."""
