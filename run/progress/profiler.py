"""--profile_steps=A,B: torch.profiler over steps A to B of rank 0, as a Chrome trace in the run's log folder,
and on GPU a CUDA memory snapshot beside it."""

import contextlib
import os
import re
import socket

import torch

from common.errors import ConfigError


class StepProfiler:
    """--profile_steps=A,B: torch.profiler over steps A to B (as logged) of rank 0, written as a Chrome trace
    that Perfetto and TensorBoard's profiler open; on GPU a CUDA memory snapshot beside it."""

    def __init__(self, steps, folder, device, master, last_step):
        """A range past last_step ends with the run, and is written then."""
        self.steps = profiled_steps(steps) if master else None
        if self.steps:
            self.steps = (self.steps[0], min(self.steps[1], last_step))
        self.folder, self.cuda = folder, device.type == "cuda"
        self.profiler = None

    @contextlib.contextmanager
    def step(self, number):
        if self.steps is None or not self.steps[0] <= number <= self.steps[1]:
            yield
            return
        if number == self.steps[0]:
            kinds = torch.profiler.ProfilerActivity
            activities = [kinds.CPU, kinds.CUDA] if self.cuda else [kinds.CPU]
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True, with_stack=True)
            self.profiler.start()
            if self.cuda:
                torch.cuda.memory._record_memory_history(max_entries=100_000)
        with torch.profiler.record_function(f"train step {number}"):
            yield
        if number == self.steps[1]:
            self.profiler.stop()
            first, last = self.steps
            # .pt.trace.json: the name TensorBoard's profiler plugin looks for
            name = f"trace_steps_{first}-{last}_{socket.gethostname()}_rank0.pt.trace.json"
            trace = os.path.join(self.folder, name)
            self.profiler.export_chrome_trace(trace)
            print(f"profile: steps {first} to {last} traced in {trace}", flush=True)
            if self.cuda:
                snapshot = os.path.join(self.folder, f"memory_steps_{first}-{last}_rank0.pickle")
                torch.cuda.memory._dump_snapshot(snapshot)
                torch.cuda.memory._record_memory_history(enabled=None)
                print(f"profile: CUDA memory snapshot in {snapshot}", flush=True)


def profiled_steps(text):
    """--profile_steps=A,B as (A, B); None when not set."""
    if text is None:
        return None
    first, _, last = text.partition(",")
    digits = re.compile(r"\s*[0-9]+\s*")  # ASCII: int() also reads other scripts' digits
    if not (digits.fullmatch(first) and digits.fullmatch(last) and 1 <= int(first) <= int(last)):
        raise ConfigError(
            f"--profile_steps={text}: expected two step numbers A,B with 1 <= A <= B, "
            f"e.g. --profile_steps=5,8"
        )
    return int(first), int(last)
