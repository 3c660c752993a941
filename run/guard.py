"""When a run misbehaves: stop signals, process-group timeouts and NCCL's flight recorder, a watchdog per
rank, stragglers, and a profiler on demand. Every file goes to the run's log folder, <log_dir>/<run_name>."""

import collections
import contextlib
import faulthandler
import glob
import os
import signal
import socket
import statistics
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from common.node import node_name
from common.stragglers import slower_than_peers
from run.heal import HEARTBEAT_S, SILENT_S, Heartbeats, write_suspects
from run.options import profiled_steps

STOPPED_BY_SIGNAL = 75  # exit status after a signal-triggered checkpoint: the launcher requeues
HUNG = 3  # exit status of a rank its watchdog ended
# Process-group timeouts, as torchtitan's set_pg_timeouts: generous until the first step is done (compiling,
# loading weights) and while a checkpoint is written; short after, so a hung collective ends in minutes, not
# half an hour. Longer than hang_minimum_s, so the watchdog names the hang first.
PG_TIMEOUT_FIRST_STEP = timedelta(minutes=30)
PG_TIMEOUT = timedelta(minutes=10)
FR_BUFFER_SIZE = 20000  # NCCL flight recorder: the last collectives kept per rank (torchtitan's)
STRAGGLER_LOG_WINDOWS = 3  # named in this many log windows in a row: a warning to exclude its node
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# Signals this soon after the first are the same stop: torchrun forwards to its workers the SIGTERM or
# SIGINT that SLURM (scancel, preemption) or the terminal (Ctrl-C) has already sent each of them.
SAME_STOP_SECONDS = 2.0
STOP_FILE_POLL_S = 1.0  # how often rank 0 looks for the job script's stop file


class StopSignals:
    """SLURM sends SIGUSR1 (--signal) before the time limit, SIGTERM on preemption; a person types Ctrl-C.
    During training the first asks for a checkpoint at the end of the current step (requests is summed over
    the ranks, so all stop at the same step); a second exits at once with 128 + its number, writing nothing,
    so the last complete checkpoint stays as it was. Before training (data, model, loading) the first exits
    at once; SIGUSR1 is caught only from then on. Under the job script (run/job.py), which alone receives
    SLURM's SIGUSR1, the stop comes as the file $JOB_STOP_FILE instead, looked for once training has started.
    The interpreter's C handler writes each signal to a pipe read by a thread: that works while the main
    thread waits inside a step or a collective, where a Python handler would only run once it returns."""

    def __init__(self):
        self.requests, self.training, self.first = [], False, 0.0
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        self.catch(signal.SIGTERM, signal.SIGINT)
        os.register_at_fork(after_in_child=default_signals)
        threading.Thread(target=self.watch, args=(read_end,), daemon=True).start()

    @staticmethod
    def catch(*numbers):
        for number in numbers:
            signal.signal(number, lambda *_: None)  # the wakeup fd carries it to watch()

    def start_training(self, rank):
        self.training = True
        self.catch(signal.SIGUSR1)
        stop_file = os.environ.get("JOB_STOP_FILE")
        if stop_file and rank == 0:  # one rank looks: train_step shares its request with every rank
            threading.Thread(target=self.watch_file, args=(stop_file,), daemon=True).start()

    def watch_file(self, path):
        while not os.path.exists(path):
            time.sleep(STOP_FILE_POLL_S)
        if not self.requests:
            self.requests.append(signal.SIGUSR1)
            self.first = time.monotonic()
            print("the job asks for a stop: checkpointing at the end of this step", flush=True)

    def watch(self, read_end):
        while True:
            number = os.read(read_end, 1)[0]
            if number not in STOP_SIGNALS:
                continue
            name = signal.Signals(number).name
            if self.training and not self.requests:
                self.requests.append(number)
                self.first = time.monotonic()
                print(
                    f"{name}: checkpointing at the end of this step (a second signal exits at once)",
                    flush=True,
                )
                continue
            if self.training and time.monotonic() - self.first < SAME_STOP_SECONDS:
                continue
            if self.training:
                why = "a second stop signal"
            else:  # torchrun ends the other ranks so when one fails before training (a refused lock, say)
                why = "before training started (a stop, or torchrun ending the ranks after one failed)"
            message = f"{name}, {why}: exiting at once with status {128 + number}, writing nothing"
            print(message, file=sys.stderr, flush=True)
            end_children(number)
            os._exit(128 + number)


def default_signals():
    """In a forked child (the tokenizer's workers): the stop signals end it again, as they would have before
    StopSignals caught them for the parent, whose thread and pipe the child does not have."""
    signal.set_wakeup_fd(-1)
    for number in STOP_SIGNALS:
        signal.signal(number, signal.SIG_DFL)


def end_children(number, grace_s=2.0):
    """Passes a stop signal on to this process's children before it exits, so that none is left running
    (and holding the launcher's output open). A child still there after grace_s is killed: one forked just
    as the signal came may have caught it with the handler it inherited, before it set the default one."""
    children = set()
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        with contextlib.suppress(OSError), open(path) as file:
            children.update(int(child) for child in file.read().split())
    for child in children:
        with contextlib.suppress(OSError):
            os.kill(child, number)
    deadline = time.monotonic() + grace_s
    while children and time.monotonic() < deadline:
        for child in list(children):
            with contextlib.suppress(ChildProcessError):
                if not os.waitpid(child, os.WNOHANG)[0]:
                    continue
            children.discard(child)
        time.sleep(0.02)
    for child in children:
        with contextlib.suppress(OSError):
            os.kill(child, signal.SIGKILL)


def flight_recorder_env(environ, folder):
    """Turns on NCCL's flight recorder (the last FR_BUFFER_SIZE collectives of each rank, dumped when one
    times out) with its dumps in folder/flight_recorder, alone there as torchfrtrace wants them; a variable
    the user set, under its new or its old name, wins."""
    dumps = os.path.join(folder, "flight_recorder")
    defaults = {
        ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"): str(FR_BUFFER_SIZE),
        ("TORCH_NCCL_DUMP_ON_TIMEOUT",): "1",
        ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"): os.path.join(dumps, "rank_"),
    }
    for names, value in defaults.items():
        if not any(name in environ for name in names):
            environ[names[0]] = value
    if environ.get("TORCH_FR_DUMP_TEMP_FILE", "").startswith(dumps):
        os.makedirs(dumps, exist_ok=True)


def set_pg_timeouts(timeout, mesh):
    """The timeout of the default group and the mesh's. Every rank first reaches this point (as in
    torchtitan), so none issues a collective under a short timeout while another is still in a long first
    step."""
    dist.barrier()
    for group in [None, *(mesh.get_group(dim) for dim in range(mesh.ndim))]:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


@contextlib.contextmanager
def generous_pg_timeouts(mesh):
    """A checkpoint write waits in barriers for the slowest writer, which on slow storage may take longer than
    PG_TIMEOUT: its own limit is checkpoint_limit_s, kept by the watchdog."""
    set_pg_timeouts(PG_TIMEOUT_FIRST_STEP, mesh)
    yield
    set_pg_timeouts(PG_TIMEOUT, mesh)


class Watchdog:
    """A daemon thread that ends a hung rank. When no optimizer step completes within max(hang_minimum_s,
    hang_factor x median step time), it writes every thread's Python stack (and on GPU the flight recorder)
    to the run's log folder, names the node its hang waits for (from every rank's heartbeat), prints one
    line and exits with HUNG: no rank waits out a collective's timeout silently. Until a step has been timed
    (the first compiles) the limit is PG_TIMEOUT_FIRST_STEP; checkpoint writing and evaluation run under
    their own limits (phase)."""

    def __init__(self, args, folder, rank, device, mesh, on_hang):
        """on_hang: called before the rank ends for a hang (the goodput ledger counts it)."""
        self.args, self.rank, self.cuda, self.mesh, self.on_hang = (
            args,
            rank,
            device.type == "cuda",
            mesh,
            on_hang,
        )
        self.limits = {
            "evaluating": args.eval_limit_s,
            "writing a checkpoint": args.checkpoint_limit_s,
            "writing the last checkpoint and model": args.checkpoint_limit_s,
        }
        self.folder, self.node = folder, node_name()
        self.path = os.path.join(folder, f"stacks_{self.node}_rank{rank}.txt")
        self.step_times, self.steps = collections.deque(maxlen=100), 0
        launch = [f"{time.time():.6f}-{os.getpid()}"]  # rank 0's: names this launch's heartbeats
        dist.broadcast_object_list(launch, src=0)
        training = threading.get_ident()
        self.heartbeats = Heartbeats(folder, rank, dist.get_world_size(), launch[0], training)
        self.last, self.phase_limit, self.phase_name = time.monotonic(), None, None
        threading.Thread(target=self.watch, name="watchdog", daemon=True).start()

    def step_done(self, timed):
        now = time.monotonic()
        if timed:
            self.step_times.append(now - self.last)
        self.last, self.steps = now, self.steps + 1

    @contextlib.contextmanager
    def phase(self, name):
        """Evaluation and writing run under their own limits. A write also waits in barriers for the slowest
        writer, which on slow storage may take longer than PG_TIMEOUT."""
        # The order of the assignments keeps the thread from pairing a short limit with an old start time.
        self.phase_limit, self.phase_name = self.limits[name], name
        self.last = time.monotonic()
        writing = generous_pg_timeouts(self.mesh) if name.startswith("writing") else contextlib.nullcontext()
        try:
            with writing:
                yield
        finally:
            self.last = time.monotonic()
            self.phase_limit = None

    def limit(self):
        if self.phase_limit is not None:
            return self.phase_limit
        if not self.step_times:
            return PG_TIMEOUT_FIRST_STEP.total_seconds()
        return max(self.args.hang_minimum_s, self.args.hang_factor * statistics.median(self.step_times))

    def watch(self):
        while True:
            time.sleep(0.5)
            self.heartbeats.beat(self.steps)
            limit, waited = self.limit(), time.monotonic() - self.last
            if waited > limit:
                self.report(waited, limit)

    def suspects(self):
        """The nodes this hang waits for. A rank that stopped is known once its heartbeat is SILENT_S old:
        until then this rank keeps beating and looking."""
        deadline = time.time() + SILENT_S + 2 * HEARTBEAT_S
        while not (suspects := self.heartbeats.suspects()) and time.time() < deadline:
            time.sleep(1.0)
            self.heartbeats.beat(self.steps)
        write_suspects(self.folder, f"hang_rank{self.rank}", suspects)
        return suspects

    def report(self, waited, limit):
        during = f"{self.phase_name}, " if self.phase_limit is not None else ""
        line = (
            f"no step for {waited:.0f} s on {self.node} rank {self.rank}; stacks in {self.path} "
            f"({during}limit {limit:.0f} s)"
        )
        try:  # whatever fails here, the rank must still end
            self.on_hang()
            if suspects := self.suspects():
                line += "; waiting for " + ", ".join(f"{node} ({why})" for node, why in suspects.items())
            with open(self.path, "w") as file:
                file.write(line + "\n\n")
                file.flush()
                faulthandler.dump_traceback(file, all_threads=True)
            dump_trace = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
            if self.cuda and dump_trace is not None:  # a CUDA build: this rank's last collectives too
                names = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
                prefix = next(os.environ[name] for name in names if os.environ.get(name))
                with open(f"{prefix}{self.rank}", "wb") as file:
                    file.write(dump_trace())
        finally:
            print(line, file=sys.stderr, flush=True)
            os._exit(HUNG)


class RankTimes:
    """This rank's seconds computing and waiting for data since the last read. Compute is the decoder layers'
    forward, timed from hooks that run after FSDP's own pre-forward hook has waited for the layer's gathered
    weights: waiting for a slower rank is not counted, so a slow rank stands out instead of making every rank
    look slow. On GPU the hooks record CUDA events, read at the log window's end when the step's own
    synchronisation has completed them: no extra sync. Data wait is the host's time in next(batches)."""

    def __init__(self, layers, device, compiled):
        self.device, self.cuda = device, device.type == "cuda"
        self.compute, self.data, self.started, self.events = 0.0, 0.0, None, []
        # The hooks run inside a compiled block's call: traced into its graph, they would time the tracing
        # once. Only imported when compiling: torch.compiler imports dynamo, a second of every start.
        outside_graph = torch.compiler.disable if compiled else lambda hook: hook
        for layer in layers:
            layer.register_forward_pre_hook(outside_graph(self.start))
            layer.register_forward_hook(outside_graph(self.stop))

    def start(self, module, args):
        if torch.is_grad_enabled():  # training, not evaluation
            self.started = torch.cuda.Event(enable_timing=True) if self.cuda else time.perf_counter()
            if self.cuda:
                self.started.record()

    def stop(self, module, args, output):
        if self.started is None:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events.append((self.started, end))
        else:
            self.compute += time.perf_counter() - self.started
        self.started = None

    def timed(self, batches):
        while True:
            started = time.perf_counter()
            item = next(batches)
            self.data += time.perf_counter() - started
            yield item

    def reset(self):
        self.compute, self.data, self.events = 0.0, 0.0, []

    def gather(self, world_size, master):
        """(compute s, data s) of every rank since the last gather, on rank 0; None on the others."""
        compute = self.compute + sum(start.elapsed_time(end) / 1e3 for start, end in self.events)
        local = torch.tensor([compute, self.data])
        self.reset()
        if self.cuda:
            local = local.pin_memory().to(self.device, non_blocking=True)
        gathered = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(gathered, local)
        return torch.stack(gathered).tolist() if master else None


class Stragglers:
    """Rank 0's view of the stragglers, log window after log window. exclude(node, why) is called for a node
    one of whose ranks has been named exclude_after windows in a row (0: never)."""

    def __init__(self, names, exclude_after=0, exclude=None):
        self.names, self.streaks, self.exclude_after, self.exclude = names, {}, exclude_after, exclude

    def log_window(self, timings, steps):
        """The record's fields for one log window of steps timed steps (seconds per step); warns of a rank
        named STRAGGLER_LOG_WINDOWS windows in a row."""
        if not steps:
            return {}
        medians, named = slower_than_peers(
            self.names, [[value / steps for value in rank] for rank in timings]
        )
        self.streaks = {name: self.streaks.get(name, 0) + 1 for name in named}
        for name, streak in self.streaks.items():
            node, figures = name.rpartition(":")[0], describe_straggler(named[name], medians)
            if streak == STRAGGLER_LOG_WINDOWS:
                then = f"the job leaves its node out after {self.exclude_after} in a row"
                if not self.exclude_after:
                    then = "if its node stays slow, stop the job and resubmit without it: "
                    then += f"sbatch --exclude={node} slurm_submit.sh ..."
                warning = (
                    f"warning: {name} has been a straggler for {streak} log windows in a row ({figures})"
                )
                print(f"{warning}; {then}", flush=True)
            if streak == self.exclude_after:
                self.exclude(node, f"straggler: {name} {streak} log windows in a row, {figures}")
        return {**medians, "stragglers": named}


def describe_straggler(figures, medians):
    """figures and medians: seconds per step by compute_s and data_wait_s."""
    described = [f"{key[:-2].replace('_', ' ')} {value:.3f} s/step vs median {medians[key]:.3f}"
                 for key, value in figures.items()]  # fmt: skip
    return ", ".join(described)


class StepProfiler:
    """--profile_steps=A,B: torch.profiler over steps A to B (as logged) of rank 0, written as a Chrome trace
    that Perfetto and TensorBoard's profiler open; on GPU a CUDA memory snapshot beside it."""

    def __init__(self, steps, folder, device, master, last_step):
        """A range past last_step ends with the run, and is written then."""
        self.steps = profiled_steps(steps) if master else None
        if self.steps:
            self.steps = (self.steps[0], min(self.steps[1], last_step))
        self.folder, self.cuda = folder, device.type == "cuda"
        self.profiler = None

    @contextlib.contextmanager
    def step(self, number):
        if self.steps is None or not self.steps[0] <= number <= self.steps[1]:
            yield
            return
        if number == self.steps[0]:
            kinds = torch.profiler.ProfilerActivity
            activities = [kinds.CPU, kinds.CUDA] if self.cuda else [kinds.CPU]
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True, with_stack=True)
            self.profiler.start()
            if self.cuda:
                torch.cuda.memory._record_memory_history(max_entries=100_000)
        with torch.profiler.record_function(f"train step {number}"):
            yield
        if number == self.steps[1]:
            self.profiler.stop()
            first, last = self.steps
            # .pt.trace.json: the name TensorBoard's profiler plugin looks for
            name = f"trace_steps_{first}-{last}_{socket.gethostname()}_rank0.pt.trace.json"
            trace = os.path.join(self.folder, name)
            self.profiler.export_chrome_trace(trace)
            print(f"profile: steps {first} to {last} traced in {trace}", flush=True)
            if self.cuda:
                snapshot = os.path.join(self.folder, f"memory_steps_{first}-{last}_rank0.pickle")
                torch.cuda.memory._dump_snapshot(snapshot)
                torch.cuda.memory._record_memory_history(enabled=None)
                print(f"profile: CUDA memory snapshot in {snapshot}", flush=True)
