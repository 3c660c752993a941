"""The batch loaders in process, on token arrays and sources made in the test: the window loader shuffles
each epoch and resumes after the last completed step; prefetched items end where a finite source ends, and
its error is raised in the consumer. The streaming loader, which needs the tokenizer of test_data.py, is
tested there."""

import json
from types import SimpleNamespace

import pytest


def test_window_loader_shuffles_each_epoch_and_resumes_after_the_last_completed_step():
    import numpy as np
    import torch

    from run.data import batches

    cfg = SimpleNamespace(batch_size=2, seq_length=8, seed=1)
    tokens = np.arange(125 * 8 + 1)  # 125 windows; window i starts with token 8·i

    def loader():
        return batches.WindowBatches(
            lambda i: tokens[i * 8 : (i + 1) * 8 + 1],
            125,
            cfg,
            world_size=1,
            rank=0,
            accumulation=2,
            device=torch.device("cpu"),
            prefetch=True,
            shuffle=True,
        )

    run_through = loader()
    inputs = [next(run_through)[0] for _ in range(130)]
    first_epoch = [int(row[0]) // 8 for batch in inputs[:62] for row in batch]
    # 31 steps of 4 fit in 125 windows
    assert sorted(first_epoch) != first_epoch and len(set(first_epoch)) == 124
    second_epoch = [int(row[0]) // 8 for batch in inputs[63:125] for row in batch]
    assert second_epoch[:20] != first_epoch[:20]  # a new order each epoch

    stopped = loader()
    for _ in range(67):  # 33 whole steps and half of the next
        next(stopped)
    state = json.loads(json.dumps(stopped.state_dict()))
    assert state == {"epoch": 1, "offset": 33 * 4 - 125}
    resumed = loader()
    resumed.load_state_dict(state)
    assert torch.equal(next(resumed)[0], inputs[66])  # step 34 again from its first micro-batch
    assert torch.equal(next(resumed)[0], inputs[67])


def test_prefetched_items_end_where_a_finite_source_ends_and_its_error_is_raised_here():
    from run.data import batches

    assert list(batches.prefetched(iter(range(5)), depth=2)) == [0, 1, 2, 3, 4]

    def broken():
        yield 1
        raise ValueError("the source broke")

    with pytest.raises(ValueError, match="the source broke"):
        list(batches.prefetched(broken(), depth=2))
