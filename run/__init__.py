"""What a training run is made of, a package per concept: data/, model/, checkpoint/, progress/ (the run's log
and goodput), health/ (when a run misbehaves), prediction/; the run's options.py, launch.py and stops.py; the
figures a benchmark report gives a run (report_figures.py); and the job that launches and recovers it (job.py
and its recovery, job_launch, heartbeats, benchmark_reports, slurm). train.py imports them; none imports
train.py (run/options.py reads its options from its source), benchmark.py or sample.py. Each package's own
docstring says what it may import."""
