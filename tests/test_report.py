"""The cluster report people look at: its picture beside the YAML, and each node against its own history, on
real CPU reports (and, for the GPU panels, a report of healthy H100 nodes as the verdict tests build it)."""

import json
import re

import yaml
from conftest import launch
from matplotlib.image import imread
from test_benchmark import cluster, statuses

from checks import history, picture, verdicts

QUICK = ["--quick", "--skip=storage"]  # the storage figures are the noisiest of a shared 2-core machine


def benchmark(report_dir, *args, nproc=0):
    result = launch("benchmark.py", [*QUICK, f"--report_dir={report_dir}", *args], nproc=nproc, timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    line = re.search(r"^verdict: (\w+) in .*; report: (\S+); picture: (\S+)$", result.stdout, re.M)
    assert line, result.stdout[-2000:]
    return result, line[1], line[2], line[3]


def test_a_two_process_cpu_report_has_its_picture_and_starts_the_history(tmp_path):
    result, verdict, report, drawn = benchmark(tmp_path, nproc=2)
    assert drawn == report.removesuffix(".yaml") + ".png"
    assert imread(drawn).shape == (960, 1280, 4)  # 16 x 12 inches at 80 dpi
    checks = {c["check"]: c for c in yaml.safe_load(open(report))["checks"]}
    assert checks["history"]["status"] == "skip" and checks["history"]["value"] == "no history yet"
    [line] = (tmp_path / history.HISTORY_FILE).read_text().splitlines()
    figures = {entry["figure"] for entry in json.loads(line)["figures"]}
    assert {"cpu all_core_ops/s", "memory copy_all_cores_GB/s"} <= figures


def test_the_picture_draws_every_panel_of_a_gpu_cluster(tmp_path):
    report = cluster(n_nodes=2, gpus=4)
    report["checks"] = list(statuses(report).values())
    report["verdict"], report["world"] = "pass", {"nodes": 2, "ranks_per_node": 4, "device": "cuda"}
    titles = picture.draw(report, str(tmp_path / "gpus.png"))
    assert titles[:2] == ["bf16 matmul, TFLOP/s", "HBM copy, GB/s"]
    # the H100's peaks from the datasheet, the floors at half of them
    matmul, copy = picture.gpu_bar_panels(report)
    assert (matmul["peaks"], matmul["floors"], copy["peaks"], copy["floors"]) == (
        [989.4],
        [494.7],
        [3350.0],
        [1675.0],
    )
    assert titles[2:7] == [f"{op} busbw, GB/s" for op in picture.COLLECTIVES]
    assert imread(tmp_path / "gpus.png").shape == (960, 1280, 4)


def seed_history(tmp_path, report_path, faster, runs=3, damaged=False):
    """A history of earlier runs of the same node: its figures of the report, times `faster`."""
    report = yaml.safe_load(open(report_path))
    entries = history.entries(report)
    lines = ["not a record {\n"] if damaged else []
    for run in range(runs):
        earlier = [{**entry, "value": entry["value"] * faster} for entry in entries]
        record = {"time": run, "job": f"earlier{run}", "mode": "quick", "figures": earlier}
        lines.append(json.dumps(record) + "\n")
    (tmp_path / history.HISTORY_FILE).write_text("".join(lines))
    return {entry["node"] for entry in entries}


def test_a_node_slower_than_its_own_history_is_warned_and_the_job_goes_on(tmp_path):
    _, _, first, _ = benchmark(tmp_path)
    [node] = seed_history(tmp_path, first, faster=1.5)
    result, verdict, report, _ = benchmark(tmp_path)
    assert verdict == "warn"
    warns = [c for c in yaml.safe_load(open(report))["checks"] if c["check"].startswith("history ")]
    assert warns and all(c["status"] == "warn" and c["check"].startswith(f"history {node} ") for c in warns)
    # a third slower, unless this run was faster than the first by chance (a 2-core machine is shared)
    assert all(re.fullmatch(r"[\d.]+, usually [\d.]+ \(-[1-9]\d%\)", c["value"]) for c in warns), warns
    assert f"warn    {warns[0]['check']}" in result.stdout
    assert len((tmp_path / history.HISTORY_FILE).read_text().splitlines()) == 4  # 3 seeded and this one


def test_history_warns_about_the_slower_node_alone():
    report = cluster(n_nodes=2, gpus=2)
    report["job"] = {"mode": "default"}
    earlier = [
        {**entry, "value": entry["value"] * (1.2 if entry["node"] == "h1" else 1.0)}
        for entry in history.entries(report)
    ]
    checks = history.history_checks(report, [{"mode": "default", "figures": earlier}] * 2)
    assert {c["check"] for c in checks} == {
        "history h1 gpu0 gpu matmul_bf16_TFLOPS",
        "history h1 gpu1 gpu matmul_bf16_TFLOPS",
        "history h1 gpu0 gpu copy_GB/s",
        "history h1 gpu1 gpu copy_GB/s",
        "history h1 cpu single_core_ops/s",
        "history h1 cpu matmul_fp32_GFLOPS",
        "history h1 memory triad_all_cores_GB/s",
    }  # fmt: skip  (h1's storage lost 17%, under the storage threshold)
    assert history.history_checks(report, [{"mode": "quick", "figures": earlier}])[0]["status"] == "skip"


def test_a_damaged_history_line_is_skipped_with_a_warning(tmp_path):
    _, _, first, _ = benchmark(tmp_path)
    seed_history(tmp_path, first, faster=1.0, runs=1, damaged=True)
    result, verdict, _, _ = benchmark(tmp_path)
    assert f"warning: {tmp_path / history.HISTORY_FILE} line 1 is damaged" in result.stderr
    assert verdict in ("pass", "warn")  # warn: a figure of this busy machine fell below the one earlier run
    table = launch("benchmark.py", ["--history", f"--report_dir={tmp_path}"], nproc=0)
    assert table.returncode == 0
    assert re.search(r"^\S+ +cpu all_core_ops/s +[\d.]+ [\d.]+ +[+-]\d+%$", table.stdout, re.M), table.stdout


def test_a_node_failing_only_the_storage_floor_is_flagged_in_the_picture_and_blamed():
    """node2's write is 7% below its peers' (no straggler) and under --min_storage_GBps: the storage floor
    alone fails it, and the picture and the job both read that from the check's fields."""
    report = cluster(n_nodes=3, gpus=2)
    report["storage"]["node2 (h2)"]["parallel_write_GB/s"] = 2.8
    report["checks"] = verdicts.verdict_checks(report, min_storage_GBps=2.9)
    (failing,) = [c for c in report["checks"] if c["status"] == "fail"]
    assert failing["check"] == "storage parallel_write_GB/s" and failing["flagged"] == {
        "node2 (h2)": "2.8 GB/s"
    }
    assert (failing["measured"], failing["floor"], failing["unit"], failing["nodes"]) == (
        2.8,
        2.9,
        "GB/s",
        ["h2"],
    )
    assert list(verdicts.failed_nodes(report["checks"])) == ["h2"]
    write = picture.node_bar_panels(report)[0]
    assert write["title"] == "storage write, GB/s" and write["flagged"] == {"node2 (h2)"}
    assert write["floors"] == [2.9]


def test_a_real_node_under_the_storage_floor_is_flagged_in_the_picture_and_named_for_the_job(tmp_path):
    """One real node whose write cannot reach --min_storage_GBps=1e6: with no peer it is no straggler, and
    the floor alone names it."""
    result = launch(
        "benchmark.py",
        ["--quick", "--only=storage", f"--storage_path={tmp_path}", "--min_storage_GBps=1e6",
         f"--report_dir={tmp_path}", f"--suspects_folder={tmp_path / 'suspects'}"],
        nproc=0,
        env={"SLURMD_NODENAME": "n5"},
    )  # fmt: skip
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
    (path,) = [path for path in tmp_path.glob("benchmark_*.yaml") if "_rank" not in path.name]
    report = yaml.safe_load(path.read_text())
    assert [c["check"] for c in report["checks"] if c["status"] == "fail"] == ["storage parallel_write_GB/s"]
    suspects = json.loads((tmp_path / "suspects" / "benchmark.json").read_text())["nodes"]
    assert list(suspects) == ["n5"] and suspects["n5"].startswith("benchmark: storage parallel_write_GB/s: ")
    write = picture.node_bar_panels(report)[0]
    assert write["flagged"] == {"node0 (n5)"} and write["floors"] == [1e6]
