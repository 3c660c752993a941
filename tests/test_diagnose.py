"""When a run misbehaves: the watchdog names a hang, stragglers are named during training, the profiler
writes a trace; the flight recorder's variables and the process-group timeouts, which need NCCL to act,
are checked in-process."""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import (
    BLAMED,
    REPO,
    TINY,
    launch,
    parse_options,
    read_metrics,
    torchrun_command,
    validated,
    worker_pids,
)

import train as train_script
from common import stragglers
from run import options
from run.health import watchdog
from run.health.stragglers import Stragglers
from run.job import heartbeats
from run.prediction import live, step_time
from run.prediction.step_time import Prediction

HOST = socket.gethostname()


def test_ranks_above_the_median_are_named_with_their_figure():
    names = ["a:0", "a:1", "b:0", "b:1"]
    medians, named = stragglers.slower_than_peers(names, [(1.0, 0.01), (1.05, 0.01), (1.3, 0.01), (0.9, 0.4)])
    assert medians == pytest.approx({"compute_s": 1.025, "data_wait_s": 0.01})
    assert named == {"b:0": {"compute_s": 1.3}, "b:1": {"data_wait_s": 0.4}}  # a:1 is 2% above: not named
    # Data waits of microseconds, one of them twice the median: noise, not a straggler.
    assert stragglers.slower_than_peers(names, [(1.0, 1e-5), (1.0, 1e-5), (1.0, 3e-5), (1.0, 1e-5)])[1] == {}


def test_a_rank_named_three_windows_in_a_row_is_warned_once(capsys):
    stragglers = Stragglers(["n1:0", "n2:0"])
    slow, even = [[10.0, 0.1], [20.0, 0.1]], [[10.0, 0.1], [10.0, 0.1]]
    for timings in (slow, slow, even, slow, slow):  # an even window breaks the streak
        record = stragglers.log_window(timings, steps=10)
    assert record["stragglers"] == {"n2:0": {"compute_s": 2.0}} and record["compute_s"] == pytest.approx(1.5)
    assert capsys.readouterr().out == ""
    stragglers.log_window(slow, steps=10)
    stragglers.log_window(slow, steps=10)
    warnings = capsys.readouterr().out.splitlines()
    assert len(warnings) == 1 and "n2:0 has been a straggler for 3 log windows in a row" in warnings[0]
    assert "sbatch --exclude=n2 slurm_submit.sh" in warnings[0]


def test_a_node_named_the_straggler_n_windows_in_a_row_is_excluded_once(capsys):
    excluded = []
    stragglers = Stragglers(["n1:0", "n2:0"], exclude_after=4, exclude=lambda *why: excluded.append(why))
    slow = [[10.0, 0.1], [20.0, 0.1]]
    for _ in range(3):
        stragglers.log_window(slow, steps=10)
    assert excluded == [] and "the job leaves its node out after 4 in a row" in capsys.readouterr().out
    for _ in range(3):
        stragglers.log_window(slow, steps=10)
    assert excluded == [
        ("n2", "straggler: n2:0 4 log windows in a row, compute 2.000 s/step vs median 1.500")
    ]


def test_flight_recorder_is_on_and_users_settings_win(tmp_path):
    environ = {}
    watchdog.flight_recorder_env(environ, str(tmp_path))
    assert environ == {
        "TORCH_FR_BUFFER_SIZE": "20000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path}/flight_recorder/rank_",
    }
    assert (tmp_path / "flight_recorder").is_dir()
    users = {  # the variables' older names
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "500",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/scratch/fr_",
    }
    environ = dict(users)
    watchdog.flight_recorder_env(environ, str(tmp_path))
    assert environ == users


def test_process_group_timeouts_drop_after_the_first_step():
    from torch.distributed.device_mesh import init_device_mesh

    with tempfile.NamedTemporaryFile() as store_file:
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(store_file.name, 1),
            rank=0,
            world_size=1,
            timeout=watchdog.PG_TIMEOUT_FIRST_STEP,
        )
        try:
            # hybrid's two groups
            mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
            groups = [None, mesh.get_group(0), mesh.get_group(1)]

            def timeout(group):
                return (group or dist.group.WORLD)._get_backend(torch.device("cpu")).options._timeout

            watchdog.set_pg_timeouts(watchdog.PG_TIMEOUT, mesh)
            assert [timeout(g) for g in groups] == [watchdog.PG_TIMEOUT] * 3
            with watchdog.generous_pg_timeouts(mesh):  # a checkpoint being written
                assert [timeout(g) for g in groups] == [watchdog.PG_TIMEOUT_FIRST_STEP] * 3
            assert [timeout(g) for g in groups] == [watchdog.PG_TIMEOUT] * 3
        finally:
            dist.destroy_process_group()
    hang_minimum = timedelta(seconds=train_script.hang_minimum_s)
    assert watchdog.PG_TIMEOUT_FIRST_STEP > watchdog.PG_TIMEOUT > hang_minimum


@pytest.mark.parametrize("value", ["5", "8,5", "a,b", "0,3"])
def test_bad_profile_steps_is_one_line(value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_script.main([f"--profile_steps={value}", "--model=tiny"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --profile_steps={value}: expected two step numbers A,B with "
        f"1 <= A <= B, e.g. --profile_steps=5,8"
    )


def test_profile_steps_past_the_run_warn_and_the_trace_ends_with_it(tmp_path):
    args = [
        *TINY,
        "--profile_steps=3,900",
        "--max_steps=4",
        f"--log_dir={tmp_path}",
        f"--checkpoint_dir={tmp_path}",
    ]
    result = launch("train.py", [*args, "--run_name=p"], nproc=0)
    assert result.returncode == 0, result.stderr[-2000:]
    warning = (
        "warning: --profile_steps=3,900 ends after --max_steps=4: the trace ends with the run's last step"
    )
    assert warning in result.stderr
    trace = tmp_path / "p" / f"trace_steps_3-4_{HOST}_rank0.pt.trace.json"
    assert f"profile: steps 3 to 4 traced in {trace}" in result.stdout
    names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
    assert {"train step 3", "train step 4"} <= names


# Each layer forward's delay on the straggler: its compute at least 0.3 s a step against the others' 0.02 s
# (0.1 s on a busy machine), so that it stands out in every log window, and steps of about 0.4 s.
SLOW_LAYER_S = 0.15


def slow_run(folder, max_steps):
    """The options of the run below, with its logs and checkpoints in folder."""
    return [*TINY, f"--log_dir={folder}", f"--checkpoint_dir={folder}", "--run_name=slow",
            f"--max_steps={max_steps}", "--seq_length=64", "--log_every=2", "--checkpoint_every=3",
            "--hang_minimum_s=6", "--hang_factor=4", "--profile_steps=2,3", "--predict=True"]  # fmt: skip


# The prediction the run below holds its steps against, kept in its log folder as a first launch keeps one:
# a step of a millisecond, below any this run takes whatever the machine's load (a probe on a busy machine may
# be refused), so that the tests read how the live step is held against it.
KEPT_STEP_S, KEPT_LAYER_FORWARD_S = 1e-3, 1e-4


def keep_a_prediction(folder):
    """A prediction kept for the run of slow_run(folder), as its first launch would keep one."""
    cfg = parse_options(slow_run(folder, max_steps=60))
    validated(cfg)
    holds_for = live.holds_for(cfg, options.names_the_run(), torch.device("cpu"), 2, 2)
    source = "this run's own CPU (2 ranks)"
    prediction = Prediction(KEPT_STEP_S, KEPT_STEP_S, KEPT_STEP_S, "measured", source, 1,
                            layer_forward_s=KEPT_LAYER_FORWARD_S)  # fmt: skip
    (folder / "slow").mkdir(parents=True, exist_ok=True)
    step_time.keep(folder / "slow", prediction, holds_for)


@pytest.fixture(scope="module")
def slow_then_stopped(tmp_path_factory):
    """One 2-process run in two acts, which the tests below read. Rank 1 is a straggler: each of its layers'
    forwards takes SLOW_LAYER_S longer (tests/slow_rank/); log windows are 2 steps. After step 8, once the run
    has warned that its steps are slower than predicted, at a step it does not checkpoint after, rank 1 is
    stopped, and rank 0 waits in a collective until its watchdog (limit max(6 s, 4 x median step)) ends the
    run. Rank 0 also profiles steps 2 and 3."""
    tmp_path = tmp_path_factory.mktemp("slow")
    keep_a_prediction(tmp_path)
    hook = str(Path(__file__).parent / "slow_rank")  # before the user's own PYTHONPATH, which it keeps
    path = os.pathsep.join(filter(None, [hook, os.environ.get("PYTHONPATH")]))
    slow_rank = {"PYTHONPATH": path, "SLOW_RANK": "1", "SLOW_LAYER_S": str(SLOW_LAYER_S)}
    process = subprocess.Popen(
        torchrun_command("train.py", slow_run(tmp_path, max_steps=60), 2),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **slow_rank},
    )
    output, stopped_at, reported_at, stopped_step = [], None, None, None
    try:
        for line in process.stdout:
            output.append(line)
            if line.startswith("time to first step"):
                rank1 = worker_pids(process.pid)[1]
            step = re.match(r"step +(\d+)/", line)
            warned = any(said.startswith("warning: steps take") for said in output)  # over 10 s of steps
            # not at a step the run checkpoints after: rank 0 would wait in the save, whose limit is 30 min
            if step and int(step[1]) >= 8 and int(step[1]) % 3 and warned and stopped_at is None:
                os.kill(rank1, signal.SIGSTOP)
                stopped_at, stopped_step = time.monotonic(), int(step[1])
            if line.startswith("no step for") and reported_at is None:
                reported_at = time.monotonic()
                os.kill(rank1, signal.SIGCONT)  # so that torchrun can end it at once
        process.wait(timeout=60)
    finally:
        process.kill()
    return SimpleNamespace(
        output=output, log="".join(output), folder=tmp_path, run=tmp_path / "slow",
        returncode=process.returncode, stopped_at=stopped_at, reported_at=reported_at,
        stopped_step=stopped_step,
    )  # fmt: skip


def watchdog_line(slow_then_stopped):
    line = r"^no step for (\d+) s on (\S+) rank 0; stacks in (\S+) \(limit (\d+) s\)"
    line += r"; waiting for (\S+) \((.*)\)$"
    report = re.search(line, slow_then_stopped.log, re.M)
    assert report, slow_then_stopped.log[-3000:]
    return report


def test_a_throttled_rank_is_named_the_straggler_in_every_log_window(slow_then_stopped):
    # The first window's one timed step, step 2, starts as the throttling does: it may name either rank.
    output = slow_then_stopped.output
    windows = [line for line in output if re.match(r"step +[468]/\d+ \|", line)]
    named = all(f"| straggler {HOST}:1: compute" in line for line in windows)
    assert len(windows) == 3 and named, slow_then_stopped.log[-3000:]
    assert f"{HOST}:0" not in "".join(output[output.index(windows[0]) :])
    records = read_metrics(slow_then_stopped.folder)[1:]  # up to the stop, once the run has warned
    assert len(records) >= 3 and all(list(r["stragglers"]) == [f"{HOST}:1"] for r in records), records
    assert all(r["stragglers"][f"{HOST}:1"]["compute_s"] > 1.1 * r["compute_s"] for r in records)


def test_a_throttled_rank_makes_the_step_slower_than_predicted_and_the_warning_names_its_compute(
    slow_then_stopped,
):
    """Rank 0 takes the prediction kept in the run's log folder; every window after the first holds the step
    against it, and the throttled rank's compute is the largest difference."""
    log = slow_then_stopped.log
    kept = r"^predicted step: 0.001 s \(measured on this run's own CPU \(2 ranks\)\) \(kept in the run's log "
    assert re.search(kept, log, re.M), log[:3000]
    held = re.findall(
        r"^step +[468]/60 \|.* \| ([\d.]+)x predicted \((\w[\w ]*) ([+-][\d.e-]+) s\)", log, re.M
    )
    assert len(held) == 3 and all(float(ratio) > live.SLOW_RATIO for ratio, _, _ in held), log[-3000:]
    warnings = re.findall(
        r"^warning: steps take ([\d.]+)x their predicted .* is (compute), .*\(slowest: (\S+),", log, re.M
    )
    assert warnings and all(where == f"{HOST}:1" for _, _, where in warnings), log[-3000:]
    ratios = [float(ratio) for ratio, _, _ in warnings]
    assert all(later > earlier + 0.25 for earlier, later in zip(ratios, ratios[1:]))  # again only if it grows
    records = read_metrics(slow_then_stopped.folder)
    assert all(record["vs_predicted"] > live.SLOW_RATIO for record in records[1:])
    assert "vs_predicted" not in records[0]
    # a prediction its run's steps contradict is not one for the next launch: dropped, once
    assert log.count("is no longer kept for later launches") == 1, log[-3000:]
    assert not (slow_then_stopped.run / step_time.KEPT).exists()


def test_a_relaunch_of_the_run_reads_the_prediction_its_first_launch_kept(slow_then_stopped, tmp_path):
    """A restart does not probe the step again (it would cost a recovery seconds to minutes): resumed from
    the hung run's last checkpoint, in a copy of its folder with its prediction kept again, it prints the
    prediction kept in the run's log folder, as the first launch did."""
    shutil.copytree(slow_then_stopped.folder, tmp_path, dirs_exist_ok=True)
    keep_a_prediction(tmp_path)  # the slow run dropped the one it was given: its steps contradicted it
    result = launch("train.py", slow_run(tmp_path, max_steps=slow_then_stopped.stopped_step + 1))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    kept = r"^(predicted step: .*) \(kept in the run's log folder by its launch of [\d-]+ [\d:]+\)$"
    first, again = re.search(kept, slow_then_stopped.log, re.M), re.search(kept, result.stdout, re.M)
    assert first and again and again[1] == first[1], result.stdout[:3000]
    assert "resumed from" in result.stdout, result.stdout[-3000:]


def test_a_straggler_three_windows_in_a_row_is_warned_of_once_with_the_command_that_leaves_it_out(
    slow_then_stopped,
):
    assert (
        slow_then_stopped.log.count(f"warning: {HOST}:1 has been a straggler for 3 log windows in a row") == 1
    )
    assert f"sbatch --exclude={HOST} slurm_submit.sh" in slow_then_stopped.log


def test_a_stopped_rank_ends_the_run_by_the_watchdog_naming_its_node_from_its_heartbeat(slow_then_stopped):
    report = watchdog_line(slow_then_stopped)
    assert report[2] == HOST and report[3] == str(slow_then_stopped.run / f"stacks_{HOST}_rank0.txt")
    assert report[5] == HOST and re.fullmatch(BLAMED.format(rank=1), report[6]), report[0]
    assert slow_then_stopped.returncode != 0


def test_the_watchdog_ends_a_hang_within_its_limit_and_the_heartbeat_silence(slow_then_stopped):
    report = watchdog_line(slow_then_stopped)
    limit, waited = int(report[4]), slow_then_stopped.reported_at - slow_then_stopped.stopped_at
    assert 6 <= limit <= int(report[1]) and waited < limit + heartbeats.SILENT_S + 2 * heartbeats.HEARTBEAT_S


def test_the_goodput_ledger_counts_a_hang_as_stalled(slow_then_stopped):
    """From the ledger's last update (step 8's log window) to the watchdog's line."""
    limit = int(watchdog_line(slow_then_stopped)[4])
    assert json.loads((slow_then_stopped.run / "goodput.json").read_text())["stalled_s"] >= limit - 1


def test_the_stacks_of_a_hung_rank_show_its_training_thread_waiting_in_a_collective(slow_then_stopped):
    threads = (slow_then_stopped.run / f"stacks_{HOST}_rank0.txt").read_text().split("\n\n")
    main_thread = next(t for t in threads if re.search(r'train\.py", line \d+ in main', t))
    waits = re.search(r"in (all_reduce|all_gather|wait\w*|barrier)", main_thread)
    assert "torch/distributed/" in main_thread and waits


def test_a_hung_run_leaves_its_complete_checkpoints_and_nothing_half_written(slow_then_stopped):
    run, stopped = slow_then_stopped.run, slow_then_stopped.stopped_step
    saved = [f"step_{step}" for step in range(3, stopped + 1, 3)][-3:]  # --keep_last=3
    assert sorted(p.name for p in run.glob("step_*")) == sorted(saved), stopped
    assert all((run / name / "trainer_state.json").exists() for name in saved)


def test_profile_steps_trace_the_steps_asked_for(slow_then_stopped):
    trace_file = slow_then_stopped.run / f"trace_steps_2-3_{HOST}_rank0.pt.trace.json"
    events = json.loads(trace_file.read_text())["traceEvents"]
    assert {e["name"] for e in events if "train step" in e.get("name", "")} == {
        "train step 2",
        "train step 3",
    }
    assert f"profile: steps 2 to 3 traced in {trace_file}" in slow_then_stopped.log


def test_a_stop_signal_before_training_ends_the_processes_the_rank_forked():
    """As when SIGTERM comes while the tokenizer's workers (forked by datasets) run: the rank exits at once
    and its children end too, rather than running on, ignoring SIGTERM with the handler they inherited."""
    script = (
        "import multiprocessing, time\n"
        "from run import stops\n"
        "stops.StopSignals(stops.StopRequests())\n"
        "worker = multiprocessing.get_context('fork').Process(target=time.sleep, args=(120,))\n"
        "worker.start()\n"
        "print(worker.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    worker = int(process.stdout.readline())
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 128 + signal.SIGTERM

    def running():  # a zombie has ended: it waits for its new parent to reap it
        with contextlib.suppress(OSError):
            return Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        return False

    deadline = time.monotonic() + 10
    while running() and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = running()
    if alive:
        os.kill(worker, signal.SIGKILL)
    assert not alive, "the forked worker outlived its rank"
