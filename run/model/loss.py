"""The output layer and the cross-entropy in one, chunk by chunk, with no logits kept and none recomputed.

The forward computes each chunk's logits, its loss and at once its gradients with respect to the hidden
states and the output weight (Liger-Kernel's fused linear cross-entropy, Apple's cut-cross-entropy); the
backward only scales them by the incoming gradient. So the step runs the output layer's matmuls once forward
and twice for the gradients, as a plain loop does, and the full fp32 logits never exist at once.
"""

import torch
import torch.nn.functional as F


def chunk_loss_and_gradients(hidden, weight, targets):
    """Summed cross-entropy of one chunk and its gradient with respect to the chunk's logits, in fp32."""
    # One fused kernel turns the logits, in the compute dtype, into fp32 log-probabilities: no fp32 copy of
    # the logits, no separate logsumexp and subtraction. The softmax is then their exp, in place.
    log_probs = F.log_softmax(hidden @ weight.t(), dim=-1, dtype=torch.float32)
    loss = -log_probs.gather(1, targets[:, None]).sum()
    grad_logits = log_probs.exp_()
    grad_logits[torch.arange(targets.numel(), device=targets.device), targets] -= 1
    return loss, grad_logits


class LinearCrossEntropy(torch.autograd.Function):
    """sum over tokens of cross_entropy(hidden @ weight.T, targets), chunk_tokens tokens at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens):
        grad_hidden = torch.empty_like(hidden)
        # Kept in the weight's dtype, as autograd would accumulate the chunks' gradients.
        grad_weight = torch.zeros_like(weight)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            h, t = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
            loss, grad_logits = chunk_loss_and_gradients(h, weight, t)
            total += loss
            grad_logits = grad_logits.to(hidden.dtype)
            torch.mm(grad_logits, weight, out=grad_hidden[start : start + chunk_tokens])
            # addmm's out= form, which FlopCounterMode counts (it misses addmm_)
            torch.addmm(grad_weight, grad_logits.t(), h, out=grad_weight)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_total.to(grad_hidden.dtype)
        return grad_hidden * scale, grad_weight * scale, None, None


def linear_cross_entropy(hidden, weight, targets, chunk_tokens):
    """Summed next-token cross-entropy of hidden (tokens x width) through the output weight (vocab x width).
    With gradients on, through LinearCrossEntropy; without (evaluation), chunk by chunk, the loss alone. A
    profile names its kernels by the range linear_cross_entropy (tests/perf/trace_summary.py)."""
    with torch.profiler.record_function("linear_cross_entropy"):
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            return LinearCrossEntropy.apply(hidden, weight, targets, chunk_tokens)
        return sum(
            F.cross_entropy((h @ weight.t()).float(), t, reduction="sum")
            for h, t in zip(hidden.split(chunk_tokens), targets.split(chunk_tokens))
        )
