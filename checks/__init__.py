"""The benchmark's measurements, verdicts and reports, one module per job; benchmark.py runs them. It imports
common/ alone, nothing of run/: what the benchmark needs of a training run, benchmark.py takes from run/."""
