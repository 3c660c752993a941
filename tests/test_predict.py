"""The step's prediction (run/prediction/) follows its inputs and says its basis: a probe of the run's own
model gives its step at the run's micro-steps; a roofline follows the figures it is given and is printed as a
range; the dry run predicts from a report's probe of the same configuration, from this CPU measured now, or
from a roofline, and says which; a prediction measured badly is refused or never kept, and a kept one holds
only for its options and machine; a compiled step keeps no more memory than the eager one.
(test_live_prediction.py holds the live step against its prediction.)"""

import copy
import dataclasses
import json
import os
import re
import socket
import sys
import time
import types

import pytest
import torch
from conftest import ODD, SIMULATES, TINY, launch, make_odd, parse_options, read_metrics, validated
from prediction_inputs import TINY_STEP, cpu_report, damaged, gpu_report, measured, probed, written

import train as train_script
from common.errors import ConfigError
from run import options as train_options
from run import report_figures
from run.model import presets
from run.prediction import plan, probe, roofline, simulate, step_time
from run.prediction.simulate import Operation, Work
from run.report_figures import BadReport, read_report

# the probe's micro-steps (accumulation), the run's -> the step's seconds, its layers' forward seconds
FITS = {
    "the run's own micro-steps": (3, 3, 1.0, 0.1),
    "each micro-step past the probe's, its middle one": (3, 9, 1.0 + 6 * 0.3, 0.3),
    "one micro-step": (1, 1, 1.0, 0.1),
}


@pytest.mark.parametrize("case", FITS)
def test_a_probe_extrapolates_the_runs_micro_steps_from_its_middle_one(case):
    traced, accumulation, step_s, layer_forward_s = FITS[case]
    found = measured(accumulation=traced, micro_s=0.3 if traced > 2 else 0.0)
    assert found.step_at(accumulation) == pytest.approx(step_s)
    assert found.layer_forward_at(accumulation) == pytest.approx(layer_forward_s)


def test_the_cores_other_work_took_are_the_busiest_hosts_less_the_runs_own():
    """(host, the rank's CPU s, the host's busy s, wall s) per rank; 2 cores here stand for any count."""
    cores = os.cpu_count()
    quiet = [("a", 1.0, 2.0, 1.0), ("a", 1.0, 2.0, 1.0)]
    assert probe.others_share(quiet) == 0.0
    busy = [("a", 1.0, 2.0 + cores / 2, 1.0), ("a", 1.0, 2.0 + cores / 2, 1.0), ("b", 1.0, 1.0, 1.0)]
    assert probe.others_share(busy) == pytest.approx(0.5)
    assert probe.others_share([("a", 1.0, None, 1.0)]) == 0.0  # no /proc/stat: unknown, not busy


def test_a_real_probe_steps_the_runs_own_model_on_this_cpu(tmp_path):
    """The tiny model built as training builds it, stepped at three micro-steps (a global batch of twelve)."""
    folders = [f"--log_dir={tmp_path}", f"--checkpoint_dir={tmp_path}"]
    cfg = parse_options([*TINY_STEP, "--global_batch_size=12", *folders])
    config = presets.build_model_config(validated(cfg))
    found = probe.on_this_cpu(cfg, config, 1)
    assert found.accumulation == 3 and found.step_s > found.micro_s > 0 and found.layer_forward_s > 0
    prediction = step_time.measured(found, 5, "this machine's CPU")
    assert (
        prediction.step_s == pytest.approx(found.step_s + 2 * found.micro_s)
        and prediction.basis == "measured"
    )
    rest = r"(\d[\d.e+-]* s|under the timings' noise)"  # never below zero
    told = rf"predicted step: [\d.e-]+ s = 5 micro-steps of [\d.e-]+ s \+ the rest {rest}"
    assert re.fullmatch(told + r" \(measured on this machine's CPU\)", prediction.line())


@pytest.mark.parametrize(
    "step_s, said",
    [
        (8.0, "= 32 micro-steps of 0.243 s + the rest 0.224 s"),  # the optimizer's step and the first's extra
        (7.76, "= 32 micro-steps of 0.243 s + the rest under the timings' noise"),  # 7.776 s of micro-steps
    ],
)
def test_a_measured_step_is_told_as_its_micro_steps_and_a_rest_that_is_never_below_zero(step_s, said):
    prediction = step_time.Prediction(step_s, step_s, step_s, "measured", "this run's own CPU", 32, 0.243)
    assert prediction.line() == f"predicted step: {step_s:.3g} s {said} (measured on this run's own CPU)"


def work(flops, micro_steps=1.0):
    """A step of one operation and one all-gather of 2 ranks on one node, each repeated micro_steps times."""
    gather = Operation(0, None, ("all_gather", 8e9, 2, 1))
    return Work([Operation(flops, torch.bfloat16), gather], [], micro_steps)


def test_a_roofline_follows_its_figures_and_a_gpu_hides_communication_that_a_cpu_waits_for():
    gpu = roofline.from_report("r.yaml", gpu_report())
    slow = roofline.from_report("r.yaml", gpu_report(matmul_TFLOPS=400.0, busbw_GBps=150.0))
    step = work(8e14)
    assert roofline.roofline_seconds(step, gpu) == pytest.approx(1.0)  # compute 1 s hides 8e9/2/300e9
    assert roofline.roofline_seconds(step, slow) == pytest.approx(2.0)
    assert roofline.roofline_seconds(work(8e14, micro_steps=4), gpu) == pytest.approx(4.0)
    cpu = roofline.from_report("r.yaml", cpu_report(busbw_GBps=4.0))  # all-core 50 GFLOP/s, 2 ranks
    cpu_step = Work([Operation(25e9, torch.float32), Operation(0, None, ("all_reduce", 2e9, 2, 1))], [], 1)
    assert roofline.roofline_seconds(cpu_step, cpu) == pytest.approx(1.0 + 2e9 / 4e9)  # in turn
    datasheet = roofline.from_datasheet("H100")
    assert datasheet.flops_per_s[torch.bfloat16] == pytest.approx(676e12)  # the benchmark's own measure


def test_a_roofline_is_a_range_and_says_it_is_not_measured():
    prediction = roofline.predicted(work(8e14), roofline.from_datasheet("H100"), 4)
    low, high = roofline.STEP_OVER_ROOFLINE["cuda"]
    bound = 8e14 / 676e12
    assert (prediction.low_s, prediction.high_s) == pytest.approx((bound * low, bound * high))
    assert prediction.line().startswith(f"predicted step: {bound * low:.3g}-{bound * high:.3g} s, a roofline "
                                        "from the datasheet of H100, not measured")  # fmt: skip
    assert not prediction.measured_well


def test_a_probe_that_varied_is_refused_and_one_made_on_a_busy_machine_is_never_kept(tmp_path, capsys):
    holds_for = {"options": {"model": "tiny"}, "machine": {"device": "CPU, 2 cores"}}
    quiet = step_time.measured(measured(), 4, "here")
    assert step_time.refusal(quiet) is None and quiet.measured_well
    varied = dataclasses.replace(quiet, spread=1.2, others=0.4)
    assert step_time.refusal(varied) == (
        "not predicted: this machine's timings varied by 120%, and other work took 40% of its cores"
    )
    uneven = dataclasses.replace(quiet, spread=0.8)  # a quiet machine's probe of an uneven step: printed
    assert step_time.refusal(uneven) is None and not uneven.measured_well
    crowded = dataclasses.replace(quiet, others=0.4)
    assert step_time.refusal(crowded) == (
        "not predicted: other work took 40% of the cores while this machine's timings were made"
    )
    busy = dataclasses.replace(quiet, others=0.2)
    assert step_time.refusal(busy) is None and not busy.measured_well
    step_time.keep(tmp_path, busy, holds_for)
    assert not (tmp_path / step_time.KEPT).exists() and "is not kept" in capsys.readouterr().out
    step_time.keep(tmp_path, quiet, holds_for)
    assert step_time.kept(tmp_path, holds_for) == (quiet, time.strftime("%Y-%m-%d %H:%M"))


def kept_record(tmp_path, change):
    """A kept prediction, changed after it was written."""
    path = tmp_path / step_time.KEPT
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


DAMAGED = {
    "its checksum": lambda r: r["prediction"].update(step_s=0.5),
    "a step of 1e9 s": lambda r: (r["prediction"].update(step_s=1e9), r.update(checksum=step_time.checksum(
        {k: r[k] for k in ("for", "made", "prediction")}))),
    "a step of 1e-9 s": lambda r: (r["prediction"].update(step_s=1e-9), r.update(checksum=step_time.checksum(
        {k: r[k] for k in ("for", "made", "prediction")}))),
    "escape codes": lambda r: (r["prediction"].update(source="\x1b[2K\rerror: forged"), r.update(
        checksum=step_time.checksum({k: r[k] for k in ("for", "made", "prediction")}))),
    "a field missing": lambda r: r["prediction"].pop("spread"),
}  # fmt: skip


@pytest.mark.parametrize("case", [*DAMAGED, *ODD])
def test_a_damaged_kept_prediction_is_one_warning_set_aside_and_predicted_anew(
    tmp_path, capsys, case, deadline
):
    holds_for = {"options": {"model": "tiny"}, "machine": {"device": "CPU, 2 cores"}}
    quiet = step_time.measured(measured(), 4, "here")
    if case in ODD:
        make_odd(tmp_path / step_time.KEPT, case)
    else:
        step_time.keep(tmp_path, quiet, holds_for)
        kept_record(tmp_path, DAMAGED[case])
    assert step_time.kept(tmp_path, holds_for) is None
    warning = capsys.readouterr().err
    assert warning.startswith(f"warning: {tmp_path / step_time.KEPT} is not a kept prediction (")
    assert warning.count("\n") == 1 and "predicted again" in warning and "\x1b" not in warning
    assert not (tmp_path / step_time.KEPT).exists()  # set aside


def test_a_kept_prediction_holds_only_for_its_options_and_machine(tmp_path, capsys):
    holds_for = {"options": {"model": "tiny", "batch_size": 4}, "machine": {"device": "CPU, 2 cores"}}
    quiet = step_time.measured(measured(), 4, "here")
    step_time.keep(tmp_path, quiet, holds_for)
    relaunched = {**holds_for, "options": {"model": "tiny", "batch_size": 1}}
    assert step_time.kept(tmp_path, relaunched) is None and capsys.readouterr().err == ""
    assert step_time.kept(tmp_path, holds_for)[0] == quiet
    step_time.keep(tmp_path / "no such folder", quiet, holds_for)  # a warning; the run goes on
    assert "warning: cannot keep the prediction in" in capsys.readouterr().err


def run_main(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        sys.exit(train_script.main(list(args)))
    return exit_info.value.code, capsys.readouterr().out


@SIMULATES
def test_the_dry_run_says_its_basis_this_cpu_measured_a_reports_probe_or_a_roofline(tmp_path, capsys):
    code, out = run_main(capsys, "--dry_run", "--gpu=cpu", "--world_size=1", *TINY_STEP, "--max_steps=10",
                         f"--log_dir={tmp_path}")  # fmt: skip
    # On a busy machine (CI's) the probe's steps may vary by more than half, or other work take more than a
    # quarter of the cores: then it says so instead.
    if not re.search(r"^not predicted: (this machine's timings varied|other work took) ", out, re.M):
        assert code == 0 and re.search(r"^predicted step: [\d.e-]+ s \(measured on this machine's CPU, one "
                                       r"process\)$", out, re.M), out  # fmt: skip
        assert re.search(r"^predicted: [\d,]+ tokens/s per device$", out, re.M), out
    # A report of this CPU without this configuration's probe: its figures give a roofline, said so.
    report = written(tmp_path, "named.yaml", cpu_report(host=socket.gethostname()))
    code, out = run_main(capsys, "--dry_run", "--gpu=cpu", "--world_size=2", *TINY_STEP,
                         f"--benchmark_report={report}")  # fmt: skip
    assert code == 0 and f"a roofline from the figures of benchmark report {report}, not measured" in out, out
    # The same report holding the benchmark's probe of this very configuration at this world size.
    cfg = parse_options(["--dry_run", "--gpu=cpu", "--world_size=2", *TINY_STEP])
    validated(cfg)
    options = {name: getattr(cfg, name) for name in train_options.names_the_run()}
    written(tmp_path, "named.yaml", {**cpu_report(host=socket.gethostname()), "model": probed(0.25, options)})
    code, out = run_main(capsys, "--dry_run", "--gpu=cpu", "--world_size=2", *TINY_STEP,
                         f"--benchmark_report={report}")  # fmt: skip
    source = f"from benchmark report {report}'s timings of this configuration on its 2 ranks"
    line = rf"^predicted step: [\d.e-]+ s \({re.escape(source)}\)$"
    assert code == 0 and re.search(line, out, re.M), out
    # A probe the benchmark made while its steps varied by 120% is not worth a figure, and says so.
    varied = probed(0.25, options)
    varied["measured"].update(spread=1.2, others=0.4)
    written(tmp_path, "named.yaml", {**cpu_report(host=socket.gethostname()), "model": varied})
    code, out = run_main(capsys, "--dry_run", "--gpu=cpu", "--world_size=2", *TINY_STEP,
                         f"--benchmark_report={report}")  # fmt: skip
    refused = "not predicted: the benchmark report's timings varied by 120%, and other work took 40% of its "
    refused += "cores"
    assert code == 0 and refused in out and "predicted step" not in out, out
    code, out = run_main(capsys, "--dry_run", "--world_size=2", *TINY_STEP)
    assert code == 0 and "a roofline from the datasheet of H100, not measured" in out, out


@SIMULATES
def test_the_plan_ranks_candidates_measured_on_this_cpu_or_says_it_ranks_by_a_roofline(capsys):
    code, out = run_main(capsys, "--plan", "--gpu=cpu", "--world_size=1", *TINY_STEP,
                         "--activation_checkpointing=auto")  # fmt: skip
    rows = re.findall(r"^  (\S+) +(none|op|selective|full) +(\d+) +([\d.e-]+) ", out, re.M)
    assert code == 0 and len(rows) == 4 and "ranked by a roofline" not in out, out  # every mode fits
    steps = [float(row[3]) for row in rows]
    assert steps == sorted(steps)
    code, out = run_main(capsys, "--plan", "--world_size=2", *TINY_STEP, "--activation_checkpointing=auto")
    assert code == 0 and "ranked by a roofline, not measured" in out, out


@SIMULATES
def test_a_candidate_that_does_not_fit_is_never_picked():
    cfg = parse_options(["--dry_run", *TINY_STEP, "--world_size=2", "--activation_checkpointing=auto"])
    config = presets.build_model_config(validated(cfg))
    figures = roofline.from_report("r.yaml", gpu_report())

    def predictor(options, model_config, work, names):
        return roofline.predicted(work, figures, 1)

    everything = plan.plan(cfg, config, 2, 0, 1e9, predictor, ())
    peaks = sorted(peak for _, peak, _ in everything)
    # room for the two smallest peaks only: the candidates of the larger ones do not fit
    squeezed = plan.plan(cfg, config, 2, 0, peaks[1], predictor, ())
    fitting = [row for row in squeezed if row[2] is not None]
    assert fitting and all(peak <= peaks[1] for _, peak, _ in fitting)
    assert plan.fastest(squeezed) == fitting[0][0] and len(fitting) < len(squeezed)
    with pytest.raises(ConfigError, match="no candidate"):
        plan.fastest(plan.plan(cfg, config, 2, 0, peaks[0] / 2, predictor, ()))


@SIMULATES
@pytest.mark.parametrize("mode", ["none", "full"])
def test_a_compiled_step_keeps_no_more_for_backward_than_an_eager_one_and_less_without_checkpointing(mode):
    """The dry run of a compiled run simulates the compiler's own partition of what the forward saves; with
    every block checkpointed both keep the block's input alone."""
    cfg = parse_options(["--dry_run", "--gpu=cpu", "--world_size=1", *TINY_STEP, "--seq_length=128",
                         f"--activation_checkpointing={mode}"])  # fmt: skip
    config = presets.build_model_config(validated(cfg))
    kept = {}
    for compiled in (False, True):
        options = types.SimpleNamespace(**{**vars(cfg), "compile": compiled})
        memory, _ = simulate.simulate_step(options, config, 1, 1, False, 1)
        kept[compiled] = memory["activations"] + memory["temporaries"]
    assert kept[True] < kept[False] if mode == "none" else kept[True] <= kept[False], kept


@SIMULATES
def test_a_ddp_step_all_reduces_every_gradient_over_the_world_once_a_step():
    cfg = parse_options(
        ["--dry_run", *TINY_STEP, "--world_size=2", "--sharding=ddp", "--global_batch_size=32"]
    )
    config = presets.build_model_config(validated(cfg))
    n_params = sum(p.numel() for p in presets.build_meta_model(config).parameters())
    _, step = simulate.simulate(cfg, config, 2, n_params)
    reduced = [operation.collective for operation in step.rest if operation.collective]
    assert reduced.count(("all_reduce", 4 * n_params, 2, 1)) == 1
    assert step.times == 2  # 4 micro-steps, 2 traced


def test_auto_options_are_refused_where_they_make_no_sense():
    with pytest.raises(ConfigError, match="--batch_size expects an integer or 'auto', got 'fast'"):
        parse_options(["--model=tiny", "--batch_size=fast"])
    with pytest.raises(ConfigError, match="--shard_group_size=3 needs --sharding=hybrid"):
        validated(copy.copy(parse_options(["--model=tiny", "--dry_run", "--shard_group_size=3"])))


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
    "an infinite step": (
        lambda r: r.update(model=probed(step_s=float("inf"))),
        "model.measured.step_s is inf, not between 1e-12 and 3600",
    ),
    "ranks per node in text": (
        lambda r: r["world"].update(ranks_per_node="8"),
        'world.ranks_per_node is "8", not a whole number',
    ),
    "a section of the wrong kind": (
        lambda r: r.update(nccl=[1, 2]),
        "its nccl section is list, not a mapping",
    ),
    "a probe of another shape": (
        lambda r: r.update(model={**probed(), "measured": [["step_s", 8]]}),
        "model.measured is not a probe of the run's step",
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


@SIMULATES
def test_the_benchmark_probes_a_configuration_on_its_ranks_and_the_dry_run_predicts_from_it(tmp_path, capsys):
    """benchmark.py --train_args on 2 processes steps the run's model on its own process group; the
    report's model section then gives the dry run of the same configuration its step, said so."""
    train_args = [*TINY_STEP, "--sharding=grad_op"]
    report = tmp_path / "probed.yaml"
    done = launch("benchmark.py", ["--quick", "--only=cpu", f"--report={report}", f"--report_dir={tmp_path}",
                                   f"--train_args={' '.join(train_args)}"])  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    model = read_report(report)["model"]
    assert model["world_size"] == 2 and model["options"]["sharding"] == "grad_op", model
    assert model["measured"]["step_s"] > 0 and model["measured"]["accumulation"] == 1
    code, out = run_main(capsys, "--dry_run", "--gpu=cpu", "--world_size=2", *train_args,
                         f"--benchmark_report={report}")  # fmt: skip
    # On a busy machine (CI's) the probe's steps may lie more than half apart, or other work take more than a
    # quarter of the cores: the dry run then says so.
    varied = re.search(r"^not predicted: .*the benchmark report's timings (varied|were made)", out, re.M)
    source = f"(from benchmark report {report}'s timings of this configuration on its 2 ranks)"
    assert code == 0 and (varied or source in out), out


def test_a_run_that_probes_its_step_trains_exactly_as_one_that_does_not(tmp_path, train):
    """The probe steps the run's own model before training sets its weights, on batches and with an optimizer
    of its own, its random numbers put back: the losses after it are those of a run without it, bit for bit.
    Two processes of ddp: a wrapper built before the weights are set."""
    runs = {}
    for predicting in (True, False):
        folder = tmp_path / str(predicting)
        train(folder, *TINY, "--sharding=ddp", "--max_steps=4", f"--predict={predicting}", "--run_name=r")
        runs[predicting] = [record["loss"] for record in read_metrics(folder)]
    assert len(runs[True]) == 4 and runs[True] == runs[False], runs


def test_a_job_s_run_takes_its_step_from_the_job_s_benchmark_of_it_and_keeps_it(tmp_path):
    """The job's benchmark probed this very configuration on these nodes (benchmark.py --train_args, its
    report in $BENCHMARK_REPORT): training predicts from it instead of probing again, and keeps it for a
    relaunch."""
    flags = [*TINY, "--predict=True", "--max_steps=2", f"--log_dir={tmp_path}",
             f"--checkpoint_dir={tmp_path}"]  # fmt: skip
    args = parse_options(flags)
    validated(args)
    naming = {name: getattr(args, name) for name in train_options.names_the_run()}
    report = written(tmp_path, "job.yaml", {**cpu_report(), "model": probed(0.321, naming, world_size=1)})
    done = launch("train.py", flags, nproc=0, env={"BENCHMARK_REPORT": str(report)})
    source = f"from benchmark report {report}'s timings of this configuration on its one rank"
    assert done.returncode == 0 and f"predicted step: 0.321 s ({source})" in done.stdout, done.stdout[-3000:]
    (kept,) = tmp_path.glob(f"*/{step_time.KEPT}")
    assert json.loads(kept.read_text())["prediction"]["basis"] == "report"


def test_a_job_s_benchmark_of_other_options_or_made_beside_other_work_is_not_its_run_s_prediction(
    tmp_path, monkeypatch, capsys
):
    from run.prediction.live import without_probe

    holds_for = {"options": {"model": "tiny"}, "machine": {"world_size": 2}}
    path = tmp_path / "job.yaml"
    monkeypatch.setenv("BENCHMARK_REPORT", str(path))
    written(tmp_path, "job.yaml", {**cpu_report(), "model": probed(0.25, {"model": "tiny"})})
    prediction, where = without_probe(tmp_path, holds_for, 1)
    assert (prediction.step_s, prediction.basis, where) == (0.25, "report", "")
    for other in ({"model": probed(0.25, {"model": "gpt2"})}, {"model": probed(0.25, world_size=4)}, {}):
        written(tmp_path, "job.yaml", {**cpu_report(), **other})
        assert without_probe(tmp_path, holds_for, 1) is None
    busy = probed(0.25, {"model": "tiny"})
    busy["measured"]["others"] = 0.3  # another job took 30% of the cores while the benchmark timed the step
    written(tmp_path, "job.yaml", {**cpu_report(), "model": busy})
    assert without_probe(tmp_path, holds_for, 1) is None
    path.write_text("not: [a report")
    assert without_probe(tmp_path, holds_for, 1) is None
    warning = capsys.readouterr().err
    assert warning.startswith(f"warning: BENCHMARK_REPORT: {path} is not YAML (") and warning.count("\n") == 1
    # a prediction an earlier launch kept comes first
    step_time.keep(tmp_path, step_time.measured(measured(), 1, "here"), holds_for)
    assert without_probe(tmp_path, holds_for, 1)[1].startswith("kept in the run's log folder")


@SIMULATES
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_experts_matmuls_are_simulated_and_counted_in_any_precision(precision):
    """A mixture of experts runs its experts as one grouped matmul, which fake tensors take in bf16 alone and
    the FLOP counter does not count: the simulated step still runs, and computes what MFU counts."""
    cfg = parse_options(["--model=tiny-mixtral", "--compile=False", "--activation_checkpointing=none",
                         "--batch_size=2", "--global_batch_size=2", "--seq_length=64", "--gpu=cpu",
                         f"--mixed_precision={precision}"])  # fmt: skip
    config = presets.build_model_config(validated(cfg))
    _, work = simulate.simulate(cfg, config, 1, 0)
    computed = sum(operation.flops for operation in work.micro_steps + work.rest)
    model_flops = presets.flops_per_token(presets.build_meta_model(config), config, 64) * 2 * 64
    assert computed == pytest.approx(model_flops, rel=0.05)
