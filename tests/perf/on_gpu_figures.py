"""One line of figures from a run's metrics.jsonl (logged every step): median step time, tokens/s and MFU
over the steps after the first (compilation) and outside the profiled ones, the step the run predicted for
itself, and the largest max_memory_allocated of those steps beside the dry run's simulated peak (which is a
later step's), with the first step's apart (compiling can take more once). From the run's output (--output)
and its log folder: the time to its first step, the seconds its probe took (prediction.json, which holds a
prediction measured well), dynamo's recompiles, and the lines that refused its prediction or warned of a
slower run.
Used by tests/perf/on_gpu.sh.

    python tests/perf/on_gpu_figures.py logs/<run>/metrics.jsonl --name=op --simulated_gb=98.8 \
        --skip_steps=20,21 --output=run_output.txt
"""

import argparse
import json
import re
import statistics
from pathlib import Path


def figures(records, skip):
    timed = [r for r in records if r["step"] > 1 and r["step"] not in skip and r.get("tokens_per_s")]
    if not timed:
        return {"steps_timed": 0}
    peaks = [r["peak_mem_GB"] for r in timed if r.get("peak_mem_GB") is not None]
    first = [r["peak_mem_GB"] for r in records if r["step"] == 1 and r.get("peak_mem_GB") is not None]
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    predicted = [r["predicted_step_s"] for r in records if r.get("predicted_step_s")]
    return {
        "steps_timed": len(timed),
        "last_step": records[-1]["step"],
        "step_time_s": statistics.median(r["step_time_s"] for r in timed),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "mfu": statistics.median(mfus) if mfus else None,
        "max_memory_allocated_GB": max(peaks) if peaks else None,
        "first_step_max_memory_allocated_GB": first[0] if first else None,
        "predicted_step_s": predicted[-1] if predicted else None,
        "first_loss": records[0]["loss"],
        "last_loss": records[-1]["loss"],
    }


def from_output(output, log_folder):
    """The time to the first step, the probe's seconds, dynamo's recompiles (with TORCH_LOGS=recompiles), and
    the refusals and warnings, where they were."""
    text = Path(output).read_text(errors="replace") if output and Path(output).is_file() else ""
    first = re.search(r"time to first step: ([0-9.]+) s", text)
    kept = log_folder / "prediction.json"
    probe_s = json.loads(kept.read_text())["prediction"]["probe_s"] if kept.is_file() else None
    flagged = [
        line
        for line in text.splitlines()
        if line.startswith(("not predicted: this", "not predicted: other", "warning: steps"))
    ]
    return {"time_to_first_step_s": float(first.group(1)) if first else None, "probe_s": probe_s,
            "recompiles": text.count("Recompiling function"), "refused_or_warned": flagged}  # fmt: skip


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("metrics")
    parser.add_argument("--name", required=True)
    parser.add_argument("--simulated_gb", type=float, default=0.0, help="the dry run's peak; 0: none")
    parser.add_argument("--skip_steps", default="", help="A,B: the profiled steps, left out of the timings")
    parser.add_argument("--output", help="the run's output, for its time to the first step and its warnings")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    path = Path(args.metrics)
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    skip = [int(step) for step in args.skip_steps.split(",") if step]
    skip = set(range(skip[0], skip[-1] + 1)) if skip else set()
    result = dict(
        figures(records, skip),
        name=args.name,
        simulated_peak_GB=args.simulated_gb or None,
        **from_output(args.output, path.parent),
    )
    if not result["steps_timed"]:
        print(f"{args.name}: no timed step logged")
    else:
        mfu = f"{result['mfu']:.1%}" if result["mfu"] is not None else "n/a"
        real = result["max_memory_allocated_GB"]
        memory = f"{real:.1f} GB" if real is not None else "n/a (no GPU)"
        if result["first_step_max_memory_allocated_GB"] is not None:
            memory += f", the first step's {result['first_step_max_memory_allocated_GB']:.1f} GB"
        predicted = result["predicted_step_s"]
        error = (predicted - result["step_time_s"]) / result["step_time_s"] if predicted else None
        against = f"predicted {predicted:.3f} s ({error:+.1%})" if predicted else "no prediction"
        print(
            f"{args.name}: {result['steps_timed']} steps timed (to step {result['last_step']}), median step "
            f"{result['step_time_s']:.3f} s ({against}), {result['tokens_per_s']:,.0f} tokens/s, MFU {mfu}, "
            f"max_memory_allocated {memory} (dry run {args.simulated_gb or 'n/a'} GB), "
            f"loss {result['first_loss']:.3f} -> {result['last_loss']:.3f}"
        )
    first, probe_s = result["time_to_first_step_s"], result["probe_s"]
    if first is not None:
        print(
            f"{args.name}: time to first step {first:.1f} s"
            + (f", the probe's {probe_s:.1f} s in it" if probe_s else "")
            + f", {result['recompiles']} recompiles"
        )
    for line in result["refused_or_warned"]:
        print(f"{args.name}: {line}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
