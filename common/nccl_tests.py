"""Collectives as nccl-tests names and counts them, for the benchmark's sweeps (checks/) and a step's
prediction (run/prediction/roofline.py): each collective's name, and its bus-bandwidth factor."""

# nccl-tests' bus-bandwidth factors for n ranks (doc/PERFORMANCE.md there): the fraction of the data that
# crosses the slowest link, so busbw is comparable to link speed whatever the rank count.
BUSBW_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}
# nccl-tests' name of each kind of collective a training step issues, as run/prediction/simulate.py records
# them.
SWEEP_NAMES = {
    "all-reduce": "all_reduce",
    "all-gather": "all_gather",
    "reduce-scatter": "reduce_scatter",
    "broadcast": "broadcast",
}
