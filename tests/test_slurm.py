"""The job scripts on a real SLURM: a controller and ten slurmd on this one host, started by
tests/slurm_cluster.sh (needs root; installs Debian's slurm packages when missing), in three partitions:
debug (n1-n3, the default), spare (n4-n6) and tight (n7-n9), where the two recovery jobs run beside the
other tests without waiting for their nodes. The nodes have no GPU, so jobs run CPU processes: 2 per node
on two nodes, or 1 per node."""

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml
from conftest import REPO, launch
from slurm_jobs import (
    ENV,
    RECOVERED,
    TINY,
    assert_prompt,
    assert_recovered,
    excluded_nodes,
    goodput,
    log,
    metrics,
    recovery_job,
    seconds_between,
    submit,
    training_processes,
    wait,
)


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.skip(
            "SLURM tests need root: tests/slurm_cluster.sh installs packages and starts slurmctld/slurmd"
        )
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        pytest.skip(
            "SLURM tests need Debian's slurm packages (slurmctld, slurmd, slurm-client, munge) or apt-get"
        )
    # `up` restarts the cluster: a second test session on this machine waits instead of breaking this one
    with open("/tmp/slurm_cluster.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        up = subprocess.run(
            ["bash", "tests/slurm_cluster.sh", "up"],
            cwd=REPO,
            env={**os.environ, "NNODES": "9", "PARTITIONS": "debug=n[1-3] spare=n[4-6] tight=n[7-9]"},
            capture_output=True,
            text=True,
        )
        if up.returncode != 0:
            message = f"could not bring up the SLURM cluster: {(up.stderr or up.stdout).strip()[-2000:]}"
            if os.environ.get("CI"):
                pytest.fail(message)  # CI is root on Debian: this is a bug, not a missing prerequisite
            pytest.skip(message)
        yield
        subprocess.run(["scancel", "--user=root"], capture_output=True)
        subprocess.run(["bash", "tests/slurm_cluster.sh", "down"], cwd=REPO, capture_output=True)


def test_benchmark_only_two_nodes(cluster, tmp_path):
    job_id = submit(
        "benchmark_only.sh",
        tmp_path,
        "--quick",
        "--skip=storage,memory",  # test_benchmark.py checks both; STREAM allocates 12x the L3
        f"--report_dir={tmp_path}",
        sbatch=["--nodes=2"],
    )
    fields, output = wait(job_id, tmp_path)
    # named after the job and its first start: another job of the same id (a controller reset) had others
    (path,) = [path for path in tmp_path.glob(f"benchmark_{job_id}_*.yaml") if "_rank" not in path.name]
    report = yaml.safe_load(path.read_text())
    assert report["world"]["ranks"] == 4 and report["world"]["nodes"] == 2, output
    assert "skipped" not in report["links"] and report["links"]["pairs"], report["links"]
    # both "nodes" share this machine's two cores, so their CPU figures may differ by more than 10%: that
    # warns, it never fails, and the job goes on to train
    assert report["verdict"] in ("pass", "warn"), report["checks"]
    assert not [c for c in report["checks"] if c["status"] == "fail"], report["checks"]
    assert fields["ExitCode"] == "0:0", output
    assert "intra_node" in report["nccl"] and report["links"]["one_rank_per_node"]["ranks"] == 2
    assert {p.name for p in tmp_path.glob(f"{path.stem}_rank*.yaml")} == {
        f"{path.stem}_rank0.yaml",
        f"{path.stem}_rank2.yaml",
    }
    assert json.loads(path.with_name(f"{path.stem}.outcome.json").read_text())["verdict"] == report["verdict"]
    # the picture beside the report, printed on the job's last lines
    from matplotlib.image import imread

    assert f"picture: {path.with_suffix('.png')}" in output
    assert imread(path.with_suffix(".png")).shape == (960, 1280, 4)


MAX_STEPS = 40


@pytest.fixture(scope="module")
def time_limit_job(cluster, tmp_path_factory):
    """A 2-node training job that reaches its time limit, checkpoints, requeues and finishes:
    (job id, its fields, its output, its folder)."""
    # slurmctld checks time limits every 30 s and sends --signal at the first check at most 30 s before it
    # is due: due 60 s into this run, it comes 30-60 s in, and training starts ~12-25 s in. So that it
    # lands mid-training on a fast or a slow machine, the test pauses training (SIGSTOP) after step 3 until
    # the batch script has the signal, like a long run would still be training. The job asks rank 0 to stop
    # by a file; train.py tells the other ranks, on both nodes. A lead of 60 s leaves a busy machine time to
    # stop and checkpoint, and stays under the share of the limit that the job takes for a mistake (a lead
    # longer than the limit allows, tests/test_job_stops.py).
    tmp_path = tmp_path_factory.mktemp("time_limit")
    job_id = submit(
        "slurm_submit.sh",
        tmp_path,
        *TINY,
        f"--max_steps={MAX_STEPS}",
        "--checkpoint_every=1000",
        f"--log_dir={tmp_path}/logs",
        f"--checkpoint_dir={tmp_path}/ckpt",
        sbatch=["--nodes=2", "--time=2", "--signal=B:USR1@60"],
        SKIP_BENCHMARK="1",
    )
    paused = {"pids": [], "done": False}

    def pause_until_signalled(fields):
        signalled = "SIGUSR1" in log(tmp_path, job_id)
        if paused["pids"] and signalled:
            for pid in paused["pids"]:
                os.kill(pid, signal.SIGCONT)
            paused["pids"], paused["done"] = [], True
        elif not paused["done"] and not signalled and len(metrics(tmp_path / "logs")) >= 3:
            paused["pids"] = training_processes(job_id)
            for pid in paused["pids"]:
                os.kill(pid, signal.SIGSTOP)
        # The requeued run would get the same early SIGUSR1 and requeue again; a longer limit lets it
        # finish, as a real job's next run would.
        if fields["Restarts"] == "1" and fields["TimeLimit"] == "00:02:00":
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=5"], check=True)

    fields, output = wait(job_id, tmp_path, on_poll=pause_until_signalled)
    return job_id, fields, output, tmp_path


def test_training_across_two_nodes_writes_a_checkpoint(time_limit_job):
    """The time-limit job is a training job on two nodes too, one that also had to requeue."""
    job_id, fields, output, tmp_path = time_limit_job
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", output
    assert f"job {job_id} on n1 n2" in output and "world_size=4" in output, output
    assert metrics(tmp_path / "logs")[-1]["step"] == MAX_STEPS
    assert list((tmp_path / "ckpt").glob(f"*/step_{MAX_STEPS}")), output


def test_time_limit_checkpoints_requeues_and_resumes(time_limit_job):
    job_id, fields, output, tmp_path = time_limit_job
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", output
    assert fields["Restarts"] == "1", f"no requeue: did training end before SIGUSR1 came?\n{output}"
    resumed = re.search(r"^resumed from.*\bstep[_ ](\d+)", output, re.M)
    assert re.search(r"^stopped by signal", output, re.M) and resumed, output
    step = int(resumed.group(1))
    assert 0 < step < MAX_STEPS and list((tmp_path / "ckpt").glob(f"*/step_{step}")), output
    assert "SLURM_RESTART_COUNT=1" in output and f"requeueing job {job_id}" in output, output
    assert "SKIP_BENCHMARK=1: skipping the benchmarks" in output and "phase 1" not in output, output
    assert metrics(tmp_path / "logs")[-1]["step"] == MAX_STEPS
    ledger = goodput(tmp_path / "logs")  # the time between the two launches is the wait for the requeue
    assert ledger["launches"] == 2 and ledger["waiting_s"] > 0, ledger


@pytest.mark.parametrize(
    "scancel, said",
    [
        (["--signal=TERM"], "a stop signal to the training processes"),  # the job's steps, not the job
        (["--signal=TERM", "--batch"], "SIGTERM"),  # the job alone: it asks its workers to stop
    ],
    ids=["the training processes", "the job"],
)
def test_scancel_ends_the_job_once_saved_with_no_restart(cluster, tmp_path, scancel, said):
    """SIGTERM to one side of the job: the training processes save and torchrun exits 1, which is no crash,
    and the job ends in one line. (A cancel sends it to both, and SIGKILL KillWait later, 5 s here.)"""
    job_id = submit(
        "slurm_submit.sh",
        tmp_path,
        *TINY,
        "--max_steps=100000",
        f"--log_dir={tmp_path}/logs",
        f"--checkpoint_dir={tmp_path}/ckpt",
        sbatch=["--nodes=2"],
        NPROC_PER_NODE="1",
        SKIP_BENCHMARK="1",
    )
    signalled = []

    def scancel_once_training(fields):
        if not signalled and len(metrics(tmp_path / "logs")) >= 3:
            subprocess.run(["scancel", *scancel, job_id], check=True)
            signalled.append(job_id)

    fields, output = wait(job_id, tmp_path, on_poll=scancel_once_training)
    assert signalled and fields["Restarts"] == "0" and fields["JobState"] == "FAILED", output
    assert output.count("phase 2: train.py") == 1 and "restarting in place" not in output, output
    stops = re.findall(r"^stopped by signal after step (\d+)", output, re.M)
    assert len(stops) == 1 and list((tmp_path / "ckpt").glob(f"*/step_{stops[0]}")), output
    assert re.search(
        rf"^\d\d:\d\d:\d\d stopped by {said}: training exited \(status 1\) and is not restarted; to "
        r"resume, launch again with --run_name=\S+$",
        output,
        re.M,
    ), output


def test_impossible_node_count_is_rejected_at_submission(cluster):
    out = subprocess.run(
        ["sbatch", "--nodes=4", "slurm_submit.sh"], cwd=REPO, env=ENV, capture_output=True, text=True
    )
    # slurmctld words the refusal by whichever limit it checks first (node count or processors)
    assert out.returncode != 0 and "Batch job submission failed" in out.stderr, out.stderr
    assert not re.search(r"Submitted batch job", out.stdout)


def test_failed_benchmark_stops_the_job_before_training(cluster, tmp_path):
    # on one node (sbatch overrides the script's 2); bad benchmark input is refused by benchmark.py's own
    # check on one node, in one line, before torchrun starts anywhere
    job_id = submit(
        "slurm_submit.sh",
        tmp_path,
        f"--log_dir={tmp_path}/logs",
        sbatch=["--nodes=1"],
        BENCHMARK_ARGS=f"--only=nonsense --report_dir={tmp_path}",
    )
    fields, output = wait(job_id, tmp_path)
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "2:0", output
    assert fields["NumNodes"] == "1" and f"job {job_id} on n1:" in output, output
    assert "error: --only: unknown section 'nonsense'" in output and "phase 1" not in output, output
    assert "error: not started: benchmark.py refused its options (above)" in output, output
    # the options' check made the log folder, as it checks it can write there: nothing more
    assert "phase 2" not in output and not list((tmp_path / "logs").iterdir()), output
    assert "leaving out" not in output and fields["Restarts"] == "0", output  # bad input blames no node


def test_a_training_option_error_stops_the_job_in_one_line_before_the_benchmarks(cluster, tmp_path):
    job_id = submit(
        "slurm_submit.sh", tmp_path, "--batch_sise=4", f"--log_dir={tmp_path}/logs", sbatch=["--nodes=1"]
    )
    fields, output = wait(job_id, tmp_path)
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "2:0", output
    assert output.count("error: unknown option --batch_sise; did you mean --batch_size?") == 1, output
    assert "phase 1" not in output and "leaving out" not in output and fields["Restarts"] == "0", output
    assert not excluded_nodes(tmp_path / "logs") and not list(tmp_path.glob("logs/*/suspects/*")), output


# The requeued job starts without n3, or, when SLURM allocates it again, runs on the other two
ON_N1_N2 = r"job {job_id} on n1 n2:|running on n1 n2 alone: this job left out n3 before"
ON_N7_N9 = r"job {job_id} on n7 n9:|running on n7 alone: this job left out n8 before"


def test_a_node_failing_the_benchmark_is_left_out_before_any_training_step(cluster, tmp_path):
    """n3 fails the benchmark of n1, n2 and n3, the whole partition: a requeue could have no more nodes than
    the two left, so the job goes on here without it, and benchmarks n1 and n2 again before training."""
    job_id = submit(
        "slurm_submit.sh",
        tmp_path,
        *TINY,
        "--global_batch_size=6",  # world size 3, then 2
        "--max_steps=3",
        f"--log_dir={tmp_path}/logs",
        f"--checkpoint_dir={tmp_path}/ckpt",
        sbatch=["--nodes=2-3"],
        NPROC_PER_NODE="1",
        REHEARSE_BAD_NODES="n3",
        BENCHMARK_ARGS=f"--only=cpu --report_dir={tmp_path}",
    )
    fields, output = wait(job_id, tmp_path)
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "0", output
    first, again = output.split("benchmarking n1 n2 again, without n3")
    assert "on n1 n2 n3:" in first and "phase 2" not in first and "leaving out n3" in first, output
    assert "the job's partition has 2 nodes usable besides those it left out" in first, output
    # the two nodes share this machine's cores: CPU figures may differ by more than 10%, which only warns
    assert re.search(r"verdict: (pass|warn)", again) and "world_size=2" in again, output
    assert list(excluded_nodes(tmp_path / "logs")) == ["n3"], output
    assert re.match(
        r"benchmark: cpu on node\d \(n3\): REHEARSE_BAD_NODES", excluded_nodes(tmp_path / "logs")["n3"]
    )
    assert [r["step"] for r in metrics(tmp_path / "logs") if "loss" in r] == [1, 2, 3], output


def test_a_node_left_out_before_stays_out_when_slurm_allocates_it_again(cluster, tmp_path):
    """SLURM may refuse a requeued job's ExcNodeList while the job completes, and start it on n3 again; the
    job's comment, which slurm_submit.sh set before the requeue, keeps the run on the other two nodes."""
    job_id = submit(
        "slurm_submit.sh",
        tmp_path,
        *TINY,
        "--max_steps=2",
        f"--log_dir={tmp_path}/logs",
        f"--checkpoint_dir={tmp_path}/ckpt",
        sbatch=["--nodes=3", "--comment=left_out=n3"],
        NPROC_PER_NODE="1",
        SKIP_BENCHMARK="1",
    )
    fields, output = wait(job_id, tmp_path)
    assert fields["JobState"] == "COMPLETED", output
    assert f"job {job_id} on n1 n2 n3:" in output, output
    assert re.search(ON_N1_N2.format(job_id=job_id), output) and "world_size=2" in output, output
    assert [r["step"] for r in metrics(tmp_path / "logs") if "loss" in r] == [1, 2], output


def test_more_bad_nodes_than_the_cap_stop_the_job_in_one_line(cluster, tmp_path):
    job_id = submit(
        "slurm_submit.sh",
        tmp_path,
        f"--log_dir={tmp_path}/logs",
        sbatch=["--nodes=3"],
        NPROC_PER_NODE="1",
        REHEARSE_BAD_NODES="n2,n3",
        MAX_EXCLUDED_NODES="1",
        BENCHMARK_ARGS=f"--only=cpu --report_dir={tmp_path}",
    )
    fields, output = wait(job_id, tmp_path)
    assert fields["JobState"] == "FAILED" and fields["Restarts"] == "0", output
    line = re.findall(
        r"^error: stopping: 2 bad nodes, more than MAX_EXCLUDED_NODES=1: n2 \(.*\); n3 \(.*$", output, re.M
    )
    assert len(line) == 1 and "phase 2" not in output, output
    assert list(excluded_nodes(tmp_path / "logs")) == ["n2", "n3"], output


@pytest.fixture(scope="module")
def recoveries(cluster, tmp_path_factory):
    """The two recovery jobs and the uninterrupted run, started together and watched in the background, so
    that the minutes they mostly wait pass beside the module's other tests: futures of recovery_job's
    results ("spare", "tight"), and the uninterrupted run's losses by step ("reference")."""
    spare, tight, reference = (tmp_path_factory.mktemp(name) for name in ("spare", "tight", "reference"))

    def uninterrupted():
        result = launch("train.py", [*RECOVERED, f"--log_dir={reference}", f"--checkpoint_dir={reference}"])
        assert result.returncode == 0, result.stderr[-3000:]
        return {r["step"]: r["loss"] for r in metrics(reference) if "loss" in r}

    pool = ThreadPoolExecutor(3)
    yield {
        "spare": pool.submit(
            recovery_job, spare, "spare", 3, "n5", "n5", SPARE_NODES="1",
            BENCHMARK_ARGS=f"--only=cpu --report_dir={spare}",
        ),
        "tight": pool.submit(
            recovery_job, tight, "tight", 2, "n7", "n8", SPARE_NODES="0", SKIP_BENCHMARK="1"
        ),
        "reference": pool.submit(uninterrupted),
    }  # fmt: skip
    pool.shutdown(cancel_futures=True)


@pytest.fixture(scope="module", autouse=True)
def recoveries_start_first(request):
    """When a recovery test is selected, its jobs start with the module's first test."""
    if any(item.name.startswith("test_recovery_") for item in request.session.items):
        request.getfixturevalue("recoveries")


def test_recovery_with_a_spare_restarts_in_place_then_swaps_the_spare_in(recoveries):
    """SPARE_NODES=1 in a job of 3 nodes: training on n4 and n5, n6 kept ready. A rank on n5 SIGKILLed: the
    benchmark finds n4 and n5 healthy, and training restarts in place. n5 frozen: its heartbeat falls
    silent, the job ends the launch and trains on n4 and n6. No requeue; the uninterrupted run's losses."""
    job_id, fields, output, hurt = recoveries["spare"].result()
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "0", output
    assert len(hurt.failures) == 2 and len(hurt.stopped) >= 2, output  # n5's torchrun and its worker
    assert "training on 2 nodes, n6 kept as spare (SPARE_NODES=1)" in output, output
    assert "a rank crashed (training exited with status 1, no node named): benchmarking its nodes" in output
    assert (
        "restarting in place on n4 n5 (the benchmark passed them): restart 1 of at most MAX_RESTARTS=3"
        in (output)
    )
    assert re.search(
        r"a node fell silent: n5 \(rank \d sent no heartbeat for \d+ s\), and the launch goes", output
    )
    assert "training on n4 n6, with the spare n6 (0 spares left)" in output, output
    print(f"spare: from the kill, then the freeze, to the next step: {hurt.to_next_step()} s")
    ledger = assert_recovered(hurt.log_dir, recoveries["reference"].result(), output)
    print(f"spare: recoveries {json.dumps(ledger['recoveries'])}")
    crash, silent = ledger["recoveries"]
    assert (crash["cause"], crash["action"], silent["cause"], silent["action"]) == (
        "crash", "in place", "silent node", "spare n6 for n5"
    ), ledger["recoveries"]  # fmt: skip
    assert list(silent["nodes"]) == ["n5"], silent
    check_s = seconds_between(output, "benchmarking its nodes", "restarting in place on n4 n5")
    assert_prompt(crash, hurt.to_next_step()[0], check_s + 1)  # +1: the log's clock counts whole seconds
    assert_prompt(silent, hurt.to_next_step()[1])
    assert re.search(r"effective training time .*; 2 recoveries cost \d+ s: detection", output), output


def test_recovery_without_a_spare_restarts_in_place_then_requeues_without_the_frozen_node(recoveries):
    """SPARE_NODES=0 in a job of 2 nodes, its partition of 3: a rank on n7 (the rendezvous' host) SIGKILLed,
    and training restarts in place (SKIP_BENCHMARK=1: with no check); n8 frozen, and the job requeues
    without it, to resume on the other nodes with the uninterrupted run's losses."""
    job_id, fields, output, hurt = recoveries["tight"].result()
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", output
    assert "restarting in place on n7 n8 (no check (SKIP_BENCHMARK=1)): restart 1 of at most" in output
    assert re.search(
        r"a node fell silent: n8 \(rank \d sent no heartbeat for \d+ s\), and the launch goes", output
    )
    first, requeued = output.split(f"requeueing job {job_id}")
    # SLURM may refuse the requeued job's ExcNodeList while the job completes and start it on n8 again: the
    # job's comment then keeps the run off n8, on n7 alone (its losses equal the reference's all the same)
    assert re.search(ON_N7_N9.format(job_id=job_id), requeued), output
    assert ("world_size=1" if "alone" in requeued else "world_size=2") in requeued, output
    print(f"tight: from the kill, then the freeze, to the next step: {hurt.to_next_step()} s")
    ledger = assert_recovered(hurt.log_dir, recoveries["reference"].result(), output)
    print(f"tight: recoveries {json.dumps(ledger['recoveries'])}")
    crash, silent = ledger["recoveries"]
    assert (crash["action"], silent["action"]) == ("in place", "requeue"), ledger["recoveries"]
    assert_prompt(crash, hurt.to_next_step()[0])
    assert silent["detection_s"] <= 60 and silent["teardown_s"] <= 30, silent  # its waiting is the queue
