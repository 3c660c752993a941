"""The live step held against its prediction (run/predict.py), at every log window after the first: the
measured step over the predicted one, and the part that differs most, in the log line, the run's records
(TensorBoard, W&B, metrics.jsonl) and the goodput ledger. A run slower than SLOW_RATIO times its prediction
warns in one line naming that part, once, and again only if the gap grows by GROWTH more. The prediction is
kept in the run's log folder: a later launch of the run on the same machine (a restart, a requeue) reads it
there instead of tracing and timing the step again, which costs a recovery a minute on a large model."""

import dataclasses
import json
import os
import sys
import time

import torch

from common.files import UnsafeFile, read_json, write_atomically
from run.predict import Prediction

SLOW_RATIO = 1.25
GROWTH = 0.25
KEPT = "prediction.json"


class LivePrediction:
    """prediction: the Prediction of this run's step on this machine; layer_forward_s: the part of it that
    is the decoder layers' forward, which the ranks time themselves (run/stragglers.py's RankTimes)."""

    def __init__(self, prediction, layer_forward_s):
        self.prediction, self.layer_forward_s = prediction, layer_forward_s
        self.windows, self.warned_ratio = 0, None

    def log_window(self, step_s, rank_times):
        """The record's fields for a log window of mean step time step_s; rank_times: {rank name: (compute s,
        data wait s) per step}. {} for the first window (it holds the warm-up), or without a step time."""
        self.windows += 1
        if step_s is None or self.windows == 1:
            return {}
        predicted, parts = self.prediction.step_s, self.prediction.parts
        slowest, (compute_s, data_s) = max(rank_times.items(), key=lambda item: item[1][0])
        compute = sum(parts[name] for name in ("forward", "backward", "recomputation"))
        # the step waits for its slowest rank, whose compute runs at this pace against the prediction's
        compute_excess = compute * (compute_s / self.layer_forward_s - 1) if self.layer_forward_s else 0.0
        differences = {
            "compute": compute_excess,
            "data loading": max(data_s for _, data_s in rank_times.values()),
        }
        differences["communication and the rest"] = step_s - predicted - sum(differences.values())
        largest = max(differences, key=lambda name: abs(differences[name]))
        ratio = step_s / predicted
        fields = {"predicted_step_s": predicted, "vs_predicted": ratio, "largest_difference": largest,
                  "largest_difference_s": differences[largest]}  # fmt: skip
        if largest == "compute":
            fields["slowest_rank"] = slowest
        if ratio > SLOW_RATIO and (self.warned_ratio is None or ratio > self.warned_ratio + GROWTH):
            self.warned_ratio = ratio
            where = f" (slowest: {slowest}, computing {compute_s / self.layer_forward_s:.2f}x its prediction)"
            print(
                f"warning: steps take {ratio:.2f}x their predicted {predicted:.3g} s; the largest difference "
                f"is {largest}, {differences[largest]:+.3g} s a step{where if largest == 'compute' else ''}",
                flush=True,
            )
        return fields


def describe(record):
    """The log line's part: 'step 0.412 s = 1.31x predicted (compute +0.09 s)'."""
    if "vs_predicted" not in record:
        return ""
    return (
        f" | {record['vs_predicted']:.2f}x predicted ({record['largest_difference']} "
        f"{record['largest_difference_s']:+.3g} s)"
    )


def machine_here(world_size, processes_per_node, benchmark_report=None):
    """What a kept prediction holds for: this kind of device, as many processes on as many nodes, this
    torch, and the report the user named (--benchmark_report). Not the job's own report ($BENCHMARK_REPORT),
    which is new after each check of the nodes: a restart on the same kind of nodes keeps the prediction."""
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        device = f"CPU, {os.cpu_count()} cores"
    return {"device": device, "world_size": world_size, "processes_per_node": processes_per_node,
            "torch": torch.__version__, "benchmark_report": benchmark_report}  # fmt: skip


def keep(log_folder, prediction, machine):
    """Writes the prediction, what it holds for and when it was made into the run's log folder; where it
    cannot be written (a full disk), a warning, and the run goes on with it."""
    made = time.strftime("%Y-%m-%d %H:%M")
    record = {"machine": machine, "made": made, "prediction": dataclasses.asdict(prediction)}
    path = os.path.join(log_folder, KEPT)
    try:
        write_atomically(path, json.dumps(record, indent=1))
    except OSError as error:
        print(f"warning: cannot keep the prediction in {path} ({error.strerror or error}); a restart will "
              "predict the step again", file=sys.stderr)  # fmt: skip


def kept(log_folder, machine):
    """(the Prediction an earlier launch of this run kept, when it was made) if it holds for this machine;
    None if there is none, or it holds for another machine. A damaged one is a warning, and predicted anew."""
    path = os.path.join(log_folder, KEPT)
    try:
        record = read_json(path)
        if record["machine"] != machine:
            return None
        return Prediction(**record["prediction"]), record["made"]
    except FileNotFoundError:
        return None
    except (OSError, UnsafeFile, ValueError, KeyError, TypeError) as error:
        print(f"warning: {path} is not a prediction ({error}); predicting the step again", file=sys.stderr)
        return None
