"""The run's records, rank 0's, in its folder <log_dir>/<run_name>: metrics.jsonl (appended to by every
launch), TensorBoard, W&B when --wandb names a project, and config.yaml."""

import contextlib
import json
import os
import sys
import threading

import yaml

from common.files import UnsafeFile, append_whole, no_links, read_regular, set_aside_damaged, write_atomically


class RunLog:
    """Rank 0's records of a run in its folder <log_dir>/<run_name>: metrics.jsonl (appended to by every
    launch of the run), TensorBoard, and W&B when --wandb names a project. The W&B run's id is the run
    name, so a requeued or relaunched job continues the same W&B run."""

    def __init__(self, args, folder):
        self.folder, self.path, self.metrics = folder, os.path.join(folder, "metrics.jsonl"), None
        try:
            self.metrics = open(self.path, "ab", buffering=0, opener=no_links)
        except OSError as error:  # a symbolic link left at its name too: never appended through
            self.stop_writing(error)
        self.writer = self.wandb = None
        if args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # Process-wide, as Python has no hook per thread; it passes on every exception but TensorBoard's.
            threading.excepthook = quiet_tensorboard_disk_errors
            self.writer = SummaryWriter(os.path.join(folder, "tensorboard"))
        if args.wandb:
            self.wandb = start_wandb(args, folder)

    def write(self, record):
        if self.metrics is not None:
            try:
                append_whole(self.metrics, json.dumps(record) + "\n")
            except OSError as error:  # a full log disk must not end a run whose checkpoints are elsewhere
                self.stop_writing(error)
        scalars = {f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}": value
                   for key, value in record.items() if key != "step"}  # fmt: skip
        self.scalars(scalars, record["step"])

    def scalars(self, values, step):
        """TensorBoard and W&B: the numbers among values."""
        values = {key: value for key, value in values.items() if isinstance(value, (int, float))}
        try:
            for key, value in values.items() if self.writer is not None else ():
                self.writer.add_scalar(key, value, step)
        except OSError as error:  # its writer thread met a full disk: TensorBoard stops, the run goes on
            print(f"warning: cannot write {self.writer.log_dir} ({error.strerror}); TensorBoard's records "
                  f"stop here, training goes on", file=sys.stderr, flush=True)  # fmt: skip
            self.writer = None
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def stop_writing(self, error):
        print(f"warning: cannot write {self.path} ({error.strerror}); the run's records stop here, "
              f"training goes on and its step lines still print", file=sys.stderr, flush=True)  # fmt: skip
        if self.metrics is not None:
            with contextlib.suppress(OSError):
                self.metrics.close()
        self.metrics = None

    def close(self):
        if self.metrics is not None:
            try:
                self.metrics.close()
            except OSError as error:
                self.stop_writing(error)
        if self.writer is not None:
            with contextlib.suppress(OSError):  # a full disk was warned about already, or goes unrecorded
                self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def quiet_tensorboard_disk_errors(hook_args, default=threading.excepthook):
    """TensorBoard's writer thread dies of a full disk with a traceback; its next record says so."""
    thread_module = type(hook_args.thread).__module__
    if isinstance(hook_args.exc_value, OSError) and thread_module.startswith("tensorboard"):
        return
    default(hook_args)


WANDB_INIT_TIMEOUT_S = 20  # W&B's own is 90 s, and an unreachable server cost a run about 95 s


def start_wandb(args, folder):
    """W&B's run for this run (its id is the run name, so a relaunch continues it). When W&B cannot be
    reached, or refuses (no API key), the run logs offline, which `wandb sync` uploads later, rather than
    waiting or stopping. Its debug logs and staged files go to the run's folder too, not to ~/.cache and
    ~/.local/share (a user's WANDB_CACHE_DIR and WANDB_DATA_DIR win)."""
    for variable, name in (("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        os.environ.setdefault(variable, os.path.join(os.path.abspath(folder), "wandb", name))
    import wandb

    run = dict(project=args.wandb, id=args.run_name, name=args.run_name, resume="allow", config=vars(args))
    try:
        timeout = float(os.environ.get("WANDB_INIT_TIMEOUT", WANDB_INIT_TIMEOUT_S))  # W&B's own variable wins
        return wandb.init(**run, dir=folder, settings=wandb.Settings(init_timeout=timeout))
    except wandb.errors.Error as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(f"warning: --wandb={args.wandb}: W&B is unreachable or refused ({reason}); logging offline in "
              f"{folder}/wandb: `wandb sync` uploads it later", file=sys.stderr, flush=True)  # fmt: skip
        wandb.teardown()  # the failed attempt still holds the run's id in W&B's service
        return wandb.init(**run, dir=folder, mode="offline")


def write_run_folder(args, folder):
    """The resolved config, which --config=<folder>/config.yaml replays, and a pointer to the benchmark
    report of each job that trained the run (slurm_submit.sh names it in $BENCHMARK_REPORT)."""
    write_atomically(os.path.join(folder, "config.yaml"), yaml.safe_dump(vars(args), sort_keys=False))
    report = os.environ.get("BENCHMARK_REPORT")
    if report:
        pointer = os.path.join(folder, "benchmark_reports.txt")
        try:
            known = read_regular(pointer).decode(errors="replace").splitlines()
        except FileNotFoundError:
            known = []
        except (OSError, UnsafeFile) as error:
            aside = set_aside_damaged(pointer)
            print(f"warning: {error}; {aside}, and the list of the run's benchmark reports starts anew",
                  file=sys.stderr, flush=True)  # fmt: skip
            known = []
        line = f"{os.environ.get('SLURM_JOB_ID', 'no SLURM job')}: {os.path.abspath(report)}"
        write_atomically(pointer, "\n".join(dict.fromkeys([*known, line])) + "\n")
