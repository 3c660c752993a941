"""A few lines from a --profile_steps Chrome trace: the kernels that take the most time, the device's idle
share, and the split of kernel time between matmul, attention, elementwise, the optimizer, FSDP copies and
the loss.

    python tests/perf/trace_summary.py logs/<run>/trace_steps_10-11_<host>_rank0.pt.trace.json [--json F]

On a GPU the kernels are the CUDA kernels, memcpys and memsets; on CPU, where a trace holds none, the
operators that no other operator encloses stand in for them. A kernel belongs to the loss or the optimizer
when the host launched it inside train.py's loss or the optimizer's step (by the trace's correlation ids).
"""

import argparse
import bisect
import collections
import json
import re
from pathlib import Path

DEVICE_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")
# By kernel name, first match wins; what the host launched inside the loss or optimizer comes first.
CLASSES = [
    (
        "FSDP copies",
        r"nccl|all_?gather|reduce_?scatter|chunk_cat|split_with_sizes|foreach_copy|memcpy|memset",
    ),
    ("attention", r"flash|fmha|attention|sdpa|softmax"),
    ("matmul", r"gemm|xmma|cutlass|nvjet|cublas|matmul|addmm|\bmm\b|linear|wgmma|sm90"),
]
OPTIMIZER_RANGE = re.compile(r"Optimizer\.step")
LOSS_RANGE = "linear_cross_entropy"  # named in run/model/loss.py


def load_events(path):
    with open(path) as file:
        return json.load(file)["traceEvents"]


def device_events(events):
    kernels = [e for e in events if e.get("cat") in DEVICE_KINDS and "dur" in e]
    if kernels:
        return kernels
    ops = sorted((e for e in events if e.get("cat") == "cpu_op" and "dur" in e), key=lambda e: e["ts"])
    outermost, end = [], float("-inf")
    for op in ops:  # on CPU: the operators no other one encloses
        if op["ts"] >= end:
            outermost.append(op)
            end = op["ts"] + op["dur"]
    return outermost


def host_ranges(events, matches):
    ranges = [(e["ts"], e["ts"] + e["dur"]) for e in events if "dur" in e and matches(e.get("name", ""))]
    return sorted(ranges)


def inside(ranges, ts):
    index = bisect.bisect_right(ranges, (ts, float("inf"))) - 1
    return any(start <= ts <= end for start, end in ranges[max(0, index - 8) : index + 1])


def launch_times(events):
    """The host time at which each correlation id was launched (a CPU trace: the event's own)."""
    return {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }


def classify(kernel, launched_at, loss, optimizer):
    host_ts = launched_at.get(kernel.get("args", {}).get("correlation"), kernel["ts"])
    if inside(loss, host_ts):
        return "loss"
    if inside(optimizer, host_ts):
        return "optimizer"
    name = kernel["name"].lower()
    return next((label for label, pattern in CLASSES if re.search(pattern, name)), "elementwise")


def busy_time(kernels):
    """The union of the kernels' intervals: streams that overlap count once."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted((k["ts"], k["ts"] + k["dur"]) for k in kernels):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def summarise(events, top=15):
    kernels = device_events(events)
    span = max(k["ts"] + k["dur"] for k in kernels) - min(k["ts"] for k in kernels)
    launched_at = launch_times(events)
    loss = host_ranges(events, lambda name: name == LOSS_RANGE)
    optimizer = host_ranges(events, OPTIMIZER_RANGE.search)
    by_name, by_class = collections.Counter(), collections.Counter()
    for kernel in kernels:
        by_name[kernel["name"]] += kernel["dur"]
        by_class[classify(kernel, launched_at, loss, optimizer)] += kernel["dur"]
    total = sum(by_name.values())
    return {
        "span_ms": span / 1e3,
        "kernel_ms": total / 1e3,
        "idle_share": 1 - busy_time(kernels) / span,
        "split": {label: time / total for label, time in by_class.most_common()},
        "top_kernels": [
            {"name": name[:120], "ms": time / 1e3, "share": time / total}
            for name, time in by_name.most_common(top)
        ],
    }


def print_summary(summary):
    print(f"traced span {summary['span_ms']:.1f} ms, kernel time {summary['kernel_ms']:.1f} ms")
    print(f"device idle share: {summary['idle_share']:.1%}")
    print("split: " + ", ".join(f"{label} {share:.1%}" for label, share in summary["split"].items()))
    print(f"{'ms':>10} {'share':>7}  kernel")
    for row in summary["top_kernels"]:
        print(f"{row['ms']:>10.2f} {row['share']:>7.1%}  {row['name']}")


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace")
    parser.add_argument("--json", help="also write the summary to this file")
    args = parser.parse_args()
    summary = summarise(load_events(args.trace))
    print_summary(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
