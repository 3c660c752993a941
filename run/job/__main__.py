"""python -m run.job: the job, as slurm_submit.sh hands over to it, with the signals that reach it."""

import os
import signal
import sys

from run.job import slurm
from run.job.job import ENDING, Job
from run.job.knobs import read_knobs
from run.job.lines import JobError, Stopped, log


def main(argv):
    sys.stdout.reconfigure(line_buffering=True)  # the job's lines among its workers', in order
    try:
        knobs = read_knobs(os.environ)
        scheduler = slurm.scheduler(os.environ, knobs.CONTAINER_IMAGE)
        # in a container, the job itself runs on the host's python3, its workers on the container's python
        python = "python" if knobs.CONTAINER_IMAGE and scheduler.in_job else sys.executable
        job = Job(knobs, scheduler, argv, python, dict(os.environ))
        signal.signal(signal.SIGUSR1, job.on_signal)  # SLURM sends it to the job alone
        for number in ENDING:
            if signal.getsignal(number) != signal.SIG_IGN:  # nohup's SIGHUP stays ignored
                signal.signal(number, job.on_signal)
        if os.environ.get("JOB_SIGUSR1"):  # it came before this process started (slurm_submit.sh)
            job.signals.append(signal.SIGUSR1)
        return job.run()
    except Stopped as stop:
        log(str(stop))
        return stop.status
    except JobError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.status


sys.exit(main(sys.argv[1:]))
