"""How good the planner's pick is (train.py --plan): every candidate the plan lists as fitting is trained for
real on this machine's CPU with gloo, and the pick (the plan's first row, the fastest predicted) is held
against the fastest measured. The target: the pick's measured step within 5% of the fastest's.

    python tests/perf/bench_plan.py                    # tiny on 1 and 2 processes
    python tests/perf/bench_plan.py --processes=1 --limit=6 --json=plan.json
    python tests/perf/bench_plan.py --auto=batch_size  # only the micro-batch is planned: minutes

For each model and number of processes: `train.py --plan --gpu=cpu` over the options of --auto at a fixed
global batch and sequence length (each candidate that fits is probed on this CPU on as many processes), then
each candidate it lists, trained one after another for a dozen steps; a measured step is the median of the
log windows after the first. The options the plan does not choose are train.py's defaults
(--sharding=full, --activation_checkpointing=op) and the micro-batch of a rank's whole share of the global
batch. --limit=N trains only the plan's first N: the comparison then covers only those, and says so. Run
it on a quiet machine: every figure is a wall-clock time, and the load average is printed with each row.
"""

import argparse
import itertools
import json
import os
import re
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from host_runs import MODELS, PYTHON, REPO, trained

PLANNED = ("sharding", "activation_checkpointing", "batch_size")
FIXED = {"sharding": "full", "activation_checkpointing": "op"}
STEPS, LOG_EVERY = 12, 2
TARGET = 0.05  # the pick's measured step at most this much slower than the fastest measured


def base_options(model, global_batch, seq_length):
    return [*MODELS[model], f"--global_batch_size={global_batch}", f"--seq_length={seq_length}",
            "--compile=False", "--mixed_precision=fp32"]  # fmt: skip


def planned_options(auto, world, global_batch):
    """--option=auto for those the plan chooses, the fixed value of the others."""
    fixed = {**FIXED, "batch_size": global_batch // world}
    return [f"--{name}={'auto' if name in auto else fixed[name]}" for name in PLANNED]


def candidate_options(row):
    group = [f"--shard_group_size={row['shard_group_size']}"] if row["shard_group_size"] else []
    checkpointing = row["activation_checkpointing"]
    return [f"--sharding={row['sharding']}", *group, f"--activation_checkpointing={checkpointing}",
            f"--batch_size={row['batch_size']}"]  # fmt: skip


def parse_plan(stdout):
    """The rows of run/prediction/plan.py's print_plan, fastest predicted first: the candidate, its predicted
    step and peak; (None, why) where the output is not a plan whose row count matches its headline."""
    headline = re.search(r"^plan: (\d+) of (\d+) candidates fit", stdout, re.M)
    if not headline:
        return None, "no plan headline"
    table = stdout[headline.end() :].splitlines()[2:]  # past the headline's end and the column names
    rows = []
    for line in itertools.takewhile(lambda line: line.startswith("  ") and len(line.split()) == 6, table):
        sharding, checkpointing, batch, step, _, peak = line.split()
        sharding, _, group = sharding.partition("/")
        rows.append({"sharding": sharding, "shard_group_size": int(group) if group else None,
                     "activation_checkpointing": checkpointing, "batch_size": int(batch),
                     "predicted_s": float(step), "peak_gb": float(peak)})  # fmt: skip
    if len(rows) != int(headline[1]):
        return None, f"{len(rows)} rows parsed of the {headline[1]} the headline says fit"
    return rows, int(headline[2])


def describe(row):
    group = f"/{row['shard_group_size']}" if row["shard_group_size"] else ""
    return f"{row['sharding']}{group} {row['activation_checkpointing']} {row['batch_size']}"


def measure(model, processes, cli, folder):
    """The plan of model on this many processes, each of its first cli.limit candidates trained: {"rows":
    [...], "candidates": how many the plan tried, "fitting": how many fit}, or {"error": why}."""
    base = base_options(model, cli.global_batch_size, cli.seq_length)
    auto = planned_options(cli.auto, processes, cli.global_batch_size)
    command = [PYTHON, "train.py", "--plan", "--gpu=cpu", f"--world_size={processes}",
               f"--gpus_per_node={processes}", f"--log_dir={folder}", *base, *auto]  # fmt: skip
    started = time.perf_counter()
    planned = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    plan_s = time.perf_counter() - started
    rows, tried = parse_plan(planned.stdout)
    if rows is None:
        return {"error": f"plan: {tried}: {planned.stdout[-500:]} {planned.stderr[-800:]}"}
    chosen = rows[: cli.limit]
    which = "all" if len(chosen) == len(rows) else f"the first {len(chosen)}"
    print(f"{model} on {processes}: {len(rows)} of {tried} candidates fit (planned in {plan_s:.0f} s); "
          f"training {which}", flush=True)  # fmt: skip
    for index, row in enumerate(chosen):
        train_args, started = [*base, *candidate_options(row)], time.perf_counter()
        with tempfile.TemporaryDirectory(dir=folder) as run_folder:  # its checkpoint gone once measured
            found = trained(processes, train_args, Path(run_folder), cli.steps, LOG_EVERY)
        row.update({key: found[key] for key in ("measured_s", "error") if key in found})
        row["wall_s"], row["load"] = time.perf_counter() - started, os.getloadavg()[0]
        figure = row["error"] if "error" in row else f"measured {row['measured_s']:.4g} s"
        print(f"  {index + 1:>3} {describe(row):<22} predicted {row['predicted_s']:.4g} s, {figure} "
              f"(load {row['load']:.1f}, {row['wall_s']:.0f} s)", flush=True)  # fmt: skip
    return {"rows": chosen, "candidates": tried, "fitting": len(rows), "plan_s": plan_s}


def rank(result):
    """Sets each trained row's rank by prediction (the plan's order), by measurement (None if it failed)
    and its prediction's error; returns those measured, fastest first."""
    measured = sorted(
        (row for row in result["rows"] if "measured_s" in row), key=lambda row: row["measured_s"]
    )
    measured_rank = {id(row): index + 1 for index, row in enumerate(measured)}
    for index, row in enumerate(result["rows"]):
        row["predicted_rank"], row["measured_rank"] = index + 1, measured_rank.get(id(row))
        if "measured_s" in row:
            row["prediction_error"] = (row["predicted_s"] - row["measured_s"]) / row["measured_s"]
    return measured


def report(model, name, result):
    """The ranked table, then the pick against the fastest measured; the pick's gap, or None."""
    measured = rank(result)
    print(f"{model} on {name}, fastest predicted first:")
    print(f"  {'candidate':<22} {'predicted s':>11} {'measured s':>10} {'error':>7} {'rank pred':>9} "
          f"{'rank meas':>9}")  # fmt: skip
    for row in result["rows"]:
        if "measured_s" in row:
            figures = f"{row['measured_s']:>10.4g} {row['prediction_error']:>+7.1%}"
        else:
            figures = f"{'failed':>10} {'':>7}"
        print(f"  {describe(row):<22} {row['predicted_s']:>11.4g} {figures} {row['predicted_rank']:>9} "
              f"{row['measured_rank'] or '-':>9}")  # fmt: skip
    pick = result["rows"][0]
    if not measured or "measured_s" not in pick:
        print("  the pick did not train: no comparison")
        return None
    fastest, gap = measured[0], pick["measured_s"] / measured[0]["measured_s"] - 1
    covered, fitting = len(result["rows"]), result["fitting"]
    scope = "" if covered == fitting else f", over the plan's first {covered} of {fitting} candidates only"
    print(f"  pick: {describe(pick)}, predicted {pick['predicted_s']:.4g} s, "
          f"measured {pick['measured_s']:.4g} s")  # fmt: skip
    print(f"  fastest measured: {describe(fastest)}, {fastest['measured_s']:.4g} s "
          f"(rank {fastest['predicted_rank']} predicted)")  # fmt: skip
    verdict = "within" if gap <= TARGET else "outside"
    print(f"  the pick is {gap:+.1%} from the fastest measured: {verdict} the {TARGET:.0%} target{scope}")
    return gap


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny", help=f"comma-separated, of: {', '.join(MODELS)}")
    parser.add_argument("--processes", default="1,2", help="comma-separated numbers of processes")
    parser.add_argument("--auto", default=",".join(PLANNED), help="the options the plan chooses")
    parser.add_argument("--global_batch_size", type=int, default=8)
    parser.add_argument("--seq_length", type=int, default=128)
    parser.add_argument("--limit", type=int, help="train only the plan's first N candidates (default: all)")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"training steps, logged every {LOG_EVERY}")
    parser.add_argument("--json", help="write the rows here too")
    cli = parser.parse_args()
    cli.auto = cli.auto.split(",")
    unknown = [name for name in cli.auto if name not in PLANNED] + [
        model for model in cli.models.split(",") if model not in MODELS
    ]
    if unknown:
        parser.error(f"unknown: {', '.join(unknown)}")
    print(f"host {socket.gethostname()}, {os.cpu_count()} cores", flush=True)
    results, gaps = [], []
    processes = [int(count) for count in cli.processes.split(",")]
    for model, name in itertools.product(cli.models.split(","), processes):
        with tempfile.TemporaryDirectory() as folder:
            result = measure(model, name, cli, Path(folder))
        if "error" in result:
            print(f"{model} on {name}: {result['error']}", flush=True)
        else:
            result["gap"] = report(model, name, result)
            gaps.append((model, name, result["gap"]))
        results.append({"model": model, "processes": name, "global_batch_size": cli.global_batch_size,
                        "seq_length": cli.seq_length, "auto": cli.auto, **result})  # fmt: skip
    if len(gaps) > 1:
        figures = [f"{model} on {name} {'-' if gap is None else f'{gap:+.1%}'}" for model, name, gap in gaps]
        print(f"the pick's gap to the fastest measured: {', '.join(figures)}")
    if cli.json:
        Path(cli.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
