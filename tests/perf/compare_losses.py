"""Two runs' final losses side by side (the same options but one, from the same seed): the mean training loss
of the last logged steps, and the validation loss of the last evaluation, each as the second run's over the
first's. Used by tests/perf/on_gpu.sh for bf16 against float8.

    python tests/perf/compare_losses.py logs/bf16/metrics.jsonl logs/float8/metrics.jsonl --tolerance=0.02
"""

import argparse
import json
import statistics
from pathlib import Path

LAST = 10  # logged steps averaged: one step's loss moves with its batch


def final_losses(path):
    records = (
        [json.loads(line) for line in Path(path).read_text().splitlines()] if Path(path).is_file() else []
    )
    if not records:
        return None
    validation = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    return {
        "last_step": records[-1]["step"],
        "first_loss": records[0]["loss"],
        "train_loss": statistics.fmean(r["loss"] for r in records[-LAST:]),
        "val_loss": validation[-1] if validation else None,
    }


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("first")
    parser.add_argument("second")
    parser.add_argument("--tolerance", type=float, default=0.02, help="the largest relative difference")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    first, second = final_losses(args.first), final_losses(args.second)
    if first is None or second is None:
        print(f"losses: {'the first' if first is None else 'the second'} run logged no step")
        return
    result = {"first": first, "second": second}
    parts = []
    for key in ("train_loss", "val_loss"):
        if first[key] is None or second[key] is None:
            continue
        ratio = second[key] / first[key]
        result[f"{key}_ratio"] = ratio
        verdict = "within" if abs(ratio - 1) <= args.tolerance else "NOT within"
        parts.append(f"{key} {first[key]:.4f} vs {second[key]:.4f} ({ratio - 1:+.2%}, {verdict} "
                     f"{args.tolerance:.0%})")  # fmt: skip
    print(f"losses at step {first['last_step']} / {second['last_step']} (from {first['first_loss']:.3f} / "
          f"{second['first_loss']:.3f}): {'; '.join(parts)}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
