"""What the job (run/job.py) does after a launch failed, inside its allocation where it can (docs/SLURM.md):
- a crashed rank on nodes the benchmark then finds healthy: the launch again on the same nodes, at most
  MAX_RESTARTS times;
- a node to blame (one that fell silent, a hang's, a straggler's, one the benchmark fails): it is left out,
  and a spare (SPARE_NODES) takes its place; with none left, training goes on with fewer nodes where
  train.py's options fit them, or the job requeues without the node: asking for fewer nodes when its
  partition has too few left to start it, or ending, saying why, when even those cannot train;
- a failure that blames no node and is no crash (bad input, a diverging loss, a failure before the first
  step): the job ends, as it would have;
- a stop asked for (SIGTERM, SIGINT: scancel, kill, Ctrl-C), whatever the launch's status: the job ends,
  and nothing restarts or requeues it (after_training).
Each decision is one line of the job's log; its timing is left for the next launch's goodput ledger
(run/goodput.py). Every call to SLURM goes through the scheduler (run/slurm.py). Standard library only."""

import os
import signal
import sys
import time

from common import suspects
from run import goodput
from run.job import slurm
from run.job.launch import Failure

STOPPED_BY_SIGNAL = 75  # train.py's status after a stop it checkpointed for (run/stops.py)


class JobError(Exception):
    """Stops the job with one line; status is its exit status."""

    def __init__(self, message, status=1):
        super().__init__(message)
        self.status = status


class Stopped(JobError):
    """Ends the job after a stop asked for, with one line that is no error."""


def stopped(number, what):
    """The job's end after the stop signal number: exit status 128 + number, as a process it ended."""
    return Stopped(f"stopped by {signal.Signals(number).name}: {what}", 128 + number)


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


def nodes(count):
    return f"{count} node{'s' * (count != 1)}"


def log(message):
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


class Recovery:
    """The job's decisions after a failure, the part of Job (run/job.py) that run/job.py's phases call."""

    def recover(self, watch):
        """After a failed training launch (watch, run/job_launch.py): None to launch again, or the job's
        exit status."""
        failure, status = watch.failure or watch.blamed(), watch.status
        if failure is None:
            if watch.said_error or status == STOPPED_BY_SIGNAL:
                return status  # train.py stopped on purpose and said why, or was stopped
            if not watch.trained:
                print("the launch failed before its first step: not restarting it", file=sys.stderr)
                return status
            if self.restarts_in_place >= self.knobs.MAX_RESTARTS:
                print(
                    f"error: stopping: training failed (exit {status}) with no node to blame, and the "
                    f"MAX_RESTARTS={self.knobs.MAX_RESTARTS} restarts in place are used",
                    file=sys.stderr,
                )
                return status
            failure = Failure("crash", {}, watch.progress_at, watch.ended_at)
            blamed, failed = self.check_nodes(status)
            if failed is not None:
                print(f"error: stopping: {failed}", file=sys.stderr)
                return status
            if not blamed:
                return self.restart_in_place(failure, watch)
            failure.nodes = blamed
        return self.replace(failure, watch)

    def check_nodes(self, status):
        """The benchmark on the training nodes, after a crash that blamed no node: ({node: why} of the nodes
        it fails, None), or ({}, why) where its verdict fails and names no node. SKIP_BENCHMARK=1: none."""
        if self.knobs.SKIP_BENCHMARK:
            return {}, None
        log(f"a rank crashed (training exited with status {status}, no node named): benchmarking its nodes")
        _, _, _, failure = self.benchmark(self.bench_args, self.training, again=True)
        if failure is None:
            return {}, None
        blamed = suspects.read_suspects(suspects.suspects_folder(self.run_folder))[0]
        return (blamed, None) if blamed else ({}, failure)

    def restart_in_place(self, failure, watch):
        self.restarts_in_place += 1
        cap = self.knobs.MAX_RESTARTS
        checked = "no check (SKIP_BENCHMARK=1)" if self.knobs.SKIP_BENCHMARK else "the benchmark passed them"
        log(
            f"restarting in place on {' '.join(self.training)} ({checked}): restart {self.restarts_in_place} "
            f"of at most MAX_RESTARTS={cap}"
        )
        self.note(failure, "in place", watch)
        return None

    def replace(self, failure, watch):
        """A failure that blamed nodes: they are left out, and the job goes on without them here, or
        requeues without them."""
        status = watch.status
        gone = self.blame(status) if self.may_leave_out() else []
        if not gone:
            return status
        log(f"{failure.cause}: {failure.named()}")
        action = self.without(gone)
        if action is None:
            return status
        self.note(failure, action, watch)
        return self.requeue_left_out(status) if action == "requeue" else None

    def without(self, gone):
        """How the job goes on once the nodes gone are left out: a spare in each one's place ("spare ...");
        with no spare left, fewer nodes ("fewer nodes") where train.py's options fit them and the job keeps
        spares (SPARE_NODES) or its partition has no more nodes for a requeue; else "requeue"; None where
        it cannot go on at all (said in one line)."""
        spares = self.take_spares()
        left, why, named = len(self.nodes) - len(self.training), self.why_file(), ",".join(gone)
        if len(self.training) == self.training_count:
            log(
                f"leaving out {named} ({why}); training on {' '.join(self.training)}, with the spare "
                f"{','.join(spares)} ({left} spare{'s' * (left != 1)} left)"
            )
            return f"spare {','.join(spares)} for {named}"
        usable = self.partition_left()
        short = usable is not None and len(usable) < self.allocated
        if short:
            log(
                f"the job's partition has {nodes(len(usable))} usable besides those it left out, fewer than "
                f"the {self.allocated} this start was given: a requeue would have no more, and if it asks "
                f"for {self.allocated} never starts (sinfo -N: the nodes' states)"
            )
        if not self.training:  # every node of the allocation is left out
            return self.cannot_go_on("no node of this allocation is left") if short else "requeue"
        if not (self.knobs.SPARE_NODES or short):
            return "requeue"
        if self.options_fit(self.train_args, len(self.training)):
            log(
                f"leaving out {named} ({why}); no spare left: going on with {' '.join(self.training)}, as "
                f"train.py's options fit {nodes(len(self.training))}"
            )
            self.training_count = len(self.training)
            return "fewer nodes"
        if short:
            return self.cannot_go_on(
                f"train.py's options do not fit the {nodes(len(self.training))} left (above)"
            )
        log(f"train.py's options do not fit {nodes(len(self.training))} (above): requeueing instead")
        return "requeue"

    def cannot_go_on(self, why):
        print(f"error: stopping: {why}, and a requeue could not start", file=sys.stderr)

    def partition_left(self):
        """The usable nodes of the job's partition that it has not left out; None where SLURM does not say."""
        usable = self.scheduler.partition_nodes()
        gone = suspects.read_excluded(self.run_folder)[0]
        return None if usable is None else [node for node in usable if node not in gone]

    def note(self, failure, action, watch):
        """The job's part of the recovery, for the next launch's ledger."""
        goodput.write_recovery(
            self.run_folder, failure.cause, failure.nodes, action, failure.failed_at, failure.detected_at,
            watch.ended_at,
        )  # fmt: skip

    def may_leave_out(self):
        return bool(self.scheduler.in_job and self.run_folder and self.knobs.MAX_EXCLUDED_NODES > 0)

    def why_file(self):
        return f"why: {self.run_folder}/{suspects.EXCLUDED}"

    def blame(self, status):
        """The nodes blamed since the job last looked, added to excluded_nodes and taken out of this start's
        nodes; [] when none is new. None, said in one line, past MAX_EXCLUDED_NODES."""
        try:
            gone = list(suspects.exclude(self.run_folder, self.knobs.MAX_EXCLUDED_NODES))
        except suspects.TooManyBadNodes as error:
            print(f"error: stopping: {error}", file=sys.stderr)
            return None
        self.nodes = [node for node in self.nodes if node not in gone]
        self.training = [node for node in self.training if node not in gone]
        if gone:  # the next start too, even one that a requeue for the time limit gives them again
            every = list(suspects.read_excluded(self.run_folder)[0])
            refused = self.scheduler.set_comment(slurm.with_left_out(self.scheduler.comment(), every))
            if refused:
                print(f"warning: cannot keep left_out={','.join(every)} in the job's comment ({refused})")
        return gone

    def take_spares(self):
        """Spares into training, where nodes left out left room: the spares taken."""
        spares = [node for node in self.nodes if node not in self.training]
        taken = spares[: max(0, self.training_count - len(self.training))]
        self.training += taken
        return taken

    def requeue_left_out(self, status):
        """Requeues the job to resume without every node it left out, to start on other nodes."""
        nodes = list(suspects.read_excluded(self.run_folder)[0])
        restarts, cap, job_id = self.scheduler.restarts, self.knobs.MAX_REQUEUES, self.scheduler.job_id
        named = ",".join(nodes)
        if restarts >= cap:
            print(
                f"error: stopping: {named} left out, but all MAX_REQUEUES={cap} requeues are used",
                file=sys.stderr,
            )
            return status
        log(
            f"leaving out {named} ({self.why_file()}); requeueing job {job_id} (restart {restarts + 1} of at "
            f"most {cap}) to resume on the other nodes"
        )
        excluded = self.scheduler.excluded()
        refused = self.scheduler.set_comment(slurm.with_left_out(self.scheduler.comment(), nodes))
        refused = refused or self.scheduler.requeue()
        if refused:
            print(
                f"error: stopping: SLURM refused to requeue the job without {named}: {refused}",
                file=sys.stderr,
            )
            return status
        self.exclude_once_requeued(excluded, nodes)
        return 0

    def exclude_once_requeued(self, excluded, nodes):
        """ExcNodeList: excluded, as SLURM wrote it before the requeue (n[2-3] names n2 and n3), and nodes.
        A running job's node list cannot change. Once requeued it can, until it starts again; SLURM may
        refuse while the job completes, and then the job's comment keeps the next start off these nodes."""
        for _ in range(10):
            if self.scheduler.exclude(",".join(dict.fromkeys(filter(None, [excluded, *nodes])))) is None:
                return
            time.sleep(self.retry_s)
        log(
            f"SLURM refused ExcNodeList={','.join(nodes)} for now: the next start may be given them, and "
            "runs on its other nodes"
        )

    def requeue(self, status):
        """Requeues the job to resume from its checkpoint; status is the exit status if none is left."""
        restarts, cap = self.scheduler.restarts, self.knobs.MAX_REQUEUES
        if self.scheduler.in_job and restarts >= cap:
            print(f"stopped for the time limit, but all MAX_REQUEUES={cap} requeues are used")
            return status
        if self.scheduler.in_job:
            log(
                f"requeueing job {self.scheduler.job_id} (restart {restarts + 1} of at most {cap}), "
                "to resume from the checkpoint"
            )
        excluded = self.scheduler.excluded() if self.scheduler.in_job else ""
        refused = self.scheduler.requeue()
        if refused:
            print(f"stopped and not requeued: {refused}; {self.to_resume()}", file=sys.stderr)
            return status
        gone = list(suspects.read_excluded(self.run_folder)[0]) if self.run_folder else []
        if gone:  # left out inside the allocation: the next start is not given them either
            self.exclude_once_requeued(excluded, gone)
        return 0

    def to_resume(self):
        """How to go on from the run's checkpoint: the run's name, which a new quick start does not reuse."""
        return f"to resume, launch again with --run_name={os.path.basename(self.run_folder)}"
