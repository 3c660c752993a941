"""Every rank's heartbeat: <log_dir>/<run_name>/heartbeats/rank<R>.json, rewritten by each rank's watchdog
thread (run/watchdog.py), whose reading names the node a hang waits for."""

import contextlib
import json
import os
import sys
import time

from common.files import write_atomically
from common.node import node_name

HEARTBEAT_S = 5.0  # each rank's heartbeat file is rewritten this often
SILENT_S = 4 * HEARTBEAT_S  # a heartbeat this old: the rank's process is stopped, dead or cut off


def waiting_in_collective(thread_id):
    """Whether the thread's innermost Python frame is in torch.distributed: a rank blocked in a collective
    (or in FSDP's wait for one) waits for others; a rank stuck anywhere else is what they wait for."""
    frame = sys._current_frames().get(thread_id)
    return frame is not None and f"torch{os.sep}distributed{os.sep}" in frame.f_code.co_filename


class Heartbeats:
    """<folder>/heartbeats/rank<R>.json, rewritten every HEARTBEAT_S by the rank's watchdog thread: its node,
    the steps it has completed, whether its training thread waits in a collective, and the time. token
    names the launch: files an earlier launch left are ignored."""

    def __init__(self, folder, rank, world_size, token, thread_id):
        self.folder, self.rank, self.world_size = os.path.join(folder, "heartbeats"), rank, world_size
        self.token, self.thread_id, self.node, self.last = token, thread_id, node_name(), 0.0
        self.unwritten = False  # whether a write failed, which is said once
        os.makedirs(self.folder, exist_ok=True)

    def beat(self, steps):
        """Called often; writes at most every HEARTBEAT_S. A full or failing disk must not end the run: a beat
        that cannot be written is said once, and the rank's older beat removed, so that no reader takes it for
        the rank's state (a rank that never stepped, or whose beat stopped)."""
        now = time.time()
        if now - self.last < HEARTBEAT_S:
            return
        self.last = now
        beat = {"token": self.token, "node": self.node, "rank": self.rank, "steps": steps, "time": now}
        beat["waiting"] = waiting_in_collective(self.thread_id)
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

    def read(self):
        beats = {}
        for rank in range(self.world_size):
            try:
                with open(os.path.join(self.folder, f"rank{rank}.json")) as file:
                    beat = json.load(file)
            except (OSError, ValueError):
                continue
            if beat.get("token") == self.token:
                beats[rank] = beat
        return beats

    def suspects(self):
        """{node: why} of a hang: the ranks whose heartbeat stopped (a stopped, dead or unreachable process);
        else, every beat being fresh, the ranks that still compute while every other waits in a collective
        for them. {} when the heartbeats cannot tell yet (a late beat), or at all (all waiting: the network,
        or a collective no rank can finish)."""
        beats, now = self.read(), time.time()
        ages = {rank: now - beat["time"] for rank, beat in beats.items()}
        silent = {rank: age for rank, age in ages.items() if age > SILENT_S}
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
