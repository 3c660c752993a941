"""The step measured where it will run: the run's own model, built and compiled as training builds it, stepped
on dummy batches with an optimizer of its own before training sets its weights, every rank at once. Nothing
is modelled: kernels, recomputation, FSDP, the collectives on the real links and the host's time are in the
step. More micro-steps than the probe's (at most five) add each what its middle ones cost on average (the
first takes the gradients' memory anew, the last reduces them under DDP and steps). A probe says how well it
measured: how far apart its timed steps lay (spread), and on a CPU how much of the cores others took."""

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
from torch.distributed.fsdp import FSDPModule

from common.stopwatch import Stopwatch
from run.health.stragglers import RankTimes
from run.launch import device_mesh
from run.model.build import build_model, init_weights
from run.model.presets import decoder_layers
from run.model.step import build_optimizer, model_loss, train_step
from run.stops import StopRequests

# A step of one micro-step first (it compiles and takes the optimizer's state), then timed steps of up to
# MICRO_STEPS micro-steps until they add up to BUDGET_S (at least two, at most MAX_TIMED; a third where two
# lie more than STEADY apart on any rank), their median counting: on a quiet 2-core machine steps varied by
# 10-30% one to the next, and two alone put gpt2's step 32% high in one run, 13% low in the next. The middle
# micro-steps' mean: four probes of the tiny model gave 8.3-9.9 s a step from one micro-step, 8.8-9.7 s from
# three; its training steps took 8.6-9.3 s. A GPU's steps lie within a few percent of each other (gpt2-xl
# compiled on one H200: 0.349-0.364 s): there, 2-3 timed steps (GPU_BUDGET_S) predicted six runs within
# 3.6%, in every checkpointing mode, as 3 s of them had within 4.1%.
MICRO_STEPS, BUDGET_S, GPU_BUDGET_S, MAX_TIMED, STEADY = 5, 3.0, 0.5, 12, 0.05
# What a run's own probe may add to an eager run on a CPU: two timed steps of gpt2 (3 s each on the 2-core
# machines) and their warm-up added 11.6 s to a run of 8 steps (the median of three pairs of runs with
# --predict=True and False in turns); such a run's step is taken from its own first steps instead (live.py).
# One forward tells a probe that would take longer: a warm-up step to tell it added 4-5 s to gpt2's run; with
# the forward, such pairs of runs took 1.02x as long with the prediction as without (0.95-1.09).
LIMIT_S = 5.0


@dataclasses.dataclass
class Measured:
    """A probe's figures, each the median rank's median over the timed steps: the step at `accumulation`
    micro-steps, its middle micro-steps' mean (0 with fewer than three), its decoder layers' forward; the
    worst rank's spread; the busiest host's others (CPU only); the probe's wall time."""

    accumulation: int
    step_s: float
    micro_s: float
    layer_forward_s: float
    spread: float
    others: float
    seconds: float

    def step_at(self, accumulation):
        return self.step_s + (accumulation - self.accumulation) * self.micro_s

    def layer_forward_at(self, accumulation):
        return self.layer_forward_s / self.accumulation * accumulation


def measure(args, model, model_config, device, limit_s=None):
    """Steps model (built for training; its weights are set here, and must be set afresh after) on every rank
    of the process group at once: a Measured, the same on every rank; None where one forward says that the
    probe would take longer than limit_s seconds."""
    world_size = dist.get_world_size()
    accumulation = min(MICRO_STEPS, args.global_batch_size // (args.batch_size * world_size))
    started = time.perf_counter()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        inner = getattr(model, "module", model)
        init_weights(inner, model_config.initializer_range, model_config.num_hidden_layers, args.seed)
        if not within_limit(args, model, device, accumulation, limit_s):
            return None
        timings, used = timed_steps(args, model, model_config, device, accumulation)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (timings, (socket.gethostname(), *used)))
    medians = [[statistics.median(column) for column in zip(*rank)] for rank, _ in everyone]
    step_s, micro_s, layer_forward_s = (statistics.median(column) for column in zip(*medians))
    spread = max(spread_of([step for step, _, _ in rank]) for rank, _ in everyone)
    others = others_share([rank_usage for _, rank_usage in everyone]) if device.type == "cpu" else 0.0
    seconds = time.perf_counter() - started
    return Measured(accumulation, step_s, micro_s, layer_forward_s, spread, others, seconds)


def timed_steps(args, model, model_config, device, accumulation):
    """This rank's (step, middle micro-steps' mean, layer forward) seconds of each timed step, and its usage()
    over them. The optimizer and the gradients are freed before it returns."""
    optimizer = build_optimizer(model, args, fused=device.type == "cuda")
    generator, shape = torch.Generator().manual_seed(args.seed), (args.batch_size, args.seq_length)
    tokens = torch.randint(0, model_config.vocab_size, shape, generator=generator)
    batches = itertools.repeat((tokens.to(device), tokens.to(device)))
    layer_times = RankTimes(decoder_layers(model), device, args.compile)
    train_step(model, batches, optimizer, 1, args.grad_clip, StopRequests())
    before = usage()  # compiling's workers are done

    def timed():
        layer_times.read()
        watch = Stopwatch(device)
        hook = model.register_forward_pre_hook(lambda *_: watch.mark())  # each micro-step's start
        watch.mark()
        train_step(model, batches, optimizer, accumulation, args.grad_clip, StopRequests())
        watch.mark()
        hook.remove()
        gaps = watch.intervals()  # to the first micro-step, each micro-step, the last with the optimizer's
        middle = gaps[2:-1]
        return sum(gaps), sum(middle) / len(middle) if middle else 0.0, layer_times.read()[0]

    timings = []
    while more_steps([step for step, _, _ in timings], device):
        timings.append(timed())
    used = usage_since(before)
    layer_times.remove()
    optimizer = None  # its state freed before training's is taken
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return timings, used


def within_limit(args, model, device, accumulation, limit_s):
    """Whether the probe would end within limit_s on every rank (None: no limit), judged by one forward
    without gradients: a micro-step takes about three (its backward computes twice what the forward does),
    and the probe a warm-up micro-step and at least BUDGET_S of timed steps, two at the least."""
    if limit_s is None:
        return True
    tokens = torch.zeros(args.batch_size, args.seq_length, dtype=torch.long, device=device)
    started = time.perf_counter()
    with torch.no_grad():
        model_loss(model, tokens, tokens)
    micro_s = 3 * (time.perf_counter() - started)
    for module in model.modules():  # FSDP leaves the root's gathered after a forward without gradients: the
        if isinstance(module, FSDPModule):  # weights set after would not be the ones the next forward uses
            module.reshard()
    estimate = torch.tensor(micro_s + max(BUDGET_S, 2 * accumulation * micro_s), device=device)
    dist.all_reduce(estimate, op=dist.ReduceOp.MAX)
    return estimate.item() <= limit_s


def more_steps(steps, device):
    """Whether every rank takes another timed step: any rank that has not yet timed enough says so."""
    budget_s = GPU_BUDGET_S if device.type == "cuda" else BUDGET_S
    wanted = len(steps) < 2 or (sum(steps) < budget_s and len(steps) < MAX_TIMED)
    wanted = wanted or (len(steps) == 2 and spread_of(steps) > STEADY)
    flag = torch.tensor(float(wanted), device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def usage():
    """(this process's CPU seconds, its host's busy CPU seconds since boot (/proc/stat; None where unknown),
    wall seconds)."""
    try:
        with open("/proc/stat") as file:
            fields = [int(value) for value in file.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and waiting for I/O
        busy = (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        busy = None
    return sum(os.times()[:2]), busy, time.perf_counter()


def usage_since(before):
    """usage() since before, each figure's difference (None where unknown)."""
    return tuple(None if None in pair else pair[0] - pair[1] for pair in zip(usage(), before))


def others_share(everyone):
    """The largest share of a host's cores that work other than this run's ranks took while they were timed,
    from each rank's (host, *usage())."""
    per_host = {}  # host: (busy, wall, its ranks' CPU) seconds
    for host, cpu, busy, wall in everyone:
        if busy is not None:
            per_host[host] = (busy, wall, per_host.get(host, (0, 0, 0.0))[2] + cpu)
    cores = os.cpu_count() or 1
    return max(
        (max(0.0, busy - ranks) / (wall * cores) for busy, wall, ranks in per_host.values()), default=0.0
    )


def spread_of(seconds):
    """How far apart the timed steps lie: (slowest - fastest) / median, of five or more without their slowest
    and fastest (one step interrupted does not make a machine busy)."""
    kept = sorted(seconds)[1:-1] if len(seconds) >= 5 else seconds
    return (max(kept) - min(kept)) / statistics.median(seconds)


def build_and_measure(args, model_config, device, local_world_size):
    """Builds the run's model on the process group as training would and probes it; the model is freed."""
    mesh = device_mesh(args, device.type, dist.get_world_size(), local_world_size)
    found = measure(args, build_model(model_config, args, device, mesh), model_config, device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return found


def on_this_cpu(options, model_config, world_size):
    """A probe of world_size processes on this machine's CPU, as torchrun would start them: in this process
    for one, else in as many processes started here."""
    if world_size == 1:
        return probe_in(0, 1, dist.HashStore(), options, model_config)
    import torch.multiprocessing as mp

    results = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as folder:
        arguments = (world_size, os.path.join(folder, "store"), options, model_config, results)
        mp.start_processes(probe_in, arguments, world_size, start_method="spawn")
    return Measured(**results.get())


def probe_in(rank, world_size, store, options, model_config, results=None):
    """One rank's probe; a process of several started here takes one thread, as torchrun starts it, and its
    store is a file's path; the first puts its Measured in results."""
    if results is not None:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
        store = dist.FileStore(store, world_size)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, store=store)
    try:
        found = build_and_measure(copy.copy(options), model_config, torch.device("cpu"), world_size)
    finally:
        dist.destroy_process_group()
    if results is not None and rank == 0:
        results.put(dataclasses.asdict(found))
    return found


def benchmark_section(args, model_config, naming, device, local_world_size):
    """benchmark.py --train_args's model section: the run's configuration probed on the cluster as it will
    train, every rank at once, with the options that name the run, for a dry run to match."""
    found = build_and_measure(args, model_config, device, local_world_size)
    return {"options": naming, "world_size": dist.get_world_size(), "measured": dataclasses.asdict(found)}
