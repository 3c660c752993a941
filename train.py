"""Pretrain a GPT-2-style transformers model with PyTorch FSDP2.

    torchrun --standalone --nproc_per_node=8 train.py                  # 4B model on one 8-GPU node
    torchrun --standalone --nproc_per_node=2 train.py --model=tiny --compile=False   # CPU, gloo
    python train.py --dry_run                                          # config, size, memory; no training

Edit the constants below, or override any of them as --name=value (bare --flag means True).
Read top to bottom: configuration, data, model, optimizer, logging, main().
"""
import difflib
import hashlib
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import types
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

# --------------------------------------------------------------------------------------------
# Configuration: the constants a user edits. Every one can be overridden as --name=value.
# --------------------------------------------------------------------------------------------
# Model: a preset from MODEL_PRESETS; a shape constant set here (not None) overrides the preset.
model: str = "4b"
n_embd: int | None = None
n_layer: int | None = None
n_head: int | None = None
n_positions: int | None = None      # longest sequence the model can take
vocab_size: int | None = None       # dummy data draws from it; real data: the tokenizer's size
# Data and batch
data: str = "dummy"                 # dummy: synthetic learnable tokens
batch_size: int = 8                 # sequences per device per micro-step
seq_length: int | None = None       # tokens per sequence; None: the model's n_positions
global_batch_size: int = 256        # sequences per optimizer step, whatever the number of processes
num_epochs: int = 1
max_steps: int = -1                 # -1: num_epochs passes over the data
# Optimizer: AdamW, linear warm-up then cosine decay to min_lr
lr: float = 3e-4
min_lr: float = 3e-5
warmup_steps: int = 200
weight_decay: float = 0.1
grad_clip: float = 1.0              # 0 disables clipping (the norm is still logged)
seed: int = 1337
# Parallelism and speed
sharding: str = "full"              # full (FULL_SHARD) | grad_op (SHARD_GRAD_OP) | hybrid (HYBRID_SHARD)
activation_checkpointing: bool = True
compile: bool = True                # torch.compile each transformer block
# Checkpoints and fault tolerance
checkpoint_dir: str = "checkpoints"
run_name: str | None = None         # None: derived from the arguments, so a relaunch or requeue resumes
checkpoint_every: int = 500         # steps; a checkpoint is also written at the end and on SIGTERM/SIGUSR1
keep_last: int = 3                  # older step_N folders are removed; 0 keeps all
ckpt_format: str = "sharded"        # sharded (DCP, every rank writes its shard) | full (one file from rank 0)
async_checkpoint: bool = False      # write in the background while training goes on
resume_from: str | None = None      # a step_N folder; None: the newest complete one of this run
skip_optimizer: bool = False        # resume weights only, with a fresh optimizer and schedule
max_bad_steps: int = 5              # stop after this many non-finite steps in a row
# Logging
log_every: int = 10
log_dir: str = "logs"
tensorboard: bool = True            # used when the tensorboard package is installed
dry_run: bool = False               # print config, parameter count and memory estimate, then exit

CHOICES = {"sharding": ("full", "grad_op", "hybrid"), "data": ("dummy",), "ckpt_format": ("sharded", "full")}
# Options that change how a run is operated but not what it computes: left out of the default run_name.
OPERATIONAL = {"run_name", "checkpoint_dir", "checkpoint_every", "keep_last", "async_checkpoint", "resume_from",
               "skip_optimizer", "max_bad_steps", "log_every", "log_dir", "tensorboard", "dry_run"}
STOPPED_BY_SIGNAL = 75              # exit status after a signal-triggered checkpoint: the launcher requeues

GPT2_VOCAB = 50257                  # token ids of the gpt2 tokenizer
# GPT2Config shapes. 4b: 3072 wide (head size 128, the fast path of flash attention; a multiple
# of 256 for tensor-core tiles) and 34 layers give 4.01B parameters.
MODEL_PRESETS = {
    "tiny": dict(n_embd=256, n_layer=2, n_head=4, n_positions=256, vocab_size=512),
    "gpt2": dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=GPT2_VOCAB),
    "gpt2-medium": dict(n_embd=1024, n_layer=24, n_head=16, n_positions=1024, vocab_size=GPT2_VOCAB),
    "gpt2-large": dict(n_embd=1280, n_layer=36, n_head=20, n_positions=1024, vocab_size=GPT2_VOCAB),
    "gpt2-xl": dict(n_embd=1600, n_layer=48, n_head=25, n_positions=1024, vocab_size=GPT2_VOCAB),
    "4b": dict(n_embd=3072, n_layer=34, n_head=24, n_positions=2048, vocab_size=GPT2_VOCAB),
}
DUMMY_EPOCH_SAMPLES = 2**20         # what one epoch of dummy data means for num_epochs
DUMMY_PERIOD = 8                   # each dummy sequence repeats a random block of this many tokens


class ConfigError(ValueError):
    """Bad user input: reported as one line and exit status 2, before anything expensive."""


def parse_args(argv):
    """Module constants overridden by --name=value arguments, type-checked against their annotations."""
    hints = {k: v for k, v in __annotations__.items() if not k.isupper()}
    cfg = {name: globals()[name] for name in hints}
    for arg in argv:
        name, has_value, text = arg.removeprefix("--").partition("=")
        if not arg.startswith("--") or not name:
            raise ConfigError(f"unexpected argument {arg!r}: options are written --name=value")
        if name not in cfg:
            close = difflib.get_close_matches(name, cfg, n=1)
            hint = f"; did you mean --{close[0]}?" if close else f"; valid options: {', '.join(cfg)}"
            raise ConfigError(f"unknown option --{name}{hint}")
        cfg[name] = convert(name, text if has_value else "true", hints[name])
    return types.SimpleNamespace(**cfg)


def convert(name, text, hint):
    allows_none = isinstance(hint, types.UnionType)
    kind = next(t for t in getattr(hint, "__args__", (hint,)) if t is not type(None))
    if allows_none and text.lower() == "none":
        return None
    if kind is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
    else:
        try:
            return kind(text)
        except ValueError:
            pass
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]
    raise ConfigError(f"--{name} expects {expected}{' or none' if allows_none else ''}, got {text!r}")


def resolve_shape(cfg):
    if cfg.model not in MODEL_PRESETS:
        close = difflib.get_close_matches(cfg.model, MODEL_PRESETS, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(f"--model={cfg.model} is not a preset; {hint}presets: {', '.join(MODEL_PRESETS)}")
    shape = dict(MODEL_PRESETS[cfg.model])
    shape.update({k: getattr(cfg, k) for k in shape if getattr(cfg, k) is not None})
    return types.SimpleNamespace(**shape)


def check_config(cfg, shape, world_size):
    """Every impossible combination, caught before any model is built."""
    if cfg.seq_length is None:
        cfg.seq_length = shape.n_positions
    for name, choices in CHOICES.items():
        if getattr(cfg, name) not in choices:
            raise ConfigError(f"--{name}={getattr(cfg, name)} is not one of: {', '.join(choices)}")
    for name in ("n_embd", "n_layer", "n_head", "n_positions", "vocab_size"):
        if getattr(shape, name) <= 0:
            raise ConfigError(f"--{name} must be positive, got {getattr(shape, name)}")
    for name in ("batch_size", "seq_length", "global_batch_size", "num_epochs", "log_every", "checkpoint_every",
                 "max_bad_steps"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"--{name} must be positive, got {getattr(cfg, name)}")
    if shape.n_embd % shape.n_head:
        raise ConfigError(f"--n_embd={shape.n_embd} is not divisible by --n_head={shape.n_head}")
    if cfg.seq_length > shape.n_positions:
        raise ConfigError(f"--seq_length={cfg.seq_length} exceeds the model's {shape.n_positions} positions; "
                          f"lower --seq_length or raise --n_positions")
    per_micro_step = cfg.batch_size * world_size
    if cfg.global_batch_size % per_micro_step:
        raise ConfigError(f"--global_batch_size={cfg.global_batch_size} is not divisible by batch_size x world size "
                          f"= {cfg.batch_size} x {world_size}; use a multiple of {per_micro_step}")
    if cfg.max_steps == 0 or cfg.max_steps < -1:
        raise ConfigError(f"--max_steps must be positive, or -1 for num_epochs passes, got {cfg.max_steps}")
    if not 0 <= cfg.min_lr <= cfg.lr:
        raise ConfigError(f"--min_lr={cfg.min_lr} must lie between 0 and --lr={cfg.lr}")
    if cfg.warmup_steps < 0 or cfg.weight_decay < 0 or cfg.grad_clip < 0 or cfg.keep_last < 0:
        raise ConfigError("--warmup_steps, --weight_decay, --grad_clip and --keep_last must not be negative")
    if cfg.resume_from is not None and not os.path.isfile(os.path.join(cfg.resume_from, "trainer_state.json")):
        raise ConfigError(f"--resume_from={cfg.resume_from} is not a complete checkpoint folder (no trainer_state.json)")
    if cfg.run_name is None:
        identity = {k: v for k, v in vars(cfg).items() if k not in OPERATIONAL}
        digest = hashlib.sha1(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]
        cfg.run_name = f"{cfg.model}-{digest}"
    if cfg.dry_run:
        return
    run_dir = os.path.join(cfg.checkpoint_dir, cfg.run_name)
    try:
        os.makedirs(run_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as error:
        raise ConfigError(f"--checkpoint_dir={cfg.checkpoint_dir} is not writable ({error.strerror}); "
                          f"point it at a writable shared folder")


# --------------------------------------------------------------------------------------------
# Data: the global batch of step k is a function of k alone, so it is the same for any world size.
# --------------------------------------------------------------------------------------------
def padded_vocab(n_tokens):
    """Vocabulary rounded up to a multiple of 64: the output layer's matmul runs faster."""
    return (n_tokens + 63) // 64 * 64


def dummy_sample(index, seq_length, vocab_size, seed):
    """seq_length + 1 tokens: a random block repeated, so a model can learn to copy and the loss falls."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    block = torch.randint(0, vocab_size, (DUMMY_PERIOD,), generator=generator)
    return block.repeat(seq_length // DUMMY_PERIOD + 1)[: seq_length + 1]


def micro_batches(cfg, shape, world_size, rank, accumulation, start_step, device):
    """Yields (inputs, targets) for every micro-step from start_step on; rank r of micro-step m reads
    samples m·B·W + r·B ... of the global batch, so accumulation and world size only split it."""
    step = start_step
    while True:
        for micro in range(accumulation):
            first = step * cfg.global_batch_size + (micro * world_size + rank) * cfg.batch_size
            windows = torch.stack([dummy_sample(first + i, cfg.seq_length, shape.vocab_size, cfg.seed) for i in range(cfg.batch_size)])
            if device.type == "cuda":
                windows = windows.pin_memory().to(device, non_blocking=True)
            yield windows[:, :-1], windows[:, 1:]
        step += 1


# --------------------------------------------------------------------------------------------
# Model: meta device -> activation checkpointing -> torch.compile per block -> fully_shard -> init
# --------------------------------------------------------------------------------------------
def model_config(shape):
    from transformers import GPT2Config

    # No dropout: modern pretraining does without it, and it keeps runs of any world size identical.
    config = GPT2Config(vocab_size=padded_vocab(shape.vocab_size), n_embd=shape.n_embd, n_layer=shape.n_layer, n_head=shape.n_head,
                        n_positions=shape.n_positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=shape.vocab_size - 1, eos_token_id=shape.vocab_size - 1, use_cache=False)
    config._attn_implementation = "sdpa"
    return config


def build_meta_model(config):
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        return GPT2LMHeadModel(config)


def flops_per_token(config, n_params, seq_length):
    """6·N + 12·L·H·Q·T (PaLM appendix B, as torchtitan): N counts the tied token embedding once, as the
    output layer's matmul, and leaves out the position embedding, a lookup with no FLOPs."""
    n_matmul = n_params - config.n_positions * config.n_embd
    head_dim = config.n_embd // config.n_head
    return 6 * n_matmul + 12 * config.n_layer * config.n_head * head_dim * seq_length


def estimate_memory_gb(config, n_params, cfg, world_size, local_world_size, on_gpu=True):
    """Rough bytes per GPU with bf16 compute: sharded fp32 state, gathered bf16 blocks, activations
    (Korthikanti et al. 2022: 34·s·b·h bytes per layer without the s² attention matrix that SDPA never
    stores; 2·s·b·h per layer plus one recomputed layer with activation checkpointing) and the logits."""
    shards = local_world_size if cfg.sharding == "hybrid" else world_size
    s, b, h, L, V = cfg.seq_length, cfg.batch_size, config.n_embd, config.n_layer, config.vocab_size
    block = 12 * h * h + 13 * h
    act_bytes = 2 if on_gpu else 4
    gathered = n_params * act_bytes if cfg.sharding == "grad_op" else (n_params - L * block + 2 * block) * act_bytes
    layer_activations = 34 * s * b * h * act_bytes / 2
    parts = {
        "params+grads+AdamW (fp32, sharded)": 16 * n_params / shards,
        "gathered params": gathered,
        "activations without checkpointing": L * layer_activations,
        "activations with checkpointing": L * 2 * s * b * h * act_bytes / 2 + layer_activations,
        "logits and their gradient": s * b * V * (act_bytes + 4 + 4),
    }
    return {k: v / 1e9 for k, v in parts.items()}


@torch.no_grad()
def init_weights(model, std, n_layer, seed):
    """GPT-2's initialisation: N(0, 0.02) weights, residual projections scaled by 1/sqrt(2·n_layer), zero
    biases, unit norms. Each tensor is drawn whole from its own seeded generator and then sharded, so
    runs of every world size start from the same weights."""
    from torch.distributed.tensor import distribute_tensor

    for index, (name, param) in enumerate(model.named_parameters()):
        if param.ndim == 1:
            full = torch.ones if name.endswith("weight") else torch.zeros  # norm weights; biases
            value = full(param.shape, device=param.device)
        else:
            scale = std / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else std
            generator = torch.Generator(param.device).manual_seed(seed + index)
            value = torch.randn(param.shape, generator=generator, device=param.device) * scale
        param.to_local().copy_(distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None).to_local())


def build_model(config, cfg, device, mesh):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build_meta_model(config)
    blocks = model.transformer.h
    for index, block in enumerate(blocks):
        if cfg.activation_checkpointing:
            block = checkpoint_wrapper(block, preserve_rng_state=False)
        if cfg.compile:
            block.compile()
        blocks[index] = block
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" else None
    fsdp_kwargs = dict(mesh=mesh, reshard_after_forward=cfg.sharding != "grad_op")
    if mp is not None:
        fsdp_kwargs["mp_policy"] = mp
    for block in blocks:
        fully_shard(block, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    model.to_empty(device=device)
    init_weights(model, config.initializer_range, config.n_layer, cfg.seed)
    return model


# --------------------------------------------------------------------------------------------
# Optimizer and schedule
# --------------------------------------------------------------------------------------------
def build_optimizer(model, cfg, device):
    """AdamW; biases, norms and embeddings get no weight decay."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    decay, no_decay = [], []
    for param in model.parameters():
        (decay if param.ndim >= 2 and id(param) not in embeddings else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def lr_factor(step, cfg, total_steps):
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    return (cfg.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)) / cfg.lr


# --------------------------------------------------------------------------------------------
# Checkpoints: <checkpoint_dir>/<run_name>/step_<N>/, written under a temporary name and renamed
# once every rank has finished, so a folder named step_<N> is always complete.
# --------------------------------------------------------------------------------------------
def newest_checkpoint(run_dir):
    steps = [int(m.group(1)) for name in os.listdir(run_dir) if (m := re.fullmatch(r"step_(\d+)", name))]
    return os.path.join(run_dir, f"step_{max(steps)}") if steps else None


def model_and_optimizer_state(model, optimizer, full):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=full, cpu_offload=full))


class Checkpointer:
    """Saves and restores everything an exact resume needs: model, optimizer, schedule, step, tokens
    seen, data position, RNG states and the config. Tensors go through torch.distributed.checkpoint;
    the rest is JSON and per-rank RNG tensors, so nothing is unpickled on load."""

    def __init__(self, cfg, rank, world_size):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.run_dir = os.path.join(cfg.checkpoint_dir, cfg.run_name)
        self.pending = None  # (future, temporary folder, final folder) of an async save still writing
        # Background saves talk over their own group so they never interleave with training collectives.
        self.group = dist.new_group(backend="gloo") if cfg.async_checkpoint else None

    def save(self, step, model, optimizer, scheduler, trainer_state):
        import torch.distributed.checkpoint as dcp

        self.finish()
        final = os.path.join(self.run_dir, f"step_{step}")
        temporary = final + ".tmp"
        try:
            if self.rank == 0:
                shutil.rmtree(temporary, ignore_errors=True)  # left by a save that was killed
                os.makedirs(temporary)
            dist.barrier()
            full = self.cfg.ckpt_format == "full"
            model_state, optimizer_state = model_and_optimizer_state(model, optimizer, full)
            state = {"model": model_state, "optimizer": optimizer_state}
            if full:
                if self.rank == 0:
                    torch.save(state, os.path.join(temporary, "state_dict.pt"))
            elif self.cfg.async_checkpoint:
                self.pending = (dcp.async_save(state, checkpoint_id=temporary, process_group=self.group), temporary, final)
            else:
                dcp.save(state, checkpoint_id=temporary)
            torch.save(rng_states(), os.path.join(temporary, f"rng_rank{self.rank}.pt"))
            if self.rank == 0:
                trainer_state = {**trainer_state, "scheduler": scheduler.state_dict(), "world_size": self.world_size}
                with open(os.path.join(temporary, "trainer_state.json"), "w") as f:
                    json.dump(trainer_state, f, indent=1)
        except OSError as error:
            self.abandon(temporary, error)
        if self.pending is None:
            self.publish(temporary, final)

    def finish(self):
        """Waits for a background save, then publishes it."""
        if self.pending is not None:
            future, temporary, final = self.pending
            self.pending = None
            try:
                future.result()
            except OSError as error:
                self.abandon(temporary, error)
            self.publish(temporary, final)

    def publish(self, temporary, final):
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.rename(temporary, final)
            steps = sorted(int(name[5:]) for name in os.listdir(self.run_dir) if re.fullmatch(r"step_\d+", name))
            for old in steps[: -self.cfg.keep_last] if self.cfg.keep_last else []:
                shutil.rmtree(os.path.join(self.run_dir, f"step_{old}"), ignore_errors=True)
            print(f"checkpoint saved: {final}", flush=True)
        dist.barrier()

    def abandon(self, temporary, error):
        shutil.rmtree(temporary, ignore_errors=True)
        previous = newest_checkpoint(self.run_dir)
        kept = f"the previous checkpoint {previous} is untouched" if previous else "there is no earlier checkpoint"
        fail(f"writing checkpoint {temporary} failed ({error}); {kept}. Free space or fix permissions, then relaunch")

    def load(self, path, model, optimizer, scheduler, shape):
        """Restores a checkpoint written by save(); returns its trainer state."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

        with open(os.path.join(path, "trainer_state.json")) as f:
            trainer_state = json.load(f)
        changed = {k: (v, getattr(shape, k)) for k, v in trainer_state["shape"].items() if getattr(shape, k) != v}
        if changed:
            details = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items())
            fail(f"checkpoint {path} has another model shape ({details}); use another --run_name or --checkpoint_dir")
        full_file = os.path.join(path, "state_dict.pt")
        full = os.path.exists(full_file)
        if full:  # memory-mapped: the ranks of a node share one copy in the page cache
            state = torch.load(full_file, weights_only=True, mmap=True)
        else:
            model_state, optimizer_state = model_and_optimizer_state(model, optimizer, full=False)
            state = {"model": model_state}
            if not self.cfg.skip_optimizer:
                state["optimizer"] = optimizer_state
            dcp.load(state, checkpoint_id=path)
        options = StateDictOptions(full_state_dict=full)
        if self.cfg.skip_optimizer:  # fresh optimizer; the schedule of this run's config, at the resumed step
            set_model_state_dict(model, state["model"], options=options)
            scheduler.last_epoch = trainer_state["step"] - 1
            scheduler.step()
        else:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                           options=options)
            scheduler.load_state_dict(trainer_state["scheduler"])
        rng_file = os.path.join(path, f"rng_rank{self.rank}.pt")
        if trainer_state["world_size"] == self.world_size and os.path.exists(rng_file):
            restore_rng_states(torch.load(rng_file, weights_only=True))
        return trainer_state


def rng_states():
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def restore_rng_states(states):
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def export_pretrained(model, config, path, rank):
    """The final weights as a transformers folder (safetensors + config): from_pretrained(path) loads it
    with no code from this repo."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        plain = build_meta_model(config)
        plain.load_state_dict(state, assign=True)
        plain.tie_weights()
        plain.save_pretrained(path)
        print(f"model exported: {path}", flush=True)
    dist.barrier()


# --------------------------------------------------------------------------------------------
# Logging
# --------------------------------------------------------------------------------------------
def peak_flops(device):
    """Dense bf16 peak of one device from benchmark.py's datasheet table; None on CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    from benchmark import datasheet

    sheet = datasheet(torch.cuda.get_device_name(device))
    return sheet["bf16"] * 1e12 if sheet and sheet.get("bf16") else None


def open_tensorboard(cfg):
    if not cfg.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(os.path.join(cfg.log_dir, "tensorboard"))


def log_step(record, metrics_file, writer):
    mfu = f"{record['mfu']:.1%}" if record["mfu"] is not None else "-"
    mem = f"{record['peak_mem_GB']:.1f} GB" if record["peak_mem_GB"] is not None else "-"
    print(f"step {record['step']:>6} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
          f"grad norm {record['grad_norm']:.3f} | {record['tokens_per_s']:,.0f} tok/s | "
          f"{record['samples_per_s']:.1f} samples/s | step {record['step_time_s']:.3f} s | MFU {mfu} | mem {mem}",
          flush=True)
    metrics_file.write(json.dumps(record) + "\n")
    metrics_file.flush()
    if writer is not None:
        for key, value in record.items():
            if key != "step" and value is not None:
                writer.add_scalar(f"train/{key}", value, record["step"])


def fail(message):
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


# --------------------------------------------------------------------------------------------
def main(argv):
    try:
        cfg = parse_args(argv)
        shape = resolve_shape(cfg)
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        check_config(cfg, shape, world_size)
    except ConfigError as error:
        fail(error)
    config = model_config(shape)
    n_params = sum(p.numel() for p in build_meta_model(config).parameters())
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))

    if cfg.dry_run:
        print("config:", " ".join(f"{k}={v}" for k, v in vars(cfg).items()))
        print(f"model: {cfg.model} n_embd={config.n_embd} n_layer={config.n_layer} n_head={config.n_head} "
              f"n_positions={config.n_positions} vocab={config.vocab_size}")
        print(f"parameters: {n_params:,} ({n_params / 1e9:.2f}B)")
        memory = estimate_memory_gb(config, n_params, cfg, world_size, local_world_size)
        fixed = memory["params+grads+AdamW (fp32, sharded)"] + memory["gathered params"] + memory["logits and their gradient"]
        print(f"memory per GPU (estimate, bf16, world size {world_size}, sharding={cfg.sharding}):")
        for name, gb in memory.items():
            print(f"  {name:<38} {gb:8.1f} GB")
        print(f"  {'total with activation checkpointing':<38} {fixed + memory['activations with checkpointing']:8.1f} GB")
        print(f"  {'total without':<38} {fixed + memory['activations without checkpointing']:8.1f} GB")
        return 0

    start_time = time.perf_counter()
    if "RANK" not in os.environ:  # a plain `python train.py`: a process group of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        device = torch.device("cpu")
    store = None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Workers restarted by torchrun --max-restarts meet in the same agent store as the failed attempt;
        # without a per-attempt prefix they would read the dead workers' addresses and hang.
        agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                    is_master=False, timeout=timedelta(minutes=30))
        store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent_store)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=world_size, timeout=timedelta(minutes=30))
    from torch.distributed.device_mesh import init_device_mesh

    if cfg.sharding == "hybrid":
        if world_size % local_world_size:
            fail(f"--sharding=hybrid needs the same number of processes on every node ({world_size} over nodes of {local_world_size})")
        mesh = init_device_mesh(device.type, (world_size // local_world_size, local_world_size),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world_size,))
    master = rank == 0

    accumulation = cfg.global_batch_size // (cfg.batch_size * world_size)
    total_steps = cfg.max_steps if cfg.max_steps > 0 else cfg.num_epochs * DUMMY_EPOCH_SAMPLES // cfg.global_batch_size
    tokens_per_step = cfg.global_batch_size * cfg.seq_length
    if master:
        print("config:", " ".join(f"{k}={v}" for k, v in vars(cfg).items()), flush=True)
        print(f"model: {cfg.model}, {n_params:,} parameters ({n_params / 1e9:.2f}B) | world_size={world_size} | "
              f"device={torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'} | "
              f"gradient accumulation {accumulation} | {total_steps} steps of {tokens_per_step:,} tokens", flush=True)

    model = build_model(config, cfg, device, mesh)
    optimizer = build_optimizer(model, cfg, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))
    checkpointer = Checkpointer(cfg, rank, world_size)
    start_step, tokens_seen = 0, 0
    resume_path = cfg.resume_from or newest_checkpoint(checkpointer.run_dir)
    if resume_path:
        trainer_state = checkpointer.load(resume_path, model, optimizer, scheduler, shape)
        start_step, tokens_seen = trainer_state["step"], trainer_state["tokens_seen"]
        if master:
            print(f"resumed from {resume_path} at step {start_step}"
                  f"{' (weights only, fresh optimizer)' if cfg.skip_optimizer else ''}", flush=True)
    batches = micro_batches(cfg, shape, world_size, rank, accumulation, start_step, device)
    peak = peak_flops(device)
    flops_token = flops_per_token(config, n_params, cfg.seq_length)

    # SLURM sends SIGUSR1 (--signal) before the time limit and SIGTERM on preemption: finish the step,
    # checkpoint, exit. Any rank may get it; the flag is summed over ranks so all stop at the same step.
    stop_requests = []
    for stop_signal in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(stop_signal, lambda signum, frame: stop_requests.append(signum))

    os.makedirs(cfg.log_dir, exist_ok=True)
    metrics_file = open(os.path.join(cfg.log_dir, "metrics.jsonl"), "a") if master else None
    writer = open_tensorboard(cfg) if master else None
    model.train()
    window_start, window_steps, loss_sum = time.perf_counter(), 0, torch.zeros((), device=device)
    bad_steps, last_saved = 0, start_step
    for step in range(start_step, total_steps):
        for micro in range(accumulation):
            inputs, targets = next(batches)
            # Gradients are reduced only on the last micro-step; earlier ones accumulate locally.
            model.set_requires_gradient_sync(micro == accumulation - 1)
            logits = model(input_ids=inputs).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            (loss / accumulation).backward()
            loss_sum += loss.detach() / accumulation
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        if torch.isfinite(grad_norm):  # the norm is global, so every rank takes the same branch
            optimizer.step()
            bad_steps = 0
        else:
            bad_steps += 1
            if master:
                print(f"step {step + 1}: non-finite loss or gradient norm, update skipped "
                      f"({bad_steps} in a row, limit {cfg.max_bad_steps})", flush=True)
            if bad_steps >= cfg.max_bad_steps:
                kept = newest_checkpoint(checkpointer.run_dir) or "none written yet"
                fail(f"stopping: {bad_steps} non-finite steps in a row (lower --lr or raise --warmup_steps); "
                     f"last good checkpoint: {kept}")
        optimizer.zero_grad(set_to_none=True)
        lr_now = scheduler.get_last_lr()[0]
        scheduler.step()
        tokens_seen += tokens_per_step
        window_steps += 1
        if step == start_step and master:
            print(f"time to first step: {time.perf_counter() - start_time:.1f} s", flush=True)
        if (step + 1) % cfg.log_every == 0 or step + 1 == total_steps:
            dist.all_reduce(loss_sum)  # gloo has no AVG: sum, then divide
            elapsed = time.perf_counter() - window_start
            tokens_per_s = tokens_per_step * window_steps / elapsed
            if master:
                record = {
                    "step": step + 1, "loss": loss_sum.item() / world_size / window_steps, "lr": lr_now,
                    "grad_norm": grad_norm.item(), "tokens_per_s": tokens_per_s,
                    "samples_per_s": cfg.global_batch_size * window_steps / elapsed, "step_time_s": elapsed / window_steps,
                    "mfu": flops_token * tokens_per_s / (peak * world_size) if peak else None,
                    "peak_mem_GB": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
                }
                log_step(record, metrics_file, writer)
            window_start, window_steps = time.perf_counter(), 0
            loss_sum.zero_()
        stop = torch.tensor(float(len(stop_requests)), device=device)
        dist.all_reduce(stop)
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == total_steps or stop.item():
            trainer_state = {"step": step + 1, "tokens_seen": tokens_seen, "data": {"step": step + 1},
                             "shape": vars(shape), "config": vars(cfg)}
            checkpointer.save(step + 1, model, optimizer, scheduler, trainer_state)
            last_saved = step + 1
        if stop.item():
            checkpointer.finish()
            if master:
                print(f"stopped by signal after step {step + 1}; checkpoint saved, relaunch to resume", flush=True)
            dist.barrier()
            dist.destroy_process_group()
            return STOPPED_BY_SIGNAL
    checkpointer.finish()
    if last_saved == total_steps:
        export_pretrained(model, config, os.path.join(checkpointer.run_dir, "final_model"), rank)
    if master:
        print(f"done: {total_steps} steps in {time.perf_counter() - start_time:.1f} s", flush=True)
        metrics_file.close()
    dist.barrier()  # a rank leaving while gloo still talks to it aborts the other
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
