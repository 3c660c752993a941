"""A run's curves, <log_dir>/<run_name>/curves.png, from its metrics.jsonl and goodput.json alone: at the end
of a run, and at any time with train.py --plot=<run folder>."""

import json
import os
import sys

from common.errors import ConfigError
from common.files import UnsafeFile, matplotlib_writes_under, read_json, replace_atomically
from run.progress import goodput


def duration(seconds):
    if seconds is None:
        return "-"
    return f"{int(seconds) // 3600}:{int(seconds) % 3600 // 60:02d}:{int(seconds) % 60:02d}"


def read_records(folder):
    """The last record of each logged step of a run folder's metrics.jsonl (a resumed run logs some again)."""
    records, path = {}, os.path.join(folder, "metrics.jsonl")
    with open(path) as file:
        for number, line in enumerate(file, 1):
            if not line.endswith("\n"):  # a line being written as --plot reads is left for the next plot
                continue
            try:
                record = json.loads(line)
                if type(record["step"]) is not int:  # a step of text would not sort among the numbers
                    raise TypeError(record["step"])
                records[record["step"]] = record
            except (ValueError, TypeError, KeyError):  # cut short, as a full disk leaves a line
                print(f"warning: {path} line {number} is not a record; skipped", file=sys.stderr)
    return [records[step] for step in sorted(records)]


def plot_curves(folder):
    """<folder>/curves.png: loss and validation loss, learning rate, tokens/s and MFU against the step."""
    records = read_records(folder)
    if not records:  # before matplotlib, whose font cache would be written for nothing
        return None
    matplotlib_writes_under(os.path.dirname(os.path.abspath(folder)))  # the log folder, beside the runs
    import matplotlib

    matplotlib.use("Agg")  # no display on a compute node
    import matplotlib.pyplot as plt

    def series(key):
        logged = [r for r in records if r.get(key) is not None]
        return [r["step"] for r in logged], [r[key] for r in logged]

    layout = [["loss", "lr"], ["tokens", "mfu"], ["goodput", "goodput"]]
    figure, named = plt.subplot_mosaic(layout, figsize=(12, 9), height_ratios=[1, 1, 0.35])
    curves = [named[name] for name in ("loss", "lr", "tokens", "mfu")]
    for axis in curves[1:]:
        axis.sharex(curves[0])
    panels = [
        ("loss", [("loss", "training"), ("val_loss", "validation")]),
        ("learning rate", [("lr", None)]),
        ("tokens/s (all devices)", [("tokens_per_s", None)]),
        ("MFU", [("mfu", None)]),
    ]
    for axis, (title, keys) in zip(curves, panels):
        axis.set_title(title)
        axis.grid(alpha=0.3)
        for key, label in keys:
            steps, values = series(key)
            if steps:
                few = len(steps) < 30 or key == "val_loss"
                axis.plot(steps, values, label=label, marker="o" if few else None, markersize=3)
        if not axis.lines:
            empty = "not measured (MFU needs a GPU of the datasheet)" if title == "MFU" else "not measured"
            axis.text(0.5, 0.5, empty, ha="center", va="center", transform=axis.transAxes, color="gray")
        elif len(keys) > 1:
            axis.legend()
    named["lr"].ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    named["tokens"].set_ylim(bottom=0)  # a small dip must not look like a collapse
    named["mfu"].yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    for axis in curves[2:]:
        axis.set_xlabel("step")
    plot_goodput(named["goodput"], os.path.join(folder, goodput.LEDGER))
    figure.suptitle(f"{os.path.basename(os.path.abspath(folder))}: {records[-1]['step']} steps")
    figure.tight_layout()
    path = os.path.join(folder, "curves.png")
    try:
        replace_atomically(path, lambda file: figure.savefig(file, format="png", dpi=100), "xb")
    finally:
        plt.close(figure)
    return path


def plot_goodput(axis, path):
    """One bar: the run's wall time split as goodput.json splits it."""
    from matplotlib.ticker import PercentFormatter

    try:
        figures = read_json(path)
        shares = {part: figures[part] / figures["wall_s"] for part in ("productive_s", *goodput.SHOWN)}
    except (OSError, UnsafeFile, ValueError, KeyError, TypeError, ZeroDivisionError):
        shares = {}
    axis.set_title(
        f"where the run's {duration(figures['wall_s'])} went (goodput.json)" if shares else "goodput"
    )
    left = 0.0
    for part, share in shares.items():
        label = "training" if part == "productive_s" else goodput.SHOWN[part]
        axis.barh(0, share, left=left, label=f"{label} {100 * share:.1f}%" if share >= 5e-4 else None)
        left += max(share, 0.0)
    if not shares:
        axis.text(0.5, 0.5, "not measured", ha="center", va="center", transform=axis.transAxes, color="gray")
    axis.set_xlim(0, 1)
    axis.set_yticks([])
    axis.xaxis.set_major_formatter(PercentFormatter(1.0))
    if shares:
        axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=5, frameon=False)


def plot_run(folder):
    """--plot: a run folder's curves.png, while it trains too."""
    curves = os.path.isfile(os.path.join(folder, "metrics.jsonl")) and plot_curves(folder)
    if not curves:
        raise ConfigError(f"--plot={folder} holds no logged steps; give a run folder, <log_dir>/<run_name>")
    print(f"curves: {curves}")
    return 0
