"""The nodes a phase blames, and the nodes the job leaves out for it. A phase that finds a bad node (the
benchmark's failing check, a hang's watchdog, rank 0's straggler watch, the job's heartbeat reading) writes it
as a suspect to <run folder>/suspects/, each writer its own file; once the phase has ended the job
(run/job/) adds the suspects to <run folder>/excluded_nodes, kept across requeues, and goes on without
them (docs/SLURM.md). Standard library only: the job may run on a python without torch (run/job/)."""

import json
import os
import sys
import time

from common.files import UnsafeFile, no_links, read_json, read_regular, set_aside_damaged, write_atomically

SUSPECTS = "suspects"  # the folder, in the run folder
EXCLUDED = "excluded_nodes"  # the file, in the run folder


def suspects_folder(run_folder):
    return os.path.join(run_folder, SUSPECTS)


def write_suspects(folder, name, suspects):
    """Adds {node: why} to the suspects in folder (suspects_folder(run folder), or benchmark.py's
    --suspects_folder), as <name>.json: each writer its own file, so none overwrites another's (hang_rank<R>:
    the watchdog of rank R; straggler: rank 0; benchmark: benchmark.py; heartbeat: the job)."""
    if not suspects:
        return
    os.makedirs(folder, exist_ok=True)
    write_atomically(
        os.path.join(folder, f"{name}.json"), json.dumps({"time": time.time(), "nodes": suspects})
    )


class TooManyBadNodes(Exception):
    """More nodes to leave out than the job may: its message is the one line that stops the job."""


def read_suspects(folder):
    """{node: why} from every file in a suspects folder, and the files read: the caller removes them once it
    has acted on them, so that a suspect is acted on once, and never lost to a failure in between."""
    suspects, read = {}, []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        path = os.path.join(folder, name)
        read.append(path)
        try:
            nodes = read_json(path)["nodes"]
            named = isinstance(nodes, dict) and all(map(is_node_name, nodes))
            if not (named and all(isinstance(why, str) for why in nodes.values())):
                raise ValueError(f"its nodes are {json.dumps(nodes)[:40]}, not a record of node: why")
            suspects.update({node: " ".join(why.split()) for node, why in nodes.items()})  # a line each
        except (OSError, UnsafeFile, ValueError, KeyError, TypeError) as error:
            print(f"warning: {path} is unreadable ({error}); ignored", file=sys.stderr)
    return suspects, read


def read_excluded(run_folder):
    """{node: why} of the excluded_nodes file, and whether its last line is whole. A damaged one (a torn
    line, bytes that are not text) is read as far as it goes: the nodes it still names stay out, and new
    ones can be added."""
    path = os.path.join(run_folder, EXCLUDED)
    try:
        data = read_regular(path)
    except FileNotFoundError:
        return {}, True
    except UnsafeFile as error:  # a file of another kind lists no node (and an append to a FIFO would wait)
        print(f"warning: {error}; {set_aside_damaged(path)}, and the nodes left out are listed anew",
              file=sys.stderr, flush=True)  # fmt: skip
        return {}, True
    rows = [line.split("\t") for line in data.decode("utf-8", errors="replace").splitlines()]
    return {row[0]: row[-1] for row in rows if len(row) == 3}, data.endswith(b"\n") or not data


def is_node_name(text):
    """Whether text can be a node's name, as excluded_nodes holds it at the start of a line: printable text
    with no space or tab."""
    return isinstance(text, str) and text.isprintable() and text != "" and len(text.split()) == 1


def exclude(run_folder, limit):
    """The job's step after a phase that blamed nodes: adds the suspects written since it last looked to
    excluded_nodes, a line "node<TAB>time<TAB>why" each. Returns {node: why} of the nodes newly excluded
    ({} when no new node is to blame); raises TooManyBadNodes, naming them all, when more than limit nodes
    would be left out."""
    suspects, read = read_suspects(suspects_folder(run_folder))
    excluded, whole_lines = read_excluded(run_folder)
    new = {node: why for node, why in sorted(suspects.items()) if node not in excluded}
    if new:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        with open(os.path.join(run_folder, EXCLUDED), "a", opener=no_links) as file:
            file.write("" if whole_lines else "\n")  # a torn last line stays alone
            file.writelines(f"{node}\t{when}\t{why}\n" for node, why in new.items())
    for suspect in read:
        os.remove(suspect)
    excluded.update(new)
    if new and len(excluded) > limit:
        named = "; ".join(f"{node} ({why})" for node, why in excluded.items())
        raise TooManyBadNodes(f"{len(excluded)} bad nodes, more than MAX_EXCLUDED_NODES={limit}: {named}")
    return new


def hang_blamed(folder, seconds):
    """Whether a watchdog named in the suspects folder, at least seconds ago, the node its rank waits for
    (hang_rank<R>): the other ranks had that long to end, and the launch still runs, so the node froze."""
    try:
        names = [name for name in os.listdir(folder) if name.startswith("hang_")]
    except OSError:
        return False
    for name in names:
        try:
            if time.time() - os.stat(os.path.join(folder, name)).st_mtime >= seconds:
                return True
        except OSError:
            continue  # removed meanwhile
    return False
