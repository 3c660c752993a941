"""What the job takes from its environment: its knobs, and the counts SLURM sets. Standard library only."""

import argparse

from run.job.lines import JobError

# Each knob and what it takes: a whole number, at least this one, or str (text). slurm_submit.sh sets every
# one, with its default and what it does: the job has no default of its own.
KNOBS = {"SKIP_BENCHMARK": 0, "CONTINUE_ON_BENCHMARK_FAILURE": 0, "NPROC_PER_NODE": 1, "REQUIRE_GPUS": 0,
         "MAX_REQUEUES": 0, "MAX_EXCLUDED_NODES": 0, "SPARE_NODES": 0, "MAX_RESTARTS": 0, "BENCHMARK_ONLY": 0,
         "BENCHMARK_ARGS": str, "CONTAINER_IMAGE": str}  # fmt: skip


def read_knobs(environ):
    knobs = {}
    for name, least in KNOBS.items():
        if name not in environ:
            raise JobError(
                f"{name} is not set: the job takes its knobs from slurm_submit.sh, which sets each one; "
                "start it with sbatch slurm_submit.sh (or bash slurm_submit.sh outside SLURM)",
                2,
            )
        value = environ[name]
        if least is not str and not (whole_number(value) and int(value) >= least):
            raise JobError(f"{name}={value}: give a whole number, {least} or more", 2)
        knobs[name] = value if least is str else int(value)
    return argparse.Namespace(**knobs)


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
