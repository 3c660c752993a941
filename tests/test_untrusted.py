"""A checkpoint or export that someone changed on purpose runs nothing when it is loaded: the attack is built
for real (a pickle that would create a marker file, the manifest's checksums recomputed with the project's own
function, as anyone can) and every way of loading a checkpoint is tried on it."""

import json
import os
import pickle
import shutil

import pytest
import torch
from conftest import TINY, launch, together

from run.checkpoints import MANIFEST, file_checksum

RUN = [*TINY, "--seq_length=32", "--max_steps=4", "--checkpoint_every=2", "--run_name=r"]


class Payload:
    """Unpickled, it creates the marker file: what an attacker's pickle would do with a worse command."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def trusted(tmp_path_factory):
    """A finished one-process run with checkpoints at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("trusted")
    result = launch("train.py", [f"--log_dir={tmp}", f"--checkpoint_dir={tmp}", *RUN], nproc=0)
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp


def forge_manifest(step):
    """The manifest recomputed over the changed files, so that the checksums pass."""
    names = sorted(name for name in os.listdir(step) if name != MANIFEST)
    files = {name: file_checksum(step / name) for name in names}
    (step / MANIFEST).write_text(json.dumps({"files": files}))


def tamper_metadata(step, marker):
    (step / ".metadata").write_bytes(pickle.dumps(Payload(marker)))


def tamper_rank_file(step, marker):
    state = torch.load(step / "rank0.pt", weights_only=True)
    torch.save({**state, "rng": Payload(marker)}, step / "rank0.pt")


def tamper_optimizer_value(step, marker):
    """A value DCP stores as pickled bytes (the learning rate of a parameter group), saved anew with DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(step, step.parent / "plain.pt")
    state = torch.load(step.parent / "plain.pt", weights_only=False)  # written just now by this test
    (step.parent / "plain.pt").unlink()
    state["optimizer"]["param_groups"][0]["lr"] = Payload(marker)
    for name in os.listdir(step):
        if name == ".metadata" or name.endswith(".distcp"):
            (step / name).unlink()
    dcp.save(state, checkpoint_id=step, no_dist=True)


def attacked_copy(trusted, tmp_path, tamper):
    """A copy of the trusted run whose newest checkpoint, step_4, is tampered with; and the marker file."""
    shutil.copytree(trusted, tmp_path / "run")
    step, marker = tmp_path / "run" / "r" / "step_4", tmp_path / "marker"
    tamper(step, marker)
    forge_manifest(step)
    return tmp_path / "run", step, marker


def resume(folder):
    args = [f"--log_dir={folder}", f"--checkpoint_dir={folder}", *RUN, "--max_steps=6"]
    return lambda: launch("train.py", args, nproc=0)


def refusals(output):
    return [line for line in output.splitlines() if "is refused" in line]


@pytest.mark.parametrize(
    "tamper, refused",
    [(tamper_metadata, "step_4/.metadata is refused, not unpickled: it names posix.system"),
     (tamper_rank_file, "step_4/rank0.pt is refused, not unpickled: it holds more than tensors (it names "
                        "posix.system)")],
)  # fmt: skip
def test_a_tampered_checkpoint_is_set_aside_for_the_previous_one_and_runs_nothing(
    trusted, tmp_path, tamper, refused
):
    folder, step, marker = attacked_copy(trusted, tmp_path, tamper)
    result = resume(folder)()
    assert not marker.exists()
    assert result.returncode == 0, result.stderr[-3000:]
    [warning] = refusals(result.stdout)
    assert warning.startswith(f"warning: checkpoint {step} is unusable: {folder}/r/{refused}"), warning
    assert warning.endswith(f"falling back to {folder}/r/step_2")
    assert f"resumed from {folder}/r/step_2 at step 2" in result.stdout


def test_a_tampered_value_in_a_shard_is_refused_in_one_line_and_runs_nothing(trusted, tmp_path):
    folder, step, marker = attacked_copy(trusted, tmp_path, tamper_optimizer_value)
    result = resume(folder)()
    assert not marker.exists()
    assert result.returncode == 2
    [line] = [line for line in result.stderr.splitlines() if line.strip()]
    assert line == (
        f"error: not resuming: {step}/__0_0.distcp is refused: its value optimizer.param_groups.0.lr holds "
        "more than data (it names posix.system)"
    )


def test_export_and_sample_refuse_a_tampered_checkpoint_and_run_nothing(trusted, tmp_path):
    folder, step, marker = attacked_copy(trusted, tmp_path, tamper_metadata)
    exported, sampled = together(
        lambda: launch("train.py", [f"--export_from={step}"], nproc=0),
        lambda: launch("sample.py", [f"--init_from={step}", "--max_new_tokens=2"], nproc=0),
    )
    assert not marker.exists()
    for result, option in (exported, "--export_from"), (sampled, "--init_from"):
        assert result.returncode == 2, result.stderr[-3000:]
        assert result.stderr.strip() == (
            f"error: {option}={step} is unusable: {step}/.metadata is refused, not unpickled: it names "
            "posix.system, which checkpoint metadata never holds"
        )
    assert not (step.parent / "export_step_4").exists()


def test_pretrained_weights_in_a_pickle_that_names_code_are_refused_in_one_line(tmp_path):
    from transformers import GPT2Config

    folder, marker = tmp_path / "pretrained", tmp_path / "marker"
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32).save_pretrained(folder)
    torch.save({"transformer.wte.weight": Payload(marker)}, folder / "pytorch_model.bin")
    trained, sampled = together(
        lambda: launch(
            "train.py",
            [*RUN, f"--init_from={folder}", f"--checkpoint_dir={tmp_path}", f"--log_dir={tmp_path}"],
            nproc=0,
        ),  # fmt: skip
        lambda: launch("sample.py", [f"--init_from={folder}", "--max_new_tokens=2"], nproc=0),
    )
    assert not marker.exists()
    for result in trained, sampled:
        assert result.returncode == 2, result.stderr[-3000:]
        [line] = [line for line in result.stderr.splitlines() if line.startswith("error")]
        assert line == (
            f"error: --init_from={folder}: its weights are refused, not unpickled: they hold more than "
            "tensors (it names posix.system); use weights saved as safetensors, from a source you trust"
        )
        assert "Traceback" not in result.stderr


def test_a_folder_that_needs_its_own_code_is_refused_before_transformers_asks(tmp_path, capsys):
    """transformers would prompt "Do you wish to run the custom code? [y/N]" and point to the hub."""
    from transformers import GPT2Config

    import train as train_script

    folder = tmp_path / "custom"
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "modeling.EvilConfig", "AutoModelForCausalLM": "modeling.EvilModel"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["tok.Evil", None]}})
    )
    capsys.readouterr()
    for argv, named in (
        ([f"--init_from={folder}"], "config.json maps to modeling.EvilConfig, modeling.EvilModel"),
        (["--data=train.py", f"--tokenizer={folder}"], "config.json maps to modeling.EvilConfig"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            train_script.main(argv)
        assert exit_info.value.code == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"error: {argv[-1]} needs code of its own ({named}"), line
    sampled = launch("sample.py", [f"--init_from={folder}"], nproc=0)
    assert sampled.returncode == 2 and sampled.stderr.strip().startswith(f"error: --init_from={folder} needs")
    assert "[y/N]" not in sampled.stdout + sampled.stderr


def test_a_model_folder_without_weights_is_refused_before_the_model_is_built(tmp_path, capsys):
    from transformers import GPT2Config

    import train as train_script

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32).save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        train_script.main([f"--init_from={tmp_path}"])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: --init_from={tmp_path} has a config.json but no weights (model.safetensors, "
        "pytorch_model.bin); give the folder save_pretrained wrote"
    ]
