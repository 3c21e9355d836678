"""torch.distributed collectives with one-line contracts, shape asserts and size-1 shortcuts.

NCCL on CUDA tensors, gloo on CPU tensors (the CommGroup's process group decides). These are
the plain (unfused) paths: the reference layers use them, and the fused kernels fall back to
them where fusion does not pay.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fusedpar.collectives.context import CommGroup

# torch 2.13 renamed all_gather_into_tensor (deprecated there); the GPU image runs torch 2.11.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def seq_to_head_all_to_all(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """[n/G, G*C] sequence-sharded, column block g for peer g -> [n, C] head-sharded, rows in peer order.

    The Ulysses exchange before attention (Algorithm 2 line 4): peer g receives column block g
    of every peer's rows, stacked by source rank, i.e. its heads for the whole sequence.
    """
    G = group.size
    if x.dim() != 2:
        raise ValueError(f"seq_to_head_all_to_all expects [tokens, columns], got shape {tuple(x.shape)}")
    if x.shape[1] % G:
        raise ValueError(
            f"seq_to_head_all_to_all: {x.shape[1]} columns are not divisible by group size {G}"
        )
    if G == 1:
        return x
    m, C = x.shape[0], x.shape[1] // G
    send = x.reshape(m, G, C).transpose(0, 1).contiguous()  # [G, m, C]: block for peer g first
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group.pg)
    return recv.reshape(G * m, C)


def head_to_seq_all_to_all(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """[n, C] head-sharded, rows in peer order -> [n/G, G*C] sequence-sharded. Inverse of the above."""
    G = group.size
    if x.dim() != 2:
        raise ValueError(f"head_to_seq_all_to_all expects [tokens, columns], got shape {tuple(x.shape)}")
    if x.shape[0] % G:
        raise ValueError(
            f"head_to_seq_all_to_all: {x.shape[0]} tokens are not divisible by group size {G} "
            "(pad the step to a multiple of SP first)"
        )
    if G == 1:
        return x
    m, C = x.shape[0] // G, x.shape[1]
    send = x.contiguous()  # rows [g*m, (g+1)*m) belong to peer g
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group.pg)
    return recv.reshape(G, m, C).transpose(0, 1).reshape(m, G * C)


def all_gather_rows(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """[m, ...] on each peer -> [G*m, ...], peer g's rows at [g*m, (g+1)*m)."""
    if x.dim() == 0:
        raise ValueError("all_gather_rows: x must have >= 1 dim (rows first), got a 0-d tensor; use x.reshape(1)")
    if group.size == 1:
        return x
    out = torch.empty((group.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x.contiguous(), group=group.pg)
    return out


def all_reduce_sum(x: torch.Tensor, group: CommGroup) -> torch.Tensor:
    """Sum of x over the group's peers, in place on x (returned for chaining); x may be any view."""
    if group.size == 1:
        return x
    if not x.is_contiguous():
        # The process groups want dense tensors: gloo reduced a column slice's storage from its first
        # element as if it were contiguous (wrong sums, stores outside the view). Reduce a contiguous
        # copy and write it back.
        return x.copy_(all_reduce_sum(x.contiguous(), group))
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group.pg)
    return x
