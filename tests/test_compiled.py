"""The path a GPU user runs by default, on CPU: torch.compile per block, activation checkpointing and bf16
parameters with fp32 reduction, over gloo with 2 processes."""

import functools

import pytest
import torch
from conftest import (
    TINY,
    assert_ran,
    assert_same_model,
    bare_model,
    launch,
    parse_options,
    read_metrics,
    run_training,
    together,
    validated,
)

from run import launch as run_launch
from run.health import stragglers
from run.model import build, presets, step
from run.stops import StopRequests

COMPILED = [*TINY, "--compile=True"]
# A CPU without native bf16 multiplies bf16 matrices on a slower path, 4 to 50 times slower than fp32.
NATIVE_BF16 = run_launch.native_bf16()
# Sized for a CPU without native bf16: 64 wide, 8 sequences of 64 tokens a step, a tenth of a second, so
# that a run's time is compilation's. Each run: (model, activation checkpointing, processes (0: a plain
# `python train.py`), steps, the least drop of the loss: half of what the same run achieves in fp32, eager;
# precision). The first is the default GPU path, op-level checkpointing in bf16 over 2 processes, wherever it
# runs; the second, compiled Llama blocks some of which are checkpointed whole, in bf16 where the CPU has it
# and in fp32 where bf16 is emulated and would only make it slower. Of the vocabulary padded to 64,
# tiny-llama's data uses 32 tokens: learning that alone takes the loss from ln 64 to ln 32.
COMPILED_RUNS = [
    (["--model=tiny", "--vocab_size=64", "--lr=1e-2"], "op", 2, 60, 0.7, "bf16"),  # fp32 eager: 4.15 -> 2.69
    (["--model=tiny-llama", "--vocab_size=32", "--lr=5e-3"], "selective", 0, 40, 0.45,
     "bf16" if NATIVE_BF16 else "fp32"),  # fp32 eager: 4.16 -> 3.24
]  # fmt: skip
SMALL = ["--n_embd=64", "--n_head=2", "--seq_length=64", "--batch_size=4", "--global_batch_size=8"]


@pytest.fixture(scope="module")
def compiled_runs(tmp_path_factory):
    """The runs of COMPILED_RUNS, launched together: checkpointing -> (log dir, result)."""
    folders = {run[1]: tmp_path_factory.mktemp("compiled") for run in COMPILED_RUNS}

    def run(model, checkpointing, nproc, steps, _, precision):
        options = [f"--activation_checkpointing={checkpointing}", f"--max_steps={steps}", "--warmup_steps=5"]
        args = [*COMPILED, *SMALL, *model, *options, f"--mixed_precision={precision}", "--run_name=compiled"]
        return run_training(folders[checkpointing], *args, "--ckpt_format=full", nproc=nproc, expect_ok=False)

    results = together(*[functools.partial(run, *compiled_run) for compiled_run in COMPILED_RUNS])
    return dict(zip(folders, zip(folders.values(), results)))


@pytest.mark.parametrize("model, checkpointing, nproc, steps, drop, precision", COMPILED_RUNS)
def test_compiled_run_with_checkpointing_learns_and_exports_clean_names(
    compiled_runs, model, checkpointing, nproc, steps, drop, precision
):
    from transformers import AutoModelForCausalLM

    tmp_path, result = compiled_runs[checkpointing]
    assert_ran(result)
    losses = [r["loss"] for r in read_metrics(tmp_path)]
    assert len(losses) == steps and losses[-1] < losses[0] - drop, losses
    said = result.stdout.count("warning: this CPU has no bf16 matrix instructions")
    assert said == (precision == "bf16" and not NATIVE_BF16), result.stdout[
        -3000:
    ]  # once, where bf16 is slow
    state = torch.load(tmp_path / "compiled" / f"step_{steps}" / "state_dict.pt", weights_only=True)["model"]
    assert not [name for name in state if "_orig_mod" in name or "_checkpoint_wrapped_module" in name]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "compiled" / "final_model")
    trained = type(exported)(exported.config)
    trained.load_state_dict(state)
    assert_same_model(exported, trained)


def test_compiled_fp32_losses_equal_eager_and_its_checkpoint_resumes_eager(train, tmp_path):
    common = [*TINY, "--mixed_precision=fp32", "--activation_checkpointing=op", "--max_steps=4"]
    together(
        lambda: train(tmp_path / "compiled", *common, "--compile=True", "--run_name=run"),
        lambda: train(tmp_path / "eager", *common, "--compile=False", "--run_name=run"),
    )
    compiled = [r["loss"] for r in read_metrics(tmp_path / "compiled")]
    eager = [r["loss"] for r in read_metrics(tmp_path / "eager")]
    assert compiled == pytest.approx(eager, rel=1e-4)
    resumed = train(
        tmp_path / "resumed",
        *common,
        "--compile=False",
        "--max_steps=6",
        "--run_name=run",
        f"--resume_from={tmp_path / 'compiled' / 'run' / 'step_4'}",
        nproc=0,  # and on one process
    )
    assert "at step 4" in resumed.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "resumed")] == [5, 6]


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama", "tiny-mixtral"])
def test_compiled_block_has_no_graph_break_and_compiles_once(preset, monkeypatch, tmp_path):
    """Each family's decoder block as build_model compiles it (op-level checkpointing, FSDP2's bf16 policy,
    the training's timing hooks): one graph with no break, shared by all 10 layers (more than dynamo's
    recompile limit of 8, past which a graph per layer would leave the rest eager), and nothing compiled
    again in steps 2 to 5. A break or a recompilation costs a GPU far more than a CPU. aot_eager traces
    forward and backward as inductor does, without generating code."""
    import itertools

    import torch.distributed as dist
    from torch._dynamo.utils import counters

    monkeypatch.chdir(tmp_path)  # validate creates the log and checkpoint folders
    cfg = parse_options(
        [f"--model={preset}", "--n_layer=10", "--mixed_precision=bf16", "--seq_length=32", "--batch_size=2"]
    )
    config = presets.build_model_config(validated(cfg))
    torch._dynamo.reset()
    counters.clear()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = run_launch.device_mesh(cfg, "cpu", 1, 1)
        model = build.build_model(config, cfg, torch.device("cpu"), mesh, backend="aot_eager")
        build.init_weights(model, config.initializer_range, config.num_hidden_layers, cfg.seed)
        stragglers.RankTimes(presets.decoder_layers(model), torch.device("cpu"), compiled=True)
        optimizer = step.build_optimizer(model, cfg, fused=False)
        tokens = torch.randint(0, config.vocab_size, (2, 33))
        batches = itertools.repeat((tokens[:, :-1], tokens[:, 1:]))
        compiled = []
        for _ in range(5):
            step.train_step(model, batches, optimizer, 1, cfg.grad_clip, StopRequests())
            compiled.append((dict(counters["frames"]), dict(counters["stats"])))
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
    assert dict(counters["graph_break"]) == {}
    assert compiled[0][1]["unique_graphs"] == 1, compiled[0]
    assert compiled[1:] == [compiled[0]] * 4


def test_compile_without_a_compiler_is_one_line_before_any_work(tmp_path):
    result = launch(
        "train.py",
        [f"--log_dir={tmp_path}", f"--checkpoint_dir={tmp_path}", *COMPILED, "--max_steps=2"],
        nproc=0,
        env={"CXX": str(tmp_path / "no-such-g++"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--compile=True cannot compile for cpu: it needs a C++ compiler" in lines[0], (
        result.stderr
    )
    assert "--compile=False" in lines[0]
    assert not list(tmp_path.glob("*/step_*"))


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama", "tiny-mixtral"])
def test_flops_per_token_agrees_with_the_flop_counter(preset):
    """A forward and backward of the plain model with eager attention and experts (plain matmuls, which the
    counter counts; it counts neither CPU SDPA kernels nor grouped matmuls), no activation checkpointing."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    cfg = parse_options([f"--model={preset}"])
    config = presets.build_model_config(presets.resolve_shape(cfg))
    config._attn_implementation = config._experts_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config)
    seq_length, batch = 128, 2
    tokens = torch.randint(0, config.vocab_size, (batch, seq_length))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=tokens).logits.float().logsumexp(-1).sum().backward()
    expected = presets.flops_per_token(model, config, seq_length) * batch * seq_length
    assert counter.get_total_flops() == pytest.approx(expected, rel=0.03)


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_chunked_loss_equals_the_plain_loss_and_its_gradients(preset):
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    cfg = parse_options([f"--model={preset}"])
    config = presets.build_model_config(presets.resolve_shape(cfg))
    model = AutoModelForCausalLM.from_config(config)
    tokens = torch.randint(0, config.vocab_size, (3, 50))
    targets = torch.randint(0, config.vocab_size, (3, 50))
    plain = F.cross_entropy(model(input_ids=tokens).logits.flatten(0, 1).float(), targets.flatten())
    plain.backward()
    plain_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    # 150 tokens: 9 full chunks and 6
    chunked = step.model_loss(model, tokens, targets, chunk_tokens=16)
    chunked.backward()
    assert chunked.item() == pytest.approx(plain.item(), rel=1e-6)
    for plain_grad, param in zip(plain_grads, model.parameters()):
        torch.testing.assert_close(param.grad, plain_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_hardware_flops_count_the_recomputation(mode, preset):
    """The dry run's hardware FLOPs: a checkpointed step with the chunked loss, counted (eager attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = parse_options(
        [
            f"--model={preset}",
            "--n_layer=4",
            "--compile=False",
            "--sharding=ddp",
            "--mixed_precision=fp32",
            f"--activation_checkpointing={mode}",
            "--seq_length=128",
        ]
    )
    shape = validated(cfg)
    config = presets.build_model_config(shape)
    config._attn_implementation = "eager"
    model = bare_model(config, cfg)
    build.init_weights(model, config.initializer_range, config.num_hidden_layers, cfg.seed)
    tokens = torch.randint(0, config.vocab_size, (2, 128))
    with FlopCounterMode(display=False) as counter:
        step.model_loss(model, tokens, tokens).backward()
    model_flops = presets.flops_per_token(model, config, 128)
    plain = presets.build_meta_model(config)
    expected = presets.hardware_flops_per_token(cfg, config, plain, model_flops) * tokens.numel()
    assert counter.get_total_flops() == pytest.approx(expected, rel=0.03)
