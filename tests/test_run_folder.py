"""Living with a run: its folder, trackers, curves, relaunches, export and sampling, signals, offline hubs."""

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import time
import types
from pathlib import Path

import pytest
from conftest import (
    REPO,
    TINY,
    assert_same_model,
    fill_disk,
    launch,
    read_metrics,
    run_until,
    together,
    torchrun_command,
    worker_pids,
)

import train as train_script
from run import stops

RUN = [*TINY, "--max_steps=6", "--run_name=life", "--checkpoint_every=100", "--curves=True"]


def test_unreachable_wandb_logs_offline_after_a_bounded_wait(tmp_path):
    env = {"WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_API_KEY": "a" * 40, "WANDB_INIT_TIMEOUT": "3"}
    args = [*TINY, "--max_steps=2", "--run_name=w", "--wandb=proj", f"--log_dir={tmp_path}",
            f"--checkpoint_dir={tmp_path}"]  # fmt: skip
    started = time.monotonic()
    result = launch("train.py", args, nproc=0, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert time.monotonic() - started < 60  # it waited about 95 s
    [warning] = [line for line in result.stderr.splitlines() if line.startswith("warning: --wandb=proj")]
    assert warning.endswith(f"logging offline in {tmp_path}/w/wandb: `wandb sync` uploads it later")
    assert list((tmp_path / "w" / "wandb").glob("offline-run-*/run-w.wandb"))


def wandb_records(path):
    """The protobuf records of a W&B transaction log: a 7-byte header, then LevelDB-style records (CRC,
    length, type: 1 whole, 2 first, 3 middle, 4 last part) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2

    data, offset, pending = Path(path).read_bytes(), 7, b""
    while offset + 7 <= len(data):
        if 32768 - offset % 32768 < 7:  # a block's tail too short for a header is padding
            offset += 32768 - offset % 32768
            continue
        length, kind = int.from_bytes(data[offset + 4 : offset + 6], "little"), data[offset + 6]
        pending += data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_a_run_stopped_resumed_finished_and_continued_lives_in_one_folder(tmp_path):
    report = tmp_path / "benchmark_7.yaml"
    home = tmp_path / "home"  # a run writes under the folders it was given alone: nothing lands here
    home.mkdir()
    env = {"WANDB_MODE": "offline", "BENCHMARK_REPORT": str(report), "SLURM_JOB_ID": "7", "HOME": str(home)}
    common = [f"--log_dir={tmp_path / 'logs'}", f"--checkpoint_dir={tmp_path / 'ckpt'}", "--wandb=fsdp-test"]
    code, output = run_until([*common, *RUN], tmp_path / "logs", 1, signal.SIGTERM, env=env)
    assert code != 0 and "stopped by signal after step" in output, output[-3000:]

    # One process where two started: the run name leaves the world size out, so it resumes the same run.
    resumed = launch("train.py", [*common, *RUN], nproc=0, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    eta = r"^step +5/6 \| loss .* \| elapsed \d+:\d\d:\d\d \| ETA \d+:\d\d:\d\d$"
    assert re.search(eta, resumed.stdout, re.M), resumed.stdout
    folder = tmp_path / "logs" / "life"
    assert [r["step"] for r in read_metrics(tmp_path / "logs")] == [1, 2, 3, 4, 5, 6]
    assert list((folder / "tensorboard").glob("events.out.tfevents.*"))
    assert (folder / "curves.png").read_bytes()[:4] == b"\x89PNG"
    (folder / "curves.png").unlink()
    assert train_script.main([f"--plot={folder}"]) == 0  # at any time, from the run's folder alone
    assert (folder / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert (folder / "benchmark_reports.txt").read_text() == f"7: {report}\n"
    assert not list(folder.glob("*.tmp*"))
    # Both parts went to the W&B run whose id is the run name, with the config: each launch writes its
    # offline folder, and `wandb sync` puts them together.
    runs, steps = set(), []
    for run_file in (folder / "wandb").glob("offline-run-*/run-life.wandb"):
        for record in wandb_records(run_file):
            if record.WhichOneof("record_type") == "run":
                runs.add((record.run.run_id, record.run.project))
                assert {item.key for item in record.run.config.update} >= {"model", "max_steps", "run_name"}
            elif record.WhichOneof("record_type") == "history":
                steps.append(record.history.step.num)
    assert runs == {("life", "fsdp-test")} and sorted(steps) == [1, 2, 3, 4, 5, 6], (runs, steps)

    # The saved config replays the run: it has finished, so nothing is done.
    # (W&B is left out from here on: it takes seconds to start, and the parts above tested it.)
    replay = launch(
        "train.py", [f"--config={folder / 'config.yaml'}", "--wandb=none"], nproc=0, env={"HOME": str(home)}
    )
    assert replay.returncode == 0, replay.stderr[-3000:]
    assert replay.stdout.strip().splitlines()[-1] == (
        f"run life already finished at step 6 ({tmp_path / 'ckpt' / 'life' / 'step_6'}); nothing to do. "
        "Pass --run_name=NEW for a new run, or a larger --max_steps to train on."
    )
    assert "model exported" not in replay.stdout
    longer = launch(
        "train.py",
        [f"--config={folder / 'config.yaml'}", "--max_steps=8", "--wandb=none"],
        nproc=0,
        env={"HOME": str(home)},
    )
    assert longer.returncode == 0 and "resumed from" in longer.stdout, longer.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "logs")] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert "max_steps: 8" in (folder / "config.yaml").read_text()
    assert [str(path.relative_to(home)) for path in home.rglob("*")] == [], list(home.rglob("*"))


EXPORTS = [("tiny", "sharded"), ("tiny-llama", "full")]


@pytest.fixture(scope="module")
def export_runs(tmp_path_factory):
    """A 2-step one-process run for each of EXPORTS, launched together:
    (model, ckpt_format) -> (its folder, result)."""
    folders = {export: tmp_path_factory.mktemp("export") for export in EXPORTS}

    def run(model, ckpt_format):
        tmp = folders[model, ckpt_format]
        options = [f"--model={model}", "--max_steps=2", "--run_name=run", f"--ckpt_format={ckpt_format}"]
        args = [f"--log_dir={tmp}", f"--checkpoint_dir={tmp}", *TINY, *options, "--tensorboard=False"]
        return launch("train.py", args, nproc=0)

    results = together(*[functools.partial(run, *export) for export in EXPORTS])
    return {export: (folders[export], result) for export, result in zip(EXPORTS, results)}


@pytest.mark.parametrize("model, ckpt_format", EXPORTS)
def test_export_from_any_step_and_sample(export_runs, capsys, model, ckpt_format):
    """--export_from writes what the training's own export writes; sample.py generates from either."""
    from transformers import AutoModelForCausalLM

    import sample

    folder, result = export_runs[model, ckpt_format]
    assert result.returncode == 0, result.stderr[-3000:]
    assert train_script.main([f"--export_from={folder / 'run' / 'step_2'}"]) == 0
    exported = AutoModelForCausalLM.from_pretrained(folder / "run" / "export_step_2")
    final = AutoModelForCausalLM.from_pretrained(folder / "run" / "final_model")
    assert_same_model(exported, final)

    capsys.readouterr()
    for source in ("final_model", "step_2"):  # a checkpoint is exported on the fly
        options = ["--prompt=1 2 3", "--num_samples=2", "--max_new_tokens=5", "--temperature=0"]
        assert sample.main([f"--init_from={folder / 'run' / source}", *options]) == 0
    samples = [line for line in capsys.readouterr().out.splitlines() if line.startswith("1 2 3")]
    assert len(samples) == 4 and len(set(samples)) == 1, samples  # greedy: the same from both
    assert len(samples[0].split()) == 8

    # A checkpoint is verified before it is exported: one flipped byte is named, and nothing is written.
    shard = max((folder / "run" / "step_2").glob("*.distcp" if ckpt_format == "sharded" else "*.pt"),
                key=lambda path: path.stat().st_size)  # fmt: skip
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    shutil.rmtree(folder / "run" / "export_step_2")
    with pytest.raises(SystemExit) as exit_info:
        train_script.main([f"--export_from={folder / 'run' / 'step_2'}"])
    assert exit_info.value.code == 2
    assert f"{shard.name} does not match its checksum (corrupt)" in capsys.readouterr().err
    assert not (folder / "run" / "export_step_2").exists()


def test_sample_starts_after_a_document_end_and_refuses_what_it_cannot_do(export_runs, tmp_path, capsys):
    import sample

    folder, result = export_runs["tiny", "sharded"]
    assert result.returncode == 0, result.stderr[-3000:]
    model = folder / "run" / "final_model"
    # dummy data has no tokenizer: the default prompt is the end-of-document token, the vocabulary's last
    options = ["--num_samples=1", "--max_new_tokens=3", "--temperature=0"]
    assert sample.main([f"--init_from={model}", *options]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("---")]
    assert line.split()[0] == "511" and len(line.split()) == 4, line

    broken_config, typed, no_weights, worded = (
        tmp_path / "broken_config",
        tmp_path / "typed",
        tmp_path / "no_weights",
        tmp_path / "worded",
    )
    for copy in (broken_config, typed, no_weights, worded):
        shutil.copytree(model, copy)
    (broken_config / "config.json").write_text("{")
    config = json.loads((typed / "config.json").read_text())
    (typed / "config.json").write_text(json.dumps({**config, "n_embd": "abc"}))
    (no_weights / "model.safetensors").unlink()
    save_word_tokenizer(worded)
    cases = [
        ([f"--init_from={model}", "--prompt=1 2 3", "--max_new_tokens=300"],
         "--max_new_tokens=300 after a prompt of 3 tokens passes the model's 256 positions; use at most 253"),
        ([f"--init_from={model}", f"--prompt={' '.join(['1'] * 300)}"],
         "--prompt is 300 tokens, and the model holds 256 positions in all: shorten the prompt"),
        ([f"--init_from={model}", "--prompt=the cat"],
         f"{model} has no tokenizer (no tokenizer_config.json), so --prompt must be token ids"),
        ([f"--init_from={worded}", "--prompt="], "--prompt is empty: give some text to continue"),
        ([f"--init_from={broken_config}"], f"--init_from={broken_config}: cannot load the model ("),
        ([f"--init_from={typed}"], "Field 'n_embd' expected int, got str"),  # it was a traceback
        ([f"--init_from={no_weights}"], f"--init_from={no_weights}: cannot load the model ("),
    ]  # fmt: skip
    for args, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            sample.main(args)
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert exit_info.value.code == 2 and len(errors) == 1 and message in errors[0], errors


def save_word_tokenizer(folder):
    """A tokenizer of a few words, as save_pretrained writes one, into folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<eos>", "<unk>", "the", "cat", "sees", "a", "dog"]
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>").save_pretrained(folder)


def wait_for_catching(pid, number, timeout=120):
    """Waits until the process has a handler for signal `number` (its SigCgt bit in /proc)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = Path(f"/proc/{pid}/status").read_text()
        if int(re.search(r"^SigCgt:\s*(\w+)", status, re.M).group(1), 16) >> (number - 1) & 1:
            return
        time.sleep(0.1)
    raise AssertionError(f"process {pid} never caught signal {number}")


@pytest.mark.parametrize("when", ["before training", "inside a step"])
def test_a_stop_signal_exits_at_once_when_it_cannot_checkpoint(tmp_path, when):
    """Rank 0 is frozen, so rank 1 waits for it forever: before training in the process group's set-up, or
    inside a step's collective. A signal before training, or a second one inside a step, exits at once."""
    command = torchrun_command(
        "train.py",
        [
            f"--log_dir={tmp_path}",
            f"--checkpoint_dir={tmp_path}",
            *RUN,
            "--max_steps=1000",
            "--checkpoint_every=1",
        ],
        2,
    )
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        if when == "before training":  # rank 0 frozen while it imports: it never reaches the process group
            while len(ranks := worker_pids(process.pid)) < 2:
                time.sleep(0.02)
            os.kill(ranks[0], signal.SIGSTOP)
        else:
            next(line for line in process.stdout if line.startswith("step      2/"))
            ranks = worker_pids(process.pid)
            os.kill(ranks[0], signal.SIGSTOP)
        wait_for_catching(ranks[1], signal.SIGTERM)
        os.kill(ranks[1], signal.SIGTERM)
        if when == "inside a step":
            time.sleep(stops.SAME_STOP_SECONDS + 1)  # sooner, it would count as the same stop
            os.kill(ranks[1], signal.SIGTERM)
        started = time.monotonic()
        while Path(f"/proc/{ranks[1]}").exists() and time.monotonic() - started < 60:
            time.sleep(0.05)
        exited_after = time.monotonic() - started
        os.kill(ranks[0], signal.SIGCONT)
        output = process.communicate(timeout=120)[0]
    finally:
        process.kill()
    assert exited_after < 5, output[-3000:]
    why = "a second stop signal"
    if when == "before training":
        why = "before training started (a stop, or torchrun ending the ranks after one failed)"
    assert f"SIGTERM, {why}: exiting at once with status 143, writing nothing" in output, output[-3000:]
    if when == "inside a step":
        assert "SIGTERM: checkpointing at the end of this step" in output
        steps = sorted(int(p.name[5:]) for p in (tmp_path / "life").glob("step_*") if p.name[5:].isdigit())
        assert steps and steps[-1] <= 3, steps  # what was complete stays; nothing more was written


@pytest.mark.parametrize("offline", ["1", ""])
def test_an_unreachable_hub_fails_in_seconds(tmp_path, offline):
    """No hub here: whether HF_HUB_OFFLINE says so or a first request finds out, no retries."""
    env = {"HF_HUB_OFFLINE": offline, "HF_HOME": str(tmp_path / "hf")}
    started = time.monotonic()
    result = launch(
        "train.py",
        ["--data=wikitext", "--prepare_only", f"--data_cache={tmp_path}"],
        nproc=0,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert "Retry" not in result.stderr, result.stderr[-2000:]
    assert "cannot load tokenizer 'gpt2'" in result.stderr, result.stderr[-2000:]
    assert time.monotonic() - started < 30


def launch_losses(run, *launches):
    """{step: loss} of each launch: the metrics.jsonl lines it appended (launches are callables)."""
    results = []
    for launch_once in launches:
        before = (
            len((run / "metrics.jsonl").read_text().splitlines()) if (run / "metrics.jsonl").exists() else 0
        )
        out = launch_once()
        lines = (run / "metrics.jsonl").read_text().splitlines()[before:]
        records = [json.loads(line) for line in lines]
        results.append((out, {r["step"]: r["loss"] for r in records if "loss" in r}))
    return results


def test_a_rewound_run_sets_its_later_checkpoints_aside_and_every_relaunch_continues_the_rewound_line(
    tmp_path, train
):
    """A constant learning rate after warm-up, so that a launch's length does not change its losses."""
    run = tmp_path / "rewind"
    base = [*TINY, "--run_name=rewind", "--seq_length=32", "--batch_size=4", "--global_batch_size=4",
            "--checkpoint_every=10", "--lr=1e-3", "--min_lr=1e-3", "--warmup_steps=2",
            "--tensorboard=False"]  # fmt: skip
    rewind = [f"--resume_from={run}/step_10", "--keep_last=1"]
    (first, original), (rewound, again), (relaunched, continued), (finished, no_steps), (plain, _) = (
        launch_losses(
            run,
            lambda: train(tmp_path, *base, "--max_steps=30", nproc=0),
            lambda: train(tmp_path, *base, *rewind, "--max_steps=15", nproc=0),  # then stopped, say
            lambda: train(tmp_path, *base, *rewind, "--max_steps=20", nproc=0),  # the same command, requeued
            lambda: train(tmp_path, *base, *rewind, "--max_steps=20", nproc=0),  # and once more, finished
            lambda: train(tmp_path, *base, "--max_steps=21", nproc=0),
        )
    )
    set_aside = re.search(
        rf"^rewinding run {run} to step 10: its later checkpoints \(step_20, step_30\) are set aside "
        r"in (\S+)$",
        rewound.stdout,
        re.M,
    )
    assert set_aside and sorted(p.name for p in Path(set_aside[1]).iterdir()) == ["step_20", "step_30"]
    assert f"checkpoint saved: {run}/step_15" in rewound.stdout
    assert again == {step: original[step] for step in range(11, 16)}  # the same data, bitwise
    assert f"{run}/step_10: this run was rewound to it before; continuing" in relaunched.stdout
    assert f"resumed from {run}/step_15 at step 15" in relaunched.stdout
    assert continued == {step: original[step] for step in range(16, 21)}
    said = finished.stdout.strip().splitlines()[-1]  # the same command once the run has finished
    assert said.startswith(f"run rewind already finished at step 20 ({run}/step_20); nothing to do."), said
    assert not no_steps and "model exported" not in finished.stdout
    assert f"resumed from {run}/step_20 at step 20" in plain.stdout
    assert sorted(p.name for p in run.glob("step_*")) == ["step_20", "step_21"]  # keep_last=3, one line


def test_a_broken_line_in_metrics_is_skipped_with_a_warning(tmp_path, capsys):
    """A full log disk can cut a line short; --plot, and the plot at the end of every later launch, go on."""
    records = [{"step": step, "loss": 5.0 - step / 10, "lr": 1e-3} for step in (1, 2, 3)]
    lines = [json.dumps(records[0]), '{"step": 2, "lo', json.dumps(records[2]), json.dumps(records[1])]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert train_script.main([f"--plot={tmp_path}"]) == 0
    out, err = capsys.readouterr()
    assert err.strip() == f"warning: {tmp_path}/metrics.jsonl line 2 is not a record; skipped"
    assert out.strip() == f"curves: {tmp_path}/curves.png" and (tmp_path / "curves.png").stat().st_size > 0


def test_a_step_that_is_no_number_is_skipped_and_a_folder_with_no_steps_is_refused_leaving_nothing(
    tmp_path, capsys
):
    """A step of text did not sort among the numbers: a traceback. With no steps, matplotlib's font cache was
    written beside the run before the refusal."""
    run, empty = tmp_path / "logs" / "run", tmp_path / "logs" / "empty"
    run.mkdir(parents=True)
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        train_script.main([f"--plot={empty}"])
    assert exit_info.value.code == 2 and sorted(os.listdir(tmp_path / "logs")) == ["empty", "run"]
    records = [{"step": 1, "loss": 5.0}, {"step": "a", "loss": 4.0}, {"step": 2, "loss": 4.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    capsys.readouterr()
    assert train_script.main([f"--plot={run}"]) == 0
    assert capsys.readouterr().err.strip() == f"warning: {run}/metrics.jsonl line 2 is not a record; skipped"


def test_a_full_log_disk_ends_the_records_with_one_warning_not_the_run(small_disks, capsys):
    from run.progress.run_log import RunLog

    disk = small_disks(1)
    fill_disk(disk)  # what room it leaves, less than a filler's write, the records below take
    run_log = RunLog(types.SimpleNamespace(tensorboard=False, wandb=None), str(disk))
    for step in range(1, 300):
        run_log.write({"step": step, "loss": 5.0, "note": "x" * 300})
    run_log.close()
    err = capsys.readouterr().err
    assert err.count("warning:") == 1, err
    assert f"warning: cannot write {disk}/metrics.jsonl (No space left on device)" in err


def test_on_a_log_disk_that_fills_a_record_is_written_whole_or_not_at_all(small_disks, capsys):
    """A record that crossed the end of the disk's last free page was cut there, and the next launch's
    records were appended to the cut line."""
    from run.progress.run_log import RunLog

    disk = small_disks(1)
    run_log = RunLog(types.SimpleNamespace(tensorboard=False, wandb=None), str(disk))
    record = {"step": 1, "loss": 5.0, "note": "x" * 300}
    run_log.write(record)  # the file's first page, then no room beyond it
    fill_disk(disk)
    for step in range(2, 40):
        run_log.write({**record, "step": step})
    run_log.close()
    lines = (disk / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert [json.loads(line)["step"] for line in lines if line.endswith("\n")] == list(
        range(1, len(lines) + 1)
    )
    assert len(lines) > 2  # the records filled the page before one met its end
    [warning] = capsys.readouterr().err.splitlines()
    assert warning.startswith(f"warning: cannot write {disk}/metrics.jsonl (No space left on device)")


def test_a_heartbeat_that_cannot_be_written_is_said_once_and_not_left_stale(small_disks, capsys, monkeypatch):
    """On a full disk the heartbeat stayed at its last step, which a hang's report read as a rank that
    stopped there; its write failed without a word."""
    import threading

    from run.job import heartbeats

    monkeypatch.setattr(heartbeats, "HEARTBEAT_S", 0.0)  # a beat at every call, not every 5 s
    disk = small_disks(1)
    beats = heartbeats.Heartbeats(str(disk), 0, 1, "launch", threading.get_ident())
    beats.beat(0)
    assert heartbeats.read_beats(beats.folder, 1, "launch")[0]["steps"] == 0
    fill_disk(disk)
    beats.beat(1)
    assert heartbeats.read_beats(beats.folder, 1, "launch") == {}  # no stale beat at step 0
    for step in range(2, 6):  # the old beat's page, freed, may take one more
        beats.beat(step)
    path = disk / "heartbeats" / "rank0.json"
    assert capsys.readouterr().err.splitlines() == [
        f"warning: cannot write heartbeat {path} (No space left on device); it is removed rather than left "
        "stale, and training goes on"
    ]
    latest = heartbeats.read_beats(beats.folder, 1, "launch")
    assert latest == {} or latest[0]["steps"] == 5  # the last beat, or none: never an older one
    assert not list(disk.rglob("*.tmp"))


def test_a_log_disk_that_fills_during_a_run_warns_once_per_writer_and_training_goes_on(tmp_path):
    """TensorBoard's writer thread met the full disk and ended the run, with no checkpoint."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=32k", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs ({mounted.stderr.decode().strip() or 'not permitted'}): needs root"
        )
    try:
        args = [*TINY, "--seq_length=32", "--max_steps=80", "--run_name=full", f"--log_dir={disk}",
                f"--checkpoint_dir={tmp_path}", "--tensorboard=True"]  # fmt: skip
        result = launch("train.py", args, nproc=0)
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: cannot write")]
    for written in ("metrics.jsonl", "tensorboard"):
        assert len([line for line in warnings if f"full/{written} (No space left on device)" in line]) == 1
    assert (tmp_path / "full" / "step_80" / "manifest.json").exists()
