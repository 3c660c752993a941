"""benchmark.py's bad input: an unknown section, an unusable folder or option, training options (--train_args)
that are wrong, left to auto, or name a hub model with no hub to reach, and --only=gpu on a machine without a
GPU. Each is one line naming the option and exit status 2, before any measurement."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SIMULATES, launch

import benchmark

ROOT = Path(__file__).resolve().parents[1]


def test_unknown_section_is_one_line_and_exit_2(tmp_path):
    result = launch("benchmark.py", ["--skip", "storge"], nproc=0, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == (
        "error: --skip: unknown section 'storge' (did you mean 'storage'?); "
        "sections are gpu, nccl, links, storage, cpu, memory\n"
    )


def unwritable_folder(tmp_path: Path) -> Path:
    if os.geteuid() == 0:
        return Path("/sys")  # root ignores permission bits, but /sys is mounted read-only
    folder = tmp_path / "read_only"
    folder.mkdir(mode=0o500)
    return folder


def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "file"
    path.write_text("")
    return path


@pytest.mark.parametrize(
    "arguments, message",
    [
        (
            lambda tmp: ["--storage_path", str(tmp / "missing")],
            "--storage_path {tmp}/missing: no such folder",
        ),
        (lambda tmp: ["--storage_path", str(unwritable_folder(tmp))], "cannot write there"),
        (
            lambda tmp: ["--storage_path", str(a_file(tmp))],
            "--storage_path {tmp}/file is a file, not a folder",
        ),
        (lambda tmp: ["--storage_path", str(tmp), "--storage_MiB", str(10**9)], "the storage test needs"),
        (
            lambda tmp: ["--storage_path", str(tmp), "--storage_MiB", "2", "--storage_workers", "8"],
            "each worker writes whole 1 MiB blocks",
        ),
        (lambda tmp: ["--skip", "storage", "--memory_MiB", "1"], "it would measure cache, not memory"),
        (
            lambda tmp: ["--skip", "storage", "--memory_MiB", str(10**9)],
            "3 arrays need more than half of the",
        ),
        (lambda tmp: ["--only", "gpu", "--skip", "gpu"], "leave no section to run"),
        (lambda tmp: ["--storage_MiB", "0"], "'0' is not a positive whole number"),
        (lambda tmp: ["--only", "nccl", "--nccl_max_MiB", str(10**9)], "the largest collective's input and"),
        (lambda tmp: ["--nic_gbps", "0"], "--nic_gbps: '0' is not a positive number"),
        (lambda tmp: ["--gpu_seconds", "inf"], "--gpu_seconds: 'inf' is not a positive number"),
        (lambda tmp: ["--min_storage_GBps", "fast"], "--min_storage_GBps: 'fast' is not a positive number"),
        (
            lambda tmp: ["--outcome", str(a_file(tmp))],
            "--outcome {tmp}/file already exists; pass a new file name or remove it",
        ),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(tmp_path, capsys, arguments, message):
    with pytest.raises(SystemExit) as exit_status:
        benchmark.parse_args(arguments(tmp_path) + ["--report_dir", str(tmp_path / "logs")])
    assert exit_status.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 1 and stderr.startswith("error: ")
    assert message.format(tmp=tmp_path) in stderr


@pytest.mark.parametrize("check_only", [False, True], ids=["measuring", "check_only"])
@pytest.mark.parametrize(
    "train_args, lines",
    [
        ("--sharding=hybrid", ["--sharding=hybrid over groups of one process shards nothing: use "]),
        ("--bogus=1", ["unknown option --bogus; "]),
        ("--lr=fast", ["--lr expects a finite number, got 'fast'"]),
        ("--lr=0 --batch_size=0", ["--batch_size must be positive, got 0", "--lr must be positive, got 0.0"]),
        ("--config={tmp}/missing.yaml", ["--config={tmp}/missing.yaml: "]),
        ("--config={tmp}", ["--config: {tmp} is a folder, not a regular file; "]),
        ("--run_name='x", ["No closing quotation in \"--model=tiny --run_name='x\"; write train.py's "]),
        ("--plot={tmp} --dry_run", ["--plot, --dry_run: train.py does not train with them, and the "]),
    ],
)  # fmt: skip
def test_bad_train_args_are_a_line_each_naming_them_and_exit_2_before_any_measurement(
    tmp_path, capsys, monkeypatch, train_args, lines, check_only
):
    """A quote left open was a traceback; --check_only passed train_args unread; an option that makes
    train.py do something other than train was timed as another configuration's step."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # where train.py's own folders are checked
    reports = tmp_path / "reports"
    reports.mkdir()
    arguments = ["--quick", "--only=cpu", f"--report_dir={reports}", *(["--check_only"] * check_only),
                 f"--train_args=--model=tiny {train_args.format(tmp=tmp_path)}"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_status:
        benchmark.main(arguments)
    assert exit_status.value.code == 2
    said = capsys.readouterr().err.splitlines()
    assert len(said) == len(lines), said
    for line, start in zip(said, lines):
        assert line.startswith(f"error: --train_args: {start.format(tmp=tmp_path)}"), said
    assert not list(reports.iterdir())


@SIMULATES
def test_options_left_to_auto_or_a_run_without_prediction_are_not_timed_and_say_so(
    tmp_path, capsys, monkeypatch
):
    """--batch_size=auto was a TypeError after the measurements, --sharding=auto timed as full. The job passes
    its training options, auto ones included: they are checked, and the model's step is left out; so it is
    for a run with --predict=False, which has no use for it (it cost each benchmark a model build and a probe
    on every rank)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    arguments = ["--quick", "--only=cpu", f"--report_dir={tmp_path}", "--check_only",
                 "--train_args=--model=tiny --sharding=auto --batch_size=auto"]  # fmt: skip
    assert benchmark.main(arguments) == 0
    out = capsys.readouterr().out
    note = "note: --train_args: --sharding=auto, --batch_size=auto is chosen as train.py launches, so this "
    assert note in out
    assert benchmark.train_run("--model=tiny --activation_checkpointing=auto") is None
    assert benchmark.train_run("--model=tiny --predict=False") is None  # a step nobody will predict from
    note = "note: --train_args: --predict=False, so this model's step is not timed here"
    assert note in capsys.readouterr().out
    assert benchmark.train_run("--model=tiny") is not None


def without_a_hub(tmp_path, port, credentials=""):
    """The environment of a machine whose Hugging Face hub is at a local port, with an empty cache."""
    env = {key: value for key, value in os.environ.items() if key != "HF_HUB_OFFLINE"}
    hub = {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": f"http://{credentials}127.0.0.1:{port}"}
    return {**env, **hub, "NO_PROXY": "*", "no_proxy": "*"}


def test_a_hub_name_in_train_args_without_a_hub_is_one_line_at_once_and_a_stop_ends_it(tmp_path):
    """huggingface_hub retried an unreachable hub for 49 s, and once held on through a SIGTERM for 120 s. The
    hub is asked once, before any Hugging Face library loads: unreachable, what the run needs from it comes
    from the cache, or its line says it is missing; a mirror's credentials in HF_ENDPOINT are never shown."""
    benchmark_command = [sys.executable, str(ROOT / "benchmark.py"), "--quick", "--only=cpu",
                         f"--report_dir={tmp_path / 'reports'}"]  # fmt: skip
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        refusing = closed.getsockname()[1]  # nothing listens there once it is closed: refused at once
    refused = subprocess.run(
        [*benchmark_command, "--train_args=--model=tiny --data=hf:some/name --max_steps=5"],
        cwd=tmp_path, env=without_a_hub(tmp_path, refusing, "user:s3cret@"), capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert f"http://127.0.0.1:{refusing} is unreachable (" in refused.stdout, refused.stdout
    assert "s3cret" not in refused.stdout + refused.stderr
    [line] = refused.stderr.splitlines()
    assert line.startswith("error: --train_args: cannot load tokenizer 'gpt2' (") and "Retry" not in line
    with socket.socket() as silent:  # a hub that takes the connection and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(120)
        hub = silent.getsockname()[1]
        process = subprocess.Popen(
            [*benchmark_command, "--train_args=--model=tiny --init_from=org/model"], cwd=tmp_path, text=True,
            env=without_a_hub(tmp_path, hub), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            asking, _ = silent.accept()  # it waits for the hub's answer now
            process.send_signal(signal.SIGTERM)
            _, stderr = process.communicate(timeout=60)
            asking.close()
        finally:
            process.kill()
    # ended by the signal itself: a handler runs only once Python has control again, which a blocked name
    # lookup or a library's threads can hold off (it went unanswered for 120 s)
    assert process.returncode == -signal.SIGTERM, stderr[-2000:]
    assert not (tmp_path / "reports").exists() or not list((tmp_path / "reports").iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the case of a machine without a GPU")
def test_only_gpu_without_a_gpu_is_refused_not_passed(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_status:
        benchmark.parse_args(["--only", "gpu", "--report_dir", str(tmp_path)])
    assert exit_status.value.code == 2
    nothing = "--only=gpu on a machine without a GPU would check nothing; run it on a GPU node"
    assert capsys.readouterr().err == f"error: {nothing}\n"
