"""train.py's options, in one place. They are declared at the top of train.py, in two blocks: what the run
computes, whose values name the run, and how the run is operated. Here they are read from its source
(declared, blocks), so that benchmark.py and sample.py take them without importing train.py; parsed (parse);
completed and checked as a run settles them before anything is built (complete_and_check: the model's shape,
the kind of data, every check that needs no data), a choice of the auto options as well (taking_choice); and
the options and model of a run to come (run_options, for benchmark.py) or of a checkpoint (rebuild_model, for
--export_from and sample.py). Bad input is a ConfigError: one line per problem, exit status 2."""

import contextlib
import functools
import hashlib
import importlib.util
import json
import math
import os
import re
import sys
import tempfile
import types

import torch

from common.datasheet import datasheet
from common.errors import ConfigError
from common.files import make_folders, remove_empty
from common.model_folders import check_weights, missing_folder
from common.node import available_memory_bytes
from common.options import declared as declared_in
from common.options import option_nodes, parse_args
from run.checkpoint.set_aside import REWINDS
from run.data.source import load_tokenizer, parse_source
from run.model.float8 import check_float8_available, import_torchao
from run.model.presets import build_meta_model, build_model_config, never_packed_sequences, resolve_shape
from run.progress.profiler import profiled_steps
from run.report_figures import BadReport, measured_elsewhere, read_report

TRAIN_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train.py")
# The lines that open train.py's two blocks of options.
COMPUTES = "# What the run computes"
OPERATES = "# How the run is operated"

CHOICES = {
    "sharding": ("full", "grad_op", "hybrid", "ddp", "auto"),
    "ckpt_format": ("sharded", "full"),
    "activation_checkpointing": ("none", "full", "op", "selective", "auto"),
    "mixed_precision": ("auto", "bf16", "fp32"),
}

POSITIVE = ("batch_size", "seq_length", "global_batch_size", "num_epochs", "log_every", "checkpoint_every",
            "max_bad_steps", "ac_every", "gpus_per_node", "eval_batches", "hang_minimum_s", "hang_factor",
            "checkpoint_limit_s", "eval_limit_s", "lr", "node_mtbf_hours")  # fmt: skip

NOT_NEGATIVE = ("warmup_steps", "weight_decay", "grad_clip", "keep_last", "exclude_stragglers_after")

MAX_RUN_NAME = 200
# Options added after runs were named by the digest of the first block: at their default they stay out of it,
# so that a run named before keeps its name and its relaunch finds its checkpoints.
NAMED_ONLY_WHEN_SET = {"float8": False}

# Far beyond the largest clusters (about 100,000 GPUs); what a plan's search and simulation can take.
MAX_WORLD_SIZE = 1 << 20


@functools.cache
def declared():
    """train.py's options, name -> (default, type), as its source declares them (common/options.py)."""
    return declared_in(TRAIN_SCRIPT)


@functools.cache
def blocks():
    """(the options under COMPUTES, those under OPERATES), in train.py's order. The first block names the run:
    the default --run_name is a digest of its values (complete), so that a relaunch with the same values
    resumes the run and a change of one starts another. The second only operates it: a larger --max_steps
    goes on with the same run."""
    with open(TRAIN_SCRIPT) as file:
        lines = file.read().splitlines()
    found = [[number for number, line in enumerate(lines, 1) if line.startswith(heading)]
             for heading in (COMPUTES, OPERATES)]  # fmt: skip
    computes_at, operates_at = (numbers[0] if len(numbers) == 1 else math.inf for numbers in found)
    options = option_nodes(TRAIN_SCRIPT)
    if not computes_at < options[0].lineno < operates_at < math.inf:
        raise ConfigError(
            f"{TRAIN_SCRIPT}: its options stand in two blocks, each opened by its line: '{COMPUTES}...' "
            f"above the first option, then '{OPERATES}...'; write each of the two once"
        )
    computes = tuple(node.target.id for node in options if node.lineno < operates_at)
    return computes, tuple(name for name in declared() if name not in computes)


def names_the_run():
    """The options whose values make a run what it is: train.py's first block."""
    return blocks()[0]


def parse(argv):
    """train.py's options from its command line and --config files."""
    return parse_args(argv, declared())


def complete_and_check(args):
    """The options as a run settles them before anything is built: the model's shape, what the options leave
    to the run filled in, and every check that needs no data. Returns the shape."""
    shape = resolve_shape(args)
    complete(args, shape)
    validate(args, shape, parse_source(args)[0])
    return shape


def taking_choice(args, shape, chosen):
    """args with a choice of the auto options taken (run/prediction/plan.py's settle), each value read and
    checked as the same option given on the command line: a ConfigError says what is wrong with it."""
    given = parse([f"--{name}={value}" for name, value in chosen.items()])
    taken = types.SimpleNamespace(**{**vars(args), **{name: getattr(given, name) for name in chosen}})
    validate(taken, shape, parse_source(taken)[0])
    return taken


def run_options(argv):
    """For benchmark.py --train_args: the options of a training run with these arguments, completed and
    checked as train.py does (a ConfigError as it would refuse them), its model's config, and the values of
    the options that name the run."""
    args = parse(argv)
    shape = complete_and_check(args)
    tokenizer = load_tokenizer(args)
    never_packed_sequences()
    naming = {name: getattr(args, name) for name in names_the_run()}
    return args, build_model_config(shape, tokenizer, args.vocab_size), naming


def rebuild_model(saved_options, saved_shape):
    """For --export_from and sample.py: the model a checkpoint's trainer_state describes, on the meta device,
    and its tokenizer. The vocabulary is the one saved, whatever the tokenizer holds now."""
    saved = parse([])
    vars(saved).update({name: value for name, value in saved_options.items() if name in declared()})
    shape = resolve_shape(saved)  # its --init_from checked as a user's would be
    vars(shape).update(saved_shape)
    if saved.data != "dummy":  # a checkpoint's checksums prove no author: its folders are checked likewise
        missing_folder("the checkpoint's --tokenizer", saved.tokenizer)
    tokenizer = load_tokenizer(saved)
    return build_meta_model(build_model_config(shape, tokenizer, shape.vocab_size)), tokenizer


def complete(args, shape):
    """Fills in what the options leave to the run: --plan's dry run, the sequence length (the model's
    positions), the precision (auto: bf16 on a GPU, and in a dry run, which simulates one) and the run's
    name, a digest of the options that name it (blocks), so that a relaunch of the same run resumes it."""
    args.dry_run = args.dry_run or args.plan  # a plan is a dry run of every candidate
    if args.seq_length is None:
        args.seq_length = shape.n_positions
    if args.mixed_precision == "auto":
        gpu_simulated = args.dry_run and args.gpu != "cpu"
        args.mixed_precision = "bf16" if gpu_simulated or torch.cuda.is_available() else "fp32"
    if args.run_name is None:
        identity = {name: getattr(args, name) for name in names_the_run()}
        for name, default in NAMED_ONLY_WHEN_SET.items():
            if identity[name] == default:
                del identity[name]
        digest = hashlib.sha1(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]
        args.run_name = f"{args.model}-{digest}"


def validate(args, shape, data_kind):
    """Every check that needs no data, before any process group or model. shape: the model's (run/model/
    presets.py's resolve_shape, its shape constants named in shape.names); data_kind: the kind of --data
    (run/data/source.py's parse_source)."""
    for name, choices in CHOICES.items():
        if getattr(args, name) not in choices:
            raise ConfigError(f"--{name}={getattr(args, name)} is not one of: {', '.join(choices)}")
    check_ranges(args, shape)
    check_shape(args, shape)
    check_world(args)
    check_combinations(args, shape)
    if args.init_from:
        check_weights("--init_from", args.init_from)
    if args.prepare_only and data_kind not in ("hub", "local"):
        raise ConfigError(f"--prepare_only prepares wikitext or a local path; --data={args.data} needs none")
    if args.data != "dummy":
        missing_folder("--tokenizer", args.tokenizer)
    if args.benchmark_report:
        check_benchmark_report(args)
    if args.dry_run:
        gpu_memory_gb(args.gpu)
    else:
        check_trackers(args)
    check_simulating_torch(args)
    if args.float8:  # a dry run simulates a GPU: it needs torchao, not one at hand
        (import_torchao if args.dry_run else check_float8_available)()
    folders = [] if args.dry_run or args.prepare_only else ["checkpoint_dir", "log_dir"]
    if args.data != "dummy" and not args.dry_run:
        folders.append("data_cache")
    created = []  # removed again if a later folder is refused: a refused run leaves nothing behind
    try:
        for name in folders:
            created += writable_folder(f"--{name}", getattr(args, name))
    except ConfigError:
        remove_empty(created)
        raise


def check_ranges(args, shape):
    """Each value out of range is its own line, all of them at once."""
    problems = [f"--{name} must be positive, got {getattr(shape, name)}" for name in shape.names
                if getattr(shape, name) <= 0]  # fmt: skip
    problems += [f"--{name} must be positive, got {getattr(args, name)}" for name in POSITIVE
                 if isinstance(getattr(args, name), (int, float)) and getattr(args, name) <= 0]  # fmt: skip
    problems += [f"--{name} must not be negative, got {getattr(args, name)}" for name in NOT_NEGATIVE
                 if getattr(args, name) < 0]  # fmt: skip
    if not 0 < args.val_fraction < 1:
        problems.append(f"--val_fraction must lie between 0 and 1, got {args.val_fraction}")
    if args.eval_every < 0:
        problems.append(f"--eval_every must not be negative (0: never), got {args.eval_every}")
    if args.max_steps == 0 or args.max_steps < -1:
        problems.append(f"--max_steps must be positive, or -1 for num_epochs passes, got {args.max_steps}")
    if not 0 <= args.seed < 2**32:  # numpy's seeds
        problems.append(f"--seed must lie between 0 and 2**32 - 1, got {args.seed}")
    if (
        args.run_name is not None
        and not re.fullmatch(r"[\w.+-]+", args.run_name)
        or args.run_name in (".", "..")
    ):
        problems.append(
            f"--run_name={args.run_name!r} must be a folder name: letters, digits, '.', '_', '+', '-'"
        )
    elif args.run_name is not None and len(args.run_name.encode()) > MAX_RUN_NAME:
        # step_N.tmp folders and rewound_<time> names go inside it; a file system allows 255 bytes a name
        problems.append(f"--run_name is {len(args.run_name.encode())} bytes long; use at most {MAX_RUN_NAME}")
    if problems:
        raise ConfigError("\n".join(problems))


def launched_world_size(args):
    """torchrun's world size; a dry run's is --world_size, else $WORLD_SIZE, else 8."""
    if args.world_size is not None:  # 0 too: refused by validate, never read as "unset"
        return args.world_size
    return int(os.environ.get("WORLD_SIZE", 8 if args.dry_run else 1))


def check_shape(args, shape):
    """The model's shape holds together, and takes the sequences asked for."""
    if shape.n_embd % shape.n_head:
        raise ConfigError(f"--n_embd={shape.n_embd} is not divisible by --n_head={shape.n_head}")
    kv_heads = shape.arguments.get("num_key_value_heads") or shape.n_head
    if shape.n_head % kv_heads:
        raise ConfigError(
            f"--n_head={shape.n_head} is not a multiple of the model's {kv_heads} key/value heads "
            f"(num_key_value_heads); use a multiple of {kv_heads}"
        )
    head_size = shape.n_embd // shape.n_head
    if head_size % 2 and "rope_parameters" in shape.config_class().to_dict():
        raise ConfigError(
            f"--n_embd={shape.n_embd} / --n_head={shape.n_head} = {head_size} per head: rotary position "
            f"embeddings rotate pairs of features, so the head size must be even"
        )
    if args.seq_length > shape.n_positions:
        raise ConfigError(
            f"--seq_length={args.seq_length} exceeds the model's {shape.n_positions} positions; "
            f"lower --seq_length or raise --n_positions"
        )


def check_world(args):
    """The world size, and how the batch and the model's copies divide over it."""
    if args.world_size is not None and not args.dry_run:
        raise ConfigError("--world_size is for --dry_run; a training run takes its world size from torchrun")
    world_size = launched_world_size(args)
    if world_size <= 0:
        raise ConfigError(f"--world_size must be positive, got {world_size}")
    if world_size > MAX_WORLD_SIZE:
        raise ConfigError(f"--world_size={world_size} is more processes than any cluster runs; use at most "
                          f"{MAX_WORLD_SIZE:,}")  # fmt: skip
    per_micro_step = (1 if args.batch_size == "auto" else args.batch_size) * world_size
    if args.global_batch_size % per_micro_step:
        raise ConfigError(
            f"--global_batch_size={args.global_batch_size} is not divisible by batch_size x world "
            f"size = {args.batch_size} x {world_size}; use a multiple of {per_micro_step}"
        )
    node_size = args.gpus_per_node if args.dry_run else int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    group = args.shard_group_size
    if group is not None and (args.sharding != "hybrid" or group <= 0 or world_size % group):
        raise ConfigError(
            f"--shard_group_size={group} needs --sharding=hybrid and a positive divisor of the world size "
            f"({world_size})"
        )
    if args.sharding == "hybrid" and not group and world_size % node_size:
        raise ConfigError(
            f"--sharding=hybrid needs the same number of processes on every node "
            f"({world_size} over nodes of {node_size})"
        )
    if args.sharding == "hybrid" and (group or node_size) == 1:
        raise ConfigError(
            f"--sharding=hybrid over groups of one process shards nothing: use --sharding=ddp, or a "
            f"--shard_group_size of 2 or more that divides the world size ({world_size})"
        )


def check_combinations(args, shape):
    """Options that exclude each other, a checkpoint to resume that is not one, a trace past the run's end."""
    if not 0 <= args.min_lr <= args.lr:
        raise ConfigError(f"--min_lr={args.min_lr} must lie between 0 and --lr={args.lr}")
    if args.init_from and any(getattr(args, name) is not None for name in shape.names):
        raise ConfigError(
            f"--init_from={args.init_from} brings its own shape; drop --{', --'.join(shape.names)}"
        )
    if args.cpu_offload and args.sharding == "ddp":
        raise ConfigError("--cpu_offload=True needs FSDP; it does not work with --sharding=ddp")
    resume_from = args.resume_from
    if resume_from and resume_from.rstrip("/").endswith(".tmp"):
        raise ConfigError(
            f"--resume_from={resume_from} is a save cut short (a .tmp folder is never complete); name its "
            f"step_N folder or an earlier one"
        )
    rewound = resume_from and os.path.isfile(os.path.join(os.path.dirname(resume_from), REWINDS))
    if resume_from and not rewound and not os.path.isfile(os.path.join(resume_from, "trainer_state.json")):
        raise ConfigError(
            f"--resume_from={args.resume_from} is not a complete checkpoint folder (no trainer_state.json)"
        )
    profiled = profiled_steps(args.profile_steps)
    if profiled and 0 < args.max_steps < profiled[1] and os.environ.get("RANK", "0") == "0":
        print(f"warning: --profile_steps={args.profile_steps} ends after --max_steps={args.max_steps}: the "
              f"trace ends with the run's last step", file=sys.stderr)  # fmt: skip


def writable_folder(option, path):
    """Creates path and checks a file can be written in it: a folder that cannot be written would fail
    later, after hours. Checked on every node, as one may lack it. The folders it created, outermost first."""
    dangling = next(
        (part for part in parents(path) if os.path.islink(part) and not os.path.exists(part)), None
    )
    if dangling:
        message = (
            f"{option}={path}: {dangling} is a symbolic link to {os.readlink(dangling)}, which does not exist"
        )
        raise ConfigError(f"{message}; create its target or point {option} elsewhere", per_node=True)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{option}={path} is a file, not a folder; point it at a folder", per_node=True)
    created = []
    try:
        created = make_folders(path)
        with tempfile.TemporaryFile(dir=path) as file:  # bytes, not an empty file: a full disk has inodes
            file.write(bytes(4096))
            file.flush()
    except OSError as error:
        remove_empty(created)
        message = f"{option}={path} is not writable ({error.strerror}); point it at a writable folder"
        raise ConfigError(message, per_node=True) from None
    return created


def parents(path):
    """path and the folders above it, nearest first."""
    path = os.path.abspath(path)
    while True:
        yield path
        if path == os.path.dirname(path):
            return
        path = os.path.dirname(path)


def check_benchmark_report(args):
    """--benchmark_report names a report a run can use (run/report_figures.py); a dry run's, one measured on
    the machine --gpu names."""
    try:
        report = read_report(args.benchmark_report)
    except BadReport as error:
        raise ConfigError(f"--benchmark_report: {error}; give a report benchmark.py wrote") from None
    if args.dry_run and (elsewhere := measured_elsewhere(report, args.gpu)):
        raise ConfigError(
            f"--benchmark_report={args.benchmark_report}: {elsewhere}; give the --gpu it was measured on, or "
            f"a report of --gpu={args.gpu}"
        )


def check_trackers(args):
    """The trackers asked for must be importable."""
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
    """--gpu as (its name, its memory in GB): a name of the GPU datasheet, a number of GB, or cpu: this
    machine's CPU and its available memory."""
    if gpu == "cpu":
        return "this machine's CPU", available_memory_bytes() / 1e9
    memory = None
    with contextlib.suppress(ValueError):
        memory = float(gpu)
    if memory is not None and not 0 < memory < math.inf:
        raise ConfigError(f"--gpu={gpu}: a GPU's memory in GB must be a positive number, e.g. --gpu=80")
    if memory is not None:
        return None, memory
    sheet = datasheet(gpu)
    if sheet is None:
        raise ConfigError(
            f"--gpu={gpu} is not in the GPU datasheet (common/datasheet.py); give its memory in GB, "
            "e.g. --gpu=80, or --gpu=cpu for this machine's CPU"
        )
    return gpu, sheet["memory_GB"]


SIMULATING_TORCH = "2.13"  # the oldest torch whose memory tracker the simulation trusts
# The options a launch may leave to auto: it keeps the candidates whose simulated peak fits the device.
CHOSEN_AT_LAUNCH = ("sharding", "activation_checkpointing", "batch_size")
PINNED_TRAIN = "bash setup.sh; .venv/bin/python train.py"  # train.py on the pinned torch


def left_to_auto(args):
    """The options args leaves to auto, as the command line gives them (--sharding=auto, ...)."""
    return [f"--{name}=auto" for name in CHOSEN_AT_LAUNCH if getattr(args, name) == "auto"]


def check_simulating_torch(args):
    """--dry_run, --plan and the options left to auto, which keep the candidates whose simulated peak fits,
    refused on a torch whose FSDPMemTracker counted DTensor's sharding propagation (full-size fake tensors)
    as memory, until pytorch/pytorch#183970. Measured on one H100 (gpt2-xl, batch 4): torch 2.11 simulated
    48.5 GB, torch 2.13 25.5 GB, and torch.cuda.max_memory_allocated was 25.8 GB."""
    if torch.__version__ >= SIMULATING_TORCH:
        return
    if args.dry_run:
        flag = "--plan" if args.plan else "--dry_run"
        what = f"{flag} needs"
        fix = f"run it with the pinned torch, which needs no GPU ({PINNED_TRAIN} {flag})"
    elif auto := left_to_auto(args):
        what = ", ".join(auto) + (" need" if len(auto) > 1 else " needs")
        fix = f"give each a value ({PINNED_TRAIN} --plan ranks them)"
    else:
        return
    overstates = f"torch {torch.__version__}'s memory tracker overstates the peak"
    raise ConfigError(f"{what} torch {SIMULATING_TORCH} or later: {overstates}; {fix}")
