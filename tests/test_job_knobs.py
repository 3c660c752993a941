"""The job's knobs and what it hands over: slurm_submit.sh states each knob's default once, the job takes
them as benchmark_only.sh and docs/SLURM.md say, on a python without torch; bad knobs, spares, benchmark
arguments and a container outside SLURM are refused in one line before any launch; train.py's options check
writes the run folder for the job."""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest
from conftest import REPO, TINY, launch
from fake_scheduler import FakeSlurm, knobs_of, run_job, script_knobs

from run.job import job, slurm
from run.job.knobs import KNOBS, read_knobs

# The job writes its benchmark reports under logs/, relative to where it runs.
pytestmark = pytest.mark.usefixtures("reports_in_tmp")


def test_spares_that_leave_no_node_to_train_on_are_refused_in_one_line(tmp_path):
    with pytest.raises(
        job.JobError, match=r"^SPARE_NODES=3 leaves no node to train on: the job has 3 node"
    ) as refused:
        run_job(FakeSlurm(tmp_path, None), SPARE_NODES=3)
    assert refused.value.status == 2


def test_bad_knobs_are_refused_in_one_line(tmp_path):
    for name, value, least in (
        ("MAX_REQUEUES", "five", 0),
        ("MAX_REQUEUES", "²", 0),
        ("NPROC_PER_NODE", "0", 1),
    ):
        with pytest.raises(job.JobError) as refused:
            read_knobs({**script_knobs(), name: value})
        assert str(refused.value) == f"{name}={value}: give a whole number, {least} or more"
        assert refused.value.status == 2
    # a switch is 0 or 1: SKIP_BENCHMARK=2 was taken, and the job's lines said SKIP_BENCHMARK=1
    for name, value in (("SKIP_BENCHMARK", "2"), ("REQUIRE_GPUS", "yes"), ("BENCHMARK_ONLY", "")):
        with pytest.raises(job.JobError) as refused:
            read_knobs({**script_knobs(), name: value})
        assert str(refused.value) == f"{name}={value}: give 0 (off) or 1 (on)"
        assert refused.value.status == 2
    # the job started without slurm_submit.sh, which alone gives the defaults
    missing = {name: value for name, value in script_knobs().items() if name != "MAX_REQUEUES"}
    with pytest.raises(
        job.JobError, match=r"^MAX_REQUEUES is not set: the job takes its knobs from slurm_submit"
    ):
        read_knobs(missing)
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_NNODES"):
        start = job.Job(knobs_of(), FakeSlurm(tmp_path, None), [], "python", {name: "abc"})
        with pytest.raises(
            job.JobError, match=rf"^{name}=abc is not a whole number: SLURM sets it"
        ) as refused:
            start.run()
        assert refused.value.status == 2


def test_each_knob_the_scripts_set_is_one_the_job_takes_with_its_default_stated_once():
    """slurm_submit.sh states each knob's default, on its export line; the job says what each one takes
    (KNOBS), and docs/SLURM.md lists the defaults: a knob added, dropped or changed in one of them alone fails
    here, as does a default, or a value benchmark_only.sh sets over slurm_submit.sh's, that the job refuses
    or reads as another."""
    defaults = script_knobs()
    assert list(defaults) == list(KNOBS)  # in the order the job's first lines say them
    handover = (REPO / "benchmark_only.sh").read_text().splitlines()[-1]
    assert handover.endswith('exec bash slurm_submit.sh "$@"'), handover
    benchmark_only = {**defaults, **dict(re.findall(r"\b([A-Z_]+)=(\S*)", handover))}
    assert list(benchmark_only) == list(KNOBS) and benchmark_only["BENCHMARK_ONLY"] == "1", handover
    for environ in (defaults, benchmark_only):
        assert {name: str(value) for name, value in vars(read_knobs(environ)).items()} == environ
    docs = (REPO / "docs" / "SLURM.md").read_text()
    section = docs[docs.index("## Knobs") : docs.index("## How a job runs")]
    documented = dict(re.findall(r"^\| `([A-Z_]+)` \| *([^|]*?) *\|", section, re.M))
    assert {name: documented.get(name) for name in KNOBS} == defaults


# what tests/run.sh sets, so that these jobs too leave no bytecode in the checkout: not a knob
NO_BYTECODE = {"PYTHONDONTWRITEBYTECODE": "1"}


def test_the_job_runs_on_a_python_without_torch():
    """In a container the job runs on the host's python3, which may have none of the packages: without
    site-packages (python -S) it starts, reads its knobs and refuses the missing one."""
    result = subprocess.run(
        [sys.executable, "-S", "-m", "run.job"],
        cwd=REPO,
        env={"PATH": os.environ["PATH"], **NO_BYTECODE},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: SKIP_BENCHMARK is not set: the job takes its knobs"), result


def test_the_job_runs_with_the_knobs_slurm_submit_sh_sets(tmp_path):
    """slurm_submit.sh alone holds the knobs' defaults: run as a user runs it, in an environment that sets no
    knob, the job says it runs with those, and every knob it takes has one there. A bad option stops it at
    train.py's check, a few seconds in."""
    result = subprocess.run(
        ["bash", "slurm_submit.sh", "--batch_sise=4", f"--log_dir={tmp_path}"],
        cwd=REPO,
        env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/"), **NO_BYTECODE},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = re.findall(r"^\d\d:\d\d:\d\d knobs: (.*)$", result.stdout, re.M)
    said = dict(knob.split("=", 1) for knob in shlex.split(line))
    assert said == {name: script_knobs()[name] for name in KNOBS}, (said, script_knobs())
    assert "error: unknown option --batch_sise; did you mean --batch_size?" in result.stderr


def test_bad_benchmark_arguments_stop_the_job_before_any_launch(tmp_path, capsys):
    scheduler = FakeSlurm(tmp_path, lambda script, nodes, process: 0, benchmark_check=2)
    with pytest.raises(
        job.JobError, match=r"^not started: benchmark.py refused its options \(above\)$"
    ) as refused:
        run_job(scheduler, BENCHMARK_ARGS="--only=nonsense")
    assert refused.value.status == 2 and scheduler.checks == ["train.py", "benchmark.py"]
    assert scheduler.launches == []


def test_bad_benchmark_arguments_are_refused_in_one_line_by_a_real_check(tmp_path):
    """benchmark_only.sh outside SLURM, as a user runs it: benchmark.py --check_only refuses the section, and
    no torchrun starts."""
    result = subprocess.run(
        [sys.executable, "-m", "run.job"],
        cwd=REPO,
        env={**os.environ, **script_knobs(), "BENCHMARK_ONLY": "1", "NPROC_PER_NODE": "1",
             "BENCHMARK_ARGS": f"--only=nonsense --report_dir={tmp_path}"},
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr == (
        "error: --only: unknown section 'nonsense'; sections are gpu, nccl, links, storage, cpu, memory\n"
        "error: not started: benchmark.py refused its options (above)\n"
    )
    assert "phase 1" not in result.stdout and not list(tmp_path.glob("benchmark_*")), result.stdout


def test_a_container_image_outside_slurm_is_refused_in_one_line(tmp_path):
    start = job.Job(knobs_of(CONTAINER_IMAGE="img.sqsh"), slurm.Local(), [], "python", {})
    with pytest.raises(
        job.JobError, match=r"^CONTAINER_IMAGE=img.sqsh runs the job's processes in a container"
    ):
        start.run()


def test_the_options_check_writes_the_log_folder_for_the_job(tmp_path):
    """train.py --check_only, as the job runs it: the folder comes from a file, not from the output."""
    checked = tmp_path / "checked.json"
    result = launch(
        "train.py",
        ["--check_only", *TINY, f"--log_dir={tmp_path}", "--run_name=r"],
        nproc=0,
        env={"CHECKED_JSON": str(checked)},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(checked.read_text()) == {"log_folder": f"{tmp_path}/r"}
