"""The training step, which the dry run simulates and the prediction measures too: the loss, AdamW, the
learning-rate schedule, clipping, evaluation."""

import contextlib
import math

import torch
import torch.distributed as dist

from run.model.float8 import scales_kept_current
from run.model.loss import linear_cross_entropy

LOSS_CHUNK_BYTES = 256e6  # the loss computes the fp32 logits of this many bytes at a time


def final_hidden_states(model, inputs):
    """The last decoder layer's output after the final norm, taken through the model's own forward (so that
    FSDP and DDP hooks run) with the output layer applied to no position."""
    captured = []

    def capture(_module, _inputs, output):
        captured.append(output.last_hidden_state)

    handle = getattr(model, "module", model).base_model.register_forward_hook(capture)
    try:
        model(input_ids=inputs, logits_to_keep=torch.empty(0, dtype=torch.long, device=inputs.device))
    finally:
        handle.remove()
    return captured[0]


def model_loss(model, inputs, targets, chunk_tokens=None):
    """Mean next-token cross-entropy. The output layer and the loss run over chunks of the tokens, each
    chunk's gradients computed in the forward (run/model/loss.py): the full fp32 logits, their log-softmax and
    gradient never exist together (a few GB at 4b and batch 8), and the backward recomputes nothing."""
    hidden = final_hidden_states(model, inputs).flatten(0, 1)
    targets = targets.flatten()
    output_layer = getattr(model, "module", model).get_output_embeddings()
    if chunk_tokens is None:  # fp32 logits of one chunk: LOSS_CHUNK_BYTES at most
        chunk_tokens = max(1, int(LOSS_CHUNK_BYTES // (4 * output_layer.out_features)))
    total = linear_cross_entropy(hidden, output_layer.weight, targets, chunk_tokens)
    return total / targets.numel()


def build_optimizer(model, args, fused):
    """AdamW; biases, norms and embeddings get no weight decay. Fused on GPUs; elsewhere foreach kernels,
    which take FSDP's DTensors a list at a time rather than one by one (half the optimizer's time at tiny
    sizes on CPU). With float8 all-gathers, each step ends with the weights' float8 scales."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    decay, no_decay = [], []
    for param in model.parameters():
        (decay if param.ndim >= 2 and id(param) not in embeddings else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(
        groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused, foreach=not fused
    )
    if args.float8:
        scales_kept_current(model, optimizer)
    return optimizer


def lr_factor(step, args, total_steps):
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, total_steps - args.warmup_steps))
    return (args.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (args.lr - args.min_lr)) / args.lr


def clip_gradients(parameters, max_norm):
    """The global gradient norm, and the gradients scaled to max_norm (0: not clipped). With foreach kernels
    over DTensors too, where clip_grad_norm_ falls back to one kernel per tensor (as torchtitan does)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, norm, foreach=True)
    return norm


def host_values(tensor):
    """The step's one device-to-host synchronisation. A simulated step's fake tensors hold no values."""
    from torch._subclasses.fake_tensor import is_fake

    return [0.0] * tensor.numel() if is_fake(tensor) else tensor.tolist()


def train_step(model, batches, optimizer, accumulation, grad_clip, stop_requests):
    """One optimizer step, as the training loop and the dry run's simulation both take it: per micro-batch a
    forward, the loss and a backward, then clipping and the update, skipped when the gradient norm is not
    finite. Under FSDP each micro-step reduce-scatters its gradients (as torchtitan does): skipping that
    would keep a whole unsharded fp32 gradient alive between micro-steps. DDP all-reduces on the last one.
    stop_requests (run/stops.py) is read as late as possible. Returns the mean loss (a device tensor), the
    gradient norm and whether any rank asked to stop."""
    loss = 0.0
    for micro in range(accumulation):
        inputs, targets = next(batches)
        defer_sync = isinstance(model, torch.nn.parallel.DistributedDataParallel) and micro < accumulation - 1
        with model.no_sync() if defer_sync else contextlib.nullcontext():
            micro_loss = model_loss(model, inputs, targets) / accumulation
            micro_loss.backward()
        loss += micro_loss.detach()
    grad_norm = clip_gradients(model.parameters(), grad_clip)
    stop = torch.full((), float(stop_requests.pending), device=grad_norm.device)
    dist.all_reduce(stop)  # any rank may get the signal; all stop at the same step
    grad_norm, stop = host_values(torch.stack([grad_norm, stop]))
    if math.isfinite(grad_norm):  # the norm is global, so every rank takes the same branch
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm, stop > 0


@torch.no_grad()
def evaluate(model, batches, n_batches, world_size):
    """Mean validation loss over n_batches micro-batches of every rank."""
    model.eval()
    total = sum(
        model_loss(model, inputs, targets) for inputs, targets in (next(batches) for _ in range(n_batches))
    )
    model.train()
    dist.all_reduce(total)
    return total.item() / (n_batches * world_size)
