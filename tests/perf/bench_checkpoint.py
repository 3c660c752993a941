"""Checkpoint speed: save and load throughput of train.py's checkpoints next to the disk's own
sequential write bandwidth, measured in the same run on the same folder.

    python tests/perf/bench_checkpoint.py [--model=gpt2] [--dir=checkpoints/bench]

Prints GB/s (GB = 1e9 bytes) for: a plain fsync'd sequential write of the same number of bytes,
a synchronous sharded save, the time an async save blocks training, and a load; and how much of the
save is its checksums, and how long checking them before a load takes.
"""

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from run import options  # noqa: E402
from run.checkpoint import checkpointer as checkpoints  # noqa: E402
from run.data.batches import open_batches  # noqa: E402
from run.model.build import build_model  # noqa: E402
from run.model.presets import build_model_config  # noqa: E402
from run.model.step import build_optimizer  # noqa: E402


def disk_write_gbps(folder, n_bytes, chunk=64 << 20):
    """Sequential write of n_bytes with one fsync at the end, as a checkpoint writer does."""
    chunk = min(chunk, n_bytes)  # a small model's checkpoint is less than one chunk, and wrote nothing
    path = os.path.join(folder, "disk_probe.bin")
    buffer = os.urandom(chunk)
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(n_bytes // chunk):
            f.write(buffer)
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    os.remove(path)
    return n_bytes // chunk * chunk / seconds / 1e9


def timed(function, *args):
    start = time.perf_counter()
    function(*args)
    return time.perf_counter() - start


def save_without_checksums(model, optimizer, folder):
    import torch.distributed.checkpoint as dcp

    state = checkpoints.model_and_optimizer_state(model, optimizer, full=False)
    dcp.save(dict(zip(("model", "optimizer"), state)), checkpoint_id=folder)


def stepped_model(args):
    """The model built for training on a process group of one, stepped once so that its AdamW moments exist
    and are saved: (cfg, shape, model, optimizer, scheduler, batches, bytes of weights and moments)."""
    from torch.distributed.device_mesh import init_device_mesh

    cfg = options.parse([f"--model={args.model}", "--compile=False", "--activation_checkpointing=none",
                         f"--checkpoint_dir={args.dir}", "--run_name=bench", "--keep_last=0"])  # fmt: skip
    shape = options.complete_and_check(cfg)
    device = torch.device("cpu")
    model = build_model(build_model_config(shape), cfg, device, init_device_mesh("cpu", (1,)))
    optimizer = build_optimizer(model, cfg, fused=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    optimizer.step()
    n_bytes = sum(t.numel() * t.element_size() for t in model.parameters()) * 3  # weights + 2 moments
    batches = open_batches(cfg, shape, None, 1, 0, 1, device)[0]
    return cfg, shape, model, optimizer, scheduler, batches, n_bytes


def best_seconds(args, cfg, shape, model, optimizer, scheduler, batches):
    """The best of --repeat of each, interleaved (other work on the machine shifts all alike): the sharded
    save with checksums, DCP's save alone, the checksums, their check, the load; then one asynchronous save's
    time that training is blocked."""
    n_params = sum(param.numel() for param in model.parameters())
    checkpointer = checkpoints.Checkpointer(cfg, shape, 0, 1, n_params)
    step_1 = os.path.join(args.dir, "bench", "step_1")
    plain = os.path.join(args.dir, "plain")
    state = (model, optimizer, scheduler, batches)
    times = {"sync": [], "bare": [], "hash": [], "verify": [], "load": []}
    for _ in range(args.repeat):
        shutil.rmtree(step_1, ignore_errors=True)
        times["bare"].append(timed(save_without_checksums, model, optimizer, plain))
        shutil.rmtree(plain)
        times["sync"].append(timed(checkpointer.save, {"step": 1, "tokens_seen": 0}, *state))
        times["hash"].append(timed(checkpointer.checksums, step_1))  # the part of save() that hashes
        times["verify"].append(timed(checkpointer.problem, step_1, model))
        times["load"].append(timed(checkpointer.load, step_1, *state))
    best = {name: min(seconds) for name, seconds in times.items()}
    cfg.async_checkpoint = True
    async_checkpointer = checkpoints.Checkpointer(cfg, shape, 0, 1, n_params)
    best["blocked"] = timed(async_checkpointer.save, {"step": 2, "tokens_seen": 0}, *state)
    async_checkpointer.finish()
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--dir", default="checkpoints/bench")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg, shape, model, optimizer, scheduler, batches, n_bytes = stepped_model(args)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    disk = disk_write_gbps(args.dir, n_bytes)
    best = best_seconds(args, cfg, shape, model, optimizer, scheduler, batches)
    shutil.rmtree(args.dir, ignore_errors=True)

    def line(name, seconds, note=""):
        print(f"{name:<38} {n_bytes / seconds / 1e9:6.2f} GB/s  {seconds:6.2f} s  {note}")

    print(
        f"model {args.model}: {n_bytes / 1e9:.2f} GB of weights and AdamW moments (fp32); "
        f"best of {args.repeat}"
    )
    print(f"{'disk sequential write (fsync)':<38} {disk:6.2f} GB/s")
    line("sharded save with checksums", best["sync"], f"{n_bytes / best['sync'] / 1e9 / disk:5.0%} of disk")
    line("DCP save alone, no checksums", best["bare"], f"{n_bytes / best['bare'] / 1e9 / disk:5.0%} of disk")
    line("  of which the checksums", best["hash"], f"{best['hash'] / best['sync']:5.0%} of the save")
    print(
        f"{'async save: training blocked for':<38} {best['blocked']:6.2f} s  "
        f"{best['blocked'] / best['sync']:5.0%} of the sync save"
    )
    line("load", best["load"])
    line("checksums checked before the load", best["verify"], f"{best['verify'] / best['load']:5.0%} of load")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
