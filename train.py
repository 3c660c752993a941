"""Pretrain or fine-tune a transformers model (GPT-2, Llama, Mistral, Mixtral) with PyTorch FSDP2 or DDP.

    torchrun --standalone --nproc_per_node=8 train.py                  # 4B model on one 8-GPU node
    torchrun --standalone --nproc_per_node=2 train.py --model=tiny --compile=False   # CPU, gloo
    python train.py --dry_run                                          # config, size, memory; no training

Edit the constants below, set them in a YAML file given as --config=FILE.yaml, or override any of them
as --name=value (bare --flag means True); flags win over the file.
Read top to bottom: configuration, data, model, optimizer, logging, main().
"""
import copy
import difflib
import json
import math
import os
import sys
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
init_from: str | None = None        # a transformers model (directory or hub name) to start from; sets the shape
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
sharding: str = "full"              # full (FULL_SHARD) | grad_op (SHARD_GRAD_OP) | hybrid (HYBRID_SHARD) | ddp
cpu_offload: bool = False           # FSDP keeps parameters, gradients and optimizer state in CPU memory
activation_checkpointing: str = "full"  # none | full (every block) | selective (every ac_every-th block)
ac_every: int = 2                   # selective checkpoints layers ac_every, 2·ac_every, ...
compile: bool = True                # torch.compile each transformer block
# Logging
log_every: int = 10
log_dir: str = "logs"
tensorboard: bool = True            # used when the tensorboard package is installed
dry_run: bool = False               # print config, parameter count and memory estimate, then exit

CHOICES = {"sharding": ("full", "grad_op", "hybrid", "ddp"), "data": ("dummy",),
           "activation_checkpointing": ("none", "full", "selective")}

GPT2_VOCAB = 50257                  # token ids of the gpt2 tokenizer
LLAMA2 = dict(vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5)
LLAMA3 = dict(vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, num_key_value_heads=8,
              rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                   high_freq_factor=4.0, original_max_position_embeddings=8192))
LLAMA3_2 = dict(LLAMA3, tie_word_embeddings=True, rope_parameters=dict(LLAMA3["rope_parameters"], factor=32.0))
# Mistral 7B v0.2's shape (v0.1's with rope theta 1e6 and no sliding window), which Mixtral 8x7B shares.
MISTRAL = dict(vocab_size=32000, max_position_embeddings=32768, rms_norm_eps=1e-5, hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, sliding_window=None,
               rope_parameters=dict(rope_type="default", rope_theta=1e6))
TINY_LLAMA = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, vocab_size=512)
# A preset is a transformers config class and its arguments: the published shapes, no weights. GPT-2's
# 4b: 3072 wide (head size 128, the fast path of flash attention; a multiple of 256 for tensor-core
# tiles) and 34 layers give 4.01B parameters.
MODEL_PRESETS = {
    "tiny": ("GPT2Config", dict(n_embd=256, n_layer=2, n_head=4, n_positions=256, vocab_size=512)),
    "gpt2": ("GPT2Config", dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=GPT2_VOCAB)),
    "gpt2-medium": ("GPT2Config", dict(n_embd=1024, n_layer=24, n_head=16, n_positions=1024, vocab_size=GPT2_VOCAB)),
    "gpt2-large": ("GPT2Config", dict(n_embd=1280, n_layer=36, n_head=20, n_positions=1024, vocab_size=GPT2_VOCAB)),
    "gpt2-xl": ("GPT2Config", dict(n_embd=1600, n_layer=48, n_head=25, n_positions=1024, vocab_size=GPT2_VOCAB)),
    "4b": ("GPT2Config", dict(n_embd=3072, n_layer=34, n_head=24, n_positions=2048, vocab_size=GPT2_VOCAB)),
    "tiny-llama": ("LlamaConfig", dict(TINY_LLAMA, tie_word_embeddings=True)),
    "tiny-mixtral": ("MixtralConfig", dict(TINY_LLAMA, intermediate_size=256, num_local_experts=4, num_experts_per_tok=2)),
    "llama2-7b": ("LlamaConfig", dict(LLAMA2, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32)),
    "llama2-13b": ("LlamaConfig", dict(LLAMA2, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40)),
    "llama2-70b": ("LlamaConfig", dict(LLAMA2, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                                       num_key_value_heads=8)),
    "llama3.1-8b": ("LlamaConfig", dict(LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32)),
    "llama3.1-70b": ("LlamaConfig", dict(LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)),
    "llama3.2-1b": ("LlamaConfig", dict(LLAMA3_2, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32)),
    "llama3.2-3b": ("LlamaConfig", dict(LLAMA3_2, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24)),
    "mistral-7b": ("MistralConfig", MISTRAL),
    "mixtral-8x7b": ("MixtralConfig", dict(MISTRAL, num_local_experts=8, num_experts_per_tok=2)),
}
# The shape constants in each family's own words (GPT2Config maps these to n_embd, n_layer, ...).
SHAPE_NAMES = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
               "n_positions": "max_position_embeddings", "vocab_size": "vocab_size"}
DUMMY_EPOCH_SAMPLES = 2**20         # what one epoch of dummy data means for num_epochs
DUMMY_PERIOD = 8                   # each dummy sequence repeats a random block of this many tokens


class ConfigError(ValueError):
    """Bad user input: reported as one line and exit status 2, before anything expensive."""


def parse_args(argv):
    """Module constants, then --config=FILE.yaml files, then --name=value flags, each type-checked against
    the constant's annotation."""
    hints = {k: v for k, v in __annotations__.items() if not k.isupper()}
    cfg = {name: globals()[name] for name in hints}
    for path in [arg.removeprefix("--config=") for arg in argv if arg.startswith("--config=")]:
        cfg.update(read_config_file(path, hints))
    for arg in (arg for arg in argv if not arg.startswith("--config=")):
        name, has_value, text = arg.removeprefix("--").partition("=")
        if not arg.startswith("--") or not name:
            raise ConfigError(f"unexpected argument {arg!r}: options are written --name=value")
        if name not in cfg:
            raise ConfigError(f"unknown option --{name}{suggestion(name, cfg, '--')}")
        cfg[name] = convert(name, text if has_value else "true", hints[name], "--")
    return types.SimpleNamespace(**cfg)


def suggestion(name, valid, prefix):
    close = difflib.get_close_matches(name, valid, n=1)
    return f"; did you mean {prefix}{close[0]}?" if close else f"; valid options: {', '.join(valid)}"


def read_config_file(path, hints):
    import yaml

    try:
        with open(path) as file:
            values = yaml.safe_load(file) or {}
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"--config={path}: {' '.join(str(error).split())}")
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping of name: value, got {type(values).__name__}")
    for name in values:
        if name not in hints:
            raise ConfigError(f"{path}: unknown key {name!r}{suggestion(str(name), hints, '')}")
    return {name: convert(name, value, hints[name], f"{path}: ") for name, value in values.items()}


def convert(name, value, hint, where):
    """value: a flag's text, or a YAML value, typed already or text read the way a flag is."""
    allows_none = isinstance(hint, types.UnionType)
    kind = next(t for t in getattr(hint, "__args__", (hint,)) if t is not type(None))
    if allows_none and (value is None or isinstance(value, str) and value.lower() == "none"):
        return None
    if type(value) is kind or kind is float and type(value) is int:
        return kind(value)
    if isinstance(value, str) and kind is bool:
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
    elif isinstance(value, str):
        try:
            return kind(value)
        except ValueError:
            pass
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]
    raise ConfigError(f"{where}{name} expects {expected}{' or none' if allows_none else ''}, got {value!r}")


def resolve_shape(cfg):
    """The model's transformers config class, its arguments (the preset's, or the init_from model's) and
    its shape with the shape constants applied."""
    import transformers

    if cfg.init_from:
        try:
            pretrained = transformers.AutoConfig.from_pretrained(cfg.init_from)
        except (OSError, ValueError) as error:
            raise ConfigError(f"--init_from={cfg.init_from}: {str(error).splitlines()[0]}")
        config_class, arguments = type(pretrained), pretrained.to_dict()
    elif cfg.model in MODEL_PRESETS:
        class_name, arguments = MODEL_PRESETS[cfg.model]
        config_class = getattr(transformers, class_name)
    else:
        close = difflib.get_close_matches(cfg.model, MODEL_PRESETS, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(f"--model={cfg.model} is not a preset; {hint}presets: {', '.join(MODEL_PRESETS)}")
    shape = {name: arguments[config_class.attribute_map.get(key, key)] for name, key in SHAPE_NAMES.items()}
    shape.update({k: getattr(cfg, k) for k in shape if getattr(cfg, k) is not None})
    return types.SimpleNamespace(config_class=config_class, arguments=arguments, pretrained=bool(cfg.init_from), **shape)


def check_config(cfg, shape, world_size):
    """Every impossible combination, caught before any model is built."""
    if cfg.seq_length is None:
        cfg.seq_length = shape.n_positions
    # true and false: the values from before the option had a selective mode
    cfg.activation_checkpointing = {"true": "full", "false": "none"}.get(cfg.activation_checkpointing.lower(),
                                                                        cfg.activation_checkpointing)
    for name, choices in CHOICES.items():
        if getattr(cfg, name) not in choices:
            raise ConfigError(f"--{name}={getattr(cfg, name)} is not one of: {', '.join(choices)}")
    for name in ("n_embd", "n_layer", "n_head", "n_positions", "vocab_size"):
        if getattr(shape, name) <= 0:
            raise ConfigError(f"--{name} must be positive, got {getattr(shape, name)}")
    for name in ("batch_size", "seq_length", "global_batch_size", "num_epochs", "log_every", "ac_every"):
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
    if cfg.warmup_steps < 0 or cfg.weight_decay < 0 or cfg.grad_clip < 0:
        raise ConfigError("--warmup_steps, --weight_decay and --grad_clip must not be negative")
    if cfg.init_from and any(getattr(cfg, name) is not None for name in SHAPE_NAMES):
        raise ConfigError(f"--init_from={cfg.init_from} brings its own shape; drop --{', --'.join(SHAPE_NAMES)}")
    if cfg.cpu_offload and cfg.sharding == "ddp":
        raise ConfigError("--cpu_offload=True needs FSDP; it does not work with --sharding=ddp")


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
# Model: meta device -> activation checkpointing -> torch.compile per block -> fully_shard (or DDP) -> init or load
# --------------------------------------------------------------------------------------------
def model_config(shape):
    """The transformers config: the preset's arguments with the shape constants applied and a vocabulary
    padded for speed, or the pretrained model's; SDPA attention, no dropout."""
    defaults = shape.config_class().to_dict()
    arguments = dict(copy.deepcopy(shape.arguments), use_cache=False)
    # No dropout: modern pretraining does without it, and it keeps runs of any world size identical.
    arguments.update({k: 0.0 for k, v in defaults.items() if k.endswith(("pdrop", "dropout")) and isinstance(v, float)})
    for key in ("bos_token_id", "eos_token_id"):  # GPT-2's default 50256 must fit the tiny vocabulary
        if isinstance(token := arguments.get(key, defaults.get(key)), int) and token >= shape.vocab_size:
            arguments[key] = shape.vocab_size - 1
    if not shape.pretrained:  # a pretrained model keeps its shape and its vocabulary, whatever a tokenizer holds
        arguments.update({shape.config_class.attribute_map.get(key, key): getattr(shape, name) for name, key in SHAPE_NAMES.items()})
        arguments["vocab_size"] = padded_vocab(shape.vocab_size)
    config = shape.config_class.from_dict(arguments)
    config._attn_implementation = "sdpa"
    return config


def build_meta_model(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # not a pretrained config's bf16


def decoder_layers(model):
    """The ModuleList of the family's own decoder-layer class, the unit transformers names for sharding."""
    return next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and type(m[0]).__name__ in model._no_split_modules)


def flops_per_token(model, config, seq_length):
    """6·N + 12·L·H·Q·T (PaLM appendix B, as torchtitan). N counts the weights of matmuls: a tied token
    embedding once, as the output layer, no lookup-only embedding (positions, untied input tokens), and
    of a mixture of experts the num_experts_per_tok of num_local_experts that each token runs through."""
    matmuls = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)} - matmuls
    active = getattr(config, "num_experts_per_tok", 1) / getattr(config, "num_local_experts", 1)
    n_matmul = sum(p.numel() * (active if ".experts." in name else 1) for name, p in model.named_parameters() if id(p) not in lookups)
    head_dim = config.hidden_size // config.num_attention_heads
    return 6 * n_matmul + 12 * config.num_hidden_layers * config.num_attention_heads * head_dim * seq_length


def estimate_memory_gb(config, n_params, cfg, world_size, local_world_size, on_gpu=True):
    """Rough bytes per GPU with bf16 compute: sharded fp32 state, gathered bf16 blocks, activations
    (Korthikanti et al. 2022: 34·s·b·h bytes per layer without the s² attention matrix that SDPA never
    stores; 2·s·b·h per layer plus one recomputed layer with activation checkpointing) and the logits."""
    shards = {"hybrid": local_world_size, "ddp": 1}.get(cfg.sharding, world_size)
    s, b, h, L, V = cfg.seq_length, cfg.batch_size, config.hidden_size, config.num_hidden_layers, config.vocab_size
    block = (n_params - V * h * (1 if config.tie_word_embeddings else 2)) / L
    act_bytes = 2 if on_gpu else 4
    gathered = n_params * act_bytes if cfg.sharding in ("grad_op", "ddp") else (n_params - L * block + 2 * block) * act_bytes
    layer_activations = 34 * s * b * h * act_bytes / 2
    parts = {
        "params+grads+AdamW (fp32, sharded)": 0 if cfg.cpu_offload else 16 * n_params / shards,  # offload: host memory
        "gathered params": gathered,
        "activations without checkpointing": L * layer_activations,
        "activations with checkpointing": L * 2 * s * b * h * act_bytes / 2 + layer_activations,
        "logits and their gradient": s * b * V * (act_bytes + 4 + 4),
    }
    return {k: v / 1e9 for k, v in parts.items()}


@torch.no_grad()
def init_weights(model, std, n_layer, seed):
    """GPT-2's initialisation: N(0, 0.02) weights, residual projections (GPT-2's c_proj, Llama's o_proj and
    down_proj) scaled by 1/sqrt(2·n_layer), zero biases, unit norms. Each tensor is drawn whole from its
    own seeded generator and then sharded, so runs of every world size start from the same weights."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for index, (name, param) in enumerate(model.named_parameters()):
        if param.ndim == 1:
            full = torch.ones if name.endswith("weight") else torch.zeros  # norm weights; biases
            value = full(param.shape, device=param.device)
        else:
            residual = name.endswith(("c_proj.weight", "o_proj.weight", "down_proj.weight", "experts.down_proj"))
            generator = torch.Generator(param.device).manual_seed(seed + index)
            value = torch.randn(param.shape, generator=generator, device=param.device) * (std / math.sqrt(2 * n_layer) if residual else std)
        if isinstance(param, DTensor):
            param.to_local().copy_(distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None).to_local())
        else:
            param.copy_(value)


def init_rotary_embeddings(model, device):
    """to_empty leaves the rotary embeddings' non-persistent inv_freq buffers uninitialised: a fresh
    module computes them, on the compute device even when parameters are offloaded to the CPU."""
    for module in model.modules():
        if hasattr(module, "inv_freq"):
            with torch.device(device):
                fresh = type(module)(module.config)
            for name, buffer in fresh.named_buffers():
                setattr(module, name, buffer)


def load_pretrained(model, name_or_path):
    """Only rank 0 holds a full copy in host memory; set_model_state_dict broadcasts it and every rank keeps its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoModelForCausalLM

    weights = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch.float32).state_dict() if dist.get_rank() == 0 else {}
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    def set_requires_gradient_sync(self, requires_gradient_sync):
        """FSDP2's call for what DDP's no_sync() context switches, so that the training loop serves both."""
        self.require_backward_grad_sync = requires_gradient_sync


def build_model(config, cfg, device, mesh):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    model = build_meta_model(config)
    blocks = decoder_layers(model)
    for index, block in enumerate(blocks):
        if cfg.activation_checkpointing == "full" or cfg.activation_checkpointing == "selective" and (index + 1) % cfg.ac_every == 0:
            block = checkpoint_wrapper(block, preserve_rng_state=False)
        if cfg.compile:
            block.compile()
        blocks[index] = block
    if cfg.sharding == "ddp":
        model.to_empty(device=device)
        model.tie_weights()  # to_empty gave the tied modules a new tensor each (fully_shard keeps them shared)
    else:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" else None
        fsdp_kwargs = dict(mesh=mesh, reshard_after_forward=cfg.sharding != "grad_op")
        if mp is not None:
            fsdp_kwargs["mp_policy"] = mp
        if cfg.cpu_offload:
            fsdp_kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        for block in blocks:
            fully_shard(block, **fsdp_kwargs)
        fully_shard(model, **fsdp_kwargs)
        model.to_empty(device="cpu" if cfg.cpu_offload else device)
    init_rotary_embeddings(model, device)
    if cfg.init_from:
        load_pretrained(model, cfg.init_from)
    else:
        init_weights(model, config.initializer_range, config.num_hidden_layers, cfg.seed)
    if cfg.sharding == "ddp":
        if device.type == "cuda":  # FSDP's mixed precision: bf16 compute, fp32 weights and gradient reduction
            model.forward = torch.autocast("cuda", dtype=torch.bfloat16)(model.forward)
        model = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
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
        print(f"model: {cfg.init_from or cfg.model} ({type(config).__name__}) n_embd={shape.n_embd} n_layer={shape.n_layer} "
              f"n_head={shape.n_head} n_positions={shape.n_positions} vocab={config.vocab_size}")
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
    # Offloaded gradients are CPU tensors: their norm needs a CPU backend beside NCCL.
    backend = ("cuda:nccl,cpu:gloo" if cfg.cpu_offload else "nccl") if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(minutes=30))
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
        print(f"model: {cfg.init_from or cfg.model}, {n_params:,} parameters ({n_params / 1e9:.2f}B) | world_size={world_size} | "
              f"device={torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'} | "
              f"gradient accumulation {accumulation} | {total_steps} steps of {tokens_per_step:,} tokens", flush=True)

    model = build_model(config, cfg, device, mesh)
    optimizer = build_optimizer(model, cfg, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))
    batches = micro_batches(cfg, shape, world_size, rank, accumulation, 0, device)
    peak = peak_flops(device)
    flops_token = flops_per_token(model, config, cfg.seq_length)

    os.makedirs(cfg.log_dir, exist_ok=True)
    metrics_file = open(os.path.join(cfg.log_dir, "metrics.jsonl"), "a") if master else None
    writer = open_tensorboard(cfg) if master else None
    model.train()
    window_start, window_steps, loss_sum = time.perf_counter(), 0, torch.zeros((), device=device)
    for step in range(total_steps):
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
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        lr_now = scheduler.get_last_lr()[0]
        scheduler.step()
        window_steps += 1
        if step == 0 and master:
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
    if master:
        print(f"done: {total_steps} steps in {time.perf_counter() - start_time:.1f} s", flush=True)
        metrics_file.close()
    dist.barrier()  # a rank leaving while gloo still talks to it aborts the other
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
