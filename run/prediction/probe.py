"""The step measured where it will run: copies of the model one and two decoder layers deep (or the model
itself, when it has two or fewer), built, wrapped, compiled and stepped exactly as training builds and steps
it, on the run's own process group and devices, at its micro-batch, with its threads, on every rank at once.
Every decoder layer is the same, so the step of L layers is the one-layer step plus L - 1 times what the
second layer added; and every micro-step past the probe's costs what its middle one cost. What the copies
measure holds everything a step does: kernels as compiled, recomputation, FSDP's copies and hooks, the
collectives at their real sizes on the real links, the optimizer, the host's own time. Nothing is modelled
but that linearity.

A probe says how well it measured: how much its timed steps varied (spread), and on a CPU how much of the
machine's cores other work used meanwhile. A prediction is kept for later launches only if both were low."""

import copy
import dataclasses
import gc
import itertools
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from run.health.stragglers import RankTimes
from run.launch import device_mesh
from run.model.build import build_model, init_or_load
from run.model.presets import decoder_layers
from run.model.step import build_optimizer, train_step
from run.stops import StopRequests

# Steps of each copy: the first compiles and allocates the optimizer's state, the second still finds the
# allocator settling (measured on a CPU: 5-15% slower than the third); then the median of the timed ones.
WARMUP_STEPS, TIMED_STEPS = 2, 3


@dataclasses.dataclass
class Copy:
    """One copy of the model, depth layers deep, stepped at accumulation micro-steps: median seconds of its
    step, of a micro-step between its first and its last (0 with fewer than three), of its decoder layers'
    forward, and its spread."""

    depth: int
    step_s: float
    micro_s: float
    layer_forward_s: float
    spread: float


@dataclasses.dataclass
class Measured:
    """A probe's figures: the copies, the micro-steps each step took (accumulation), the share of the busiest
    host's cores that other work used while it ran (others, CPU only), and its wall time."""

    layers: int
    accumulation: int
    copies: list
    others: float
    seconds: float

    def fitted(self, field, accumulation):
        """field (step_s or layer_forward_s) of the whole model at `accumulation` micro-steps."""
        one = self.copies[0]
        value, micro = getattr(one, field), one.micro_s
        if len(self.copies) == 2:  # depths 1 and 2: each layer past the first adds what the second did
            two = self.copies[1]
            value += (self.layers - 1) * max(0.0, getattr(two, field) - getattr(one, field))
            micro += (self.layers - 1) * max(0.0, two.micro_s - one.micro_s)
        if field == "layer_forward_s":
            return value / self.accumulation * accumulation
        return value + (accumulation - self.accumulation) * micro

    @property
    def spread(self):
        return max(copy.spread for copy in self.copies)

    @staticmethod
    def from_dict(record):
        return Measured(**{**record, "copies": [Copy(**copy) for copy in record["copies"]]})


def at_depth(model_config, depth):
    shallow = copy.deepcopy(model_config)
    shallow.num_hidden_layers = depth
    return shallow


def mark(device):
    """A point in time on the device: a CUDA event on its stream, or the host's clock."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def between(start, end):
    return start.elapsed_time(end) / 1e3 if isinstance(start, torch.cuda.Event) else end - start


def step_copy(args, model_config, mesh, device, accumulation):
    """This rank's (step seconds, middle micro-step seconds, layer forward seconds) of each timed step of one
    copy, and (its CPU seconds, its host's busy seconds, wall seconds) over them; the copy is freed before it
    returns."""
    options = copy.copy(args)
    options.init_from = None  # a copy is initialised, never loaded: its weights' values do not matter
    model = init_or_load(build_model(model_config, options, device, mesh), model_config, options)
    optimizer = build_optimizer(model, args, fused=device.type == "cuda")
    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(
        0, model_config.vocab_size, (args.batch_size, args.seq_length), generator=generator
    )
    batches = itertools.repeat((tokens.to(device), tokens.to(device)))
    layer_times = RankTimes(decoder_layers(model), device, args.compile)
    micro_starts = []
    hook = model.register_forward_pre_hook(lambda *_: micro_starts.append(mark(device)))
    timings, usage = [], None
    for index in range(WARMUP_STEPS + TIMED_STEPS):
        if index == WARMUP_STEPS:  # compiling (its workers' time too) is over: others' use is measured now
            usage = (own_cpu_seconds(), host_busy_seconds(), time.perf_counter())
        micro_starts.clear()
        layer_times.read()
        start = mark(device)
        train_step(model, batches, optimizer, accumulation, args.grad_clip, StopRequests())
        end = mark(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        # a middle micro-step: not the first (which takes the gradients' memory anew), nor the last (which
        # reduces them under DDP, then clips and steps)
        micro = between(micro_starts[1], micro_starts[2]) if accumulation > 2 else 0.0
        if index >= WARMUP_STEPS:
            timings.append((between(start, end), micro, layer_times.read()[0]))
    cpu, busy, wall = own_cpu_seconds(), host_busy_seconds(), time.perf_counter()
    usage = (cpu - usage[0], None if busy is None else busy - usage[1], wall - usage[2])
    hook.remove()
    del model, optimizer, layer_times
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return timings, usage


def host_busy_seconds():
    """CPU seconds all of this host's cores have spent busy since boot (/proc/stat), None where unknown."""
    try:
        with open("/proc/stat") as file:
            fields = [int(value) for value in file.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and waiting for I/O
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds():
    times = os.times()
    return times.user + times.system


def others_share(everyone):
    """The largest share of a host's cores that work other than this run's ranks took while they were timed:
    everyone holds each rank's (host, its CPU seconds, the host's busy seconds, wall seconds)."""
    per_host = {}
    for host, cpu, busy, wall in everyone:
        if busy is not None:
            _, _, ranks = per_host.get(host, (busy, wall, 0.0))
            per_host[host] = (busy, wall, ranks + cpu)
    cores = os.cpu_count() or 1
    return max(
        (max(0.0, busy - ranks) / (wall * cores) for busy, wall, ranks in per_host.values()), default=0.0
    )


def measure(args, model_config, mesh, device):
    """The probe, on every rank of the process group at once: a Measured, the same on every rank."""
    world_size = dist.get_world_size()
    accumulation = min(3, args.global_batch_size // (args.batch_size * world_size))
    layers = model_config.num_hidden_layers
    depths = (layers,) if layers <= 2 else (1, 2)
    started = time.perf_counter()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        mine = [
            step_copy(args, at_depth(model_config, depth), mesh, device, accumulation) for depth in depths
        ]
    cpu, busy, wall = (sum(usage[part] for _, usage in mine) if all(u[part] is not None for _, u in mine)
                       else None for part in range(3))  # fmt: skip
    everyone = [None] * world_size
    dist.all_gather_object(
        everyone, ([timings for timings, _ in mine], (socket.gethostname(), cpu, busy, wall))
    )
    copies = []
    for index, depth in enumerate(depths):
        per_rank = [timings[index] for timings, _ in everyone]
        medians = [[statistics.median(column) for column in zip(*rank)] for rank in per_rank]
        spreads = [spread([step for step, _, _ in rank]) for rank in per_rank]
        step_s, micro, layer_forward = (statistics.median(column) for column in zip(*medians))
        copies.append(Copy(depth, step_s, micro, layer_forward, max(spreads)))
    others = others_share([rank_usage for _, rank_usage in everyone]) if device.type == "cpu" else 0.0
    return Measured(layers, accumulation, copies, others, time.perf_counter() - started)


def spread(seconds):
    """How far apart the timed steps lie: (slowest - fastest) / median."""
    return (max(seconds) - min(seconds)) / statistics.median(seconds)


def on_this_cpu(options, model_config, world_size):
    """A probe of world_size processes on this machine's CPU, as torchrun would start them (one thread each
    where there are several): in this process for one, else in as many processes started here."""
    if world_size == 1:
        return probe_in(0, 1, dist.HashStore(), options, model_config)
    import torch.multiprocessing as mp

    results = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        mp.start_processes(probe_process, (world_size, store, options, model_config, results), world_size,
                           start_method="spawn")  # fmt: skip
    return Measured.from_dict(results.get())


def probe_process(rank, world_size, store, options, model_config, results):
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    found = probe_in(rank, world_size, dist.FileStore(store, world_size), options, model_config)
    if rank == 0:
        results.put(dataclasses.asdict(found))


def probe_in(rank, world_size, store, options, model_config):
    dist.init_process_group("gloo", rank=rank, world_size=world_size, store=store)
    try:
        mesh = device_mesh(options, "cpu", world_size, world_size)
        return measure(options, model_config, mesh, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def benchmark_section(args, model_config, naming, device, local_world_size):
    """benchmark.py --train_args's model section: the run's configuration probed on the cluster as it will
    train, every rank at once, with the options that name the run, for a dry run to match."""
    world_size = dist.get_world_size()
    found = measure(args, model_config, device_mesh(args, device.type, world_size, local_world_size), device)
    return {"options": naming, "world_size": world_size, "measured": dataclasses.asdict(found)}
