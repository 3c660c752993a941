"""Preparing token files: a corpus (wikitext or local .txt/.jsonl/.parquet files) tokenised once, on every
core of one node, into a flat file of token ids with a JSON sidecar; every rank then maps the same file.
Rank 0 prepares while the others wait."""

import codecs
import glob
import hashlib
import json
import os
import re
import stat
from datetime import timedelta

import numpy as np
import torch.distributed as dist

from common.errors import ConfigError
from common.files import no_links, temporary_beside, write_atomically

FILE_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def tokenize_documents(tokenizer, column):
    """A batched map function: each non-blank text becomes its token ids followed by EOS."""

    def tokenize(batch):
        texts = [text or "" for text in batch[column]]
        ids = tokenizer(texts, verbose=False)["input_ids"]
        eos = [tokenizer.eos_token_id]
        return {"input_ids": [doc + eos if text.strip() else [] for text, doc in zip(texts, ids)]}

    return tokenize


def token_dtype(tokenizer):
    return np.uint16 if len(tokenizer) <= 2**16 else np.uint32


def corpus_files(path):
    """The corpus's files: path itself, or the files under the folder. Anything but a regular file is refused
    before it is opened: a named pipe's open would wait forever for a writer."""
    found = [path] if not os.path.isdir(path) else glob.glob(os.path.join(path, "**", "*.*"), recursive=True)
    found = [name for name in found if name == path or not os.path.isdir(name)]
    for name in found:
        kind = not_a_regular_file(name)
        if kind:
            raise ConfigError(f"--data: {name} is {kind}, not a regular file; remove it from the corpus")
    return sorted(found)


# Filesystems the kernel makes up: their "files" are views of the running system, some endless, some that
# block on read, and walking one (/proc) takes minutes. Never a corpus.
KERNEL_FILESYSTEMS = {
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs",
    "configfs", "bpf", "pstore", "efivarfs", "mqueue", "hugetlbfs", "fusectl", "binfmt_misc", "autofs",
    "nsfs", "rpc_pipefs", "selinuxfs",
}  # fmt: skip


def kernel_filesystem(path):
    """The type of the kernel's filesystem path lies on (proc, sysfs, devtmpfs, ...), or None: the mount of
    /proc/self/mountinfo with the longest mount point that contains the path."""
    path, mounts = os.path.realpath(path), {}
    try:
        with open("/proc/self/mountinfo") as file:
            for line in file:
                fields, _, after = line.partition(" - ")
                point = re.sub(r"\\([0-7]{3})", lambda code: chr(int(code.group(1), 8)), fields.split()[4])
                mounts[point] = after.split()[0]  # mountinfo writes a space in a path as \040
    except (OSError, IndexError):
        return None
    inside = [point for point in mounts if path == point or path.startswith(point.rstrip("/") + "/")]
    kind = mounts[max(inside, key=len)] if inside else None
    return kind if kind in KERNEL_FILESYSTEMS else None


def not_a_regular_file(path):
    """What the path is when it is not a regular file (a link is judged by what it points to), else None."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a broken symbolic link" if os.path.islink(path) else "missing"
    kinds = {stat.S_ISFIFO: "a named pipe", stat.S_ISSOCK: "a socket", stat.S_ISCHR: "a character device",
             stat.S_ISBLK: "a block device"}  # fmt: skip
    return next((kind for test, kind in kinds.items() if test(mode)), None)


def check_text_file(path):
    """A text corpus file must be UTF-8 without NUL bytes: anything else would fail deep inside datasets,
    or be tokenised as if it were text."""
    decoder, offset, lines = codecs.getincrementaldecoder("utf-8")(), 0, 0
    with open(path, "rb") as file:
        while True:
            chunk = file.read(2**24)
            held = len(decoder.getstate()[0])  # the start of a character cut by the previous chunk's end
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as error:
                position = offset - held + error.start
                raise ConfigError(
                    f"--data: {path} is not UTF-8 text (invalid byte at offset {position}); "
                    f"convert it (iconv -t utf-8) or remove it"
                ) from None
            if (nul := chunk.find(b"\0")) >= 0:
                line = lines + chunk.count(b"\n", 0, nul) + 1
                raise ConfigError(
                    f"--data: {path} line {line} holds a NUL byte (offset {offset + nul}): not text; "
                    f"remove the line, or the file"
                )
            if not chunk:
                return
            offset += len(chunk)
            lines += chunk.count(b"\n")


def unreadable_file(files, extension, column):
    """Why datasets could not read the corpus, or read it with records that hold no text: its first file that
    does not parse, or the line of a JSON-lines file whose text field is not text; None when all is well."""
    import pyarrow.parquet as pq

    for path in files:
        if extension == ".parquet":
            try:
                pq.read_table(path)
            except Exception as error:  # pyarrow raises a different class for each kind of damage
                return f"{path} is not a readable parquet file ({str(error).splitlines()[0]})"
            continue
        with open(path, encoding="utf-8") as file:
            try:
                json.load(file)  # a .json file may hold one document rather than a record per line
                continue
            except ValueError:
                file.seek(0)
            for number, line in enumerate(file, 1):
                if not line.strip():
                    continue
                try:
                    why = text_problem(json.loads(line), column)
                except ValueError as error:
                    why = f"is not a JSON record ({error})"
                if why:
                    return f"{path} line {number} {why}"
    return None


JSON_KINDS = {type(None): "null", bool: "true or false", int: "a number", float: "a number", str: "a string",
              list: "a list", dict: "an object"}  # fmt: skip


def text_problem(record, column):
    """Why one parsed JSON line holds no text in column, or None when it does."""
    if not isinstance(record, dict):
        return f"is not a JSON record ({JSON_KINDS[type(record)]})"
    if column not in record:
        return f"has no text in its '{column}' field (missing)"
    if not isinstance(record[column], str):
        return f"has no text in its '{column}' field ({JSON_KINDS[type(record[column])]})"
    return None


def holds_non_text(split, column):
    """Whether a loaded JSON corpus's text column holds anything but strings (nulls, numbers)."""
    feature = split.features[column]
    return getattr(feature, "dtype", None) != "string" or split.data.column(column).null_count > 0


def load_document_splits(args, kind, name, config):
    """train and validation splits of wikitext or a local corpus, as map-style datasets."""
    from datasets import load_dataset
    from datasets.utils import logging as datasets_logging

    if kind == "hub":
        fix = (
            f" and nothing is prepared in {args.data_cache}; run `python train.py --prepare_only "
            f"--data={args.data} --tokenizer={args.tokenizer} --data_cache={args.data_cache}` on a machine "
            f"with internet"
        )
        splits = load_hub_dataset(args, name, config, fix)
    else:
        files = corpus_files(name)
        formats = sorted({os.path.splitext(path)[1] for path in files} & set(FILE_BUILDERS))
        if len(formats) != 1:  # datasets would silently read only the most common format
            found = f"mixes {', '.join(formats)}; keep one format per folder" if formats else ""
            raise ConfigError(f"--data={args.data} {found or 'has no .txt, .jsonl or .parquet file'}")
        if sum(os.path.getsize(path) for path in files) == 0:
            raise ConfigError(f"--data={args.data} holds no text")
        for path in files if formats[0] != ".parquet" else []:
            check_text_file(path)
        # In a folder, files named like train/validation/test become those splits (datasets' naming rules).
        where = dict(data_files=name) if os.path.isfile(name) else dict(data_dir=name)
        # datasets logs a traceback for a file it cannot parse before it raises; the file is named below
        verbosity = datasets_logging.get_verbosity()
        datasets_logging.set_verbosity(datasets_logging.CRITICAL)
        try:
            splits = load_dataset(FILE_BUILDERS[formats[0]], **where, cache_dir=hub_cache(args))
        except Exception:
            if formats[0] == ".txt" or not (why := unreadable_file(files, formats[0], args.text_column)):
                raise
            raise ConfigError(f"--data: {why}; fix or remove it") from None
        finally:
            datasets_logging.set_verbosity(verbosity)
        check_text_column(args, splits["train"].column_names)
        if formats[0] != ".txt" and any(holds_non_text(split, args.text_column) for split in splits.values()):
            why = unreadable_file(files, formats[0], args.text_column) or "a record holds no text"
            raise ConfigError(f"--data: {why}; fix or remove the line")
    if "validation" not in splits:
        if splits["train"].num_rows < 2:
            raise ConfigError(
                f"--data={args.data} holds fewer than 2 documents, too few to hold some out for validation"
            )
        # A fixed seed: the same share every run.
        held_out = splits["train"].train_test_split(test_size=args.val_fraction, seed=0)
        splits = {"train": held_out["train"], "validation": held_out["test"]}
    return splits


def hub_cache(args):
    """Where datasets keeps its downloads, its Arrow files and its lock files: under --data_cache, never in
    the user's ~/.cache, which a run was not told it may write to."""
    return os.path.join(args.data_cache, "hf")


def load_hub_dataset(args, name, config, fix, **options):
    """A dataset of the hub, whose train split must hold --text_column; when the hub cannot give it
    (unreachable, or not there), one line that ends with fix."""
    from datasets import load_dataset

    try:
        splits = load_dataset(name, config, cache_dir=hub_cache(args), **options)
    except OSError as error:  # unreachable (ConnectionError) or not there
        reason = str(error).splitlines()[0]
        raise ConfigError(f"cannot load {name} from the Hugging Face hub ({reason}){fix}") from None
    check_text_column(args, splits["train"].column_names)
    return splits


def check_text_column(args, columns):
    """columns: None where a stream does not know them before it is read."""
    if columns is not None and args.text_column not in columns:
        raise ConfigError(
            f"--text_column={args.text_column} is not a column of --data={args.data}; "
            f"columns: {', '.join(columns)}"
        )


def read_sidecar(path):
    """The sidecar of a complete token file; None when either is missing, truncated or corrupt."""
    try:
        with open(path + ".json") as file:
            meta = json.load(file)
        if os.path.getsize(path) != meta["tokens"] * np.dtype(meta["dtype"]).itemsize:
            return None
        digest = hashlib.blake2b()
        with open(path, "rb") as file:
            while chunk := file.read(2**26):
                digest.update(chunk)
        return meta if digest.hexdigest() == meta["blake2b"] else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def token_file_identity(path):
    """What a data position counts windows of: the prepared folder, token count and digest of a token file
    that prepare_token_files has just verified (from its sidecar)."""
    with open(path + ".json") as file:
        meta = json.load(file)
    return {
        "prepared": os.path.basename(os.path.dirname(path)),
        "tokens": meta["tokens"],
        "blake2b": meta["blake2b"],
    }


def prepare_token_files(args, kind, name, config, tokenizer):
    """Paths of the train and validation token files of wikitext or a local corpus, tokenised on every
    core of the node unless complete. Each is written under a temporary name and renamed, its sidecar
    last, so a file cut short by a crash is never taken for complete."""
    meta = {"source": name, "config": config, "text_column": args.text_column}
    meta.update(val_fraction=args.val_fraction, tokenizer=args.tokenizer, vocab=len(tokenizer))
    # The corpus files' sizes and times and the vocabulary are in the key: an edited corpus or tokenizer
    # is prepared anew.
    corpus = corpus_files(name) if kind == "local" else []
    files = [(f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in corpus]
    vocabulary = sorted(tokenizer.get_vocab().items())
    key = hashlib.sha256(json.dumps([meta, files, vocabulary]).encode()).hexdigest()[:12]
    folder = os.path.join(args.data_cache, f"{os.path.basename(name.rstrip('/'))}-{key}")
    paths = {split: os.path.join(folder, f"{split}.bin") for split in ("train", "validation")}
    if all(read_sidecar(path) for path in paths.values()):
        print(f"data: reusing prepared tokens in {folder}", flush=True)
        return paths
    print(f"data: tokenizing --data={args.data} with {args.tokenizer} into {folder}", flush=True)
    os.makedirs(folder, exist_ok=True)
    import pyarrow.compute as pc

    cores = len(os.sched_getaffinity(0))
    for split, documents in load_document_splits(args, kind, name, config).items():
        tokenize = tokenize_documents(tokenizer, args.text_column)
        workers, columns = min(cores, max(1, documents.num_rows // 1000)), documents.column_names
        label = f"tokenizing {split}"
        tokens = documents.map(tokenize, batched=True, remove_columns=columns, num_proc=workers, desc=label)
        digest, count = hashlib.blake2b(), 0
        with temporary_beside(paths[split]) as temporary:  # removed if anything below fails
            with open(temporary, "xb", opener=no_links) as file:
                for table in tokens.with_format("arrow").iter(batch_size=2**16):
                    ids = pc.list_flatten(table["input_ids"]).to_numpy().astype(token_dtype(tokenizer))
                    ids.tofile(file)
                    digest.update(ids)
                    count += len(ids)
            if count == 0:
                raise ConfigError(f"--data={args.data} holds no text in its {split} split")
            os.replace(temporary, paths[split])
        dtype = np.dtype(token_dtype(tokenizer)).name
        record = {**meta, "split": split, "tokens": count, "dtype": dtype, "blake2b": digest.hexdigest()}
        write_atomically(paths[split] + ".json", json.dumps(record))
    return paths


def shared_token_files(args, kind, name, config, tokenizer, rank):
    """Global rank 0 prepares; the others wait (for hours if need be) and get its paths or its error."""
    group = dist.new_group(backend="gloo", timeout=timedelta(hours=12))
    outcome = [None]
    if rank == 0:
        try:
            outcome = [prepare_token_files(args, kind, name, config, tokenizer)]
        except ConfigError as error:
            outcome = [error]
    dist.broadcast_object_list(outcome, src=0, group=group)
    if isinstance(outcome[0], ConfigError):
        raise outcome[0]
    return outcome[0]
