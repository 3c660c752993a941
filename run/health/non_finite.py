"""Non-finite steps: too many in a row end the run with an error that names the last checkpoint from before
the damage, the one to resume from with new options; the checkpoints the streak rules out are set aside
(run/checkpoint/set_aside.py), and none is written during it."""

import math
import os

from common.errors import exit_after_the_speaker, fail
from run.checkpoint.checkpointer import checkpoint_steps
from run.checkpoint.set_aside import set_aside_unusable


class NonFiniteSteps:
    """Counts the steps in a row whose loss or gradient norm is not finite (train_step skips their update),
    from the gradient norm the step already brought to the host, and stops the run at max_bad_steps of
    them, or at the run's end (its last step, a stop asked for) during such a streak. No checkpoint is
    written during one, nor older ones pruned (sound): the weights are those the blow-up came from."""

    def __init__(self, max_bad_steps, run_dir, master):
        self.max_bad_steps, self.run_dir, self.master = max_bad_steps, run_dir, master
        self.in_a_row = 0

    def step_done(self, step, grad_norm, ending):
        """ending: the run ends after this step, with its checkpoint and, at its last step, its export."""
        self.in_a_row = 0 if math.isfinite(grad_norm) else self.in_a_row + 1
        if not self.in_a_row:
            return
        if self.master:
            print(
                f"step {step}: non-finite loss or gradient norm, update skipped ({self.in_a_row} in a row, "
                f"limit {self.max_bad_steps})",
                flush=True,
            )
        if self.in_a_row >= self.max_bad_steps or ending:
            self.stop(first_bad=step - self.in_a_row + 1, cut_short=self.in_a_row < self.max_bad_steps)

    @property
    def sound(self):
        return not self.in_a_row

    def stop(self, first_bad, cut_short):
        if not self.master:
            exit_after_the_speaker()
        aside = set_aside_ruled_out(self.run_dir, first_bad)
        good = last_good_checkpoint(self.run_dir, first_bad)
        if good:
            then = f"last good checkpoint: {good}; resume with --resume_from={good} and the new options"
        else:
            then = (
                f"no checkpoint of this run is from before step {first_bad - 1}'s update: start again with "
                "the new options"
            )
        when = ", at the run's end" if cut_short else ""
        fail(
            f"stopping: {self.in_a_row} non-finite steps in a row from step {first_bad}{when} (lower --lr or "
            f"raise --warmup_steps); {aside}{then}"
        )


def set_aside_ruled_out(run_dir, first_bad):
    """The checkpoints of run_dir a non-finite stop rules out, set aside as unusable (run/checkpoint/
    set_aside.py), so that no relaunch resumes from them and no later stop names them: the one holding the
    update that broke the weights (first_bad - 1), saved before anyone could know, and any later. Returns
    what it says of them, ending '; ', or ''."""
    names = [f"step_{step}" for step in checkpoint_steps(run_dir) if step >= first_bad - 1]
    if not names:
        return ""
    moved = set_aside_unusable(run_dir, [os.path.join(run_dir, name) for name in names], "nonfinite")
    if isinstance(moved, str):
        return f"{moved}; "
    folder = os.path.dirname(next(iter(moved.values())))
    if len(names) == 1:
        return f"{names[0]}, which holds the update that broke the weights, is set aside in {folder}; "
    return f"{', '.join(names)}, from the update that broke the weights on, are set aside in {folder}; "


def last_good_checkpoint(run_dir, first_bad):
    """The newest step_K of run_dir from before the update that made step first_bad non-finite. A checkpoint
    holds the weights after its step's update, and the update of the step before the first non-finite one
    is what broke them (the one before it still gave a finite gradient): so K <= first_bad - 2."""
    good = [step for step in checkpoint_steps(run_dir) if step <= first_bad - 2]
    return os.path.join(run_dir, f"step_{max(good)}") if good else None
