#!/usr/bin/env bash
# Benchmarks every node:   sbatch benchmark_only.sh [benchmark.py arguments]   (from the repo root)
# Report: logs/benchmark_<jobid>_<first start, UTC>.yaml, with its picture (.png) and each node's part
# Without SLURM, `bash benchmark_only.sh [arguments]` benchmarks this machine. The job is slurm_submit.sh's
# (run/job/), whose knobs (NPROC_PER_NODE, BENCHMARK_ARGS, CONTAINER_IMAGE, ...) apply here too; see docs/SLURM.md.
#SBATCH --job-name=benchmark
#SBATCH --nodes=2
# (one torchrun per node is srun's choice: an #SBATCH --ntasks-per-node would pin --nodes=MIN-MAX to MIN)
##SBATCH --gpus-per-node=8            # GPU partitions: delete one '#' (CPU-only partitions: leave it off)
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=00:30:00
##SBATCH --partition=gpu
#SBATCH --output=logs/%x_%j.out
#SBATCH --error=logs/%x_%j.err
#SBATCH --no-requeue
set -euo pipefail
# sbatch runs a spool copy of this file, so in a job the repository is the working directory
[ -n "${SLURM_JOB_ID:-}" ] || cd "$(dirname "${BASH_SOURCE[0]}")"
[ -f slurm_submit.sh ] || { echo "error: no slurm_submit.sh in $PWD: submit from the repository root" >&2; exit 1; }
BENCHMARK_ONLY=1 SKIP_BENCHMARK=0 exec bash slurm_submit.sh "$@"
