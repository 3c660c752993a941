#!/usr/bin/env bash
# Benchmarks every node, then trains:   sbatch slurm_submit.sh [train.py arguments]   (from the repo root)
# Without SLURM, `bash slurm_submit.sh [train.py arguments]` runs the same phases on this machine: on a
# machine without GPUs that is the quick start (tiny model, 2 CPU processes). docs/SLURM.md has the details.
#
# The job's shape, in one place. Command-line options override these: sbatch --nodes=4 slurm_submit.sh
#SBATCH --job-name=fsdp-train
#SBATCH --nodes=2
# (one torchrun per node is srun's choice below: an #SBATCH --ntasks-per-node would pin --nodes=MIN-MAX to MIN)
##SBATCH --gpus-per-node=8            # GPU partitions: delete one '#' (CPU-only partitions: leave it off)
#SBATCH --exclusive                   # whole nodes: every CPU for the data loaders ...
#SBATCH --mem=0                       # ... and all of the memory
#SBATCH --time=04:00:00
##SBATCH --partition=gpu              # when the cluster's default partition is not the one you want
#SBATCH --output=logs/%x_%j.out
#SBATCH --error=logs/%x_%j.err
#SBATCH --signal=B:USR1@300           # SIGUSR1 to this script ~5 min before the time limit: checkpoint, requeue
#SBATCH --requeue
#SBATCH --open-mode=append            # a requeued run appends to the same log files
set -euo pipefail

# Network: uncomment only what your cluster needs (NCCL picks working defaults on most).
# export NCCL_SOCKET_IFNAME=ib0       # init hangs or uses a slow NIC: name the interface the nodes reach each other on
# export NCCL_IB_HCA=mlx5_0,mlx5_1    # InfiniBand: limit NCCL to the HCAs that are cabled / allowed for jobs
# export FI_PROVIDER=efa              # AWS EFA (with the aws-ofi-nccl plugin): use the EFA libfabric provider
# export FI_EFA_USE_DEVICE_RDMA=1     # AWS EFA on p4d/p5: GPUDirect RDMA between GPUs and the EFA devices
# export NCCL_DEBUG=INFO              # a collective hangs or is slow: log the transports NCCL chose

# Knobs: environment variables, e.g. SKIP_BENCHMARK=1 sbatch slurm_submit.sh (sbatch passes the environment).
SKIP_BENCHMARK=${SKIP_BENCHMARK:-0}                               # 1: go straight to training
CONTINUE_ON_BENCHMARK_FAILURE=${CONTINUE_ON_BENCHMARK_FAILURE:-0} # 1: train even when a check failed
BENCHMARK_ARGS=${BENCHMARK_ARGS:-}            # extra benchmark.py arguments, e.g. "--skip storage"
NPROC_PER_NODE=${NPROC_PER_NODE:-2}           # processes per node on nodes without GPUs
REQUIRE_GPUS=${REQUIRE_GPUS:-0}               # 1: fail instead of running on CPU when there is no GPU
MAX_REQUEUES=${MAX_REQUEUES:-5}               # how many times the job may requeue itself (time limit, bad node)
MAX_EXCLUDED_NODES=${MAX_EXCLUDED_NODES:-2}   # nodes the job may leave out as bad, requeueing without each; 0: none
REHEARSE_BAD_NODES=${REHEARSE_BAD_NODES:-}    # node names (n1,n2): benchmark.py fails them, to rehearse the above
TORCHRUN_MAX_RESTARTS=${TORCHRUN_MAX_RESTARTS:-0} # >0: torchrun restarts failed workers inside the allocation
CONTAINER_IMAGE=${CONTAINER_IMAGE:-}          # run in this image (pyxis/enroot, its python) instead of .venv
VENV=${VENV:-.venv}
BENCHMARK_ONLY=${BENCHMARK_ONLY:-0}           # set by benchmark_only.sh: arguments go to benchmark.py

die() { echo "error: $*" >&2; exit 1; }

# Time limit: SLURM sends SIGUSR1 (--signal) to this script only, possibly a minute early, so the traps are
# set first (an untrapped SIGUSR1 kills this shell). torchrun dies of SIGUSR1, so the stop goes to the
# training processes themselves; train.py checkpoints, every rank exits 75, and the job requeues.
stop=""   # "requested" once SIGUSR1 came, "sent" once a training process has it
trap 'stop=${stop:-requested}; echo "$(date +%T) SIGUSR1: time limit near, checkpointing to requeue"' USR1
# at the time limit (or on scancel) SLURM signals every process; keep waiting so the checkpoint can finish
trap 'echo "$(date +%T) SIGTERM: waiting for the training processes to exit"' TERM

# sbatch runs a spool copy of this file, so in a job the repository is the working directory (where sbatch
# ran, or its --chdir)
[ -n "${SLURM_JOB_ID:-}" ] || cd "$(dirname "${BASH_SOURCE[0]}")"
[ -f train.py ] || die "no train.py in $PWD: submit from the repository root (cd <repo> && sbatch slurm_submit.sh)"

seen=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
gpus=${SLURM_GPUS_ON_NODE:-$seen}
[ "$gpus" -eq 0 ] || [ "$seen" -gt 0 ] || die "the job has $gpus GPUs per node but nvidia-smi sees none on $(hostname)"
if [ "$gpus" -eq 0 ] && [ "$REQUIRE_GPUS" = 1 ]; then
  [ -n "${SLURM_JOB_ID:-}" ] \
    || die "no SLURM job and no GPU here (REQUIRE_GPUS=1): run sbatch slurm_submit.sh on a GPU cluster"
  die "no GPU on $(hostname) (REQUIRE_GPUS=1): add --gpus-per-node to the #SBATCH lines or pick a GPU partition"
fi

read -ra bench_args <<< "$BENCHMARK_ARGS"
train_args=()
if [ "$gpus" -gt 0 ]; then
  nproc=$gpus
  # GPU runs train on wikitext-103 unless the arguments say otherwise; compute nodes without internet
  # need `python train.py --prepare_only --data=wikitext` run once on a login node (train.py says so)
  train_args=(--data=wikitext)
else
  # no GPU: a run small enough for CPUs; the script's arguments come last, so they override it
  nproc=$NPROC_PER_NODE
  world=$(( nproc * ${SLURM_NNODES:-1} ))
  bench_args=(--quick "${bench_args[@]}")
  # 4 sequences per process, at least 16 per step, a multiple of 4 x world whatever the process count
  train_args=(--model=tiny --data=dummy --max_steps=40 --seq_length=64 --batch_size=4
              --global_batch_size=$(( 4 * world * ((4 + world - 1) / world) ))
              --lr=3e-3 --warmup_steps=4 --compile=False --activation_checkpointing=False
              --log_every=5 --log_dir=logs/quickstart)
  # outside SLURM this is the quick start: a new run each time, which shows the loss falling again
  # rather than resuming the finished one (pass --run_name=... to resume instead)
  [ -n "${SLURM_JOB_ID:-}" ] || train_args+=(--checkpoint_dir=logs/quickstart/checkpoints --keep_last=1
                                             --run_name="quickstart-$(date +%Y%m%d-%H%M%S)")
fi
if [ "$BENCHMARK_ONLY" = 1 ]; then bench_args+=("$@"); else train_args+=("$@"); fi

py=$(realpath -m "$VENV")/bin/python   # VENV may be relative to the repository, like setup.sh takes it
if [ -n "${SLURM_JOB_ID:-}" ]; then
  mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  [ "${#hosts[@]}" -eq "$SLURM_NNODES" ] \
    || die "SLURM_NNODES=$SLURM_NNODES but the job has ${#hosts[@]} nodes (${hosts[*]}): torchrun would wait forever"
  # --cpus-per-task: srun (22.05+) no longer inherits it, and one CPU would starve the data loaders.
  # --kill-on-bad-exit=0 (some clusters default to 1): every rank exits 75 after a checkpoint, and the
  # first node to finish must not kill the others while they still write theirs.
  srun_args=(--ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" --kill-on-bad-exit=0)
  if [ -n "$CONTAINER_IMAGE" ]; then
    py=python
    srun_args+=(--container-image="$CONTAINER_IMAGE" --container-mounts="$PWD:$PWD" --container-workdir="$PWD")
  else
    # once, here, not on every node: on a cluster the repository is on the shared filesystem
    bash setup.sh \
      || die "no usable virtual environment in ${py%/bin/python}: run 'bash setup.sh' on the login node, then resubmit"
  fi
  where="job $SLURM_JOB_ID on ${hosts[*]}"
else
  bash setup.sh
  hosts=("$(hostname)")
  where="$(hostname) (no SLURM job)"
fi
restarts=${SLURM_RESTART_COUNT:-0}
device=$([ "$gpus" -gt 0 ] && echo GPUs || echo CPU)
echo "$(date +%T) $where: SLURM_RESTART_COUNT=$restarts, $nproc processes per node ($device)"
export REHEARSE_BAD_NODES

# Nodes this job left out before (heal() below) stay out even when SLURM allocates them again, as it may
# when the requeue's ExcNodeList came too late: the job's comment keeps them (squeue -o %k shows it).
nodes=("${hosts[@]}")
if [ -n "${SLURM_JOB_ID:-}" ]; then
  left_out=$(squeue -h -j "$SLURM_JOB_ID" -o %k | grep -oP '(^| )left_out=\K\S+' || true)
  mapfile -t nodes < <(printf '%s\n' "${hosts[@]}" | grep -vxFf <(tr , '\n' <<< "$left_out") || true)
  [ "${#nodes[@]}" -gt 0 ] || die "this job left out every node it has now: ${hosts[*]} (left_out=$left_out)"
  [ "${#nodes[@]}" -eq "${#hosts[@]}" ] \
    || echo "$(date +%T) running on ${nodes[*]} alone: this job left out $left_out before (its comment: squeue -j $SLURM_JOB_ID -o %k)"
fi

# The training options are checked first, on this node, so that a typo costs seconds rather than the
# benchmarks. The check names the run's log folder, where a failed phase leaves the nodes it blames.
run_folder=""
if [ "$BENCHMARK_ONLY" != 1 ]; then
  one_node=()
  [ -z "$CONTAINER_IMAGE" ] || one_node=(srun "${srun_args[@]}" --nodes=1 --ntasks=1 --nodelist="${nodes[0]}")
  checked=$(WORLD_SIZE=$(( nproc * ${#nodes[@]} )) "${one_node[@]}" "$py" train.py --check_only \
            "${train_args[@]}") || { echo "error: not started: train.py refused its options (above)" >&2; exit 2; }
  run_folder=${checked#checked: log folder }
fi

if [ -n "${SLURM_JOB_ID:-}" ]; then
  # The port comes from the job id, so that two jobs sharing a node do not collide, and lies below the
  # kernel's ephemeral ports (32768 and up), one of which an outgoing connection may hold on the first node.
  launcher=(srun "${srun_args[@]}" --nodes="${#nodes[@]}" --nodelist="$(IFS=,; echo "${nodes[*]}")"
            "$py" -m torch.distributed.run --nnodes="${#nodes[@]}" --nproc_per_node="$nproc"
            --rdzv_backend=c10d --rdzv_endpoint="${nodes[0]}:$((10000 + SLURM_JOB_ID % 20000))"
            --rdzv_id="$SLURM_JOB_ID" --max-restarts="$TORCHRUN_MAX_RESTARTS")
else
  launcher=("$py" -m torch.distributed.run --standalone --nproc_per_node="$nproc"
            --max-restarts="$TORCHRUN_MAX_RESTARTS")
fi

# SIGUSR1 for one local worker (a child of this job's torchrun) that catches it: a worker that has not set
# its handler yet would die of it. One is enough: train.py shares the stop flag with every rank, on every node.
signal_workers() {
  local launchers pid mask
  launchers=$(pgrep -d, -f -- "--rdzv_id=$SLURM_JOB_ID( |\$)") || return 1
  for pid in $(pgrep -P "$launchers"); do
    mask=$(awk '/^SigCgt/ {print $2}' "/proc/$pid/status" 2>/dev/null) || continue
    if (( 0x${mask:-0} & 0x200 )) && kill -USR1 "$pid" 2>/dev/null; then return 0; fi
  done
  return 1
}

# A phase's ranks name the nodes they blame in <run folder>/suspects (train.py's watchdog, benchmark.py).
hang_blamed_before() {  # $1 seconds ago: a watchdog named the node its rank waits for
  [ -n "$(find "$run_folder/suspects" -name 'hang_*' ! -newermt "@$(( $(date +%s) - $1 ))" 2>/dev/null)" ]
}

# Runs one phase on every node. In the background because bash runs a trap only while waiting on a builtin;
# the loop hands a pending stop to the workers as soon as one of them can catch it. A node that froze never
# lets its srun end: once the other ranks have blamed it and had time to exit, the step is ended (srun ends
# it with SIGKILL on a second SIGINT).
launch() {
  rm -rf "${run_folder:-/nonexistent}/suspects"
  "${launcher[@]}" "$@" &
  local pid=$! ended=""
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$stop" = requested ] && signal_workers; then stop=sent; fi
    if [ -n "${SLURM_JOB_ID:-}" ] && [ -z "$ended" ] && [ -n "$run_folder" ] && hang_blamed_before 15; then
      echo "$(date +%T) a hang blamed a node 15 s ago ($run_folder/suspects) and the step goes on: ending it"
      kill -INT "$pid"; sleep 0.2; kill -INT "$pid" 2>/dev/null || true; ended=1
    fi
    sleep 1 & wait $! || true
  done
  wait "$pid"
}

requeue() {  # $1: the exit status to report when no requeue is left
  [ "$restarts" -lt "$MAX_REQUEUES" ] \
    || { echo "stopped for the time limit, but all MAX_REQUEUES=$MAX_REQUEUES requeues are used"; exit "$1"; }
  echo "$(date +%T) requeueing job $SLURM_JOB_ID (restart $((restarts + 1)) of at most $MAX_REQUEUES)," \
       "to resume from the checkpoint"
  scontrol requeue "$SLURM_JOB_ID" || die "scontrol requeue failed (was the job submitted with --no-requeue?)"
  exit 0
}

# A failed phase that blamed nodes: they are added to <run folder>/excluded_nodes and the job is requeued
# without them, to resume from its last checkpoint on the others (docs/SLURM.md). A failure that blames no
# node (bad input, a diverging loss, a full disk) stops the job, as does a node beyond MAX_EXCLUDED_NODES.
heal() {  # $1: the failed phase's exit status
  local nodes excluded
  [ -n "${SLURM_JOB_ID:-}" ] && [ -n "$run_folder" ] && [ "$MAX_EXCLUDED_NODES" -gt 0 ] || exit "$1"
  nodes=$(python3 -m run.heal "$run_folder" "$MAX_EXCLUDED_NODES") || exit "$1"
  [ "$restarts" -lt "$MAX_REQUEUES" ] \
    || { echo "error: stopping: $nodes left out, but all MAX_REQUEUES=$MAX_REQUEUES requeues are used" >&2; exit "$1"; }
  excluded=$(scontrol show job "$SLURM_JOB_ID" | grep -oP 'ExcNodeList=\K[^ (]+' || true)
  comment=$(squeue -h -j "$SLURM_JOB_ID" -o %k | sed -E 's/^\(null\)$//; s/ ?left_out=\S+//')
  echo "$(date +%T) leaving out $nodes (why: $run_folder/excluded_nodes); requeueing job $SLURM_JOB_ID" \
       "(restart $((restarts + 1)) of at most $MAX_REQUEUES) to resume on the other nodes"
  scontrol update JobId="$SLURM_JOB_ID" Comment="${comment:+$comment }left_out=$nodes" \
    || die "scontrol update JobId=$SLURM_JOB_ID Comment=... failed: the job is not requeued"
  # A running job's node list cannot change. Once requeued it can, until it starts again; SLURM may refuse
  # while the job completes, and then the comment above keeps the next start off these nodes.
  scontrol requeue "$SLURM_JOB_ID" || die "scontrol requeue failed (was the job submitted with --no-requeue?)"
  for _ in $(seq 10); do
    scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="${excluded:+$excluded,}$nodes" 2>/dev/null && exit 0
    sleep 0.3
  done
  echo "$(date +%T) SLURM refused ExcNodeList=$nodes for now: the next start may be given them, and runs on its other nodes"
  exit 0
}

report=logs/benchmark_${SLURM_JOB_ID:-}.yaml
if [ "$SKIP_BENCHMARK" = 1 ]; then
  echo "SKIP_BENCHMARK=1: skipping the benchmarks"
elif [ "$restarts" -gt 0 ] && grep -Eqs '^verdict: (pass|warn)' "$report"; then
  echo "requeued run: skipping the benchmarks (they passed in this job's earlier start)"
else
  echo "$(date +%T) phase 1: benchmark.py ${bench_args[*]}"
  [ -z "$run_folder" ] || bench_args+=(--suspects_folder="$run_folder/suspects")
  rc=0
  launch benchmark.py "${bench_args[@]}" || rc=$?
  # benchmark.py names it after the job, or after the time outside SLURM
  report=logs/benchmark_${SLURM_JOB_ID:-}.yaml
  [ -n "${SLURM_JOB_ID:-}" ] \
    || report=$(ls -t logs/benchmark_*.yaml 2>/dev/null | grep -v _rank | head -1 || true)
  [ "$BENCHMARK_ONLY" != 1 ] || exit $rc
  if [ $rc -ne 0 ] && [ "$CONTINUE_ON_BENCHMARK_FAILURE" != 1 ]; then
    echo "error: benchmark failed (exit $rc), not training: its failing checks are in the output (the job's .out log)" \
         "(CONTINUE_ON_BENCHMARK_FAILURE=1 trains anyway)" >&2
    heal $rc
  fi
  [ $rc -eq 0 ] || echo "benchmark failed (exit $rc); CONTINUE_ON_BENCHMARK_FAILURE=1, so training anyway"
  # the time limit came during the benchmarks: the requeued run goes straight to training
  [ -z "$stop" ] || requeue 1
fi

# train.py points to this job's report from the run's folder, logs/<run_name>/benchmark_reports.txt
if [ -f "$report" ]; then export BENCHMARK_REPORT=$report; fi
echo "$(date +%T) phase 2: train.py ${train_args[*]}"
rc=0
launch train.py "${train_args[@]}" || rc=$?
echo "$(date +%T) training exited with status $rc"
if [ -n "$stop" ] && [ $rc -ne 0 ]; then requeue $rc; fi
[ $rc -eq 0 ] || heal $rc
if [ -z "${SLURM_JOB_ID:-}" ] && [ "$gpus" -eq 0 ] && [ $rc -eq 0 ]; then
  echo "That was the CPU quick start. On a GPU cluster: sbatch slurm_submit.sh [train.py arguments] (docs/SLURM.md)."
fi
exit $rc
