"""One launch of a job's phase (run/job/job.py), as the job watches it while it runs. Its stderr comes through
the job, line by line, which notes a line beginning 'error: ': train.py's one line when it stops on purpose
(bad input, a diverging loss; common/errors.py), a failure that no restart mends. While it trains, the job
reads every rank's heartbeat (run/job/heartbeats.py) and the suspects folder: a node whose ranks all fell
silent, or a node that a hang's watchdog blamed HANG_GRACE_S ago while the launch still runs, is a failure the
launch does not end by itself; the job ends it. Standard library only (see run/job/__init__.py)."""

import dataclasses
import os
import sys
import threading
import time

from common import suspects
from run.job.heartbeats import HEARTBEAT_S, LaunchBeats

HANG_GRACE_S = 15  # a watchdog blamed a node this long ago and the launch goes on: that node froze


@dataclasses.dataclass
class Failure:
    """Why a launch failed, as the job knows it: its cause, the nodes to blame ({node: why}), the last sign
    of the failed node or of training's progress (failed_at), and when the job knew (detected_at), in epoch
    seconds."""

    cause: str
    nodes: dict
    failed_at: float
    detected_at: float

    def named(self):
        return "; ".join(f"{node} ({why})" for node, why in self.nodes.items()) or "no node named"


class Watch:
    """The job's view of one running launch: look() at every poll, finish() once its process has exited."""

    def __init__(self, process, run_folder, world_size, beats_every=HEARTBEAT_S):
        """run_folder: the training run's, whose heartbeats and suspects are read; None for the benchmark.
        The heartbeats are read every beats_every seconds: they change no faster."""
        self.process, self.run_folder, self.started = process, run_folder, time.time()
        self.beats_every = beats_every
        self.beats = LaunchBeats(run_folder, world_size, self.started) if run_folder else None
        self.failure, self.said_error, self.read_at, self.status, self.ended_at = None, False, 0.0, None, None
        self.seen = None  # the failure the job ends the launch for, in words
        self.forwarding = None
        if getattr(process, "stderr", None):
            self.forwarding = threading.Thread(target=self.forward, args=(process.stderr,), daemon=True)
            self.forwarding.start()

    def forward(self, stream):
        """The launch's stderr to the job's, whole lines as they come; read to its end whatever happens, so
        that no worker blocks on a full pipe."""
        for line in iter(stream.readline, b""):
            self.said_error = self.said_error or line.startswith(b"error: ")
            try:
                sys.stderr.write(line.decode(errors="replace"))
                sys.stderr.flush()
            except (OSError, ValueError):
                pass

    def look(self):
        """The failure the job must end the launch for, the first time it sees one: a node a hang's watchdog
        blamed HANG_GRACE_S ago, or a node whose ranks fell silent (written down as a suspect); else None."""
        if self.failure or not self.beats:
            return None
        now, folder = time.time(), suspects.suspects_folder(self.run_folder)
        if suspects.hang_blamed(folder, HANG_GRACE_S):
            self.beats.read()
            blamed = suspects.read_suspects(folder)[0]
            self.failure = Failure("hang", blamed, self.beats.progress_at, now)
            self.seen = f"a hang's watchdog blamed {self.failure.named()} {HANG_GRACE_S} s ago"
        elif now - self.read_at >= self.beats_every:
            self.read_at = now
            silent, last = self.beats.silent_nodes()
            if silent:
                suspects.write_suspects(folder, "heartbeat", silent)
                self.failure = Failure("silent node", silent, last, now)
                self.seen = f"a node fell silent: {self.failure.named()}"
        return self.failure

    def finish(self, status):
        """The launch has exited with status: the last of its output, and of its heartbeats."""
        self.status, self.ended_at = status, time.time()
        if self.forwarding:
            self.forwarding.join()
        if self.beats:
            self.beats.read()
        return self

    @property
    def trained(self):
        return bool(self.beats and self.beats.trained)

    @property
    def progress_at(self):
        return self.beats.progress_at if self.beats else self.started

    def blamed(self):
        """The failure of a launch that ended by itself while a phase blamed nodes (a hang's watchdog, the
        straggler watch): its cause is the suspects' writer."""
        folder = suspects.suspects_folder(self.run_folder)
        nodes, files = suspects.read_suspects(folder)
        if not nodes:
            return None
        causes = sorted({os.path.basename(path).split("_")[0].removesuffix(".json") for path in files})
        return Failure(", ".join(causes), nodes, self.progress_at, self.ended_at)
