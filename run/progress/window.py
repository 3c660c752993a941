"""The end of a log window, in one place: what every owner of the run's watch does with it, in order."""


class LogWindows:
    """A window ends every log_every steps, at the run's last step and after an evaluation. Then the
    checkpoint schedule takes the window's step time (auto's interval follows it); every rank gathers its
    stragglers' times; on rank 0 the window's step is held against the live prediction (None on the other
    ranks, or without one), and the goodput ledger keeps the gap; the window's record is logged and the
    ledger written."""

    def __init__(self, args, total_steps, progress, stragglers, live, ledger, schedule):
        self.log_every, self.total_steps = args.log_every, total_steps
        self.progress, self.stragglers, self.live = progress, stragglers, live
        self.ledger, self.schedule = ledger, schedule

    def ends(self, step, val_loss):
        """Whether step ends a log window; val_loss: the evaluation after it, or None."""
        return step % self.log_every == 0 or step == self.total_steps or val_loss is not None

    def close(self, val_loss):
        """Every rank takes part."""
        step_s = self.progress.mean_step_s
        self.schedule.choose(step_s)
        fields = self.stragglers.log_window(self.progress.timed_steps)
        if self.live:
            fields |= self.ledger.against_prediction(
                self.live.log_window(step_s, self.progress.timed_steps, self.stragglers.per_step)
            )
        self.progress.log(val_loss, fields)
        self.ledger.write()
