"""The report's picture, <report>.png beside the YAML: what an operator looks at first to see which node or
GPU stands out. Drawn from the report (its figures and its checks' fields: floors, flagged members) and the
datasheet (common/datasheet.py), in the shapes people know:
- per GPU, sustained bf16 matmul TFLOP/s and HBM copy GB/s, grouped by node, with the datasheet and the floor;
- per collective, busbw against message size (nccl-tests' busbw), a line per scope, with the floor;
- per node, storage, CPU and host memory, what a check flagged (a straggler, a node under the storage
  floor) in another colour;
- the verdict in the title. What a report skipped (no GPU, one node) is said in its panel."""

import os

import matplotlib

matplotlib.use("Agg")  # no display on a compute node
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from checks.verdicts import DATASHEET_CHECKS  # noqa: E402
from common.datasheet import datasheet  # noqa: E402

GPU_FIGURES = (("matmul_bf16_TFLOPS", "bf16 matmul, TFLOP/s"), ("copy_GB/s", "HBM copy, GB/s"))
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


def flagged(report, *names):
    """The members that the named checks flagged."""
    return {member for c in report.get("checks") or [] if c["check"] in names for member in c["flagged"]}


def floor_of(report, name):
    """The least that passes the named check, in its figure's unit, or None."""
    found = check_named(report, name)
    return found["floor"] if found else None


def bar_panel(title, values, flagged_members, floors=(), peaks=(), why="not measured"):
    """A panel of bars, one per member: {"title", "values": {member: figure}, "flagged": members drawn in the
    flagged colour, "floors" and "peaks" (the datasheet's) as lines, "why" a panel without figures is
    empty}."""
    return {"title": title, "values": values, "flagged": set(flagged_members) & set(values),
            "floors": sorted(set(floors)), "peaks": sorted(set(peaks)), "why": why}  # fmt: skip


def gpu_bar_panels(report):
    """Per GPU: sustained bf16 matmul and HBM copy, with the datasheet's peak (common/datasheet.py) and the
    floor the datasheet check applies to it."""
    gpus = {name: g for name, g in report["gpu"].items() if isinstance(g, dict) and "name" in g}
    panels = []
    for key, title in GPU_FIGURES:
        values = {name: g[key] for name, g in gpus.items() if isinstance(g.get(key), (int, float))}
        known = [datasheet(g["name"]) for name, g in gpus.items() if name in values and datasheet(g["name"])]
        peaks = [sheet[DATASHEET_CHECKS[key]] for sheet in known if sheet[DATASHEET_CHECKS[key]]]
        percent = floor_of(report, f"gpu {key} vs datasheet")
        floors = [peak * percent / 100 for peak in peaks] if percent else []
        members = flagged(report, f"gpu {key}", f"gpu {key} vs datasheet")
        panels.append(
            bar_panel(title, values, members, floors, peaks, report["gpu"].get("skipped", "not measured"))
        )
    return panels


def node_bar_panels(report):
    """Per node: storage, CPU and host memory; flagged by their stragglers' checks and the storage floor."""
    panels = []
    for section, key, title in NODE_FIGURES:
        figures = report.get(section) or {}
        nodes = {name: f for name, f in figures.items() if name != "aggregate" and isinstance(f, dict)}
        values = {name: f[key] for name, f in nodes.items() if isinstance(f.get(key), (int, float))}
        floor = floor_of(report, f"{section} {key}")
        members = flagged(report, f"node {section} {key}", f"{section} {key}")
        panels.append(
            bar_panel(
                title, values, members, [floor] if floor else [], (), figures.get("skipped", "not measured")
            )
        )
    return panels


def skipped(axis, title, why):
    axis.set_title(title)
    axis.text(0.5, 0.5, why, ha="center", va="center", transform=axis.transAxes, color="gray", wrap=True)
    axis.set_xticks([])
    axis.set_yticks([])


def bars(axis, panel):
    """One bar per member, flagged ones in another colour; the floors and the datasheet peaks as lines."""
    if not panel["values"]:
        skipped(axis, panel["title"], panel["why"])
        return
    names = list(panel["values"])
    colours = [FLAGGED if name in panel["flagged"] else NORMAL for name in names]
    axis.bar(range(len(names)), [panel["values"][name] for name in names], color=colours)
    axis.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
    axis.set_title(panel["title"])
    for floor in panel["floors"]:
        axis.axhline(floor, color=FLOOR, linestyle="--", linewidth=1, label=f"floor {floor:.4g}")
    for peak in panel["peaks"]:
        axis.axhline(peak, color=DATASHEET, linestyle=":", linewidth=1, label=f"datasheet {peak:.4g}")
    if panel["floors"] or panel["peaks"]:
        axis.legend(fontsize=7, loc="lower right")


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


def draw(report, path):
    """Writes the picture to path (under a temporary name, then renamed); returns its panels' titles."""
    figure = plt.figure(figsize=(16, 12), layout="constrained")
    rows = figure.subfigures(3, 1, height_ratios=[1, 1, 1])
    gpu_axes = rows[0].subplots(1, len(GPU_FIGURES))
    collective_axes = rows[1].subplots(1, len(COLLECTIVES))
    node_axes = rows[2].subplots(1, len(NODE_FIGURES))
    for axis, panel in zip(gpu_axes, gpu_bar_panels(report)):
        bars(axis, panel)
    collective_panels(report, collective_axes)
    for axis, panel in zip(node_axes, node_bar_panels(report)):
        bars(axis, panel)
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
