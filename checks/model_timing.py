"""This model's own step on the cluster (--train_args): the distinct operations and collectives of one
training step of the model the job will train, as train.py's dry run records them on fake tensors, timed on
every device at once and over the real process groups at the sizes and groups FSDP issues. The report's
model section is then what the step's prediction (run/predict.py) costs it with: the cluster's own
figures."""

import statistics
import time

import torch
import torch.distributed as dist

from checks.collectives import collective_call, collective_seconds
from checks.world import World
from common.nccl_tests import SWEEP_NAMES
from common.op_timing import describe, eager_overheads, time_operation

# A step's collectives are few and small beside a sweep's: each is timed at least this long, even --quick.
MIN_WARMUP, MIN_ITERS = 3, 10
# A CPU step meets each collective after a stretch of compute about this long (a layer's forward or backward).
STRETCH_S = 0.005


def distinct(events):
    """(operations: {key: (name, args, kwargs, calls)}, collectives: {(kind, bytes, group, nodes): calls}) of
    a recorded step, without what cannot leave the recording process (its process groups)."""
    operations, collectives = {}, {}
    for event in events:
        if event.collective:
            collectives[event.collective] = collectives.get(event.collective, 0) + 1
        elif not event.free:
            name, args, kwargs, calls = operations.get(event.key, (event.name, event.args, event.kwargs, 0))
            operations[event.key] = (name, args, kwargs, calls + 1)
    return operations, collectives


def group_of(world: World, size: int, nodes: int):
    """This rank's process group of `size` ranks over `nodes` nodes, as FSDP's mesh makes them: one rank a
    node (a hybrid mesh's replicas), else consecutive ranks (a shard group). Every rank makes every group."""
    if size == world.size:
        return None  # the default group
    if size == nodes:
        blocks = [list(range(local, world.size, world.local_size)) for local in range(world.local_size)]
    else:
        blocks = [list(range(first, first + size)) for first in range(0, world.size, size)]
    mine = None
    for ranks in blocks:
        group = dist.new_group(ranks)
        if world.rank in ranks:
            mine = group
    return mine


def compute_stretch(device):
    """A closure computing for about STRETCH_S: matmuls of a size each rank times for itself."""
    matrix = torch.ones(256, 256, device=device)
    started = time.perf_counter()
    for _ in range(10):
        matrix @ matrix
    calls = max(1, round(STRETCH_S / ((time.perf_counter() - started) / 10)))

    def stretch():
        for _ in range(calls):
            matrix @ matrix

    return stretch


def met_seconds(call, stretch, world: World, group, warmup: int, iters: int) -> float:
    """What a collective adds to a CPU step, which meets it after a stretch of compute: the ranks arrive
    apart and the collective's threads wake from sleep. The stretch and the collective in turns, less the
    stretch alone; no less than the collective back to back. On this kind of host (2 ranks of gloo, 3 MB) a
    collective met so costs 1.1 to 1.9 times its back-to-back time."""
    alone = collective_seconds(stretch, world, group, 1, iters)
    both = collective_seconds(lambda: (stretch(), call()), world, group, warmup, iters)
    return max(both - alone, collective_seconds(call, world, group, warmup, iters))


def model_section(world: World, cfg: dict, step) -> dict:
    """step: rank 0's (train_args, operations, collectives) from distinct(), None on the other ranks and
    where rank 0 could not record the step: the section then says so, and a prediction on this report
    costs the step with the report's other figures."""
    shared = [step]
    dist.broadcast_object_list(shared, src=0, group=world.cpu_group)
    if shared[0] is None:
        return {"skipped": "the step of --train_args could not be recorded (rank 0's warning says why)"}
    train_args, operations, collectives = shared[0]
    local = {key: time_operation(name, args, kwargs, world.device) for key, (name, args, kwargs, _) in
             operations.items()}  # fmt: skip
    overheads = eager_overheads() if world.device.type == "cpu" else None
    everyone = [None] * world.size
    dist.all_gather_object(everyone, (local, overheads), group=world.cpu_group)
    overheads = [rank_overheads for _, rank_overheads in everyone if rank_overheads]
    timed = {}
    for key, (name, args, kwargs, calls) in operations.items():
        seconds = [rank[key] for rank, _ in everyone if rank[key] is not None]
        if seconds:  # the median rank's, as a step runs at every rank's pace but for its slowest
            timed[key] = {"seconds": statistics.median(seconds), "slowest_s": max(seconds), "calls": calls,
                          "op": name, "args": describe(args, kwargs)[:200]}  # fmt: skip
    measured, stretch = [], compute_stretch(world.device)
    for (kind, size, group_size, nodes), calls in sorted(collectives.items()):
        if group_size <= 1:
            continue
        group = group_of(world, group_size, nodes)
        call = collective_call(SWEEP_NAMES[kind], size, group_size, world.device, group)
        warmup, iters = max(cfg["collective_warmup"], MIN_WARMUP), max(cfg["collective_iters"], MIN_ITERS)
        if world.device.type == "cpu":
            seconds = met_seconds(call, stretch, world, group, warmup, iters)
        else:
            seconds = collective_seconds(call, world, group, warmup, iters)
        slowest = torch.tensor([seconds], device=world.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step waits for its slowest rank
        measured.append({"kind": kind, "bytes": size, "group": group_size, "nodes": nodes,
                         "seconds": slowest.item(), "calls": calls})  # fmt: skip
    section = {"train_args": train_args, "world_size": world.size, "operations": timed,
               "collectives": measured}  # fmt: skip
    # A CPU's eager step: each operation's cost beyond its kernel, and a new byte's (run/machines.py).
    if overheads:
        section["eager_overheads_s"] = [
            statistics.median(one[part] for one in overheads) for part in range(3)
        ]
    return section
