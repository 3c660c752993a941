"""The live step against its prediction (run/prediction/live.py), fed log windows as training gives them: a
slower run is warned of only when two windows in a row are slow over 10 s of steps; a kept prediction that the
run's steps contradict is dropped for the next launch; an eager CPU run that a probe would hold up too long
takes its prediction from its own first steps, unless they varied or other work took the cores, and a forward
that found the probe too long leaves training as if it never ran. (test_diagnose.py holds real training
runs' live steps against their prediction.)"""

import itertools
import math
import os
import types

import pytest
import torch
from conftest import parse_options, validated
from prediction_inputs import TINY_STEP, measured

from run.model import presets
from run.prediction import probe, step_time


@pytest.mark.parametrize(
    "window_ratios, window_s, warned_at",
    [
        ([1.0, 1.0, 1.0], 3, []),  # on time
        ([1.0, 1.5, 1.0, 1.0], 3, []),  # one window held up (the host, a profiled step): no slower run
        ([1.0, 1.5, 1.0, 1.5, 1.0], 3, []),  # slow windows, never two in a row
        ([1.0, 1.3, 1.3, 1.3], 3, [2]),  # slower from the second timed window on: said once
        ([1.0, 1.3, 1.3, 1.4, 1.6, 1.6], 3, [2, 5]),  # again once the gap over 10 s grew by a quarter more
        # windows of a second and a quarter, as the CPU quick start logs them: two slow ones in a row are not
        # enough (the last four took 1.15x)...
        ([1.0, 1.26, 1.2, 1.13, 1.07, 1.03], 1.25, []),
        ([1.0, *[1.3] * 8], 1.25, [6]),  # ... a slower run is, once its slow steps add up to 10 s
        # a healthy quick start's windows, one of its ranks held up by the host for its last 4 s...
        ([1.08, 1.02, 1.1, 0.96, 1.07, 1.04, 0.98, 0.95, 0.99, 0.99, 1.06, 1.39, 1.18, 1.39, 1.45], 0.75, []),
        ([1.0, *[1.3] * 12], 0.75, [10]),  # ... and one whose rank is slower throughout
    ],
)
def test_the_live_prediction_warns_of_a_slower_run_only_when_two_windows_in_a_row_are_slow(
    window_ratios, window_s, warned_at, capsys
):
    """LivePrediction.log_window for windows of the given measured/predicted ratios, each window_s of
    predicted steps, after the first (the warm-up, never held): the windows that print a warning."""
    from run.prediction.live import LivePrediction

    prediction = step_time.Prediction(0.25, 0.25, 0.25, "measured", "this CPU", 1, layer_forward_s=0.125)
    live = LivePrediction(prediction)
    steps = round(window_s / prediction.step_s)
    live.log_window(1.25, steps, {"host:0": (0.625, 0.0)})  # the first window: its compilation
    warned = []
    for index, ratio in enumerate(window_ratios):
        live.log_window(0.25 * ratio, steps, {"host:0": (0.125 * ratio, 0.0)})
        if "warning: steps take" in capsys.readouterr().out:
            warned.append(index)
    assert warned == warned_at


@pytest.mark.parametrize("ratio, dropped", [(1.0, False), (1.15, False), (0.64, True), (1.6, True)])
def test_a_kept_prediction_the_runs_own_steps_contradict_is_dropped_for_the_next_launch(
    ratio, dropped, tmp_path, capsys
):
    """Steps at `ratio` times the kept prediction, over 10 s and two windows: it stays kept, or is removed
    with one note, once (a host that ran the probe's cores slower or faster than the run's)."""
    from run.prediction.live import LivePrediction

    holds_for = {"options": {"model": "tiny"}, "machine": {"device": "CPU, 2 cores"}}
    prediction = step_time.measured(measured(), 4, "here")
    step_time.keep(tmp_path, prediction, holds_for)
    live = LivePrediction(prediction, str(tmp_path))
    steps = math.ceil(3 / prediction.step_s)
    live.log_window(5 * prediction.step_s, steps, {"host:0": (1.0, 0.0)})  # the first window: its warm-up
    compute_s = ratio * prediction.layer_forward_s
    for _ in range(6):
        live.log_window(ratio * prediction.step_s, steps, {"host:0": (compute_s, 0.0)})
    out = capsys.readouterr().out
    assert (step_time.kept(tmp_path, holds_for) is None) == dropped
    assert out.count("is no longer kept for later launches") == dropped, out


def test_a_kept_prediction_that_cannot_be_removed_is_one_warning_and_the_run_goes_on(tmp_path, capsys):
    from run.prediction.live import LivePrediction

    prediction = step_time.measured(measured(), 4, "here")
    kept = tmp_path / step_time.KEPT
    kept.mkdir()  # a folder: removing it as a file fails
    live = LivePrediction(prediction, str(tmp_path))
    for _ in range(4):
        live.log_window(1.6 * prediction.step_s, 3, {"host:0": (1.6 * prediction.layer_forward_s, 0.0)})
    err = capsys.readouterr().err
    assert err.count(f"warning: cannot remove {kept} (") == 1 and kept.is_dir(), err


def test_a_step_too_long_to_time_first_is_predicted_from_the_runs_first_steps_kept_and_reused(
    tmp_path, capsys, monkeypatch
):
    """An eager CPU run whose probe would add more than probe.LIMIT_S (here none may be added) is not stepped
    on dummy batches: its first 5 s of steps after the first log window, less their wait for data, are its
    prediction, printed and kept; its next launch prints the kept one and probes nothing."""
    import torch.distributed as dist

    from run.launch import device_mesh
    from run.model.build import build_model
    from run.prediction import live

    cfg = parse_options([*TINY_STEP, "--max_steps=40"])
    config = presets.build_model_config(validated(cfg))
    holds_for = live.holds_for(cfg, ["model"], torch.device("cpu"), 1, 1)
    monkeypatch.setattr(probe, "LIMIT_S", 0.0)
    host_where_others_take(monkeypatch, 0.0)
    note = (
        "note: the step is predicted from this run's first steps: timing it before them would add more than"
    )
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        model = build_model(config, cfg, torch.device("cpu"), device_mesh(cfg, "cpu", 1, 1))
        first = live.predict_own_step(cfg, model, config, torch.device("cpu"), tmp_path, holds_for, 1e6)
        out = capsys.readouterr().out
        assert first.prediction is None and not (tmp_path / step_time.KEPT).exists()
        assert f"{note} 0 s" in out and "predicted step" not in out, out
        assert first.log_window(2.0, 1, {"host:0": (0.5, 0.0)}) == {}  # the first window: its warm-up
        assert first.log_window(1.2, 2, {"host:0": (0.3, 0.2)}) == {}  # 2 s of steps: not yet
        assert first.log_window(1.1, 3, {"host:0": (0.25, 0.0)}) == {}  # 5.3 s now: predicted
        out = capsys.readouterr().out
        line = "predicted step: 1.06 s (measured on this run's first 5 steps after its first log window)"
        assert line in out and "predicted: 40 steps in" in out and (tmp_path / step_time.KEPT).exists(), out
        fields = first.log_window(1.4, 3, {"host:0": (0.3, 0.0)})
        assert fields["predicted_step_s"] == pytest.approx(1.06) and fields["vs_predicted"] > 1.2
        relaunch = live.predict_own_step(cfg, model, config, torch.device("cpu"), tmp_path, holds_for, 1e6)
        out = capsys.readouterr().out
        assert relaunch.prediction.step_s == pytest.approx(1.06) and "kept in the run's log folder" in out
    finally:
        dist.destroy_process_group()


def host_where_others_take(monkeypatch, share):
    """probe.usage() on a host where other work takes `share` of the cores: each call a second after the last,
    this process having used one core of it meanwhile."""
    seconds, cores = itertools.count(1.0), os.cpu_count() or 1

    def usage():
        second = next(seconds)
        return second, second * (1 + share * cores), second

    monkeypatch.setattr(probe, "usage", usage)


ON_TIME = "predicted step: 1.03 s (measured on this run's first 6 steps after its first log window)"
CROWDED = "not predicted: other work took 40% of the cores while this machine's timings were made"


@pytest.mark.parametrize(
    "step_times, others, said, kept",
    [
        ((1.0, 1.1, 1.0), 0.0, ON_TIME, True),
        ((1.0, 1.1, 1.0), 0.2, ON_TIME, False),  # printed; not for later launches
        ((1.0, 1.1, 1.0), 0.4, CROWDED, False),
        ((0.5, 2.0, 0.5), 0.0, "not predicted: this machine's timings varied by 120%", False),
    ],
)
def test_first_steps_predict_the_step_once_unless_they_varied_or_other_work_took_the_cores(
    step_times, others, said, kept, capsys, monkeypatch
):
    """Log windows of two steps after the first (its warm-up), on a host where other work took `others` of
    the cores: the line said once 5 s of steps in, whether the prediction is kept, and nothing said after."""
    from run.prediction.live import LivePrediction

    host_where_others_take(monkeypatch, others)
    announced, unlogged = [], types.SimpleNamespace(global_batch_size=8, seq_length=64, max_steps=0)

    def announce(prediction):
        announced.append(prediction)
        return step_time.announce(unlogged, prediction, 1, 1e6, None)

    live = LivePrediction(None, announce=announce)
    live.log_window(2.0, 1, {"host:0": (0.5, 0.0)})
    for step_s in (*step_times, 1.0, 1.0):
        live.log_window(step_s, 2, {"host:0": (0.2, 0.0)})
    out = capsys.readouterr().out
    assert len(announced) == 1 and announced[0].measured_well == kept, announced
    assert out.splitlines()[0] == said and out.count("predicted step") == (said == ON_TIME), out


def test_the_forward_that_finds_a_probe_too_long_leaves_training_as_if_it_never_ran():
    """probe.measure with no time to spare runs one forward without gradients and returns None; the weights
    training then sets are the ones its steps use (FSDP would keep its root's gathered from that forward):
    three steps' losses and gradient norms equal those of a model no forward touched, bit for bit."""
    import torch.distributed as dist

    from run.launch import device_mesh
    from run.model.build import build_model, init_weights
    from run.model.step import build_optimizer, train_step
    from run.stops import StopRequests

    cfg = parse_options([*TINY_STEP, "--global_batch_size=4"])
    config = presets.build_model_config(validated(cfg))
    tokens = torch.randint(0, config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        steps = []
        for probed in (False, True):
            model = build_model(config, cfg, torch.device("cpu"), device_mesh(cfg, "cpu", 1, 1))
            if probed:
                assert probe.measure(cfg, model, config, torch.device("cpu"), limit_s=0.0) is None
            init_weights(model, config.initializer_range, config.num_hidden_layers, cfg.seed)
            optimizer = build_optimizer(model, cfg, fused=False)
            batches = itertools.repeat((tokens, tokens))
            taken = [
                train_step(model, batches, optimizer, 1, cfg.grad_clip, StopRequests()) for _ in range(3)
            ]
            steps.append([(loss.item(), grad_norm) for loss, grad_norm, _ in taken])
        assert steps[0] == steps[1], steps
    finally:
        dist.destroy_process_group()
