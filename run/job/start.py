"""A start of the job: the nodes it has (those SLURM gave it, less those it left out before), how many of them
it keeps as spares, the GPUs of a node, and the arguments of its phases. Standard library only."""

import shutil
import subprocess
import time

from common.node import node_name
from run.job import slurm
from run.job.knobs import slurm_count
from run.job.lines import JobError, log

# train.py's arguments on nodes without GPUs, before the user's, which override them
CPU_RUN = ["--model=tiny", "--data=dummy", "--max_steps=40", "--seq_length=64", "--batch_size=4", "--lr=3e-3",
           "--warmup_steps=4", "--compile=False", "--activation_checkpointing=none", "--log_every=5",
           "--log_dir=logs/quickstart"]  # fmt: skip


def visible_gpus():
    if not shutil.which("nvidia-smi"):
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return sum(line.startswith("GPU") for line in listed.splitlines())


def gpus_per_node(environ, knobs, in_job):
    """The GPUs a node of the job has: SLURM's count, else those nvidia-smi lists."""
    seen = visible_gpus()
    gpus = slurm_count(environ, "SLURM_GPUS_ON_NODE", seen)
    host = node_name()
    if gpus and not seen:
        raise JobError(f"the job has {gpus} GPUs per node but nvidia-smi sees none on {host}")
    if not gpus and knobs.REQUIRE_GPUS:
        if not in_job:
            raise JobError(
                "no SLURM job and no GPU here (REQUIRE_GPUS=1): run sbatch slurm_submit.sh on a GPU cluster"
            )
        raise JobError(
            f"no GPU on {host} (REQUIRE_GPUS=1): add --gpus-per-node to the #SBATCH lines or "
            "pick a GPU partition"
        )
    return gpus


def job_hosts(scheduler, environ):
    hosts = scheduler.hostnames()
    count = slurm_count(environ, "SLURM_NNODES", len(hosts))
    if len(hosts) != count:
        raise JobError(
            f"SLURM_NNODES={count} but the job has {len(hosts)} nodes ({' '.join(hosts)}): "
            "torchrun would wait forever"
        )
    return hosts


def usable_nodes(scheduler, hosts):
    """The nodes to run on: the job's, but for those it left out before (heal), which stay out even when
    SLURM allocates them again, as it may when the requeue's ExcNodeList came too late. The job's
    comment keeps them (squeue -o %k shows it)."""
    gone = slurm.left_out(scheduler.comment())
    nodes = [host for host in hosts if host not in gone]
    if not nodes:
        raise JobError(
            f"this job left out every node it has now: {' '.join(hosts)} (left_out={','.join(gone)})"
        )
    if len(nodes) < len(hosts):
        log(
            f"running on {' '.join(nodes)} alone: this job left out {','.join(gone)} before "
            f"(its comment: squeue -j {scheduler.job_id} -o %k)"
        )
    return nodes


def spare_count(knobs, allocated, nodes):
    """How many of the nodes (those the start runs on) it keeps as spares: SPARE_NODES, or fewer when a
    requeued start has fewer nodes (of the allocated ones); it trains on one at least."""
    wanted = 0 if knobs.BENCHMARK_ONLY else knobs.SPARE_NODES
    if wanted and allocated <= wanted:
        raise JobError(
            f"SPARE_NODES={wanted} leaves no node to train on: the job has {allocated} node(s); "
            f"ask for the nodes to train on and {wanted} more (#SBATCH --nodes=N+{wanted}, or sbatch "
            "--nodes)",
            2,
        )
    kept = min(wanted, len(nodes) - 1)
    if wanted:
        spares = " ".join(nodes[len(nodes) - kept :])
        named = f"{spares} kept as spare{'s' * (kept > 1)}" if kept else "no spare"
        log(f"training on {len(nodes) - kept} nodes, {named} (SPARE_NODES={wanted})")
    return kept


def phase_arguments(knobs, gpus, world, in_job, argv):
    """train.py's and benchmark.py's arguments, for nodes with gpus and world processes in all: the
    defaults for the job's devices, then the user's (argv)."""
    bench_args = knobs.BENCHMARK_ARGS.split()
    if gpus:
        # GPU runs train on wikitext-103 unless the arguments say otherwise; compute nodes without
        # internet need `python train.py --prepare_only --data=wikitext` once on a login node
        train_args = ["--data=wikitext"]
    else:  # a run small enough for CPUs: 4 sequences per process, at least 16 per step
        bench_args = ["--quick", *bench_args]
        train_args = [*CPU_RUN, f"--global_batch_size={4 * world * ((4 + world - 1) // world)}"]
        if not in_job:
            # the quick start: a new run each time, which shows the loss falling again rather than
            # resuming the finished one (pass --run_name=... to resume instead)
            train_args += ["--checkpoint_dir=logs/quickstart/checkpoints", "--keep_last=1",
                           f"--run_name=quickstart-{time.strftime('%Y%m%d-%H%M%S')}"]  # fmt: skip
    if knobs.BENCHMARK_ONLY:
        return train_args, [*bench_args, *argv]
    return [*train_args, *argv], bench_args
