"""The dry run: train.py's own training step on fake tensors over a fake process group at the target world
size, so that a CPU answers "does it fit?" with the real model, wrapping and step; FLOPs per token; and the
nearest change that fits when it does not."""

import contextlib
import copy
import dataclasses
import itertools
import logging
import os
import statistics
import sys
import time
import types
from collections.abc import Callable

import torch
import torch.distributed as dist

from common.datasheet import datasheet
from common.node import available_memory_bytes
from common.op_timing import OperationCount, framework_seconds
from run import live_prediction
from run.curves import duration
from run.launch import device_mesh
from run.live_prediction import LivePrediction
from run.machines import Report, ThisDevice, machine_for, processes_here, read_report
from run.options import gpu_memory_gb, launched_world_size
from run.plan import fastest, has_auto, plan, print_plan
from run.predict import StepRecorder, phases, play, with_accumulation, with_ddp_all_reduce
from run.progress import describe_model
from run.stops import StopRequests


@dataclasses.dataclass
class TrainingPath:
    """What the dry run simulates, as train.py hands it over: its own model, optimizer and step."""

    build_model: Callable  # (model_config, args, device, mesh) -> the model wrapped for training
    build_optimizer: Callable  # (model, args, fused) -> the optimizer
    train_step: Callable  # (model, batches, optimizer, accumulation, grad_clip, stop_requests) -> ...
    decoder_layers: Callable  # model -> its decoder layers
    flops_per_token: Callable  # (model, model_config, seq_length) -> 6·N + 12·L·H·Q·T


# The tracker's categories, in the words of the dry run's report.
MEMORY_CATEGORIES = {
    "sharded parameters": ("Sharded Param", "Parameter", "Buffer"),
    "gathered parameters": ("Unsharded Param", "All Gather"),
    "gradients": ("Sharded Grad", "Unsharded Grad", "Reduce Scatter", "Gradient"),
    "optimizer state": ("OptState", "Optstate"),
    "activations": ("Activation", "Inputs"),
    "temporaries": ("Temp", "Other"),
}

OFFLOADED = ("sharded parameters", "gradients", "optimizer state")

# The miniature whose step gives the model's own host time per operation (host_scale).
MINIATURE_HEAD_DIM, MINIATURE_VOCAB, MINIATURE_TOKENS, MINIATURE_STEPS = 8, 64, (1, 16), 5

DDP_ESTIMATE = (
    "estimated for DDP: FSDP simulated at world size 1 (every rank holds the whole model, as DDP does), plus "
    "DDP's gradient buckets, 4 bytes a parameter"
)

OFFLOAD_ESTIMATE = (
    "estimated for cpu_offload: the simulation without offloading, less the sharded parameters, gradients "
    "and optimizer state, which offloading keeps in host memory"
)

PREDICTION_BLIND_SPOTS = (
    "compiled blocks fuse what eager runs as several operations (a compiled step is faster than predicted); "
    "the first step's compilation; data loading; collectives of several streams sharing links"
)

SIMULATION_BLIND_SPOTS = (
    "allocator fragmentation, NCCL buffers and the CUDA context (leave a few GB); CPU SDPA stands in "
    "for flash attention (both keep the same tensors); blocks run eager, where compiled ones keep "
    "no more"
)


def simulate_step(args, model_config, world_size, training, ranks_per_node, fused, accumulation):
    """One optimizer step, the second of two (the first allocates the optimizer state, and fake DTensors
    allocate extra once), on fake tensors: peak bytes per GPU by category, and the step's events as one rank
    runs them (run/predict.py). accumulation: the run's micro-steps a step, of which two stand for any more:
    with gradients reduce-scattered every micro-step, the third looks like the second. ranks_per_node: to
    tell collectives inside a node from those between nodes, and a hybrid mesh's shard group where
    --shard_group_size leaves it to a node's ranks; fused: AdamW's fused kernels (a GPU's) or its foreach
    ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    simulated = copy.copy(args)
    simulated.cpu_offload = False  # see report_dry_run: offloading is subtracted, not simulated
    simulated.compile = False  # inductor does not run on fake tensors; eager keeps at least what it keeps
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        mesh = device_mesh(simulated, "cpu", world_size, ranks_per_node)
        with FakeTensorMode():
            device = torch.device("cpu")
            model = training.build_model(model_config, simulated, device, mesh)
            optimizer = training.build_optimizer(model, args, fused=fused)
            tokens = torch.randint(0, model_config.vocab_size, (args.batch_size, args.seq_length))
            batches = itertools.repeat((tokens, tokens))
            training.train_step(model, batches, optimizer, 1, args.grad_clip, StopRequests())
            tracker, recorder = FSDPMemTracker(model, optimizer), StepRecorder(ranks_per_node)
            recorder.watch_layers(training.decoder_layers(model))
            with tracker, recorder:
                # The tracker takes a second forward of the root for a second iteration; a micro-step is not.
                hook = model.register_forward_pre_hook(lambda *_: tracker.reset_mod_stats(), prepend=True)
                training.train_step(model, batches, optimizer, accumulation, args.grad_clip, StopRequests())
                hook.remove()
            snapshot = tracker.get_tracker_snapshot("peak")
    finally:
        dist.destroy_process_group()
    by_kind = {
        getattr(kind, "value", kind): size
        for device_snapshot in snapshot.values()
        for kind, size in device_snapshot.items()
    }
    memory = {name: sum(by_kind.get(kind, 0) for kind in kinds) for name, kinds in MEMORY_CATEGORIES.items()}
    return memory, phases(recorder.events)


def host_scale(args, model_config, training, accumulation):
    """How much more host time this model's step spends on each operation it dispatches than the small model
    of framework_seconds: Python, its modules' code, FSDP's or DDP's hooks, checkpointing's recomputation.
    Found by stepping a miniature of the model (miniature()), built, wrapped and stepped as training does
    it, on a one-rank group. Where a CPU runs what it issues, each operation is charged the host's time per
    operation times this (run/machines.py)."""
    from torch.nn.parallel import DistributedDataParallel

    mini, options = miniature(model_config), copy.copy(args)
    # One rank has no mesh of two dimensions: hybrid's hooks are full's.
    options.sharding = "full" if args.sharding == "hybrid" else args.sharding
    options.cpu_offload, options.compile, options.batch_size = False, False, MINIATURE_TOKENS[0]
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        model = training.build_model(mini, options, torch.device("cpu"), device_mesh(options, "cpu", 1, 1))
        with torch.no_grad():  # weights of the scale of training's: finite gradients, the optimizer steps
            for parameter in model.parameters():
                getattr(parameter, "_local_tensor", parameter).normal_(0.0, 0.02)
        model = DistributedDataParallel(model) if options.sharding == "ddp" else model
        optimizer = training.build_optimizer(model, options, fused=False)
        tokens = torch.randint(0, mini.vocab_size, MINIATURE_TOKENS)
        batches = itertools.repeat((tokens, tokens))

        def step():
            training.train_step(model, batches, optimizer, accumulation, args.grad_clip, StopRequests())

        step()
        with OperationCount() as count:
            step()
        seconds = []
        for _ in range(MINIATURE_STEPS):
            started = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - started)
    finally:
        dist.destroy_process_group()
    return statistics.median(seconds) / count.calls / framework_seconds()


def miniature(model_config):
    """The model at its depth, with its code and its heads, its widths cut to MINIATURE_HEAD_DIM a head: its
    kernels cost next to nothing beside the host's work of issuing them."""
    mini = copy.deepcopy(model_config)
    mini.hidden_size = model_config.num_attention_heads * MINIATURE_HEAD_DIM
    if getattr(mini, "head_dim", None):
        mini.head_dim = MINIATURE_HEAD_DIM
    for name in ("intermediate_size", "n_inner"):
        if getattr(mini, name, None):
            setattr(mini, name, 4 * MINIATURE_HEAD_DIM)
    mini.vocab_size = MINIATURE_VOCAB
    return mini


def simulate(args, model_config, world_size, n_params, training, ranks_per_node=None, fused=None):
    """Peak per GPU in GB by category, and the step's events (run/predict.py), for the dry run's target (a GPU
    of --gpus_per_node a node, with fused AdamW; or --gpu=cpu) unless ranks_per_node and fused say. DDP's
    replicas cannot be faked (DDP reads its parameters' data), and CPU tensors on a CPU cannot be told apart
    from GPU ones: both are estimated from a simulation (see DDP_ESTIMATE and OFFLOAD_ESTIMATE)."""
    ranks_per_node = ranks_per_node or min(args.gpus_per_node, world_size)
    fused = args.gpu != "cpu" if fused is None else fused
    accumulation = min(2, args.global_batch_size // (args.batch_size * world_size))
    if args.sharding == "ddp":
        as_full = types.SimpleNamespace(**dict(vars(args), sharding="full"))
        memory, events = simulate_step(as_full, model_config, 1, training, 1, fused, accumulation)
        memory["gradients"] += 4 * n_params
        if world_size > 1:
            nodes = max(1, world_size // ranks_per_node)
            events = with_ddp_all_reduce(events, 4 * n_params, world_size, nodes)
        # Measured, a DDP step on a CPU keeps its memory from step to step, where an FSDP one, which frees
        # and takes back its gathered parameters, maps its activations anew (run/machines.py): gpt2 cut to
        # 4 layers on 2 processes was predicted 17% slow with the first touch, 5% without.
        for event in events:
            event.allocates = ()
    else:
        memory, events = simulate_step(
            args, model_config, world_size, training, ranks_per_node, fused, accumulation
        )
    if not fused:  # a CPU, which runs what it issues: the host's time counts (run/machines.py)
        scale = host_scale(args, model_config, training, accumulation)
        for event in events:
            event.host_scale = scale
    if args.cpu_offload:
        memory.update({name: 0 for name in OFFLOADED})
    return {name: size / 1e9 for name, size in memory.items()}, events


def hardware_flops_per_token(args, layer, model_config, model_flops):
    """What the GPU computes per token, recomputation included. model_flops (6·N + 12·L·H·Q·T) is three
    forwards' worth; of one forward, the output layer is 2·vocab·width and attention 4·L·H·Q·T. The loss
    recomputes nothing (run/loss.py); full checkpointing every block's forward, selective every
    ac_every-th block's, op-level every other matmul (attention outputs are kept). A recomputation stops
    at the last tensor backward needs, so a block's last matmul, the MLP's output projection, is not
    redone."""
    layers = model_config.num_hidden_layers
    output_forward = 2 * model_config.vocab_size * model_config.hidden_size
    attention_forward = 4 * layers * model_config.hidden_size * args.seq_length
    active = getattr(model_config, "num_experts_per_tok", 1) / getattr(model_config, "num_local_experts", 1)
    name, last = [(n, p) for n, p in layer.named_parameters() if p.ndim >= 2][-1]
    last_matmul = 2 * layers * last.numel() * (active if "experts" in name else 1)
    redone_forward = model_flops / 3 - output_forward - last_matmul
    recomputed = {
        "none": 0,
        "full": redone_forward,
        "selective": redone_forward * (layers // args.ac_every) / layers,
        "op": (redone_forward - attention_forward) / 2,
    }[args.activation_checkpointing]
    return model_flops + recomputed


def changes_that_might_fit(args):
    """The changes to try, least costly first: full activation checkpointing, then smaller micro-batches
    with more accumulation (the same global batch), then offloading the model state to host memory."""
    change = {} if args.activation_checkpointing == "full" else {"activation_checkpointing": "full"}
    if change:
        yield dict(change)
    batch = args.batch_size
    while batch > 1:
        batch //= 2
        change["batch_size"] = batch
        yield dict(change)
    if args.sharding != "ddp" and not args.cpu_offload:
        yield dict(change, cpu_offload=True)


def report_dry_run(args, shape, model_config, meta_model, training):
    """Prints the config, the model, the simulated peak memory per GPU, FLOPs per token and a verdict.
    Exit status: 0 fits, 1 does not fit, 2 bad input."""
    gpu_name, gpu_gb = gpu_memory_gb(args.gpu)
    world_size = launched_world_size(args)
    n_params = describe_model(args, shape, model_config, meta_model)
    if args.plan or has_auto(args):
        started, machine = time.perf_counter(), machine_for(args, world_size)
        rows = plan(args, model_config, world_size, n_params, training, machine, gpu_gb, simulate)
        if args.plan:
            return print_plan(rows, args, world_size, machine, gpu_gb, started)
        vars(args).update(fastest(rows))
        print(f"chose: --sharding={args.sharding} --activation_checkpointing={args.activation_checkpointing} "
              f"--batch_size={args.batch_size} (the fastest that fits)")  # fmt: skip
    model_flops = training.flops_per_token(meta_model, model_config, args.seq_length)
    layer = training.decoder_layers(meta_model)[0]
    hardware_flops = hardware_flops_per_token(args, layer, model_config, model_flops)
    print(
        f"FLOPs per token: {model_flops / 1e9:.4g} G for MFU (6·N + 12·L·H·Q·T), {hardware_flops / 1e9:.4g} "
        f"G computed with recomputation: at most {model_flops / hardware_flops:.0%} MFU"
    )
    started = time.perf_counter()
    memory, events = simulate(args, model_config, world_size, n_params, training)
    total = sum(memory.values())
    print(
        f"simulated one training step on fake tensors: world size {world_size}, sharding={args.sharding}, "
        f"{args.mixed_precision}, activation_checkpointing={args.activation_checkpointing}, "
        f"batch {args.batch_size} x {args.seq_length} ({time.perf_counter() - started:.0f} s)"
    )
    for name, gb in memory.items():
        print(f"  {name:<22} {gb:9.3f} GB")
    if args.sharding == "ddp":
        print(f"  {DDP_ESTIMATE}")
    if args.cpu_offload:
        print(f"  {OFFLOAD_ESTIMATE}")
    print(f"not simulated: {SIMULATION_BLIND_SPOTS}")
    target = f"{gpu_gb:g} GB ({gpu_name})" if gpu_name else f"{gpu_gb:g} GB"
    print(f"peak memory per GPU (simulated): {total:.1f} GB of {target}")
    if total <= gpu_gb:
        print(f"verdict: fits, {gpu_gb - total:.1f} GB to spare")
        report_prediction(args, events, world_size, model_flops)
        return 0
    for change in changes_that_might_fit(args):
        candidate = types.SimpleNamespace(**{**vars(args), **change})
        peak = sum(simulate(candidate, model_config, world_size, n_params, training)[0].values())
        if peak <= gpu_gb:
            flags = " ".join(f"--{name}={value}" for name, value in change.items())
            print(f"verdict: does not fit; fits with {flags} (simulated {peak:.2f} GB)")
            return 1
    tried = "full activation checkpointing, batch_size 1, cpu_offload"
    print(f"verdict: does not fit, and no change tried fits ({tried}): use more GPUs or a smaller model")
    return 1


def report_prediction(args, events, world_size, model_flops):
    """The dry run's prediction of the step (run/predict.py) on the machine the options name."""
    accumulation = args.global_batch_size // (args.batch_size * world_size)
    events = with_accumulation(events, min(2, accumulation), accumulation)
    started = time.perf_counter()
    machine = machine_for(args, world_size)
    peak = datasheet(args.gpu) if args.gpu != "cpu" else None
    prediction = play(events, machine)
    where = f"on {machine.name}, {time.perf_counter() - started:.0f} s"
    return print_prediction(args, prediction, where, world_size, model_flops, peak)


def print_prediction(args, prediction, where, world_size, model_flops, peak):
    """The predicted step and its parts, tokens/s per device, MFU over the datasheet peak, the time to
    --max_steps, and what the prediction cannot see."""
    print(f"{prediction.line()} ({where})")
    tokens = args.global_batch_size * args.seq_length / world_size / prediction.step_s
    mfu = f", MFU {model_flops * tokens / (peak['bf16'] * 1e12):.1%}" if peak and peak.get("bf16") else ""
    steps = f"; {args.max_steps} steps in {duration(args.max_steps * prediction.step_s)}"
    print(f"predicted: {tokens:,.0f} tokens/s per device{mfu}{steps if args.max_steps > 0 else ''}")
    for note in [*prediction.notes, PREDICTION_BLIND_SPOTS]:
        print(f"not predicted: {note}")
    return prediction


@dataclasses.dataclass
class OwnStep:
    """Rank 0's step, to predict before training: its events, traced now, or the prediction that an earlier
    launch of the run made on the same kind of machine (run/live_prediction.py), with when it was made."""

    machine: dict
    log_folder: str | None
    events: list | None = None
    kept: tuple | None = None


def trace_own_step(args, model_config, n_params, training, world_size, ranks_per_node, on_gpu, log_folder):
    """This run's own step, traced on fake tensors before its process group exists (rank 0's, to hold the
    live step against), with its accumulation, or kept by an earlier launch in log_folder: an OwnStep; None,
    with a warning, where it cannot be traced."""
    machine = live_prediction.machine_here(world_size, ranks_per_node, args.benchmark_report)
    kept = live_prediction.kept(log_folder, machine) if log_folder else None
    if kept:
        return OwnStep(machine, log_folder, kept=kept)
    accumulation = args.global_batch_size // (args.batch_size * world_size)
    with advisory():
        _, events = simulate(args, model_config, world_size, n_params, training, ranks_per_node, fused=on_gpu)
        events = with_accumulation(events, min(2, accumulation), accumulation)
        return OwnStep(machine, log_folder, events=events)
    return None


def predict_own_step(args, own_step, device, world_size, model_flops):
    """This run's step on its own device, each distinct operation timed there now, and collectives at the
    figures of the job's benchmark report ($BENCHMARK_REPORT, or --benchmark_report), or as an earlier launch
    of the run predicted it: a LivePrediction, kept in the run's log folder."""
    started = time.perf_counter()
    with advisory():
        peak = datasheet(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        if own_step.kept:
            prediction, made = own_step.kept
            where = f"kept in the run's log folder by its launch of {made}"
        else:
            path = os.environ.get("BENCHMARK_REPORT") or args.benchmark_report
            report = Report(path, read_report(path)) if path else None
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            machine = ThisDevice(device, processes_here(report, local), report)
            prediction = play(own_step.events, machine)
            where = f"on {machine.name}, {time.perf_counter() - started:.0f} s"
        print_prediction(args, prediction, where, world_size, model_flops, peak)
        if own_step.log_folder and not own_step.kept:
            live_prediction.keep(own_step.log_folder, prediction, own_step.machine)
        return LivePrediction(prediction, prediction.layer_forward_s)
    return None


@contextlib.contextmanager
def advisory():
    """A training run's prediction is advice: whatever stops it (an operation fake tensors cannot take, a
    report that is not one) is one warning, and training goes on without it. Fake tensors log the failure of
    an operation with its whole traceback; that is held back too."""
    fake_tensor_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_tensor_log.level
    fake_tensor_log.setLevel(logging.CRITICAL)
    try:
        yield
    except Exception as error:  # noqa: BLE001 - any failure of the prediction leaves the run as it was
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(f"warning: no prediction of this run's step ({first[:200]}); training goes on", file=sys.stderr,
              flush=True)  # fmt: skip
    finally:
        fake_tensor_log.setLevel(level)


def choose_on_this_device(args, model_config, n_params, training, rank_device):
    """For a training run's auto options, before its process group: the fastest candidate that fits this
    device's memory, each predicted with its operations timed on the device."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if rank_device.type == "cuda":
        memory_gb = torch.cuda.get_device_properties(rank_device).total_memory / 1e9
    else:
        memory_gb = available_memory_bytes() / 1e9 / processes
    targeted = types.SimpleNamespace(
        **dict(vars(args), gpus_per_node=processes, gpu="cpu" if rank_device.type == "cpu" else args.gpu)
    )
    machine = ThisDevice(rank_device, processes)
    rows = plan(targeted, model_config, world_size, n_params, training, machine, memory_gb, simulate)
    return fastest(rows)
