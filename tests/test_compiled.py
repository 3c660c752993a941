"""The path a GPU user runs by default, on CPU: torch.compile per block, activation checkpointing and bf16
parameters with fp32 reduction, over gloo with 2 processes."""

import functools

import pytest
import torch
from conftest import TINY, assert_ran, assert_same_model, launch, read_metrics, run_training, together

import train as train_script

COMPILED = [*TINY, "--compile=True"]
TINY_LLAMA = ["--model=tiny-llama", "--seq_length=64", "--batch_size=4", "--global_batch_size=16"]


BF16_RUNS = [([], "full"), (TINY_LLAMA, "selective")]  # (model, activation checkpointing)


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory):
    """30 compiled bf16 steps of each of BF16_RUNS, launched together: checkpointing -> (log dir, result)."""
    folders = {checkpointing: tmp_path_factory.mktemp("bf16") for _, checkpointing in BF16_RUNS}

    def run(model, checkpointing):
        options = ["--mixed_precision=bf16", f"--activation_checkpointing={checkpointing}", "--max_steps=30"]
        args = [*COMPILED, *model, *options, "--run_name=compiled", "--ckpt_format=full"]
        return run_training(folders[checkpointing], *args, expect_ok=False)

    results = together(*[functools.partial(run, *bf16_run) for bf16_run in BF16_RUNS])
    return dict(zip(folders, zip(folders.values(), results)))


@pytest.mark.parametrize("model, checkpointing", BF16_RUNS)
def test_compiled_bf16_run_with_checkpointing_learns_and_exports_clean_names(bf16_runs, model, checkpointing):
    from transformers import AutoModelForCausalLM

    tmp_path, result = bf16_runs[checkpointing]
    assert_ran(result)
    losses = [r["loss"] for r in read_metrics(tmp_path)]
    assert losses[-1] < losses[0] - 0.6, losses  # fp32 eager: 6.24 -> 5.04 in these 30 steps
    state = torch.load(tmp_path / "compiled" / "step_30" / "state_dict.pt", weights_only=True)["model"]
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
    )
    assert "at step 4" in resumed.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "resumed")] == [5, 6]


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

    cfg = train_script.parse_args([f"--model={preset}"])
    config = train_script.build_model_config(train_script.resolve_shape(cfg))
    config._attn_implementation = config._experts_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config)
    seq_length, batch = 128, 2
    tokens = torch.randint(0, config.vocab_size, (batch, seq_length))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=tokens).logits.float().logsumexp(-1).sum().backward()
    expected = train_script.flops_per_token(model, config, seq_length) * batch * seq_length
    assert counter.get_total_flops() == pytest.approx(expected, rel=0.03)


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_chunked_loss_equals_the_plain_loss_and_its_gradients(preset):
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    cfg = train_script.parse_args([f"--model={preset}"])
    config = train_script.build_model_config(train_script.resolve_shape(cfg))
    model = AutoModelForCausalLM.from_config(config)
    tokens = torch.randint(0, config.vocab_size, (3, 50))
    targets = torch.randint(0, config.vocab_size, (3, 50))
    plain = F.cross_entropy(model(input_ids=tokens).logits.flatten(0, 1).float(), targets.flatten())
    plain.backward()
    plain_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    # 150 tokens: 9 full chunks and 6
    chunked = train_script.model_loss(model, tokens, targets, chunk_tokens=16)
    chunked.backward()
    assert chunked.item() == pytest.approx(plain.item(), rel=1e-6)
    for plain_grad, param in zip(plain_grads, model.parameters()):
        torch.testing.assert_close(param.grad, plain_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_hardware_flops_count_the_recomputation(mode, preset):
    """The dry run's hardware FLOPs: a checkpointed step with the chunked loss, counted (eager attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = train_script.parse_args(
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
    shape = train_script.validate(cfg)
    config = train_script.build_model_config(shape)
    config._attn_implementation = "eager"
    model = train_script.build_model(config, cfg, torch.device("cpu"), mesh=None)
    train_script.init_weights(model, config.initializer_range, config.num_hidden_layers, cfg.seed)
    tokens = torch.randint(0, config.vocab_size, (2, 128))
    with FlopCounterMode(display=False) as counter:
        train_script.model_loss(model, tokens, tokens).backward()
    model_flops = train_script.flops_per_token(model, config, 128)
    plain = train_script.build_meta_model(config)
    expected = train_script.hardware_flops_per_token(cfg, plain, config, model_flops) * tokens.numel()
    assert counter.get_total_flops() == pytest.approx(expected, rel=0.03)
