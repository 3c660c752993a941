"""This node: its name as SLURM knows it, the host memory free for work, and the device of this process."""

import os
import socket
from pathlib import Path


def available_memory_bytes() -> int:
    """MemAvailable: what the kernel can give without swapping; 0 where /proc/meminfo does not say."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def node_name() -> str:
    """This node as SLURM names it (what sbatch --exclude takes); its hostname outside a job."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def local_device():
    """This process's device: its local rank's GPU, made the current one so that NCCL and every
    allocation land there, or the CPU where there is no GPU."""
    import torch  # here, not above: the job (run/job/) names its node on a python that may lack torch

    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    return device
