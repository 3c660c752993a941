"""Naming a bad node so that the job can go on without it: every rank's heartbeat, the suspects of a hang or
of a node that straggles window after window, written to <log_dir>/<run_name>/suspects/ for the job
(run/job.py), which excludes them and requeues the job (docs/SLURM.md)."""

import json
import os
import sys
import time

from common.files import write_atomically
from common.node import node_name
from common.node import write_suspects as common_write_suspects

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
        os.makedirs(self.folder, exist_ok=True)

    def beat(self, steps):
        """Called often; writes at most every HEARTBEAT_S. A full or failing disk must not end the run."""
        now = time.time()
        if now - self.last < HEARTBEAT_S:
            return
        self.last = now
        beat = {"token": self.token, "node": self.node, "rank": self.rank, "steps": steps, "time": now}
        beat["waiting"] = waiting_in_collective(self.thread_id)
        try:
            write_atomically(os.path.join(self.folder, f"rank{self.rank}.json"), json.dumps(beat))
        except OSError:
            pass

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


def write_suspects(folder, name, suspects):
    """Adds {node: why} to the suspects the job (run/job.py) reads once the phase has ended, as <name>.json:
    each writer its own file (hang_rank<R>: the watchdog of rank R, whose step the job ends if it hangs
    on; straggler: rank 0; benchmark: benchmark.py)."""
    common_write_suspects(os.path.join(folder, "suspects"), name, suspects)


class TooManyBadNodes(Exception):
    """More nodes to leave out than the job may: its message is the one line that stops the job."""


def read_suspects(folder):
    """{node: why} from every file in folder, and the files read: the caller removes them once it has acted
    on them, so that a suspect is acted on once, and never lost to a failure in between."""
    suspects, read = {}, []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        path = os.path.join(folder, name)
        read.append(path)
        try:
            with open(path) as file:
                suspects.update(json.load(file)["nodes"])
        except (OSError, ValueError, KeyError) as error:
            print(f"warning: {path} is unreadable ({error}); ignored", file=sys.stderr)
    return suspects, read


def read_excluded(path):
    """{node: why} of an excluded_nodes file. A damaged one (a torn line, bytes that are not text) is read
    as far as it goes: the nodes it still names stay out, and new ones can be added."""
    try:
        with open(path, "rb") as file:
            data = file.read()
    except FileNotFoundError:
        return {}, True
    rows = [line.split("\t") for line in data.decode("utf-8", errors="replace").splitlines()]
    return {row[0]: row[-1] for row in rows if len(row) == 3}, data.endswith(b"\n") or not data


def exclude(run_folder, limit):
    """The job's step after a failed phase: adds the suspects written since it last looked to
    <run_folder>/excluded_nodes, a line "node<TAB>time<TAB>why" each, kept across requeues. Returns every
    node excluded so far, or [] when no new node is to blame (the job stops, as it would have); raises
    TooManyBadNodes, naming them all, when more than limit nodes would be left out."""
    suspects, read = read_suspects(os.path.join(run_folder, "suspects"))
    path = os.path.join(run_folder, "excluded_nodes")
    excluded, whole_lines = read_excluded(path)
    new = {node: why for node, why in sorted(suspects.items()) if node not in excluded}
    if new:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        with open(path, "a") as file:
            file.write("" if whole_lines else "\n")  # a torn last line stays alone
            file.writelines(f"{node}\t{when}\t{why}\n" for node, why in new.items())
    for suspect in read:
        os.remove(suspect)
    if not new:
        return []
    excluded.update(new)
    if len(excluded) > limit:
        named = "; ".join(f"{node} ({why})" for node, why in excluded.items())
        raise TooManyBadNodes(f"{len(excluded)} bad nodes, more than MAX_EXCLUDED_NODES={limit}: {named}")
    return list(excluded)
