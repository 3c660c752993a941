"""From figures to checks: each member against its peers, GPUs against the datasheet and their first
second, collectives against a busbw floor per platform, storage against --min_storage_GBps; the
verdict and the nodes a failing check names. Each check carries its text for people (value, reference)
and the same as fields for the table, the picture, the history and the job (check()): nothing reads a
verdict back out of its text.
"""

import math
import statistics

from checks.timing import MiB
from checks.world import SECTIONS
from common import stragglers
from common.datasheet import datasheet
from common.nccl_tests import BUSBW_FACTORS

# Verdict thresholds. A member more than stragglers.MARGIN below the median of its peers is
# flagged (a fail for GPUs and node pairs, a warn for CPU and host-memory figures); a GPU below
# DATASHEET_MIN_PERCENT of its datasheet peak fails for the figures training lives on (a healthy
# H100 sustains ~80% of bf16 peak at the MAMF finder's shapes and ~85% of HBM bandwidth in a copy).
DATASHEET_MIN_PERCENT = 50.0
DATASHEET_CHECKS = {"matmul_bf16_TFLOPS": "bf16", "copy_GB/s": "memory_GBps"}
# A GPU whose last second of a sustained loop runs below this fraction of its first is throttling:
# power and clocks settle within a second or two, so a healthy GPU stays within a few percent.
THROTTLE_MIN_RATIO = 0.90
# A rank whose time for a collective is this many times the average across ranks is named (a warn):
# it entered the loop late or its GPU ran slower than the rest.
SLOW_RANK_RATIO = 1.5
MIN_STORAGE_GBPS = 0.1  # --min_storage_GBps default: each node's parallel write, for checkpoints
# Keys ending in one of these are rates (higher is better) that are compared across peers.
RATE_UNITS = ("GB/s", "MB/s", "TFLOPS", "GFLOPS", "IOPS", "ops/s", "Melem/s")

# Collective busbw floors in GB/s within one node, by substring of the GPU name in this order
# (None: no floor known), judged on all-reduce and all-gather at the sweep's largest size when
# that is at least FLOOR_MIN_BYTES. Each is about half of what nccl-tests reaches on a healthy node
# of that kind and several times what NCCL gets when NVLink is down and it falls back to PCIe.
# Sources: docs/BENCHMARK_FEATURES.md.
NVLINK4 = {"platform": "H100/H200 SXM, NVLink 4", "all_reduce": 230.0, "all_gather": 180.0}
NVLINK3 = {"platform": "A100 SXM, NVLink 3", "all_reduce": 120.0, "all_gather": 100.0}
PCIE_ONLY = {"platform": "PCIe only", "all_reduce": 10.0, "all_gather": 10.0}
COLLECTIVE_FLOORS = {
    "GH200": None,
    "H100 NVL": PCIE_ONLY,
    "H200 NVL": PCIE_ONLY,
    "PCIe": PCIE_ONLY,
    "H100": NVLINK4,
    "H200": NVLINK4,
    "A100-SXM": NVLINK3,
}
FLOOR_OPS = ("all_reduce", "all_gather")
FLOOR_MIN_BYTES = 256 * MiB  # below this, busbw is still climbing: no floor applies
# Between nodes, one rank per node: NCCL over InfiniBand or RoCE reaches 80-95% of one NIC's line
# rate at large sizes; below half of it the link trained down or NCCL fell back to TCP sockets.
INTER_NODE_FLOOR_FRACTION = 0.5


def check(status, name, value, reference="", *, measured=None, floor=None, unit="", flagged=None) -> dict:
    """A check as people read it (status, check, value, reference) and as the rest of the benchmark reads it:
    measured, the figure its value shows (None: none); floor, the least that passes, in the same unit
    (None: none); flagged, {member as the report labels it: why}; nodes, the SLURM names of the flagged
    nodes and of the nodes of flagged GPUs (verdict_checks fills them in)."""
    return {"status": status, "check": name, "value": value, "reference": reference, "measured": measured,
            "floor": floor, "unit": unit, "flagged": flagged or {}, "nodes": []}  # fmt: skip


def flagged_text(flagged: dict) -> str:
    return f"; flagged {', '.join(flagged)}" if flagged else ""


def under(value: float, floor: float) -> bool:
    """Whether a figure fails its floor: below it, or not a finite number (a failed measurement)."""
    return not (math.isfinite(value) and value >= floor)


def unit_of(figure: str) -> str:
    return next(unit for unit in RATE_UNITS if figure.endswith(unit))


def size_text(size_bytes: int) -> str:
    return f"{size_bytes // MiB} MiB" if size_bytes >= MiB else f"{size_bytes // 1024} KiB"


def straggler_checks(kind: str, members: dict, below: str = "fail") -> list:
    """One check per rate figure: every member (GPU, node, node pair) against the median of all;
    a member too far below has status `below`."""
    figures = sorted(
        {
            key
            for figures in members.values()
            for key, value in figures.items()
            if key.endswith(RATE_UNITS) and isinstance(value, (int, float))
        }
    )
    if len(members) < 2:
        return (
            [check("skip", f"{kind} stragglers", f"only one {kind}: nothing to compare")] if figures else []
        )
    checks = []
    for figure in figures:
        numbers = {name: m[figure] for name, m in members.items() if isinstance(m.get(figure), (int, float))}
        values = {name: value for name, value in numbers.items() if math.isfinite(value)}
        low = {name: f"{value}: not a number" for name, value in numbers.items() if name not in values}
        if not values:  # never a pass: every measurement failed
            text = f"no finite figure{flagged_text(low)}"
            checks.append(check(below, f"{kind} {figure}", text, unit=unit_of(figure), flagged=low))
            continue
        median = statistics.median(values.values())
        floor = (1 - stragglers.MARGIN) * median
        low |= {name: f"{values[name]:.4g}, median {median:.4g}" for name in stragglers.below_peers(values)}
        slowest = min(numbers, key=lambda name: (name in values, values.get(name, 0)))
        checks.append(
            check(
                below if low else "pass",
                f"{kind} {figure}",
                f"slowest {slowest}: {numbers[slowest]:.4g}{flagged_text(low)}",
                f"median {median:.4g}, flag below {floor:.4g}",
                measured=numbers[slowest],
                floor=floor,
                unit=unit_of(figure),
                flagged=low,
            )
        )
    return checks


def gpu_checks(gpus: dict) -> list:
    """Against the datasheet, against the GPU's own first second (throttling), and ECC; the
    stragglers among GPUs are straggler_checks'."""
    return datasheet_checks(gpus) + throttle_checks(gpus) + ecc_checks(gpus)


def datasheet_checks(gpus: dict) -> list:
    """Each figure of every GPU against its datasheet's peak; a skip for a GPU the datasheet lacks."""
    checks = []
    for figure, peak_key in DATASHEET_CHECKS.items():
        known = {
            name: (g[figure], datasheet(g["name"])[peak_key])
            for name, g in gpus.items()
            if datasheet(g["name"]) and g.get(figure)
        }
        unknown = sorted({g["name"] for name, g in gpus.items() if name not in known})
        if unknown:
            checks.append(
                check("skip", f"gpu {figure} vs datasheet", f"no datasheet entry for {', '.join(unknown)}")
            )
        if known:
            percent = {name: 100 * value / peak for name, (value, peak) in known.items()}
            low = {
                name: f"{p:.0f}% of {known[name][1]:g}"
                for name, p in percent.items()
                if under(p, DATASHEET_MIN_PERCENT)
            }
            worst = min(percent, key=lambda name: (name not in low, percent[name]))
            checks.append(
                check(
                    "fail" if low else "pass",
                    f"gpu {figure} vs datasheet",
                    f"lowest {worst}: {percent[worst]:.0f}% of {known[worst][1]:g}{flagged_text(low)}",
                    f">= {DATASHEET_MIN_PERCENT:.0f}% of datasheet",
                    measured=percent[worst],
                    floor=DATASHEET_MIN_PERCENT,
                    unit="% of datasheet",
                    flagged=low,
                )
            )
    return checks


def throttle_checks(gpus: dict) -> list:
    """Each GPU's last second of a loop against its first: a GPU that slows as it heats up."""
    ratios = {
        (name, key.removesuffix("_throttle_ratio")): value
        for name, g in gpus.items()
        for key, value in g.items()
        if key.endswith("_throttle_ratio") and isinstance(value, (int, float))
    }
    if not ratios:
        return []
    low = [(name, loop) for (name, loop), ratio in ratios.items() if under(ratio, THROTTLE_MIN_RATIO)]
    worst = min(ratios, key=lambda member: (member not in low, ratios[member]))
    reasons = {}
    for name, loop in low:
        reasons[name] = "; ".join(filter(None, [reasons.get(name), f"{loop} {ratios[name, loop]:.3g}"]))
    shown = {f"{name} {loop}": None for name, loop in low}
    return [
        check(
            "fail" if low else "pass",
            "gpu throttling (last second / first)",
            f"lowest {' '.join(worst)}: {ratios[worst]:.3g}{flagged_text(shown)}",
            f">= {THROTTLE_MIN_RATIO:g}",
            measured=ratios[worst],
            floor=THROTTLE_MIN_RATIO,
            unit="last second / first",
            flagged=reasons,
        )
    ]


def ecc_checks(gpus: dict) -> list:
    """Uncorrected ECC errors, where the GPUs count them."""
    if not any(isinstance(g.get("ecc_uncorrected_errors"), int) for g in gpus.values()):
        return []
    ecc = {name: g["ecc_uncorrected_errors"] for name, g in gpus.items() if g.get("ecc_uncorrected_errors")}
    return [
        check(
            "fail" if ecc else "pass",
            "gpu uncorrected ECC errors",
            ", ".join(f"{n}: {v}" for n, v in ecc.items()) or "none",
            "0",
            measured=max(ecc.values(), default=0),
            unit="errors",
            flagged={name: f"{count} uncorrected ECC errors" for name, count in ecc.items()},
        )
    ]


def platform_floor(sweep: dict) -> dict | str:
    """The intra-node busbw floors for the sweep's GPUs, or why there are none."""
    if "device_name" not in sweep:
        return f"no floor for {sweep.get('backend', 'this backend')} without GPUs"
    for name_part, floor in COLLECTIVE_FLOORS.items():
        if name_part.lower() in sweep["device_name"].lower():
            return floor or f"no floor known for {sweep['device_name']}"
    return f"no floor known for {sweep['device_name']}"


def inter_node_floor(nodes: dict, nic_Gbps: float | None) -> dict | str:
    """Floors for one rank per node: a fraction of one NIC's line rate, from --nic_gbps or else the
    slowest node's fastest active port; or why there are none."""
    if nic_Gbps:
        rate, origin = nic_Gbps, "--nic_gbps"
    else:
        fastest = {
            name: max(node.get("nics_Gbps", {}).values(), default=None) for name, node in nodes.items()
        }
        missing = [name for name, rate in fastest.items() if rate is None]
        if missing:
            return f"no active port in /sys/class/infiniband on {', '.join(missing)}; pass --nic_gbps"
        rate, origin = min(fastest.values()), "/sys/class/infiniband"
    floor = INTER_NODE_FLOOR_FRACTION * rate / 8
    return {
        "platform": f"{INTER_NODE_FLOOR_FRACTION:.0%} of a {rate:g} Gb/s NIC, {origin}",
        **dict.fromkeys(FLOOR_OPS, floor),
    }


def busbw_floor_checks(scope: str, sweeps: dict, floors: dict) -> list:
    """busbw of all-reduce and all-gather at each sweep's largest size against its member's floor
    ({op: GB/s}, or a string saying why there is none)."""
    checks = []
    for op in FLOOR_OPS:
        rows = {
            name: sweep[op][-1]
            for name, sweep in sweeps.items()
            if isinstance(sweep.get(op), list) and sweep[op]
        }
        judged, unjudged = {}, {}
        for name, row in rows.items():
            if isinstance(floors[name], str):
                unjudged.setdefault(floors[name], []).append(name)
            elif row["size_bytes"] < FLOOR_MIN_BYTES:
                reason = f"largest message {size_text(row['size_bytes'])}, under {size_text(FLOOR_MIN_BYTES)}"
                unjudged.setdefault(reason, []).append(name)
            else:
                judged[name] = (row["busbw_GB/s"], floors[name])
        if unjudged:
            reasons = [f"{reason} ({', '.join(names)})" for reason, names in unjudged.items()]
            checks.append(check("skip", f"{scope} {op} busbw", "; ".join(reasons)))
        if judged:
            low = {
                name: f"{busbw:.4g} GB/s, floor {floor[op]:.4g}"
                for name, (busbw, floor) in judged.items()
                if under(busbw, floor[op])
            }
            worst = min(judged, key=lambda name: (name not in low, judged[name][0] / judged[name][1][op]))
            busbw, floor = judged[worst]
            checks.append(
                check(
                    "fail" if low else "pass",
                    f"{scope} {op} busbw",
                    f"lowest {worst}: {busbw:.4g} GB/s{flagged_text(low)}",
                    f">= {floor[op]:.4g} GB/s ({floor['platform']})",
                    measured=busbw,
                    floor=floor[op],
                    unit="GB/s",
                    flagged=low,
                )
            )
    return checks


def slow_rank_checks(sweeps: dict) -> list:
    """One warn naming each collective whose slowest rank took SLOW_RANK_RATIO times the average, at
    each op's largest size: at small sizes the ranks' skew leaving the barrier (tens of us, more for
    gloo on a busy host) is a large part of the loop and would name a rank for nothing."""
    rows = [
        (scope, op, sweep[op][-1])
        for scope, sweep in sweeps.items()
        for op in BUSBW_FACTORS
        if isinstance(sweep.get(op), list) and sweep[op]
    ]
    slow = [
        f"rank {row.get('time_max_rank', '?')} in {scope} {op} at {size_text(row['size_bytes'])}: "
        f"{row['time_max_us'] / row['time_us']:.1f}x"
        for scope, op, row in rows
        if row["time_max_us"] > SLOW_RANK_RATIO * row["time_us"]
    ]
    if not rows:
        return []
    shown = "; ".join(slow[:3]) + (f"; {len(slow) - 3} more" if len(slow) > 3 else "")
    return [
        check(
            "warn" if slow else "pass",
            "collective slowest rank",
            shown or "every rank near the average",
            f"time_max_us <= {SLOW_RANK_RATIO:g} x time_us",
            measured=max(row["time_max_us"] / row["time_us"] for _, _, row in rows),
            unit="x time_us",
        )
    ]


def collective_checks(report: dict, nic_Gbps: float | None) -> list:
    """Intra-node busbw against the platform's floor (the all-ranks sweep on one node, each node's
    own sweep on several), inter-node busbw against the NIC's, slow ranks in any sweep."""
    nccl, links = report["nccl"], report["links"]
    sweeps, checks = {}, []
    if nccl and "skipped" not in nccl:
        sweeps["all ranks"] = nccl
        alone = len(report["nodes"]) == 1  # then all ranks are one node's
        intra = nccl.get("intra_node") or ({next(iter(report["nodes"])): nccl} if alone else {})
        sweeps.update({f"{name} intra-node": sweep for name, sweep in nccl.get("intra_node", {}).items()})
        floors = {name: platform_floor(sweep) for name, sweep in intra.items()}
        checks += busbw_floor_checks("intra-node", intra, floors)
    if links.get("one_rank_per_node"):
        sweeps["one rank per node"] = links["one_rank_per_node"]
        checks += busbw_floor_checks(
            "inter-node",
            {"one rank per node": links["one_rank_per_node"]},
            {"one rank per node": inter_node_floor(report["nodes"], nic_Gbps)},
        )
    return checks + slow_rank_checks(sweeps)


def storage_floor_checks(storage: dict, min_GBps: float) -> list:
    """Each node's parallel write (like every rank writing its checkpoint shard at once) against
    --min_storage_GBps."""
    nodes = {
        name: figures["parallel_write_GB/s"]
        for name, figures in storage.items()
        if name != "aggregate"
        and isinstance(figures, dict)
        and isinstance(figures.get("parallel_write_GB/s"), (int, float))
    }
    if not nodes or not min_GBps:
        return []
    low = {name: f"{value:.4g} GB/s" for name, value in nodes.items() if under(value, min_GBps)}
    worst = min(nodes, key=lambda name: (name not in low, nodes[name]))
    return [
        check(
            "fail" if low else "pass",
            "storage parallel_write_GB/s",
            f"slowest {worst}: {nodes[worst]:.4g}{flagged_text(low)}",
            f">= {min_GBps:g} (--min_storage_GBps)",
            measured=nodes[worst],
            floor=min_GBps,
            unit="GB/s",
            flagged=low,
        )
    ]


def verdict_checks(
    report: dict, nic_Gbps: float | None = None, min_storage_GBps: float = MIN_STORAGE_GBPS
) -> list:
    """Every check, fails first, then warns, passes and skips. Fail is for what training depends on
    (GPUs, collectives, links, storage writes, errors); CPU and host-memory stragglers only warn."""
    checks = [
        check("skip", section, report[section]["skipped"])
        for section in SECTIONS
        if isinstance(report[section], dict) and "skipped" in report[section]
    ]
    checks += [
        check("fail", f"{section} on {name}", figures["error"], flagged={name: figures["error"]})
        for section in ("gpu", "storage", "cpu", "memory")
        for name, figures in report[section].items()
        if isinstance(figures, dict) and "error" in figures
    ]
    gpus = {name: g for name, g in report["gpu"].items() if isinstance(g, dict) and "name" in g}
    checks += straggler_checks("gpu", gpus) + gpu_checks(gpus) + collective_checks(report, nic_Gbps)
    checks += storage_floor_checks(report["storage"], min_storage_GBps)
    nodes = {
        name: {
            f"{section} {key}": value
            for section in ("storage", "cpu", "memory")
            for key, value in report[section].get(name, {}).items()
        }
        for name in report["nodes"]
    }
    checks += straggler_checks("node", nodes, below="warn")
    if isinstance(report["links"].get("pairs"), dict):
        checks += straggler_checks("node pair", report["links"]["pairs"])
    name_nodes(checks, report)
    order = {"fail": 0, "warn": 1, "pass": 2, "skip": 3}
    return sorted(checks, key=lambda c: order[c["status"]])


def name_nodes(checks: list, report: dict):
    """Fills in each check's nodes: the SLURM names of the nodes it flagged and of the nodes of the GPUs it
    flagged (a collective or a pair of nodes is neither)."""
    nodes = {label: node["node_name"] for label, node in report["nodes"].items()}
    # A GPU's label is its node's, then /gpu<i>: its node is looked up, not searched for among all nodes
    # (trying every node for every GPU took minutes on a report of 100,000 nodes).
    gpus = {gpu: nodes[node] for gpu in report["gpu"] if (node := gpu.rpartition("/")[0]) in nodes}
    names = {**nodes, **gpus}
    for c in checks:
        c["nodes"] = sorted({names[member] for member in c["flagged"] if member in names})


def verdict(checks: list, fail_on_warn: bool = False) -> str:
    statuses = {c["status"] for c in checks}
    if "fail" in statuses or (fail_on_warn and "warn" in statuses):
        return "fail"
    return "warn" if "warn" in statuses else "pass"


def failed_nodes(checks: list) -> dict:
    """{node name: the first failing check naming it}: what slurm_submit.sh leaves out of the job. A check
    that names no node (a collective, a pair of nodes) blames none."""
    nodes = {}
    for c in checks:
        if c["status"] == "fail":
            for name in c["nodes"]:
                nodes.setdefault(name, f"benchmark: {c['check']}: {c['value']}")
    return nodes
