"""Where benchmark.py's reports go: --report=PATH exactly, under torchrun too; two runs into one folder keep
two reports, each printing its own; and the one-line refusals about report folders and storage space."""

import json
import os
import re
import subprocess

import pytest
from conftest import torchrun_command

import benchmark
from checks.inputs import bytes_text

QUICK = ["--quick", "--only=cpu"]  # the shortest real run: the paths, not the figures, are under test


def printed_report(stdout: str) -> str:
    line = re.search(r"^verdict: \w+ in .*; report: (\S+); picture: (\S+)$", stdout, re.M)
    assert line, stdout[-2000:]
    return line[1]


def refusal(capsys, *arguments) -> str:
    with pytest.raises(SystemExit) as exit_status:
        benchmark.parse_args(list(arguments))
    assert exit_status.value.code == 2
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 1 and stderr.startswith("error: "), stderr
    return stderr


def test_two_runs_started_together_into_one_folder_leave_two_reports(tmp_path):
    """One job id for both (as two runs in the same second have one time stamp): the second takes _2."""
    env = {**os.environ, "SLURM_JOB_ID": "same"}
    command = torchrun_command("benchmark.py", [*QUICK, f"--report_dir={tmp_path}"], nproc=0)
    runs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    runs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [run.communicate(timeout=180) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err[-2000:] for _, err in outputs]
    printed = sorted(printed_report(out) for out, _ in outputs)
    assert printed == [str(tmp_path / "benchmark_same.yaml"), str(tmp_path / "benchmark_same_2.yaml")]
    reports = sorted(path.name for path in tmp_path.glob("benchmark_same*.yaml"))
    assert reports == [
        "benchmark_same.yaml",
        "benchmark_same_2.yaml",
        "benchmark_same_2_rank0.yaml",
        "benchmark_same_rank0.yaml",
    ]
    assert not list(tmp_path.glob("*.tmp"))


def test_report_path_is_taken_exactly_under_torchrun_and_then_refused(tmp_path, capsys):
    report = tmp_path / "runs" / "job" / "cluster.yaml"
    outcome = report.with_name("outcome.json")
    command = torchrun_command(
        "benchmark.py", [*QUICK, f"--report={report}", f"--outcome={outcome}"], nproc=2
    )
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert printed_report(result.stdout) == str(report)
    assert sorted(path.name for path in report.parent.iterdir()) == [
        "benchmark_history.jsonl",
        "cluster.png",
        "cluster.yaml",
        "cluster_rank0.yaml",
        "outcome.json",
    ]
    assert json.loads(outcome.read_text()) == {"verdict": "pass", "report": str(report), "failed_nodes": {}}
    assert not (tmp_path / "logs").exists()  # --report_dir's default is not touched
    stderr = refusal(capsys, *QUICK, f"--report={report}")
    assert stderr == f"error: --report {report} already exists; pass a new file name or remove it\n"


def test_a_broken_symlink_as_report_dir_is_named(tmp_path, capsys):
    link = tmp_path / "reports"
    link.symlink_to(tmp_path / "gone")
    stderr = refusal(capsys, *QUICK, f"--report_dir={link / 'today'}")
    assert f"{link} is a broken symbolic link (to {tmp_path / 'gone'})" in stderr
    assert "File exists" not in stderr


def test_storage_space_refusal_shows_the_numbers(tmp_path, capsys):
    stderr = refusal(
        capsys, "--quick", "--only=storage", f"--storage_path={tmp_path}", "--storage_MiB=1000000000"
    )
    free, needed = re.search(r"([\d.]+ \w+) free, the storage test needs ([\d.]+ \w+);", stderr).groups()
    assert needed == "2.1 PB" and not free.startswith("0.0 ")
    assert [bytes_text(n) for n in (0, 999, 1000, 420e3, 67.1e6, 1e9, 3.2e12)] == [
        "0 bytes",
        "999 bytes",
        "1.0 kB",
        "420.0 kB",
        "67.1 MB",
        "1.0 GB",
        "3.2 TB",
    ]


def test_a_refused_benchmark_leaves_no_report_folder_it_made(tmp_path, capsys):
    """The report folder is made before the other checks: a run refused by them left it behind."""
    reports = tmp_path / "new" / "reports"
    for arguments in (
        ["--only=storage", f"--storage_path={tmp_path / 'missing'}", f"--report={reports / 'r.yaml'}"],
        ["--only=memory", "--memory_MiB=1", f"--report_dir={reports}"],
        ["--only=cpu", "--train_args=--model=tiny --batch_size=0", f"--report_dir={reports}", "--check_only"],
    ):
        with pytest.raises(SystemExit) as exit_status:
            benchmark.main(arguments)
        assert exit_status.value.code == 2 and capsys.readouterr().err.startswith("error: ")
        assert os.listdir(tmp_path) == []
