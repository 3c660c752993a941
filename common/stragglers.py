"""Two straggler rules, one margin, for two kinds of figure.

The benchmark measures rates (higher is better) once, after warm-up, with nothing else running: a member
(GPU, node, pair of nodes) more than MARGIN below the median of its peers is named at once, by
below_peers. Training measures times (lower is better) per log window, which data loading and the host's
other work make noisy: slower_than_peers names a rank more than MARGIN above the median, by more than
MARGIN of the whole step too, and only a streak of windows leaves its node out (run/health/stragglers.py,
--exclude_stragglers_after); describe_straggler words its figures, for the warning and the log line.
"""

import statistics

MARGIN = 0.10


def below_peers(values: dict, margin: float = MARGIN) -> list:
    """Names whose rate is more than margin below the median of all rates."""
    if len(values) < 2:
        return []
    floor = (1 - margin) * statistics.median(values.values())
    return [name for name, value in values.items() if value < floor]


def slower_than_peers(names, timings, margin=MARGIN):
    """The medians, and the ranks more than margin above the median compute or data-wait time, as
    {name: {figure: seconds}}. names: host:local_rank per rank; timings: (compute s, data s) per rank. The
    excess must also be margin of the median compute and data time together: a data wait of microseconds
    twice the median is noise."""
    medians = dict(zip(("compute_s", "data_wait_s"), (statistics.median(column) for column in zip(*timings))))
    floor = margin * sum(medians.values())
    named = {}
    for name, values in zip(names, timings):
        slow = {
            key: value
            for (key, median), value in zip(medians.items(), values)
            if value > (1 + margin) * median and value - median > floor
        }
        if slow:
            named[name] = slow
    return medians, named


def describe_straggler(figures, medians):
    """figures and medians: seconds per step by compute_s and data_wait_s."""
    described = [f"{key[:-2].replace('_', ' ')} {value:.3f} s/step vs median {medians[key]:.3f}"
                 for key, value in figures.items()]  # fmt: skip
    return ", ".join(described)
