"""How far the predicted step (train.py --dry_run, run/predict.py) lies from the measured one, over a grid of
configurations on this machine's CPU with gloo: three model sizes, one and two processes, two and three
"nodes" of one process each and two of two (one torchrun agent a node, meeting through c10d rendezvous on this
host, as the job's srun starts one a node on the test cluster), every sharding mode, checkpointing
none/op/full, two micro-batch sizes and two sequence lengths.

    python tests/perf/bench_prediction.py                      # the whole grid, about 40 minutes on 2 cores
    python tests/perf/bench_prediction.py --only=0,3 --json=out.json

For each configuration, as the job does it: benchmark.py on the same layout with --train_args (the model's
own operations and collectives, timed on every rank at once), then the dry run's prediction from that
report, then the training run itself; the measured step is the median of its log windows after the first.
Prints a row each, then the median and the largest |predicted - measured| / measured. Run it on a quiet
machine: every figure is a wall-clock time, and the load average is printed with each row.
"""

import argparse
import json
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable

MODELS = {
    "tiny": ["--model=tiny"],
    "gpt2-4x384": ["--model=gpt2", "--n_layer=4", "--n_embd=384", "--n_head=6"],
    "gpt2": ["--model=gpt2"],
}
# (model, layout, sharding, checkpointing, micro-batch, sequence length); layout: "1" and "2" processes on
# this machine, "2n" and "3n" nodes of one process each, "2x2n" two nodes of two
GRID = [
    ("tiny", "1", "full", "none", 8, 128), ("tiny", "1", "full", "op", 4, 128),
    ("tiny", "1", "full", "full", 8, 256), ("tiny", "2", "full", "none", 8, 128),
    ("tiny", "2", "grad_op", "op", 4, 128), ("tiny", "2", "ddp", "none", 8, 128),
    ("tiny", "2x2n", "hybrid", "none", 8, 128), ("tiny", "2n", "full", "full", 4, 256),
    ("tiny", "3n", "full", "none", 8, 128), ("tiny", "3n", "grad_op", "op", 4, 64),
    ("gpt2-4x384", "1", "full", "none", 4, 128), ("gpt2-4x384", "1", "full", "full", 8, 128),
    ("gpt2-4x384", "2", "full", "op", 4, 256), ("gpt2-4x384", "2", "ddp", "none", 4, 128),
    ("gpt2-4x384", "2x2n", "hybrid", "none", 4, 128), ("gpt2-4x384", "3n", "full", "op", 2, 128),
    ("gpt2", "1", "full", "none", 2, 128), ("gpt2", "2", "full", "op", 2, 128),
    ("gpt2", "2n", "grad_op", "full", 2, 64),
]  # fmt: skip
STEPS, LOG_EVERY = 12, 3


def layout(name):
    """(world size, processes a node, nodes) of "1", "2" (processes), "2n", "3n" (nodes of one) or "2x2n"."""
    if not name.endswith("n"):
        return int(name), int(name), 1
    per_node, _, nodes = name.removesuffix("n").rpartition("x")
    per_node, nodes = int(per_node or 1), int(nodes)
    return nodes * per_node, per_node, nodes


def launch(name, script, args, folder, port):
    """script under the layout: a plain process, torchrun --standalone, or one torchrun agent a node."""
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


def options(config):
    model, name, sharding, checkpointing, batch, seq = config
    world, _, _ = layout(name)
    return [*MODELS[model], f"--sharding={sharding}", f"--activation_checkpointing={checkpointing}",
            f"--batch_size={batch}", f"--global_batch_size={batch * world * 2}", f"--seq_length={seq}",
            "--compile=False", "--mixed_precision=fp32"]  # fmt: skip


def measure(index, config, folder):
    name = config[1]
    world, per_node, _ = layout(name)
    train_args, port = options(config), 29600 + index
    report = folder / "report.yaml"
    bench = ["--quick", "--only=nccl,links,cpu,memory", f"--report={report}", f"--report_dir={folder}",
             f"--train_args={shlex.join([*train_args, '--predict=False'])}"]  # fmt: skip
    done = launch(name, "benchmark.py", bench, folder, port)
    if not report.exists():
        return {"error": f"benchmark: {done.stderr[-800:]}"}
    dry = [PYTHON, "train.py", "--dry_run", "--gpu=cpu", f"--world_size={world}",
           f"--gpus_per_node={per_node}", f"--benchmark_report={report}", *train_args]  # fmt: skip
    predicted = subprocess.run(dry, cwd=REPO, capture_output=True, text=True)
    line = re.search(r"^predicted step: ([\d.e+-]+) s", predicted.stdout, re.M)
    if not line:
        return {"error": f"dry run: {predicted.stdout[-500:]} {predicted.stderr[-800:]}"}
    run = [*train_args, "--predict=False", f"--max_steps={STEPS}", f"--log_every={LOG_EVERY}",
           "--tensorboard=False", "--curves=False", f"--log_dir={folder}/logs", "--run_name=r",
           f"--checkpoint_dir={folder}/ck", "--checkpoint_every=1000", "--eval_every=0"]  # fmt: skip
    trained = launch(name, "train.py", run, folder, port + 100)
    metrics = folder / "logs" / "r" / "metrics.jsonl"
    if trained.returncode or not metrics.exists():
        return {"error": f"training: {trained.stderr[-800:]}"}
    windows = [json.loads(record)["step_time_s"] for record in metrics.read_text().splitlines()][1:]
    measured = statistics.median(windows)
    prediction = float(line[1])
    return {"predicted_s": prediction, "measured_s": measured, "error": (prediction - measured) / measured,
            "windows_s": windows, "load": os.getloadavg()[0]}  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated indices of GRID to run")
    parser.add_argument("--json", help="write the rows here too")
    cli = parser.parse_args()
    chosen = [int(i) for i in cli.only.split(",")] if cli.only else range(len(GRID))
    rows = []
    print(f"host {socket.gethostname()}, {os.cpu_count()} cores", flush=True)
    for index in chosen:
        config = GRID[index]
        with tempfile.TemporaryDirectory() as folder:
            row = {"index": index, "config": config, **measure(index, config, Path(folder))}
        rows.append(row)
        if isinstance(row.get("error"), str):
            print(f"{index:>3} {config}: {row['error']}", flush=True)
        else:
            figures = f"predicted {row['predicted_s']:.4f} s, measured {row['measured_s']:.4f} s"
            print(f"{index:>3} {' '.join(map(str, config)):<40} {figures}: {row['error']:+.1%} "
                  f"(load {row['load']:.1f})", flush=True)  # fmt: skip
    errors = [abs(row["error"]) for row in rows if isinstance(row.get("error"), float)]
    if errors:
        median, largest = statistics.median(errors), max(errors)
        print(f"{len(errors)} configurations: median |error| {median:.1%}, largest {largest:.1%}")
    if cli.json:
        Path(cli.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
