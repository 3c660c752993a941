"""The report's picture, <report>.png beside the YAML: what an operator looks at first to see which node or
GPU stands out. Drawn from the report (its figures and its checks' fields: floors, flagged members) and the
datasheet (common/datasheet.py), in the shapes people know:
- per GPU, sustained bf16 matmul TFLOP/s and HBM copy GB/s, grouped by node, with the datasheet and the floor;
- per collective, busbw against message size (nccl-tests' busbw), a line per scope, with the floor;
- per node, storage, CPU and host memory, what a check flagged (a straggler, a node under the storage
  floor) in another colour;
- the verdict in the title. What a report skipped (no GPU, one node) is said in its panel; checks without
  the fields the picture reads (an older or hand-edited report) leave their floors and flags out, with a
  warning."""

import math
import sys

from checks.terminal import printable
from checks.verdicts import DATASHEET_CHECKS
from common.datasheet import datasheet
from common.files import replace_atomically

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
# Past this many bars or lines a panel cannot be read (and 300 nodes' GPUs took minutes to draw): it draws
# the flagged members and the lowest ones, and says how many it hides.
MAX_BARS, MAX_LINES = 24, 8
LOG_SPREAD = 30  # a bar this many times below the tallest bar or line would vanish: a log scale


def readable_checks(report):
    """(the report's checks that carry the fields the picture reads, as check() writes them: a name, a floor
    that is a number or None, the members flagged; how many others it has). An older or hand-edited report's
    checks may lack them: the picture is drawn without their floors and flagged members."""
    checks = report.get("checks") or []
    if not isinstance(checks, list):
        return [], 1
    readable = [
        c
        for c in checks
        if isinstance(c, dict)
        and isinstance(c.get("check"), str)
        and "floor" in c
        and type(c["floor"]) in (int, float, type(None))
        and isinstance(c.get("flagged"), dict)
    ]
    return readable, len(checks) - len(readable)


def check_named(report, name):
    return next((c for c in readable_checks(report)[0] if c["check"] == name), None)


def flagged(report, *names):
    """The members that the named checks flagged."""
    return {member for c in readable_checks(report)[0] if c["check"] in names for member in c["flagged"]}


def floor_of(report, name):
    """The least that passes the named check, in its figure's unit, or None."""
    found = check_named(report, name)
    return found["floor"] if found else None


def drawn_first(values, flagged_members, limit):
    """The members a panel of more than limit draws: the flagged ones, then the lowest; and its note."""
    ranked = sorted(values, key=lambda name: (name not in flagged_members, values[name]))
    shown = set(ranked[:limit])
    note = f"{len(values) - limit} of {len(values)} hidden (the flagged and the lowest drawn)"
    return {name: value for name, value in values.items() if name in shown}, note


def bar_panel(title, numbers, flagged_members, floors=(), peaks=(), why="not measured"):
    """A panel of bars, one per member: {"title", "values": {member: figure} to draw, "flagged": those drawn
    in the flagged colour, "floors" and "peaks" (the datasheet's) as lines, "log": a log scale, where a bar
    would vanish beside a line or a bar far above it, "note": what is not drawn, "why": an empty panel's}."""
    values = {name: value for name, value in numbers.items() if math.isfinite(value)}
    not_numbers = [name for name in numbers if name not in values]
    notes = [f"not a number: {', '.join(not_numbers)}"] if not_numbers else []
    if len(values) > MAX_BARS:
        values, note = drawn_first(values, set(flagged_members), MAX_BARS)
        notes.append(note)
    floors = sorted({floor for floor in floors if floor and math.isfinite(floor)})
    peaks = sorted({peak for peak in peaks if peak and math.isfinite(peak)})
    heights = [height for height in (*values.values(), *floors, *peaks) if height > 0]
    return {
        "title": title,
        "values": values,
        "flagged": set(flagged_members) & set(values),
        "floors": floors,
        "peaks": peaks,
        "log": bool(heights) and max(heights) > LOG_SPREAD * min(heights),
        "note": "; ".join(notes),
        "why": "; ".join(notes) or why,
    }


def gpu_bar_panels(report):
    """Per GPU: sustained bf16 matmul and HBM copy, with the datasheet's peak (common/datasheet.py) and the
    floor the datasheet check applies to it."""
    section = report.get("gpu") or {}
    gpus = {name: g for name, g in section.items() if isinstance(g, dict) and "name" in g}
    panels = []
    for key, title in GPU_FIGURES:
        values = {name: g[key] for name, g in gpus.items() if isinstance(g.get(key), (int, float))}
        known = [datasheet(g["name"]) for name, g in gpus.items() if name in values and datasheet(g["name"])]
        peaks = [sheet[DATASHEET_CHECKS[key]] for sheet in known if sheet[DATASHEET_CHECKS[key]]]
        percent = floor_of(report, f"gpu {key} vs datasheet")
        floors = [peak * percent / 100 for peak in peaks] if percent else []
        members = flagged(report, f"gpu {key}", f"gpu {key} vs datasheet")
        panels.append(
            bar_panel(title, values, members, floors, peaks, section.get("skipped", "not measured"))
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


def noted(axis, note):
    """What a panel leaves out, in small print at its top, outside the layout (it may run past the panel)."""
    if note:
        axis.text(0.01, 0.99, note, transform=axis.transAxes, va="top", fontsize=6, color="gray", wrap=True)
        axis.texts[-1].set_in_layout(False)


def bars(axis, panel):
    """One bar per member, flagged ones in another colour; the floors and the datasheet peaks as lines."""
    if not panel["values"]:
        skipped(axis, panel["title"], panel["why"])
        return
    names = list(panel["values"])
    colours = [FLAGGED if name in panel["flagged"] else NORMAL for name in names]
    axis.bar(range(len(names)), [panel["values"][name] for name in names], color=colours)
    axis.set_xticks(
        range(len(names)), [printable(name) for name in names], rotation=30, ha="right", fontsize=7
    )
    axis.set_title(panel["title"])
    if panel["log"]:
        axis.set_yscale("log")
    noted(axis, panel["note"])
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


def collective_lines(report):
    """Per collective: {"lines": {scope: ([sizes], [busbw])}, "floors": {scope: GB/s}, "note", "why"}. A point
    that is not a finite number is left out, and said; above MAX_LINES scopes, the nodes' own sweeps drawn
    are those the floor check flagged, then the lowest at the largest size."""
    found, panels = sweeps(report), {}
    for op in COLLECTIVES:
        lines, broken = {}, []
        for scope, sweep in found.items():
            rows = sweep[op] if isinstance(sweep.get(op), list) else []
            points = [(row["size_bytes"], row["busbw_GB/s"]) for row in rows]
            finite = [(size, busbw) for size, busbw in points if math.isfinite(busbw)]
            if len(finite) < len(points):
                broken.append(scope)
            if finite:
                lines[scope] = tuple(map(list, zip(*finite)))
        notes = [f"not a number: {', '.join(broken)}"] if broken else []
        nodes = {scope: line[1][-1] for scope, line in lines.items() if scope.endswith(" intra-node")}
        if len(lines) > MAX_LINES:
            flagged_nodes = {f"{member} intra-node" for member in flagged(report, f"intra-node {op} busbw")}
            kept, note = drawn_first(nodes, flagged_nodes, MAX_LINES - (len(lines) - len(nodes)))
            lines = {scope: line for scope, line in lines.items() if scope not in nodes or scope in kept}
            notes.append(f"nodes' own lines: {note}")
        floors = {scope: floor_of(report, f"{scope} {op} busbw") for scope in ("intra-node", "inter-node")}
        panels[op] = {
            "lines": lines,
            "floors": {scope: floor for scope, floor in floors.items() if floor},
            "note": "; ".join(notes),
            "why": "; ".join(notes) or (report.get("nccl") or {}).get("skipped", "not measured"),
        }
    return panels


def collective_panels(report, axes):
    for axis, (op, panel) in zip(axes, collective_lines(report).items()):
        if not panel["lines"]:
            skipped(axis, op, panel["why"])
            continue
        for scope, (sizes, busbw) in panel["lines"].items():
            axis.plot(sizes, busbw, marker="o", markersize=3, label=printable(scope))
        for scope, style in (("intra-node", "--"), ("inter-node", ":")):
            if scope in panel["floors"]:
                axis.axhline(
                    panel["floors"][scope], color=FLOOR, linestyle=style, linewidth=1, label=f"{scope} floor"
                )
        axis.set_xscale("log", base=2)
        axis.xaxis.set_major_formatter(size_label)
        axis.set_title(f"{op} busbw, GB/s")
        axis.set_xlabel("message size", fontsize=7)
        axis.tick_params(labelsize=7)
        axis.legend(fontsize=6)
        noted(axis, panel["note"])


def size_label(size, _):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size:g} B"


def draw(report, path):
    """Writes the picture to path (under a temporary name, then renamed); returns its panels' titles."""
    # here, not above: only the rank that writes the report draws, and the import costs every rank 0.4 s
    import matplotlib

    matplotlib.use("Agg")  # no display on a compute node
    import matplotlib.pyplot as plt

    if unreadable := readable_checks(report)[1]:
        print(f"warning: {path}: {unreadable} of the report's checks lack the fields the picture reads (a "
              "floor, the members flagged: an older or hand-edited report); drawn without their floors and "
              "flagged members", file=sys.stderr, flush=True)  # fmt: skip
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
    try:
        replace_atomically(path, lambda file: figure.savefig(file, format="png", dpi=80), "xb")
    finally:
        plt.close(figure)
    return [axis.get_title() for axis in (*gpu_axes, *collective_axes, *node_axes)]
