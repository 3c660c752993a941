"""Benchmark reports made by hand, as benchmark.py records them, for the tests of its verdicts
(test_benchmark_verdicts.py) and of the picture drawn from them (test_report.py): healthy H100 nodes whose
figures a test then lowers, and the check each verdict_checks gives, by its name."""

from checks import verdicts
from common import nccl_tests

H100 = {
    "name": "NVIDIA H100 80GB HBM3",
    "copy_GB/s": 2900.0,
    "copy_throttle_ratio": 0.99,
    "matmul_bf16_TFLOPS": 760.0,
    "matmul_bf16_throttle_ratio": 0.98,
    "matmul_bf16_shape": "2048x2048x13312",
    "ecc_uncorrected_errors": 0,
}


def sweep(busbw: float, ranks: list, device_name="NVIDIA H100 80GB HBM3", slow_rank=None) -> dict:
    """A sweep as collectives_sweep records it, 1 MiB and 1 GiB per op, at `busbw` for 1 GiB;
    `slow_rank` took 2x the average there."""
    rows = {}
    for op, factor in nccl_tests.BUSBW_FACTORS.items():
        rows[op] = []
        for size, bandwidth in ((1 << 20, busbw / 10), (1 << 30, busbw)):
            time_us = size / (bandwidth / factor(len(ranks))) / 1e3
            slow = slow_rank is not None and size == 1 << 30
            rows[op].append(
                {
                    "size_bytes": size,
                    "time_us": time_us,
                    "time_max_us": time_us * (2.0 if slow else 1.05),
                    "time_max_rank": slow_rank if slow else ranks[-1],
                    "algbw_GB/s": bandwidth / factor(len(ranks)),
                    "busbw_GB/s": bandwidth,
                }
            )
    return {"backend": "nccl", "ranks": len(ranks), "device_name": device_name, **rows}


def cluster(n_nodes=1, gpus=8, intra_busbw=450.0, inter_busbw=45.0, nics=None) -> dict:
    """A report as cluster_report builds it, for n_nodes healthy H100 nodes with NDR NICs (or `nics`)."""
    nics = {"mlx5_0/1": 400.0} if nics is None else nics
    nodes = {
        f"node{n} (h{n})": {
            "node_name": f"h{n}",
            "hostname": f"h{n}",
            "first_rank": n * gpus,
            "nics_Gbps": dict(nics),
        }
        for n in range(n_nodes)
    }
    report = {
        "gpu": {f"{node}/gpu{i}": dict(H100) for node in nodes for i in range(gpus)},
        "nccl": sweep(intra_busbw if n_nodes == 1 else inter_busbw, list(range(n_nodes * gpus))),
        "links": {"skipped": "single node"},
        "storage": {node: {"sequential_write_GB/s": 2.0, "parallel_write_GB/s": 3.0} for node in nodes},
        "cpu": {node: {"single_core_ops/s": 68.0, "matmul_fp32_GFLOPS": 40.0} for node in nodes},
        "memory": {node: {"copy_1thread_GB/s": 18.0, "triad_all_cores_GB/s": 18.0} for node in nodes},
        "nodes": nodes,
    }
    if n_nodes > 1:
        report["nccl"]["intra_node"] = {
            node: sweep(intra_busbw, list(range(n * gpus, (n + 1) * gpus))) for n, node in enumerate(nodes)
        }
        report["links"] = {
            "pairs": {
                f"node{a}-node{b}": {"latency_us": 3.0, "bandwidth_GB/s": 45.0}
                for a in range(n_nodes)
                for b in range(a + 1, n_nodes)
            },
            "one_rank_per_node": sweep(inter_busbw, [n * gpus for n in range(n_nodes)]),
        }
    return report


def statuses(report, **options) -> dict:
    return {c["check"]: c for c in verdicts.verdict_checks(report, **options)}
