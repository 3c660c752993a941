"""The job (run/job/) through the fake scheduler of tests/fake_scheduler.py as nodes fail: a node failing the
benchmark is left out and the job requeues without it or brings a spare in; a crash restarts in place; a hung
or silent node is ended and replaced, or the job goes on with fewer nodes, or requeues; the caps on requeues,
restarts and bad nodes stop it in one line; a node left out stays out. tests/test_slurm.py proves the same on
a real SLURM."""

import itertools
import json
import os
import signal
import time
from pathlib import Path

import pytest
from fake_scheduler import (
    HOSTS,
    FakeSlurm,
    blame,
    failing_benchmark,
    first_start,
    knobs_of,
    launched,
    passing_benchmark,
    recovery,
    run_job,
    trains,
)

from common import suspects
from run.job import benchmark_reports, job, slurm

# The job writes its benchmark reports under logs/, relative to where it runs.
pytestmark = pytest.mark.usefixtures("reports_in_tmp")


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


def test_a_first_start_in_the_comment_that_is_no_time_is_replaced_and_names_no_path_out_of_logs(tmp_path):
    """The job's comment is text anyone who may update the job can set: a first_start= that is not the time
    the job keeps there (one that climbs out of logs/) is replaced by this start's time, and every report
    stays in the folder."""
    reports = []

    def phases(script, nodes, process):
        if script == "benchmark.py":
            reports.append(process.report)
            return passing_benchmark(process)
        return 0

    scheduler = FakeSlurm(tmp_path, phases, comment="mine first_start=x/../../../escape")
    assert run_job(scheduler) == [0]
    stamp = first_start(scheduler)
    assert stamp != "x/../../../escape" and scheduler.comment_text == f"mine first_start={stamp}"
    assert reports == [f"logs/benchmark_42_{stamp}.yaml"]


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


@pytest.mark.parametrize("spares, times_the_run", [(0, True), (1, False)], ids=["no spare", "a spare"])
def test_the_benchmark_times_the_runs_step_only_on_the_nodes_it_trains_on(tmp_path, spares, times_the_run):
    """Three nodes. With a spare, training runs on two, and the run's global batch divides over 1 or 2 ranks
    only: the benchmark of all three is a world training never runs at, so it measures the nodes and training
    times its own step (its --train_args there stopped a real job: 'not divisible by ... = 4 x 6')."""

    def phases(script, nodes, process):
        return passing_benchmark(process) if script == "benchmark.py" else 0

    scheduler = FakeSlurm(tmp_path, phases)
    scheduler.fits = lambda world: world <= 2 if spares else True
    assert run_job(scheduler, ["--max_steps=5"], SPARE_NODES=spares) == [0]
    benchmarks = [launch for launch in scheduler.launches if launch[1] == "benchmark.py"]
    assert [nodes for _, _, nodes, _ in benchmarks] == [HOSTS]
    timed = [arg for arg in benchmarks[0][3].command if arg.startswith("--train_args=")]
    assert [arg.endswith(" --max_steps=5") for arg in timed] == [True] * times_the_run, timed
    assert launched(scheduler)[-1] == (0, "train.py", "n1 n2" if spares else "n1 n2 n3")
