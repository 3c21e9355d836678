"""Checks, TMA descriptors and the launcher of the persistent GEMM (kernels.py); no op registration.

`_launch` checks the operands and runs the kernel into a given out, with an optional explicit
tiling (the registered ops of ops.py call it; tests and perf/tools/tune_gemm.py pass tilings).
`tma_compatible`, `tma_descriptors` and `split_w_descriptor` are shared with the fused kernels'
launchers (fusedpar.kernels.ulysses).
"""

from __future__ import annotations

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from fusedpar.kernels._host import INTERPRETED, SUPPORTED_DTYPES, cdiv, check_out_overlap, max_offset
from fusedpar.kernels._sync import device_guard, sm_count
from fusedpar.kernels.gemm.config import GemmConfig, pick_config
from fusedpar.kernels.gemm.kernels import _persistent_matmul_kernel

# ================================================================================== checks


def _check_args(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None) -> None:
    """Shape/dtype/device checks shared by the real launch and the fake (meta) impl."""
    if a.dim() != 2 or w.dim() != 2:
        raise ValueError(
            f"fusedpar.matmul: a must be [M, K] and w [N, K] (2-D), got a {tuple(a.shape)}, "
            f"w {tuple(w.shape)}; flatten leading dims of a first"
        )
    if a.shape[1] != w.shape[1]:
        raise ValueError(
            f"fusedpar.matmul: inner dims differ: a {tuple(a.shape)} is [M, K] and w {tuple(w.shape)} "
            f"is [N, K] (nn.Linear orientation), so a.shape[1] must equal w.shape[1]"
        )
    if a.dtype not in SUPPORTED_DTYPES or w.dtype != a.dtype:
        raise TypeError(
            f"fusedpar.matmul: a and w must share one dtype of {SUPPORTED_DTYPES}, got a {a.dtype}, w {w.dtype}"
        )
    if a.device != w.device:
        raise ValueError(f"fusedpar.matmul: a is on {a.device} but w is on {w.device}")
    if out is not None:
        want = (a.shape[0], w.shape[0])
        if tuple(out.shape) != want:
            raise ValueError(
                f"fusedpar.matmul: out must be [M, N] = {want} for a {tuple(a.shape)}, w {tuple(w.shape)}, "
                f"got {tuple(out.shape)}"
            )
        if out.dtype not in (a.dtype, torch.float32):
            raise TypeError(f"fusedpar.matmul: out dtype must be {a.dtype} or torch.float32, got {out.dtype}")
        if out.device != a.device:
            raise ValueError(f"fusedpar.matmul: out is on {out.device} but a is on {a.device}")


def tma_compatible(*tensors: torch.Tensor) -> bool:
    """Whether every 2-D tensor can back a TMA descriptor: stride 1 along its last dim, and a
    16-byte aligned base and row stride (the hardware's rule for bulk tensor copies)."""
    for t in tensors:
        size = t.element_size()
        if t.stride(1) != 1 or t.data_ptr() % 16 or (t.stride(0) * size) % 16 or (t.shape[1] * size) < 16:
            return False
    return True


def tma_descriptors(a: torch.Tensor, w: torch.Tensor, block_m: int, block_n: int, block_k: int):
    """Host-side TMA descriptors of a [M, K] (tiles [block_m, block_k]) and w [N, K] (tiles
    [block_n, block_k]); reads past either edge return zeros. Host-side (kernel arguments) rather
    than built in the kernel, which would need a global Triton scratch allocator."""
    return (TensorDescriptor(a, list(a.shape), list(a.stride()), [block_m, block_k]),
            TensorDescriptor(w, list(w.shape), list(w.stride()), [block_n, block_k]))


def split_w_descriptor(w: torch.Tensor, cfg: GemmConfig, use_tma: bool):
    """The TMA descriptor of w for a split tile's second column block ([block_n2, block_k] tiles), or
    None: no TMA loads or no split tile (the kernels then take w2_desc=None)."""
    if not (use_tma and cfg.block_n2):
        return None
    return TensorDescriptor(w, list(w.shape), list(w.stride()), [cfg.block_n2, cfg.block_k])


# ================================================================================ launcher


def _launch(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, config: GemmConfig | None = None,
            *, fresh_out: bool = False) -> torch.Tensor:
    """Check the arguments and run the kernel into `out` (allocated by the caller); `config` overrides the
    block-size heuristic (tests use it to exercise other tilings). fresh_out: out was just allocated
    here, so the overlap checks are skipped."""
    _check_args(a, w, out)
    if not fresh_out:  # real tensors only: the fake impls see no memory
        check_out_overlap("fusedpar.matmul", out, a=a, w=w)
    m, k = a.shape
    n = w.shape[0]
    if m == 0 or n == 0:
        return out
    if a.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            "fusedpar.matmul got CPU tensors but its Triton kernel was compiled for a GPU: set "
            "TRITON_INTERPRET=1 before fusedpar.kernels.gemm is first imported (Triton reads it "
            "when @triton.jit runs) to use the CPU interpreter"
        )
    if a.device.type not in ("cpu", "cuda"):
        raise ValueError(f"fusedpar.matmul supports CUDA (and CPU under TRITON_INTERPRET=1), got {a.device}")
    for name, t in (("a", a), ("w", w), ("out", out)):
        # The kernel forms offsets as int32 products of index and stride.
        if max_offset(t) >= 2**31:
            raise ValueError(
                f"fusedpar.matmul: {name} {tuple(t.shape)} with strides {t.stride()} spans >= 2**31 "
                "elements; int32 offsets would overflow (split the call)"
            )

    num_sms = sm_count(a.device, INTERPRETED)
    tma_ok = tma_compatible(a, w)
    cfg = config or pick_config(m, n, k, dtype=a.dtype, out_dtype=out.dtype, num_sms=num_sms, interpret=INTERPRETED,
                                tma=tma_ok and not INTERPRETED)
    num_tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.tile_n)
    grid = (min(num_sms, num_tiles),)
    use_tma = cfg.tma and tma_ok
    a_desc, w_desc = tma_descriptors(a, w, cfg.block_m, cfg.block_n, cfg.block_k) if use_tma else (None, None)
    w2_desc = split_w_descriptor(w, cfg, use_tma)
    with device_guard(a.device):  # Triton launches on the current CUDA device
        _persistent_matmul_kernel[grid](
            a,
            w,
            out,
            a_desc,
            w_desc,
            w2_desc,
            m,
            n,
            k,
            a.stride(0),
            a.stride(1),
            w.stride(0),
            w.stride(1),
            out.stride(0),
            out.stride(1),
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            GROUP_M=cfg.group_m,
            NUM_SMS=num_sms,
            EVEN_K=k % cfg.block_k == 0,
            INPUT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
            TMA=use_tma,
            FLATTEN=cfg.flatten,
            BLOCK_N2=cfg.block_n2,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return out
