"""Each node against its own history. GPUs, HBM and links degrade before they fail: a node that lost a
tenth of its speed since last week still clears the absolute floors and matches peers that are no faster.
Every report's per-node and per-GPU figures are appended to one history file (<report dir>/
benchmark_history.jsonl, rewritten whole under a temporary name), keyed by node name and GPU index. A new
report compares each figure with the median of the same node's last HISTORY_RUNS runs; a drop beyond
HISTORY_DROP is a warning that names the node, the figure, today's value and its usual one. It never fails
a job: the floors do that. The file keeps only what is read: each figure's last HISTORY_RUNS + 1 values
per mode, so it grows with the cluster, not with the number of runs."""

import json
import math
import statistics
import sys
import time
from pathlib import Path

from checks.terminal import printable
from checks.verdicts import check, name_nodes, unit_of
from common.files import write_atomically

HISTORY_FILE = "benchmark_history.jsonl"
HISTORY_RUNS = 5  # a node's usual value: the median of its last 5 runs
# Above the run-to-run noise the benchmark measures on a healthy node: a GPU's sustained loops and a node's
# CPU and memory figures repeat within a few percent; a shared filesystem's within a quarter (other jobs
# write to it too). Runs compare with earlier runs of the same mode (quick or default) alone.
HISTORY_DROP = {"gpu": 0.10, "cpu": 0.10, "memory": 0.10, "storage": 0.25}
TRACKED = {
    "gpu": ("matmul_bf16_TFLOPS", "copy_GB/s"),
    "storage": ("parallel_write_GB/s", "parallel_read_GB/s", "sequential_write_GB/s", "sequential_read_GB/s"),
    "cpu": ("all_core_ops/s", "single_core_ops/s", "matmul_fp32_GFLOPS"),
    "memory": ("copy_all_cores_GB/s", "triad_all_cores_GB/s"),
}


def host_of(report, label):
    """A node's name as SLURM knows it ('n3'), from the report's label ('node2 (n3)')."""
    return report["nodes"].get(label, {}).get("hostname", label)


def history_path(cfg):
    """The history lives beside the reports: in --report's folder, else in --report_dir."""
    return (Path(cfg["report"]).parent if cfg["report"] else Path(cfg["report_dir"])) / HISTORY_FILE


def entries(report):
    """The report's figures as history entries: {"node", "gpu" (index or None), "figure", "value"}; a figure
    that is not a finite number is a failed measurement, and no part of any node's history."""
    return [entry for _, entry in labelled_entries(report) if math.isfinite(entry["value"])]


def labelled_entries(report):
    """(the member as the report labels it, its history entry) for each of the report's figures."""
    members = []  # (member, node label, gpu index, section, figures)
    for label, gpu in (report.get("gpu") or {}).items():
        if isinstance(gpu, dict) and "/gpu" in label:
            node, index = label.rsplit("/gpu", 1)
            members.append((label, node, int(index), "gpu", gpu))
    for section in ("storage", "cpu", "memory"):
        for label, figures in (report.get(section) or {}).items():
            if label in report.get("nodes", {}) and isinstance(figures, dict):
                members.append((label, label, None, section, figures))
    return [
        (
            member,
            {"node": host_of(report, node), "gpu": gpu, "figure": f"{section} {key}", "value": figures[key]},
        )
        for member, node, gpu, section, figures in members
        for key in TRACKED[section]
        if isinstance(figures.get(key), (int, float))
    ]


def read_history(path):
    """The history's lines, oldest first, each with the entries entries() writes; a damaged line (not a
    record, nested past what json reads, not text) is skipped with a warning, as is an entry of another
    shape, never a crash."""
    lines = []
    try:
        with open(path, errors="replace") as file:
            for number, line in enumerate(file, 1):
                try:
                    record = json.loads(line)
                    if not (isinstance(record, dict) and isinstance(record.get("figures"), list)):
                        raise ValueError("not a report's figures")
                    if not isinstance(record.get("mode"), (str, type(None))):
                        raise ValueError("its mode is not a name")
                except (ValueError, RecursionError) as error:
                    why = error if isinstance(error, ValueError) else "nested too deep"
                    print(f"warning: {path} line {number} is damaged ({why}); skipped", file=sys.stderr)
                    continue
                lines.append({**record, "figures": [entry for entry in record["figures"] if valid(entry)]})
    except FileNotFoundError:
        pass
    return lines


def valid(entry):
    """Whether a history entry has the shape entries() writes: names as text, a GPU index or none, a finite
    figure."""
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("node"), str)
        and isinstance(entry.get("figure"), str)
        and (entry.get("gpu") is None or type(entry.get("gpu")) is int)
        and type(entry.get("value")) in (int, float)
        and math.isfinite(entry["value"])
    )


def usual_values(history, mode):
    """(node, gpu, figure) -> the median of its last HISTORY_RUNS values in runs of this mode."""
    series = {}
    for record in (r for r in history if r.get("mode") == mode):
        for entry in record["figures"]:
            series.setdefault((entry["node"], entry["gpu"], entry["figure"]), []).append(entry["value"])
    return {key: statistics.median(values[-HISTORY_RUNS:]) for key, values in series.items()}


def describe(node, gpu):
    return f"{node} gpu{gpu}" if gpu is not None else node


def history_checks(report, history):
    """One warn per figure that fell more than HISTORY_DROP below its node's usual value; a pass, or a skip
    when no node has a history yet."""
    usual = usual_values(history, report.get("job", {}).get("mode"))
    drops, compared = [], 0
    for member, entry in labelled_entries(report):
        if not math.isfinite(entry["value"]):  # never a pass: a failed measurement
            where = describe(entry["node"], entry["gpu"])
            value = f"{entry['value']}: not a number, a failed measurement"
            drops.append(check("warn", f"history {where} {entry['figure']}", value, flagged={member: value}))
            continue
        before = usual.get((entry["node"], entry["gpu"], entry["figure"]))
        if before is None or before <= 0:
            continue
        compared += 1
        drop = HISTORY_DROP[entry["figure"].split()[0]]
        if entry["value"] < (1 - drop) * before:
            where = describe(entry["node"], entry["gpu"])
            change = 100 * (entry["value"] / before - 1)
            value = f"{entry['value']:.4g}, usually {before:.4g} ({change:+.0f}%)"
            drops.append(
                check(
                    "warn",
                    f"history {where} {entry['figure']}",
                    value,
                    f">= {100 * (1 - drop):.0f}% of its last {HISTORY_RUNS} runs' median",
                    measured=entry["value"],
                    floor=(1 - drop) * before,
                    unit=unit_of(entry["figure"]),
                    flagged={member: value},
                )
            )
    if drops:
        return drops
    status, value = (
        ("pass", f"{compared} figures near their usual") if compared else ("skip", "no history yet")
    )
    limits = ", ".join(f"{section} {drop:.0%}" for section, drop in HISTORY_DROP.items())
    return [check(status, "history", value, f"drops within {limits}")]


def append(path, report, history):
    """The history with this report's figures added and what no run reads any more left out (kept()),
    written whole under a temporary name, then renamed."""
    job = report.get("job", {})
    record = {"time": time.time(), "job": job.get("id"), "mode": job.get("mode"), "figures": entries(report)}
    write_atomically(path, "".join(json.dumps(line) + "\n" for line in kept([*history, record])))


def kept(history):
    """The records with only the entries a later run reads: per mode, node, GPU and figure, the last
    HISTORY_RUNS + 1 (the usual value, and --history's latest beside it); a record left with none goes."""
    counts, records = {}, []
    for record in reversed(history):
        figures = []
        for entry in record["figures"]:
            key = (record.get("mode"), entry["node"], entry["gpu"], entry["figure"])
            counts[key] = counts.get(key, 0) + 1
            if counts[key] <= HISTORY_RUNS + 1:
                figures.append(entry)
        if figures:
            records.append({**record, "figures": figures})
    return records[::-1]


def trend_table(history):
    """benchmark.py --history: each node's figures over its runs, oldest to newest, and the last change."""
    rows, series = [], {}
    for record in history:
        for entry in record["figures"]:
            key = (printable(describe(entry["node"], entry["gpu"])), printable(entry["figure"]))
            series.setdefault(key, []).append(entry["value"])
    for (where, figure), values in sorted(series.items()):
        recent = values[-HISTORY_RUNS:]
        usual = statistics.median(values[:-1][-HISTORY_RUNS:]) if len(values) > 1 else 0
        change = f"{100 * (values[-1] / usual - 1):+.0f}%" if usual > 0 else "-"  # no usual value to compare
        rows.append((where, figure, " ".join(f"{v:.4g}" for v in recent), change))
    if not rows:
        return "no history yet"
    header = ("NODE", "FIGURE", f"LAST {HISTORY_RUNS} RUNS (oldest first)", "LATEST vs MEDIAN BEFORE")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(3)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3]
        for row in [header, *rows]
    )


def judge_against_history(report, history):
    """Adds the history's checks to the report. A drop makes a passing verdict a warning, and never fails the
    job, --fail_on_warn included: the absolute floors decide that."""
    checks = history_checks(report, history)
    name_nodes(checks, report)
    order = {"fail": 0, "warn": 1, "pass": 2, "skip": 3}
    report["checks"] = sorted(report["checks"] + checks, key=lambda c: order[c["status"]])
    if report["verdict"] == "pass" and any(c["status"] == "warn" for c in checks):
        report["verdict"] = "warn"
