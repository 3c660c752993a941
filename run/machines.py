"""The machine a step is predicted on (run/predict.py): what each operation and collective costs there,
whether its device runs collectives beside compute, and what the host spends issuing each operation. In
order of faithfulness: a benchmark report's own timings of this model's operations and collectives
(benchmark.py --train_args, which the job runs on its nodes); this device, each distinct operation timed
now; a report's figures (matmul rate, memory bandwidth, busbw per collective and message size); a GPU's
datasheet."""

import bisect
import contextlib
import functools
import os

import torch
from torch.utils._pytree import tree_leaves

from common.datasheet import datasheet
from common.nccl_tests import BUSBW_FACTORS, SWEEP_NAMES
from common.op_timing import TensorMeta, eager_overheads, time_operation
from run.predict import FAKE_ONLY
from run.report_figures import newest_report, read_report

# Of a datasheet's dense peak, what a GPU sustains: the best bf16 matmul the MAMF finder reaches on an H100
# SXM (794.5 of 989.4 TFLOP/s; docs/BENCHMARK_FEATURES.md, "gpu: each GPU", its matmul shapes) and a STREAM
# copy (2.90 of 3.35 TB/s).
MAMF_OF_PEAK = 794.5 / 989.4
COPY_OF_PEAK = 2.90 / 3.35
# Without a report, the collectives of a GPU node: NVLink 4 ring busbw of 8 H100s (nccl-tests, NVLS off)
# inside a node, one 400 Gb/s NIC per GPU between nodes (46 GB/s each).
ASSUMED_BUSBW_GBPS = {"intra-node": 360.0, "inter-node": 46.0}
KERNEL_LAUNCH_S = 5e-6  # a CUDA kernel's launch, on the host, and the least a kernel costs on the device


class Machine:
    """overlaps: collectives run beside compute on a GPU's streams, while the host issues the operations
    ahead of the device (issue_seconds); on a CPU the operations run as they are issued, in turn with the
    collectives. notes: what the costing could not see."""

    overlaps = True

    def __init__(self, name):
        self.name, self.notes, self.timed = name, [], {}

    def first_touch_seconds(self, size):
        """What writing `size` bytes the step has not held before adds: on a CPU, the pages the system maps
        and zeroes again every step; none on a GPU, whose caching allocator keeps its memory."""
        return 0.0 if self.overlaps else size * self.overheads[2]

    def issue_seconds(self, event):
        """The host's time to issue an event: dispatching it (as measured on this host) and, for an
        operation that computes, launching its kernel. 0 where the device runs what the host issues."""
        if not self.overlaps:
            return 0.0
        return self.overheads[1] + (0.0 if event.free or event.collective else KERNEL_LAUNCH_S)

    @functools.cached_property
    def overheads(self):
        """(framework, dispatch, first touch): an eager step's seconds per operation on this host, and per new
        byte (eager_overheads)."""
        return eager_overheads()

    def seconds(self, event):
        """(seconds, how they were found) of one event on this machine. On a CPU, which runs what it issues,
        with the time an eager step spends on the event beyond its kernel: Python, modules, autograd and the
        dispatcher, this host's per operation times the model's own scale (Event.host_scale), less the
        dispatch a timed operation already holds; none for what only fake tensors dispatch."""
        seconds, how = self.cost(event)
        if self.overlaps or event.name in FAKE_ONLY:
            return seconds, how
        framework, dispatch, _ = self.overheads
        return seconds + framework * event.host_scale - (dispatch if how.startswith("timed") else 0.0), how

    def cost(self, event):
        if event.collective:
            return self.collective_seconds(*event.collective)
        if event.free:
            return 0.0, "free (a view or an allocation)"
        if event.key in self.timed:
            return self.timed[event.key], "timed"
        return self.roofline(event), "roofline"

    def roofline(self, event):
        raise NotImplementedError

    def collective_seconds(self, kind, size, group, nodes):
        raise NotImplementedError


class Datasheet(Machine):
    """A GPU known only by its datasheet: each operation the longer of its FLOPs at the achievable matmul rate
    and its bytes at the achievable memory bandwidth; collectives at ASSUMED_BUSBW_GBPS."""

    def __init__(self, gpu):
        super().__init__(f"the datasheet of {gpu}")
        sheet = datasheet(gpu)
        self.flops_per_s = {torch.bfloat16: sheet["bf16"], torch.float16: sheet["bf16"],
                            torch.float32: sheet["tf32"] or sheet["fp32"]}  # fmt: skip
        self.flops_per_s = {dtype: rate * 1e12 * MAMF_OF_PEAK for dtype, rate in self.flops_per_s.items()}
        self.bytes_per_s = sheet["memory_GBps"] * 1e9 * COPY_OF_PEAK
        self.notes.append(f"costed from {self.name}, not measured: no benchmark report matches this GPU")

    def roofline(self, event):
        dtype = next(
            (meta.dtype for meta in tensors_of(event) if meta.dtype.is_floating_point), torch.float32
        )
        compute = event.flops / self.flops_per_s.get(dtype, self.flops_per_s[torch.float32])
        return max(compute, event.bytes / self.bytes_per_s, KERNEL_LAUNCH_S)

    def collective_seconds(self, kind, size, group, nodes):
        if group <= 1:
            return 0.0, "a group of one"
        busbw = ASSUMED_BUSBW_GBPS["inter-node" if nodes > 1 else "intra-node"] * 1e9
        return size * BUSBW_FACTORS[SWEEP_NAMES[kind]](group) / busbw, "assumed busbw"


class Report(Datasheet):
    """A cluster's benchmark report: its own timings of this model's operations and collectives where it has
    them (benchmark.py --train_args), else its figures: the GPUs' bf16 matmul rate and memory copy, each
    collective's busbw at the message size, inside a node and between nodes; a CPU report's matmul and
    memory figures. path: the report's YAML file, report: its content."""

    def __init__(self, path, report):
        Machine.__init__(self, f"benchmark report {path}")
        self.report, self.device = report, report["world"]["device"]
        model = report.get("model") or {}
        gpus = [g for g in (report.get("gpu") or {}).values() if isinstance(g, dict) and "name" in g]
        self.overlaps = bool(gpus)
        # The ranks time each operation at once, sharing their host's cores as they will train; where they
        # outnumber the cores (a test cluster runs its nodes on one host), training takes whole turns.
        processes, cores = busiest_host(report)
        shared = 1.0 if gpus or not cores else shares_of_cores(processes, cores) / max(1.0, processes / cores)
        self.timed = {key: row["seconds"] * shared for key, row in (model.get("operations") or {}).items()}
        measured = model.get("eager_overheads_s")  # on the nodes, by every rank; all three, or this host's
        self.measured_overheads = (
            tuple(s * shared for s in measured) if measured and len(measured) == 3 else None
        )
        self.measured_collectives = {(c["kind"], c["bytes"], c["group"], c["nodes"]): c["seconds"]
                                     for c in model.get("collectives") or []}  # fmt: skip
        if gpus:
            rate, copy = least(gpus, "matmul_bf16_TFLOPS", 1e12), least(gpus, "copy_GB/s", 1e9)
            half = rate / 2 if rate else None
            self.flops_per_s = {torch.bfloat16: rate, torch.float16: rate, torch.float32: half}
        else:  # a CPU: every core's matmul, and the memory copy of all cores, shared by the node's ranks
            per_node = report["world"]["ranks_per_node"]
            rate = least(node_figures(report, "cpu"), "matmul_fp32_GFLOPS", 1e9 / per_node)
            copy = least(node_figures(report, "memory"), "copy_all_cores_GB/s", 1e9 / per_node)
            self.flops_per_s = {torch.float32: rate, torch.bfloat16: rate, torch.float16: rate}
        self.bytes_per_s = copy
        if not (rate and copy):
            sections = "gpu" if gpus else "cpu and memory"
            self.notes.append(f"operations the report has not timed, for want of its {sections} figures")

    @functools.cached_property
    def overheads(self):
        return self.measured_overheads or eager_overheads()

    def roofline(self, event):
        if not (self.flops_per_s[torch.float32] and self.bytes_per_s):
            return 0.0
        return super().roofline(event)

    def collective_seconds(self, kind, size, group, nodes):
        if group <= 1:
            return 0.0, "a group of one"
        if (kind, size, group, nodes) in self.measured_collectives:
            return self.measured_collectives[(kind, size, group, nodes)], "timed"
        sweep = self.sweep(kind, group, nodes)
        if sweep is None:
            return Datasheet.collective_seconds(self, kind, size, group, nodes)[0], "assumed busbw"
        sizes = [row["size_bytes"] for row in sweep]
        busbws = [row["busbw_GB/s"] * 1e9 for row in sweep]
        at = min(max(bisect.bisect_left(sizes, size), 1), len(sizes) - 1)
        # busbw between the two measured sizes around it, linear in the size; beyond the sweep, its last
        low, high = sizes[at - 1], sizes[at]
        weight = min(max((size - low) / (high - low), 0.0), 1.0)
        busbw = busbws[at - 1] + weight * (busbws[at] - busbws[at - 1])
        if size < sizes[0]:  # below the sweep a collective costs what its smallest did: its latency
            return sweep[0]["time_us"] / 1e6, "report's busbw"
        return size * BUSBW_FACTORS[SWEEP_NAMES[kind]](group) / busbw, "report's busbw"

    def sweep(self, kind, group, nodes):
        """The report's rows for a collective of this group: between nodes, the one-rank-per-node sweep for a
        group of one rank a node, else the all-ranks one; inside a node, a node's own sweep."""
        name, nccl, links = SWEEP_NAMES[kind], self.report.get("nccl") or {}, self.report.get("links") or {}
        if nodes > 1 and group == nodes and isinstance(links.get("one_rank_per_node"), dict):
            rows = links["one_rank_per_node"].get(name)
        elif nodes > 1 or not nccl.get("intra_node"):
            rows = nccl.get(name)
        else:
            rows = next(iter(nccl["intra_node"].values())).get(name)
        return rows if isinstance(rows, list) and rows else None


class ThisDevice(Machine):
    """The device this process runs on, as a run of `processes` processes on this machine uses it: each
    distinct operation timed there the first time it is costed. On a CPU each process gets its share of the
    cores (torchrun gives each of several processes one thread), and more processes than cores share them;
    collectives, where a report of this machine is given, at its figures, else not costed (and said so)."""

    def __init__(self, device, processes, report=None):
        super().__init__(f"this machine's {'GPU' if device.type == 'cuda' else 'CPU'}, timed now")
        self.device, self.report, cores = device, report, os.cpu_count() or 1
        self.overlaps = device.type == "cuda"
        self.threads = max(1, cores // processes)
        self.shared = 1.0 if self.overlaps else shares_of_cores(processes, cores)

    @functools.cached_property
    def overheads(self):
        if self.report is not None and self.report.measured_overheads:
            return self.report.measured_overheads
        with self.rank_threads():  # a first touch is faster on more threads
            return tuple(seconds * self.shared for seconds in eager_overheads())

    @contextlib.contextmanager
    def rank_threads(self):
        """Torch's threads set to a rank's share of the cores while the block runs."""
        threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def cost(self, event):
        if self.report is not None and event.key in self.report.timed:  # timed on every rank, shared
            return self.report.timed[event.key], "timed by the benchmark"
        if not (event.collective or event.free) and event.key not in self.timed:
            with self.rank_threads():
                seconds = time_operation(event.name, event.args, event.kwargs, self.device)
            self.timed[event.key] = seconds * self.shared if seconds is not None else None
        if event.key in self.timed and self.timed[event.key] is None:
            return self.roofline(event), "roofline"
        return super().cost(event)

    def roofline(self, event):
        """An operation that cannot be replayed alone (one of FSDP's copies, small beside the rest): its bytes
        at the speed of a large copy on this device."""
        if self.report is not None:
            return self.report.roofline(event)
        return event.bytes / self.copy_bytes_per_s

    @functools.cached_property
    def copy_bytes_per_s(self):
        elements = 1 << 25  # 64 MB of bf16 each way: past the caches
        vector = TensorMeta((elements,), (1,), torch.bfloat16)
        seconds = time_operation("aten.copy_.default", (vector, vector), {}, self.device)
        return 2 * vector.bytes / seconds

    def collective_seconds(self, kind, size, group, nodes):
        if group <= 1:
            return 0.0, "a group of one"
        if self.report is None:
            note = "collectives, for want of a benchmark report of this machine (--benchmark_report)"
            if note not in self.notes:
                self.notes.append(note)
            return 0.0, "not costed"
        return self.report.collective_seconds(kind, size, group, nodes)


def node_figures(report, section):
    """Each node's figures of a report's section; none where the section was skipped."""
    figures = report.get(section) or {}
    return [value for key, value in figures.items() if key != "aggregate" and isinstance(value, dict)]


def least(members, key, scale):
    """The least of the members' figure, times scale; None where no member has it."""
    values = [member[key] for member in members if isinstance(member.get(key), (int, float))]
    return min(values) * scale if values else None


def tensors_of(event):
    return [leaf for leaf in tree_leaves((event.args, event.kwargs)) if isinstance(leaf, TensorMeta)]


def machine_for(args, world_size):
    """The machine the dry run predicts for: --benchmark_report, else the newest report under --log_dir of
    the target (--gpu=cpu: this machine's CPU; else a report whose GPUs are --gpu's), else this CPU timed now
    or --gpu's datasheet."""
    ranks_per_node = min(args.gpus_per_node, world_size)
    path = args.benchmark_report or newest_report(args.log_dir, args.gpu)
    report = Report(path, read_report(path)) if path else None
    if args.gpu == "cpu":
        return ThisDevice(torch.device("cpu"), processes_here(report, ranks_per_node), report)
    return report or Datasheet(args.gpu)


def busiest_host(report):
    """(processes, cores) of a CPU cluster's busiest host: cores None where the report does not say."""
    nodes = [node.get("hostname") for node in (report.get("nodes") or {}).values() if isinstance(node, dict)]
    per_host = max((nodes.count(host) for host in nodes), default=1) * report["world"]["ranks_per_node"]
    return per_host, least(node_figures(report, "cpu"), "cores", 1)


def shares_of_cores(processes, cores):
    """How much longer a stretch of work takes when processes share cores: ranks meet at every collective,
    and the cores run the stretches between in turns, each rank's whole (it runs until it waits), so three
    ranks on two cores take two turns, not one and a half."""
    return float(-(-processes // cores))


def processes_here(report, ranks_per_node):
    """The training processes sharing this machine: those a report of it places on this host (a test cluster
    runs its nodes on one), else a node's."""
    import socket

    if report is None:
        return ranks_per_node
    nodes = report.report.get("nodes") or {}
    hosts = [node.get("hostname") for node in nodes.values() if isinstance(node, dict)]
    return (
        max(1, hosts.count(socket.gethostname()) * report.report["world"]["ranks_per_node"])
        if hosts
        else ranks_per_node
    )
