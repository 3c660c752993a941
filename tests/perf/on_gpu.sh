#!/usr/bin/env bash
# The whole one-GPU check of the 4b default in one command, in under 10 minutes, every figure in OUTDIR:
#
#   bash tests/perf/on_gpu.sh OUTDIR              # a bare GPU machine: its own python3, no network
#   bash tests/perf/on_gpu.sh OUTDIR --cpu-smoke  # the same steps on CPU at tiny size: the plumbing only
#
# 1. two runs of the 4b on dummy data, seq 2048, about 30 steps: the default `op` checkpointing and `full`
#    (on an 80 GB GPU `op` runs with --cpu_offload and fewer steps: its state alone fills the GPU);
#    tokens/s, MFU and max_memory_allocated beside the dry run's simulated peak;
# 2. a two-step --profile_steps trace of the first run, summarised by tests/perf/trace_summary.py;
# 3. benchmark.py's GPU section, and a plain loop of bf16 torch.mm at 8192^3 and 2048x2048x13312;
# 4. gpt2-xl at seq 1024 on dummy data, the same figures as 1.
# Each training run predicts its own step (copies of the model stepped on the GPU) and logs its steps against that.
#
# OUTDIR gets at most 8 small files: figures.txt (every figure, in order), log.txt (each step's output),
# and the same figures as JSON: run_<name>.json, trace.json, matmul.json, benchmark.yaml. A step that fails or runs out of its
# time says so in one line and the next one runs. Python: $PYTHON, else python3 (.venv's for --cpu-smoke).
set -uo pipefail

OUT=${1:?usage: bash tests/perf/on_gpu.sh OUTDIR [--cpu-smoke]}
SMOKE=0
[[ ${2:-} == --cpu-smoke ]] && SMOKE=1
REPO=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)  # logs, traces, checkpoints: large, so not in OUTDIR
trap 'rm -rf "$WORK"' EXIT
FIGURES=$OUT/figures.txt LOG=$OUT/log.txt
: >"$FIGURES"
: >"$LOG"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

say() { echo "$*" | tee -a "$FIGURES"; }

if ((SMOKE)); then
    PY=${PYTHON:-$REPO/.venv/bin/python}
    BATCH=2 MODEL=(--model=tiny --seq_length=64 --compile=False --mixed_precision=fp32)
    STEPS=8 OFFLOAD_STEPS=8 PROFILE=4,5 TRAIN_LIMIT=120
    MATMUL=(--shapes=256x256x256,128x128x512 --seconds=1)
    XL_BATCH=2 XL_MODEL=("${MODEL[@]}") XL_STEPS=8 XL_LIMIT=60
else
    PY=${PYTHON:-python3}
    BATCH=8 MODEL=(--model=4b --seq_length=2048)
    STEPS=30 OFFLOAD_STEPS=12 PROFILE=20,21 TRAIN_LIMIT=160
    MATMUL=(--seconds=10)
    XL_BATCH=16 XL_MODEL=(--model=gpt2-xl --seq_length=1024) XL_STEPS=25 XL_LIMIT=120
fi

# What is importable decides what runs: one line for what is missing, never a traceback.
missing=$("$PY" - <<'EOF' 2>/dev/null || echo "python"
import importlib.util
print(" ".join(m for m in ("torch", "transformers", "yaml", "numpy") if importlib.util.find_spec(m) is None))
EOF
)
if [[ -n $missing ]]; then
    say "missing: $missing (for $PY); nothing can run without them"
    exit 1
fi
GPU_GB=$("$PY" -c 'import torch; print(torch.cuda.get_device_properties(0).total_memory // 10**9 if torch.cuda.is_available() else 0)')
say "$("$PY" -c 'import torch, transformers, platform; print(f"torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}, " + (f"{torch.cuda.get_device_name(0)}, {torch.cuda.get_device_properties(0).total_memory / 1e9:.1f} GB" if torch.cuda.is_available() else "no GPU"))')"
if ((!SMOKE && GPU_GB == 0)); then
    say "no GPU seen by $PY: run with --cpu-smoke for the plumbing only"
    exit 1
fi
cd "$REPO" || exit 1

# Figures of `python train.py --dry_run --world_size=1 --seq_length=2048` at batch 8 (gpt2-xl: seq 1024, batch
# 16, no checkpointing), compiled as the runs are, run beforehand on CPU with torch 2.13, which the GPU image
# lacks: the simulated peak to hold max_memory_allocated against.
declare -A SIMULATED_GB=([op]=82.9 [full]=68.8 [op_offload]=34.7 [gpt2-xl]=60.8)
((SMOKE)) && SIMULATED_GB=()

# Trains until step $steps is logged, then kills the run: the 4b's final checkpoint (48 GB) would take
# minutes and most of the disk. A step that never comes is cut off after $TRAIN_LIMIT seconds. A plain
# `python train.py` (a process group of one), not torchrun: torchrun starts its worker in a session of its
# own, which killing torchrun's group leaves running, holding the GPU under the next run.
train_run() {
    local name=$1 steps=$2
    shift 2
    local metrics=$WORK/logs/$name/metrics.jsonl start=$SECONDS
    setsid "$PY" train.py "${MODEL[@]}" \
        --data=dummy --batch_size=$BATCH --global_batch_size=$BATCH --max_steps=1000 --warmup_steps=10 \
        --log_every=1 --eval_every=0 --checkpoint_every=1000 --tensorboard=False --curves=False \
        --hang_minimum_s=600 --log_dir="$WORK/logs" --checkpoint_dir="$WORK/checkpoints" --run_name="$name" \
        "$@" >>"$LOG" 2>&1 &
    local pid=$! limit
    limit=$(within "$TRAIN_LIMIT")
    until grep -qs "\"step\": $steps," "$metrics"; do
        if ! kill -0 "$pid" 2>/dev/null; then
            say "$name: the run ended before step $steps (see log.txt)"
            break
        fi
        if ((SECONDS - start > limit)); then
            say "$name: step $steps not reached in $limit s; figures of the steps logged"
            break
        fi
        sleep 2
    done
    kill -KILL -- "-$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    "$PY" tests/perf/on_gpu_figures.py "$metrics" --name="$name" --simulated_gb="${SIMULATED_GB[$name]:-0}" \
        --skip_steps="$PROFILE" --json="$OUT/run_$name.json" 2>>"$LOG" | tee -a "$FIGURES"
}

DEADLINE=570  # seconds for the whole script: the device tool ends a command at 600

# The smaller of $1 and the time left before DEADLINE, at least 0.
within() {
    local left=$((DEADLINE - SECONDS))
    echo $(($1 < left ? $1 : (left > 0 ? left : 0)))
}

step() {  # a title, a time limit in seconds, then the command
    local title=$1 limit
    limit=$(within "$2")
    shift 2
    if ((limit < 10)); then
        say "--- $title: skipped, the script's $DEADLINE s are spent"
        return 0
    fi
    echo "=== $title" >>"$LOG"
    say "--- $title"
    timeout -k 10 "$limit" "$@" 2>>"$LOG" | tee -a "$FIGURES"
    local status=${PIPESTATUS[0]}
    ((status == 124 || status == 137)) && say "$title: cut off after $limit s"
    ((status != 0 && status != 124 && status != 137)) && say "$title: failed with status $status (see log.txt)"
    return 0
}

# 3 first: seconds, and they tell whether the GPU is healthy before the long runs.
if ((GPU_GB > 0)); then
    step "benchmark.py's GPU section" 90 "$PY" benchmark.py --only=gpu --report_dir="$WORK/report"
    cp "$WORK"/report/*.yaml "$OUT/benchmark.yaml" 2>/dev/null
else
    say "--- benchmark.py's GPU section: needs a GPU, skipped"
fi
step "plain bf16 torch.mm loop" 40 "$PY" tests/perf/matmul_loop.py "${MATMUL[@]}" --json="$OUT/matmul.json"

# 1 and 2: the run that fits without offloading carries the trace.
if ((GPU_GB >= 120 || SMOKE)); then
    say "--- 1. op (the default), traced at steps $PROFILE"
    train_run op "$STEPS" --activation_checkpointing=op --profile_steps="$PROFILE"
    say "--- 1. full"
    train_run full "$STEPS" --activation_checkpointing=full
else
    say "--- 1. full, traced at steps $PROFILE (op at batch 8 needs ${SIMULATED_GB[op]} GB)"
    train_run full "$STEPS" --activation_checkpointing=full --profile_steps="$PROFILE"
    say "--- 1. op (the default) with --cpu_offload"
    train_run op_offload "$OFFLOAD_STEPS" --activation_checkpointing=op --cpu_offload=True
fi
trace=$(find "$WORK/logs" -name 'trace_steps_*.pt.trace.json' | head -1)
if [[ -n $trace ]]; then
    step "2. trace of steps $PROFILE" 90 "$PY" tests/perf/trace_summary.py "$trace" --json="$OUT/trace.json"
else
    say "--- 2. no trace was written (see log.txt)"
fi

say "--- 4. gpt2-xl"
BATCH=$XL_BATCH MODEL=("${XL_MODEL[@]}") TRAIN_LIMIT=$XL_LIMIT
train_run gpt2-xl "$XL_STEPS" --activation_checkpointing=none
say "--- done in $SECONDS s; files: $(cd "$OUT" && ls | tr '\n' ' ')"
