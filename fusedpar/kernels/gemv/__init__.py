"""Weight-streaming Triton GEMM for decode: C = A @ W^T with A of 1 to 64 rows.

Math and layout
    C[M, N] = A[M, K] @ W[N, K]^T (F.linear without bias), W in nn.Linear orientation; A, W and C
    may have any strides (W typically a `narrow` shard view read in place, as in
    fusedpar.kernels.gemm). Inputs fp16 / bf16 / fp32 (A and W alike); fp32 accumulation; C in
    A's dtype or fp32. M <= 64 (MAX_M): larger batches belong to fusedpar.kernels.gemm. Optional
    SwiGLU epilogue for gate_up projections (swiglu_block; kernels.py says how).

Why a second GEMM: at a few rows the step is bound by reading W once, and a TP rank's shard GEMMs
have too few N tiles to cover the SMs (N = 1280 is 20 tiles of 64 on 132 SMs). Here the K steps of
all N tiles (one step: a [BLOCK_N, BLOCK_K] W tile, read in wide loads) are shared out in equal
contiguous runs over a chosen number of programs (config.choose_programs): split-K where that fills
the SMs in whole waves, stream-K (one program per SM) where it does not. Tiles several programs
share have their fp32 partials summed by a second, tiny pass in program order: bit-identical
results run to run, whatever order the programs finish in.

Modules: kernels (@triton.jit), config (SkinnyConfig, GPU_TABLE, pick_config), launch (checks and
launcher), ops (torch.library ops `torch.ops.fusedpar.skinny_matmul` / `skinny_matmul_out` with fake
impls), this module (`skinny_matmul`, and `takes`: whether a caller's GEMM belongs here).

CPU: under TRITON_INTERPRET=1 (set before the first import) the kernels run on the interpreter: tl.dot
for fp16 / fp32, CUDA-core products (SkinnyConfig.dot=False) for bf16, which the interpreter's tl.dot
cannot do.
"""

from __future__ import annotations

import torch

from fusedpar.kernels.gemv import ops as _ops  # noqa: F401  (registers torch.ops.fusedpar.skinny_matmul*)
from fusedpar.kernels.gemv.config import GPU_TABLE, MAX_M, SkinnyConfig, choose_programs, pick_config

__all__ = ["GPU_TABLE", "MAX_M", "SkinnyConfig", "choose_programs", "pick_config", "skinny_matmul", "takes"]

_HALF = (torch.float16, torch.bfloat16)


def takes(a: torch.Tensor, w: object, swiglu_block: int = 0) -> bool:
    """Whether a decode layer's GEMM a @ w^T (with the SwiGLU epilogue when swiglu_block > 0) belongs on
    skinny_matmul: a [M, K] with 1 <= M <= MAX_M, w a plain [N, K] tensor (not a quantised weight) of a's
    dtype, fp16 or bf16, and with SwiGLU N a multiple of 2 * swiglu_block. Reads shapes and dtypes only,
    so every rank of a group decides alike; fp32 stays on the plain GEMM."""
    if not isinstance(w, torch.Tensor) or a.dim() != 2 or w.dim() != 2:
        return False
    if not 1 <= a.shape[0] <= MAX_M or a.shape[1] != w.shape[1]:
        return False
    if a.dtype not in _HALF or w.dtype != a.dtype:
        return False
    return swiglu_block == 0 or (swiglu_block > 0 and w.shape[0] % (2 * swiglu_block) == 0)


def skinny_matmul(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *,
                  swiglu_block: int = 0) -> torch.Tensor:
    """C[M, N] = a[M, K] @ w[N, K]^T (fp32 accumulation, deterministic) for M <= 64.

    a: [M, K], w: [N, K] in nn.Linear orientation; both fp16/bf16/fp32 (same dtype), any strides.
    out: optional [M, N] destination of a's dtype or fp32, any strides; fully overwritten; must not
    share memory with a, w or itself (ValueError). Returns out (or a new tensor).
    swiglu_block = I > 0: a gate_up projection with its SwiGLU epilogue: w holds per-block [gate | up]
    chunks of I rows (fusedpar.kernels.swiglu's layout), the result is [M, N / 2] =
    blocked_swiglu(a @ w^T, I) with the same roundings as that GEMM followed by silu_mul, without the
    [M, N] intermediate.
    Goes through the registered ops, so it is safe under torch.compile and CUDA-graph capture (the
    K-split workspace is allocated inside the op, from the graph's pool when captured).
    No autograd: this is an inference kernel.
    """
    if out is None:
        return torch.ops.fusedpar.skinny_matmul(a, w, swiglu_block)
    torch.ops.fusedpar.skinny_matmul_out(a, w, out, swiglu_block)
    return out
