"""Goodput: a run's ledger of where its time went, across launches (goodput.json), on real runs that are
killed, stopped and relaunched; and the checkpoint interval of --checkpoint_every=auto."""

import json
import re
import signal
import time

import pytest
from conftest import TINY, run_training, run_until

from run import goodput

RUN = [*TINY, "--seq_length=32", "--max_steps=16", "--checkpoint_every=5", "--run_name=g"]


def ledger(folder):
    return json.loads((folder / "g" / goodput.LEDGER).read_text())


def assert_adds_up(figures):
    parts = sum(figures[part] for part in goodput.PARTS)
    assert parts + figures["other_s"] == pytest.approx(figures["wall_s"])
    assert 0 <= figures["other_s"] <= 0.1 * figures["wall_s"], figures  # what no part names: logging
    assert figures["effective_training_time"] == pytest.approx(figures["productive_s"] / figures["wall_s"])


@pytest.mark.parametrize("number", [signal.SIGKILL, signal.SIGTERM])
def test_a_relaunch_counts_exactly_the_steps_it_lost(tmp_path, number):
    """SIGKILL between checkpoints loses the steps after the last; SIGTERM saves first and loses none. After
    the SIGKILL, the job's part of the recovery (run/job.py) is in the run folder, as the job leaves it, and
    the relaunch records the recovery whole."""
    args = [f"--checkpoint_dir={tmp_path}", *RUN]
    status, output = run_until(args, tmp_path, 7, number)
    assert status != 0, output
    before = ledger(tmp_path)
    reached = before["marks"]["step"]  # the last step the killed launch recorded
    assert reached >= 7
    if number == signal.SIGKILL:
        ended = time.time()
        goodput.write_recovery(tmp_path / "g", "crash", {}, "in place", ended - 3, ended - 1, ended)
        goodput.relaunching(tmp_path / "g")
    resumed = run_training(tmp_path, *RUN)
    checkpoint = int(re.search(r"resumed from \S+/step_(\d+) at step", resumed.stdout).group(1))
    after = ledger(tmp_path)
    assert after["launches"] == 2
    if number == signal.SIGKILL:
        assert checkpoint == 5
        assert after["lost_steps"] == reached - checkpoint > 0
        assert after["lost_s"] > 0
    else:
        assert checkpoint == reached
        assert after["lost_steps"] == 0 and after["lost_s"] == 0
    assert after["waiting_s"] > 0  # from the first launch's last update to the relaunch
    assert after["checkpoint_s"] > before["checkpoint_s"] > 0 and after["startup_s"] > before["startup_s"]
    assert_adds_up(after)
    [line] = [line for line in resumed.stdout.splitlines() if line.startswith("effective training time ")]
    assert line.startswith(f"effective training time {100 * after['effective_training_time']:.1f}%: lost ")
    if number == signal.SIGKILL:
        assert "% to restarts" in line
        (recovery,) = after["recoveries"]
        lost = reached - checkpoint
        assert (recovery["cause"], recovery["action"], recovery["lost_steps"]) == ("crash", "in place", lost)
        assert recovery["detection_s"] == pytest.approx(2) and recovery["teardown_s"] == pytest.approx(1)
        assert recovery["load_s"] > 0 and recovery["startup_s"] > 0 and recovery["lost_s"] == after["lost_s"]
        parts = sum(recovery[part] for part in goodput.RECOVERY_PARTS)
        assert recovery["cost_s"] == pytest.approx(parts)  # from the failure to the first step, and the lost
        cost, lost_s = f"{recovery['cost_s']:.0f}", f"{recovery['lost_s']:.0f}"
        said = rf"; 1 recovery cost {cost} s: detection 2 s, teardown 1 s, .*, lost steps {lost_s} s"
        said += rf" \({lost} steps\)$"
        assert re.search(said, line), line
        assert not (tmp_path / "g" / goodput.RECOVERY).exists()  # recorded once
    else:
        assert after["recoveries"] == []


def test_auto_interval_is_chosen_by_rank_0_and_followed_by_every_rank(tmp_path):
    """A failure every 3.6 s of one node makes the interval a few steps: both ranks save where rank 0 says."""
    result = run_training(
        tmp_path,
        *RUN,
        "--checkpoint_every=auto",
        "--node_mtbf_hours=0.001",
        "--max_steps=20",
        "--keep_last=0",
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("checkpoint interval: every ")]
    assert lines, result.stdout[-3000:]
    chosen = {int(re.search(r"every (\d+) steps", line).group(1)) for line in lines}
    saved = sorted(int(path.name[5:]) for path in (tmp_path / "g").glob("step_*"))
    periodic = [step for step in saved if step != 20]  # the last step is always saved
    assert len(periodic) >= 2
    # each save came at least the interval in force after the one before: the interval changes between
    # saves (step times vary), so a gap lies between the smallest and the largest interval chosen
    gaps = [later - earlier for earlier, later in zip(periodic, periodic[1:])]
    assert all(min(chosen) <= gap <= max(chosen) for gap in gaps), (saved, lines)
    assert_adds_up(ledger(tmp_path))


def test_a_damaged_recovery_file_goes_unrecorded_with_a_warning(tmp_path, capsys):
    """The job's part of a recovery, torn: the launch's ledger says so once and counts its time as ever."""
    (tmp_path / goodput.RECOVERY).write_text('{"cause": "crash", "failed_at": ')
    ledger = goodput.Ledger(str(tmp_path), goodput.launch_start())
    ledger.step_done(1, 0.1)
    ledger.write()
    assert json.loads((tmp_path / goodput.LEDGER).read_text())["recoveries"] == []
    assert f"warning: {tmp_path / goodput.RECOVERY} is unreadable (" in capsys.readouterr().err
