"""Exports for transformers: the final model of a run, and any step_N checkpoint (--export_from), as a
save_pretrained folder that from_pretrained loads with no code from this repo."""

import os
import shutil
import warnings

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from common.errors import ConfigError, exit_after_the_speaker, fail
from run.checkpoint.checkpointer import save_error, save_errors, space_left
from run.checkpoint.files import FULL, checkpoint_problem, plain_tensors, read_json
from run.checkpoint.safe_load import UnsafeFile, load_full, load_sharded


def save_export(model, tokenizer, path):
    """A transformers folder (safetensors, config and the tokenizer of real data) that from_pretrained(path)
    loads with no code from this repo; written beside path and renamed once complete, removed if not."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a log file keeps every redraw of a bar; the run ends here
    temporary = path + ".tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    try:
        model.tie_weights()
        model.save_pretrained(temporary)
        if tokenizer is not None:
            tokenizer.save_pretrained(temporary)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    shutil.rmtree(path, ignore_errors=True)
    os.rename(temporary, path)
    print(f"model exported: {path}", flush=True)


def export_pretrained(model, plain_model, tokenizer, path, rank):
    """The final weights of the training model, gathered on rank 0 into plain_model (the same model built
    on the meta device, unwrapped), as a transformers folder. A failed write is one line, and every rank
    exits."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    state = plain_tensors(state)
    problem = [None]
    if rank == 0:
        try:
            plain_model.load_state_dict(state, assign=True)
            save_export(plain_model, tokenizer, path)
        except save_errors() as error:
            problem = [
                f"writing the export {path}.tmp failed ({save_error(error)}; "
                f"{space_left(os.path.dirname(path))}); the checkpoints are untouched. "
                f"Free space, then relaunch to export"
            ]
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        fail(problem[0]) if rank == 0 else exit_after_the_speaker()


def export_checkpoint(path, rebuild, destination=None, option="--export_from"):
    """Any step_N checkpoint, of either format, as a transformers folder (by default export_step_N beside
    it): one process, no GPU, no process group. Its files are checked against their checksums first; then
    rebuild(options, shape) (run/options.py's rebuild_model), given the options and shape the checkpoint
    records, builds the model on the meta device and its tokenizer, and the checkpoint is loaded if its
    tensors are that model's."""
    path = os.path.normpath(path)
    destination = destination or os.path.join(os.path.dirname(path), f"export_{os.path.basename(path)}")
    if not os.path.isfile(os.path.join(path, "trainer_state.json")):
        raise ConfigError(
            f"{option}={path} is not a complete checkpoint (no trainer_state.json); "
            f"give a step_N folder of <checkpoint_dir>/<run_name>"
        )
    if problem := checkpoint_problem(path):
        raise ConfigError(f"{option}={path} is unusable: {problem}")
    trainer_state = read_json(os.path.join(path, "trainer_state.json"))
    model, tokenizer = rebuild(trainer_state["config"], trainer_state["shape"])
    full_file = os.path.join(path, FULL)
    try:
        if os.path.exists(full_file):
            state = load_full(full_file, {"model": model.state_dict()})["model"]
        else:
            model.to_empty(device="cpu")
            state = model.state_dict()
            with warnings.catch_warnings():  # one process, on purpose
                warnings.filterwarnings("ignore", "torch.distributed is disabled")
                load_sharded({"model": state}, path, no_dist=True)
    except UnsafeFile as error:
        raise ConfigError(f"{option}={path} is unusable: {error}") from None
    model.load_state_dict(state, assign=True)
    try:
        save_export(model, tokenizer, destination)
    except save_errors() as error:
        raise ConfigError(
            f"writing the export {destination}.tmp failed ({save_error(error)}; "
            f"{space_left(os.path.dirname(destination))}); the checkpoint is untouched. Free space, then "
            f"export again"
        ) from None
    return destination
