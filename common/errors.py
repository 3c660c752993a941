"""One error style for train.py, sample.py and benchmark.py: bad input is one line, `error: ...`, on stderr
and exit status 2, said once (by rank 0, or by each node's local rank 0 for what differs by node)."""

import os
import re
import signal
import sys
import time


class ConfigError(ValueError):
    """Bad user input: reported as one line and exit status 2, before anything expensive. Every rank finds
    the same error, so one says it: global rank 0, or for what differs by node local rank 0 of each node."""

    def __init__(self, message, per_node=False):
        super().__init__(message)
        self.per_node = per_node


def report_config_error(error):
    speaker = os.environ.get("LOCAL_RANK" if error.per_node else "RANK", "0") == "0"
    fail(error) if speaker else exit_after_the_speaker()


def fail(message):
    lines = without_credentials(str(message)).splitlines()
    print("\n".join(f"error: {line}" for line in lines), file=sys.stderr, flush=True)
    sys.exit(2)


def without_credentials(text):
    """text with the user:password@ of every URL in it left out: a mirror's (HF_ENDPOINT=https://user:token@
    host) reaches the job's log inside the hub libraries' own messages."""
    return re.sub(r"(\b[A-Za-z][A-Za-z0-9+.-]*://)[^/\s@]+@", r"\1", text)


SPEAKER_WAIT_S = 30


def exit_after_the_speaker():
    """Exit status 2, without a word, for a rank that leaves an error every rank met to one rank to say.
    torchrun ends every rank once one exits, so a silent rank that left first could end the speaker before
    its line was out (seen under torchrun: a checkpoint of another shape refused with no line at all). So it
    waits, dies quietly when torchrun ends it, and exits by itself after SPEAKER_WAIT_S."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    time.sleep(SPEAKER_WAIT_S)
    sys.exit(2)
