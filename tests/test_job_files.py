"""What the job reads that others write, damaged or odd: its excluded_nodes file (bytes that are not text, a
torn line, a FIFO, a link, a full disk), the suspects' files, and the ranks' heartbeats, each read as far as
it goes or said once and left out, never hanging or stopping the job."""

import json
import os

import pytest
from conftest import ODD, fill_disk, make_odd
from fake_scheduler import FakeSlurm, beat, blame, launched, run_job

from common import suspects

# The job writes its benchmark reports under logs/, relative to where it runs.
pytestmark = pytest.mark.usefixtures("reports_in_tmp")


def test_a_damaged_excluded_nodes_file_is_read_as_far_as_it_goes(tmp_path):
    """Bytes that are not text and a torn last line: the nodes still named stay out, the new one is added on
    a line of its own, and the suspects are removed only once it is written."""
    path = tmp_path / "excluded_nodes"
    path.write_bytes(b"n1\t2026-01-01T00:00:00Z\tslow \xff\xfe disk\nn2\t2026-01-0")
    blame(tmp_path, "benchmark", ["n3"])
    assert list(suspects.exclude(str(tmp_path), 5)) == ["n3"]
    assert list(suspects.read_excluded(tmp_path)[0]) == ["n1", "n3"]
    assert path.read_text(errors="replace").splitlines()[2].startswith("n3\t")
    assert not list((tmp_path / "suspects").iterdir())


def test_the_suspects_stay_when_the_exclusion_cannot_be_written(small_disks):
    full = small_disks(1)
    blame(full, "benchmark", ["n3"])
    fill_disk(full)
    with pytest.raises(OSError):
        suspects.exclude(str(full), 5)
    assert [path.name for path in (full / "suspects").iterdir()] == ["benchmark.json"]


@pytest.mark.parametrize("kind", ODD)
def test_an_excluded_nodes_file_that_is_not_a_regular_file_is_set_aside_and_listed_anew(
    tmp_path, capsys, kind, deadline
):
    """A FIFO hung the job as it read the nodes left out (and an append to it waits for a reader); a link to
    /dev/zero read until memory ran out."""
    path = tmp_path / suspects.EXCLUDED
    words = make_odd(path, kind)
    blame(tmp_path, "benchmark", ["n3"])
    assert suspects.exclude(str(tmp_path), 5) == {"n3": "benchmark blamed it"}
    [aside] = tmp_path.glob("excluded_nodes.damaged_*")
    assert capsys.readouterr().err.splitlines() == [
        f"warning: {path} {words}; set aside as {aside}, and the nodes left out are listed anew"
    ]
    assert list(suspects.read_excluded(tmp_path)[0]) == ["n3"] and path.read_text().startswith("n3\t")


def test_a_suspect_that_names_no_node_is_ignored_and_a_why_on_many_lines_is_kept_on_one(
    tmp_path, capsys, deadline
):
    """A why on several lines, or a node named with a tab, would have added lines of its own to
    excluded_nodes: nodes nobody blamed."""
    folder = suspects.suspects_folder(tmp_path)
    suspects.write_suspects(folder, "benchmark", {"n3": "slow\nn9\t2020\tforged"})
    suspects.write_suspects(folder, "heartbeat", {"n4\t2020\tforged\nn5": "silent"})
    make_odd(os.path.join(folder, "hang_rank0.json"), "FIFO")
    assert suspects.exclude(str(tmp_path), 5) == {"n3": "slow n9 2020 forged"}
    assert list(suspects.read_excluded(tmp_path)[0]) == ["n3"]
    err = capsys.readouterr().err
    assert "hang_rank0.json is unreadable (" in err and "is a FIFO, not a regular file); ignored" in err
    assert 'heartbeat.json is unreadable (its nodes are {"n4\\t2020\\tforged\\nn5"' in err, err


def rewritten(path, change):
    beat = json.loads(path.read_text())
    change(beat)
    path.write_text(json.dumps(beat))


def replaced(path, make):
    path.unlink()
    make(str(path))


# A heartbeat the job cannot use, made of a good one, and how its warning names it
DAMAGED_BEATS = {
    "without its time": (lambda path: rewritten(path, lambda beat: beat.pop("time")), "its time is null"),
    "with a text time": (
        lambda path: rewritten(path, lambda beat: beat.update(time="soon")),
        'its time is "soon"',
    ),
    "a link to /dev/zero": (
        lambda path: replaced(path, lambda name: os.symlink("/dev/zero", name)),
        "is a symbolic link, not a regular file",
    ),
    "a FIFO": (lambda path: replaced(path, os.mkfifo), "is a FIFO, not a regular file"),
}


@pytest.mark.parametrize("kind", DAMAGED_BEATS)
def test_a_damaged_heartbeat_is_one_warning_and_left_out_while_training_goes_on(
    tmp_path, capsys, kind, deadline
):
    """n3's rank left a heartbeat the job cannot use: it is said once and left out, and the launch trains on
    to its end. A beat without its time, or with a text one, killed the job with a traceback (KeyError,
    TypeError), a link to /dev/zero with a MemoryError, and a FIFO hung it: each left torchrun and its
    workers running."""
    damage, words = DAMAGED_BEATS[kind]
    damaged = tmp_path / "heartbeats" / "rank2.json"

    def phases(script, nodes, process):
        for rank, node in enumerate(nodes[:2]):
            beat(tmp_path, process, rank, node, steps=process.polls)
        if process.polls == 1:
            beat(tmp_path, process, 2, "n3", steps=1)
            damage(damaged)
        return 0 if process.polls == 4 else None

    scheduler = FakeSlurm(tmp_path, phases)
    assert run_job(scheduler, SKIP_BENCHMARK=1) == [0]
    assert launched(scheduler) == [(0, "train.py", "n1 n2 n3")] and scheduler.ended == []
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: heartbeat {damaged} is damaged ("), (
        warnings
    )
    assert words in warnings[0] and warnings[0].endswith("; left out until its rank writes it again")
