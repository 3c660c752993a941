"""The benchmark's command line checked before any measurement: bad input is one line, exit status 2."""

import argparse
import difflib
import glob
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch

from checks.history import history_path
from checks.host import l3_cache_bytes
from checks.timing import MiB
from checks.world import SECTIONS
from common.errors import ConfigError, report_config_error
from common.files import make_folders
from common.node import available_memory_bytes

# Largest collective message by (device, quick): gloo on CPU is ~100x slower than NCCL on NVLink.
# On GPU, 1 GiB: NVLS all-reduce levels off only above 256 MiB (nccl-tests sweeps to 8 GiB).
NCCL_MAX_MiB = {("cuda", False): 1024, ("cuda", True): 256, ("cpu", False): 16, ("cpu", True): 1}
CACHE_MULTIPLE = 4  # STREAM's rule: each array at least 4x the last-level cache


class OneLineErrors(argparse.ArgumentParser):
    """Bad input is train.py's one line, `error: ...`, on stderr (once per node under torchrun), exit
    status 2."""

    def error(self, message):
        report_config_error(ConfigError(message, per_node=True))


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(text)


def positive_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def section_list(option: str, text: str, parser) -> set:
    names = {name.strip() for name in text.split(",") if name.strip()}
    for name in names - set(SECTIONS):
        close = difflib.get_close_matches(name, SECTIONS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        parser.error(f"{option}: unknown section {name!r}{hint}; sections are {', '.join(SECTIONS)}")
    return names


# Options that size the measurements: (type, help). Unset, they take the mode's value from MODES.
SIZE_OPTIONS = {
    "--storage_MiB": (positive_int, "MiB written per node (default 1024, --quick 64)"),
    "--storage_workers": (positive_int, "parallel writers/readers (default 8, --quick 4)"),
    "--memory_MiB": (positive_int, "each STREAM array (default 256, --quick 64; >= 4x L3)"),
    "--matmul_size": (
        positive_int,
        "square matmul tried besides the MAMF shapes (default 8192, --quick 4096)",
    ),
    "--nccl_max_MiB": (positive_int, "largest collective (default 1024 GPU / 16 CPU, --quick 256 / 1)"),
    "--gpu_seconds": (
        positive_number,
        "timed loop of each GPU figure after 1 s of warm-up (default 3, --quick 1)",
    ),
    "--nic_gbps": (
        positive_number,
        "one NIC's line rate in Gb/s, for the inter-node floor (default: read from /sys/class/infiniband)",
    ),
}


def validate(cfg: dict, args, parser):
    """Everything knowable before the first measurement, so bad input costs nothing."""
    if cfg["report"]:
        check_report_path(Path(cfg["report"]), parser, cfg["created_folders"])
    else:
        check_folder("--report_dir", Path(cfg["report_dir"]), parser, cfg["created_folders"])
    found = history_path(cfg)
    if os.path.lexists(found) and not found.is_file():
        option = "--report" if cfg["report"] else "--report_dir"
        parser.error(f"{option}: the history beside the reports, {found}, is not a file; move it away")
    if cfg["outcome"]:
        refuse_existing("--outcome", Path(cfg["outcome"]), parser)
        check_folder("--outcome", Path(cfg["outcome"]).parent, parser, cfg["created_folders"])
    if "storage" in cfg["sections"]:
        check_storage(cfg, parser)
    if "memory" in cfg["sections"]:
        check_memory(cfg, args, parser)
    if cfg["sections"] == ["gpu"] and not torch.cuda.is_available():
        parser.error("--only=gpu on a machine without a GPU would check nothing; run it on a GPU node")
    if cfg["nccl_max_MiB"] is None:
        cfg["nccl_max_MiB"] = NCCL_MAX_MiB[("cuda" if torch.cuda.is_available() else "cpu", cfg["quick"])]
    elif {"nccl", "links"} & set(cfg["sections"]):
        check_collective_size(cfg["nccl_max_MiB"], parser)


def check_collective_size(max_mib: int, parser):
    """The largest collective's input and output, on every rank, fit in half of what a rank has: a GPU's
    memory, or its share of the node's available memory."""
    needed = 2 * max_mib * MiB
    if torch.cuda.is_available():
        room, whose = torch.cuda.get_device_properties(0).total_memory, "a GPU's memory"
    else:
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        room, whose = (
            available_memory_bytes() / ranks,
            f"its share of the node's memory ({ranks} rank{'s' * (ranks > 1)})",
        )
    if needed > room / 2:
        parser.error(
            f"--nccl_max_MiB {max_mib}: the largest collective's input and output need {bytes_text(needed)} "
            f"a rank, more than half of {whose}, {bytes_text(room)}; lower it"
        )


def dangling_link(path: Path) -> Path | None:
    """The first folder on the way to path that is a symbolic link to nothing: mkdir would only say
    "File exists" about it."""
    for folder in [*reversed(path.parents), path]:
        if folder.is_symlink() and not folder.exists():
            return folder
    return None


def check_folder(option: str, folder: Path, parser, created: list):
    """A folder the reports can go to: created if missing (added to created, outermost first), and
    writable."""
    if link := dangling_link(folder):
        parser.error(
            f"{option} {folder}: {link} is a broken symbolic link (to {os.readlink(link)}); "
            "create its target or pass another folder"
        )
    try:
        created.extend(make_folders(folder))
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as error:
        parser.error(f"{option} {folder}: cannot write there ({error.strerror}); pass a writable folder")


def refuse_existing(option: str, path: Path, parser):
    """A file the run creates: never one that exists."""
    if os.path.lexists(path):
        parser.error(f"{option} {path} already exists; pass a new file name or remove it")


def check_report_path(path: Path, parser, created: list):
    """--report names a new file: never one that exists, nor one whose node reports would replace others."""
    refuse_existing("--report", path, parser)
    if path.suffix != ".yaml":
        parser.error(f"--report {path}: the report is YAML; pass a name ending in .yaml")
    if taken := sorted(path.parent.glob(f"{glob.escape(path.stem)}_rank*.yaml")):
        parser.error(f"--report {path}: {taken[0]} already exists; pass a new file name or remove it")
    check_folder("--report", path.parent, parser, created)


def bytes_text(nbytes: float) -> str:
    """Bytes in the largest decimal unit that keeps a digit before the point: 0.4 GB reads 400.0 MB."""
    if nbytes < 1000:
        return f"{nbytes:.0f} bytes"
    units = ("kB", "MB", "GB", "TB", "PB")
    power = min(int(math.log10(nbytes) // 3), len(units))
    return f"{nbytes / 1000**power:.1f} {units[power - 1]}"


def check_storage(cfg: dict, parser):
    path = Path(cfg["storage_path"])
    if path.is_file():
        parser.error(f"--storage_path {path} is a file, not a folder; pass a folder or --skip storage")
    if not path.is_dir():
        parser.error(
            f"--storage_path {path}: no such folder; create it (mkdir -p {path}), pass another "
            "or --skip storage"
        )
    try:
        tempfile.TemporaryFile(dir=path).close()
    except OSError as error:
        parser.error(
            f"--storage_path {path}: cannot write there ({error.strerror}); pass a writable folder "
            "or --skip storage"
        )
    if cfg["storage_MiB"] < cfg["storage_workers"]:
        parser.error(
            f"--storage_MiB {cfg['storage_MiB']} is less than --storage_workers "
            f"{cfg['storage_workers']}: each worker writes whole 1 MiB blocks"
        )
    free, needed = shutil.disk_usage(path).free, 2 * cfg["storage_MiB"] * MiB
    if free < needed:
        parser.error(
            f"--storage_path {path}: {bytes_text(free)} free, the storage test needs {bytes_text(needed)}; "
            "lower --storage_MiB or free space"
        )


def check_memory(cfg: dict, args, parser):
    """STREAM's arrays at least CACHE_MULTIPLE times the L3 cache, three of them in half the memory. Where
    the size is this check's own choice and none fits (a small VM on a host of a large L3), the section is
    skipped, with why: the rest of the benchmark still runs."""
    l3, available = l3_cache_bytes(), available_memory_bytes()
    floor, fits = -(-CACHE_MULTIPLE * l3 // MiB), int(available / 2 / 3 // MiB)
    if args.memory_MiB is None:
        cfg["memory_MiB"] = max(cfg["memory_MiB"], floor)
        if cfg["memory_MiB"] > fits:
            cfg["sections"].remove("memory")
            cfg["skipped"]["memory"] = (
                f"3 arrays of {cfg['memory_MiB']} MiB (at least {CACHE_MULTIPLE}x the {l3 // MiB} MiB L3 "
                f"cache) need more than half of the {bytes_text(available)} available"
            )
            if not cfg["sections"]:
                parser.error(f"--only=memory: {cfg['skipped']['memory']}")
    elif args.memory_MiB < floor:
        parser.error(
            f"--memory_MiB {args.memory_MiB} is under {CACHE_MULTIPLE}x this node's L3 cache "
            f"({floor} MiB): it would measure cache, not memory; pass at least {floor}"
        )
    elif args.memory_MiB > fits:
        fix = f"lower it to {fits} at most" if fits >= floor else f"not even {floor} fits: --skip=memory"
        parser.error(
            f"--memory_MiB {args.memory_MiB}: 3 arrays need more than half of the {bytes_text(available)} "
            f"available; {fix}"
        )
