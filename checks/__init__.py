"""The benchmark's measurements, verdicts and reports, one module per job; benchmark.py runs them."""
