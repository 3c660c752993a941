"""The README's first command, as a user runs it on a machine without SLURM or GPUs."""

import os
import re
import subprocess

from conftest import REPO


def test_quick_start_trains_tiny_on_two_cpu_processes_and_the_loss_falls():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(
        ["bash", "slurm_submit.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "phase 1: benchmark.py --quick" in result.stdout
    # one node: no peers for the CPU figures; a slow rank in a collective would warn and training goes on
    assert re.search(r"^verdict: (pass|warn) in ", result.stdout, re.MULTILINE), result.stdout[-3000:]
    assert "world_size=2" in result.stdout
    losses = [float(loss) for loss in re.findall(r"^step +\d+/\d+ \| loss ([\d.]+)", result.stdout, re.M)]
    assert len(losses) == 8 and losses[-1] < losses[0] - 1.0, losses
    assert "On a GPU cluster: sbatch slurm_submit.sh" in result.stdout
