"""What the job takes from its environment: its knobs, and the counts SLURM sets. Each knob's default is
stated once, on its export line in slurm_submit.sh, where users read and edit it (docs/SLURM.md lists
them); KNOBS says what each one takes, and the job refuses one that is missing. tests/test_job_knobs.py
fails where the script's knobs and KNOBS differ. Standard library only."""

import argparse

from run.job.lines import JobError

# Each knob and what it takes: bool (0 or 1, a switch), a whole number, at least this one, or str (text).
# REHEARSE_BAD_NODES is benchmark.py's, which it reaches through the job's environment; the job says it with
# the others.
KNOBS = {"SKIP_BENCHMARK": bool, "CONTINUE_ON_BENCHMARK_FAILURE": bool, "BENCHMARK_ARGS": str,
         "NPROC_PER_NODE": 1, "REQUIRE_GPUS": bool, "MAX_REQUEUES": 0, "MAX_EXCLUDED_NODES": 0,
         "REHEARSE_BAD_NODES": str, "SPARE_NODES": 0, "MAX_RESTARTS": 0, "CONTAINER_IMAGE": str,
         "BENCHMARK_ONLY": bool}  # fmt: skip


def read_knobs(environ):
    knobs = {}
    for name, kind in KNOBS.items():
        if name not in environ:
            raise JobError(
                f"{name} is not set: the job takes its knobs from slurm_submit.sh, which sets each one; "
                "start it with sbatch slurm_submit.sh (or bash slurm_submit.sh outside SLURM)",
                2,
            )
        knobs[name] = knob_value(name, environ[name], kind)
    return argparse.Namespace(**knobs)


def knob_value(name, value, kind):
    """The knob's value as the job uses it. A switch is 0 or 1 alone: the job's lines name one that is on
    as =1 (SKIP_BENCHMARK=1: skipping the benchmarks), which another value would not be."""
    if kind is str:
        return value
    if kind is bool:
        if value not in ("0", "1"):
            raise JobError(f"{name}={value}: give 0 (off) or 1 (on)", 2)
        return int(value)
    if not (whole_number(value) and int(value) >= kind):
        raise JobError(f"{name}={value}: give a whole number, {kind} or more", 2)
    return int(value)


def whole_number(text):
    """Digits 0-9 alone: str.isdigit() takes '²' too, which int() refuses."""
    return text.isascii() and text.isdigit()


def slurm_count(environ, name, default):
    """A count SLURM sets (SLURM_GPUS_ON_NODE, SLURM_NNODES), or default where it is unset."""
    value = environ.get(name) or str(default)
    if not whole_number(value):
        raise JobError(
            f"{name}={value} is not a whole number: SLURM sets it in a job; unset it outside one", 2
        )
    return int(value)
