"""The model built for training: on the meta device, each decoder layer wrapped in activation checkpointing
and compiled, then sharded with FSDP2 (torchtitan's order) or replicated with DDP, and its weights allocated,
then initialised as GPT-2 is or loaded from pretrained weights."""

import math
import pickle

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from common.errors import fail
from run.checkpoint import safe_load
from run.model.float8 import convert_to_float8
from run.model.presets import build_meta_model, decoder_layers


@torch.no_grad()
def init_weights(model, std, n_layer, seed):
    """GPT-2's initialisation: N(0, 0.02) weights, residual projections (GPT-2's c_proj, Llama's o_proj and
    down_proj) scaled by 1/sqrt(2·n_layer), zero biases, unit norms. Each tensor is drawn whole from its
    own seeded generator and then sharded, so runs of every world size start from the same weights."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for index, (name, param) in enumerate(model.named_parameters()):
        if param.ndim == 1:
            full = torch.ones if name.endswith("weight") else torch.zeros  # norm weights; biases
            value = full(param.shape, device=param.device)
        else:
            residual = name.endswith(
                ("c_proj.weight", "o_proj.weight", "down_proj.weight", "experts.down_proj")
            )
            generator = torch.Generator(param.device).manual_seed(seed + index)
            scale = std / math.sqrt(2 * n_layer) if residual else std
            value = torch.randn(param.shape, generator=generator, device=param.device) * scale
        if isinstance(param, DTensor):
            shard = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(value)


def init_rotary_embeddings(model, device):
    """to_empty leaves the rotary embeddings' non-persistent inv_freq buffers uninitialised: a fresh
    module computes them, on the compute device even when parameters are offloaded to the CPU."""
    for module in model.modules():
        if hasattr(module, "inv_freq"):
            with torch.device(device):
                fresh = type(module)(module.config)
            for name, buffer in fresh.named_buffers():
                setattr(module, name, buffer)


def initialise(model, model_config, args):
    """Sets the model's weights: GPT-2's initialisation, the same on every rank, or the pretrained ones of
    --init_from, which rank 0 reads and hands to the others. Returns the model."""
    inner = getattr(model, "module", model)  # inside DDP's wrapper
    if args.init_from:
        load_pretrained(inner, args.init_from)
    else:
        init_weights(inner, model_config.initializer_range, model_config.num_hidden_layers, args.seed)
    return model


def load_pretrained(model, name_or_path):
    """Only rank 0 holds a full copy in host memory; set_model_state_dict broadcasts it and every rank
    keeps its shard."""
    from transformers import AutoModelForCausalLM

    weights = {}
    if dist.get_rank() == 0:
        try:
            weights = AutoModelForCausalLM.from_pretrained(
                name_or_path, dtype=torch.float32, trust_remote_code=False
            ).state_dict()
        except (
            pickle.UnpicklingError
        ) as error:  # the other ranks wait in the broadcast until torchrun ends them
            fail(safe_load.refused_weights("--init_from", name_or_path, error))
    broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, weights, options=broadcast)


def precision_policy(args):
    """FSDP's mixed precision for --mixed_precision=bf16: bf16 compute, fp32 master weights and gradient
    reduction. Inputs are not cast per block (torchtitan's choice): the embeddings already hand bf16 on."""
    if args.mixed_precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
    )


# Op-level selective checkpointing (torchtitan's "op" mode) keeps these outputs of every block and recomputes
# the rest: attention (the costliest to recompute per byte), every other matmul, and FSDP's reduce-scatter.
# GPT-2's Conv1D layers are addmm, Llama's linear layers mm (float8's too, as the policy sees them); float8's
# amax (max) is kept as torchtitan keeps it, rather than read over its input again.
MATMULS = {"aten.mm.default", "aten.addmm.default"}
SAVED_OPS = MATMULS | {
    "aten._scaled_dot_product_flash_attention.default", "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "_c10d_functional.reduce_scatter_tensor.default", "aten.max.default",
}  # fmt: skip


def op_level_checkpointing():
    """A context for one checkpointed forward and its recomputation: both count matmuls the same way, so
    the recomputation replays exactly the matmuls the forward did not save."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    matmuls_seen = {False: 0, True: 0}  # by is_recompute

    def policy(ctx, op, *args, **kwargs):
        name = str(op)
        if name in MATMULS:
            matmuls_seen[ctx.is_recompute] += 1
            if matmuls_seen[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if name in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def checkpointed(index, args):
    """Whether decoder layer index is wrapped in activation checkpointing, and with which context."""
    mode = args.activation_checkpointing
    if mode == "op":
        return {"context_fn": op_level_checkpointing}
    if mode == "full" or mode == "selective" and (index + 1) % args.ac_every == 0:
        return {}
    return None


def build_model(model_config, args, device, mesh, backend="inductor"):
    """The model wrapped for training (FSDP2, or DDP), weights allocated but not yet set (initialise follows).
    backend: the compiler of each block (the dry run's simulates inductor's)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = build_meta_model(model_config)
    if args.float8:  # weights gathered in float8 only where a gather moves them between ranks
        convert_to_float8(model, float8_all_gather=args.sharding != "ddp" and mesh.size(mesh.ndim - 1) > 1)
    blocks = decoder_layers(model)
    for index, block in enumerate(blocks):
        if (checkpoint_options := checkpointed(index, args)) is not None:
            block = checkpoint_wrapper(block, preserve_rng_state=False, **checkpoint_options)
        if args.compile:
            block.compile(backend=backend)
        blocks[index] = block
    if args.sharding == "ddp":
        model.to_empty(device=device)
        model.tie_weights()  # to_empty gave the tied modules a tensor each (fully_shard keeps them shared)
        init_rotary_embeddings(model, device)
        # DDP has no precision policy: autocast computes in bf16, the weights and gradients stay fp32, so the
        # all-reduce is fp32 as FSDP's reduction is.
        if args.mixed_precision == "bf16":
            model.forward = torch.autocast(device.type, dtype=torch.bfloat16)(model.forward)
        return torch.nn.parallel.DistributedDataParallel(model)
    fsdp_kwargs = dict(mesh=mesh, mp_policy=precision_policy(args))
    if args.cpu_offload:
        fsdp_kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in blocks:
        fully_shard(block, reshard_after_forward=args.sharding != "grad_op", **fsdp_kwargs)
    # Untied input embeddings are their own unit, freed after forward until the end of backward (1 GB
    # gathered at 8B, measured in docs/PERFORMANCE.md); tied ones are one tensor with the output layer.
    embeddings = model.get_input_embeddings()
    if embeddings.weight is not model.get_output_embeddings().weight:
        fully_shard(embeddings, reshard_after_forward=args.sharding != "grad_op", **fsdp_kwargs)
    # The root (embeddings, final norm, output layer) stays gathered after forward: the loss and the
    # backward need it at once.
    fully_shard(model, reshard_after_forward=False, **fsdp_kwargs)
    model.to_empty(device="cpu" if args.cpu_offload else device)
    init_rotary_embeddings(model, device)
    return model
