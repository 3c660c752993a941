"""The benchmark reports of a job (run/job/job.py): which report each start writes, under a name no other
job's can take, and the outcome benchmark.py leaves beside it for the job, from which the job learns the
verdict. Standard library only (see run/job/__init__.py)."""

import argparse
import itertools
import re
import sys
import time
from pathlib import Path

from common.files import UnsafeFile, read_json
from run.job import slurm


def split_report(bench_args):
    """bench_args without --report/--report_dir, the folder for the reports and the report the user named
    (None: none): the job names each start's report itself."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--report", type=Path)
    parser.add_argument("--report_dir", type=Path, default=Path("logs"))
    named, rest = parser.parse_known_args(bench_args)
    return rest, named.report_dir, named.report


def outcome_path(report):
    """Where benchmark.py writes its outcome for the job (--outcome), beside the report."""
    return report.with_name(f"{report.stem}.outcome.json")


def read_outcome(path):
    """benchmark.py's outcome: {"verdict": pass, warn or fail, "report": its path, "failed_nodes": {node:
    why}}; None where it wrote none, having stopped before a verdict (bad input, a crash, a stop)."""
    try:
        outcome = read_json(path)
    except (OSError, UnsafeFile, ValueError):
        return None
    valid = isinstance(outcome, dict) and outcome.get("verdict") in ("pass", "warn", "fail")
    valid = valid and isinstance(outcome.get("failed_nodes"), dict) and isinstance(outcome.get("report"), str)
    # training reads the report it names: one beside the outcome, as benchmark.py writes them, and no other
    return (
        outcome if valid and Path(outcome["report"]).parent.resolve() == Path(path).parent.resolve() else None
    )


def numbered(report, run):
    """The report of a start's run-th benchmark: the first is the start's own, later ones (the nodes left
    once others failed, a check after a crash) are <stem>_2, _3, ..."""
    return report if run == 1 else report.with_name(f"{report.stem}_{run}{report.suffix}")


def last_outcome(report):
    """The outcome of the last benchmark of the start whose first report is report; None: it has none."""
    last = read_outcome(outcome_path(report))
    for run in itertools.count(2):
        later = numbered(report, run)
        if not (later.exists() or outcome_path(later).exists()):
            return last
        last = read_outcome(outcome_path(later)) or last


def report_names(scheduler, folder, given):
    """The benchmark report of each start of this job so far, this one's last. benchmark.py refuses one that
    exists, so each start has its own: <stem>.yaml, then <stem>_restart<N>.yaml, with given's stem when the
    user named one. In a SLURM job the stem is benchmark_<job id>_<its first start, UTC>: job ids start again
    from 1 when a controller's state is reset, and two clusters may share a folder, so the id alone may name
    another job's report. Outside SLURM each run's is named after the time."""
    if given:
        stem, folder = given.stem, given.parent
    elif scheduler.in_job:
        stem = f"benchmark_{scheduler.job_id}_{first_start(scheduler)}"
    else:
        stem = f"benchmark_{time.strftime('%Y%m%d-%H%M%S')}"
        while (folder / f"{stem}.yaml").exists():  # another run this second
            stem += "_"
    suffix = given.suffix if given else ".yaml"
    return [
        folder / f"{stem}{f'_restart{restart}' if restart else ''}{suffix}"
        for restart in range(scheduler.restarts + 1)
    ]


def first_start(scheduler):
    """The job's first start, which its comment keeps for the starts after a requeue (first_start=, squeue
    -o %k); kept there now, on the first start."""
    comment = scheduler.comment()
    kept = slurm.comment_value(comment, "first_start")
    if kept and re.fullmatch(r"\d{8}T\d{6}Z", kept):  # anything else would name a path out of the folder
        return kept
    now = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    refused = scheduler.set_comment(slurm.with_comment_value(comment, "first_start", now))
    if refused:
        print(
            f"warning: cannot keep first_start={now} in the job's comment ({refused}): a requeued start will "
            "not find this start's benchmark report, and benchmarks again",
            file=sys.stderr,
        )
    return now
