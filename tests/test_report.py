"""The cluster report people look at: its picture beside the YAML, and each node against its own history, on
real CPU reports (and, for the GPU panels, a report of healthy H100 nodes as the verdict tests build it)."""

import contextlib
import json
import re
import signal
from pathlib import Path

import pytest
import yaml
from conftest import launch
from hand_reports import H100, cluster, statuses
from matplotlib.image import imread

import benchmark as benchmark_script
from checks import history, picture, verdicts

QUICK = ["--quick", "--skip=storage"]  # the storage figures are the noisiest of a shared 2-core machine
# The history tests' runs: the CPU's figures suffice, and STREAM's arrays, at four times the L3 cache (1.9 GB
# each under a 480 MB L3), cost a run more than the rest of it
CPU_ALONE = ["--only=cpu"]


def benchmark(report_dir, *args, nproc=0):
    result = launch("benchmark.py", [*QUICK, f"--report_dir={report_dir}", *args], nproc=nproc, timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    line = re.search(r"^verdict: (\w+) in .*; report: (\S+); picture: (\S+)$", result.stdout, re.M)
    assert line, result.stdout[-2000:]
    return result, line[1], line[2], line[3]


@pytest.fixture(scope="module")
def two_process_report(tmp_path_factory):
    """A 2-process run's (report, picture) as it printed them; the report's figures seed the history tests'
    earlier runs of this node."""
    return benchmark(tmp_path_factory.mktemp("two_processes"), nproc=2)[2:]


def test_a_two_process_cpu_report_has_its_picture_and_starts_the_history(two_process_report):
    report, drawn = two_process_report
    assert drawn == report.removesuffix(".yaml") + ".png"
    assert imread(drawn).shape == (960, 1280, 4)  # 16 x 12 inches at 80 dpi
    checks = {c["check"]: c for c in yaml.safe_load(open(report))["checks"]}
    assert checks["history"]["status"] == "skip" and checks["history"]["value"] == "no history yet"
    [line] = (Path(report).parent / history.HISTORY_FILE).read_text().splitlines()
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


def test_a_node_slower_than_its_own_history_is_warned_and_the_job_goes_on(two_process_report, tmp_path):
    # a history 4 times faster: far beyond what two runs on a busy machine differ by (at 1.5 times, a second
    # run on a loaded machine once measured fast enough to pass)
    [node] = seed_history(tmp_path, two_process_report[0], faster=4)
    result, verdict, report, _ = benchmark(tmp_path, *CPU_ALONE)
    assert verdict == "warn"
    warns = [c for c in yaml.safe_load(open(report))["checks"] if c["check"].startswith("history ")]
    assert warns and all(c["status"] == "warn" and c["check"].startswith(f"history {node} ") for c in warns)
    # slower by more than the 10% allowed: by how much, depends on what else ran beside each run (the
    # all-core figures of two runs in the suite have lain 2.4 times apart)
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


def test_a_damaged_history_line_is_skipped_with_a_warning(two_process_report, tmp_path):
    seed_history(tmp_path, two_process_report[0], faster=1.0, runs=1, damaged=True)
    result, verdict, _, _ = benchmark(tmp_path, *CPU_ALONE)
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
    assert write["log"]  # its bar, a millionth of the floor, would vanish on a linear scale


def test_history_never_passes_a_nan_and_reads_past_damaged_lines(tmp_path, capsys):
    """Lines from elsewhere: nested 200,000 deep (json's recursion), a figure name that is a list, a node
    name with a terminal escape and a line break, a median of 0, a NaN. None stops the benchmark; nothing
    prints raw; a NaN never passes and never enters the history."""
    report = cluster(n_nodes=1, gpus=2)
    report["job"] = {"mode": "default"}
    good = history.entries(report)
    odd = [
        {"node": "h0", "gpu": None, "figure": ["cpu", "x"], "value": 1.0},
        {"node": "evil\x1b[2J\nnode", "gpu": None, "figure": "cpu single_core_ops/s", "value": 5.0},
        {"node": "h9", "gpu": None, "figure": "cpu single_core_ops/s", "value": 0.0},
        {"node": "h0", "gpu": None, "figure": "cpu single_core_ops/s", "value": float("nan")},
    ]
    path = tmp_path / history.HISTORY_FILE
    lines = ["[" * 200_000 + "]" * 200_000, *(json.dumps({"mode": "default", "figures": good + odd})
             for _ in range(3))]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    earlier = history.read_history(path)
    assert "line 1 is damaged (nested too deep); skipped" in capsys.readouterr().err
    assert [len(record["figures"]) for record in earlier] == [len(good) + 2] * 3  # the list and the NaN out
    table = history.trend_table(earlier)
    assert "\x1b" not in table and "evil\\x1b[2J\\nnode" in table
    assert [line.split()[-1] for line in table.splitlines() if line.startswith("h9")] == ["-"]  # median 0
    report["gpu"]["node0 (h0)/gpu1"]["copy_GB/s"] = float("nan")
    checks = history.history_checks(report, earlier)
    nan = [c for c in checks if c["check"] == "history h0 gpu1 gpu copy_GB/s"]
    assert nan and nan[0]["status"] == "warn" and "not a number" in nan[0]["value"], checks
    history.append(path, report, earlier)
    latest = json.loads(path.read_text().splitlines()[-1])["figures"]
    assert len(latest) == len(good) - 1  # the NaN is no part of the node's history


def test_the_history_keeps_only_what_is_read(tmp_path):
    """200 runs of one node: the file keeps each figure's last HISTORY_RUNS + 1 values per mode, no more."""
    report = cluster(n_nodes=1, gpus=2)
    path, earlier = tmp_path / history.HISTORY_FILE, []
    for run in range(200):
        report["job"] = {"id": str(run), "mode": ("quick", "default")[run % 2]}
        history.append(path, report, earlier)
        earlier = history.read_history(path)
    figures = len(history.entries(report))
    assert len(earlier) == 2 * (history.HISTORY_RUNS + 1)
    assert [record["job"] for record in earlier] == [str(run) for run in range(188, 200)]
    assert sum(len(record["figures"]) for record in earlier) == 2 * (history.HISTORY_RUNS + 1) * figures


def test_a_history_that_is_a_folder_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / history.HISTORY_FILE).mkdir()
    with pytest.raises(SystemExit) as exit_status:
        benchmark_script.parse_args(["--quick", "--only=cpu", f"--report_dir={tmp_path}"])
    assert exit_status.value.code == 2
    assert capsys.readouterr().err == (
        f"error: --report_dir: the history beside the reports, {tmp_path / history.HISTORY_FILE}, is not a "
        "file; move it away\n"
    )


def test_the_picture_says_what_it_cannot_draw_and_keeps_many_nodes_readable(tmp_path):
    """A NaN and an infinite figure are named in their panels, not drawn as empty ones; 60 nodes draw the
    flagged ones and the lowest, saying how many are hidden; a bar far under its floor gets a log scale."""
    report = cluster(n_nodes=60, gpus=2)
    report["storage"]["node7 (h7)"]["parallel_write_GB/s"] = float("nan")
    report["storage"]["node9 (h9)"]["parallel_write_GB/s"] = 0.01
    report["gpu"]["node3 (h3)/gpu1"]["copy_GB/s"] = float("inf")
    for row in report["nccl"]["intra_node"]["node5 (h5)"]["all_gather"]:
        row["busbw_GB/s"] = float("nan")
    report["checks"] = verdicts.verdict_checks(report, min_storage_GBps=1.0)
    report["verdict"], report["world"] = "fail", {"nodes": 60, "ranks_per_node": 2, "device": "cuda"}
    matmul, copy = picture.gpu_bar_panels(report)
    assert len(matmul["values"]) == picture.MAX_BARS and matmul["note"].startswith("96 of 120 hidden")
    assert copy["note"].startswith("not a number: node3 (h3)/gpu1; ")
    write = picture.node_bar_panels(report)[0]
    assert write["note"].startswith("not a number: node7 (h7); 35 of 59 hidden")
    assert "node9 (h9)" in write["values"] and write["flagged"] == {"node9 (h9)"} and write["log"]
    gathered = picture.collective_lines(report)["all_gather"]
    assert gathered["note"].startswith("not a number: node5 (h5) intra-node; nodes' own lines: ")
    assert len(gathered["lines"]) == picture.MAX_LINES
    titles = picture.draw(report, str(tmp_path / "many.png"))
    assert titles[0] == "bf16 matmul, TFLOP/s" and imread(tmp_path / "many.png").shape == (960, 1280, 4)


def test_a_report_whose_checks_lack_their_fields_is_drawn_with_one_warning(tmp_path, capsys):
    """An older or hand-edited report: its checks as people read them (status, check, value, reference),
    without their floors and flagged members, and one not a check at all. The picture raised KeyError:
    'floor'; it draws the figures and the datasheet, and the floor of the one check that has its fields."""
    report = cluster(n_nodes=2, gpus=2)
    report["gpu"]["node1 (h1)/gpu0"]["matmul_bf16_TFLOPS"] = 300.0  # a straggler, under half the datasheet
    kept = "gpu matmul_bf16_TFLOPS vs datasheet"
    report["checks"] = [
        c if c["check"] == kept else {key: c[key] for key in ("status", "check", "value", "reference")}
        for c in verdicts.verdict_checks(report)
    ] + ["fail: written by hand"]
    report["verdict"], report["world"] = "fail", {"nodes": 2, "ranks_per_node": 2, "device": "cuda"}
    drawn = tmp_path / "older.png"
    titles = picture.draw(report, str(drawn))
    assert titles[:2] == ["bf16 matmul, TFLOP/s", "HBM copy, GB/s"] and imread(drawn).shape == (960, 1280, 4)
    unread = len(report["checks"]) - 1
    assert capsys.readouterr().err == (
        f"warning: {drawn}: {unread} of the report's checks lack the fields the picture reads (a floor, the "
        "members flagged: an older or hand-edited report); drawn without their floors and flagged members\n"
    )
    matmul, copy = picture.gpu_bar_panels(report)
    assert len(matmul["values"]) == 4 and matmul["peaks"] == [989.4] and matmul["floors"] == [494.7]
    assert matmul["flagged"] == {"node1 (h1)/gpu0"}  # by the check that has its fields
    assert copy["peaks"] == [3350.0] and copy["floors"] == [] and copy["flagged"] == set()


@contextlib.contextmanager
def at_most(seconds):
    """A limit on a test's wall time, past which it fails instead of running on."""

    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_report_of_many_nodes_is_judged_named_and_summarised_in_time_linear_in_its_nodes():
    """Each check's nodes were found by trying every node's label against every GPU: GPUs x nodes steps,
    minutes for 100,000 nodes. Here 30,000 nodes of one GPU, judged and their history checked: 1.8e9 steps the
    old way, which cannot end within the limit on any machine; looked up, seconds on a busy one. The slow GPU
    is still named, and its node."""
    nodes = 30_000
    labels = [f"node{n} (h{n})" for n in range(nodes)]
    report = {
        "job": {"mode": "default"},
        "gpu": {f"{label}/gpu0": dict(H100) for label in labels},
        "nccl": {"skipped": "not selected"},
        "links": {"skipped": "not selected"},
        "storage": {label: {"parallel_write_GB/s": 3.0} for label in labels},
        "cpu": {label: {"all_core_ops/s": 68.0} for label in labels},
        "memory": {label: {"copy_all_cores_GB/s": 18.0} for label in labels},
        "nodes": {label: {"node_name": f"h{n}", "hostname": f"h{n}"} for n, label in enumerate(labels)},
    }
    report["gpu"]["node27182 (h27182)/gpu0"]["matmul_bf16_TFLOPS"] = 300.0
    with at_most(60):
        report["checks"] = verdicts.verdict_checks(report)
        report["verdict"] = verdicts.verdict(report["checks"])
        history.judge_against_history(report, [])
        failed = verdicts.failed_nodes(report["checks"])
        panels = picture.gpu_bar_panels(report) + picture.node_bar_panels(report)
    assert report["verdict"] == "fail" and list(failed) == ["h27182"], failed
    assert panels[0]["flagged"] == {"node27182 (h27182)/gpu0"}
    hidden = f"{nodes - picture.MAX_BARS} of {nodes} hidden (the flagged and the lowest drawn)"
    assert panels[0]["note"] == hidden
