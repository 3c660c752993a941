"""benchmark.py and train.py run for real on a layout of this host, for the perf scripts that hold a
prediction against a measurement (bench_prediction.py, bench_plan.py): the layout's processes and nodes, the
report of benchmark.py --train_args on it, and a training run's measured step, the median of its log windows
after the first (which compiles and loads)."""

import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable

MODELS = {
    "tiny": ["--model=tiny"],
    "gpt2-4x384": ["--model=gpt2", "--n_layer=4", "--n_embd=384", "--n_head=6"],
    "gpt2": ["--model=gpt2"],
}
STEPS, LOG_EVERY = 12, 3


def layout(name):
    """(world size, processes a node, nodes) of "1", "2" (processes), "2n", "3n" (nodes of one) or "2x2n"."""
    if not name.endswith("n"):
        return int(name), int(name), 1
    per_node, _, nodes = name.removesuffix("n").rpartition("x")
    per_node, nodes = int(per_node or 1), int(nodes)
    return nodes * per_node, per_node, nodes


def launch(name, script, args, port):
    """script under the layout: a plain process, torchrun --standalone, or one torchrun agent a node, meeting
    through c10d rendezvous on this host at port (as the job's srun starts one a node on the test cluster)."""
    world, per_node, nodes = layout(name)
    if world == 1:
        return subprocess.run([PYTHON, script, *args], cwd=REPO, capture_output=True, text=True)
    if nodes == 1:
        command = [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={per_node}"]
        return subprocess.run([*command, script, *args], cwd=REPO, capture_output=True, text=True)
    agents = [
        subprocess.Popen(
            [
                PYTHON,
                "-m",
                "torch.distributed.run",
                f"--nnodes={nodes}",
                f"--nproc_per_node={per_node}",
                f"--node_rank={node}",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint=127.0.0.1:{port}",
                "--rdzv_id=bench",
                script,
                *args,
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "SLURMD_NODENAME": f"n{node + 1}"},
        )  # fmt: skip
        for node in range(nodes)
    ]
    outputs = [agent.communicate() for agent in agents]
    return subprocess.CompletedProcess(args, max(a.returncode for a in agents), outputs[0][0], outputs[0][1])


def benchmark_report(name, train_args, folder, port):
    """benchmark.py on the layout, as the job runs it before training: the model's own operations and
    collectives of train_args timed on every rank at once. The report's path, or {"error": why}."""
    report = folder / "report.yaml"
    bench = ["--quick", "--only=nccl,links,cpu,memory", f"--report={report}", f"--report_dir={folder}",
             f"--train_args={shlex.join([*train_args, '--predict=False'])}"]  # fmt: skip
    done = launch(name, "benchmark.py", bench, port)
    return report if report.exists() else {"error": f"benchmark: {done.stderr[-800:]}"}


def measured_step(name, train_args, folder, port, steps=STEPS, log_every=LOG_EVERY):
    """Trains train_args on the layout for `steps` steps: {"measured_s": the median of the log windows after
    the first, "windows_s": those windows}, or {"error": why}."""
    run = [*train_args, "--predict=False", f"--max_steps={steps}", f"--log_every={log_every}",
           "--tensorboard=False", "--curves=False", f"--log_dir={folder}/logs", "--run_name=r",
           f"--checkpoint_dir={folder}/ck", "--checkpoint_every=1000", "--eval_every=0"]  # fmt: skip
    trained = launch(name, "train.py", run, port)
    metrics = folder / "logs" / "r" / "metrics.jsonl"
    if trained.returncode or not metrics.exists():
        return {"error": f"training: {trained.stderr[-800:]}"}
    windows = [json.loads(record)["step_time_s"] for record in metrics.read_text().splitlines()][1:]
    if not windows:
        return {"error": f"training: {steps} steps logged every {log_every} leave no window after the first"}
    return {"measured_s": statistics.median(windows), "windows_s": windows}
