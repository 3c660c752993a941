"""The choice of how to run: every candidate way of running this model at this world size (sharding with each
sensible shard-group size, activation checkpointing, the micro-batch at the same global batch), each simulated
on fake tensors for its peak memory and predicted on the machine (run/predict.py). --plan lists those that
fit, fastest first; --sharding=auto, --activation_checkpointing=auto and --batch_size=auto take the fastest.
A training run makes its choice once: rank 0 writes it to the run's log folder (CHOSEN), and every rank and
every later launch of the run takes it from there."""

import json
import os
import time
import types

from common.errors import ConfigError
from common.files import write_atomically
from run.predict import play, with_accumulation

AUTO = "auto"
CHOSEN = "plan.json"
CHECKPOINTING = ("none", "op", "selective", "full")
WAIT_FOR_RANK_0_S = 1800  # the other ranks wait this long for rank 0's choice
WIDTHS = (12, 14, 5, 9, 16, 8)  # the plan's columns


def shardings(args, world_size, ranks_per_node):
    """(sharding, shard group size) to try: full, grad_op, ddp, and hybrid over each group size that divides
    the world and nests with a node (within one, or whole nodes), short of the whole world."""
    if args.sharding != AUTO:
        return [(args.sharding, args.shard_group_size)]
    tried = [("full", None), ("grad_op", None), ("ddp", None)]
    for size in range(2, world_size):
        nests = ranks_per_node % size == 0 or size % ranks_per_node == 0
        if world_size % size == 0 and nests:
            tried.append(("hybrid", size))
    return tried


def batch_sizes(args, world_size):
    """Micro-batches to try at the same global batch: the powers of two that divide a rank's share of it."""
    if args.batch_size != AUTO:
        return [args.batch_size]
    per_rank = args.global_batch_size // world_size
    return [2**power for power in range(per_rank.bit_length()) if per_rank % 2**power == 0]


def candidates(args, world_size, ranks_per_node):
    checkpointing = (
        CHECKPOINTING if args.activation_checkpointing == AUTO else [args.activation_checkpointing]
    )
    for sharding, group in shardings(args, world_size, ranks_per_node):
        for mode in checkpointing:
            for batch in batch_sizes(args, world_size):
                yield {"sharding": sharding, "shard_group_size": group, "activation_checkpointing": mode,
                       "batch_size": batch}  # fmt: skip


def plan(args, model_config, world_size, n_params, training, machine, memory_gb, simulate):
    """Rows of (candidate, peak GB, Prediction or None where it does not fit), fastest first, then those that
    do not fit. simulate: run/simulation.py's, given a candidate's options."""
    ranks_per_node = min(args.gpus_per_node, world_size)
    rows = []
    for change in candidates(args, world_size, ranks_per_node):
        candidate = types.SimpleNamespace(**{**vars(args), **change})
        memory, events = simulate(candidate, model_config, world_size, n_params, training)
        peak = sum(memory.values())
        prediction = None
        if peak <= memory_gb:
            accumulation = args.global_batch_size // (change["batch_size"] * world_size)
            prediction = play(with_accumulation(events, min(2, accumulation), accumulation), machine)
        rows.append((change, peak, prediction))
    return sorted(rows, key=lambda row: (row[2] is None, row[2].step_s if row[2] else row[1]))


def print_plan(rows, args, world_size, machine, memory_gb, started):
    fitting = [row for row in rows if row[2] is not None]
    tokens = args.global_batch_size * args.seq_length / world_size
    seconds = time.perf_counter() - started
    print(f"plan: {len(fitting)} of {len(rows)} candidates fit in {memory_gb:g} GB at world size "
          f"{world_size}, predicted on {machine.name} ({seconds:.0f} s), fastest first:")  # fmt: skip
    header = ("sharding", "checkpointing", "batch", "step s", "tokens/s/device", "peak GB")
    print("  " + " ".join(f"{name:<{width}}" for name, width in zip(header, WIDTHS)))
    for change, peak, prediction in fitting:
        group = change["shard_group_size"]
        sharding, step = change["sharding"] + (f"/{group}" if group else ""), prediction.step_s
        cells = (sharding, change["activation_checkpointing"], change["batch_size"], f"{step:.4g}",
                 f"{tokens / step:,.0f}", f"{peak:.2f}")  # fmt: skip
        print("  " + " ".join(f"{cell:<{width}}" for cell, width in zip(cells, WIDTHS)))
    if not fitting:
        print("  none fits: use more GPUs or a smaller model")
    return 0 if fitting else 1


def fastest(rows):
    """The fastest candidate that fits; a ConfigError if none does."""
    fitting = [row for row in rows if row[2] is not None]
    if not fitting:
        raise ConfigError("no candidate of --sharding/--activation_checkpointing/--batch_size=auto fits: "
                          "use more GPUs or a smaller model (python train.py --plan lists them)")  # fmt: skip
    return fitting[0][0]


def has_auto(args):
    return AUTO in (args.sharding, args.activation_checkpointing, args.batch_size)


def settle(args, log_folder, rank, choose):
    """Sets the auto options of a training run to its choice: the run's earlier one (CHOSEN in its log
    folder), else rank 0's, made by choose() and written there for the other ranks, which wait for it."""
    path, world_size = os.path.join(log_folder, CHOSEN), int(os.environ.get("WORLD_SIZE", 1))
    if rank == 0 and chosen_for(path, world_size) is None:
        chosen = choose()
        write_atomically(path, json.dumps({"world_size": world_size, "options": chosen}))
        flags = " ".join(f"--{key}={value}" for key, value in chosen.items())
        print(f"chose: {flags} (the fastest that fits; "
              f"kept in {path} for every relaunch of this run at this world size)", flush=True)  # fmt: skip
    deadline = time.monotonic() + WAIT_FOR_RANK_0_S
    while (chosen := chosen_for(path, world_size)) is None and time.monotonic() < deadline:
        time.sleep(1.0)
    if chosen is None:
        raise ConfigError(f"rank 0 wrote no choice of the auto options to {path} in {WAIT_FOR_RANK_0_S} s")
    vars(args).update(chosen)


def chosen_for(path, world_size):
    """The options a run chose at this world size, or None (none yet, or chosen at another world size)."""
    try:
        with open(path) as file:
            chosen = json.load(file)
        return chosen["options"] if chosen["world_size"] == world_size else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
