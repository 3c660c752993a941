"""When the checkpointer saves (run/checkpoint/schedule.py), as torchtitan tests its _should_save: a fixed
interval, Young/Daly's computed by hand, the last step and a requested stop, and a relaunch of an auto run. In
one process, whose process group of one carries rank 0's choice."""

import math

import pytest
import torch.distributed as dist
import yaml
from conftest import ODD, make_odd

from run.checkpoint.schedule import ASSUMED_WRITE_GBPS, CheckpointSchedule, benchmark_write_GBps

# a 30 s save, 6,335 h between failures of one node, 4 nodes: M = 6,335 x 3,600 / 4 = 5,701,500 s, and
# T = sqrt(2 x 30 x 5,701,500) = 18,495.4 s, which is 9,248 steps of 2 s
MTBF_HOURS, NODES, INTERVAL = 6335.0, 4, 9248


@pytest.fixture
def process_group():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def test_a_fixed_interval_saves_every_n_steps_and_at_the_last():
    schedule = CheckpointSchedule(500, 1e9, NODES, MTBF_HOURS, None)
    assert [step for step in range(1, 1501) if schedule.due(step)] == [500, 1000, 1500]
    assert schedule.due(1234, last=True)


def test_young_daly_interval_as_computed_by_hand(process_group, capsys):
    schedule = CheckpointSchedule("auto", 1e9, NODES, MTBF_HOURS, 1.0)
    assert not any(schedule.due(step) for step in range(1, 100)) and schedule.due(7, last=True)
    schedule.saved(100, 30.0)
    schedule.choose(2.0)
    assert capsys.readouterr().out.startswith(f"checkpoint interval: every {INTERVAL} steps (Young/Daly")
    schedule.choose(2.0)
    assert capsys.readouterr().out == ""  # said when it changes only
    assert not schedule.due(100 + INTERVAL - 1) and schedule.due(100 + INTERVAL)


def test_before_the_first_save_the_interval_is_estimated_from_the_parameter_count(process_group):
    schedule = CheckpointSchedule("auto", 1e9, NODES, MTBF_HOURS, 1.0)
    schedule.choose(2.0)  # 1e9 parameters x 12 bytes at 1 GB/s: a 12 s save
    assert schedule.steps == round(math.sqrt(2 * 12 * 5_701_500) / 2)


def test_a_relaunched_auto_run_counts_the_interval_from_the_checkpoint_it_resumed(process_group):
    """Counted from step 0, as it was, the interval had long passed at a relaunch's first log window, which
    saved again at once."""
    schedule = CheckpointSchedule("auto", 1e9, NODES, MTBF_HOURS, 1.0)
    schedule.resumed(20_000)
    schedule.choose(2.0)
    assert not schedule.due(20_001) and schedule.due(20_000 + schedule.steps)


def report_writing(rate):
    """A benchmark report whose storage check measured this parallel write rate."""
    return {
        "world": {"device": "cuda", "ranks_per_node": 8},
        "storage": {"aggregate": {"parallel_write_GB/s": rate}},
    }


@pytest.mark.parametrize("case", ["a rate of 1e-320", "a NaN rate", "FIFO", "link to /dev/zero"])
def test_a_write_rate_no_storage_writes_at_is_one_warning_and_the_assumed_rate(
    tmp_path, monkeypatch, capsys, process_group, case, deadline
):
    """The job's report ($BENCHMARK_REPORT) with a write rate of 1e-320 gave an OverflowError mid-training,
    before any checkpoint; a FIFO in its place hung the run."""
    path = tmp_path / "benchmark_1.yaml"
    monkeypatch.setenv("BENCHMARK_REPORT", str(path))
    path.write_text(yaml.safe_dump(report_writing(2.5)))
    assert benchmark_write_GBps(master=True) == 2.5
    path.unlink()
    if case in ODD:
        make_odd(path, case)
    else:
        path.write_text(yaml.safe_dump(report_writing(1e-320 if case == "a rate of 1e-320" else math.nan)))
    assert benchmark_write_GBps(master=True) == benchmark_write_GBps(master=False) == ASSUMED_WRITE_GBPS
    [warning] = capsys.readouterr().err.splitlines()
    assert warning.startswith(f"warning: BENCHMARK_REPORT: {path} ") and warning.endswith(
        "; the first checkpoint is estimated at 1 GB/s"
    ), warning
    schedule = CheckpointSchedule("auto", 8e9, NODES, MTBF_HOURS, ASSUMED_WRITE_GBPS)
    schedule.choose(1e-3)
    assert 0 < schedule.steps < math.inf
