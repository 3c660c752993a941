"""A fake scheduler for the job's tests (tests/test_job_*.py): no SLURM, no root, seconds. FakeSlurm keeps
what SLURM would (the job's comment, its excluded nodes, its requeues), and run_job starts the job again after
each requeue on the nodes it may use, as SLURM does; each phase is a fake launch whose outcome the test
scripts, with the benchmark verdicts, blames and heartbeats below. tests/test_slurm.py proves the same on a
real SLURM."""

import functools
import io
import json
import os
import re
import subprocess
import sys
import time

from conftest import REPO

from common import suspects
from run.job import job, slurm
from run.job.knobs import read_knobs

HOSTS = ["n1", "n2", "n3"]


class FakeLaunch:
    """A phase's launch: ends with status once outcome(self) returns one (None: still running). Its stderr,
    which the job passes on, is the lines said (bytes) before it is started."""

    def __init__(self, outcome, env, said=b""):
        self.outcome, self.env, self.returncode, self.polls = outcome, env, None, 0
        self.stderr = io.BytesIO(said)

    def poll(self):
        if self.returncode is None:
            self.polls += 1
            self.returncode = self.outcome(self)
        return self.returncode


class FakeSlurm:
    """run/job/slurm.py's Slurm, with SLURM's side kept in memory. phases(script, nodes, launch) gives each
    launch's exit status on each poll (None: still running). The usable nodes of the job's partition are
    partition, those of them another job holds busy: by default the job's and a fourth, busy, so that a
    requeued start is given those of the job's it did not leave out. train.py's options fit a world of W
    ranks where fits(W), and so do benchmark.py's --train_args."""

    in_job, job_id = True, "42"

    def __init__(self, run_folder, phases, comment="", time_left=None, refuse_exclude=0, benchmark_check=0):
        self.run_folder, self.phases, self.comment_text, self.time_left = (
            str(run_folder),
            phases,
            comment,
            time_left,
        )
        self.restarts, self.hosts, self.excluded_nodes, self.requeues = 0, list(HOSTS), "", 0
        self.refuse_exclude, self.launches, self.ended = refuse_exclude, [], []
        self.benchmark_check, self.checks = benchmark_check, []
        self.partition, self.busy, self.fits, self.said = [*HOSTS, "n4"], ["n4"], lambda world: True, {}

    def hostnames(self):
        return list(self.hosts)

    def comment(self):
        return self.comment_text

    def set_comment(self, text):
        self.comment_text = text

    def excluded(self):
        return self.excluded_nodes

    def exclude(self, nodes):
        if self.refuse_exclude:
            self.refuse_exclude -= 1
            return "Job is in transition"
        self.excluded_nodes = nodes

    def requeue(self):
        self.requeues += 1

    def time_left_s(self):
        return self.time_left

    def partition_nodes(self):
        return list(self.partition)

    def torchrun(self, python, nodes, nproc):
        return ["torchrun", f"--nnodes={len(nodes)}", f"--nproc_per_node={nproc}"]

    def check(self, node, command, env, container_image):  # train.py's names the run folder, which it makes
        self.checks.append(command[1])
        benchmark = command[1] == "benchmark.py"
        if benchmark and self.benchmark_check:
            return self.benchmark_check
        # benchmark.py checks train.py's options too where it times the run's step (--train_args)
        if not benchmark or any(arg.startswith("--train_args=") for arg in command):
            if not self.fits(int(env["WORLD_SIZE"])):
                print(f"error: --global_batch_size does not divide over {env['WORLD_SIZE']} ranks",
                      file=sys.stderr)  # fmt: skip
                return 2
        if benchmark:
            return 0
        with open(env["CHECKED_JSON"], "w") as file:
            json.dump({"log_folder": self.run_folder}, file)
        return 0

    def start(self, nodes, command, env):
        script = command[3]
        said = self.said.pop(len(self.launches), b"")  # said by launch number: what it printed
        process = FakeLaunch(lambda process: self.phases(script, nodes, process), env, said)
        process.command = command
        if script == "benchmark.py":
            named = dict(arg.split("=", 1) for arg in command if arg.startswith(("--report=", "--outcome=")))
            process.report, process.outcome_path = named["--report"], named["--outcome"]
        self.launches.append((self.restarts, script, list(nodes), process))
        return process

    def end(self, process):
        self.ended.append(process)
        process.returncode = 130


@functools.cache
def script_knobs():
    """The knobs as slurm_submit.sh sets them where the environment sets none: its knob lines, run by bash in
    an empty environment. The tests take the defaults from there, where users read and edit them."""
    text = (REPO / "slurm_submit.sh").read_text()
    knob_lines = list(re.finditer(r"^export ([A-Z_]+)=\$\{.*$", text, re.M))
    script = "\n".join(line.group(0) for line in knob_lines) + "\nenv -0"
    done = subprocess.run(["bash", "-c", script], env={}, capture_output=True, text=True, check=True)
    environ = dict(item.split("=", 1) for item in done.stdout.split("\0") if item)
    return {line.group(1): environ[line.group(1)] for line in knob_lines}


def knobs_of(**changed):
    """The job's knobs: the script's defaults, with changed ones (and one process per node)."""
    return read_knobs({**script_knobs(), "NPROC_PER_NODE": "1", **{k: str(v) for k, v in changed.items()}})


def run_job(scheduler, argv=(), clock=None, **knobs):
    """Starts the job, and again after each requeue, as SLURM would: on the nodes it has not excluded.
    Returns the exit status of each start."""
    knobs = knobs_of(**knobs)
    statuses = []
    while len(statuses) < 10:
        start = job.Job(knobs, scheduler, list(argv), "python", {})
        start.poll_s = start.retry_s = start.beats_s = 0
        start.clock = clock or start.clock
        requeues = scheduler.requeues
        statuses.append(start.run())
        if scheduler.requeues == requeues:
            return statuses
        scheduler.restarts += 1
        gone = [*scheduler.excluded_nodes.split(","), *scheduler.busy]
        scheduler.hosts = [host for host in scheduler.partition if host not in gone][: len(HOSTS)]
    raise AssertionError(f"the job requeued 10 times: {statuses}")


def blame(run_folder, name, nodes):
    suspects.write_suspects(
        suspects.suspects_folder(run_folder), name, {node: f"{name} blamed it" for node in nodes}
    )


def benchmark_verdict(process, verdict="pass", failed_nodes=None):
    """What benchmark.py leaves once it has a verdict: the report, and the outcome the job reads."""
    with open(process.report, "w") as file:
        file.write(f"world:\n  nodes: 3\nverdict: {verdict}\n")
    with open(process.outcome_path, "w") as file:
        json.dump({"verdict": verdict, "report": process.report, "failed_nodes": failed_nodes or {}}, file)
    return 1 if verdict == "fail" else 0


def passing_benchmark(process):
    return benchmark_verdict(process)


def failing_benchmark(process, run_folder, nodes):
    blame(run_folder, "benchmark", nodes)
    return benchmark_verdict(process, "fail", {node: "benchmark blamed it" for node in nodes})


def first_start(scheduler):
    return slurm.comment_value(scheduler.comment_text, "first_start")


def launched(scheduler):
    return [(restart, script, " ".join(nodes)) for restart, script, nodes, _ in scheduler.launches]


def stops_when_asked(then=None):
    """A training launch that checkpoints and exits 75 once the job's stop file appears; then(process), if
    given, is called on each poll before (a signal arriving, say)."""

    def outcome(process):
        if os.path.exists(process.env["JOB_STOP_FILE"]):
            return 75
        if then:
            then(process)
        return None

    return outcome


def beat(run_folder, process, rank, node, steps, age=0.0):
    """The heartbeat of a rank of the launch process, as its watchdog thread writes it
    (run/job/heartbeats.py), age seconds old."""
    folder = os.path.join(run_folder, "heartbeats")
    os.makedirs(folder, exist_ok=True)
    beat = {"token": str(id(process)), "node": node, "rank": rank, "steps": steps, "time": time.time() - age}
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as file:
        json.dump({**beat, "waiting": False, "ended": False}, file)


def trains(run_folder, process, nodes, then, silent=()):
    """A training launch on nodes: every rank beats, having done a step, at its first poll; from its second
    the ranks of silent beat no more, their last beat 25 s old; then it ends with then (None: never)."""
    if process.polls == 1:
        for rank, node in enumerate(nodes):
            beat(run_folder, process, rank, node, steps=1)
        return None
    for rank, node in enumerate(nodes):
        beat(run_folder, process, rank, node, steps=2, age=25 if node in silent else 0)
    return then


def recovery(run_folder):
    with open(os.path.join(run_folder, "recovery.json")) as file:
        return json.load(file)
