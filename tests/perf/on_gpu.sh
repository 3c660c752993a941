#!/usr/bin/env bash
# The whole one-GPU check of the 4b default in one command, in under 10 minutes, every figure in OUTDIR:
#
#   bash tests/perf/on_gpu.sh OUTDIR              # a bare GPU machine: its own python3, no network
#   bash tests/perf/on_gpu.sh OUTDIR --cpu-smoke  # the same steps on CPU at tiny size: the plumbing only
#
# In this order, each step skipped with one line once the script's time is spent:
# 1. benchmark.py's GPU section (seconds: it tells whether the GPU is healthy before the long runs);
# 2. the 4b on dummy data, seq 2048, about 25 steps, with the default `op` checkpointing (on an 80 GB GPU,
#    `full`: `op` does not fit), then the same with --float8: tokens/s, MFU and max_memory_allocated beside
#    the dry run's simulated peak, and a two-step profile of each (tests/perf/trace_summary.py);
# 3. float8's loss against bf16's: gpt2 (124M) for 200 steps from the same seed on a corpus made of this
#    repository's text (tests/perf/learnable_corpus.py), the two runs side by side on the GPU;
# 4. gpt2-xl at seq 1024 in each checkpointing mode (none, op, full, selective), and without checkpointing
#    once more with --predict=False: what predicting adds to the time to the first step; then the 4b with
#    `full` (on an 80 GB GPU: `op` with --cpu_offload); the same figures as 2;
# 5. a plain loop of bf16 torch.mm at 8192^3 and 2048x2048x13312.
# PARTS="2 4" runs those parts alone (default: all); XL_MODES="none unpredicted none.2" picks gpt2-xl's
# runs. Each training run predicts its own step (the real model stepped on the GPU before its weights are
# set) and logs its steps against that; its figures give the time to its first step and the probe's seconds
# in it, and how often dynamo compiled a function again (TORCH_LOGS=recompiles). Every run compiles into a
# cache of its own, cold, as a user's first run does. float8 needs torchao and a GPU of compute capability
# 8.9 or newer; --cpu-smoke runs it through tests/float8_on_cpu.py, which allows it on the CPU.
#
# OUTDIR gets figures.txt (every figure, in order), log.txt (each step's output), and the same figures as
# JSON: run_<name>.json, trace_<name>.json, losses.json, matmul.json, benchmark.yaml. A step that fails or
# runs out of its time says so in one line and the next one runs. Python: $PYTHON, else python3 (.venv's for
# --cpu-smoke).
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
PARTS=" ${PARTS:-1 2 3 4 5} "
part() { [[ $PARTS == *" $1 "* ]]; }

if ((SMOKE)); then
    PY=${PYTHON:-$REPO/.venv/bin/python}
    SCRIPT=tests/float8_on_cpu.py  # train.py, with --float8 allowed on the CPU
    BATCH=2 MODEL=(--model=tiny --seq_length=64 --compile=False --mixed_precision=fp32)
    STEPS=8 OFFLOAD_STEPS=8 PROFILE=4,5 TRAIN_LIMIT=120
    MATMUL=(--shapes=256x256x256,128x128x512 --seconds=1)
    XL_BATCH=2 XL_MODEL=("${MODEL[@]}") XL_STEPS=8 XL_LIMIT=60
    LOSS_BATCH=8 LOSS_MODEL=("${MODEL[@]}") LOSS_STEPS=30 LOSS_LIMIT=120
else
    PY=${PYTHON:-python3}
    SCRIPT=train.py
    BATCH=8 MODEL=(--model=4b --seq_length=2048)
    STEPS=25 OFFLOAD_STEPS=12 PROFILE=15,16 TRAIN_LIMIT=170
    MATMUL=(--seconds=10)
    XL_BATCH=16 XL_MODEL=(--model=gpt2-xl --seq_length=1024) XL_STEPS=25 XL_LIMIT=120
    LOSS_BATCH=16 LOSS_MODEL=(--model=gpt2 --seq_length=512) LOSS_STEPS=200 LOSS_LIMIT=150
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
FLOAT8=$("$PY" - <<'EOF' 2>/dev/null
import importlib.util, torch
if importlib.util.find_spec("torchao") is None:
    print("torchao is not installed")
elif torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
    print("this GPU has no float8 matmuls (compute capability below 8.9)")
EOF
)
cd "$REPO" || exit 1

# Figures of `python train.py --dry_run --world_size=1 --seq_length=2048` at batch 8 and the run's
# --activation_checkpointing (gpt2-xl: seq 1024, batch 16; _float8: with --float8), compiled as the runs
# are, run beforehand on CPU with torch 2.13, which the GPU image lacks: the peak to hold
# max_memory_allocated against.
declare -A SIMULATED_GB=([op]=82.9 [full]=68.8 [op_offload]=34.7 [op_float8]=83.2 [full_float8]=69.3
    [gpt2-xl_none]=60.8 [gpt2-xl_op]=43.3 [gpt2-xl_full]=27.3 [gpt2-xl_selective]=42.7)
((SMOKE)) && SIMULATED_GB=()

# Trains until step $steps is logged, then kills the run: the 4b's final checkpoint (48 GB) would take
# minutes and most of the disk. A step that never comes is cut off after $TRAIN_LIMIT seconds. A plain
# `python train.py` (a process group of one), not torchrun: torchrun starts its worker in a session of its
# own, which killing torchrun's group leaves running, holding the GPU under the next run.
train_run() {
    local name=$1 steps=$2
    shift 2
    local metrics=$WORK/logs/$name/metrics.jsonl output=$WORK/output_$name.txt start=$SECONDS limit
    limit=$(within "$TRAIN_LIMIT")
    if ((limit < 20)); then
        say "$name: skipped, the script's $DEADLINE s are spent"
        return 0
    fi
    TORCHINDUCTOR_CACHE_DIR=$WORK/inductor_$name TORCH_LOGS=recompiles \
        setsid "$PY" "$SCRIPT" "${MODEL[@]}" --data=dummy --batch_size=$BATCH --global_batch_size=$BATCH \
        --max_steps=1000 --warmup_steps=10 --log_every=1 --eval_every=0 --checkpoint_every=1000 \
        --tensorboard=False --curves=False \
        --hang_minimum_s=600 --log_dir="$WORK/logs" --checkpoint_dir="$WORK/checkpoints" --run_name="$name" \
        "$@" >"$output" 2>&1 &
    local pid=$!
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
    { echo "=== $name"; cat "$output"; } >>"$LOG"
    "$PY" tests/perf/on_gpu_figures.py "$metrics" --name="$name" --simulated_gb="${SIMULATED_GB[$name]:-0}" \
        --skip_steps="$PROFILE" --output="$output" --json="$OUT/run_$name.json" 2>>"$LOG" | tee -a "$FIGURES"
}

DEADLINE=${DEADLINE:-570}  # seconds for the whole script (a device tool may end a command at 600)

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

# The profile of run $1, summarised in the background while the next run goes on; printed by summaries.
summarise() {
    local trace limit
    trace=$(find "$WORK/logs/$1" -name 'trace_steps_*.pt.trace.json' 2>/dev/null | head -1)
    limit=$(within 150)
    if [[ -z $trace ]]; then
        say "--- $1: no trace was written (see log.txt)"
        return 0
    fi
    timeout -k 10 "$limit" "$PY" tests/perf/trace_summary.py "$trace" --json="$OUT/trace_$1.json" \
        >"$WORK/summary_$1.txt" 2>>"$LOG" &
}

summaries() {
    wait  # the summaries still running
    local file
    for file in "$WORK"/summary_*.txt; do
        [[ -e $file ]] || continue
        say "--- the profile of $(basename "$file" .txt | cut -d_ -f2-)"
        tee -a "$FIGURES" <"$file"
    done
}

# float8's loss against bf16's: the same model, seed and data, the two runs at once on the one GPU.
loss_check() {
    step "3. the corpus" 60 "$PY" tests/perf/learnable_corpus.py "$WORK/learn"
    local data=(--data="$WORK/learn/corpus" --tokenizer="$WORK/learn/tokenizer" --max_steps=$LOSS_STEPS
        --warmup_steps=20 --lr=6e-4 --min_lr=6e-5 --eval_every=$LOSS_STEPS --eval_batches=20 --predict=False)
    (BATCH=$LOSS_BATCH MODEL=("${LOSS_MODEL[@]}") TRAIN_LIMIT=$LOSS_LIMIT
        train_run loss_bf16 "$LOSS_STEPS" "${data[@]}" --data_cache="$WORK/cache_bf16") &
    local bf16=$!
    (BATCH=$LOSS_BATCH MODEL=("${LOSS_MODEL[@]}") TRAIN_LIMIT=$LOSS_LIMIT
        train_run loss_float8 "$LOSS_STEPS" "${data[@]}" --data_cache="$WORK/cache_float8" --float8=True) &
    wait "$bf16" $!
    "$PY" tests/perf/compare_losses.py "$WORK/logs/loss_bf16/metrics.jsonl" \
        "$WORK/logs/loss_float8/metrics.jsonl" --json="$OUT/losses.json" 2>>"$LOG" | tee -a "$FIGURES"
}

if ! part 1; then
    :
elif ((GPU_GB > 0)); then
    step "1. benchmark.py's GPU section" 90 "$PY" benchmark.py --only=gpu --report_dir="$WORK/report"
    cp "$WORK"/report/*.yaml "$OUT/benchmark.yaml" 2>/dev/null
else
    say "--- 1. benchmark.py's GPU section: needs a GPU, skipped"
fi

# 2: the configuration that fits without offloading, in bf16 and in float8, each traced.
if ((GPU_GB >= 120 || SMOKE)); then
    FIRST=op SECOND=(full "$STEPS" --activation_checkpointing=full)
else
    FIRST=full SECOND=(op_offload "$OFFLOAD_STEPS" --activation_checkpointing=op --cpu_offload=True)
fi
if part 2; then
    say "--- 2. $FIRST, traced at steps $PROFILE"
    train_run "$FIRST" "$STEPS" --activation_checkpointing=$FIRST --profile_steps="$PROFILE"
    summarise "$FIRST"
    if [[ -n $FLOAT8 ]]; then
        say "--- 2. $FIRST with --float8: skipped, $FLOAT8"
    else
        say "--- 2. $FIRST with --float8, traced at steps $PROFILE"
        train_run "${FIRST}_float8" "$STEPS" --activation_checkpointing=$FIRST --float8=True \
            --profile_steps="$PROFILE"
        summarise "${FIRST}_float8"
    fi
fi
if part 3; then
    say "--- 3. float8's loss against bf16's"
    if [[ -n $FLOAT8 ]]; then
        say "skipped, $FLOAT8"
    else
        loss_check
    fi
fi

if part 4; then
    for mode in ${XL_MODES:-none unpredicted op full selective}; do  # a run again: none.2, unpredicted.2
        base=${mode%.*}
        checkpointing=${base/unpredicted/none}
        say "--- 4. gpt2-xl, checkpointing ${base/unpredicted/none, --predict=False}"
        flags=(--activation_checkpointing=$checkpointing)
        [[ $base == unpredicted ]] && flags+=(--predict=False)
        SIMULATED_GB[gpt2-xl_$mode]=${SIMULATED_GB[gpt2-xl_$checkpointing]:-0}
        (BATCH=$XL_BATCH MODEL=("${XL_MODEL[@]}") TRAIN_LIMIT=$XL_LIMIT
            train_run "gpt2-xl_$mode" "$XL_STEPS" "${flags[@]}")
    done
    say "--- 4. ${SECOND[0]}"
    train_run "${SECOND[@]}"
fi
part 5 && step "5. plain bf16 torch.mm loop" 40 "$PY" tests/perf/matmul_loop.py "${MATMUL[@]}" \
    --json="$OUT/matmul.json"
summaries
say "--- done in $SECONDS s; files: $(cd "$OUT" && ls | tr '\n' ' ')"
