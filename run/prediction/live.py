"""The live step held against its prediction at every log window after the first: the measured step over the
predicted one and the part that differs most, in the log line, the run's records and the goodput ledger. A
run whose steps took more than SLOW_RATIO times their prediction in two log windows in a row, and over its
last JUDGED_S seconds of steps, warns in one line naming that part, once, and again only if the gap grows by
GROWTH more: one slow window is not a slower run (a step the host held up, a profiled step at
--log_every=1), nor a few seconds of slow steps on a shared CPU. A kept prediction that the run's steps,
judged so, put outside SLOW_RATIO either way is dropped, for the next launch to measure again. A run that a
probe would hold up too long takes its prediction from its own first FIRST_STEPS_S seconds of steps."""

import os
import statistics
import sys

import torch
import torch.distributed as dist

from common.datasheet import datasheet
from run.prediction import probe, step_time
from run.report_figures import BadReport, read_report

# A healthy run lies within a few percent of a measured prediction (docs/PERFORMANCE.md); a rank slowed by
# 1.3x slows the step past this. Judged over seconds, not single windows: the CPU quick start's windows of
# 1.25 s, on a quiet 2-core machine, lay 0.72-1.26x its prediction one by one, and 0.85-1.17x four at a time;
# in one of five quick starts on another 2-core machine, a rank computed 1.65x its prediction for the run's
# last 4 s, nothing of the run's own doing: its steps took 1.29x over their last 5.6 s, 1.12x over 10 s.
SLOW_RATIO = 1.2
GROWTH = 0.25
JUDGED_S = 10.0
# Where a probe would take longer than it may, the run's own first steps predict its step: as many seconds.
FIRST_STEPS_S = probe.LIMIT_S


class LivePrediction:
    """prediction: rank 0's Prediction of this run's step, or None to take it from the run's first steps (of
    micro_steps micro-steps each, ranks_here ranks on rank 0's host), which announce(prediction) prints and
    keeps (False where it refused it); kept_in: the log folder that keeps it for later launches."""

    def __init__(self, prediction, kept_in=None, announce=None, micro_steps=1, ranks_here=1):
        self.prediction, self.kept_in, self.announce = prediction, kept_in, announce
        self.micro_steps, self.ranks_here, self.first_steps, self.recent = micro_steps, ranks_here, [], []
        self.windows, self.slow_in_a_row, self.warned_ratio, self.since = 0, 0, 0.0, None

    def log_window(self, step_s, steps, rank_times):
        """The record's fields for a log window of `steps` timed steps of mean time step_s; rank_times: {rank
        name: (compute s, data wait s) per step}, compute being the decoder layers' forward. {} for the first
        window (it holds the warm-up), without a step time, or until the run's first steps predict it."""
        self.windows += 1
        if step_s is None or self.windows == 1:
            self.since = self.since or probe.usage()  # where the first steps that may predict the step start
            return {}
        if self.prediction is None:
            if self.announce:
                self.predict_from_first_steps(step_s, steps, rank_times)
            return {}
        predicted, layer_forward = self.prediction.step_s, self.prediction.layer_forward_s
        slowest, (compute_s, _) = max(rank_times.items(), key=lambda item: item[1][0])
        # The step waits for its slowest rank; where its layers run slower than predicted, so does the rest
        # of its compute, most of the step.
        differences = {"compute": predicted * (compute_s / layer_forward - 1) if layer_forward else 0.0,
                       "data loading": max(data_s for _, data_s in rank_times.values())}  # fmt: skip
        differences["communication and the rest"] = step_s - predicted - sum(differences.values())
        largest = max(differences, key=lambda name: abs(differences[name]))
        ratio = step_s / predicted
        fields = {"predicted_step_s": predicted, "vs_predicted": ratio, "largest_difference": largest,
                  "largest_difference_s": differences[largest]}  # fmt: skip
        if largest == "compute":
            fields["slowest_rank"] = slowest
        self.slow_in_a_row = self.slow_in_a_row + 1 if ratio > SLOW_RATIO else 0
        judged, seconds = self.judged(step_s * steps, predicted * steps)
        if self.slow_in_a_row >= 2 and judged > max(SLOW_RATIO, self.warned_ratio + GROWTH):
            self.warned_ratio = judged
            pace = f" (slowest: {slowest}, computing {compute_s / layer_forward:.2f}x its prediction)"
            print(f"warning: steps take {judged:.2f}x their predicted {predicted:.3g} s (the last "
                  f"{seconds:.3g} s of steps); the largest difference is {largest}, "
                  f"{differences[largest]:+.3g} s a step{pace if largest == 'compute' else ''}",
                  flush=True)  # fmt: skip
        # A probe made in a spell when the host ran this machine's cores slower or faster than it runs them
        # now, which nothing inside the machine sees (on the 2-core test machine, a matmul loop on both cores
        # ran at 56% of its speed for 17 s, then at full speed), must not predict the next launch's step.
        if self.kept_in and judged and not 1 / SLOW_RATIO <= judged <= SLOW_RATIO:
            step_time.forget(self.kept_in, judged)
            self.kept_in = None
        return fields

    def predict_from_first_steps(self, step_s, steps, rank_times):
        """Once the windows after the first hold FIRST_STEPS_S seconds of steps, their mean step less its wait
        for data (which a probe's step holds none of) is the prediction, announced once, with the share of
        the host's cores that other work took meanwhile, as a probe measures it (this host's ranks taken to
        use what rank 0 used)."""
        data_s = max(data for _, data in rank_times.values())
        compute_s = statistics.median(compute for compute, _ in rank_times.values())
        self.first_steps.append((step_s - data_s, steps, compute_s))
        counted = sum(count for _, count, _ in self.first_steps)
        taken = sum(step * count for step, count, _ in self.first_steps)
        if taken < FIRST_STEPS_S:
            return
        windows, step = [step for step, _, _ in self.first_steps], taken / counted
        layer_forward = sum(compute * count for _, count, compute in self.first_steps) / counted
        cpu, busy, wall = probe.usage_since(self.since)
        others = probe.others_share([("here", cpu * self.ranks_here, busy, wall)])
        source = f"this run's first {counted} steps after its first log window"
        prediction = step_time.Prediction(step, step, step, "measured", source, self.micro_steps,
                                          layer_forward_s=layer_forward, spread=probe.spread_of(windows),
                                          others=others)  # fmt: skip
        self.prediction = prediction if self.announce(prediction) else None
        self.announce = None  # announced once; refused, the run goes on unpredicted

    def judged(self, seconds, predicted_s):
        """(measured over predicted, seconds) of the fewest latest windows, this one's included, that hold
        JUDGED_S seconds of steps and two windows at least; (0, 0) until the run has taken that long."""
        self.recent.append((seconds, predicted_s))
        while len(self.recent) > 2 and sum(taken for taken, _ in self.recent[1:]) >= JUDGED_S:
            self.recent.pop(0)
        total = sum(taken for taken, _ in self.recent)
        if len(self.recent) < 2 or total < JUDGED_S:
            return 0.0, 0.0
        return total / sum(expected for _, expected in self.recent), total


def predict_own_step(args, model, model_config, device, log_folder, holds_for, model_flops):
    """Before training sets model's weights, on every rank: this run's step as an earlier launch kept it
    (step_time.py) or the job's benchmark measured it on these nodes, else measured by stepping model on
    dummy batches (probe.py), else, where that would add more than probe.LIMIT_S to an eager run on a CPU,
    taken from the run's first steps. Rank 0 prints it, keeps a prediction measured well, and returns its
    LivePrediction; the other ranks, or where the timed steps varied too much (one line, and training goes
    on), None."""
    master, world_size = dist.get_rank() == 0, dist.get_world_size()
    accumulation = args.global_batch_size // (args.batch_size * world_size)
    known = [without_probe(log_folder, holds_for, accumulation) if master else None]
    dist.broadcast_object_list(known, src=0)  # the probe is collective: every rank must know whether it runs
    if not known[0]:
        limit_s = probe.LIMIT_S if device.type == "cpu" and not args.compile else None
        found = probe.measure(args, model, model_config, device, limit_s)
    if not master:
        return None
    peak = datasheet(torch.cuda.get_device_name(device)) if device.type == "cuda" else None

    def announce(prediction, where=""):
        """Prints prediction, keeping one measured by this launch; whether it printed it."""
        printed = step_time.announce(args, prediction, world_size, model_flops, peak, where)
        if printed and not where:
            step_time.keep(log_folder, prediction, holds_for)
        return printed

    if known[0]:
        prediction, where = known[0]
    elif found is None:
        print(f"note: the step is predicted from this run's first steps: timing it before them would add "
              f"more than {probe.LIMIT_S:g} s", flush=True)  # fmt: skip
        ranks_here = holds_for["machine"]["processes_per_node"]
        return LivePrediction(None, log_folder, announce, accumulation, ranks_here)
    else:
        devices = "GPUs" if device.type == "cuda" else "CPU"
        source = f"this run's own {devices} ({step_time.ranks(world_size)})"
        prediction, where = step_time.measured(found, accumulation, source), ""
    return LivePrediction(prediction, log_folder) if announce(prediction, where) else None


def without_probe(log_folder, holds_for, accumulation):
    """(the Prediction, where it was kept) that needs no probe: the one an earlier launch kept, else the job's
    benchmark's probe of this configuration on these nodes ($BENCHMARK_REPORT, where: ""), where it measured
    well (a probe made beside other work is the run's own to make again); None."""
    if kept := step_time.kept(log_folder, holds_for):
        prediction, made = kept
        return prediction, f"kept in the run's log folder by its launch of {made}"
    path = os.environ.get("BENCHMARK_REPORT")
    if not path:
        return None
    try:
        report = read_report(path)
    except BadReport as error:
        print(f"warning: BENCHMARK_REPORT: {error}; the step is measured here", file=sys.stderr, flush=True)
        return None
    world_size = holds_for["machine"]["world_size"]
    found = step_time.reported(path, report, holds_for["options"], world_size, accumulation)
    return (found, "") if found and found.measured_well else None


def holds_for(args, names_the_run, device, world_size, processes_per_node):
    """What a kept prediction holds for: the values of the options that name the run, and the machine."""
    machine = step_time.this_machine(device, world_size, processes_per_node)
    return {"options": {name: getattr(args, name) for name in names_the_run}, "machine": machine}
