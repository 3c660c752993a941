"""The prediction: will a run fit, and how fast will it go? The step simulated on fake tensors for its peak
memory and work (simulate), measured where it will run (probe), or bounded by a roofline (roofline); the
predicted step on its basis, kept for later launches (step_time); --dry_run (dry_run), --plan and the auto
options (plan), and the live step held against its prediction at every log window (live). It imports
common/, the model, run/options.py, run/launch.py, run/stops.py, run/report_figures.py, the stragglers'
timing of a rank (run/health/) and the run's log's words (run/progress/); nothing imports it but train.py
and benchmark.py."""
