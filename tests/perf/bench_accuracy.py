#!/usr/bin/env python3
"""Are benchmark.py's storage and memory figures true? Compares them, in one run, with references.

    .venv/bin/python tests/perf/bench_accuracy.py [--path checkpoints] [--storage_MiB 1024] [--rounds 3]

Storage: benchmark.py's storage section against fio (Debian package `fio`) on the same folder,
direct I/O, the same block sizes, sizes and worker count: sequential 1 MiB write (ending in fsync)
and read, the same with N jobs at once, random 4 KiB reads at queue depth 1. Memory: its STREAM
copy and triad against a plain numpy measurement (np.copyto; triad in cache-sized blocks so that
memory sees STREAM's three arrays, not numpy's two passes). The two sides alternate for --rounds
rounds and each figure is the median over rounds, so a noisy neighbour hits both alike. Prints a
table of ours vs reference; the goal is within 15%. Exits 1 if fio is missing or a figure misses.
"""
import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import benchmark  # noqa: E402

GOAL = 0.15
TRIAD_BLOCK = 1 << 16  # float64 elements: 512 KiB, stays in L2 between the multiply and the add


def fio(folder: Path, name: str, rw: str, block: str, size_MiB: int, jobs: int = 1, seconds: float = 0) -> dict:
    """One fio run on `folder`; returns its (group-reported) read or write figures."""
    command = ["fio", f"--name={name}", f"--directory={folder}", f"--rw={rw}", f"--bs={block}",
               f"--size={size_MiB}M", f"--numjobs={jobs}", "--direct=1", "--ioengine=psync", "--iodepth=1",
               "--end_fsync=1", "--group_reporting", "--output-format=json"]
    if seconds:
        command += [f"--runtime={seconds}", "--time_based"]
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    job = json.loads(output[output.index("{"):])["jobs"][0]
    return job["write" if "write" in rw else "read"]


def fio_storage(folder: Path, size_MiB: int, workers: int, random_seconds: float) -> dict:
    shard = size_MiB // workers
    figures = {
        "sequential_write_GB/s": fio(folder, "seq", "write", "1M", size_MiB)["bw_bytes"] / 1e9,
        "sequential_read_GB/s": fio(folder, "seq", "read", "1M", size_MiB)["bw_bytes"] / 1e9,
        "random_read_4k_IOPS": fio(folder, "seq", "randread", "4k", size_MiB, seconds=random_seconds)["iops"],
        "parallel_write_GB/s": fio(folder, "par", "write", "1M", shard, workers)["bw_bytes"] / 1e9,
        "parallel_read_GB/s": fio(folder, "par", "read", "1M", shard, workers)["bw_bytes"] / 1e9,
    }
    return figures


def numpy_memory(n_elements: int, cores: int, repeats: int) -> dict:
    """STREAM-style numpy: copy b = a and triad a = b + 3c over three float64 arrays."""
    a, b, c = np.full(n_elements, 1.0), np.full(n_elements, 2.0), np.full(n_elements, 0.5)

    def triad(start, stop):
        for i in range(start, stop, TRIAD_BLOCK):
            j = min(i + TRIAD_BLOCK, stop)
            np.multiply(c[i:j], 3.0, out=a[i:j])
            np.add(a[i:j], b[i:j], out=a[i:j])
    bounds = np.linspace(0, n_elements, cores + 1).astype(int)
    slices = list(zip(bounds[:-1], bounds[1:]))
    figures = {}
    with ThreadPoolExecutor(cores) as pool:  # copyto and the ufuncs release the GIL on big arrays
        for label, parts in (("1thread", [(0, n_elements)]), ("all_cores", slices)):
            copy = benchmark.median_seconds(lambda: list(pool.map(lambda s: np.copyto(b[s[0]:s[1]], a[s[0]:s[1]]), parts)), repeats=repeats)
            tri = benchmark.median_seconds(lambda: list(pool.map(lambda s: triad(*s), parts)), repeats=repeats)
            figures[f"copy_{label}_GB/s"] = benchmark.stream_bytes("copy", n_elements) / copy / 1e9
            figures[f"triad_{label}_GB/s"] = benchmark.stream_bytes("triad", n_elements) / tri / 1e9
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", default="checkpoints", help="folder on the filesystem to test")
    parser.add_argument("--storage_MiB", type=int, default=1024)
    parser.add_argument("--storage_workers", type=int, default=8)
    parser.add_argument("--memory_MiB", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    has_fio = shutil.which("fio") is not None
    if not has_fio:
        print("bench_accuracy.py: fio is not installed (Debian: apt-get install -y fio); comparing memory only",
              file=sys.stderr)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    world = benchmark.World(0, 1, 0, 1, torch.device("cpu"), None)
    cfg = {**benchmark.MODES["default"], "storage_path": args.path, "storage_MiB": args.storage_MiB,
           "storage_workers": args.storage_workers, "memory_MiB": args.memory_MiB}
    cores = benchmark.usable_cores()
    ours, reference = {}, {}
    for _ in range(args.rounds):
        for key, value in benchmark.storage_section(world, cfg).items() if has_fio else ():
            ours.setdefault(key, []).append(value)
        if has_fio:
            folder = Path(tempfile.mkdtemp(prefix=".fio-", dir=args.path))
            try:
                for key, value in fio_storage(folder, args.storage_MiB, args.storage_workers, cfg["random_read_seconds"]).items():
                    reference.setdefault(key, []).append(value)
            finally:
                shutil.rmtree(folder)
        for key, value in benchmark.memory_section(cfg).items():
            ours.setdefault(key, []).append(value)
        for key, value in numpy_memory(args.memory_MiB * benchmark.MiB // 8, cores, cfg["repeats"]).items():
            reference.setdefault(key, []).append(value)
    dist.destroy_process_group()
    print(f"{time.strftime('%Y-%m-%d')}, {cores} cores, {args.rounds} rounds (median), storage on {Path(args.path).resolve()} "
          f"({args.storage_MiB} MiB, {args.storage_workers} workers, method {ours['method'][0] if has_fio else '-'}), "
          f"memory arrays 3 x {args.memory_MiB} MiB")
    print(f"{'figure':<28}{'benchmark.py':>14}{'reference':>14}{'ratio':>8}  reference is")
    misses = 0
    for key in reference:
        mine, theirs = statistics.median(ours[key]), statistics.median(reference[key])
        ratio = mine / theirs
        misses += abs(ratio - 1) > GOAL
        source = "numpy STREAM-style" if key.startswith(("copy", "triad")) else "fio, direct=1"
        print(f"{key:<28}{mine:>14.4g}{theirs:>14.4g}{ratio:>8.2f}  {source}{'' if abs(ratio - 1) <= GOAL else '  MISS'}")
    return 1 if misses or not has_fio else 0


if __name__ == "__main__":
    sys.exit(main())
