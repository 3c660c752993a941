"""A model or tokenizer folder a user names (train.py's --init_from and --tokenizer, sample.py's --init_from):
it must exist, hold weights, and need no code of its own, which this project never runs. Each is refused in
one line before transformers reads the folder."""

import json
import os

from common.errors import ConfigError
from common.options import quoted


def load_errors():
    """What transformers raises for a model folder it cannot load: an OSError (files missing), a ValueError
    (a config.json that is not JSON), huggingface_hub's StrictDataclassError or a TypeError (a field of the
    wrong type)."""
    from huggingface_hub.errors import StrictDataclassError

    return OSError, ValueError, TypeError, StrictDataclassError


def why_not_loaded(error):
    """transformers' reason, on one line, its start where it is long."""
    return quoted(" ".join(str(error).split()), 300)


def missing_folder(option, value):
    """A value written as a local path (a hub name is NAME or OWNER/NAME) must be an existing folder, and a
    folder must not need code of its own."""
    local = value.startswith((".", "/", "~")) or value.endswith("/") or value.count("/") > 1
    if local and not os.path.isdir(os.path.expanduser(value)):
        file = " (it is a file; give the folder holding it)" if os.path.isfile(value) else ""
        raise ConfigError(f"{option}={value}: no such folder{file}")
    refuse_remote_code(option, os.path.expanduser(value))


REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json")
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def check_weights(option, folder):
    """A local model folder holds weights in a file transformers reads: checked before the model is built."""
    if os.path.isdir(folder) and not any(os.path.isfile(os.path.join(folder, name)) for name in WEIGHT_FILES):
        raise ConfigError(
            f"{option}={folder} has a config.json but no weights ({', '.join(WEIGHT_FILES[::2])}); "
            f"give the folder save_pretrained wrote"
        )


def refuse_remote_code(option, folder):
    """A model or tokenizer whose config names classes of its own (auto_map) runs code from its folder:
    refused here, in one line, before transformers asks whether to run it."""
    for name in REMOTE_CODE_FILES if os.path.isdir(folder) else ():
        try:
            with open(os.path.join(folder, name)) as file:
                auto_map = json.load(file).get("auto_map")
        except (OSError, ValueError, AttributeError):
            continue  # transformers names a broken file
        if auto_map:
            classes = ", ".join(
                sorted(set(map(str, auto_map.values())) if isinstance(auto_map, dict) else [])
            )
            raise ConfigError(
                f"{option}={folder} needs code of its own ({name} maps to {classes or auto_map}), which this "
                f"repo never runs; use a folder of a model transformers knows (its own classes)"
            )
