#!/usr/bin/env bash
# Benchmarks every node, then trains:   sbatch slurm_submit.sh [train.py arguments]   (from the repo root)
# Without SLURM, `bash slurm_submit.sh [train.py arguments]` runs the same phases on this machine: on a
# machine without GPUs that is the quick start (tiny model, 2 CPU processes). docs/SLURM.md has the details.
#
# The job's shape, in one place. Command-line options override these: sbatch --nodes=4 slurm_submit.sh
#SBATCH --job-name=fsdp-train
#SBATCH --nodes=2
# (one torchrun per node is the job's choice, run/job/slurm.py: an #SBATCH --ntasks-per-node would pin --nodes=MIN-MAX to MIN)
##SBATCH --gpus-per-node=8            # GPU partitions: delete one '#' (CPU-only partitions: leave it off)
#SBATCH --exclusive                   # whole nodes: every CPU for the data loaders ...
#SBATCH --mem=0                       # ... and all of the memory
#SBATCH --time=04:00:00
##SBATCH --partition=gpu              # when the cluster's default partition is not the one you want
#SBATCH --output=logs/%x_%j.out
#SBATCH --error=logs/%x_%j.err
#SBATCH --signal=B:USR1@300           # SIGUSR1 to this script ~5 min before the time limit: checkpoint, requeue
#SBATCH --requeue
#SBATCH --no-kill                     # a node that fails does not end the job: the job leaves it out (SPARE_NODES)
#SBATCH --open-mode=append            # a requeued run appends to the same log files
set -euo pipefail

# Network: uncomment only what your cluster needs (NCCL picks working defaults on most).
# export NCCL_SOCKET_IFNAME=ib0       # init hangs or uses a slow NIC: name the interface the nodes reach each other on
# export NCCL_IB_HCA=mlx5_0,mlx5_1    # InfiniBand: limit NCCL to the HCAs that are cabled / allowed for jobs
# export FI_PROVIDER=efa              # AWS EFA (with the aws-ofi-nccl plugin): use the EFA libfabric provider
# export FI_EFA_USE_DEVICE_RDMA=1     # AWS EFA on p4d/p5: GPUDirect RDMA between GPUs and the EFA devices
# export NCCL_DEBUG=INFO              # a collective hangs or is slow: log the transports NCCL chose

# SLURM may send SIGUSR1 (--signal) this early: noted, for the job's Python to act on (an untrapped one
# would kill this shell), then ignored while that Python starts.
trap 'export JOB_SIGUSR1=1' USR1

# Knobs: environment variables, e.g. SKIP_BENCHMARK=1 sbatch slurm_submit.sh (sbatch passes the environment).
# Each default is stated here alone: run/job/knobs.py says what each knob takes and refuses one that is missing.
export SKIP_BENCHMARK=${SKIP_BENCHMARK:-0}                      # 1: go straight to training
export CONTINUE_ON_BENCHMARK_FAILURE=${CONTINUE_ON_BENCHMARK_FAILURE:-0} # 1: train even when a check failed
export BENCHMARK_ARGS=${BENCHMARK_ARGS:-}   # extra benchmark.py arguments, e.g. "--skip storage"
export NPROC_PER_NODE=${NPROC_PER_NODE:-2}  # processes per node on nodes without GPUs
export REQUIRE_GPUS=${REQUIRE_GPUS:-0}      # 1: fail instead of running on CPU when there is no GPU
export MAX_REQUEUES=${MAX_REQUEUES:-5}      # how many times the job may requeue itself (time limit, bad node)
export MAX_EXCLUDED_NODES=${MAX_EXCLUDED_NODES:-2} # nodes the job may leave out as bad (a spare or a requeue for each); 0: none
export REHEARSE_BAD_NODES=${REHEARSE_BAD_NODES:-}  # node names (n1,n2): benchmark.py fails them, to rehearse the above
export SPARE_NODES=${SPARE_NODES:-0}        # nodes kept ready to replace a failed one (--nodes = nodes to train on + these)
export MAX_RESTARTS=${MAX_RESTARTS:-3}      # restarts in place, on the same nodes, after a crashed rank on healthy nodes
export CONTAINER_IMAGE=${CONTAINER_IMAGE:-} # run in this image (pyxis/enroot, its python) instead of .venv
export BENCHMARK_ONLY=${BENCHMARK_ONLY:-0}  # 1: the benchmarks alone, no training (benchmark_only.sh sets it)
VENV=${VENV:-.venv}

# sbatch runs a spool copy of this file, so in a job the repository is the working directory (where sbatch
# ran, or its --chdir)
[ -n "${SLURM_JOB_ID:-}" ] || cd "$(dirname "${BASH_SOURCE[0]}")"
if [ ! -f run/job/__main__.py ]; then
  echo "error: no run/job/ in $PWD: submit from the repository root (cd <repo> && sbatch slurm_submit.sh)" >&2
  exit 1
fi
py=$(realpath -m "$VENV")/bin/python   # VENV may be relative to the repository, like setup.sh takes it
if [ -n "$CONTAINER_IMAGE" ] && [ -n "${SLURM_JOB_ID:-}" ]; then
  py=python3   # the job needs only the standard library here; its workers run the container's python
elif ! bash setup.sh; then   # once, here: on a cluster the repository is on the shared filesystem
  echo "error: no usable virtual environment in ${py%/bin/python}: run 'bash setup.sh', then resubmit" >&2
  exit 1
fi
# The phases (run/job/): the options checked, benchmarks, nodes left out, training, the requeue. SLURM's
# SIGUSR1 (--signal=B:) comes to this process, which is then the job's Python.
trap '' USR1
exec "$py" -m run.job "$@"
