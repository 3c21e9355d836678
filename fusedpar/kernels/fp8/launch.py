"""Checks, tilings and launchers of the FP8 kernels (kernels.py); no op registration (ops.py).

`_launch_quantize` quantises activations into given tensors, `_launch_mm` runs the scaled GEMM into
a given out (tests pass poisoned outs and explicit tilings). `check_quantize_args` / `check_mm_args`
are shared with the fake impls: every violated constraint is listed, with its numbers.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton.language as tl

from fusedpar.kernels._host import INTERPRETED, cdiv, check_out_overlap, max_offset, next_pow2
from fusedpar.kernels._sync import device_guard, sm_count
from fusedpar.kernels.fp8.kernels import _fp8_matmul_kernel, _quantize_groups_kernel, _quantize_rows_kernel
from fusedpar.kernels.fp8.reference import E4M3
from fusedpar.kernels.gemm.config import SMEM_BYTES, GemmConfig
from fusedpar.kernels.gemm.launch import tma_compatible, tma_descriptors

ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # activations and outputs
NO_FP8_SCALES = (None, None, 1, 1, 1, 0, 0, 0, 0)  # a fused kernel's scale arguments without FP8
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
MIN_BLOCK_K = 16 if INTERPRETED else 32  # an e4m3 wgmma consumes K in steps of 32
# inputs per step of the per-token quantiser: a whole row of the TP=4 shapes (K <= 8192) in one load, kept in
# registers (16 per thread at 16 warps); 1024 under the interpreter, so the tests see the two-pass loop too
_QUANT_BLOCK = 1024 if INTERPRETED else 8192


def _fail(op: str, problems: list[str], exc: type[Exception] = ValueError) -> None:
    if problems:
        raise exc(f"{op}: " + "; ".join(problems))


def _check_device(op: str, *tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"{op}: operands on several devices {sorted(map(str, devices))}")
    device = tensors[0].device
    if device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(f"{op} got CPU tensors but its Triton kernels were compiled for a GPU: set "
                           "TRITON_INTERPRET=1 before fusedpar.kernels is first imported to use the CPU interpreter "
                           "(or use fusedpar.kernels.fp8.fp8_linear, the plain-PyTorch reference)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{op} supports CUDA (and CPU under TRITON_INTERPRET=1), got {device}")


# ============================================================================ quantisation


def check_quantize_args(x: torch.Tensor, group: int) -> None:
    op = "fusedpar fp8 quantize"
    problems = []
    if x.dim() != 2:
        problems.append(f"x must be 2-D [tokens, K], got shape {tuple(x.shape)}")
    if x.dtype not in ACT_DTYPES:
        problems.append(f"x dtype {x.dtype} is not one of {ACT_DTYPES}")
    if group < 1:
        problems.append(f"group={group} must be >= 1 (input columns per scale)")
    _fail(op, problems)


def quantize_shapes(x: torch.Tensor, group: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(q, scale) shapes for x [M, K] in groups of `group` columns (>= K: one scale per token)."""
    m, k = x.shape
    return (m, k), (m, cdiv(k, min(group, k)) if k else 1)


def _launch_quantize(x: torch.Tensor, group: int, q: torch.Tensor, scale: torch.Tensor) -> None:
    """x [M, K] -> q (e4m3 [M, K], rows contiguous) and scale (fp32 [M, ceil(K / group)])."""
    check_quantize_args(x, group)
    m, k = x.shape
    if m == 0 or k == 0:
        return
    _check_device("fusedpar fp8 quantize", x)
    with device_guard(x.device):
        if group >= k:
            block = min(_QUANT_BLOCK, max(16, next_pow2(k)))
            _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), x.stride(1), q.stride(0), scale.stride(0),
                                        BLOCK=block, ONE_BLOCK=k <= block, num_warps=max(4, min(16, block // 512)))
        else:
            num_groups = cdiv(k, group)
            group_p2 = max(16, next_pow2(group))
            per_prog = max(1, min(next_pow2(num_groups), 2048 // group_p2))
            _quantize_groups_kernel[(m, cdiv(num_groups, per_prog))](
                x, q, scale, k, group, num_groups, x.stride(0), x.stride(1), q.stride(0), scale.stride(0),
                GROUPS_PER_PROG=per_prog, GROUP_P2=group_p2, num_warps=4)


# ==================================================================================== GEMM


def mm_block_k(k: int, w_tile_k: int, x_group: int, block_k: int) -> int | None:
    """The largest BLOCK_K <= block_k (>= MIN_BLOCK_K) putting every K step inside one weight tile and one
    activation group along K (a tile or group spanning K always does), or None."""
    bk = block_k
    while bk >= MIN_BLOCK_K:
        if all(t >= k or t % bk == 0 for t in (w_tile_k, x_group)):
            return bk
        bk //= 2
    return None


def check_mm_args(qx: torch.Tensor, x_scale: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor,
                  w_tile: tuple[int, int], x_group: int, bias: torch.Tensor | None, out_dtype: torch.dtype,
                  out: torch.Tensor | None = None) -> None:
    """Every violated constraint of the scaled GEMM, listed with its numbers (shared by the fake impls)."""
    op = "fusedpar fp8 scaled_mm"
    problems = []
    if qx.dim() != 2 or qw.dim() != 2:
        _fail(op, [f"qx must be [M, K] and qw [N, K] (2-D), got {tuple(qx.shape)} and {tuple(qw.shape)}"])
    m, k = qx.shape
    n = qw.shape[0]
    if qw.shape[1] != k:
        problems.append(f"inner dims differ: qx {tuple(qx.shape)} is [M, K], qw {tuple(qw.shape)} is [N, K]")
    for name, t in (("qx", qx), ("qw", qw)):
        if t.dtype != E4M3:
            problems.append(f"{name} dtype {t.dtype} must be {E4M3}")
    for name, t in (("x_scale", x_scale), ("w_scale", w_scale)):
        if t.dtype != torch.float32:
            problems.append(f"{name} dtype {t.dtype} must be torch.float32")
    if out_dtype not in ACT_DTYPES:
        problems.append(f"output dtype {out_dtype} is not one of {ACT_DTYPES}")
    tn, tk = w_tile
    if tn < 1 or tk < 1 or x_group < 1:
        problems.append(f"weight tile {tuple(w_tile)} and activation group {x_group} must be >= 1")
    else:
        want_x = (m, cdiv(k, min(x_group, k)) if k else 1)
        if tuple(x_scale.shape) != want_x:
            problems.append(f"x_scale {tuple(x_scale.shape)} must be [M, ceil(K / {x_group})] = {want_x}")
        want_w = (cdiv(n, tn) if n else 0, cdiv(k, tk) if k else 1)
        if tuple(w_scale.shape) != want_w:
            problems.append(f"w_scale {tuple(w_scale.shape)} must be [ceil(N / {tn}), ceil(K / {tk})] = {want_w} "
                            f"for qw {tuple(qw.shape)}")
        if k and mm_block_k(k, tk, x_group, 128) is None:
            problems.append(f"the weight tile's {tk} columns and the activation group's {x_group} must each span K "
                            f"= {k} or be a multiple of {MIN_BLOCK_K} (the kernel's smallest K step)")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n or bias.dtype not in ACT_DTYPES):
        problems.append(f"bias must be [N] = [{n}] of one of {ACT_DTYPES}, got {bias.dtype} {tuple(bias.shape)}")
    if out is not None:
        if tuple(out.shape) != (m, n):
            problems.append(f"out {tuple(out.shape)} must be [M, N] = {(m, n)}")
        if out.dtype != out_dtype:
            problems.append(f"out dtype {out.dtype} must be {out_dtype}")
    _fail(op, problems)


def check_block_view(qw: torch.Tensor, w_tile: tuple[int, int], scale_rows: int, scale_cols: int) -> None:
    """A block-scaled weight that is a view of a larger row-major weight (a TP shard, a shift view) must start
    on a scale-block boundary of it: its scales are whole rows and columns of the base's scales. The start is
    read off the view's storage offset (row = offset // row stride, column = offset % row stride)."""
    off = qw.storage_offset()
    if not off or qw.stride(1) != 1 or qw.stride(0) < qw.shape[1]:
        return
    row, col = divmod(off, qw.stride(0))
    tn, tk = w_tile
    problems = []
    if scale_rows > 1 and row % tn:
        problems.append(f"starts at row {row}, inside a {tn}-row scale block (row % {tn} = {row % tn})")
    if scale_cols > 1 and col % tk:
        problems.append(f"starts at column {col}, inside a {tk}-column scale block (column % {tk} = {col % tk})")
    if problems:
        raise ValueError(f"fusedpar fp8 scaled_mm: the block-scaled weight view {tuple(qw.shape)} with strides "
                         f"{qw.stride()} " + " and ".join(problems) + "; cut views on scale-block boundaries "
                         "(fusedpar.layouts.check_scale_blocks says which layouts do)")


@functools.lru_cache(maxsize=4096)
def pick_fp8_config(m: int, n: int, k: int, *, out_dtype: torch.dtype, num_sms: int, interpret: bool,
                    tma: bool = False) -> GemmConfig:
    """Block sizes for the e4m3 GEMM (1-byte operands, so BLOCK_K = 128 holds the bytes a 16-bit GEMM's
    64 does; 128 is also the block scheme's group).

    Interpreter: 32x32x32 tiles, GROUP_M=2 (several tiles, ragged edges, more than one swizzle group).
    GPU: m <= 64 (decode, weight-read bound): BLOCK_M = next power of two >= m (16..64), BLOCK_N the
    widest of 128/64 giving >= 0.6 x #SMs column tiles (else 32), 4 warps, as many stages (<= 6) as fit.
    Larger m, by wave quantisation: 128x256 tiles (8 warps) when they fill their waves >= 84% or form
    one wave of >= 60% of the SMs (16-bit outputs only: an fp32 128x256 epilogue tile is 128 KiB),
    else 128x128 (4 warps) when those give >= 0.6 x #SMs tiles, else 64x128. TMA loads for m > 64
    where the operands allow them (tma_compatible). Stages: as many as fit the 227 KiB of shared
    memory next to the epilogue tile.
    """
    if interpret:
        return GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=1, tma=tma)
    out_bytes = out_dtype.itemsize

    def tiles(bm: int, bn: int) -> int:
        return cdiv(m, bm) * cdiv(n, bn)

    def wave_fill(t: int) -> float:
        return t / (cdiv(t, num_sms) * num_sms)

    def stages(bm: int, bn: int, bk: int, cap: int) -> int:
        return max(2, min(cap, (SMEM_BYTES - bm * bn * out_bytes - 4096) // ((bm + bn) * bk)))

    if m <= 64:
        bm = max(16, next_pow2(m))
        bn = next((b for b in (128, 64) if cdiv(n, b) >= 0.6 * num_sms), 32)
        return GemmConfig(bm, bn, 128, group_m=8, num_warps=4, num_stages=stages(bm, bn, 128, 6))
    t256 = tiles(128, 256)
    if out_bytes <= 2 and (wave_fill(t256) >= 0.84 or 0.6 * num_sms <= t256 <= num_sms):
        cfg = GemmConfig(128, 256, 128, group_m=8, num_warps=8, num_stages=stages(128, 256, 128, 4))
    elif tiles(128, 128) >= 0.6 * num_sms:
        cfg = GemmConfig(128, 128, 128, group_m=8, num_warps=4, num_stages=stages(128, 128, 128, 5))
    else:
        cfg = GemmConfig(64, 128, 128, group_m=8, num_warps=4, num_stages=stages(64, 128, 128, 5))
    return dataclasses.replace(cfg, tma=tma)


def _launch_mm(qx: torch.Tensor, x_scale: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor,
               w_tile: tuple[int, int], x_group: int, bias: torch.Tensor | None, out: torch.Tensor,
               config: GemmConfig | None = None, *, fresh_out: bool = False) -> torch.Tensor:
    """Check the arguments and run the scaled GEMM into `out` (allocated by the caller); `config` overrides
    the tiling heuristic (BLOCK_K is still lowered to fit the scale tiles). fresh_out: out was just
    allocated, so the overlap checks are skipped."""
    check_mm_args(qx, x_scale, qw, w_scale, w_tile, x_group, bias, out.dtype, out)
    op = "fusedpar fp8 scaled_mm"
    if not fresh_out:
        check_out_overlap(op, out, qx=qx, qw=qw)
    m, k = qx.shape
    n = qw.shape[0]
    if m == 0 or n == 0:
        return out
    if k == 0:
        out.zero_()
        if bias is not None:
            out += bias
        return out
    tn, tk = w_tile
    check_block_view(qw, w_tile, w_scale.shape[0], w_scale.shape[1])
    _check_device(op, *(t for t in (qx, x_scale, qw, w_scale, bias, out) if t is not None))
    for name, t in (("qx", qx), ("qw", qw), ("out", out)):
        if max_offset(t) >= 2**31:
            raise ValueError(f"{op}: {name} {tuple(t.shape)} with strides {t.stride()} spans >= 2**31 elements; "
                             "int32 offsets would overflow (split the call)")
    num_sms = sm_count(qx.device, INTERPRETED)
    tma_ok = not INTERPRETED and m > 64 and tma_compatible(qx, qw)
    cfg = config or pick_fp8_config(m, n, k, out_dtype=out.dtype, num_sms=num_sms, interpret=INTERPRETED, tma=tma_ok)
    scale_in_loop = tk < k or x_group < k
    block_k = mm_block_k(k, tk, x_group, cfg.block_k) if scale_in_loop else cfg.block_k
    if block_k != cfg.block_k:
        cfg = dataclasses.replace(cfg, block_k=block_k)
    use_tma = cfg.tma and tma_ok
    a_desc, w_desc = tma_descriptors(qx, qw, cfg.block_m, cfg.block_n, cfg.block_k) if use_tma else (None, None)
    grid = (min(num_sms, cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)),)
    with device_guard(qx.device):
        _fp8_matmul_kernel[grid](
            qx, qw, out, x_scale, w_scale, None if bias is None else bias.contiguous(), a_desc, w_desc,
            m, n, k, tn, tk, x_group,
            qx.stride(0), qx.stride(1), qw.stride(0), qw.stride(1), out.stride(0), out.stride(1),
            x_scale.stride(0), x_scale.stride(1), w_scale.stride(0), w_scale.stride(1),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, NUM_SMS=num_sms,
            EVEN_K=k % cfg.block_k == 0, SCALE_IN_LOOP=scale_in_loop, HAS_BIAS=bias is not None, TMA=use_tma,
            FLATTEN=cfg.flatten, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out


# ============================================================ e4m3 operands of the fused kernels


@dataclasses.dataclass(frozen=True)
class FP8Operands:
    """What a fused communication kernel needs besides its e4m3 qx [M, K] and qw [N, K] to run the scaled
    GEMM (qx * x_scale) @ (qw * w_scale)^T: qx's element (m, k) has scale x_scale[m, k // x_group], qw's
    (n, k) w_scale[n // w_tile[0], k // w_tile[1]]; the products are computed, exchanged and reduced in
    out_dtype (fp16 / bf16 / fp32), the dtype of the activations qx was quantised from."""

    x_scale: torch.Tensor
    w_scale: torch.Tensor
    w_tile: tuple[int, int]
    x_group: int
    out_dtype: torch.dtype

    def scale_in_loop(self, k: int) -> bool:
        """Whether a scale changes along K (block scales): then every K step is scaled in the loop."""
        return self.w_tile[1] < k or self.x_group < k

    def block_k(self, k: int, block_k: int) -> int:
        """The K step of a tiling with BLOCK_K = block_k: lowered so that every step lies in one weight
        tile and one activation group (check_fp8_operands has made sure one exists)."""
        return mm_block_k(k, self.w_tile[1], self.x_group, block_k) if self.scale_in_loop(k) else block_k

    def kernel_args(self) -> tuple:
        """The fused kernels' scale arguments, one tuple (S of the shared mainloop functions in kernels.py):
        pointers, tile sizes and strides."""
        xs, ws = self.x_scale, self.w_scale
        return (xs, ws, self.w_tile[0], self.w_tile[1], self.x_group, xs.stride(0), xs.stride(1), ws.stride(0),
                ws.stride(1))

    @property
    def tl_out_dtype(self):
        """out_dtype as a Triton dtype (a kernel's constexpr)."""
        return _TL_DTYPES[self.out_dtype]

    @staticmethod
    def op_args(fp8: FP8Operands | None) -> tuple:
        """fp8 (or None) as a registered op's flat trailing arguments: x_scale, w_scale, [w_tile_n, w_tile_k,
        x_group], out_dtype (all None without FP8)."""
        if fp8 is None:
            return None, None, None, None
        return fp8.x_scale, fp8.w_scale, [*fp8.w_tile, fp8.x_group], fp8.out_dtype

    @staticmethod
    def from_op_args(x_scale, w_scale, tiles, out_dtype) -> FP8Operands | None:
        """The inverse of op_args."""
        if x_scale is None:
            return None
        return FP8Operands(x_scale, w_scale, (tiles[0], tiles[1]), tiles[2], out_dtype)


def check_fp8_operands(op: str, qx: torch.Tensor, qw: torch.Tensor, fp8: FP8Operands) -> None:
    """A fused kernel's e4m3 operands and their scales: the scaled GEMM's constraints (check_mm_args, with
    qw any [N, K] slice of the kernel's weight) and, for a block-scaled view, its start on a block boundary
    (check_block_view). Every violated constraint is listed in one error named after `op`, with its numbers."""
    problems = []
    try:
        check_mm_args(qx, fp8.x_scale, qw, fp8.w_scale, fp8.w_tile, fp8.x_group, None, fp8.out_dtype)
    except ValueError as e:
        problems.append(str(e).split(": ", 1)[-1])
    if qw.dim() == 2 and fp8.w_scale.dim() == 2:
        try:
            check_block_view(qw, fp8.w_tile, fp8.w_scale.shape[0], fp8.w_scale.shape[1])
        except ValueError as e:
            problems.append(str(e).split(": ", 1)[-1])
    _fail(op, problems)
