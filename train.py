"""Pretrain or fine-tune a transformers model (GPT-2, Llama, Mistral, Mixtral) with PyTorch FSDP2 or DDP.

    torchrun --standalone --nproc_per_node=8 train.py             # 4B model on one 8-GPU node
    torchrun --standalone --nproc_per_node=2 train.py --model=tiny --compile=False   # CPU, gloo
    python train.py --dry_run                                     # config, size, memory; no training

Edit the constants below, set them in a YAML file given as --config=FILE.yaml, or override any of them
as --name=value (bare --flag means True); flags win over the file.

This file decides what is trained; read top to bottom: the constants, main() (the plan of a run), then
data, the model and the training step, each section opening with a comment bar. How a run is operated
(options, launch, checkpoints, progress and the run log, goodput, stops, the watchdog, stragglers, the dry
run) is in the modules of run/, one owner each, which this file imports and which never import it.
"""

import functools
import gc
import json
import math
import os
import queue
import sys
import threading
import time
import types
from typing import Literal

if __name__ == "__main__":
    # Importing torch and transformers creates millions of objects that live as long as the process; the
    # collector would scan them again and again as they appear, a second of every start on a small CPU.
    # It resumes once the model classes are imported (imports_done).
    gc.disable()

import numpy as np
import torch

from common.errors import ConfigError, report_config_error
from common.files import write_atomically
from common.options import constants_of, parse_args, print_help
from run import export, goodput, launch, options, prepare, run_log, stops
from run.checkpoints import Checkpointer
from run.curves import plot_run
from run.hub import use_cache_if_hub_unreachable
from run.model.build import build_model, initialise, never_packed_sequences
from run.model.presets import (
    build_meta_model,
    build_model_config,
    decoder_layers,
    flops_per_token,
    resolve_shape,
)
from run.model.step import build_optimizer, evaluate, lr_factor, train_step
from run.prediction import live as live_prediction
from run.prediction.dry_run import report_dry_run
from run.prediction.plan import has_auto, settle
from run.profiler import StepProfiler
from run.progress import Progress, print_start
from run.stragglers import StragglerWatch
from run.watchdog import Watchdog

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
batch_size: int | Literal["auto"] = 8  # sequences per device per micro-step | auto: the fastest that fits
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
sharding: str = "full"              # full | grad_op | hybrid | ddp (FSDP2 or DDP) | auto: the fastest fit
shard_group_size: int | None = None # hybrid: the ranks sharing one copy of the model; None: a node's
cpu_offload: bool = False           # FSDP keeps parameters, gradients and optimizer state in CPU memory
activation_checkpointing: str = "op"  # none | full | op (saves chosen op outputs) | selective (see ac_every)
                                    #   | auto: the fastest that fits
ac_every: int = 2                   # selective checkpoints layers ac_every, 2·ac_every, ...
compile: bool = True                # torch.compile each transformer block
mixed_precision: str = "auto"       # bf16 (compute; fp32 weights and reduction) | fp32 | auto: bf16 on GPU
# Checkpoints and fault tolerance
checkpoint_dir: str = "checkpoints"
run_name: str | None = None         # None: derived from the arguments, so a relaunch or requeue resumes
checkpoint_every: int | Literal["auto"] = 500  # steps; also at the end and on SIGTERM/SIGUSR1; auto:
                                    #   Young/Daly's sqrt(2 x save time x MTBF) (docs/SLURM.md)
node_mtbf_hours: float = 6335.0     # auto's mean time between failures of one node (Llama 3's rate), over
                                    #   the number of nodes: 6,335 h = 2,048 nodes x 54 days / 419 stops
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
curves: bool = True                 # <log_dir>/<run_name>/curves.png at the end: loss, lr, tokens/s, MFU
wandb: str | None = None            # a W&B project to log to as well; None: off
plot: str | None = None             # a run folder (<log_dir>/<run_name>): write its curves.png, then exit
export_from: str | None = None      # a step_N checkpoint: write export_step_N beside it, then exit
check_only: bool = False            # check the options, print the log folder, exit (the job script)
dry_run: bool = False               # simulate training steps on fake tensors: peak memory per GPU, FLOPs
plan: bool = False                  # dry run: every way to run this that fits, predicted, fastest first
world_size: int | None = None       # dry run: the world size simulated; None: $WORLD_SIZE, else 8
gpus_per_node: int = 8              # dry run: GPUs per node, for --sharding=hybrid
gpu: str = "H100"                   # dry run: a GPU of common/datasheet.py, its memory in GB, or cpu
benchmark_report: str | None = None # dry run: predict the step from this report; None: the newest of --gpu
                                    #   under log_dir, else this CPU timed now (--gpu=cpu) or the datasheet
# When a run misbehaves (docs/SLURM.md): a watchdog per rank, and a profiler on demand
hang_minimum_s: float = 300.0       # watchdog: no optimizer step for max(this, hang_factor x median step
hang_factor: float = 10.0           #   time) is a hang: stacks to the run's log folder, one line, exit HUNG
checkpoint_limit_s: float = 1800.0  # a checkpoint write (or the final export) taking longer is a hang too
eval_limit_s: float = 900.0         # an evaluation taking longer is a hang too
exclude_stragglers_after: int = 0   # log windows in a row a node is the straggler before the run stops to
                                    #   leave it out (slurm_submit.sh requeues without it); 0: warn only
profile_steps: str | None = None    # A,B: torch.profiler traces steps A to B (as logged) of rank 0
predict: bool = True                # before training, predict the step on this device (docs/PERFORMANCE.md)
                                    #   and hold each log window's step against it
# fmt: on

# Each option above either changes what a run computes or only how the run is operated. The default
# --run_name is a digest of the first kind, so that a relaunch with the same values resumes the run and a
# change of one starts another. A run's length is of the second kind: a larger --max_steps goes on with the
# same run. tests/test_train.py fails for an option in neither list.
# fmt: off
NAMES_THE_RUN = (
    "model", "init_from", "n_embd", "n_layer", "n_head", "n_positions", "vocab_size", "data", "batch_size",
    "seq_length", "global_batch_size", "tokenizer", "text_column", "val_fraction", "lr", "min_lr",
    "warmup_steps", "weight_decay", "grad_clip", "seed", "sharding", "shard_group_size", "cpu_offload",
    "activation_checkpointing", "ac_every", "compile", "mixed_precision", "ckpt_format",
)
OPERATES_THE_RUN = (
    "num_epochs", "max_steps", "data_cache", "prepare_only", "eval_every", "eval_batches", "checkpoint_dir",
    "run_name", "checkpoint_every", "node_mtbf_hours", "keep_last", "async_checkpoint", "resume_from",
    "skip_optimizer", "max_bad_steps", "log_every", "log_dir", "tensorboard", "curves", "wandb", "plot",
    "export_from", "check_only", "dry_run", "plan", "world_size", "gpus_per_node", "gpu", "benchmark_report",
    "hang_minimum_s",
    "hang_factor", "checkpoint_limit_s", "eval_limit_s", "exclude_stragglers_after", "profile_steps",
    "predict",
)
# fmt: on


def main(argv):
    """The plan of a run. Bad input is a ConfigError wherever it is found: one line, exit status 2."""
    if {"-h", "--help"} & set(argv):
        return print_help(sys.modules[__name__])
    try:
        args = parse_args(argv, constants_of(sys.modules[__name__]))
        use_cache_if_hub_unreachable(args, parse_source(args)[0])  # before any Hugging Face library loads
        if args.plot:
            return plot_run(args.plot)
        if args.export_from:
            export.export_checkpoint(args.export_from, rebuild_model)
            return 0
        shape = complete_and_check(args)
        if args.check_only:
            return report_checked(os.path.join(args.log_dir, args.run_name))
        tokenizer = load_tokenizer(args)
        never_packed_sequences()  # a process-wide change to transformers: see its docstring
        model_config = build_model_config(shape, tokenizer, args.vocab_size)
        meta_model = build_meta_model(model_config)
        imports_done()
        if args.prepare_only:
            return prepare_data(args, tokenizer)
        if args.dry_run or args.plan:
            return report_dry_run(args, shape, model_config, meta_model, NAMES_THE_RUN)
        launch.check_machine_holds(args, meta_model)
        stop_requests = stops.StopRequests()
        signals = stops.StopSignals(stop_requests)
        run_dir, log_folder, lock = launch.make_run_folders(args)
        start_time = time.perf_counter()
        device, rank, world_size, mesh = launch.setup_distributed(args, log_folder)
        if has_auto(args):  # decided once for the run, and kept in its log folder
            taking = functools.partial(taking_choice, args, shape)
            settle(args, model_config, count_parameters(meta_model), log_folder, device, taking)
            mesh = launch.device_mesh(args, device.type, world_size, int(os.environ["LOCAL_WORLD_SIZE"]))
        accumulation = args.global_batch_size // (args.batch_size * world_size)
        batches, validation_batches, epoch_steps = open_batches(
            args, shape, tokenizer, world_size, rank, accumulation, device
        )
    except ConfigError as error:
        report_config_error(error)
    total_steps = args.max_steps if args.max_steps > 0 else args.num_epochs * epoch_steps
    n_params = count_parameters(meta_model)
    checkpointer = Checkpointer(args, shape, rank, world_size, n_params)
    resume_path = checkpointer.choose(args.resume_from, meta_model)  # the newest usable checkpoint
    if launch.already_finished(args, resume_path, total_steps, run_dir, rank == 0):
        return launch.teardown(lock)
    benchmark_s = goodput.benchmark_seconds(rank == 0)  # the job's benchmarks, before this launch
    ledger = goodput.Ledger(log_folder, goodput.launch_start(), benchmark_s, rank == 0)
    ledger.launch_started()
    if rank == 0:
        run_log.write_run_folder(args, log_folder)
        print_start(args, shape, model_config, meta_model, device, total_steps)
        describe_epochs(args, total_steps, batches, epoch_steps)

    model_flops = flops_per_token(meta_model, model_config, args.seq_length)
    model = build_model(model_config, args, device, mesh)
    live = None  # the model stepped on dummy batches before its weights are set
    if args.predict:
        local = int(os.environ["LOCAL_WORLD_SIZE"])
        holds_for = live_prediction.holds_for(args, NAMES_THE_RUN, device, world_size, local)
        live = live_prediction.predict_own_step(
            args, model, model_config, device, log_folder, holds_for, model_flops
        )
    model = initialise(model, model_config, args)
    optimizer = build_optimizer(model, args, fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, args, total_steps))
    progress = Progress(args, model_flops, device, total_steps, start_time, log_folder)
    stragglers = StragglerWatch(decoder_layers(model), args, device, log_folder, stop_requests)
    non_finite = stops.NonFiniteSteps(args.max_bad_steps, run_dir, rank == 0)
    if resume_path:
        with ledger.loading():  # a part of a recovery's cost (run/goodput.py)
            progress.resume(checkpointer.load(resume_path, model, optimizer, scheduler, batches), resume_path)

    model.train()
    signals.start_training(rank)
    watchdog = Watchdog(args, log_folder, rank, device, mesh, ledger.stalled)
    profiler = StepProfiler(args.profile_steps, log_folder, device, rank == 0, total_steps)
    timed_batches = stragglers.timed(batches)
    first_step, stopped = progress.step + 1, False
    for step in range(first_step, total_steps + 1):  # numbered as logged: the first step is 1
        with profiler.step(step), progress.timing():
            loss, grad_norm, stop = train_step(
                model, timed_batches, optimizer, accumulation, args.grad_clip, stop_requests
            )
        watchdog.step_done(first=step == first_step)
        if step == first_step:  # it compiled and loaded: its times say nothing of a rank's speed
            stragglers.first_step_done()
        progress.step_done(step, loss, grad_norm, scheduler.get_last_lr()[0])
        ledger.step_done(step, progress.step_seconds)
        non_finite.step_done(step, grad_norm, ending=stop or step == total_steps)
        if non_finite.sound:  # the weights of the last save gave a finite step
            checkpointer.prune()
        scheduler.step()
        val_loss = None
        if validation_batches and args.eval_every and (step % args.eval_every == 0 or step == total_steps):
            with watchdog.phase("evaluating"), ledger.spending("eval_s"):
                val_loss = evaluate(model, validation_batches(), args.eval_batches, world_size)
        if step % args.log_every == 0 or step == total_steps or val_loss is not None:
            checkpointer.schedule.choose(progress.mean_step_s)
            fields = stragglers.log_window(progress.timed_steps)
            if live:  # rank 0's
                fields |= ledger.against_prediction(
                    live.log_window(progress.mean_step_s, stragglers.per_step)
                )
            progress.log(val_loss, fields)
            ledger.write()
        stopped = stop and step < total_steps  # a stop asked for at the last step changes nothing
        if checkpointer.due(step, last=step == total_steps or stopped) and non_finite.sound:
            with watchdog.phase("writing a checkpoint"), ledger.checkpoint(step):
                checkpointer.save(progress.trainer_state(), model, optimizer, scheduler, batches)
        if stopped:
            break

    with watchdog.phase("writing the last checkpoint and model"), ledger.spending("checkpoint_s"):
        checkpointer.finish()
        if not stopped:
            checkpointer.prune()
            export.export_pretrained(model, meta_model, tokenizer, os.path.join(run_dir, "final_model"), rank)
    if stopped:
        signals.saved(rank)
    progress.close(stopped, ledger)
    launch.teardown(lock)
    return stops.STOPPED_BY_SIGNAL if stopped else 0


def complete_and_check(args):
    """The options as main() settles them before anything is built: the model's shape, what the options leave
    to the run filled in, and every check that needs no data. Returns the shape."""
    shape = resolve_shape(args)
    options.complete(args, shape, NAMES_THE_RUN)
    options.validate(args, shape, parse_source(args)[0])
    return shape


def taking_choice(args, shape, chosen):
    """args with a choice of the auto options taken (run/prediction/plan.py's settle), each value read and
    checked as the same option given on the command line: a ConfigError says what is wrong with it."""
    given = parse_args(
        [f"--{name}={value}" for name, value in chosen.items()], constants_of(sys.modules[__name__])
    )
    taken = types.SimpleNamespace(**{**vars(args), **{name: getattr(given, name) for name in chosen}})
    options.validate(taken, shape, parse_source(taken)[0])
    return taken


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())


def run_options(argv):
    """For benchmark.py --train_args: the options of a training run with these arguments, completed and
    checked as main() does (a ConfigError as it would refuse them), its model's config, and the values of the
    options that name the run."""
    args = parse_args(argv, constants_of(sys.modules[__name__]))
    shape = complete_and_check(args)
    tokenizer = load_tokenizer(args)
    never_packed_sequences()
    naming = {name: getattr(args, name) for name in NAMES_THE_RUN}
    return args, build_model_config(shape, tokenizer, args.vocab_size), naming


def report_checked(log_folder):
    """--check_only's answer: the run's log folder, also as JSON in $CHECKED_JSON for the job (run/job.py)."""
    print(f"checked: log folder {log_folder}")
    if os.environ.get("CHECKED_JSON"):
        write_atomically(os.environ["CHECKED_JSON"], json.dumps({"log_folder": log_folder}))
    return 0


# --------------------------------------------------------------------------------------------------------
# Data: the global batch of step k is a function of k alone, so it is the same for any world size.
# --------------------------------------------------------------------------------------------------------
DUMMY_EPOCH_SAMPLES = 2**20  # what one epoch of dummy data means for num_epochs
DUMMY_PERIOD = 8  # each dummy sequence repeats a random block of this many tokens


def dummy_window(seq_length, vocab_size, seed, index):
    """Window index of dummy data, seq_length + 1 tokens: a random block repeated, so a model can learn to
    copy and the loss falls."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    block = torch.randint(0, vocab_size, (DUMMY_PERIOD,), generator=generator)
    return block.repeat(seq_length // DUMMY_PERIOD + 1)[: seq_length + 1].numpy()


HUB_SOURCES = {
    "wikitext": ("hub", "Salesforce/wikitext", "wikitext-103-raw-v1"),
    "c4": ("stream", "allenai/c4", "en"),
}


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
    if source[0] != "hub" and os.path.exists(source[1]) and (kind := prepare.kernel_filesystem(source[1])):
        raise ConfigError(
            f"--data={args.data} is on the kernel's {kind} filesystem, a view of the running system and not "
            f"a corpus; give a file or folder of .txt, .jsonl or .parquet files"
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
        reason = str(error).splitlines()[0] if str(error).strip() else type(error).__name__
        if os.path.isdir(args.tokenizer):
            reason = reason if os.listdir(args.tokenizer) else "the folder is empty"
            raise ConfigError(
                f"--tokenizer={args.tokenizer}: cannot load the tokenizer in this folder ({reason}); it "
                f"needs what a tokenizer's save_pretrained writes (tokenizer.json, tokenizer_config.json)"
            ) from None
        raise ConfigError(
            f"cannot load tokenizer {args.tokenizer!r} ({reason}); "
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


def prefetched(items, depth):
    """items produced up to depth ahead by a daemon thread, so reading and tokenising overlap the
    training step; an error in the thread is raised here, and a finite items ends here where it ends
    (the training's sources never do: they start another epoch)."""
    ahead, end = queue.Queue(depth), object()

    def produce():
        try:
            for item in items:
                ahead.put(item)
            ahead.put(end)
        except Exception as error:
            ahead.put(error)

    threading.Thread(target=produce, daemon=True).start()
    while (item := ahead.get()) is not end:
        if isinstance(item, Exception):
            raise item
        yield item


class Batches:
    """This rank's micro-batches (inputs, targets). state_dict() is the json-able position after the
    last completed optimizer step (every accumulation-th micro-batch), whatever was read ahead;
    load_state_dict() restores it before the first batch is taken."""

    position_per_rank = False  # whether each rank has its own position (a stream's) or all share one
    corpus = None  # the token file a position counts windows of (prepare.token_file_identity), if any

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

    position_per_rank = True

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
    splits = prepare.load_hub_dataset(args, name, config, fix, streaming=True)
    tokenize = prepare.tokenize_documents(tokenizer, args.text_column)

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
    paths = prepare.shared_token_files(args, kind, name, config, tokenizer, rank)
    dtype = prepare.token_dtype(tokenizer)
    tokens = {split: np.memmap(path, dtype=dtype, mode="r") for split, path in paths.items()}
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
    train.corpus = prepare.token_file_identity(paths["train"])
    evaluation = functools.partial(
        batches, validation_window, windows["validation"], accumulation=1, prefetch=False, shuffle=False
    )
    return train, evaluation, windows["train"] // args.global_batch_size


def describe_epochs(args, total_steps, batches, epoch_steps):
    """One line at the start of a run on a corpus: how many passes over its training windows the run's steps
    make, and the option that set them; a warning when --max_steps makes more than --num_epochs asks for (a
    small corpus was repeated a thousand times without a word)."""
    if args.data == "dummy" or epoch_steps is None:  # generated data, or a stream of unknown length
        return
    epochs = total_steps * args.global_batch_size / batches.n_windows
    corpus = f"--data={args.data} ({batches.n_windows:,} windows of {args.seq_length} tokens)"
    if total_steps > args.num_epochs * epoch_steps:
        needed = math.ceil(total_steps / epoch_steps)
        print(f"warning: --max_steps={args.max_steps} makes {epochs:,.2f} epochs of {corpus}, more than "
              f"--num_epochs={args.num_epochs} asks for: the corpus repeats; lower --max_steps, give more "
              f"data, or set --num_epochs={needed} to mean it", file=sys.stderr, flush=True)  # fmt: skip
        return
    setting = f"--max_steps={args.max_steps}" if args.max_steps > 0 else f"--num_epochs={args.num_epochs}"
    print(f"data: {total_steps:,} steps of {args.global_batch_size} sequences make {epochs:,.2f} epochs of "
          f"{corpus}, as {setting} sets", flush=True)  # fmt: skip


def prepare_data(args, tokenizer):
    """--prepare_only: the token files of wikitext or a local corpus, by one process even under torchrun."""
    if int(os.environ.get("RANK", 0)) == 0:
        prepare.prepare_token_files(args, *parse_source(args), tokenizer)
    return 0


def imports_done():
    """The collector, paused at the top of this file in a process started to train, runs again, leaving
    alone (frozen) the objects the imports created."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def rebuild_model(saved_options, saved_shape):
    """For --export_from: the model a checkpoint's trainer_state describes, on the meta device, and its
    tokenizer. The vocabulary is the one saved, whatever the tokenizer holds now."""
    known = constants_of(sys.modules[__name__])
    saved = parse_args([], known)
    vars(saved).update({k: v for k, v in saved_options.items() if k in known})
    shape = resolve_shape(saved)
    vars(shape).update(saved_shape)
    tokenizer = load_tokenizer(saved)
    return build_meta_model(build_model_config(shape, tokenizer, shape.vocab_size)), tokenizer


if __name__ == "__main__":
    try:
        status = main(sys.argv[1:])
    except SystemExit as refusal:  # bad input or a refused run, said in one line
        status = refusal.code
    launch.exit_at_once(status)  # without the interpreter's teardown, which can abort here: see its docstring
