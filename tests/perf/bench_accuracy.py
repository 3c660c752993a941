#!/usr/bin/env python3
"""Are benchmark.py's storage and memory figures true? Compares them, in one run, with references.

    .venv/bin/python tests/perf/bench_accuracy.py [--path checkpoints] [--storage_MiB 1024] [--rounds 5]

Storage: each phase of benchmark.py's storage section (its own functions, its default sizes)
against fio (Debian package `fio`) on the same folder: direct=1, psync, queue depth 1, 1 MiB
blocks for the sequential write (ending in fsync) and read, the same with N jobs at once (figure:
all jobs' bytes over the longest job's run time, as fio's "aggrb"), 4 KiB random reads for the same
time. fio writes fresh files without preallocating (fallocate=none), as a checkpoint does.
benchmark.py reads and writes through a transparent huge page; fio's buffer is 4 KiB pages unless
huge pages are reserved (as root: echo 64 > /proc/sys/vm/nr_hugepages), when this script passes
--iomem=shmhuge. Without that, on a device that splits a request with more than its segment limit
(virtio-blk: 254; a 1 MiB buffer of scattered 4 KiB pages has 256), fio measures its buffer.
Memory: the memory section's STREAM copy and triad against plain numpy on the same array sizes
(np.copyto; triad in cache-sized blocks so that memory sees STREAM's three arrays), one thread
and one thread per core; and, where gcc is there, against STREAM's own kernels in C (OpenMP,
static schedule, compiled here with gcc -O3 -march=native -fopenmp), median time like ours.

Each phase runs ours and the reference back to back, the order swapped every round, for --rounds
rounds; each figure is the median over rounds, so a noisy neighbour hits both alike. Prints a
table of ours vs reference with ratios; the goal is within 15%. Exits 1 if fio is missing
(the memory comparison still runs) or a figure misses.
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from checks import host, storage, timing, world  # noqa: E402

GOAL = 0.15
TRIAD_BLOCK = 1 << 16  # float64 elements: 512 KiB, stays in L2 between the multiply and the add


def fio_huge_pages(cfg: dict) -> bool:
    """Enough reserved huge pages for every fio job's 1 MiB buffer (each rounds up to a 2 MiB page)."""
    free = re.search(r"HugePages_Free:\s+(\d+)", Path("/proc/meminfo").read_text())
    return bool(free) and int(free.group(1)) >= cfg["storage_workers"] + 1


def fio_command(folder: Path, phase: str, cfg: dict) -> list:
    size, workers = cfg["storage_MiB"], cfg["storage_workers"]
    name, rw, block, size_MiB, jobs = {
        "sequential_write": ("seq", "write", "1M", size, 1),
        "sequential_read": ("seq", "read", "1M", size, 1),
        "random_read_4k": ("seq", "randread", "4k", size, 1),
        "parallel_write": ("par", "write", "1M", size // workers, workers),
        "parallel_read": ("par", "read", "1M", size // workers, workers),
    }[phase]
    command = [
        "fio",
        f"--name={name}",
        f"--directory={folder}",
        f"--rw={rw}",
        f"--bs={block}",
        f"--size={size_MiB}M",
        f"--numjobs={jobs}",
        "--direct=1",
        "--ioengine=psync",
        "--iodepth=1",
        "--end_fsync=1",
        "--fallocate=none",
        "--output-format=json",
    ] + (["--iomem=shmhuge"] if fio_huge_pages(cfg) else [])
    if rw == "randread":
        command += [f"--runtime={cfg['random_read_seconds']}", "--time_based"]
    return command


def fio_figure(folder: Path, phase: str, cfg: dict) -> float:
    """GB/s (all jobs' bytes over the longest job's run time) or IOPS, as fio measured it."""
    output = subprocess.run(
        fio_command(folder, phase, cfg), capture_output=True, text=True, check=True
    ).stdout
    jobs = json.loads(output[output.index("{") :])["jobs"]
    side = "write" if phase.endswith("write") else "read"
    if phase.startswith("random"):
        return sum(job[side]["iops"] for job in jobs)
    return sum(job[side]["io_bytes"] for job in jobs) / (max(job["job_runtime"] for job in jobs) / 1e3) / 1e9


def our_figure(phases: dict, phase: str) -> float:
    amount, seconds = phases[phase][1]()
    return amount / seconds


def numpy_memory(n_elements: int, cores: int, repeats: int) -> dict:
    """STREAM-style numpy: copy b = a and triad a = b + 3c over three float64 arrays."""
    a, b, c = np.full(n_elements, 1.0), np.full(n_elements, 2.0), np.full(n_elements, 0.5)

    def copy_part(start, stop):
        np.copyto(b[start:stop], a[start:stop])

    def triad(start, stop):
        for i in range(start, stop, TRIAD_BLOCK):
            j = min(i + TRIAD_BLOCK, stop)
            np.multiply(c[i:j], 3.0, out=a[i:j])
            np.add(a[i:j], b[i:j], out=a[i:j])

    def seconds(pool, kernel, parts):
        """Median time of kernel(start, stop) over every part at once, each part on a pool thread."""
        return timing.median_seconds(lambda: list(pool.map(lambda s: kernel(*s), parts)), repeats=repeats)

    bounds = np.linspace(0, n_elements, cores + 1).astype(int).tolist()
    one_thread, all_cores = [(0, n_elements)], list(zip(bounds[:-1], bounds[1:]))
    figures = {}
    with ThreadPoolExecutor(cores) as pool:  # copyto and the ufuncs release the GIL on big arrays
        for label, parts in (("1thread", one_thread), ("all_cores", all_cores)):
            copy, tri = seconds(pool, copy_part, parts), seconds(pool, triad, parts)
            figures[f"copy_{label}_GB/s"] = timing.stream_bytes("copy", n_elements) / copy / 1e9
            figures[f"triad_{label}_GB/s"] = timing.stream_bytes("triad", n_elements) / tri / 1e9
    return figures


STREAM_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <omp.h>
static int by_value(const void *x, const void *y) {
    double a = *(const double *)x, b = *(const double *)y; return (a > b) - (a < b);
}
int main(int argc, char **argv) {
    long n = atol(argv[1]); int repeats = atoi(argv[2]);
    double *a = malloc(n * 8), *b = malloc(n * 8), *c = malloc(n * 8), copy[64], triad[64];
    #pragma omp parallel for schedule(static)
    for (long i = 0; i < n; i++) { a[i] = 1.0; b[i] = 2.0; c[i] = 0.5; }
    for (int r = 0; r <= repeats; r++) {  /* r = 0 is the warm-up */
        double t0 = omp_get_wtime();
        #pragma omp parallel for schedule(static)
        for (long i = 0; i < n; i++) b[i] = a[i];
        double t1 = omp_get_wtime();
        #pragma omp parallel for schedule(static)
        for (long i = 0; i < n; i++) a[i] = b[i] + 3.0 * c[i];
        double t2 = omp_get_wtime();
        if (r) { copy[r - 1] = t1 - t0; triad[r - 1] = t2 - t1; }
    }
    qsort(copy, repeats, 8, by_value); qsort(triad, repeats, 8, by_value);
    printf("%g %g\n", 16.0 * n / copy[repeats / 2] / 1e9, 24.0 * n / triad[repeats / 2] / 1e9);
    return 0;
}
"""


def compile_stream(folder: Path) -> Path | None:
    if not shutil.which("gcc"):
        return None
    (folder / "stream.c").write_text(STREAM_C)
    subprocess.run(
        ["gcc", "-O3", "-march=native", "-fopenmp", "stream.c", "-o", "stream"], cwd=folder, check=True
    )
    return folder / "stream"


def c_stream(program: Path, n_elements: int, cores: int, repeats: int) -> dict:
    figures = {}
    for label, threads in (("1thread", 1), ("all_cores", cores)):
        output = subprocess.run(
            [str(program), str(n_elements), str(repeats)],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": str(threads)},
        ).stdout
        figures[f"copy_{label}_GB/s"], figures[f"triad_{label}_GB/s"] = map(float, output.split())
    return figures


def compare_storage(cfg: dict, rounds: int, ours: dict, reference: dict) -> str:
    for round_number in range(rounds):
        mine = Path(tempfile.mkdtemp(prefix=".benchmark-", dir=cfg["storage_path"]))
        theirs = Path(tempfile.mkdtemp(prefix=".fio-", dir=cfg["storage_path"]))
        try:
            direct = storage.direct_io_works(mine)
            phases = storage.storage_phases(mine, cfg, direct)
            for phase in storage.STORAGE_PHASES:
                key = f"{phase}_{phases[phase][0]}"
                runs = [
                    (ours, partial(our_figure, phases, phase)),
                    (reference, partial(fio_figure, theirs, phase, cfg)),
                ]
                for figures, run in runs[::-1] if round_number % 2 else runs:
                    figures.setdefault(key, []).append(run())
        finally:
            shutil.rmtree(mine)
            shutil.rmtree(theirs)
    return "O_DIRECT" if direct else "fsync + posix_fadvise(DONTNEED)"


def compare_memory(cfg: dict, rounds: int, ours: dict, reference: dict, stream: dict, program: Path | None):
    n_elements, cores = cfg["memory_MiB"] * timing.MiB // 8, host.usable_cores()
    runs = [
        (ours, lambda: host.memory_section(cfg)),
        (reference, lambda: numpy_memory(n_elements, cores, cfg["repeats"])),
    ]
    if program:
        runs.append((stream, lambda: c_stream(program, n_elements, cores, cfg["repeats"])))
    for round_number in range(rounds):
        for figures, run in runs[::-1] if round_number % 2 else runs:
            for key, value in run().items():
                if key.startswith(("copy", "triad")):
                    figures.setdefault(key, []).append(value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", default="checkpoints", help="folder on the filesystem to test")
    parser.add_argument("--storage_MiB", type=int, default=world.MODES["default"]["storage_MiB"])
    parser.add_argument("--storage_workers", type=int, default=world.MODES["default"]["storage_workers"])
    parser.add_argument("--memory_MiB", type=int, default=world.MODES["default"]["memory_MiB"])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cfg = {
        **world.MODES["default"],
        "storage_path": args.path,
        "storage_MiB": args.storage_MiB,
        "storage_workers": args.storage_workers,
        "memory_MiB": args.memory_MiB,
    }
    ours, reference, method = {}, {}, "storage not measured"
    if shutil.which("fio"):
        method = compare_storage(cfg, args.rounds, ours, reference)
        buffer = "huge pages (shmhuge)" if fio_huge_pages(cfg) else "4 KiB pages (no huge pages reserved)"
        method += f"; fio buffer {buffer}"
    else:
        print(
            "bench_accuracy.py: fio is not installed (Debian: apt-get install -y fio); comparing memory only",
            file=sys.stderr,
        )
    stream = {}
    with tempfile.TemporaryDirectory() as build:
        compare_memory(cfg, args.rounds, ours, reference, stream, compile_stream(Path(build)))
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {host.usable_cores()} cores; median of "
        f"{args.rounds} rounds; storage {Path(args.path).resolve()}, {args.storage_MiB} MiB, "
        f"{args.storage_workers} workers, {method}; memory 3 x {args.memory_MiB} MiB float64"
    )
    print("| figure | benchmark.py | reference | ratio | reference is | STREAM in C | ratio |")
    print("|---|---|---|---|---|---|---|")
    misses = 0
    for key in reference:
        mine, theirs = statistics.median(ours[key]), statistics.median(reference[key])
        missed = abs(mine / theirs - 1) > GOAL
        misses += missed
        source = "numpy" if key.startswith(("copy", "triad")) else "fio"
        in_c = "|"
        if key in stream:
            in_c = f"{statistics.median(stream[key]):.4g} | {mine / statistics.median(stream[key]):.2f}"
        ratio = f"{mine / theirs:.2f}{' MISS' if missed else ''}"
        print(f"| {key} | {mine:.4g} | {theirs:.4g} | {ratio} | {source} | {in_c} |")
    return 1 if misses or not shutil.which("fio") else 0


if __name__ == "__main__":
    sys.exit(main())
