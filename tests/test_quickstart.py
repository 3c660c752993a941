"""The README's first command, as a user runs it on a machine without SLURM or GPUs: its folders given on the
command line, so that the test writes only under its temporary folder."""

import os
import re
import subprocess

from conftest import REPO


def test_quick_start_trains_tiny_on_two_cpu_processes_and_the_loss_falls(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["BENCHMARK_ARGS"] = f"--report_dir={tmp_path}/reports --storage_path={tmp_path}"
    folders = [f"--log_dir={tmp_path}/logs", f"--checkpoint_dir={tmp_path}/checkpoints"]
    result = subprocess.run(
        ["bash", "slurm_submit.sh", *folders], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "phase 1: benchmark.py --quick" in result.stdout
    # one node: no peers for the CPU figures; a slow rank in a collective would warn and training goes on
    verdict = re.search(r"^verdict: (pass|warn) in .*; report: (\S+);", result.stdout, re.MULTILINE)
    assert verdict and verdict.group(2).startswith(f"{tmp_path}/reports/benchmark_"), result.stdout[-3000:]
    assert "world_size=2" in result.stdout
    losses = [float(loss) for loss in re.findall(r"^step +\d+/\d+ \| loss ([\d.]+)", result.stdout, re.M)]
    assert len(losses) == 8 and losses[-1] < losses[0] - 1.0, losses
    assert "On a GPU cluster: sbatch slurm_submit.sh" in result.stdout
    # the job counted its benchmark phase in the run's time
    ledger = next((tmp_path / "logs").glob("quickstart-*/goodput.json")).read_text()
    assert re.search(r'"benchmark_s": [1-9]', ledger), ledger
