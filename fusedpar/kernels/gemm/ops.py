"""torch.library ops of the persistent GEMM, with fake impls: torch.compile and CUDA graphs see one
opaque node.

`torch.ops.fusedpar.matmul` returns a new contiguous [M, N] tensor of A's dtype; `matmul_out`
writes a given [M, N] view. torch.library.custom_op re-registers cleanly when this module is
re-imported (the new definition replaces the old one), so import has no side effect beyond these
registrations.
"""

from __future__ import annotations

import torch

from fusedpar.kernels.gemm.launch import _check_args, _launch


@torch.library.custom_op("fusedpar::matmul", mutates_args=())
def _matmul_op(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """C = A @ W^T into a new contiguous [M, N] tensor of A's dtype."""
    out = torch.empty((a.shape[0], w.shape[0]), dtype=a.dtype, device=a.device)
    return _launch(a, w, out, fresh_out=True)


@_matmul_op.register_fake
def _matmul_fake(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    _check_args(a, w, None)
    return a.new_empty((a.shape[0], w.shape[0]))


@torch.library.custom_op("fusedpar::matmul_out", mutates_args=("out",))
def _matmul_out_op(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """out[:] = A @ W^T; out may be any strided [M, N] view of A's dtype or fp32."""
    _launch(a, w, out)


@_matmul_out_op.register_fake
def _matmul_out_fake(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    _check_args(a, w, out)
