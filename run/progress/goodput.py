"""Goodput: where the hours of a run went, across every launch and requeue of it, in <run folder>/goodput.json
(rank 0's, written atomically as each launch starts, at every log window, checkpoint and end).

The parts add up to wall_s, from the first launch's start to the last update:
- productive_s: steps whose results were kept;
- lost_s (lost_steps): steps done, then thrown away by a restart from an earlier checkpoint;
- checkpoint_s, eval_s: the blocking part of saves, and evaluation;
- startup_s: each launch's start to its first step; benchmark_s: the job's benchmark phase, as the job says;
- stalled_s: a hang, from the last update to the watchdog's end of it;
- waiting_s: from one launch's last update to the next launch's start (the queue, and whatever a killed
  launch did after its last update);
- other_s: the rest (logging, teardown), never hidden.

Beside the parts, `recoveries`: each failure the job (run/job/) recovered from inside its allocation or by
a requeue, with its cause, node and action, timed from the failure to the next launch's first step. The job
measures its part (detection, teardown, the wait before the relaunch) and leaves it in <run folder>/
recovery.json; the next launch's rank 0 adds its own (start-up, checkpoint load, lost steps) and records it
whole."""

import contextlib
import json
import math
import os
import sys
import time

from common.files import UnsafeFile, read_json, set_aside_damaged, write_atomically

LEDGER = "goodput.json"
RECOVERY = "recovery.json"  # the job's part of a recovery, for the next launch's ledger
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
RECOVERY_PARTS = ("detection_s", "teardown_s", "waiting_s", "startup_s", "load_s", "lost_s")
RECOVERY_WORDS = ("detection", "teardown", "waiting", "start-up", "checkpoint load", "lost steps")
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


def benchmark_seconds(master):
    """$BENCHMARK_SECONDS: how long the job's benchmarks ran before this launch (the job sets it); 0 when
    unset, and when it is not a finite number of seconds, with one warning (rank 0's)."""
    text = os.environ.get("BENCHMARK_SECONDS")
    if text is None:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not_seconds(value) or value > time.time():
        if master:
            print(f"warning: BENCHMARK_SECONDS={text[:40]!r} is not a number of seconds; the benchmarks' "
                  f"time is left out of {LEDGER}", file=sys.stderr, flush=True)  # fmt: skip
        return 0.0
    return value


def not_seconds(value):
    """Why value is not a number of seconds (or a time since the epoch), or None."""
    if type(value) not in (int, float):
        return f"{json.dumps(value)[:40]}, not a number"
    if not math.isfinite(value) or value < 0:
        return f"{value}, not a finite number 0 or more"
    return None


COUNTS = ("lost_steps", "launches")
# A job's times read on another node's clock (recovery.json): one this far ahead of this node's is damage.
CLOCK_SLACK_S = 3600
# The wall runs between the marks of launches that may have read other nodes' clocks, which NTP keeps within
# milliseconds of each other: parts adding up past it by more than this are damage, however long the run.
PARTS_SLACK_S, PARTS_SLACK_SHARE = 5.0, 0.01


def ledger_problem(totals, marks):
    """Why the figures of a ledger read back cannot be carried on, or None: each a finite number of seconds no
    longer than the run so far, each count a whole number, none negative, and the marks of the kinds write()
    gives them."""
    times = {f"marks.{key}": marks[key] for key in ("first_start", "updated")}
    for name, value in {**totals, **times}.items():
        if name in COUNTS and (type(value) is not int or value < 0):
            return f"{name} is {json.dumps(value)[:40]}, not a whole number 0 or more"
        if name not in COUNTS and (why := not_seconds(value)):
            return f"{name} is {why}"
    wall = marks["updated"] - marks["first_start"]
    most = wall + PARTS_SLACK_S + PARTS_SLACK_SHARE * max(wall, 0)
    if longer := next((part for part in PARTS if totals[part] > most), None):
        return f"{longer} is {totals[longer]:.4g} s, longer than the run's {max(wall, 0):.4g} s"
    if (counted := sum(totals[part] for part in PARTS)) > most:
        return f"its parts add up to {counted:.4g} s, more than the run's {max(wall, 0):.4g} s"
    if type(marks["step"]) is not int or marks["step"] < 0:
        return f"marks.step is {json.dumps(marks['step'])[:40]}, not a step number"
    saves = marks["at_checkpoint"]
    if not isinstance(saves, dict):
        return f"marks.at_checkpoint is {json.dumps(saves)[:40]}, not a record of steps"
    for step, productive_s in saves.items():
        if not (step.isascii() and step.isdigit()):
            return f"marks.at_checkpoint has {step[:40]!r}, not a step number"
        if why := not_seconds(productive_s):
            return f"marks.at_checkpoint.{step} is {why}"
    return None


class Ledger:
    """The account of the run's time, kept by every rank and written by rank 0 (master). A relaunch reads the
    ledger its earlier launches left; a damaged one is set aside with a warning and the account starts
    again."""

    def __init__(self, folder, started, benchmark_s=0.0, master=True):
        self.path, self.writable, self.master = os.path.join(folder, LEDGER), master, master
        self.started, self.first_step_done, self.load_s, self.prediction = started, False, 0.0, None
        self.recoveries, self.recovering = [], None
        self.totals = {part: 0.0 for part in PARTS} | {"lost_steps": 0, "launches": 0}
        began = started - benchmark_s  # the job's benchmarks came before this launch, in the run's time
        self.marks = {"first_start": began, "updated": began, "step": 0, "at_checkpoint": {}}
        if master:
            self.read_earlier_launches()
            self.recovering = read_recovery(folder)
        self.totals["launches"] += 1
        self.totals["benchmark_s"] += benchmark_s
        self.totals["waiting_s"] += max(0.0, started - benchmark_s - self.marks["updated"])
        # Start-up is counted up to started_up_to. The process's start is known to the second (the boot time's
        # precision), and a launch on another node reads another clock: never from before the last update.
        self.started_up_to = max(started, self.marks["updated"])

    def read_earlier_launches(self):
        try:
            saved = read_json(self.path)
            totals = {key: saved[key] for key in self.totals}
            marks = {**self.marks, **saved["marks"], "first_start": saved["marks"]["first_start"]}
            if problem := ledger_problem(totals, marks):
                raise ValueError(problem)
            if not isinstance(recoveries := saved.get("recoveries", []), list):
                raise ValueError(f"its recoveries are {json.dumps(recoveries)[:40]}, not a list")
            self.totals, self.marks = totals, marks
            problems = [recovered_problem(entry) for entry in recoveries]
            self.recoveries = [entry for entry, problem in zip(recoveries, problems) if not problem]
            if left_out := [problem for problem in problems if problem]:
                print(f"warning: {self.path}: {len(left_out)} of its recoveries are damaged ({left_out[0]}); "
                      "they are left out of the run's account", file=sys.stderr, flush=True)  # fmt: skip
        except FileNotFoundError:
            pass
        except UnsafeFile as error:
            self.set_aside(error)
        except OSError as error:
            self.set_aside(error.strerror)
        except KeyError as error:
            self.set_aside(f"no {error}")
        except (ValueError, TypeError) as error:
            self.set_aside(error)

    def set_aside(self, why):
        """A damaged ledger is renamed, so that this launch's writes keep it, and said in one warning."""
        aside = set_aside_damaged(self.path)
        print(f"warning: {self.path} is damaged ({why}); {aside}, and the run's time is counted from this "
              f"launch", file=sys.stderr, flush=True)  # fmt: skip

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

    def launch_started(self):
        """Writes the ledger as the launch starts, with its start-up so far: a launch that dies before its
        first log window still counts."""
        now = time.time()
        self.totals["startup_s"] += now - self.started_up_to
        self.started_up_to = now
        self.write(now)

    def step_done(self, step, seconds):
        """A step of seconds done: the launch's first also ends its start-up, says where it resumed, and
        completes the recovery that led to this launch."""
        if not self.first_step_done:
            self.first_step_done = True
            self.totals["startup_s"] += time.time() - seconds - self.started_up_to
            lost = self.totals["lost_steps"], self.totals["lost_s"]
            self.resumed_at(step - 1, seconds)
            if self.recovering:
                lost = self.totals["lost_steps"] - lost[0], self.totals["lost_s"] - lost[1]
                self.recovered(*lost)
        self.totals["productive_s"] += seconds
        self.marks["step"] = step

    @contextlib.contextmanager
    def loading(self):
        """Times the launch's checkpoint load, a part of its start-up that a recovery names."""
        started = time.perf_counter()
        yield
        self.load_s = time.perf_counter() - started

    def recovered(self, lost_steps, lost_s):
        """The recovery the job left in recovery.json, whole now that training goes on: from the failure to
        the end of this launch's first step, and the steps it threw away."""
        job, now = self.recovering, time.time()
        relaunched = job.get("relaunched_at") or self.started
        self.recoveries.append({
            "cause": job["cause"], "nodes": job["nodes"], "action": job["action"],
            "detection_s": job["detected_at"] - job["failed_at"],
            "teardown_s": job["ended_at"] - job["detected_at"],
            "waiting_s": relaunched - job["ended_at"], "startup_s": now - relaunched - self.load_s,
            "load_s": self.load_s, "lost_steps": lost_steps, "lost_s": lost_s,
            "cost_s": now - job["failed_at"] + lost_s,
        })  # fmt: skip
        self.recovering = None
        with contextlib.suppress(OSError):
            os.remove(os.path.join(os.path.dirname(self.path), RECOVERY))

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
        """The live step against its prediction (run/prediction/live.py): kept as the ledger's latest, and
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
        saved = {**self.figures(now), "recoveries": self.recoveries, "prediction": self.prediction}
        text = json.dumps({**saved, "marks": self.marks}, indent=1)
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
        line = f"effective training time {100 * effective:.1f}%: lost {parts or 'nothing'} ({self.path})"
        return line + recoveries_cost(self.recoveries)


def recovered_problem(entry):
    """Why a recovery the ledger read back cannot be summed, or None: each figure the end-of-launch line sums
    a finite number of seconds, its lost steps a whole number."""
    if not isinstance(entry, dict):
        return f"{json.dumps(entry)[:40]} is not a record"
    if type(entry.get("lost_steps")) is not int or entry["lost_steps"] < 0:
        return f"its lost_steps is {json.dumps(entry.get('lost_steps'))[:40]}, not a whole number 0 or more"
    for name in (*RECOVERY_PARTS, "cost_s"):
        if why := not_seconds(entry.get(name)):
            return f"its {name} is {why}"
    return None


def recoveries_cost(recoveries):
    """What the run's recoveries cost, summed by part, for the end-of-launch line ('' when none)."""
    if not recoveries:
        return ""
    total = {part: sum(entry[part] for entry in recoveries) for part in (*RECOVERY_PARTS, "lost_steps")}
    parts = ", ".join(f"{words} {total[part]:.0f} s" for part, words in zip(RECOVERY_PARTS, RECOVERY_WORDS))
    count = f"{len(recoveries)} recover{'y' if len(recoveries) == 1 else 'ies'}"
    return (
        f"; {count} cost {sum(e['cost_s'] for e in recoveries):.0f} s: {parts} ({total['lost_steps']} steps)"
    )


def write_recovery(folder, cause, nodes, action, failed_at, detected_at, ended_at):
    """The job's part of a recovery, for the next launch (epoch times): what failed, when the job knew, when
    the failed launch was gone."""
    write_atomically(os.path.join(folder, RECOVERY), json.dumps({
        "cause": cause, "nodes": nodes, "action": action, "failed_at": failed_at, "detected_at": detected_at,
        "ended_at": ended_at,
    }))  # fmt: skip


def relaunching(folder):
    """The job starts the launch after a recovery: the time the launch's start-up is counted from."""
    recovery = read_recovery(folder)
    if recovery and not recovery.get("relaunched_at"):
        write_atomically(
            os.path.join(folder, RECOVERY), json.dumps({**recovery, "relaunched_at": time.time()})
        )


def read_recovery(folder):
    """recovery.json, or None where there is none, or it is damaged: a warning, it is set aside, and that
    recovery goes unrecorded."""
    path = os.path.join(folder, RECOVERY)
    try:
        recovery = read_json(path)
        if problem := recovery_problem(recovery):
            raise ValueError(problem)
        return recovery
    except FileNotFoundError:
        return None
    except (OSError, UnsafeFile, ValueError) as error:
        print(f"warning: {path} is unreadable ({error}); {set_aside_damaged(path)}, and that recovery goes "
              "unrecorded", file=sys.stderr, flush=True)  # fmt: skip
        return None


def recovery_problem(recovery):
    """Why the job's part of a recovery, read back, cannot be used, or None: its cause and action are text,
    its nodes {node: why}, its times epoch seconds no later than now (give or take CLOCK_SLACK_S)."""
    if not isinstance(recovery, dict):
        return f"{json.dumps(recovery)[:40]} is not a record"
    for name in ("cause", "action"):
        if not isinstance(recovery.get(name), str):
            return f"its {name} is {json.dumps(recovery.get(name))[:40]}, not text"
    nodes = recovery.get("nodes")
    if not (isinstance(nodes, dict) and all(isinstance(why, str) for why in nodes.values())):
        return f"its nodes are {json.dumps(nodes)[:40]}, not a record of node: why"
    times = (
        "failed_at",
        "detected_at",
        "ended_at",
        *(["relaunched_at"] if "relaunched_at" in recovery else []),
    )
    for name in times:
        if why := not_seconds(recovery[name] if name in recovery else None):
            return f"its {name} is {why}"
        if recovery[name] > time.time() + CLOCK_SLACK_S:
            return f"its {name} is {recovery[name]:.0f}, a time yet to come"
    return None
