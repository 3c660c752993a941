"""Why a run stops before its last step. Too many non-finite steps in a row end it with an error that names
the last checkpoint from before the damage, which is the one to resume from with the options changed."""

import math
import os

from run.checkpoints import checkpoint_steps
from run.options import exit_after_the_speaker, fail


class NonFiniteSteps:
    """Counts the steps in a row whose loss or gradient norm is not finite (train_step skips their update),
    and stops the run at max_bad_steps of them."""

    def __init__(self, max_bad_steps, run_dir, master):
        self.max_bad_steps, self.run_dir, self.master = max_bad_steps, run_dir, master
        self.in_a_row = 0

    def step_done(self, step, grad_norm):
        self.in_a_row = 0 if math.isfinite(grad_norm) else self.in_a_row + 1
        if not self.in_a_row:
            return
        if self.master:
            print(
                f"step {step}: non-finite loss or gradient norm, update skipped ({self.in_a_row} in a row, "
                f"limit {self.max_bad_steps})",
                flush=True,
            )
        if self.in_a_row >= self.max_bad_steps:
            self.stop(first_bad=step - self.in_a_row + 1)

    def stop(self, first_bad):
        if not self.master:
            exit_after_the_speaker()
        good = last_good_checkpoint(self.run_dir, first_bad)
        if good:
            then = f"last good checkpoint: {good}; resume with --resume_from={good} and the new options"
        else:
            then = (
                f"no checkpoint of this run is from before step {first_bad - 1}'s update: start again with "
                "the new options and another --run_name"
            )
        fail(
            f"stopping: {self.in_a_row} non-finite steps in a row from step {first_bad} (lower --lr or raise "
            f"--warmup_steps); {then}"
        )


def last_good_checkpoint(run_dir, first_bad):
    """The newest step_K of run_dir from before the update that made step first_bad non-finite. A checkpoint
    holds the weights after its step's update, and the update of the step before the first non-finite one
    is what broke them (the one before it still gave a finite gradient): so K <= first_bad - 2."""
    good = [step for step in checkpoint_steps(run_dir) if step <= first_bad - 2]
    return os.path.join(run_dir, f"step_{max(good)}") if good else None
