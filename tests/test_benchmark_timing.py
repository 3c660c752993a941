"""benchmark.py's measurements against plain references on this machine, marked timing to run alone: storage
reads come from storage, not the page cache; memory bandwidth agrees with a numpy copy; the sustained loop
times back-to-back calls, sees a device slow down, and agrees with single calls."""

import ctypes
import mmap
import os
import statistics
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from checks import gpu, host, storage, timing, world


def resident_fraction(path: Path) -> float:
    """Share of the file's pages in the page cache (mincore on a mapping that touches nothing)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    with open(path, "rb") as file, mmap.mmap(file.fileno(), size, access=mmap.ACCESS_COPY) as mapping:
        view = (ctypes.c_char * size).from_buffer(mapping)
        pages = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
        status = libc.mincore(ctypes.c_void_p(ctypes.addressof(view)), ctypes.c_size_t(size), pages)
        del view
    assert status == 0, os.strerror(ctypes.get_errno())
    return sum(page & 1 for page in pages) / len(pages)


def cached_read_GBps(path: Path) -> float:
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as file:
        while file.read(1 << 20):
            pass
    return path.stat().st_size / (time.perf_counter() - started) / 1e9


@pytest.mark.timing
@pytest.mark.parametrize("direct", [True, False], ids=["O_DIRECT", "fadvise"])
def test_storage_reads_come_from_storage_not_the_page_cache(tmp_path, direct):
    path, size = tmp_path / "file", 256 * timing.MiB
    write_seconds = storage.write_file(path, size, direct)
    assert resident_fraction(path) < 0.02, "a file just written must not sit in the page cache"
    cached_read_GBps(path)  # now every page is cached: the uncached open must drop or bypass them
    assert resident_fraction(path) > 0.9
    os.close(storage.open_uncached(path, os.O_RDONLY, direct))
    if not direct:
        assert resident_fraction(path) < 0.02
    ours = size / storage.read_file(path, size, direct) / 1e9
    page_cache = max(cached_read_GBps(path) for _ in range(3))
    # this VM's disk: fio direct=1 reads ~2.2 GB/s and writes ~2.4 GB/s; the page cache serves 5-8 GB/s
    assert ours < 0.7 * page_cache, f"read {ours:.2f} GB/s is page-cache speed ({page_cache:.2f} GB/s)"
    assert size / write_seconds / 1e9 < 0.7 * page_cache


@pytest.mark.timing
def test_memory_bandwidth_agrees_with_a_plain_numpy_copy_of_the_same_size():
    """Within 25% of np.copyto on arrays of the same size, bytes counted alike (read + write): glibc's memmove
    writes differently above and below a size (on this VM a 1 GB copy runs at 20 GB/s, a 128 MiB one at
    12), so only the same size compares. The benchmark's copy is timed between two plain ones, against their
    mean, and the test takes up to three tries, since other jobs share this VM's memory bus."""
    cfg = {
        **world.MODES["quick"],
        "memory_MiB": max(64, -(-4 * host.l3_cache_bytes() // timing.MiB)),
    }
    elements = cfg["memory_MiB"] * timing.MiB // 8
    source, target = np.full(elements, 1.0), np.empty(elements)
    threshold = host.memcpy_streaming_threshold_bytes()

    def plain():
        return 2 * source.nbytes / timing.median_seconds(lambda: np.copyto(target, source), repeats=3) / 1e9

    ratios = []
    for _ in range(3):
        before = plain()
        memory = host.memory_section(cfg)
        ratios.append(memory["copy_1thread_GB/s"] / statistics.mean([before, plain()]))
        if threshold is not None:
            stores = "non-temporal" if source.nbytes > threshold else "regular"
            assert memory["copy_1thread_stores"] == stores
        if 0.75 <= ratios[-1] <= 1.25:
            return
    pytest.fail(f"benchmark copy / numpy copy = {ratios}, outside 0.75-1.25 every time")


def sleeper(seconds_at, started):
    """A call that sleeps seconds_at(t) for t seconds since `started`: a device with a known rate."""
    return lambda: time.sleep(seconds_at(time.perf_counter() - started))


@pytest.mark.timing
def test_sustained_loop_times_back_to_back_calls_and_sees_a_device_slow_down():
    """Sleeps overshoot when other jobs share this VM's two cores: the timed bounds get up to three tries."""
    loop = {"warmup_s": 0.1, "seconds": 0.6, "window_s": 0.15, "device": torch.device("cpu")}
    tries = []
    for _ in range(3):
        steady = timing.sustained(sleeper(lambda t: 0.002, time.perf_counter()), **loop)
        assert steady["calls"] % 4 == 0  # 4 windows
        # a call that gets slower the longer the loop runs, as a GPU does when it throttles
        slowing = timing.sustained(sleeper(lambda t: 0.002 * (1 + 2 * t), time.perf_counter()), **loop)
        within = (
            350 < steady["calls_per_s"] <= 500  # 2 ms a call; sleep only ever overshoots
            and steady["seconds"] == pytest.approx(0.6, rel=0.3)
            and 0.85 < steady["throttle_ratio"] < 1.18
            and slowing["throttle_ratio"] < 0.8
        )
        if within:
            return
        tries.append((steady, slowing["throttle_ratio"]))
    pytest.fail(f"steady loop and slowing throttle ratio outside their bounds every time: {tries}")


@pytest.mark.timing
def test_sustained_matmul_on_cpu_tensors_agrees_with_the_median_of_single_calls():
    """The same work timed two ways: within a factor of 2, in one of three tries, since other jobs
    share this VM's two cores and the warm-up's calibration is only as steady as they let it be."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        call = gpu.matmul_call("fp32", (256, 384, 512), torch.device("cpu"))
        ratios = []
        for _ in range(3):
            loop = timing.sustained(call, torch.device("cpu"), warmup_s=0.1, seconds=0.4, window_s=0.1)
            assert loop["calls"] % 4 == 0 and loop["seconds"] > 0
            ratios.append(loop["calls_per_s"] * timing.median_seconds(call, repeats=20))
            if 0.5 < ratios[-1] < 2.0:
                return
    finally:
        torch.set_num_threads(threads)
    pytest.fail(f"sustained calls/s x median seconds per call = {ratios}, outside 0.5-2 every time")
