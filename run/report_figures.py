"""A benchmark report as a run reads it (benchmark.py writes it: checks/report.py). One reader for every use,
the prediction of a step (run/prediction/), the checkpoint schedule's write rate and the options' check of
--benchmark_report: a regular YAML file of a bounded size, each figure they use checked before anything uses
it (finite, positive, within what a machine measures, of the shape they read), and the machine it was
measured on. A file that is not such a report is BadReport, one line naming the file and the figure: a
report the user named stops the run (exit status 2); one the run found (the job's, or the newest under
--log_dir) is a warning, and is not used."""

import glob
import json
import os
import socket
import sys

from common.errors import ConfigError
from common.files import UnsafeFile, read_regular

# A cluster's report holds about 10 KB a node of 8 GPUs: 256 MB is a report of 25,000 such nodes, and all a
# file in its place can make a reader take.
REPORT_LIMIT = 256 << 20

# Each figure's range, (least, most, whole number): rates in their unit (GB/s, TFLOP/s, GFLOP/s) from a
# kilobyte a second to a petabyte; an operation's or collective's seconds from a picosecond to an hour.
RATE = (1e-6, 1e6, False)
SECONDS = (1e-12, 3600.0, False)
COUNT = (1, 1 << 20, True)
BYTES = (1, 1 << 50, True)
FIGURES = {
    "gpu": {"matmul_bf16_TFLOPS": RATE, "copy_GB/s": RATE},
    "cpu": {"matmul_fp32_GFLOPS": RATE, "cores": COUNT},
    "memory": {"copy_all_cores_GB/s": RATE},
    "storage": {"parallel_write_GB/s": RATE},
}
SWEEP = {"size_bytes": BYTES, "busbw_GB/s": RATE, "time_us": (1e-6, 3.6e9, False)}
# A probe's figures (run/prediction/probe.py's Measured): seconds of a step or a part of one (none where there
# is no such part), how far apart its steps lay, the share of cores others took.
SPAN = (0.0, 3600.0, False)
SHARE = (0.0, 100.0, False)
PROBE = {"accumulation": COUNT, "step_s": SECONDS, "micro_s": SPAN, "layer_forward_s": SPAN, "spread": SHARE,
         "others": SHARE, "seconds": SECONDS}  # fmt: skip
SECTIONS = ("gpu", "cpu", "memory", "storage", "nccl", "links", "model", "nodes")


class BadReport(ConfigError):
    """A file that is not a benchmark report a run can use: its message names the file and why."""


def read_report(path):
    """The benchmark report at path, each figure a run uses checked; BadReport says why it cannot be used."""
    import yaml

    try:
        data = read_regular(path, REPORT_LIMIT)
        report = yaml.load(data, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except FileNotFoundError:
        raise BadReport(f"{path}: no such file") from None
    except OSError as error:
        raise BadReport(f"{path}: {error.strerror}") from None
    except UnsafeFile as error:
        raise BadReport(str(error)) from None
    except (yaml.YAMLError, ValueError, RecursionError) as error:
        raise BadReport(f"{path} is not YAML ({' '.join(str(error).split())[:200]})") from None
    if problem := report_problem(report):
        raise BadReport(f"{path} is not a benchmark report a run can use: {problem}")
    return report


def report_problem(report):
    """Why a report read back cannot be used, or None."""
    if not isinstance(report, dict):
        return f"it holds {type(report).__name__}, not a report"
    world = report.get("world")
    if not isinstance(world, dict) or world.get("device") not in ("cpu", "cuda"):
        return "its world.device is neither cpu nor cuda"
    if odd := next((name for name in SECTIONS if not isinstance(report.get(name), (dict, type(None)))), None):
        return f"its {odd} section is {type(report[odd]).__name__}, not a mapping"
    for where, value, bounds in figures(report):
        if problem := out_of_range(value, *bounds):
            return f"{where} is {problem}"
    for where, rows in sweeps(report):
        if problem := sweep_problem(rows):
            return f"{where} {problem}"
    for section, field in (("gpu", "name"), ("nodes", "hostname")):
        for member, entry in members(report, section):
            if field in entry and not isinstance(entry[field], str):
                return f"{section}.{member}.{field} is {json.dumps(entry[field], default=str)[:40]}, not text"
    return model_problem(report.get("model") or {})


def members(report, section):
    """(name, figures) of each member of a section (a GPU, a node) that has figures."""
    return [(name, entry) for name, entry in (report.get(section) or {}).items() if isinstance(entry, dict)]


def figures(report):
    """(where, value, bounds) of each figure of the report that a run reads: those of FIGURES that a member
    has (a section skipped, or a member that failed, has none), and the ranks per node, which it must have."""
    yield "world.ranks_per_node", report["world"].get("ranks_per_node"), COUNT
    for section, bounds in FIGURES.items():
        for member, entry in members(report, section):
            for name in bounds.keys() & entry.keys():
                yield f"{section}.{member}.{name}", entry[name], bounds[name]


def out_of_range(value, least, most, whole):
    """Why value is not a figure between least and most (a whole number where whole), or None."""
    if type(value) not in ((int,) if whole else (int, float)):
        return f"{json.dumps(value, default=str)[:40]}, not {'a whole number' if whole else 'a number'}"
    if not least <= value <= most:  # NaN too
        return f"{value!r}, not between {least:g} and {most:g}"
    return None


def sweeps(report):
    """(where, rows) of each collective's sweep of message sizes that a run reads: the report's, each node's,
    and between nodes one rank a node's; rows None where a mapping of them is something else. An operation
    its backend lacks says why instead of a list, and has none."""
    nccl, links = report.get("nccl") or {}, report.get("links") or {}
    intra = nccl.get("intra_node") or {}
    places = {"nccl": nccl, "links.one_rank_per_node": links.get("one_rank_per_node") or {}}
    if not isinstance(intra, dict):
        yield "nccl.intra_node", None
    else:
        places |= {f"nccl.intra_node.{node}": ops for node, ops in intra.items()}
    for where, ops in places.items():
        if not isinstance(ops, dict):
            yield where, None
            continue
        yield from ((f"{where}.{op}", rows) for op, rows in ops.items() if isinstance(rows, list))


def sweep_problem(rows):
    if rows is None:
        return "is not a mapping of collectives"
    for index, row in enumerate(rows):
        for name, bounds in SWEEP.items():
            if problem := out_of_range(row.get(name) if isinstance(row, dict) else None, *bounds):
                return f"row {index}: {name} is {problem}"
    sizes = [row["size_bytes"] for row in rows]
    if sizes != sorted(set(sizes)):
        return "has sizes out of order, or one twice"
    return None


def model_problem(model):
    """Why the report's probe of a run's step (benchmark.py --train_args: run/prediction/probe.py) cannot be
    used, or None."""
    if not model:
        return None
    if not isinstance(model.get("options"), dict):
        return "model.options is not a mapping of the run's options"
    measured = model.get("measured")
    if not isinstance(measured, dict) or set(measured) != set(PROBE):
        return "model.measured is not a probe of the run's step"
    checked = [("model.world_size", model.get("world_size"), COUNT)]
    checked += [(f"model.measured.{name}", measured[name], bounds) for name, bounds in PROBE.items()]
    for where, value, bounds in checked:
        if problem := out_of_range(value, *bounds):
            return f"{where} is {problem}"
    return None


def measured_elsewhere(report, gpu, named=True):
    """Why the report was not measured on the machine --gpu names, or None: a CPU report for --gpu=cpu (one
    nobody named, of this host alone: another's figures are not this machine's), a GPU report whose GPUs are
    all --gpu's (by name) for a GPU of the datasheet; a GPU's memory in GB (--gpu=80) takes any."""
    cpu_report = report["world"]["device"] == "cpu"
    names = sorted({entry["name"] for _, entry in members(report, "gpu") if "name" in entry})
    if gpu == "cpu":
        if not cpu_report:
            return f"it was measured on {', '.join(names) or 'GPUs'}, not on this machine's CPU"
        hosts = sorted({str(entry.get("hostname")) for _, entry in members(report, "nodes")})
        if not named and hosts != [socket.gethostname()]:
            return f"it was measured on {', '.join(hosts) or 'hosts it does not name'}, not on this host"
        return None
    try:
        float(gpu)
    except ValueError:
        pass
    else:
        return None  # a GPU's memory in GB (--gpu=80): a report of any GPU will do
    if cpu_report or not names:
        return f"it was measured on CPUs, not on {gpu} GPUs"
    if others := [name for name in names if gpu.lower() not in name.lower()]:
        return f"it was measured on {', '.join(others)}, not on {gpu} GPUs"
    return None


def newest_report(folder, gpu):
    """The newest cluster report (benchmark_*.yaml, not a node's _rank file) in folder measured on the target
    (run/report_figures.py's measured_elsewhere): for gpu=cpu a CPU report of this host, else one whose GPUs
    are --gpu's. One that is not a report a run can use is passed over, with one warning."""
    reports = [p for p in glob.glob(os.path.join(folder, "benchmark_*.yaml")) if "_rank" not in p]
    for path in sorted(reports, key=modified, reverse=True):
        try:
            report = read_report(path)
        except BadReport as error:
            if path not in PASSED_OVER:
                PASSED_OVER.add(path)
                print(f"warning: {error}; passed over", file=sys.stderr, flush=True)
            continue
        if not measured_elsewhere(report, gpu, named=False):
            return path
    return None


PASSED_OVER = set()  # the reports newest_report warned of, once each


def modified(path):
    """path's time of change, or 0 for one gone since it was listed; a link's own, never its target's."""
    try:
        return os.lstat(path).st_mtime
    except OSError:
        return 0.0
