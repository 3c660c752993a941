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
import socket
import statistics
import subprocess
import tempfile
from pathlib import Path

from host_runs import MODELS, PYTHON, REPO, benchmark_report, layout, measured_step

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
    report = benchmark_report(name, train_args, folder, port)
    if isinstance(report, dict):
        return report
    dry = [PYTHON, "train.py", "--dry_run", "--gpu=cpu", f"--world_size={world}",
           f"--gpus_per_node={per_node}", f"--benchmark_report={report}", *train_args]  # fmt: skip
    predicted = subprocess.run(dry, cwd=REPO, capture_output=True, text=True)
    line = re.search(r"^predicted step: ([\d.e+-]+) s", predicted.stdout, re.M)
    if not line:
        return {"error": f"dry run: {predicted.stdout[-500:]} {predicted.stderr[-800:]}"}
    measured = measured_step(name, train_args, folder, port + 100)
    if "error" in measured:
        return measured
    prediction = float(line[1])
    error = (prediction - measured["measured_s"]) / measured["measured_s"]
    return {"predicted_s": prediction, **measured, "error": error, "load": os.getloadavg()[0]}


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
