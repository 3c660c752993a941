"""The step's prediction (run/predict.py) follows its inputs: the step recorded on fake tensors at world size
2, played on machines whose figures the tests change; the planner never picks what does not fit; the dry run
says the prediction and the plan. (test_diagnose.py holds a training run's live step against it.)"""

import copy
import dataclasses
import os
import re
import shlex
import socket
import sys
import time
import types

import pytest
import torch
import yaml
from conftest import ODD, SIMULATES, make_odd, parse_options, validated

import benchmark
import train as train_script
from common.errors import ConfigError
from common.op_timing import CPU_ATTENTION, replay, resolve
from run import live_prediction, plan, report_figures, simulation
from run.machines import Report
from run.model import presets
from run.predict import DDP_ALL_REDUCE, FAKE_ONLY, Prediction, fresh_bytes, play
from run.report_figures import BadReport, read_report

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


@pytest.fixture(scope="module")
def step():
    """The events of one training step of the tiny model at world size 2, as the dry run records them."""
    cfg = parse_options(["--dry_run", *TINY_STEP, "--world_size=2"])
    config = presets.build_model_config(validated(cfg))
    _, events = simulation.simulate(cfg, config, 2, 0, train_script.training_path())
    return events


@SIMULATES
def test_the_benchmark_records_a_hybrid_step_over_two_nodes_of_two_in_its_shard_and_replica_groups(
    monkeypatch,
):
    """benchmark.py --train_args on rank 0 of two nodes of two processes, as torchrun starts it: a hybrid
    run's step is sharded inside each node (a node's ranks by default) and replicated between the nodes."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    batch_of_four = [arg for arg in TINY_STEP if not arg.startswith("--global_batch_size")]
    train_args = shlex.join(
        [*batch_of_four, "--global_batch_size=16", "--sharding=hybrid", "--predict=False"]
    )
    recorded = benchmark.traced_model_step(train_args)
    assert recorded is not None, "the step was not recorded"
    _, operations, collectives = recorded
    groups = {(kind, group, nodes) for kind, _, group, nodes in collectives}
    assert {("all-gather", 2, 1), ("reduce-scatter", 2, 1), ("all-reduce", 2, 2)} <= groups
    assert operations


def exposed(prediction):
    return sum(seconds for name, seconds in prediction.parts.items() if name.startswith("exposed "))


def compute(prediction):
    return sum(prediction.parts[name] for name in ("forward", "backward", "recomputation"))


@SIMULATES
def test_the_step_records_fsdp_collectives_and_the_parts_add_up(step):
    kinds = {event.collective[0] for event in step if event.collective}
    assert {"all-gather", "reduce-scatter", "all-reduce"} <= kinds
    prediction = play(step, Report("r.yaml", gpu_report()))
    assert sum(prediction.parts.values()) == pytest.approx(prediction.step_s)
    assert compute(prediction) > 0 and prediction.parts["optimizer"] > 0


@SIMULATES
def test_halving_the_busbw_raises_the_exposed_communication(step):
    # the tiny model's collectives are small: a slow link is what exposes them
    fast, slow = (play(step, Report("r.yaml", gpu_report(busbw_GBps=busbw))) for busbw in (0.2, 0.1))
    assert exposed(slow) > exposed(fast) > 0 and slow.step_s > fast.step_s


@SIMULATES
def test_a_faster_matmul_figure_lowers_the_compute(step):
    # rates slow enough that the tiny model's compute outlasts the host's issuing of it
    slow, fast = (play(step, Report("r.yaml", gpu_report(matmul_TFLOPS=rate))) for rate in (0.002, 0.004))
    assert compute(fast) < compute(slow) and fast.step_s < slow.step_s


@SIMULATES
def test_a_candidate_that_does_not_fit_is_never_picked():
    cfg = parse_options(["--dry_run", *TINY_STEP, "--world_size=2", "--activation_checkpointing=auto"])
    config = presets.build_model_config(validated(cfg))
    training, machine = train_script.training_path(), Report("r.yaml", gpu_report())
    everything = plan.plan(cfg, config, 2, 0, training, machine, 1e9, simulation.simulate)
    peaks = sorted(peak for _, peak, _ in everything)
    # room for the two smallest peaks only: the candidates of the larger ones do not fit
    squeezed = plan.plan(cfg, config, 2, 0, training, machine, peaks[1], simulation.simulate)
    fitting = [row for row in squeezed if row[2] is not None]
    assert fitting and all(peak <= peaks[1] for _, peak, _ in fitting)
    assert plan.fastest(squeezed) == fitting[0][0] and len(fitting) < len(squeezed)
    with pytest.raises(ConfigError, match="no candidate"):
        plan.fastest(plan.plan(cfg, config, 2, 0, training, machine, peaks[0] / 2, simulation.simulate))


def cpu_report(framework_s=20e-6, busbw_GBps=1.0, first_touch_s=1e-10):
    """A report of one host of 2 cores running 2 ranks, as benchmark.py --train_args writes one on a CPU."""
    return {"world": {"device": "cpu", "ranks": 2, "nodes": 1, "ranks_per_node": 2},
            "nodes": {"node0 (h)": {"hostname": "h"}},
            "cpu": {"node0 (h)": {"cores": 2, "matmul_fp32_GFLOPS": 50.0}},
            "memory": {"node0 (h)": {"copy_all_cores_GB/s": 10.0}},
            "nccl": {"all_reduce": sweep(busbw_GBps)},
            "model": {"eager_overheads_s": [framework_s, 2e-6, first_touch_s]}}  # fmt: skip


@SIMULATES
def test_on_a_cpu_each_operation_an_eager_step_dispatches_is_charged_the_models_host_time(step):
    """A CPU runs what it issues: each recorded operation costs its kernel and the host's time per operation
    (the report's, times the model's own scale); fake tensors' device queries, which an eager step never
    dispatches, cost nothing."""
    machine = Report("r.yaml", cpu_report())
    scaled = [dataclasses.replace(event, host_scale=event.host_scale + 1.0) for event in step]
    dispatched = [event for event in step if event.name not in FAKE_ONLY]
    assert 0 < len(dispatched) < len(step)  # the trace holds device queries
    added = play(scaled, machine).step_s - play(step, machine).step_s
    assert added == pytest.approx(len(dispatched) * 20e-6)


@SIMULATES
def test_on_a_cpu_the_memory_a_step_takes_anew_costs_its_first_touch(step):
    """A CPU step gives back its activations and takes them again next step: each byte above the step's
    high-water mark costs the report's first touch; on a GPU, whose allocator keeps its memory, nothing."""
    fresh = sum(fresh_bytes(step))
    assert 0 < fresh < sum(size for event in step for _, size in event.allocates)  # memory is reused
    slow, fast = (play(step, Report("r.yaml", cpu_report(first_touch_s=rate))) for rate in (2e-10, 1e-10))
    assert slow.step_s - fast.step_s == pytest.approx(fresh * 1e-10)
    assert Report("r.yaml", gpu_report()).first_touch_seconds(fresh) == 0.0


@SIMULATES
def test_a_ddp_step_all_reduces_every_gradient_at_its_own_accumulation(step):
    """DDP's C++ reducer all-reduces the gradients where no dispatch mode sees it: the prediction adds it, in
    DDP's buckets, over the whole world; the step is traced with the run's micro-steps (one here: global
    batch 8 over 2 ranks of 4), not those a world of one would take."""
    cfg = parse_options(["--dry_run", *TINY_STEP, "--world_size=2", "--sharding=ddp"])
    config = presets.build_model_config(validated(cfg))
    n_params = sum(p.numel() for p in presets.build_meta_model(config).parameters())
    _, events = simulation.simulate(cfg, config, 2, n_params, train_script.training_path())
    reduced = [event.collective for event in events if event.name == DDP_ALL_REDUCE]
    assert sum(size for _, size, _, _ in reduced) == 4 * n_params and {c[2] for c in reduced} == {2}
    embeddings = [sum(event.name == "aten.embedding.default" for event in e) for e in (events, step)]
    assert embeddings[0] == embeddings[1] > 0  # as many forwards as full sharding's one micro-step
    fast, slow = (play(events, Report("r.yaml", cpu_report(busbw_GBps=rate))) for rate in (1.0, 0.5))
    assert slow.parts["exposed all-reduce"] > fast.parts["exposed all-reduce"] > 0


@pytest.mark.parametrize("model", ["tiny", "tiny-llama", "tiny-mixtral"])
def test_the_miniature_of_each_family_steps_and_gives_the_models_host_time(model):
    """The model's own host time per operation comes from stepping a miniature of it, built and wrapped as
    training does: the same depth and heads, narrow widths, in every family."""
    cfg = parse_options(["--dry_run", "--gpu=cpu", *TINY_STEP, f"--model={model}", "--world_size=1"])
    config = presets.build_model_config(validated(cfg))
    mini = simulation.miniature(config)
    assert mini.num_hidden_layers == config.num_hidden_layers
    assert mini.num_attention_heads == config.num_attention_heads and mini.hidden_size < config.hidden_size
    scale = simulation.host_scale(cfg, config, train_script.training_path(), 1)
    assert 0.1 < scale < 100


def run_main(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        sys.exit(train_script.main(list(args)))
    return exit_info.value.code, capsys.readouterr().out


@SIMULATES
def test_the_dry_run_predicts_the_step_on_this_cpu_and_the_plan_lists_candidates_fastest_first(capsys):
    code, out = run_main(capsys, "--dry_run", "--gpu=cpu", "--world_size=1", *TINY_STEP, "--max_steps=10")
    assert code == 0, out
    predicted = re.search(
        r"^predicted step: ([\d.e-]+) s = compute .* \(on this machine's CPU, timed now", out, re.M
    )
    assert predicted and float(predicted[1]) > 0, out
    assert re.search(r"^predicted: [\d,]+ tokens/s per device; 10 steps in \d+:\d\d:\d\d$", out, re.M), out
    code, out = run_main(
        capsys, "--plan", "--gpu=cpu", "--world_size=1", *TINY_STEP, "--activation_checkpointing=auto"
    )
    rows = re.findall(r"^  (\S+) +(none|op|selective|full) +(\d+) +([\d.e-]+) ", out, re.M)
    assert code == 0 and len(rows) == 4, out  # every checkpointing mode fits
    steps = [float(row[3]) for row in rows]
    assert steps == sorted(steps)


def test_auto_options_are_refused_where_they_make_no_sense():
    with pytest.raises(ConfigError, match="--batch_size expects an integer or 'auto', got 'fast'"):
        parse_options(["--model=tiny", "--batch_size=fast"])
    with pytest.raises(ConfigError, match="--shard_group_size=3 needs --sharding=hybrid"):
        validated(copy.copy(parse_options(["--model=tiny", "--dry_run", "--shard_group_size=3"])))


@SIMULATES
def test_cpu_flash_attention_replays_as_the_gpu_runs_it_with_the_same_results(step):
    """A step traced on a CPU records CPU flash attention, which a GPU cannot run: there it is replayed as
    the GPU's own attention, forward or backward alone, again and again. Here the replay's results are held
    against the CPU kernels' own on random tensors of the step's shapes."""
    as_on_gpu = types.SimpleNamespace(type="cuda")  # replay() reads the device's type; the tensors stay here
    forward = next(event for event in step if CPU_ATTENTION.get(event.name) == "forward")
    backward = next(event for event in step if CPU_ATTENTION.get(event.name) == "backward")
    query, key, value = (torch.randn(meta.shape, dtype=meta.dtype) for meta in forward.args[:3])
    # Causal attention as the trace has it: a mask added to the scores, or is_causal
    mask, causal = forward.kwargs.get("attn_mask"), len(forward.args) > 4 and forward.args[4]
    assert (mask is None) == causal
    kwargs = {"scale": forward.kwargs.get("scale")}
    if mask is not None:
        lower = torch.ones(mask.shape[-2:], dtype=torch.bool).tril()
        kwargs["attn_mask"] = torch.zeros(mask.shape, dtype=mask.dtype).masked_fill(~lower, float("-inf"))
    out, logsumexp = resolve(forward.name)(query, key, value, 0.0, causal, **kwargs)
    attend = replay(forward.name, (query, key, value, 0.0, causal), kwargs, as_on_gpu)
    for _ in range(2):
        torch.testing.assert_close(attend(), out)
    grad_out = torch.randn_like(out)
    inputs = (grad_out, query, key, value, out, logsumexp, 0.0, causal)
    expected = resolve(backward.name)(*inputs, **kwargs)
    gradients = replay(backward.name, inputs, kwargs, as_on_gpu)
    for _ in range(2):
        for got, want in zip(gradients(), expected, strict=True):
            torch.testing.assert_close(got, want)


def test_a_kept_prediction_holds_only_for_its_machine_and_a_damaged_or_unwritable_one_is_a_warning(
    tmp_path, capsys
):
    prediction = Prediction(0.5, {"forward": 0.2, "backward": 0.3}, 0.1, {"timed": 3}, ["a note"])
    here = live_prediction.machine_here(world_size=2, processes_per_node=2)
    live_prediction.keep(tmp_path, prediction, here)
    assert live_prediction.kept(tmp_path, here)[0] == prediction
    assert live_prediction.kept(tmp_path, {**here, "world_size": 4}) is None  # relaunched elsewhere
    assert live_prediction.kept(tmp_path, {**here, "benchmark_report": "logs/other.yaml"}) is None
    (tmp_path / live_prediction.KEPT).write_text('{"machine": ')
    assert live_prediction.kept(tmp_path, here) is None
    assert "is not a prediction" in capsys.readouterr().err
    live_prediction.keep(tmp_path / "no such folder", prediction, here)  # a warning; the run goes on
    assert "warning: cannot keep the prediction in" in capsys.readouterr().err


def written(folder, name, report):
    """report written as benchmark.py writes one, at folder/name."""
    path = folder / name
    path.write_text(yaml.safe_dump(report, sort_keys=False))
    return path


def damaged(report, change):
    report = copy.deepcopy(report)
    change(report)
    return report


FIGURES_OUT_OF_RANGE = {
    "a NaN matmul rate": (
        lambda r: r["gpu"]["node0 (n1)/gpu3"].update(matmul_bf16_TFLOPS=float("nan")),
        "gpu.node0 (n1)/gpu3.matmul_bf16_TFLOPS is nan, not between 1e-06 and 1e+06",
    ),
    "a write rate of 1e-320": (
        lambda r: r.update(storage={"aggregate": {"parallel_write_GB/s": 1e-320}}),
        "storage.aggregate.parallel_write_GB/s is 1e-320, not between 1e-06 and 1e+06",
    ),
    "a negative busbw": (
        lambda r: r["nccl"]["all_reduce"][2].update({"busbw_GB/s": -3.0}),
        "nccl.all_reduce row 2: busbw_GB/s is -3.0, not between",
    ),
    "sizes out of order": (
        lambda r: r["nccl"]["all_gather"].reverse(),
        "nccl.all_gather has sizes out of order, or one twice",
    ),
    "an infinite operation": (
        lambda r: r.update(model={"operations": {"aten.mm x": {"seconds": float("inf")}}}),
        "model.operations.aten.mm x.seconds is inf, not between 1e-12 and 3600",
    ),
    "ranks per node in text": (
        lambda r: r["world"].update(ranks_per_node="8"),
        'world.ranks_per_node is "8", not a whole number',
    ),
    "a section of the wrong kind": (
        lambda r: r.update(nccl=[1, 2]),
        "its nccl section is list, not a mapping",
    ),
    "collectives as pairs": (
        lambda r: r.update(model={"collectives": [["all-reduce", 8]]}),
        "model.collectives row 0 is not a timed collective",
    ),
}


@pytest.mark.parametrize("case", FIGURES_OUT_OF_RANGE)
def test_report_figures_out_of_range_are_refused_where_the_report_is_read(tmp_path, case):
    """Each figure a prediction or the checkpoint schedule uses is checked as the report is read: NaN figures
    gave a finite predicted step and an auto pick called the fastest that fits, a write rate of 1e-320 an
    OverflowError mid-training."""
    change, why = FIGURES_OUT_OF_RANGE[case]
    assert read_report(written(tmp_path, "good.yaml", gpu_report())) == gpu_report()
    assert read_report(written(tmp_path, "cpu.yaml", cpu_report()))["world"]["device"] == "cpu"
    path = written(tmp_path, "bad.yaml", damaged(gpu_report(), change))
    with pytest.raises(
        BadReport, match=f"^{re.escape(f'{path} is not a benchmark report a run can use: {why}')}"
    ):
        read_report(path)


@SIMULATES
@pytest.mark.parametrize("kind", ["FIFO", "link to /dev/zero", "NaN figures", "A100s for --gpu=H100", "CPUs"])
def test_a_benchmark_report_the_user_names_that_cannot_be_used_is_one_line_and_exit_2(
    tmp_path, capsys, kind, deadline
):
    """Refused before the model is built: a FIFO hung the dry run, a link to /dev/zero read until memory ran
    out, NaN figures gave a finite step, and an A100 report predicted --gpu=H100 without a word."""
    path = tmp_path / "benchmark_1.yaml"
    if kind in ODD:
        words = f"--benchmark_report: {path} {make_odd(path, kind)}; give a report benchmark.py wrote"
    elif kind == "NaN figures":
        written(tmp_path, path.name, damaged(gpu_report(), lambda r: r["nccl"]["all_reduce"][0].update(
            {"busbw_GB/s": float("nan")})))  # fmt: skip
        words = f"--benchmark_report: {path} is not a benchmark report a run can use: nccl.all_reduce row 0"
    elif kind == "A100s for --gpu=H100":
        a100 = damaged(
            gpu_report(), lambda r: [gpu.update(name="NVIDIA A100-SXM4-80GB") for gpu in r["gpu"].values()]
        )
        written(tmp_path, path.name, a100)
        words = (f"--benchmark_report={path}: it was measured on NVIDIA A100-SXM4-80GB, not on H100 GPUs; "
                 "give the --gpu it was measured on, or a report of --gpu=H100")  # fmt: skip
    else:
        written(tmp_path, path.name, cpu_report())
        words = f"--benchmark_report={path}: it was measured on CPUs, not on H100 GPUs"
    with pytest.raises(SystemExit) as exit_info:
        sys.exit(train_script.main(["--dry_run", "--world_size=2", *TINY_STEP, f"--benchmark_report={path}"]))
    code, (out, err) = exit_info.value.code, capsys.readouterr()
    assert code == 2 and out == "" and err.startswith(f"error: {words}") and err.count("\n") == 1, err


def test_a_cpu_report_of_another_host_or_a_broken_one_under_log_dir_is_passed_over(
    tmp_path, capsys, deadline
):
    """Nobody named them: another host's CPU report was taken for this machine's CPU (142x off), and a torn
    one broke every --gpu=cpu dry run; a FIFO hung it."""
    elsewhere = damaged(cpu_report(), lambda r: r["nodes"]["node0 (h)"].update(hostname="elsewhere"))
    here = damaged(cpu_report(), lambda r: r["nodes"]["node0 (h)"].update(hostname=socket.gethostname()))
    written(tmp_path, "benchmark_1.yaml", here)
    newest = [written(tmp_path, "benchmark_2.yaml", elsewhere), tmp_path / "benchmark_3.yaml"]
    (tmp_path / "benchmark_3.yaml").write_text("world: {device: cpu\n")  # torn
    make_odd(tmp_path / "benchmark_4.yaml", "FIFO")
    for age, path in enumerate(reversed([tmp_path / "benchmark_1.yaml", *newest])):
        os.utime(path, (time.time() - 100 * (age + 1),) * 2)
    assert report_figures.newest_report(str(tmp_path), "cpu") == str(tmp_path / "benchmark_1.yaml")
    assert report_figures.newest_report(str(tmp_path), "cpu") == str(tmp_path / "benchmark_1.yaml")
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 2 and all(line.endswith("; passed over") for line in warnings), warnings
    assert "benchmark_3.yaml is not YAML (" in warnings[1] and "benchmark_4.yaml is a FIFO" in warnings[0]
    assert report_figures.newest_report(str(tmp_path), "H100") is None
