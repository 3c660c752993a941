"""Pretrain or fine-tune a transformers model (GPT-2, Llama, Mistral, Mixtral) with PyTorch FSDP2 or DDP.

    torchrun --standalone --nproc_per_node=8 train.py             # 4B model on one 8-GPU node
    torchrun --standalone --nproc_per_node=2 train.py --model=tiny --compile=False   # CPU, gloo
    python train.py --dry_run                                     # config, size, memory; no training

Edit the constants below, set them in a YAML file given as --config=FILE.yaml, or override any of them
as --name=value (bare --flag means True); flags win over the file.

Read top to bottom; sections 3 to 11 each open with a comment bar:
   1. the constants a user edits;
   2. main(), the plan of a run;
   3. options: parse_args, validate (every check that needs no data), the --plot exit;
   4. data: tokenizer, prepared token files, batches;
   5. model: presets, transformers config, build_model (meta, checkpointing, compile, fully_shard), init;
   6. the training step: loss, optimizer, schedule, train_step (which the dry run runs too), evaluate;
   7. dry run: the step simulated on fake tensors at the target world size;
   8. setup: the machine check, run folders and lock, device and process group;
   9. checkpoints: save, verify, resume; exports for transformers (--export_from);
  10. logging: the log line, metrics.jsonl, TensorBoard, W&B, curves.png;
  11. when a run misbehaves: stop signals, process-group timeouts, watchdog, stragglers, profiler.
"""

import codecs
import collections
import contextlib
import copy
import difflib
import faulthandler
import functools
import gc
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
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

if __name__ == "__main__":
    # Importing torch and transformers creates millions of objects that live as long as the process; the
    # collector would scan them again and again as they appear, a second of every start on a small CPU.
    # It resumes once the model classes are imported (imports_done).
    gc.disable()

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

# The constants are a table: the formatter leaves its alignment alone.
# fmt: off
# Model: a preset from MODEL_PRESETS; a shape constant set here (not None) overrides the preset.
model: str = "4b"
init_from: str | None = None        # a transformers model (folder or hub name) to start from; its shape
n_embd: int | None = None
n_layer: int | None = None
n_head: int | None = None
n_positions: int | None = None      # longest sequence the model can take
vocab_size: int | None = None       # dummy data draws from it; real data: the tokenizer's size
# Data and batch
data: str = "dummy"                 # dummy | wikitext | c4 | hf:NAME[:CONFIG] | a file or folder (docs/DATA)
batch_size: int = 8                 # sequences per device per micro-step
seq_length: int | None = None       # tokens per sequence; None: the model's n_positions
global_batch_size: int = 256        # sequences per optimizer step, whatever the number of processes
num_epochs: int = 1
max_steps: int = -1                 # -1: num_epochs passes over the data; a larger one continues a run
tokenizer: str = "gpt2"             # AutoTokenizer name or local folder (real data); sets the vocabulary
text_column: str = "text"           # the column of .jsonl/.parquet/hub data holding the text
val_fraction: float = 0.005         # share of a local corpus held out for validation, if no validation file
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
sharding: str = "full"              # full | grad_op | hybrid | ddp: FSDP2 or DDP
cpu_offload: bool = False           # FSDP keeps parameters, gradients and optimizer state in CPU memory
activation_checkpointing: str = "op"  # none | full | op (saves chosen op outputs) | selective (see ac_every)
ac_every: int = 2                   # selective checkpoints layers ac_every, 2·ac_every, ...
compile: bool = True                # torch.compile each transformer block
mixed_precision: str = "auto"       # bf16 (compute; fp32 weights and reduction) | fp32 | auto: bf16 on GPU
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
export_from: str | None = None      # a step_N checkpoint: write export_step_N beside it, then exit
dry_run: bool = False               # simulate training steps on fake tensors: peak memory per GPU, FLOPs
world_size: int | None = None       # dry run: the world size simulated; None: $WORLD_SIZE, else 8
gpus_per_node: int = 8              # dry run: GPUs per node, for --sharding=hybrid
gpu: str = "H100"                   # dry run: a GPU of benchmark.py's datasheet, or its memory in GB
# When a run misbehaves (docs/SLURM.md): a watchdog per rank, and a profiler on demand
hang_minimum_s: float = 300.0       # watchdog: no optimizer step for max(this, hang_factor x median step
hang_factor: float = 10.0           #   time) is a hang: stacks to the run's log folder, one line, exit HUNG
checkpoint_limit_s: float = 1800.0  # a checkpoint write (or the final export) taking longer is a hang too
eval_limit_s: float = 900.0         # an evaluation taking longer is a hang too
profile_steps: str | None = None    # A,B: torch.profiler traces steps A to B (as logged) of rank 0
# fmt: on


def main(argv):
    """The plan of a run. Bad input is a ConfigError wherever it is found: one line, exit status 2."""
    if {"-h", "--help"} & set(argv):
        return print_help()
    try:
        args = parse_args(argv)
        shape = validate(args)
        if args.plot:
            return plot_run(args.plot)
        if args.export_from:
            export_checkpoint(args.export_from)
            return 0
        tokenizer = load_tokenizer(args)
        model_config = build_model_config(shape, tokenizer, args.vocab_size)
        meta_model = build_meta_model(model_config)
        imports_done()
        if args.prepare_only:
            return prepare_data(args, tokenizer)
        if args.dry_run:
            return report_dry_run(args, shape, model_config, meta_model)
        check_machine_holds(args, meta_model)
        signals = StopSignals()
        run_dir, log_folder, lock = make_run_folders(args)
        start_time = time.perf_counter()
        device, rank, world_size, mesh = setup_distributed(args, log_folder)
        accumulation = args.global_batch_size // (args.batch_size * world_size)
        batches, validation_batches, epoch_steps = open_batches(
            args, shape, tokenizer, world_size, rank, accumulation, device
        )
    except ConfigError as error:
        report_config_error(error)
    total_steps = args.max_steps if args.max_steps > 0 else args.num_epochs * epoch_steps
    checkpointer = Checkpointer(args, shape, rank, world_size)
    resume_path = checkpointer.choose(args.resume_from)  # the newest usable checkpoint: checksums checked
    if already_finished(args, resume_path, total_steps, run_dir, rank == 0):
        return teardown(lock)
    if rank == 0:
        write_run_folder(args, log_folder)
        print_run_banner(args, shape, model_config, meta_model, device, world_size, accumulation, total_steps)

    model = build_model(model_config, args, device, mesh)
    if args.init_from:
        load_pretrained(model, args.init_from)
    else:
        init_weights(model, model_config.initializer_range, model_config.num_hidden_layers, args.seed)
    if args.sharding == "ddp":  # after initialisation: DDP's constructor broadcasts rank 0's weights
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = build_optimizer(model, args, fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, args, total_steps))
    progress = Progress(args, model, model_config, device, total_steps, start_time, log_folder)
    if resume_path:
        progress.resume(checkpointer.load(resume_path, model, optimizer, scheduler, batches), resume_path)

    model.train()
    signals.start_training()
    watchdog = Watchdog(args, log_folder, rank, device, mesh)
    profiler = StepProfiler(args.profile_steps, log_folder, device, rank == 0)
    timed_batches = progress.timed(batches)
    first_step, stopped = progress.step + 1, False
    for step in range(first_step, total_steps + 1):  # numbered as logged: the first step is 1
        with profiler.step(step), progress.timing():
            loss, grad_norm, stop = train_step(
                model, timed_batches, optimizer, accumulation, args.grad_clip, signals.requests
            )
        watchdog.step_done(timed=step > first_step)
        if step == first_step:  # compiled and loaded: from now on a hung collective ends in minutes
            set_pg_timeouts(PG_TIMEOUT, mesh)
        progress.step_done(step, loss, grad_norm, scheduler.get_last_lr()[0])
        scheduler.step()
        val_loss = None
        if validation_batches and args.eval_every and (step % args.eval_every == 0 or step == total_steps):
            with watchdog.phase("evaluating"):
                val_loss = evaluate(model, validation_batches(), args.eval_batches, world_size)
        if step % args.log_every == 0 or step == total_steps or val_loss is not None:
            progress.log(val_loss)
        stopped = stop and step < total_steps  # a signal at the last step changes nothing
        if step % args.checkpoint_every == 0 or step == total_steps or stopped:
            with watchdog.phase("writing a checkpoint"):
                checkpointer.save(progress.trainer_state(), model, optimizer, scheduler, batches)
        if stopped:
            break

    with watchdog.phase("writing the last checkpoint and model"):
        checkpointer.finish()
        if not stopped:
            export_pretrained(model, model_config, tokenizer, os.path.join(run_dir, "final_model"), rank)
    progress.close(stopped)
    teardown(lock)
    return STOPPED_BY_SIGNAL if stopped else 0


# --------------------------------------------------------------------------------------------------------
# Options: the constants, then --config=FILE.yaml files, then --name=value flags; validated in one place.
# --------------------------------------------------------------------------------------------------------
CHOICES = {
    "sharding": ("full", "grad_op", "hybrid", "ddp"),
    "ckpt_format": ("sharded", "full"),
    "activation_checkpointing": ("none", "full", "op", "selective"),
    "mixed_precision": ("auto", "bf16", "fp32"),
}
POSITIVE = ("batch_size", "seq_length", "global_batch_size", "num_epochs", "log_every", "checkpoint_every",
            "max_bad_steps", "ac_every", "gpus_per_node", "eval_batches", "hang_minimum_s", "hang_factor",
            "checkpoint_limit_s", "eval_limit_s")  # fmt: skip
NOT_NEGATIVE = ("warmup_steps", "weight_decay", "grad_clip", "keep_last")
# Options that change how a run is operated but not what it computes: left out of the default run_name.
# The run's length is among them, so that a larger max_steps continues the same run.
OPERATIONAL = {
    "run_name", "checkpoint_dir", "checkpoint_every", "keep_last", "async_checkpoint", "resume_from",
    "skip_optimizer", "max_bad_steps", "log_every", "log_dir", "tensorboard", "dry_run", "data_cache",
    "prepare_only", "eval_every", "eval_batches", "world_size", "gpus_per_node", "gpu", "hang_minimum_s",
    "hang_factor", "checkpoint_limit_s", "eval_limit_s", "profile_steps", "max_steps", "num_epochs", "wandb",
    "plot", "export_from",
}  # fmt: skip
STOPPED_BY_SIGNAL = 75  # exit status after a signal-triggered checkpoint: the launcher requeues


def print_help():
    """The help is the constants block itself, with its comments."""
    source = open(__file__).read()
    constants = source[source.index("# Model: a preset") : source.index("# fmt: on")]
    print(f"{__doc__}\nOptions (--name=value):\n{constants}")
    return 0


class ConfigError(ValueError):
    """Bad user input: reported as one line and exit status 2, before anything expensive. Every rank finds
    the same error, so one says it: global rank 0, or for what differs by node local rank 0 of each node."""

    def __init__(self, message, per_node=False):
        super().__init__(message)
        self.per_node = per_node


def report_config_error(error):
    speaker = os.environ.get("LOCAL_RANK" if error.per_node else "RANK", "0") == "0"
    fail(error) if speaker else sys.exit(2)


def fail(message):
    print("\n".join(f"error: {line}" for line in str(message).splitlines()), file=sys.stderr, flush=True)
    sys.exit(2)


def option_types():
    return {name: hint for name, hint in __annotations__.items() if not name.isupper()}


def parse_args(argv):
    """Each value type-checked against its constant's annotation."""
    hints = option_types()
    args = {name: globals()[name] for name in hints}
    for path in [arg.removeprefix("--config=") for arg in argv if arg.startswith("--config=")]:
        args.update(read_config_file(path, hints))
    for arg in (arg for arg in argv if not arg.startswith("--config=")):
        name, has_value, text = arg.removeprefix("--").partition("=")
        if not arg.startswith("--") or not name:
            raise ConfigError(f"unexpected argument {arg!r}: options are written --name=value")
        if name not in args:
            raise ConfigError(f"unknown option --{name}{suggestion(name, args, '--')}")
        args[name] = convert(name, text if has_value else "true", hints[name], "--")
    return types.SimpleNamespace(**args)


def suggestion(name, valid, prefix):
    close = difflib.get_close_matches(name, valid, n=1)
    return f"; did you mean {prefix}{close[0]}?" if close else f"; valid options: {', '.join(valid)}"


def read_config_file(path, hints):
    import yaml

    try:
        with open(path) as file:
            values = yaml.safe_load(file) or {}
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"--config={path}: {' '.join(str(error).split())}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping of name: value, got {type(values).__name__}")
    for name in values:
        if name not in hints:
            raise ConfigError(f"{path}: unknown key {name!r}{suggestion(str(name), hints, '')}")
    return {name: convert(name, value, hints[name], f"{path}: ") for name, value in values.items()}


BOOLEANS = dict.fromkeys(("1", "true", "yes", "on"), True) | dict.fromkeys(("0", "false", "no", "off"), False)


def convert(name, value, hint, where):
    """value: a flag's text, or a YAML value, typed already or text read the way a flag is."""
    allows_none = isinstance(hint, types.UnionType)
    kind = next(t for t in getattr(hint, "__args__", (hint,)) if t is not type(None))
    if allows_none and (value is None or isinstance(value, str) and value.lower() == "none"):
        return None
    converted = value
    if isinstance(value, str) and kind is bool:
        converted = BOOLEANS.get(value.lower(), value)
    elif isinstance(value, str):
        with contextlib.suppress(ValueError):
            converted = kind(value)
    if type(converted) is kind or kind is float and type(converted) is int:
        if kind is not float or math.isfinite(converted):
            return kind(converted)
    expected = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}[kind]
    raise ConfigError(f"{where}{name} expects {expected}{' or none' if allows_none else ''}, got {value!r}")


def validate(args):
    """Every check that needs no data, before any process group or model; fills in what the options
    leave to the run (seq_length, precision, run_name). Returns the model's shape, or None for --plot and
    --export_from, which need no model."""
    use_cache_if_hub_unreachable(args)  # before any Hugging Face library is imported
    if args.plot or args.export_from:
        return None
    shape = resolve_shape(args)
    if args.seq_length is None:
        args.seq_length = shape.n_positions
    # true and false: the values from before the option had a selective mode
    mode = {"true": "full", "false": "none"}.get(args.activation_checkpointing.lower())
    args.activation_checkpointing = mode or args.activation_checkpointing
    if args.mixed_precision == "auto":  # a dry run simulates the GPU
        args.mixed_precision = "bf16" if args.dry_run or torch.cuda.is_available() else "fp32"
    for name, choices in CHOICES.items():
        if getattr(args, name) not in choices:
            raise ConfigError(f"--{name}={getattr(args, name)} is not one of: {', '.join(choices)}")
    check_ranges(args, shape)
    check_combinations(args, shape)
    kind = parse_source(args)[0]  # checks --data
    if args.prepare_only and kind not in ("hub", "local"):
        raise ConfigError(f"--prepare_only prepares wikitext or a local path; --data={args.data} needs none")
    if args.data != "dummy":
        missing_folder("--tokenizer", args.tokenizer)
    if args.dry_run:
        gpu_memory_gb(args.gpu)
        check_simulating_torch()
    else:
        check_trackers(args)
    folders = [] if args.dry_run or args.prepare_only else ["checkpoint_dir", "log_dir"]
    if args.data != "dummy" and not args.dry_run:
        folders.append("data_cache")
    for name in folders:
        writable_folder(f"--{name}", getattr(args, name))
    if args.run_name is None:
        identity = {k: v for k, v in vars(args).items() if k not in OPERATIONAL}
        digest = hashlib.sha1(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]
        args.run_name = f"{args.model}-{digest}"
    return shape


def resolve_shape(args):
    """The model's transformers config class, its arguments (the preset's, or the init_from model's) and
    its shape with the shape constants applied."""
    import transformers

    if args.init_from:
        missing_folder("--init_from", args.init_from)
        try:
            pretrained = transformers.AutoConfig.from_pretrained(args.init_from)
        except (OSError, ValueError) as error:
            raise ConfigError(f"--init_from={args.init_from}: {str(error).splitlines()[0]}") from None
        config_class, arguments = type(pretrained), pretrained.to_dict()
    elif args.model in MODEL_PRESETS:
        class_name, arguments = MODEL_PRESETS[args.model]
        config_class = getattr(transformers, class_name)
    else:
        close = difflib.get_close_matches(args.model, MODEL_PRESETS, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(f"--model={args.model} is not a preset; {hint}presets: {', '.join(MODEL_PRESETS)}")
    shape = {name: arguments[config_class.attribute_map.get(key, key)] for name, key in SHAPE_NAMES.items()}
    shape.update({name: getattr(args, name) for name in shape if getattr(args, name) is not None})
    return types.SimpleNamespace(
        config_class=config_class, arguments=arguments, pretrained=bool(args.init_from), **shape
    )


def check_ranges(args, shape):
    """Each value out of range is its own line, all of them at once."""
    problems = [f"--{name} must be positive, got {getattr(shape, name)}" for name in SHAPE_NAMES
                if getattr(shape, name) <= 0]  # fmt: skip
    problems += [f"--{name} must be positive, got {getattr(args, name)}" for name in POSITIVE
                 if getattr(args, name) <= 0]  # fmt: skip
    problems += [f"--{name} must not be negative, got {getattr(args, name)}" for name in NOT_NEGATIVE
                 if getattr(args, name) < 0]  # fmt: skip
    if not 0 < args.val_fraction < 1:
        problems.append(f"--val_fraction must lie between 0 and 1, got {args.val_fraction}")
    if args.eval_every < 0:
        problems.append(f"--eval_every must not be negative (0: never), got {args.eval_every}")
    if args.max_steps == 0 or args.max_steps < -1:
        problems.append(f"--max_steps must be positive, or -1 for num_epochs passes, got {args.max_steps}")
    if problems:
        raise ConfigError("\n".join(problems))


def launched_world_size(args):
    """torchrun's world size; a dry run's is --world_size, else $WORLD_SIZE, else 8."""
    return args.world_size or int(os.environ.get("WORLD_SIZE", 8 if args.dry_run else 1))


def check_combinations(args, shape):
    if shape.n_embd % shape.n_head:
        raise ConfigError(f"--n_embd={shape.n_embd} is not divisible by --n_head={shape.n_head}")
    if args.seq_length > shape.n_positions:
        raise ConfigError(
            f"--seq_length={args.seq_length} exceeds the model's {shape.n_positions} positions; "
            f"lower --seq_length or raise --n_positions"
        )
    if args.world_size is not None and not args.dry_run:
        raise ConfigError("--world_size is for --dry_run; a training run takes its world size from torchrun")
    world_size = launched_world_size(args)
    if world_size <= 0:
        raise ConfigError(f"--world_size must be positive, got {world_size}")
    per_micro_step = args.batch_size * world_size
    if args.global_batch_size % per_micro_step:
        raise ConfigError(
            f"--global_batch_size={args.global_batch_size} is not divisible by batch_size x world "
            f"size = {args.batch_size} x {world_size}; use a multiple of {per_micro_step}"
        )
    node_size = args.gpus_per_node if args.dry_run else int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if args.sharding == "hybrid" and world_size % node_size:
        raise ConfigError(
            f"--sharding=hybrid needs the same number of processes on every node "
            f"({world_size} over nodes of {node_size})"
        )
    if not 0 <= args.min_lr <= args.lr:
        raise ConfigError(f"--min_lr={args.min_lr} must lie between 0 and --lr={args.lr}")
    if args.init_from and any(getattr(args, name) is not None for name in SHAPE_NAMES):
        raise ConfigError(
            f"--init_from={args.init_from} brings its own shape; drop --{', --'.join(SHAPE_NAMES)}"
        )
    if args.cpu_offload and args.sharding == "ddp":
        raise ConfigError("--cpu_offload=True needs FSDP; it does not work with --sharding=ddp")
    if args.resume_from and not os.path.isfile(os.path.join(args.resume_from, "trainer_state.json")):
        raise ConfigError(
            f"--resume_from={args.resume_from} is not a complete checkpoint folder (no trainer_state.json)"
        )
    profiled_steps(args.profile_steps)


def profiled_steps(text):
    """--profile_steps=A,B as (A, B); None when not set."""
    if text is None:
        return None
    first, _, last = text.partition(",")
    if not (first.strip().isdigit() and last.strip().isdigit() and 1 <= int(first) <= int(last)):
        raise ConfigError(
            f"--profile_steps={text}: expected two step numbers A,B with 1 <= A <= B, "
            f"e.g. --profile_steps=5,8"
        )
    return int(first), int(last)


def missing_folder(option, value):
    """A value written as a local path (a hub name is NAME or OWNER/NAME) must be an existing folder."""
    local = value.startswith((".", "/", "~")) or value.endswith("/") or value.count("/") > 1
    if local and not os.path.isdir(os.path.expanduser(value)):
        file = " (it is a file; give the folder holding it)" if os.path.isfile(value) else ""
        raise ConfigError(f"{option}={value}: no such folder{file}")


def writable_folder(option, path):
    """Creates path and checks a file can be written in it: a folder that cannot be written would fail
    later, after hours. Checked on every node, as one may lack it."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        message = f"{option}={path} is not writable ({error.strerror}); point it at a writable folder"
        raise ConfigError(message, per_node=True) from None


def check_trackers(args):
    """The trackers asked for must be importable."""
    import importlib.util

    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "--tensorboard=True needs the tensorboard package: pip install -r "
            "requirements.txt, or pass --tensorboard=False"
        )
    if args.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"--wandb={args.wandb} needs the wandb package: pip install -r requirements.txt, "
            f"or leave --wandb unset"
        )


def gpu_memory_gb(gpu):
    """--gpu as (its name, its memory in GB): a name of benchmark.py's datasheet, or a number of GB."""
    from benchmark import datasheet

    with contextlib.suppress(ValueError):
        return None, float(gpu)
    sheet = datasheet(gpu)
    if sheet is None:
        raise ConfigError(
            f"--gpu={gpu} is not in benchmark.py's datasheet; give its memory in GB, e.g. --gpu=80"
        )
    return gpu, sheet["memory_GB"]


def check_simulating_torch():
    """FSDPMemTracker counted DTensor's sharding propagation (full-size fake tensors) as memory until
    pytorch/pytorch#183970. Measured on one H100 (gpt2-xl, batch 4): torch 2.11 simulated 48.5 GB, torch 2.13
    25.5 GB, and torch.cuda.max_memory_allocated was 25.8 GB."""
    if torch.__version__ < "2.13":
        raise ConfigError(
            f"--dry_run needs torch 2.13 or later: torch {torch.__version__}'s memory tracker overstates the "
            "peak; run it with the pinned torch, which needs no GPU (bash setup.sh; "
            ".venv/bin/python train.py --dry_run)"
        )


def hub_needed(args):
    """Whether the data, tokenizer or init_from model may have to come from the Hugging Face hub."""
    tokenizer_from_hub = args.data != "dummy" and not os.path.isdir(args.tokenizer)
    hub_data = args.data in HUB_SOURCES or args.data.startswith("hf:")
    model_from_hub = bool(args.init_from) and not os.path.isdir(args.init_from)
    return tokenizer_from_hub or hub_data or model_from_hub


def use_cache_if_hub_unreachable(args):
    """One quick request to the hub; when it fails, offline mode: only cached files are used, and what is
    missing fails at once instead of after huggingface_hub's retries (a minute for a tokenizer). Before any
    Hugging Face library is imported: they read HF_HUB_OFFLINE once, at import."""
    import urllib.request

    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0") or not hub_needed(args):
        return
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=5).close()
    except urllib.error.HTTPError:
        pass  # reachable
    except (OSError, ValueError) as error:
        os.environ["HF_HUB_OFFLINE"] = "1"
        if int(os.environ.get("RANK", 0)) == 0:
            print(
                f"{endpoint} is unreachable ({getattr(error, 'reason', error)}): using cached files only",
                flush=True,
            )


def plot_run(folder):
    """--plot: a run folder's curves.png, while it trains too."""
    curves = os.path.isfile(os.path.join(folder, "metrics.jsonl")) and plot_curves(folder)
    if not curves:
        raise ConfigError(f"--plot={folder} holds no logged steps; give a run folder, <log_dir>/<run_name>")
    print(f"curves: {curves}")
    return 0


# --------------------------------------------------------------------------------------------------------
# Data: the global batch of step k is a function of k alone, so it is the same for any world size.
# --------------------------------------------------------------------------------------------------------
DUMMY_EPOCH_SAMPLES = 2**20  # what one epoch of dummy data means for num_epochs
DUMMY_PERIOD = 8  # each dummy sequence repeats a random block of this many tokens


def dummy_window(seq_length, vocab_size, seed, index):
    return dummy_sample(index, seq_length, vocab_size, seed).numpy()


def dummy_sample(index, seq_length, vocab_size, seed):
    """seq_length + 1 tokens: a random block repeated, so a model can learn to copy and the loss falls."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    block = torch.randint(0, vocab_size, (DUMMY_PERIOD,), generator=generator)
    return block.repeat(seq_length // DUMMY_PERIOD + 1)[: seq_length + 1]


HUB_SOURCES = {
    "wikitext": ("hub", "Salesforce/wikitext", "wikitext-103-raw-v1"),
    "c4": ("stream", "allenai/c4", "en"),
}
FILE_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def parse_source(args):
    """(kind, name, config) of --data; kind is dummy, hub or local (prepared token files) or stream."""
    if args.data == "dummy":
        return "dummy", None, None
    if args.data in HUB_SOURCES:
        source = HUB_SOURCES[args.data]
    elif args.data.startswith("hf:") and args.data[3:]:
        name, _, config = args.data[3:].partition(":")
        source = ("stream", name, config or None)
    elif os.path.exists(args.data):
        source = ("local", os.path.abspath(args.data), None)
    else:
        raise ConfigError(
            f"--data={args.data}: no such file or folder, and not one of dummy, wikitext, c4, "
            f"hf:NAME[:CONFIG]"
        )
    if source[0] == "stream" and args.max_steps == -1:
        raise ConfigError(f"--data={args.data} is streamed and has no known length: set --max_steps")
    return source


def load_tokenizer(args):
    """The tokenizer of real data (None for dummy data); the model's vocabulary becomes its size."""
    if args.data == "dummy":
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"cannot load tokenizer {args.tokenizer!r} ({str(error).splitlines()[0]}); "
            f"`python train.py --prepare_only --data={args.data} --tokenizer={args.tokenizer}` "
            f"on a machine with internet caches it"
        ) from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"tokenizer {args.tokenizer!r} has no EOS token to separate documents with")
    if args.vocab_size is not None and len(tokenizer) > args.vocab_size:
        raise ConfigError(
            f"tokenizer {args.tokenizer!r} has {len(tokenizer)} tokens, more than "
            f"--vocab_size={args.vocab_size}"
        )
    return tokenizer


def tokenize_documents(tokenizer, column):
    """A batched map function: each non-blank text becomes its token ids followed by EOS."""

    def tokenize(batch):
        texts = [text or "" for text in batch[column]]
        ids = tokenizer(texts, verbose=False)["input_ids"]
        eos = [tokenizer.eos_token_id]
        return {"input_ids": [doc + eos if text.strip() else [] for text, doc in zip(texts, ids)]}

    return tokenize


def token_dtype(tokenizer):
    return np.uint16 if len(tokenizer) <= 2**16 else np.uint32


def corpus_files(path):
    return (
        [path] if os.path.isfile(path) else sorted(glob.glob(os.path.join(path, "**", "*.*"), recursive=True))
    )


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
                raise ConfigError(
                    f"--data: {path} is not UTF-8 text (invalid byte at offset {position}); "
                    f"convert it (iconv -t utf-8) or remove it"
                ) from None
            if not chunk:
                return
            offset += len(chunk)


def load_document_splits(args, kind, name, config):
    """train and validation splits of wikitext or a local corpus, as map-style datasets."""
    from datasets import load_dataset

    cache_dir = os.path.join(args.data_cache, "hf")
    if kind == "hub":
        fix = (
            f" and nothing is prepared in {args.data_cache}; run `python train.py --prepare_only "
            f"--data={args.data} --tokenizer={args.tokenizer} --data_cache={args.data_cache}` on a machine "
            f"with internet"
        )
        splits = load_hub_dataset(args, name, config, fix, cache_dir=cache_dir)
    else:
        files = corpus_files(name)
        formats = sorted({os.path.splitext(path)[1] for path in files} & set(FILE_BUILDERS))
        if len(formats) != 1:  # datasets would silently read only the most common format
            found = f"mixes {', '.join(formats)}; keep one format per folder" if formats else ""
            raise ConfigError(f"--data={args.data} {found or 'has no .txt, .jsonl or .parquet file'}")
        if sum(os.path.getsize(path) for path in files) == 0:
            raise ConfigError(f"--data={args.data} holds no text")
        for path in files if formats[0] != ".parquet" else []:
            check_utf8(path)
        # In a folder, files named like train/validation/test become those splits (datasets' naming rules).
        where = dict(data_files=name) if os.path.isfile(name) else dict(data_dir=name)
        splits = load_dataset(FILE_BUILDERS[formats[0]], **where, cache_dir=cache_dir)
        check_text_column(args, splits["train"].column_names)
    if "validation" not in splits:
        if splits["train"].num_rows < 2:
            raise ConfigError(
                f"--data={args.data} holds fewer than 2 documents, too few to hold some out for validation"
            )
        # A fixed seed: the same share every run.
        held_out = splits["train"].train_test_split(test_size=args.val_fraction, seed=0)
        splits = {"train": held_out["train"], "validation": held_out["test"]}
    return splits


def load_hub_dataset(args, name, config, fix, **options):
    """A dataset of the hub, whose train split must hold --text_column; when the hub cannot give it
    (unreachable, or not there), one line that ends with fix."""
    from datasets import load_dataset

    try:
        splits = load_dataset(name, config, **options)
    except OSError as error:  # unreachable (ConnectionError) or not there
        reason = str(error).splitlines()[0]
        raise ConfigError(f"cannot load {name} from the Hugging Face hub ({reason}){fix}") from None
    check_text_column(args, splits["train"].column_names)
    return splits


def check_text_column(args, columns):
    """columns: None where a stream does not know them before it is read."""
    if columns is not None and args.text_column not in columns:
        raise ConfigError(
            f"--text_column={args.text_column} is not a column of --data={args.data}; "
            f"columns: {', '.join(columns)}"
        )


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


def prepare_token_files(args, kind, name, config, tokenizer):
    """Paths of the train and validation token files of wikitext or a local corpus, tokenised on every
    core of the node unless complete. Each is written under a temporary name and renamed, its sidecar
    last, so a file cut short by a crash is never taken for complete."""
    meta = {"source": name, "config": config, "text_column": args.text_column}
    meta.update(val_fraction=args.val_fraction, tokenizer=args.tokenizer, vocab=len(tokenizer))
    # The corpus files' sizes and times and the vocabulary are in the key: an edited corpus or tokenizer
    # is prepared anew.
    corpus = corpus_files(name) if kind == "local" else []
    files = [(f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in corpus]
    vocabulary = sorted(tokenizer.get_vocab().items())
    key = hashlib.sha256(json.dumps([meta, files, vocabulary]).encode()).hexdigest()[:12]
    folder = os.path.join(args.data_cache, f"{os.path.basename(name.rstrip('/'))}-{key}")
    paths = {split: os.path.join(folder, f"{split}.bin") for split in ("train", "validation")}
    if all(read_sidecar(path) for path in paths.values()):
        print(f"data: reusing prepared tokens in {folder}", flush=True)
        return paths
    print(f"data: tokenizing --data={args.data} with {args.tokenizer} into {folder}", flush=True)
    os.makedirs(folder, exist_ok=True)
    import pyarrow.compute as pc

    cores = len(os.sched_getaffinity(0))
    for split, documents in load_document_splits(args, kind, name, config).items():
        tokenize = tokenize_documents(tokenizer, args.text_column)
        workers, columns = min(cores, max(1, documents.num_rows // 1000)), documents.column_names
        label = f"tokenizing {split}"
        tokens = documents.map(tokenize, batched=True, remove_columns=columns, num_proc=workers, desc=label)
        digest, count, temporary = hashlib.blake2b(), 0, f"{paths[split]}.{os.getpid()}.tmp"
        with open(temporary, "wb") as file:
            for table in tokens.with_format("arrow").iter(batch_size=2**16):
                ids = pc.list_flatten(table["input_ids"]).to_numpy().astype(token_dtype(tokenizer))
                ids.tofile(file)
                digest.update(ids)
                count += len(ids)
        if count == 0:
            raise ConfigError(f"--data={args.data} holds no text in its {split} split")
        os.replace(temporary, paths[split])
        with open(temporary, "w") as file:
            dtype = np.dtype(token_dtype(tokenizer)).name
            json.dump(
                {**meta, "split": split, "tokens": count, "dtype": dtype, "blake2b": digest.hexdigest()}, file
            )
        os.replace(temporary, paths[split] + ".json")
    return paths


def shared_token_files(args, kind, name, config, tokenizer, rank):
    """Global rank 0 prepares; the others wait (for hours if need be) and get its paths or its error."""
    group = dist.new_group(backend="gloo", timeout=timedelta(hours=12))
    outcome = [None]
    if rank == 0:
        try:
            outcome = [prepare_token_files(args, kind, name, config, tokenizer)]
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
            self.items = self.produce()
            if self.prefetch:
                self.items = prefetched(self.items, 4 * self.accumulation)
        windows, position = next(self.items)
        self.taken += 1
        if self.taken % self.accumulation == 0:
            self.position = position
        windows = torch.from_numpy(windows)
        if self.device.type == "cuda":
            windows = windows.pin_memory().to(self.device, non_blocking=True)
        return windows[:, :-1], windows[:, 1:]


def token_window(tokens, seq_length, index):
    """Window index of a token file: seq_length + 1 tokens, the first shared with the previous window."""
    return tokens[index * seq_length : (index + 1) * seq_length + 1]


@functools.lru_cache(maxsize=2)
def epoch_order(n_windows, seed, epoch):
    return np.random.default_rng([seed, epoch]).permutation(n_windows)


class WindowBatches(Batches):
    """window(i) is window i of n_windows. Sample g of the run is window g mod n of epoch g // n, in
    a seeded order per epoch when shuffled; rank r of micro-step m of step k reads samples
    k·G + (m·W + r)·B ..., so the global batch of a step is the same for every world size. The
    position {epoch, offset} is the first sample of the next step."""

    def __init__(self, window, n_windows, args, world_size, rank, accumulation, device, prefetch, shuffle):
        super().__init__(accumulation, device, prefetch)
        self.window, self.n_windows, self.world_size, self.rank = window, n_windows, world_size, rank
        self.batch_size, self.seed, self.shuffle = args.batch_size, args.seed, shuffle
        self.step_samples = accumulation * world_size * args.batch_size
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
                    if self.shuffle:
                        index = epoch_order(self.n_windows, self.seed, sample_epoch)[index]
                    rows.append(self.window(index))
                yield np.stack(rows).astype(np.int64), {"epoch": epoch, "offset": offset}
            step += 1


class StreamingBatches(Batches):
    """Packs a tokenised stream on the fly: documents joined by EOS and cut into batch_size windows
    of seq_length + 1; after the stream's end it starts again. The position is the stream's own
    state plus the tokens it read but has not used."""

    def __init__(self, documents, args, accumulation, device, prefetch):
        super().__init__(accumulation, device, prefetch)
        self.documents, self.batch_size = documents, args.batch_size
        self.batch_tokens = args.batch_size * (args.seq_length + 1)
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
                    windows = np.array(buffer[: self.batch_tokens], dtype=np.int64)
                    del buffer[: self.batch_tokens]
                    position = {"stream": self.documents.state_dict(), "buffer": list(buffer)}
                    yield windows.reshape(self.batch_size, -1), position
            if not tokens_read:
                raise ValueError("this rank's share of the stream holds no text")
            stream = self.start


def stream_splits(args, name, config, tokenizer, world_size, rank):
    """This rank's share of the tokenised train and validation (None if absent) streams of a hub dataset."""
    from datasets.distributed import split_dataset_by_node

    fix = "; streaming needs it during training: use a local copy as --data=PATH instead"
    splits = load_hub_dataset(args, name, config, fix, streaming=True)
    tokenize = tokenize_documents(tokenizer, args.text_column)

    def share(split):
        shard = split_dataset_by_node(splits[split], rank=rank, world_size=world_size)
        return shard.map(tokenize, batched=True)

    return [share(split) if split in splits else None for split in ("train", "validation")]


def open_batches(args, shape, tokenizer, world_size, rank, accumulation, device):
    """(training batches, a function returning fresh validation batches or None, steps per epoch or None)."""
    kind, name, config = parse_source(args)
    if kind == "stream":
        train, validation = stream_splits(args, name, config, tokenizer, world_size, rank)
        evaluation = functools.partial(StreamingBatches, validation, args, 1, device, prefetch=False)
        train = StreamingBatches(train, args, accumulation, device, prefetch=True)
        return train, evaluation if validation is not None else None, None
    batches = functools.partial(WindowBatches, args=args, world_size=world_size, rank=rank, device=device)
    if kind == "dummy":
        window = functools.partial(dummy_window, args.seq_length, shape.vocab_size, args.seed)
        train = batches(window, DUMMY_EPOCH_SAMPLES, accumulation=accumulation, prefetch=True, shuffle=False)
        return train, None, DUMMY_EPOCH_SAMPLES // args.global_batch_size
    paths = shared_token_files(args, kind, name, config, tokenizer, rank)
    tokens = {split: np.memmap(path, dtype=token_dtype(tokenizer), mode="r") for split, path in paths.items()}
    windows = {split: (len(split_tokens) - 1) // args.seq_length for split, split_tokens in tokens.items()}
    if windows["train"] < args.global_batch_size:
        raise ConfigError(
            f"--data={args.data} has {len(tokens['train']):,} training tokens, fewer than one global batch "
            f"({args.global_batch_size} x {args.seq_length + 1}); lower --global_batch_size or --seq_length"
        )
    if windows["validation"] < 1:
        raise ConfigError(
            f"the validation split of --data={args.data} is shorter than one sequence; raise --val_fraction"
        )
    train_window, validation_window = (
        functools.partial(token_window, tokens[split], args.seq_length) for split in ("train", "validation")
    )
    train = batches(train_window, windows["train"], accumulation=accumulation, prefetch=True, shuffle=True)
    evaluation = functools.partial(
        batches, validation_window, windows["validation"], accumulation=1, prefetch=False, shuffle=False
    )
    return train, evaluation, windows["train"] // args.global_batch_size


def prepare_data(args, tokenizer):
    """--prepare_only: the token files of wikitext or a local corpus, by one process even under torchrun."""
    if int(os.environ.get("RANK", 0)) == 0:
        prepare_token_files(args, *parse_source(args), tokenizer)
    return 0


# --------------------------------------------------------------------------------------------------------
# Model: presets; meta device -> activation checkpointing -> compile per block -> fully_shard (or DDP)
# -> to_empty; then init or load (in main).
# --------------------------------------------------------------------------------------------------------
# The presets are a table: the formatter leaves its layout alone.
# fmt: off
GPT2_VOCAB = 50257  # token ids of the gpt2 tokenizer
LLAMA2 = dict(vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5)
LLAMA3 = dict(vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, num_key_value_heads=8,
              rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                   high_freq_factor=4.0, original_max_position_embeddings=8192))
LLAMA3_2 = dict(LLAMA3, tie_word_embeddings=True,
                rope_parameters=dict(LLAMA3["rope_parameters"], factor=32.0))
# Mistral 7B v0.2's shape (v0.1's with rope theta 1e6 and no sliding window), which Mixtral 8x7B shares.
MISTRAL = dict(vocab_size=32000, max_position_embeddings=32768, rms_norm_eps=1e-5, hidden_size=4096,
               intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               sliding_window=None, rope_parameters=dict(rope_type="default", rope_theta=1e6))
TINY_LLAMA = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, vocab_size=512)
# A preset is a transformers config class and its arguments: the published shapes, no weights. GPT-2's
# 4b: 3072 wide (head size 128, the fast path of flash attention; a multiple of 256 for tensor-core
# tiles) and 34 layers give 4.01B parameters.
MODEL_PRESETS = {
    "tiny": ("GPT2Config", dict(n_embd=256, n_layer=2, n_head=4, n_positions=256, vocab_size=512)),
    "gpt2": ("GPT2Config", dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=GPT2_VOCAB)),
    "gpt2-medium": ("GPT2Config", dict(n_embd=1024, n_layer=24, n_head=16, n_positions=1024,
                                       vocab_size=GPT2_VOCAB)),
    "gpt2-large": ("GPT2Config", dict(n_embd=1280, n_layer=36, n_head=20, n_positions=1024,
                                      vocab_size=GPT2_VOCAB)),
    "gpt2-xl": ("GPT2Config", dict(n_embd=1600, n_layer=48, n_head=25, n_positions=1024,
                                   vocab_size=GPT2_VOCAB)),
    "4b": ("GPT2Config", dict(n_embd=3072, n_layer=34, n_head=24, n_positions=2048, vocab_size=GPT2_VOCAB)),
    "tiny-llama": ("LlamaConfig", dict(TINY_LLAMA, tie_word_embeddings=True)),
    "tiny-mixtral": ("MixtralConfig", dict(TINY_LLAMA, intermediate_size=256, num_local_experts=4,
                                           num_experts_per_tok=2)),
    "llama2-7b": ("LlamaConfig", dict(LLAMA2, hidden_size=4096, intermediate_size=11008,
                                      num_hidden_layers=32, num_attention_heads=32)),
    "llama2-13b": ("LlamaConfig", dict(LLAMA2, hidden_size=5120, intermediate_size=13824,
                                       num_hidden_layers=40, num_attention_heads=40)),
    "llama2-70b": ("LlamaConfig", dict(LLAMA2, hidden_size=8192, intermediate_size=28672,
                                       num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8)),
    "llama3.1-8b": ("LlamaConfig", dict(LLAMA3, hidden_size=4096, intermediate_size=14336,
                                        num_hidden_layers=32, num_attention_heads=32)),
    "llama3.1-70b": ("LlamaConfig", dict(LLAMA3, hidden_size=8192, intermediate_size=28672,
                                         num_hidden_layers=80, num_attention_heads=64)),
    "llama3.2-1b": ("LlamaConfig", dict(LLAMA3_2, hidden_size=2048, intermediate_size=8192,
                                        num_hidden_layers=16, num_attention_heads=32)),
    "llama3.2-3b": ("LlamaConfig", dict(LLAMA3_2, hidden_size=3072, intermediate_size=8192,
                                        num_hidden_layers=28, num_attention_heads=24)),
    "mistral-7b": ("MistralConfig", MISTRAL),
    "mixtral-8x7b": ("MixtralConfig", dict(MISTRAL, num_local_experts=8, num_experts_per_tok=2)),
}
# The shape constants in each family's own words (GPT2Config maps these to n_embd, n_layer, ...).
SHAPE_NAMES = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
               "n_positions": "max_position_embeddings", "vocab_size": "vocab_size"}
# fmt: on


def padded_vocab(n_tokens):
    """Vocabulary rounded up to a multiple of 64: the output layer's matmul runs faster."""
    return (n_tokens + 63) // 64 * 64


def build_model_config(shape, tokenizer=None, vocab_size=None):
    """The transformers config: the preset's arguments with the shape constants applied and a vocabulary
    padded for speed (vocab_size, else the tokenizer's size), or the pretrained model's; SDPA attention,
    no dropout."""
    if tokenizer is not None:
        shape.vocab_size = vocab_size or len(tokenizer)
    defaults = shape.config_class().to_dict()
    arguments = dict(copy.deepcopy(shape.arguments), use_cache=False)
    # No dropout: modern pretraining does without it, and it keeps runs of any world size identical.
    dropouts = [k for k, v in defaults.items() if k.endswith(("pdrop", "dropout")) and isinstance(v, float)]
    arguments.update(dict.fromkeys(dropouts, 0.0))
    for key in ("bos_token_id", "eos_token_id"):  # GPT-2's default 50256 must fit the tiny vocabulary
        if isinstance(token := arguments.get(key, defaults.get(key)), int) and token >= shape.vocab_size:
            arguments[key] = shape.vocab_size - 1
    # A pretrained model keeps its shape and its vocabulary, whatever a tokenizer holds.
    if not shape.pretrained:
        names = shape.config_class.attribute_map
        arguments.update({names.get(key, key): getattr(shape, name) for name, key in SHAPE_NAMES.items()})
        arguments["vocab_size"] = padded_vocab(shape.vocab_size)
    model_config = shape.config_class.from_dict(arguments)
    model_config._attn_implementation = "sdpa"
    if tokenizer is not None:
        model_config.bos_token_id = model_config.eos_token_id = tokenizer.eos_token_id
    return model_config


def imports_done():
    """The collector, paused at the top of this file in a process started to train, runs again, leaving
    alone (frozen) the objects the imports created."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def build_meta_model(model_config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)  # not a pretrained bf16


def decoder_layers(model):
    """The ModuleList of the family's own decoder-layer class, the unit transformers names for sharding; also
    once its layers are wrapped for checkpointing and sharded (fully_shard names the class FSDP<name>)."""

    def layer_class(layer):
        return type(getattr(layer, "_checkpoint_wrapped_module", layer)).__name__.removeprefix("FSDP")

    lists = (m for m in model.modules() if isinstance(m, torch.nn.ModuleList))
    return next(m for m in lists if layer_class(m[0]) in model._no_split_modules)


def flops_per_token(model, model_config, seq_length):
    """6·N + 12·L·H·Q·T (PaLM appendix B, as torchtitan). N counts the weights of matmuls: a tied token
    embedding once, as the output layer, no lookup-only embedding (positions, untied input tokens), and
    of a mixture of experts the num_experts_per_tok of num_local_experts that each token runs through."""
    matmuls = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)} - matmuls
    active = getattr(model_config, "num_experts_per_tok", 1) / getattr(model_config, "num_local_experts", 1)
    weights = [(name, p) for name, p in model.named_parameters() if id(p) not in lookups]
    n_matmul = sum(p.numel() * (active if ".experts." in name else 1) for name, p in weights)
    layers, heads = model_config.num_hidden_layers, model_config.num_attention_heads
    return 6 * n_matmul + 12 * layers * heads * (model_config.hidden_size // heads) * seq_length


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
            residual = name.endswith(
                ("c_proj.weight", "o_proj.weight", "down_proj.weight", "experts.down_proj")
            )
            generator = torch.Generator(param.device).manual_seed(seed + index)
            scale = std / math.sqrt(2 * n_layer) if residual else std
            value = torch.randn(param.shape, generator=generator, device=param.device) * scale
        if isinstance(param, DTensor):
            shard = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
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
    """Only rank 0 holds a full copy in host memory; set_model_state_dict broadcasts it and every rank
    keeps its shard."""
    from transformers import AutoModelForCausalLM

    weights = {}
    if dist.get_rank() == 0:
        weights = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch.float32).state_dict()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, weights, options=options)


def precision_policy(args):
    """FSDP's mixed precision for --mixed_precision=bf16: bf16 compute, fp32 master weights and gradient
    reduction. Inputs are not cast per block (torchtitan's choice): the embeddings already hand bf16 on."""
    if args.mixed_precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
    )


def unpacked_sequences(position_ids):
    """Every row of a batch is one window of a corpus, never several documents packed together. transformers
    asks its data to find out, which costs a device-to-host sync per forward and, on fake tensors, a full
    seq x seq mask that a real run never allocates."""
    return None


# Op-level selective checkpointing (torchtitan's "op" mode) keeps these outputs of every block and recomputes
# the rest: attention (the costliest to recompute per byte), every other matmul, and FSDP's reduce-scatter.
# GPT-2's Conv1D layers are addmm, Llama's linear layers mm.
MATMULS = {"aten.mm.default", "aten.addmm.default"}
SAVED_OPS = MATMULS | {
    "aten._scaled_dot_product_flash_attention.default", "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "_c10d_functional.reduce_scatter_tensor.default",
}  # fmt: skip


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


def checkpointed(index, args):
    """Whether decoder layer index is wrapped in activation checkpointing, and with which context."""
    mode = args.activation_checkpointing
    if mode == "op":
        return {"context_fn": op_level_checkpointing}
    if mode == "full" or mode == "selective" and (index + 1) % args.ac_every == 0:
        return {}
    return None


def build_model(model_config, args, device, mesh):
    """The model wrapped for training, weights allocated but not yet initialised (init_weights or
    load_pretrained follow)."""
    import transformers.masking_utils
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    transformers.masking_utils.find_packed_sequence_indices = unpacked_sequences
    model = build_meta_model(model_config)
    blocks = decoder_layers(model)
    for index, block in enumerate(blocks):
        if (checkpoint_options := checkpointed(index, args)) is not None:
            block = checkpoint_wrapper(block, preserve_rng_state=False, **checkpoint_options)
        if args.compile:
            block.compile()
        blocks[index] = block
    if args.sharding == "ddp":
        model.to_empty(device=device)
        model.tie_weights()  # to_empty gave the tied modules a tensor each (fully_shard keeps them shared)
        init_rotary_embeddings(model, device)
        # FSDP's mixed precision: bf16 compute, fp32 weights and gradient reduction.
        if args.mixed_precision == "bf16":
            model.forward = torch.autocast(device.type, dtype=torch.bfloat16)(model.forward)
        return model
    fsdp_kwargs = dict(mesh=mesh, mp_policy=precision_policy(args))
    if args.cpu_offload:
        fsdp_kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in blocks:
        fully_shard(block, reshard_after_forward=args.sharding != "grad_op", **fsdp_kwargs)
    # Untied input embeddings are their own unit, freed after forward until the end of backward (1 GB
    # gathered at 8B, measured in docs/PERFORMANCE.md); tied ones are one tensor with the output layer.
    embeddings = model.get_input_embeddings()
    if embeddings.weight is not model.get_output_embeddings().weight:
        fully_shard(embeddings, reshard_after_forward=args.sharding != "grad_op", **fsdp_kwargs)
    # The root (embeddings, final norm, output layer) stays gathered after forward: the loss and the
    # backward need it at once.
    fully_shard(model, reshard_after_forward=False, **fsdp_kwargs)
    model.to_empty(device="cpu" if args.cpu_offload else device)
    init_rotary_embeddings(model, device)
    return model


# --------------------------------------------------------------------------------------------------------
# The training step, which the dry run simulates too: loss, optimizer, schedule.
# --------------------------------------------------------------------------------------------------------
LOSS_CHUNK_BYTES = 256e6  # the loss computes the fp32 logits of this many bytes at a time


def final_hidden_states(model, inputs):
    """The last decoder layer's output after the final norm, taken through the model's own forward (so that
    FSDP and DDP hooks run) with the output layer applied to no position."""
    captured = []

    def capture(_module, _inputs, output):
        captured.append(output.last_hidden_state)

    handle = getattr(model, "module", model).base_model.register_forward_hook(capture)
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
    total = sum(
        checkpoint(chunk_cross_entropy, output_layer, h, t, use_reentrant=False)
        for h, t in zip(hidden.split(chunk_tokens), targets.split(chunk_tokens))
    )
    return total / targets.numel()


def build_optimizer(model, args, fused):
    """AdamW; biases, norms and embeddings get no weight decay."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    decay, no_decay = [], []
    for param in model.parameters():
        (decay if param.ndim >= 2 and id(param) not in embeddings else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def lr_factor(step, args, total_steps):
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, total_steps - args.warmup_steps))
    return (args.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (args.lr - args.min_lr)) / args.lr


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


@torch.no_grad()
def evaluate(model, batches, n_batches, world_size):
    """Mean validation loss over n_batches micro-batches of every rank."""
    model.eval()
    total = sum(
        model_loss(model, inputs, targets) for inputs, targets in (next(batches) for _ in range(n_batches))
    )
    model.train()
    dist.all_reduce(total)
    return total.item() / (n_batches * world_size)


# --------------------------------------------------------------------------------------------------------
# Dry run: the training step above, run on fake tensors over a fake process group at the target world
# size, so that a CPU answers "does it fit?" with the real model, wrapping and step.
# --------------------------------------------------------------------------------------------------------
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
DDP_ESTIMATE = (
    "estimated for DDP: FSDP simulated at world size 1 (every rank holds the whole model, as DDP does), plus "
    "DDP's gradient buckets, 4 bytes a parameter"
)
OFFLOAD_ESTIMATE = (
    "estimated for cpu_offload: the simulation without offloading, less the sharded parameters, gradients "
    "and optimizer state, which offloading keeps in host memory"
)
SIMULATION_BLIND_SPOTS = (
    "allocator fragmentation, NCCL buffers and the CUDA context (leave a few GB); CPU SDPA stands in "
    "for flash attention (both keep the same tensors); blocks run eager, where compiled ones keep "
    "no more"
)


def simulate_peak_memory(args, model_config, world_size):
    """Peak bytes per GPU by category over one optimizer step, the second of two (the first allocates the
    optimizer state, and fake DTensors allocate extra once). Two micro-steps stand for any accumulation:
    with gradients reduce-scattered every micro-step, the third looks like the second."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    accumulation = min(2, args.global_batch_size // (args.batch_size * world_size))
    simulated = copy.copy(args)
    simulated.cpu_offload = False  # see report_dry_run: offloading is subtracted, not simulated
    simulated.compile = False  # inductor does not run on fake tensors; eager keeps at least what it keeps
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        mesh = device_mesh(simulated, "cpu", world_size, args.gpus_per_node)
        with FakeTensorMode():
            device = torch.device("cpu")
            model = build_model(model_config, simulated, device, mesh)
            optimizer = build_optimizer(model, args, fused=True)
            tokens = torch.randint(0, model_config.vocab_size, (args.batch_size, args.seq_length))
            batches = itertools.repeat((tokens, tokens))
            train_step(model, batches, optimizer, 1, args.grad_clip, [])
            tracker = FSDPMemTracker(model, optimizer)
            with tracker:
                # The tracker takes a second forward of the root for a second iteration; a micro-step is not.
                hook = model.register_forward_pre_hook(lambda *_: tracker.reset_mod_stats(), prepend=True)
                train_step(model, batches, optimizer, accumulation, args.grad_clip, [])
                hook.remove()
            snapshot = tracker.get_tracker_snapshot("peak")
    finally:
        dist.destroy_process_group()
    by_kind = {
        getattr(kind, "value", kind): size
        for device_snapshot in snapshot.values()
        for kind, size in device_snapshot.items()
    }
    return {name: sum(by_kind.get(kind, 0) for kind in kinds) for name, kinds in MEMORY_CATEGORIES.items()}


def peak_gb(args, model_config, world_size, n_params):
    """Peak per GPU in GB by category. DDP's replicas cannot be faked (DDP reads its parameters' data), and
    CPU tensors on a CPU cannot be told apart from GPU ones: both are estimated from a simulation (see
    DDP_ESTIMATE and OFFLOAD_ESTIMATE)."""
    if args.sharding == "ddp":
        memory = simulate_peak_memory(
            types.SimpleNamespace(**dict(vars(args), sharding="full")), model_config, 1
        )
        memory["gradients"] += 4 * n_params
    else:
        memory = simulate_peak_memory(args, model_config, world_size)
    if args.cpu_offload:
        memory.update({name: 0 for name in OFFLOADED})
    return {name: size / 1e9 for name, size in memory.items()}


def hardware_flops_per_token(args, model, model_config, model_flops):
    """What the GPU computes per token, recomputation included. model_flops (6·N + 12·L·H·Q·T) is three
    forwards' worth; of one forward, the output layer is 2·vocab·width and attention 4·L·H·Q·T. The chunked
    loss recomputes the output layer; full checkpointing every block's forward, selective every
    ac_every-th block's, op-level every other matmul (attention outputs are kept). A recomputation stops
    at the last tensor backward needs, so a block's last matmul, the MLP's output projection, is not
    redone."""
    layers = model_config.num_hidden_layers
    output_forward = 2 * model_config.vocab_size * model_config.hidden_size
    attention_forward = 4 * layers * model_config.hidden_size * args.seq_length
    active = getattr(model_config, "num_experts_per_tok", 1) / getattr(model_config, "num_local_experts", 1)
    name, last = [(n, p) for n, p in decoder_layers(model)[0].named_parameters() if p.ndim >= 2][-1]
    last_matmul = 2 * layers * last.numel() * (active if "experts" in name else 1)
    redone_forward = model_flops / 3 - output_forward - last_matmul
    recomputed = {
        "none": 0,
        "full": redone_forward,
        "selective": redone_forward * (layers // args.ac_every) / layers,
        "op": (redone_forward - attention_forward) / 2,
    }[args.activation_checkpointing]
    return model_flops + recomputed + output_forward


def changes_that_might_fit(args):
    """The changes to try, least costly first: full activation checkpointing, then smaller micro-batches
    with more accumulation (the same global batch), then offloading the model state to host memory."""
    change = {} if args.activation_checkpointing == "full" else {"activation_checkpointing": "full"}
    if change:
        yield dict(change)
    batch = args.batch_size
    while batch > 1:
        batch //= 2
        change["batch_size"] = batch
        yield dict(change)
    if args.sharding != "ddp" and not args.cpu_offload:
        yield dict(change, cpu_offload=True)


def report_dry_run(args, shape, model_config, meta_model):
    """Prints the config, the model, the simulated peak memory per GPU, FLOPs per token and a verdict.
    Exit status: 0 fits, 1 does not fit, 2 bad input."""
    gpu_name, gpu_gb = gpu_memory_gb(args.gpu)
    world_size = launched_world_size(args)
    n_params = describe_model(args, shape, model_config, meta_model)
    model_flops = flops_per_token(meta_model, model_config, args.seq_length)
    hardware_flops = hardware_flops_per_token(args, meta_model, model_config, model_flops)
    print(
        f"FLOPs per token: {model_flops / 1e9:.4g} G for MFU (6·N + 12·L·H·Q·T), {hardware_flops / 1e9:.4g} "
        f"G computed with recomputation: at most {model_flops / hardware_flops:.0%} MFU"
    )
    started = time.perf_counter()
    memory = peak_gb(args, model_config, world_size, n_params)
    total = sum(memory.values())
    print(
        f"simulated one training step on fake tensors: world size {world_size}, sharding={args.sharding}, "
        f"{args.mixed_precision}, activation_checkpointing={args.activation_checkpointing}, "
        f"batch {args.batch_size} x {args.seq_length} ({time.perf_counter() - started:.0f} s)"
    )
    for name, gb in memory.items():
        print(f"  {name:<22} {gb:9.3f} GB")
    if args.sharding == "ddp":
        print(f"  {DDP_ESTIMATE}")
    if args.cpu_offload:
        print(f"  {OFFLOAD_ESTIMATE}")
    print(f"not simulated: {SIMULATION_BLIND_SPOTS}")
    target = f"{gpu_gb:g} GB ({gpu_name})" if gpu_name else f"{gpu_gb:g} GB"
    print(f"peak memory per GPU (simulated): {total:.1f} GB of {target}")
    if total <= gpu_gb:
        print(f"verdict: fits, {gpu_gb - total:.1f} GB to spare")
        return 0
    for change in changes_that_might_fit(args):
        candidate = types.SimpleNamespace(**{**vars(args), **change})
        peak = sum(peak_gb(candidate, model_config, world_size, n_params).values())
        if peak <= gpu_gb:
            flags = " ".join(f"--{name}={value}" for name, value in change.items())
            print(f"verdict: does not fit; fits with {flags} (simulated {peak:.2f} GB)")
            return 1
    tried = "full activation checkpointing, batch_size 1, cpu_offload"
    print(f"verdict: does not fit, and no change tried fits ({tried}): use more GPUs or a smaller model")
    return 1


def describe_model(args, shape, model_config, meta_model):
    """Prints the options and the model, as the dry run and the training run both begin; returns the
    number of parameters."""
    n_params = sum(p.numel() for p in meta_model.parameters())
    print("config:", " ".join(f"{k}={v}" for k, v in vars(args).items()))
    print(
        f"model: {args.init_from or args.model} ({type(model_config).__name__}) n_embd={shape.n_embd} "
        f"n_layer={shape.n_layer} n_head={shape.n_head} n_positions={shape.n_positions} "
        f"vocab={model_config.vocab_size}"
    )
    print(f"parameters: {n_params:,} ({n_params / 1e9:.2f}B)", flush=True)
    return n_params


# --------------------------------------------------------------------------------------------------------
# Setup: the machine, the run's folders and lock, the device and the process group.
# --------------------------------------------------------------------------------------------------------
def check_machine_holds(args, meta_model):
    """Refuses, before any model is built, a run whose weights, gradients and AdamW state alone (16 bytes a
    parameter in fp32, sharded over the ranks) exceed this node's memory: GPU memory, or host memory."""
    from benchmark import available_memory_bytes

    n_params = sum(p.numel() for p in meta_model.parameters())
    world_size = launched_world_size(args)
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    shards = 1 if args.sharding == "ddp" else world_size
    if torch.cuda.is_available():
        needed, where = 16 * n_params / shards, "per GPU"
        available = torch.cuda.get_device_properties(0).total_memory
    else:
        needed, where = 16 * n_params / shards * local_world_size, "of host memory on this node"
        available = available_memory_bytes()
    if needed > available:
        check = "python train.py --dry_run"
        fix = f"on a CPU use --model=tiny; for GPUs, sbatch slurm_submit.sh (check first with {check})"
        if torch.cuda.is_available():
            fix = f"on GPUs, check a config with {check}"
        raise ConfigError(
            f"--model={args.init_from or args.model} needs at least {needed / 1e9:.1f} GB {where} for "
            f"its weights, gradients and optimizer state; {available / 1e9:.1f} GB are available: {fix}"
        )


RUN_LOCK = "trainer.lock"
LOCK_HEARTBEAT_S = 30
LOCK_STALE_S = 300  # a lock whose heartbeat is this old, held on another host, is abandoned


def make_run_folders(args):
    """The run's checkpoint folder, its log folder (logs, config, curves, diagnostics) and its lock, which
    rank 0 takes before any process group: a second launch of the same run stops here."""
    run_dir = os.path.join(args.checkpoint_dir, args.run_name)
    log_folder = os.path.join(args.log_dir, args.run_name)
    os.makedirs(run_dir, exist_ok=True)
    os.makedirs(log_folder, exist_ok=True)
    return run_dir, log_folder, take_run_lock(run_dir) if os.environ.get("RANK", "0") == "0" else None


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
    me = {"host": socket.gethostname(), "pid": os.getpid(), "job_id": os.environ.get("SLURM_JOB_ID")}
    with open(mine, "w") as file:
        json.dump(me, file)
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
                raise ConfigError(
                    f"run {run_dir} is already being trained by pid {holder.get('pid', '?')} "
                    f"on {holder.get('host', '?')}{job} (lock {path}); wait for it to finish, "
                    f"or set another --run_name or --checkpoint_dir"
                )
            try:  # the rename lets only one of several launches take a stale lock over
                os.rename(path, mine + ".stale")
            except FileNotFoundError:
                continue
            os.remove(mine + ".stale")
            gone = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
            print(f"taking over the lock of run {run_dir} from {gone}, which is gone", flush=True)
    finally:
        os.remove(mine)

    def heartbeat():
        while True:
            time.sleep(LOCK_HEARTBEAT_S)
            with contextlib.suppress(OSError):
                os.utime(path)

    threading.Thread(target=heartbeat, daemon=True).start()
    return path


def release_run_lock(path):
    """Removes the lock if this process holds it; path is None on ranks other than 0."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        with open(path) as file:
            if json.load(file)["pid"] == os.getpid():
                os.remove(path)


def setup_distributed(args, log_folder):
    """(device, rank, world size, device mesh), the process group started. A plain `python train.py` is a
    process group of one, on a free port."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        port = os.environ.get("MASTER_PORT") or str(free_port())
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cpu")
    if torch.cuda.is_available():
        # Segments that grow in place instead of new blocks: less fragmentation as sequence shapes and
        # FSDP's all-gather buffers come and go (torchtitan's launcher sets it too). A user's setting wins.
        if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
            os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")
        flight_recorder_env(os.environ, log_folder)
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    if args.compile:
        check_compiler(device)
    if device.type == "cpu" and args.mixed_precision == "bf16" and rank == 0:
        warn_if_bf16_is_slow()
    store = None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Workers restarted by torchrun --max-restarts meet in the same agent store as the failed attempt;
        # without a per-attempt prefix they would read the dead workers' addresses and hang.
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        agent_store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timedelta(minutes=30))
        store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent_store)
    cuda = device.type == "cuda"
    # Offloaded gradients are CPU tensors: their norm needs a CPU backend beside NCCL. device_id binds
    # NCCL's communicator to this GPU at once, instead of guessing it at the first collective.
    backend = ("cuda:nccl,cpu:gloo" if args.cpu_offload else "nccl") if cuda else "gloo"
    options = dict(timeout=PG_TIMEOUT_FIRST_STEP, device_id=device if cuda else None)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **options)
    mesh = device_mesh(args, device.type, world_size, int(os.environ["LOCAL_WORLD_SIZE"]))
    return device, rank, world_size, mesh


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_compiler(device):
    """--compile needs a toolchain: a C++ compiler for CPU kernels, Triton and libcuda for GPU ones. Compiling
    a two-line function finds out in seconds, before any data or model, instead of at the first step."""
    try:
        torch.compile(lambda x: torch.sin(x) * 2 + 1)(torch.ones(8, device=device))
    except Exception as error:  # inductor raises many types; the first line names what is missing
        needs = "a C++ compiler (g++, or $CXX)" if device.type == "cpu" else "Triton with libcuda"
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(
            f"--compile=True cannot compile for {device.type}: it needs {needs} ({first[:200]}); "
            f"install it, or use --compile=False"
        ) from None


def cpu_matmul_gflops():
    """(fp32 GFLOP/s, bf16 GFLOP/s) of a small CPU matmul, best of 3. A CPU without native bf16 (AVX512-BF16,
    AMX) multiplies bf16 matrices through a scalar fallback: 0.9 against fp32's 93 on an AVX2 EPYC."""
    rates = []
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.ones(64, 256, dtype=dtype), torch.ones(256, 256, dtype=dtype)
        a @ b
        seconds = []
        for _ in range(3):
            started = time.perf_counter()
            a @ b
            seconds.append(time.perf_counter() - started)
        rates.append(2 * 64 * 256 * 256 / min(seconds) / 1e9)
    return rates


def warn_if_bf16_is_slow():
    fp32, bf16 = cpu_matmul_gflops()
    if fp32 > 4 * bf16:
        print(
            f"warning: this CPU multiplies bf16 matrices {fp32 / bf16:.0f}x slower than fp32 ({bf16:.1f} "
            f"against {fp32:.1f} GFLOP/s): on it, --mixed_precision=fp32 trains faster",
            flush=True,
        )


def device_mesh(args, device_type, world_size, local_world_size):
    """One dimension, or (replicate, shard) over nodes for --sharding=hybrid."""
    if args.sharding == "hybrid":
        shape = (world_size // local_world_size, local_world_size)
        return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (world_size,))


def already_finished(args, resume_path, total_steps, run_dir, master):
    """A relaunch of a run that finished (its newest checkpoint is its last step, its model exported)."""
    step = int(resume_path.rsplit("_", 1)[1]) if resume_path else 0
    exported = os.path.isdir(os.path.join(run_dir, "final_model"))
    finished = not args.resume_from and step >= total_steps and exported
    if finished and master:
        print(
            f"run {args.run_name} already finished at step {step} ({resume_path}); nothing to do. Pass "
            f"--run_name=NEW for a new run, or a larger --max_steps to train on.",
            flush=True,
        )
    return finished


def teardown(lock):
    """Returns 0 once every rank is done with the process group, and the run's lock is released."""
    dist.barrier()  # a rank leaving while gloo still talks to it aborts the other
    dist.destroy_process_group()
    release_run_lock(lock)
    return 0


def print_run_banner(args, shape, model_config, meta_model, device, world_size, accumulation, total_steps):
    describe_model(args, shape, model_config, meta_model)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    tokens = args.global_batch_size * args.seq_length
    print(
        f"world_size={world_size} | device={name} | gradient accumulation {accumulation} | "
        f"{total_steps} steps of {tokens:,} tokens",
        flush=True,
    )


# --------------------------------------------------------------------------------------------------------
# Checkpoints: <checkpoint_dir>/<run_name>/step_<N>/, written under a temporary name and renamed once
# every rank has finished, so a folder named step_<N> is always complete. Its manifest.json holds a CRC-32
# checksum of every other file, checked before any tensor is loaded. Exports for transformers.
# --------------------------------------------------------------------------------------------------------
MANIFEST = "manifest.json"
HASH_CHUNK = 64 << 20


def checkpoint_steps(run_dir):
    """Steps of the step_N folders of a run, oldest first (step_N.tmp folders are not complete)."""
    return sorted(int(m.group(1)) for name in os.listdir(run_dir) if (m := re.fullmatch(r"step_(\d+)", name)))


def newest_checkpoint(run_dir):
    steps = checkpoint_steps(run_dir)
    return os.path.join(run_dir, f"step_{steps[-1]}") if steps else None


def model_and_optimizer_state(model, optimizer, full):
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

    def own(name):
        match = per_rank.fullmatch(name)
        return str(rank) in match.groups() if match else rank == 0

    return sorted(name for name in os.listdir(folder) if name != MANIFEST and own(name))


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

    return OSError, RuntimeError, dcp.CheckpointException, SafetensorError


class Checkpointer:
    """Saves and restores everything an exact resume needs: model, optimizer, schedule, step, tokens
    seen, data position, RNG states and the config. Tensors go through torch.distributed.checkpoint;
    the rest is JSON and a small per-rank file of RNG states and data position, read with
    weights_only=True, so nothing is unpickled on load."""

    def __init__(self, args, shape, rank, world_size):
        self.args, self.shape, self.rank, self.world_size = args, shape, rank, world_size
        self.run_dir = os.path.join(args.checkpoint_dir, args.run_name)
        self.pending = None  # (future of (error, checksums), temporary folder, final folder) of an async save
        # Background saves talk over their own group so they never interleave with training collectives.
        self.group = dist.new_group(backend="gloo") if args.async_checkpoint else None
        self.hasher = ThreadPoolExecutor(1) if args.async_checkpoint else None
        self.stager = None
        if args.async_checkpoint and torch.cuda.is_available():
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
            names = own_files(temporary, self.rank)
            return None, {name: file_checksum(os.path.join(temporary, name)) for name in names}
        except OSError as error:
            return save_error(error), None

    def written(self, future, temporary):
        """The outcome of a background save, then the checksums of its files: runs on the hasher thread."""
        try:
            future.result()
        except save_errors() as error:
            return save_error(error), None
        return self.checksums(temporary)

    def save(self, trainer_state, model, optimizer, scheduler, batches):
        """trainer_state: the step, tokens seen and time so far; the options and the shape are added."""
        self.finish()
        step = trainer_state["step"]
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
        full = self.args.ckpt_format == "full"
        model_state, optimizer_state = model_and_optimizer_state(model, optimizer, full)
        state = {"model": model_state, "optimizer": optimizer_state}
        try:
            if full:
                if self.rank == 0:
                    torch.save(state, os.path.join(temporary, "state_dict.pt"))
            elif self.args.async_checkpoint:
                future = dcp.async_save(
                    state, checkpoint_id=temporary, process_group=self.group, async_stager=self.stager
                )
                self.pending = (self.hasher.submit(self.written, future, temporary), temporary, final)
            else:
                dcp.save(state, checkpoint_id=temporary)
            # The data position is per rank for streams; RNG states are per rank always.
            position, rank_file = batches.state_dict(), os.path.join(temporary, f"rank{self.rank}.pt")
            torch.save({"rng": rng_states(), "data": position}, rank_file)
            if self.rank == 0:
                shape = {name: getattr(self.shape, name) for name in SHAPE_NAMES}
                trainer_state = dict(trainer_state, config=vars(self.args), shape=shape, data=position)
                trainer_state.update(scheduler=scheduler.state_dict(), world_size=self.world_size)
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
                kept = self.args.keep_last
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
        kept = (
            f"the previous checkpoint {previous} is untouched"
            if previous
            else "there is no earlier checkpoint"
        )
        fail(
            f"writing checkpoint {temporary} failed ({problem}; {space_left(self.run_dir)}); {kept}. "
            f"Free space or fix permissions, then relaunch"
        )

    def problem(self, path):
        """The first problem any rank finds in its share of the checkpoint's files, or None."""
        return next(filter(None, self.gather(checkpoint_problem(path, self.rank, self.world_size))), None)

    def choose(self, resume_from):
        """The checkpoint to resume from: resume_from, else the newest of the run; one that is incomplete
        or corrupt is skipped for the one before it. None for a fresh run; exit 2 if none is usable."""
        run_dir = os.path.dirname(os.path.normpath(resume_from)) or "." if resume_from else self.run_dir
        steps = reversed(checkpoint_steps(run_dir))
        candidates = [os.path.normpath(os.path.join(run_dir, f"step_{step}")) for step in steps]
        if resume_from:
            newest = os.path.normpath(resume_from)
            older = candidates[candidates.index(newest) + 1 :] if newest in candidates else []
            candidates = [newest] + older
        for index, path in enumerate(candidates):
            problem = self.problem(path)
            if problem is None:
                return path
            if self.rank == 0:
                following = "no earlier checkpoint is left"
                if index + 1 < len(candidates):
                    following = f"falling back to {candidates[index + 1]}"
                print(f"warning: checkpoint {path} is unusable: {problem}; {following}", flush=True)
        if candidates:
            message = (
                f"no usable checkpoint to resume from ({', '.join(candidates)}); delete them to start "
                f"over, or set another --run_name"
            )
            fail(message) if self.rank == 0 else sys.exit(2)
        return None

    def load(self, path, model, optimizer, scheduler, batches):
        """Restores a checkpoint written by save(); returns its trainer state."""
        with open(os.path.join(path, "trainer_state.json")) as f:
            trainer_state = json.load(f)
        recorded = trainer_state["shape"]
        changed = {k: (v, getattr(self.shape, k)) for k, v in recorded.items() if getattr(self.shape, k) != v}
        if changed:
            details = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items())
            fail(
                f"checkpoint {path} has another model shape ({details}); use another --run_name or "
                f"--checkpoint_dir"
            )
        full_file = os.path.join(path, "state_dict.pt")
        full = os.path.exists(full_file)
        if full:  # memory-mapped: the ranks of a node share one copy in the page cache
            state = torch.load(full_file, weights_only=True, mmap=True)
        else:
            model_state, optimizer_state = model_and_optimizer_state(model, optimizer, full=False)
            state = {"model": model_state}
            if not self.args.skip_optimizer:
                state["optimizer"] = optimizer_state
            dcp.load(state, checkpoint_id=path)
        options = StateDictOptions(full_state_dict=full)
        if self.args.skip_optimizer:  # fresh optimizer; this run's schedule, at the resumed step
            set_model_state_dict(model, state["model"], options=options)
            scheduler.last_epoch = trainer_state["step"] - 1
            scheduler.step()
        else:
            set_state_dict(
                model,
                optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
                options=options,
            )
            scheduler.load_state_dict(trainer_state["scheduler"])
        rank_file = os.path.join(path, f"rank{self.rank}.pt")
        if trainer_state["world_size"] == self.world_size:
            rank_state = torch.load(rank_file, weights_only=True)
            restore_rng_states(rank_state["rng"])
            batches.load_state_dict(rank_state["data"])
        elif isinstance(batches, StreamingBatches):
            writers = trainer_state["world_size"]
            fail(
                f"checkpoint {path} of a streamed run was written by {writers} processes: "
                f"a stream's position cannot be split anew, so resume it with {writers}"
            )
        else:  # window positions do not depend on the world size
            batches.load_state_dict(trainer_state["data"])
        return trainer_state


def checkpoint_problem(path, rank=0, world_size=1):
    """None if path is a complete checkpoint whose files all match their checksums, else the first problem
    found; of several ranks, each checks its share of the files."""
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
    for name in sorted(files)[rank::world_size] if problem is None else []:
        file = os.path.join(path, name)
        try:
            checksum = file_checksum(file)
        except FileNotFoundError:
            problem = f"{file} is missing"
        except OSError as error:
            problem = f"{file} is unreadable ({error.strerror})"
        else:
            if checksum["size"] != files[name]["size"]:
                problem = f"{file} has {checksum['size']} bytes instead of {files[name]['size']} (truncated?)"
            elif checksum != files[name]:
                problem = f"{file} does not match its checksum (corrupt)"
        if problem:
            break
    return problem


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


def export_pretrained(model, model_config, tokenizer, path, rank):
    """The final weights of the training model, gathered on rank 0, as a transformers folder. A failed write
    is one line, and every rank exits."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    problem = [None]
    if rank == 0:
        try:
            plain = build_meta_model(model_config)
            plain.load_state_dict(state, assign=True)
            save_export(plain, tokenizer, path)
        except save_errors() as error:
            problem = [
                f"writing the export {path}.tmp failed ({save_error(error)}; "
                f"{space_left(os.path.dirname(path))}); the checkpoints are untouched. "
                f"Free space, then relaunch to export"
            ]
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        fail(problem[0]) if rank == 0 else sys.exit(2)


def export_checkpoint(path, destination=None):
    """Any step_N checkpoint, of either format, as a transformers folder (by default export_step_N beside
    it): one process, no GPU, no process group. The model is rebuilt from the options and shape the
    checkpoint records, and its files are checked against their checksums first."""
    path = os.path.normpath(path)
    destination = destination or os.path.join(os.path.dirname(path), f"export_{os.path.basename(path)}")
    if not os.path.isfile(os.path.join(path, "trainer_state.json")):
        raise ConfigError(
            f"--export_from={path} is not a complete checkpoint (no trainer_state.json); "
            f"give a step_N folder of <checkpoint_dir>/<run_name>"
        )
    if problem := checkpoint_problem(path):
        raise ConfigError(f"--export_from={path} is unusable: {problem}")
    with open(os.path.join(path, "trainer_state.json")) as file:
        trainer_state = json.load(file)
    saved = parse_args([])
    vars(saved).update({k: v for k, v in trainer_state["config"].items() if k in option_types()})
    shape = resolve_shape(saved)
    vars(shape).update(trainer_state["shape"])
    tokenizer = load_tokenizer(saved)
    # The vocabulary as it was saved, whatever the tokenizer holds now.
    model = build_meta_model(build_model_config(shape, tokenizer, shape.vocab_size))
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


# --------------------------------------------------------------------------------------------------------
# Logging: a line per log window on rank 0, and the run's folder <log_dir>/<run_name>: metrics.jsonl,
# TensorBoard, W&B, config.yaml and curves.png.
# --------------------------------------------------------------------------------------------------------
class Progress:
    """Where the run stands (step, tokens seen, time) and its log window: the loss over every step since the
    last line, and speed over the timed steps among them (not the first, compiling, step; never evaluation
    or checkpoint writing). Also stops the run after max_bad_steps non-finite steps in a row."""

    def __init__(self, args, model, model_config, device, total_steps, start_time, folder):
        self.args, self.device, self.total_steps, self.start_time = args, device, total_steps, start_time
        self.world_size, self.master = dist.get_world_size(), dist.get_rank() == 0
        self.step, self.tokens_seen, self.elapsed_before, self.bad_steps = 0, 0, 0.0, 0
        self.tokens_per_step = args.global_batch_size * args.seq_length
        self.flops_per_token = flops_per_token(model, model_config, args.seq_length)
        self.peak_flops = peak_flops(device)
        self.rank_times = RankTimes(model, device, args.compile)
        names = [None] * self.world_size
        dist.all_gather_object(names, f"{socket.gethostname()}:{os.environ['LOCAL_RANK']}")
        self.stragglers = Stragglers(names)
        self.run_log = RunLog(args, folder) if self.master else None
        self.first_step_end, self.step_seconds = None, 0.0
        self.log_window = self.new_log_window()

    def resume(self, trainer_state, path):
        self.step, self.tokens_seen = trainer_state["step"], trainer_state["tokens_seen"]
        self.elapsed_before = trainer_state.get("elapsed_s", 0.0)  # the time of the run's earlier launches
        if self.master:
            fresh = " (weights only, fresh optimizer)" if self.args.skip_optimizer else ""
            print(f"resumed from {path} at step {self.step}{fresh}", flush=True)

    def timed(self, batches):
        return self.rank_times.timed(batches)

    @contextlib.contextmanager
    def timing(self):
        started = time.perf_counter()
        yield
        self.step_seconds = time.perf_counter() - started

    def new_log_window(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        return {"loss": torch.zeros((), device=self.device), "steps": 0, "seconds": 0.0, "timed": 0}

    def step_done(self, step, loss, grad_norm, lr):
        self.step, self.grad_norm, self.lr = step, grad_norm, lr
        self.tokens_seen += self.tokens_per_step
        # The ETA counts from the first step's end: evaluation and checkpoints in, compiling out.
        if self.first_step_end is None:
            self.first_step_end, self.first_step = time.perf_counter(), step
            self.rank_times.reset()
            if self.master:
                print(f"time to first step: {self.first_step_end - self.start_time:.1f} s", flush=True)
        else:
            self.log_window["seconds"] += self.step_seconds
            self.log_window["timed"] += 1
        self.log_window["loss"] += loss
        self.log_window["steps"] += 1
        self.bad_steps = 0 if math.isfinite(grad_norm) else self.bad_steps + 1
        if self.bad_steps and self.master:
            print(
                f"step {step}: non-finite loss or gradient norm, update skipped ({self.bad_steps} in a row, "
                f"limit {self.args.max_bad_steps})",
                flush=True,
            )
        if self.bad_steps >= self.args.max_bad_steps:
            kept = newest_checkpoint(os.path.join(self.args.checkpoint_dir, self.args.run_name))
            fail(
                f"stopping: {self.bad_steps} non-finite steps in a row (lower --lr or raise --warmup_steps); "
                f"last good checkpoint: {kept or 'none written yet'}"
            )

    def log(self, val_loss):
        """Every rank takes part: the loss is averaged, and the ranks' timings gathered for stragglers."""
        dist.all_reduce(self.log_window["loss"])  # gloo has no AVG: sum, then divide
        timings = self.rank_times.gather(self.world_size, self.master)
        if self.master:
            record = self.record(val_loss)
            record.update(self.stragglers.log_window(timings, self.log_window["timed"]))
            print(log_line(record, self.total_steps), flush=True)
            self.run_log.write(record)
        self.log_window = self.new_log_window()

    def record(self, val_loss):
        timed, seconds, now = self.log_window["timed"], self.log_window["seconds"], time.perf_counter()
        cuda, steps_since_first = self.device.type == "cuda", self.step - self.first_step
        tokens_per_s = self.tokens_per_step * timed / seconds if timed else None
        peak = self.peak_flops * self.world_size if self.peak_flops and timed else None
        mfu = self.flops_per_token * tokens_per_s / peak if peak else None
        rate = (now - self.first_step_end) / steps_since_first if steps_since_first else None
        loss_sum = self.log_window["loss"]  # over the steps of the window and the ranks
        record = {
            "step": self.step, "loss": loss_sum.item() / self.world_size / self.log_window["steps"],
            "lr": self.lr, "grad_norm": self.grad_norm, "tokens_per_s": tokens_per_s,
            "samples_per_s": self.args.global_batch_size * timed / seconds if timed else None,
            "step_time_s": seconds / timed if timed else None, "mfu": mfu,
            "peak_mem_GB": torch.cuda.max_memory_allocated(self.device) / 1e9 if cuda else None,
            "peak_reserved_GB": torch.cuda.max_memory_reserved(self.device) / 1e9 if cuda else None,
            "elapsed_s": self.elapsed_before + now - self.start_time,
            "eta_s": rate * (self.total_steps - self.step) if rate is not None else None,
        }  # fmt: skip
        if val_loss is not None:
            record.update(val_loss=val_loss, val_ppl=math.exp(min(val_loss, 50)))
        return record

    def trainer_state(self):
        elapsed = self.elapsed_before + time.perf_counter() - self.start_time
        return {"step": self.step, "tokens_seen": self.tokens_seen, "elapsed_s": elapsed}

    def close(self, stopped):
        if not self.master:
            return
        if stopped:
            print(
                f"stopped by signal after step {self.step}; checkpoint saved, relaunch to resume", flush=True
            )
        else:
            print(
                f"done: {self.total_steps} steps in {time.perf_counter() - self.start_time:.1f} s", flush=True
            )
        self.run_log.close()
        if curves := plot_curves(self.run_log.folder):
            print(f"curves: {curves}", flush=True)


def peak_flops(device):
    """Dense bf16 peak of one device from benchmark.py's datasheet table; None on CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    from benchmark import datasheet

    sheet = datasheet(torch.cuda.get_device_name(device))
    return sheet["bf16"] * 1e12 if sheet and sheet.get("bf16") else None


def duration(seconds):
    if seconds is None:
        return "-"
    return f"{int(seconds) // 3600}:{int(seconds) % 3600 // 60:02d}:{int(seconds) % 60:02d}"


def log_line(record, total_steps):
    def shown(key, text):
        return text.format(record[key]) if record[key] is not None else "-"

    line = (f"step {record['step']:>6}/{total_steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
            f"grad norm {record['grad_norm']:.3f} | {shown('tokens_per_s', '{:,.0f}')} tok/s | "
            f"{shown('samples_per_s', '{:.1f}')} samples/s | step {shown('step_time_s', '{:.3f}')} s | "
            f"MFU {shown('mfu', '{:.1%}')} | mem {shown('peak_mem_GB', '{:.1f}')} / "
            f"{shown('peak_reserved_GB', '{:.1f}')} GB | elapsed {duration(record['elapsed_s'])} | "
            f"ETA {duration(record['eta_s'])}")  # fmt: skip
    if "val_loss" in record:
        line += f" | val loss {record['val_loss']:.4f} | val ppl {record['val_ppl']:.2f}"
    for name, figures in record.get("stragglers", {}).items():
        line += f" | straggler {name}: {describe_straggler(figures, record)}"
    return line


class RunLog:
    """Rank 0's records of a run in its folder <log_dir>/<run_name>: metrics.jsonl (appended to by every
    launch of the run), TensorBoard, and W&B when --wandb names a project. The W&B run's id is the run
    name, so a requeued or relaunched job continues the same W&B run."""

    def __init__(self, args, folder):
        self.folder = folder
        self.metrics = open(os.path.join(folder, "metrics.jsonl"), "a")
        self.writer = self.wandb = None
        if args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(os.path.join(folder, "tensorboard"))
        if args.wandb:
            import wandb as wandb_module  # the constant wandb is the project's name

            try:
                run = dict(project=args.wandb, id=args.run_name, name=args.run_name, resume="allow")
                self.wandb = wandb_module.init(**run, config=vars(args), dir=folder)
            except wandb_module.errors.Error as error:  # no API key, W&B unreachable
                fail(f"--wandb={args.wandb}: {str(error).splitlines()[0]}; or set WANDB_MODE=offline")

    def write(self, record):
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        scalars = {
            f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}": value
            for key, value in record.items()
            if key != "step" and isinstance(value, (int, float))
        }
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


def write_run_folder(args, folder):
    """The resolved config, which --config=<folder>/config.yaml replays, and a pointer to the benchmark
    report of each job that trained the run (slurm_submit.sh names it in $BENCHMARK_REPORT)."""
    import yaml

    write_atomically(os.path.join(folder, "config.yaml"), yaml.safe_dump(vars(args), sort_keys=False))
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

    def series(key):
        logged = [r for r in records if r.get(key) is not None]
        return [r["step"] for r in logged], [r[key] for r in logged]

    figure, axes = plt.subplots(2, 2, figsize=(12, 7.5), sharex=True)
    panels = [
        ("loss", [("loss", "training"), ("val_loss", "validation")]),
        ("learning rate", [("lr", None)]),
        ("tokens/s (all devices)", [("tokens_per_s", None)]),
        ("MFU", [("mfu", None)]),
    ]
    for axis, (title, keys) in zip(axes.flat, panels):
        axis.set_title(title)
        axis.grid(alpha=0.3)
        for key, label in keys:
            steps, values = series(key)
            if steps:
                few = len(steps) < 30 or key == "val_loss"
                axis.plot(steps, values, label=label, marker="o" if few else None, markersize=3)
        if not axis.lines:
            empty = "not measured (MFU needs a GPU of the datasheet)" if title == "MFU" else "not measured"
            axis.text(0.5, 0.5, empty, ha="center", va="center", transform=axis.transAxes, color="gray")
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


# --------------------------------------------------------------------------------------------------------
# When a run misbehaves: stop signals, flight recorder, process-group timeouts, a watchdog, stragglers, a
# profiler. Every file goes to the run's log folder, <log_dir>/<run_name>.
# --------------------------------------------------------------------------------------------------------
HUNG = 3  # exit status of a rank its watchdog ended
# Process-group timeouts, as torchtitan's set_pg_timeouts: generous until the first step is done (compiling,
# loading weights) and while a checkpoint is written; short after, so a hung collective ends in minutes, not
# half an hour. Longer than hang_minimum_s, so the watchdog names the hang first.
PG_TIMEOUT_FIRST_STEP = timedelta(minutes=30)
PG_TIMEOUT = timedelta(minutes=10)
FR_BUFFER_SIZE = 20000  # NCCL flight recorder: the last collectives kept per rank (torchtitan's)
STRAGGLER_MARGIN = 0.10  # a rank this far above the median compute or data-wait time is named
STRAGGLER_LOG_WINDOWS = 3  # named in this many log windows in a row: a warning to exclude its node
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
                print(
                    f"{name}: checkpointing at the end of this step (a second signal exits at once)",
                    flush=True,
                )
                continue
            if self.training and time.monotonic() - self.first < SAME_STOP_SECONDS:
                continue
            why = "a second stop signal" if self.training else "before training started"
            message = f"{name}, {why}: exiting at once with status {128 + number}, writing nothing"
            print(message, file=sys.stderr, flush=True)
            os._exit(128 + number)


def flight_recorder_env(environ, folder):
    """Turns on NCCL's flight recorder (the last FR_BUFFER_SIZE collectives of each rank, dumped when one
    times out) with its dumps in folder/flight_recorder, alone there as torchfrtrace wants them; a variable
    the user set, under its new or its old name, wins."""
    dumps = os.path.join(folder, "flight_recorder")
    defaults = {
        ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"): str(FR_BUFFER_SIZE),
        ("TORCH_NCCL_DUMP_ON_TIMEOUT",): "1",
        ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"): os.path.join(dumps, "rank_"),
    }
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

    def __init__(self, args, folder, rank, device, mesh):
        self.args, self.rank, self.cuda, self.mesh = args, rank, device.type == "cuda", mesh
        self.limits = {
            "evaluating": args.eval_limit_s,
            "writing a checkpoint": args.checkpoint_limit_s,
            "writing the last checkpoint and model": args.checkpoint_limit_s,
        }
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
    def phase(self, name):
        """Evaluation and writing run under their own limits. A write also waits in barriers for the slowest
        writer, which on slow storage may take longer than PG_TIMEOUT."""
        # The order of the assignments keeps the thread from pairing a short limit with an old start time.
        self.phase_limit, self.phase_name = self.limits[name], name
        self.last = time.monotonic()
        writing = generous_pg_timeouts(self.mesh) if name.startswith("writing") else contextlib.nullcontext()
        try:
            with writing:
                yield
        finally:
            self.last = time.monotonic()
            self.phase_limit = None

    def limit(self):
        if self.phase_limit is not None:
            return self.phase_limit
        if not self.step_times:
            return PG_TIMEOUT_FIRST_STEP.total_seconds()
        return max(self.args.hang_minimum_s, self.args.hang_factor * statistics.median(self.step_times))

    def watch(self):
        while True:
            time.sleep(0.5)
            limit, waited = self.limit(), time.monotonic() - self.last
            if waited > limit:
                self.report(waited, limit)

    def report(self, waited, limit):
        during = f"{self.phase_name}, " if self.phase_limit is not None else ""
        line = (
            f"no step for {waited:.0f} s on {self.host} rank {self.rank}; stacks in {self.path} "
            f"({during}limit {limit:.0f} s)"
        )
        try:  # whatever fails here, the rank must still end
            with open(self.path, "w") as file:
                file.write(line + "\n\n")
                file.flush()
                faulthandler.dump_traceback(file, all_threads=True)
            dump_trace = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
            if self.cuda and dump_trace is not None:  # a CUDA build: this rank's last collectives too
                names = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
                prefix = next(os.environ[name] for name in names if os.environ.get(name))
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

    def __init__(self, model, device, compiled):
        self.device, self.cuda = device, device.type == "cuda"
        self.compute, self.data, self.started, self.events = 0.0, 0.0, None, []
        # The hooks run inside a compiled block's call: traced into its graph, they would time the tracing
        # once. Only imported when compiling: torch.compiler imports dynamo, a second of every start.
        outside_graph = torch.compiler.disable if compiled else lambda hook: hook
        for layer in decoder_layers(getattr(model, "module", model)):
            layer.register_forward_pre_hook(outside_graph(self.start))
            layer.register_forward_hook(outside_graph(self.stop))

    def start(self, module, args):
        if torch.is_grad_enabled():  # training, not evaluation
            self.started = torch.cuda.Event(enable_timing=True) if self.cuda else time.perf_counter()
            if self.cuda:
                self.started.record()

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
        slow = {
            key: value
            for (key, median), value in zip(medians.items(), values)
            if value > (1 + margin) * median and value - median > floor
        }
        if slow:
            named[name] = slow
    return medians, named


class Stragglers:
    """Rank 0's view of the stragglers, log window after log window."""

    def __init__(self, names):
        self.names, self.streaks = names, {}

    def log_window(self, timings, steps):
        """The record's fields for one log window of steps timed steps (seconds per step); warns of a rank
        named STRAGGLER_LOG_WINDOWS windows in a row."""
        if not steps:
            return {}
        medians, named = find_stragglers(self.names, [[value / steps for value in rank] for rank in timings])
        self.streaks = {name: self.streaks.get(name, 0) + 1 for name in named}
        for name, streak in self.streaks.items():
            if streak == STRAGGLER_LOG_WINDOWS:
                host = name.rpartition(":")[0]
                print(
                    f"warning: {name} has been a straggler for {streak} log windows in a row "
                    f"({describe_straggler(named[name], medians)}); if its node stays slow, stop the job "
                    f"and resubmit without it: sbatch --exclude={host} slurm_submit.sh ...",
                    flush=True,
                )
        return {**medians, "stragglers": named}


def describe_straggler(figures, medians):
    """figures and medians: seconds per step by compute_s and data_wait_s."""
    described = [f"{key[:-2].replace('_', ' ')} {value:.3f} s/step vs median {medians[key]:.3f}"
                 for key, value in figures.items()]  # fmt: skip
    return ", ".join(described)


class StepProfiler:
    """--profile_steps=A,B: torch.profiler over steps A to B (as logged) of rank 0, written as a Chrome trace
    that Perfetto and TensorBoard's profiler open; on GPU a CUDA memory snapshot beside it."""

    def __init__(self, steps, folder, device, master):
        self.steps = profiled_steps(steps) if master else None
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


if __name__ == "__main__":
    status = main(sys.argv[1:])
    # Skip the interpreter's teardown: the loader's daemon thread may be inside tokenizer or Arrow code,
    # and finalising around it can abort a process whose run has already finished and saved.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
