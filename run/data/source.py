"""What --data and --tokenizer name: the kind of source (generated, a hub dataset, local token files, a
stream), the tokenizer of real data, and --prepare_only's token files."""

import os

from common.errors import ConfigError
from run.data import prepare

HUB_SOURCES = {
    "wikitext": ("hub", "Salesforce/wikitext", "wikitext-103-raw-v1"),
    "c4": ("stream", "allenai/c4", "en"),
}


def parse_source(args):
    """(kind, name, config) of --data; kind is dummy, hub or local (prepared token files) or stream."""
    if args.data == "dummy":
        return "dummy", None, None
    if args.data in HUB_SOURCES:
        source = HUB_SOURCES[args.data]
    elif args.data.startswith("hf:") and args.data[3:]:
        name, _, config = args.data[3:].partition(":")
        source = ("stream", name, config or None)
    elif os.path.exists(args.data):
        source = ("local", os.path.abspath(args.data), None)
    else:
        raise ConfigError(
            f"--data={args.data}: no such file or folder, and not one of dummy, wikitext, c4, "
            f"hf:NAME[:CONFIG]"
        )
    if source[0] != "hub" and os.path.exists(source[1]) and (kind := prepare.kernel_filesystem(source[1])):
        raise ConfigError(
            f"--data={args.data} is on the kernel's {kind} filesystem, a view of the running system and not "
            f"a corpus; give a file or folder of .txt, .jsonl or .parquet files"
        )
    if source[0] == "stream" and args.max_steps == -1:
        raise ConfigError(f"--data={args.data} is streamed and has no known length: set --max_steps")
    return source


def load_tokenizer(args):
    """The tokenizer of real data (None for dummy data); the model's vocabulary becomes its size."""
    if args.data == "dummy":
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, trust_remote_code=False)
    except (OSError, ValueError) as error:
        reason = str(error).splitlines()[0] if str(error).strip() else type(error).__name__
        if os.path.isdir(args.tokenizer):
            reason = reason if os.listdir(args.tokenizer) else "the folder is empty"
            raise ConfigError(
                f"--tokenizer={args.tokenizer}: cannot load the tokenizer in this folder ({reason}); it "
                f"needs what a tokenizer's save_pretrained writes (tokenizer.json, tokenizer_config.json)"
            ) from None
        raise ConfigError(
            f"cannot load tokenizer {args.tokenizer!r} ({reason}); "
            f"`python train.py --prepare_only --data={args.data} --tokenizer={args.tokenizer}` "
            f"on a machine with internet caches it"
        ) from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"tokenizer {args.tokenizer!r} has no EOS token to separate documents with")
    if args.vocab_size is not None and len(tokenizer) > args.vocab_size:
        raise ConfigError(
            f"tokenizer {args.tokenizer!r} has {len(tokenizer)} tokens, more than "
            f"--vocab_size={args.vocab_size}"
        )
    return tokenizer


def prepare_data(args, tokenizer):
    """--prepare_only: the token files of wikitext or a local corpus, by one process even under torchrun."""
    if int(os.environ.get("RANK", 0)) == 0:
        prepare.prepare_token_files(args, *parse_source(args), tokenizer)
    return 0
