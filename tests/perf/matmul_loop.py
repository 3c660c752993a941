"""A plain loop of bf16 torch.mm, for benchmark.py's matmul figure to be held against: the same shapes, no
harness. Prints TFLOP/s of each shape, timed by device events over --seconds after a warm-up.

    python tests/perf/matmul_loop.py                          # 8192^3 and MAMF's best H100 shape, 10 s each
    python tests/perf/matmul_loop.py --shapes=512x512x512 --seconds=1   # on CPU: the plumbing only

Each product reads fresh random inputs from a ring of several sets (bigger together than the L2), and the
median of 20 windows is reported beside the mean, so that a clock ramp or a throttled stretch shows.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

RING = 4  # input sets: 4 x 2 x 128 MiB at 8192^3, well past a 50 MB L2
PASSES = 10  # over the ring between synchronisations


def parse_shape(text):
    m, n, k = (int(size) for size in text.split("x"))
    return m, n, k


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_loop(m, n, k, seconds, device, dtype):
    """(mean, median over windows) TFLOP/s of m x k times k x n products, looping for about seconds."""
    sets = [(torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype))]
    sets += [(torch.randn_like(a), torch.randn_like(b)) for a, b in sets * (RING - 1)]
    out = torch.empty(m, n, device=device, dtype=dtype)
    for a, b in sets * 3:  # warm-up: handles, clocks
        torch.mm(a, b, out=out)
    synchronize(device)
    window_rates, products, started = [], 0, time.perf_counter()
    window = seconds / 20
    while time.perf_counter() - started < seconds:
        window_start, count = time.perf_counter(), 0
        while time.perf_counter() - window_start < window:
            for a, b in sets * PASSES:
                torch.mm(a, b, out=out)
            count += len(sets) * PASSES
            synchronize(device)  # once per PASSES passes: the host's wait stays out of the products' way
        window_rates.append(2 * m * n * k * count / (time.perf_counter() - window_start) / 1e12)
        products += count
    mean = 2 * m * n * k * products / (time.perf_counter() - started) / 1e12
    return mean, statistics.median(window_rates)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="8192x8192x8192,2048x2048x13312", help="MxNxK, comma-separated")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    figures = {}
    for text in args.shapes.split(","):
        mean, median = timed_loop(*parse_shape(text), args.seconds, device, dtype)
        figures[text] = {"mean_tflops": mean, "median_window_tflops": median}
        print(f"bf16 torch.mm {text}: {mean:.1f} TFLOP/s mean, {median:.1f} median of 20 windows ({device})")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
