"""Launch shape, options and workspace size of the one-shot all-reduce.

OneShotConfig: one launch's shape (tile, warps, program cap); default_config() picks small tiles
under the interpreter. AllReduceOptions: the tuning options of the public functions (size limit,
launch shape). one_shot_capacity_bytes: the largest message a workspace's double-buffer slot holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from fusedpar.collectives.symmetric import PeerTable
from fusedpar.kernels._host import INTERPRETED, require_pow2
from fusedpar.kernels._sync import slot_size


@dataclass(frozen=True)
class OneShotConfig:
    """Launch shape: BLOCK elements per tile, num_warps per program, at most max_blocks programs.

    GPU default: 2048 elements = 8 per thread with 8 warps = one 16-byte access per rank per
    thread for bf16; at most 32 programs, well under the 132 SMs of an H200, so every program is
    co-resident with the peer programs it waits for.
    """

    block: int = 2048
    num_warps: int = 8
    max_blocks: int = 32

    def __post_init__(self) -> None:
        # max_blocks=0 would launch an empty grid: out left unwritten and the epoch never advanced.
        require_pow2("OneShotConfig", block=self.block, num_warps=self.num_warps)
        if self.max_blocks < 1:
            raise ValueError(f"OneShotConfig: max_blocks={self.max_blocks} must be >= 1")


# Interpreter: small tiles and a few programs so the CPU tests exercise several programs, the
# grid-stride loop and partial tiles on small messages.
_INTERPRETER_CONFIG = OneShotConfig(block=256, num_warps=1, max_blocks=4)


_GPU_CONFIG = OneShotConfig()  # one instance: the default is taken per call


def default_config() -> OneShotConfig:
    """The launch shape used when none is given: small under the interpreter, OneShotConfig() on GPUs."""
    return _INTERPRETER_CONFIG if INTERPRETED else _GPU_CONFIG


@dataclass(frozen=True)
class AllReduceOptions:
    """Tuning options of all_reduce and one_shot_all_reduce (the defaults: None).

    max_one_shot_bytes: all_reduce takes the one-shot up to this many bytes (None: the routing
        table's all_reduce_one_shot_max_bytes, fusedpar.kernels.routing).
    config: the one-shot's launch shape (None: default_config()).
    """

    max_one_shot_bytes: int | None = None
    config: OneShotConfig | None = None


DEFAULT_OPTIONS = AllReduceOptions()


def one_shot_capacity_bytes(peers: PeerTable) -> int:
    """Largest message (bytes) one launch can reduce: one double-buffer slot."""
    return slot_size(peers)
