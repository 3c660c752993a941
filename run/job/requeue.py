"""What SLURM keeps of the job from one start to the next, which the job (run/job/job.py) changes through its
scheduler (run/job/slurm.py): the nodes it left out (the run's excluded_nodes, the job's comment, its
ExcNodeList) and its requeues, at most MAX_REQUEUES. Standard library only."""

import os
import sys
import time

from common import suspects
from run.job import slurm
from run.job.lines import log


def leave_out(scheduler, run_folder, limit):
    """The nodes blamed since the job last looked, added to excluded_nodes and to the job's comment, so that
    the next start too keeps off them, even one that a requeue for the time limit gives them again: (the
    nodes new, ""), or ([], why) past MAX_EXCLUDED_NODES (limit)."""
    try:
        gone = list(suspects.exclude(run_folder, limit))
    except suspects.TooManyBadNodes as error:
        return [], str(error)
    if gone:
        every = list(suspects.read_excluded(run_folder)[0])
        refused = scheduler.set_comment(slurm.with_left_out(scheduler.comment(), every))
        if refused:
            print(f"warning: cannot keep left_out={','.join(every)} in the job's comment ({refused})")
    return gone, ""


def partition_left(scheduler, run_folder):
    """How many usable nodes the job's partition has that the job has not left out; None where SLURM does
    not say."""
    usable = scheduler.partition_nodes()
    gone = suspects.read_excluded(run_folder)[0]
    return None if usable is None else len([node for node in usable if node not in gone])


def without_left_out(scheduler, cap, run_folder, status, retry_s):
    """Requeues the job to resume without every node it left out, to start on other nodes; the job's exit
    status."""
    nodes = list(suspects.read_excluded(run_folder)[0])
    restarts, named = scheduler.restarts, ",".join(nodes)
    if restarts >= cap:
        print(
            f"error: stopping: {named} left out, but all MAX_REQUEUES={cap} requeues are used",
            file=sys.stderr,
        )
        return status
    log(
        f"leaving out {named} ({why_file(run_folder)}); requeueing job {scheduler.job_id} (restart "
        f"{restarts + 1} of at most {cap}) to resume on the other nodes"
    )
    excluded = scheduler.excluded()
    refused = scheduler.set_comment(slurm.with_left_out(scheduler.comment(), nodes))
    refused = refused or scheduler.requeue()
    if refused:
        print(
            f"error: stopping: SLURM refused to requeue the job without {named}: {refused}", file=sys.stderr
        )
        return status
    exclude_once_requeued(scheduler, excluded, nodes, retry_s)
    return 0


def to_resume(scheduler, cap, run_folder, status, retry_s):
    """Requeues the job to resume from its checkpoint (the time limit is near), without the nodes it left out
    inside its allocation; the job's exit status."""
    restarts = scheduler.restarts
    if scheduler.in_job and restarts >= cap:
        print(f"stopped for the time limit, but all MAX_REQUEUES={cap} requeues are used")
        return status
    if scheduler.in_job:
        log(
            f"requeueing job {scheduler.job_id} (restart {restarts + 1} of at most {cap}), to resume from "
            "the checkpoint"
        )
    excluded = scheduler.excluded() if scheduler.in_job else ""
    refused = scheduler.requeue()
    if refused:
        print(f"stopped and not requeued: {refused}; {how_to_resume(run_folder)}", file=sys.stderr)
        return status
    gone = list(suspects.read_excluded(run_folder)[0]) if run_folder else []
    if gone:  # left out inside the allocation: the next start is not given them either
        exclude_once_requeued(scheduler, excluded, gone, retry_s)
    return 0


def exclude_once_requeued(scheduler, excluded, nodes, retry_s):
    """ExcNodeList: excluded, as SLURM wrote it before the requeue (n[2-3] names n2 and n3), and nodes. A
    running job's node list cannot change. Once requeued it can, until it starts again; SLURM may refuse
    while the job completes, and then the job's comment keeps the next start off these nodes."""
    for _ in range(10):
        if scheduler.exclude(",".join(dict.fromkeys(filter(None, [excluded, *nodes])))) is None:
            return
        time.sleep(retry_s)
    log(
        f"SLURM refused ExcNodeList={','.join(nodes)} for now: the next start may be given them, and runs on "
        "its other nodes"
    )


def why_file(run_folder):
    return f"why: {run_folder}/{suspects.EXCLUDED}"


def how_to_resume(run_folder):
    """How to go on from the run's checkpoint: the run's name, which a new quick start does not reuse."""
    return f"to resume, launch again with --run_name={os.path.basename(run_folder)}"
