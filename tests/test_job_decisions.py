"""The job's decisions (run/job/decisions.py), pure functions, as tables of cases: what the job does once a
training launch has exited, and after a failed one (check the nodes, restart in place, swap a spare in, go on
with fewer nodes, requeue or stop); and the small readers of SLURM's durations, the job's comment and the
hang watchdogs' blames."""

import argparse
import signal

import pytest
from fake_scheduler import blame

from common import suspects
from run.job import slurm
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
from run.job.launch import HANG_GRACE_S

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


def test_the_scheduler_reads_slurm_durations_and_the_left_out_comment():
    assert slurm.duration_s("1-02:03:04") == 93784 and slurm.duration_s("00:03:00") == 180
    assert slurm.duration_s("UNLIMITED") is None
    assert slurm.left_out("(null)") == [] and slurm.left_out("x left_out=n1,n2") == ["n1", "n2"]
    assert slurm.with_left_out("x left_out=n1", ["n1", "n2"]) == "x left_out=n1,n2"


def test_a_recent_hang_is_left_to_the_watchdogs_of_the_other_ranks(tmp_path):
    blame(tmp_path, "hang_rank1", ["n2"])
    assert not suspects.hang_blamed(suspects.suspects_folder(tmp_path), HANG_GRACE_S)
    assert not suspects.hang_blamed(tmp_path / "nowhere", HANG_GRACE_S)
