"""float8 training (--float8): the decoder layers' linear layers compute in float8 with torchao, as torchtitan
does under FSDP2: tensorwise scales computed from each tensor as it is cast; over two ranks or more the
weights all-gathered in float8 (half of bf16's bytes), their scales computed for all of them in one
all-reduce after each optimizer step; the output layer, the embeddings and any layer whose sides are not
multiples of 16 left in bf16. The master weights stay in fp32 and keep their names and shapes, so a float8
run's checkpoint loads into a bf16 run and exports as one. GPT-2's Conv1D layers (weights stored input x
output) are computed as torchao's Float8Linear on the same tensor; Llama's nn.Linear layers are converted by
torchao itself. A mixture of experts' experts are grouped matmuls, not linear layers: they stay in bf16."""

import functools
import types

import torch

from common.errors import ConfigError
from common.quiet import torchao_for_float8_only

MIN_CAPABILITY = (8, 9)  # float8 matmuls on tensor cores: Ada (8.9), Hopper (9.0) and newer
ALIGNMENT = 16  # torch._scaled_mm's rule for both sides of a matmul


def check_float8_available():
    """ConfigError unless this machine can train in float8: a GPU of compute capability 8.9 or newer, and
    torchao importable. Called before anything is built."""
    if not torch.cuda.is_available():
        raise ConfigError(
            "--float8=True needs a GPU with float8 matmuls (H100, H200, L40S, B200); this machine has none: "
            "leave --float8 off"
        )
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        raise ConfigError(
            f"--float8=True needs compute capability 8.9 or newer (H100, H200, L40S, B200); "
            f"{torch.cuda.get_device_name()} has {capability[0]}.{capability[1]}: leave --float8 off"
        )
    import_torchao()


def import_torchao():
    """torchao's float8 training API."""
    torchao_for_float8_only()
    try:
        import torchao.float8
    except ImportError as error:
        raise ConfigError(f"--float8=True needs torchao ({error}): pip install -r requirements.txt") from None
    return torchao.float8


def convert_to_float8(model, float8_all_gather):
    """model's decoder linear layers swapped in place for float8 ones. float8_all_gather: FSDP2 gathers the
    weights from other ranks, in float8 (cast before the gather); otherwise each block casts its weights
    where it uses them, inside its compiled code. Returns the number of layers converted."""
    float8 = import_torchao()
    from torchao.float8.float8_linear import Float8Linear
    from transformers.pytorch_utils import Conv1D

    config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=float8_all_gather)
    output_layer = model.get_output_embeddings()
    converted = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if child is output_layer or not aligned(child):
                continue
            if isinstance(child, Conv1D):
                setattr(parent, name, float8_conv1d(child, config))
                converted += 1
            elif type(child) is torch.nn.Linear:
                setattr(parent, name, Float8Linear.from_float(child, config=config))
                converted += 1
    return converted


def aligned(module):
    """Whether module is a linear layer whose both sides are multiples of ALIGNMENT."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, Conv1D):
        sides = module.weight.shape
    elif type(module) is torch.nn.Linear:
        sides = (module.in_features, module.out_features)
    else:
        return False
    return all(side % ALIGNMENT == 0 for side in sides)


def float8_conv1d(conv1d, config):
    """A Float8Linear computing conv1d: its weight (input x output) is already the transposed weight that
    torchao's matmul takes, so it is used as it is, under the same name and shape. torchao's own from_float
    builds it (and wraps the weight for float8 all-gathers), given conv1d's sides as a linear layer's."""
    in_features, out_features = conv1d.weight.shape
    as_linear = types.SimpleNamespace(
        in_features=in_features, out_features=out_features, weight=conv1d.weight, bias=conv1d.bias
    )
    return float8_conv1d_class().from_float(as_linear, config=config)


@functools.cache
def float8_conv1d_class():
    """One class for every layer, so that the compiled code of one block serves them all."""
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

    class Float8Conv1D(Float8Linear):
        def forward(self, input):
            if torch.is_autocast_enabled("cuda"):  # DDP's bf16 (autocast), as Float8Linear does
                input = input.to(torch.get_autocast_dtype("cuda"))
            mm_config = self.linear_mm_config
            output = matmul_with_hp_or_float8_args.apply(input, self.weight, mm_config, self.config)
            return output + self.bias.to(output.dtype)

    return Float8Conv1D


def scales_kept_current(model, optimizer):
    """With float8 all-gathers, the scales of all the weights in one all-reduce after every optimizer step
    (torchao's precompute), rather than one all-reduce per weight in each all-gather; and after weights are
    loaded, so that a resumed step casts them with the scales the uninterrupted run would have."""
    from torch._subclasses.fake_tensor import is_fake

    float8 = import_torchao()
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    local = [getattr(p, "_local_tensor", p) for p in model.parameters()]
    if not any(isinstance(tensor, WeightWithDynamicFloat8CastTensor) for tensor in local):
        return  # no float8 all-gather: each cast takes its own scale

    def precompute(*_):
        if not is_fake(next(model.parameters())):  # a dry run's: no values to take a scale of
            float8.precompute_float8_dynamic_scale_for_fsdp(model)

    optimizer.register_step_post_hook(precompute)
    model.register_load_state_dict_post_hook(precompute)
