"""torch.library ops of the decode GEMM, with fake impls: torch.compile and CUDA graphs see one
opaque node (the partial kernel, the K-split workspace and the reduce pass are inside it).

`torch.ops.fusedpar.skinny_matmul` returns a new contiguous [M, N] tensor of A's dtype;
`skinny_matmul_out` writes a given [M, N] view. swiglu_block = I > 0: the SwiGLU epilogue (W in
per-block [gate | up] chunks of I rows), results [M, N / 2].
"""

from __future__ import annotations

import torch

from fusedpar.kernels.gemv.launch import _check_args, _launch, out_columns


@torch.library.custom_op("fusedpar::skinny_matmul", mutates_args=())
def _skinny_matmul_op(a: torch.Tensor, w: torch.Tensor, swiglu_block: int = 0) -> torch.Tensor:
    """C = A @ W^T (A of at most 64 rows; SwiGLU of it when swiglu_block > 0) into a new contiguous
    tensor of A's dtype."""
    out = torch.empty((a.shape[0], out_columns(w, swiglu_block)), dtype=a.dtype, device=a.device)
    return _launch(a, w, out, swiglu_block=swiglu_block, fresh_out=True)


@_skinny_matmul_op.register_fake
def _skinny_matmul_fake(a: torch.Tensor, w: torch.Tensor, swiglu_block: int = 0) -> torch.Tensor:
    _check_args(a, w, None, swiglu_block)
    return a.new_empty((a.shape[0], out_columns(w, swiglu_block)))


@torch.library.custom_op("fusedpar::skinny_matmul_out", mutates_args=("out",))
def _skinny_matmul_out_op(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, swiglu_block: int = 0) -> None:
    """out[:] = A @ W^T (or its SwiGLU); out may be any strided view of A's dtype or fp32."""
    _launch(a, w, out, swiglu_block=swiglu_block)


@_skinny_matmul_out_op.register_fake
def _skinny_matmul_out_fake(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, swiglu_block: int = 0) -> None:
    _check_args(a, w, out, swiglu_block)
