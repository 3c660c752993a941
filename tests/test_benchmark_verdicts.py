"""benchmark.py's verdicts on reports made by hand (tests/hand_reports.py): healthy H100 nodes pass every
check; a throttling GPU, NVLink down, a slow inter-node link or slow storage fail; a slow rank in one
collective, a slow CPU or host memory figure only warn; stragglers are flagged against their peers."""

from hand_reports import cluster, statuses, sweep

from checks import verdicts
from common import stragglers


def test_stragglers_are_flagged_and_uniform_values_pass():
    assert stragglers.below_peers({f"gpu{i}": 700.0 for i in range(8)}) == []
    assert stragglers.below_peers({**{f"gpu{i}": 700.0 for i in range(7)}, "gpu7": 620.0}) == ["gpu7"]
    assert stragglers.below_peers({"a": 100.0, "b": 91.0, "c": 100.0}) == []  # 9% below: tolerated
    assert stragglers.below_peers({"only": 1.0}) == []


def test_verdict_fails_a_slow_gpu_and_one_far_below_its_datasheet():
    healthy = {
        "name": "NVIDIA H100 80GB HBM3",
        "copy_GB/s": 2900.0,
        "matmul_bf16_TFLOPS": 700.0,
        "ecc_uncorrected_errors": 0,
    }
    gpus = {f"node0/gpu{i}": dict(healthy) for i in range(4)}
    report = {
        "gpu": gpus,
        "nccl": {},
        "links": {"skipped": "single node"},
        "storage": {},
        "cpu": {},
        "memory": {},
        "nodes": {"node0": {"node_name": "n0"}},
    }
    assert [c for c in verdicts.verdict_checks(report) if c["status"] == "fail"] == []
    gpus["node0/gpu3"]["matmul_bf16_TFLOPS"] = 400.0  # 43% of 989.4 and 43% below its siblings
    failures = [c for c in verdicts.verdict_checks(report) if c["status"] == "fail"]
    assert {c["check"] for c in failures} == {"gpu matmul_bf16_TFLOPS", "gpu matmul_bf16_TFLOPS vs datasheet"}
    assert all("node0/gpu3" in c["value"] for c in failures)
    assert verdicts.verdict_checks(report)[0]["status"] == "fail"  # failures first


def test_healthy_h100_nodes_pass_every_check():
    for n_nodes in (1, 3):
        checks = statuses(cluster(n_nodes))
        assert [c for c in checks.values() if c["status"] in ("fail", "warn")] == []
        for check in (
            "intra-node all_reduce busbw",
            "intra-node all_gather busbw",
            "gpu throttling (last second / first)",
            "gpu matmul_bf16_TFLOPS vs datasheet",
            "collective slowest rank",
            "storage parallel_write_GB/s",
        ):
            assert checks[check]["status"] == "pass", checks[check]
        assert verdicts.verdict(list(checks.values())) == "pass"
    checks = statuses(cluster(3))
    assert (
        checks["inter-node all_reduce busbw"]["reference"]
        == ">= 25 GB/s (50% of a 400 Gb/s NIC, /sys/class/infiniband)"
    )
    assert checks["intra-node all_gather busbw"]["reference"] == ">= 180 GB/s (H100/H200 SXM, NVLink 4)"


def test_a_throttling_gpu_fails():
    report = cluster()
    report["gpu"]["node0 (h0)/gpu5"]["matmul_bf16_throttle_ratio"] = 0.8  # last second 20% under the first
    failures = [c for c in verdicts.verdict_checks(report) if c["status"] == "fail"]
    assert [c["check"] for c in failures] == ["gpu throttling (last second / first)"]
    assert (
        failures[0]["value"] == "lowest node0 (h0)/gpu5 matmul_bf16: 0.8; flagged node0 (h0)/gpu5 matmul_bf16"
    )


def test_nvlink_down_fails_the_intra_node_floor_on_one_node_or_many():
    report = cluster(intra_busbw=30.0)  # NCCL over PCIe at 1 GiB: a node whose NVLink is down
    failing = {c["check"] for c in verdicts.verdict_checks(report) if c["status"] == "fail"}
    assert failing == {"intra-node all_reduce busbw", "intra-node all_gather busbw"}
    report = cluster(n_nodes=2)
    report["nccl"]["intra_node"]["node1 (h1)"] = sweep(30.0, list(range(8, 16)))
    check = statuses(report)["intra-node all_reduce busbw"]
    assert check["status"] == "fail" and check["value"] == "lowest node1 (h1): 30 GB/s; flagged node1 (h1)"
    # the same busbw is healthy on a PCIe-only node, and an unknown GPU has no floor
    for name in ("NVIDIA H100 PCIe", "NVIDIA A100 80GB PCIe"):
        pcie = cluster(intra_busbw=30.0) | {"nccl": sweep(30.0, list(range(8)), name)}
        assert statuses(pcie)["intra-node all_reduce busbw"]["status"] == "pass"
    t4 = cluster() | {"nccl": sweep(30.0, list(range(8)), "Tesla T4")}
    skipped = statuses(t4)["intra-node all_reduce busbw"]
    assert skipped["status"] == "skip" and "no floor known for Tesla T4" in skipped["value"]


def test_a_slow_inter_node_link_fails_against_the_nic_and_its_peers():
    report = cluster(n_nodes=3, inter_busbw=12.0)  # a 400 Gb/s NIC gives ~45; 12: a link trained down, or TCP
    check = statuses(report)["inter-node all_reduce busbw"]
    assert check["status"] == "fail" and check["value"].startswith("lowest one rank per node: 12 GB/s")
    assert statuses(report, nic_Gbps=100.0)["inter-node all_reduce busbw"]["status"] == "pass"  # floor 6.25
    report = cluster(n_nodes=3, nics={})
    skipped = statuses(report)["inter-node all_reduce busbw"]
    assert skipped["status"] == "skip" and "pass --nic_gbps" in skipped["value"]
    report["links"]["pairs"]["node0-node2"]["bandwidth_GB/s"] = 20.0
    assert statuses(report)["node pair bandwidth_GB/s"]["status"] == "fail"


def test_a_slow_rank_in_one_collective_only_warns_and_names_it():
    report = cluster(n_nodes=2)
    report["nccl"]["intra_node"]["node1 (h1)"] = sweep(450.0, list(range(8, 16)), slow_rank=13)
    checks = verdicts.verdict_checks(report)
    warns = [c for c in checks if c["status"] == "warn"]
    assert len(warns) == 1 and warns[0]["check"] == "collective slowest rank"
    assert warns[0]["value"].startswith("rank 13 in node1 (h1) intra-node all_reduce at 1024 MiB: 2.0x")
    assert verdicts.verdict(checks) == "warn" and verdicts.verdict(checks, fail_on_warn=True) == "fail"
    assert checks[0]["status"] == "warn"  # warns before passes


def test_a_slow_cpu_or_host_memory_figure_only_warns_but_slow_storage_fails():
    report = cluster(n_nodes=3)
    report["cpu"]["node2 (h2)"]["single_core_ops/s"] = 50.0  # 26% below its peers: another job on the node
    report["memory"]["node1 (h1)"]["triad_all_cores_GB/s"] = 12.0
    checks = verdicts.verdict_checks(report)
    assert {c["check"] for c in checks if c["status"] == "warn"} == {
        "node cpu single_core_ops/s",
        "node memory triad_all_cores_GB/s",
    }
    assert verdicts.verdict(checks) == "warn" and not [c for c in checks if c["status"] == "fail"]
    report["storage"]["node0 (h0)"]["parallel_write_GB/s"] = 0.05
    checks = verdicts.verdict_checks(report)
    assert [c["check"] for c in checks if c["status"] == "fail"] == ["storage parallel_write_GB/s"]
    assert [c["status"] for c in checks[:3]] == ["fail", "warn", "warn"]  # fails first, then warns
    assert statuses(report, min_storage_GBps=0.01)["storage parallel_write_GB/s"]["status"] == "pass"
