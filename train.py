"""Pretrain or fine-tune a transformers model (GPT-2, Llama, Mistral, Mixtral) with PyTorch FSDP2 or DDP.

    torchrun --standalone --nproc_per_node=8 train.py                  # 4B model on one 8-GPU node
    torchrun --standalone --nproc_per_node=2 train.py --model=tiny --compile=False   # CPU, gloo
    python train.py --dry_run                                          # config, size, memory; no training

Edit the constants below, set them in a YAML file given as --config=FILE.yaml, or override any of them
as --name=value (bare --flag means True); flags win over the file.
Read top to bottom: configuration, data, model, optimizer, checkpoints, logging, main().
"""
import codecs
import collections
import contextlib
import copy
import difflib
import faulthandler
import functools
import glob
import hashlib
import itertools
import json
import math
import os
import queue
import re
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import types
import zlib
import warnings
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import numpy as np
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
data: str = "dummy"                 # dummy | wikitext | c4 | hf:NAME[:CONFIG] | a .txt file or a folder (docs/DATA.md)
batch_size: int = 8                 # sequences per device per micro-step
seq_length: int | None = None       # tokens per sequence; None: the model's n_positions
global_batch_size: int = 256        # sequences per optimizer step, whatever the number of processes
num_epochs: int = 1
max_steps: int = -1                 # -1: num_epochs passes over the data; a larger one continues a run
tokenizer: str = "gpt2"             # AutoTokenizer name or local folder (real data); the vocabulary follows it
text_column: str = "text"           # the column of .jsonl/.parquet/hub data holding the text
val_fraction: float = 0.005         # share of a local corpus held out for validation when it has no validation file
data_cache: str = "data_cache"      # prepared token files (and hub downloads); put it on shared storage
prepare_only: bool = False          # tokenise --data into data_cache, then exit (a login node with internet)
eval_every: int = 500               # validation loss every this many steps and at the end; 0: never
eval_batches: int = 20              # micro-batches per rank in each evaluation
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
activation_checkpointing: str = "op"    # none | full | op (saves chosen op outputs) | selective (every ac_every-th block)
ac_every: int = 2                   # selective checkpoints layers ac_every, 2·ac_every, ...
compile: bool = True                # torch.compile each transformer block
mixed_precision: str = "auto"       # bf16 (bf16 compute, fp32 weights and gradient reduction) | fp32 | auto: bf16 on GPU
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
tensorboard: bool = True            # <log_dir>/<run_name>/tensorboard
wandb: str | None = None            # a W&B project to log to as well; None: off
plot: str | None = None             # a run folder (<log_dir>/<run_name>): write its curves.png, then exit
export_from: str | None = None      # a step_N checkpoint: write the export_step_N folder beside it, then exit
dry_run: bool = False               # simulate training steps on fake tensors: peak memory per GPU, FLOPs; no training
world_size: int | None = None       # dry run: the world size simulated; None: $WORLD_SIZE, else 8
gpus_per_node: int = 8              # dry run: GPUs per node, for --sharding=hybrid
gpu: str = "H100"                   # dry run: a GPU of benchmark.py's datasheet (its memory), or its memory in GB
# When a run misbehaves (docs/SLURM.md): a watchdog per rank, and a profiler on demand
hang_minimum_s: float = 300.0       # watchdog: no optimizer step for max(this, hang_factor x median step
hang_factor: float = 10.0           #   time) is a hang: stacks to the run's log folder, one line, exit HUNG
checkpoint_limit_s: float = 1800.0  # a checkpoint write (or the final export) taking longer is a hang too
eval_limit_s: float = 900.0         # an evaluation taking longer is a hang too
profile_steps: str | None = None    # A,B: torch.profiler traces steps A to B (as logged) of rank 0

CHOICES = {"sharding": ("full", "grad_op", "hybrid", "ddp"), "ckpt_format": ("sharded", "full"),
           "activation_checkpointing": ("none", "full", "op", "selective"), "mixed_precision": ("auto", "bf16", "fp32")}
# Options that change how a run is operated but not what it computes: left out of the default run_name. The
# run's length is among them, so that a larger max_steps continues the same run.
OPERATIONAL = {"run_name", "checkpoint_dir", "checkpoint_every", "keep_last", "async_checkpoint", "resume_from",
               "skip_optimizer", "max_bad_steps", "log_every", "log_dir", "tensorboard", "dry_run", "data_cache",
               "prepare_only", "eval_every", "eval_batches", "world_size", "gpus_per_node", "gpu",
               "hang_minimum_s", "hang_factor", "checkpoint_limit_s", "eval_limit_s", "profile_steps",
               "max_steps", "num_epochs", "wandb", "plot", "export_from"}
STOPPED_BY_SIGNAL = 75              # exit status after a signal-triggered checkpoint: the launcher requeues
HUNG = 3                            # exit status of a rank its watchdog ended
# Process-group timeouts, as torchtitan's set_pg_timeouts: generous until the first step is done (compiling,
# loading weights) and while a checkpoint is written; short after, so a hung collective ends in minutes, not
# half an hour. Longer than hang_minimum_s, so the watchdog names the hang first.
PG_TIMEOUT_FIRST_STEP = timedelta(minutes=30)
PG_TIMEOUT = timedelta(minutes=10)
FR_BUFFER_SIZE = 20000              # NCCL flight recorder: the last collectives kept per rank (torchtitan's)
STRAGGLER_MARGIN = 0.10             # a rank this far above the median compute or data-wait time is named
STRAGGLER_WINDOWS = 3               # named in this many log windows in a row: a warning to exclude its node

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
LOSS_CHUNK_BYTES = 256e6            # the loss computes the fp32 logits of this many bytes at a time


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
        if kind is not float or math.isfinite(value):
            return kind(value)
    if isinstance(value, str) and kind is bool:
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
    elif isinstance(value, str):
        try:
            converted = kind(value)
        except ValueError:
            pass
        else:
            if kind is not float or math.isfinite(converted):
                return converted
    expected = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}[kind]
    raise ConfigError(f"{where}{name} expects {expected}{' or none' if allows_none else ''}, got {value!r}")


def missing_folder(option, value):
    """A value written as a local path (a hub name is NAME or OWNER/NAME) must be an existing folder."""
    local = value.startswith((".", "/", "~")) or value.endswith("/") or value.count("/") > 1
    if local and not os.path.isdir(os.path.expanduser(value)):
        raise ConfigError(f"{option}={value}: no such folder" + (" (it is a file; give the folder holding it)"
                                                                  if os.path.isfile(value) else ""))


def writable_folder(option, path):
    """Creates path and checks a file can be written in it, before any process group or model."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise ConfigError(f"{option}={path} is not writable ({error.strerror}); "
                          f"point it at a writable folder")


def resolve_shape(cfg):
    """The model's transformers config class, its arguments (the preset's, or the init_from model's) and
    its shape with the shape constants applied."""
    import transformers

    if cfg.init_from:
        missing_folder("--init_from", cfg.init_from)
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
    if cfg.mixed_precision == "auto":  # a dry run simulates the GPU
        cfg.mixed_precision = "bf16" if cfg.dry_run or torch.cuda.is_available() else "fp32"
    for name, choices in CHOICES.items():
        if getattr(cfg, name) not in choices:
            raise ConfigError(f"--{name}={getattr(cfg, name)} is not one of: {', '.join(choices)}")
    # Each value out of range is its own line, all of them at once.
    problems = [f"--{name} must be positive, got {getattr(shape, name)}"
                for name in ("n_embd", "n_layer", "n_head", "n_positions", "vocab_size")
                if getattr(shape, name) <= 0]
    problems += [f"--{name} must be positive, got {getattr(cfg, name)}"
                 for name in ("batch_size", "seq_length", "global_batch_size", "num_epochs", "log_every",
                              "checkpoint_every", "max_bad_steps", "ac_every", "gpus_per_node")
                 if getattr(cfg, name) <= 0]
    problems += [f"--{name} must not be negative, got {getattr(cfg, name)}"
                 for name in ("warmup_steps", "weight_decay", "grad_clip", "keep_last")
                 if getattr(cfg, name) < 0]
    if problems:
        raise ConfigError("\n".join(problems))
    if shape.n_embd % shape.n_head:
        raise ConfigError(f"--n_embd={shape.n_embd} is not divisible by --n_head={shape.n_head}")
    if cfg.seq_length > shape.n_positions:
        raise ConfigError(f"--seq_length={cfg.seq_length} exceeds the model's {shape.n_positions} positions; "
                          f"lower --seq_length or raise --n_positions")
    if world_size <= 0:
        raise ConfigError(f"--world_size must be positive, got {world_size}")
    per_micro_step = cfg.batch_size * world_size
    if cfg.global_batch_size % per_micro_step:
        raise ConfigError(f"--global_batch_size={cfg.global_batch_size} is not divisible by batch_size x world size "
                          f"= {cfg.batch_size} x {world_size}; use a multiple of {per_micro_step}")
    if cfg.max_steps == 0 or cfg.max_steps < -1:
        raise ConfigError(f"--max_steps must be positive, or -1 for num_epochs passes, got {cfg.max_steps}")
    if not 0 <= cfg.min_lr <= cfg.lr:
        raise ConfigError(f"--min_lr={cfg.min_lr} must lie between 0 and --lr={cfg.lr}")
    if cfg.init_from and any(getattr(cfg, name) is not None for name in SHAPE_NAMES):
        raise ConfigError(f"--init_from={cfg.init_from} brings its own shape; drop --{', --'.join(SHAPE_NAMES)}")
    if cfg.cpu_offload and cfg.sharding == "ddp":
        raise ConfigError("--cpu_offload=True needs FSDP; it does not work with --sharding=ddp")
    if cfg.resume_from is not None and not os.path.isfile(os.path.join(cfg.resume_from, "trainer_state.json")):
        raise ConfigError(f"--resume_from={cfg.resume_from} is not a complete checkpoint folder (no trainer_state.json)")
    for name in ("hang_minimum_s", "hang_factor", "checkpoint_limit_s", "eval_limit_s"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"--{name} must be positive, got {getattr(cfg, name)}")
    profiled_steps(cfg.profile_steps)
    if cfg.run_name is None:
        identity = {k: v for k, v in vars(cfg).items() if k not in OPERATIONAL}
        digest = hashlib.sha1(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]
        cfg.run_name = f"{cfg.model}-{digest}"


def profiled_steps(text):
    """--profile_steps=A,B as (A, B); None when not set."""
    if text is None:
        return None
    first, _, last = text.partition(",")
    if not (first.strip().isdigit() and last.strip().isdigit() and 1 <= int(first) <= int(last)):
        raise ConfigError(f"--profile_steps={text}: expected two step numbers A,B with 1 <= A <= B, "
                          f"e.g. --profile_steps=5,8")
    return int(first), int(last)


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


HUB_SOURCES = {"wikitext": ("hub", "Salesforce/wikitext", "wikitext-103-raw-v1"), "c4": ("stream", "allenai/c4", "en")}
FILE_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def parse_source(cfg):
    """(kind, name, config) of --data; kind is dummy, hub or local (prepared token files) or stream."""
    problems = [message for wrong, message in (
        (not 0 < cfg.val_fraction < 1, f"--val_fraction must lie between 0 and 1, got {cfg.val_fraction}"),
        (cfg.eval_every < 0, f"--eval_every must not be negative (0: never), got {cfg.eval_every}"),
        (cfg.eval_batches <= 0, f"--eval_batches must be positive, got {cfg.eval_batches}")) if wrong]
    if problems:
        raise ConfigError("\n".join(problems))
    if cfg.data == "dummy":
        return "dummy", None, None
    if cfg.data in HUB_SOURCES:
        source = HUB_SOURCES[cfg.data]
    elif cfg.data.startswith("hf:") and cfg.data[3:]:
        name, _, config = cfg.data[3:].partition(":")
        source = ("stream", name, config or None)
    elif os.path.exists(cfg.data):
        source = ("local", os.path.abspath(cfg.data), None)
    else:
        raise ConfigError(f"--data={cfg.data}: no such file or folder, and not one of dummy, wikitext, c4, hf:NAME[:CONFIG]")
    if source[0] == "stream" and cfg.max_steps == -1:
        raise ConfigError(f"--data={cfg.data} is streamed and has no known length: set --max_steps")
    return source


def hub_needed(cfg):
    """Whether the data, tokenizer or init_from model may have to come from the Hugging Face hub."""
    tokenizer_from_hub = cfg.data != "dummy" and not os.path.isdir(cfg.tokenizer)
    hub_data = cfg.data in HUB_SOURCES or cfg.data.startswith("hf:")
    return tokenizer_from_hub or hub_data or bool(cfg.init_from) and not os.path.isdir(cfg.init_from)


def use_cache_if_hub_unreachable(cfg):
    """One quick request to the hub; when it fails, offline mode: only cached files are used, and what is
    missing fails at once instead of after huggingface_hub's retries (a minute for a tokenizer). Before any
    Hugging Face library is imported: they read HF_HUB_OFFLINE once, at import."""
    import urllib.request

    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") or not hub_needed(cfg):
        return
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=5).close()
    except urllib.error.HTTPError:
        pass  # reachable
    except (OSError, ValueError) as error:
        os.environ["HF_HUB_OFFLINE"] = "1"
        if int(os.environ.get("RANK", 0)) == 0:
            reason = getattr(error, "reason", error)
            print(f"{endpoint} is unreachable ({reason}): using cached files only", flush=True)


def load_tokenizer(cfg, shape):
    """The tokenizer of real data (None for dummy data); the model's vocabulary becomes its size."""
    if cfg.data == "dummy":
        return None
    from transformers import AutoTokenizer

    missing_folder("--tokenizer", cfg.tokenizer)
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot load tokenizer {cfg.tokenizer!r} ({str(error).splitlines()[0]}); "
                          f"`python train.py --prepare_only --data={cfg.data} --tokenizer={cfg.tokenizer}` "
                          f"on a machine with internet caches it") from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"tokenizer {cfg.tokenizer!r} has no EOS token to separate documents with")
    if cfg.vocab_size is not None and len(tokenizer) > cfg.vocab_size:
        raise ConfigError(f"tokenizer {cfg.tokenizer!r} has {len(tokenizer)} tokens, more than --vocab_size={cfg.vocab_size}")
    shape.vocab_size = cfg.vocab_size or len(tokenizer)
    return tokenizer


def tokenize_documents(tokenizer, column):
    """A batched map function: each non-blank text becomes its token ids followed by EOS."""
    def tokenize(batch):
        texts = [text or "" for text in batch[column]]
        ids = tokenizer(texts, verbose=False)["input_ids"]
        return {"input_ids": [doc + [tokenizer.eos_token_id] if text.strip() else [] for text, doc in zip(texts, ids)]}
    return tokenize


def token_dtype(tokenizer):
    return np.uint16 if len(tokenizer) <= 2**16 else np.uint32


def corpus_files(path):
    return [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "**", "*.*"), recursive=True))


def check_utf8(path):
    """A text corpus file must be UTF-8: anything else would fail deep inside datasets."""
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as file:
        while True:
            chunk = file.read(2**24)
            held = len(decoder.getstate()[0])  # the start of a character cut by the previous chunk's end
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as error:
                position = offset - held + error.start
                raise ConfigError(f"--data: {path} is not UTF-8 text (invalid byte at offset {position}); "
                                  f"convert it (iconv -t utf-8) or remove it") from None
            if not chunk:
                return
            offset += len(chunk)


def load_document_splits(cfg, kind, name, config):
    """train and validation splits of wikitext or a local corpus, as map-style datasets."""
    from datasets import load_dataset

    cache_dir = os.path.join(cfg.data_cache, "hf")
    if kind == "hub":
        try:
            splits = load_dataset(name, config, cache_dir=cache_dir)
        except OSError as error:  # unreachable (ConnectionError) or not there
            raise ConfigError(f"cannot load {name} from the Hugging Face hub ({str(error).splitlines()[0]}) and nothing "
                              f"is prepared in {cfg.data_cache}; run `python train.py --prepare_only --data={cfg.data} "
                              f"--tokenizer={cfg.tokenizer} --data_cache={cfg.data_cache}` on a machine with internet") from None
    else:
        files = corpus_files(name)
        formats = sorted({os.path.splitext(path)[1] for path in files} & set(FILE_BUILDERS))
        if len(formats) != 1:  # datasets would silently read only the most common format
            raise ConfigError(f"--data={cfg.data} " + (f"mixes {', '.join(formats)}; keep one format per folder" if formats
                                                       else "has no .txt, .jsonl or .parquet file"))
        if sum(os.path.getsize(path) for path in files) == 0:
            raise ConfigError(f"--data={cfg.data} holds no text")
        for path in files if formats[0] != ".parquet" else []:
            check_utf8(path)
        # In a folder, files named like train/validation/test become those splits (datasets' naming rules).
        where = dict(data_files=name) if os.path.isfile(name) else dict(data_dir=name)
        splits = load_dataset(FILE_BUILDERS[formats[0]], **where, cache_dir=cache_dir)
    if cfg.text_column not in splits["train"].column_names:
        raise ConfigError(f"--text_column={cfg.text_column} is not a column of --data={cfg.data}; "
                          f"columns: {', '.join(splits['train'].column_names)}")
    if "validation" not in splits:
        if splits["train"].num_rows < 2:
            raise ConfigError(f"--data={cfg.data} holds fewer than 2 documents, too few to hold some out for validation")
        held_out = splits["train"].train_test_split(test_size=cfg.val_fraction, seed=0)  # fixed: the same share every run
        splits = {"train": held_out["train"], "validation": held_out["test"]}
    return splits


def read_sidecar(path):
    """The sidecar of a complete token file; None when either is missing, truncated or corrupt."""
    try:
        with open(path + ".json") as file:
            meta = json.load(file)
        if os.path.getsize(path) != meta["tokens"] * np.dtype(meta["dtype"]).itemsize:
            return None
        digest = hashlib.blake2b()
        with open(path, "rb") as file:
            while chunk := file.read(2**26):
                digest.update(chunk)
        return meta if digest.hexdigest() == meta["blake2b"] else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def prepare_token_files(cfg, kind, name, config, tokenizer):
    """Paths of the train and validation token files of wikitext or a local corpus, tokenised on every
    core of the node unless complete. Each is written under a temporary name and renamed, its sidecar
    last, so a file cut short by a crash is never taken for complete."""
    meta = {"source": name, "config": config, "text_column": cfg.text_column, "val_fraction": cfg.val_fraction,
            "tokenizer": cfg.tokenizer, "vocab": len(tokenizer)}
    # The corpus files' sizes and times and the vocabulary are in the key: an edited corpus or tokenizer is prepared anew.
    files = [(f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in (corpus_files(name) if kind == "local" else [])]
    key = hashlib.sha256(json.dumps([meta, files, sorted(tokenizer.get_vocab().items())]).encode()).hexdigest()[:12]
    folder = os.path.join(cfg.data_cache, f"{os.path.basename(name.rstrip('/'))}-{key}")
    paths = {split: os.path.join(folder, f"{split}.bin") for split in ("train", "validation")}
    if all(read_sidecar(path) for path in paths.values()):
        print(f"data: reusing prepared tokens in {folder}", flush=True)
        return paths
    print(f"data: tokenizing --data={cfg.data} with {cfg.tokenizer} into {folder}", flush=True)
    os.makedirs(folder, exist_ok=True)
    import pyarrow.compute as pc

    cores = len(os.sched_getaffinity(0))
    for split, documents in load_document_splits(cfg, kind, name, config).items():
        tokens = documents.map(tokenize_documents(tokenizer, cfg.text_column), batched=True, remove_columns=documents.column_names,
                               num_proc=min(cores, max(1, documents.num_rows // 1000)), desc=f"tokenizing {split}")
        digest, count, temporary = hashlib.blake2b(), 0, f"{paths[split]}.{os.getpid()}.tmp"
        with open(temporary, "wb") as file:
            for table in tokens.with_format("arrow").iter(batch_size=2**16):
                ids = pc.list_flatten(table["input_ids"]).to_numpy().astype(token_dtype(tokenizer))
                ids.tofile(file)
                digest.update(ids)
                count += len(ids)
        if count == 0:
            raise ConfigError(f"--data={cfg.data} holds no text in its {split} split")
        os.replace(temporary, paths[split])
        with open(temporary, "w") as file:
            json.dump({**meta, "split": split, "tokens": count, "dtype": np.dtype(token_dtype(tokenizer)).name,
                       "blake2b": digest.hexdigest()}, file)
        os.replace(temporary, paths[split] + ".json")
    return paths


def shared_token_files(cfg, kind, name, config, tokenizer, rank):
    """Global rank 0 prepares; the others wait (for hours if need be) and get its paths or its error."""
    group = dist.new_group(backend="gloo", timeout=timedelta(hours=12))
    outcome = [None]
    if rank == 0:
        try:
            outcome = [prepare_token_files(cfg, kind, name, config, tokenizer)]
        except ConfigError as error:
            outcome = [error]
    dist.broadcast_object_list(outcome, src=0, group=group)
    if isinstance(outcome[0], ConfigError):
        raise outcome[0]
    return outcome[0]


def prefetched(items, depth):
    """items produced up to depth ahead by a daemon thread, so reading and tokenising overlap the
    training step; an error in the thread is raised here."""
    ahead = queue.Queue(depth)

    def produce():
        try:
            for item in items:
                ahead.put(item)
        except Exception as error:
            ahead.put(error)

    threading.Thread(target=produce, daemon=True).start()
    while True:
        item = ahead.get()
        if isinstance(item, Exception):
            raise item
        yield item


class Batches:
    """This rank's micro-batches (inputs, targets). state_dict() is the json-able position after the
    last completed optimizer step (every accumulation-th micro-batch), whatever was read ahead;
    load_state_dict() restores it before the first batch is taken."""

    def __init__(self, accumulation, device, prefetch):
        self.accumulation, self.device, self.prefetch = accumulation, device, prefetch
        self.items, self.taken, self.position = None, 0, None

    def state_dict(self):
        return json.loads(json.dumps(self.position))

    def load_state_dict(self, state):
        if self.items is not None:
            raise RuntimeError("load_state_dict must come before the first batch")
        self.position = json.loads(json.dumps(state))

    def __next__(self):
        if self.items is None:
            self.items = prefetched(self.produce(), 4 * self.accumulation) if self.prefetch else self.produce()
        windows, position = next(self.items)
        self.taken += 1
        if self.taken % self.accumulation == 0:
            self.position = position
        windows = torch.from_numpy(windows)
        if self.device.type == "cuda":
            windows = windows.pin_memory().to(self.device, non_blocking=True)
        return windows[:, :-1], windows[:, 1:]


def token_window(tokens, seq_length, index):
    """Window index of a token file: seq_length + 1 tokens, sharing its first with the previous window's last."""
    return tokens[index * seq_length: (index + 1) * seq_length + 1]


@functools.lru_cache(maxsize=2)
def epoch_order(n_windows, seed, epoch):
    return np.random.default_rng([seed, epoch]).permutation(n_windows)


class WindowBatches(Batches):
    """window(i) is window i of n_windows. Sample g of the run is window g mod n of epoch g // n, in
    a seeded order per epoch when shuffled; rank r of micro-step m of step k reads samples
    k·G + (m·W + r)·B ..., so the global batch of a step is the same for every world size. The
    position {epoch, offset} is the first sample of the next step."""

    def __init__(self, window, n_windows, cfg, world_size, rank, accumulation, device, prefetch, shuffle):
        super().__init__(accumulation, device, prefetch)
        self.window, self.n_windows, self.world_size, self.rank = window, n_windows, world_size, rank
        self.batch_size, self.seed, self.shuffle = cfg.batch_size, cfg.seed, shuffle
        self.step_samples = accumulation * world_size * cfg.batch_size
        self.position = {"epoch": 0, "offset": 0}

    def produce(self):
        step = (self.position["epoch"] * self.n_windows + self.position["offset"]) // self.step_samples
        while True:
            epoch, offset = divmod((step + 1) * self.step_samples, self.n_windows)
            for micro in range(self.accumulation):
                first = step * self.step_samples + (micro * self.world_size + self.rank) * self.batch_size
                rows = []
                for sample in range(first, first + self.batch_size):
                    sample_epoch, index = divmod(sample, self.n_windows)
                    rows.append(self.window(epoch_order(self.n_windows, self.seed, sample_epoch)[index] if self.shuffle else index))
                yield np.stack(rows).astype(np.int64), {"epoch": epoch, "offset": offset}
            step += 1


class StreamingBatches(Batches):
    """Packs a tokenised stream on the fly: documents joined by EOS and cut into batch_size windows
    of seq_length + 1; after the stream's end it starts again. The position is the stream's own
    state plus the tokens it read but has not used."""

    def __init__(self, documents, cfg, accumulation, device, prefetch):
        super().__init__(accumulation, device, prefetch)
        self.documents, self.batch_size, self.batch_tokens = documents, cfg.batch_size, cfg.batch_size * (cfg.seq_length + 1)
        self.start = documents.state_dict()
        self.position = {"stream": self.start, "buffer": []}

    def produce(self):
        stream, buffer = self.position["stream"], list(self.position["buffer"])
        while True:
            self.documents.load_state_dict(stream)
            tokens_read = 0
            for document in self.documents:
                buffer += document["input_ids"]
                tokens_read += len(document["input_ids"])
                while len(buffer) >= self.batch_tokens:
                    windows = np.array(buffer[:self.batch_tokens], dtype=np.int64).reshape(self.batch_size, -1)
                    del buffer[:self.batch_tokens]
                    yield windows, {"stream": self.documents.state_dict(), "buffer": list(buffer)}
            if not tokens_read:
                raise ValueError("this rank's share of the stream holds no text")
            stream = self.start


def stream_splits(cfg, name, config, tokenizer, world_size, rank):
    """This rank's share of the tokenised train and validation (None if absent) streams of a hub dataset."""
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node

    try:
        splits = load_dataset(name, config, streaming=True)
    except OSError as error:  # unreachable (ConnectionError) or not there
        raise ConfigError(f"cannot load {name} from the Hugging Face hub ({str(error).splitlines()[0]}); streaming "
                          f"needs it during training: use a local copy as --data=PATH instead") from None
    columns = splits["train"].column_names
    if columns is not None and cfg.text_column not in columns:
        raise ConfigError(f"--text_column={cfg.text_column} is not a column of --data={cfg.data}; columns: {', '.join(columns)}")
    tokenize = tokenize_documents(tokenizer, cfg.text_column)
    return [split_dataset_by_node(splits[split], rank=rank, world_size=world_size).map(tokenize, batched=True)
            if split in splits else None for split in ("train", "validation")]


def open_batches(cfg, source, shape, tokenizer, world_size, rank, accumulation, device):
    """(training batches, a function returning fresh validation batches or None, steps per epoch or None)."""
    kind, name, config = source
    if kind == "dummy":
        window = lambda index: dummy_sample(index, cfg.seq_length, shape.vocab_size, cfg.seed).numpy()
        batches = WindowBatches(window, DUMMY_EPOCH_SAMPLES, cfg, world_size, rank, accumulation, device, prefetch=True, shuffle=False)
        return batches, None, DUMMY_EPOCH_SAMPLES // cfg.global_batch_size
    if kind == "stream":
        train, validation = stream_splits(cfg, name, config, tokenizer, world_size, rank)
        evaluation = (lambda: StreamingBatches(validation, cfg, 1, device, prefetch=False)) if validation else None
        return StreamingBatches(train, cfg, accumulation, device, prefetch=True), evaluation, None
    paths = shared_token_files(cfg, kind, name, config, tokenizer, rank)
    tokens = {split: np.memmap(path, dtype=token_dtype(tokenizer), mode="r") for split, path in paths.items()}
    windows = {split: (len(split_tokens) - 1) // cfg.seq_length for split, split_tokens in tokens.items()}
    if windows["train"] < cfg.global_batch_size:
        raise ConfigError(f"--data={cfg.data} has {len(tokens['train']):,} training tokens, fewer than one global batch "
                          f"({cfg.global_batch_size} x {cfg.seq_length + 1}); lower --global_batch_size or --seq_length")
    if windows["validation"] < 1:
        raise ConfigError(f"the validation split of --data={cfg.data} is shorter than one sequence; raise --val_fraction")
    window = {split: functools.partial(token_window, split_tokens, cfg.seq_length) for split, split_tokens in tokens.items()}
    train = WindowBatches(window["train"], windows["train"], cfg, world_size, rank, accumulation, device, prefetch=True, shuffle=True)
    evaluation = lambda: WindowBatches(window["validation"], windows["validation"], cfg, world_size, rank, 1, device,
                                       prefetch=False, shuffle=False)
    return train, evaluation, windows["train"] // cfg.global_batch_size


@torch.no_grad()
def evaluate(model, batches, n_batches, world_size):
    """Mean validation loss over n_batches micro-batches of every rank."""
    model.eval()
    total = sum(model_loss(model, inputs, targets) for inputs, targets in (next(batches) for _ in range(n_batches)))
    model.train()
    dist.all_reduce(total)
    return total.item() / (n_batches * world_size)


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
    """The ModuleList of the family's own decoder-layer class, the unit transformers names for sharding; also
    once its layers are wrapped for checkpointing and sharded (fully_shard names the class FSDP<name>)."""
    def layer_class(layer):
        return type(getattr(layer, "_checkpoint_wrapped_module", layer)).__name__.removeprefix("FSDP")
    return next(m for m in model.modules()
                if isinstance(m, torch.nn.ModuleList) and layer_class(m[0]) in model._no_split_modules)


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


def precision_policy(cfg):
    """FSDP's mixed precision for --mixed_precision=bf16: bf16 compute, fp32 master weights and gradient
    reduction. Inputs are not cast per block (torchtitan's choice): the embeddings already hand bf16 on."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if cfg.mixed_precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)


def unpacked_sequences(position_ids):
    """Every row of a batch is one window of a corpus, never several documents packed together. transformers
    asks its data to find out, which costs a device-to-host sync per forward and, on fake tensors, a full
    seq x seq mask that a real run never allocates."""
    return None


# Op-level selective checkpointing (torchtitan's "op" mode) keeps these outputs of every block and recomputes
# the rest: attention (the costliest to recompute per byte), every other matmul, and FSDP's reduce-scatter.
# GPT-2's Conv1D layers are addmm, Llama's linear layers mm.
SAVED_OPS = {"aten.mm.default", "aten.addmm.default", "aten._scaled_dot_product_flash_attention.default",
             "aten._scaled_dot_product_efficient_attention.default", "aten._scaled_dot_product_cudnn_attention.default",
             "aten._scaled_dot_product_flash_attention_for_cpu.default", "_c10d_functional.reduce_scatter_tensor.default"}
MATMULS = {"aten.mm.default", "aten.addmm.default"}


def op_level_checkpointing():
    """A context for one checkpointed forward and its recomputation: both count matmuls the same way, so
    the recomputation replays exactly the matmuls the forward did not save."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    matmuls_seen = {False: 0, True: 0}  # by is_recompute

    def policy(ctx, op, *args, **kwargs):
        name = str(op)
        if name in MATMULS:
            matmuls_seen[ctx.is_recompute] += 1
            if matmuls_seen[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if name in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpointed(index, cfg):
    """Whether decoder layer index is wrapped in activation checkpointing, and with which context."""
    mode = cfg.activation_checkpointing
    if mode == "op":
        return {"context_fn": op_level_checkpointing}
    if mode == "full" or mode == "selective" and (index + 1) % cfg.ac_every == 0:
        return {}
    return None


def build_model(config, cfg, device, mesh):
    """The model wrapped for training, weights allocated but not yet initialised (init_weights or
    load_pretrained follow)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    import transformers.masking_utils

    transformers.masking_utils.find_packed_sequence_indices = unpacked_sequences
    model = build_meta_model(config)
    blocks = decoder_layers(model)
    for index, block in enumerate(blocks):
        if (checkpoint_options := checkpointed(index, cfg)) is not None:
            block = checkpoint_wrapper(block, preserve_rng_state=False, **checkpoint_options)
        if cfg.compile:
            block.compile()
        blocks[index] = block
    if cfg.sharding == "ddp":
        model.to_empty(device=device)
        model.tie_weights()  # to_empty gave the tied modules a new tensor each (fully_shard keeps them shared)
        init_rotary_embeddings(model, device)
        if cfg.mixed_precision == "bf16":  # FSDP's mixed precision: bf16 compute, fp32 weights and gradient reduction
            model.forward = torch.autocast(device.type, dtype=torch.bfloat16)(model.forward)
        return model
    fsdp_kwargs = dict(mesh=mesh, mp_policy=precision_policy(cfg))
    if cfg.cpu_offload:
        fsdp_kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in blocks:
        fully_shard(block, reshard_after_forward=cfg.sharding != "grad_op", **fsdp_kwargs)
    # Untied input embeddings are their own unit, freed after forward until the end of backward (1 GB
    # gathered at 8B, measured in docs/PERFORMANCE.md); tied ones are one tensor with the output layer.
    embeddings = model.get_input_embeddings()
    if embeddings.weight is not model.get_output_embeddings().weight:
        fully_shard(embeddings, reshard_after_forward=cfg.sharding != "grad_op", **fsdp_kwargs)
    # The root (embeddings, final norm, output layer) stays gathered after forward: the loss and the
    # backward need it at once.
    fully_shard(model, reshard_after_forward=False, **fsdp_kwargs)
    model.to_empty(device="cpu" if cfg.cpu_offload else device)
    init_rotary_embeddings(model, device)
    return model


def wrap_ddp(model, device):
    """DDP after initialisation: its constructor broadcasts rank 0's weights."""
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)


def final_hidden_states(model, inputs):
    """The last decoder layer's output after the final norm, taken through the model's own forward (so that
    FSDP and DDP hooks run) with the output layer applied to no position."""
    captured = []
    body = getattr(model, "module", model).base_model
    handle = body.register_forward_hook(lambda module, args, output: captured.append(output.last_hidden_state))
    try:
        model(input_ids=inputs, logits_to_keep=torch.empty(0, dtype=torch.long, device=inputs.device))
    finally:
        handle.remove()
    return captured[0]


def chunk_cross_entropy(output_layer, hidden, targets):
    return F.cross_entropy(output_layer(hidden).float(), targets, reduction="sum")


def model_loss(model, inputs, targets, chunk_tokens=None):
    """Mean next-token cross-entropy. The output layer and the loss run over chunks of the tokens, each
    checkpointed: the forward keeps no logits, and the backward recomputes one chunk's at a time, so the
    full fp32 logits, their log-softmax and gradient never exist together (a few GB at 4b and batch 8)."""
    from torch.utils.checkpoint import checkpoint

    hidden = final_hidden_states(model, inputs).flatten(0, 1)
    targets = targets.flatten()
    output_layer = getattr(model, "module", model).get_output_embeddings()
    if chunk_tokens is None:  # fp32 logits of one chunk: LOSS_CHUNK_BYTES at most
        chunk_tokens = max(1, int(LOSS_CHUNK_BYTES // (4 * output_layer.out_features)))
    total = sum(checkpoint(chunk_cross_entropy, output_layer, h, t, use_reentrant=False)
                for h, t in zip(hidden.split(chunk_tokens), targets.split(chunk_tokens)))
    return total / targets.numel()


# --------------------------------------------------------------------------------------------
# Optimizer and schedule
# --------------------------------------------------------------------------------------------
def build_optimizer(model, cfg, fused):
    """AdamW; biases, norms and embeddings get no weight decay."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    decay, no_decay = [], []
    for param in model.parameters():
        (decay if param.ndim >= 2 and id(param) not in embeddings else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def lr_factor(step, cfg, total_steps):
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    return (cfg.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)) / cfg.lr


def clip_gradients(parameters, max_norm):
    """The global gradient norm, and the gradients scaled to max_norm (0: not clipped). With foreach kernels
    over DTensors too, where clip_grad_norm_ falls back to one kernel per tensor (as torchtitan does)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, norm, foreach=True)
    return norm


def host_values(tensor):
    """The step's one device-to-host synchronisation. A simulated step's fake tensors hold no values."""
    from torch._subclasses.fake_tensor import is_fake

    return [0.0] * tensor.numel() if is_fake(tensor) else tensor.tolist()


def train_step(model, batches, optimizer, accumulation, grad_clip, stop_requests):
    """One optimizer step, as the training loop and the dry run's simulation both take it: per micro-batch a
    forward, the loss and a backward, then clipping and the update, skipped when the gradient norm is not
    finite. Under FSDP each micro-step reduce-scatters its gradients (as torchtitan does): skipping that
    would keep a whole unsharded fp32 gradient alive between micro-steps. DDP all-reduces on the last one.
    stop_requests is the list the signal handler appends to, read as late as possible. Returns the mean loss
    (a device tensor), the gradient norm and whether any rank asked to stop."""
    loss = 0.0
    for micro in range(accumulation):
        inputs, targets = next(batches)
        defer_sync = isinstance(model, torch.nn.parallel.DistributedDataParallel) and micro < accumulation - 1
        with model.no_sync() if defer_sync else contextlib.nullcontext():
            micro_loss = model_loss(model, inputs, targets) / accumulation
            micro_loss.backward()
        loss += micro_loss.detach()
    grad_norm = clip_gradients(model.parameters(), grad_clip)
    stop = torch.full((), float(len(stop_requests)), device=grad_norm.device)
    dist.all_reduce(stop)  # any rank may get the signal; all stop at the same step
    grad_norm, stop = host_values(torch.stack([grad_norm, stop]))
    if math.isfinite(grad_norm):  # the norm is global, so every rank takes the same branch
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm, stop > 0


# --------------------------------------------------------------------------------------------
# Dry run: the training step above, run on fake tensors over a fake process group at the target world
# size, so that a CPU answers "does it fit?" with the real model, wrapping and step.
# --------------------------------------------------------------------------------------------
# The tracker's categories, in the words of the dry run's report.
MEMORY_CATEGORIES = {
    "sharded parameters": ("Sharded Param", "Parameter", "Buffer"),
    "gathered parameters": ("Unsharded Param", "All Gather"),
    "gradients": ("Sharded Grad", "Unsharded Grad", "Reduce Scatter", "Gradient"),
    "optimizer state": ("OptState", "Optstate"),
    "activations": ("Activation", "Inputs"),
    "temporaries": ("Temp", "Other"),
}
OFFLOADED = ("sharded parameters", "gradients", "optimizer state")
ESTIMATES = {
    "sharding": ("ddp", "estimated for DDP: FSDP simulated at world size 1 (every rank holds the whole model, as DDP "
                        "does), plus DDP's gradient buckets, 4 bytes a parameter"),
    "cpu_offload": (True, "estimated for cpu_offload: the simulation without offloading, less the sharded parameters, "
                          "gradients and optimizer state, which offloading keeps in host memory"),
}
SIMULATION_BLIND_SPOTS = ("allocator fragmentation, NCCL buffers and the CUDA context (leave a few GB); CPU SDPA stands in "
                          "for flash attention (both keep the same tensors); blocks run eager, where compiled ones keep "
                          "no more")


def device_mesh(cfg, device_type, world_size, local_world_size):
    from torch.distributed.device_mesh import init_device_mesh

    if cfg.sharding == "hybrid":
        if world_size % local_world_size:
            raise ConfigError(f"--sharding=hybrid needs the same number of processes on every node "
                              f"({world_size} over nodes of {local_world_size})")
        return init_device_mesh(device_type, (world_size // local_world_size, local_world_size),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (world_size,))


def simulate_peak_memory(cfg, config, world_size):
    """Peak bytes per GPU by category over one optimizer step, the second of two (the first allocates the
    optimizer state, and fake DTensors allocate extra once). Two micro-steps stand for any accumulation:
    with gradients reduce-scattered every micro-step, the third looks like the second."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    accumulation = min(2, cfg.global_batch_size // (cfg.batch_size * world_size))
    simulated = copy.copy(cfg)
    simulated.cpu_offload = False  # see report_dry_run: offloading is subtracted, not simulated
    simulated.compile = False  # inductor does not run on fake tensors; eager keeps at least what it keeps
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        mesh = device_mesh(simulated, "cpu", world_size, cfg.gpus_per_node)
        with FakeTensorMode():
            device = torch.device("cpu")
            model = build_model(config, simulated, device, mesh)
            optimizer = build_optimizer(model, cfg, fused=True)
            tokens = torch.randint(0, config.vocab_size, (cfg.batch_size, cfg.seq_length))
            batches = itertools.repeat((tokens, tokens))
            train_step(model, batches, optimizer, 1, cfg.grad_clip, [])
            tracker = FSDPMemTracker(model, optimizer)
            with tracker:
                # The tracker takes a second forward of the root for a second iteration; a micro-step is not.
                hook = model.register_forward_pre_hook(lambda *_: tracker.reset_mod_stats(), prepend=True)
                train_step(model, batches, optimizer, accumulation, cfg.grad_clip, [])
                hook.remove()
            snapshot = tracker.get_tracker_snapshot("peak")
    finally:
        dist.destroy_process_group()
    by_kind = {getattr(kind, "value", kind): size for device_snapshot in snapshot.values()
               for kind, size in device_snapshot.items()}
    return {name: sum(by_kind.get(kind, 0) for kind in kinds) for name, kinds in MEMORY_CATEGORIES.items()}


def peak_gb(cfg, config, world_size, n_params):
    """Peak per GPU in GB by category. DDP's replicas cannot be faked (DDP reads its parameters' data), and
    CPU tensors on a CPU cannot be told apart from GPU ones: both are estimated from a simulation, as
    ESTIMATES says."""
    if cfg.sharding == "ddp":
        memory = simulate_peak_memory(types.SimpleNamespace(**{**vars(cfg), "sharding": "full"}), config, 1)
        memory["gradients"] += 4 * n_params
    else:
        memory = simulate_peak_memory(cfg, config, world_size)
    if cfg.cpu_offload:
        memory.update({name: 0 for name in OFFLOADED})
    return {name: size / 1e9 for name, size in memory.items()}


def hardware_flops_per_token(cfg, model, config, model_flops):
    """What the GPU computes per token, recomputation included. model_flops (6·N + 12·L·H·Q·T) is three
    forwards' worth; of one forward, the output layer is 2·vocab·width and attention 4·L·H·Q·T. The chunked
    loss recomputes the output layer; full checkpointing every block's forward, selective every
    ac_every-th block's, op-level every other matmul (attention outputs are kept). A recomputation stops
    at the last tensor backward needs, so a block's last matmul, the MLP's output projection, is not redone."""
    layers = config.num_hidden_layers
    output_forward = 2 * config.vocab_size * config.hidden_size
    attention_forward = 4 * layers * config.hidden_size * cfg.seq_length
    active = getattr(config, "num_experts_per_tok", 1) / getattr(config, "num_local_experts", 1)
    name, last = [(n, p) for n, p in decoder_layers(model)[0].named_parameters() if p.ndim >= 2][-1]
    redone_forward = model_flops / 3 - output_forward - 2 * layers * last.numel() * (active if "experts" in name else 1)
    recomputed = {"none": 0, "full": redone_forward, "selective": redone_forward * (layers // cfg.ac_every) / layers,
                  "op": (redone_forward - attention_forward) / 2}[cfg.activation_checkpointing]
    return model_flops + recomputed + output_forward


def gpu_memory_gb(gpu):
    """--gpu as (its name, its memory in GB): a name of benchmark.py's datasheet, or a number of GB (no name)."""
    from benchmark import datasheet

    if gpu is None:
        return None, None
    try:
        return None, float(gpu)
    except ValueError:
        sheet = datasheet(gpu)
    if sheet is None:
        raise ConfigError(f"--gpu={gpu} is not in benchmark.py's datasheet; give its memory in GB instead, e.g. --gpu=80")
    return gpu, sheet["memory_GB"]


def changes_that_might_fit(cfg):
    """The changes to try, least costly first: full activation checkpointing, then smaller micro-batches
    with more accumulation (the same global batch), then offloading the model state to host memory."""
    change = {} if cfg.activation_checkpointing == "full" else {"activation_checkpointing": "full"}
    if change:
        yield dict(change)
    batch = cfg.batch_size
    while batch > 1:
        batch //= 2
        change["batch_size"] = batch
        yield dict(change)
    if cfg.sharding != "ddp" and not cfg.cpu_offload:
        yield dict(change, cpu_offload=True)


def report_dry_run(cfg, config, shape, meta_model, world_size):
    """Prints the config, the model, the simulated peak memory per GPU, FLOPs per token and a verdict.
    Exit status: 0 fits, 1 does not fit, 2 bad input."""
    try:
        gpu_name, gpu_gb = gpu_memory_gb(cfg.gpu)
    except ConfigError as error:
        fail(error)
    n_params = sum(p.numel() for p in meta_model.parameters())
    print("config:", " ".join(f"{k}={v}" for k, v in vars(cfg).items()))
    print(f"model: {cfg.init_from or cfg.model} ({type(config).__name__}) n_embd={shape.n_embd} n_layer={shape.n_layer} "
          f"n_head={shape.n_head} n_positions={shape.n_positions} vocab={config.vocab_size}")
    print(f"parameters: {n_params:,} ({n_params / 1e9:.2f}B)")
    model_flops = flops_per_token(meta_model, config, cfg.seq_length)
    hardware_flops = hardware_flops_per_token(cfg, meta_model, config, model_flops)
    print(f"FLOPs per token: {model_flops / 1e9:.4g} G for MFU (6·N + 12·L·H·Q·T), {hardware_flops / 1e9:.4g} G computed "
          f"with recomputation: at most {model_flops / hardware_flops:.0%} MFU")
    started = time.perf_counter()
    memory = peak_gb(cfg, config, world_size, n_params)
    total = sum(memory.values())
    print(f"simulated one training step on fake tensors: world size {world_size}, sharding={cfg.sharding}, "
          f"{cfg.mixed_precision}, activation_checkpointing={cfg.activation_checkpointing}, "
          f"batch {cfg.batch_size} x {cfg.seq_length} ({time.perf_counter() - started:.0f} s)")
    for name, gb in memory.items():
        print(f"  {name:<22} {gb:9.3f} GB")
    for name, (value, estimate) in ESTIMATES.items():
        if getattr(cfg, name) == value:
            print(f"  {estimate}")
    print(f"not simulated: {SIMULATION_BLIND_SPOTS}")
    target = "unknown" if gpu_gb is None else f"{gpu_gb:g} GB" + (f" ({gpu_name})" if gpu_name else "")
    print(f"peak memory per GPU (simulated): {total:.1f} GB of {target}")
    if gpu_gb is None:
        print("verdict: not judged; name the GPU with --gpu")
        return 0
    if total <= gpu_gb:
        print(f"verdict: fits, {gpu_gb - total:.1f} GB to spare")
        return 0
    for change in changes_that_might_fit(cfg):
        candidate = types.SimpleNamespace(**{**vars(cfg), **change})
        peak = sum(peak_gb(candidate, config, world_size, n_params).values())
        if peak <= gpu_gb:
            flags = " ".join(f"--{name}={value}" for name, value in change.items())
            print(f"verdict: does not fit; fits with {flags} (simulated {peak:.2f} GB)")
            return 1
    print("verdict: does not fit, and no change tried fits (full activation checkpointing, batch_size 1, cpu_offload): "
          "use more GPUs or a smaller model")
    return 1


def check_machine_holds(cfg, n_params, world_size, local_world_size):
    """Refuses, before any model is built, a run whose weights, gradients and AdamW state alone (16 bytes a
    parameter in fp32, sharded over the ranks) exceed this node's memory: GPU memory, or host memory."""
    from benchmark import available_memory_bytes

    shards = 1 if cfg.sharding == "ddp" else world_size
    if torch.cuda.is_available():
        needed, where = 16 * n_params / shards, "per GPU"
        available = torch.cuda.get_device_properties(0).total_memory
    else:
        needed, where = 16 * n_params / shards * local_world_size, "of host memory on this node"
        available = available_memory_bytes()
    if needed > available:
        fix = ("on GPUs, check a config with python train.py --dry_run" if torch.cuda.is_available()
               else "on a CPU use --model=tiny; for GPUs, sbatch slurm_submit.sh (check first with python train.py --dry_run)")
        fail(f"--model={cfg.init_from or cfg.model} needs at least {needed / 1e9:.1f} GB {where} for its weights, gradients "
             f"and optimizer state; {available / 1e9:.1f} GB are available: {fix}")


# --------------------------------------------------------------------------------------------
# Checkpoints: <checkpoint_dir>/<run_name>/step_<N>/, written under a temporary name and renamed
# once every rank has finished, so a folder named step_<N> is always complete. Its manifest.json
# holds a CRC-32 checksum of every other file, checked before any tensor is loaded.
# --------------------------------------------------------------------------------------------
MANIFEST = "manifest.json"
HASH_CHUNK = 64 << 20
RUN_LOCK = "trainer.lock"
LOCK_HEARTBEAT_S = 30
LOCK_STALE_S = 300                  # a lock whose heartbeat is this old, held on another host, is abandoned


def checkpoint_steps(run_dir):
    """Steps of the step_N folders of a run, oldest first (step_N.tmp folders are not complete)."""
    return sorted(int(m.group(1)) for name in os.listdir(run_dir) if (m := re.fullmatch(r"step_(\d+)", name)))


def newest_checkpoint(run_dir):
    steps = checkpoint_steps(run_dir)
    return os.path.join(run_dir, f"step_{steps[-1]}") if steps else None


def model_and_optimizer_state(model, optimizer, full):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=full, cpu_offload=full))


def hash_threads():
    return max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def file_checksum(path):
    """Size and CRC-32 of the CRC-32s of the file's 64 MiB chunks, hashed on parallel threads (zlib releases
    the GIL). CRC-32 finds accidental corruption, which is what a checkpoint meets, at twice SHA-256's speed
    (2.0 against 1.0 GB/s a core here), so checksums cost a save a quarter of its time, not half."""
    size = os.path.getsize(path)
    with open(path, "rb") as file, ThreadPoolExecutor(hash_threads()) as pool:
        def digest(offset):
            return zlib.crc32(os.pread(file.fileno(), HASH_CHUNK, offset)).to_bytes(4, "big")
        digests = pool.map(digest, range(0, size, HASH_CHUNK))
        return {"size": size, "crc32": f"{zlib.crc32(b''.join(digests)):08x}"}


def own_files(folder, rank):
    """The files of a checkpoint this rank wrote: its DCP shards and RNG file; rank 0 also the shared ones."""
    per_rank = re.compile(r"__(\d+)_\d+\.distcp|rank(\d+)\.pt")
    return sorted(name for name in os.listdir(folder) if name != MANIFEST and (
        (m := per_rank.fullmatch(name)) and str(rank) in m.groups() or not m and rank == 0))


def save_error(error):
    """One line for a failed write. DCP's CheckpointException holds each rank's error with its traceback."""
    failures = getattr(error, "failures", None)
    if failures:
        error = next(iter(failures.values()))[0]
    return " ".join(str(error).split()) or type(error).__name__


def space_left(path):
    try:
        return f"{shutil.disk_usage(path).free / 2**20:.0f} MiB free there"
    except OSError:
        return "free space unknown"


def save_errors():
    """What a failed write raises: OSError, RuntimeError from torch.save, CheckpointException (a
    BaseException) from DCP, SafetensorError from the export."""
    from safetensors import SafetensorError
    from torch.distributed.checkpoint import CheckpointException

    return OSError, RuntimeError, CheckpointException, SafetensorError


def lock_is_stale(holder, age):
    """The holder is gone: the same SLURM job, requeued; or it ran on this host and its pid is dead;
    or, on another host, its heartbeat stopped."""
    if holder.get("job_id") and holder["job_id"] == os.environ.get("SLURM_JOB_ID"):
        return True
    if holder.get("host") == socket.gethostname():
        try:
            os.kill(holder["pid"], 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, run by another user
            return False
        return False
    return age > LOCK_STALE_S


def take_run_lock(run_dir):
    """One trainer per run: rank 0 holds <run_dir>/trainer.lock (host, pid, SLURM job id), its mtime
    refreshed as a heartbeat. Returns the lock's path; a live holder is a ConfigError naming it."""
    path = os.path.join(run_dir, RUN_LOCK)
    mine = f"{path}.{socket.gethostname()}.{os.getpid()}"
    with open(mine, "w") as file:
        json.dump({"host": socket.gethostname(), "pid": os.getpid(), "job_id": os.environ.get("SLURM_JOB_ID")},
                  file)
    try:
        while True:
            try:
                os.link(mine, path)  # atomic, and fails if the lock exists, also on NFS
                break
            except FileExistsError:
                pass
            try:
                with open(path) as file:
                    holder = json.load(file)
                age = time.time() - os.path.getmtime(path)
            except FileNotFoundError:  # released meanwhile
                continue
            except (OSError, ValueError):
                holder, age = {}, 0.0
            if not lock_is_stale(holder, age):
                job = f", SLURM job {holder['job_id']}" if holder.get("job_id") else ""
                raise ConfigError(f"run {run_dir} is already being trained by pid {holder.get('pid', '?')} "
                                  f"on {holder.get('host', '?')}{job} (lock {path}); wait for it to finish, "
                                  f"or set another --run_name or --checkpoint_dir")
            try:  # the rename lets only one of several launches take a stale lock over
                os.rename(path, mine + ".stale")
            except FileNotFoundError:
                continue
            os.remove(mine + ".stale")
            print(f"taking over the lock of run {run_dir} from pid {holder.get('pid', '?')} on "
                  f"{holder.get('host', '?')}, which is gone", flush=True)
    finally:
        os.remove(mine)

    def heartbeat():
        while True:
            time.sleep(LOCK_HEARTBEAT_S)
            try:
                os.utime(path)
            except OSError:
                pass
    threading.Thread(target=heartbeat, daemon=True).start()
    return path


def release_run_lock(path):
    try:
        with open(path) as file:
            if json.load(file)["pid"] == os.getpid():
                os.remove(path)
    except (OSError, ValueError, KeyError):
        pass


class Checkpointer:
    """Saves and restores everything an exact resume needs: model, optimizer, schedule, step, tokens
    seen, data position, RNG states and the config. Tensors go through torch.distributed.checkpoint;
    the rest is JSON and a small per-rank file of RNG states and data position, read with
    weights_only=True, so nothing is unpickled on load."""

    def __init__(self, cfg, rank, world_size):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.run_dir = os.path.join(cfg.checkpoint_dir, cfg.run_name)
        self.pending = None  # (future of (error, checksums), temporary folder, final folder) of an async save
        # Background saves talk over their own group so they never interleave with training collectives.
        self.group = dist.new_group(backend="gloo") if cfg.async_checkpoint else None
        self.hasher = ThreadPoolExecutor(1) if cfg.async_checkpoint else None
        self.stager = None
        if cfg.async_checkpoint and torch.cuda.is_available():
            from torch.distributed.checkpoint.staging import BlockingAsyncStager

            # One pinned host copy of this rank's state, reused by every save (as torchtitan stages): the
            # device-to-host copy runs at full PCIe/C2C speed, and no save allocates host memory again.
            self.stager = BlockingAsyncStager(cache_staged_state_dict=True)

    def gather(self, value):
        values = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def checksums(self, temporary):
        """(None, this rank's files' checksums), or (the error, None)."""
        try:
            return None, {name: file_checksum(os.path.join(temporary, name))
                          for name in own_files(temporary, self.rank)}
        except OSError as error:
            return save_error(error), None

    def written(self, future, temporary):
        """The outcome of a background save, then the checksums of its files: runs on the hasher thread."""
        try:
            future.result()
        except save_errors() as error:
            return save_error(error), None
        return self.checksums(temporary)

    def save(self, step, model, optimizer, scheduler, batches, trainer_state):
        import torch.distributed.checkpoint as dcp

        self.finish()
        final = os.path.join(self.run_dir, f"step_{step}")
        temporary = final + ".tmp"
        error = None
        if self.rank == 0:
            try:
                shutil.rmtree(temporary, ignore_errors=True)  # left by a save that was killed
                os.makedirs(temporary)
            except OSError as failure:
                error = save_error(failure)
        if problem := next(filter(None, self.gather(error)), None):
            self.abandon(temporary, problem)
        full = self.cfg.ckpt_format == "full"
        model_state, optimizer_state = model_and_optimizer_state(model, optimizer, full)
        state = {"model": model_state, "optimizer": optimizer_state}
        try:
            if full:
                if self.rank == 0:
                    torch.save(state, os.path.join(temporary, "state_dict.pt"))
            elif self.cfg.async_checkpoint:
                future = dcp.async_save(state, checkpoint_id=temporary, process_group=self.group,
                                        async_stager=self.stager)
                self.pending = (self.hasher.submit(self.written, future, temporary), temporary, final)
            else:
                dcp.save(state, checkpoint_id=temporary)
            # The data position is per rank for streams; RNG states are per rank always.
            torch.save({"rng": rng_states(), "data": batches.state_dict()}, os.path.join(temporary, f"rank{self.rank}.pt"))
            if self.rank == 0:
                trainer_state = {**trainer_state, "scheduler": scheduler.state_dict(), "world_size": self.world_size,
                                 "data": batches.state_dict()}
                with open(os.path.join(temporary, "trainer_state.json"), "w") as f:
                    json.dump(trainer_state, f, indent=1)
        except save_errors() as failure:
            error = save_error(failure)
        if self.pending is None:
            self.publish(temporary, final, (error, None) if error else self.checksums(temporary))
        elif problem := next(filter(None, self.gather(error)), None):
            self.abandon(temporary, problem)

    def finish(self):
        """Waits for a background save and its checksums, then publishes it."""
        if self.pending is not None:
            outcome, temporary, final = self.pending
            self.pending = None
            self.publish(temporary, final, outcome.result())

    def publish(self, temporary, final, outcome):
        """outcome: this rank's (error, checksums). Rank 0 writes the manifest of every rank's files, then
        renames the folder: a step_N folder with a manifest is complete."""
        outcomes = self.gather(outcome)
        problem = next((error for error, _ in outcomes if error), None)
        if problem is None and self.rank == 0:
            try:
                files = {name: checksum for _, checksums in outcomes for name, checksum in checksums.items()}
                with open(os.path.join(temporary, MANIFEST), "w") as f:
                    json.dump({"files": files}, f, indent=1)
                shutil.rmtree(final, ignore_errors=True)
                os.rename(temporary, final)
            except OSError as error:
                problem = save_error(error)
            else:
                kept = self.cfg.keep_last
                for old in checkpoint_steps(self.run_dir)[:-kept] if kept else []:
                    shutil.rmtree(os.path.join(self.run_dir, f"step_{old}"), ignore_errors=True)
                print(f"checkpoint saved: {final}", flush=True)
        verdict = [problem]
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0]:
            self.abandon(temporary, verdict[0])

    def abandon(self, temporary, problem):
        """Every rank comes here together: removes the folder of the failed save and exits, rank 0 naming
        the cause and the checkpoint that is kept."""
        if self.pending is not None:
            self.pending[0].result()  # the background writer must be done before its folder goes
            self.pending = None
        if self.rank != 0:
            sys.exit(2)
        shutil.rmtree(temporary, ignore_errors=True)
        previous = newest_checkpoint(self.run_dir)
        kept = f"the previous checkpoint {previous} is untouched" if previous else "there is no earlier checkpoint"
        fail(f"writing checkpoint {temporary} failed ({problem}; {space_left(self.run_dir)}); {kept}. "
             f"Free space or fix permissions, then relaunch")

    def problem(self, path):
        """None if path is a complete checkpoint whose files all match their checksums, else the first
        problem found. The ranks share the files out and hash them in parallel."""
        problem, files = None, {}
        try:
            with open(os.path.join(path, MANIFEST)) as f:
                files = json.load(f)["files"]
            if not os.path.isfile(os.path.join(path, "trainer_state.json")):
                problem = "no trainer_state.json (a save cut short)"
        except FileNotFoundError:
            problem = f"no {MANIFEST} (a save cut short, or written before checkpoints had checksums)"
        except (OSError, ValueError, KeyError, TypeError) as error:
            problem = f"unreadable {MANIFEST} ({save_error(error)})"
        for name in sorted(files)[self.rank::self.world_size] if problem is None else []:
            file = os.path.join(path, name)
            try:
                checksum = file_checksum(file)
            except FileNotFoundError:
                problem = f"{file} is missing"
            except OSError as error:
                problem = f"{file} is unreadable ({error.strerror})"
            else:
                if checksum["size"] != files[name]["size"]:
                    problem = (f"{file} has {checksum['size']} bytes instead of {files[name]['size']} "
                               f"(truncated?)")
                elif checksum != files[name]:
                    problem = f"{file} does not match its checksum (corrupt)"
            if problem:
                break
        return next(filter(None, self.gather(problem)), None)

    def choose(self, resume_from):
        """The checkpoint to resume from: resume_from, else the newest of the run; one that is incomplete
        or corrupt is skipped for the one before it. None for a fresh run; exit 2 if none is usable."""
        run_dir = os.path.dirname(os.path.normpath(resume_from)) or "." if resume_from else self.run_dir
        candidates = [os.path.normpath(os.path.join(run_dir, f"step_{step}"))
                      for step in reversed(checkpoint_steps(run_dir))]
        if resume_from:
            newest = os.path.normpath(resume_from)
            older = candidates[candidates.index(newest) + 1:] if newest in candidates else []
            candidates = [newest] + older
        for index, path in enumerate(candidates):
            problem = self.problem(path)
            if problem is None:
                return path
            if self.rank == 0:
                following = (f"falling back to {candidates[index + 1]}" if index + 1 < len(candidates)
                             else "no earlier checkpoint is left")
                print(f"warning: checkpoint {path} is unusable: {problem}; {following}", flush=True)
        if candidates:
            message = (f"no usable checkpoint to resume from ({', '.join(candidates)}); delete them to start "
                       f"over, or set another --run_name")
            fail(message) if self.rank == 0 else sys.exit(2)
        return None

    def load(self, path, model, optimizer, scheduler, shape, batches):
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
        rank_file = os.path.join(path, f"rank{self.rank}.pt")
        if trainer_state["world_size"] == self.world_size:
            rank_state = torch.load(rank_file, weights_only=True)
            restore_rng_states(rank_state["rng"])
            batches.load_state_dict(rank_state["data"])
        elif isinstance(batches, StreamingBatches):
            fail(f"checkpoint {path} of a streamed run was written by {trainer_state['world_size']} processes: "
                 f"a stream's position cannot be split anew, so resume it with {trainer_state['world_size']}")
        else:  # window positions do not depend on the world size
            batches.load_state_dict(trainer_state["data"])
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


def save_export(model, tokenizer, path):
    """A transformers folder (safetensors, config and the tokenizer of real data) that from_pretrained(path)
    loads with no code from this repo; written beside path and renamed once complete, removed if not."""
    temporary = path + ".tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    try:
        model.tie_weights()
        model.save_pretrained(temporary)
        if tokenizer is not None:
            tokenizer.save_pretrained(temporary)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    shutil.rmtree(path, ignore_errors=True)
    os.rename(temporary, path)
    print(f"model exported: {path}", flush=True)


def export_pretrained(model, config, tokenizer, path, rank):
    """The final weights of the training model, gathered on rank 0, as a transformers folder. A failed write
    is one line, and every rank exits."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    problem = [None]
    if rank == 0:
        try:
            plain = build_meta_model(config)
            plain.load_state_dict(state, assign=True)
            save_export(plain, tokenizer, path)
        except save_errors() as error:
            problem = [f"writing the export {path}.tmp failed ({save_error(error)}; "
                       f"{space_left(os.path.dirname(path))}); the checkpoints are untouched. "
                       f"Free space, then relaunch to export"]
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        fail(problem[0]) if rank == 0 else sys.exit(2)


def export_checkpoint(path, destination):
    """Any step_N checkpoint, of either format, as a transformers folder: one process, no GPU, no process
    group. The model is rebuilt from the config and shape the checkpoint records."""
    import torch.distributed.checkpoint as dcp

    if not os.path.isfile(os.path.join(path, "trainer_state.json")):
        raise ConfigError(f"--export_from={path} is not a complete checkpoint (no trainer_state.json); "
                          f"give a step_N folder of <checkpoint_dir>/<run_name>")
    with open(os.path.join(path, "trainer_state.json")) as file:
        trainer_state = json.load(file)
    hints = {k: v for k, v in __annotations__.items() if not k.isupper()}
    cfg = types.SimpleNamespace(**{name: globals()[name] for name in hints})
    vars(cfg).update({k: v for k, v in trainer_state["config"].items() if k in hints})
    shape = resolve_shape(cfg)
    vars(shape).update(trainer_state["shape"])
    tokenizer = load_tokenizer(cfg, types.SimpleNamespace(vocab_size=None))
    config = model_config(shape)
    if tokenizer is not None:
        config.bos_token_id = config.eos_token_id = tokenizer.eos_token_id
    model = build_meta_model(config)
    full_file = os.path.join(path, "state_dict.pt")
    if os.path.exists(full_file):
        state = torch.load(full_file, weights_only=True, mmap=True)["model"]
    else:
        model.to_empty(device="cpu")
        state = model.state_dict()
        with warnings.catch_warnings():  # one process, on purpose
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load({"model": state}, checkpoint_id=path, no_dist=True)
    model.load_state_dict(state, assign=True)
    save_export(model, tokenizer, destination)
    return destination


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


def check_trackers(cfg):
    """The trackers asked for must be importable: found out before any data or model."""
    import importlib.util

    if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--tensorboard=True needs the tensorboard package: pip install -r "
                          "requirements.txt, or pass --tensorboard=False")
    if cfg.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"--wandb={cfg.wandb} needs the wandb package: pip install -r requirements.txt, "
                          f"or leave --wandb unset")


class RunLog:
    """Rank 0's records of a run in its folder <log_dir>/<run_name>: metrics.jsonl (appended to by every
    launch of the run), TensorBoard, and W&B when --wandb names a project. The W&B run's id is the run
    name, so a requeued or relaunched job continues the same W&B run."""

    def __init__(self, cfg, folder):
        self.metrics = open(os.path.join(folder, "metrics.jsonl"), "a")
        self.writer = self.wandb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(os.path.join(folder, "tensorboard"))
        if cfg.wandb:
            import wandb as wandb_module  # the constant wandb is the project's name

            try:
                self.wandb = wandb_module.init(project=cfg.wandb, id=cfg.run_name, name=cfg.run_name,
                                               resume="allow", config=vars(cfg), dir=folder)
            except wandb_module.errors.Error as error:  # no API key, W&B unreachable
                fail(f"--wandb={cfg.wandb}: {str(error).splitlines()[0]}; or set WANDB_MODE=offline")

    def write(self, record):
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        scalars = {f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}": value
                   for key, value in record.items() if key != "step" and isinstance(value, (int, float))}
        for key, value in scalars.items() if self.writer is not None else ():
            self.writer.add_scalar(key, value, record["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=record["step"])

    def close(self):
        self.metrics.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def write_atomically(path, text):
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as file:
        file.write(text)
    os.replace(temporary, path)


def write_run_folder(cfg, folder):
    """The resolved config, which --config=<folder>/config.yaml replays, and a pointer to the benchmark
    report of each job that trained the run (slurm_submit.sh names it in $BENCHMARK_REPORT)."""
    import yaml

    write_atomically(os.path.join(folder, "config.yaml"), yaml.safe_dump(vars(cfg), sort_keys=False))
    report = os.environ.get("BENCHMARK_REPORT")
    if report:
        pointer = os.path.join(folder, "benchmark_reports.txt")
        known = open(pointer).read().splitlines() if os.path.exists(pointer) else []
        line = f"{os.environ.get('SLURM_JOB_ID', 'no SLURM job')}: {os.path.abspath(report)}"
        write_atomically(pointer, "\n".join(dict.fromkeys([*known, line])) + "\n")


def read_records(folder):
    """The last record of each logged step of a run folder's metrics.jsonl (a resumed run logs some again)."""
    records = {}
    with open(os.path.join(folder, "metrics.jsonl")) as file:
        for line in file:
            if line.endswith("\n"):  # a line being written as --plot reads is left for the next plot
                record = json.loads(line)
                records[record["step"]] = record
    return [records[step] for step in sorted(records)]


def plot_curves(folder):
    """<folder>/curves.png: loss and validation loss, learning rate, tokens/s and MFU against the step."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a compute node
    import matplotlib.pyplot as plt

    records = read_records(folder)
    if not records:
        return None
    series = lambda key: ([r["step"] for r in records if r.get(key) is not None],
                          [r[key] for r in records if r.get(key) is not None])
    figure, axes = plt.subplots(2, 2, figsize=(12, 7.5), sharex=True)
    panels = [("loss", [("loss", "training"), ("val_loss", "validation")]), ("learning rate", [("lr", None)]),
              ("tokens/s (all devices)", [("tokens_per_s", None)]), ("MFU", [("mfu", None)])]
    for axis, (title, keys) in zip(axes.flat, panels):
        axis.set_title(title)
        axis.grid(alpha=0.3)
        for key, label in keys:
            steps, values = series(key)
            if steps:
                few = len(steps) < 30 or key == "val_loss"
                axis.plot(steps, values, label=label, marker="o" if few else None, markersize=3)
        if not axis.lines:
            axis.text(0.5, 0.5, "not measured (MFU needs a GPU of the datasheet)" if title == "MFU" else
                      "not measured", ha="center", va="center", transform=axis.transAxes, color="gray")
        elif len(keys) > 1:
            axis.legend()
    axes[0, 1].ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    axes[1, 0].set_ylim(bottom=0)  # a small dip must not look like a collapse
    axes[1, 1].yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    for axis in axes[1]:
        axis.set_xlabel("step")
    figure.suptitle(f"{os.path.basename(os.path.abspath(folder))}: {records[-1]['step']} steps")
    figure.tight_layout()
    path = os.path.join(folder, "curves.png")
    temporary = os.path.join(folder, f"curves.{os.getpid()}.tmp.png")
    figure.savefig(temporary, dpi=100)
    plt.close(figure)
    os.replace(temporary, path)
    return path


def duration(seconds):
    if seconds is None:
        return "-"
    return f"{int(seconds) // 3600}:{int(seconds) % 3600 // 60:02d}:{int(seconds) % 60:02d}"


def new_window(device):
    """What a log line averages: the loss over every step since the last line, and speed over the timed
    steps among them (not the first, compiling, step; never evaluation or checkpoint writing)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return {"loss": torch.zeros((), device=device), "steps": 0, "seconds": 0.0, "timed": 0}


def window_record(window, step, lr, grad_norm, tokens_per_step, samples_per_step, flops_token, peak, world_size,
                  device, val_loss):
    timed = window["timed"] > 0
    tokens_per_s = tokens_per_step * window["timed"] / window["seconds"] if timed else None
    record = {
        "step": step, "loss": window["loss"].item() / world_size / window["steps"], "lr": lr, "grad_norm": grad_norm,
        "tokens_per_s": tokens_per_s,
        "samples_per_s": samples_per_step * window["timed"] / window["seconds"] if timed else None,
        "step_time_s": window["seconds"] / window["timed"] if timed else None,
        "mfu": flops_token * tokens_per_s / (peak * world_size) if peak and timed else None,
        "peak_mem_GB": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
        "peak_reserved_GB": torch.cuda.max_memory_reserved(device) / 1e9 if device.type == "cuda" else None,
    }
    if val_loss is not None:
        record.update(val_loss=val_loss, val_ppl=math.exp(min(val_loss, 50)))
    return record


def log_step(record, total_steps, run_log):
    shown = lambda key, text: text.format(record[key]) if record[key] is not None else "-"
    print(f"step {record['step']:>6}/{total_steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
          f"grad norm {record['grad_norm']:.3f} | {shown('tokens_per_s', '{:,.0f}')} tok/s | "
          f"{shown('samples_per_s', '{:.1f}')} samples/s | step {shown('step_time_s', '{:.3f}')} s | "
          f"MFU {shown('mfu', '{:.1%}')} | mem {shown('peak_mem_GB', '{:.1f}')} / {shown('peak_reserved_GB', '{:.1f}')} GB"
          f" | elapsed {duration(record['elapsed_s'])} | ETA {duration(record['eta_s'])}"
          + (f" | val loss {record['val_loss']:.4f} | val ppl {record['val_ppl']:.2f}" if "val_loss" in record else "")
          + "".join(f" | straggler {name}: {describe_straggler(figures, record)}"
                    for name, figures in record.get("stragglers", {}).items()),
          flush=True)
    run_log.write(record)


# --------------------------------------------------------------------------------------------
# When a run misbehaves: flight recorder, process-group timeouts, a watchdog, stragglers, a profiler.
# Every file goes to the run's log folder, <log_dir>/<run_name>.
# --------------------------------------------------------------------------------------------
def flight_recorder_env(environ, folder):
    """Turns on NCCL's flight recorder (the last FR_BUFFER_SIZE collectives of each rank, dumped when one
    times out) with its dumps in folder/flight_recorder, alone there as torchfrtrace wants them; a variable
    the user set, under its new or its old name, wins."""
    dumps = os.path.join(folder, "flight_recorder")
    defaults = {("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"): str(FR_BUFFER_SIZE),
                ("TORCH_NCCL_DUMP_ON_TIMEOUT",): "1",
                ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"): os.path.join(dumps, "rank_")}
    for names, value in defaults.items():
        if not any(name in environ for name in names):
            environ[names[0]] = value
    if environ.get("TORCH_FR_DUMP_TEMP_FILE", "").startswith(dumps):
        os.makedirs(dumps, exist_ok=True)


def set_pg_timeouts(timeout, mesh):
    """The timeout of the default group and the mesh's. Every rank first reaches this point (as in
    torchtitan), so none issues a collective under a short timeout while another is still in a long first
    step."""
    dist.barrier()
    for group in [None, *(mesh.get_group(dim) for dim in range(mesh.ndim))]:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


@contextlib.contextmanager
def generous_pg_timeouts(mesh):
    """A checkpoint write waits in barriers for the slowest writer, which on slow storage may take longer than
    PG_TIMEOUT: its own limit is checkpoint_limit_s, kept by the watchdog."""
    set_pg_timeouts(PG_TIMEOUT_FIRST_STEP, mesh)
    yield
    set_pg_timeouts(PG_TIMEOUT, mesh)


class Watchdog:
    """A daemon thread that ends a hung rank. When no optimizer step completes within max(hang_minimum_s,
    hang_factor x median step time), it writes every thread's Python stack (and on GPU the flight recorder)
    to the run's log folder, prints one line and exits with HUNG: no rank waits out a collective's timeout
    silently. Until a step has been timed (the first compiles) the limit is PG_TIMEOUT_FIRST_STEP; checkpoint
    writing and evaluation run under their own limits (phase)."""

    def __init__(self, cfg, folder, rank, device):
        self.cfg, self.rank, self.cuda = cfg, rank, device.type == "cuda"
        self.host = socket.gethostname()
        self.path = os.path.join(folder, f"stacks_{self.host}_rank{rank}.txt")
        self.step_times = collections.deque(maxlen=100)
        self.last, self.phase_limit, self.phase_name = time.monotonic(), None, None
        threading.Thread(target=self.watch, name="watchdog", daemon=True).start()

    def step_done(self, timed):
        now = time.monotonic()
        if timed:
            self.step_times.append(now - self.last)
        self.last = now

    @contextlib.contextmanager
    def phase(self, name, limit):
        # The order of the assignments keeps the thread from pairing a short limit with an old start time.
        self.phase_limit, self.phase_name = limit, name
        self.last = time.monotonic()
        try:
            yield
        finally:
            self.last = time.monotonic()
            self.phase_limit = None

    def limit(self):
        if self.phase_limit is not None:
            return self.phase_limit
        if not self.step_times:
            return PG_TIMEOUT_FIRST_STEP.total_seconds()
        return max(self.cfg.hang_minimum_s, self.cfg.hang_factor * statistics.median(self.step_times))

    def watch(self):
        while True:
            time.sleep(0.5)
            limit, waited = self.limit(), time.monotonic() - self.last
            if waited > limit:
                self.report(waited, limit)

    def report(self, waited, limit):
        during = f"{self.phase_name}, " if self.phase_limit is not None else ""
        line = (f"no step for {waited:.0f} s on {self.host} rank {self.rank}; stacks in {self.path} "
                f"({during}limit {limit:.0f} s)")
        try:  # whatever fails here, the rank must still end
            with open(self.path, "w") as file:
                file.write(line + "\n\n")
                file.flush()
                faulthandler.dump_traceback(file, all_threads=True)
            dump_trace = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
            if self.cuda and dump_trace is not None:  # a CUDA build: this rank's view of its last collectives too
                prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
                with open(f"{prefix}{self.rank}", "wb") as file:
                    file.write(dump_trace())
        finally:
            print(line, file=sys.stderr, flush=True)
            os._exit(HUNG)


class RankTimes:
    """This rank's seconds computing and waiting for data since the last read. Compute is the decoder layers'
    forward, timed from hooks that run after FSDP's own pre-forward hook has waited for the layer's gathered
    weights: waiting for a slower rank is not counted, so a slow rank stands out instead of making every rank
    look slow. On GPU the hooks record CUDA events, read at the log window's end when the step's own
    synchronisation has completed them: no extra sync. Data wait is the host's time in next(batches)."""

    def __init__(self, model, device):
        self.device, self.cuda = device, device.type == "cuda"
        self.compute, self.data, self.started, self.events = 0.0, 0.0, None, []
        for layer in decoder_layers(getattr(model, "module", model)):
            layer.register_forward_pre_hook(self.start)
            layer.register_forward_hook(self.stop)

    @torch.compiler.disable
    def start(self, module, args):
        if torch.is_grad_enabled():  # training, not evaluation
            self.started = torch.cuda.Event(enable_timing=True) if self.cuda else time.perf_counter()
            if self.cuda:
                self.started.record()

    @torch.compiler.disable
    def stop(self, module, args, output):
        if self.started is None:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events.append((self.started, end))
        else:
            self.compute += time.perf_counter() - self.started
        self.started = None

    def timed(self, batches):
        while True:
            started = time.perf_counter()
            item = next(batches)
            self.data += time.perf_counter() - started
            yield item

    def reset(self):
        self.compute, self.data, self.events = 0.0, 0.0, []

    def gather(self, world_size, master):
        """(compute s, data s) of every rank since the last gather, on rank 0; None on the others."""
        compute = self.compute + sum(start.elapsed_time(end) / 1e3 for start, end in self.events)
        local = torch.tensor([compute, self.data])
        self.reset()
        if self.cuda:
            local = local.pin_memory().to(self.device, non_blocking=True)
        gathered = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(gathered, local)
        return torch.stack(gathered).tolist() if master else None


def find_stragglers(names, timings, margin=STRAGGLER_MARGIN):
    """The medians, and the ranks more than margin above the median compute or data-wait time, as
    {name: {figure: seconds}}. names: host:local_rank per rank; timings: (compute s, data s) per rank. The
    excess must also be margin of the median compute and data time together: a data wait of microseconds
    twice the median is noise."""
    medians = dict(zip(("compute_s", "data_wait_s"), (statistics.median(column) for column in zip(*timings))))
    floor = margin * sum(medians.values())
    named = {}
    for name, values in zip(names, timings):
        slow = {key: value for (key, median), value in zip(medians.items(), values)
                if value > (1 + margin) * median and value - median > floor}
        if slow:
            named[name] = slow
    return medians, named


class Stragglers:
    """Rank 0's view of the stragglers, window after window."""

    def __init__(self, names):
        self.names, self.streaks = names, {}

    def window(self, timings, steps):
        """The record's fields for one log window of steps timed steps (seconds per step); warns of a rank
        named STRAGGLER_WINDOWS windows in a row."""
        if not steps:
            return {}
        medians, named = find_stragglers(self.names, [[value / steps for value in rank] for rank in timings])
        self.streaks = {name: self.streaks.get(name, 0) + 1 for name in named}
        for name, streak in self.streaks.items():
            if streak == STRAGGLER_WINDOWS:
                host = name.rpartition(":")[0]
                print(f"warning: {name} has been a straggler for {streak} log windows in a row "
                      f"({describe_straggler(named[name], medians)}); if its node stays slow, stop the job "
                      f"and resubmit without it: sbatch --exclude={host} slurm_submit.sh ...", flush=True)
        return {**medians, "stragglers": named}


def describe_straggler(figures, medians):
    """figures and medians: seconds per step by compute_s and data_wait_s."""
    return ", ".join(f"{key[:-2].replace('_', ' ')} {value:.3f} s/step vs median {medians[key]:.3f}"
                     for key, value in figures.items())


class StepProfiler:
    """--profile_steps=A,B: torch.profiler over steps A to B (as logged) of rank 0, written as a Chrome trace
    that Perfetto and TensorBoard's profiler open; on GPU a CUDA memory snapshot beside it."""

    def __init__(self, steps, folder, device, master):
        self.steps, self.folder, self.cuda = steps if master else None, folder, device.type == "cuda"
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


def check_compiler(device):
    """--compile needs a toolchain: a C++ compiler for CPU kernels, Triton and libcuda for GPU ones. Compiling a
    two-line function finds out in seconds, before any data or model, instead of at the first step."""
    try:
        torch.compile(lambda x: torch.sin(x) * 2 + 1)(torch.ones(8, device=device))
    except Exception as error:  # inductor raises many types; the first line names what is missing
        needs = "a C++ compiler (g++, or $CXX)" if device.type == "cpu" else "Triton with libcuda"
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        fail(f"--compile=True cannot compile for {device.type}: it needs {needs} ({first[:200]}); install it, or use --compile=False")


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# Signals this soon after the first are the same stop: torchrun forwards to its workers the SIGTERM or
# SIGINT that SLURM (scancel, preemption) or the terminal (Ctrl-C) has already sent each of them.
SAME_STOP_SECONDS = 2.0


class StopSignals:
    """SLURM sends SIGUSR1 (--signal) before the time limit, SIGTERM on preemption; a person types Ctrl-C.
    During training the first asks for a checkpoint at the end of the current step (requests is summed over
    the ranks, so all stop at the same step); a second exits at once with 128 + its number, writing nothing,
    so the last complete checkpoint stays as it was. Before training (data, model, loading) the first exits
    at once; SIGUSR1 is caught only from then on, as slurm_submit.sh holds it until a worker catches it.
    The interpreter's C handler writes each signal to a pipe read by a thread: that works while the main
    thread waits inside a step or a collective, where a Python handler would only run once it returns."""

    def __init__(self):
        self.requests, self.training, self.first = [], False, 0.0
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        self.catch(signal.SIGTERM, signal.SIGINT)
        threading.Thread(target=self.watch, args=(read_end,), daemon=True).start()

    @staticmethod
    def catch(*numbers):
        for number in numbers:
            signal.signal(number, lambda *_: None)  # the wakeup fd carries it to watch()

    def start_training(self):
        self.training = True
        self.catch(signal.SIGUSR1)

    def watch(self, read_end):
        while True:
            number = os.read(read_end, 1)[0]
            if number not in STOP_SIGNALS:
                continue
            name = signal.Signals(number).name
            if self.training and not self.requests:
                self.requests.append(number)
                self.first = time.monotonic()
                print(f"{name}: checkpointing at the end of this step (a second signal exits at once)",
                      flush=True)
                continue
            if self.training and time.monotonic() - self.first < SAME_STOP_SECONDS:
                continue
            why = "a second stop signal" if self.training else "before training started"
            print(f"{name}, {why}: exiting at once with status {128 + number}, writing nothing",
                  file=sys.stderr, flush=True)
            os._exit(128 + number)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fail(message):
    print("\n".join(f"error: {line}" for line in str(message).splitlines()), file=sys.stderr, flush=True)
    sys.exit(2)


# --------------------------------------------------------------------------------------------
def main(argv):
    if {"-h", "--help"} & set(argv):  # the help is the constants block itself, with its comments
        source = open(__file__).read()
        print(__doc__ + "\nOptions (--name=value):\n" + source[source.index("# Model: a preset"):source.index("\nCHOICES")])
        return 0
    try:
        cfg = parse_args(argv)
        if cfg.plot:
            logged = os.path.isfile(os.path.join(cfg.plot, "metrics.jsonl"))
            if not logged or not (curves := plot_curves(cfg.plot)):
                raise ConfigError(f"--plot={cfg.plot} holds no logged steps; "
                                  f"give a run folder, <log_dir>/<run_name>")
            print(f"curves: {curves}")
            return 0
        use_cache_if_hub_unreachable(cfg)
        if cfg.export_from:
            checkpoint = os.path.normpath(cfg.export_from)
            export = os.path.join(os.path.dirname(checkpoint), f"export_{os.path.basename(checkpoint)}")
            export_checkpoint(checkpoint, export)
            return 0
        shape = resolve_shape(cfg)
        source = parse_source(cfg)
        tokenizer = load_tokenizer(cfg, shape)
        if cfg.world_size is not None and not cfg.dry_run:
            raise ConfigError("--world_size is for --dry_run; a training run takes its world size from torchrun")
        world_size = cfg.world_size or int(os.environ.get("WORLD_SIZE", 8 if cfg.dry_run else 1))
        check_config(cfg, shape, world_size)
        if not cfg.dry_run and not cfg.prepare_only:
            check_trackers(cfg)
    except ConfigError as error:  # every rank finds the same error: rank 0 alone says it
        fail(error) if os.environ.get("RANK", "0") == "0" else sys.exit(2)
    if cfg.prepare_only:
        if source[0] not in ("hub", "local"):
            fail(f"--prepare_only prepares wikitext or a local path; --data={cfg.data} needs no preparation")
        try:
            if int(os.environ.get("RANK", 0)) == 0:  # under torchrun, one process is enough
                writable_folder("--data_cache", cfg.data_cache)
                prepare_token_files(cfg, *source, tokenizer)
        except ConfigError as error:
            fail(error)
        return 0
    config = model_config(shape)
    if tokenizer is not None:
        config.bos_token_id = config.eos_token_id = tokenizer.eos_token_id
    meta_model = build_meta_model(config)
    n_params = sum(p.numel() for p in meta_model.parameters())
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))

    if cfg.dry_run:
        return report_dry_run(cfg, config, shape, meta_model, world_size)
    check_machine_holds(cfg, n_params, world_size, local_world_size)

    signals = StopSignals()
    run_dir = os.path.join(cfg.checkpoint_dir, cfg.run_name)
    try:  # before any process group or model: a folder we cannot write to would fail later, after hours
        writable_folder("--checkpoint_dir", cfg.checkpoint_dir)
        writable_folder("--log_dir", cfg.log_dir)
        if source[0] != "dummy":
            writable_folder("--data_cache", cfg.data_cache)
    except ConfigError as error:  # once per node: a folder may be missing on one node only
        fail(error) if os.environ.get("LOCAL_RANK", "0") == "0" else sys.exit(2)
    log_run_dir = os.path.join(cfg.log_dir, cfg.run_name)  # the run's folder: logs, config, curves, diagnostics
    os.makedirs(run_dir, exist_ok=True)
    os.makedirs(log_run_dir, exist_ok=True)
    lock = None
    if os.environ.get("RANK", "0") == "0":  # before the process group: a second launch stops here
        try:
            lock = take_run_lock(run_dir)
        except ConfigError as error:
            fail(error)
    start_time = time.perf_counter()
    if "RANK" not in os.environ:  # a plain `python train.py`: a process group of one, on a free port
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        # Segments that grow in place instead of new blocks: less fragmentation as sequence shapes and
        # FSDP's all-gather buffers come and go (torchtitan's launcher sets it too). A user's setting wins.
        if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
            os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")
        flight_recorder_env(os.environ, log_run_dir)
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        device = torch.device("cpu")
    if cfg.compile:
        check_compiler(device)
    store = None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Workers restarted by torchrun --max-restarts meet in the same agent store as the failed attempt;
        # without a per-attempt prefix they would read the dead workers' addresses and hang.
        agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                    is_master=False, timeout=timedelta(minutes=30))
        store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent_store)
    # Offloaded gradients are CPU tensors: their norm needs a CPU backend beside NCCL.
    backend = ("cuda:nccl,cpu:gloo" if cfg.cpu_offload else "nccl") if device.type == "cuda" else "gloo"
    # device_id binds NCCL's communicator to this GPU at once, instead of guessing it at the first collective.
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=PG_TIMEOUT_FIRST_STEP,
                            device_id=device if device.type == "cuda" else None)
    try:
        mesh = device_mesh(cfg, device.type, world_size, local_world_size)
    except ConfigError as error:
        fail(error)
    master = rank == 0

    accumulation = cfg.global_batch_size // (cfg.batch_size * world_size)
    try:
        batches, validation_batches, epoch_steps = open_batches(cfg, source, shape, tokenizer, world_size, rank, accumulation, device)
    except ConfigError as error:
        fail(error) if master else sys.exit(2)
    total_steps = cfg.max_steps if cfg.max_steps > 0 else cfg.num_epochs * epoch_steps
    tokens_per_step = cfg.global_batch_size * cfg.seq_length
    checkpointer = Checkpointer(cfg, rank, world_size)
    resume_path = checkpointer.choose(cfg.resume_from)  # the newest usable checkpoint: checksums checked
    resume_step = int(resume_path.rsplit("_", 1)[1]) if resume_path else 0
    if not cfg.resume_from and resume_step >= total_steps and os.path.isdir(os.path.join(run_dir, "final_model")):
        if master:
            print(f"run {cfg.run_name} already finished at step {resume_step} ({resume_path}); "
                  f"nothing to do. Pass --run_name=NEW for a new run, or a larger --max_steps to train on.",
                  flush=True)
        dist.destroy_process_group()
        return 0
    if master:
        write_run_folder(cfg, log_run_dir)
        print("config:", " ".join(f"{k}={v}" for k, v in vars(cfg).items()), flush=True)
        print(f"model: {cfg.init_from or cfg.model}, {n_params:,} parameters ({n_params / 1e9:.2f}B) | world_size={world_size} | "
              f"device={torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'} | "
              f"gradient accumulation {accumulation} | {total_steps} steps of {tokens_per_step:,} tokens", flush=True)

    model = build_model(config, cfg, device, mesh)
    if cfg.init_from:
        load_pretrained(model, cfg.init_from)
    else:
        init_weights(model, config.initializer_range, config.num_hidden_layers, cfg.seed)
    if cfg.sharding == "ddp":
        model = wrap_ddp(model, device)
    optimizer = build_optimizer(model, cfg, fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))
    start_step, tokens_seen, elapsed_before = 0, 0, 0.0
    if resume_path:
        trainer_state = checkpointer.load(resume_path, model, optimizer, scheduler, shape, batches)
        start_step, tokens_seen = trainer_state["step"], trainer_state["tokens_seen"]
        elapsed_before = trainer_state.get("elapsed_s", 0.0)  # the time of the run's earlier launches
        if master:
            print(f"resumed from {resume_path} at step {start_step}"
                  f"{' (weights only, fresh optimizer)' if cfg.skip_optimizer else ''}", flush=True)
    peak = peak_flops(device)
    flops_token = flops_per_token(model, config, cfg.seq_length)

    run_log = RunLog(cfg, log_run_dir) if master else None
    model.train()
    signals.start_training()
    window = new_window(device)
    bad_steps, stopped = 0, False
    watchdog = Watchdog(cfg, log_run_dir, rank, device)
    rank_times = RankTimes(model, device)
    profiler = StepProfiler(profiled_steps(cfg.profile_steps), log_run_dir, device, master)
    names = [None] * world_size
    dist.all_gather_object(names, f"{socket.gethostname()}:{local_rank}")
    stragglers, timed_batches = Stragglers(names), rank_times.timed(batches)
    for step in range(start_step, total_steps):
        step_start = time.perf_counter()
        with profiler.step(step + 1):
            loss, grad_norm, stop = train_step(model, timed_batches, optimizer, accumulation, cfg.grad_clip,
                                               signals.requests)
        watchdog.step_done(timed=step > start_step)
        if step == start_step:  # the ETA counts from here: evaluation and checkpoints in, compiling out
            first_step_end = time.perf_counter()
            set_pg_timeouts(PG_TIMEOUT, mesh)
            rank_times.reset()  # the first step compiles, as for the window's speed
        else:  # the first step compiles: timing it would understate every later one
            window.update(seconds=window["seconds"] + time.perf_counter() - step_start, timed=window["timed"] + 1)
        window.update(loss=window["loss"] + loss, steps=window["steps"] + 1)
        if math.isfinite(grad_norm):
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
        lr_now = scheduler.get_last_lr()[0]
        scheduler.step()
        tokens_seen += tokens_per_step
        if step == start_step and master:
            print(f"time to first step: {time.perf_counter() - start_time:.1f} s", flush=True)
        evaluating = validation_batches and cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == total_steps)
        val_loss = None
        if evaluating:
            with watchdog.phase("evaluating", cfg.eval_limit_s):
                val_loss = evaluate(model, validation_batches(), cfg.eval_batches, world_size)
        if (step + 1) % cfg.log_every == 0 or step + 1 == total_steps or evaluating:
            dist.all_reduce(window["loss"])  # gloo has no AVG: sum, then divide
            timings = rank_times.gather(world_size, master)
            if master:
                record = window_record(window, step + 1, lr_now, grad_norm, tokens_per_step,
                                       cfg.global_batch_size, flops_token, peak, world_size, device, val_loss)
                now = time.perf_counter()
                rate = (now - first_step_end) / (step - start_step) if step > start_step else None
                record.update(elapsed_s=elapsed_before + now - start_time,
                              eta_s=rate * (total_steps - step - 1) if rate is not None else None,
                              **stragglers.window(timings, window["timed"]))
                log_step(record, total_steps, run_log)
            window = new_window(device)
        stopped = stop and step + 1 < total_steps  # a signal at the last step changes nothing
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == total_steps or stopped:
            trainer_state = {"step": step + 1, "tokens_seen": tokens_seen, "config": vars(cfg),
                             "elapsed_s": elapsed_before + time.perf_counter() - start_time,
                             "shape": {name: getattr(shape, name) for name in SHAPE_NAMES}}
            with watchdog.phase("writing a checkpoint", cfg.checkpoint_limit_s), generous_pg_timeouts(mesh):
                checkpointer.save(step + 1, model, optimizer, scheduler, batches, trainer_state)
        if stopped:
            break
    last_writes = watchdog.phase("writing the last checkpoint and model", cfg.checkpoint_limit_s)
    with last_writes, generous_pg_timeouts(mesh):
        checkpointer.finish()
        if not stopped:
            final_model = os.path.join(checkpointer.run_dir, "final_model")
            export_pretrained(model, config, tokenizer, final_model, rank)
    if master:
        if stopped:
            print(f"stopped by signal after step {step + 1}; checkpoint saved, relaunch to resume", flush=True)
        else:
            print(f"done: {total_steps} steps in {time.perf_counter() - start_time:.1f} s", flush=True)
        run_log.close()
        if curves := plot_curves(log_run_dir):
            print(f"curves: {curves}", flush=True)
    dist.barrier()  # a rank leaving while gloo still talks to it aborts the other
    dist.destroy_process_group()
    if lock:
        release_run_lock(lock)
    return STOPPED_BY_SIGNAL if stopped else 0


if __name__ == "__main__":
    status = main(sys.argv[1:])
    # Skip the interpreter's teardown: the loader's daemon thread may be inside tokenizer or Arrow code,
    # and finalising around it can abort a process whose run has already finished and saved.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
