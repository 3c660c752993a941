"""The job (run/job/) through the fake scheduler of tests/fake_scheduler.py as stops come: SIGUSR1 for the
time limit checkpoints and requeues, at whatever phase it comes and however early SLURM sends it; a stop
(scancel, Ctrl-C), to the job, its workers or both, ends the job in one line with no restart or requeue, and
outside SLURM reaches the launch; a failure of the job itself ends the launch it watches."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import TINY, launch
from fake_scheduler import (
    FakeSlurm,
    first_start,
    knobs_of,
    launched,
    passing_benchmark,
    run_job,
    stops_when_asked,
    trains,
)

from run.job import job, slurm
from run.job.launch import Watch
from run.job.lines import Stopped

# The job writes its benchmark reports under logs/, relative to where it runs.
pytestmark = pytest.mark.usefixtures("reports_in_tmp")


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
