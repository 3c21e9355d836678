"""Persistent Triton GEMM over strided weight views: the base of the fused GEMM + collective ops.

Math and layout
    C[M, N] = A[M, K] @ W[N, K]^T, i.e. C[m, n] = sum_k A[m, k] W[n, k] (F.linear without bias), W in
    nn.Linear orientation [out_features, in_features]. A, W and C may have ANY strides: shift-mode
    weights are `narrow` views of the rank's base weight (a row range for column-parallel weights, a
    column range for row-parallel ones), read in place, so the shift config costs no weight bytes.
    Inputs fp16 / bf16 / fp32 (A and W alike); fp32 accumulator; C stored in its own dtype (the
    input dtype or fp32).

Persistence: the grid is min(#SMs, #tiles); program p handles tiles p, p + #SMs, ... in a
GROUP_M-swizzled order (GROUP_M tile rows sweep the N tiles together, so a band of A rows and the
W tiles they meet stay in L2). The fused kernels reuse this loop (`tile_coords`, `load_k_tile`,
`load_w_tile`): resident programs owning a known tile sequence can publish each finished tile.

Modules: kernels (@triton.jit: the kernel and its device helpers), config (GemmConfig,
pick_config), launch (checks, TMA descriptors, the launcher), ops (torch.library ops
`torch.ops.fusedpar.matmul` / `matmul_out` with fake impls: torch.compile and CUDA graphs see one
opaque node), this module (`matmul` and its reference).

CPU: under TRITON_INTERPRET=1 (set before the first import) the kernel runs on the interpreter,
which cannot tl.dot bf16: interpret fp16/fp32, test bf16 on a GPU.
"""

from __future__ import annotations

import torch

from fusedpar.kernels.gemm import ops as _ops  # noqa: F401  (registers torch.ops.fusedpar.matmul*)
from fusedpar.kernels.gemm.config import SMEM_BYTES, GemmConfig, pick_config, require_one_block
from fusedpar.kernels.gemm.kernels import load_k_tile, load_w_tile, tile_coords
from fusedpar.kernels.gemm.launch import split_w_descriptor, tma_compatible, tma_descriptors

__all__ = ["SMEM_BYTES", "GemmConfig", "load_k_tile", "load_w_tile", "matmul", "matmul_reference", "pick_config",
           "require_one_block", "split_w_descriptor", "tile_coords", "tma_compatible", "tma_descriptors"]


def matmul(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """C[M, N] = a[M, K] @ w[N, K]^T (fp32 accumulation) with the persistent Triton kernel.

    a: [M, K], w: [N, K] in nn.Linear orientation; both fp16/bf16/fp32 (same dtype), any strides
    (w is typically a `narrow` view of a larger base weight). out: optional [M, N] destination of
    a's dtype or fp32, any strides; it is fully overwritten, and must not share memory with a, w or
    itself (ValueError). Returns out (or a new tensor).
    Goes through the registered ops, so it is safe under torch.compile and CUDA-graph capture.
    No autograd: this is an inference kernel.
    """
    if out is None:
        return torch.ops.fusedpar.matmul(a, w)
    torch.ops.fusedpar.matmul_out(a, w, out)
    return out


def matmul_reference(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The plain PyTorch result (cuBLAS on GPU): torch.nn.functional.linear(a, w), a's dtype.

    This is both the perf baseline and a same-precision oracle; tests that check accuracy
    compare against a float64 product instead.
    """
    return torch.nn.functional.linear(a, w)
