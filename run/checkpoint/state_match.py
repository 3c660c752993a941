"""Whether a checkpoint holds this model's tensors: the names and shapes it recorded against those of the
state about to be loaded. DCP loads what the state asks for and ignores the rest, and a state_dict.pt holds
whatever was saved in it, so the checkpoint of another model (a layer more, another vocabulary) would load
in part and say nothing; here the difference is one line instead. Names are DCP's flattened ones, as a
sharded checkpoint records them: model.transformer.h.0.attn.c_attn.weight, optimizer.state.<name>.exp_avg."""

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

OPTIMIZER_STATE = "optimizer.state."
SHOWN = 3


def saved_entries(metadata):
    """{name: shape} of the tensors DCP's metadata records, None for a value it stores pickled."""
    items = metadata.state_dict_metadata.items()
    return {name: list(item.size) if type(item) is TensorStorageMetadata else None for name, item in items}


def state_entries(state):
    """{name: shape} of a (nested) state dict's tensors, flattened as DCP names them; None for other values.
    The shape of a DTensor is its whole shape, whatever this rank holds of it."""
    flat, _ = flatten_state_dict(state)
    return {
        name: list(value.shape) if isinstance(value, torch.Tensor) else None for name, value in flat.items()
    }


def difference(saved, expected):
    """None if saved holds exactly expected's entries with their shapes, in the parts of a state expected
    holds ("model", and "optimizer" unless it is left out); else the first difference, in one line."""
    parts = {name.split(".", 1)[0] for name in expected}
    saved = {name: shape for name, shape in saved.items() if name.split(".", 1)[0] in parts}
    if extra := [name for name in saved if name not in expected]:
        return f"has tensors the model does not: {listed(extra)}"
    if missing := [name for name in expected if name not in saved]:
        return f"lacks tensors the model has: {listed(missing)}"
    for name, shape in expected.items():
        if saved[name] != shape:
            if saved[name] is not None and shape is not None:
                return f"has {name} of shape {saved[name]}, the model's is {shape}"
            return f"has {name} as {kind(saved[name])}, where the model has {kind(shape)}"
    return None


def model_difference(saved, model):
    """saved against the model's tensors (a model on the meta device will do), and the optimizer state it
    holds against the model's parameters: for choosing a checkpoint, before any optimizer exists."""
    expected = state_entries({"model": model.state_dict()})
    if problem := difference(saved, expected):
        return problem
    names = {name.removeprefix("model.") for name in expected}
    states = [name for name in saved if name.startswith(OPTIMIZER_STATE)]
    if foreign := [state for state in states if parameter_of(state) not in names]:
        return f"has optimizer state of parameters the model does not have: {listed(foreign)}"
    return None


def parameter_of(optimizer_state):
    """The parameter an optimizer state is of: optimizer.state.transformer.wte.weight.exp_avg names
    transformer.wte.weight."""
    return optimizer_state.removeprefix(OPTIMIZER_STATE).rsplit(".", 1)[0]


def kind(shape):
    return "a pickled value" if shape is None else f"a tensor of shape {shape}"


def listed(names):
    """The first few names, sorted, and how many more there are."""
    names = sorted(names)
    more = f" ({len(names) - SHOWN} more)" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more
