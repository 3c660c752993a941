"""Ways to change a trusted checkpoint on purpose, for tests/test_untrusted.py: storage entries that point
out of the step folder or past a file's end, FIFOs, another model's tensors, crafted metadata. Each tamper
takes a step folder (a copy of a trusted one) and changes it in place; .metadata is changed by reading it with
the project's own reader, changing its objects and pickling them again. tampered_run makes a run of them."""

import dataclasses
import json
import os
import pickle
import shutil

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from run.checkpoint.files import MANIFEST, file_checksum
from run.checkpoint.safe_load import read_metadata

WTE, WPE, LR = "model.transformer.wte.weight", "model.transformer.wpe.weight", "optimizer.param_groups.0.lr"


def replace(path, data):
    """Writes path anew: the copies share the trusted files' inodes (hard links), which must stay intact."""
    path.unlink(missing_ok=True)
    path.write_bytes(data)


def changed_metadata(change):
    def tamper(step):
        metadata = read_metadata(step)
        change(metadata, step)
        replace(step / ".metadata", pickle.dumps(metadata))

    return tamper


def locate(fqn, **location):
    """A change that moves the storage entry of fqn."""

    def change(metadata, step):
        index = next(index for index in metadata.storage_data if index.fqn == fqn)
        metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], **location)

    return changed_metadata(change)


def pipe_named_by_entries(step):
    os.mkfifo(step / "pipe")
    locate(WTE, relative_path="pipe")(step)


def shard_made_a_pipe(step):
    (step / "__0_0.distcp").unlink()
    os.mkfifo(step / "__0_0.distcp")


def pipe_in_manifest(step):
    os.mkfifo(step / "notes")


def resized(metadata, step):
    item = metadata.state_dict_metadata[WTE]
    item.size = item.chunks[0].sizes = torch.Size([600, 256])


def as_bytes(metadata, step):
    index = next(index for index in metadata.storage_data if index.fqn == WPE)
    metadata.storage_data[MetadataIndex(WPE)] = metadata.storage_data.pop(index)
    metadata.state_dict_metadata[WPE] = BytesStorageMetadata()


def foreign_optimizer_state(metadata, step):
    """The state of h.1's attention weights, renamed as that of an h.7 the model does not have."""
    old = "optimizer.state.transformer.h.1.attn.c_attn.weight."
    for name in [name for name in metadata.state_dict_metadata if name.startswith(old)]:
        new = name.replace(".h.1.", ".h.7.")
        metadata.state_dict_metadata[new] = metadata.state_dict_metadata.pop(name)
        index = next(index for index in metadata.storage_data if index.fqn == name)
        metadata.storage_data[MetadataIndex(new, index.offset)] = metadata.storage_data.pop(index)


def raw_metadata(data):
    def tamper(step):
        replace(step / ".metadata", data)

    return tamper


def unknown_layout(step):
    replace(step / ".metadata", (step / ".metadata").read_bytes().replace(b"torch.strided", b"torch.unknown"))


def three_layers(trusted):
    """The trusted step_4's state with a third layer (a copy of the second's tensors and optimizer state), as
    3-layer run would save it."""
    dcp_to_torch_save(trusted / "r" / "step_4", trusted / "plain.pt")
    state = torch.load(trusted / "plain.pt", weights_only=False)  # written just now by this test
    (trusted / "plain.pt").unlink()
    model, optimizer = state["model"], state["optimizer"]
    for part in model, optimizer["state"]:
        part.update({name.replace(".h.1.", ".h.2."): v for name, v in list(part.items()) if ".h.1." in name})
    for group in optimizer["param_groups"]:
        group["params"] += [name.replace(".h.1.", ".h.2.") for name in group["params"] if ".h.1." in name]
    return state


def another_model_sharded(state):
    def tamper(step):
        for name in (".metadata", "__0_0.distcp"):
            (step / name).unlink()
        dcp.save(state, checkpoint_id=step, no_dist=True)

    return tamper


def another_model_full(state):
    def tamper(step):
        for name in (".metadata", "__0_0.distcp"):
            (step / name).unlink()
        torch.save(state, step / "state_dict.pt")

    return tamper


def unlisted_full_state(state):
    def tamper(step):
        torch.save(state, step / "state_dict.pt")

    return tamper


# A pickle that sets an attribute of DCP's Metadata class itself, its default version, for the whole process:
# BUILD on the class, with a state of (None, {"version": "x"}).
BUILD_ON_METADATA_CLASS = (
    b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\nN}X\x07\x00\x00\x00versionX\x01\x00\x00\x00xs"
    b"\x86b."
)  # fmt: skip


def forge_listing(step, *extra):
    """The manifest recomputed over the regular files of step, listing extra names too (with made-up sums)."""
    names = sorted(name for name in os.listdir(step) if name != MANIFEST and (step / name).is_file())
    files = {name: file_checksum(step / name) for name in names}
    files.update({name: {"size": 0, "crc32": "00000000"} for name in extra})
    replace(step / MANIFEST, json.dumps({"files": files}).encode())


def link_shards(source, destination):
    """Copies a file, but links a shard: 22 MB each, in some 20 copies."""
    (os.link if source.endswith(".distcp") else shutil.copy2)(source, destination)


def tampered_run(trusted, tmp_path, cases):
    """A copy of the trusted run with step_5, step_6, ...: each a copy of step_4 changed by the tamper of a
    case (tamper, manifest), its manifest then forged ("forged"), kept (None), or forged listing one more."""
    run = tmp_path / "run"
    shutil.copytree(trusted, run, copy_function=link_shards)
    steps = []
    for number, (tamper, manifest) in enumerate(cases, start=5):
        step = run / "r" / f"step_{number}"
        shutil.copytree(run / "r" / "step_4", step, copy_function=link_shards)
        tamper(step)
        if manifest:
            forge_listing(step, *([] if manifest == "forged" else [manifest]))
        steps.append(step)
    return run, steps
