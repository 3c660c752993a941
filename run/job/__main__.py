"""python -m run.job: the job, as slurm_submit.sh hands over to it."""

import sys

from run.job.job import main

sys.exit(main(sys.argv[1:]))
