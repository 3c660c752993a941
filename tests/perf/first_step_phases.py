"""Where a run's time to its first step goes: train.py run as given, each phase of its start stamped on
stderr (`phase <seconds since this script started> <what>`), with dynamo's compile seconds and graphs so far
and the CUDA allocator's cudaMalloc calls, ending the run after its second training step. With --predict
(the default) the probe's phases show, and whether training's first step compiles again after it. Each
run in a cold compile cache of its own, as a user's first run is:

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python tests/perf/first_step_phases.py --model=gpt2-xl \
        --seq_length=1024 --batch_size=16 --global_batch_size=16 --data=dummy --run_name=new [--predict=False]

A new --run_name each time: a relaunch of a run uses the prediction its first launch kept.
"""

import os
import runpy
import sys
import time

STARTED = time.perf_counter()
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch._dynamo.utils  # noqa: E402

from run.model import build, step  # noqa: E402


def stamp(what):
    compiled = sum(sum(times) for name, times in torch._dynamo.utils.compilation_time_metrics.items()
                   if name.endswith("compile_inner"))  # fmt: skip
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    mallocs = torch.cuda.memory_stats().get("segment.all.allocated", 0) if torch.cuda.is_available() else 0
    print(f"phase {time.perf_counter() - STARTED:7.2f} {what} (compiled {compiled:.2f} s, {graphs} graphs, "
          f"{mallocs} cudaMalloc)", file=sys.stderr, flush=True)  # fmt: skip


def stamped(function, name, after=None):
    def wrapper(*args, **kwargs):
        stamp(f"{name} starts")
        result = function(*args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        stamp(f"{name} ends")
        if after:
            after()
        return result

    return wrapper


class Steps:
    """Training's steps, not the probe's, counted: the run ends after its second."""

    probing, training = False, 0

    @classmethod
    def count(cls):
        if not cls.probing:
            cls.training += 1
            if cls.training == 2:
                os._exit(0)  # the run's last checkpoint and export would take minutes

    @classmethod
    def probe(cls, measure):
        def measured(*args, **kwargs):
            cls.probing = True
            try:
                return stamped(measure, "probe")(*args, **kwargs)
            finally:
                cls.probing = False

        return measured


def main():
    build.build_model = stamped(build.build_model, "build_model")
    build.initialise = stamped(build.initialise, "initialise")
    step.build_optimizer = stamped(step.build_optimizer, "build_optimizer")
    step.train_step = stamped(step.train_step, "train_step", Steps.count)
    from run.prediction import probe  # after the patches, so that it imports the stamped ones

    probe.measure = Steps.probe(probe.measure)
    stamp("imports done")
    sys.argv = ["train.py", *sys.argv[1:]]
    runpy.run_path(os.path.join(REPO, "train.py"), run_name="__main__")


if __name__ == "__main__":
    main()
