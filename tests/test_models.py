import functools
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import (
    REPO,
    SIMULATES,
    assert_ran,
    bare_model,
    parse_options,
    read_metrics,
    run_training,
    together,
    validated,
)

import train as train_script
from run.data.batches import dummy_window
from run.model import build, presets, step

# Published parameter counts (model cards and papers; GPT-2's with the vocabulary padded to 50304).
PUBLISHED = {
    "gpt2": 124e6,
    "gpt2-medium": 355e6,
    "gpt2-large": 774e6,
    "gpt2-xl": 1.558e9,
    "4b": 4.01e9,
    "llama2-7b": 6.74e9,
    "llama2-13b": 13.0e9,
    "llama2-70b": 69.0e9,
    "llama3.1-8b": 8.03e9,
    "llama3.1-70b": 70.6e9,
    "llama3.2-1b": 1.24e9,
    "llama3.2-3b": 3.21e9,
    "mistral-7b": 7.24e9,
    "mixtral-8x7b": 46.7e9,
}
DECODER_LAYERS = {
    "GPT2Config": "GPT2Block",
    "LlamaConfig": "LlamaDecoderLayer",
    "MistralConfig": "MistralDecoderLayer",
    "MixtralConfig": "MixtralDecoderLayer",
}
# tiny-llama with a global batch of 2 micro-steps on 2 processes, so accumulation is exercised too.
TINY_LLAMA = [
    "--model=tiny-llama",
    "--compile=False",
    "--batch_size=4",
    "--global_batch_size=16",
    "--seq_length=64",
    "--lr=3e-3",
    "--min_lr=1e-4",
    "--warmup_steps=2",
    "--log_every=1",
    "--max_steps=6",
    "--curves=False",
    "--predict=False",
]


def meta_model(*args):
    cfg = parse_options(list(args))
    config = presets.build_model_config(presets.resolve_shape(cfg))
    return presets.build_meta_model(config), config


@pytest.mark.parametrize("preset", presets.MODEL_PRESETS)
def test_preset_builds_on_meta_with_its_published_size(preset):
    model, config = meta_model(f"--model={preset}")
    n_params = sum(p.numel() for p in model.parameters())
    if preset in PUBLISHED:
        assert n_params == pytest.approx(PUBLISHED[preset], rel=0.01)
    else:  # the tiny CPU presets
        assert 1e6 < n_params < 5e6
    assert type(presets.decoder_layers(model)[0]).__name__ == DECODER_LAYERS[type(config).__name__]


def test_llama3_2_ties_embeddings_and_llama3_1_does_not():
    small, _ = meta_model("--model=llama3.2-1b")
    large, _ = meta_model("--model=llama3.1-8b")
    assert small.get_output_embeddings().weight is small.get_input_embeddings().weight
    assert large.get_output_embeddings().weight is not large.get_input_embeddings().weight


def test_shape_constants_override_every_family():
    model, config = meta_model(
        "--model=tiny-mixtral",
        "--n_embd=128",
        "--n_layer=3",
        "--n_head=2",
        "--n_positions=64",
        "--vocab_size=300",
    )
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (128, 3, 2)
    assert config.max_position_embeddings == 64 and config.vocab_size == 320  # padded to a multiple of 64
    assert len(presets.decoder_layers(model)) == 3 and config.num_local_experts == 4


def test_mfu_counts_the_active_experts_of_mixtral():
    """Mixtral 8x7B runs 12.9B of its 46.7B parameters per token; the input embedding is a lookup."""
    model, config = meta_model("--model=mixtral-8x7b")
    active = presets.flops_per_token(model, config, seq_length=0) / 6
    assert active == pytest.approx(12.9e9 - 32000 * 4096, rel=0.01)


def test_gpt2_flops_leave_out_only_the_position_embedding():
    model, config = meta_model("--model=4b")
    n_params = sum(p.numel() for p in model.parameters())
    expected = 6 * (n_params - 2048 * 3072) + 12 * 34 * 3072 * 2048
    assert presets.flops_per_token(model, config, seq_length=2048) == expected


MODES = [
    ["--sharding=ddp", "--activation_checkpointing=full"],
    ["--cpu_offload=True"],
    ["--activation_checkpointing=op"],
]


@pytest.fixture(scope="module")
def llama_runs(tmp_path_factory):
    """One FSDP run of tiny-llama with selective activation checkpointing, the reference of the other modes,
    and each mode of MODES run on 2 processes, then resumed on one for 2 more steps; started two at a time (a
    mode's resume after its run): "fsdp" or " ".join(mode) -> (log dir, [run, its losses, resumed run] or
    [run])."""
    folders = {name: tmp_path_factory.mktemp("llama") for name in ["fsdp", *map(" ".join, MODES)]}

    def fsdp():
        return [run_training(folders["fsdp"], *TINY_LLAMA, "--activation_checkpointing=selective")]

    def run_and_resume(mode):
        folder, args = folders[" ".join(mode)], [*TINY_LLAMA, *mode, "--run_name=mode"]
        run = run_training(folder, *args, expect_ok=False)
        losses = [r["loss"] for r in read_metrics(folder)] if run.returncode == 0 else None
        return [run, losses, run_training(folder, *args, "--max_steps=8", nproc=0, expect_ok=False)]

    results = together(fsdp, *[functools.partial(run_and_resume, mode) for mode in MODES])
    return {name: (folders[name], result) for name, result in zip(folders, results)}


@pytest.fixture(scope="module")
def fsdp_llama_losses(llama_runs):
    return [r["loss"] for r in read_metrics(llama_runs["fsdp"][0])]


def test_tiny_llama_learns_with_fsdp(fsdp_llama_losses):
    assert len(fsdp_llama_losses) == 6 and all(math.isfinite(loss) for loss in fsdp_llama_losses)
    assert fsdp_llama_losses[0] == pytest.approx(math.log(512), abs=0.3)
    assert fsdp_llama_losses[-1] < fsdp_llama_losses[0] - 0.2, fsdp_llama_losses


@pytest.mark.parametrize("mode", MODES)
def test_ddp_and_cpu_offload_compute_the_fsdp_losses(llama_runs, fsdp_llama_losses, mode):
    """Same initial weights (drawn whole, whatever the wrapping), same batches: the same losses."""
    folder, (run, losses, resumed) = llama_runs[" ".join(mode)]
    assert_ran(run)
    assert losses == pytest.approx(fsdp_llama_losses, rel=1e-4)
    assert_ran(resumed)
    assert "resumed from" in resumed.stdout and "at step 6" in resumed.stdout
    assert [r["step"] for r in read_metrics(folder)][-2:] == [7, 8]


def test_tiny_mixtral_learns_with_fsdp_as_in_one_process(tmp_path):
    """Expert weights are sharded like any other; one process accumulating 2 micro-steps computes the same."""
    args = [*TINY_LLAMA, "--model=tiny-mixtral", "--max_steps=4", "--global_batch_size=8"]
    together(
        lambda: run_training(tmp_path / "two", *args),
        lambda: run_training(tmp_path / "one", *args, nproc=0),
    )
    losses = [r["loss"] for r in read_metrics(tmp_path / "two")]
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0] and len(set(losses)) == 4, losses
    assert [r["loss"] for r in read_metrics(tmp_path / "one")] == pytest.approx(losses, rel=1e-5)


@pytest.mark.parametrize("tied, sharding", [(False, "full"), (True, "ddp")])
def test_init_from_starts_at_the_saved_models_loss(train, tmp_path, tied, sharding):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # A wide initialisation puts its loss far from the log(vocab) of a freshly initialised model.
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=128,
        initializer_range=0.2,
        tie_word_embeddings=tied,
    )
    pretrained = LlamaForCausalLM(config).eval()
    pretrained.save_pretrained(tmp_path / "pretrained")
    train(
        tmp_path / "logs",
        f"--init_from={tmp_path / 'pretrained'}",
        f"--sharding={sharding}",
        "--compile=False",
        "--batch_size=4",
        "--global_batch_size=8",
        "--seq_length=64",
        "--max_steps=1",
    )
    windows = [dummy_window(64, 300, train_script.seed, i) for i in range(8)]
    batch = torch.from_numpy(np.stack(windows))
    with torch.no_grad():
        logits = pretrained(input_ids=batch[:, :-1]).logits
    expected = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()
    assert abs(expected - math.log(300)) > 0.5
    assert read_metrics(tmp_path / "logs")[0]["loss"] == pytest.approx(expected, rel=1e-5)


def write_config(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


@SIMULATES
def test_config_file_sets_constants_and_flags_override_it(tmp_path, capsys):
    path = write_config(
        tmp_path, "model: tiny-llama\nbatch_size: 2\nlr: 1e-4\ncompile: false\nn_layer: null\n"
    )
    cfg = parse_options([f"--config={path}", "--batch_size=4"])
    assert (cfg.model, cfg.batch_size, cfg.lr, cfg.compile) == ("tiny-llama", 4, 1e-4, False)
    code = train_script.main(["--dry_run", f"--config={path}", "--global_batch_size=8", "--world_size=1"])
    assert code == 0
    out = capsys.readouterr().out
    assert "model=tiny-llama" in out and "batch_size=2 " in out and "global_batch_size=8 " in out


@pytest.mark.parametrize(
    "text, message",
    [
        ("batch_sise: 4\n", "run.yaml: unknown key 'batch_sise'; did you mean batch_size?"),
        ("batch_size: four\n", "run.yaml: batch_size expects an integer or 'auto', got 'four'"),
        ("batch_size: 2.5\n", "run.yaml: batch_size expects an integer or 'auto', got 2.5"),
        ("compile: 1.0\n", "run.yaml: compile expects true or false, got 1.0"),
        ("model: 7\n", "run.yaml: model expects a string, got 7"),
        ("- model\n", "run.yaml: expected a mapping of name: value, got list"),
    ],
)
def test_config_file_errors_are_one_line_naming_file_and_key(tmp_path, capsys, text, message):
    path = write_config(tmp_path, text)
    with pytest.raises(SystemExit) as exit_info:
        train_script.main([f"--config={path}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and str(tmp_path) in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--activation_checkpointing=some"],
            "--activation_checkpointing=some is not one of: none, full, op, selective",
        ),
        (["--sharding=ddp", "--cpu_offload=True"], "--cpu_offload=True needs FSDP"),
        (["--init_from=/nonexistent/model"], "--init_from=/nonexistent/model: "),
        (["--init_from={saved}", "--n_layer=2"], "brings its own shape; drop --n_embd"),
    ],
)
def test_bad_model_options_are_one_clear_line(args, message, capsys, tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, num_attention_heads=4).save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        train_script.main([arg.format(saved=tmp_path) for arg in args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("name", ["gpt2-4b-wikitext.yaml", "llama3.2-1b-c4.yaml"])
def test_example_configs_pass_the_checks(name, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no hub here: skip the request that would find out
    monkeypatch.chdir(tmp_path)  # the checks create the data cache, log and checkpoint folders
    cfg = parse_options([f"--config={REPO / 'configs' / name}"])
    assert validated(cfg).n_positions >= cfg.seq_length


@pytest.mark.parametrize("mode, wrapped", [("none", []), ("full", [0, 1, 2, 3]), ("selective", [1, 3])])
def test_activation_checkpointing_wraps_the_chosen_decoder_layers(mode, wrapped):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    cfg = parse_options(
        [
            "--model=tiny-llama",
            "--n_layer=4",
            "--compile=False",
            "--sharding=ddp",
            f"--activation_checkpointing={mode}",
            "--ac_every=2",
        ]
    )
    shape = validated(cfg)
    layers = bare_model(presets.build_model_config(shape), cfg).model.layers
    assert [i for i, layer in enumerate(layers) if isinstance(layer, CheckpointWrapper)] == wrapped


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_op_level_checkpointing_gives_the_plain_loss_and_gradients(preset):
    """One process: the blocks recompute what the policy did not save, and nothing else changes."""
    tokens, targets = torch.randint(0, 512, (2, 64)), torch.randint(0, 512, (2, 64))
    results = {}
    for mode in ("none", "op"):
        cfg = parse_options(
            [
                f"--model={preset}",
                "--compile=False",
                "--sharding=ddp",
                "--mixed_precision=fp32",
                f"--activation_checkpointing={mode}",
            ]
        )
        shape = validated(cfg)
        config = presets.build_model_config(shape)
        model = bare_model(config, cfg)
        build.init_weights(model, config.initializer_range, config.num_hidden_layers, cfg.seed)
        loss = step.model_loss(model, tokens, targets)
        loss.backward()
        results[mode] = loss.item(), [p.grad for p in model.parameters()]
    assert results["op"][0] == pytest.approx(results["none"][0], rel=1e-6)
    for with_op, without in zip(results["op"][1], results["none"][1]):
        torch.testing.assert_close(with_op, without, rtol=1e-5, atol=1e-7)


def test_an_init_from_config_with_a_field_of_the_wrong_type_is_one_line(tmp_path, capsys):
    """transformers checks a config's fields with an error that is neither an OSError nor a ValueError: it
    was a traceback."""
    from transformers import LlamaConfig

    import train as train_script

    LlamaConfig(hidden_size=64, num_attention_heads=4).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": "abc"}))
    with pytest.raises(SystemExit) as exit_info:
        train_script.main([f"--init_from={tmp_path}"])
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: --init_from={tmp_path}: ") and "'hidden_size' expected int" in line, line
