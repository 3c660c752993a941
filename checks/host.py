"""The host: CPU (pure-Python work per core, all cores, matmul, sort, zlib) and memory (STREAM copy and
triad, one thread and all cores, with arrays at least 4x the L3 cache).
"""

import mmap
import os
import statistics
import subprocess
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from checks.timing import GB, MiB, matmul_tflops, median_seconds, stream_bytes

CPU_WORK_ITERATIONS = 200_000  # one pure-Python work unit, ~10 ms on a current core

# Fresh interpreters (-I: no site-packages, ~20 ms to start), not a fork: forking a process that
# holds gloo/NCCL/OpenMP threads can deadlock the child on a lock one of those threads held.
# Each says "ready", waits for "go" so that all work at once, and prints its own working time.
CPU_WORKER = f"""
import sys, time
print("ready", flush=True)
sys.stdin.readline()
started = time.perf_counter()
for _ in range(int(sys.argv[1])):
    sum(i * i % 7 for i in range({CPU_WORK_ITERATIONS}))
print(time.perf_counter() - started)
"""


def pure_python_seconds(processes: int, units: int) -> float:
    """Seconds for `processes` interpreters each doing `units` work units at the same time."""
    workers = [
        subprocess.Popen(
            [sys.executable, "-I", "-c", CPU_WORKER, str(units)],
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for _ in range(processes)
    ]
    for worker in workers:
        worker.stdout.readline()
    for worker in workers:
        worker.stdin.write("go\n")
        worker.stdin.flush()
    return max(float(worker.communicate()[0]) for worker in workers)


def usable_cores() -> int:
    return len(os.sched_getaffinity(0))  # what SLURM's cgroup gives this job, not the whole machine


def cpu_section(cfg: dict) -> dict:
    cores, units = usable_cores(), cfg["cpu_units_per_core"]
    single = statistics.median(pure_python_seconds(1, units) for _ in range(cfg["repeats"]))
    every = statistics.median(pure_python_seconds(cores, units) for _ in range(cfg["repeats"]))
    result = {"cores": cores, "single_core_ops/s": units / single, "all_core_ops/s": cores * units / every}
    result["per_core_ops/s"] = result["all_core_ops/s"] / cores
    # torch rather than numpy: numpy's BLAS thread count is fixed at import (torchrun sets
    # OMP_NUM_THREADS=1), while torch.set_num_threads gives the matmul every core of the node.
    threads, n = torch.get_num_threads(), cfg["cpu_matmul_size"]
    torch.set_num_threads(cores)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        seconds = median_seconds(lambda: torch.mm(a, b), repeats=cfg["repeats"])
        result["matmul_fp32_GFLOPS"] = matmul_tflops(n, seconds) * 1e3
    finally:
        torch.set_num_threads(threads)
    # 16-symbol random bytes compress to ~57%, like tokenized data; zlib.compress releases the GIL
    data = np.random.default_rng(0).integers(0, 16, cfg["zlib_MiB"] * MiB, dtype=np.uint8).tobytes()
    seconds = median_seconds(lambda: zlib.compress(data), repeats=cfg["repeats"])
    result["zlib_single_core_MB/s"] = len(data) / seconds / 1e6
    with ThreadPoolExecutor(cores) as pool:
        seconds = median_seconds(
            lambda: list(pool.map(zlib.compress, [data] * cores)), repeats=cfg["repeats"]
        )
    result["zlib_all_cores_MB/s"] = len(data) * cores / seconds / 1e6
    values = np.random.default_rng(0).random(cfg["sort_Melem"] * 1_000_000)
    seconds = median_seconds(lambda: np.sort(values), repeats=cfg["repeats"])
    result["sort_float64_Melem/s"] = cfg["sort_Melem"] / seconds
    return result


def l3_cache_bytes() -> int:
    """Total last-level cache over all sockets, each shared cache counted once; 0 where /sys won't say."""
    caches = {}
    for index in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            if (index / "level").read_text().strip() == "3":
                size = (index / "size").read_text().strip()  # "32768K"
                multiple = {"K": 1 << 10, "M": MiB, "G": 1 << 30}.get(size[-1], 1)
                caches[(index / "shared_cpu_list").read_text().strip()] = int(size.rstrip("KMG")) * multiple
        except (OSError, ValueError):
            continue
    return sum(caches.values())


def memcpy_streaming_threshold_bytes() -> int | None:
    """glibc's x86_non_temporal_threshold: a memcpy or memmove larger than this writes with non-temporal
    stores, which skip reading each destination line before writing it; a smaller one reads it first (a
    third more traffic than a copy counts). From ld.so's tunables (glibc 2.33+); None elsewhere."""
    for loader in sorted(Path("/").glob("lib*/ld-linux*.so*")):
        try:
            listed = subprocess.run([loader, "--list-tunables"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        for line in listed.stdout.splitlines():
            if line.startswith("glibc.cpu.x86_non_temporal_threshold:"):
                return int(line.split()[1], 16)
    return None


def stream_rates(pool: ThreadPoolExecutor, n: int, slices: list, repeats: int) -> dict:
    """GB/s of STREAM copy and triad over three float64 arrays of `n` elements, on one thread, then on
    `slices` from `pool`. The arrays are local to this call, so they are freed before the allocation
    test that follows it."""
    a, b, c = (torch.from_numpy(np.empty(n)) for _ in range(3))
    # first touch by the threads that will use each slice, so a 2-socket node spreads the pages
    list(pool.map(lambda part: [x[part].fill_(1.0) for x in (a, b, c)], slices))
    rates = {}
    for label, parts in (("1thread", [slice(0, n)]), ("all_cores", slices)):
        # copy as memmove, what a compiled STREAM copy loop becomes (torch's copy_ reaches less
        # than half of it on one thread); numpy releases the GIL for it too
        kernels = {
            "copy": lambda s: np.copyto(b.numpy()[s], a.numpy()[s]),
            "triad": lambda s: torch.add(b[s], c[s], alpha=3.0, out=a[s]),
        }
        for kernel, run in kernels.items():
            seconds = median_seconds(lambda run=run, parts=parts: list(pool.map(run, parts)), repeats=repeats)
            rates[f"{kernel}_{label}_GB/s"] = stream_bytes(kernel, n) / seconds / GB
    return rates


def memory_section(cfg: dict) -> dict:
    """STREAM copy (b = a) and triad (a = b + 3c) over float64 arrays, bytes counted as STREAM does.
    Copy is numpy's memmove, triad torch's one-pass add (numpy's triad takes two, moving 5 arrays for
    STREAM's 3); on one thread, then on one slice per core from a thread pool (both release the GIL)."""
    n = cfg["memory_MiB"] * MiB // 8
    cores, threads = usable_cores(), torch.get_num_threads()
    threshold = memcpy_streaming_threshold_bytes()
    result = {
        "array_MiB": cfg["memory_MiB"],
        "arrays": 3,
        "l3_cache_MiB": l3_cache_bytes() / MiB,
        "cores": cores,
    }
    for label, copied in (("1thread", n * 8), ("all_cores", n * 8 // cores)):
        kind = "unknown" if threshold is None else "non-temporal" if copied > threshold else "regular"
        result[f"copy_{label}_stores"] = kind
    if threshold is not None:
        result["memcpy_non_temporal_threshold_MiB"] = threshold / MiB
    bounds = np.linspace(0, n, cores + 1).astype(int).tolist()
    slices = [slice(start, stop) for start, stop in zip(bounds[:-1], bounds[1:])]
    torch.set_num_threads(1)  # each slice on one core; torch's own pool would spin-wait between kernels
    try:
        with ThreadPoolExecutor(cores) as pool:
            result.update(stream_rates(pool, n, slices, cfg["repeats"]))
    finally:
        torch.set_num_threads(threads)
    page_elements = mmap.PAGESIZE // 8

    def allocate_and_touch():
        fresh = np.empty(n)  # large allocations are fresh mmap pages, returned on release
        fresh[::page_elements] = 1.0

    result["allocation_GB/s"] = n * 8 / median_seconds(allocate_and_touch, repeats=cfg["repeats"]) / GB
    return result
