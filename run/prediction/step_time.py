"""The predicted step, on one of three bases, each named where it is printed: measured on the run's own
devices (a probe, probe.py, or the run's first steps, live.py), a benchmark report's probe of this very
configuration, or a roofline of a report's or a datasheet's figures (roofline.py), printed as a range. A
prediction measured well is kept in the run's log folder with the options and machine it holds for and a
checksum, so that a later launch of the run (a restart, a requeue) prints it without probing again; one the
run's own steps contradict is removed (live.py decides when)."""

import dataclasses
import hashlib
import json
import math
import os
import sys
import time

import torch

from common.files import UnsafeFile, read_json, set_aside_damaged, write_atomically
from run.prediction.probe import Measured
from run.progress.curves import duration

KEPT = "prediction.json"
# Kept where the timed steps lie within KEEP_SPREAD of their median and other work took at most KEEP_OTHERS
# of the cores (on the quiet 2-core machines half the grid's probes, and the quick start's, lay more than 15%
# apart: docs/PERFORMANCE.md). Refused where other work took more than REFUSE_OTHERS: quiet, the grid's
# probes saw others take 0-10% of the cores; beside two busy loops 33-52%, and a step there varies as they do
# (the tiny model compiled, probed at 0.895 s, stepped at 2.19 s, its log windows up to 104% apart). Refused
# past REFUSE_SPREAD too: quiet probes lay up to 82% apart (tiny-mixtral, whose steps vary with its routing;
# their median was 5.8% off its step), busy ones 99-127%.
KEEP_SPREAD, KEEP_OTHERS, REFUSE_SPREAD, REFUSE_OTHERS = 0.15, 0.10, 1.0, 0.25
PLAUSIBLE_STEP_S = (1e-5, 86400.0)  # a kept step outside this is not one a run measured
NOT_PREDICTED = "data loading; the first step's compilation"


@dataclasses.dataclass
class Prediction:
    """step_s within [low_s, high_s] (a roofline's range; a measured step is all three); its basis (measured,
    report or roofline) and source, in words; the step's micro-steps, one micro-step past the first and the
    decoder layers' forward per step (0: not measured); the probe's spread, others' share and seconds."""

    step_s: float
    low_s: float
    high_s: float
    basis: str
    source: str
    micro_steps: int
    micro_step_s: float = 0.0
    layer_forward_s: float = 0.0
    spread: float = 0.0
    others: float = 0.0
    probe_s: float = 0.0

    @property
    def measured_well(self):
        return self.basis != "roofline" and self.spread <= KEEP_SPREAD and self.others <= KEEP_OTHERS

    @property
    def steps_s(self):
        """The step as printed: a roofline's range, or the step measured."""
        return (self.low_s, self.high_s) if self.basis == "roofline" else (self.step_s,)

    def line(self):
        if self.basis == "roofline":
            return (f"predicted step: {self.low_s:.3g}-{self.high_s:.3g} s, a roofline from {self.source}, "
                    f"not measured")  # fmt: skip
        parts = ""
        if self.micro_step_s:
            rest = self.step_s - self.micro_steps * self.micro_step_s
            # the rest is the step less its micro-steps, two timings apart: under their noise it can come
            # out below zero (the tiny model on one CPU process, its optimizer step a few ms: -0.003 s)
            rest = f"{rest:.3g} s" if rest >= 0 else "under the timings' noise"
            parts = f" = {self.micro_steps} micro-steps of {self.micro_step_s:.3g} s + the rest {rest}"
        where = f"measured on {self.source}" if self.basis == "measured" else f"from {self.source}"
        return f"predicted step: {self.step_s:.3g} s{parts} ({where})"


def this_machine(device, world_size, processes_per_node):
    """The machine a kept prediction or choice holds for."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {os.cpu_count()} cores"
    return {"device": name, "world_size": world_size, "processes_per_node": processes_per_node,
            "torch": torch.__version__}  # fmt: skip


def measured(probed, accumulation, source, basis="measured"):
    """The Prediction of a probe (probe.py's Measured) at the run's accumulation."""
    step = probed.step_at(accumulation)
    return Prediction(step, step, step, basis, source, accumulation, probed.micro_s,
                      probed.layer_forward_at(accumulation), probed.spread, probed.others,
                      probed.seconds)  # fmt: skip


def reported(path, report, naming, world_size, accumulation):
    """The Prediction of benchmark report path's probe of this very configuration (benchmark.py --train_args):
    the values of the options that name the run as naming, on as many ranks; None where it has none."""
    section = report.get("model") or {}
    if section.get("options") != naming or section.get("world_size") != world_size:
        return None
    source = f"benchmark report {path}'s timings of this configuration on its {ranks(world_size)}"
    return measured(Measured(**section["measured"]), accumulation, source, "report")


def ranks(count):
    return "one rank" if count == 1 else f"{count} ranks"


def refusal(prediction):
    """Why a probe's prediction, this machine's or a report's, is not worth printing, or None."""
    if prediction.basis == "roofline":
        return None
    whose = "this machine's" if prediction.basis == "measured" else "the benchmark report's"
    others = f"other work took {prediction.others:.0%}"
    if prediction.spread > REFUSE_SPREAD:
        busy = f", and {others} of its cores" if prediction.others > 0.05 else ""
        return f"not predicted: {whose} timings varied by {prediction.spread:.0%}{busy}"
    if prediction.others > REFUSE_OTHERS:
        return f"not predicted: {others} of the cores while {whose} timings were made"
    return None


def announce(args, prediction, world_size, model_flops, peak, where=""):
    """Prints the predicted step (and where it was kept), tokens/s per device, MFU over peak (the GPU
    datasheet's figures, or None) and the time to --max_steps; or why it is refused. Whether it printed it."""
    if refused := refusal(prediction):
        print(refused, flush=True)
        return False
    print(prediction.line() + (f" ({where})" if where else ""))
    tokens = args.global_batch_size * args.seq_length / world_size
    slowest_first = prediction.steps_s[::-1]
    rates = "-".join(f"{tokens / step:,.0f}" for step in slowest_first)
    mfu = ""
    if peak:
        peak_flops = peak["bf16"] * 1e12
        mfu = ", MFU " + "-".join(f"{model_flops * tokens / step / peak_flops:.1%}" for step in slowest_first)
    print(f"predicted: {rates} tokens/s per device{mfu}")
    if args.max_steps > 0:
        print(f"predicted: {args.max_steps} steps in {duration(args.max_steps * prediction.step_s)}")
    print(f"not predicted: {NOT_PREDICTED}", flush=True)
    return True


def checksum(record):
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def keep(log_folder, prediction, holds_for):
    """Writes a prediction measured well into the run's log folder, with what it holds for and a checksum;
    says why where it is not kept. A failed write (a full disk) is a warning, and the run goes on."""
    path = os.path.join(log_folder, KEPT)
    if not prediction.measured_well:
        print(f"note: this prediction is not kept for later launches: it was measured while other work used "
              f"{prediction.others:.0%} of the cores, its steps {prediction.spread:.0%} apart",
              flush=True)  # fmt: skip
        return
    record = {"for": holds_for, "made": time.strftime("%Y-%m-%d %H:%M"),
              "prediction": dataclasses.asdict(prediction)}  # fmt: skip
    try:
        write_atomically(path, json.dumps({**record, "checksum": checksum(record)}, indent=1))
    except OSError as error:
        print(f"warning: cannot keep the prediction in {path} ({error.strerror or error}); a restart will "
              "predict the step again", file=sys.stderr)  # fmt: skip


def forget(log_folder, judged):
    """Removes the prediction kept in log_folder, which the run's own steps put `judged` times off, with one
    note; one that cannot be removed (a read-only log folder) is a warning, and the run goes on."""
    path = os.path.join(log_folder, KEPT)
    try:
        os.remove(path)
    except FileNotFoundError:
        return
    except OSError as error:
        print(f"warning: cannot remove {path} ({error.strerror or error}); later launches of this run will "
              "print its prediction", file=sys.stderr, flush=True)  # fmt: skip
        return
    print(f"note: steps take {judged:.2f}x their prediction; it is no longer kept for later launches ({path} "
          "removed): the next launch measures the step again", flush=True)  # fmt: skip


def kept(log_folder, holds_for):
    """(the Prediction an earlier launch of this run kept, when) if it holds for holds_for, else None. A
    damaged one (unreadable, not a regular file, checksum or fields wrong) is one warning and set aside."""
    path = os.path.join(log_folder, KEPT)
    try:
        record = read_json(path)
        problem = record_problem(record)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, UnsafeFile) as error:
        problem = str(error)
    if problem:
        print(f"warning: {path} is not a kept prediction ({problem[:200]}); it is {set_aside_damaged(path)}, "
              f"and the step is predicted again", file=sys.stderr, flush=True)  # fmt: skip
        return None
    if record["for"] != holds_for:
        return None
    return Prediction(**record["prediction"]), record["made"]


def record_problem(record):
    """What makes a kept record unusable, or None."""
    if not isinstance(record, dict) or set(record) != {"for", "made", "prediction", "checksum"}:
        return "not a record of a prediction"
    if record["checksum"] != checksum({key: record[key] for key in ("for", "made", "prediction")}):
        return "its checksum does not match its content"
    fields = {field.name: field.type for field in dataclasses.fields(Prediction)}
    saved = record["prediction"]
    if not isinstance(saved, dict) or set(saved) != set(fields):
        return "its prediction lacks fields or has others"
    for name, value in saved.items():
        kind = (int, float) if fields[name] is float else fields[name]
        if not isinstance(value, kind) or isinstance(value, bool):
            return f"{name} is not a {fields[name].__name__}"
        if isinstance(value, float) and not math.isfinite(value):
            return f"{name} is {value}"
        if isinstance(value, str) and (len(value) > 200 or not value.isprintable()):
            return f"{name} holds what is not printable text"
    low, high = PLAUSIBLE_STEP_S
    if not all(low <= saved[name] <= high for name in ("step_s", "low_s", "high_s")):
        return f"a step of {saved['step_s']!r} s is not one a run measured"
    if not isinstance(record["made"], str) or not record["made"].isprintable() or len(record["made"]) > 40:
        return "its date is not printable text"
    return None
