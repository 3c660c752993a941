"""The loss that computes its gradients in the forward gives what a plain loop gives: full logits and
F.cross_entropy over the same transformers model, with accumulation, under FSDP and DDP."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import parse_options, validated
from torch.distributed.device_mesh import init_device_mesh

from run.model import build, presets, step
from run.model.loss import linear_cross_entropy


def plain_loss_and_gradients(model, micro_batches):
    """Full logits, F.cross_entropy, gradients accumulated over the micro-batches: nothing of train.py."""
    total = 0.0
    for tokens, targets in micro_batches:
        logits = model(input_ids=tokens).logits.flatten(0, 1).float()
        loss = F.cross_entropy(logits, targets.flatten()) / len(micro_batches)
        loss.backward()
        total += loss.item()
    return total, {name: p.grad for name, p in model.named_parameters()}


def full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


@pytest.mark.parametrize("sharding", ["full", "ddp"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-llama", "tiny-mixtral"])
def test_chunked_loss_and_gradients_equal_full_logits_cross_entropy(preset, sharding):
    from transformers import AutoModelForCausalLM

    cfg = parse_options(
        [f"--model={preset}", "--compile=False", f"--sharding={sharding}", "--mixed_precision=fp32"]
        + ["--activation_checkpointing=none", "--seq_length=40"]
    )
    config = presets.build_model_config(validated(cfg))
    generator = torch.Generator().manual_seed(0)
    micro_batches = [torch.randint(0, config.vocab_size, (2, 2, 40), generator=generator) for _ in range(2)]
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1,)) if sharding != "ddp" else None
        model = build.build_model(config, cfg, torch.device("cpu"), mesh)
        model = build.initialise(model, config, cfg)
        plain = AutoModelForCausalLM.from_config(config)
        plain.load_state_dict({k.removeprefix("module."): full(v) for k, v in model.state_dict().items()})
        total = 0.0
        for tokens, targets in micro_batches:  # 80 tokens: 5 chunks, or 3 with a partial one
            loss = step.model_loss(model, tokens, targets, chunk_tokens=16 if preset == "tiny" else 30)
            (loss / len(micro_batches)).backward()
            total += loss.item() / len(micro_batches)
        grads = {name.removeprefix("module."): full(p.grad) for name, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()
    plain_total, plain_grads = plain_loss_and_gradients(plain, micro_batches)
    assert total == pytest.approx(plain_total, rel=1e-6)
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_evaluation_gives_the_same_loss_and_keeps_no_gradients():
    hidden, weight = torch.randn(50, 8, requires_grad=True), torch.randn(30, 8, requires_grad=True)
    targets = torch.randint(0, 30, (50,))
    trained = linear_cross_entropy(hidden, weight, targets, chunk_tokens=7)
    with torch.no_grad():
        evaluated = linear_cross_entropy(hidden, weight, targets, chunk_tokens=7)
    assert trained.grad_fn is not None and evaluated.grad_fn is None
    expected = F.cross_entropy(hidden @ weight.t(), targets, reduction="sum")
    assert trained.item() == pytest.approx(expected.item(), rel=1e-6)
    assert evaluated.item() == pytest.approx(expected.item(), rel=1e-6)
