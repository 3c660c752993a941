"""Where the run stands and how fast it goes: the config and model at the start, then per log window on rank 0
one line and one record (loss, speed, MFU, memory, ETA, what the other owners add: stragglers) written through
the run log (run/progress/run_log.py)."""

import contextlib
import math
import sys
import time

import torch
import torch.distributed as dist

from common.datasheet import datasheet
from common.stragglers import describe_straggler
from run.progress.curves import duration, plot_curves
from run.progress.run_log import RunLog


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
    """The step count, tokens seen and time of the run, and its log window: the loss over every step since the
    last line, and speed over the timed steps among them (not the first, compiling, step; never evaluation or
    checkpoint writing). MFU is over the GPU datasheet's dense bf16 peak."""

    def __init__(self, args, flops_per_token, device, total_steps, start_time, folder):
        self.args, self.device, self.total_steps, self.start_time = args, device, total_steps, start_time
        self.world_size, self.master = dist.get_world_size(), dist.get_rank() == 0
        self.step, self.tokens_seen, self.elapsed_before = 0, 0, 0.0
        self.tokens_per_step = args.global_batch_size * args.seq_length
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops(device)
        self.run_log = RunLog(args, folder) if self.master else None
        self.first_step_end, self.step_seconds = None, 0.0
        self.window = self.new_window()

    def resume(self, trainer_state, path):
        self.step, self.tokens_seen = trainer_state["step"], trainer_state["tokens_seen"]
        self.elapsed_before = trainer_state.get("elapsed_s", 0.0)  # the time of the run's earlier launches
        if self.master:
            fresh = " (weights only, fresh optimizer)" if self.args.skip_optimizer else ""
            print(f"resumed from {path} at step {self.step}{fresh}", flush=True)

    @contextlib.contextmanager
    def timing(self):
        started = time.perf_counter()
        yield
        self.step_seconds = time.perf_counter() - started

    def new_window(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        return {"loss": torch.zeros((), device=self.device), "steps": 0, "seconds": 0.0, "timed": 0}

    def step_done(self, step, loss, grad_norm, lr):
        self.step, self.grad_norm, self.lr = step, grad_norm, lr
        self.tokens_seen += self.tokens_per_step
        # The ETA counts from the first step's end: evaluation and checkpoints in, compiling out.
        if self.first_step_end is None:
            self.first_step_end, self.first_step = time.perf_counter(), step
            if self.master:
                print(f"time to first step: {self.first_step_end - self.start_time:.1f} s", flush=True)
        else:
            self.window["seconds"] += self.step_seconds
            self.window["timed"] += 1
        self.window["loss"] += loss
        self.window["steps"] += 1

    @property
    def timed_steps(self):
        """The window's timed steps so far."""
        return self.window["timed"]

    @property
    def mean_step_s(self):
        """The window's mean step time so far; None before a step is timed."""
        return self.window["seconds"] / self.window["timed"] if self.window["timed"] else None

    def log(self, val_loss, fields):
        """Ends the log window. Every rank takes part: the loss is averaged over the ranks. fields: what other
        owners add to rank 0's record (the stragglers)."""
        dist.all_reduce(self.window["loss"])  # gloo has no AVG: sum, then divide
        if self.master:
            record = {**self.record(val_loss), **fields}
            print(log_line(record, self.total_steps), flush=True)
            self.run_log.write(record)
        self.window = self.new_window()

    def record(self, val_loss):
        timed, seconds, now = self.window["timed"], self.window["seconds"], time.perf_counter()
        cuda, steps_since_first = self.device.type == "cuda", self.step - self.first_step
        tokens_per_s = self.tokens_per_step * timed / seconds if timed else None
        peak = self.peak_flops * self.world_size if self.peak_flops and timed else None
        mfu = self.flops_per_token * tokens_per_s / peak if peak else None
        rate = (now - self.first_step_end) / steps_since_first if steps_since_first else None
        loss_sum = self.window["loss"]  # over the steps of the window and the ranks
        record = {
            "step": self.step, "loss": loss_sum.item() / self.world_size / self.window["steps"],
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

    def close(self, stopped, ledger):
        """The launch's last lines: where its time went (the goodput ledger), how it ended, the curves."""
        if not self.master:
            return
        ledger.write()
        figures = ledger.figures(time.time())
        self.run_log.scalars({f"goodput/{key}": value for key, value in figures.items()}, self.step)
        print(ledger.summary(), flush=True)
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
    line += describe_prediction(record)
    for name, figures in record.get("stragglers", {}).items():
        line += f" | straggler {name}: {describe_straggler(figures, record)}"
    return line


def describe_prediction(record):
    """The log line's part of the live prediction's fields (run/prediction/live.py): '1.31x predicted (compute
    +0.09 s)'."""
    if "vs_predicted" not in record:
        return ""
    return (
        f" | {record['vs_predicted']:.2f}x predicted ({record['largest_difference']} "
        f"{record['largest_difference_s']:+.3g} s)"
    )
