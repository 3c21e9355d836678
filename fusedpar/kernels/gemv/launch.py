"""Checks and the launcher of the decode GEMM (kernels.py); no op registration.

`_launch` checks the operands, picks the tiling (or takes an explicit SkinnyConfig: tests and
perf/tools/bench_gemv.py --sweep pass them) and runs the partial kernel, then the reduce pass
when some N tile is shared by several programs.
"""

from __future__ import annotations

import torch

from fusedpar.kernels._host import INTERPRETED, SUPPORTED_DTYPES, cdiv, check_out_overlap, max_offset
from fusedpar.kernels._sync import device_guard, sm_count
from fusedpar.kernels.gemv.config import MAX_M, SkinnyConfig, pick_config, schedule, tiles_are_whole
from fusedpar.kernels.gemv.kernels import _skinny_partial_kernel, _skinny_reduce_kernel

OP = "fusedpar.skinny_matmul"
REDUCE_BLOCK = 1024

# ================================================================================== checks


def out_columns(w: torch.Tensor, swiglu_block: int) -> int:
    """Columns of the result: W's rows, or half of them with the SwiGLU epilogue."""
    return w.shape[0] // 2 if swiglu_block else w.shape[0]


def _check_args(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None, swiglu_block: int = 0) -> None:
    """Shape/dtype/device checks shared by the real launch and the fake (meta) impl: one error that
    lists every violated constraint."""
    problems = []
    if swiglu_block < 0 or (swiglu_block and w.dim() == 2 and w.shape[0] % (2 * swiglu_block)):
        problems.append(f"swiglu_block={swiglu_block} must be 0 (no epilogue) or I > 0 with w's {w.shape[0]} rows a "
                        f"multiple of 2 I (per-block [gate | up] chunks of I rows)")
    if a.dim() != 2 or w.dim() != 2:
        problems.append(f"a must be [M, K] and w [N, K] (2-D), got a {tuple(a.shape)}, w {tuple(w.shape)}; "
                        "flatten leading dims of a first")
    else:
        if a.shape[0] > MAX_M:
            problems.append(f"a has M={a.shape[0]} rows, more than the {MAX_M} this decode GEMM takes "
                            "(use fusedpar.kernels.gemm.matmul)")
        if a.shape[1] != w.shape[1]:
            problems.append(f"inner dims differ: a {tuple(a.shape)} is [M, K] and w {tuple(w.shape)} is [N, K] "
                            f"(nn.Linear orientation), so a.shape[1]={a.shape[1]} must equal w.shape[1]={w.shape[1]}")
    if a.dtype not in SUPPORTED_DTYPES or w.dtype != a.dtype:
        problems.append(f"a and w must share one dtype of {SUPPORTED_DTYPES}, got a {a.dtype}, w {w.dtype}")
    if a.device != w.device:
        problems.append(f"a is on {a.device} but w is on {w.device}")
    if out is not None:
        if a.dim() == 2 and w.dim() == 2:
            want = (a.shape[0], out_columns(w, swiglu_block))
            if tuple(out.shape) != want:
                what = "[M, N / 2] (SwiGLU)" if swiglu_block else "[M, N]"
                problems.append(f"out must be {what} = {want} for a {tuple(a.shape)}, w {tuple(w.shape)}, "
                                f"got {tuple(out.shape)}")
        if out.dtype not in (a.dtype, torch.float32):
            problems.append(f"out dtype must be {a.dtype} (a's) or torch.float32, got {out.dtype}")
        if out.device != a.device:
            problems.append(f"out is on {out.device} but a is on {a.device}")
    if problems:
        raise ValueError(f"{OP}: " + "; ".join(problems))


# ================================================================================ launcher


def _launch(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, config: SkinnyConfig | None = None,
            *, swiglu_block: int = 0, fresh_out: bool = False) -> torch.Tensor:
    """Check the arguments and compute out = a @ w^T (swiglu_block = I > 0: out = SwiGLU of it, W in
    per-block [gate | up] chunks of I rows); `config` overrides pick_config. fresh_out: out was just
    allocated here, so the overlap checks are skipped."""
    _check_args(a, w, out, swiglu_block)
    if not fresh_out:  # real tensors only: the fake impls see no memory
        check_out_overlap(OP, out, a=a, w=w)
    m, k = a.shape
    n = out_columns(w, swiglu_block)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()  # silu(0) * 0 = 0 too
    if a.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            f"{OP} got CPU tensors but its Triton kernel was compiled for a GPU: set TRITON_INTERPRET=1 before "
            "fusedpar.kernels.gemv is first imported (Triton reads it when @triton.jit runs) to use the CPU "
            "interpreter"
        )
    if a.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{OP} supports CUDA (and CPU under TRITON_INTERPRET=1), got {a.device}")
    for name, t in (("a", a), ("w", w), ("out", out)):
        if max_offset(t) >= 2**31:  # int32 offsets in the kernels
            raise ValueError(f"{OP}: {name} {tuple(t.shape)} with strides {t.stride()} spans >= 2**31 elements; "
                             "int32 offsets would overflow (split the call)")

    # With SwiGLU a unit reads two W tiles (gate, up): the schedule is that of the N output columns.
    cfg = config or pick_config(m, n, k, dtype=a.dtype, num_sms=sm_count(a.device, INTERPRETED),
                                interpret=INTERPRETED, swiglu=bool(swiglu_block))
    programs, k_steps, units, max_segments, max_slots = schedule(n, k, cfg.block_n, cfg.block_k, cfg.programs)
    split = not tiles_are_whole(units, k_steps, programs)
    # Split tiles: fp32 partials per (slot, row, column), summed in slot order by the reduce pass.
    planes = 2 if swiglu_block else 1  # SwiGLU: gate and up partials
    ws = torch.empty((max_slots, planes, m, n) if split else (1,), dtype=torch.float32, device=a.device)
    with device_guard(a.device):  # Triton launches on the current CUDA device
        _skinny_partial_kernel[(programs,)](
            a,
            w,
            out,
            ws,
            m,
            n,
            k,
            swiglu_block,
            k_steps,
            units,
            max_segments,
            a.stride(0),
            a.stride(1),
            w.stride(0),
            w.stride(1),
            out.stride(0),
            out.stride(1),
            BLOCK_M=cfg.block_m(m),
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            EVEN_K=k % cfg.block_k == 0,
            DOT=cfg.dot,
            INPUT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
            SWIGLU=bool(swiglu_block),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        if split:
            _skinny_reduce_kernel[(cdiv(m * n, REDUCE_BLOCK),)](
                ws, out, m, n, k_steps, units, programs, max_slots, out.stride(0), out.stride(1),
                BLOCK_N=cfg.block_n, BLOCK=REDUCE_BLOCK, SWIGLU=bool(swiglu_block), num_warps=4,
            )
    return out
