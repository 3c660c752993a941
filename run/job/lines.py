"""How the job speaks: a timed line on stdout for each thing it does, and the one line that ends it (JobError,
Stopped). Standard library only."""

import signal
import time


class JobError(Exception):
    """Stops the job with one line; status is its exit status."""

    def __init__(self, message, status=1):
        super().__init__(message)
        self.status = status


class Stopped(JobError):
    """Ends the job after a stop asked for, with one line that is no error."""


def stopped(number, what):
    """The job's end after the stop signal number: exit status 128 + number, as a process it ended."""
    return Stopped(f"stopped by {signal.Signals(number).name}: {what}", 128 + number)


def log(message):
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


def nodes(count):
    return f"{count} node{'s' * (count != 1)}"
