"""benchmark.py: real runs under torchrun on CPU, the formulas against hand-computed values, a failing
check's exit status and datasheets. Its bad input is in test_benchmark_input.py, its verdicts on reports made
by hand in test_benchmark_verdicts.py, its measurements against plain references in
test_benchmark_timing.py."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import launch

import benchmark
from checks import collectives, timing, world
from common import datasheet, nccl_tests
from run.job import job

ROOT = Path(__file__).resolve().parents[1]

TORCHRUN = Path(sys.executable).parent / "torchrun"


def read_report(report_dir: Path) -> dict:
    (cluster,) = [p for p in report_dir.glob("benchmark_*.yaml") if "_rank" not in p.name]
    return yaml.safe_load(cluster.read_text())


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    """`torchrun --nproc_per_node=2 benchmark.py --quick` on this CPU, as a user runs it: (its result, its
    report, its storage folder, its report folder)."""
    tmp_path = tmp_path_factory.mktemp("two_process")
    storage, reports = tmp_path / "storage", tmp_path / "logs"
    storage.mkdir()
    result = launch(
        "benchmark.py",
        ["--quick", "--storage_path", str(storage), "--report_dir", str(reports)],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result, read_report(reports), storage, reports


def test_two_process_cpu_run_writes_a_complete_report_with_its_verdict(two_process_run):
    result, report, _, _ = two_process_run
    assert list(report)[:4] == ["job", "world", "verdict", "checks"]
    assert set(world.SECTIONS) | {"nodes"} <= set(report)
    # one node: nothing to compare CPU figures with; a slow rank in a collective would only warn
    assert report["verdict"] in ("pass", "warn") and report["world"]["ranks"] == 2
    assert report["world"]["backend"] == "gloo"
    assert not [c for c in report["checks"] if c["status"] == "fail"], report["checks"]
    assert report["gpu"] == {"skipped": "no GPU present"}
    gpu_check = {"status": "skip", "check": "gpu", "value": "no GPU present", "reference": "", "flagged": {}}
    assert any(gpu_check.items() <= c.items() for c in report["checks"]), report["checks"]
    assert report["links"] == {"skipped": "single node"}
    floor_checks = {c["check"]: c for c in report["checks"] if c["check"].startswith("intra-node")}
    assert set(floor_checks) == {"intra-node all_reduce busbw", "intra-node all_gather busbw"}
    assert all(c["status"] == "skip" and "no floor for gloo" in c["value"] for c in floor_checks.values())
    assert f"verdict: {report['verdict']} in" in result.stdout


def test_two_process_cpu_run_times_each_collective_as_nccl_tests_counts(two_process_run):
    _, report, _, _ = two_process_run
    for op in nccl_tests.BUSBW_FACTORS:
        rows = report["nccl"][op]
        assert [row["size_bytes"] for row in rows] == [65536, 262144, 1048576]
        for row in rows:
            assert row["time_us"] > 0 and row["time_max_us"] >= row["time_us"] * 0.999
            assert row["time_max_rank"] in (0, 1)
            assert row["algbw_GB/s"] == pytest.approx(row["size_bytes"] / row["time_us"] / 1e3, rel=2e-3)
            assert row["busbw_GB/s"] == pytest.approx(
                row["algbw_GB/s"] * nccl_tests.BUSBW_FACTORS[op](2), rel=2e-3
            )


STORAGE_FIGURES = ("sequential_write_GB/s", "sequential_read_GB/s", "parallel_write_GB/s",
                   "parallel_read_GB/s", "random_read_4k_IOPS")  # fmt: skip
CPU_FIGURES = ("all_core_ops/s", "single_core_ops/s", "matmul_fp32_GFLOPS", "zlib_single_core_MB/s",
               "zlib_all_cores_MB/s", "sort_float64_Melem/s")  # fmt: skip
MEMORY_FIGURES = ("copy_1thread_GB/s", "triad_1thread_GB/s", "copy_all_cores_GB/s", "triad_all_cores_GB/s",
                  "allocation_GB/s")  # fmt: skip


def test_two_process_cpu_run_measures_its_node_and_leaves_no_file_in_the_storage_folder(two_process_run):
    _, report, storage, reports = two_process_run
    (node,) = report["nodes"]
    storage_figures = report["storage"][node]
    assert storage_figures["method"].startswith(("O_DIRECT", "fsync + posix_fadvise"))
    assert all(storage_figures[key] > 0 for key in STORAGE_FIGURES), storage_figures
    assert report["storage"]["aggregate"]["parallel_write_GB/s"] == pytest.approx(
        storage_figures["parallel_write_GB/s"], rel=2e-3
    )
    assert not list(storage.iterdir()), "the storage test must remove its files"
    assert all(report["cpu"][node][key] > 0 for key in CPU_FIGURES), report["cpu"]
    assert all(report["memory"][node][key] > 0 for key in MEMORY_FIGURES), report["memory"]
    per_node = yaml.safe_load((reports / f"benchmark_{report['job']['id']}_rank0.yaml").read_text())
    assert per_node["storage"] == storage_figures and "copy_1thread_GB/s" in per_node["memory"]
    assert report["nodes"][node]["nics_Gbps"] == collectives.nic_rates_Gbps()
    storage_check = next(c for c in report["checks"] if c["check"] == "storage parallel_write_GB/s")
    assert {"status": "pass", "check": "storage parallel_write_GB/s"}.items() <= storage_check.items()


def test_two_nodes_measure_links_between_them_and_nvlink_within_each(tmp_path):
    """Two torchrun "nodes" on this machine, two ranks each: ping-pong and one-rank-per-node
    collectives between them, each node's own collectives within it."""
    # The rendezvous store is this test's, bound to a port the kernel picks and held until both nodes are
    # done: each torchrun joins it as a client (is_host=0), so no other launch can take its port meanwhile.
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    command = [
        str(TORCHRUN),
        "--nnodes=2",
        "--nproc_per_node=2",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{store.port}",
        "--rdzv_conf=is_host=0",
        "--rdzv_id=two-nodes",
        str(ROOT / "benchmark.py"),
        "--quick",
        "--only",
        "nccl,links",
        "--report_dir",
        str(tmp_path),
        "--nic_gbps",
        "400",
    ]
    nodes = [
        subprocess.Popen(
            command,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in (0, 1)
    ]
    outputs = [node.communicate(timeout=180) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-3000:]
    report = read_report(tmp_path)
    assert report["world"]["nodes"] == 2 and report["nccl"]["ranks"] == 4
    pair = report["links"]["pairs"]["node0-node1"]
    assert 0 < pair["latency_us"] < 1e5 and pair["bandwidth_GB/s"] > 0
    between = report["links"]["one_rank_per_node"]
    assert between["ranks"] == 2 and between["all_reduce"][0]["busbw_GB/s"] > 0
    assert {row["time_max_rank"] for op in nccl_tests.BUSBW_FACTORS for row in between[op]} <= {0, 2}
    (first, second) = report["nccl"]["intra_node"]
    assert first.startswith("node0") and second.startswith("node1")
    for node, ranks in ((first, {0, 1}), (second, {2, 3})):
        sweep = report["nccl"]["intra_node"][node]
        assert sweep["ranks"] == 2 and sweep["all_gather"][-1]["busbw_GB/s"] > 0
        assert {row["time_max_rank"] for op in nccl_tests.BUSBW_FACTORS for row in sweep[op]} <= ranks
    checks = {c["check"]: c for c in report["checks"]}
    # gloo's 1 MiB is far from a bandwidth plateau: --nic_gbps gives a floor, the size is too small to judge
    assert checks["inter-node all_reduce busbw"]["status"] == "skip"
    assert "largest message 1 MiB, under 256 MiB" in checks["inter-node all_reduce busbw"]["value"]
    assert "no floor for gloo" in checks["intra-node all_gather busbw"]["value"]
    assert report["verdict"] in ("pass", "warn")
    assert not [c for c in report["checks"] if c["status"] == "fail"]
    node_files = sorted(p.name.rsplit("_", 1)[1] for p in tmp_path.glob("benchmark_*_rank*.yaml"))
    assert node_files == ["rank0.yaml", "rank2.yaml"]


def test_bandwidth_formulas_match_nccl_tests_by_hand():
    algbw = timing.algbw_GBps(256e6, 0.004)  # 256 MB in 4 ms
    assert algbw == pytest.approx(64.0)
    assert timing.busbw_GBps("all_reduce", algbw, 8) == pytest.approx(64.0 * 14 / 8)  # 112
    assert timing.busbw_GBps("all_gather", algbw, 8) == pytest.approx(56.0)
    assert timing.busbw_GBps("reduce_scatter", algbw, 4) == pytest.approx(48.0)
    assert timing.busbw_GBps("all_to_all", algbw, 16) == pytest.approx(60.0)
    assert timing.busbw_GBps("broadcast", algbw, 8) == pytest.approx(64.0)
    assert timing.busbw_GBps("all_reduce", algbw, 2) == pytest.approx(64.0)
    assert timing.stream_bytes("copy", 1_000_000) == 16_000_000
    assert timing.stream_bytes("triad", 1_000_000) == 24_000_000
    assert timing.stream_bytes("copy", 1 << 28, itemsize=4) == 2 << 30  # GPU copy of 1 GiB: read + write
    assert timing.matmul_tflops(8192, 0.001) == pytest.approx(1099.5, rel=1e-4)


def test_a_failing_check_makes_exit_status_1(tmp_path, monkeypatch, capsys):
    """A node whose memory section breaks: the run goes on, the check fails first in the table, exit 1."""

    def broken_memory(cfg):
        raise OSError("simulated: a DIMM channel down")

    monkeypatch.setattr(benchmark, "memory_section", broken_memory)
    previous_handler = signal.getsignal(signal.SIGTERM)
    try:
        status = benchmark.main(["--only", "memory", "--report_dir", str(tmp_path)])
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
    assert status == 1
    table = capsys.readouterr().out.splitlines()
    assert table[1].startswith("fail") and "memory on node0" in table[1] and "a DIMM channel down" in table[1]
    assert table[-1].startswith("verdict: fail")
    assert read_report(tmp_path)["verdict"] == "fail"


def test_memory_that_cannot_hold_stream_arrays_of_4x_the_l3_skips_the_section_saying_why(
    tmp_path, monkeypatch, capsys
):
    """A VM of 1 GB on a host of a 480 MB L3 cache: arrays big enough to measure memory, not cache, do not
    fit. The size is the benchmark's own choice, so the memory section is skipped with why, and the rest
    runs; asked for alone, or at a size given, it is one line and exit 2."""
    from checks import inputs

    monkeypatch.setattr(inputs, "l3_cache_bytes", lambda: 480 << 20)
    monkeypatch.setattr(inputs, "available_memory_bytes", lambda: 1 << 30)
    previous_handler = signal.getsignal(signal.SIGTERM)
    try:
        status = benchmark.main(["--quick", "--only=cpu,memory", "--report_dir", str(tmp_path)])
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
    capsys.readouterr()
    report = read_report(tmp_path)
    why = (
        "3 arrays of 1920 MiB (at least 4x the 480 MiB L3 cache) need more than half of the 1.1 GB available"
    )
    assert status == 0 and report["memory"] == {"skipped": why} and "matmul_fp32_GFLOPS" in str(report["cpu"])
    assert {"status": "skip", "check": "memory", "value": why}.items() <= next(
        c for c in report["checks"] if c["check"] == "memory"
    ).items()
    for arguments, line in [
        (["--only=memory"], f"error: --only=memory: {why}"),
        (["--memory_MiB=2000"], "error: --memory_MiB 2000: 3 arrays need more than half of the 1.1 GB "
                                "available; not even 1920 fits: --skip=memory"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit) as exit_status:
            benchmark.parse_args([*arguments, "--skip=storage", "--report_dir", str(tmp_path / "refused")])
        assert exit_status.value.code == 2 and capsys.readouterr().err == line + "\n"


def test_datasheet_matches_the_most_specific_name():
    assert datasheet.datasheet("NVIDIA H100 80GB HBM3")["bf16"] == 989.4
    assert datasheet.datasheet("NVIDIA H100 80GB HBM3")["memory_GBps"] == 3350.0
    assert datasheet.datasheet("NVIDIA H100 PCIe") == {
        "fp32": 51.0,
        "tf32": 378.0,
        "bf16": 756.0,
        "fp8": 1513.0,
        "memory_GBps": 2000.0,
        "memory_GB": 80.0,
    }
    h200 = datasheet.datasheet("NVIDIA H200")
    assert h200["memory_GBps"] == 4800.0 and h200["bf16"] == 989.4
    assert datasheet.datasheet("NVIDIA GH200 480GB")["memory_GBps"] == 4000.0
    assert datasheet.datasheet("NVIDIA A100-SXM4-80GB") == {
        "fp32": 19.5,
        "tf32": 156.0,
        "bf16": 312.0,
        "fp8": None,
        "memory_GBps": 2039.0,
        "memory_GB": 80.0,
    }
    assert datasheet.datasheet("NVIDIA A100-SXM4-40GB")["memory_GBps"] == 1555.0
    assert datasheet.datasheet("NVIDIA B200")["bf16"] == 2250.0
    assert datasheet.datasheet("Tesla T4") is None


def test_importing_benchmark_starts_nothing():
    result = subprocess.run(  # a new interpreter, which has imported nothing before
        [
            sys.executable,
            "-c",
            "import sys, benchmark, torch.distributed as d; print(d.is_initialized(), 'yaml' in sys.modules)",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.stdout.split() == ["False", "True"] and result.stderr == ""


SLOW_PICTURE = """import os, sys, time
sys.path.insert(0, {repo!r})
sys.argv[0] = {script!r}
from checks import picture
import benchmark

drawn = picture.draw


def slow_draw(report, path):
    if os.environ["RANK"] == "0":  # the other rank, failed too, would exit meanwhile
        time.sleep(5)
    return drawn(report, path)


picture.draw = slow_draw
sys.exit(benchmark.main())
"""


def test_a_failing_node_is_recorded_before_any_rank_exits(tmp_path):
    """Under torchrun every rank learns a failing verdict, and torchrun ends rank 0 once another rank exits
    1. Rank 0's picture takes 5 s here: the failing node and the table must be out all the same."""
    wrapper = tmp_path / "slow_picture.py"
    wrapper.write_text(SLOW_PICTURE.format(repo=str(ROOT), script=str(ROOT / "benchmark.py")))
    suspects, outcome = tmp_path / "suspects", tmp_path / "outcome.json"
    result = launch(
        str(wrapper),
        [
            "--quick",
            "--only=cpu",
            f"--report_dir={tmp_path}",
            f"--suspects_folder={suspects}",
            f"--outcome={outcome}",
        ],
        cwd=tmp_path,
        env={"SLURMD_NODENAME": "n7", "REHEARSE_BAD_NODES": "n7"},
        timeout=180,
    )
    assert result.returncode != 0
    named = json.loads((suspects / "benchmark.json").read_text())["nodes"]
    assert list(named) == ["n7"] and "REHEARSE_BAD_NODES" in named["n7"], named
    assert "fail    cpu on node0 (n7)" in result.stdout and "verdict: fail in" in result.stdout, result.stdout
    assert read_report(tmp_path)["verdict"] == "fail"
    read = job.read_outcome(outcome)  # as the job reads it
    assert read["verdict"] == "fail" and read["failed_nodes"] == named
    assert read["report"] == f"{tmp_path}/benchmark_{read_report(tmp_path)['job']['id']}.yaml"
