"""Process-group setup and helpers for GPU tests and benchmarks launched with torchrun (one process per GPU)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

# NVLink multicast stays off (on a shared host it can take every GPU down).
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


def local_device() -> torch.device:
    """The device of a single-GPU test: cuda:LOCAL_RANK (mod #GPUs, one GPU per torchrun rank), else CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def world_group_or_skip(nccl_world: tuple[int, int]):
    """The WORLD process group of the `nccl_world` session (tests/conftest.py) with >= 2 ranks, or a pytest skip."""
    import pytest

    _, world_size = nccl_world
    if world_size < 2:
        pytest.skip("needs at least 2 ranks: torchrun --nproc-per-node N with N >= 2")
    return dist.group.WORLD


def all_ranks_ok(ok: bool) -> bool:
    """True iff `ok` on every rank: ranks assert together instead of one hanging in a collective."""
    flag = torch.tensor([1 if ok else 0], device="cuda")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
