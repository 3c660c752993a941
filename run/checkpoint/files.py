"""A checkpoint's files, checked before anything of them loads. Its manifest.json names every other file of
the step_N folder with its size and CRC-32 checksum; each named file must be a regular file of that folder
that matches its checksum. DCP's .metadata must be plain data whose storage entries lie inside files the
manifest lists, and a checkpoint's tensors must be the model's (state_match.py). Whatever fails is the
checkpoint's problem, in one line: a resume sets the checkpoint aside for the one before it, an export refuses
it."""

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch

from run.checkpoint.safe_load import (
    METADATA,
    UnsafeFile,
    load_file,
    open_regular,
    plain_name,
    read_metadata,
    storage_problem,
)
from run.checkpoint.state_match import model_difference, saved_entries, state_entries

MANIFEST = "manifest.json"
FULL = "state_dict.pt"

HASH_CHUNK = 64 << 20


def hash_threads():
    return max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def file_checksum(path):
    """Size and CRC-32 of the CRC-32s of the file's 64 MiB chunks, hashed on parallel threads (zlib releases
    the GIL). CRC-32 finds accidental corruption, which is what a checkpoint meets, at twice SHA-256's speed
    (2.0 against 1.0 GB/s a core here), so checksums cost a save a quarter of its time, not half. Only a
    regular file is read (a FIFO would block)."""
    with open_regular(path) as file, ThreadPoolExecutor(hash_threads()) as pool:
        size = os.fstat(file.fileno()).st_size

        def digest(offset):
            return zlib.crc32(os.pread(file.fileno(), HASH_CHUNK, offset)).to_bytes(4, "big")

        digests = pool.map(digest, range(0, size, HASH_CHUNK))
        return {"size": size, "crc32": f"{zlib.crc32(b''.join(digests)):08x}"}


def read_json(path):
    with open_regular(path) as file:
        return json.load(file)


def checkpoint_problem(path, rank=0, world_size=1, model=None):
    """None if path is a complete checkpoint whose files all match their checksums and hold plain data that
    keeps to its folder, and, given the model, hold its tensors; else the first problem found. Of several
    ranks, each checks its share of the files."""
    problem, files = None, {}
    try:
        files = read_json(os.path.join(path, MANIFEST))["files"]
        if not os.path.isfile(os.path.join(path, "trainer_state.json")):
            problem = "no trainer_state.json (a save cut short)"
        else:
            problem = manifest_problem(path, files, rank)
    except FileNotFoundError:
        problem = f"no {MANIFEST} (a save cut short, or written before checkpoints had checksums)"
    except UnsafeFile as error:
        problem = str(error)
    except (OSError, ValueError, KeyError, TypeError) as error:
        problem = f"unreadable {MANIFEST} ({' '.join(str(error).split())})"
    for name in sorted(files)[rank::world_size] if problem is None else []:
        file = os.path.join(path, name)
        try:
            checksum = file_checksum(file)
        except FileNotFoundError:
            problem = f"{file} is missing"
        except UnsafeFile as error:
            problem = str(error)
        except OSError as error:
            problem = f"{file} is unreadable ({error.strerror})"
        else:
            if checksum["size"] != files[name]["size"]:
                problem = f"{file} has {checksum['size']} bytes instead of {files[name]['size']} (truncated?)"
            elif checksum != files[name]:
                problem = f"{file} does not match its checksum (corrupt)"
        if problem or (problem := contents_problem(file, files, model)):
            break
    return problem


def contents_problem(file, files, model):
    """Why a checkpoint file would be refused, checked before anything loads it: DCP's metadata, and the
    pickles of torch.save, whose tensors load lazily (mmap): no tensor data is read."""
    name = os.path.basename(file)
    try:
        if name == METADATA:
            metadata = read_metadata(os.path.dirname(file))
            if problem := storage_problem(metadata, files):
                return f"{file} is refused: {problem}"
            saved = saved_entries(metadata)
        elif name.endswith(".pt"):
            state = load_file(file, mmap=True)
            if name != FULL or not model:
                return None
            if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
                return f"{file} holds no model state"
            saved = state_entries(state)
        else:
            return None
    except UnsafeFile as error:
        return str(error)
    except (OSError, RuntimeError, ValueError) as error:
        return f"{file} is unreadable ({str(error).strip().splitlines()[0]})"
    difference = model_difference(saved, model) if model else None
    return f"{file} {difference}" if difference else None


def manifest_problem(path, files, rank):
    """A manifest written by save() names each file of its folder with its size and checksum, the trainer
    state and the model's state among them, and every file a load reads; anything else is damage (or a
    change) that the checksums alone would let through."""
    entry = {"size": int, "crc32": str}
    if not isinstance(files, dict) or not all(
        isinstance(value, dict) and all(isinstance(value.get(key), kind) for key, kind in entry.items())
        for value in files.values()
    ):
        return f"{MANIFEST} has entries of the wrong type (damaged)"
    if outside := next((name for name in files if not plain_name(name)), None):
        return f"{MANIFEST} lists {outside!r}, which is not a file of the checkpoint's folder"
    if "trainer_state.json" not in files or not {METADATA, FULL} & set(files):
        return f"{MANIFEST} does not list the trainer state and the model state (damaged)"
    read = (FULL, METADATA, f"rank{rank}.pt")  # a load reads state_dict.pt if it is there, else .metadata
    if unlisted := next((n for n in read if n not in files and os.path.lexists(os.path.join(path, n))), None):
        return f"{os.path.join(path, unlisted)} is not listed in {MANIFEST}, so it is not checked"
    return None


def plain_tensor(tensor):
    """The plain tensor inside a tensor subclass that wraps one, sharing its storage; a DTensor whose shard is
    such a subclass, as the same DTensor of the plain shard. A float8 run's weights are such a subclass
    (torchao keeps the fp32 master weight in one that casts it as FSDP gathers it); saved as they are, a
    checkpoint would name torchao's class, which no run may unpickle (weights_only), and an export would not
    be plain weights."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        if type(local) is torch.Tensor:
            return tensor
        return DTensor.from_local(plain_tensor(local), tensor.device_mesh, tensor.placements, run_check=False,
                                  shape=tensor.shape, stride=tensor.stride())  # fmt: skip
    while type(tensor) is not torch.Tensor and hasattr(tensor, "__tensor_flatten__"):
        inner, _ = tensor.__tensor_flatten__()
        tensor = getattr(tensor, inner[0])
    return tensor


def plain_tensors(state):
    """A (nested) state dict with each tensor as plain_tensor makes it."""
    if isinstance(state, dict):
        return {key: plain_tensors(value) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(plain_tensors(value) for value in state)
    return plain_tensor(state) if isinstance(state, torch.Tensor) else state
