"""Goodput: where the hours of a run went, across every launch and requeue of it, in <run folder>/goodput.json
(rank 0's, written atomically at every log window, checkpoint and end).

The parts add up to wall_s, from the first launch's start to the last update:
- productive_s: steps whose results were kept;
- lost_s (lost_steps): steps done, then thrown away by a restart from an earlier checkpoint;
- checkpoint_s, eval_s: the blocking part of saves, and evaluation;
- startup_s: each launch's start to its first step; benchmark_s: the job's benchmark phase, as the job says;
- stalled_s: a hang, from the last update to the watchdog's end of it;
- waiting_s: from one launch's last update to the next launch's start (the queue, and whatever a killed
  launch did after its last update);
- other_s: the rest (logging, teardown), never hidden."""

import contextlib
import json
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


def launch_start():
    """The epoch time this process started (Linux), else now: the launch's clock starts before torch loads."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/stat") as system:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
            boot = next(int(line.split()[1]) for line in system if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class Ledger:
    """The account of the run's time, kept by every rank and written by rank 0 (master). A relaunch reads the
    ledger its earlier launches left; a damaged one is set aside with a warning and the account starts
    again."""

    def __init__(self, folder, started, benchmark_s=0.0, master=True):
        self.path, self.writable, self.master = os.path.join(folder, LEDGER), master, master
        self.started, self.first_step_done, self.prediction = started, False, None
        self.totals = {part: 0.0 for part in PARTS} | {"lost_steps": 0, "launches": 0}
        began = started - benchmark_s  # the job's benchmarks came before this launch, in the run's time
        self.marks = {"first_start": began, "updated": began, "step": 0, "at_checkpoint": {}}
        if master:
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
        """A step of seconds done: the launch's first also ends its start-up, and says where it resumed."""
        if not self.first_step_done:
            self.first_step_done = True
            self.totals["startup_s"] += time.time() - seconds - self.started
            self.resumed_at(step - 1, seconds)
        self.totals["productive_s"] += seconds
        self.marks["step"] = step

    @contextlib.contextmanager
    def spending(self, part):
        """Times a phase of the loop outside the steps (eval_s, checkpoint_s), then writes the ledger."""
        started = time.perf_counter()
        yield
        self.totals[part] += time.perf_counter() - started
        self.write()

    @contextlib.contextmanager
    def checkpoint(self, step):
        """A save at step: its time, and the productive time it keeps should a later launch go back to it."""
        with self.spending("checkpoint_s"):
            yield
            self.marks["at_checkpoint"][str(step)] = self.totals["productive_s"]

    def against_prediction(self, fields):
        """The live step against its prediction (run/live_prediction.py): kept as the ledger's latest, and
        handed on to the log record."""
        if fields:
            self.prediction = {key: fields[key] for key in ("predicted_step_s", "vs_predicted")}
        return fields

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
        """Rank 0's. A full or failing disk must not end the run: the ledger stops being written, with one
        warning."""
        now = now or time.time()
        self.marks["updated"] = now
        text = json.dumps({**self.figures(now), "prediction": self.prediction, "marks": self.marks}, indent=1)
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
