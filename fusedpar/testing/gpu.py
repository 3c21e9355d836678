"""Process-group setup for GPU tests and benchmarks launched with torchrun (one process per GPU)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

# NVLink multicast stays off on the lent machines (it can take a shared host's GPUs down).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


def init_torchrun_nccl() -> tuple[int, int]:
    """Initialise NCCL from torchrun's environment (idempotent); returns (rank, world_size)."""
    for k, v in MULTICAST_OFF.items():
        os.environ.setdefault(k, v)
    if not dist.is_initialized():
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    return dist.get_rank(), dist.get_world_size()
