"""The SLURM job and its recoveries (python -m run.job), which slurm_submit.sh and benchmark_only.sh start.
It owns the job's phases (job.py), its decisions after a failure (recovery.py), the launches it watches
(launch.py) and the heartbeats it reads there (heartbeats.py, which the ranks write: run/watchdog.py imports
it), the benchmark reports of its starts (benchmark_reports.py), and every call to SLURM (slurm.py).

It may import the standard library, common/ (files, node, suspects) and run/goodput.py, which records a
recovery for the next launch's ledger: nothing that imports torch, since in a container the job runs on the
host's python3 (docs/SLURM.md). It never imports train.py or benchmark.py: it launches them."""
