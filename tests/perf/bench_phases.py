"""Where the predicted step and the measured one part, by phase and sharding mode, in one process: train.py's
own step on a one-rank gloo group, its forward, backward, and clipping with the optimizer step each timed on
this CPU (the median of the steps after two of warm-up), beside the parts that the dry run predicts for the
same run on this machine (train.py --dry_run --gpu=cpu --world_size=1). With one rank the collectives cost
next to nothing: what one mode adds over another is the host's own work, FSDP's hooks among it.

    python tests/perf/bench_phases.py                      # tiny, full, grad_op and ddp: about a minute
    python tests/perf/bench_phases.py --model=gpt2-4x384 --steps=8

Run it on a quiet machine: every figure is a wall-clock time.
"""

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from host_runs import MODELS, PYTHON, REPO

sys.path.insert(0, str(REPO))
import train  # noqa: E402
from common.options import constants_of, parse_args  # noqa: E402
from run.launch import device_mesh  # noqa: E402

MODES = ("full", "grad_op", "ddp")
PHASES = ("forward", "backward", "optimizer")


def options(model, mode, folder):
    return [*MODELS[model], f"--sharding={mode}", "--compile=False", "--activation_checkpointing=none",
            "--mixed_precision=fp32", "--batch_size=8", "--global_batch_size=8", "--seq_length=128",
            f"--log_dir={folder}", f"--checkpoint_dir={folder}"]  # fmt: skip


def predicted(args):
    """The dry run's predicted parts on this CPU, in seconds: forward, backward, optimizer, step."""
    dry_run = [PYTHON, "train.py", "--dry_run", "--gpu=cpu", "--world_size=1", *args]
    output = subprocess.run(dry_run, cwd=REPO, capture_output=True, text=True, check=True).stdout
    line = re.search(r"^predicted step: ([\d.e-]+) s = .*\(forward ([\d.e-]+), backward ([\d.e-]+).*"
                     r"optimizer ([\d.e-]+)", output, re.M)  # fmt: skip
    step, forward, backward, optimizer = map(float, line.groups())
    return {"forward": forward, "backward": backward, "optimizer": optimizer, "step": step}


def measured(args, steps):
    """The same step's phases timed here, in seconds: the median of each over the steps after two."""
    cfg = parse_args(args, constants_of(train))
    config = train.build_model_config(train.complete_and_check(cfg))
    model = train.build_model(config, cfg, torch.device("cpu"), device_mesh(cfg, "cpu", 1, 1))
    train.init_weights(model, config.initializer_range, config.num_hidden_layers, cfg.seed)
    optimizer = train.build_optimizer(model, cfg, fused=False)
    tokens = torch.randint(0, config.vocab_size, (cfg.batch_size, cfg.seq_length + 1))
    times = {phase: [] for phase in PHASES}
    for step in range(steps + 2):
        started = time.perf_counter()
        loss = train.model_loss(model, tokens[:, :-1], tokens[:, 1:])
        forward_done = time.perf_counter()
        loss.backward()
        backward_done = time.perf_counter()
        grad_norm, stop = train.clip_gradients(model.parameters(), cfg.grad_clip), torch.zeros(())
        dist.all_reduce(stop)  # as train_step does, for a stop asked of any rank
        train.host_values(torch.stack([grad_norm, stop]))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= 2:
            times["forward"].append(forward_done - started)
            times["backward"].append(backward_done - forward_done)
            times["optimizer"].append(time.perf_counter() - backward_done)
    parts = {phase: statistics.median(seconds) for phase, seconds in times.items()}
    return parts | {"step": sum(parts.values())}


def cell(real, guess):
    return f"{real * 1e3:7.1f} / {guess * 1e3:6.1f} ({guess / real - 1:+4.0%})"


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny", choices=MODELS)
    parser.add_argument("--steps", type=int, default=10)
    cli = parser.parse_args()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    print(f"{cli.model}, batch 8 x 128, fp32, no checkpointing, one process of {torch.get_num_threads()} "
          "threads; milliseconds, measured / predicted")  # fmt: skip
    print(f"{'sharding':10}" + "".join(f"{name:>22}" for name in (*PHASES, "step")))
    with tempfile.TemporaryDirectory() as folder:
        for mode in MODES:
            args = options(cli.model, mode, folder)
            guess, real = predicted(args), measured(args, cli.steps)
            cells = [cell(real[name], guess[name]) for name in (*PHASES, "step")]
            print(f"{mode:10}" + "".join(f"{text:>22}" for text in cells), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
