"""Jobs on the test cluster of tests/test_slurm.py, as the tests submit, watch and hurt them: sbatch and
scontrol from the repository root (as if from a login shell), a poll until the job ends, its logs and its run
folder's records, the processes of its launches on this host, and the recovery jobs whose ranks and nodes the
tests kill and freeze."""

import json
import os
import re
import signal
import subprocess
import time

import pytest
from conftest import REPO

# run as if from a login shell, also when the tests themselves run inside a SLURM job
ENV = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


# the smallest training that still exercises FSDP, checkpoints and resume on 4 CPU processes
TINY = [
    "--model=tiny",
    "--data=dummy",
    "--seq_length=16",
    "--batch_size=1",
    "--global_batch_size=4",
    "--compile=False",
    "--activation_checkpointing=none",
    "--log_every=1",
    "--tensorboard=False",
    "--curves=False",
    "--predict=False",  # up to a minute on a loaded machine before the first step; test_diagnose.py has it
]


def submit(script, tmp, *args, sbatch=(), **knobs):
    """Submits a job from the repository root with its logs in tmp; returns the job id."""
    cmd = ["sbatch", "--parsable", f"--output={tmp}/%j.out", f"--error={tmp}/%j.err", *sbatch, script, *args]
    out = subprocess.run(cmd, cwd=REPO, env={**ENV, **knobs}, capture_output=True, text=True, check=True)
    return out.stdout.strip().split(";")[0]


def job(job_id):
    """The job's fields from scontrol (the cluster has no accounting, so no sacct)."""
    line = subprocess.run(
        ["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, check=True
    ).stdout
    return dict(re.findall(r"(\w+)=(\S*)", line))


ENDED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


def wait(job_id, tmp, timeout=480, on_poll=None):
    """Polls until the job has ended (sbatch --wait polls with growing pauses of up to 30 s); returns its
    fields and its .out and .err logs. timeout only catches a job that never ends: the time-limit job takes
    about 100 s here alone, 183 s on a loaded CI machine."""
    deadline = time.time() + timeout
    # a live job also shows transient states (SIGNALING while SIGUSR1 goes out, REQUEUED, ...)
    while (fields := job(job_id))["JobState"] not in ENDED:
        if time.time() > deadline:
            subprocess.run(["scancel", job_id])
            pytest.fail(f"job {job_id} still {fields['JobState']} after {timeout} s:\n{log(tmp, job_id)}")
        if on_poll:
            on_poll(fields)
        time.sleep(1)
    return fields, log(tmp, job_id)


def log(tmp, job_id):
    return "".join(p.read_text() for p in (tmp / f"{job_id}.out", tmp / f"{job_id}.err") if p.exists())


def metrics(log_dir):
    """The records of the run folder, <log_dir>/<run_name>/metrics.jsonl."""
    return [json.loads(line) for path in log_dir.glob("*/metrics.jsonl") for line in path.open()]


def launchers(job_id):
    """The job's torchruns on this host (every "node"), as "pid,pid": srun, whose command line holds
    torchrun's, runs on the job's first node, and is none of them."""
    pgrep = ["pgrep", "-d,", "-f", "--", f"^[^ ]*python[^ ]* -m torch.distributed.run .*--rdzv_id={job_id} "]
    return subprocess.run(pgrep, capture_output=True, text=True).stdout.strip()


def training_processes(job_id):
    """The job's training processes on this host (every "node"): the children of its torchruns."""
    torchruns = launchers(job_id)
    children = (
        subprocess.run(["pgrep", "-P", torchruns], capture_output=True, text=True).stdout if torchruns else ""
    )
    return [int(pid) for pid in children.split()]


def goodput(log_dir):
    """The one run's <log_dir>/<run_name>/goodput.json."""
    (path,) = log_dir.glob("*/goodput.json")
    return json.loads(path.read_text())


def excluded_nodes(log_dir):
    """{node: why} of <log_dir>/<run_name>/excluded_nodes, each line node, time and why."""
    lines = [
        line.split("\t")
        for path in log_dir.glob("*/excluded_nodes")
        for line in path.read_text().splitlines()
    ]
    return {node: why for node, _, why in lines}


def node_of(pid):
    with open(f"/proc/{pid}/environ", "rb") as file:
        return dict(v.split(b"=", 1) for v in file.read().split(b"\0") if b"=" in v).get(b"SLURMD_NODENAME")


# The recovery jobs train with these options (and slurm_submit.sh's CPU run's learning rate and warm-up,
# which their arguments do not override), on 2 nodes of 1 process, before and after each failure: one
# uninterrupted run on 2 processes gives the losses every resumed run must have (to 1e-5: a run on 3
# processes sums in another order, and over 60 steps differs by 2e-5).
RECOVERED = [*TINY, "--global_batch_size=6", "--max_steps=48", "--checkpoint_every=4", "--eval_every=0",
             "--lr=3e-3", "--warmup_steps=4"]  # fmt: skip


class Hurt:
    """wait()'s poll for a recovery job: a training rank on kill_node SIGKILLed once 8 steps are logged (a
    segfault, an OOM kill); 6 steps after training resumed, every process of the job on freeze_node
    SIGSTOPped, never to go on (a frozen node). Each failure's time, and the time of the first step logged
    after training resumed from it."""

    def __init__(self, job_id, folder, kill_node, freeze_node):
        self.job_id, self.folder, self.kill_node, self.freeze_node = job_id, folder, kill_node, freeze_node
        self.log_dir, self.failures, self.steps_after, self.stopped = folder / "logs", [], [], []
        self.resumes = self.logged = 0

    def __call__(self, fields):
        logged, now = len(metrics(self.log_dir)), time.time()
        resumes = log(self.folder, self.job_id).count("\nresumed from ")
        if len(self.steps_after) < len(self.failures):  # a failure training has not resumed from yet
            if resumes > self.resumes:
                self.resumes, self.logged = resumes, logged  # resumed: its first step comes next
            elif self.resumes == len(self.failures) and logged > self.logged:
                self.steps_after.append(now)
                self.logged = logged
        elif not self.failures and logged >= 8:
            workers = [
                pid for pid in training_processes(self.job_id) if node_of(pid) == self.kill_node.encode()
            ]
            if workers:
                os.kill(workers[0], signal.SIGKILL)
                self.failures.append(now)
        elif len(self.failures) == 1 and logged >= self.logged + 6:
            launched = [int(pid) for pid in launchers(self.job_id).split(",") if pid]
            self.stopped = [
                pid
                for pid in launched + training_processes(self.job_id)
                if node_of(pid) == self.freeze_node.encode()
            ]
            for pid in self.stopped:
                os.kill(pid, signal.SIGSTOP)
            self.failures.append(now)

    def to_next_step(self):
        """Seconds from each failure to the first step logged after training resumed from it."""
        return [after - failed for failed, after in zip(self.failures, self.steps_after)]


def recovery_job(tmp_path, partition, nodes, kill_node, freeze_node, **knobs):
    """A job of nodes in its own partition, hurt as Hurt says: (its id, fields and output, Hurt)."""
    job_id = submit(
        "slurm_submit.sh",
        tmp_path,
        *RECOVERED,
        f"--log_dir={tmp_path}/logs",
        f"--checkpoint_dir={tmp_path}/ckpt",
        sbatch=[f"--partition={partition}", f"--nodes={nodes}"],
        NPROC_PER_NODE="1",
        **knobs,
    )
    hurt = Hurt(job_id, tmp_path, kill_node, freeze_node)
    fields, output = wait(job_id, tmp_path, on_poll=hurt)
    return job_id, fields, output, hurt


def assert_recovered(log_dir, reference, output):
    """The run completed, and every step it logged (before a failure, redone after a resume, and after) has
    the loss of the uninterrupted run, to 1e-5. Returns goodput.json."""
    logged = [(r["step"], r["loss"]) for r in metrics(log_dir) if "loss" in r]
    assert logged[-1][0] == 48, output
    assert [loss for _, loss in logged] == pytest.approx([reference[step] for step, _ in logged], rel=1e-5)
    return goodput(log_dir)


def seconds_between(output, first, then):
    """Seconds from the job's log line holding first to the one holding then (each starts with HH:MM:SS)."""

    def said_at(text):
        (clock,) = re.findall(rf"^(\d\d):(\d\d):(\d\d) .*{re.escape(text)}", output, re.M)
        return int(clock[0]) * 3600 + int(clock[1]) * 60 + int(clock[2])

    return (said_at(then) - said_at(first)) % 86400


def assert_prompt(recovery, seen_s, check_s=0.0):
    """A recovery the job carried out at once: it knew of the failure within a minute (a crash: torchrun's
    notice; a frozen node: 20 s of silent heartbeats and the job's next look), ended the launch within 30 s
    and, check_s of benchmark aside, launched again within 10 s; and the ledger's recovery is the one the test
    saw, seen_s from the failure to the next step (to its poll's lag). Its start-up and the benchmark go with
    the machine's speed and load: 33 s from a SIGKILL to the next step quiet here, 132 s on a loaded CI
    machine, so no wall-clock bound is put on them."""
    assert recovery["detection_s"] <= 60 and recovery["teardown_s"] <= 30, recovery
    assert recovery["waiting_s"] - check_s <= 10, (recovery, check_s)
    assert recovery["cost_s"] - recovery["lost_s"] == pytest.approx(seen_s, abs=15), (recovery, seen_s)
