"""Loading files that someone else may have written: a checkpoint on shared storage, a colleague's export.
Nothing they bring is unpickled beyond plain data. torch.distributed.checkpoint reads its .metadata with
plain pickle and the non-tensor values of a state dict with torch.load(weights_only=False), either of which
runs whatever code a crafted file names. Here the first goes through an unpickler that admits only the
classes DCP's metadata is made of, the second through torch.load(weights_only=True), and a refused file is
named in one line.

The checksums in a checkpoint's manifest.json find accidents (a torn write, bit rot, a zeroed shard), not a
deliberate change: whoever can write the files can write their checksums too. This module is what keeps a
deliberately changed checkpoint from running code."""

import io
import os
import pickle
import re

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

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


class UnsafeFile(Exception):
    """A file that would run code, or load anything but plain data, if it were unpickled."""


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if is_dtype or (module, name) in METADATA_CLASSES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which checkpoint metadata never holds")


def read_metadata(folder):
    """The folder's DCP metadata, read through MetadataUnpickler; UnsafeFile says why it is refused."""
    path = os.path.join(folder, METADATA)
    try:
        with open(path, "rb") as file:
            return MetadataUnpickler(file).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError) as error:
        detail = str(error).splitlines()[0] if str(error) else "damaged"
        raise UnsafeFile(f"{path} is refused, not unpickled: {detail}") from None


def metadata_problem(folder):
    """None if the folder has no DCP metadata or its metadata is plain data; else why it is refused."""
    try:
        read_metadata(folder)
    except FileNotFoundError:
        return None
    except UnsafeFile as error:
        return str(error)
    return None


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, with the metadata read through MetadataUnpickler, and a value SafePlanner refuses
    named with the file that holds it."""

    def _slice_file(self, file, sinfo):
        self.reading = sinfo.relative_path
        return super()._slice_file(file, sinfo)

    def read_data(self, plan, planner):
        try:
            return super().read_data(plan, planner)
        except UnsafeFile as error:
            raise UnsafeFile(f"{os.path.join(str(self.path), self.reading)} is refused: {error}") from None

    def read_metadata(self, *args, **kwargs):
        metadata = read_metadata(str(self.path))  # once: a second read could find another file
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, with the non-tensor values of a state dict (optimizer hyperparameters) loaded with
    weights_only=True."""

    def load_bytes(self, read_item, value: io.BytesIO):
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            raise UnsafeFile(
                f"its value {read_item.dest_index.fqn} holds more than data{named(error)}"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def named(error):
    """What torch.load(weights_only=True) refused, from its long message: ' (it names posix.system)'."""
    found = re.search(r"GLOBAL ([\w.]+)", str(error))
    return f" (it names {found.group(1)})" if found else ""


def load_sharded(state, folder, **kwargs):
    """dcp.load(state, checkpoint_id=folder) that unpickles nothing but plain data; UnsafeFile names the file.
    DCP wraps a rank's exception in a CheckpointException, from which the refusal is taken back out."""
    try:
        dcp.load(state, storage_reader=SafeReader(folder), planner=SafePlanner(), **kwargs)
    except dcp.CheckpointException as error:
        refusals = [e for e, _ in getattr(error, "failures", {}).values() if isinstance(e, UnsafeFile)]
        if refusals:
            raise UnsafeFile(str(refusals[0])) from None
        raise


def load_file(path, **kwargs):
    """torch.load(path, weights_only=True); a file that names anything but tensors and plain data is refused
    in one line (torch's own message is a 20-line UnpicklingError)."""
    try:
        return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as error:
        raise UnsafeFile(
            f"{path} is refused, not unpickled: it holds more than tensors{named(error)}"
        ) from None


def refused_weights(option, folder, error):
    """One line for pretrained weights in a pickle (pytorch_model.bin) that name more than tensors."""
    return (
        f"{option}={folder}: its weights are refused, not unpickled: they hold more than "
        f"tensors{named(error)}; use weights saved as safetensors, from a source you trust"
    )
