"""The job that slurm_submit.sh and benchmark_only.sh hand over to (python -m run.job), phase after phase:
1. train.py's options are checked first, on one node: a typo costs seconds, not the benchmarks;
2. benchmark.py on every node (a requeued job skips it once it passed); a node it fails is left out;
3. training on all nodes but SPARE_NODES of them, kept ready, with SLURM's SIGUSR1 (the time limit is near)
   passed on to the workers, and a node that froze found by its heartbeats; a stop (SIGTERM, SIGINT) ends the
   job once the workers have checkpointed and exited;
4. after a failure, what run/job/decisions.py decides, carried out here: a restart in place, a spare for a
   bad node, fewer nodes, or a requeue without it (run/job/requeue.py);
5. at the time limit, the requeue that resumes from the checkpoint.
Knobs come from the environment (run/job/knobs.py); the arguments go to train.py, or to benchmark.py under
benchmark_only.sh. Outside SLURM the same phases run on this machine: the quick start. Every call to SLURM
goes through run/job/slurm.py. Standard library only."""

import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from common import suspects
from common.files import read_json, write_atomically
from run.job import requeue
from run.job.benchmark_reports import (
    last_outcome,
    numbered,
    outcome_path,
    read_outcome,
    report_names,
    split_report,
)
from run.job.decisions import FailedLaunch, after_failure, after_training
from run.job.heartbeats import HEARTBEAT_S
from run.job.launch import Failure, Watch
from run.job.lines import JobError, Stopped, log, nodes, stopped
from run.job.start import gpus_per_node, job_hosts, phase_arguments, spare_count, usable_nodes
from run.progress import goodput

# SIGUSR1 with more than EARLY_SIGNAL of the time limit left, beyond the SIGNAL_EARLINESS_S by which SLURM
# may send it early (sbatch(1): "up to 60 seconds earlier than specified"): the signal's lead is longer than
# the limit allows, and each start would requeue at once; the job stops with SCALED_LEAD of the limit left.
EARLY_SIGNAL = 0.8
SIGNAL_EARLINESS_S = 60
SCALED_LEAD = 0.1
STOP_FILE = "stop_requested"  # in the run folder: rank 0 looks for it (JOB_STOP_FILE, run/stops.py)
# The signals that end the job, those torchrun ends its workers for: SIGTERM (kill, scancel, the end of the
# time limit, a preemption), SIGINT (Ctrl-C), SIGHUP (its terminal closed), SIGQUIT (Ctrl-\)
ENDING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class Job:
    """One start of the job: run() goes through the phases and returns the job's exit status. Of its nodes
    (nodes: those of the allocation it has not left out), it trains on `training`, and keeps the others as
    spares, and carries out the decisions after a failure (run/job/decisions.py)."""

    def __init__(self, knobs, scheduler, argv, python, environ):
        self.knobs, self.scheduler, self.argv, self.python = knobs, scheduler, argv, python
        self.environ = environ
        self.signals = []  # signal numbers, as the handler got them; handled between polls
        self.stop = False  # SIGUSR1 came: the workers checkpoint and the job requeues
        self.stop_deadline = None  # an early SIGUSR1: stop at this time of clock() instead
        self.ending = None  # the first of ENDING to come: no phase starts after it
        self.clock, self.poll_s, self.retry_s, self.beats_s = time.monotonic, 1.0, 0.3, HEARTBEAT_S
        self.run_folder, self.benchmark_s, self.process, self.benchmarks_run = None, 0.0, None, 0
        self.train_args, self.bench_args, self.restarts_in_place = None, None, 0

    def on_signal(self, number, _frame):
        self.signals.append(number)

    def run(self):
        if self.knobs.CONTAINER_IMAGE and not self.scheduler.in_job:
            raise JobError(
                f"CONTAINER_IMAGE={self.knobs.CONTAINER_IMAGE} runs the job's processes in a container "
                "through SLURM (pyxis), and this is no SLURM job: unset it to run here, or use sbatch",
                2,
            )
        gpus = gpus_per_node(self.environ, self.knobs, self.scheduler.in_job)
        hosts = job_hosts(self.scheduler, self.environ)
        self.nproc = gpus or self.knobs.NPROC_PER_NODE
        where = f"job {self.scheduler.job_id} on {' '.join(hosts)}" if self.scheduler.in_job else hosts[0]
        device = "GPUs" if gpus else "CPU"
        log(
            f"{where}{'' if self.scheduler.in_job else ' (no SLURM job)'}: SLURM_RESTART_COUNT="
            f"{self.scheduler.restarts}, {self.nproc} processes per node ({device})"
        )
        log(
            "knobs: "
            + " ".join(f"{name}={shlex.quote(str(value))}" for name, value in vars(self.knobs).items())
        )
        self.allocated = len(hosts)
        self.nodes = usable_nodes(self.scheduler, hosts)
        self.training = self.nodes[: len(self.nodes) - spare_count(self.knobs, self.allocated, self.nodes)]
        self.training_count = len(self.training)
        world = self.nproc * len(self.training)
        train_args, bench_args = phase_arguments(self.knobs, gpus, world, self.scheduler.in_job, self.argv)
        if self.knobs.BENCHMARK_ONLY:
            status, _, _, failure = self.benchmark(bench_args, self.nodes)
            if failure:
                print(f"error: {failure}", file=sys.stderr)
            return status
        self.train_args, self.bench_args = train_args, bench_args
        self.run_folder = self.check(train_args)
        status, report, ran, failure = self.benchmarks(bench_args)
        if failure and not self.knobs.CONTINUE_ON_BENCHMARK_FAILURE:
            return status
        if failure:
            print(f"{failure}; CONTINUE_ON_BENCHMARK_FAILURE=1, so training anyway")
        if ran and self.stop:  # the time limit came during the benchmarks: the requeued run goes on to train
            return self.requeue_to_resume(1)
        status = self.train(train_args, report)
        if status == 0 and not self.scheduler.in_job and not gpus:
            print(
                "That was the CPU quick start. On a GPU cluster: sbatch slurm_submit.sh "
                "[train.py arguments] (docs/SLURM.md)."
            )
        return status

    def options_fit(self, train_args, nodes):
        """train.py --check_only, for a world of that many nodes: the run's log folder, where a failed phase
        leaves the nodes it blames; None when train.py refused its options (it says why). Where only the
        container has the Python, it runs there, on the first node."""
        here = os.getcwd() if self.knobs.CONTAINER_IMAGE else None  # a folder the container sees
        with tempfile.TemporaryDirectory(prefix=".job-check-", dir=here) as folder:
            checked = os.path.join(folder, "checked.json")
            env = {**self.environ, "WORLD_SIZE": str(self.nproc * nodes), "CHECKED_JSON": checked}
            command = [self.python, "train.py", "--check_only", *train_args]
            refused = self.scheduler.check(self.nodes[0], command, env, self.knobs.CONTAINER_IMAGE)
            self.handle_signals()  # Ctrl-C reaches the check too: a stop, not a refusal
            if refused:
                return None
            return read_json(checked)["log_folder"]

    def check(self, train_args):
        run_folder = self.options_fit(train_args, len(self.training))
        if run_folder is None:
            raise JobError("not started: train.py refused its options (above)", 2)
        with_stop = os.path.join(run_folder, STOP_FILE)
        if os.path.exists(with_stop):  # an earlier start's: this start has had no stop yet
            os.remove(with_stop)
        return run_folder

    def benchmarks(self, bench_args):
        """Phase 1 on every node, as benchmark() returns it; where the job may not train on these nodes, the
        job's exit status is the first of the four. The nodes the benchmark fails are left out, and the job
        requeues without them, or goes on here with the others (after_failure), benchmarked again."""
        status, report, ran, failure = self.benchmark(bench_args, self.nodes)
        while failure and not self.knobs.CONTINUE_ON_BENCHMARK_FAILURE:
            failed = self.facts(status, bool(self.failed_nodes), benchmark=True)
            done = self.carry_out(after_failure(failed, self.knobs), failed)
            if done in (None, "requeue"):
                then = "CONTINUE_ON_BENCHMARK_FAILURE=1 trains anyway"
                print(f"error: {failure}; not training ({then})", file=sys.stderr)
                return (self.requeue_without(status) if done else status), None, ran, failure
            log(f"benchmarking {' '.join(self.nodes)} again, without {','.join(failed.left_out)}")
            status, report, ran, failure = self.benchmark(bench_args, self.nodes)
        return status, report, ran, failure

    def benchmark(self, bench_args, nodes, again=False):
        """benchmark.py on nodes. Returns its status (0: its verdict lets the job train), the report to give
        training (None: none), whether it ran, and why the job may not train (None: it may), from the
        outcome benchmark.py writes for the job, never from its exit status alone: a benchmark that stopped
        before a verdict failed no check. The nodes it fails: self.failed_nodes. again: a check after a crash,
        which an earlier start's passing benchmark does not stand in for."""
        self.failed_nodes = {}
        if self.knobs.SKIP_BENCHMARK:
            print("SKIP_BENCHMARK=1: skipping the benchmarks")
            return 0, None, False, None
        rest, folder, given = split_report(bench_args)
        reports = report_names(self.scheduler, folder, given)
        earlier = [outcome for outcome in map(last_outcome, reports[:-1]) if outcome]
        if not again and not self.benchmarks_run and earlier and earlier[-1]["verdict"] != "fail":
            print("requeued run: skipping the benchmarks (they passed in this job's earlier start)")
            return 0, Path(earlier[-1]["report"]), False, None
        self.benchmarks_run += 1
        report = numbered(reports[-1], self.benchmarks_run)
        args = [*rest, f"--report={report}", f"--outcome={outcome_path(report)}"]
        if self.run_folder:
            args.append(f"--suspects_folder={suspects.suspects_folder(self.run_folder)}")
        # The run's own step too, timed where it will train: its prediction is theirs. With the spares, the
        # nodes make a world training never runs at (SPARE_NODES=1 on 3 nodes of 2 processes: 6 ranks for
        # training's 4), whose global batch may not divide over it: training times its own step instead.
        if self.train_args and len(nodes) == len(self.training):
            args.append(f"--train_args={shlex.join(self.train_args)}")
        command = [self.python, "benchmark.py", "--check_only", *args]  # on one node: a typo costs seconds
        checked = self.benchmarks_run > 1  # the same options, checked before this start's first benchmark
        if not checked:  # --train_args checked for the world these nodes make (hybrid's groups need it)
            world = {"WORLD_SIZE": str(self.nproc * len(nodes)), "LOCAL_WORLD_SIZE": str(self.nproc)}
            env = {**self.environ, **world}
            refused = self.scheduler.check(self.nodes[0], command, env, self.knobs.CONTAINER_IMAGE)
            self.handle_signals()
            if refused:
                raise JobError("not started: benchmark.py refused its options (above)", 2)
        log(f"phase 1: benchmark.py {' '.join(bench_args)}")
        started = self.clock()
        status = self.launch("benchmark.py", args, {}, nodes).status
        self.benchmark_s += self.clock() - started
        if self.ending:
            raise stopped(self.ending, f"the benchmark exited (status {status}); nothing more runs")
        outcome = read_outcome(outcome_path(report))
        if outcome is None:
            why = f"the benchmark stopped before a verdict (exit {status}; see its output above)"
            return status or 1, None, True, why
        if outcome["verdict"] == "fail":
            self.failed_nodes = outcome["failed_nodes"]
            blamed = ", ".join(outcome["failed_nodes"]) or "no node"
            why = (
                f"the benchmark's verdict is fail (exit {status}), blaming {blamed}: its failing checks are "
                f"in the output above and in {outcome['report']}"
            )
            return status or 1, Path(outcome["report"]), True, why
        if status:
            print(f"warning: benchmark.py exited {status} after its verdict, {outcome['verdict']}; going on")
        return 0, Path(outcome["report"]), True, None

    def train(self, train_args, report):
        """Phase 2, launched again after each failure the job recovers from inside its allocation."""
        env = {"JOB_STOP_FILE": self.stop_file()}
        if report:  # train.py points to it from the run folder (benchmark_reports.txt)
            env["BENCHMARK_REPORT"] = str(report)
        while True:
            env["BENCHMARK_SECONDS"] = f"{self.benchmark_s:.1f}"  # since the last launch, for the ledger
            self.benchmark_s = 0.0
            goodput.relaunching(self.run_folder)
            log(f"phase 2: train.py {' '.join(train_args)}")
            watch = self.launch("train.py", train_args, env, self.training)
            log(f"training exited with status {watch.status}")
            # a stop file the job did not write: rank 0 says the workers saved for a stop signal of their own
            theirs = not (self.ending or self.stop) and os.path.exists(self.stop_file())
            move = after_training(watch.status, self.ending or theirs, self.stop)
            if move == "done":
                return 0
            if move == "end":
                resume = requeue.how_to_resume(self.run_folder)
                what = f"training exited (status {watch.status}) and is not restarted; {resume}"
                if self.ending:
                    raise stopped(self.ending, what)
                raise Stopped(f"stopped by a stop signal to the training processes: {what}", watch.status)
            if move == "requeue":
                return self.requeue_for_time_limit(watch)
            status = self.recover(watch)
            if status is not None:
                return status
            if self.stop:  # the time limit came while the job recovered: the requeued start trains
                return self.requeue_to_resume(watch.status)

    def recover(self, watch):
        """After a failed training launch (watch, run/job/launch.py), after_failure's decision carried out:
        None to launch again, or the job's exit status."""
        found = watch.failure or watch.blamed()  # a node the launch blamed, or a crash that blames none
        failure = found or Failure("crash", {}, watch.progress_at, watch.ended_at)
        launch = {"said_error": watch.said_error, "trained": watch.trained}
        failed = self.facts(watch.status, found is not None, **launch)
        action = after_failure(failed, self.knobs)
        if action.kind == "check":
            failure.nodes, check = self.check_nodes(watch.status)
            failed = self.facts(watch.status, bool(failure.nodes), check=check, **launch)
            action = after_failure(failed, self.knobs)
        if action.kind == "restart":
            self.restart_in_place(failure, watch)
            return None
        if failed.left_out:
            log(f"{failure.cause}: {failure.named()}")
        done = self.carry_out(action, failed)
        if done is None:
            return watch.status
        self.note(failure, done, watch)
        return self.requeue_without(watch.status) if done == "requeue" else None

    def facts(self, status, named, **launch):
        """What after_failure decides from, once the nodes blamed (named: whether the launch blamed any) are
        left out where the job may; launch: what the launch that failed said of itself (FailedLaunch's
        fields)."""
        gone, too_many = [], ""
        if named and self.may_leave_out():
            gone, too_many = requeue.leave_out(self.scheduler, self.run_folder, self.knobs.MAX_EXCLUDED_NODES)
            self.nodes = [node for node in self.nodes if node not in gone]
            self.training = [node for node in self.training if node not in gone]
        return FailedLaunch(
            status, named=named, left_out=tuple(gone), too_many=too_many, **launch,
            restarts=self.restarts_in_place, training=len(self.training),
            spares=len(self.nodes) - len(self.training), wanted=self.training_count,
            partition=requeue.partition_left(self.scheduler, self.run_folder) if gone else None,
            allocated=self.allocated,
        )  # fmt: skip

    def may_leave_out(self):
        return bool(self.scheduler.in_job and self.run_folder and self.knobs.MAX_EXCLUDED_NODES > 0)

    def check_nodes(self, status):
        """The benchmark of the training nodes, after a crash that blamed no node: ({node: why} of the nodes
        it fails, ""), or ({}, why) where it fails and names no node; ({}, "") where it passes them."""
        log(f"a rank crashed (training exited with status {status}, no node named): benchmarking its nodes")
        _, _, _, failure = self.benchmark(self.bench_args, self.training, again=True)
        if failure is None:
            return {}, ""
        blamed = suspects.read_suspects(suspects.suspects_folder(self.run_folder))[0]
        return (blamed, "") if blamed else ({}, failure)

    def restart_in_place(self, failure, watch):
        self.restarts_in_place += 1
        checked = "no check (SKIP_BENCHMARK=1)" if self.knobs.SKIP_BENCHMARK else "the benchmark passed them"
        log(
            f"restarting in place on {' '.join(self.training)} ({checked}): restart {self.restarts_in_place} "
            f"of at most MAX_RESTARTS={self.knobs.MAX_RESTARTS}"
        )
        self.note(failure, "in place", watch)

    def carry_out(self, action, failed):
        """Carries out after_failure's action once nodes are left out (failed): what the job did, to note for
        the ledger ("spare <nodes> for <nodes>", "fewer nodes", or "requeue", which the caller does), or None
        where it stops (said)."""
        named, why = ",".join(failed.left_out), requeue.why_file(self.run_folder)
        if action.kind == "spare":
            spares = ",".join(self.take_spares())
            left = len(self.nodes) - len(self.training)
            log(
                f"leaving out {named} ({why}); training on {' '.join(self.training)}, with the spare "
                f"{spares} ({left} spare{'s' * (left != 1)} left)"
            )
            return f"spare {spares} for {named}"
        if failed.short:
            log(
                f"the job's partition has {nodes(failed.partition)} usable besides those it left out, "
                f"fewer than the {self.allocated} this start was given: a requeue would have no more, and if "
                f"it asks for {self.allocated} never starts (sinfo -N: the nodes' states)"
            )
        if action.kind == "fewer":
            self.take_spares()
            if self.options_fit(self.train_args, action.nodes):
                log(
                    f"leaving out {named} ({why}); no spare left: going on with {' '.join(self.training)}, "
                    f"as train.py's options fit {nodes(action.nodes)}"
                )
                self.training_count = action.nodes
                return "fewer nodes"
            if action.otherwise.kind == "requeue":
                log(f"train.py's options do not fit {nodes(action.nodes)} (above): requeueing instead")
            action = action.otherwise
        if action.line:
            print(action.line, file=sys.stderr)
        return "requeue" if action.kind == "requeue" else None

    def take_spares(self):
        """Spares into training, where nodes left out left room: the spares taken."""
        spares = [node for node in self.nodes if node not in self.training]
        taken = spares[: max(0, self.training_count - len(self.training))]
        self.training += taken
        return taken

    def note(self, failure, action, watch):
        """The job's part of the recovery, for the next launch's ledger."""
        goodput.write_recovery(
            self.run_folder, failure.cause, failure.nodes, action, failure.failed_at, failure.detected_at,
            watch.ended_at,
        )  # fmt: skip

    def requeue_for_time_limit(self, watch):
        """The time limit is near: the requeue that resumes from the checkpoint, without the nodes the launch
        blamed as well; past MAX_EXCLUDED_NODES the job stops, saying so."""
        if self.may_leave_out() and (watch.failure or watch.blamed()):
            too_many = requeue.leave_out(self.scheduler, self.run_folder, self.knobs.MAX_EXCLUDED_NODES)[1]
            if too_many:
                print(f"error: stopping: {too_many}", file=sys.stderr)
                return watch.status
        return self.requeue_to_resume(watch.status)

    def requeue_to_resume(self, status):
        return requeue.to_resume(
            self.scheduler, self.knobs.MAX_REQUEUES, self.run_folder, status, self.retry_s
        )

    def requeue_without(self, status):
        return requeue.without_left_out(
            self.scheduler, self.knobs.MAX_REQUEUES, self.run_folder, status, self.retry_s
        )

    def stop_file(self):
        return os.path.join(self.run_folder, STOP_FILE)

    def launch(self, script, args, env, nodes):
        """One phase, torchrun on nodes, watched until it exits (run/job/launch.py). Meanwhile it hands a stop
        on to the workers, and ends a launch whose node failed without ending it: a node silent or blamed
        for a hang, whose srun never ends by itself."""
        if self.run_folder:
            shutil.rmtree(suspects.suspects_folder(self.run_folder), ignore_errors=True)
        torchrun = self.scheduler.torchrun(self.python, nodes, self.nproc)
        self.handle_signals()  # a stop that came before: its file is there when the workers look
        process = self.process = self.scheduler.start(
            nodes, [*torchrun, script, *args], {**self.environ, **env}
        )
        training = self.run_folder if script == "train.py" else None
        try:
            watch = Watch(process, training, self.nproc * len(nodes), self.beats_s)
            while process.poll() is None:
                self.handle_signals()
                if watch.look():
                    log(f"{watch.seen}, and the launch goes on: ending it")
                    self.scheduler.end(process)
                time.sleep(self.poll_s)
        except BaseException:  # whatever stops the job (a JobError, a bug) ends the launch: none left running
            if process.poll() is None:
                self.scheduler.end(process)
            raise
        self.handle_signals()
        self.process = None
        return watch.finish(process.returncode)

    def handle_signals(self):
        """Acts on the signals the handler saw: one of ENDING ends the job (terminated()), SIGUSR1 requeues
        it. Either asks the workers to stop, by a file rank 0 looks for (one a worker that does not catch
        signals yet cannot die of, and that reaches workers SLURM did not signal: scancel --batch)."""
        while self.signals:
            number = self.signals.pop(0)
            if number != signal.SIGUSR1:
                self.terminated(number)
            elif not self.stop and self.stop_deadline is None:
                self.time_limit_near()
        if self.stop_deadline is not None and not self.stop and self.clock() >= self.stop_deadline:
            log("the scaled lead is reached: checkpointing to requeue")
            self.stop = True
        asked = self.ending or (signal.SIGUSR1 if self.stop else None)
        if asked and self.run_folder and not os.path.exists(self.stop_file()):
            try:  # the folder is train.py's to make, and it may not have yet
                os.makedirs(self.run_folder, exist_ok=True)
                write_atomically(self.stop_file(), f"{signal.Signals(asked).name}\n")
            except OSError as error:  # tried again at the next poll
                print(f"warning: cannot ask the workers to stop ({error})", file=sys.stderr)

    def terminated(self, number):
        """A stop: the job ends once the launch running has exited, and no phase starts after it. In a job
        SLURM signals every process of the job (scancel, the end of the time limit, a preemption), and the
        job waits for its workers, asked by the stop file too. Outside SLURM the launch runs in a session of
        its own (run/job/slurm.py), and this process alone gets the signal, sent to it (kill) or to its
        process group (Ctrl-C): the launch gets each one from here, once."""
        self.ending = self.ending or number
        if self.process is None:
            raise stopped(self.ending, "before the next phase started")
        name = signal.Signals(number).name
        if self.scheduler.in_job:
            log(f"{name}: waiting for the training processes to exit")
        else:
            self.process.send_signal(number)
            log(f"{name}: passed on to the launch; waiting for it to exit")

    def time_limit_near(self):
        times = self.scheduler.time_left_s()
        if times is None or times[0] <= EARLY_SIGNAL * times[1] + SIGNAL_EARLINESS_S:
            log("SIGUSR1: time limit near, checkpointing to requeue")
            self.stop = True
            return
        left, limit = times
        self.stop_deadline = self.clock() + left - SCALED_LEAD * limit
        print(
            f"warning: SIGUSR1 came with {left:.0f} s of the job's {limit:.0f} s time limit left: the "
            "lead of #SBATCH --signal is longer than this time limit allows, and each start would requeue at "
            f"once; stopping with {SCALED_LEAD * limit:.0f} s left instead (give --signal=B:USR1@SECONDS "
            f"less than {EARLY_SIGNAL:.0%} of --time)",
            file=sys.stderr,
            flush=True,
        )
