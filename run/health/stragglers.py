"""Stragglers in training: each rank's compute and data-wait time per log window, gathered on rank 0, which
names a rank slower than its peers (common/stragglers.py's rule) and, after exclude_stragglers_after windows
in a row, leaves its node out: the node is written down as a suspect for the job (run/job/), and a stop is
posted, so that the run checkpoints and the job goes on without the node."""

import os
import time

import torch
import torch.distributed as dist

from common.node import node_name
from common.stragglers import describe_straggler, slower_than_peers
from common.suspects import suspects_folder, write_suspects

STRAGGLER_LOG_WINDOWS = 3  # named in this many log windows in a row: a warning to exclude its node


class RankTimes:
    """This rank's seconds computing and waiting for data since the last read. Compute is the decoder layers'
    forward, timed from hooks that run after FSDP's own pre-forward hook has waited for the layer's gathered
    weights: waiting for a slower rank is not counted, so a slow rank stands out instead of making every rank
    look slow. On GPU the hooks record CUDA events, read at the log window's end when the step's own
    synchronisation has completed them: no extra sync. Data wait is the host's time in next(batches)."""

    def __init__(self, layers, device, compiled):
        self.device, self.cuda = device, device.type == "cuda"
        self.compute, self.data, self.started, self.events = 0.0, 0.0, None, []
        # The hooks run inside a compiled block's call: traced into its graph, they would time the tracing
        # once. Only imported when compiling: torch.compiler imports dynamo, a second of every start.
        outside_graph = torch.compiler.disable if compiled else lambda hook: hook
        self.hooks = [hook for layer in layers for hook in (
            layer.register_forward_pre_hook(outside_graph(self.start)),
            layer.register_forward_hook(outside_graph(self.stop)))]  # fmt: skip

    def remove(self):
        for hook in self.hooks:
            hook.remove()

    def start(self, module, args):
        if torch.is_grad_enabled():  # training, not evaluation
            self.started = torch.cuda.Event(enable_timing=True) if self.cuda else time.perf_counter()
            if self.cuda:
                self.started.record()

    def stop(self, module, args, output):
        if self.started is None:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events.append((self.started, end))
        else:
            self.compute += time.perf_counter() - self.started
        self.started = None

    def timed(self, batches):
        while True:
            started = time.perf_counter()
            item = next(batches)
            self.data += time.perf_counter() - started
            yield item

    def reset(self):
        self.compute, self.data, self.events = 0.0, 0.0, []

    def read(self):
        """(compute s, data s) of this rank since the last read; on GPU once its events have completed."""
        compute = self.compute + sum(start.elapsed_time(end) / 1e3 for start, end in self.events)
        data = self.data
        self.reset()
        return compute, data

    def gather(self, world_size, master):
        """(compute s, data s) of every rank since the last gather, on rank 0; None on the others."""
        local = torch.tensor(self.read())
        if self.cuda:
            local = local.pin_memory().to(self.device, non_blocking=True)
        gathered = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(gathered, local)
        return torch.stack(gathered).tolist() if master else None


class Stragglers:
    """Rank 0's view of the stragglers, log window after log window. exclude(node, why) is called for a node
    one of whose ranks has been named exclude_after windows in a row (0: never)."""

    def __init__(self, names, exclude_after=0, exclude=None):
        self.names, self.streaks, self.exclude_after, self.exclude = names, {}, exclude_after, exclude

    def log_window(self, timings, steps):
        """The record's fields for one log window of steps timed steps (seconds per step); warns of a rank
        named STRAGGLER_LOG_WINDOWS windows in a row."""
        if not steps:
            return {}
        medians, named = slower_than_peers(
            self.names, [[value / steps for value in rank] for rank in timings]
        )
        self.streaks = {name: self.streaks.get(name, 0) + 1 for name in named}
        for name, streak in self.streaks.items():
            node, figures = name.rpartition(":")[0], describe_straggler(named[name], medians)
            if streak == STRAGGLER_LOG_WINDOWS:
                then = f"the job leaves its node out after {self.exclude_after} in a row"
                if not self.exclude_after:
                    then = "if its node stays slow, stop the job and resubmit without it: "
                    then += f"sbatch --exclude={node} slurm_submit.sh ..."
                warning = (
                    f"warning: {name} has been a straggler for {streak} log windows in a row ({figures})"
                )
                print(f"{warning}; {then}", flush=True)
            if streak == self.exclude_after:
                self.exclude(node, f"straggler: {name} {streak} log windows in a row, {figures}")
        return {**medians, "stragglers": named}


class StragglerWatch:
    """This run's watch: every rank times itself (RankTimes) and takes part in each log window's gather;
    rank 0 judges (Stragglers), and its exclusion of a node writes the node down and posts a stop."""

    def __init__(self, layers, args, device, folder, stop_requests):
        self.rank_times, self.master = RankTimes(layers, device, args.compile), dist.get_rank() == 0
        self.world_size, self.folder, self.stop_requests = dist.get_world_size(), folder, stop_requests
        names = [None] * self.world_size
        dist.all_gather_object(names, f"{node_name()}:{os.environ['LOCAL_RANK']}")
        self.stragglers = Stragglers(names, args.exclude_stragglers_after, self.exclude)
        self.names, self.per_step = names, {}  # per_step: rank 0's {name: (compute s, data s)} a step

    def timed(self, batches):
        return self.rank_times.timed(batches)

    def first_step_done(self):
        """The first step compiles and loads: its times say nothing of a rank's speed."""
        self.rank_times.reset()

    def log_window(self, timed_steps):
        """Every rank takes part; rank 0 returns the log record's fields, the others {}."""
        timings = self.rank_times.gather(self.world_size, self.master)
        if not self.master:
            return {}
        if timed_steps:
            self.per_step = {
                name: tuple(v / timed_steps for v in rank) for name, rank in zip(self.names, timings)
            }
        return self.stragglers.log_window(timings, timed_steps)

    def exclude(self, node, why):
        write_suspects(suspects_folder(self.folder), "straggler", {node: why})
        self.stop_requests.post(f"leaving {node} out")
        print(f"stopping to leave {node} out ({why}): checkpointing at the end of this step", flush=True)
