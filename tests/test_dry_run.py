"""--dry_run: the real training step on fake tensors over a fake process group, at any world size."""

import functools
import re
import resource
import subprocess
import sys

import pytest
from conftest import REPO, SIMULATES, parse_options, validated
from torch.torch_version import TorchVersion

import train as train_script
from common.errors import ConfigError
from run.model import presets
from run.prediction import simulate

SMALL = ["--compile=False", "--batch_size=8"]
# gpt2's width, heads and vocabulary with 4 of its layers: what the tests compare holds at any depth, and a
# simulation takes seconds
GPT2_SHORT = ["--model=gpt2", "--n_layer=4", "--seq_length=256"]


@functools.cache  # two tests simulate the same configuration, each simulation taking seconds
def simulated_peak(*args, world_size):
    """Peak bytes per rank by category, from the dry run's own simulation."""
    cfg = parse_options(["--dry_run", *SMALL, *args, f"--world_size={world_size}"])
    shape = validated(cfg)
    config = presets.build_model_config(shape)
    ranks_per_node = min(cfg.gpus_per_node, world_size)
    accumulation = min(2, cfg.global_batch_size // (cfg.batch_size * world_size))
    return simulate.simulate_step(cfg, config, world_size, ranks_per_node, True, accumulation)[0]


def dry_run(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        sys.exit(train_script.main(["--dry_run", *args]))
    return exit_info.value.code, capsys.readouterr().out


@SIMULATES
@pytest.mark.parametrize("model", ["tiny", "gpt2"])
@pytest.mark.parametrize("world_size", [2, 8])
def test_dry_run_prints_the_simulated_peak_and_a_verdict(capsys, model, world_size):
    code, out = dry_run(
        capsys,
        f"--model={model}",
        f"--world_size={world_size}",
        *SMALL,
        f"--global_batch_size={8 * world_size}",
        "--gpu=H100",
    )
    assert code == 0, out
    peak = re.search(r"^peak memory per GPU \(simulated\): ([\d.]+) GB of 80 GB \(H100\)$", out, re.M)
    assert peak and 0 <= float(peak.group(1)) < 80, out
    assert "verdict: fits" in out
    for category in simulate.MEMORY_CATEGORIES:
        assert re.search(rf"^  {category} +[\d.]+ GB$", out, re.M), category
    assert sum(float(gb) for gb in re.findall(r"^  [a-z ]+ +([\d.]+) GB$", out, re.M)) > 0
    flops = re.search(
        r"FLOPs per token: ([\d.]+) G for MFU .* ([\d.]+) G computed .*: at most (\d+)% MFU", out
    )
    assert float(flops.group(2)) > float(flops.group(1))  # full activation checkpointing recomputes


@SIMULATES
def test_accumulation_keeps_only_a_sharded_gradient_between_micro_steps():
    """FSDP reduce-scatters every micro-step: accumulating adds the sharded fp32 gradient, never the
    whole one."""
    world_size = 2
    one = simulated_peak(*GPT2_SHORT, "--global_batch_size=16", world_size=world_size)
    four = simulated_peak(*GPT2_SHORT, "--global_batch_size=64", world_size=world_size)
    shape = presets.resolve_shape(parse_options(["--model=gpt2"]))
    model = presets.build_meta_model(presets.build_model_config(shape))
    n_params = sum(p.numel() for p in model.parameters())
    sharded_gradient = 4 * n_params / world_size
    assert 0 <= sum(four.values()) - sum(one.values()) <= 1.05 * sharded_gradient
    # no unsharded fp32 gradient (4 bytes x all parameters)
    assert four["gradients"] < 1.05 * sharded_gradient


@SIMULATES
def test_memory_falls_with_checkpointing_and_sharded_state_with_world_size():
    peaks = {}
    for mode in ("none", "selective", "op", "full"):
        args = (*GPT2_SHORT, "--global_batch_size=16", f"--activation_checkpointing={mode}")
        peaks[mode] = sum(simulated_peak(*args, world_size=2).values())
    assert peaks["none"] > peaks["selective"] > peaks["full"], peaks
    assert peaks["none"] > peaks["op"] > peaks["full"], peaks
    two = simulated_peak(*GPT2_SHORT, "--global_batch_size=16", world_size=2)
    eight = simulated_peak(*GPT2_SHORT, "--global_batch_size=64", world_size=8)
    for category in ("sharded parameters", "optimizer state"):
        assert eight[category] == pytest.approx(two[category] / 4, rel=0.02), category
    assert eight["activations"] == pytest.approx(two["activations"], rel=0.02)  # the same batch per rank


@SIMULATES
def test_a_config_that_cannot_fit_exits_1_and_names_a_simulated_change_that_fits(capsys):
    code, out = dry_run(
        capsys,
        "--model=tiny",
        "--world_size=2",
        *SMALL,
        "--global_batch_size=16",
        "--activation_checkpointing=none",
        "--gpu=0.07",
    )
    assert code == 1, out
    assert re.search(r"^peak memory per GPU \(simulated\): [\d.]+ GB of 0.07 GB$", out, re.M), out
    change = re.search(r"^verdict: does not fit; fits with (.*) \(simulated ([\d.]+) GB\)$", out, re.M)
    assert change and float(change.group(2)) <= 0.07, out
    assert "--activation_checkpointing=full" in change.group(1)


@SIMULATES
def test_ddp_and_cpu_offload_say_they_are_estimated(capsys):
    for option, words in (
        ("--sharding=ddp", "estimated for DDP"),
        ("--cpu_offload=True", "estimated for cpu_offload"),
    ):
        code, out = dry_run(
            capsys, "--model=tiny", "--world_size=2", *SMALL, "--global_batch_size=16", option
        )
        assert code == 0 and words in out, out


def test_unknown_gpu_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_script.main(["--dry_run", "--model=tiny", "--gpu=H900"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "--gpu=H900 is not in the GPU datasheet" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    "flags, refused",
    [
        (["--dry_run"], "--dry_run needs"),
        (["--plan", "--sharding=auto"], "--plan needs"),
        (["--sharding=auto", "--batch_size=auto"], "--sharding=auto, --batch_size=auto need"),
        (["--activation_checkpointing=auto"], "--activation_checkpointing=auto needs"),
        ([], None),  # a run that simulates nothing trains on it
    ],
)
def test_a_torch_whose_tracker_overstates_the_peak_refuses_what_simulates_in_one_line(
    monkeypatch, tmp_path, flags, refused
):
    """torch 2.11's FSDPMemTracker simulated gpt2-xl on one H100 at 48.5 GB; the GPU measured 25.8 GB. The
    auto options keep the candidates whose simulated peak fits, so they would leave out those that fit."""
    monkeypatch.setattr(train_script.torch, "__version__", TorchVersion("2.11.0+cu130"))
    logs, checkpoints = tmp_path / "logs", tmp_path / "ckpt"
    run = ["--model=tiny", "--data=dummy", f"--log_dir={logs}", f"--checkpoint_dir={checkpoints}", *flags]
    if refused is None:
        validated(parse_options(run))  # checked through to the folders training writes in
        assert logs.is_dir() and checkpoints.is_dir()
        return
    # checked as main() checks the options: a ConfigError is one line and exit status 2, before any work
    with pytest.raises(ConfigError) as error:
        validated(parse_options(run))
    said = str(error.value)
    assert said.startswith(f"{refused} torch 2.13 or later: torch 2.11.0+cu130's memory tracker"), said
    assert len(said.splitlines()) == 1 and not logs.exists() and not checkpoints.exists(), said


def test_default_model_is_about_4b():
    shape = presets.resolve_shape(parse_options([]))
    model = presets.build_meta_model(presets.build_model_config(shape))
    count = sum(p.numel() for p in model.parameters())
    assert 3.8e9 <= count <= 4.3e9


def test_a_machine_that_cannot_hold_the_run_refuses_it_before_building_it(tmp_path):
    from common.node import available_memory_bytes

    if available_memory_bytes() > 70e9:
        pytest.skip("this machine could hold the 4b model's 64 GB of state")
    # refused before the build: with 12 GiB of address space (the refusal needs under 3 here; a CUDA build of
    # torch maps a few GB of libraries), building the model's 15 GiB of fp32 weights would end in an
    # allocation error, not this line: a bound that holds however busy the machine is, unlike a time limit
    result = subprocess.run(
        [sys.executable, str(REPO / "train.py"), f"--checkpoint_dir={tmp_path}", f"--log_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (12 * 2**30,) * 2),
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--model=4b needs at least 64.2 GB of host memory" in lines[0], result.stderr
    assert "--model=tiny" in lines[0] and "GB are available" in lines[0]
