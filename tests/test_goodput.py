"""Goodput: a run's ledger of where its time went, across launches (goodput.json), on real runs that are
killed, stopped and relaunched; and the checkpoint interval of --checkpoint_every=auto."""

import json
import re
import signal
import time

import pytest
from conftest import ODD, TINY, fill_disk, make_odd, run_training, run_until

from common.files import create_atomically
from run.progress import goodput

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
    the SIGKILL, the job's part of the recovery (run/job/) is in the run folder, as the job leaves it, and
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


def test_a_ledger_that_cannot_be_replaced_warns_once_and_leaves_no_temporary_file(
    tmp_path, small_disks, capsys
):
    """Where the ledger's path is a folder, or its disk is full, the run goes on without it: one warning, and
    no goodput.json.<pid>.tmp left beside it (the rename or the write failed, and the temporary file
    stayed)."""
    blocked, full = tmp_path, small_disks(1)
    ledgers = {folder: goodput.Ledger(str(folder), time.time()) for folder in (blocked, full)}
    (blocked / goodput.LEDGER).mkdir()  # once read: a folder read back as the ledger is set aside
    fill_disk(full)
    for folder, why in (blocked, "Is a directory"), (full, "No space left on device"):
        for _ in range(2):
            ledgers[folder].write()
        assert capsys.readouterr().err.splitlines() == [
            f"warning: cannot write {folder / goodput.LEDGER} ({why}); training goes on without it"
        ]
        assert not list(folder.glob("*.tmp")), list(folder.iterdir())
    with pytest.raises(OSError):  # the benchmark's reports are created the same way
        create_atomically(full / "report.yaml", "verdict: pass\n" * 1000)
    assert sorted(path.name for path in full.iterdir()) == ["filler"]


def earlier_ledger(folder, change):
    """An earlier launch's ledger at step 4 with a checkpoint at step 2, changed by change(figures)."""
    ledger = goodput.Ledger(str(folder), time.time() - 100)
    for step in range(1, 5):
        ledger.step_done(step, 1.0)
        if step == 2:
            with ledger.checkpoint(step):
                pass
    ledger.write()
    figures = json.loads((folder / goodput.LEDGER).read_text())
    change(figures)
    (folder / goodput.LEDGER).write_text(json.dumps(figures))  # NaN as json.dumps writes it
    return (folder / goodput.LEDGER).read_text()


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda f: f.update(productive_s=float("nan")), "productive_s is nan, not a finite number 0 or more"),
        (lambda f: f.update(lost_s=-5.0), "lost_s is -5.0, not a finite number 0 or more"),
        (lambda f: f.update(eval_s=1e300), "eval_s is 1e+300 s, longer than the run's 100 s"),
        (lambda f: f.update(launches=1.5), "launches is 1.5, not a whole number 0 or more"),
        (lambda f: f["marks"].update(at_checkpoint=5), "marks.at_checkpoint is 5, not a record of steps"),
        (lambda f: f["marks"].update(step="4"), 'marks.step is "4", not a step number'),
        (
            lambda f: f["marks"]["at_checkpoint"].update(two=3.0),
            "marks.at_checkpoint has 'two', not a step number",
        ),
        (
            lambda f: f["marks"].update(updated=float("inf")),
            "marks.updated is inf, not a finite number 0 or more",
        ),
        (lambda f: f.pop("marks"), "no 'marks'"),
    ],
)
def test_a_damaged_ledger_is_set_aside_with_one_warning_and_the_account_starts_again(
    tmp_path, capsys, change, why
):
    """A figure that is not a finite number of seconds (NaN, negative, longer than the run) was carried on
    into every later figure; a mark of the wrong kind crashed every relaunch at its first step."""
    damaged = earlier_ledger(tmp_path, change)
    capsys.readouterr()
    ledger = goodput.Ledger(str(tmp_path), time.time() - 10)
    ledger.step_done(3, 1.0)  # the relaunch resumes from the checkpoint at step 2
    ledger.write()
    [aside] = tmp_path.glob("goodput.damaged_*.json")
    assert capsys.readouterr().err.splitlines() == [
        f"warning: {tmp_path / goodput.LEDGER} is damaged ({why}); set aside as {aside}, and the run's time "
        "is counted from this launch"
    ]
    assert aside.read_text() == damaged  # kept as it was, for whoever looks into it
    figures = json.loads((tmp_path / goodput.LEDGER).read_text())
    assert figures["launches"] == 1 and figures["lost_steps"] == 0
    assert_adds_up(figures)


@pytest.mark.parametrize("value", ["nan", "-3", "1e400", "seven", ""])
def test_a_benchmark_time_that_is_not_a_number_of_seconds_is_left_out_with_one_warning(
    monkeypatch, capsys, value
):
    monkeypatch.setenv("BENCHMARK_SECONDS", value)
    assert goodput.benchmark_seconds(master=True) == 0.0
    assert goodput.benchmark_seconds(master=False) == 0.0  # the other ranks say nothing
    assert capsys.readouterr().err.splitlines() == [
        f"warning: BENCHMARK_SECONDS={value!r} is not a number of seconds; the benchmarks' time is left out "
        "of goodput.json"
    ]
    monkeypatch.setenv("BENCHMARK_SECONDS", "7.0")  # as the job writes it
    assert goodput.benchmark_seconds(master=True) == 7.0
    assert capsys.readouterr().err == ""


def test_an_intact_ledger_is_carried_on(tmp_path, capsys):
    earlier_ledger(tmp_path, lambda figures: None)
    ledger = goodput.Ledger(str(tmp_path), time.time() - 10)
    ledger.step_done(3, 1.0)  # the step after the checkpoint at step 2: step 3 and 4 are lost
    ledger.write()
    figures = json.loads((tmp_path / goodput.LEDGER).read_text())
    assert figures["launches"] == 2 and figures["lost_steps"] == 2 and capsys.readouterr().err == ""


def test_a_launch_that_dies_before_its_first_log_window_still_counts(tmp_path):
    """The second launch stops before its first step (it is refused when it loads the checkpoint: another
    model family under the same run name); the ledger was written as it started, so it counts."""
    run_training(tmp_path, *RUN, "--max_steps=2", nproc=0)
    refused = run_training(tmp_path, *RUN, "--max_steps=4", "--model=tiny-llama", nproc=0, expect_ok=False)
    assert refused.returncode == 2 and "holds a GPT2Config model" in refused.stderr, refused.stderr[-3000:]
    assert "step      3/" not in refused.stdout
    after = ledger(tmp_path)
    assert after["launches"] == 2 and after["marks"]["step"] == 2
    assert_adds_up(after)


def test_a_damaged_recovery_file_goes_unrecorded_with_a_warning(tmp_path, capsys):
    """The job's part of a recovery, torn: the launch's ledger says so once and counts its time as ever."""
    (tmp_path / goodput.RECOVERY).write_text('{"cause": "crash", "failed_at": ')
    ledger = goodput.Ledger(str(tmp_path), goodput.launch_start())
    ledger.step_done(1, 0.1)
    ledger.write()
    assert json.loads((tmp_path / goodput.LEDGER).read_text())["recoveries"] == []
    assert f"warning: {tmp_path / goodput.RECOVERY} is unreadable (" in capsys.readouterr().err


def job_recovery(change):
    """The job's part of a recovery in place, 30 s ago, as goodput.write_recovery writes it, changed."""
    now = time.time()
    recovery = {"cause": "crash", "nodes": {}, "action": "in place", "failed_at": now - 30,
                "detected_at": now - 20, "ended_at": now - 10}  # fmt: skip
    change(recovery)
    return recovery


@pytest.mark.parametrize(
    "change, why",
    [
        (lambda r: r.pop("cause"), "its cause is null, not text"),
        (lambda r: r.update(relaunched_at="soon"), 'its relaunched_at is "soon", not a number'),
        (lambda r: r.update(failed_at=float("nan")), "its failed_at is nan, not a finite number 0 or more"),
        (
            lambda r: r.update(nodes=[["n1", "hang"]]),
            'its nodes are [["n1", "hang"]], not a record of node: why',
        ),
        (
            lambda r: r.update(ended_at=1e300),
            "its ended_at is 1000000000000000052504760255204420248704468581108",
        ),
    ],
)
def test_a_recovery_with_a_damaged_field_is_set_aside_with_one_warning_and_the_launch_goes_on(
    tmp_path, capsys, change, why
):
    """Without its cause, or with a text relaunched_at, it crashed every launch at its first step (KeyError,
    TypeError); a NaN was carried into every later summary."""
    path = tmp_path / goodput.RECOVERY
    path.write_text(json.dumps(job_recovery(change)))
    ledger = goodput.Ledger(str(tmp_path), time.time() - 5)
    ledger.step_done(1, 0.1)
    ledger.write()
    assert ledger.recoveries == [] and "cost" not in ledger.summary()
    [aside] = tmp_path.glob("recovery.damaged_*.json")
    [warning] = capsys.readouterr().err.splitlines()
    assert warning.startswith(f"warning: {path} is unreadable ({why}") and warning.endswith(
        f"; set aside as {aside}, and that recovery goes unrecorded"
    ), warning
    path.write_text(json.dumps(job_recovery(lambda r: r.update(relaunched_at=time.time() - 5))))
    ledger = goodput.Ledger(str(tmp_path), time.time() - 5)
    ledger.step_done(1, 0.1)
    assert [entry["cause"] for entry in ledger.recoveries] == ["crash"] and capsys.readouterr().err == ""


@pytest.mark.parametrize("kind", ODD)
@pytest.mark.parametrize("name", [goodput.RECOVERY, goodput.LEDGER])
def test_a_recovery_or_ledger_that_is_not_a_regular_file_is_set_aside_unread(
    tmp_path, capsys, kind, name, deadline
):
    """A FIFO hung the launch with no message; a link to /dev/zero read until memory ran out."""
    words = make_odd(tmp_path / name, kind)
    ledger = goodput.Ledger(str(tmp_path), time.time() - 5)
    ledger.step_done(1, 0.1)
    ledger.write()
    [warning] = capsys.readouterr().err.splitlines()
    assert f"({tmp_path / name} {words}" in warning and "; set aside as " in warning, warning
    assert json.loads((tmp_path / goodput.LEDGER).read_text())["launches"] == 1


def test_recoveries_and_parts_that_do_not_add_up_are_left_out_of_the_account(tmp_path, capsys):
    """A NaN recovery was carried into every later summary; parts adding up to more than the run's wall time
    printed percentages summing to 169%."""

    def with_bad_recovery(figures):
        good = {part: 1.0 for part in (*goodput.RECOVERY_PARTS, "cost_s")} | {"lost_steps": 0}
        figures["recoveries"] = [good, {**good, "cost_s": float("nan")}, {**good, "lost_steps": -1}]

    earlier_ledger(tmp_path, with_bad_recovery)
    capsys.readouterr()
    ledger = goodput.Ledger(str(tmp_path), time.time() - 10)
    assert len(ledger.recoveries) == 1 and "1 recovery cost 1 s" in ledger.summary()
    assert capsys.readouterr().err.splitlines() == [
        f"warning: {tmp_path / goodput.LEDGER}: 2 of its recoveries are damaged (its cost_s is nan, not a "
        "finite number 0 or more); they are left out of the run's account"
    ]
    # each part within the run's 100 s, together 120 s past it: only parts an hour past the run were damage
    parts = tmp_path / "parts"
    parts.mkdir()
    earlier_ledger(parts, lambda figures: figures.update(eval_s=60.0, checkpoint_s=60.0))
    ledger = goodput.Ledger(str(parts), time.time() - 10)
    assert ledger.totals["launches"] == 1 and list(parts.glob("goodput.damaged_*.json"))
    [warning] = capsys.readouterr().err.splitlines()
    damaged = re.escape(str(parts / goodput.LEDGER))
    assert re.fullmatch(
        rf"warning: {damaged} is damaged \(its parts add up to 2\d\d s, more than the run's 10\d s\); set "
        r"aside as .*goodput\.damaged_\w+\.json, and the run's time is counted from this launch",
        warning,
    ), warning


def test_parts_past_the_run_within_what_clocks_may_disagree_are_carried_on(tmp_path, capsys):
    """Launches on other nodes read other clocks: a ledger whose parts are 2 s past its 100 s is kept."""
    earlier_ledger(tmp_path, lambda figures: figures.update(eval_s=1.0, checkpoint_s=1.0))
    capsys.readouterr()
    ledger = goodput.Ledger(str(tmp_path), time.time() - 10)
    assert ledger.totals["launches"] == 2 and ledger.totals["eval_s"] == 1.0
    assert capsys.readouterr().err == "" and not list(tmp_path.glob("goodput.damaged_*.json"))
