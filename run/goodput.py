"""Goodput: where the hours of a run went, across every launch and requeue of it, in <run folder>/goodput.json
(rank 0's, written atomically at every log window, checkpoint and end), and the checkpoint interval that loses
least to failures (--checkpoint_every=auto).

The parts add up to wall_s, from the first launch's start to the last update:
- productive_s: steps whose results were kept;
- lost_s (lost_steps): steps done, then thrown away by a restart from an earlier checkpoint;
- checkpoint_s, eval_s: the blocking part of saves, and evaluation;
- startup_s: each launch's start to its first step; benchmark_s: the job's benchmark phase, as the job says;
- stalled_s: a hang, from the last update to the watchdog's end of it;
- waiting_s: from one launch's last update to the next launch's start (the queue, and whatever a killed
  launch did after its last update);
- other_s: the rest (logging, teardown), never hidden."""

import json
import math
import os
import sys
import time

from common.files import write_atomically

LEDGER = "goodput.json"
PARTS = (
    "productive_s",
    "lost_s",
    "checkpoint_s",
    "eval_s",
    "startup_s",
    "benchmark_s",
    "stalled_s",
    "waiting_s",
)
SHOWN = {"lost_s": "restarts", "checkpoint_s": "checkpoints", "eval_s": "evaluation", "startup_s": "start-up",
         "benchmark_s": "benchmarks", "stalled_s": "hangs", "waiting_s": "waiting between launches",
         "other_s": "other"}  # fmt: skip
# Llama 3's 54-day pretraining on 16,384 H100s (2,048 nodes of 8) met 419 unexpected interruptions: one per
# 2,048 x 54 x 24 / 419 = 6,335 node-hours.
NODE_MTBF_HOURS = 6335.0
# Before the first save is timed, the checkpoint is estimated from the parameter count (fp32 weights and two
# AdamW moments) over the benchmark's parallel write rate, or this rate without a benchmark report.
ASSUMED_WRITE_GBPS = 1.0
BYTES_PER_PARAMETER = 12


def launch_start():
    """The epoch time this process started (Linux), else now: the launch's clock starts before torch loads."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/stat") as system:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
            boot = next(int(line.split()[1]) for line in system if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def young_daly_interval_s(save_s, mtbf_s):
    """The checkpoint interval that loses least, T = sqrt(2 * save_s * mtbf_s) (Young 1974; Daly 2006)."""
    return math.sqrt(2 * save_s * mtbf_s)


class Ledger:
    """Rank 0's account of the run's time. A relaunch reads the ledger its earlier launches left; a damaged
    one is set aside with a warning and the account starts again."""

    def __init__(self, folder, started, benchmark_s=0.0):
        self.path, self.writable = os.path.join(folder, LEDGER), True
        self.started, self.first_step_started = started, None
        self.totals = {part: 0.0 for part in PARTS} | {"lost_steps": 0, "launches": 0}
        began = started - benchmark_s  # the job's benchmarks came before this launch, in the run's time
        self.marks = {"first_start": began, "updated": began, "step": 0, "at_checkpoint": {}}
        self.read_earlier_launches()
        self.totals["launches"] += 1
        self.totals["benchmark_s"] += benchmark_s
        self.totals["waiting_s"] += max(0.0, started - benchmark_s - self.marks["updated"])

    def read_earlier_launches(self):
        try:
            with open(self.path) as file:
                saved = json.load(file)
            totals = {key: saved[key] for key in self.totals}
            marks = saved["marks"]
            if not all(isinstance(value, (int, float)) for value in totals.values()):
                raise TypeError("a figure is not a number")
            self.totals, self.marks = totals, {**self.marks, **marks, "first_start": marks["first_start"]}
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError) as error:
            print(f"warning: {self.path} is unreadable ({error}); the run's time is counted from this launch",
                  file=sys.stderr, flush=True)  # fmt: skip

    def step_started(self):
        if self.first_step_started is None:
            self.first_step_started = time.time()
            self.totals["startup_s"] += self.first_step_started - self.started

    def resumed_at(self, step, mean_step_s):
        """The launch's first step follows `step`: the steps done after it by earlier launches are lost."""
        lost_steps = max(0, self.marks["step"] - step)
        if lost_steps:
            kept = self.marks["at_checkpoint"].get(str(step), 0.0 if step == 0 else None)
            lost_s = self.totals["productive_s"] - kept if kept is not None else lost_steps * mean_step_s
            self.totals["lost_steps"] += lost_steps
            self.totals["lost_s"] += lost_s
            self.totals["productive_s"] -= lost_s
        self.marks["step"] = step
        self.marks["at_checkpoint"] = {k: v for k, v in self.marks["at_checkpoint"].items() if int(k) <= step}

    def step_done(self, step, seconds):
        self.totals["productive_s"] += seconds
        self.marks["step"] = step

    def spent(self, part, seconds):
        self.totals[part] += seconds

    def checkpointed(self, step):
        self.marks["at_checkpoint"][str(step)] = self.totals["productive_s"]

    def stalled(self):
        """A hang: from the last update to now."""
        now = time.time()
        self.totals["stalled_s"] += now - self.marks["updated"]
        self.write(now)

    def figures(self, now):
        wall = now - self.marks["first_start"]
        counted = sum(self.totals[part] for part in PARTS)
        figures = {"wall_s": wall, **self.totals, "other_s": wall - counted}
        figures["effective_training_time"] = self.totals["productive_s"] / wall if wall > 0 else None
        return figures

    def write(self, now=None):
        """A full or failing disk must not end the run: the ledger stops being written, with one warning."""
        now = now or time.time()
        self.marks["updated"] = now
        text = json.dumps({**self.figures(now), "marks": self.marks}, indent=1)
        try:
            if self.writable:
                write_atomically(self.path, text + "\n")
        except OSError as error:
            self.writable = False
            print(f"warning: cannot write {self.path} ({error.strerror}); training goes on without it",
                  file=sys.stderr, flush=True)  # fmt: skip

    def summary(self):
        """The end-of-launch line, from the figures last written."""
        figures = self.figures(self.marks["updated"])
        share = {part: figures[part] / figures["wall_s"] for part in SHOWN} if figures["wall_s"] > 0 else {}
        parts = ", ".join(
            f"{100 * value:.1f}% to {SHOWN[part]}" for part, value in share.items() if value >= 5e-4
        )
        effective = figures["effective_training_time"] or 0.0
        return f"effective training time {100 * effective:.1f}%: lost {parts or 'nothing'} ({self.path})"


class CheckpointInterval:
    """--checkpoint_every: a number of steps, or auto: Young/Daly's interval, over the mean step time, from
    the last save's blocking time (estimated before the first) and the job's mean time between failures, one
    node's MTBF over the number of nodes. Rank 0 decides; every rank follows (interval)."""

    def __init__(self, setting, n_params, nodes, node_mtbf_hours, write_GBps):
        self.auto, self.last_save_step, self.steps = (
            setting == "auto",
            0,
            None if setting == "auto" else setting,
        )
        self.save_s = n_params * BYTES_PER_PARAMETER / ((write_GBps or ASSUMED_WRITE_GBPS) * 1e9)
        self.mtbf_s, self.nodes = node_mtbf_hours * 3600 / nodes, nodes

    def due(self, step):
        if not self.auto:
            return step % self.steps == 0
        return self.steps is not None and step - self.last_save_step >= self.steps

    def saved(self, step, seconds):
        self.last_save_step, self.save_s = step, seconds

    def choose(self, mean_step_s):
        """Rank 0's interval in steps for the mean step time, and whether it changed."""
        steps = max(1, round(young_daly_interval_s(self.save_s, self.mtbf_s) / mean_step_s))
        changed, self.steps = steps != self.steps, steps
        return steps, changed

    def describe(self):
        return (
            f"checkpoint interval: every {self.steps} steps (Young/Daly: sqrt(2 x {self.save_s:.1f} s a save "
            f"x {self.mtbf_s / 3600:.4g} h between failures of {self.nodes} node{'s' * (self.nodes > 1)}))"
        )


def benchmark_write_GBps():
    """The parallel write rate of the job's benchmark report ($BENCHMARK_REPORT), else ASSUMED_WRITE_GBPS."""
    import yaml

    try:
        with open(os.environ["BENCHMARK_REPORT"]) as file:
            rate = yaml.safe_load(file)["storage"]["aggregate"]["parallel_write_GB/s"]
        return float(rate) if rate and float(rate) > 0 else ASSUMED_WRITE_GBPS
    except (KeyError, OSError, TypeError, ValueError, yaml.YAMLError):
        return ASSUMED_WRITE_GBPS
