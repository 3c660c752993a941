import signal

import pytest
import torch

from conftest import TINY, launch, read_metrics, run_until

RUN = [*TINY, "--max_steps=30", "--run_name=exact", "--checkpoint_every=10"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    result = launch("train.py", [f"--log_dir={tmp}", f"--checkpoint_dir={tmp}", *RUN])
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp, {r["step"]: r["loss"] for r in read_metrics(tmp)}


def test_sigterm_to_one_rank_checkpoints_and_resume_is_bitwise_exact(uninterrupted, tmp_path):
    losses = uninterrupted[1]
    args = [f"--checkpoint_dir={tmp_path}", *RUN]
    code, output = run_until(args, tmp_path, 3, signal.SIGTERM)
    assert code != 0  # torchrun reports the worker's status 75 as a failure: the launcher requeues
    stopped = int(output.split("stopped by signal after step ")[1].split(";")[0])
    assert 3 <= stopped < 10  # before the first periodic checkpoint: this one came from the signal
    run_dir = tmp_path / "exact"
    assert (run_dir / f"step_{stopped}" / "trainer_state.json").exists()
    (run_dir / "step_999.tmp").mkdir()  # what a save killed half-way leaves behind: never resumed from
    (run_dir / "step_999.tmp" / "trainer_state.json").write_text("{not json")

    result = launch("train.py", [f"--log_dir={tmp_path}", *args])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {run_dir}/step_{stopped} at step {stopped}" in result.stdout
    resumed = {r["step"]: r["loss"] for r in read_metrics(tmp_path)}
    assert [resumed[s] for s in range(stopped + 1, 31)] == [losses[s] for s in range(stopped + 1, 31)]


def test_one_process_resumes_a_two_process_checkpoint(uninterrupted, tmp_path):
    two, two_losses = uninterrupted
    result = launch("train.py", [f"--log_dir={tmp_path}", f"--checkpoint_dir={tmp_path}", *RUN,
                                 f"--resume_from={two}/exact/step_20"], nproc=0)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "at step 20" in result.stdout
    losses = {r["step"]: r["loss"] for r in read_metrics(tmp_path)}
    assert sorted(losses) == list(range(21, 31))  # DCP resharded the 2-rank checkpoint onto 1 rank
    assert [losses[s] for s in range(21, 31)] == pytest.approx([two_losses[s] for s in range(21, 31)], rel=1e-4)


def test_killed_rank_is_restarted_by_torchrun_and_resumes(uninterrupted, tmp_path):
    losses = uninterrupted[1]
    args = [f"--checkpoint_dir={tmp_path}", *RUN, "--checkpoint_every=5", "--async_checkpoint=True"]
    code, output = run_until(args, tmp_path, 12, signal.SIGKILL, extra_torchrun=["--max-restarts=1"])
    assert code == 0, output[-3000:]
    assert "resumed from" in output
    restarted = {r["step"]: r["loss"] for r in read_metrics(tmp_path)}
    assert [restarted[s] for s in range(25, 31)] == [losses[s] for s in range(25, 31)]
    kept = sorted(p.name for p in (tmp_path / "exact").iterdir() if p.name.startswith(("step_", "final_")))
    assert kept == ["final_model", "step_20", "step_25", "step_30"]  # keep_last=3


def test_full_format_and_export_load_without_this_repo(tmp_path):
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel

    result = launch("train.py", [f"--log_dir={tmp_path}", f"--checkpoint_dir={tmp_path}", *TINY, "--max_steps=6",
                                 "--run_name=full", "--ckpt_format=full"])
    assert result.returncode == 0, result.stderr[-3000:]
    state = torch.load(tmp_path / "full" / "step_6" / "state_dict.pt", weights_only=True)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "final_model")
    trained = GPT2LMHeadModel(exported.config)
    trained.load_state_dict(state["model"])
    tokens = torch.randint(0, 512, (2, 64))
    with torch.no_grad():
        assert torch.equal(exported(tokens).logits, trained(tokens).logits)
    assert state["optimizer"]["state"]  # the optimizer moments are in the file too

    resumed = launch("train.py", [f"--log_dir={tmp_path}", f"--checkpoint_dir={tmp_path}", *TINY, "--max_steps=8",
                                  "--run_name=full", "--ckpt_format=full"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 6" in resumed.stdout
    changed = launch("train.py", [f"--log_dir={tmp_path}", f"--checkpoint_dir={tmp_path}", *TINY, "--max_steps=9",
                                  "--run_name=full", "--n_embd=128"], nproc=0)
    assert changed.returncode == 2
    assert "has another model shape (n_embd 256 -> 128)" in changed.stderr


def test_non_finite_steps_are_skipped_then_stop(tmp_path):
    # An absurd learning rate blows the weights up after one update: every later loss is NaN.
    result = launch("train.py", [f"--log_dir={tmp_path}", f"--checkpoint_dir={tmp_path}", *TINY, "--max_steps=20",
                                 "--lr=1e30", "--min_lr=0", "--max_bad_steps=3", "--warmup_steps=0"])
    assert result.returncode != 0  # each rank exits 2; torchrun reports 1
    assert result.stdout.count("non-finite loss or gradient norm, update skipped") == 3
    assert "stopping: 3 non-finite steps in a row" in result.stderr
    assert not list(tmp_path.glob("*/step_*"))  # nothing bad was checkpointed


def test_unwritable_checkpoint_dir_is_refused_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = launch("train.py", [f"--checkpoint_dir={blocker}/sub", *TINY], nproc=0)
    assert result.returncode == 2
    assert f"--checkpoint_dir={blocker}/sub is not writable" in result.stderr
