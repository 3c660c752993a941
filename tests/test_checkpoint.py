import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import time

import pytest
import torch
from conftest import (
    REPO,
    TINY,
    assert_rank_0_failed_first_with_status_2,
    assert_same_model,
    error_lines,
    fill_disk,
    launch,
    read_metrics,
    run_until,
    together,
    torchrun_command,
)

from common.errors import ConfigError
from run import launch as run_launch
from run import options

# Sequences a quarter of TINY's: these runs are about checkpoints, not learning, and their steps cost half.
RUN = [*TINY, "--seq_length=32", "--max_steps=30", "--run_name=exact", "--checkpoint_every=10"]


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


def test_one_process_resumes_a_two_process_checkpoint(uninterrupted, resumes):
    two_losses = uninterrupted[1]
    tmp, result = resumes["one process"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "at step 20" in result.stdout
    losses = {r["step"]: r["loss"] for r in read_metrics(tmp)}
    assert sorted(losses) == list(range(21, 31))  # DCP resharded the 2-rank checkpoint onto 1 rank
    assert [losses[s] for s in range(21, 31)] == pytest.approx(
        [two_losses[s] for s in range(21, 31)], rel=1e-4
    )


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

    result = launch(
        "train.py",
        [
            f"--log_dir={tmp_path}",
            f"--checkpoint_dir={tmp_path}",
            *TINY,
            "--max_steps=6",
            "--run_name=full",
            "--ckpt_format=full",
        ],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    state = torch.load(tmp_path / "full" / "step_6" / "state_dict.pt", weights_only=True)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "final_model")
    trained = GPT2LMHeadModel(exported.config)
    trained.load_state_dict(state["model"])
    assert_same_model(exported, trained)
    assert state["optimizer"]["state"]  # the optimizer moments are in the file too

    resumed = launch(
        "train.py",
        [
            f"--log_dir={tmp_path}",
            f"--checkpoint_dir={tmp_path}",
            *TINY,
            "--max_steps=8",
            "--run_name=full",
            "--ckpt_format=full",
        ],
        nproc=0,  # the file holds the whole state: any world size loads it
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 6" in resumed.stdout
    zero_bytes(tmp_path / "full" / "step_8" / "state_dict.pt", 4096, 4096)
    changed = launch(
        "train.py",
        [
            f"--log_dir={tmp_path}",
            f"--checkpoint_dir={tmp_path}",
            *TINY,
            "--max_steps=9",
            "--run_name=full",
            "--n_embd=128",
        ],
    )
    assert_rank_0_failed_first_with_status_2(changed)
    assert changed.stderr.count("has another model shape (n_embd 256 -> 128)") == 1, changed.stderr  # rank 0
    step_8 = tmp_path / "full" / "step_8"
    [aside] = (tmp_path / "full").glob("unusable_*/step_8")
    assert (
        f"warning: checkpoint {step_8} is unusable: {step_8}/state_dict.pt does not match its checksum "
        f"(corrupt); set aside as {aside}; falling back to {tmp_path}/full/step_6"
    ) in changed.stdout


def test_unwritable_checkpoint_dir_is_refused_before_training(tmp_path, capsys):
    """Checked in-process: the error must come before any process group or model exists."""
    import train as train_script

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        train_script.main([f"--checkpoint_dir={blocker}/sub", *TINY])
    assert exit_info.value.code == 2
    assert f"--checkpoint_dir={blocker}/sub is not writable" in capsys.readouterr().err


def zero_bytes(path, offset, count):
    with open(path, "r+b") as file:
        file.seek(offset)
        file.write(bytes(count))


def copy_of_run(uninterrupted, tmp_path):
    shutil.copytree(uninterrupted[0] / "exact", tmp_path / "exact")
    # the run's log shares the folder (log_dir = checkpoint_dir)
    (tmp_path / "exact" / "metrics.jsonl").unlink()
    return tmp_path / "exact"


def corrupt_shard(step):
    shard = step / "__1_0.distcp"
    zero_bytes(shard, shard.stat().st_size // 2, 64 << 10)  # 64 KiB inside the weights


def truncate(path):
    os.truncate(path, path.stat().st_size // 2)


def remove_manifests(run_dir):
    for step in (10, 20, 30):
        (run_dir / f"step_{step}" / "manifest.json").unlink()


# The damaged checkpoints of one copy of the run, newest first: told to resume from step_30, the run meets
# each in turn, says why it cannot use it, falls back to the next, and resumes from the intact step_20.
# Below step_30 the damaged ones are copies of step_20. (step, what is done to it, the words of the warning)
DAMAGES = [
    (30, lambda step: (step / ".metadata").unlink(), "step_30/.metadata is missing"),
    (29, lambda step: truncate(step / "__0_0.distcp"), "__0_0.distcp has {size} bytes instead of"),
    (28, lambda step: (step / "trainer_state.json").unlink(), "no trainer_state.json (a save cut short)"),
    (27, lambda step: (step / "manifest.json").write_text("{"), "unreadable manifest.json"),
    (26, lambda step: edit_manifest(step, lambda files: {}), "manifest.json does not list the trainer state"),
    (
        25,
        lambda step: edit_manifest(step, lambda files: {name: "?" for name in files}),
        "manifest.json has entries of the wrong type (damaged)",
    ),
    (24, corrupt_shard, "__1_0.distcp does not match its checksum (corrupt)"),
]


def edit_manifest(step, change):
    manifest = json.loads((step / "manifest.json").read_text())
    (step / "manifest.json").write_text(json.dumps({"files": change(manifest["files"])}))


def damage_checkpoints(run_dir):
    for step, damage, _ in DAMAGES:
        if step != 30:
            shutil.copytree(run_dir / "step_20", run_dir / f"step_{step}")
        damage(run_dir / f"step_{step}")


@pytest.fixture(scope="module")
def resumes(uninterrupted, tmp_path_factory):
    """The launches that resume the uninterrupted run's checkpoints, or a damaged copy of them, started two
    at a time: name -> (its folder, result)."""
    two = uninterrupted[0]
    folders, launches = {}, {}

    def add(name, damage, *args, nproc=0):
        """args may name the launch's own folder as {tmp}."""
        tmp = folders[name] = tmp_path_factory.mktemp("resume")
        if damage:
            damage(copy_of_run(uninterrupted, tmp))
        args = [f"--log_dir={tmp}", f"--checkpoint_dir={tmp}", *RUN, *(arg.format(tmp=tmp) for arg in args)]
        launches[name] = functools.partial(launch, "train.py", args, nproc=nproc)

    # a checkpoint copied under a name of the user's: its step is in its trainer state
    renamed = tmp_path_factory.mktemp("renamed") / "weights_at_20"
    shutil.copytree(two / "exact" / "step_20", renamed)
    add("damaged", damage_checkpoints, "--resume_from={tmp}/exact/step_30", nproc=2)
    add("one process", None, f"--resume_from={renamed}")
    add("no usable checkpoint", remove_manifests)
    add("past max_steps", lambda run_dir: None, "--max_steps=20")  # a copy of the finished run
    add("other family", None, "--model=tiny-llama", "--run_name=llama", f"--resume_from={renamed}")
    results = together(*launches.values())
    return {name: (folders[name], result) for name, result in zip(launches, results)}


def warnings_of(output):
    """The run's warnings about unusable checkpoints: the checkpoint's folder -> the whole line."""
    lines = [line for line in output.splitlines() if line.startswith("warning: checkpoint ")]
    return {line.split()[2]: line for line in lines}


def test_corrupt_shard_is_named_and_the_run_resumes_from_the_previous_checkpoint(uninterrupted, resumes):
    tmp, result = resumes["damaged"]
    run_dir, shard = tmp / "exact", tmp / "exact" / "step_24" / "__1_0.distcp"
    assert result.returncode == 0, result.stderr[-3000:]
    [aside] = run_dir.glob("unusable_*")  # each damaged one, kept there before training went on
    assert warnings_of(result.stdout)[f"{run_dir}/step_24"] == (
        f"warning: checkpoint {run_dir}/step_24 is unusable: {shard} does not match its checksum "
        f"(corrupt); set aside as {aside}/step_24; falling back to {run_dir}/step_20"
    )
    assert f"resumed from {run_dir}/step_20 at step 20" in result.stdout
    assert sorted(path.name for path in aside.iterdir()) == [f"step_{step}" for step, _, _ in DAMAGES[::-1]]
    losses = {r["step"]: r["loss"] for r in read_metrics(tmp)}
    assert sorted(losses) == list(range(21, 31))
    assert [losses[s] for s in range(21, 31)] == [uninterrupted[1][s] for s in range(21, 31)]


@pytest.mark.parametrize("step, message", [(step, message) for step, _, message in DAMAGES[:-1]])
def test_damaged_newest_checkpoint_is_skipped_for_the_previous_one(uninterrupted, resumes, step, message):
    tmp, result = resumes["damaged"]
    run_dir = tmp / "exact"
    size = (uninterrupted[0] / "exact" / "step_20" / "__0_0.distcp").stat().st_size // 2
    assert result.returncode == 0, result.stderr[-3000:]
    warning = warnings_of(result.stdout)[f"{run_dir}/step_{step}"]
    assert warning.startswith(f"warning: checkpoint {run_dir}/step_{step} is unusable: ")
    assert message.format(size=size) in warning
    assert warning.endswith(f"falling back to {run_dir}/step_{step - 1}")
    assert f"resumed from {run_dir}/step_20 at step 20" in result.stdout
    assert "Traceback" not in result.stderr


def test_no_usable_checkpoint_left_stops_naming_them(resumes):
    tmp, result = resumes["no usable checkpoint"]
    run_dir = tmp / "exact"
    assert result.returncode == 2
    assert len(error_lines(result.stderr)) == 1, result.stderr
    assert result.stdout.count("no manifest.json (a save cut short, or written before checkpoints had") == 3
    steps = ", ".join(f"{run_dir}/step_{step}" for step in (30, 20, 10))
    assert f"error: no usable checkpoint to resume from ({steps})" in result.stderr
    assert not (tmp / "metrics.jsonl").exists()  # stopped before training
    kept = sorted(path.name for path in run_dir.iterdir() if path.name.startswith(("step_", "unusable_")))
    assert kept == ["step_10", "step_20", "step_30"]  # none set aside: the run did not go on


def test_a_run_past_its_last_step_is_refused_rather_than_exported_as_done(resumes):
    tmp, result = resumes["past max_steps"]
    assert result.returncode == 2, result.stderr[-3000:]
    assert error_lines(result.stderr) == [
        f"error: run exact is at step 30 ({tmp}/exact/step_30), past its 20 steps; raise --max_steps to go "
        f"on, or rewind with --resume_from=<an earlier step_N>"
    ]
    assert "done:" not in result.stdout
    assert not (tmp / "exact" / "trainer.lock").exists(), "a refused run releases its lock"


def test_a_checkpoint_of_another_model_family_is_refused(resumes):
    tmp, result = resumes["other family"]
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = error_lines(result.stderr)
    assert line.startswith("error: checkpoint ") and line.endswith(
        "holds a GPT2Config model, and this run builds a LlamaConfig one (--model=tiny-llama); use "
        "another --run_name or --checkpoint_dir"
    )
    assert not read_metrics(tmp), "refused before any step"
    assert not (tmp / "llama" / "trainer.lock").exists(), "a refused run releases its lock"


def write_lock(run_dir, age_s=0.0, **holder):
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = run_dir / "trainer.lock"
    lock.write_text(json.dumps(holder))
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def test_two_launches_of_one_run_at_once_one_is_refused(tmp_path):
    args = [
        f"--log_dir={tmp_path}",
        f"--checkpoint_dir={tmp_path}",
        *TINY,
        "--max_steps=8",
        "--run_name=twice",
    ]
    launches = [
        subprocess.Popen(
            torchrun_command("train.py", args, 0),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [(process.wait(timeout=300), *process.communicate()) for process in launches]
    assert sorted(code for code, _, _ in results) == [0, 2], results
    refused = sorted(results)[1][2]
    assert len(error_lines(refused)) == 1 and "Traceback" not in refused, refused
    assert f"error: run {tmp_path}/twice is already being trained by pid " in refused
    assert f"on {socket.gethostname()} (lock {tmp_path}/twice/trainer.lock)" in refused
    assert len(read_metrics(tmp_path)) == 8  # the refused launch wrote no rows
    assert not (tmp_path / "twice" / "trainer.lock").exists()  # released at the end


def test_lock_of_a_killed_run_is_taken_over(tmp_path):
    args = [
        f"--checkpoint_dir={tmp_path}",
        *TINY,
        "--max_steps=4",
        "--run_name=killed",
        "--checkpoint_every=2",
    ]
    process = subprocess.Popen(
        torchrun_command("train.py", [f"--log_dir={tmp_path}", *args], 0),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for line in process.stdout:
        if line.startswith("checkpoint saved:"):
            process.kill()
            break
    process.wait(timeout=60)
    lock = json.loads((tmp_path / "killed" / "trainer.lock").read_text())
    assert lock["pid"] == process.pid and lock["host"] == socket.gethostname()
    result = launch("train.py", [f"--log_dir={tmp_path}", *args], nproc=0)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"taking over the lock of run {tmp_path}/killed from pid {process.pid}" in result.stdout
    assert "resumed from" in result.stdout


def test_lock_on_another_host_is_refused_until_requeued_or_its_heartbeat_stops(tmp_path):
    args = [
        f"--log_dir={tmp_path}",
        f"--checkpoint_dir={tmp_path}",
        *TINY,
        "--max_steps=1",
        "--run_name=shared",
    ]
    holder = dict(host="node-b", pid=4242, job_id="77")
    write_lock(tmp_path / "shared", **holder)
    refused = launch("train.py", args, env={"SLURM_JOB_ID": "78"})  # torchrun, 2 processes
    assert refused.returncode != 0
    assert len(error_lines(refused.stderr)) == 1, refused.stderr  # rank 0 alone checks it
    lock = tmp_path / "shared" / "trainer.lock"
    assert f"already being trained by pid 4242 on node-b, SLURM job 77 (lock {lock})" in refused.stderr
    requeued = launch("train.py", args, nproc=0, env={"SLURM_JOB_ID": "77"})
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    assert "taking over the lock" in requeued.stdout
    write_lock(tmp_path / "shared", age_s=3600, **holder)
    silent = launch("train.py", args, nproc=0)
    assert silent.returncode == 0, silent.stderr[-3000:]
    assert "taking over the lock" in silent.stdout


# A tiny checkpoint takes 22 MB and its export 7 MB: 30 MiB fit one checkpoint, not two.
SAVES = [
    (["--ckpt_format=sharded"], 2),
    (["--ckpt_format=sharded", "--async_checkpoint=True"], 2),
    (["--ckpt_format=full"], 0),
]


@pytest.fixture(scope="module")
def disk_full_runs(small_disks, tmp_path_factory):
    """The runs of the two tests below, each writing to its own small disk, launched two at a time:
    tuple(args) of SAVES, or "export" -> (disk, result)."""
    runs = {}

    def add(name, size_mib, *args, nproc=2):
        disk, logs = small_disks(size_mib), tmp_path_factory.mktemp("logs")
        args = [f"--log_dir={logs}", f"--checkpoint_dir={disk}", *TINY, *args, "--run_name=full_disk"]
        runs[name] = disk, functools.partial(launch, "train.py", args, nproc=nproc)

    for args, nproc in SAVES:
        add(tuple(args), 30, "--max_steps=4", "--checkpoint_every=2", *args, nproc=nproc)
    add("export", 26, "--max_steps=2")
    results = together(*[call for _, call in runs.values()])
    return {name: (disk, result) for (name, (disk, _)), result in zip(runs.items(), results)}


@pytest.mark.parametrize("args, nproc", SAVES)
def test_disk_full_during_a_save_keeps_the_previous_checkpoint(disk_full_runs, args, nproc):
    disk, result = disk_full_runs[tuple(args)]
    assert result.returncode != 0
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and 'train.py", line' not in result.stderr, result.stderr
    assert errors[0].startswith(f"error: writing checkpoint {disk}/full_disk/step_4.tmp failed (")
    assert f"MiB free there); the previous checkpoint {disk}/full_disk/step_2 is untouched." in errors[0]
    assert sorted(p.name for p in (disk / "full_disk").iterdir() if p.name.startswith("step")) == ["step_2"]


def test_disk_full_during_the_export_leaves_no_half_written_model(disk_full_runs, capsys):
    import train as train_script

    disk, result = disk_full_runs["export"]
    assert result.returncode != 0
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and 'train.py", line' not in result.stderr, result.stderr
    assert f"error: writing the export {disk}/full_disk/final_model.tmp failed (" in result.stderr
    assert not (disk / "full_disk" / "final_model").exists()
    assert not (disk / "full_disk" / "final_model.tmp").exists()
    assert (disk / "full_disk" / "step_2" / "manifest.json").exists()
    # exporting the checkpoint by hand, onto the same full disk
    with pytest.raises(SystemExit) as exit_info:
        train_script.main([f"--export_from={disk}/full_disk/step_2"])
    err = capsys.readouterr().err  # transformers' progress bar, then the line
    assert exit_info.value.code == 2 and len(error_lines(err)) == 1 and "Traceback" not in err, err
    assert f"error: writing the export {disk}/full_disk/export_step_2.tmp failed (" in err
    assert not [p for p in (disk / "full_disk").iterdir() if p.name.startswith("export_step_2")]


def test_an_empty_lock_is_taken_over(tmp_path, capsys):
    (tmp_path / "trainer.lock").write_text("")  # a lock is linked whole, so no live trainer left it so
    lock = run_launch.take_run_lock(str(tmp_path))
    assert json.loads((tmp_path / "trainer.lock").read_text())["pid"] == os.getpid()
    assert (
        f"taking over the lock of run {tmp_path} from no one: it is empty or unreadable"
        in capsys.readouterr().out
    )
    run_launch.release_run_lock(lock)
    assert not list(tmp_path.iterdir())


def test_a_full_disk_is_one_line_before_training_and_leaves_no_lock_file(small_disks):
    disk = small_disks(1)
    fill_disk(disk)
    with pytest.raises(ConfigError, match=r"is not writable \(No space left on device\)"):
        options.writable_folder("--checkpoint_dir", str(disk))
    with pytest.raises(
        ConfigError, match=rf"cannot write the run's lock {disk}/trainer.lock \(No space left"
    ):
        run_launch.take_run_lock(str(disk))
    assert [p.name for p in disk.iterdir()] == ["filler"]
