"""A SymmetricWorkspace stand-in for gloo processes on CPU: each rank's buffer is a shared file mapping.

fusedpar.layers.kv_reshard.migrate_kv(staging=...) stores rows into peers' buffers at raw addresses
(fusedpar.kernels.kv_rows.push_kv_rows, run by the Triton interpreter on CPU). Here every rank maps
every rank's file, so a peer's buffer has an address in this process and a store through it lands in
the peer's file; the device barrier becomes gloo's barrier (CPU work is done when the call returns).
Collective: every rank of the world constructs it with the same directory and size.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


class FileStaging:
    """rank, ranks, buffer_bytes, view, peer_addresses and barrier: what migrate_kv uses of a workspace."""

    def __init__(self, directory: str, nbytes: int, tag: str = "staging"):
        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.ranks = tuple(range(world))
        self.buffer_bytes = nbytes
        paths = [os.path.join(directory, f"{tag}-{r}") for r in range(world)]
        with open(paths[self.rank], "wb") as f:
            f.truncate(nbytes)
        dist.barrier()  # every file exists before anyone maps it
        self.buffers = [torch.from_file(p, shared=True, size=nbytes, dtype=torch.uint8) for p in paths]

    def view(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's buffer as a typed 1-D tensor."""
        return self.buffers[self.rank].view(dtype)

    def peer_addresses(self) -> list[int]:
        """Every rank's buffer address in this process, in rank order."""
        return [b.data_ptr() for b in self.buffers]

    def barrier(self, timeout_ms: int = 0) -> None:
        """Every rank's stores so far have landed (gloo's barrier; timeout_ms: the group's own)."""
        dist.barrier()
