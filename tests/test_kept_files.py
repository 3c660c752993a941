"""The files a run keeps and its job reads (plan.json, prediction.json, recovery.json, goodput.json,
rewinds.json, heartbeats, excluded_nodes, benchmark reports, --config files): each opened as a regular file
of a bounded size, never waiting on a FIFO or reading /dev/zero to its end, each record checked field by
field where it is read. A damaged kept record is one warning and set aside; a damaged file the user named is
one line and exit status 2."""

import functools
import json
import os
import re
import types
from pathlib import Path

import pytest
from conftest import ODD, SIMULATES, TINY, make_odd, parse_options, read_metrics, validated

import benchmark
from common import suspects
from common.errors import ConfigError
from common.files import UnsafeFile, create_atomically, read_json, read_regular, write_atomically
from run import launch, options
from run.checkpoint import set_aside
from run.job import benchmark_reports
from run.prediction import plan
from run.progress import run_log


@SIMULATES
def test_a_relaunch_at_another_global_batch_chooses_again_and_never_trains_without_micro_steps(
    train, tmp_path
):
    """The choice of the auto options holds only for the options it was made for: a relaunch of the run at
    another global batch chooses again (it took the kept batch of 8, which made a global batch of 4 over 2
    ranks 0 micro-steps: loss 0, grad norm 0, exit 0)."""
    kept = [*TINY, "--run_name=kept", "--seq_length=32"]  # each candidate probed: short steps, a short probe
    first = train(tmp_path, *kept, "--activation_checkpointing=auto", "--max_steps=1")
    assert re.search(r"^chose: .*--activation_checkpointing=\w+", first.stdout, re.M), first.stdout
    again = train(tmp_path, *kept, "--batch_size=auto", "--global_batch_size=4", "--max_steps=2")
    chosen = re.search(r"^chose: .*--batch_size=(\d+) ", again.stdout, re.M)
    assert chosen and int(chosen[1]) in (1, 2), again.stdout
    last = read_metrics(tmp_path)[-1]
    assert last["step"] == 2 and last["loss"] > 1 and last["grad_norm"] > 0, last


@pytest.mark.parametrize("kind", ODD)
def test_a_file_that_is_not_a_regular_file_of_a_records_size_is_refused_unread(tmp_path, kind, deadline):
    path = tmp_path / "record.json"
    words = make_odd(path, kind)
    with pytest.raises(UnsafeFile, match=f"^{re.escape(str(path))} {re.escape(words)}"):
        read_regular(path)
    (tmp_path / "whole.json").write_text('{"a": 1}')
    assert read_json(tmp_path / "whole.json") == {"a": 1}
    (tmp_path / "deep.json").write_text("[" * 200_000)
    with pytest.raises(ValueError, match="nested deeper"):
        read_json(tmp_path / "deep.json")


def auto_run(tmp_path, *flags):
    """train.py's options of a run in tmp_path with these flags, checked as main() checks them, and the
    taking of a choice of its auto options as main() gives it to settle."""
    args = parse_options([*TINY, f"--log_dir={tmp_path}", f"--checkpoint_dir={tmp_path}", *flags])
    shape = validated(args)
    return args, functools.partial(options.taking_choice, args, shape)


@pytest.fixture
def settle(monkeypatch):
    """plan.settle on a process group of one, choosing what choose() says (the fastest candidate, as probing
    each one on the run's devices finds it) and counting its calls."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())

    def settled(args, folder, choose, taking):
        monkeypatch.setattr(plan, "fastest_measured", lambda *_: choose())
        plan.settle(args, None, 0, str(folder), torch.device("cpu"), taking)

    yield settled
    dist.destroy_process_group()


def chooser(**chosen):
    """The fastest candidate, as probing each gives it, counted."""

    def choose():
        choose.calls += 1
        return {"sharding": "full", "shard_group_size": None, "activation_checkpointing": "none", **chosen}

    choose.calls = 0
    return choose


@SIMULATES
def test_a_kept_choice_is_taken_with_one_line_only_for_what_it_was_chosen_for(tmp_path, capsys, settle):
    args, taking = auto_run(tmp_path, "--batch_size=auto")
    settle(args, tmp_path, chooser(batch_size=4), taking)
    assert args.batch_size == 4
    assert re.search(
        r"^chose: --batch_size=4 \(the fastest that fits, each candidate probed .*; kept in ",
        capsys.readouterr().out,
        re.M,
    )
    again, taking = auto_run(tmp_path, "--batch_size=auto")
    choose = chooser(batch_size=2)
    settle(again, tmp_path, choose, taking)
    assert again.batch_size == 4 and choose.calls == 0
    took = capsys.readouterr().out.strip()
    assert re.fullmatch(
        rf"auto: took --batch_size=4 from {tmp_path}/plan.json, chosen by the run's launch of "
        r"\d{4}-\d\d-\d\d \d\d:\d\d",
        took,
    ), took
    other, taking = auto_run(tmp_path, "--batch_size=auto", "--global_batch_size=2")  # 2 over 1 rank
    settle(other, tmp_path, chooser(batch_size=2), taking)
    assert other.batch_size == 2  # a batch of 4 would make a global batch of 2 no micro-step at all
    explicit, taking = auto_run(tmp_path, "--batch_size=8", "--activation_checkpointing=auto")
    settle(explicit, tmp_path, chooser(batch_size=8, activation_checkpointing="op"), taking)
    assert explicit.batch_size == 8 and explicit.activation_checkpointing == "op"
    assert json.loads((tmp_path / "plan.json").read_text())["options"] == {"activation_checkpointing": "op"}
    assert "warning" not in capsys.readouterr().err


def choice(args, options):
    """A plan.json made for args's options on this machine, setting options."""
    import torch

    return {"for": plan.choice_for(args, torch.device("cpu")), "options": options, "made": "2020-01-01 00:00"}


CRAFTED = {
    "a folder to write to": (
        {"batch_size": 4, "checkpoint_dir": "/tmp/elsewhere"},
        "it sets batch_size, checkpoint_dir, and this launch leaves batch_size to auto",
    ),
    "a learning rate": ({"lr": 0.5}, "it sets lr, and this launch leaves batch_size to auto"),
    "a run length": ({"max_steps": 10**9}, "it sets max_steps"),
    "auto itself": ({"batch_size": "auto"}, "it sets batch_size, and this launch leaves batch_size to auto"),
    "a batch that does not divide": (
        {"batch_size": 3},
        "--global_batch_size=16 is not divisible by batch_size x world size = 3 x 1; use a multiple of 3",
    ),
    "a batch larger than a rank's share": ({"batch_size": 32}, "is not divisible by batch_size x world size"),
    "a batch that is not a number": (
        {"batch_size": [4]},
        "--batch_size expects an integer or 'auto', got '[4]'",
    ),
    "options as pairs": ([["batch_size", 4]], "it holds no choice"),
}


@SIMULATES
@pytest.mark.parametrize("case", CRAFTED)
def test_a_crafted_choice_sets_nothing_and_is_one_warning_then_made_again(tmp_path, capsys, case, settle):
    options, why = CRAFTED[case]
    args, taking = auto_run(tmp_path, "--batch_size=auto")
    kept = tmp_path / "plan.json"
    kept.write_text(json.dumps(choice(args, options)))
    before = dict(vars(args))
    choose = chooser(batch_size=8)
    settle(args, tmp_path, choose, taking)
    assert choose.calls == 1 and vars(args) == {**before, "batch_size": 8}
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"warning: {kept} is not a choice of the auto options this launch can take (")
    assert why in err and err.endswith(", choosing again") and err.count("\n") == 0, err
    assert len(list(tmp_path.glob("plan.damaged_*.json"))) == 1
    assert json.loads(kept.read_text())["options"] == {"batch_size": 8}


@SIMULATES
def test_a_crafted_sharding_is_refused_as_on_the_command_line(tmp_path, capsys, settle):
    args, taking = auto_run(tmp_path, "--sharding=auto")
    bogus = {"sharding": "bogus", "shard_group_size": None}
    (tmp_path / "plan.json").write_text(json.dumps(choice(args, bogus)))
    settle(args, tmp_path, chooser(batch_size=8), taking)
    assert args.sharding == "full"
    assert "(--sharding=bogus is not one of: full, grad_op, hybrid, ddp, auto)" in capsys.readouterr().err


@SIMULATES
@pytest.mark.parametrize("kind", ODD)
def test_a_kept_choice_that_is_not_a_regular_file_is_set_aside_and_made_again(
    tmp_path, capsys, kind, deadline, settle
):
    args, taking = auto_run(tmp_path, "--batch_size=auto")
    kept = tmp_path / "plan.json"
    words = make_odd(kept, kind)
    settle(args, tmp_path, chooser(batch_size=8), taking)
    assert args.batch_size == 8 and json.loads(kept.read_text())["options"] == {"batch_size": 8}
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        f"warning: {kept} is not a choice of the auto options this launch can take ({kept} "
    )
    assert words in err and f"set aside as {tmp_path}/plan.damaged_" in err and err.count("\n") == 0, err


def test_a_plan_of_a_world_of_2_to_the_40_is_refused_at_once_and_divisors_are_found_quickly():
    refused = r"^--world_size=1099511627776 is more processes than any cluster runs; use at most 1,048,576$"
    with pytest.raises(ConfigError, match=refused):
        validated(parse_options(["--plan", "--model=tiny", f"--world_size={2**40}"]))
    assert plan.divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    assert plan.divisors(2**20) == [2**power for power in range(21)]
    hybrid = plan.shardings(types.SimpleNamespace(sharding="auto"), 2**20, 8)[3:]
    assert hybrid == [("hybrid", 2**power) for power in range(1, 20)]


@pytest.mark.parametrize("kind", ODD)
def test_a_record_of_what_was_set_aside_that_is_not_a_regular_file_is_set_aside_itself(
    tmp_path, capsys, kind, deadline
):
    path = tmp_path / "rewinds.json"
    words = make_odd(path, kind)
    assert set_aside.recorded(tmp_path) == []
    [aside] = tmp_path.glob("rewinds.damaged_*.json")
    assert capsys.readouterr().err.splitlines() == [
        f"warning: {path} is damaged ({path} {words}); set aside as {aside}, and the run's record of what it "
        "set aside starts anew"
    ]
    (tmp_path / "step_4").mkdir()
    set_aside.set_aside(tmp_path, ["step_4"], "rewound", to=2)
    assert [entry["steps"] for entry in set_aside.recorded(tmp_path)] == [["step_4"]]


def test_a_checkpoint_set_aside_as_unusable_is_matched_by_its_whole_name(tmp_path):
    """step_20 set aside (its steps written as text, not a list) also matched step_2."""
    (tmp_path / "rewinds.json").write_text(json.dumps([{"unusable": True, "steps": "step_20"}]))
    assert not set_aside.set_aside_as_unusable(tmp_path, "step_2")
    (tmp_path / "rewinds.json").write_text(json.dumps([{"unusable": True, "steps": ["step_20"]}]))
    assert not set_aside.set_aside_as_unusable(tmp_path, "step_2")
    assert set_aside.set_aside_as_unusable(tmp_path, "step_20")


@pytest.mark.parametrize("kind", ODD)
def test_a_benchmark_outcome_that_is_not_a_regular_file_is_no_verdict(tmp_path, kind, deadline):
    make_odd(tmp_path / "benchmark_1.outcome.json", kind)
    assert benchmark_reports.read_outcome(tmp_path / "benchmark_1.outcome.json") is None


@pytest.mark.parametrize(
    "report, verdict",
    [("{folder}/benchmark_1.yaml", "pass"), ("{folder}/../elsewhere/benchmark_1.yaml", None),
     ("/etc/passwd", None), (["not", "a", "path"], None)],
)  # fmt: skip
def test_a_benchmark_outcome_names_a_report_beside_it_or_is_no_verdict(tmp_path, report, verdict):
    """Training reads the report an outcome names: one anywhere else, or no path, is no verdict (the job
    benchmarks again), where a list crashed the job."""
    path = tmp_path / "benchmark_1.outcome.json"
    named = report.format(folder=tmp_path) if isinstance(report, str) else report
    path.write_text(json.dumps({"verdict": "pass", "report": named, "failed_nodes": {}}))
    outcome = benchmark_reports.read_outcome(path)
    assert (outcome and outcome["verdict"]) == verdict


@pytest.mark.parametrize("kind", ODD)
def test_a_config_file_that_is_not_a_regular_file_is_one_line_and_exit_2(tmp_path, kind, deadline):
    """train.py --config, and the same inside benchmark.py --train_args: a FIFO hung them, a link to
    /dev/zero read until memory ran out."""
    path = tmp_path / "c.yaml"
    words = f"--config: {path} {make_odd(path, kind)}; give a YAML file of name: value lines"
    with pytest.raises(ConfigError, match=f"^{re.escape(words)}$"):
        parse_options(["--model=tiny", f"--config={path}"])
    with pytest.raises(SystemExit) as exit_info:
        benchmark.train_run(f"--model=tiny --config={path}")
    assert exit_info.value.code == 2


@pytest.mark.parametrize("kind", ODD)
def test_a_list_of_benchmark_reports_that_is_not_a_regular_file_is_set_aside_and_begun_again(
    tmp_path, monkeypatch, capsys, kind, deadline
):
    pointer = tmp_path / "benchmark_reports.txt"
    words = make_odd(pointer, kind)
    monkeypatch.setenv("BENCHMARK_REPORT", str(tmp_path / "benchmark_7.yaml"))
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    run_log.write_run_folder(parse_options(["--model=tiny"]), str(tmp_path))
    assert pointer.read_text() == f"7: {tmp_path / 'benchmark_7.yaml'}\n"
    [aside] = tmp_path.glob("benchmark_reports.damaged_*.txt")
    assert capsys.readouterr().err == (
        f"warning: {pointer} {words}; set aside as {aside}, and the list of the run's benchmark reports "
        "starts anew\n"
    )


@pytest.mark.parametrize("kind", ["FIFO", "link to /dev/zero", "file of 2 MB"])
def test_a_run_lock_that_is_not_a_regular_file_of_a_locks_size_is_taken_over(
    tmp_path, capsys, kind, deadline
):
    """A lock is linked whole, so no live trainer left one of these: a FIFO hung the launch that read it."""
    make_odd(tmp_path / launch.RUN_LOCK, kind)
    path = launch.take_run_lock(str(tmp_path))
    assert json.loads(Path(path).read_text())["pid"] == os.getpid()
    assert "from no one: it is empty or unreadable" in capsys.readouterr().out
    launch.release_run_lock(path)
    assert not os.path.lexists(path)


def test_a_link_planted_where_a_write_goes_is_never_followed(tmp_path, capsys):
    """In a folder others may write to (a shared data cache, a team's logs), a link left at a name a write
    takes would send the write to a file of their choosing: temporary names cannot be guessed (they were the
    path and the pid), the run's lock is never written through one, the run's records are not appended
    through one (one warning), and the job's list of excluded nodes, a link, is set aside and written anew."""
    victim = tmp_path / "victim"
    victim.write_text("theirs")
    shared = tmp_path / "shared"
    shared.mkdir()
    host = os.uname().nodename
    planted = [f"report.yaml.{os.getpid()}.tmp", f"new.json.{os.getpid()}.tmp",
               f"{launch.RUN_LOCK}.{host}.{os.getpid()}", suspects.EXCLUDED, "metrics.jsonl"]  # fmt: skip
    for name in planted:
        (shared / name).symlink_to(victim)
    write_atomically(shared / "report.yaml", "mine")
    create_atomically(shared / "new.json", "mine")
    launch.release_run_lock(launch.take_run_lock(str(shared)))
    os.makedirs(suspects.suspects_folder(str(shared)))
    suspects.write_suspects(suspects.suspects_folder(str(shared)), "test", {"n3": "failed its check"})
    records = run_log.RunLog(types.SimpleNamespace(tensorboard=False, wandb=None), str(shared))
    records.write({"step": 1, "loss": 2.5})
    records.close()
    assert "cannot write" in capsys.readouterr().err
    assert suspects.exclude(str(shared), limit=2) == {"n3": "failed its check"}
    assert (shared / suspects.EXCLUDED).is_file() and not (shared / suspects.EXCLUDED).is_symlink()
    assert victim.read_text() == "theirs"
    assert (shared / "report.yaml").read_text() == (shared / "new.json").read_text() == "mine"
