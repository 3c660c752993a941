"""Pretrain or fine-tune a transformers model (GPT-2, Llama, Mistral, Mixtral) with PyTorch FSDP2 or DDP.

    torchrun --standalone --nproc_per_node=8 train.py             # 4B model on one 8-GPU node
    torchrun --standalone --nproc_per_node=2 train.py --model=tiny --compile=False   # CPU, gloo
    python train.py --dry_run                                     # config, size, memory; no training

Edit the constants below, set them in a YAML file given as --config=FILE.yaml, or override any of them
as --name=value (bare --flag means True); flags win over the file.

Read top to bottom: the constants, in two blocks (what the run computes, which names it, and how the run is
operated), main() (the plan of a run), then train() (its loop). The rest is in the packages of run/, which
this file imports and which never import it: the data, the model and its step, the checkpoint, the run's log
and goodput, what happens when a run misbehaves, the prediction; and the run's options, launch and stops.
"""

import dataclasses
import functools
import gc
import json
import os
import sys
import time
import types
from typing import Literal

if __name__ == "__main__":
    # Importing torch and transformers creates millions of objects that live as long as the process; the
    # collector would scan them again and again as they appear, a second of every start on a small CPU.
    # It resumes once the model classes are imported (imports_done).
    gc.disable()

import torch

from common.errors import ConfigError, report_config_error
from common.files import write_atomically
from common.options import print_help
from common.quiet import torchao_for_float8_only
from run import launch, options, stops
from run.checkpoint import export
from run.checkpoint.checkpointer import Checkpointer
from run.data.batches import describe_epochs, open_batches
from run.data.hub import use_cache_if_hub_unreachable
from run.data.source import load_tokenizer, parse_source, prepare_data
from run.health.non_finite import NonFiniteSteps
from run.health.stragglers import StragglerWatch
from run.health.watchdog import Watchdog
from run.model.build import build_model, initialise
from run.model.presets import (
    build_meta_model,
    build_model_config,
    decoder_layers,
    flops_per_token,
    never_packed_sequences,
)
from run.model.step import build_optimizer, evaluate, lr_factor, train_step
from run.prediction import live as live_prediction
from run.prediction.plan import settle
from run.progress import goodput, run_log
from run.progress.curves import plot_run
from run.progress.profiler import StepProfiler
from run.progress.progress import Progress, print_start
from run.progress.window import LogWindows

# The constants are a table: the formatter leaves its alignment alone.
# fmt: off
# What the run computes. These name the run: the default --run_name is a digest of their values, so that a
# relaunch with the same values resumes the run and a change of one starts another.
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
tokenizer: str = "gpt2"             # AutoTokenizer name or local folder (real data); sets the vocabulary
text_column: str = "text"           # the column of .jsonl/.parquet/hub data holding the text
val_fraction: float = 0.005         # share of a local corpus held out for validation, if no validation file
batch_size: int | Literal["auto"] = 8  # sequences per device per micro-step | auto: the fastest that fits
seq_length: int | None = None       # tokens per sequence; None: the model's n_positions
global_batch_size: int = 256        # sequences per optimizer step, whatever the number of processes
# Optimizer: AdamW, linear warm-up then cosine decay to min_lr
lr: float = 3e-4
min_lr: float = 3e-5
warmup_steps: int = 200
weight_decay: float = 0.1
grad_clip: float = 1.0              # 0 disables clipping (the norm is still logged)
seed: int = 1337
# Parallelism and speed, and the checkpoints' layout
sharding: str = "full"              # full | grad_op | hybrid | ddp (FSDP2 or DDP) | auto: the fastest fit
shard_group_size: int | None = None # hybrid: the ranks sharing one copy of the model; None: a node's
cpu_offload: bool = False           # FSDP keeps parameters, gradients and optimizer state in CPU memory
activation_checkpointing: str = "op"  # none | full | op (saves chosen op outputs) | selective (see ac_every)
                                    #   | auto: the fastest that fits
ac_every: int = 2                   # selective checkpoints layers ac_every, 2·ac_every, ...
compile: bool = True                # torch.compile each transformer block
mixed_precision: str = "auto"       # bf16 (compute; fp32 weights and reduction) | fp32 | auto: bf16 on GPU
float8: bool = False                # the decoder layers' matmuls in float8 (torchao; H100, H200 and newer)
ckpt_format: str = "sharded"        # sharded (DCP, every rank writes its shard) | full (one file from rank 0)

# How the run is operated. These leave what it computes alone: a larger --max_steps goes on with the same run.
# Length and evaluation
num_epochs: int = 1
max_steps: int = -1                 # -1: num_epochs passes over the data; a larger one continues a run
eval_every: int = 500               # validation loss every this many steps and at the end; 0: never
eval_batches: int = 20              # micro-batches per rank in each evaluation
# Prepared data
data_cache: str = "data_cache"      # prepared token files (and hub downloads); put it on shared storage
prepare_only: bool = False          # tokenise --data into data_cache, then exit (a login node with internet)
# Checkpoints and fault tolerance
checkpoint_dir: str = "checkpoints"
run_name: str | None = None         # None: derived from the arguments, so a relaunch or requeue resumes
checkpoint_every: int | Literal["auto"] = 500  # steps; also at the end and on SIGTERM/SIGUSR1; auto:
                                    #   Young/Daly's sqrt(2 x save time x MTBF) (docs/SLURM.md)
node_mtbf_hours: float = 6335.0     # auto's mean time between failures of one node (Llama 3's rate), over
                                    #   the number of nodes: 6,335 h = 2,048 nodes x 54 days / 419 stops
keep_last: int = 3                  # older step_N folders are removed; 0 keeps all
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


def main(argv):
    """The plan of a run. Bad input is a ConfigError wherever it is found: one line, exit status 2."""
    if {"-h", "--help"} & set(argv):
        return print_help(sys.modules[__name__])
    try:
        args = options.parse(argv)
        use_cache_if_hub_unreachable(args, parse_source(args)[0])  # before any Hugging Face library loads
        torchao_for_float8_only()  # before any model class: see common/quiet.py
        if args.plot:
            return plot_run(args.plot)
        if args.export_from:
            export.export_checkpoint(args.export_from, options.rebuild_model)
            return 0
        shape = options.complete_and_check(args)
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
            # imported here: the simulation's imports would cost every training start 0.6 s of CPU
            from run.prediction.dry_run import report_dry_run

            return report_dry_run(args, shape, model_config, meta_model, options.names_the_run())
        launch.check_machine_holds(args, meta_model)
        signals = stops.StopSignals(stops.StopRequests())
        folders = launch.RunFolders(args)  # rank 0 takes the run's lock: one trainer per run
    except ConfigError as error:
        report_config_error(error)
    with folders:  # the lock is released as the run ends, however it ends
        return train(start(args, shape, tokenizer, model_config, meta_model, folders), signals)


def train(run, signals):
    """From the run's newest usable checkpoint to its last step, or to a stop asked for. Returns the exit
    status: 0, or STOPPED_BY_SIGNAL once checkpointed for a stop."""
    trainer = ready(run, signals.requests)
    if trainer is None:  # the run has finished already
        return launch.teardown()
    args, total_steps = run.args, run.total_steps
    model, optimizer, scheduler = trainer.model, trainer.optimizer, trainer.scheduler
    checkpointer, progress, ledger = trainer.checkpointer, trainer.progress, trainer.ledger
    stragglers, non_finite, log_windows = trainer.stragglers, trainer.non_finite, trainer.log_windows
    profiler = trainer.profiler
    signals.start_training(run.rank)
    watchdog = Watchdog(args, run.folders.log_folder, run.rank, run.device, run.mesh, ledger.stalled)
    timed_batches, first_step, stopped = stragglers.timed(run.batches), progress.step + 1, False
    try:
        for step in range(first_step, total_steps + 1):  # numbered as logged: the first step is 1
            with profiler.step(step), progress.timing():
                loss, grad_norm, stop = train_step(
                    model, timed_batches, optimizer, run.accumulation, args.grad_clip, signals.requests
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
            if run.evaluates_after(step):
                with watchdog.phase("evaluating"), ledger.spending("eval_s"):
                    val_loss = evaluate(model, run.validation_batches(), args.eval_batches, run.world_size)
            if log_windows.ends(step, val_loss):
                log_windows.close(val_loss)
            stopped = stop and step < total_steps  # a stop asked for at the last step changes nothing
            if checkpointer.due(step, last=step == total_steps or stopped) and non_finite.sound:
                with watchdog.phase("writing a checkpoint"), ledger.checkpoint(step):
                    checkpointer.save(progress.trainer_state(), model, optimizer, scheduler, run.batches)
            if stopped:
                break
        with watchdog.phase("writing the last checkpoint and model"), ledger.spending("checkpoint_s"):
            finish(run, trainer, stopped)
        if stopped:
            signals.saved(run.rank)
        progress.close(stopped, ledger)
        launch.teardown()
        return stops.STOPPED_BY_SIGNAL if stopped else 0
    finally:
        watchdog.end()  # the last heartbeat says this rank ended, whatever ended it


@dataclasses.dataclass
class Run:
    """A run as start() launches it: what main() settled, its folders, its process group and its data."""

    args: types.SimpleNamespace
    shape: types.SimpleNamespace
    tokenizer: object  # None for dummy data
    model_config: object
    meta_model: torch.nn.Module
    folders: launch.RunFolders
    started: float  # time.perf_counter() as the launch began
    device: torch.device
    rank: int
    world_size: int
    mesh: object
    accumulation: int  # micro-steps per optimizer step
    batches: object  # this rank's training batches (run/data/batches.py)
    validation_batches: object  # a function returning fresh validation batches, or None
    epoch_steps: int | None  # None: a stream of unknown length
    total_steps: int

    def evaluates_after(self, step):
        """Whether the validation loss is measured after step: every eval_every steps and after the last,
        where the data has a validation split."""
        every = self.args.eval_every
        return bool(self.validation_batches and every and (step % every == 0 or step == self.total_steps))


def start(args, shape, tokenizer, model_config, meta_model, folders):
    """The launch: the process group, the choice of the auto options (decided once for the run, and kept in
    its log folder) and the data. Bad input: one line, exit status 2."""
    started = time.perf_counter()
    try:
        device, rank, world_size, mesh = launch.setup_distributed(args, folders.log_folder)
        if options.left_to_auto(args):
            taking = functools.partial(options.taking_choice, args, shape)
            settle(args, model_config, count_parameters(meta_model), folders.log_folder, device, taking)
            mesh = launch.device_mesh(args, device.type, world_size, int(os.environ["LOCAL_WORLD_SIZE"]))
        accumulation = args.global_batch_size // (args.batch_size * world_size)
        batches, validation_batches, epoch_steps = open_batches(
            args, shape, tokenizer, world_size, rank, accumulation, device
        )
    except ConfigError as error:
        report_config_error(error)
    total_steps = args.max_steps if args.max_steps > 0 else args.num_epochs * epoch_steps
    return Run(args, shape, tokenizer, model_config, meta_model, folders, started, device, rank, world_size,
               mesh, accumulation, batches, validation_batches, epoch_steps, total_steps)  # fmt: skip


@dataclasses.dataclass
class Trainer:
    """What train() steps with: the model, its optimizer and schedule, and the owners of what steps leave."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    checkpointer: Checkpointer
    progress: Progress
    ledger: goodput.Ledger
    stragglers: StragglerWatch
    non_finite: NonFiniteSteps
    log_windows: LogWindows
    profiler: StepProfiler


def ready(run, stop_requests):
    """The model built, and resumed from the run's newest usable checkpoint, with what watches its steps; None
    when that checkpoint is the run's last step, its model exported."""
    args, master, folders, total_steps = run.args, run.rank == 0, run.folders, run.total_steps
    checkpointer = Checkpointer(args, run.shape, run.rank, run.world_size, count_parameters(run.meta_model))
    resume_path = checkpointer.choose(args.resume_from, run.meta_model)  # the newest usable checkpoint
    if launch.already_finished(args, resume_path, total_steps, checkpointer, master):
        return None
    benchmark_s = goodput.benchmark_seconds(master)  # the job's benchmarks, before this launch
    ledger = goodput.Ledger(folders.log_folder, goodput.launch_start(), benchmark_s, master)
    ledger.launch_started()
    if master:
        run_log.write_run_folder(args, folders.log_folder)
        print_start(args, run.shape, run.model_config, run.meta_model, run.device, total_steps)
        describe_epochs(args, total_steps, run.batches, run.epoch_steps)
    model_flops = flops_per_token(run.meta_model, run.model_config, args.seq_length)
    model = build_model(run.model_config, args, run.device, run.mesh)
    live = own_prediction(run, model, model_flops) if args.predict else None  # stepped before weights are set
    model = initialise(model, run.model_config, args)
    optimizer = build_optimizer(model, args, fused=run.device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, args, total_steps))
    progress = Progress(args, model_flops, run.device, total_steps, run.started, folders.log_folder)
    stragglers = StragglerWatch(decoder_layers(model), args, run.device, folders.log_folder, stop_requests)
    non_finite = NonFiniteSteps(args.max_bad_steps, folders.run_dir, master)
    if resume_path:
        with ledger.loading():  # a part of a recovery's cost (run/progress/goodput.py)
            state = checkpointer.load(resume_path, model, optimizer, scheduler, run.batches)
            progress.resume(state, resume_path)
    model.train()
    log_windows = LogWindows(args, total_steps, progress, stragglers, live, ledger, checkpointer.schedule)
    profiler = StepProfiler(args.profile_steps, folders.log_folder, run.device, master, total_steps)
    return Trainer(model, optimizer, scheduler, checkpointer, progress, ledger, stragglers, non_finite,
                   log_windows, profiler)  # fmt: skip


def own_prediction(run, model, model_flops):
    """Before training sets model's weights, on every rank: this run's step measured by stepping model on
    dummy batches, as an earlier launch kept it, or to be taken from its first steps (run/prediction/live.py).
    Rank 0's LivePrediction; None on the other ranks."""
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    naming = options.names_the_run()
    holds_for = live_prediction.holds_for(run.args, naming, run.device, run.world_size, local)
    return live_prediction.predict_own_step(
        run.args, model, run.model_config, run.device, run.folders.log_folder, holds_for, model_flops
    )


def finish(run, trainer, stopped):
    """The run's last checkpoint written whole; at the run's last step, older ones pruned and the model
    exported for transformers (<run_dir>/final_model)."""
    trainer.checkpointer.finish()
    if not stopped:
        trainer.checkpointer.prune()
        final_model = os.path.join(run.folders.run_dir, "final_model")
        export.export_pretrained(trainer.model, run.meta_model, run.tokenizer, final_model, run.rank)


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())


def report_checked(log_folder):
    """--check_only's answer: the run's log folder, also as JSON in $CHECKED_JSON for the job (run/job/)."""
    print(f"checked: log folder {log_folder}")
    if os.environ.get("CHECKED_JSON"):
        write_atomically(os.environ["CHECKED_JSON"], json.dumps({"log_folder": log_folder}))
    return 0


def imports_done():
    """The collector, paused at the top of this file in a process started to train, runs again, leaving
    alone (frozen) the objects the imports created."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


if __name__ == "__main__":
    try:
        status = main(sys.argv[1:])
    except SystemExit as refusal:  # bad input or a refused run, said in one line
        status = refusal.code
    launch.exit_at_once(status)  # without the interpreter's teardown, which can abort here: see its docstring
