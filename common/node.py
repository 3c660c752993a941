"""This node: its name as SLURM knows it, the host memory free for work, and the suspects file by which a
phase names a bad node to the job script, which leaves it out and requeues (docs/SLURM.md)."""

import json
import os
import socket
import time
from pathlib import Path

import torch

from common.files import write_atomically


def available_memory_bytes() -> int:
    """MemAvailable: what the kernel can give without swapping; 0 where /proc/meminfo does not say."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def node_name() -> str:
    """This node as SLURM names it (what sbatch --exclude takes); its hostname outside a job."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def local_device() -> torch.device:
    """This process's device: its local rank's GPU, made the current one so that NCCL and every
    allocation land there, or the CPU where there is no GPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    return device


def write_suspects(folder, name, suspects):
    """Adds {node: why} to the suspects the job script reads once the phase has ended, as
    <folder>/<name>.json: each writer its own file, so none overwrites another's."""
    if not suspects:
        return
    os.makedirs(folder, exist_ok=True)
    write_atomically(
        os.path.join(folder, f"{name}.json"), json.dumps({"time": time.time(), "nodes": suspects})
    )
