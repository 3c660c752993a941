"""A hung rank ends in minutes, never silently: process-group timeouts (generous while compiling, loading and
writing checkpoints), NCCL's flight recorder, and a watchdog thread per rank that writes every thread's stack
and names the node the hang waits for (from the heartbeats) before it exits with HUNG. Its files go to the
run's log folder, <log_dir>/<run_name>."""

import collections
import contextlib
import faulthandler
import os
import statistics
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from common.files import no_links
from common.node import node_name
from common.suspects import suspects_folder, write_suspects
from run.job.heartbeats import HEARTBEAT_S, SILENT_S, Heartbeats

HUNG = 3  # exit status of a rank its watchdog ended
# Process-group timeouts, as torchtitan's set_pg_timeouts: generous until the first step is done (compiling,
# loading weights) and while a checkpoint is written; short after, so a hung collective ends in minutes, not
# half an hour. Longer than hang_minimum_s, so the watchdog names the hang first.
PG_TIMEOUT_FIRST_STEP = timedelta(minutes=30)
PG_TIMEOUT = timedelta(minutes=10)
FR_BUFFER_SIZE = 20000  # NCCL flight recorder: the last collectives kept per rank (torchtitan's)


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
        self.beating, self.ended = threading.Lock(), False
        self.last, self.phase_limit, self.phase_name = time.monotonic(), None, None
        threading.Thread(target=self.watch, name="watchdog", daemon=True).start()

    def end(self):
        """The rank's last heartbeat says that it ended, so that the job does not take it for a silent one
        (run/job/heartbeats.py); the watch ends with it."""
        with self.beating:
            self.ended = True
            self.heartbeats.write(ended=True)

    def step_done(self, first):
        """first: the launch's first step, which compiled and loaded: from now on a hung collective ends in
        minutes, and the steps are timed."""
        now = time.monotonic()
        if first:
            set_pg_timeouts(PG_TIMEOUT, self.mesh)
        else:
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
            with self.beating:
                if self.ended:
                    return
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
        write_suspects(suspects_folder(self.folder), f"hang_rank{self.rank}", suspects)
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
            with open(self.path, "w", opener=no_links) as file:
                file.write(line + "\n\n")
                file.flush()
                faulthandler.dump_traceback(file, all_threads=True)
            dump_trace = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
            if self.cuda and dump_trace is not None:  # a CUDA build: this rank's last collectives too
                names = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
                prefix = next(os.environ[name] for name in names if os.environ.get(name))
                with open(f"{prefix}{self.rank}", "wb", opener=no_links) as file:
                    file.write(dump_trace())
        finally:
            print(line, file=sys.stderr, flush=True)
            os._exit(HUNG)
