#!/usr/bin/env python3
"""Cluster check before a long training run: GPUs, collectives, inter-node links, storage, CPU, host memory.

Launch it the way training is launched, one process per GPU on every node:

    srun torchrun --nnodes=$SLURM_NNODES --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=$MASTER_ADDR:29500 benchmark.py
    python benchmark.py --quick                  # one process, no GPU needed

Sections, chosen with --only / --skip: gpu, nccl (collectives; gloo on CPU), links (between
nodes), storage (--storage_path), cpu, memory. GPU work runs on every local GPU at once; per-node
work (storage, cpu, memory) runs on local rank 0 while the node's other ranks wait, so nothing
competes with it. Rank 0 writes the cluster report, --report=PATH or else
<report_dir>/benchmark_<jobid>.yaml (_2, _3... when that name is taken: a report never replaces
another), with its picture (.png) and the nodes' history beside it; each node's local rank 0 writes
<stem>_rank<R>.yaml (that node). Rank 0 prints the checks, fails first, then warns, and the paths.

Checks are fail, warn, pass or skip. Fail is kept for what training depends on: GPU compute and
memory (against the datasheet, their peers, and their own first second: throttling), collectives
against a busbw floor per platform, links between nodes against their peers, storage writes
against --min_storage_GBps, and errors. CPU and host-memory figures below their peers only warn.
Exit status: 0 pass or warn, 1 fail (or warn with --fail_on_warn), 2 bad input.

GPU figures are sustained: at least 1 s of warm-up, then back-to-back loops of seconds timed by
CUDA events; other figures are medians of repeats after warm-up. Bytes and FLOPs are counted as
STREAM and nccl-tests count them; GB = 1e9 bytes. What each figure means and how to read it:
docs/BENCHMARK_FEATURES.md. The measurements are in checks/, one module per section; what train.py
shares with them (the GPU datasheet, node names, suspects) in common/.
"""

import os
import shlex
import signal
import socket
import sys
import time
from datetime import UTC, datetime

import torch
import torch.distributed as dist

from checks import history
from checks.collectives import links_section, nccl_section, nic_rates_Gbps
from checks.gpu import gpu_section
from checks.host import cpu_section, memory_section
from checks.inputs import SIZE_OPTIONS, OneLineErrors, positive_number, section_list, validate
from checks.report import cluster_report, write_reports
from checks.storage import storage_section
from checks.verdicts import MIN_STORAGE_GBPS
from checks.world import MODES, SECTIONS, World, start_world
from common.errors import ConfigError, report_config_error
from common.files import remove_empty
from common.node import node_name
from common.quiet import torchao_for_float8_only
from run.data.hub import use_cache_if_hub_unreachable
from run.data.source import parse_source
from run.options import left_to_auto, parse, run_options


def argument_parser():
    parser = OneLineErrors(
        description=__doc__.split("\n\n")[0],
        epilog=f"Sections: {', '.join(SECTIONS)}. Figures explained in docs/BENCHMARK_FEATURES.md.",
    )
    what_to_measure(parser)
    where_answers_go(parser)
    for flag, (kind, text) in SIZE_OPTIONS.items():
        parser.add_argument(flag, type=kind, help=text)
    parser.add_argument(
        "--min_storage_GBps",
        type=positive_number,
        default=MIN_STORAGE_GBPS,
        help=f"each node's parallel write must reach this (default {MIN_STORAGE_GBPS:g})",
    )
    parser.add_argument(
        "--fail_on_warn",
        action="store_true",
        help="warnings (CPU and host-memory stragglers, slow ranks) fail the verdict too; a node slower "
        "than its own history only warns",
    )
    parser.add_argument(
        "--train_args",
        help="train.py's options for the run to come (e.g. '--model=gpt2 --batch_size=4'): its step's own "
        "operations and collectives are timed too, for the prediction of its step (the job passes them; not "
        "with --predict=False or an option left to auto)",
    )
    parser.add_argument(
        "--history",
        action="store_true",
        help=f"print each node's figures over its runs (<report_dir>/{history.HISTORY_FILE}), then exit",
    )
    return parser


def what_to_measure(parser):
    parser.add_argument(
        "--only", default=",".join(SECTIONS), help="comma-separated sections to run (default: all)"
    )
    parser.add_argument("--skip", default="", help="comma-separated sections not to run")
    parser.add_argument(
        "--quick", action="store_true", help="small sizes, few repeats, 1 s GPU loops: seconds on CPU"
    )
    parser.add_argument("--storage_path", default="checkpoints", help="folder to test (default: checkpoints)")


def where_answers_go(parser):
    parser.add_argument(
        "--report_dir",
        default="logs",
        help="where the YAML reports go, as benchmark_<job id>.yaml, never replacing one (default: logs)",
    )
    parser.add_argument(
        "--report",
        help="write the cluster report exactly here (a new .yaml file), the node reports beside it",
    )
    parser.add_argument(
        "--suspects_folder",
        help="write the nodes that fail a check to <this>/benchmark.json (slurm_submit.sh)",
    )
    parser.add_argument(
        "--check_only",
        action="store_true",
        help="check the options and the folders they name, then exit: 0, or 2 with one line (the job does "
        "this before it starts the benchmark on every node)",
    )
    parser.add_argument(
        "--outcome",
        help="write the verdict, the report's path and the failing nodes here as JSON, a new file, once the "
        "verdict is known (the job reads it: no file, no verdict)",
    )


def parse_args(argv=None):
    parser = argument_parser()
    args = parser.parse_args(argv)
    sections = section_list("--only", args.only, parser) - section_list("--skip", args.skip, parser)
    if not sections:
        parser.error("--only/--skip leave no section to run")
    cfg = {
        **MODES["quick" if args.quick else "default"],
        "quick": args.quick,
        "sections": [s for s in SECTIONS if s in sections],
        "storage_path": args.storage_path,
        "report_dir": args.report_dir,
        "report": args.report,
        "suspects_folder": args.suspects_folder,
        "outcome": args.outcome,
        "check_only": args.check_only,
        "nic_gbps": args.nic_gbps,
        "min_storage_GBps": args.min_storage_GBps,
        "fail_on_warn": args.fail_on_warn,
        "history": args.history,
        "train_args": args.train_args,
        "skipped": {},  # section: why, for a selected section the checks below cannot run here
    }
    cfg.update({key: value for key, value in vars(args).items() if key in cfg and value is not None})
    cfg["created_folders"] = []  # where the reports go: removed again if a later check refuses the run
    try:
        validate(cfg, args, parser)
    except SystemExit:
        remove_empty(cfg["created_folders"])
        raise
    return cfg


def run_section(section: str, world: World, cfg: dict) -> dict:
    """Runs one section where it belongs; a local failure becomes a reported error, not a hang."""
    world.barrier()
    if section in ("nccl", "links"):
        return {"nccl": nccl_section, "links": links_section}[section](world, cfg)
    if section == "storage":
        return storage_section(world, cfg)
    rehearsed = os.environ.get("REHEARSE_BAD_NODES", "").split(",")
    if section == "cpu" and world.is_node_leader and node_name() in rehearsed:
        return {"error": "REHEARSE_BAD_NODES names this node: it fails on purpose, to rehearse healing"}
    if section == "gpu" or world.is_node_leader:
        try:
            return {
                "gpu": lambda: gpu_section(world, cfg),
                "cpu": lambda: cpu_section(cfg),
                "memory": lambda: memory_section(cfg),
            }[section]()
        except Exception as error:  # noqa: BLE001 - reported as a failed check
            return {"error": f"{type(error).__name__}: {error}"}
    return {}


def train_run(train_args):
    """(options, model config, the values of the options that name the run) of train.py with these arguments,
    or None where the run predicts nothing (--predict=False) or leaves an option to auto (it is chosen as it
    launches): nothing to time here.
    Options train.py refuses are refused here, before anything is measured (--check_only too): every rank
    checks them, one says why, a line per problem."""
    try:
        try:
            argv = shlex.split(train_args)
        except ValueError as error:
            why = f"{error} in {train_args!r}; write train.py's options as on its command line"
            raise ConfigError(why) from None
        args = parse(argv)
        refuse_untimed(args)
        use_cache_if_hub_unreachable(args, parse_source(args)[0])  # before any Hugging Face library loads
        torchao_for_float8_only()  # before any model class: see common/quiet.py
        options = run_options(argv)
    except ConfigError as error:
        lines = "\n".join(f"--train_args: {line}" for line in str(error).splitlines())
        report_config_error(ConfigError(lines, error.per_node))
    if auto := left_to_auto(args):
        why = f"{', '.join(auto)} is chosen as train.py launches"
        after = " (python train.py --plan with these options ranks the choices)"
    elif not args.predict:
        why, after = "--predict=False", ""
    else:
        return options
    if os.environ.get("RANK", "0") == "0":
        print(f"note: --train_args: {why}, so this model's step is not timed here{after}")
    return None


# train.py's options that make it do something other than train
OTHER_THAN_TRAINING = ("plot", "export_from", "check_only", "prepare_only", "dry_run", "plan")


def refuse_untimed(args):
    """The step timed is one training run's, of one configuration."""
    if others := [f"--{name}" for name in OTHER_THAN_TRAINING if getattr(args, name)]:
        them = "it" if len(others) == 1 else "them"
        raise ConfigError(
            f"{', '.join(others)}: train.py does not train with {them}, and the benchmark times a training "
            "run's step; give the options of the run to come"
        )


def main(argv=None) -> int:
    cfg = parse_args(argv)
    try:
        run = train_run(cfg["train_args"]) if cfg["train_args"] else None
    except SystemExit:
        remove_empty(cfg["created_folders"])
        raise
    if cfg["check_only"]:
        return 0
    if cfg["history"]:
        print(history.trend_table(history.read_history(history.history_path(cfg))))
        return 0
    # scancel: still remove the test files. Not before: nothing is written until here, and a stop ends it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.perf_counter()
    world = start_world()
    try:
        job_id = [os.environ.get("SLURM_JOB_ID") or datetime.now(UTC).strftime("%Y%m%d-%H%M%S")]
        dist.broadcast_object_list(job_id, src=0, group=world.cpu_group)
        local = {
            "rank": world.rank,
            "node_rank": world.node_rank,
            "hostname": socket.gethostname(),
            "node_name": node_name(),
            "nics_Gbps": nic_rates_Gbps(),
        }
        section_seconds = {}
        for section in SECTIONS:
            section_started = time.perf_counter()
            selected = section in cfg["sections"]
            why = cfg["skipped"].get(section, "not selected")
            local[section] = run_section(section, world, cfg) if selected else {"skipped": why}
            section_seconds[section] = time.perf_counter() - section_started
        everyone = [None] * world.size
        dist.all_gather_object(everyone, local, group=world.cpu_group)
        job = {
            "id": job_id[0],
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv),
            "mode": "quick" if cfg["quick"] else "default",
            "torch": str(torch.__version__),
            "seconds": time.perf_counter() - started,
            "section_seconds": section_seconds,
        }
        report = cluster_report(everyone, world, job, cfg)
        if run:
            # here, not above: only --train_args builds a model, and FSDP's imports cost every rank 0.7 s
            from run.prediction.probe import benchmark_section

            report["model"] = {
                "train_args": cfg["train_args"],
                **benchmark_section(*run, world.device, world.local_size),
            }
        write_reports(report, world, f"node{world.node_rank} ({local['node_name']})", cfg)
        return 1 if report["verdict"] == "fail" else 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
