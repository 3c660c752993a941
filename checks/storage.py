"""Storage: sequential and parallel writes and reads, 4 KiB random reads, through O_DIRECT where the
file system allows it so that the page cache does not flatter the figures.
"""

import functools
import mmap
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from checks.timing import GB, MiB
from checks.world import World

STORAGE_PHASES = ("sequential_write", "sequential_read", "random_read_4k", "parallel_write", "parallel_read")
STORAGE_BLOCK = 1 * MiB  # fio's sequential block size in the accuracy comparison
HUGE_PAGE = 2 * MiB
RANDOM_BLOCK = 4096


def aligned_buffer(nbytes: int) -> memoryview:
    """Memory for O_DIRECT, aligned and backed by a huge page where the kernel allows (THP
    "madvise" or "always"): a 1 MiB request from scattered 4 KiB pages has 256 segments, and a
    device taking fewer (virtio-blk here: 254) splits it, which measures the buffer, not the storage."""
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to start on a huge-page boundary
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared ones get no THP
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    start = -np.frombuffer(region, np.uint8).ctypes.data % HUGE_PAGE
    buffer = memoryview(region)[start : start + nbytes]
    for offset in range(0, nbytes, HUGE_PAGE):
        buffer[offset] = 0  # fault each huge page in now: O_DIRECT's page pinning would take 4 KiB ones
    return buffer


@functools.cache
def random_block() -> memoryview:
    """One block of random bytes, so a compressing filesystem can't shrink what is written; made
    once and shared by the writers, so making it is in no timing."""
    block = aligned_buffer(STORAGE_BLOCK)
    block[:] = np.random.default_rng().bytes(STORAGE_BLOCK)
    return block


def direct_io_works(folder: Path) -> bool:
    probe = folder / "direct_io_probe"
    try:
        descriptor = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            os.pwrite(descriptor, aligned_buffer(RANDOM_BLOCK), 0)
        finally:
            os.close(descriptor)
        return True
    except (OSError, AttributeError):  # EINVAL on tmpfs and some FUSE mounts; no O_DIRECT off Linux
        return False
    finally:
        probe.unlink(missing_ok=True)


def open_uncached(path: Path, flags: int, direct: bool) -> int:
    """Open for I/O that bypasses the page cache: O_DIRECT, else drop the file's cached pages."""
    descriptor = os.open(path, flags | (os.O_DIRECT if direct else 0), 0o600)
    if not direct:
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    return descriptor


def write_file(path: Path, nbytes: int, direct: bool) -> float:
    """Seconds to write `nbytes` in 1 MiB blocks and fsync them (so the data is on storage)."""
    buffer = random_block()
    descriptor = open_uncached(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct)
    try:
        started = time.perf_counter()
        for offset in range(0, nbytes, STORAGE_BLOCK):
            if os.pwrite(descriptor, buffer, offset) != STORAGE_BLOCK:
                raise OSError(f"short write to {path}")
        os.fsync(descriptor)
        elapsed = time.perf_counter() - started
        if not direct:  # the written pages stay cached: drop them so the read phase reads storage
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        return elapsed
    finally:
        os.close(descriptor)


def read_file(path: Path, nbytes: int, direct: bool) -> float:
    buffer = aligned_buffer(STORAGE_BLOCK)
    descriptor = open_uncached(path, os.O_RDONLY, direct)
    try:
        started = time.perf_counter()
        for offset in range(0, nbytes, STORAGE_BLOCK):
            os.preadv(descriptor, [buffer], offset)
        return time.perf_counter() - started
    finally:
        os.close(descriptor)


def random_reads(path: Path, nbytes: int, direct: bool, seconds: float) -> tuple:
    """4 KiB reads at random offsets, one at a time (fio's psync, iodepth 1), each offset read once
    so that without O_DIRECT no read is served by a page an earlier read brought in. (reads, seconds)"""
    buffer = aligned_buffer(RANDOM_BLOCK)
    offsets = np.random.default_rng().permutation(nbytes // RANDOM_BLOCK) * RANDOM_BLOCK
    descriptor = open_uncached(path, os.O_RDONLY, direct)
    try:
        if not direct:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead
        started = time.perf_counter()
        for count, offset in enumerate(offsets.tolist(), start=1):
            os.preadv(descriptor, [buffer], offset)
            if count % 64 == 0 and time.perf_counter() - started > seconds:
                break
        return count, time.perf_counter() - started
    finally:
        os.close(descriptor)


def parallel(paths: list, work) -> float:
    """Seconds for all `paths` to be processed by `work(path)` at once, one thread each
    (os.pwrite/preadv release the GIL, so threads overlap their I/O as processes would)."""
    with ThreadPoolExecutor(len(paths)) as pool:
        started = time.perf_counter()
        list(pool.map(work, paths))
        return time.perf_counter() - started


def parallel_bytes(cfg: dict) -> int:
    """What the parallel phases move: --storage_MiB shared by the workers in whole blocks."""
    shard = cfg["storage_MiB"] * MiB // cfg["storage_workers"] // STORAGE_BLOCK * STORAGE_BLOCK
    return shard * cfg["storage_workers"]


def storage_phases(folder: Path, cfg: dict, direct: bool) -> dict:
    """{phase: (unit, run)} in the order they run; run() gives (GB or reads, seconds)."""
    nbytes, workers = cfg["storage_MiB"] * MiB, cfg["storage_workers"]
    single, shards = folder / "sequential", [folder / f"parallel_{i}" for i in range(workers)]
    shard, moved = parallel_bytes(cfg) // workers, parallel_bytes(cfg) / GB
    return {
        "sequential_write": ("GB/s", lambda: (nbytes / GB, write_file(single, nbytes, direct))),
        "sequential_read": ("GB/s", lambda: (nbytes / GB, read_file(single, nbytes, direct))),
        "random_read_4k": ("IOPS", lambda: random_reads(single, nbytes, direct, cfg["random_read_seconds"])),
        "parallel_write": ("GB/s", lambda: (moved, parallel(shards, lambda p: write_file(p, shard, direct)))),
        "parallel_read": ("GB/s", lambda: (moved, parallel(shards, lambda p: read_file(p, shard, direct)))),
    }


def storage_section(world: World, cfg: dict) -> dict:
    """Phases start together on every node (a barrier each), so parallel write/read are also the
    storage's aggregate when the path is shared; the node's other ranks only take the barriers."""
    folder = None
    if world.is_node_leader:
        folder = Path(tempfile.mkdtemp(prefix=".benchmark-", dir=cfg["storage_path"]))
    result = {}
    try:
        direct = world.is_node_leader and direct_io_works(folder)
        phases = (
            storage_phases(folder, cfg, direct) if folder else dict.fromkeys(STORAGE_PHASES, (None, None))
        )
        seconds = {}
        for phase, (unit, run) in phases.items():
            world.barrier()
            if world.is_node_leader and "error" not in result:
                try:
                    amount, seconds[phase] = run()
                    result[f"{phase}_{unit}"] = amount / seconds[phase]
                except OSError as error:  # a full or failing disk is a finding, not a crash
                    result["error"] = f"{phase}: {error}"
        if world.is_node_leader:
            result.update(
                {
                    "method": "O_DIRECT" if direct else "fsync + posix_fadvise(DONTNEED) (no O_DIRECT here)",
                    "path": str(Path(cfg["storage_path"]).resolve()),
                    "file_MiB": cfg["storage_MiB"],
                    "workers": cfg["storage_workers"],
                    "parallel_bytes": parallel_bytes(cfg),
                    "seconds": seconds,
                }
            )
    finally:
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
    return result


def storage_aggregate(nodes: list) -> dict:
    """All nodes wrote (read) at once from a common barrier: total bytes over the slowest node's
    time is what the filesystem delivered; summing across nodes is right here, unlike for links."""
    aggregate = {"nodes": len(nodes)}
    for phase in ("parallel_write", "parallel_read"):
        if nodes and all(phase in node.get("seconds", {}) for node in nodes):
            slowest = max(node["seconds"][phase] for node in nodes)
            aggregate[f"{phase}_GB/s"] = sum(node["parallel_bytes"] for node in nodes) / slowest / GB
    return aggregate
