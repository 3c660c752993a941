"""Collectives (nccl-tests' busbw over message sizes, intra- and inter-node) and the links between
nodes (NIC rates, one-way latency and bandwidth of every pair of nodes, in rounds of disjoint pairs).
"""

from pathlib import Path

import torch
import torch.distributed as dist

from checks.timing import GB, MiB, algbw_GBps, busbw_GBps, median_seconds
from checks.world import World
from common.nccl_tests import BUSBW_FACTORS
from common.stopwatch import Stopwatch

NCCL_MIN_BYTES = {"cuda": 1 * MiB, "cpu": 64 * 1024}
# Python and PyTorch's host time per collective call, generously: on a GPU the stream is held this
# long per queued call so that the timed window holds GPU time only (collective_seconds).
HOST_SECONDS_PER_CALL = 100e-6
SPIN_CYCLES_PER_SECOND = 2e9  # torch.cuda._sleep counts cycles; no GPU in DATASHEET clocks above 2 GHz
PINGPONG_BYTES = {"cuda": 64 * MiB, "cpu": 16 * MiB}
LATENCY_BYTES = 8

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
