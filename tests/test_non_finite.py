"""Non-finite steps: a loss or gradient norm that is not finite skips the update, and a streak of them
stops the run in one line naming the last good checkpoint; the checkpoints saved since the update that broke
the weights are set aside, nothing holding them is saved or exported, and the stop's advice holds across
relaunches."""

import math
import os
import re
import subprocess

import pytest
from conftest import (
    REPO,
    TINY,
    assert_rank_0_failed_first_with_status_2,
    error_lines,
    launch,
    read_metrics,
    torchrun_command,
)


def steps_of(run_dir):
    return sorted(path.name for path in run_dir.glob("step_*"))


def test_non_finite_steps_are_skipped_then_stop(tmp_path):
    """An absurd learning rate blows the weights up after one update: every later loss is NaN. Step 1's
    checkpoint holds what that update made, and is set aside; no step after it is saved. With none left, the
    same --run_name starts again."""
    run = [
        f"--log_dir={tmp_path}",
        f"--checkpoint_dir={tmp_path}",
        *TINY,
        "--run_name=blown",
        "--max_steps=20",
    ]
    result = launch(
        "train.py",
        [*run, "--lr=1e30", "--min_lr=0", "--max_bad_steps=3", "--warmup_steps=0", "--checkpoint_every=1"],
    )
    assert_rank_0_failed_first_with_status_2(result)
    assert result.stdout.count("non-finite loss or gradient norm, update skipped") == 3
    assert result.stdout.count("checkpoint saved: ") == 1  # step 1's, before the first non-finite step
    (aside,) = (tmp_path / "blown").glob("nonfinite_*")
    assert error_lines(result.stderr) == [  # rank 0's line alone
        "error: stopping: 3 non-finite steps in a row from step 2 (lower --lr or raise --warmup_steps); "
        f"step_1, which holds the update that broke the weights, is set aside in {aside}; no checkpoint of "
        "this run is from before step 1's update: start again with the new options"
    ]
    assert steps_of(tmp_path / "blown") == [] and steps_of(aside) == ["step_1"]
    again = launch("train.py", [*run, "--max_steps=3"], nproc=0)
    assert again.returncode == 0 and "resumed from" not in again.stdout, again.stderr[-2000:]
    assert all(math.isfinite(record["loss"]) for record in read_metrics(tmp_path)[:3])


def test_a_non_finite_stop_sets_aside_what_it_rules_out_and_its_advice_holds_across_relaunches(tmp_path):
    """A healthy run to step 4, then a relaunch of it with an absurd --lr: step 5's update wrecks the weights,
    and steps 6 and 7 are non-finite. step_5, saved before anyone could know, is set aside, nothing later is
    saved, and the stop names step_4; step_2, which keep_last=3 would have pruned at step_5's save, is kept
    until a finite step has shown step_5 sound. A relaunch that blows up again resumes step_4, writes nothing
    and names step_4 again; one that names the set-aside step_5 with a sound --lr resumes step_4, at that
    --lr."""
    run = [f"--log_dir={tmp_path}", f"--checkpoint_dir={tmp_path}", *TINY, "--seq_length=32"]
    run += ["--run_name=wrecked", "--checkpoint_every=1"]
    assert launch("train.py", [*run, "--max_steps=4"], nproc=0).returncode == 0
    wrecked = launch("train.py", [*run, "--max_steps=8", "--lr=1e30", "--max_bad_steps=2"], nproc=0)
    assert wrecked.returncode == 2, wrecked.stderr[-2000:]
    assert "options changed since the checkpoint, applied from here on: --lr 0.003 -> 1e+30" in wrecked.stdout
    (aside,) = (tmp_path / "wrecked").glob("nonfinite_*")
    assert steps_of(tmp_path / "wrecked") == ["step_2", "step_3", "step_4"] and steps_of(aside) == ["step_5"]
    good = tmp_path / "wrecked" / "step_4"
    assert error_lines(wrecked.stderr) == [
        "error: stopping: 2 non-finite steps in a row from step 6 (lower --lr or raise --warmup_steps); "
        f"step_5, which holds the update that broke the weights, is set aside in {aside}; last good "
        f"checkpoint: {good}; resume with --resume_from={good} and the new options"
    ]
    blow_up_again = [*run, "--max_steps=8", "--lr=1e30", "--max_bad_steps=2", "--checkpoint_every=2"]
    again = launch("train.py", blow_up_again, nproc=0)
    assert again.returncode == 2 and f"resumed from {good} at step 4" in again.stdout, again.stderr[-2000:]
    assert "checkpoint saved" not in again.stdout  # step 6 was due, and non-finite
    assert steps_of(tmp_path / "wrecked") == ["step_2", "step_3", "step_4"]
    assert error_lines(again.stderr) == [
        "error: stopping: 2 non-finite steps in a row from step 6 (lower --lr or raise --warmup_steps); last "
        f"good checkpoint: {good}; resume with --resume_from={good} and the new options"
    ]
    ruled_out = tmp_path / "wrecked" / "step_5"
    followed = launch("train.py", [*run, "--max_steps=8", f"--resume_from={ruled_out}", "--lr=2e-3"], nproc=0)
    assert followed.returncode == 0, followed.stderr[-2000:]
    assert f"resumed from {good} at step 4" in followed.stdout
    assert "options changed since the checkpoint, applied from here on: --lr 0.003 -> 0.002" in (
        followed.stdout
    )
    records = {r["step"]: r for r in read_metrics(tmp_path)}
    # warm-up: step s runs at lr x s / warmup_steps (10)
    assert [records[step]["lr"] for step in (5, 6, 7, 8)] == pytest.approx([1e-3, 1.2e-3, 1.4e-3, 1.6e-3])
    assert all(math.isfinite(records[step]["loss"]) for step in (5, 6, 7, 8))


@pytest.mark.parametrize("end", ["the last step", "a stop asked for"])
def test_a_run_that_ends_during_a_non_finite_streak_stops_as_at_the_limit_and_saves_nothing(tmp_path, end):
    """The run's end comes during a streak shorter than --max_bad_steps: its weights are those of the blow-up,
    so the streak is judged then, and nothing holding them is saved: no checkpoint for the stop, no last
    checkpoint or export at the last step."""
    stop_file = tmp_path / "stop_requested"
    steps = 3 if end == "the last step" else 1000
    args = [*TINY, "--seq_length=32", f"--max_steps={steps}", "--lr=1e30", "--min_lr=0", "--warmup_steps=0"]
    args += [
        "--max_bad_steps=1000",
        "--checkpoint_every=1",
        f"--log_dir={tmp_path}",
        f"--checkpoint_dir={tmp_path}",
    ]
    command = torchrun_command("train.py", args, 0)
    env = {**os.environ, "JOB_STOP_FILE": str(stop_file)}
    process = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output = []
    for line in process.stdout:
        output.append(line)
        if line.startswith("step 2: non-finite") and end == "a stop asked for":
            stop_file.write_text("SIGUSR1\n")
    assert process.wait(timeout=120) == 2, "".join(output)[-3000:]
    error = error_lines("".join(output))
    assert len(error) == 1 and re.match(
        r"error: stopping: \d+ non-finite steps in a row from step 2, at the run's end \(lower --lr", error[0]
    ), error
    assert not list(tmp_path.glob("*/step_*")) and list(tmp_path.glob("*/nonfinite_*/step_1"))
    assert not list(tmp_path.glob("*/final_model"))
