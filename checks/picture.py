"""The report's picture, <report>.png beside the YAML: what an operator looks at first to see which node or
GPU stands out. Drawn from the report alone (its figures and its checks' floors), in the shapes people know:
- per GPU, sustained bf16 matmul TFLOP/s and HBM copy GB/s, grouped by node, with the datasheet and the floor;
- per collective, busbw against message size (nccl-tests' busbw), a line per scope, with the floor;
- per node, storage, CPU and host memory, the flagged stragglers in another colour;
- the verdict in the title. What a report skipped (no GPU, one node) is said in its panel."""

import os
import re

import matplotlib

matplotlib.use("Agg")  # no display on a compute node
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from checks.verdicts import flagged_names  # noqa: E402

GPU_FIGURES = (
    ("matmul_bf16_TFLOPS", "matmul_bf16", "bf16 matmul, TFLOP/s"),
    ("copy_GB/s", "copy", "HBM copy, GB/s"),
)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
NODE_FIGURES = (
    ("storage", "parallel_write_GB/s", "storage write, GB/s"),
    ("storage", "parallel_read_GB/s", "storage read, GB/s"),
    ("cpu", "all_core_ops/s", "CPU, work units/s"),
    ("memory", "copy_all_cores_GB/s", "host memory copy, GB/s"),
)
VERDICT_COLOURS = {"pass": "tab:green", "warn": "tab:orange", "fail": "tab:red"}
NORMAL, FLAGGED, FLOOR, DATASHEET = "tab:blue", "tab:red", "tab:red", "tab:gray"


def check_named(report, name):
    return next((c for c in report.get("checks") or [] if c["check"] == name), None)


def flagged(report, name):
    """The members a check flagged: its value ends '; flagged a, b'."""
    found = check_named(report, name)
    return flagged_names(found["value"]) if found else set()


def floor_of(report, name):
    """The number after '>= ' in a check's reference, or None."""
    found = check_named(report, name)
    number = re.match(r">= ([\d.e+-]+)", str(found["reference"])) if found else None
    return float(number.group(1)) if number else None


def skipped(axis, title, why):
    axis.set_title(title)
    axis.text(0.5, 0.5, why, ha="center", va="center", transform=axis.transAxes, color="gray", wrap=True)
    axis.set_xticks([])
    axis.set_yticks([])


def bars(axis, title, values, flagged_names, floor=None, datasheet=None):
    """One bar per member, flagged ones in another colour; the floor and the datasheet as lines."""
    names = list(values)
    colours = [FLAGGED if name in flagged_names else NORMAL for name in names]
    axis.bar(range(len(names)), [values[name] for name in names], color=colours)
    axis.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
    axis.set_title(title)
    if floor:
        axis.axhline(floor, color=FLOOR, linestyle="--", linewidth=1, label=f"floor {floor:.4g}")
    if datasheet:
        axis.axhline(
            datasheet, color=DATASHEET, linestyle=":", linewidth=1, label=f"datasheet {datasheet:.4g}"
        )
    if floor or datasheet:
        axis.legend(fontsize=7, loc="lower right")


def gpu_panels(report, axes):
    gpus = {name: g for name, g in report["gpu"].items() if isinstance(g, dict) and "name" in g}
    for axis, (key, short, title) in zip(axes, GPU_FIGURES):
        values = {name: g[key] for name, g in gpus.items() if isinstance(g.get(key), (int, float))}
        if not values:
            skipped(axis, title, report["gpu"].get("skipped", "not measured"))
            continue
        percent = [g.get(f"{short}_percent_of_datasheet") for g in gpus.values()]
        first = next((i for i, p in enumerate(percent) if p), None)
        peak = list(values.values())[first] * 100 / percent[first] if first is not None else None
        minimum = floor_of(report, f"gpu {key} vs datasheet")  # '>= 50% of datasheet'
        floor = peak * minimum / 100 if peak and minimum else None
        bars(axis, title, values, flagged(report, f"gpu {key}") | flagged(report, f"gpu {key} vs datasheet"),
             floor, peak)  # fmt: skip


def sweeps(report):
    """busbw sweeps by scope: all ranks, each node's own, one rank per node (the links between nodes)."""
    nccl, found = report.get("nccl") or {}, {}
    if "skipped" not in nccl and nccl:
        found["all ranks"] = nccl
        found.update({f"{name} intra-node": sweep for name, sweep in nccl.get("intra_node", {}).items()})
    between = (report.get("links") or {}).get("one_rank_per_node")
    if between:
        found["one rank per node"] = between
    return found


def collective_panels(report, axes):
    found = sweeps(report)
    for axis, op in zip(axes, COLLECTIVES):
        lines = {scope: sweep[op] for scope, sweep in found.items() if isinstance(sweep.get(op), list)}
        if not lines:
            skipped(axis, op, (report.get("nccl") or {}).get("skipped", "not measured"))
            continue
        for scope, rows in lines.items():
            axis.plot([r["size_bytes"] for r in rows], [r["busbw_GB/s"] for r in rows], marker="o",
                      markersize=3, label=scope)  # fmt: skip
        for scope, style in (("intra-node", "--"), ("inter-node", ":")):
            floor = floor_of(report, f"{scope} {op} busbw")
            if floor:
                axis.axhline(floor, color=FLOOR, linestyle=style, linewidth=1, label=f"{scope} floor")
        axis.set_xscale("log", base=2)
        axis.xaxis.set_major_formatter(FuncFormatter(size_label))
        axis.set_title(f"{op} busbw, GB/s")
        axis.set_xlabel("message size", fontsize=7)
        axis.tick_params(labelsize=7)
        axis.legend(fontsize=6)


def size_label(size, _):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size:g} B"


def node_panels(report, axes):
    for axis, (section, key, title) in zip(axes, NODE_FIGURES):
        figures = report.get(section) or {}
        nodes = {name: f for name, f in figures.items() if name != "aggregate" and isinstance(f, dict)}
        values = {name: f[key] for name, f in nodes.items() if isinstance(f.get(key), (int, float))}
        if not values:
            skipped(axis, title, figures.get("skipped", "not measured"))
            continue
        floor = floor_of(report, f"{section} {key}") if key == "parallel_write_GB/s" else None
        bars(axis, title, values, flagged(report, f"node {section} {key}"), floor)


def draw(report, path):
    """Writes the picture to path (under a temporary name, then renamed); returns its panels' titles."""
    figure = plt.figure(figsize=(16, 12), layout="constrained")
    rows = figure.subfigures(3, 1, height_ratios=[1, 1, 1])
    gpu_axes = rows[0].subplots(1, len(GPU_FIGURES))
    collective_axes = rows[1].subplots(1, len(COLLECTIVES))
    node_axes = rows[2].subplots(1, len(NODE_FIGURES))
    gpu_panels(report, gpu_axes)
    collective_panels(report, collective_axes)
    node_panels(report, node_axes)
    for row, name in zip(rows, ("GPUs", "collectives", "nodes")):
        row.suptitle(name, fontsize=10, x=0.01, ha="left")
    job, world = report.get("job", {}), report.get("world", {})
    verdict = report.get("verdict") or "?"
    shape = f"{world.get('nodes', '?')} nodes x {world.get('ranks_per_node', '?')} ranks"
    figure.suptitle(
        f"verdict: {verdict.upper()}  |  job {job.get('id', '?')}, {job.get('date', '')}  |  "
        f"{shape} ({world.get('device', '?')})",
        color=VERDICT_COLOURS.get(verdict, "black"),
        fontsize=13,
    )
    temporary = f"{path}.{os.getpid()}.tmp.png"
    try:
        figure.savefig(temporary, dpi=80)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
        plt.close(figure)
    return [axis.get_title() for axis in (*gpu_axes, *collective_axes, *node_axes)]
