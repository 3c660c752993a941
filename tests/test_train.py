import math

import pytest
from conftest import TINY, launch, read_metrics


def test_two_process_fsdp_run_learns(train, tmp_path):
    result = train(tmp_path, *TINY, "--max_steps=60")
    assert "world_size=2" in result.stdout
    assert "time to first step" in result.stdout
    losses = [r["loss"] for r in read_metrics(tmp_path)]
    assert len(losses) == 60
    assert losses[0] == pytest.approx(math.log(512), abs=0.3)  # a fresh model guesses uniformly
    assert losses[-1] < 0.5 * losses[0], losses
    record = read_metrics(tmp_path)[-1]
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu"} <= set(record)
    assert record["mfu"] is None and record["tokens_per_s"] > 0  # no MFU without a GPU peak


def test_one_process_with_accumulation_matches_two_processes(train, tmp_path):
    """The global batch of a step is the same whatever the world size, so are the losses."""
    two = tmp_path / "two"
    one = tmp_path / "one"
    train(two, *TINY, "--max_steps=5")
    # A plain process (no torchrun), accumulating 2 micro-steps, with activation checkpointing on.
    train(one, *TINY, "--max_steps=5", "--activation_checkpointing=True", nproc=0)
    two_losses = [r["loss"] for r in read_metrics(two)]
    one_losses = [r["loss"] for r in read_metrics(one)]
    assert one_losses == pytest.approx(two_losses, rel=1e-5, abs=1e-5)
    assert len(set(one_losses)) == 5  # the weights really changed between steps


@pytest.fixture(scope="module")
def full_sharding_losses(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("full")
    result = launch(
        "train.py", [f"--log_dir={log_dir}", f"--checkpoint_dir={log_dir}", *TINY, "--max_steps=3"]
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return [r["loss"] for r in read_metrics(log_dir)]


@pytest.mark.parametrize(
    "option", ["--sharding=grad_op", "--sharding=hybrid", "--activation_checkpointing=op"]
)
def test_sharding_and_checkpointing_modes_compute_the_same_losses(
    train, tmp_path, full_sharding_losses, option
):
    train(tmp_path, *TINY, "--max_steps=3", option)
    assert [r["loss"] for r in read_metrics(tmp_path)] == pytest.approx(full_sharding_losses, rel=1e-5)


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--batch_sise=4"], {}, "unknown option --batch_sise; did you mean --batch_size?"),
        (["--batch_size=four"], {}, "--batch_size expects an integer, got 'four'"),
        (["--compile=maybe"], {}, "--compile expects true or false"),
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
        (["--sharding=zero3"], {}, "--sharding=zero3 is not one of: full, grad_op, hybrid"),
        (["--model=gpt3"], {}, "--model=gpt3 is not a preset"),
        (["batch_size=4"], {}, "options are written --name=value"),
        (["--lr=inf"], {}, "--lr expects a finite number, got 'inf'"),
        (["--min_lr=nan"], {}, "--min_lr expects a finite number, got 'nan'"),
        (["--eval_every=-1"], {}, "--eval_every must not be negative (0: never), got -1"),
        (["--val_fraction=1.5"], {}, "--val_fraction must lie between 0 and 1, got 1.5"),
        (["--keep_last=-1"], {}, "--keep_last must not be negative, got -1"),
        (["--init_from=./no_such_model"], {}, "--init_from=./no_such_model: no such folder"),
        (["--init_from=/no/such/model"], {}, "--init_from=/no/such/model: no such folder"),
        (["--model=tiny", "--log_dir=/proc/logs"], {}, "--log_dir=/proc/logs is not writable"),
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


def test_help_lists_every_option_with_its_default_and_comment(capsys):
    import train as train_script

    assert train_script.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "global_batch_size: int = 256        # sequences per optimizer step" in out
    assert all(f"\n{name}:" in out for name in ("model", "data", "sharding", "checkpoint_every", "dry_run"))


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


def test_plain_run_picks_a_free_port(train, tmp_path):
    """Without MASTER_PORT a plain `python train.py` finds a free port: the old fixed one may be taken."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 29517))
        taken.listen()
        train(tmp_path, *TINY, "--max_steps=1", nproc=0, env={"MASTER_PORT": ""})  # launch() would set one
