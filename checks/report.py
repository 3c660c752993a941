"""What the user reads: the checks as a table, the cluster report and each node's part as YAML, and the
failed nodes for the job script.
"""

import contextlib
import glob
import itertools
import json
from pathlib import Path

import torch.distributed as dist
import yaml

from checks import history, picture
from checks.storage import storage_aggregate
from checks.terminal import printable
from checks.verdicts import check, failed_nodes, verdict, verdict_checks
from checks.world import World
from common.errors import fail
from common.files import create_atomically
from common.suspects import write_suspects


def print_table(checks: list):
    """The checks, a line each; what the nodes named themselves is printed as text, never acted on."""
    rows = [
        [printable(row[key]) for key in ("status", "check", "value", "reference")]
        for row in [check("STATUS", "CHECK", "VALUE", "REFERENCE"), *checks]
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    for row in rows:
        print("  ".join([cell.ljust(width) for cell, width in zip(row, widths)] + [row[3]]))


def rounded(value):
    """Figures to 4 significant digits, so the YAML reads like a measurement and not like noise."""
    if isinstance(value, dict):
        return {key: rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [rounded(item) for item in value]
    return float(f"{value:.4g}") if isinstance(value, float) else value


def as_yaml(content: dict) -> str:
    return yaml.safe_dump(rounded(content), sort_keys=False, width=120)


def claim_report_path(cfg: dict, job_id: str, report: dict) -> Path:
    """Writes the cluster report to a file no other run has: --report exactly, or
    <report_dir>/benchmark_<job id>.yaml, then _2, _3... while that name or its node reports are taken,
    so two runs started in the same second keep both reports."""
    if cfg["report"]:
        path = Path(cfg["report"])
        try:
            create_atomically(path, as_yaml(report))
        except FileExistsError:
            fail(f"--report {path} was created by something else while the benchmark ran; run it again")
        return path
    for attempt in itertools.count(1):
        stem = f"benchmark_{job_id}" + (f"_{attempt}" if attempt > 1 else "")
        path = Path(cfg["report_dir"]) / f"{stem}.yaml"
        if any(path.parent.glob(f"{glob.escape(stem)}_rank*.yaml")):
            continue
        with contextlib.suppress(FileExistsError):
            create_atomically(path, as_yaml(report))
            return path


def write_reports(report: dict, world: World, node: str, cfg: dict) -> Path:
    """Rank 0 judges each node against its history, claims the report's name, which every rank then learns,
    and names the failing nodes at once; each node's local rank 0 writes <stem>_rank<R>.yaml beside it. Then
    rank 0 prints the table and draws the picture while the others wait: a rank that left first would have
    torchrun end rank 0 on a failing verdict before the nodes to leave out were written. Returns the report's
    path."""
    chosen = [None]
    if world.rank == 0:
        earlier = history.read_history(history.history_path(cfg))
        history.judge_against_history(report, earlier)
        chosen = [claim_report_path(cfg, report["job"]["id"], report)]
        failed = failed_nodes(report["checks"])
        if cfg["suspects_folder"]:
            write_suspects(cfg["suspects_folder"], "benchmark", failed)
        if cfg["outcome"]:
            outcome = {"verdict": report["verdict"], "report": str(chosen[0]), "failed_nodes": failed}
            create_atomically(cfg["outcome"], json.dumps(outcome))
    dist.broadcast_object_list(chosen, src=0, group=world.cpu_group)
    path = chosen[0]
    if world.is_node_leader:
        create_atomically(
            path.with_name(f"{path.stem}_rank{world.rank}.yaml"), as_yaml(node_report(report, node))
        )
    if world.rank == 0:
        print_table(report["checks"])
        drawn = path.with_suffix(".png")
        picture.draw(report, str(drawn))
        history.append(path.parent / history.HISTORY_FILE, report, earlier)
        seconds = report["job"]["seconds"]
        print(f"verdict: {report['verdict']} in {seconds:.1f} s; report: {path}; picture: {drawn}")
    world.barrier()
    return path


def cluster_report(everyone: list, world: World, job: dict, cfg: dict) -> dict:
    """Rank 0's view from every rank's figures: GPUs by name, per-node sections, aggregates, checks."""
    label = {r["node_rank"]: f"node{r['node_rank']} ({r['node_name']})" for r in everyone}
    leaders = [r for r in everyone if r["rank"] % world.local_size == 0]
    first = everyone[0]

    def per_node(section):
        skipped = next((r[section] for r in leaders if "skipped" in r[section]), None)
        if skipped:  # on one node skipped is skipped on all: nodes compare with each other
            return skipped
        return {label[r["node_rank"]]: r[section] for r in leaders}

    gpus = first["gpu"]
    if "skipped" not in gpus:
        gpus = {f"{label[r['node_rank']]}/gpu{r['rank'] % world.local_size}": r["gpu"] for r in everyone}
    nccl = first["nccl"]
    if "intra_node" in nccl:
        nccl = {**nccl, "intra_node": {label[r["node_rank"]]: r["nccl"]["intra_node"] for r in leaders}}
    report = {
        "job": job,
        "world": {
            "ranks": world.size,
            "nodes": world.nodes,
            "ranks_per_node": world.local_size,
            "backend": dist.get_backend(),
            "device": world.device.type,
        },
        "verdict": None,
        "checks": None,
        "gpu": gpus,
        "nccl": nccl,
        "links": {key: value for key, value in first["links"].items() if key != "pairs"},
        "storage": per_node("storage"),
        "cpu": per_node("cpu"),
        "memory": per_node("memory"),
        "nodes": {
            label[r["node_rank"]]: {
                "node_name": r["node_name"],
                "hostname": r["hostname"],
                "first_rank": r["rank"],
                "nics_Gbps": r["nics_Gbps"],
            }
            for r in leaders
        },
    }
    if "skipped" not in report["links"]:
        report["links"]["pairs"] = {
            pair: figures for r in leaders for pair, figures in r["links"].get("pairs", {}).items()
        }
    if "skipped" not in report["storage"]:
        report["storage"] = {
            "aggregate": storage_aggregate(list(report["storage"].values())),
            **report["storage"],
        }
    report["checks"] = verdict_checks(report, cfg["nic_gbps"], cfg["min_storage_GBps"])
    report["verdict"] = verdict(report["checks"], cfg["fail_on_warn"])
    return report


def node_report(report: dict, node: str) -> dict:
    """One node's part of the cluster report, for its benchmark_<job>_rank<R>.yaml."""

    def mine(section):
        figures = report[section]
        if "skipped" in figures:
            return figures
        if section == "gpu":
            return {key: value for key, value in figures.items() if key.startswith(node + "/")}
        return figures[node]

    return {
        "job": report["job"],
        "node": {node: report["nodes"][node]},
        **{section: mine(section) for section in ("gpu", "storage", "cpu", "memory")},
    }
