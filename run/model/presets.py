"""The model presets, published shapes without weights, and the transformers config and meta-device model a
run's shape options make of them; the decoder layers; FLOPs per token; each batch row one sequence."""

import copy
import difflib
import types

import torch

from common.errors import ConfigError
from common.model_folders import load_errors, missing_folder, why_not_loaded

# The presets are a table: the formatter leaves its layout alone.
# fmt: off
GPT2_VOCAB = 50257  # token ids of the gpt2 tokenizer
LLAMA2 = dict(vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5)
LLAMA3 = dict(vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, num_key_value_heads=8,
              rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                   high_freq_factor=4.0, original_max_position_embeddings=8192))
LLAMA3_2 = dict(LLAMA3, tie_word_embeddings=True,
                rope_parameters=dict(LLAMA3["rope_parameters"], factor=32.0))
# Mistral 7B v0.2's shape (v0.1's with rope theta 1e6 and no sliding window), which Mixtral 8x7B shares.
MISTRAL = dict(vocab_size=32000, max_position_embeddings=32768, rms_norm_eps=1e-5, hidden_size=4096,
               intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               sliding_window=None, rope_parameters=dict(rope_type="default", rope_theta=1e6))
TINY_LLAMA = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, vocab_size=512)
# A preset is a transformers config class and its arguments: the published shapes, no weights. GPT-2's
# 4b: 3072 wide (head size 128, the fast path of flash attention; a multiple of 256 for tensor-core
# tiles) and 34 layers give 4.01B parameters.
MODEL_PRESETS = {
    "tiny": ("GPT2Config", dict(n_embd=256, n_layer=2, n_head=4, n_positions=256, vocab_size=512)),
    "gpt2": ("GPT2Config", dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=GPT2_VOCAB)),
    "gpt2-medium": ("GPT2Config", dict(n_embd=1024, n_layer=24, n_head=16, n_positions=1024,
                                       vocab_size=GPT2_VOCAB)),
    "gpt2-large": ("GPT2Config", dict(n_embd=1280, n_layer=36, n_head=20, n_positions=1024,
                                      vocab_size=GPT2_VOCAB)),
    "gpt2-xl": ("GPT2Config", dict(n_embd=1600, n_layer=48, n_head=25, n_positions=1024,
                                   vocab_size=GPT2_VOCAB)),
    "4b": ("GPT2Config", dict(n_embd=3072, n_layer=34, n_head=24, n_positions=2048, vocab_size=GPT2_VOCAB)),
    "tiny-llama": ("LlamaConfig", dict(TINY_LLAMA, tie_word_embeddings=True)),
    "tiny-mixtral": ("MixtralConfig", dict(TINY_LLAMA, intermediate_size=256, num_local_experts=4,
                                           num_experts_per_tok=2)),
    "llama2-7b": ("LlamaConfig", dict(LLAMA2, hidden_size=4096, intermediate_size=11008,
                                      num_hidden_layers=32, num_attention_heads=32)),
    "llama2-13b": ("LlamaConfig", dict(LLAMA2, hidden_size=5120, intermediate_size=13824,
                                       num_hidden_layers=40, num_attention_heads=40)),
    "llama2-70b": ("LlamaConfig", dict(LLAMA2, hidden_size=8192, intermediate_size=28672,
                                       num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8)),
    "llama3.1-8b": ("LlamaConfig", dict(LLAMA3, hidden_size=4096, intermediate_size=14336,
                                        num_hidden_layers=32, num_attention_heads=32)),
    "llama3.1-70b": ("LlamaConfig", dict(LLAMA3, hidden_size=8192, intermediate_size=28672,
                                         num_hidden_layers=80, num_attention_heads=64)),
    "llama3.2-1b": ("LlamaConfig", dict(LLAMA3_2, hidden_size=2048, intermediate_size=8192,
                                        num_hidden_layers=16, num_attention_heads=32)),
    "llama3.2-3b": ("LlamaConfig", dict(LLAMA3_2, hidden_size=3072, intermediate_size=8192,
                                        num_hidden_layers=28, num_attention_heads=24)),
    "mistral-7b": ("MistralConfig", MISTRAL),
    "mixtral-8x7b": ("MixtralConfig", dict(MISTRAL, num_local_experts=8, num_experts_per_tok=2)),
}
# The shape constants in each family's own words (GPT2Config maps these to n_embd, n_layer, ...).
SHAPE_NAMES = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
               "n_positions": "max_position_embeddings", "vocab_size": "vocab_size"}
# fmt: on


def resolve_shape(args):
    """The model's transformers config class, its arguments (the preset's, or the init_from model's) and
    its shape with the shape constants applied."""
    import transformers

    if args.init_from:
        missing_folder("--init_from", args.init_from)
        try:
            pretrained = transformers.AutoConfig.from_pretrained(args.init_from, trust_remote_code=False)
        except load_errors() as error:
            raise ConfigError(f"--init_from={args.init_from}: {why_not_loaded(error)}") from None
        config_class, arguments = type(pretrained), pretrained.to_dict()
    elif args.model in MODEL_PRESETS:
        class_name, arguments = MODEL_PRESETS[args.model]
        config_class = getattr(transformers, class_name)
    else:
        close = difflib.get_close_matches(args.model, MODEL_PRESETS, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(f"--model={args.model} is not a preset; {hint}presets: {', '.join(MODEL_PRESETS)}")
    shape = {name: arguments[config_class.attribute_map.get(key, key)] for name, key in SHAPE_NAMES.items()}
    shape.update({name: getattr(args, name) for name in shape if getattr(args, name) is not None})
    return types.SimpleNamespace(
        config_class=config_class,
        arguments=arguments,
        pretrained=bool(args.init_from),
        names=tuple(shape),
        **shape,
    )


def padded_vocab(n_tokens):
    """Vocabulary rounded up to a multiple of 64: the output layer's matmul runs faster."""
    return (n_tokens + 63) // 64 * 64


def build_model_config(shape, tokenizer=None, vocab_size=None):
    """The transformers config: the preset's arguments with the shape constants applied and a vocabulary
    padded for speed (vocab_size, else the tokenizer's size), or the pretrained model's; SDPA attention,
    no dropout."""
    if tokenizer is not None:
        shape.vocab_size = vocab_size or len(tokenizer)
    defaults = shape.config_class().to_dict()
    arguments = dict(copy.deepcopy(shape.arguments), use_cache=False)
    # No dropout: modern pretraining does without it, and it keeps runs of any world size identical.
    dropouts = [k for k, v in defaults.items() if k.endswith(("pdrop", "dropout")) and isinstance(v, float)]
    arguments.update(dict.fromkeys(dropouts, 0.0))
    for key in ("bos_token_id", "eos_token_id"):  # GPT-2's default 50256 must fit the tiny vocabulary
        if isinstance(token := arguments.get(key, defaults.get(key)), int) and token >= shape.vocab_size:
            arguments[key] = shape.vocab_size - 1
    # A pretrained model keeps its shape and its vocabulary, whatever a tokenizer holds.
    if not shape.pretrained:
        names = shape.config_class.attribute_map
        arguments.update({names.get(key, key): getattr(shape, name) for name, key in SHAPE_NAMES.items()})
        arguments["vocab_size"] = padded_vocab(shape.vocab_size)
    model_config = shape.config_class.from_dict(arguments)
    model_config._attn_implementation = "sdpa"
    if tokenizer is not None:
        model_config.bos_token_id = model_config.eos_token_id = tokenizer.eos_token_id
    return model_config


def build_meta_model(model_config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)  # not a pretrained bf16


def decoder_layers(model):
    """The ModuleList of the family's own decoder-layer class, the unit transformers names for sharding; also
    once its layers are wrapped for checkpointing and sharded (fully_shard names the class FSDP<name>)."""

    def layer_class(layer):
        return type(getattr(layer, "_checkpoint_wrapped_module", layer)).__name__.removeprefix("FSDP")

    model = getattr(model, "module", model)  # inside DDP's wrapper
    lists = (m for m in model.modules() if isinstance(m, torch.nn.ModuleList))
    return next(m for m in lists if layer_class(m[0]) in model._no_split_modules)


def flops_per_token(model, model_config, seq_length):
    """6·N + 12·L·H·Q·T (PaLM appendix B, as torchtitan). N counts the weights of matmuls: a tied token
    embedding once, as the output layer, no lookup-only embedding (positions, untied input tokens), and
    of a mixture of experts the num_experts_per_tok of num_local_experts that each token runs through."""
    matmuls = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)} - matmuls
    active = getattr(model_config, "num_experts_per_tok", 1) / getattr(model_config, "num_local_experts", 1)
    weights = [(name, p) for name, p in model.named_parameters() if id(p) not in lookups]
    n_matmul = sum(p.numel() * (active if ".experts." in name else 1) for name, p in weights)
    layers, heads = model_config.num_hidden_layers, model_config.num_attention_heads
    return 6 * n_matmul + 12 * layers * heads * (model_config.hidden_size // heads) * seq_length


def hardware_flops_per_token(args, model_config, model, model_flops):
    """What the GPU computes per token, recomputation included. model_flops (6·N + 12·L·H·Q·T) is three
    forwards' worth; of one forward, the output layer is 2·vocab·width and attention 4·L·H·Q·T. The loss
    recomputes nothing (run/model/loss.py); full checkpointing every block's forward, selective every
    ac_every-th block's, op-level every other matmul (attention outputs are kept). A recomputation stops
    at the last tensor backward needs, so a block's last matmul, the MLP's output projection, is not
    redone."""
    layers = model_config.num_hidden_layers
    output_forward = 2 * model_config.vocab_size * model_config.hidden_size
    attention_forward = 4 * layers * model_config.hidden_size * args.seq_length
    active = getattr(model_config, "num_experts_per_tok", 1) / getattr(model_config, "num_local_experts", 1)
    layer = decoder_layers(model)[0]
    name, last = [(n, p) for n, p in layer.named_parameters() if p.ndim >= 2][-1]
    last_matmul = 2 * layers * last.numel() * (active if "experts" in name else 1)
    redone_forward = model_flops / 3 - output_forward - last_matmul
    recomputed = {
        "none": 0,
        "full": redone_forward,
        "selective": redone_forward * (layers // args.ac_every) / layers,
        "op": (redone_forward - attention_forward) / 2,
    }[args.activation_checkpointing]
    return model_flops + recomputed


def never_packed_sequences():
    """Every row of a batch is one window of a corpus, never several documents packed together. transformers
    asks each batch's position ids whether it is, at every forward: a device-to-host sync each time, and on
    fake tensors a full seq x seq mask that a real run never allocates. It has no option to say so, so its
    check is replaced, for the whole process, by one that answers none is."""
    import transformers.masking_utils

    transformers.masking_utils.find_packed_sequence_indices = lambda position_ids: None
