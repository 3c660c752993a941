"""Generate text from a trained model, as nanoGPT's sample.py does.

    python sample.py --init_from=checkpoints/<run_name>/final_model --prompt="The meaning of life"
    python sample.py --init_from=checkpoints/<run_name>/step_500      # any checkpoint, exported on the fly

A model trained on dummy data has no tokenizer: its prompt is token ids separated by spaces, and so is its
output. Options are --name=value, as in train.py.
"""

import os
import pickle
import sys
import tempfile

import torch

from common import options
from common.errors import ConfigError, fail
from common.model_folders import load_errors, refuse_remote_code, why_not_loaded
from common.quiet import torchao_for_float8_only
from run.checkpoint.export import export_checkpoint
from run.checkpoint.safe_load import refused_weights
from run.checkpoint.state_match import listed
from run.options import rebuild_model

# --help prints these options verbatim from this file; fmt: off keeps their comments aligned
# fmt: off
# Options, each overridden as --name=value
init_from: str = ""                 # an exported folder (final_model, export_step_N) or a step_N checkpoint
prompt: str = "\n"                  # text; token ids separated by spaces for a model without a tokenizer
num_samples: int = 3
max_new_tokens: int = 100
temperature: float = 0.8            # 0: greedy, the most likely token every time
top_k: int = 200                    # sample from the k most likely tokens only
seed: int = 1337
# fmt: on


def parse_args(argv):
    cfg = options.parse_args(argv, options.declared(__file__))
    if not cfg.init_from:
        raise ConfigError("--init_from is required: an exported folder or a step_N checkpoint folder")
    exported = os.path.isfile(os.path.join(cfg.init_from, "config.json"))
    checkpoint = os.path.isfile(os.path.join(cfg.init_from, "trainer_state.json"))
    if not exported and not checkpoint:
        raise ConfigError(
            f"--init_from={cfg.init_from} is neither an exported model (config.json) "
            f"nor a step_N checkpoint (trainer_state.json)"
        )
    if cfg.num_samples <= 0 or cfg.max_new_tokens <= 0 or cfg.temperature < 0 or cfg.top_k <= 0:
        raise ConfigError(
            "--num_samples, --max_new_tokens and --top_k must be positive, --temperature not negative"
        )
    if not 0 <= cfg.seed < 2**64:  # what torch.manual_seed takes
        raise ConfigError(f"--seed={cfg.seed} is out of range: give a whole number from 0 to {2**64 - 1}")
    return cfg


def generate(cfg, folder):
    from transformers import AutoTokenizer

    refuse_remote_code("--init_from", folder)
    try:
        model, report = load_model(folder)
    except pickle.UnpicklingError as error:
        raise ConfigError(refused_weights("--init_from", folder, error)) from None
    except load_errors() as error:
        raise ConfigError(
            f"--init_from={folder}: cannot load the model ({why_not_loaded(error)}); it needs the "
            "config.json and model.safetensors that training exports"
        ) from None
    refuse_another_model(folder, report)
    has_tokenizer = os.path.isfile(os.path.join(folder, "tokenizer_config.json"))
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False) if has_tokenizer else None
    ids = prompt_ids(cfg, folder, model, tokenizer)
    torch.manual_seed(cfg.seed)
    sampling = (
        dict(do_sample=True, temperature=cfg.temperature, top_k=cfg.top_k)
        if cfg.temperature > 0
        else dict(do_sample=False)
    )
    with torch.no_grad():
        for _ in range(cfg.num_samples):
            output = model.generate(
                ids,
                max_new_tokens=cfg.max_new_tokens,
                use_cache=True,
                pad_token_id=model.config.eos_token_id,
                **sampling,
            )[0]
            print(tokenizer.decode(output) if tokenizer else " ".join(map(str, output.tolist())))
            print("---------------", flush=True)


def prompt_ids(cfg, folder, model, tokenizer):
    """--prompt as the model's token ids, checked to leave room for --max_new_tokens in its positions."""
    if tokenizer is not None:
        ids = tokenizer(cfg.prompt, return_tensors="pt").input_ids
        if ids.numel() == 0:
            raise ConfigError("--prompt is empty: give some text to continue (the default is a new line)")
    else:
        # the default prompt: the token that ends a document, which every document of the data follows
        tokens = cfg.prompt.split() or [str(model.config.eos_token_id or 0)]
        try:
            ids = torch.tensor([[int(token) for token in tokens]])
        except ValueError:
            raise ConfigError(
                f"{folder} has no tokenizer (no tokenizer_config.json), so --prompt must be token ids "
                f"separated by spaces, e.g. --prompt='1 2 3' (a model trained on dummy data has none; for "
                f"one trained on text, copy its tokenizer's files into the folder)"
            ) from None
        if ids.min() < 0 or ids.max() >= model.config.vocab_size:
            raise ConfigError(f"--prompt needs token ids between 0 and {model.config.vocab_size - 1}")
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions and ids.shape[1] >= positions:
        raise ConfigError(
            f"--prompt is {ids.shape[1]} tokens, and the model holds {positions} positions in all: shorten "
            f"the prompt to leave room for the tokens it writes"
        )
    if positions and ids.shape[1] + cfg.max_new_tokens > positions:
        raise ConfigError(
            f"--max_new_tokens={cfg.max_new_tokens} after a prompt of {ids.shape[1]} tokens passes the "
            f"model's {positions} positions; use at most {max(0, positions - ids.shape[1])}"
        )
    return ids


def load_model(folder):
    """The model of an exported folder and transformers' report of how its weights matched its config.json.
    transformers starts a tensor the weights lack from random values and stops at one of another shape with a
    traceback; both are left to refuse_another_model, and its own report is not printed."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        model, report = AutoModelForCausalLM.from_pretrained(
            folder, output_loading_info=True, ignore_mismatched_sizes=True, trust_remote_code=False
        )
    finally:
        transformers_logging.set_verbosity(verbosity)
    return model.eval(), report


def refuse_another_model(folder, report):
    """One line if the weights are not exactly those the config.json describes: the two are of different
    models, and sampling would run a model partly made of random values."""
    if missing := report["missing_keys"]:
        difference = f"its weights lack tensors its config.json asks for: {listed(missing)}"
    elif unexpected := report["unexpected_keys"]:
        difference = f"its weights have tensors its config.json has no place for: {listed(unexpected)}"
    elif mismatched := sorted(report["mismatched_keys"]):
        name, saved, expected = mismatched[0]
        difference = (
            f"its weights hold {name} of shape {list(saved)}, and its config.json asks for {list(expected)}"
        )
    else:
        return
    raise ConfigError(
        f"--init_from={folder}: {difference}; the two are of different models: give the config.json its "
        f"weights were exported with"
    )


def main(argv):
    if {"-h", "--help"} & set(argv):
        return options.print_help(sys.modules[__name__])
    torchao_for_float8_only()  # before any model class: see common/quiet.py
    try:
        cfg = parse_args(argv)
        if os.path.isfile(os.path.join(cfg.init_from, "config.json")):
            generate(cfg, cfg.init_from)
        else:
            with tempfile.TemporaryDirectory() as scratch:
                checkpoint = os.path.normpath(cfg.init_from)
                generate(cfg, export_checkpoint(checkpoint, rebuild_model, f"{scratch}/model", "--init_from"))
    except ConfigError as error:
        fail(error)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
