"""--float8: refused in one line where no GPU computes in float8; on the CPU (tests/float8_on_cpu.py lets a
float32 matmul of the float8 values stand in for the GPU's) a float8 run trains, its checkpoint resumes
without --float8, and its export is plain weights; the dry run simulates float8's tensors and says what it
cannot time. Speed and loss against bf16 are measured on a GPU: tests/perf/on_gpu.sh."""

import json
import os
import re
import shutil
import sys

import pytest
import torch
from conftest import SIMULATES, TINY, assert_ran, launch, parse_options, read_metrics, together, validated
from transformers import AutoModelForCausalLM

from run.model.float8 import convert_to_float8
from run.model.presets import build_meta_model, build_model_config

RUN = [*TINY, "--max_steps=6", "--checkpoint_every=3", "--tensorboard=False"]


def test_float8_is_refused_in_one_line_where_no_gpu_computes_in_float8(tmp_path):
    folders = [f"--log_dir={tmp_path}", f"--checkpoint_dir={tmp_path}"]
    result = launch("train.py", [*RUN, "--float8=True", *folders], nproc=0)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "error: --float8=True needs a GPU with float8 matmuls (H100, H200, L40S, B200); this machine has "
        "none: leave --float8 off"
    ]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("model, per_layer", [("tiny", 4), ("tiny-llama", 7)])
def test_float8_converts_the_decoder_linear_layers_and_leaves_the_output_layer(model, per_layer):
    """GPT-2's Conv1D layers (attention in and out, MLP up and down) and Llama's seven linear layers, keeping
    each weight's name and shape; the output layer and embeddings stay as they are."""
    args = parse_options([f"--model={model}"])
    config = build_model_config(validated(args))
    plain, converted = build_meta_model(config), build_meta_model(config)
    assert convert_to_float8(converted, float8_all_gather=False) == per_layer * config.num_hidden_layers
    assert {n: p.shape for n, p in converted.named_parameters()} == {
        n: p.shape for n, p in plain.named_parameters()
    }
    kinds = {type(m).__name__ for m in converted.modules()}
    assert (
        kinds & {"Float8Linear", "Float8Conv1D"}
        and type(converted.get_output_embeddings()) is torch.nn.Linear
    )


def test_a_float8_run_trains_exports_plain_weights_and_resumes_exactly_or_without_float8(tmp_path):
    """Two processes, so that FSDP gathers the weights in float8 and their scales are taken after each step
    and after a load. float8 changes the losses slightly against the same run in full precision; its export
    loads in transformers as plain weights; its step-3 checkpoint resumes with --float8 to the uninterrupted
    run's losses exactly, and without --float8 to within float8's difference."""
    float8_dir, plain_dir = tmp_path / "float8", tmp_path / "plain"
    float8_run = [*RUN, f"--log_dir={float8_dir}", f"--checkpoint_dir={float8_dir}", "--run_name=r"]
    first, plain_run = together(
        lambda: launch("tests/float8_on_cpu.py", [*float8_run, "--float8=True"]),
        lambda: launch("train.py", [*RUN, f"--log_dir={plain_dir}", f"--checkpoint_dir={plain_dir}"]),
    )
    assert_ran(first)
    assert_ran(plain_run)
    float8_losses = [r["loss"] for r in read_metrics(float8_dir)]
    plain_losses = [r["loss"] for r in read_metrics(plain_dir)]
    assert float8_losses != plain_losses
    assert all(abs(a / b - 1) < 0.02 for a, b in zip(float8_losses, plain_losses)), float8_losses
    exported = AutoModelForCausalLM.from_pretrained(float8_dir / "r" / "final_model")
    assert all(type(w.data) is torch.Tensor and w.dtype == torch.float32 for w in exported.parameters())
    assert type(exported.transformer.h[0].mlp.c_fc).__name__ == "Conv1D"

    copy = tmp_path / "copy"  # the same run, for a second resume from step 3 (a run rewinds to a step once)
    shutil.copytree(float8_dir, copy)
    resumes = [("tests/float8_on_cpu.py", float8_dir, ["--float8=True"]), ("train.py", copy, [])]
    for script, folder, extra in resumes:
        folders = [f"--log_dir={folder}", f"--checkpoint_dir={folder}", "--run_name=r"]
        resumed = launch(script, [*RUN, *folders, f"--resume_from={folder / 'r' / 'step_3'}", *extra])
        assert_ran(resumed)
        assert re.search(r"^resumed from .*step_3 at step 3$", resumed.stdout, re.M), resumed.stdout[-2000:]
    losses = {}
    for folder in (float8_dir, copy):
        records = [json.loads(line) for line in (folder / "r" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 4, 5, 6]
        losses[folder] = [r["loss"] for r in records[3:6]], [r["loss"] for r in records[6:]]
    uninterrupted, again = losses[float8_dir]
    without = losses[copy][1]
    assert again == uninterrupted
    assert all(abs(a / b - 1) < 0.02 for a, b in zip(without, uninterrupted)), (without, uninterrupted)


@SIMULATES
def test_the_dry_run_simulates_float8_weights_gathered_in_float8_and_says_its_roofline_is_bf16s(capsys):
    """At world size 2 FSDP gathers each weight in float8: a quarter of the fp32 weights' bytes and half of
    bf16's, so the gathered parameters shrink; the dry run says that a roofline does not time float8."""
    import train as train_script

    base = ["--model=tiny", "--dry_run", "--world_size=2", "--batch_size=8", "--global_batch_size=16"]
    outputs, gathered = [], []
    for extra in ([], ["--float8=True"]):
        with pytest.raises(SystemExit) as exit_info:
            sys.exit(train_script.main([*base, "--compile=False", *extra]))
        out = capsys.readouterr().out
        assert exit_info.value.code == 0, out
        outputs.append(out)
        gathered.append(float(re.search(r"^  gathered parameters +([\d.]+) GB", out, re.M)[1]))
    assert gathered[1] < 0.75 * gathered[0], gathered
    assert "float8: its tensors simulated as torchao makes them" in outputs[1]
    assert "float8" not in outputs[0].replace("float8=False", "")


def test_a_run_without_float8_never_imports_torchao(tmp_path):
    """transformers would import torchao in every process that imports a model class, at a cost of seconds
    of CPU at each start (common/quiet.py); a training run, which builds the model, imports none of it."""
    import subprocess

    from conftest import REPO

    folders = [f"--log_dir={tmp_path}", f"--checkpoint_dir={tmp_path}"]
    args = [*TINY, "--max_steps=1", "--tensorboard=False", *folders]
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}  # and in any process it starts
    result = subprocess.run([sys.executable, str(REPO / "train.py"), *args], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert re.search(r"\| +transformers\.modeling_utils$", result.stderr, re.M)  # the models' machinery
    assert re.findall(r"^import time: .*\| +torchao\b.*$", result.stderr, re.M) == []
