"""Loading files that someone else may have written: a checkpoint on shared storage, a colleague's export.
Nothing they bring is unpickled beyond plain data, and nothing is read but regular files of the checkpoint's
own folder. torch.distributed.checkpoint reads its .metadata with plain pickle and the non-tensor values of a
state dict with torch.load(weights_only=False), either of which runs whatever code a crafted file names. Here
the first goes through an unpickler that admits only the classes DCP's metadata is made of, the second
through torch.load(weights_only=True), and a refused file is named in one line.

The metadata also says where each tensor lies: a file name, an offset and a length. Each must be a regular
file of the checkpoint's folder, each range inside it; and the tensors it lists must be the model's own (run/
state_match.py), or DCP would load the model's part of another model's checkpoint and say nothing.

The checksums in a checkpoint's manifest.json find accidents (a torn write, bit rot, a zeroed shard), not a
deliberate change: whoever can write the files can write their checksums too. This module is what keeps a
deliberately changed checkpoint from running code or reading beyond its folder."""

import contextlib
import dataclasses
import io
import os
import pickle
import re

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from common.files import UnsafeFile, open_regular, read_regular
from run.checkpoint.state_match import difference, saved_entries, state_entries

METADATA = ".metadata"

# What DCP's metadata is made of (torch 2.11 to 2.13): its dataclasses and memory-format enum, the storage
# location of each item, torch sizes, dtypes and layouts, and the checkpoint's path.
DCP_METADATA = "torch.distributed.checkpoint.metadata"
METADATA_CLASSES = {
    (DCP_METADATA, name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *((module, name) for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "PurePosixPath")),
}

# The objects a pickle may give a state to (BUILD): DCP's dataclasses, each from a dict of its own fields, and
# TensorProperties from the tuple its __setstate__ takes.
BUILT = (
    Metadata,
    TensorStorageMetadata,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    _StorageInfo,
)

# Far more than any run's metadata: it holds an entry per shard of each tensor, 145 bytes pickled, so that of
# a 1024-process run of an 8B model (873 sharded tensors with the optimizer's) is about 130 MB, which
# MetadataUnpickler reads in 80 s (0.6 s a MB).
METADATA_LIMIT = 1 << 30


class Refused(Exception):
    """A part of a checkpoint's file refused while DCP reads it; SafeReader names the file."""


def plain_name(name):
    """A name of a file inside a folder: no path, no way out of it."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


class MetadataUnpickler(pickle._Unpickler):
    """The pure-Python unpickler (three times slower than the C one, 0.6 s against 0.2 a MB of metadata)
    because only it lets BUILD be checked: a pickle may BUILD any object it holds, an admitted class or
    function too, and attributes set on those would change them for the whole process."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module, name):
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if is_dtype or (module, name) in METADATA_CLASSES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which checkpoint metadata never holds")

    def load_build(self):
        instance, state = self.stack[-2], self.stack[-1]
        allowed = False
        if type(instance) is TensorProperties:
            allowed = isinstance(state, tuple) and len(state) == 5
        elif type(instance) in BUILT:
            fields = {field.name for field in dataclasses.fields(instance)}
            allowed = isinstance(state, dict) and all(key in fields for key in state)
        if not allowed:
            described = getattr(instance, "__qualname__", None) or f"a {type(instance).__name__}"
            raise pickle.UnpicklingError(
                f"it sets attributes of {described}, which checkpoint metadata never does"
            )
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build


def read_metadata(folder):
    """The folder's DCP metadata, read through MetadataUnpickler and checked as plain data that keeps to the
    folder; UnsafeFile says why it is refused. It is read whole first: a pickle that declares more bytes
    than it holds then allocates no more than the file's size."""
    path = os.path.join(folder, METADATA)
    data = read_regular(path, METADATA_LIMIT)
    try:
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as error:  # whatever a crafted pickle makes the unpickler raise (MemoryError included)
        detail = " ".join(str(error).split())
        if not isinstance(error, pickle.UnpicklingError):  # the refusals above say what they refuse
            detail = f"{type(error).__name__}: {detail}" if detail else type(error).__name__
        raise UnsafeFile(f"{path} is refused, not unpickled: {detail}") from None
    if problem := metadata_problem(metadata):
        raise UnsafeFile(f"{path} is refused: {problem}")
    return metadata


def metadata_problem(metadata):
    """None if metadata is DCP's Metadata, each of its items a tensor or a value with a storage entry for each
    chunk, each entry a plain file name and a range; else what is wrong. A pickle may leave out any field."""
    if type(metadata) is not Metadata:
        return f"it holds {type(metadata).__name__}, not DCP's Metadata"
    items, storage = getattr(metadata, "state_dict_metadata", None), metadata.storage_data
    if not isinstance(items, dict) or not isinstance(storage, dict):
        return "its tables of items and storage are not dictionaries"
    if not isinstance(metadata.storage_meta, (StorageMeta, type(None))):
        return f"its storage_meta is {type(metadata.storage_meta).__name__}"
    for index, entry in storage.items():
        if problem := entry_problem(index, entry):
            return problem
    for name, item in items.items():
        if problem := item_problem(name, item, storage):
            return problem
    return None


def entry_problem(index, entry):
    name, offset, length = (getattr(entry, field, None) for field in ("relative_path", "offset", "length"))
    if type(index) is not MetadataIndex or not isinstance(getattr(index, "fqn", None), str):
        return f"a storage entry is indexed by {type(index).__name__}, not by a name and an offset"
    where = f"its entry for {index.fqn}"
    if type(entry) is not _StorageInfo:
        return f"{where} is {type(entry).__name__}, not a file and a range"
    if not plain_name(name):
        return f"{where} names {name!r}, which is not a file of its folder"
    if not all(type(number) is int and number >= 0 for number in (offset, length)):
        return f"{where} has offset {offset!r} and length {length!r}, not byte counts"
    if entry.transform_descriptors:
        return f"{where} needs transforms ({entry.transform_descriptors!r}), which this repo never writes"
    return None


def item_problem(name, item, storage):
    if not isinstance(name, str):
        return f"it has an item named {name!r}"
    if type(item) is BytesStorageMetadata:
        return None if MetadataIndex(name) in storage else f"its value {name} has no storage entry"
    if type(item) is not TensorStorageMetadata:
        return f"its item {name} is {type(item).__name__}, neither a tensor nor a value"
    size, chunks = getattr(item, "size", None), getattr(item, "chunks", None)
    if not isinstance(getattr(getattr(item, "properties", None), "dtype", None), torch.dtype):
        return f"its tensor {name} has no dtype"
    if not counts(size) or not isinstance(chunks, list):
        return f"its tensor {name} has size {size!r} and chunks {type(chunks).__name__}"
    for chunk in chunks:
        offsets, lengths = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if type(chunk) is not ChunkStorageMetadata or not counts(offsets, size) or not counts(lengths, size):
            return f"its tensor {name} has a chunk that is not offsets and sizes of its {len(size)} axes"
        if any(start + length > whole for start, length, whole in zip(offsets, lengths, size)):
            return f"its tensor {name} of size {list(size)} has a chunk past its end"
        if MetadataIndex(name, offsets) not in storage:
            return f"its tensor {name} has a chunk with no storage entry"
    return None


def counts(value, like=None):
    """value is a torch.Size of counts, with as many dimensions as like if given."""
    whole = isinstance(value, torch.Size) and all(type(n) is int and n >= 0 for n in value)
    return whole and (like is None or len(value) == len(like))


def storage_problem(metadata, files):
    """None if every storage entry of metadata lies inside a file that files (a manifest: name -> size)
    lists; else the first entry that does not."""
    for index, entry in metadata.storage_data.items():
        name, end = entry.relative_path, entry.offset + entry.length
        if name not in files:
            return f"its entry for {index.fqn} lies in {name}, which manifest.json does not list"
        if end > files[name]["size"]:
            return (
                f"its entry for {index.fqn} reads bytes {entry.offset} to {end} of {name}, which has "
                f"{files[name]['size']}"
            )
    return None


class RegularFiles(FileSystem):
    """DCP's file system, opening nothing but regular files, and remembering which it opened last."""

    opened = None

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        self.opened = path
        with open_regular(path) as stream:
            yield stream


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, given the metadata read_metadata checked, that opens only regular files and reads
    only ranges inside them, and names the file that holds a refused value."""

    def __init__(self, folder, metadata):
        super().__init__(folder)
        self.fs, self.metadata = RegularFiles(), metadata

    def _slice_file(self, file, sinfo):
        size = os.fstat(file.fileno()).st_size
        if (end := sinfo.offset + sinfo.length) > size:
            raise Refused(f"an item lies at bytes {sinfo.offset} to {end}, and it has {size}")
        return super()._slice_file(file, sinfo)

    def read_data(self, plan, planner):
        try:
            return super().read_data(plan, planner)
        except Refused as error:
            raise UnsafeFile(f"{self.fs.opened} is refused: {error}") from None

    def read_metadata(self, *args, **kwargs):
        if getattr(self.metadata, "storage_meta", None) is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, with the non-tensor values of a state dict (optimizer hyperparameters) loaded with
    weights_only=True."""

    def load_bytes(self, read_item, value: io.BytesIO):
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            value_name = read_item.dest_index.fqn
            raise Refused(f"its value {value_name} holds more than data{named(error)}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def named(error):
    """What torch.load(weights_only=True) refused, from its long message: ' (it names posix.system)'."""
    found = re.search(r"GLOBAL ([\w.]+)", str(error))
    return f" (it names {found.group(1)})" if found else ""


def load_sharded(state, folder, **kwargs):
    """dcp.load(state, checkpoint_id=folder) that unpickles nothing but plain data, reads nothing but the
    folder's regular files, and loads only a checkpoint whose tensors are state's, by name and shape;
    UnsafeFile names the file. DCP wraps a rank's exception in a CheckpointException, from which the refusal
    is taken back out; any other failure of a crafted shard is one line too."""
    metadata = read_metadata(folder)  # once: a second read could find another file
    if problem := difference(saved_entries(metadata), state_entries(state)):
        raise UnsafeFile(f"{os.path.join(folder, METADATA)} {problem}")
    try:
        dcp.load(state, storage_reader=SafeReader(folder, metadata), planner=SafePlanner(), **kwargs)
    except dcp.CheckpointException as error:
        failures = [failure for failure, _ in getattr(error, "failures", {}).values()]
        refusal = next((failure for failure in failures if isinstance(failure, UnsafeFile)), None)
        first = refusal or (failures[0] if failures else error)
        detail = " ".join(str(first).split()) or type(first).__name__
        raise UnsafeFile(detail if refusal else f"{folder} cannot be loaded: {detail}") from None


def load_file(path, **kwargs):
    """torch.load(path, weights_only=True) of a regular file; a file that names anything but tensors and
    plain data is refused in one line (torch's own message is a 20-line UnpicklingError)."""
    with open_regular(path) as file:
        try:  # by the name of the descriptor just checked, which a file swapped in since cannot take
            return torch.load(f"/proc/self/fd/{file.fileno()}", weights_only=True, **kwargs)
        except pickle.UnpicklingError as error:
            raise UnsafeFile(
                f"{path} is refused, not unpickled: it holds more than tensors{named(error)}"
            ) from None


def load_full(path, like):
    """The state in a state_dict.pt (--ckpt_format=full), memory-mapped, if its tensors are those of the
    state like, by name and shape."""
    state = load_file(path, mmap=True)  # the ranks of a node share one copy in the page cache
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise UnsafeFile(f"{path} holds no model state")
    try:
        saved = state_entries(state)
    except ValueError as error:  # names that collide once flattened: {"a.b": x, "a": {"b": y}}
        raise UnsafeFile(f"{path} holds no state dict ({error})") from None
    if problem := difference(saved, state_entries(like)):
        raise UnsafeFile(f"{path} {problem}")
    return state


def refused_weights(option, folder, error):
    """One line for pretrained weights in a pickle (pytorch_model.bin) that name more than tensors."""
    return (
        f"{option}={folder}: its weights are refused, not unpickled: they hold more than "
        f"tensors{named(error)}; use weights saved as safetensors, from a source you trust"
    )
