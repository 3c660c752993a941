"""What a run sets aside rather than deletes: the later checkpoints of a rewind (<run>/rewound_<time>/), the
unusable ones a resume falls back past (<run>/unusable_<time>/) and those a non-finite stop rules out
(<run>/nonfinite_<time>/, run/health/non_finite.py), each moved into a folder of the run and recorded in its
rewinds.json. A later save of the same step would have replaced an unusable checkpoint, the evidence of what
went wrong; the record lets a relaunch of the same --resume_from continue the run's line instead of failing on
a folder that has gone."""

import json
import os
import sys
import time

from common.files import UnsafeFile, read_json, set_aside_damaged, write_atomically

REWINDS = "rewinds.json"  # the run folder's record: a --resume_from it names may be gone, set aside


def recorded(run_dir):
    """The run's record of what it set aside, oldest first, each entry with the list of steps it names: []
    when there is none. A damaged one (not a regular file of a record's size, not a list) is one warning and
    is set aside itself (rank 0 alone reads it)."""
    path = os.path.join(run_dir, REWINDS)
    try:
        entries = read_json(path)
        if not isinstance(entries, list):
            raise ValueError(f"it holds {json.dumps(entries)[:40]}, not a list of records")
    except FileNotFoundError:
        return []
    except (OSError, UnsafeFile, ValueError) as error:
        aside = set_aside_damaged(path)
        print(f"warning: {path} is damaged ({error}); {aside}, and the run's record of what it set aside "
              "starts anew", file=sys.stderr, flush=True)  # fmt: skip
        return []
    return [entry for entry in entries if isinstance(entry, dict) and isinstance(entry.get("steps"), list)]


def set_aside(run_dir, names, why, **entry):
    """Moves the step folders names of run_dir into <run_dir>/<why>_<time>/ and records it (with entry);
    returns that folder."""
    aside = os.path.join(run_dir, f"{why}_{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    os.makedirs(aside, exist_ok=True)
    for name in names:
        os.rename(os.path.join(run_dir, name), os.path.join(aside, name))
    entry.update(time=time.time(), set_aside=os.path.basename(aside), steps=names)
    write_atomically(os.path.join(run_dir, REWINDS), json.dumps([*recorded(run_dir), entry], indent=1))
    return aside


def set_aside_unusable(run_dir, paths, why="unusable"):
    """Rank 0's: the unusable checkpoints paths (step_N folders of run_dir) moved aside into a folder named
    for why; {path: where it went}, or the line that says why they could not be."""
    names = [os.path.basename(path) for path in paths]
    try:
        aside = set_aside(run_dir, names, why, unusable=True)
    except OSError as error:
        return (
            f"cannot set the unusable checkpoints {', '.join(names)} of {run_dir} aside ({error.strerror}), "
            f"and a later save of their step would replace them; move them out of the run's folder, then "
            f"relaunch"
        )
    return {path: os.path.join(aside, name) for path, name in zip(paths, names)}


def set_aside_as_unusable(run_dir, name):
    """Whether an earlier launch set the checkpoint name of run_dir aside as unusable."""
    return any(entry.get("unusable") and name in entry.get("steps", ()) for entry in recorded(run_dir))
