"""Training speed of the default path against its alternatives, side by side in one run: torch.compile on
and off, bf16 (bf16 compute, fp32 weights and reduction) and fp32.

    python tests/perf/bench_train.py                       # CPU: tiny on 2 processes
    python tests/perf/bench_train.py --model=4b --nproc=8  # one 8-GPU node: the GPU table of
                                                           # docs/PERFORMANCE.md
    python tests/perf/bench_train.py --model=gpt2-xl --nproc=1 --global_batch_size=8  # one GPU

Options it does not know go to train.py as they are.

Each configuration trains --steps steps of dummy data; the first step (compilation) is left out of every
figure, as train.py's own log windows leave it out. Prints one row per configuration: median step time,
tokens/s (all ranks), MFU where the GPU's datasheet peak is known, and peak GPU memory (GB = 1e9 bytes).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CPU_MODEL = ["--batch_size=8", "--global_batch_size=16", "--seq_length=128"]


def run(args, nproc, folder):
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [
        str(torchrun),
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(REPO / "train.py"),
        f"--log_dir={folder}",
        f"--checkpoint_dir={folder}",
        "--log_every=1",
        "--eval_every=0",
        "--checkpoint_every=100000",
        *args,
    ]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{' '.join(args)} failed:\n{result.stderr[-3000:]}")
    records = [
        json.loads(line)
        for path in Path(folder).rglob("metrics.jsonl")
        for line in path.read_text().splitlines()
    ]
    return [r for r in records if r["step_time_s"] is not None]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a train.py preset; default: tiny on CPU, 4b on GPU")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--checkpointing", default="op", help="activation_checkpointing (default: train.py's)"
    )
    options, train_options = parser.parse_known_args()
    import torch

    on_gpu = torch.cuda.is_available()
    model = options.model or ("4b" if on_gpu else "tiny")
    shape = [] if on_gpu else CPU_MODEL
    print(
        f"{model} on {options.nproc} {'GPUs' if on_gpu else 'CPU processes'}, "
        f"activation_checkpointing={options.checkpointing}, {options.steps} steps each (the first left out)",
        *train_options,
    )
    print(f"{'compile':<8} {'precision':<10} {'step s':>8} {'tokens/s':>11} {'MFU':>6} {'peak GB':>8}")
    for compiled in (True, False):
        for precision in ("bf16", "fp32"):
            with tempfile.TemporaryDirectory() as folder:
                train_args = [
                    f"--model={model}",
                    *shape,
                    f"--max_steps={options.steps}",
                    f"--compile={compiled}",
                    f"--mixed_precision={precision}",
                    f"--activation_checkpointing={options.checkpointing}",
                    *train_options,
                ]
                records = run(train_args, options.nproc, folder)
            step = statistics.median(r["step_time_s"] for r in records)
            tokens = statistics.median(r["tokens_per_s"] for r in records)
            mfu = max((r["mfu"] for r in records if r["mfu"] is not None), default=None)
            memory = max((r["peak_mem_GB"] for r in records if r["peak_mem_GB"] is not None), default=None)
            mfu_text = f"{mfu:.1%}" if mfu is not None else "-"
            memory_text = f"{memory:.1f}" if memory is not None else "-"
            timing = f"{str(compiled):<8} {precision:<10} {step:8.3f} {tokens:11,.0f}"
            print(f"{timing} {mfu_text:>6} {memory_text:>8}", flush=True)


if __name__ == "__main__":
    main()
