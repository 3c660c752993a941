"""The prediction: will a run fit, and how fast will it go? The step simulated on fake tensors for its peak
memory and work (simulate), measured where it will run (probe), or bounded by a roofline (roofline); the
predicted step, kept for later launches (step_time); --dry_run (dry_run), --plan and the auto options
(plan); the live step against its prediction (live). It imports common/, the model, run/options.py,
run/launch.py, run/stops.py, run/report_figures.py, run/health/ and run/progress/; only train.py and
benchmark.py import it."""
