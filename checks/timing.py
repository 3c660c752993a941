"""How the benchmark measures: CUDA-event or wall-clock stopwatches, medians of repeats, sustained loops,
and how bytes and FLOPs are counted (as STREAM and nccl-tests count them; GB = 1e9 bytes).
"""

import statistics
import time

import torch

from common.nccl_tests import BUSBW_FACTORS
from common.stopwatch import Stopwatch

GB = 1e9
MiB = 1 << 20
CPU_DEVICE = torch.device("cpu")

STREAM_ARRAYS_MOVED = {"copy": 2, "triad": 3}  # b = a; a = b + s*c


def algbw_GBps(size_bytes: float, seconds: float) -> float:
    return size_bytes / seconds / GB


def busbw_GBps(op: str, algbw: float, n_ranks: int) -> float:
    return algbw * BUSBW_FACTORS[op](n_ranks)


def stream_bytes(kernel: str, n_elements: int, itemsize: int = 8) -> int:
    """Bytes STREAM counts for one pass of `kernel`: each array read or written once, no write-allocate."""
    return STREAM_ARRAYS_MOVED[kernel] * itemsize * n_elements


def matmul_tflops(n: int, seconds: float) -> float:
    return 2 * n**3 / seconds / 1e12


def median_seconds(fn, device=CPU_DEVICE, warmup=1, repeats=5, inner=1) -> float:
    """Median over `repeats` of the seconds one call of `fn` takes (each repeat times `inner`
    back-to-back calls), after `warmup` untimed calls; on a GPU timed by CUDA events on its stream."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        watch = Stopwatch(device)
        watch.mark()
        for _ in range(inner):
            fn()
        watch.mark()
        times.append(watch.intervals()[0] / inner)
    return statistics.median(times)


def sustained(fn, device, warmup_s: float, seconds: float, window_s: float, while_busy=None) -> dict:
    """Calls of `fn` back to back: at least `warmup_s` of warm-up, in batches that double until one
    lasts half a window and that each wait for the device, so the host clock sees device time; then
    about `seconds` of calls in windows of about `window_s`, marked without any wait in between, so
    the device never idles and a throttling GPU shows as windows growing longer. `while_busy()` runs
    once everything is queued, before waiting for it (on a GPU, while the last calls still run).
    calls_per_s is over the whole timed loop; throttle_ratio is the last window's rate over the
    first's (1.0: steady, below: slowing down)."""
    calls, started = 1, time.perf_counter()
    while True:
        watch = Stopwatch(device)
        watch.mark()
        for _ in range(calls):
            fn()
        watch.mark()
        (batch,) = watch.intervals()
        if time.perf_counter() - started >= warmup_s:
            break
        if batch < window_s / 2:
            calls *= 2
    per_window = max(1, round(window_s * calls / max(batch, 1e-9)))
    windows = max(2, round(seconds / window_s))
    watch = Stopwatch(device)
    watch.mark()
    for _ in range(windows):
        for _ in range(per_window):
            fn()
        watch.mark()
    if while_busy:
        while_busy()
    durations = watch.intervals()
    calls = windows * per_window
    return {
        "calls_per_s": calls / sum(durations),
        "throttle_ratio": durations[0] / durations[-1],
        "seconds": sum(durations),
        "calls": calls,
    }
