"""How far the predicted step lies from the measured one, on each basis, over a grid of configurations on this
machine's CPU with gloo: compile on and off, the default global batch (gradient accumulation), 1 to 3
processes, every sharding and activation checkpointing mode, four model families.

    python tests/perf/bench_prediction.py --half=tuning         # the rows the cost model was built on
    python tests/perf/bench_prediction.py --half=held-out       # the rows it never saw
    python tests/perf/bench_prediction.py --only=0,1 --repeats=3 --json=out.json
    ATEN_CPU_CAPABILITY=avx2 python tests/perf/bench_prediction.py --only=0,2,5 --threads=1

For each configuration: train.py trains it (--predict=True) --repeats times, each printing its own prediction,
measured on this run's own processes before its first step (the measured basis); the measured step is the
median of its log windows after the first. Then benchmark.py probes the same configuration (--train_args)
and the dry run predicts from that report (a report's probe of this model), and from the same report without
its probe (a roofline from its figures, a range). Prints a row each and, per basis, the median and largest
|predicted - measured| / measured, with the run-to-run spread of the measured step beside them. Run it on a
quiet machine alone: every figure is a wall-clock time, and the load average is printed with each row.
"""

import argparse
import json
import os
import socket
import statistics
import tempfile
from pathlib import Path

import yaml
from host_runs import MODELS, benchmark_report, dry_run_prediction, trained

# name, model, processes, sharding, checkpointing, compile, micro-batch, sequence, global batch. Committed
# before the cost model was tuned; the odd rows are held out, run only once it was frozen.
GRID = [
    ("quick start", "tiny", 2, "full", "op", False, 8, 256, 256),
    ("newcomer", "tiny", 1, "full", "op", False, 8, 256, 256),
    ("6x384", "gpt2-6x384", 1, "full", "op", False, 8, 256, 8),
    ("tiny compiled", "tiny", 1, "full", "none", True, 8, 128, 16),
    ("grad_op", "tiny", 2, "grad_op", "op", False, 4, 128, 64),
    ("ddp", "tiny", 2, "ddp", "none", False, 8, 128, 32),
    ("hybrid", "tiny", 2, "hybrid", "full", False, 8, 128, 16),
    ("3 processes", "tiny", 3, "full", "selective", False, 4, 128, 24),
    ("llama compiled", "tiny-llama", 2, "full", "op", True, 8, 128, 16),
    ("4x384 full", "gpt2-4x384", 1, "full", "full", False, 8, 128, 16),
    ("4x384 compiled", "gpt2-4x384", 2, "full", "none", True, 4, 128, 8),
    ("4x384 ddp", "gpt2-4x384", 2, "ddp", "op", False, 4, 256, 16),
    ("4x384 3 grad_op", "gpt2-4x384", 3, "grad_op", "none", False, 2, 128, 6),
    ("gpt2", "gpt2", 1, "full", "op", False, 2, 128, 2),
    ("6x384 compiled", "gpt2-6x384", 2, "full", "selective", True, 4, 256, 8),
    ("mixtral", "tiny-mixtral", 1, "full", "none", False, 8, 128, 16),
    ("4x384 hybrid", "gpt2-4x384", 2, "hybrid", "op", False, 4, 128, 16),
    ("tiny compiled acc", "tiny", 1, "full", "full", True, 8, 256, 256),
    ("4x384 1 compiled", "gpt2-4x384", 1, "full", "op", True, 4, 128, 8),
    ("llama 3 ddp", "tiny-llama", 3, "ddp", "full", False, 4, 64, 12),
]
HALVES = {"tuning": range(0, len(GRID), 2), "held-out": range(1, len(GRID), 2)}


def options(row):
    _, model, _, sharding, checkpointing, compiled, batch, seq, global_batch = row
    return [*MODELS[model], f"--sharding={sharding}", f"--activation_checkpointing={checkpointing}",
            f"--compile={compiled}", f"--batch_size={batch}", f"--seq_length={seq}",
            f"--global_batch_size={global_batch}", "--mixed_precision=fp32"]  # fmt: skip


def error(predicted, measured):
    return None if predicted is None else (predicted - measured) / measured


def measure(row, folder, repeats, env):
    processes, train_args = row[2], options(row)
    accumulation = row[8] // (row[6] * processes)
    steps, log_every = (5, 2) if accumulation >= 16 else (9, 2)
    runs = [
        trained(processes, train_args, folder / f"run{index}", steps, log_every, env)
        for index in range(repeats)
    ]
    if any("error" in run for run in runs):
        return next(run for run in runs if "error" in run)
    steps = [run["measured_s"] for run in runs]
    measured = statistics.median(steps)
    figures = {"measured_s": measured, "runs_s": steps, "spread": (max(steps) - min(steps)) / measured,
               "measured": [error(run["predicted_s"], run["measured_s"]) for run in runs],
               "lines": [run["line"] for run in runs],
               "probes": [{k: run[k] for k in ("spread", "others", "probe_s", "not_kept")} for run in runs],
               "to_first_step_s": [run["seconds_to_first_step"] for run in runs],
               "windows_apart": max((max(run["windows_s"]) - min(run["windows_s"])) / run["measured_s"]
                                    for run in runs)}  # fmt: skip
    report = benchmark_report(processes, train_args, folder, env)
    if isinstance(report, dict):
        return {**figures, **report}
    predicted, _, line = dry_run_prediction(processes, train_args, report, env)
    figures.update(report=error(predicted, measured), report_line=line)
    without_probe = folder / "report_figures.yaml"
    content = yaml.safe_load(report.read_text())
    content.pop("model", None)
    without_probe.write_text(yaml.safe_dump(content))
    middle, span, line = dry_run_prediction(processes, train_args, without_probe, env)
    figures.update(roofline=error(middle, measured), roofline_range=span, roofline_line=line)
    return figures


def summary(rows, basis):
    errors = [abs(row[basis]) for row in rows if isinstance(row.get(basis), float)]
    if basis == "measured":
        errors = [abs(value) for row in rows for value in row.get("measured") or [] if value is not None]
    if not errors:
        return f"{basis}: none"
    spreads = [row["spread"] for row in rows if "spread" in row]
    return (f"{basis}: median |error| {statistics.median(errors):.1%}, largest {max(errors):.1%} over "
            f"{len(errors)} predictions; run-to-run spread of the measured step: median "
            f"{statistics.median(spreads):.1%}, largest {max(spreads):.1%}")  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--half", choices=sorted(HALVES), help="one half of GRID")
    parser.add_argument("--only", help="comma-separated indices of GRID to run")
    parser.add_argument("--repeats", type=int, default=2, help="training runs of each configuration")
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for every process")
    parser.add_argument("--json", help="write the rows here too")
    cli = parser.parse_args()
    chosen = [int(i) for i in cli.only.split(",")] if cli.only else HALVES.get(cli.half, range(len(GRID)))
    env = {"OMP_NUM_THREADS": str(cli.threads)} if cli.threads else {}
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "the CPU's best")
    print(f"host {socket.gethostname()}, {os.cpu_count()} cores, kernels: {capability}, "
          f"threads: {cli.threads or 'default'}", flush=True)  # fmt: skip
    rows = []
    for index in chosen:
        with tempfile.TemporaryDirectory() as folder:
            figures = measure(GRID[index], Path(folder), cli.repeats, env)
        row = {"index": index, "config": GRID[index], **figures, "load": os.getloadavg()[0]}
        rows.append(row)
        if "error" in row:
            print(f"{index:>3} {GRID[index][0]}: {row['error']}", flush=True)
            continue
        errors = " ".join(f"{value:+.1%}" if value is not None else "refused" for value in row["measured"])
        report = f"{row['report']:+.1%}" if row.get("report") is not None else row.get("report_line")
        low, high = row.get("roofline_range") or (float("nan"),) * 2
        print(f"{index:>3} {GRID[index][0]:<18} measured {row['measured_s']:.4g} s (runs {row['spread']:.1%} "
              f"apart, a run's windows up to {row['windows_apart']:.0%}) | measured basis {errors} | "
              f"report {report} | roofline {low:.3g}-{high:.3g} s, "
              f"measured {row['measured_s'] / low:.2f}x its low end | load {row['load']:.1f}",
              flush=True)  # fmt: skip
    for basis in ("measured", "report", "roofline"):
        print(summary([row for row in rows if "error" not in row], basis))
    if cli.json:
        Path(cli.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
