"""The dry run's simulated peak memory against the real one, eager and compiled, for every activation
checkpointing mode: train.py's model, wrapping and step run for real on this CPU (1 or 2 processes, gloo),
the peak of live CPU memory in its third step read from the profiler's memory events (every allocation and
free from before the model is built, tracked by address), beside the peak the dry run simulates on fake
tensors for the same options."""

import argparse
import itertools
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from run import options  # noqa: E402
from run.launch import device_mesh  # noqa: E402
from run.model.build import build_model, initialise, never_packed_sequences  # noqa: E402
from run.model.presets import build_model_config  # noqa: E402
from run.model.step import build_optimizer, train_step  # noqa: E402
from run.prediction.simulate import simulate_step  # noqa: E402
from run.stops import StopRequests  # noqa: E402

MODES = ("none", "op", "selective", "full")
GLOO_OPS = ("c10d::_allgather_base_", "c10d::_reduce_scatter_base_")
OPTIMIZER = ("Optimizer.step#AdamW.step",)
BOUNDARIES = GLOO_OPS + OPTIMIZER


def options_of(argv):
    args = options.parse(argv)
    shape = options.complete_and_check(args)
    never_packed_sequences()
    return args, build_model_config(shape, None, args.vocab_size)


def real_peak(rank, world_size, store, argv, results):
    """The peak of live CPU memory over the third step of train.py's own step on a real process group."""
    torch.set_num_threads(1 if world_size > 1 else torch.get_num_threads())
    args, config = options_of(argv)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, store=dist.FileStore(store, world_size))
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    profiler.start()
    mesh = device_mesh(args, "cpu", world_size, world_size)
    model = initialise(build_model(config, args, torch.device("cpu"), mesh), config, args)
    optimizer = build_optimizer(model, args, fused=False)
    tokens = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_length))
    accumulation = args.global_batch_size // (args.batch_size * world_size)
    for step in range(3):
        with torch.profiler.record_function(f"step {step}"):
            train_step(model, itertools.repeat((tokens, tokens)), optimizer, accumulation, args.grad_clip,
                       StopRequests())  # fmt: skip
    profiler.stop()
    dist.destroy_process_group()
    if rank == 0:
        with tempfile.NamedTemporaryFile(suffix=".json") as trace:
            profiler.export_chrome_trace(trace.name)
            events = json.load(open(trace.name))["traceEvents"]
        results.put(peak_of(events, "step 2"))


def peak_of(events, step_name):
    """The largest live CPU memory during the step named step_name: every allocation of the profiler's memory
    events, each freed by the free of its address or by a later allocation there. The buffers gloo's
    collectives take are freed on gloo's threads, where memory is not profiled: each is taken as freed by the
    next collective of its kind or the optimizer's step, by which FSDP has waited for it (the simulation's
    rule: run/prediction/simulate.py)."""
    step = next(event for event in events if event.get("name") == step_name)
    spans = [event for event in events if event.get("ph") == "X" and event["name"].startswith(BOUNDARIES)]
    collectives = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in spans if e["name"] in GLOO_OPS]
    boundaries = sorted((event["ts"], event["name"]) for event in spans)
    memory = sorted((event for event in events if event.get("name") == "[memory]"), key=lambda e: e["ts"])
    live, gloo, total, peak = {}, {}, 0, 0
    for event in memory:
        while boundaries and boundaries[0][0] <= event["ts"]:
            _, begun = boundaries.pop(0)
            for address in [address for address, kind in gloo.items() if begun in (kind, *OPTIMIZER)]:
                total -= live.pop(address, 0)
                del gloo[address]
        address, size = event["args"]["Addr"], event["args"]["Bytes"]
        total -= live.pop(address, 0)
        gloo.pop(address, None)
        if size > 0:
            live[address], total = size, total + size
            inside = next((name for start, end, name in collectives if start <= event["ts"] <= end), None)
            if inside:
                gloo[address] = inside
        if step["ts"] <= event["ts"] <= step["ts"] + step["dur"]:
            peak = max(peak, total)
    return peak


def simulated_peak(argv, world_size):
    args, config = options_of(argv)
    accumulation = min(2, args.global_batch_size // (args.batch_size * world_size))
    memory, _ = simulate_step(args, config, world_size, world_size, False, accumulation)
    return sum(memory.values())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2", help="a preset; gpt2 is cut to --n_layer")
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--processes", default="1,2")
    parser.add_argument("--compile", default="False,True")
    options = parser.parse_args()
    shape = [f"--n_layer={options.n_layer}"] if options.model.startswith("gpt2") else []
    print(
        f"{'processes':>9} {'compile':>7} {'checkpointing':>13} {'real GB':>8} {'simulated':>9} {'ratio':>6}"
    )
    for world_size, compiled, mode in itertools.product(
        [int(n) for n in options.processes.split(",")], options.compile.split(","), MODES
    ):
        argv = [f"--model={options.model}", *shape, "--batch_size=4", "--seq_length=256", "--dry_run",
                "--gpu=cpu", f"--world_size={world_size}", f"--global_batch_size={4 * world_size}",
                f"--compile={compiled}", f"--activation_checkpointing={mode}",
                "--mixed_precision=fp32"]  # fmt: skip
        results = mp.get_context("spawn").SimpleQueue()
        with tempfile.TemporaryDirectory() as folder:
            real_argv = [arg for arg in argv if not arg.startswith(("--dry_run", "--world_size", "--gpu"))]
            mp.start_processes(real_peak, (world_size, os.path.join(folder, "store"), real_argv, results),
                               world_size, start_method="spawn")  # fmt: skip
        real = results.get() / 1e9
        simulated = simulated_peak(argv, world_size) / 1e9
        ratio = simulated / real
        print(
            f"{world_size:>9} {compiled:>7} {mode:>13} {real:>8.3f} {simulated:>9.3f} {ratio:>6.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
