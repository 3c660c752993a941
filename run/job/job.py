"""The job that slurm_submit.sh and benchmark_only.sh hand over to, phase after phase:
1. train.py's options are checked first, on one node: a typo costs seconds, not the benchmarks;
2. benchmark.py on every node (a requeued job skips it once it passed); a node it fails is left out;
3. training on all nodes but SPARE_NODES of them, kept ready, with SLURM's SIGUSR1 (the time limit is near)
   passed on to the workers, and a node that froze found by its heartbeats; a stop (SIGTERM, SIGINT) ends the
   job once the workers have checkpointed and exited;
4. after a failure, the recovery (run/recovery.py): a restart in place, a spare for a bad node, fewer nodes,
   or a requeue without it;
5. at the time limit, the requeue that resumes from the checkpoint.
Knobs come from the environment (slurm_submit.sh sets them); the arguments go to train.py, or to
benchmark.py under benchmark_only.sh. Outside SLURM the same phases run on this machine: the quick start.
Every call to SLURM goes through run/slurm.py. Standard library only (see run/slurm.py)."""

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import suspects
from common.files import read_json, write_atomically
from common.node import node_name
from run import goodput
from run.job import slurm
from run.job.benchmark_reports import (
    last_outcome,
    numbered,
    outcome_path,
    read_outcome,
    report_names,
    split_report,
)
from run.job.heartbeats import HEARTBEAT_S
from run.job.launch import Watch
from run.job.recovery import JobError, Recovery, Stopped, after_training, log, stopped

# Each knob and what it takes: a whole number, at least this one, or str (text). slurm_submit.sh sets every
# one, with its default and what it does: the job has no default of its own.
KNOBS = {"SKIP_BENCHMARK": 0, "CONTINUE_ON_BENCHMARK_FAILURE": 0, "NPROC_PER_NODE": 1, "REQUIRE_GPUS": 0,
         "MAX_REQUEUES": 0, "MAX_EXCLUDED_NODES": 0, "SPARE_NODES": 0, "MAX_RESTARTS": 0, "BENCHMARK_ONLY": 0,
         "BENCHMARK_ARGS": str, "CONTAINER_IMAGE": str}  # fmt: skip
# train.py's arguments on nodes without GPUs, before the user's, which override them
CPU_RUN = ["--model=tiny", "--data=dummy", "--max_steps=40", "--seq_length=64", "--batch_size=4", "--lr=3e-3",
           "--warmup_steps=4", "--compile=False", "--activation_checkpointing=none", "--log_every=5",
           "--log_dir=logs/quickstart"]  # fmt: skip
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


def visible_gpus():
    if not shutil.which("nvidia-smi"):
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return sum(line.startswith("GPU") for line in listed.splitlines())


class Job(Recovery):
    """One start of the job: run() goes through the phases and returns the job's exit status. Of its nodes
    (nodes: those of the allocation it has not left out), it trains on `training`, and keeps the others as
    spares."""

    def __init__(self, knobs, scheduler, argv, python, environ):
        self.knobs, self.scheduler, self.argv, self.python = knobs, scheduler, argv, python
        self.environ = environ
        self.signals = []  # signal numbers, as the handler got them; handled between polls
        self.stop = False  # SIGUSR1 came: the workers checkpoint and the job requeues
        self.stop_deadline = None  # an early SIGUSR1: stop at this time of clock() instead
        self.ending = None  # the first of ENDING to come: no phase starts after it
        self.clock, self.poll_s, self.retry_s, self.beats_s = time.monotonic, 1.0, 0.3, HEARTBEAT_S
        self.run_folder, self.benchmark_s, self.process, self.benchmarks_run = None, 0.0, None, 0
        self.train_args, self.restarts_in_place = None, 0

    def on_signal(self, number, _frame):
        self.signals.append(number)

    def run(self):
        if self.knobs.CONTAINER_IMAGE and not self.scheduler.in_job:
            raise JobError(
                f"CONTAINER_IMAGE={self.knobs.CONTAINER_IMAGE} runs the job's processes in a container "
                "through SLURM (pyxis), and this is no SLURM job: unset it to run here, or use sbatch",
                2,
            )
        gpus = self.gpus()
        hosts = self.hosts()
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
        self.nodes = self.usable(hosts)
        self.training = self.nodes[: len(self.nodes) - self.spares()]
        self.training_count = len(self.training)
        train_args, bench_args = self.arguments(gpus)
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
            return self.requeue(1)
        status = self.train(train_args, report)
        if status == 0 and not self.scheduler.in_job and not gpus:
            print(
                "That was the CPU quick start. On a GPU cluster: sbatch slurm_submit.sh "
                "[train.py arguments] (docs/SLURM.md)."
            )
        return status

    def gpus(self):
        seen = visible_gpus()
        gpus = slurm_count(self.environ, "SLURM_GPUS_ON_NODE", seen)
        host = node_name()
        if gpus and not seen:
            raise JobError(f"the job has {gpus} GPUs per node but nvidia-smi sees none on {host}")
        if not gpus and self.knobs.REQUIRE_GPUS:
            if not self.scheduler.in_job:
                raise JobError(
                    "no SLURM job and no GPU here (REQUIRE_GPUS=1): run sbatch slurm_submit.sh on "
                    "a GPU cluster"
                )
            raise JobError(
                f"no GPU on {host} (REQUIRE_GPUS=1): add --gpus-per-node to the #SBATCH lines or "
                "pick a GPU partition"
            )
        return gpus

    def hosts(self):
        hosts = self.scheduler.hostnames()
        count = slurm_count(self.environ, "SLURM_NNODES", len(hosts))
        if len(hosts) != count:
            raise JobError(
                f"SLURM_NNODES={count} but the job has {len(hosts)} nodes ({' '.join(hosts)}): "
                "torchrun would wait forever"
            )
        return hosts

    def usable(self, hosts):
        """The nodes to run on: the job's, but for those it left out before (heal), which stay out even when
        SLURM allocates them again, as it may when the requeue's ExcNodeList came too late. The job's
        comment keeps them (squeue -o %k shows it)."""
        gone = slurm.left_out(self.scheduler.comment())
        nodes = [host for host in hosts if host not in gone]
        if not nodes:
            raise JobError(
                f"this job left out every node it has now: {' '.join(hosts)} (left_out={','.join(gone)})"
            )
        if len(nodes) < len(hosts):
            log(
                f"running on {' '.join(nodes)} alone: this job left out {','.join(gone)} before "
                f"(its comment: squeue -j {self.scheduler.job_id} -o %k)"
            )
        return nodes

    def spares(self):
        """How many of the nodes this start keeps as spares: SPARE_NODES, or fewer when a requeued start has
        fewer nodes; it trains on one at least."""
        wanted = 0 if self.knobs.BENCHMARK_ONLY else self.knobs.SPARE_NODES
        if wanted and self.allocated <= wanted:
            raise JobError(
                f"SPARE_NODES={wanted} leaves no node to train on: the job has {self.allocated} node(s); "
                f"ask for the nodes to train on and {wanted} more (#SBATCH --nodes=N+{wanted}, or sbatch "
                "--nodes)",
                2,
            )
        kept = min(wanted, len(self.nodes) - 1)
        if wanted:
            spares = " ".join(self.nodes[len(self.nodes) - kept :])
            named = f"{spares} kept as spare{'s' * (kept > 1)}" if kept else "no spare"
            log(f"training on {len(self.nodes) - kept} nodes, {named} (SPARE_NODES={wanted})")
        return kept

    def arguments(self, gpus):
        """train.py's and benchmark.py's arguments: the defaults for the job's devices, then the user's."""
        bench_args = self.knobs.BENCHMARK_ARGS.split()
        if gpus:
            # GPU runs train on wikitext-103 unless the arguments say otherwise; compute nodes without
            # internet need `python train.py --prepare_only --data=wikitext` once on a login node
            train_args = ["--data=wikitext"]
        else:  # a run small enough for CPUs: 4 sequences per process, at least 16 per step
            world = self.nproc * len(self.training)
            bench_args = ["--quick", *bench_args]
            train_args = [*CPU_RUN, f"--global_batch_size={4 * world * ((4 + world - 1) // world)}"]
            if not self.scheduler.in_job:
                # the quick start: a new run each time, which shows the loss falling again rather than
                # resuming the finished one (pass --run_name=... to resume instead)
                train_args += ["--checkpoint_dir=logs/quickstart/checkpoints", "--keep_last=1",
                               f"--run_name=quickstart-{time.strftime('%Y%m%d-%H%M%S')}"]  # fmt: skip
        if self.knobs.BENCHMARK_ONLY:
            return train_args, [*bench_args, *self.argv]
        return [*train_args, *self.argv], bench_args

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
        requeues without them, or goes on here with the others (run/recovery.py), benchmarked again."""
        status, report, ran, failure = self.benchmark(bench_args, self.nodes)
        while failure and not self.knobs.CONTINUE_ON_BENCHMARK_FAILURE:
            gone = self.blame(status) if self.may_leave_out() and self.failed else []
            action = self.without(gone) if gone else None
            if action in (None, "requeue"):
                then = "CONTINUE_ON_BENCHMARK_FAILURE=1 trains anyway"
                print(f"error: {failure}; not training ({then})", file=sys.stderr)
                return (self.requeue_left_out(status) if action else status), None, ran, failure
            log(f"benchmarking {' '.join(self.nodes)} again, without {','.join(gone)}")
            status, report, ran, failure = self.benchmark(bench_args, self.nodes)
        return status, report, ran, failure

    def benchmark(self, bench_args, nodes, again=False):
        """benchmark.py on nodes. Returns its status (0: its verdict lets the job train), the report to give
        training (None: none), whether it ran, and why the job may not train (None: it may), from the
        outcome benchmark.py writes for the job, never from its exit status alone: a benchmark that stopped
        before a verdict failed no check. The nodes it fails: self.failed. again: a check after a crash,
        which an earlier start's passing benchmark does not stand in for."""
        self.failed = {}
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
        if self.train_args:  # the run's own step too, timed on these nodes: its prediction is theirs
            args.append(f"--train_args={shlex.join(self.train_args)}")
        command = [self.python, "benchmark.py", "--check_only", *args]  # on one node: a typo costs seconds
        checked = self.benchmarks_run > 1  # the same options, checked before this start's first benchmark
        if not checked:
            refused = self.scheduler.check(self.nodes[0], command, self.environ, self.knobs.CONTAINER_IMAGE)
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
            self.failed = outcome["failed_nodes"]
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
                what = f"training exited (status {watch.status}) and is not restarted; {self.to_resume()}"
                if self.ending:
                    raise stopped(self.ending, what)
                raise Stopped(f"stopped by a stop signal to the training processes: {what}", watch.status)
            if move == "requeue":  # a node to blame as well is left out of the requeued start
                blamed = self.may_leave_out() and (watch.failure or watch.blamed())
                return (
                    watch.status
                    if blamed and self.blame(watch.status) is None
                    else self.requeue(watch.status)
                )
            status = self.recover(watch)
            if status is not None:
                return status
            if self.stop:  # the time limit came while the job recovered: the requeued start trains
                return self.requeue(watch.status)

    def stop_file(self):
        return os.path.join(self.run_folder, STOP_FILE)

    def launch(self, script, args, env, nodes):
        """One phase, torchrun on nodes, watched until it exits (run/job_launch.py). Meanwhile it hands a stop
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
        its own (run/slurm.py), and this process alone gets the signal, sent to it (kill) or to its process
        group (Ctrl-C): the launch gets each one from here, once."""
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


def main(argv):
    sys.stdout.reconfigure(line_buffering=True)  # the job's lines among its workers', in order
    try:
        knobs = read_knobs(os.environ)
        scheduler = slurm.scheduler(os.environ, knobs.CONTAINER_IMAGE)
        # in a container, the job itself runs on the host's python3, its workers on the container's python
        python = "python" if knobs.CONTAINER_IMAGE and scheduler.in_job else sys.executable
        job = Job(knobs, scheduler, argv, python, dict(os.environ))
        signal.signal(signal.SIGUSR1, job.on_signal)  # SLURM sends it to the job alone
        for number in ENDING:
            if signal.getsignal(number) != signal.SIG_IGN:  # nohup's SIGHUP stays ignored
                signal.signal(number, job.on_signal)
        if os.environ.get("JOB_SIGUSR1"):  # it came before this process started (slurm_submit.sh)
            job.signals.append(signal.SIGUSR1)
        return job.run()
    except Stopped as stop:
        log(str(stop))
        return stop.status
    except JobError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.status
