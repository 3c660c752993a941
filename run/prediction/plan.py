"""The choice of how to run: each candidate (a sharding and shard-group size, activation checkpointing, a
micro-batch at the same global batch) simulated for its peak memory and, where it fits, predicted. --plan
lists those that fit, fastest first; --sharding, --activation_checkpointing and --batch_size=auto take the
fastest, which a training run probes on its own devices once: rank 0 keeps its choice (CHOSEN) for every
later launch with the same options on the same machine."""

import itertools
import json
import math
import os
import sys
import time
import types
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch
import torch.distributed as dist

from common.errors import ConfigError
from common.files import UnsafeFile, read_json, set_aside_damaged, write_atomically
from common.node import available_memory_bytes
from run.prediction import probe
from run.prediction.step_time import this_machine

AUTO = "auto"
CHOSEN = "plan.json"
CHECKPOINTING = ("none", "op", "selective", "full")
WIDTHS = (12, 14, 5, 9, 16, 8)  # the plan's columns
# What decides a choice of the auto options beside the machine: every option that changes a candidate's
# memory or time, the auto options included (those the user fixed narrow the candidates).
DECIDES = ("model", "init_from", "n_embd", "n_layer", "n_head", "n_positions", "vocab_size", "data",
           "tokenizer", "seq_length", "global_batch_size", "mixed_precision", "compile", "cpu_offload",
           "sharding", "shard_group_size", "activation_checkpointing", "ac_every", "batch_size")  # fmt: skip
# What auto sets for each option left to it
SETS = {"sharding": ("sharding", "shard_group_size"), "batch_size": ("batch_size",),
        "activation_checkpointing": ("activation_checkpointing",)}  # fmt: skip
FIELDS = (("for", dict), ("options", dict), ("made", str))  # a kept choice's, and their kinds
NONE_FITS = ("no candidate of --sharding/--activation_checkpointing/--batch_size=auto fits: use more GPUs "
             "or a smaller model (python train.py --plan lists them)")  # fmt: skip


def shardings(args, world_size, ranks_per_node):
    """(sharding, shard group size) to try: full, grad_op, ddp, and hybrid over each group size that divides
    the world and nests with a node (within one, or whole nodes), short of the whole world."""
    if args.sharding != AUTO:
        return [(args.sharding, args.shard_group_size)]
    sizes = [size for size in divisors(world_size) if 1 < size < world_size]
    hybrid = [("hybrid", size) for size in sizes if ranks_per_node % size == 0 or size % ranks_per_node == 0]
    return [("full", None), ("grad_op", None), ("ddp", None), *hybrid]


def divisors(number):
    """The divisors of number, smallest first, each pair found by its smaller member: square-root many steps,
    where trying every number below a world of a million processes takes a million."""
    small = [divisor for divisor in range(1, math.isqrt(number) + 1) if number % divisor == 0]
    return small + [number // divisor for divisor in reversed(small) if divisor * divisor != number]


def candidates(args, world_size, ranks_per_node):
    """Each candidate's change to args; a micro-batch left to auto is each power of two that divides a rank's
    share of the same global batch."""
    modes = CHECKPOINTING if args.activation_checkpointing == AUTO else [args.activation_checkpointing]
    batches = [args.batch_size]
    if args.batch_size == AUTO:
        per_rank = args.global_batch_size // world_size
        batches = [2**power for power in range(per_rank.bit_length()) if per_rank % 2**power == 0]
    sharded = shardings(args, world_size, ranks_per_node)
    for (sharding, group), mode, batch in itertools.product(sharded, modes, batches):
        yield {"sharding": sharding, "shard_group_size": group, "activation_checkpointing": mode,
               "batch_size": batch}  # fmt: skip


def simulated(args, model_config, world_size, n_params, ranks_per_node, fused=None):
    """Each candidate simulated: (its change to args, args with it, peak GB, the step's Work)."""
    # imported here: the simulation's imports cost 0.6 s of CPU, which a training start need not pay
    from run.prediction.simulate import simulate

    for change in candidates(args, world_size, ranks_per_node):
        candidate = types.SimpleNamespace(**{**vars(args), **change})
        memory, work = simulate(candidate, model_config, world_size, n_params, ranks_per_node, fused)
        yield change, candidate, sum(memory.values()), work


def plan(args, model_config, world_size, n_params, memory_gb, predictor, names_the_run):
    """Rows of (candidate, peak GB, Prediction or None where it does not fit), fastest first, then those that
    do not fit. predictor: the dry run's (dry_run.py)."""
    rows = []
    ranks_per_node = min(args.gpus_per_node, world_size)
    for change, candidate, peak, work in simulated(args, model_config, world_size, n_params, ranks_per_node):
        prediction = predictor(candidate, model_config, work, names_the_run) if peak <= memory_gb else None
        rows.append((change, peak, prediction))
    return sorted(rows, key=lambda row: (row[2] is None, row[2].step_s if row[2] else row[1]))


def print_plan(rows, args, world_size, memory_gb, started):
    fitting = [row for row in rows if row[2] is not None]
    tokens = args.global_batch_size * args.seq_length / world_size
    seconds = time.perf_counter() - started
    bases = {prediction.basis for _, _, prediction in fitting}
    how = "ranked by a roofline, not measured: " if bases == {"roofline"} else ""
    sources = "; ".join(sorted({prediction.source for _, _, prediction in fitting}))
    print(f"plan: {len(fitting)} of {len(rows)} candidates fit in {memory_gb:g} GB at world size "
          f"{world_size}, {how}predicted from {sources or 'nothing'} ({seconds:.0f} s), "
          "fastest first:")  # fmt: skip
    header = ("sharding", "checkpointing", "batch", "step s", "tokens/s/device", "peak GB")
    print("  " + " ".join(f"{name:<{width}}" for name, width in zip(header, WIDTHS)))
    for change, peak, prediction in fitting:
        group, steps = change["shard_group_size"], prediction.steps_s
        cells = (change["sharding"] + (f"/{group}" if group else ""), change["activation_checkpointing"],
                 change["batch_size"], "-".join(f"{step:.3g}" for step in steps),
                 "-".join(f"{tokens / step:,.0f}" for step in reversed(steps)), f"{peak:.2f}")  # fmt: skip
        print("  " + " ".join(f"{cell:<{width}}" for cell, width in zip(cells, WIDTHS)))
    if not fitting:
        print("  none fits: use more GPUs or a smaller model")
    return 0 if fitting else 1


def fastest(rows):
    """The fastest candidate that fits; a ConfigError if none does."""
    fitting = [row for row in rows if row[2] is not None]
    if not fitting:
        raise ConfigError(NONE_FITS)
    return fitting[0][0]


def settle(args, model_config, n_params, log_folder, device, taking):
    """On every rank, the process group up: sets the options left to auto as an earlier launch chose them for
    these options on this machine, else to the fastest candidate probed, which rank 0 keeps. taking(chosen):
    args with chosen taken as the command line would take it (a ConfigError says why not)."""
    path, made_for = os.path.join(log_folder, CHOSEN), choice_for(args, device)
    names = [name for option, sets in SETS.items() if getattr(args, option) == AUTO for name in sets]
    master = dist.get_rank() == 0
    kept = kept_choice(path, made_for, names, taking) if master else None
    shared = [{name: getattr(kept[0], name) for name in names} if kept else None]
    dist.broadcast_object_list(shared, src=0)
    chosen = shared[0]
    if chosen is not None:
        said = f"auto: took {{}} from {path}, chosen by the run's launch of {kept[1] if master else ''}"
    else:
        started = time.perf_counter()
        fastest = fastest_measured(args, model_config, n_params, device)
        chosen = {name: fastest[name] for name in names}
        said = (f"chose: {{}} (the fastest that fits, each candidate probed on this run's devices: "
                f"{time.perf_counter() - started:.0f} s; kept in {path} for every relaunch of this run with "
                "these options on this machine)")  # fmt: skip
        if master:
            made = time.strftime("%Y-%m-%d %H:%M")
            write_atomically(path, json.dumps({"for": made_for, "options": chosen, "made": made}))
    taken = taking(chosen)
    if master:
        print(said.format(flags({name: getattr(taken, name) for name in names})), flush=True)
    vars(args).update({name: getattr(taken, name) for name in names})


def fastest_measured(args, model_config, n_params, device):
    """Every rank at once: the candidates that fit this device's memory (simulated by rank 0 in a process of
    its own: the simulation needs a fake process group), each probed on the run's devices; the fastest."""
    world_size = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    fitting = [None]
    if dist.get_rank() == 0:
        if device.type == "cuda":
            memory_gb = torch.cuda.get_device_properties(device).total_memory / 1e9
        else:
            memory_gb = available_memory_bytes() / 1e9 / local
        with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as simulation:
            arguments = (args, model_config, world_size, n_params, memory_gb, local, device.type == "cuda")
            fitting[0] = simulation.submit(fitting_changes, *arguments).result()
    dist.broadcast_object_list(fitting, src=0)
    if not fitting[0]:
        raise ConfigError(NONE_FITS)
    steps = []
    for change in fitting[0]:
        candidate = types.SimpleNamespace(**{**vars(args), **change})
        accumulation = candidate.global_batch_size // (candidate.batch_size * world_size)
        steps.append(probe.build_and_measure(candidate, model_config, device, local).step_at(accumulation))
    return fitting[0][steps.index(min(steps))]


def fitting_changes(args, model_config, world_size, n_params, memory_gb, ranks_per_node, fused):
    """The candidates whose simulated peak fits memory_gb."""
    simulations = simulated(args, model_config, world_size, n_params, ranks_per_node, fused)
    return [change for change, _, peak, _ in simulations if peak <= memory_gb]


def flags(options):
    return " ".join(f"--{name}={value}" for name, value in options.items())


def choice_for(args, device):
    """What a choice of the auto options is made for: the options that decide it, and the machine."""
    world_size = dist.get_world_size()
    machine = this_machine(device, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    return {**{name: getattr(args, name) for name in DECIDES}, **machine}


def kept_choice(path, made_for, names, taking):
    """(args with the choice kept at path taken, when it was made), if it was made for made_for, else None. A
    damaged one (not a regular file of a choice's shape, options other than names, a value the command line
    refuses) is one warning, set aside, and None."""
    try:
        record = read_json(path)
        if not isinstance(record, dict) or not all(isinstance(record.get(k), kind) for k, kind in FIELDS):
            raise ValueError("it holds no choice: its for, options and made are missing or of other kinds")
        if record["for"] != made_for:
            return None
        chosen = record["options"]
        if sorted(chosen) != sorted(names) or AUTO in chosen.values():
            raise ValueError(f"it sets {', '.join(map(str, chosen)) or 'nothing'}, and this launch leaves "
                             f"{', '.join(names)} to auto")  # fmt: skip
        return taking(chosen), record["made"]
    except FileNotFoundError:
        return None
    except (OSError, UnsafeFile, ValueError) as error:  # ConfigError too: a value the command line refuses
        why = " ".join(str(error).split())
        print(f"warning: {path} is not a choice of the auto options this launch can take ({why}); "
              f"{set_aside_damaged(path)}, choosing again", file=sys.stderr, flush=True)  # fmt: skip
        return None
