"""The run log: the config and model at the start, a line per log window on rank 0 (loss, speed, MFU, memory,
stragglers), and the run's folder <log_dir>/<run_name>: metrics.jsonl, TensorBoard, W&B, config.yaml and
curves.png."""

import contextlib
import json
import math
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
import yaml

from common.datasheet import datasheet
from common.files import matplotlib_writes_under, write_atomically
from common.node import node_name
from run import goodput
from run.guard import RankTimes, Stragglers, describe_straggler
from run.heal import write_suspects
from run.options import ConfigError


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


def print_start(args, shape, model_config, meta_model, device, total_steps):
    """What a training run prints before its first step: the config, the model, the world and the plan."""
    describe_model(args, shape, model_config, meta_model)
    world_size = dist.get_world_size()
    accumulation = args.global_batch_size // (args.batch_size * world_size)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    tokens = args.global_batch_size * args.seq_length
    print(
        f"world_size={world_size} | device={name} | gradient accumulation {accumulation} | "
        f"{total_steps} steps of {tokens:,} tokens",
        flush=True,
    )


class Progress:
    """Where the run stands (step, tokens seen, time) and its log window: the loss over every step since the
    last line, and speed over the timed steps among them (not the first, compiling, step; never evaluation
    or checkpoint writing)."""

    def __init__(self, args, layers, flops_per_token, device, total_steps, start_time, folder, stop_requests):
        """layers: the model's decoder layers, whose forward is this rank's compute time. stop_requests: the
        signals' list, to which a node's exclusion as a straggler adds a stop (a checkpoint, then exit)."""
        self.args, self.device, self.total_steps, self.start_time = args, device, total_steps, start_time
        self.world_size, self.master = dist.get_world_size(), dist.get_rank() == 0
        self.step, self.tokens_seen, self.elapsed_before = 0, 0, 0.0
        self.tokens_per_step = args.global_batch_size * args.seq_length
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops(device)
        self.rank_times = RankTimes(layers, device, args.compile)
        names = [None] * self.world_size
        dist.all_gather_object(names, f"{node_name()}:{os.environ['LOCAL_RANK']}")

        def exclude(node, why):  # rank 0's: slurm_submit.sh excludes the node once this launch has stopped
            write_suspects(folder, "straggler", {node: why})
            stop_requests.append(0)
            print(f"stopping to leave {node} out ({why}): checkpointing at the end of this step", flush=True)

        self.stragglers = Stragglers(names, args.exclude_stragglers_after, exclude)
        self.run_log = RunLog(args, folder) if self.master else None
        benchmark_s = float(os.environ.get("BENCHMARK_SECONDS", 0))  # the job's benchmark phase, before it
        self.ledger = goodput.Ledger(folder, goodput.launch_start(), benchmark_s) if self.master else None
        nodes = self.world_size // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        write_GBps = goodput.benchmark_write_GBps() if args.checkpoint_every == "auto" else None
        n_params = flops_per_token / 6  # 6·N plus attention: an upper bound, for the first save's estimate
        self.checkpoints = goodput.CheckpointInterval(
            args.checkpoint_every, n_params, nodes, args.node_mtbf_hours, write_GBps
        )
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
        if self.master:
            self.ledger.step_started()
        started = time.perf_counter()
        yield
        self.step_seconds = time.perf_counter() - started

    @contextlib.contextmanager
    def spending(self, part):
        """Times a phase of the loop outside the steps (eval_s, checkpoint_s) for the goodput ledger."""
        started = time.perf_counter()
        yield
        seconds = time.perf_counter() - started
        if part == "checkpoint_s":
            self.checkpoints.saved(self.step, seconds)
        if self.master:
            self.ledger.spent(part, seconds)
            if part == "checkpoint_s":
                self.ledger.checkpointed(self.step)
            self.ledger.write()

    def checkpoint_due(self, step):
        return self.checkpoints.due(step)

    def hung(self):
        """The watchdog's: the time since the ledger's last update went to a hang."""
        if self.master:
            self.ledger.stalled()

    def new_log_window(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        return {"loss": torch.zeros((), device=self.device), "steps": 0, "seconds": 0.0, "timed": 0}

    def step_done(self, step, loss, grad_norm, lr):
        self.step, self.grad_norm, self.lr = step, grad_norm, lr
        self.tokens_seen += self.tokens_per_step
        if self.master:
            if self.first_step_end is None:
                self.ledger.resumed_at(step - 1, self.step_seconds)
            self.ledger.step_done(step, self.step_seconds)
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

    def log(self, val_loss):
        """Every rank takes part: the loss is averaged, and the ranks' timings gathered for stragglers."""
        dist.all_reduce(self.log_window["loss"])  # gloo has no AVG: sum, then divide
        timings = self.rank_times.gather(self.world_size, self.master)
        if self.master:
            record = self.record(val_loss)
            record.update(self.stragglers.log_window(timings, self.log_window["timed"]))
            self.ledger.write()
            print(log_line(record, self.total_steps), flush=True)
            self.run_log.write(record)
        if self.checkpoints.auto and self.log_window["timed"]:
            self.choose_checkpoint_interval()
        self.log_window = self.new_log_window()

    def choose_checkpoint_interval(self):
        """Rank 0 chooses from its step time and its last save; every rank takes its choice."""
        decision = [None]
        if self.master:
            steps, changed = self.checkpoints.choose(self.log_window["seconds"] / self.log_window["timed"])
            decision = [steps]
            if changed:
                print(self.checkpoints.describe(), flush=True)
        dist.broadcast_object_list(decision, src=0)
        self.checkpoints.steps = decision[0]

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
        self.ledger.write()
        figures = self.ledger.figures(time.time())
        self.run_log.scalars({f"goodput/{key}": value for key, value in figures.items()}, self.step)
        print(self.ledger.summary(), flush=True)
        if stopped:
            print(
                f"stopped by signal after step {self.step}; checkpoint saved, relaunch to resume", flush=True
            )
        else:
            print(
                f"done: {self.total_steps} steps in {time.perf_counter() - self.start_time:.1f} s", flush=True
            )
        self.run_log.close()
        try:
            if self.args.curves and (curves := plot_curves(self.run_log.folder)):
                print(f"curves: {curves}", flush=True)
        except OSError as error:
            print(f"warning: cannot write curves.png ({error.strerror})", file=sys.stderr, flush=True)


def peak_flops(device):
    """Dense bf16 peak of one device from the GPU datasheet; None on CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
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

            threading.excepthook = quiet_tensorboard_disk_errors
            self.writer = SummaryWriter(os.path.join(folder, "tensorboard"))
        if args.wandb:
            self.wandb = start_wandb(args, folder)

    def write(self, record):
        if self.metrics is not None:
            try:
                self.metrics.write(json.dumps(record) + "\n")
                self.metrics.flush()
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
        print(f"warning: cannot write {self.metrics.name} ({error.strerror}); the run's records stop here, "
              f"training goes on and its step lines still print", file=sys.stderr, flush=True)  # fmt: skip
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
        known = open(pointer).read().splitlines() if os.path.exists(pointer) else []
        line = f"{os.environ.get('SLURM_JOB_ID', 'no SLURM job')}: {os.path.abspath(report)}"
        write_atomically(pointer, "\n".join(dict.fromkeys([*known, line])) + "\n")


def read_records(folder):
    """The last record of each logged step of a run folder's metrics.jsonl (a resumed run logs some again)."""
    records, path = {}, os.path.join(folder, "metrics.jsonl")
    with open(path) as file:
        for number, line in enumerate(file, 1):
            if not line.endswith("\n"):  # a line being written as --plot reads is left for the next plot
                continue
            try:
                record = json.loads(line)
                records[record["step"]] = record
            except (ValueError, TypeError, KeyError):  # cut short, as a full disk leaves a line
                print(f"warning: {path} line {number} is not a record; skipped", file=sys.stderr)
    return [records[step] for step in sorted(records)]


def plot_curves(folder):
    """<folder>/curves.png: loss and validation loss, learning rate, tokens/s and MFU against the step."""
    matplotlib_writes_under(os.path.dirname(os.path.abspath(folder)))  # the log folder, beside the runs
    import matplotlib

    matplotlib.use("Agg")  # no display on a compute node
    import matplotlib.pyplot as plt

    records = read_records(folder)
    if not records:
        return None

    def series(key):
        logged = [r for r in records if r.get(key) is not None]
        return [r["step"] for r in logged], [r[key] for r in logged]

    layout = [["loss", "lr"], ["tokens", "mfu"], ["goodput", "goodput"]]
    figure, named = plt.subplot_mosaic(layout, figsize=(12, 9), height_ratios=[1, 1, 0.35])
    curves = [named[name] for name in ("loss", "lr", "tokens", "mfu")]
    for axis in curves[1:]:
        axis.sharex(curves[0])
    panels = [
        ("loss", [("loss", "training"), ("val_loss", "validation")]),
        ("learning rate", [("lr", None)]),
        ("tokens/s (all devices)", [("tokens_per_s", None)]),
        ("MFU", [("mfu", None)]),
    ]
    for axis, (title, keys) in zip(curves, panels):
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
    named["lr"].ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    named["tokens"].set_ylim(bottom=0)  # a small dip must not look like a collapse
    named["mfu"].yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    for axis in curves[2:]:
        axis.set_xlabel("step")
    plot_goodput(named["goodput"], os.path.join(folder, goodput.LEDGER))
    figure.suptitle(f"{os.path.basename(os.path.abspath(folder))}: {records[-1]['step']} steps")
    figure.tight_layout()
    path = os.path.join(folder, "curves.png")
    temporary = os.path.join(folder, f"curves.{os.getpid()}.tmp.png")
    try:
        figure.savefig(temporary, dpi=100)
        os.replace(temporary, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise
    finally:
        plt.close(figure)
    return path


def plot_goodput(axis, path):
    """One bar: the run's wall time split as goodput.json splits it."""
    from matplotlib.ticker import PercentFormatter

    try:
        with open(path) as file:
            figures = json.load(file)
        shares = {part: figures[part] / figures["wall_s"] for part in ("productive_s", *goodput.SHOWN)}
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        shares = {}
    axis.set_title(
        f"where the run's {duration(figures['wall_s'])} went (goodput.json)" if shares else "goodput"
    )
    left = 0.0
    for part, share in shares.items():
        label = "training" if part == "productive_s" else goodput.SHOWN[part]
        axis.barh(0, share, left=left, label=f"{label} {100 * share:.1f}%" if share >= 5e-4 else None)
        left += max(share, 0.0)
    if not shares:
        axis.text(0.5, 0.5, "not measured", ha="center", va="center", transform=axis.transAxes, color="gray")
    axis.set_xlim(0, 1)
    axis.set_yticks([])
    axis.xaxis.set_major_formatter(PercentFormatter(1.0))
    if shares:
        axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=5, frameon=False)


def plot_run(folder):
    """--plot: a run folder's curves.png, while it trains too."""
    curves = os.path.isfile(os.path.join(folder, "metrics.jsonl")) and plot_curves(folder)
    if not curves:
        raise ConfigError(f"--plot={folder} holds no logged steps; give a run folder, <log_dir>/<run_name>")
    print(f"curves: {curves}")
    return 0
