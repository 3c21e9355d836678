"""torch.library ops of the decode GEMM, with fake impls: torch.compile and CUDA graphs see one
opaque node (the partial kernel, the K-split workspace and the reduce pass are inside it).

`torch.ops.fusedpar.skinny_matmul` returns a new contiguous [M, N] tensor of A's dtype;
`skinny_matmul_out` writes a given [M, N] view.
"""

from __future__ import annotations

import torch

from fusedpar.kernels.gemv.launch import _check_args, _launch


@torch.library.custom_op("fusedpar::skinny_matmul", mutates_args=())
def _skinny_matmul_op(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """C = A @ W^T (A of at most 64 rows) into a new contiguous [M, N] tensor of A's dtype."""
    out = torch.empty((a.shape[0], w.shape[0]), dtype=a.dtype, device=a.device)
    return _launch(a, w, out, fresh_out=True)


@_skinny_matmul_op.register_fake
def _skinny_matmul_fake(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    _check_args(a, w, None)
    return a.new_empty((a.shape[0], w.shape[0]))


@torch.library.custom_op("fusedpar::skinny_matmul_out", mutates_args=("out",))
def _skinny_matmul_out_op(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """out[:] = A @ W^T; out may be any strided [M, N] view of A's dtype or fp32."""
    _launch(a, w, out)


@_skinny_matmul_out_op.register_fake
def _skinny_matmul_out_fake(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    _check_args(a, w, out)
