"""A stop asked for: a signal, the job's stop file or a straggler's exclusion is posted to StopRequests, the
one channel the training step reads: the run checkpoints at the end of that step, on every rank, and exits
with STOPPED_BY_SIGNAL, the status the job (run/job/) reads as a stop it asked for or was told of. Standard
library only, so that the job, which may run on a python without torch, can import it."""

import contextlib
import glob
import os
import signal
import sys
import threading
import time

from common.files import create_atomically

STOPPED_BY_SIGNAL = 75  # exit status after a requested stop's checkpoint: the job requeues
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# Signals this soon after the first are the same stop: torchrun forwards to its workers the SIGTERM or
# SIGINT that SLURM (scancel, preemption) or the terminal (Ctrl-C) has already sent each of them.
SAME_STOP_SECONDS = 2.0
STOP_FILE_POLL_S = 1.0  # how often rank 0 looks for the job's stop file


class StopRequests:
    """Stops asked for from other threads (the signal watcher, the stop-file watcher, the straggler
    exclusion at a log window). train_step reads pending as late as possible and sums it over the ranks,
    so that every rank stops at the same step. The first request is the one kept."""

    def __init__(self):
        self.reason, self.posted_at, self.lock = None, None, threading.Lock()

    def post(self, reason):
        """Returns whether this is the first request; later ones change nothing."""
        with self.lock:
            if self.reason is not None:
                return False
            self.reason, self.posted_at = reason, time.monotonic()
            return True

    @property
    def pending(self):
        return self.reason is not None


class StopSignals:
    """SLURM sends SIGUSR1 (--signal) before the time limit, SIGTERM on preemption; a person types Ctrl-C.
    During training the first posts a stop request (a checkpoint at the end of the current step, at the same
    step on every rank); a second exits at once with 128 + its number, writing nothing,
    so the last complete checkpoint stays as it was. Before training (data, model, loading) the first exits
    at once; SIGUSR1 is caught only from then on. Under the job script (run/job/), which alone receives
    SLURM's SIGUSR1, the stop comes as the file $JOB_STOP_FILE instead, looked for once training has started.
    The interpreter's C handler writes each signal to a pipe read by a thread: that works while the main
    thread waits inside a step or a collective, where a Python handler would only run once it returns."""

    def __init__(self, requests):
        self.requests, self.training = requests, False
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

    def saved(self, rank):
        """Rank 0's word to the job (run/job/), once the run has checkpointed for a stop signal of its own
        (SIGTERM or SIGINT that reached the workers and not the job: scancel --signal=TERM, a kill of
        torchrun): the job's stop file, unless the job wrote it. The job, which sees torchrun exit 1 as
        after a crash, then ends instead of restarting it. Only once saved: torchrun sends SIGTERM to the
        ranks left after one crashed too, and they never get this far."""
        stop_file = os.environ.get("JOB_STOP_FILE")
        if rank == 0 and stop_file and self.requests.reason in ("SIGTERM", "SIGINT"):
            with contextlib.suppress(OSError):  # FileExistsError: the job wrote it
                create_atomically(stop_file, f"{self.requests.reason}\n")

    def watch_file(self, path):
        while not os.path.exists(path):
            time.sleep(STOP_FILE_POLL_S)
        if self.requests.post("the job asks for a stop"):
            print("the job asks for a stop: checkpointing at the end of this step", flush=True)

    def watch(self, read_end):
        while True:
            number = os.read(read_end, 1)[0]
            if number not in STOP_SIGNALS:
                continue
            name = signal.Signals(number).name
            if self.training and self.requests.post(name):
                print(
                    f"{name}: checkpointing at the end of this step (a second signal exits at once)",
                    flush=True,
                )
                continue
            if self.training and time.monotonic() - self.requests.posted_at < SAME_STOP_SECONDS:
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
