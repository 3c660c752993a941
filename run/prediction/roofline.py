"""A roofline: the least time the step's work can take on a device's figures, for when nothing of this model
was measured on it. The simulated step's FLOPs run at the device's sustained matmul rate, its collectives
move their bytes at the bus bandwidth; a GPU runs collectives beside its compute, a CPU in turn with it.
Memory-bound operations are left out: a compiled step fuses most of them, and costing each alone would
overstate the step. Real steps take longer (attention and elementwise kernels, the host, exposed
communication) by a factor measured on this project's runs: the prediction is the bound times its range."""

import bisect
import dataclasses
import math

import torch

from common.datasheet import datasheet
from common.nccl_tests import BUSBW_FACTORS
from run.prediction.step_time import Prediction

# Of a datasheet's dense peak, what a GPU sustains, as benchmark.py measured it on one H100 SXM: a bf16
# matmul loop at 676 of 989.4 TFLOP/s (docs/PERFORMANCE.md).
MATMUL_OF_PEAK = 676 / 989.4
# Without a report, the collectives of a GPU node: NVLink 4 ring busbw of 8 H100s (nccl-tests, NVLS off)
# inside a node, one 400 Gb/s NIC per GPU between nodes (46 GB/s each); docs/BENCHMARK_FEATURES.md.
ASSUMED_BUSBW_GBPS = {"intra-node": 360.0, "inter-node": 46.0}
# Measured steps over their roofline on this project's runs (docs/PERFORMANCE.md, "The predicted step
# against the measured one"): GPUs, the three compiled runs on one H200 (4b op 1.16, 4b full 1.14, gpt2-xl
# 1.42); CPUs, every row of tests/perf/bench_prediction.py's grid measured on two 2-core machines, a Xeon
# (1.25-2.99) and an AMD EPYC (0.98-2.99; 0.85-3.42 with other kernel paths and one thread). The held-out
# rows of a third, an AMX Xeon, fell inside (1.49-3.09); there ATen's AVX2 and default kernels, beside
# the matmul library's AMX, took up to 6.2x: the range is for a CPU's own best kernels.
STEP_OVER_ROOFLINE = {"cuda": (1.14, 1.42), "cpu": (0.85, 3.4)}


@dataclasses.dataclass
class Figures:
    """A device's figures: matmul FLOP/s by dtype, busbw by (collective, between nodes) -> [(message bytes,
    bus bytes/s)] ascending (a sweep; none: ASSUMED_BUSBW_GBPS), and its kind, "cuda" or "cpu"."""

    source: str
    kind: str
    flops_per_s: dict
    sweeps: dict | None = None

    def collective_seconds(self, name, size, group, nodes):
        if group <= 1:
            return 0.0
        sweep = (self.sweeps or {}).get((name, nodes > 1))
        if not sweep:
            busbw = ASSUMED_BUSBW_GBPS["inter-node" if nodes > 1 else "intra-node"] * 1e9
        else:  # the measured busbw at the nearest size at or above this one, the last beyond the sweep
            sizes = [message for message, _ in sweep]
            busbw = sweep[min(bisect.bisect_left(sizes, size), len(sweep) - 1)][1]
        return size * BUSBW_FACTORS[name](group) / busbw


def from_datasheet(gpu):
    sheet = datasheet(gpu)
    rate = sheet["bf16"] * 1e12 * MATMUL_OF_PEAK
    fp32 = (sheet["tf32"] or sheet["fp32"]) * 1e12 * MATMUL_OF_PEAK
    flops = {torch.bfloat16: rate, torch.float16: rate, torch.float32: fp32}
    return Figures(f"the datasheet of {gpu}", "cuda", flops)


def from_report(path, report):
    """A benchmark report's figures: its slowest GPU's bf16 matmul rate, or its slowest node's all-core CPU
    one shared by a node's ranks; its busbw sweeps; None where it holds no matmul rate."""
    gpus = [gpu for gpu in (report.get("gpu") or {}).values() if isinstance(gpu, dict) and "name" in gpu]
    if gpus:
        rate = least(gpus, "matmul_bf16_TFLOPS", 1e12)
        flops = {torch.bfloat16: rate, torch.float16: rate, torch.float32: rate and rate / 2}
    else:
        nodes = [node for key, node in (report.get("cpu") or {}).items()
                 if key != "aggregate" and isinstance(node, dict)]  # fmt: skip
        rate = least(nodes, "matmul_fp32_GFLOPS", 1e9 / report["world"]["ranks_per_node"])
        flops = {torch.float32: rate, torch.bfloat16: rate, torch.float16: rate}
    if not rate:
        return None
    kind = "cuda" if gpus else "cpu"
    return Figures(f"the figures of benchmark report {path}", kind, flops, sweeps(report))


def sweeps(report):
    """{(collective, between nodes): [(bytes, busbw bytes/s)]}: between nodes the all-ranks sweep, inside a
    node a node's own sweep (or the all-ranks one on one node)."""
    nccl, found = report.get("nccl") or {}, {}
    inside = next(iter((nccl.get("intra_node") or {}).values()), None) or nccl
    for between, section in ((True, nccl), (False, inside)):
        for name in BUSBW_FACTORS:
            rows = section.get(name) if isinstance(section, dict) else None
            if isinstance(rows, list) and rows:
                found[(name, between)] = [(row["size_bytes"], row["busbw_GB/s"] * 1e9) for row in rows]
    return found


def least(members, key, scale):
    """The least of the members' figure, times scale; None where no member has it."""
    values = [member[key] for member in members if isinstance(member.get(key), (int, float))]
    return min(values) * scale if values else None


def roofline_seconds(work, figures):
    """The least seconds the step's Work (simulate.py) takes on figures."""
    compute, communication = 0.0, 0.0
    for operations, times in ((work.micro_steps, work.times), (work.rest, 1.0)):
        for operation in operations:
            if operation.collective:
                communication += times * figures.collective_seconds(*operation.collective)
            else:
                rate = figures.flops_per_s.get(operation.dtype, figures.flops_per_s[torch.float32])
                compute += times * (operation.flops / rate)
    return max(compute, communication) if figures.kind == "cuda" else compute + communication


def predicted(work, figures, accumulation):
    """The Prediction of the step's Work on figures: its bound times the range real steps took, centred on
    their geometric mean."""
    bound = roofline_seconds(work, figures)
    low, high = (bound * over for over in STEP_OVER_ROOFLINE[figures.kind])
    return Prediction(math.sqrt(low * high), low, high, "roofline", figures.source, accumulation)
