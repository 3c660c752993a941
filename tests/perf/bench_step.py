"""What train.py's step costs beside a plain loop over the same transformers model, side by side in one
process, alternating, so that the machine's noise falls on both alike.

    python tests/perf/bench_step.py                          # CPU: the 6x384 shape, 256 tokens, batch 8
    python tests/perf/bench_step.py --model=gpt2 --batch_size=4
    python tests/perf/bench_step.py --profile --no_flops --rounds=1   # where each step's time goes
    python tests/perf/bench_step.py --model=gpt2-xl --seq_length=1024 --compile --bf16   # one GPU

The two paths:
- train.py's step: train_step over build_model's FSDP model on a process group of one, the chunked loss,
  gradient clipping, the stop flag and AdamW, as training runs it;
- the plain loop: the same transformers model, full logits, F.cross_entropy, torch.optim.AdamW, no FSDP.

Prints the median step of each over --rounds rounds of --steps steps (the first --warmup of each round left
out), their ratio, and each path's FLOPs as FlopCounterMode counts one step with eager attention, over the
model FLOPs of train.py's formula (6·N + 12·L·H·Q·T per token). --json writes the same figures to a file.
"""

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from run import options  # noqa: E402
from run.model.build import build_model, initialise, never_packed_sequences  # noqa: E402
from run.model.presets import (  # noqa: E402
    build_meta_model,
    build_model_config,
    decoder_layers,
    flops_per_token,
    resolve_shape,
)
from run.model.step import build_optimizer, train_step  # noqa: E402
from run.stops import StopRequests  # noqa: E402

# The shape a user compares against nanoGPT's train.py: 6 layers, 384 wide, 6 heads, GPT-2's vocabulary.
ISSUE_SHAPE = ["--model=gpt2", "--n_layer=6", "--n_embd=384", "--n_head=6", "--seq_length=256"]


def parse():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="a train.py preset (default: the 6x384 shape)")
    parser.add_argument("--seq_length", type=int, default=None)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="steps per path per round")
    parser.add_argument("--warmup", type=int, default=2, help="steps of each round left out")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="compile each block (both paths)")
    parser.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 weights (both paths)")
    parser.add_argument("--no_flops", action="store_true", help="skip the FLOP count")
    parser.add_argument("--profile", action="store_true", help="also print each step's 15 costliest ops")
    parser.add_argument("--json", help="also write the figures to this file")
    return parser.parse_args()


def train_options(bench):
    argv = ISSUE_SHAPE if bench.model is None else [f"--model={bench.model}"]
    if bench.seq_length:
        argv = [a for a in argv if not a.startswith("--seq_length")] + [f"--seq_length={bench.seq_length}"]
    argv += [
        f"--batch_size={bench.batch_size}",
        f"--global_batch_size={bench.batch_size}",
        "--activation_checkpointing=none",
        f"--mixed_precision={'bf16' if bench.bf16 else 'fp32'}",
        f"--compile={bench.compile}",
        "--data=dummy",
    ]
    args = options.parse(argv)
    options.complete_and_check(args)  # fills in what train.py's would
    return args


def start_process_group():
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    return device, torch.distributed.device_mesh.init_device_mesh(device.type, (1,))


def model_config_of(args, attention):
    shape = resolve_shape(args)
    model_config = build_model_config(shape)
    model_config._attn_implementation = attention
    return model_config


def train_path(args, model_config, device, mesh):
    """train.py's step over its own model: returns one step as a function."""
    never_packed_sequences()
    model = build_model(model_config, args, device, mesh)
    model = initialise(model, model_config, args)
    optimizer = build_optimizer(model, args, fused=device.type == "cuda")
    stop_requests = StopRequests()

    def step(batch):
        return train_step(model, iter([batch]), optimizer, 1, args.grad_clip, stop_requests)[0]

    return step


def plain_path(args, model_config, device):
    """The plain loop: the transformers model as it comes, full logits, F.cross_entropy, AdamW."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32).to(device)
    if args.compile:
        for block in decoder_layers(model):
            block.compile()
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda"
    )
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.mixed_precision == "bf16")

    def step(batch):
        inputs, targets = batch
        with autocast:
            logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def make_batch(args, vocab_size, device):
    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(vocab_size, (args.batch_size, args.seq_length + 1), generator=generator)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def timed_steps(step, batch, device, n):
    times = []
    for _ in range(n):
        start = time.perf_counter()
        loss = step(batch)
        float(loss)  # the step's end, as the training loop's logging sees it
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def alternating_medians(paths, batch, device, bench):
    times = {name: [] for name in paths}
    for _ in range(bench.rounds):
        for name, step in paths.items():
            times[name] += timed_steps(step, batch, device, bench.steps)[bench.warmup :]
    return {name: statistics.median(values) for name, values in times.items()}


def counted_flops(step, batch):
    from torch.utils.flop_counter import FlopCounterMode

    step(batch)  # compiled or lazy state made outside the count
    with FlopCounterMode(display=False) as counter:
        step(batch)
    return counter.get_total_flops()


def flop_ratios(args, model_config, device, mesh, batch):
    """Each path's FLOPs over one step, counted with eager attention and no compile, over the model FLOPs.
    One path's model at a time, for a GPU's memory."""
    meta = build_meta_model(model_config)
    model_flops = flops_per_token(meta, model_config, args.seq_length) * batch[0].numel()
    eager, eager_args = model_config_of(args, "eager"), argparse.Namespace(**dict(vars(args), compile=False))
    builders = {
        "train_step": lambda: train_path(eager_args, eager, device, mesh),
        "plain": lambda: plain_path(eager_args, eager, device),
    }
    ratios = {}
    for name, build in builders.items():
        ratios[name] = counted_flops(build(), batch) / model_flops
        free_memory(device)
    return {"model_flops": model_flops, "hardware_over_model_flops": ratios}


def print_profiles(paths, batch, device):
    """One profiled step of each path, its ops by their own time: where the time goes."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for name, step in paths.items():
        with profile(activities=activities) as profiler:
            timed_steps(step, batch, device, 1)
        print(f"{name}:")
        sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        print(profiler.key_averages().table(sort_by=sort_by, row_limit=15, max_name_column_width=60))


def free_memory(device):
    gc.collect()  # FSDP's hooks hold the model in reference cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main():
    bench = parse()
    args = train_options(bench)
    device, mesh = start_process_group()
    model_config = model_config_of(args, "sdpa")
    batch = make_batch(args, model_config.vocab_size, device)
    paths = {
        "train_step": train_path(args, model_config, device, mesh),
        "plain": plain_path(args, model_config, device),
    }
    medians = alternating_medians(paths, batch, device, bench)
    figures = {"median_step_s": medians, "ratio": medians["train_step"] / medians["plain"]}
    if bench.profile:
        print_profiles(paths, batch, device)
    if not bench.no_flops:
        paths.clear()  # the timed models go before the counted ones come, for a GPU's memory
        free_memory(device)
        figures.update(flop_ratios(args, model_config, device, mesh, batch))
    shape = resolve_shape(args)
    print(
        f"device {device}, torch {torch.__version__}: {shape.n_layer} layers x {shape.n_embd}, "
        f"{shape.n_head} heads, vocabulary {model_config.vocab_size}, batch {bench.batch_size} x "
        f"{args.seq_length}, {args.mixed_precision}, compile {args.compile}"
    )
    print(f"{'path':<12}{'median step':>14}{'hw/model FLOPs':>16}")
    for name, median in medians.items():
        ratio = figures.get("hardware_over_model_flops", {}).get(name, float("nan"))
        print(f"{name:<12}{median:>13.4f}s{ratio:>16.3f}")
    print(f"ratio train_step/plain: {figures['ratio']:.3f}")
    if bench.json:
        Path(bench.json).write_text(json.dumps(figures, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
