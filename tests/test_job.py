"""The job (run/job/) through a fake scheduler: no SLURM, no root, seconds. The fake keeps what SLURM would
(the job's comment, its excluded nodes, its requeues) and starts the job again after each requeue on the
nodes it may use, as SLURM does; each phase is a fake launch whose outcome the test scripts. The job's
decisions, pure functions, are tables of cases. tests/test_slurm.py proves the same on a real SLURM."""

import argparse
import functools
import io
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import ODD, REPO, TINY, fill_disk, launch, make_odd

from common import suspects
from run.job import benchmark_reports, job, slurm
from run.job.decisions import (
    CHECK,
    REQUEUE,
    RESTART,
    SPARE,
    STOP,
    Action,
    FailedLaunch,
    after_failure,
    after_training,
)
from run.job.knobs import KNOBS, read_knobs
from run.job.launch import HANG_GRACE_S, Watch
from run.job.lines import Stopped

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
    ranks where fits(W)."""

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
        if command[1] == "benchmark.py":
            return self.benchmark_check
        if not self.fits(int(env["WORLD_SIZE"])):
            print(
                f"error: --global_batch_size does not divide over {env['WORLD_SIZE']} ranks", file=sys.stderr
            )
            return 2
        with open(env["CHECKED_JSON"], "w") as file:
            json.dump({"log_folder": self.run_folder}, file)
        return 0

    def start(self, nodes, command, env):
        script = command[3]
        said = self.said.pop(len(self.launches), b"")  # said by launch number: what it printed
        process = FakeLaunch(lambda process: self.phases(script, nodes, process), env, said)
        if script == "benchmark.py":
            named = dict(arg.split("=", 1) for arg in command if arg.startswith(("--report=", "--outcome=")))
            process.report, process.outcome_path = named["--report"], named["--outcome"]
        self.launches.append((self.restarts, script, list(nodes), process))
        return process

    def end(self, process):
        self.ended.append(process)
        process.returncode = 130


@pytest.fixture
def job_signals(monkeypatch):
    """SIGUSR1 and SIGTERM to this process go to the start of the job running now, as main() sets it up."""
    original = job.Job.__init__

    def init(start, *args):
        original(start, *args)
        for number in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(number, start.on_signal)

    monkeypatch.setattr(job.Job, "__init__", init)
    previous = {number: signal.getsignal(number) for number in (signal.SIGUSR1, signal.SIGTERM)}
    yield
    for number, handler in previous.items():
        signal.signal(number, handler)


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


def test_a_node_failing_the_benchmark_is_left_out_and_the_job_requeues_without_it(tmp_path, capsys):
    def phases(script, nodes, process):
        if script == "benchmark.py" and "n3" in nodes:
            return failing_benchmark(process, tmp_path, ["n3"])
        return passing_benchmark(process) if script == "benchmark.py" else 0

    scheduler = FakeSlurm(tmp_path, phases)
    assert run_job(scheduler, clock=itertools.count(0, 7).__next__) == [0, 0]  # a benchmark takes 7 s
    assert launched(scheduler) == [(0, "benchmark.py", "n1 n2 n3"), (1, "benchmark.py", "n1 n2"),
                                   (1, "train.py", "n1 n2")]  # fmt: skip
    assert slurm.left_out(scheduler.comment_text) == ["n3"] and scheduler.excluded_nodes == "n3"
    assert list(suspects.read_excluded(tmp_path)[0]) == ["n3"]
    out, err = capsys.readouterr()
    assert "leaving out n3 (why: " in out and "requeueing job 42 (restart 1 of at most 5)" in out
    stem = f"logs/benchmark_42_{first_start(scheduler)}"
    assert (
        "error: the benchmark's verdict is fail (exit 1), blaming n3: its failing checks are in the output "
        f"above and in {stem}.yaml; not training" in err
    ), err
    # the requeued start's benchmark has a report of its own, which training is pointed to
    training_env = scheduler.launches[-1][3].env
    assert training_env["BENCHMARK_REPORT"] == f"{stem}_restart1.yaml"
    assert training_env["BENCHMARK_SECONDS"] == "7.0"  # this start's benchmark, for the goodput ledger


@pytest.fixture(autouse=True)
def reports_in_tmp(tmp_path, monkeypatch):
    """The job's default report folder, logs/, is relative: the tests run in tmp_path."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs").mkdir()


def test_nodes_are_left_out_one_requeue_each_and_the_job_stops_past_the_cap(tmp_path, capsys):
    """n3 fails the benchmark, then n2 hangs training: two nodes out, one requeue each; a third would pass
    MAX_EXCLUDED_NODES=2, and the job stops with one line naming all three."""

    def phases(script, nodes, process):
        if script == "benchmark.py":
            if "n3" in nodes:
                return failing_benchmark(process, tmp_path, ["n3"])
            return passing_benchmark(process)
        blame(tmp_path, "hang_rank0", [nodes[-1]])  # each training start blames its last node
        return 3

    scheduler = FakeSlurm(tmp_path, phases)
    assert run_job(scheduler, MAX_EXCLUDED_NODES=2) == [0, 0, 3]
    scheduler_hosts = [nodes for restart, script, nodes in launched(scheduler) if script == "train.py"]
    assert scheduler_hosts == ["n1 n2", "n1"]
    assert list(suspects.read_excluded(tmp_path)[0]) == ["n3", "n2", "n1"]
    err = capsys.readouterr().err
    assert err.count("error: stopping: 3 bad nodes, more than MAX_EXCLUDED_NODES=2: n3 (") == 1, err
    assert scheduler.excluded_nodes == "n3,n2" and slurm.left_out(scheduler.comment_text) == ["n3", "n2"]


def test_the_cap_on_requeues_stops_the_job_with_the_node_it_would_leave_out(tmp_path, capsys):
    def phases(script, nodes, process):
        blame(tmp_path, "hang_rank0", [nodes[-1]])
        return 3

    scheduler = FakeSlurm(tmp_path, phases)
    assert run_job(scheduler, SKIP_BENCHMARK=1, MAX_REQUEUES=1, MAX_EXCLUDED_NODES=5) == [0, 3]
    assert (
        "error: stopping: n3,n2 left out, but all MAX_REQUEUES=1 requeues are used" in capsys.readouterr().err
    )
    assert scheduler.requeues == 1


def test_an_earlier_job_with_the_same_id_neither_stops_this_one_nor_stands_in_for_its_benchmarks(
    tmp_path, job_signals
):
    """Job ids start again from 1 when a controller's state is reset: an earlier job 42 left its reports and
    outcomes, passing, under the names it had. This job 42 benchmarks into names of its own; the time limit
    comes meanwhile, and the requeued start finds this job's passing report by the time its comment keeps,
    skips the benchmarks and trains."""
    logs = tmp_path / "logs"
    for stem in ("benchmark_42", "benchmark_42_restart1", "benchmark_42_20240101T000000Z"):
        (logs / f"{stem}.yaml").write_text("verdict: pass\n")
        (logs / f"{stem}.outcome.json").write_text(
            json.dumps({"verdict": "pass", "report": f"logs/{stem}.yaml", "failed_nodes": {}})
        )
    earlier = {path: path.read_text() for path in logs.iterdir()}

    def phases(script, nodes, process):
        if script == "benchmark.py":
            assert not os.path.exists(process.report) and not os.path.exists(process.outcome_path)
            os.kill(os.getpid(), signal.SIGUSR1)
            return passing_benchmark(process)
        return 0

    scheduler = FakeSlurm(tmp_path, phases, comment="mine")
    assert run_job(scheduler) == [0, 0]
    stamp = first_start(scheduler)
    assert scheduler.comment_text == f"mine first_start={stamp}" and stamp != "20240101T000000Z"
    assert launched(scheduler) == [(0, "benchmark.py", "n1 n2 n3"), (1, "train.py", "n1 n2 n3")]
    assert scheduler.launches[-1][3].env["BENCHMARK_REPORT"] == f"logs/benchmark_42_{stamp}.yaml"
    assert {path: path.read_text() for path in earlier} == earlier


def test_a_benchmark_that_stopped_before_a_verdict_is_not_called_a_failing_check(tmp_path, capsys):
    """benchmark.py refused its input (exit 2) or crashed: no outcome. The job says so, blames no node and
    stops."""
    scheduler = FakeSlurm(tmp_path, lambda script, nodes, process: 2)
    assert run_job(scheduler) == [2]
    err = capsys.readouterr().err
    assert err == (
        "error: the benchmark stopped before a verdict (exit 2; see its output above); not training "
        "(CONTINUE_ON_BENCHMARK_FAILURE=1 trains anyway)\n"
    )
    assert scheduler.requeues == 0 and launched(scheduler) == [(0, "benchmark.py", "n1 n2 n3")]
    # training anyway, when asked to
    scheduler = FakeSlurm(tmp_path, lambda script, nodes, process: 2 if script == "benchmark.py" else 0)
    assert run_job(scheduler, CONTINUE_ON_BENCHMARK_FAILURE=1) == [0]
    assert launched(scheduler)[-1] == (0, "train.py", "n1 n2 n3")
    assert "the benchmark stopped before a verdict (exit 2; see its output above); CONTINUE_ON" in (
        capsys.readouterr().out
    )


def test_a_failure_that_blames_no_node_stops_the_job(tmp_path, capsys):
    scheduler = FakeSlurm(tmp_path, lambda script, nodes, process: 1)
    assert run_job(scheduler, SKIP_BENCHMARK=1) == [1]
    assert scheduler.requeues == 0 and "leaving out" not in capsys.readouterr().out


def test_a_node_left_out_before_stays_out_when_slurm_allocates_it_again(tmp_path, capsys):
    scheduler = FakeSlurm(tmp_path, lambda script, nodes, process: 0, comment="keep me left_out=n3")
    assert run_job(scheduler, SKIP_BENCHMARK=1) == [0]
    assert launched(scheduler) == [(0, "train.py", "n1 n2")]
    assert "running on n1 n2 alone: this job left out n3 before" in capsys.readouterr().out


def test_an_exclusion_slurm_refuses_for_now_is_kept_by_the_comment(tmp_path, capsys):
    def phases(script, nodes, process):
        if "n3" in nodes:
            blame(tmp_path, "hang_rank0", ["n3"])
            return 3
        return 0

    scheduler = FakeSlurm(tmp_path, phases, refuse_exclude=10)
    scheduler.requeue = lambda: setattr(scheduler, "requeues", scheduler.requeues + 1)
    start = job.Job(knobs_of(SKIP_BENCHMARK=1), scheduler, [], "python", {})
    start.poll_s = start.retry_s = 0
    assert start.run() == 0 and scheduler.requeues == 1 and scheduler.excluded_nodes == ""
    assert "SLURM refused ExcNodeList=n3 for now" in capsys.readouterr().out
    assert scheduler.comment_text == "left_out=n3"  # the next start, given n3 again, runs without it


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


def test_the_time_limit_requeues_until_the_requeues_are_used(tmp_path, capsys, job_signals):
    starts = []

    def phases(script, nodes, process):
        starts.append(process)
        return stops_when_asked(lambda process: os.kill(os.getpid(), signal.SIGUSR1))(process)

    scheduler = FakeSlurm(tmp_path, phases)
    assert run_job(scheduler, SKIP_BENCHMARK=1, MAX_REQUEUES=2) == [0, 0, 75]
    out = capsys.readouterr().out
    assert out.count("SIGUSR1: time limit near, checkpointing to requeue") >= 3
    assert "requeueing job 42 (restart 2 of at most 2)" in out
    assert "stopped for the time limit, but all MAX_REQUEUES=2 requeues are used" in out


def test_a_stop_before_the_workers_catch_signals_reaches_them_once_they_train(tmp_path, job_signals):
    """SIGUSR1 during the options' check: nothing is signalled; training starts with the stop file there
    (train.py's rank 0 looks for it once training has started), checkpoints, and the job requeues. The run
    folder, which train.py has not made yet, is made for it."""

    def phases(script, nodes, process):
        if os.path.exists(process.env["JOB_STOP_FILE"]):
            return 75
        return 0 if process.polls > 3 else None

    scheduler = FakeSlurm(tmp_path / "run", phases)
    checked = scheduler.check

    def check_during_which_the_signal_comes(*args):
        if scheduler.restarts == 0:
            os.kill(os.getpid(), signal.SIGUSR1)
        return checked(*args)

    scheduler.check = check_during_which_the_signal_comes
    assert run_job(scheduler, SKIP_BENCHMARK=1) == [0, 0]
    assert launched(scheduler) == [(0, "train.py", "n1 n2 n3"), (1, "train.py", "n1 n2 n3")]
    first, requeued = (process for _, _, _, process in scheduler.launches)
    assert (first.polls, first.returncode) == (1, 75)  # the file was there before its first look
    assert requeued.returncode == 0  # the requeued start does not inherit the earlier start's stop


def test_a_stop_during_the_benchmarks_requeues_before_training(tmp_path, job_signals):
    def phases(script, nodes, process):
        if script == "benchmark.py" and scheduler.restarts == 0:
            os.kill(os.getpid(), signal.SIGUSR1)
        return passing_benchmark(process) if script == "benchmark.py" else 0

    scheduler = FakeSlurm(tmp_path, phases)
    assert run_job(scheduler) == [0, 0]
    # the requeued start skips the benchmarks that passed, trains, and the earlier stop is not its own
    assert launched(scheduler) == [(0, "benchmark.py", "n1 n2 n3"), (1, "train.py", "n1 n2 n3")]
    assert (
        scheduler.launches[1][3].env["BENCHMARK_REPORT"] == f"logs/benchmark_42_{first_start(scheduler)}.yaml"
    )
    assert not (tmp_path / job.STOP_FILE).exists()


def test_a_signal_lead_longer_than_the_time_limit_allows_warns_and_stops_at_a_tenth(
    tmp_path, capsys, job_signals
):
    """--signal=B:USR1@590 under --time=10: SIGUSR1 comes with 585 of 600 s left; acting on it would requeue
    at once, every start. The job warns and stops with 60 s left instead."""
    now = [0.0]

    def phases(script, nodes, process):
        if process.polls == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        now[0] += 10  # each poll, 10 s pass
        return 75 if os.path.exists(process.env["JOB_STOP_FILE"]) else None

    scheduler = FakeSlurm(tmp_path, phases, time_left=(585, 600))
    assert run_job(scheduler, clock=lambda: now[0], SKIP_BENCHMARK=1, MAX_REQUEUES=0) == [75]
    polls = scheduler.launches[0][3].polls
    assert 52 <= polls <= 55, polls  # (585 - 60) s at 10 s a poll, not at once
    err = capsys.readouterr().err
    assert err.count("warning: SIGUSR1 came with 585 s of the job's 600 s time limit left") == 1, err
    assert "stopping with 60 s left instead" in err


def test_a_signal_slurm_sent_early_for_a_lead_within_the_limit_stops_at_once(tmp_path, capsys, job_signals):
    """--signal=B:USR1@200 under --time=5 (a lead of 67%): SLURM may send it up to 60 s early, here with 255
    of 300 s left, past 80% of the limit. That is SLURM's earliness, not a lead too long: it stops now."""

    def phases(script, nodes, process):
        if process.polls == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        return 75 if os.path.exists(process.env["JOB_STOP_FILE"]) else None

    scheduler = FakeSlurm(tmp_path, phases, time_left=(255, 300))
    assert run_job(scheduler, SKIP_BENCHMARK=1, MAX_REQUEUES=0) == [75]
    assert scheduler.launches[0][3].polls <= 3
    out, err = capsys.readouterr()
    assert "warning" not in err and "SIGUSR1: time limit near, checkpointing to requeue" in out


def test_a_hang_blamed_on_a_node_ends_the_step_and_the_node_is_left_out(tmp_path, capsys):
    """n3 froze: its srun never ends. Rank 0's watchdog named it 20 s ago; the job ends the step."""

    def phases(script, nodes, process):
        if "n3" not in nodes:
            return 0
        if process.polls == 1:
            blame(tmp_path, "hang_rank0", ["n3"])
            past = time.time() - 20
            os.utime(tmp_path / "suspects" / "hang_rank0.json", (past, past))
        return None  # never ends by itself

    scheduler = FakeSlurm(tmp_path, phases)
    assert run_job(scheduler, SKIP_BENCHMARK=1) == [0, 0]
    assert len(scheduler.ended) == 1 and scheduler.excluded_nodes == "n3"
    assert (
        "a hang's watchdog blamed n3 (hang_rank0 blamed it) 15 s ago, and the launch goes on: ending it"
        in (capsys.readouterr().out)
    )
    assert launched(scheduler)[-1] == (1, "train.py", "n1 n2")


def test_a_recent_hang_is_left_to_the_watchdogs_of_the_other_ranks(tmp_path):
    blame(tmp_path, "hang_rank1", ["n2"])
    assert not suspects.hang_blamed(suspects.suspects_folder(tmp_path), HANG_GRACE_S)
    assert not suspects.hang_blamed(tmp_path / "nowhere", HANG_GRACE_S)


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


def test_a_crash_on_healthy_nodes_restarts_in_place_until_max_restarts(tmp_path, capsys):
    """A rank crashes after training began, and nothing blames a node (SKIP_BENCHMARK=1: nothing checks
    them): the launch starts again on the same nodes, with no requeue, MAX_RESTARTS times; then the job
    stops in one line."""
    scheduler = FakeSlurm(tmp_path, lambda script, nodes, process: trains(tmp_path, process, nodes, 1))
    assert run_job(scheduler, SKIP_BENCHMARK=1, MAX_RESTARTS=2) == [1]
    assert launched(scheduler) == [(0, "train.py", "n1 n2 n3")] * 3 and scheduler.requeues == 0
    out, err = capsys.readouterr()
    assert "SKIP_BENCHMARK=1: skipping the benchmarks" in out
    assert (
        "restarting in place on n1 n2 n3 (no check (SKIP_BENCHMARK=1)): restart 2 of at most MAX_RESTARTS=2"
        in out
    )
    assert err.endswith(
        "error: stopping: training failed (exit 1) with no node to blame, and the MAX_RESTARTS=2 restarts in "
        "place are used\n"
    )
    noted = recovery(tmp_path)  # the job's part of the last recovery, for the next launch's ledger
    assert (noted["cause"], noted["action"], noted["nodes"]) == ("crash", "in place", {})
    assert noted["failed_at"] <= noted["detected_at"] <= noted["ended_at"] <= noted["relaunched_at"]


def test_a_crash_on_a_node_the_benchmark_then_fails_brings_the_spare_in(tmp_path, capsys):
    """SPARE_NODES=1 on 3 nodes: training on n1 and n2, n3 ready. A rank crashes; the benchmark of n1 and n2
    fails n2: training goes on, on n1 and n3, in the same allocation."""

    def phases(script, nodes, process):
        if script == "benchmark.py":
            if nodes == ["n1", "n2"]:
                return failing_benchmark(process, tmp_path, ["n2"])
            return passing_benchmark(process)
        return trains(tmp_path, process, nodes, 1 if nodes == ["n1", "n2"] else 0)

    scheduler = FakeSlurm(tmp_path, phases)
    assert run_job(scheduler, SPARE_NODES=1) == [0]
    assert launched(scheduler) == [(0, "benchmark.py", "n1 n2 n3"), (0, "train.py", "n1 n2"),
                                   (0, "benchmark.py", "n1 n2"), (0, "train.py", "n1 n3")]  # fmt: skip
    assert scheduler.requeues == 0 and list(suspects.read_excluded(tmp_path)[0]) == ["n2"]
    out = capsys.readouterr().out
    assert "training on 2 nodes, n3 kept as spare (SPARE_NODES=1)" in out
    assert "a rank crashed (training exited with status 1, no node named): benchmarking its nodes" in out
    assert "training on n1 n3, with the spare n3 (0 spares left)" in out
    assert recovery(tmp_path)["action"] == "spare n3 for n2"
    # the check had a report of its own, and the next start of the job finds that the last one failed
    stem = f"logs/benchmark_42_{first_start(scheduler)}"
    assert (
        os.path.exists(f"{stem}_2.yaml")
        and benchmark_reports.last_outcome(Path(f"{stem}.yaml"))["verdict"] == "fail"
    )


def test_a_silent_node_is_ended_and_the_spare_takes_its_place_then_fewer_nodes_go_on(tmp_path, capsys):
    """SPARE_NODES=1: n2's ranks fall silent while the others beat; the job ends the launch, leaves n2 out
    and trains on n1 and n3. Then n3 falls silent, and no spare is left: train.py's options fit one node,
    and training goes on with n1 alone."""

    def phases(script, nodes, process):
        silent = {"n1 n2": ["n2"], "n1 n3": ["n3"]}.get(" ".join(nodes), [])
        return trains(tmp_path, process, nodes, None if silent else 0, silent)

    scheduler = FakeSlurm(tmp_path, phases)
    scheduler.fits = lambda world: world in (1, 2)
    assert run_job(scheduler, SKIP_BENCHMARK=1, SPARE_NODES=1) == [0]
    assert launched(scheduler) == [(0, "train.py", "n1 n2"), (0, "train.py", "n1 n3"), (0, "train.py", "n1")]
    assert len(scheduler.ended) == 2 and scheduler.requeues == 0
    out = capsys.readouterr().out
    assert (
        "a node fell silent: n2 (rank 1 sent no heartbeat for 25 s), and the launch goes on: ending it" in out
    )
    assert (
        "leaving out n3 (why: " in out
        and "no spare left: going on with n1, as train.py's options fit 1 node" in out
    )
    noted = recovery(tmp_path)
    assert (noted["cause"], noted["nodes"], noted["action"]) == (
        "silent node",
        {"n3": "rank 1 sent no heartbeat for 25 s"},
        "fewer nodes",
    )
    assert noted["detected_at"] - noted["failed_at"] == pytest.approx(25, abs=2)


def test_with_no_spare_left_and_options_that_do_not_fit_fewer_nodes_the_job_requeues(tmp_path, capsys):
    """The spare is used and train.py's options fit no fewer nodes: the job requeues without n2 and n3, and
    starts again on three others of its partition."""

    def phases(script, nodes, process):
        silent = [node for node in ("n2", "n3") if node in nodes and nodes[0] == "n1"]
        return trains(tmp_path, process, nodes, None if silent else 0, silent=silent[:1])

    scheduler = FakeSlurm(tmp_path, phases)
    scheduler.partition, scheduler.busy = ["n1", "n2", "n3", "n4", "n5"], []
    scheduler.fits = lambda world: world == 2
    assert run_job(scheduler, SKIP_BENCHMARK=1, SPARE_NODES=1) == [0, 0]
    assert launched(scheduler) == [
        (0, "train.py", "n1 n2"),
        (0, "train.py", "n1 n3"),
        (1, "train.py", "n1 n4"),
    ]
    out, err = capsys.readouterr()
    assert "train.py's options do not fit 1 node (above): requeueing instead" in out
    assert "error: --global_batch_size does not divide over 1 ranks" in err  # train.py's own line
    assert scheduler.excluded_nodes == "n2,n3" and recovery(tmp_path)["action"] == "requeue"


def test_where_its_partition_has_no_node_for_a_requeue_the_job_goes_on_with_fewer_or_ends(tmp_path, capsys):
    """--nodes=3 on a partition of 3, SPARE_NODES=0: n3 falls silent. A requeue without it would ask for 3
    nodes of the 2 left, and wait for good (SLURM gives a requeued job the node count it was submitted
    with): the job goes on here with n1 and n2, where train.py's options fit them, and else ends, saying
    why."""

    def phases(script, nodes, process):
        return trains(tmp_path, process, nodes, None if "n3" in nodes else 0, silent=["n3"])

    scheduler = FakeSlurm(tmp_path, phases)
    scheduler.partition = list(HOSTS)
    assert run_job(scheduler, SKIP_BENCHMARK=1) == [0]
    assert launched(scheduler) == [(0, "train.py", "n1 n2 n3"), (0, "train.py", "n1 n2")]
    assert scheduler.requeues == 0 and recovery(tmp_path)["action"] == "fewer nodes"
    out = capsys.readouterr().out
    assert (
        "the job's partition has 2 nodes usable besides those it left out, fewer than the 3 this start" in out
    )
    assert "no spare left: going on with n1 n2, as train.py's options fit 2 nodes" in out

    for name in ("excluded_nodes", "recovery.json"):
        (tmp_path / name).unlink()
    scheduler = FakeSlurm(tmp_path, phases)
    scheduler.partition, scheduler.fits = list(HOSTS), lambda world: world == 3
    assert run_job(scheduler, SKIP_BENCHMARK=1) == [130]  # the status of the launch the job ended
    assert scheduler.requeues == 0 and len(scheduler.launches) == 1
    assert capsys.readouterr().err.endswith(
        "error: stopping: train.py's options do not fit the 2 nodes left (above), and a requeue could not "
        "start\n"
    )


def test_a_failure_train_py_says_or_that_comes_before_training_is_not_restarted(tmp_path, capsys):
    """A diverging loss stops train.py on purpose, with its one line 'error: ...': no restart. Nor is a
    launch that failed before its first step restarted: bad data or memory would fail it again."""
    scheduler = FakeSlurm(tmp_path, lambda script, nodes, process: trains(tmp_path, process, nodes, 1))
    scheduler.said = {0: b"error: stopping: 5 non-finite steps in a row from step 12 (lower --lr ...)\n"}
    assert run_job(scheduler, SKIP_BENCHMARK=1) == [1]
    assert len(scheduler.launches) == 1
    assert "error: stopping: 5 non-finite steps in a row" in capsys.readouterr().err  # passed on by the job

    scheduler = FakeSlurm(tmp_path, lambda script, nodes, process: 1)  # no heartbeat: no step done
    assert run_job(scheduler, SKIP_BENCHMARK=1) == [1]
    assert len(scheduler.launches) == 1
    assert "the launch failed before its first step: not restarting it" in capsys.readouterr().err


# Once a training launch has exited: (its exit status, the stop that came to the job, whether SIGUSR1 came),
# and what the job does
AFTER_TRAINING = [
    ("finished", (0, None, False), "done"),
    ("finished as a stop came", (0, signal.SIGTERM, False), "done"),
    ("a crash: restarted in place, or a node left out", (1, None, False), "recover"),
    ("a stop: torchrun passes it on, the workers save, torchrun exits 1", (1, signal.SIGTERM, False), "end"),
    ("Ctrl-C", (1, signal.SIGINT, False), "end"),
    ("a stop that ended torchrun itself", (143, signal.SIGTERM, False), "end"),
    ("the time limit's checkpoint", (75, None, True), "requeue"),
    ("a crash after the time limit's warning", (1, None, True), "requeue"),
    ("a stop after the time limit's warning: not requeued either", (1, signal.SIGTERM, True), "end"),
]


@pytest.mark.parametrize("case, move", [pytest.param(*row[1:], id=row[0]) for row in AFTER_TRAINING])
def test_after_a_training_launch_a_stop_ends_the_job_the_time_limit_requeues_and_a_crash_recovers(case, move):
    assert after_training(*case) == move


def stop(line=None):
    return Action("stop", line)


def failed(status=1, **facts):
    """A launch that failed with status, as the job knows it (facts: FailedLaunch's fields)."""
    return FailedLaunch(status, **facts)


def left_out(training, spares, wanted=2, allocated=3, partition=None, gone=("n2",), status=1, **more):
    """A failed launch that blamed nodes the job left out (gone): training is left with training nodes of the
    wanted ones, and spares spares, in a start of allocated nodes; partition: its partition's usable nodes."""
    return failed(status, named=True, left_out=gone, training=training, spares=spares, wanted=wanted,
                  allocated=allocated, partition=partition, **more)  # fmt: skip


RESTARTS_USED = "error: stopping: training failed (exit 1) with no node to blame, and the MAX_RESTARTS={} " \
                "restarts in place are used"  # fmt: skip
NO_FIT = (
    "error: stopping: train.py's options do not fit the 2 nodes left (above), and a requeue could not start"
)
NO_NODE = "error: stopping: no node of this allocation is left, and a requeue could not start"
TOO_MANY = "3 bad nodes, more than MAX_EXCLUDED_NODES=2: n1 (...); n2 (...); n3 (...)"
# After a failed launch: (what happened, what the job knows, its knobs unlike TABLE_KNOBS, what it does)
TABLE_KNOBS = {"MAX_RESTARTS": 3, "SKIP_BENCHMARK": 0, "SPARE_NODES": 0}
AFTER_FAILURE = [
    ("a crash that blames no node: its nodes are checked", failed(), {}, CHECK),
    ("a crash on nodes the check passed", failed(check=""), {}, RESTART),
    ("a crash under SKIP_BENCHMARK=1: no check", failed(), {"SKIP_BENCHMARK": 1}, RESTART),
    ("a crash whose check fails and names no node", failed(check="its verdict is fail"), {},
     stop("error: stopping: its verdict is fail")),
    ("a crash past MAX_RESTARTS restarts in place", failed(restarts=3), {}, stop(RESTARTS_USED.format(3))),
    ("a crash under MAX_RESTARTS=0", failed(), {"MAX_RESTARTS": 0}, stop(RESTARTS_USED.format(0))),
    ("a failure before the first step (data, memory, options)", failed(trained=False), {},
     stop("the launch failed before its first step: not restarting it")),
    ("train.py said why it stopped ('error: ...')", failed(said_error=True), {}, STOP),
    ("train.py saved for a stop of its own (exit 75)", failed(status=75), {}, STOP),
    ("the benchmark's verdict fails and blames no node", failed(benchmark=True), {}, STOP),
    ("nodes blamed that the job may not leave out (no SLURM)", failed(named=True), {}, STOP),
    ("more bad nodes than MAX_EXCLUDED_NODES", failed(named=True, too_many=TOO_MANY), {},
     stop(f"error: stopping: {TOO_MANY}")),
    ("n2 left out, a spare ready", left_out(1, 1), {}, SPARE),
    ("n2 left out after the check of a crash", left_out(1, 1, check=""), {}, SPARE),
    ("n2 left out by the benchmark before training", left_out(1, 1, benchmark=True), {}, SPARE),
    ("a straggler's stop (exit 75) that named n2", left_out(1, 1, status=75), {}, SPARE),
    ("a spare left out: training goes on as it was", left_out(2, 0, gone=("n3",)), {}, SPARE),
    ("two left out, one spare: 2 nodes if the options fit, else a requeue",
     left_out(1, 1, wanted=3, allocated=4, gone=("n2", "n3")), {"SPARE_NODES": 1},
     Action("fewer", nodes=2, otherwise=REQUEUE)),
    ("no spare left (SPARE_NODES=1): 1 node if the options fit, else a requeue", left_out(1, 0, partition=5),
     {"SPARE_NODES": 1}, Action("fewer", nodes=1, otherwise=REQUEUE)),
    ("no spare (SPARE_NODES=0): a requeue to start on other nodes", left_out(1, 0, partition=5), {}, REQUEUE),
    ("no spare, and sinfo does not say the partition's nodes", left_out(1, 0), {}, REQUEUE),
    ("no spare, the partition too small for a requeue: 2 nodes if the options fit",
     left_out(2, 0, wanted=3, partition=2), {}, Action("fewer", nodes=2, otherwise=stop(NO_FIT))),
    ("every node left out, the partition has others", left_out(0, 0, allocated=2, partition=2), {}, REQUEUE),
    ("every node left out, the partition too small for a requeue", left_out(0, 0, allocated=2, partition=1),
     {}, stop(NO_NODE)),
]  # fmt: skip


@pytest.mark.parametrize("facts, knobs, action", [pytest.param(*row[1:], id=row[0]) for row in AFTER_FAILURE])
def test_after_a_failure_the_job_checks_restarts_swaps_a_spare_shrinks_requeues_or_stops(
    facts, knobs, action
):
    assert after_failure(facts, argparse.Namespace(**{**TABLE_KNOBS, **knobs})) == action


@pytest.mark.parametrize("usr1_first", [False, True], ids=["scancel", "scancel after SIGUSR1"])
def test_a_stop_in_a_job_ends_it_in_one_line_with_no_restart_or_requeue(
    tmp_path, capsys, job_signals, usr1_first
):
    """In a job SLURM signals the job and its workers alike (scancel, the time limit's end): the workers
    checkpoint and torchrun exits 1, which is no crash; the job, which waited for them, ends."""

    def phases(script, nodes, process):
        if process.polls == 2:
            if usr1_first:
                os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGTERM)
        return trains(tmp_path, process, nodes, 1 if process.polls > 3 else None)

    scheduler = FakeSlurm(tmp_path, phases)
    with pytest.raises(Stopped) as stop:
        run_job(scheduler, SKIP_BENCHMARK=1)
    assert stop.value.status == 143 and str(stop.value) == (
        f"stopped by SIGTERM: training exited (status 1) and is not restarted; to resume, launch again with "
        f"--run_name={tmp_path.name}"
    )
    assert (
        len(scheduler.launches) == 1 and scheduler.requeues == 0 and not (tmp_path / "recovery.json").exists()
    )
    assert "SIGTERM: waiting for the training processes to exit" in capsys.readouterr().out


def test_a_stop_signal_the_workers_alone_saved_for_ends_the_job_with_no_restart(tmp_path):
    """scancel --signal=TERM signals the training processes and not the job: rank 0, once saved, writes the
    job's stop file, and the job takes torchrun's exit 1 for the stop it is, not a crash."""

    def phases(script, nodes, process):
        if process.polls == 3:
            Path(process.env["JOB_STOP_FILE"]).write_text("SIGTERM\n")
        return trains(tmp_path, process, nodes, 1 if process.polls > 3 else None)

    scheduler = FakeSlurm(tmp_path, phases)
    with pytest.raises(Stopped) as stop:
        run_job(scheduler, SKIP_BENCHMARK=1)
    assert stop.value.status == 1 and str(stop.value).startswith(
        "stopped by a stop signal to the training processes: training exited (status 1) and is not restarted"
    )
    assert len(scheduler.launches) == 1 and scheduler.requeues == 0


def test_a_stop_while_the_job_checks_the_nodes_after_a_crash_ends_it_before_a_restart(tmp_path, job_signals):
    def phases(script, nodes, process):
        if script == "train.py":
            return trains(tmp_path, process, nodes, 1)
        if len(scheduler.launches) == 3:  # the benchmark of the nodes after the crash
            os.kill(os.getpid(), signal.SIGTERM)
        return passing_benchmark(process)

    scheduler = FakeSlurm(tmp_path, phases)
    with pytest.raises(Stopped, match=r"^stopped by SIGTERM: the benchmark exited \(status 0\); "):
        run_job(scheduler)
    assert [script for _, script, _ in launched(scheduler)] == ["benchmark.py", "train.py", "benchmark.py"]


def test_a_node_left_out_inside_the_allocation_stays_out_after_a_requeue_for_the_time_limit(
    tmp_path, job_signals
):
    """n2 falls silent and the spare n3 takes its place; then the time limit comes: the requeued start is
    not given n2 (ExcNodeList, and the job's comment, set when it was left out)."""

    def phases(script, nodes, process):
        if scheduler.restarts:
            return 0
        if nodes == ["n1", "n3"] and process.polls == 3:
            os.kill(os.getpid(), signal.SIGUSR1)
        if os.path.exists(process.env["JOB_STOP_FILE"]):
            return 75
        return trains(tmp_path, process, nodes, None, silent=["n2"] if "n2" in nodes else [])

    scheduler = FakeSlurm(tmp_path, phases)
    assert run_job(scheduler, SKIP_BENCHMARK=1, SPARE_NODES=1) == [0, 0]
    assert launched(scheduler) == [(0, "train.py", "n1 n2"), (0, "train.py", "n1 n3"), (1, "train.py", "n1")]
    assert scheduler.excluded_nodes == "n2" and slurm.left_out(scheduler.comment_text) == ["n2"]


def test_spares_that_leave_no_node_to_train_on_are_refused_in_one_line(tmp_path):
    with pytest.raises(
        job.JobError, match=r"^SPARE_NODES=3 leaves no node to train on: the job has 3 node"
    ) as refused:
        run_job(FakeSlurm(tmp_path, None), SPARE_NODES=3)
    assert refused.value.status == 2


def test_a_node_failing_the_benchmark_is_replaced_by_a_spare_before_training(tmp_path, capsys):
    """SPARE_NODES=1: n2 fails the benchmark of all three nodes; the job leaves it out, benchmarks n1 and n3
    again, and trains on them, with no requeue."""

    def phases(script, nodes, process):
        if script == "benchmark.py":
            return (
                failing_benchmark(process, tmp_path, ["n2"]) if "n2" in nodes else passing_benchmark(process)
            )
        return 0

    scheduler = FakeSlurm(tmp_path, phases)
    assert run_job(scheduler, SPARE_NODES=1) == [0]
    assert launched(scheduler) == [(0, "benchmark.py", "n1 n2 n3"), (0, "benchmark.py", "n1 n3"),
                                   (0, "train.py", "n1 n3")]  # fmt: skip
    assert scheduler.requeues == 0 and "leaving out n2 (why: " in capsys.readouterr().out
    # training is pointed to the benchmark that passed, of the nodes it trains on
    assert (
        scheduler.launches[-1][3].env["BENCHMARK_REPORT"]
        == f"logs/benchmark_42_{first_start(scheduler)}_2.yaml"
    )


def test_bad_knobs_are_refused_in_one_line(tmp_path):
    for name, value, least in (
        ("MAX_REQUEUES", "five", 0),
        ("MAX_REQUEUES", "²", 0),
        ("NPROC_PER_NODE", "0", 1),
    ):
        with pytest.raises(job.JobError) as refused:
            read_knobs({**script_knobs(), name: value})
        assert str(refused.value) == f"{name}={value}: give a whole number, {least} or more"
        assert refused.value.status == 2
    # a switch is 0 or 1: SKIP_BENCHMARK=2 was taken, and the job's lines said SKIP_BENCHMARK=1
    for name, value in (("SKIP_BENCHMARK", "2"), ("REQUIRE_GPUS", "yes"), ("BENCHMARK_ONLY", "")):
        with pytest.raises(job.JobError) as refused:
            read_knobs({**script_knobs(), name: value})
        assert str(refused.value) == f"{name}={value}: give 0 (off) or 1 (on)"
        assert refused.value.status == 2
    # the job started without slurm_submit.sh, which alone gives the defaults
    missing = {name: value for name, value in script_knobs().items() if name != "MAX_REQUEUES"}
    with pytest.raises(
        job.JobError, match=r"^MAX_REQUEUES is not set: the job takes its knobs from slurm_submit"
    ):
        read_knobs(missing)
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_NNODES"):
        start = job.Job(knobs_of(), FakeSlurm(tmp_path, None), [], "python", {name: "abc"})
        with pytest.raises(
            job.JobError, match=rf"^{name}=abc is not a whole number: SLURM sets it"
        ) as refused:
            start.run()
        assert refused.value.status == 2


def test_each_knob_the_scripts_set_is_one_the_job_takes_with_its_default_stated_once():
    """slurm_submit.sh states each knob's default, on its export line; the job says what each one takes
    (KNOBS), and docs/SLURM.md lists the defaults: a knob added, dropped or changed in one of them alone fails
    here, as does a default, or a value benchmark_only.sh sets over slurm_submit.sh's, that the job refuses
    or reads as another."""
    defaults = script_knobs()
    assert list(defaults) == list(KNOBS)  # in the order the job's first lines say them
    handover = (REPO / "benchmark_only.sh").read_text().splitlines()[-1]
    assert handover.endswith('exec bash slurm_submit.sh "$@"'), handover
    benchmark_only = {**defaults, **dict(re.findall(r"\b([A-Z_]+)=(\S*)", handover))}
    assert list(benchmark_only) == list(KNOBS) and benchmark_only["BENCHMARK_ONLY"] == "1", handover
    for environ in (defaults, benchmark_only):
        assert {name: str(value) for name, value in vars(read_knobs(environ)).items()} == environ
    docs = (REPO / "docs" / "SLURM.md").read_text()
    section = docs[docs.index("## Knobs") : docs.index("## How a job runs")]
    documented = dict(re.findall(r"^\| `([A-Z_]+)` \| *([^|]*?) *\|", section, re.M))
    assert {name: documented.get(name) for name in KNOBS} == defaults


def test_the_job_runs_on_a_python_without_torch():
    """In a container the job runs on the host's python3, which may have none of the packages: without
    site-packages (python -S) it starts, reads its knobs and refuses the missing one."""
    result = subprocess.run(
        [sys.executable, "-S", "-m", "run.job"],
        cwd=REPO,
        env={"PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: SKIP_BENCHMARK is not set: the job takes its knobs"), result


def test_the_job_runs_with_the_knobs_slurm_submit_sh_sets(tmp_path):
    """slurm_submit.sh alone holds the knobs' defaults: run as a user runs it, in an environment that sets no
    knob, the job says it runs with those, and every knob it takes has one there. A bad option stops it at
    train.py's check, a few seconds in."""
    result = subprocess.run(
        ["bash", "slurm_submit.sh", "--batch_sise=4", f"--log_dir={tmp_path}"],
        cwd=REPO,
        env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = re.findall(r"^\d\d:\d\d:\d\d knobs: (.*)$", result.stdout, re.M)
    said = dict(knob.split("=", 1) for knob in shlex.split(line))
    assert said == {name: script_knobs()[name] for name in KNOBS}, (said, script_knobs())
    assert "error: unknown option --batch_sise; did you mean --batch_size?" in result.stderr


def test_bad_benchmark_arguments_stop_the_job_before_any_launch(tmp_path, capsys):
    scheduler = FakeSlurm(tmp_path, lambda script, nodes, process: 0, benchmark_check=2)
    with pytest.raises(
        job.JobError, match=r"^not started: benchmark.py refused its options \(above\)$"
    ) as refused:
        run_job(scheduler, BENCHMARK_ARGS="--only=nonsense")
    assert refused.value.status == 2 and scheduler.checks == ["train.py", "benchmark.py"]
    assert scheduler.launches == []


def test_bad_benchmark_arguments_are_refused_in_one_line_by_a_real_check(tmp_path):
    """benchmark_only.sh outside SLURM, as a user runs it: benchmark.py --check_only refuses the section, and
    no torchrun starts."""
    result = subprocess.run(
        [sys.executable, "-m", "run.job"],
        cwd=REPO,
        env={**os.environ, **script_knobs(), "BENCHMARK_ONLY": "1", "NPROC_PER_NODE": "1",
             "BENCHMARK_ARGS": f"--only=nonsense --report_dir={tmp_path}"},
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr == (
        "error: --only: unknown section 'nonsense'; sections are gpu, nccl, links, storage, cpu, memory\n"
        "error: not started: benchmark.py refused its options (above)\n"
    )
    assert "phase 1" not in result.stdout and not list(tmp_path.glob("benchmark_*")), result.stdout


def test_a_container_image_outside_slurm_is_refused_in_one_line(tmp_path):
    start = job.Job(knobs_of(CONTAINER_IMAGE="img.sqsh"), slurm.Local(), [], "python", {})
    with pytest.raises(
        job.JobError, match=r"^CONTAINER_IMAGE=img.sqsh runs the job's processes in a container"
    ):
        start.run()


class LocalWithoutTraining(slurm.Local):
    """This machine, as outside SLURM, whose training launch is a process that records the signal it gets."""

    def __init__(self, run_folder):
        self.run_folder = str(run_folder)

    def check(self, node, command, env, container_image):
        with open(env["CHECKED_JSON"], "w") as file:
            json.dump({"log_folder": self.run_folder}, file)
        return 0

    def start(self, nodes, command, env):
        got = os.path.join(self.run_folder, "got")
        code = (f"import signal, sys, time\nfor n in {[int(n) for n in job.ENDING]}: signal.signal(n, "
                f"lambda n, _: (open({got!r}, 'w').write(signal.Signals(n).name), sys.exit(1)))\n"
                "open(sys.argv[1], 'w').close()\ntime.sleep(60)")  # fmt: skip
        return subprocess.Popen([sys.executable, "-c", code, os.path.join(self.run_folder, "started")])


@pytest.mark.parametrize("number", job.ENDING, ids=lambda number: number.name)
def test_a_stop_to_the_job_outside_slurm_reaches_its_workers_and_ends_it(tmp_path, number):
    """Outside SLURM the launch runs in a session of its own, and the job's process alone gets a stop (kill,
    Ctrl-C to its process group): it passes it on to the launch running, then ends."""
    start = job.Job(knobs_of(SKIP_BENCHMARK=1), LocalWithoutTraining(tmp_path), [], "python", {})
    start.poll_s = 0.05

    def terminate_once_started():
        while not (tmp_path / "started").exists():
            time.sleep(0.05)
        start.on_signal(number, None)

    threading.Thread(target=terminate_once_started, daemon=True).start()
    with pytest.raises(Stopped, match=rf"^stopped by {number.name}: training exited \(status 1\)"):
        start.run()
    assert (tmp_path / "got").read_text() == number.name


def test_a_damaged_excluded_nodes_file_is_read_as_far_as_it_goes(tmp_path):
    """Bytes that are not text and a torn last line: the nodes still named stay out, the new one is added on
    a line of its own, and the suspects are removed only once it is written."""
    path = tmp_path / "excluded_nodes"
    path.write_bytes(b"n1\t2026-01-01T00:00:00Z\tslow \xff\xfe disk\nn2\t2026-01-0")
    blame(tmp_path, "benchmark", ["n3"])
    assert list(suspects.exclude(str(tmp_path), 5)) == ["n3"]
    assert list(suspects.read_excluded(tmp_path)[0]) == ["n1", "n3"]
    assert path.read_text(errors="replace").splitlines()[2].startswith("n3\t")
    assert not list((tmp_path / "suspects").iterdir())


def test_the_suspects_stay_when_the_exclusion_cannot_be_written(small_disks):
    full = small_disks(1)
    blame(full, "benchmark", ["n3"])
    fill_disk(full)
    with pytest.raises(OSError):
        suspects.exclude(str(full), 5)
    assert [path.name for path in (full / "suspects").iterdir()] == ["benchmark.json"]


@pytest.mark.parametrize("kind", ODD)
def test_an_excluded_nodes_file_that_is_not_a_regular_file_is_set_aside_and_listed_anew(
    tmp_path, capsys, kind, deadline
):
    """A FIFO hung the job as it read the nodes left out (and an append to it waits for a reader); a link to
    /dev/zero read until memory ran out."""
    path = tmp_path / suspects.EXCLUDED
    words = make_odd(path, kind)
    blame(tmp_path, "benchmark", ["n3"])
    assert suspects.exclude(str(tmp_path), 5) == {"n3": "benchmark blamed it"}
    [aside] = tmp_path.glob("excluded_nodes.damaged_*")
    assert capsys.readouterr().err.splitlines() == [
        f"warning: {path} {words}; set aside as {aside}, and the nodes left out are listed anew"
    ]
    assert list(suspects.read_excluded(tmp_path)[0]) == ["n3"] and path.read_text().startswith("n3\t")


def test_a_suspect_that_names_no_node_is_ignored_and_a_why_on_many_lines_is_kept_on_one(
    tmp_path, capsys, deadline
):
    """A why on several lines, or a node named with a tab, would have added lines of its own to
    excluded_nodes: nodes nobody blamed."""
    folder = suspects.suspects_folder(tmp_path)
    suspects.write_suspects(folder, "benchmark", {"n3": "slow\nn9\t2020\tforged"})
    suspects.write_suspects(folder, "heartbeat", {"n4\t2020\tforged\nn5": "silent"})
    make_odd(os.path.join(folder, "hang_rank0.json"), "FIFO")
    assert suspects.exclude(str(tmp_path), 5) == {"n3": "slow n9 2020 forged"}
    assert list(suspects.read_excluded(tmp_path)[0]) == ["n3"]
    err = capsys.readouterr().err
    assert "hang_rank0.json is unreadable (" in err and "is a FIFO, not a regular file); ignored" in err
    assert 'heartbeat.json is unreadable (its nodes are {"n4\\t2020\\tforged\\nn5"' in err, err


def test_the_scheduler_reads_slurm_durations_and_the_left_out_comment():
    assert slurm.duration_s("1-02:03:04") == 93784 and slurm.duration_s("00:03:00") == 180
    assert slurm.duration_s("UNLIMITED") is None
    assert slurm.left_out("(null)") == [] and slurm.left_out("x left_out=n1,n2") == ["n1", "n2"]
    assert slurm.with_left_out("x left_out=n1", ["n1", "n2"]) == "x left_out=n1,n2"


def test_the_options_check_writes_the_log_folder_for_the_job(tmp_path):
    """train.py --check_only, as the job runs it: the folder comes from a file, not from the output."""
    checked = tmp_path / "checked.json"
    result = launch(
        "train.py",
        ["--check_only", *TINY, f"--log_dir={tmp_path}", "--run_name=r"],
        nproc=0,
        env={"CHECKED_JSON": str(checked)},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(checked.read_text()) == {"log_folder": f"{tmp_path}/r"}


def test_a_stop_file_present_before_training_stops_it_after_one_step_not_before(tmp_path):
    """A plain train.py given the job's stop file, there from the start: the stop is held until training
    runs, then the run checkpoints after step 1 and exits 75 for the job to requeue."""
    stop = tmp_path / job.STOP_FILE
    stop.write_text("SIGUSR1\n")
    result = launch(
        "train.py",
        [*TINY, "--data=dummy", "--max_steps=50", f"--log_dir={tmp_path}", f"--checkpoint_dir={tmp_path}"],
        nproc=0,
        env={"JOB_STOP_FILE": str(stop)},
    )
    assert result.returncode == 75, result.stdout[-2000:] + result.stderr[-2000:]
    assert "the job asks for a stop" in result.stdout
    step = int(result.stdout.split("stopped by signal after step ")[1].split(";")[0])
    assert 1 <= step <= 2 and list(tmp_path.glob(f"*/step_{step}")), result.stdout[-2000:]


def rewritten(path, change):
    beat = json.loads(path.read_text())
    change(beat)
    path.write_text(json.dumps(beat))


def replaced(path, make):
    path.unlink()
    make(str(path))


# A heartbeat the job cannot use, made of a good one, and how its warning names it
DAMAGED_BEATS = {
    "without its time": (lambda path: rewritten(path, lambda beat: beat.pop("time")), "its time is null"),
    "with a text time": (
        lambda path: rewritten(path, lambda beat: beat.update(time="soon")),
        'its time is "soon"',
    ),
    "a link to /dev/zero": (
        lambda path: replaced(path, lambda name: os.symlink("/dev/zero", name)),
        "is a symbolic link, not a regular file",
    ),
    "a FIFO": (lambda path: replaced(path, os.mkfifo), "is a FIFO, not a regular file"),
}


@pytest.mark.parametrize("kind", DAMAGED_BEATS)
def test_a_damaged_heartbeat_is_one_warning_and_left_out_while_training_goes_on(
    tmp_path, capsys, kind, deadline
):
    """n3's rank left a heartbeat the job cannot use: it is said once and left out, and the launch trains on
    to its end. A beat without its time, or with a text one, killed the job with a traceback (KeyError,
    TypeError), a link to /dev/zero with a MemoryError, and a FIFO hung it: each left torchrun and its
    workers running."""
    damage, words = DAMAGED_BEATS[kind]
    damaged = tmp_path / "heartbeats" / "rank2.json"

    def phases(script, nodes, process):
        for rank, node in enumerate(nodes[:2]):
            beat(tmp_path, process, rank, node, steps=process.polls)
        if process.polls == 1:
            beat(tmp_path, process, 2, "n3", steps=1)
            damage(damaged)
        return 0 if process.polls == 4 else None

    scheduler = FakeSlurm(tmp_path, phases)
    assert run_job(scheduler, SKIP_BENCHMARK=1) == [0]
    assert launched(scheduler) == [(0, "train.py", "n1 n2 n3")] and scheduler.ended == []
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: heartbeat {damaged} is damaged ("), (
        warnings
    )
    assert words in warnings[0] and warnings[0].endswith("; left out until its rank writes it again")


def test_a_failure_of_the_job_itself_ends_the_launch_it_watches(tmp_path):
    """Whatever stops the job while a launch runs (here a heartbeat reader that raises) ends that launch."""
    scheduler = FakeSlurm(tmp_path, lambda script, nodes, process: trains(tmp_path, process, nodes, None))

    def broken(watch):
        raise RuntimeError("the job's own bug")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Watch, "look", broken)
        with pytest.raises(RuntimeError, match="the job's own bug"):
            run_job(scheduler, SKIP_BENCHMARK=1)
    assert len(scheduler.ended) == 1 and scheduler.ended[0].returncode == 130
