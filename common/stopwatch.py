"""Points in time on a device, for the benchmark's loops and the probe of a training step: CUDA events on the
device's current stream (the device's time, recorded without waiting for it), else the host's clock."""

import itertools
import time


class Stopwatch:
    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.marks = []

    def mark(self):
        if self.cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list:
        """Seconds between consecutive marks, once the device has reached the last one."""
        if self.cuda:
            self.marks[-1].synchronize()
            return [start.elapsed_time(end) / 1e3 for start, end in itertools.pairwise(self.marks)]
        return [end - start for start, end in itertools.pairwise(self.marks)]
