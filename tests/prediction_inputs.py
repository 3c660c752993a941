"""The inputs of the step's prediction, made by hand for tests/test_predict.py and test_live_prediction.py:
the options of a tiny run whose step is short; benchmark reports of 8 H100s or of a 2-core CPU host, as
benchmark.py writes them, with the figures a test gives; a probe's figures and a report's model section
holding one; a report written to a file, or changed in a copy."""

import copy
import dataclasses

import yaml

from run.prediction import probe

TINY_STEP = ["--model=tiny", "--compile=False", "--batch_size=4", "--global_batch_size=8", "--seq_length=64"]
SIZES = [2**20 * 4**power for power in range(6)]  # 1 MiB to 1 GiB, as the benchmark's default sweep


def sweep(busbw_GBps):
    return [{"size_bytes": size, "busbw_GB/s": busbw_GBps, "time_us": 5.0} for size in SIZES]


def gpu_report(matmul_TFLOPS=800.0, busbw_GBps=300.0):
    """A one-node report of 8 H100s, as benchmark.py writes one, with these figures."""
    gpus = {f"node0 (n1)/gpu{index}": {"name": "NVIDIA H100 80GB HBM3", "matmul_bf16_TFLOPS": matmul_TFLOPS,
                                        "copy_GB/s": 2900.0} for index in range(8)}  # fmt: skip
    collectives = {op: sweep(busbw_GBps) for op in ("all_gather", "reduce_scatter", "all_reduce")}
    world = {"device": "cuda", "ranks": 8, "nodes": 1, "ranks_per_node": 8}
    return {"world": world, "gpu": gpus, "nccl": collectives, "links": {"skipped": "one node"},
            "nodes": {"node0 (n1)": {"hostname": "n1"}}}  # fmt: skip


def cpu_report(busbw_GBps=1.0, host="h"):
    """A report of one host of 2 cores running 2 ranks, as benchmark.py writes one on a CPU."""
    return {"world": {"device": "cpu", "ranks": 2, "nodes": 1, "ranks_per_node": 2},
            "nodes": {"node0 (h)": {"hostname": host}},
            "cpu": {"node0 (h)": {"cores": 2, "matmul_fp32_GFLOPS": 50.0}},
            "memory": {"node0 (h)": {"copy_all_cores_GB/s": 10.0}},
            "nccl": {"all_reduce": sweep(busbw_GBps)}}  # fmt: skip


def measured(step_s=1.0, micro_s=0.3, layer_forward_s=0.1, accumulation=3, spread=0.05, others=0.0):
    """A probe's figures."""
    return probe.Measured(accumulation, step_s, micro_s, layer_forward_s, spread, others, 1.0)


def probed(step_s=0.3, options=None, world_size=2):
    """A report's model section: a probe of a run's step (benchmark.py --train_args)."""
    found = measured(step_s, micro_s=0.0, layer_forward_s=0.02, accumulation=1)
    return {"options": options or {"model": "tiny"}, "world_size": world_size,
            "measured": dataclasses.asdict(found)}  # fmt: skip


def written(folder, name, report):
    """report written as benchmark.py writes one, at folder/name."""
    path = folder / name
    path.write_text(yaml.safe_dump(report, sort_keys=False))
    return path


def damaged(report, change):
    report = copy.deepcopy(report)
    change(report)
    return report
