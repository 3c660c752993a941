"""A checkpoint or export that someone changed on purpose runs nothing when it is loaded: the attack is built
for real (a pickle that would create a marker file, the manifest's checksums recomputed with the project's own
function, as anyone can) and every way of loading a checkpoint is tried on it."""

import collections
import json
import os
import pathlib
import pickle
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from checkpoint_tampering import (
    BUILD_ON_METADATA_CLASS,
    LR,
    WPE,
    WTE,
    another_model_full,
    another_model_sharded,
    as_bytes,
    changed_metadata,
    foreign_optimizer_state,
    locate,
    pipe_in_manifest,
    pipe_named_by_entries,
    raw_metadata,
    resized,
    shard_made_a_pipe,
    tampered_run,
    three_layers,
    unknown_layout,
    unlisted_full_state,
)
from conftest import REPO, TINY, launch, together
from torch.distributed.checkpoint.metadata import Metadata

from run.checkpoint.files import MANIFEST, file_checksum
from run.checkpoint.safe_load import UnsafeFile, read_metadata

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
    tampered = {path.name: path.read_bytes() for path in step.iterdir()}
    result = resume(folder)()
    assert not marker.exists()
    assert result.returncode == 0, result.stderr[-3000:]
    [warning] = refusals(result.stdout)
    assert warning.startswith(f"warning: checkpoint {step} is unusable: {folder}/r/{refused}"), warning
    [aside] = (folder / "r").glob("unusable_*/step_4")
    assert warning.endswith(f"; set aside as {aside}; falling back to {folder}/r/step_2")
    assert f"resumed from {folder}/r/step_2 at step 2" in result.stdout
    # The run saved its own step_4 since; the tampered one is kept as it was, for whoever looks into it (the
    # save replaced it).
    assert f"checkpoint saved: {step}" in result.stdout
    assert {path.name: path.read_bytes() for path in aside.iterdir()} == tampered


def test_a_relaunch_naming_a_checkpoint_set_aside_as_unusable_continues_the_run(trusted, tmp_path):
    """--resume_from names the tampered step_4: the launch sets it aside and goes on from step_2 to step 3.
    The same command again (a requeued job) goes on from the run's newest checkpoint, its last step, so it is
    finished; refused at once, it would stop every requeue, as the folder it names has gone."""
    folder, step, marker = attacked_copy(trusted, tmp_path, tamper_metadata)
    args = [
        f"--log_dir={folder}",
        f"--checkpoint_dir={folder}",
        *RUN,
        "--max_steps=3",
        f"--resume_from={step}",
    ]
    first = launch("train.py", args, nproc=0)
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"resumed from {folder}/r/step_2 at step 2" in first.stdout and not step.exists()
    again = launch("train.py", args, nproc=0)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (
        f"{step}: an earlier launch found it unusable and set it aside; continuing from this run's newest "
        "checkpoint"
    ) in again.stdout
    # its newest is the run's last step: the run is finished, and says so
    assert f"run r already finished at step 3 ({folder}/r/step_3); nothing to do." in again.stdout
    assert not marker.exists()


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


def hub_repo_with_code(cache, repo, marker):
    """A repository in a Hugging Face cache whose config and tokenizer name classes of its own, in code that
    creates the marker file when it runs."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    stored = cache / f"models--{repo.replace('/', '--')}"
    (stored / "refs").mkdir(parents=True)
    (stored / "refs" / "main").write_text(commit)
    snapshot = stored / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(
        json.dumps({"model_type": "evil", "auto_map": {"AutoConfig": "evil.C"}})
    )
    (snapshot / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["evil.T", None]}})
    )
    (snapshot / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nfrom transformers import PreTrainedConfig\n\n\n"
        "class C(PreTrainedConfig):\n    model_type = 'evil'\n\n\nclass T:\n    pass\n"
    )


def test_a_hub_model_or_tokenizer_that_needs_its_own_code_is_refused_without_asking(tmp_path):
    """A hub name is no folder to read before transformers does: transformers itself must refuse its code
    rather than ask "Do you wish to run the custom code? [y/N]", here answered y."""
    marker = tmp_path / "marker"
    hub_repo_with_code(tmp_path / "hub", "someone/with-code", marker)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    for option in ("--init_from", "--tokenizer"):
        prepare = ["--data=train.py", "--prepare_only", f"--data_cache={tmp_path / 'cache'}"]
        argv = [sys.executable, "train.py", f"{option}=someone/with-code", *prepare]
        result = subprocess.run(
            argv, cwd=REPO, env=env, input="y\n", capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 2 and not marker.exists(), result.stdout + result.stderr
        assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())
        [line] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert "someone/with-code" in line and "custom code" in line, line
        assert "[y/N]" not in result.stdout + result.stderr


def test_a_checkpoint_naming_a_tokenizer_that_needs_its_own_code_is_refused_in_one_line(trusted, tmp_path):
    """The options a checkpoint records (its checksums recomputed, as anyone can) are checked as a user's:
    a tokenizer folder that needs code of its own is refused, named as the checkpoint's."""
    shutil.copytree(trusted, tmp_path / "run")
    step, folder = tmp_path / "run" / "r" / "step_4", tmp_path / "custom"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["tok.E", None]}})
    )
    state = json.loads((step / "trainer_state.json").read_text())
    state["config"].update(data="train.py", tokenizer=str(folder))
    (step / "trainer_state.json").write_text(json.dumps(state))
    forge_manifest(step)
    sampled = launch("sample.py", [f"--init_from={step}"], nproc=0)
    assert sampled.returncode == 2, sampled.stderr[-2000:]
    [line] = sampled.stderr.strip().splitlines()
    assert line.startswith(
        f"error: the checkpoint's --tokenizer={folder} needs code of its own (tokenizer_"
    ), line


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


OUTSIDE, LISTED = "which is not a file of its folder", "which is not a file of the checkpoint's folder"
THIRD_LAYER = (
    "has tensors the model does not: model.transformer.h.2.attn.c_attn.bias, model.transformer.h.2.attn."
    "c_attn.weight, model.transformer.h.2.attn.c_proj.bias (9 more)"
)
FOREIGN = ", ".join(
    f"optimizer.state.transformer.h.7.attn.c_attn.weight.{s}" for s in ("exp_avg", "exp_avg_sq", "step")
)


def test_a_checkpoint_that_reads_beyond_its_files_or_holds_another_model_is_set_aside(trusted, tmp_path):
    """One resume meets each case in turn, newest first, and falls back through them all to step_4. A FIFO
    that were opened would hang it: the launch's timeout fails the test instead. Each problem is named after
    the step folder's path and a slash, or after "manifest.json"."""
    state = three_layers(trusted)
    cases = [
        (locate(WTE, relative_path="../step_2/__0_0.distcp"), "forged",
         f".metadata is refused: its entry for {WTE} names '../step_2/__0_0.distcp', {OUTSIDE}"),
        (locate(LR, relative_path="/dev/zero", length=3 << 30), "forged",
         f".metadata is refused: its entry for {LR} names '/dev/zero', {OUTSIDE}"),
        (pipe_named_by_entries, "forged",
         f".metadata is refused: its entry for {WTE} lies in pipe, which manifest.json does not list"),
        (shard_made_a_pipe, None, "__0_0.distcp is a FIFO, not a regular file"),
        (pipe_in_manifest, "notes", "notes is a FIFO, not a regular file"),
        (another_model_sharded(state), "forged", f".metadata {THIRD_LAYER}"),
        (another_model_full(state), "forged", f"state_dict.pt {THIRD_LAYER}"),
        (unlisted_full_state(state), None,
         "state_dict.pt is not listed in manifest.json, so it is not checked"),
        (changed_metadata(resized), "forged",
         f".metadata has {WTE} of shape [600, 256], the model's is [512, 256]"),
        (changed_metadata(as_bytes), "forged",
         f".metadata has {WPE} as a pickled value, where the model has a tensor of shape [256, 256]"),
        (changed_metadata(foreign_optimizer_state), "forged",
         f".metadata has optimizer state of parameters the model does not have: {FOREIGN}"),
        (locate(WTE, offset=-1), "forged",
         f".metadata is refused: its entry for {WTE} has offset -1 and length 525865, not byte counts"),
        (locate(WTE, length=1 << 50), "forged",
         f".metadata is refused: its entry for {WTE} reads bytes 33746 to 1125899906876370 of __0_0.distcp, "
         "which has 22055915"),
        (unknown_layout, "forged", ".metadata is refused, not unpickled: KeyError: 'torch.unknown'"),
        (raw_metadata(b"\x80\x04\x8e" + (1 << 40).to_bytes(8, "little") + b"x."), "forged",
         ".metadata is refused, not unpickled: EOFError"),  # 2**40 bytes declared, 2 there
        (raw_metadata(pickle.dumps(collections.OrderedDict())), "forged",
         ".metadata is refused: it holds OrderedDict, not DCP's Metadata"),
        (raw_metadata(pickle.dumps(pathlib.PosixPath("/etc"))), "forged",
         ".metadata is refused: it holds PosixPath, not DCP's Metadata"),
        (raw_metadata(BUILD_ON_METADATA_CLASS), "forged",
         ".metadata is refused, not unpickled: it sets attributes of Metadata, which checkpoint metadata "
         "never does"),
        (lambda step: None, "../step_2/__0_0.distcp",
         f"manifest.json lists '../step_2/__0_0.distcp', {LISTED}"),
        (lambda step: None, "/etc/hostname", f"manifest.json lists '/etc/hostname', {LISTED}"),
    ]  # fmt: skip
    folder, steps = tampered_run(trusted, tmp_path, [case[:2] for case in cases])
    args = [f"--log_dir={folder}", f"--checkpoint_dir={folder}", *RUN, "--max_steps=6"]
    result = launch("train.py", args, nproc=0, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stdout.splitlines() if line.startswith("warning: checkpoint")]
    [aside] = (folder / "r").glob("unusable_*")  # where each was set aside, before the run went on
    expected = []
    for step, previous, (_, _, problem) in zip(steps, [folder / "r" / "step_4", *steps], cases):
        named = problem if problem.startswith(MANIFEST) else f"{step}/{problem}"
        kept = f"set aside as {aside / step.name}"
        expected.append(
            f"warning: checkpoint {step} is unusable: {named}; {kept}; falling back to {previous}"
        )
    assert warnings == expected[::-1]
    assert sorted(path.name for path in aside.iterdir()) == sorted(step.name for step in steps)
    assert f"resumed from {folder}/r/step_4 at step 4" in result.stdout


def test_export_and_sample_refuse_a_checkpoint_beyond_its_files_or_of_another_model(
    trusted, tmp_path, capsys
):
    """--export_from checks the tensors as it loads them, against the model the checkpoint's own trainer state
    describes: the sharded checkpoint's in the load itself, the full one's before."""
    import train as train_script

    state = three_layers(trusted)
    cases = [
        (locate(WTE, relative_path="../step_2/__0_0.distcp"), "forged"),
        (shard_made_a_pipe, None),
        (another_model_sharded(state), "forged"),
        (another_model_full(state), "forged"),
    ]
    _, (outside, pipe, sharded, full) = tampered_run(trusted, tmp_path, cases)
    signal.alarm(60)  # a FIFO that were opened would hang the test
    try:
        for step, problem in (
            (outside, f"{outside}/.metadata is refused: its entry for {WTE} names '../step_2/__0_0.distcp'"),
            (pipe, f"{pipe}/__0_0.distcp is a FIFO, not a regular file"),
            (sharded, f"{sharded}/.metadata {THIRD_LAYER}"),
            (full, f"{full}/state_dict.pt {THIRD_LAYER}"),
        ):
            with pytest.raises(SystemExit) as exit_info:
                train_script.main([f"--export_from={step}"])
            assert exit_info.value.code == 2
            [line] = capsys.readouterr().err.strip().splitlines()
            assert line.startswith(f"error: --export_from={step} is unusable: {problem}"), line
            assert not (step.parent / f"export_{step.name}").exists()
    finally:
        signal.alarm(0)
    sampled = launch("sample.py", [f"--init_from={sharded}", "--max_new_tokens=2"], nproc=0, timeout=120)
    assert sampled.returncode == 2
    assert sampled.stderr.strip().startswith(
        f"error: --init_from={sharded} is unusable: {sharded}/.metadata {THIRD_LAYER}"
    )
    assert "Traceback" not in sampled.stderr


def test_a_pickle_that_sets_attributes_of_an_admitted_class_changes_nothing(tmp_path):
    (tmp_path / ".metadata").write_bytes(BUILD_ON_METADATA_CLASS)
    with pytest.raises(UnsafeFile, match="it sets attributes of Metadata"):
        read_metadata(tmp_path)
    assert Metadata.version is None  # the class default the pickle set to "x", for the whole process


def test_sample_refuses_a_config_of_another_model_and_a_seed_out_of_range(trusted, tmp_path, capsys):
    """An exported folder whose config.json has a layer more than its weights (transformers would fill it with
    random values and warn), or another vocabulary (a traceback)."""
    import sample

    exported = trusted / "r" / "final_model"
    cases = [
        ({"n_layer": 3}, "its weights lack tensors its config.json asks for: transformer.h.2.attn.c_attn."
                         "bias"),
        ({"vocab_size": 600}, "its weights hold transformer.wte.weight of shape [512, 256], and its config."
                              "json asks for [600, 256]"),
    ]  # fmt: skip
    for change, problem in cases:
        folder = tmp_path / next(iter(change))
        shutil.copytree(exported, folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(SystemExit) as exit_info:
            sample.main([f"--init_from={folder}", "--max_new_tokens=2"])
        assert exit_info.value.code == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"error: --init_from={folder}: {problem}"), line
        assert line.endswith(
            "the two are of different models: give the config.json its weights were exported with"
        )
    with pytest.raises(SystemExit) as exit_info:
        sample.main([f"--init_from={exported}", f"--seed={10**23}"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --seed={10**23} is out of range: give a whole number from 0 to 18446744073709551615"
    )
