"""train.py beside nanoGPT's train.py at the same shape, whole runs in turns, on one CPU process.

    git clone https://github.com/karpathy/nanoGPT /tmp/nanoGPT
    python tests/perf/bench_vs_nanogpt.py --nanogpt=/tmp/nanoGPT

The shape: 6 layers, 384 wide, 6 heads, 256 tokens, batch 8, GPT-2's vocabulary padded to 50304, biases
and tied embeddings (GPT-2's own), fp32, no compile, no dropout, no activation checkpointing. Both read
random tokens (nanoGPT from a train.bin this script writes in a temporary folder, train.py its dummy data),
so the data cost is alike and small. Each run takes --steps steps; the median of each run's per-step times
(the first 5 left out) is compared, pair by pair. Nothing is written into the nanoGPT checkout.
"""

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
SHAPE = dict(n_layer=6, n_head=6, n_embd=384, seq_length=256, batch_size=8)
SKIPPED_STEPS = 5


def nanogpt_command(nanogpt, folder, steps):
    return [
        sys.executable, str(nanogpt / "train.py"), "--device=cpu", "--compile=False", "--dtype=float32",
        f"--n_layer={SHAPE['n_layer']}", f"--n_head={SHAPE['n_head']}", f"--n_embd={SHAPE['n_embd']}",
        f"--block_size={SHAPE['seq_length']}", f"--batch_size={SHAPE['batch_size']}",
        "--gradient_accumulation_steps=1", "--dropout=0.0", "--bias=True", f"--max_iters={steps}",
        "--eval_interval=100000", "--eval_iters=1", "--log_interval=1", "--dataset=random",
        f"--out_dir={folder / 'nanogpt_out'}", "--wandb_log=False",
    ]  # fmt: skip


def train_command(folder, steps):
    return [
        sys.executable, str(REPO / "train.py"), "--model=gpt2", f"--n_layer={SHAPE['n_layer']}",
        f"--n_head={SHAPE['n_head']}", f"--n_embd={SHAPE['n_embd']}", f"--seq_length={SHAPE['seq_length']}",
        f"--batch_size={SHAPE['batch_size']}", f"--global_batch_size={SHAPE['batch_size']}",
        "--activation_checkpointing=none", "--mixed_precision=fp32", "--compile=False", "--data=dummy",
        f"--max_steps={steps}", "--log_every=1", "--eval_every=100000", "--checkpoint_every=100000",
        "--tensorboard=False", "--curves=False", f"--checkpoint_dir={folder / 'checkpoints'}",
        f"--log_dir={folder / 'logs'}",
    ]  # fmt: skip


def median_step_ms(command, cwd, pattern, scale):
    """Runs one whole training and returns the median of the step times its log prints, in ms."""
    run = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"error: {' '.join(command[:2])} failed:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    times = [float(value) * scale for value in re.findall(pattern, run.stdout)][SKIPPED_STEPS:]
    if not times:
        sys.exit(f"error: no step times in the output of {' '.join(command[:2])}")
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nanogpt", type=Path, required=True, help="a checkout of karpathy/nanoGPT")
    parser.add_argument("--pairs", type=int, default=2, help="runs of each, in turns")
    parser.add_argument("--steps", type=int, default=25, help="steps per run")
    bench = parser.parse_args()
    if not (bench.nanogpt / "train.py").is_file() or not (bench.nanogpt / "configurator.py").is_file():
        sys.exit(f"error: --nanogpt={bench.nanogpt} has no nanoGPT train.py; name a nanoGPT checkout")
    if bench.steps <= SKIPPED_STEPS:
        sys.exit(f"error: --steps={bench.steps} leaves no step past the first {SKIPPED_STEPS}; raise --steps")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        # nanoGPT reads configurator.py and data/<dataset>/ from its working directory
        (folder / "configurator.py").symlink_to(bench.nanogpt.resolve() / "configurator.py")
        data = folder / "data" / "random"
        data.mkdir(parents=True)
        tokens = np.random.default_rng(0).integers(0, 50257, 2_000_000, dtype=np.uint16)
        for split in ("train", "val"):
            tokens.tofile(data / f"{split}.bin")
        print(f"{'pair':<6}{'nanoGPT':>12}{'train.py':>12}{'ratio':>8}")
        ratios = []
        for pair in range(bench.pairs):
            nano_run = nanogpt_command(bench.nanogpt, folder, bench.steps)
            nano = median_step_ms(nano_run, folder, r"time ([\d.]+)ms", 1)
            ours_run = train_command(folder / str(pair), bench.steps)
            ours = median_step_ms(ours_run, folder, r"step ([\d.]+) s", 1e3)
            ratios.append(ours / nano)
            print(f"{pair + 1:<6}{nano:>10.0f}ms{ours:>10.0f}ms{ours / nano:>8.3f}")
        print(f"median ratio train.py/nanoGPT: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
