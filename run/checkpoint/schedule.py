"""When the checkpointer saves: every --checkpoint_every steps, or with auto at Young/Daly's interval, the one
that loses least to failures; always at the run's last step and at a requested stop. The checkpointer asks
due(step) itself, and tells the schedule how long each save blocked training."""

import math
import os
import sys

import torch.distributed as dist

from run.report_figures import BadReport, read_report

# Before the first save is timed, the checkpoint is estimated from the parameter count (fp32 weights and two
# AdamW moments) over the benchmark's parallel write rate, or this rate without a benchmark report.
ASSUMED_WRITE_GBPS = 1.0
BYTES_PER_PARAMETER = 12


def young_daly_interval_s(save_s, mtbf_s):
    """The checkpoint interval that loses least, T = sqrt(2 * save_s * mtbf_s) (Young 1974; Daly 2006)."""
    return math.sqrt(2 * save_s * mtbf_s)


class CheckpointSchedule:
    """--checkpoint_every: a number of steps, or auto: Young/Daly's interval over the mean step time, from the
    last save's blocking time (estimated before the first) and the job's mean time between failures, one
    node's MTBF over the number of nodes. Under auto, rank 0 chooses at each log window and every rank
    follows; until the first choice, no save is due but the last."""

    def __init__(self, setting, n_params, nodes, node_mtbf_hours, write_GBps):
        self.auto = setting == "auto"
        self.steps = None if self.auto else setting
        self.last_save_step = 0
        self.save_s = n_params * BYTES_PER_PARAMETER / ((write_GBps or ASSUMED_WRITE_GBPS) * 1e9)
        self.mtbf_s, self.nodes = node_mtbf_hours * 3600 / nodes, nodes

    def due(self, step, last=False):
        """Whether a save is due after step; last: the run's last step, or a stop was asked for."""
        if last:
            return True
        if not self.auto:
            return step % self.steps == 0
        return self.steps is not None and step - self.last_save_step >= self.steps

    def resumed(self, step):
        """The run goes on from a checkpoint of step: the interval counts from it, not from step 0."""
        self.last_save_step = step

    def saved(self, step, seconds):
        self.last_save_step, self.save_s = step, seconds

    def choose(self, mean_step_s):
        """Under auto, the interval in steps for this mean step time, decided by rank 0 and followed by every
        rank (a collective: every rank calls it); rank 0 says when it changes."""
        if not self.auto or mean_step_s is None:
            return
        decision = [max(1, round(young_daly_interval_s(self.save_s, self.mtbf_s) / mean_step_s))]
        dist.broadcast_object_list(decision, src=0)
        changed, self.steps = decision[0] != self.steps, decision[0]
        if changed and dist.get_rank() == 0:
            print(self.describe(), flush=True)

    def describe(self):
        return (
            f"checkpoint interval: every {self.steps} steps (Young/Daly: sqrt(2 x {self.save_s:.1f} s a save "
            f"x {self.mtbf_s / 3600:.4g} h between failures of {self.nodes} node{'s' * (self.nodes > 1)}))"
        )


def benchmark_write_GBps(master):
    """The parallel write rate of the job's benchmark report ($BENCHMARK_REPORT), else ASSUMED_WRITE_GBPS:
    also where the report is not one a run can use (rank 0 says so, once)."""
    path = os.environ.get("BENCHMARK_REPORT")
    if not path:
        return ASSUMED_WRITE_GBPS
    try:
        aggregate = (read_report(path).get("storage") or {}).get("aggregate")
    except BadReport as error:
        if master:
            print(f"warning: BENCHMARK_REPORT: {error}; the first checkpoint is estimated at "
                  f"{ASSUMED_WRITE_GBPS:g} GB/s", file=sys.stderr, flush=True)  # fmt: skip
        return ASSUMED_WRITE_GBPS
    rate = aggregate.get("parallel_write_GB/s") if isinstance(aggregate, dict) else None
    return rate or ASSUMED_WRITE_GBPS  # checked, where the report has it
