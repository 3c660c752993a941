"""Every rank's heartbeat, and what the beats tell of a node: <log_dir>/<run_name>/heartbeats/rank<R>.json,
rewritten by each rank's watchdog thread (run/health/watchdog.py). A hung rank's watchdog reads them to name
the node its hang waits for; the job (run/job/job.py) reads them while a launch runs, to find a node whose
ranks fell silent (a stopped, dead or cut-off node) within SILENT_S whatever the step time, and to time a
failure. Standard library only: the job may run on a python without torch (run/job/__init__.py)."""

import contextlib
import json
import math
import os
import sys
import time

from common.files import UnsafeFile, read_json, write_atomically
from common.node import node_name

HEARTBEAT_S = 5.0  # each rank's heartbeat file is rewritten this often
SILENT_S = 4 * HEARTBEAT_S  # a heartbeat this old: the rank's process is stopped, dead or cut off
FOLDER = "heartbeats"  # in the run folder
FIELDS = {
    "token": str,
    "node": str,
    "steps": int,
    "ended": bool,
    "waiting": bool,
}  # a beat's, and their kinds


def waiting_in_collective(thread_id):
    """Whether the thread's innermost Python frame is in torch.distributed: a rank blocked in a collective
    (or in FSDP's wait for one) waits for others; a rank stuck anywhere else is what they wait for."""
    frame = sys._current_frames().get(thread_id)
    return frame is not None and f"torch{os.sep}distributed{os.sep}" in frame.f_code.co_filename


def read_beats(folder, world_size, token=None, damaged=None):
    """{rank: beat} of <folder>/rank<R>.json, of the launch named token (None: of any launch). A beat that is
    not a regular file of a record's size with a beat's fields is left out until its rank writes it again,
    with one warning where damaged, the set of the files already warned of, is given."""
    beats = {}
    for rank in range(world_size):
        path = os.path.join(folder, f"rank{rank}.json")
        try:
            beat = read_json(path)
            if problem := beat_problem(beat):
                raise ValueError(problem)
        except FileNotFoundError:
            continue
        except (OSError, UnsafeFile, ValueError) as error:
            if damaged is not None and path not in damaged:
                damaged.add(path)
                print(f"warning: heartbeat {path} is damaged ({error}); left out until its rank writes it "
                      "again", file=sys.stderr, flush=True)  # fmt: skip
            continue
        if token is None or beat["token"] == token:
            beats[rank] = beat
    return beats


def beat_problem(beat):
    """Why a heartbeat read back cannot be used, or None: each field of the kind Heartbeats.write gives it,
    its steps a count, its time a finite number of seconds since the epoch."""
    if not isinstance(beat, dict):
        return f"{json.dumps(beat)[:40]} is not a record"
    for name, kind in FIELDS.items():
        if type(beat.get(name)) is not kind:
            return f"its {name} is {json.dumps(beat.get(name))[:40]}, not {kind.__name__}"
    seconds = beat.get("time")
    if type(seconds) not in (int, float) or not 0 <= seconds < math.inf:
        return f"its time is {json.dumps(seconds)[:40]}, not a time since the epoch"
    return None if beat["steps"] >= 0 else f"its steps are {beat['steps']}"


class Heartbeats:
    """<folder>/heartbeats/rank<R>.json, rewritten every HEARTBEAT_S by the rank's watchdog thread: its node,
    the steps it has completed, whether its training thread waits in a collective, and the time; a last one,
    write(ended=True) as the rank's training ends however it ends (the watchdog's end()), says the process
    ended, so that a rank that left is not taken for a silent one (a killed or hung rank writes none). token
    names the launch: files an earlier launch left are ignored."""

    def __init__(self, folder, rank, world_size, token, thread_id):
        self.folder, self.rank, self.world_size = os.path.join(folder, FOLDER), rank, world_size
        self.token, self.thread_id, self.node, self.last, self.steps = token, thread_id, node_name(), 0.0, 0
        self.unwritten = False  # whether a write failed, which is said once
        self.damaged = set()  # the beats found damaged, each said once
        os.makedirs(self.folder, exist_ok=True)

    def beat(self, steps):
        """Called often; writes at most every HEARTBEAT_S."""
        self.steps, now = steps, time.time()
        if now - self.last >= HEARTBEAT_S:
            self.last = now
            self.write(ended=False)

    def write(self, ended):
        """A full or failing disk must not end the run: a beat that cannot be written is said once, and the
        rank's older beat removed, so that no reader takes it for the rank's state (a rank that never
        stepped, or whose beat stopped)."""
        beat = {"token": self.token, "node": self.node, "rank": self.rank, "steps": self.steps}
        beat.update(ended=ended, time=time.time(), waiting=waiting_in_collective(self.thread_id))
        path = os.path.join(self.folder, f"rank{self.rank}.json")
        try:
            write_atomically(path, json.dumps(beat))
        except OSError as error:
            with contextlib.suppress(OSError):
                os.remove(path)
            if not self.unwritten:
                print(f"warning: cannot write heartbeat {path} ({error.strerror}); it is removed rather than "
                      f"left stale, and training goes on", file=sys.stderr, flush=True)  # fmt: skip
            self.unwritten = True

    def suspects(self):
        """{node: why} of a hang: the ranks whose heartbeat stopped (a stopped, dead or unreachable process);
        else, every beat being fresh, the ranks that still compute while every other waits in a collective
        for them. {} when the heartbeats cannot tell yet (a late beat), or at all (all waiting: the network,
        or a collective no rank can finish)."""
        beats, now = read_beats(self.folder, self.world_size, self.token, self.damaged), time.time()
        ages = {rank: now - beat["time"] for rank, beat in beats.items()}
        silent = {rank: age for rank, age in ages.items() if age > SILENT_S and not beats[rank]["ended"]}
        if silent:
            return by_node(beats, silent, "rank {rank} sent no heartbeat for {value:.0f} s")
        if max(ages.values(), default=0) > 2 * HEARTBEAT_S:  # a late beat is old news: wait for silence
            return {}
        working = [rank for rank, beat in beats.items() if not beat["waiting"]]
        if working and len(working) < len(beats):
            steps = {rank: beats[rank]["steps"] for rank in working}
            return by_node(beats, steps, "rank {rank} was computing (step {value}) while the others waited")
        return {}


def by_node(beats, values, words):
    """{node: why}, each node's ranks of values described by words."""
    nodes = {}
    for rank, value in sorted(values.items()):
        node = beats[rank]["node"]
        nodes[node] = "; ".join(filter(None, [nodes.get(node), words.format(rank=rank, value=value)]))
    return nodes


class LaunchBeats:
    """The job's reading of one launch's heartbeats, as it polls: the beats written since the launch started
    (started, the epoch time) are its own, the token of the first of them names it. Also when its steps last
    advanced (progress_at), the time a failure is counted from."""

    def __init__(self, run_folder, world_size, started):
        self.folder, self.world_size, self.started = os.path.join(run_folder, FOLDER), world_size, started
        self.token, self.steps, self.progress_at, self.damaged = None, {}, started, set()

    def read(self):
        if self.token is None:
            beats = read_beats(self.folder, self.world_size, damaged=self.damaged).values()
            fresh = [beat for beat in beats if beat["time"] >= self.started]
            if not fresh:
                return {}
            self.token = min(fresh, key=lambda beat: beat["time"])["token"]
        beats = read_beats(self.folder, self.world_size, self.token, self.damaged)
        for rank, beat in beats.items():
            if beat["steps"] > self.steps.get(rank, 0):
                self.steps[rank], self.progress_at = beat["steps"], max(self.progress_at, beat["time"])
        return beats

    @property
    def trained(self):
        """Whether a rank of the launch completed a step."""
        return any(self.steps.values())

    def silent_nodes(self):
        """({node: why}, the last beat of any of them) of the nodes every rank of which sent no heartbeat for
        SILENT_S and did not end, while a rank on another node still beats: ({}, None) when none, or when
        every node fell silent at once (the filesystem of the heartbeats, or the job's own host)."""
        beats, now = self.read(), time.time()
        ages = {rank: now - beat["time"] for rank, beat in beats.items() if not beat["ended"]}
        alive = {beats[rank]["node"] for rank, age in ages.items() if age <= SILENT_S}
        silent = {rank: age for rank, age in ages.items() if beats[rank]["node"] not in alive}
        if not silent or not alive:
            return {}, None
        last = max(beats[rank]["time"] for rank in silent)
        return by_node(beats, silent, "rank {rank} sent no heartbeat for {value:.0f} s"), last
