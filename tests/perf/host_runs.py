"""benchmark.py and train.py run for real on this host, for the perf scripts that hold a prediction against a
measurement (bench_prediction.py, bench_plan.py): a training run's own prediction and its measured step, the
median of its log windows after the first (which compiles and loads); a benchmark report, with the probe of
a configuration (--train_args) or without; a dry run's predicted step from a report."""

import json
import os
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable

MODELS = {
    "tiny": ["--model=tiny"],
    "tiny-llama": ["--model=tiny-llama"],
    "tiny-mixtral": ["--model=tiny-mixtral"],
    "gpt2-4x384": ["--model=gpt2", "--n_layer=4", "--n_embd=384", "--n_head=6"],
    "gpt2-6x384": ["--model=gpt2", "--n_layer=6", "--n_embd=384", "--n_head=6"],
    "gpt2": ["--model=gpt2"],
}
# A prediction line: its step (or a roofline's range) and its basis in brackets
NUMBER = r"[\d.]+(?:e[+-]?\d+)?"
PREDICTED = re.compile(rf"^predicted step: ({NUMBER})(?:-({NUMBER}))? s.*", re.M)
REFUSED = re.compile(r"^not predicted: (.*)$", re.M)


def launch(processes, script, args, env=None):
    """script as a plain process (one) or under torchrun --standalone."""
    command = [PYTHON, script]
    if processes > 1:
        command = [
            PYTHON,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={processes}",
            script,
        ]
    return subprocess.run(
        [*command, *args], cwd=REPO, capture_output=True, text=True, env={**os.environ, **(env or {})}
    )


def prediction_of(stdout):
    """(step s, or the middle of a roofline's range; (low, high) or None; the line) of a printed prediction,
    or (None, None, why it was not predicted)."""
    line = PREDICTED.search(stdout)
    if line is None:
        refused = REFUSED.search(stdout)
        return None, None, refused[1] if refused else "no prediction printed"
    low, high = float(line[1]), float(line[2] or line[1])
    return (low * high) ** 0.5, (low, high) if line[2] else None, line[0]


def trained(processes, train_args, folder, steps, log_every, env=None):
    """Trains train_args with its own prediction (--predict=True): {"measured_s": the median of the log
    windows after the first, "windows_s", "predicted_s", "line", "seconds_to_first_step"}, or {"error":
    why}."""
    run = [*train_args, "--predict=True", f"--max_steps={steps}", f"--log_every={log_every}",
           "--tensorboard=False", "--curves=False", f"--log_dir={folder}/logs", "--run_name=r",
           f"--checkpoint_dir={folder}/ck", "--checkpoint_every=1000", "--eval_every=0"]  # fmt: skip
    done = launch(processes, "train.py", run, env)
    metrics = folder / "logs" / "r" / "metrics.jsonl"
    if done.returncode or not metrics.exists():
        return {"error": f"training: {done.stdout[-400:]} {done.stderr[-800:]}"}
    windows = [json.loads(record)["step_time_s"] for record in metrics.read_text().splitlines()][1:]
    predicted, _, line = prediction_of(done.stdout)
    first = re.search(r"^time to first step: ([\d.]+) s", done.stdout, re.M)
    kept = folder / "logs" / "r" / "prediction.json"
    probe = json.loads(kept.read_text())["prediction"] if kept.exists() else {}
    note = re.search(r"^note: this prediction is not kept.*$", done.stdout, re.M)
    return {"measured_s": statistics.median(windows), "windows_s": windows, "predicted_s": predicted,
            "line": line, "seconds_to_first_step": float(first[1]) if first else None,
            "spread": probe.get("spread"), "others": probe.get("others"), "probe_s": probe.get("probe_s"),
            "not_kept": note[0] if note else None}  # fmt: skip


def benchmark_report(processes, train_args, folder, env=None):
    """benchmark.py on this host as the job runs it, with the probe of train_args (None: without): the
    report's path, or {"error": why}."""
    report = folder / ("report_model.yaml" if train_args else "report.yaml")
    bench = ["--quick", "--only=nccl,cpu,memory", f"--report={report}", f"--report_dir={folder}"]
    if train_args:
        bench.append(f"--train_args={shlex.join(train_args)}")
    done = launch(processes, "benchmark.py", bench, env)
    return report if report.exists() else {"error": f"benchmark: {done.stderr[-800:]}"}


def dry_run_prediction(processes, train_args, report, env=None):
    """(step s, range or None, line) of train.py --dry_run --gpu=cpu from report for this many processes."""
    dry = [PYTHON, "train.py", "--dry_run", "--gpu=cpu", f"--world_size={processes}",
           f"--gpus_per_node={processes}", f"--benchmark_report={report}", *train_args]  # fmt: skip
    done = subprocess.run(dry, cwd=REPO, capture_output=True, text=True, env={**os.environ, **(env or {})})
    return prediction_of(done.stdout + done.stderr)
