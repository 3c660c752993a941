"""The benchmark's ranks: who runs where (World), the process group, the sections and the sizes of
each mode.
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.node import local_device

SECTIONS = ("gpu", "nccl", "links", "storage", "cpu", "memory")

# Sizes per mode; the CLI overrides some. Default: under 60 s per 8-GPU node (docs/PERFORMANCE.md).
# GPU figures: gpu_warmup_s of warm-up, then gpu_seconds of back-to-back calls in windows of
# gpu_window_s; the throttling ratio is the last window's rate over the first's.
# fmt: off
MODES = {
    "default": dict(matmul_size=8192, nccl_max_MiB=None, storage_MiB=1024, storage_workers=8,
                    memory_MiB=256, gpu_copy_MiB=1024, gpu_warmup_s=1.0, gpu_seconds=3.0,
                    gpu_window_s=1.0, cpu_matmul_size=2048,
                    zlib_MiB=2, sort_Melem=8, cpu_units_per_core=8, repeats=5,
                    random_read_seconds=1.0, collective_warmup=5, collective_iters=20,
                    pingpong_iters=50),
    "quick": dict(matmul_size=4096, nccl_max_MiB=None, storage_MiB=64, storage_workers=4,
                  memory_MiB=64, gpu_copy_MiB=256, gpu_warmup_s=1.0, gpu_seconds=1.0,
                  gpu_window_s=0.25, cpu_matmul_size=1024,
                  zlib_MiB=1, sort_Melem=1, cpu_units_per_core=2, repeats=3,
                  random_read_seconds=0.2, collective_warmup=1, collective_iters=3,
                  pingpong_iters=10),
}
# fmt: on


@dataclass
class World:
    rank: int
    size: int
    local_rank: int
    local_size: int
    device: torch.device
    cpu_group: object  # gloo group: waiting ranks block in it instead of spinning on a GPU sync

    @property
    def nodes(self) -> int:
        return self.size // self.local_size

    @property
    def node_rank(self) -> int:
        return self.rank // self.local_size

    @property
    def is_node_leader(self) -> bool:
        return self.local_rank == 0

    @property
    def leaders(self) -> list:
        return list(range(0, self.size, self.local_size))

    def barrier(self):
        dist.barrier(group=self.cpu_group)


def start_world() -> World:
    """torchrun's environment, or a one-rank group for a plain `python benchmark.py`."""
    device = local_device()
    backend = "nccl" if device.type == "cuda" else "gloo"
    options = {"device_id": device} if device.type == "cuda" else {}
    if "RANK" in os.environ:
        dist.init_process_group(backend, **options)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **options)
    cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else None
    return World(
        dist.get_rank(),
        dist.get_world_size(),
        int(os.environ.get("LOCAL_RANK", 0)),
        int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        device,
        cpu_group,
    )
