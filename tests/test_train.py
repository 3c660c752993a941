import functools
import math
import os
import socket
import sys
from types import SimpleNamespace

import pytest
from conftest import TINY, assert_ran, parse_options, read_metrics, run_training, together, validated

from run import options

# The runs these tests compare share their first steps: warm-up lasts 10 steps, and a step's learning rate
# before then does not depend on max_steps. So the first steps of the 60-step run are the 3- and 5-step
# 2-process runs the other runs are compared with, and each comparison checks the learning rates match too.
SHARED_STEPS = 10


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 2-process run of TINY, and a plain process (no torchrun) running its first 5 steps by accumulating
    2 micro-steps, with activation checkpointing on, launched together. The plain run is also the one that
    must need no port: its MASTER_PORT is taken."""
    two, one = tmp_path_factory.mktemp("two"), tmp_path_factory.mktemp("one")

    def plain_run():
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            args = [*TINY, "--max_steps=5", "--activation_checkpointing=full"]
            taken_port = {"MASTER_PORT": str(taken.getsockname()[1])}
            return run_training(one, *args, nproc=0, env=taken_port, expect_ok=False)

    two_result, one_result = together(
        lambda: run_training(two, *TINY, "--max_steps=60", expect_ok=False), plain_run
    )
    return SimpleNamespace(two=two_result, two_dir=two, one=one_result, one_dir=one)


def first_steps(log_dir, n):
    """(losses, learning rates) of the first n steps of the run in log_dir."""
    assert n <= SHARED_STEPS
    records = read_metrics(log_dir)[:n]
    return [r["loss"] for r in records], [r["lr"] for r in records]


def test_two_process_fsdp_run_learns(runs):
    assert_ran(runs.two)
    assert "world_size=2" in runs.two.stdout
    assert "time to first step" in runs.two.stdout
    losses = [r["loss"] for r in read_metrics(runs.two_dir)]
    assert len(losses) == 60
    assert losses[0] == pytest.approx(math.log(512), abs=0.3)  # a fresh model guesses uniformly
    assert losses[-1] < 0.5 * losses[0], losses
    record = read_metrics(runs.two_dir)[-1]
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"} <= set(record)
    assert record["mfu"] is None and record["tokens_per_s"] > 0  # no MFU without a GPU peak


def test_one_process_with_accumulation_matches_two_processes(runs):
    """The global batch of a step is the same whatever the world size, so are the losses."""
    assert_ran(runs.two)
    assert_ran(runs.one)
    one_losses, one_lrs = first_steps(runs.one_dir, 5)
    two_losses, two_lrs = first_steps(runs.two_dir, 5)
    assert len(one_losses) == 5 and one_lrs == two_lrs
    assert one_losses == pytest.approx(two_losses, rel=1e-5, abs=1e-5)
    assert len(set(one_losses)) == 5  # the weights really changed between steps


MODES = ["--sharding=grad_op", "--sharding=hybrid", "--activation_checkpointing=op"]


@pytest.fixture(scope="module")
def mode_runs(tmp_path_factory):
    """3 steps of TINY in each mode, launched together: option -> (result, log dir)."""
    log_dirs = [tmp_path_factory.mktemp("mode") for _ in MODES]
    results = together(
        *[
            functools.partial(run_training, log_dir, *TINY, "--max_steps=3", option, expect_ok=False)
            for log_dir, option in zip(log_dirs, MODES)
        ]
    )
    return dict(zip(MODES, zip(results, log_dirs)))


@pytest.mark.parametrize("option", MODES)
def test_sharding_and_checkpointing_modes_compute_the_same_losses(runs, mode_runs, option):
    result, log_dir = mode_runs[option]
    assert_ran(runs.two)
    assert_ran(result)
    losses, lrs = first_steps(log_dir, 3)
    full_losses, full_lrs = first_steps(runs.two_dir, 3)
    assert len(losses) == 3 and lrs == full_lrs
    assert losses == pytest.approx(full_losses, rel=1e-5)


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--batch_sise=4"], {}, "unknown option --batch_sise; did you mean --batch_size?"),
        (["--batch_size=four"], {}, "--batch_size expects an integer or 'auto', got 'four'"),
        (["--compile=maybe"], {}, "--compile expects true or false"),
        (["--wandb"], {}, "--wandb needs a value: write --wandb=VALUE"),  # it named a W&B project "true"
        (
            ["--global_batch_size=12", "--batch_size=8"],
            {"WORLD_SIZE": "1"},
            "--global_batch_size=12 is not divisible",
        ),
        (
            ["--global_batch_size=16", "--batch_size=4"],
            {"WORLD_SIZE": "3"},
            "batch_size x world size = 4 x 3",
        ),
        (["--model=gpt2", "--seq_length=2048"], {}, "--seq_length=2048 exceeds the model's 1024 positions"),
        (["--n_embd=100", "--n_head=3"], {}, "--n_embd=100 is not divisible by --n_head=3"),
        (
            ["--model=tiny-llama", "--n_head=1"],
            {},
            "--n_head=1 is not a multiple of the model's 2 key/value heads (num_key_value_heads)",
        ),
        (["--model=tiny-llama", "--n_embd=260"], {}, "= 65 per head: rotary position embeddings rotate"),
        (["--sharding=zero3"], {}, "--sharding=zero3 is not one of: full, grad_op, hybrid"),
        (["--model=gpt3"], {}, "--model=gpt3 is not a preset"),
        (["batch_size=4"], {}, "options are written --name=value"),
        (["--lr=inf"], {}, "--lr expects a finite number, got 'inf'"),
        (["--min_lr=nan"], {}, "--min_lr expects a finite number, got 'nan'"),
        (["--eval_every=-1"], {}, "--eval_every must not be negative (0: never), got -1"),
        (["--val_fraction=1.5"], {}, "--val_fraction must lie between 0 and 1, got 1.5"),
        (["--keep_last=-1"], {}, "--keep_last must not be negative, got -1"),
        (["--dry_run", "--world_size=0"], {}, "--world_size must be positive, got 0"),
        (["--lr=0", "--min_lr=0"], {}, "--lr must be positive, got 0.0"),
        (["--seed=-1"], {}, "--seed must lie between 0 and 2**32 - 1, got -1"),
        ([f"--seed={2**70}"], {}, f"--seed must lie between 0 and 2**32 - 1, got {2**70}"),
        (["--dry_run", "--gpu=nan"], {}, "--gpu=nan: a GPU's memory in GB must be a positive number"),
        (["--dry_run", "--gpu=-5"], {}, "--gpu=-5: a GPU's memory in GB must be a positive number"),
        (["--run_name="], {}, "--run_name='' must be a folder name"),
        (["--run_name=../up"], {}, "--run_name='../up' must be a folder name"),
        ([f"--run_name={'r' * 300}"], {}, "--run_name is 300 bytes long; use at most 200"),
        (
            ["--checkpoint_every=often"],
            {},
            "--checkpoint_every expects an integer or 'auto', got 'often'",
        ),
        (["--checkpoint_every=0"], {}, "--checkpoint_every must be positive, got 0"),
        (["--lr", "0.001"], {}, "--lr 0.001: write --lr=0.001 (options are written --name=value)"),
        (
            ["--config", "configs/x.yaml"],
            {},
            "write --config=configs/x.yaml (options are written --name=value)",
        ),
        (
            ["--profile_steps=\u0663,\u0665"],
            {},
            "--profile_steps=\u0663,\u0665: expected two step numbers A,B",
        ),
        (
            ["--resume_from=ckpt/run/step_4.tmp"],
            {},
            "--resume_from=ckpt/run/step_4.tmp is a save cut short (a .tmp folder is never complete)",
        ),
        (["--init_from=./no_such_model"], {}, "--init_from=./no_such_model: no such folder"),
        (["--init_from=/no/such/model"], {}, "--init_from=/no/such/model: no such folder"),
        (["--model=tiny", "--log_dir=/proc/logs"], {}, "--log_dir=/proc/logs is not writable"),
        (["--model=tiny", "--data=/proc"], {}, "--data=/proc is on the kernel's proc filesystem"),
        (
            ["--dry_run", "--sharding=hybrid", "--world_size=8", "--gpus_per_node=1"],
            {},
            "--sharding=hybrid over groups of one process shards nothing: use --sharding=ddp",
        ),
        (["--model=tiny", "--data=hf:/sys"], {}, "--data=hf:/sys is on the kernel's sysfs filesystem"),
        (
            ["--model=tiny", "--data=train.py", "--data_cache=/proc/cache", "--tokenizer=./no_tokenizer"],
            {},
            "--tokenizer=./no_tokenizer: no such folder",
        ),
    ],
)
def test_bad_input_is_one_clear_line(args, env, message, capsys, monkeypatch):
    """Checked in-process: the error must come before any process group or model exists."""
    import train as train_script

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exit_info:
        train_script.main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_a_refused_folder_leaves_none_of_the_folders_checked_before_it(tmp_path, capsys):
    """The checkpoint folder is made before the log folder is checked: a refused run left it behind."""
    import train as train_script

    (tmp_path / "afile").write_text("")
    for logs, said in (
        (tmp_path / "afile", "is a file, not a folder"),
        (tmp_path / "afile" / "logs", "(Not a"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            train_script.main(["--model=tiny", f"--checkpoint_dir={tmp_path}/new/ckpt", f"--log_dir={logs}"])
        assert exit_info.value.code == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"error: --log_dir={logs} ") and said in line, line
        assert sorted(os.listdir(tmp_path)) == ["afile"]


def test_a_dangling_symbolic_link_as_checkpoint_dir_is_named(tmp_path, capsys):
    import train as train_script

    (tmp_path / "ckpt").symlink_to(tmp_path / "gone")
    with pytest.raises(SystemExit) as exit_info:
        train_script.main(["--model=tiny", f"--checkpoint_dir={tmp_path / 'ckpt'}", f"--log_dir={tmp_path}"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"error: --checkpoint_dir={tmp_path / 'ckpt'}: {tmp_path / 'ckpt'} is a symbolic link to "
        f"{tmp_path / 'gone'}, which does not exist; create its target or point --checkpoint_dir elsewhere"
    )


def test_help_lists_every_option_with_its_default_and_comment(capsys):
    import train as train_script

    assert train_script.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "global_batch_size: int = 256        # sequences per optimizer step" in out
    assert all(f"\n{name}:" in out for name in ("model", "data", "sharding", "checkpoint_every", "dry_run"))


# The options whose values name a run, as runs were named before the options stood in two blocks: a run name
# and its checkpoints from then must still be found by a relaunch with the same options.
NAMED_THE_RUN = {
    "model", "init_from", "n_embd", "n_layer", "n_head", "n_positions", "vocab_size", "data", "batch_size",
    "seq_length", "global_batch_size", "tokenizer", "text_column", "val_fraction", "lr", "min_lr",
    "warmup_steps", "weight_decay", "grad_clip", "seed", "sharding", "shard_group_size", "cpu_offload",
    "activation_checkpointing", "ac_every", "compile", "mixed_precision", "float8", "ckpt_format",
}  # fmt: skip


def test_every_option_stands_in_one_of_the_two_blocks_as_python_reads_it(tmp_path, monkeypatch):
    """train.py's options, read from its source, are its constants as Python reads them, each in exactly one
    block: what the run computes (these name the run) or how it is operated. The first block holds the
    options that named a run before, and a run is named as then: a relaunch finds the run and its
    checkpoints."""
    import train as train_script

    monkeypatch.chdir(tmp_path)  # the checks create the log and checkpoint folders
    declared = options.declared()
    assert {name: default for name, (default, _) in declared.items()} == {
        name: getattr(train_script, name) for name in train_script.__annotations__ if not name.isupper()
    }
    assert all(hint == train_script.__annotations__[name] for name, (_, hint) in declared.items())
    computes, operates = options.blocks()
    assert set(computes).isdisjoint(operates) and [*computes, *operates] == list(declared)
    assert set(computes) == NAMED_THE_RUN
    args = parse_options(["--model=tiny", "--mixed_precision=fp32"])
    validated(args)
    assert args.run_name == "tiny-85af8441"  # the name this run had before --float8 was added
    named = [parse_options(["--model=tiny", *extra]) for extra in ([], ["--float8=True"])]
    for args in named:  # named as a run is, without the checks (float8 trains on a GPU alone)
        options.complete(args, options.resolve_shape(args))
    assert named[0].run_name != named[1].run_name  # float8 changes what is computed


def test_a_train_py_whose_blocks_are_not_two_is_one_line(tmp_path, monkeypatch, capsys):
    """A user who edits the constants and loses a block's opening line is told so, in one line."""
    import train as train_script

    monkeypatch.chdir(tmp_path)
    source = open(options.TRAIN_SCRIPT).read()
    edited = tmp_path / "train.py"
    edited.write_text(source.replace(options.OPERATES, "# Operating"))
    monkeypatch.setattr(options, "TRAIN_SCRIPT", str(edited))
    options.blocks.cache_clear()
    try:
        with pytest.raises(SystemExit) as exit_info:
            train_script.main(["--model=tiny", "--check_only"])
    finally:
        options.blocks.cache_clear()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{edited}: its options stand in two blocks" in err, err


def test_the_run_name_follows_what_the_run_computes_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the checks create the log and checkpoint folders
    base = ["--model=tiny", "--max_steps=10"]

    def run_name(*argv):
        args = parse_options([*base, *argv])
        validated(args)
        return args.run_name

    assert run_name("--max_steps=20", "--log_every=3", "--checkpoint_every=auto") == run_name()
    assert run_name("--lr=1e-3") != run_name() != run_name("--seed=7")


def test_help_into_a_closed_pipe_is_quiet(monkeypatch):
    """`python train.py --help | head -3`: head may close the pipe before the help is written."""
    import sample
    import train as train_script

    for script in (train_script, sample):
        read_end, write_end = os.pipe()
        os.close(read_end)
        with os.fdopen(write_end, "w") as closed_pipe:
            monkeypatch.setattr(sys, "stdout", closed_pipe)
            assert script.main(["--help"]) == 0
            closed_pipe.write("the exit's flush\n")
            closed_pipe.flush()


def test_each_invalid_option_is_its_own_line(capsys):
    import train as train_script

    with pytest.raises(SystemExit) as exit_info:
        train_script.main(["--batch_size=0", "--warmup_steps=-1", "--grad_clip=-2"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --batch_size must be positive, got 0",
        "error: --warmup_steps must not be negative, got -1",
        "error: --grad_clip must not be negative, got -2.0",
    ]


def test_config_error_under_torchrun_is_printed_once(train, tmp_path):
    result = train(tmp_path, *TINY, "--lr=inf", expect_ok=False)
    assert result.returncode != 0
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        "error: --lr expects a finite number, got 'inf'"
    ]


def test_a_plain_run_needs_no_port(runs):
    """A plain `python train.py` is a process group of one that meets in memory, so a port another run holds
    cannot stop it. The one-process run of `runs` ran with its MASTER_PORT taken."""
    assert_ran(runs.one)
    assert "world_size=1" in runs.one.stdout


@pytest.mark.parametrize(
    "text, message",
    [
        ("lr: 0.001\nbatch_size: 4\nlr: 0.01\n", "'lr' is given twice (first on line 1) in "),
        # a 'billion laughs': each alias multiplies the one before; expanded, the error line was 254 MB
        ("a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a]\nrun_name: [*b, *b]\n",
         "an alias (*a); write the value out in "),
        (f"run_name: [{', '.join(['x'] * 10000)}]\n", "... (50,000 characters)"),
        ("[model, tiny]: 1\n", "a list as a name; write name: value lines in "),  # a traceback, once
        ("? {model: tiny}\n: 1\n", "a dict as a name; write name: value lines in "),
    ],
)  # fmt: skip
def test_a_config_file_with_a_duplicate_key_or_an_alias_is_one_short_line(tmp_path, capsys, text, message):
    import train as train_script

    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        train_script.main([f"--config={tmp_path / 'c.yaml'}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and len(err) < 400, err
