#!/usr/bin/env python3
"""Cluster check before a long training run: GPUs, collectives, inter-node links, storage, CPU, host memory.

Launch it the way training is launched, one process per GPU on every node:

    srun torchrun --nnodes=$SLURM_NNODES --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$MASTER_ADDR:29500 benchmark.py
    python benchmark.py --quick                  # one process, no GPU needed

Sections, chosen with --only / --skip: gpu, nccl (collectives; gloo on CPU), links (between
nodes), storage (--storage_path), cpu, memory. GPU work runs on every local GPU at once; per-node
work (storage, cpu, memory) runs on local rank 0 while the node's other ranks wait, so nothing
competes with it. Rank 0 writes <report_dir>/benchmark_<jobid>.yaml (the cluster), each node's
local rank 0 writes <report_dir>/benchmark_<jobid>_rank<R>.yaml (that node), and rank 0 prints
the checks, fails first, then warns.

Checks are fail, warn, pass or skip. Fail is kept for what training depends on: GPU compute and
memory (against the datasheet, their peers, and their own first second: throttling), collectives
against a busbw floor per platform, links between nodes against their peers, storage writes
against --min_storage_GBps, and errors. CPU and host-memory figures below their peers only warn.
Exit status: 0 pass or warn, 1 fail (or warn with --fail_on_warn), 2 bad input.

GPU figures are sustained: at least 1 s of warm-up, then back-to-back loops of seconds timed by
CUDA events; other figures are medians of repeats after warm-up. Bytes and FLOPs are counted as
STREAM and nccl-tests count them; GB = 1e9 bytes. What each figure means and how to read it:
docs/BENCHMARK_FEATURES.md. Importing this module only defines things, so that train.py can use
`datasheet()` for MFU.
"""

import argparse
import difflib
import functools
import itertools
import json
import math
import mmap
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml

from checks import history, picture

GB = 1e9
MiB = 1 << 20
SECTIONS = ("gpu", "nccl", "links", "storage", "cpu", "memory")

# Vendor datasheet peaks per GPU, DENSE (the datasheets print tensor figures with 2:4 sparsity;
# these are half of those): TFLOPS, HBM bandwidth in GB/s and HBM capacity in GB as printed there
# (train.py --dry_run judges fit against it; an "80GB" H100 holds 80 GiB, so this errs on the safe
# side). Matched by substring of torch.cuda.get_device_name() in this order, so the more specific
# names come first ("GH200" contains "H200", "H100 PCIe" contains "H100"). Sources:
# docs/BENCHMARK_FEATURES.md.
HOPPER = {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp8": 1978.9}  # SXM, 700 W
HOPPER_NVL = {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp8": 1670.5}  # PCIe card, 350-400 W
AMPERE = {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp8": None}
# fmt: off
DATASHEET = {
    "GB200": dict(fp32=80.0, tf32=1250.0, bf16=2500.0, fp8=5000.0, memory_GBps=8000.0, memory_GB=186.0),
    "B200": dict(fp32=75.0, tf32=1100.0, bf16=2250.0, fp8=4500.0, memory_GBps=7700.0, memory_GB=180.0),
    "GH200 144G": {**HOPPER, "memory_GBps": 4900.0, "memory_GB": 144.0},
    "GH200": {**HOPPER, "memory_GBps": 4000.0, "memory_GB": 96.0},
    "H200 NVL": {**HOPPER_NVL, "memory_GBps": 4800.0, "memory_GB": 141.0},
    "H200": {**HOPPER, "memory_GBps": 4800.0, "memory_GB": 141.0},
    "H100 NVL": {**HOPPER_NVL, "memory_GBps": 3900.0, "memory_GB": 94.0},
    "H100 PCIe": dict(fp32=51.0, tf32=378.0, bf16=756.0, fp8=1513.0, memory_GBps=2000.0, memory_GB=80.0),
    "H100": {**HOPPER, "memory_GBps": 3350.0, "memory_GB": 80.0},
    "A100-SXM4-80GB": {**AMPERE, "memory_GBps": 2039.0, "memory_GB": 80.0},
    "A100 80GB PCIe": {**AMPERE, "memory_GBps": 1935.0, "memory_GB": 80.0},
    "A100": {**AMPERE, "memory_GBps": 1555.0, "memory_GB": 40.0},
}
# fmt: on

# Verdict thresholds. A member more than STRAGGLER_TOLERANCE below the median of its peers is
# flagged (a fail for GPUs and node pairs, a warn for CPU and host-memory figures); a GPU below
# DATASHEET_MIN_PERCENT of its datasheet peak fails for the figures training lives on (a healthy
# H100 sustains ~80% of bf16 peak at the MAMF finder's shapes and ~85% of HBM bandwidth in a copy).
STRAGGLER_TOLERANCE = 0.10
DATASHEET_MIN_PERCENT = 50.0
DATASHEET_CHECKS = {"matmul_bf16_TFLOPS": "bf16", "copy_GB/s": "memory_GBps"}
# A GPU whose last second of a sustained loop runs below this fraction of its first is throttling:
# power and clocks settle within a second or two, so a healthy GPU stays within a few percent.
THROTTLE_MIN_RATIO = 0.90
# A rank whose time for a collective is this many times the average across ranks is named (a warn):
# it entered the loop late or its GPU ran slower than the rest.
SLOW_RANK_RATIO = 1.5
MIN_STORAGE_GBPS = 0.1  # --min_storage_GBps default: each node's parallel write, for checkpoints
# Keys ending in one of these are rates (higher is better) that are compared across peers.
RATE_UNITS = ("GB/s", "MB/s", "TFLOPS", "GFLOPS", "IOPS", "ops/s", "Melem/s")

# Collective busbw floors in GB/s within one node, by substring of the GPU name in this order
# (None: no floor known), judged on all-reduce and all-gather at the sweep's largest size when
# that is at least FLOOR_MIN_BYTES. Each is about half of what nccl-tests reaches on a healthy node
# of that kind and several times what NCCL gets when NVLink is down and it falls back to PCIe.
# Sources: docs/BENCHMARK_FEATURES.md.
NVLINK4 = {"platform": "H100/H200 SXM, NVLink 4", "all_reduce": 230.0, "all_gather": 180.0}
NVLINK3 = {"platform": "A100 SXM, NVLink 3", "all_reduce": 120.0, "all_gather": 100.0}
PCIE_ONLY = {"platform": "PCIe only", "all_reduce": 10.0, "all_gather": 10.0}
COLLECTIVE_FLOORS = {
    "GH200": None,
    "H100 NVL": PCIE_ONLY,
    "H200 NVL": PCIE_ONLY,
    "PCIe": PCIE_ONLY,
    "H100": NVLINK4,
    "H200": NVLINK4,
    "A100-SXM": NVLINK3,
}
FLOOR_OPS = ("all_reduce", "all_gather")
FLOOR_MIN_BYTES = 256 * MiB  # below this, busbw is still climbing: no floor applies
# Between nodes, one rank per node: NCCL over InfiniBand or RoCE reaches 80-95% of one NIC's line
# rate at large sizes; below half of it the link trained down or NCCL fell back to TCP sockets.
INTER_NODE_FLOOR_FRACTION = 0.5

# Sizes per mode; the CLI overrides some. Default: under 60 s per 8-GPU node (docs/PERFORMANCE.md).
# GPU figures: gpu_warmup_s of warm-up, then gpu_seconds of back-to-back calls in windows of
# gpu_window_s; the throttling ratio is the last window's rate over the first's.
# fmt: off
MODES = {
    "default": dict(matmul_size=8192, nccl_max_MiB=None, storage_MiB=1024, storage_workers=8,
                    memory_MiB=256, gpu_copy_MiB=1024, gpu_warmup_s=1.0, gpu_seconds=3.0,
                    gpu_window_s=1.0, cpu_matmul_size=2048,
                    zlib_MiB=2, sort_Melem=8, cpu_units_per_core=8, repeats=5,
                    random_read_seconds=1.0, collective_warmup=5, collective_iters=20,
                    pingpong_iters=50),
    "quick": dict(matmul_size=4096, nccl_max_MiB=None, storage_MiB=64, storage_workers=4,
                  memory_MiB=64, gpu_copy_MiB=256, gpu_warmup_s=1.0, gpu_seconds=1.0,
                  gpu_window_s=0.25, cpu_matmul_size=1024,
                  zlib_MiB=1, sort_Melem=1, cpu_units_per_core=2, repeats=3,
                  random_read_seconds=0.2, collective_warmup=1, collective_iters=3,
                  pingpong_iters=10),
}
# fmt: on
# Largest collective message by (device, quick): gloo on CPU is ~100x slower than NCCL on NVLink.
# On GPU, 1 GiB: NVLS all-reduce levels off only above 256 MiB (nccl-tests sweeps to 8 GiB).
NCCL_MAX_MiB = {("cuda", False): 1024, ("cuda", True): 256, ("cpu", False): 16, ("cpu", True): 1}
NCCL_MIN_BYTES = {"cuda": 1 * MiB, "cpu": 64 * 1024}
# Python and PyTorch's host time per collective call, generously: on a GPU the stream is held this
# long per queued call so that the timed window holds GPU time only (collective_seconds).
HOST_SECONDS_PER_CALL = 100e-6
SPIN_CYCLES_PER_SECOND = 2e9  # torch.cuda._sleep counts cycles; no GPU in DATASHEET clocks above 2 GHz
PINGPONG_BYTES = {"cuda": 64 * MiB, "cpu": 16 * MiB}
LATENCY_BYTES = 8
STORAGE_PHASES = ("sequential_write", "sequential_read", "random_read_4k", "parallel_write", "parallel_read")
STORAGE_BLOCK = 1 * MiB  # fio's sequential block size in the accuracy comparison
HUGE_PAGE = 2 * MiB
RANDOM_BLOCK = 4096
CACHE_MULTIPLE = 4  # STREAM's rule: each array at least 4x the last-level cache
CPU_WORK_ITERATIONS = 200_000  # one pure-Python work unit, ~10 ms on a current core
CPU_DEVICE = torch.device("cpu")


def datasheet(device_name: str) -> dict | None:
    """Dense peaks for a GPU name: {"fp32", "tf32", "bf16", "fp8": TFLOPS or None, "memory_GBps",
    "memory_GB"}; None if unknown."""
    for name_part, peaks in DATASHEET.items():
        if name_part.lower() in device_name.lower():
            return dict(peaks)
    return None


# nccl-tests' bus-bandwidth factors (doc/PERFORMANCE.md there): the fraction of the data that
# crosses the slowest link, so busbw is comparable to link speed whatever the rank count.
BUSBW_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}
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


def flag_stragglers(values: dict, tolerance: float = STRAGGLER_TOLERANCE) -> list:
    """Names whose value is more than `tolerance` below the median of all values (higher is better)."""
    if len(values) < 2:
        return []
    floor = (1 - tolerance) * statistics.median(values.values())
    return [name for name, value in values.items() if value < floor]


class Stopwatch:
    """Points in time on a device: CUDA events on its current stream (the device's time, recorded
    without waiting for it), else the host clock."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks = []

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list:
        """Seconds between consecutive marks, once the device has reached the last one."""
        if self.cuda:
            self.marks[-1].synchronize()
            return [start.elapsed_time(end) / 1e3 for start, end in itertools.pairwise(self.marks)]
        return [end - start for start, end in itertools.pairwise(self.marks)]


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


@dataclass
class World:
    rank: int
    size: int
    local_rank: int
    local_size: int
    device: torch.device
    cpu_group: object  # gloo group: waiting ranks block in it instead of spinning on a GPU sync

    @property
    def nodes(self) -> int:
        return self.size // self.local_size

    @property
    def node_rank(self) -> int:
        return self.rank // self.local_size

    @property
    def is_node_leader(self) -> bool:
        return self.local_rank == 0

    @property
    def leaders(self) -> list:
        return list(range(0, self.size, self.local_size))

    def barrier(self):
        dist.barrier(group=self.cpu_group)


# ---------------------------------------------------------------- GPU
SMI_FIELDS = {
    "uuid": None,
    "clocks.sm": "sm_clock_MHz",
    "clocks.max.sm": "sm_clock_max_MHz",
    "clocks.mem": "memory_clock_MHz",
    "temperature.gpu": "temperature_C",
    "power.draw": "power_W",
    "ecc.errors.corrected.volatile.total": "ecc_corrected_errors",
    "ecc.errors.uncorrected.volatile.total": "ecc_uncorrected_errors",
    "pcie.link.gen.current": "pcie_gen",
    "pcie.link.width.current": "pcie_width",
    "pcie.link.width.max": "pcie_width_max",
}


def nvidia_smi(uuid: str) -> dict:
    """This GPU's clocks, temperature, ECC counts and PCIe link from one nvidia-smi call, if there is one."""
    command = ["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"]
    try:
        lines = subprocess.run(command, capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return {"nvidia_smi": f"not available ({type(error).__name__})"}
    for line in lines.splitlines():
        values = [value.strip() for value in line.split(",")]
        if values[0].removeprefix("GPU-") == uuid.removeprefix("GPU-"):
            keys = list(SMI_FIELDS.values())[1:]
            return {
                "telemetry": "nvidia-smi",
                **{key: as_number(value) for key, value in zip(keys, values[1:])},
            }
    return {"nvidia_smi": f"GPU {uuid} not listed"}


def as_number(text: str):
    try:
        value = float(text)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"
    return int(value) if value.is_integer() else value


def gpu_telemetry(uuid: str) -> dict:
    """The nvidia-smi fields read through NVML where nvidia-ml-py is installed (milliseconds, so
    the reading falls inside the loop still running on the GPU), else from nvidia-smi."""
    try:
        import pynvml
    except ImportError:
        return nvidia_smi(uuid)
    try:
        pynvml.nvmlInit()
        # bytes: older nvidia-ml-py hands the argument to ctypes' c_char_p as it is
        handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid.removeprefix('GPU-')}".encode())
    except pynvml.NVMLError:
        return nvidia_smi(uuid)

    def read(query, *args):
        try:
            return query(handle, *args)
        except pynvml.NVMLError:
            return None  # not supported on this board (ECC on some PCIe cards)

    milliwatts = read(pynvml.nvmlDeviceGetPowerUsage)

    def ecc(error_type):
        return read(pynvml.nvmlDeviceGetTotalEccErrors, error_type, pynvml.NVML_VOLATILE_ECC)

    return {
        "telemetry": "NVML",
        "sm_clock_MHz": read(pynvml.nvmlDeviceGetClockInfo, pynvml.NVML_CLOCK_SM),
        "sm_clock_max_MHz": read(pynvml.nvmlDeviceGetMaxClockInfo, pynvml.NVML_CLOCK_SM),
        "memory_clock_MHz": read(pynvml.nvmlDeviceGetClockInfo, pynvml.NVML_CLOCK_MEM),
        "temperature_C": read(pynvml.nvmlDeviceGetTemperature, pynvml.NVML_TEMPERATURE_GPU),
        "power_W": None if milliwatts is None else milliwatts / 1000,
        "ecc_corrected_errors": ecc(pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
        "ecc_uncorrected_errors": ecc(pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
        "pcie_gen": read(pynvml.nvmlDeviceGetCurrPcieLinkGeneration),
        "pcie_width": read(pynvml.nvmlDeviceGetCurrPcieLinkWidth),
        "pcie_width_max": read(pynvml.nvmlDeviceGetMaxPcieLinkWidth),
    }


# Matmul shapes (M, N, K) tried for each precision: the best shapes the MAMF finder found on A100,
# H100 and GH200 (its comparison table, docs/BENCHMARK_FEATURES.md), plus the square of
# --matmul_size. As the finder reports the best shape of its sweep, each is timed briefly and the
# fastest one runs the sustained loop; a full sweep would take hours.
MAMF_SHAPES = {
    "bf16": [(2048, 2048, 13312), (1024, 15360, 4096), (1024, 10240, 5120), (2048, 5120, 6144)],
    "fp8": [(1024, 9216, 14336), (1024, 14336, 14336)],
}
SHAPE_PROBE_REPEATS = 5
MATMUL_KINDS = ("fp32", "tf32", "bf16", "fp8")


def matmul_call(kind: str, shape: tuple, device):
    """A closure multiplying a random M x K by a K x N matrix in `kind` precision (inputs made once)."""
    m, n, k = shape
    if kind == "fp8":
        if torch.cuda.get_device_capability(device) < (8, 9):
            raise NotImplementedError("fp8 needs compute capability 8.9 or later")
        a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn).t()  # _scaled_mm wants column-major
        scale = torch.tensor(1.0, device=device)
        return lambda: torch._scaled_mm(a, b, scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16)
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    return lambda: torch.mm(a, b, out=out)


def fastest_shape(kind: str, shapes: list, device) -> tuple:
    """The shape whose median of a few calls gives the most FLOPS (each shape's matrices are freed
    before the next one's are made)."""

    def flops(shape):
        call = matmul_call(kind, shape, device)
        return 2 * math.prod(shape) / median_seconds(call, device, warmup=2, repeats=SHAPE_PROBE_REPEATS)

    return max(shapes, key=flops)


def gpu_section(world: World, cfg: dict) -> dict:
    if world.device.type != "cuda":
        return {"skipped": "no GPU present"}
    device = world.device
    props = torch.cuda.get_device_properties(device)
    result = {
        "name": props.name,
        "memory_GB": round(props.total_memory / GB, 1),
        "capability": f"{props.major}.{props.minor}",
    }
    timing = {
        "warmup_s": cfg["gpu_warmup_s"],
        "seconds": cfg["gpu_seconds"],
        "window_s": min(cfg["gpu_window_s"], cfg["gpu_seconds"] / 2),  # a first and a last window
    }
    numel = cfg["gpu_copy_MiB"] * MiB // 4
    source, target = torch.randn(numel, device=device), torch.empty(numel, device=device)
    loop = sustained(functools.partial(target.copy_, source), device, **timing)
    result["copy_GB/s"] = stream_bytes("copy", numel, itemsize=4) * loop["calls_per_s"] / GB
    result["copy_throttle_ratio"] = loop["throttle_ratio"]
    del source, target
    telemetry = {}

    def sample():  # while the bf16 loop, the one training lives on, still runs: clocks of a hot GPU
        telemetry.update(gpu_telemetry(str(props.uuid)))

    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for kind in MATMUL_KINDS:
            torch.backends.cuda.matmul.allow_tf32 = kind == "tf32"
            square = (cfg["matmul_size"],) * 3
            try:
                shape = fastest_shape(kind, [square] + MAMF_SHAPES.get(kind, MAMF_SHAPES["bf16"]), device)
                loop = sustained(
                    matmul_call(kind, shape, device),
                    device,
                    **timing,
                    while_busy=sample if kind == "bf16" else None,
                )
                result[f"matmul_{kind}_TFLOPS"] = 2 * math.prod(shape) * loop["calls_per_s"] / 1e12
                result[f"matmul_{kind}_throttle_ratio"] = loop["throttle_ratio"]
                result[f"matmul_{kind}_shape"] = "x".join(map(str, shape))
            except (NotImplementedError, RuntimeError) as error:
                result[f"matmul_{kind}_TFLOPS"] = None
                result[f"matmul_{kind}_note"] = f"not supported: {str(error).splitlines()[0]}"
            torch.cuda.empty_cache()  # the closure's matrices are gone; give their memory back
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    result["sustained_seconds"] = cfg["gpu_seconds"]
    peaks = datasheet(props.name) or {}
    figures = {"copy_GB/s": "memory_GBps", **{f"matmul_{k}_TFLOPS": k for k in MATMUL_KINDS}}
    for key, peak_key in figures.items():
        if peaks.get(peak_key) and result.get(key):
            result[f"{key.rsplit('_', 1)[0]}_percent_of_datasheet"] = 100 * result[key] / peaks[peak_key]
    result.update(telemetry or gpu_telemetry(str(props.uuid)))  # the bf16 loop failed: read it idle
    return result


# ---------------------------------------------------------------- collectives
# torch 2.13 renames the tensor collectives; 2.11 (the GPU image) only has the old names.
ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def collective_call(op: str, size_bytes: int, n_ranks: int, device, group):
    """A closure running `op` on buffers sized as nccl-tests sizes them: all-gather's size is its
    output, reduce-scatter's its input, the others' the one buffer each rank sends."""
    numel = size_bytes // 4
    full = torch.randn(numel, device=device)
    shard = torch.empty(numel // n_ranks, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if op == "all_gather":
        return lambda: ALL_GATHER(full, shard, group=group)
    if op == "reduce_scatter":
        return lambda: REDUCE_SCATTER(shard, full, group=group)
    if op == "all_to_all":
        received = torch.empty_like(full)
        return lambda: dist.all_to_all_single(received, full, group=group)
    return lambda: dist.broadcast(full, group=group, group_src=0)  # the group's first rank


def collective_seconds(call, world: World, group, warmup: int, iters: int) -> float:
    """Seconds per call over `iters` back-to-back calls after `warmup`, as nccl-tests times its
    iteration loop. On a GPU the stream is first held by a spinning kernel while the host queues
    every call, so the window holds only the GPU's work: at 1-4 MiB on NVLink a call takes about as
    long as Python and PyTorch take to issue it (10-30 us), which would otherwise be timed too."""
    for _ in range(warmup):
        call()
    dist.barrier(group=group)
    watch = Stopwatch(world.device)
    if world.device.type == "cuda":
        torch.cuda._sleep(int(iters * HOST_SECONDS_PER_CALL * SPIN_CYCLES_PER_SECOND))
    watch.mark()
    for _ in range(iters):
        call()
    watch.mark()
    return watch.intervals()[0] / iters


def collectives_sweep(world: World, cfg: dict, group, ranks: list) -> dict:
    """algbw/busbw per op and size for the group of global `ranks`. Each rank times its own calls;
    as in nccl-tests, time_us is the average over ranks and time_max_us the slowest rank's, and
    time_max_rank says which rank that was."""
    n_ranks, min_bytes = len(ranks), NCCL_MIN_BYTES[world.device.type]
    sizes = []
    while min_bytes * 4 ** len(sizes) <= cfg["nccl_max_MiB"] * MiB:
        sizes.append(min_bytes * 4 ** len(sizes))
    local_seconds, measured, results = [], [], {}
    for op in BUSBW_FACTORS:
        for size in sizes:
            size = size // (4 * n_ranks) * 4 * n_ranks  # whole float32 shards per rank
            call = collective_call(op, size, n_ranks, world.device, group)
            try:
                local_seconds.append(
                    collective_seconds(call, world, group, cfg["collective_warmup"], cfg["collective_iters"])
                )
            except (RuntimeError, NotImplementedError) as error:  # every rank's backend raises alike
                results[op] = {
                    "skipped": f"not supported by {dist.get_backend(group)}: {str(error).splitlines()[0]}"
                }
                break
            measured.append((op, size))
            del call  # a 1 GiB op's buffers go before the next op's are made
    times = torch.tensor(local_seconds, dtype=torch.float64, device=world.device)
    gathered = [torch.empty_like(times) for _ in ranks]
    dist.all_gather(gathered, times, group=group)
    per_rank = torch.stack(gathered).cpu()  # [rank in group, measurement]
    for (op, size), column in zip(measured, per_rank.T):
        seconds, slowest = column.mean().item(), int(column.argmax())
        algbw = algbw_GBps(size, seconds)
        results.setdefault(op, []).append(
            {
                "size_bytes": size,
                "time_us": seconds * 1e6,
                "time_max_us": column[slowest].item() * 1e6,
                "time_max_rank": ranks[slowest],
                "algbw_GB/s": algbw,
                "busbw_GB/s": busbw_GBps(op, algbw, n_ranks),
            }
        )
    device = {"device_name": torch.cuda.get_device_name(world.device)} if world.device.type == "cuda" else {}
    return {"backend": dist.get_backend(group), "ranks": n_ranks, **device, **results}


def nccl_section(world: World, cfg: dict) -> dict:
    """All ranks; with two or more nodes also each node's ranks on their own, all nodes at once,
    so NVLink inside a node is judged apart from the network between nodes."""
    if world.size < 2:
        return {"skipped": "single rank: nothing to communicate"}
    result = collectives_sweep(world, cfg, None, list(range(world.size)))
    if world.nodes > 1 and world.local_size > 1:
        node_ranks = [list(range(first, first + world.local_size)) for first in world.leaders]
        groups = [dist.new_group(ranks) for ranks in node_ranks]  # every rank must create every group
        mine = world.node_rank
        result["intra_node"] = collectives_sweep(world, cfg, groups[mine], node_ranks[mine])
    return result


def nic_rates_Gbps() -> dict:
    """Line rate of each active InfiniBand or RoCE port, from /sys/class/infiniband/<hca>/ports/<n>
    ("400 Gb/sec (4X NDR)"); empty where there is none."""
    rates = {}
    for port in sorted(Path("/sys/class/infiniband").glob("*/ports/*")):
        try:
            if "ACTIVE" in (port / "state").read_text():
                rate = float((port / "rate").read_text().split()[0])
                rates[f"{port.parent.parent.name}/{port.name}"] = rate
        except (OSError, ValueError, IndexError):
            continue
    return rates


# ---------------------------------------------------------------- links between nodes
def pairing_rounds(n_nodes: int) -> list:
    """Rounds of disjoint node pairs that together cover every pair once (the circle method)."""
    nodes = list(range(n_nodes)) + ([None] if n_nodes % 2 else [])
    rounds = []
    for _ in range(len(nodes) - 1):
        half = len(nodes) // 2
        rounds.append(
            [
                (min(a, b), max(a, b))
                for a, b in zip(nodes[:half], reversed(nodes[half:]))
                if a is not None and b is not None
            ]
        )
        nodes = [nodes[0], nodes[-1], *nodes[1:-1]]
    return rounds


def one_way_seconds(peer: int, sends_first: bool, size_bytes: int, world: World, iters: int) -> float:
    """Half the round trip of a `size_bytes` message bounced between this rank and `peer`."""
    buffer = torch.zeros(max(size_bytes // 4, 1), device=world.device)

    def round_trip():
        if sends_first:
            dist.send(buffer, peer)
            dist.recv(buffer, peer)
        else:
            dist.recv(buffer, peer)
            dist.send(buffer, peer)

    return median_seconds(round_trip, world.device, warmup=3, repeats=1, inner=iters) / 2


def links_section(world: World, cfg: dict) -> dict:
    if world.nodes < 2:
        return {"skipped": "single node"}
    leaders_group = dist.new_group(world.leaders)  # every rank must take part in creating it
    if not world.is_node_leader:
        return {}
    pairs = {}
    for pairs_this_round in pairing_rounds(world.nodes):
        dist.barrier(group=leaders_group)
        for first, second in pairs_this_round:
            if world.node_rank in (first, second):
                peer = (second if world.node_rank == first else first) * world.local_size
                sends = world.node_rank == first
                latency = one_way_seconds(peer, sends, LATENCY_BYTES, world, cfg["pingpong_iters"])
                big = PINGPONG_BYTES[world.device.type] // (8 if cfg["quick"] else 1)
                iters = max(cfg["pingpong_iters"] // 10, 2)
                bandwidth = big / one_way_seconds(peer, sends, big, world, iters) / GB
                pairs[f"node{first}-node{second}"] = {
                    "latency_us": latency * 1e6,
                    "size_bytes": big,
                    "bandwidth_GB/s": bandwidth,
                }
    return {"pairs": pairs, "one_rank_per_node": collectives_sweep(world, cfg, leaders_group, world.leaders)}


# ---------------------------------------------------------------- storage
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


# ---------------------------------------------------------------- CPU
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


# ---------------------------------------------------------------- host memory
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


def available_memory_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


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


# ---------------------------------------------------------------- verdicts and report
def check(status: str, name: str, value: str, reference: str = "") -> dict:
    return {"status": status, "check": name, "value": value, "reference": reference}


def flagged(names: list) -> str:
    return f"; flagged {', '.join(names)}" if names else ""


def size_text(size_bytes: int) -> str:
    return f"{size_bytes // MiB} MiB" if size_bytes >= MiB else f"{size_bytes // 1024} KiB"


def straggler_checks(kind: str, members: dict, below: str = "fail") -> list:
    """One check per rate figure: every member (GPU, node, node pair) against the median of all;
    a member too far below has status `below`."""
    figures = sorted(
        {
            key
            for figures in members.values()
            for key, value in figures.items()
            if key.endswith(RATE_UNITS) and isinstance(value, (int, float))
        }
    )
    if len(members) < 2:
        return (
            [check("skip", f"{kind} stragglers", f"only one {kind}: nothing to compare")] if figures else []
        )
    checks = []
    for figure in figures:
        values = {name: m[figure] for name, m in members.items() if isinstance(m.get(figure), (int, float))}
        low, median = flag_stragglers(values), statistics.median(values.values())
        slowest = min(values, key=values.get)
        checks.append(
            check(
                below if low else "pass",
                f"{kind} {figure}",
                f"slowest {slowest}: {values[slowest]:.4g}{flagged(low)}",
                f"median {median:.4g}, flag below {(1 - STRAGGLER_TOLERANCE) * median:.4g}",
            )
        )
    return checks


def gpu_checks(gpus: dict) -> list:
    """Against the datasheet, against the GPU's own first second (throttling), and ECC; the
    stragglers among GPUs are straggler_checks'."""
    checks = []
    for figure, peak_key in DATASHEET_CHECKS.items():
        known = {
            name: (g[figure], datasheet(g["name"])[peak_key])
            for name, g in gpus.items()
            if datasheet(g["name"]) and g.get(figure)
        }
        unknown = sorted({g["name"] for name, g in gpus.items() if name not in known})
        if unknown:
            checks.append(
                check("skip", f"gpu {figure} vs datasheet", f"no datasheet entry for {', '.join(unknown)}")
            )
        if known:
            percent = {name: 100 * value / peak for name, (value, peak) in known.items()}
            low = [name for name, p in percent.items() if p < DATASHEET_MIN_PERCENT]
            worst = min(percent, key=percent.get)
            checks.append(
                check(
                    "fail" if low else "pass",
                    f"gpu {figure} vs datasheet",
                    f"lowest {worst}: {percent[worst]:.0f}% of {known[worst][1]:g}{flagged(low)}",
                    f">= {DATASHEET_MIN_PERCENT:.0f}% of datasheet",
                )
            )
    ratios = {
        f"{name} {key.removesuffix('_throttle_ratio')}": value
        for name, g in gpus.items()
        for key, value in g.items()
        if key.endswith("_throttle_ratio") and isinstance(value, (int, float))
    }
    if ratios:
        low = [name for name, ratio in ratios.items() if ratio < THROTTLE_MIN_RATIO]
        worst = min(ratios, key=ratios.get)
        checks.append(
            check(
                "fail" if low else "pass",
                "gpu throttling (last second / first)",
                f"lowest {worst}: {ratios[worst]:.3g}{flagged(low)}",
                f">= {THROTTLE_MIN_RATIO:g}",
            )
        )
    ecc = {name: g["ecc_uncorrected_errors"] for name, g in gpus.items() if g.get("ecc_uncorrected_errors")}
    if any(isinstance(g.get("ecc_uncorrected_errors"), int) for g in gpus.values()):
        checks.append(
            check(
                "fail" if ecc else "pass",
                "gpu uncorrected ECC errors",
                ", ".join(f"{n}: {v}" for n, v in ecc.items()) or "none",
                "0",
            )
        )
    return checks


def platform_floor(sweep: dict) -> dict | str:
    """The intra-node busbw floors for the sweep's GPUs, or why there are none."""
    if "device_name" not in sweep:
        return f"no floor for {sweep.get('backend', 'this backend')} without GPUs"
    for name_part, floor in COLLECTIVE_FLOORS.items():
        if name_part.lower() in sweep["device_name"].lower():
            return floor or f"no floor known for {sweep['device_name']}"
    return f"no floor known for {sweep['device_name']}"


def inter_node_floor(nodes: dict, nic_Gbps: float | None) -> dict | str:
    """Floors for one rank per node: a fraction of one NIC's line rate, from --nic_gbps or else the
    slowest node's fastest active port; or why there are none."""
    if nic_Gbps:
        rate, origin = nic_Gbps, "--nic_gbps"
    else:
        fastest = {
            name: max(node.get("nics_Gbps", {}).values(), default=None) for name, node in nodes.items()
        }
        missing = [name for name, rate in fastest.items() if rate is None]
        if missing:
            return f"no active port in /sys/class/infiniband on {', '.join(missing)}; pass --nic_gbps"
        rate, origin = min(fastest.values()), "/sys/class/infiniband"
    floor = INTER_NODE_FLOOR_FRACTION * rate / 8
    return {
        "platform": f"{INTER_NODE_FLOOR_FRACTION:.0%} of a {rate:g} Gb/s NIC, {origin}",
        **dict.fromkeys(FLOOR_OPS, floor),
    }


def busbw_floor_checks(scope: str, sweeps: dict, floors: dict) -> list:
    """busbw of all-reduce and all-gather at each sweep's largest size against its member's floor
    ({op: GB/s}, or a string saying why there is none)."""
    checks = []
    for op in FLOOR_OPS:
        rows = {
            name: sweep[op][-1]
            for name, sweep in sweeps.items()
            if isinstance(sweep.get(op), list) and sweep[op]
        }
        judged, unjudged = {}, {}
        for name, row in rows.items():
            if isinstance(floors[name], str):
                unjudged.setdefault(floors[name], []).append(name)
            elif row["size_bytes"] < FLOOR_MIN_BYTES:
                reason = f"largest message {size_text(row['size_bytes'])}, under {size_text(FLOOR_MIN_BYTES)}"
                unjudged.setdefault(reason, []).append(name)
            else:
                judged[name] = (row["busbw_GB/s"], floors[name])
        if unjudged:
            reasons = [f"{reason} ({', '.join(names)})" for reason, names in unjudged.items()]
            checks.append(check("skip", f"{scope} {op} busbw", "; ".join(reasons)))
        if judged:
            low = [name for name, (busbw, floor) in judged.items() if busbw < floor[op]]
            worst = min(judged, key=lambda name: judged[name][0] / judged[name][1][op])
            busbw, floor = judged[worst]
            checks.append(
                check(
                    "fail" if low else "pass",
                    f"{scope} {op} busbw",
                    f"lowest {worst}: {busbw:.4g} GB/s{flagged(low)}",
                    f">= {floor[op]:.4g} GB/s ({floor['platform']})",
                )
            )
    return checks


def slow_rank_checks(sweeps: dict) -> list:
    """One warn naming each collective whose slowest rank took SLOW_RANK_RATIO times the average, at
    each op's largest size: at small sizes the ranks' skew leaving the barrier (tens of us, more for
    gloo on a busy host) is a large part of the loop and would name a rank for nothing."""
    rows = [
        (scope, op, sweep[op][-1])
        for scope, sweep in sweeps.items()
        for op in BUSBW_FACTORS
        if isinstance(sweep.get(op), list) and sweep[op]
    ]
    slow = [
        f"rank {row.get('time_max_rank', '?')} in {scope} {op} at {size_text(row['size_bytes'])}: "
        f"{row['time_max_us'] / row['time_us']:.1f}x"
        for scope, op, row in rows
        if row["time_max_us"] > SLOW_RANK_RATIO * row["time_us"]
    ]
    if not rows:
        return []
    shown = "; ".join(slow[:3]) + (f"; {len(slow) - 3} more" if len(slow) > 3 else "")
    return [
        check(
            "warn" if slow else "pass",
            "collective slowest rank",
            shown or "every rank near the average",
            f"time_max_us <= {SLOW_RANK_RATIO:g} x time_us",
        )
    ]


def collective_checks(report: dict, nic_Gbps: float | None) -> list:
    """Intra-node busbw against the platform's floor (the all-ranks sweep on one node, each node's
    own sweep on several), inter-node busbw against the NIC's, slow ranks in any sweep."""
    nccl, links = report["nccl"], report["links"]
    sweeps, checks = {}, []
    if nccl and "skipped" not in nccl:
        sweeps["all ranks"] = nccl
        alone = len(report["nodes"]) == 1  # then all ranks are one node's
        intra = nccl.get("intra_node") or ({next(iter(report["nodes"])): nccl} if alone else {})
        sweeps.update({f"{name} intra-node": sweep for name, sweep in nccl.get("intra_node", {}).items()})
        floors = {name: platform_floor(sweep) for name, sweep in intra.items()}
        checks += busbw_floor_checks("intra-node", intra, floors)
    if links.get("one_rank_per_node"):
        sweeps["one rank per node"] = links["one_rank_per_node"]
        checks += busbw_floor_checks(
            "inter-node",
            {"one rank per node": links["one_rank_per_node"]},
            {"one rank per node": inter_node_floor(report["nodes"], nic_Gbps)},
        )
    return checks + slow_rank_checks(sweeps)


def storage_floor_checks(storage: dict, min_GBps: float) -> list:
    """Each node's parallel write (like every rank writing its checkpoint shard at once) against
    --min_storage_GBps."""
    nodes = {
        name: figures["parallel_write_GB/s"]
        for name, figures in storage.items()
        if name != "aggregate"
        and isinstance(figures, dict)
        and isinstance(figures.get("parallel_write_GB/s"), (int, float))
    }
    if not nodes or not min_GBps:
        return []
    low = [name for name, value in nodes.items() if value < min_GBps]
    worst = min(nodes, key=nodes.get)
    return [
        check(
            "fail" if low else "pass",
            "storage parallel_write_GB/s",
            f"slowest {worst}: {nodes[worst]:.4g}{flagged(low)}",
            f">= {min_GBps:g} (--min_storage_GBps)",
        )
    ]


def verdict_checks(
    report: dict, nic_Gbps: float | None = None, min_storage_GBps: float = MIN_STORAGE_GBPS
) -> list:
    """Every check, fails first, then warns, passes and skips. Fail is for what training depends on
    (GPUs, collectives, links, storage writes, errors); CPU and host-memory stragglers only warn."""
    checks = [
        check("skip", section, report[section]["skipped"])
        for section in SECTIONS
        if isinstance(report[section], dict) and "skipped" in report[section]
    ]
    checks += [
        check("fail", f"{section} on {name}", figures["error"])
        for section in ("gpu", "storage", "cpu", "memory")
        for name, figures in report[section].items()
        if isinstance(figures, dict) and "error" in figures
    ]
    gpus = {name: g for name, g in report["gpu"].items() if isinstance(g, dict) and "name" in g}
    checks += straggler_checks("gpu", gpus) + gpu_checks(gpus) + collective_checks(report, nic_Gbps)
    checks += storage_floor_checks(report["storage"], min_storage_GBps)
    nodes = {
        name: {
            f"{section} {key}": value
            for section in ("storage", "cpu", "memory")
            for key, value in report[section].get(name, {}).items()
        }
        for name in report["nodes"]
    }
    checks += straggler_checks("node", nodes, below="warn")
    if isinstance(report["links"].get("pairs"), dict):
        checks += straggler_checks("node pair", report["links"]["pairs"])
    order = {"fail": 0, "warn": 1, "pass": 2, "skip": 3}
    return sorted(checks, key=lambda c: order[c["status"]])


def verdict(checks: list, fail_on_warn: bool = False) -> str:
    statuses = {c["status"] for c in checks}
    if "fail" in statuses or (fail_on_warn and "warn" in statuses):
        return "fail"
    return "warn" if "warn" in statuses else "pass"


def print_table(checks: list):
    widths = [
        max(len(str(c[key])) for c in checks + [check("status", "check", "value", "reference")])
        for key in ("status", "check", "value")
    ]
    for row in [check("STATUS", "CHECK", "VALUE", "REFERENCE")] + checks:
        cells = [str(row[key]).ljust(width) for key, width in zip(("status", "check", "value"), widths)]
        print("  ".join(cells + [row["reference"]]))


def rounded(value):
    """Figures to 4 significant digits, so the YAML reads like a measurement and not like noise."""
    if isinstance(value, dict):
        return {key: rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [rounded(item) for item in value]
    return float(f"{value:.4g}") if isinstance(value, float) else value


def write_yaml(path: Path, content: dict):
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    temporary.write_text(yaml.safe_dump(rounded(content), sort_keys=False, width=120))
    os.replace(temporary, path)


def node_name() -> str:
    """This node as SLURM names it (what sbatch --exclude takes); its hostname outside a job."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def failed_nodes(checks: list) -> dict:
    """{node name: the first failing check naming it}: what slurm_submit.sh leaves out of the job. A check
    that names no node (a collective, a pair of nodes) blames none."""
    nodes = {}
    for c in checks:
        if c["status"] == "fail":
            for name in re.findall(r"node\d+ \(([^)]+)\)", f"{c['check']} {c['value']}"):
                nodes.setdefault(name, f"benchmark: {c['check']}: {c['value']}")
    return nodes


def write_suspects(folder: str, checks: list):
    """<folder>/benchmark.json: the failed nodes, in the form train.py's guard writes its own suspects."""
    if nodes := failed_nodes(checks):
        Path(folder).mkdir(parents=True, exist_ok=True)
        path = Path(folder) / "benchmark.json"
        temporary = path.with_name(f"benchmark.{os.getpid()}.tmp")
        temporary.write_text(json.dumps({"time": time.time(), "nodes": nodes}))
        os.replace(temporary, path)


# ---------------------------------------------------------------- command line
class OneLineErrors(argparse.ArgumentParser):
    """Bad input is one line on stderr (once per node under torchrun) and exit status 2."""

    def error(self, message):
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"benchmark.py: error: {message}", file=sys.stderr)
        sys.exit(2)


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


def positive_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def section_list(option: str, text: str, parser) -> set:
    names = {name.strip() for name in text.split(",") if name.strip()}
    for name in names - set(SECTIONS):
        close = difflib.get_close_matches(name, SECTIONS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        parser.error(f"{option}: unknown section {name!r}{hint}; sections are {', '.join(SECTIONS)}")
    return names


# Options that size the measurements: (type, help). Unset, they take the mode's value from MODES.
SIZE_OPTIONS = {
    "--storage_MiB": (positive_int, "MiB written per node (default 1024, --quick 64)"),
    "--storage_workers": (positive_int, "parallel writers/readers (default 8, --quick 4)"),
    "--memory_MiB": (positive_int, "each STREAM array (default 256, --quick 64; >= 4x L3)"),
    "--matmul_size": (
        positive_int,
        "square matmul tried besides the MAMF shapes (default 8192, --quick 4096)",
    ),
    "--nccl_max_MiB": (positive_int, "largest collective (default 1024 GPU / 16 CPU, --quick 256 / 1)"),
    "--gpu_seconds": (
        positive_number,
        "timed loop of each GPU figure after 1 s of warm-up (default 3, --quick 1)",
    ),
    "--nic_gbps": (
        positive_number,
        "one NIC's line rate in Gb/s, for the inter-node floor (default: read from /sys/class/infiniband)",
    ),
}


def argument_parser():
    parser = OneLineErrors(
        description=__doc__.split("\n\n")[0],
        epilog=f"Sections: {', '.join(SECTIONS)}. Figures explained in docs/BENCHMARK_FEATURES.md.",
    )
    parser.add_argument(
        "--only", default=",".join(SECTIONS), help="comma-separated sections to run (default: all)"
    )
    parser.add_argument("--skip", default="", help="comma-separated sections not to run")
    parser.add_argument(
        "--quick", action="store_true", help="small sizes, few repeats, 1 s GPU loops: seconds on CPU"
    )
    parser.add_argument("--storage_path", default="checkpoints", help="folder to test (default: checkpoints)")
    parser.add_argument("--report_dir", default="logs", help="where the YAML reports go (default: logs)")
    parser.add_argument("--report", help="write the cluster report exactly here (it must not exist)")
    parser.add_argument(
        "--suspects_folder",
        help="write the nodes that fail a check to <this>/benchmark.json (slurm_submit.sh)",
    )
    for flag, (kind, text) in SIZE_OPTIONS.items():
        parser.add_argument(flag, type=kind, help=text)
    parser.add_argument(
        "--min_storage_GBps",
        type=positive_number,
        default=MIN_STORAGE_GBPS,
        help=f"each node's parallel write must reach this (default {MIN_STORAGE_GBPS:g})",
    )
    parser.add_argument(
        "--fail_on_warn",
        action="store_true",
        help="warnings (CPU and host-memory stragglers, slow ranks) fail the verdict too; a node slower "
        "than its own history only warns",
    )
    parser.add_argument(
        "--history",
        action="store_true",
        help=f"print each node's figures over its runs (<report_dir>/{history.HISTORY_FILE}), then exit",
    )
    return parser


def parse_args(argv=None):
    parser = argument_parser()
    args = parser.parse_args(argv)
    sections = section_list("--only", args.only, parser) - section_list("--skip", args.skip, parser)
    if not sections:
        parser.error("--only/--skip leave no section to run")
    cfg = {
        **MODES["quick" if args.quick else "default"],
        "quick": args.quick,
        "sections": [s for s in SECTIONS if s in sections],
        "storage_path": args.storage_path,
        "report_dir": args.report_dir,
        "report": args.report,
        "suspects_folder": args.suspects_folder,
        "nic_gbps": args.nic_gbps,
        "min_storage_GBps": args.min_storage_GBps,
        "fail_on_warn": args.fail_on_warn,
        "history": args.history,
    }
    cfg.update({key: value for key, value in vars(args).items() if key in cfg and value is not None})
    if args.report:
        cfg["report_dir"] = str(Path(args.report).parent)
    validate(cfg, args, parser)
    return cfg


def validate(cfg: dict, args, parser):
    """Everything knowable before the first measurement, so bad input costs nothing."""
    try:
        Path(cfg["report_dir"]).mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=cfg["report_dir"]).close()
    except OSError as error:
        parser.error(
            f"--report_dir {cfg['report_dir']}: cannot write there ({error.strerror}); pass a writable folder"
        )
    if cfg["report"] and Path(cfg["report"]).exists():
        parser.error(f"--report {cfg['report']} exists; pass a new path")
    if "storage" in cfg["sections"]:
        path = Path(cfg["storage_path"])
        if path.is_file():
            parser.error(f"--storage_path {path} is a file, not a folder; pass a folder or --skip storage")
        if not path.is_dir():
            parser.error(
                f"--storage_path {path}: no such folder; create it (mkdir -p {path}), pass another "
                "or --skip storage"
            )
        try:
            tempfile.TemporaryFile(dir=path).close()
        except OSError as error:
            parser.error(
                f"--storage_path {path}: cannot write there ({error.strerror}); pass a writable folder "
                "or --skip storage"
            )
        if cfg["storage_MiB"] < cfg["storage_workers"]:
            parser.error(
                f"--storage_MiB {cfg['storage_MiB']} is less than --storage_workers "
                f"{cfg['storage_workers']}: each worker writes whole 1 MiB blocks"
            )
        free, needed = shutil.disk_usage(path).free, 2 * cfg["storage_MiB"] * MiB
        if free < needed:
            parser.error(
                f"--storage_path {path}: {free / GB:.1f} GB free, the storage test needs "
                f"{needed / GB:.1f} GB; lower --storage_MiB or free space"
            )
    if "memory" in cfg["sections"]:
        floor = -(-CACHE_MULTIPLE * l3_cache_bytes() // MiB)
        if args.memory_MiB is None:
            cfg["memory_MiB"] = max(cfg["memory_MiB"], floor)
        elif args.memory_MiB < floor:
            parser.error(
                f"--memory_MiB {args.memory_MiB} is under {CACHE_MULTIPLE}x this node's L3 cache "
                f"({floor} MiB): it would measure cache, not memory; pass at least {floor}"
            )
        if 3 * cfg["memory_MiB"] * MiB > available_memory_bytes() / 2:
            parser.error(
                f"--memory_MiB {cfg['memory_MiB']}: 3 arrays need more than half of the "
                f"{available_memory_bytes() / GB:.1f} GB available; lower it"
            )
    if cfg["sections"] == ["gpu"] and not torch.cuda.is_available():
        parser.error("--only=gpu on a machine without a GPU would check nothing; run it on a GPU node")
    if cfg["nccl_max_MiB"] is None:
        cfg["nccl_max_MiB"] = NCCL_MAX_MiB[("cuda" if torch.cuda.is_available() else "cpu", cfg["quick"])]


# ---------------------------------------------------------------- main
def start_world() -> World:
    """torchrun's environment, or a one-rank group for a plain `python benchmark.py`."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    options = {"device_id": device} if device.type == "cuda" else {}
    if "RANK" in os.environ:
        dist.init_process_group(backend, **options)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **options)
    cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else None
    return World(
        dist.get_rank(),
        dist.get_world_size(),
        local_rank,
        int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        device,
        cpu_group,
    )


def run_section(section: str, world: World, cfg: dict) -> dict:
    """Runs one section where it belongs; a local failure becomes a reported error, not a hang."""
    world.barrier()
    if section in ("nccl", "links"):
        return {"nccl": nccl_section, "links": links_section}[section](world, cfg)
    if section == "storage":
        return storage_section(world, cfg)
    rehearsed = os.environ.get("REHEARSE_BAD_NODES", "").split(",")
    if section == "cpu" and world.is_node_leader and node_name() in rehearsed:
        return {"error": "REHEARSE_BAD_NODES names this node: it fails on purpose, to rehearse healing"}
    if section == "gpu" or world.is_node_leader:
        try:
            return {
                "gpu": lambda: gpu_section(world, cfg),
                "cpu": lambda: cpu_section(cfg),
                "memory": lambda: memory_section(cfg),
            }[section]()
        except Exception as error:  # noqa: BLE001 - reported as a failed check
            return {"error": f"{type(error).__name__}: {error}"}
    return {}


def cluster_report(everyone: list, world: World, job: dict, cfg: dict) -> dict:
    """Rank 0's view from every rank's figures: GPUs by name, per-node sections, aggregates, checks."""
    label = {r["node_rank"]: f"node{r['node_rank']} ({r['node_name']})" for r in everyone}
    leaders = [r for r in everyone if r["rank"] % world.local_size == 0]
    first = everyone[0]

    def per_node(section):
        if "skipped" in first[section]:
            return first[section]
        return {label[r["node_rank"]]: r[section] for r in leaders}

    gpus = first["gpu"]
    if "skipped" not in gpus:
        gpus = {f"{label[r['node_rank']]}/gpu{r['rank'] % world.local_size}": r["gpu"] for r in everyone}
    nccl = first["nccl"]
    if "intra_node" in nccl:
        nccl = {**nccl, "intra_node": {label[r["node_rank"]]: r["nccl"]["intra_node"] for r in leaders}}
    report = {
        "job": job,
        "world": {
            "ranks": world.size,
            "nodes": world.nodes,
            "ranks_per_node": world.local_size,
            "backend": dist.get_backend(),
            "device": world.device.type,
        },
        "verdict": None,
        "checks": None,
        "gpu": gpus,
        "nccl": nccl,
        "links": {key: value for key, value in first["links"].items() if key != "pairs"},
        "storage": per_node("storage"),
        "cpu": per_node("cpu"),
        "memory": per_node("memory"),
        "nodes": {
            label[r["node_rank"]]: {
                "hostname": r["hostname"],
                "first_rank": r["rank"],
                "nics_Gbps": r["nics_Gbps"],
            }
            for r in leaders
        },
    }
    if "skipped" not in report["links"]:
        report["links"]["pairs"] = {
            pair: figures for r in leaders for pair, figures in r["links"].get("pairs", {}).items()
        }
    if "skipped" not in report["storage"]:
        report["storage"] = {
            "aggregate": storage_aggregate(list(report["storage"].values())),
            **report["storage"],
        }
    report["checks"] = verdict_checks(report, cfg["nic_gbps"], cfg["min_storage_GBps"])
    report["verdict"] = verdict(report["checks"], cfg["fail_on_warn"])
    return report


def node_report(report: dict, node: str) -> dict:
    """One node's part of the cluster report, for its benchmark_<job>_rank<R>.yaml."""

    def mine(section):
        figures = report[section]
        if "skipped" in figures:
            return figures
        if section == "gpu":
            return {key: value for key, value in figures.items() if key.startswith(node + "/")}
        return figures[node]

    return {
        "job": report["job"],
        "node": {node: report["nodes"][node]},
        **{section: mine(section) for section in ("gpu", "storage", "cpu", "memory")},
    }


def main(argv=None) -> int:
    cfg = parse_args(argv)
    if cfg["history"]:
        print(history.trend_table(history.read_history(Path(cfg["report_dir"]) / history.HISTORY_FILE)))
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # scancel: still remove the test files
    started = time.perf_counter()
    world = start_world()
    try:
        job_id = [os.environ.get("SLURM_JOB_ID") or datetime.now(UTC).strftime("%Y%m%d-%H%M%S")]
        dist.broadcast_object_list(job_id, src=0, group=world.cpu_group)
        local = {
            "rank": world.rank,
            "node_rank": world.node_rank,
            "hostname": socket.gethostname(),
            "node_name": node_name(),
            "nics_Gbps": nic_rates_Gbps(),
        }
        section_seconds = {}
        for section in SECTIONS:
            section_started = time.perf_counter()
            selected = section in cfg["sections"]
            local[section] = run_section(section, world, cfg) if selected else {"skipped": "not selected"}
            section_seconds[section] = time.perf_counter() - section_started
        everyone = [None] * world.size
        dist.all_gather_object(everyone, local, group=world.cpu_group)
        job = {
            "id": job_id[0],
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv),
            "mode": "quick" if cfg["quick"] else "default",
            "torch": str(torch.__version__),
            "seconds": time.perf_counter() - started,
            "section_seconds": section_seconds,
        }
        report = cluster_report(everyone, world, job, cfg)
        path = Path(cfg["report"] or Path(cfg["report_dir"]) / f"benchmark_{job['id']}.yaml")
        if world.is_node_leader:
            node = f"node{world.node_rank} ({local['node_name']})"
            write_yaml(path.with_name(f"{path.stem}_rank{world.rank}.yaml"), node_report(report, node))
        if world.rank == 0:
            history_path = path.parent / history.HISTORY_FILE
            earlier = history.read_history(history_path)
            history.judge_against_history(report, earlier)
            write_yaml(path, report)
            drawn = path.with_suffix(".png")
            picture.draw(report, str(drawn))
            history.append(history_path, report, earlier)
            print_table(report["checks"])
            print(f"verdict: {report['verdict']} in {job['seconds']:.1f} s; report: {path}; picture: {drawn}")
            if cfg["suspects_folder"]:
                write_suspects(cfg["suspects_folder"], report["checks"])
        return 1 if report["verdict"] == "fail" else 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
