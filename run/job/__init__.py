"""The SLURM job and its recoveries (python -m run.job), which slurm_submit.sh and benchmark_only.sh start.

It owns: the job's phases, carried out by one class holding the start's state (job.py); its choices after a
failure, pure functions tabled in tests/test_job_decisions.py (decisions.py); its knobs (knobs.py); a start's
nodes and arguments (start.py); the nodes it leaves out and its requeues (requeue.py); the launches it watches
(launch.py) and the heartbeats it reads there (heartbeats.py); the benchmark reports of its starts
(benchmark_reports.py); every call to SLURM (slurm.py); and its lines (lines.py).

It may import the standard library, common/ (files, node, suspects), run/progress/goodput.py (the recovery
it notes for the next launch's ledger) and run/stops.py (train.py's status after a stop): nothing that
imports torch, since in a container the job runs on the host's python3 (docs/SLURM.md). It launches train.py
and benchmark.py and never imports them. The ranks' side imports heartbeats.py alone
(run/health/watchdog.py writes the beats the job reads)."""
