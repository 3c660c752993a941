"""The job's decisions, as pure functions of what it knows: nothing here reads a file, calls SLURM or prints.
The job (run/job/job.py) gathers the facts and carries the decision out; tests/test_job_decisions.py tables
the cases.

- after_training: once a training launch has exited, whether it finished, was stopped (SIGTERM, SIGINT: the
  job ends), met the time limit (SIGUSR1: it requeues) or failed;
- after_failure: after a failed launch (training, or the benchmark before it), what the job does, inside its
  allocation where it can (docs/SLURM.md): a crash that blames no node is checked by the benchmark, then
  restarted in place, at most MAX_RESTARTS times; a node to blame is left out, and a spare takes its place,
  or training goes on with fewer nodes, or the job requeues without it, or ends where even that cannot go
  on. A failure train.py says, one before the first step, or more bad nodes than MAX_EXCLUDED_NODES end it.
Standard library only."""

import dataclasses

from run.job.lines import nodes
from run.stops import STOPPED_BY_SIGNAL  # train.py's exit status after a stop it checkpointed for


def after_training(status, ending, time_limit):
    """What the job does once a training launch has exited with status: "done" (0); "end" after a stop asked
    for (ending: a stop signal that came to the job, or to the workers, as rank 0 said), whatever the status,
    since torchrun exits 1 when it passes a signal on to workers that checkpoint and exit; "requeue" when
    the time limit is near (time_limit: SIGUSR1); else "recover" from a failure."""
    if status == 0:
        return "done"
    if ending:
        return "end"
    return "requeue" if time_limit else "recover"


@dataclasses.dataclass(frozen=True)
class FailedLaunch:
    """What the job knows of a failed launch, once it has left out the nodes blamed for it."""

    status: int  # the launch's exit status
    benchmark: bool = False  # the launch was the benchmark before training, which nothing restarts
    named: bool = False  # the launch, or the check of its nodes after it, blamed nodes
    left_out: tuple = ()  # of those, the nodes newly left out: none where the job may not leave any out
    too_many: str = ""  # why the job may not leave them out: more bad nodes than MAX_EXCLUDED_NODES
    said_error: bool = False  # train.py stopped on purpose and said why ('error: ...')
    trained: bool = True  # a rank of the launch completed a step
    restarts: int = 0  # the restarts in place this start of the job has made
    check: str | None = None  # the check of a crash's nodes: None not made, "" passed, else why not
    training: int = 0  # the nodes training is left with
    spares: int = 0  # the spares left
    wanted: int = 0  # the nodes training ran on
    partition: int | None = None  # the usable nodes of the partition not left out (None: SLURM does not say)
    allocated: int = 0  # the nodes this start of the job was given

    @property
    def short(self):
        """Whether a requeue could not start: the partition has fewer usable nodes than this start was given,
        and SLURM gives a requeued job the node count it was submitted with."""
        return self.partition is not None and self.partition < self.allocated

    @property
    def back(self):
        """The nodes training has once the spares left fill the places left, as far as they go."""
        return self.training + min(self.spares, max(0, self.wanted - self.training))


@dataclasses.dataclass(frozen=True)
class Action:
    """One of: "check" the training nodes (the benchmark), then decide again; "restart" in place; a "spare"
    in the place of each node left out; "fewer" nodes, `nodes` of them, where train.py's options fit them,
    else `otherwise`; "requeue" without the nodes left out; "stop", with the launch's status, after `line`
    (None: said already)."""

    kind: str
    line: str | None = None
    nodes: int = 0
    otherwise: "Action | None" = None


CHECK, RESTART, SPARE, REQUEUE, STOP = (
    Action(kind) for kind in ("check", "restart", "spare", "requeue", "stop")
)


def after_failure(failed, knobs):
    """What the job does after a launch failed (failed: FailedLaunch), under its knobs (MAX_RESTARTS,
    SKIP_BENCHMARK, SPARE_NODES): the action of the first rule below that applies."""
    restarts_used = (
        f"error: stopping: training failed (exit {failed.status}) with no node to blame, and the "
        f"MAX_RESTARTS={knobs.MAX_RESTARTS} restarts in place are used"
    )
    rules = (
        (failed.too_many, Action("stop", f"error: stopping: {failed.too_many}")),
        (failed.named, without(failed, knobs) if failed.left_out else STOP),
        # a verdict that blames no node; train.py stopped on purpose and said why, or saved for a stop
        (failed.benchmark or failed.said_error or failed.status == STOPPED_BY_SIGNAL, STOP),
        # bad data, memory or options: a restart meets them again
        (not failed.trained, Action("stop", "the launch failed before its first step: not restarting it")),
        (failed.restarts >= knobs.MAX_RESTARTS, Action("stop", restarts_used)),
        (failed.check is None and not knobs.SKIP_BENCHMARK, CHECK),
        (failed.check, Action("stop", f"error: stopping: {failed.check}")),
    )
    return next((action for applies, action in rules if applies), RESTART)


def without(failed, knobs):
    """How the job goes on without the nodes it left out: a spare in each one's place; with no spare left,
    fewer nodes where the job keeps spares (SPARE_NODES) or a requeue could not start; else a requeue."""
    if failed.back == failed.wanted:
        return SPARE
    if failed.back == 0:  # every node of the allocation is left out
        return cannot_go_on("no node of this allocation is left") if failed.short else REQUEUE
    if not (knobs.SPARE_NODES or failed.short):
        return REQUEUE
    unfit = f"train.py's options do not fit the {nodes(failed.back)} left (above)"
    return Action("fewer", nodes=failed.back, otherwise=cannot_go_on(unfit) if failed.short else REQUEUE)


def cannot_go_on(why):
    return Action("stop", f"error: stopping: {why}, and a requeue could not start")
