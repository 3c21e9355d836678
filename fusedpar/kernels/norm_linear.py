"""RMSNorm fused into the GEMM that consumes it, for decode-sized steps: one launch instead of two.

Math (x [M, K] the residual stream, g [K] the norm weight, W [N, K] in nn.Linear orientation,
optional bias [N]; M <= MAX_ROWS)
    reference:  h = g * (x32 * rsqrt(mean_k x32^2 + eps)).to(dtype)      (fusedpar.kernels.rmsnorm)
                out = F.linear(h, W, bias)
    fused:      out[m, n] = round( r_m * sum_k round_d(x[m, k] * g[k]) W[n, k]  [+ bias[n]] )
                r_m = 1 / sqrt(sum_k x[m, k]^2 / K + eps)
    RMSNorm's scale is per row, so it commutes with the GEMM: the kernel multiplies the fp32
    accumulator by r_m in the epilogue and feeds the MMA x * g, rounded once to the dot dtype d
    (bf16 for bf16 inputs: one rounding where the reference rounds twice, x * r and then * g).
    The sum of squares is accumulated in the same K loop from the x tiles the MMA loads anyway,
    so the norm costs no extra pass over x and no extra launch. Results equal the reference to
    bf16 rounding, not bit for bit.
    fp16 and fp32 inputs feed the MMA in fp32 (d = fp32, exact products): x * g of a large
    residual could overflow fp16 before the scale that the reference applies first. That path
    exists for the CPU interpreter (which has no bf16 dot) and for completeness; the layer only
    routes bf16 here (`use_fused`).

Why (decode, shift mode): the layer's two RMSNorms each cost a launch + ~2 us kernel, and the
cuBLAS GEMMs after them (qkv, gate_up) are weight-read bound; the narrow qkv GEMM (N = 2560 on
the Llama-70B / Qwen3-32B TP=4 shards) runs as cuBLAS split-K + a separate reduce kernel.
Here the qkv GEMM splits K itself (`split_k`) and the last-arriving program of each output tile
sums the partials, so a decode step loses two or three launches per norm+GEMM pair.

Split-K protocol: program p = tile * S + s computes K range s of output tile `tile`, stores its
fp32 partial accumulator and partial sum of squares into a workspace block, then takes a ticket
from counters[tile] (atomic add, acq_rel, GPU scope, after a CTA barrier: the release covers the
whole CTA's stores). The program that draws ticket S - 1 is the last: its acquire makes every
partial visible; it sums the S partials in the fixed order s = 0..S-1 (deterministic bits), so
r_m sees the whole row's sum of squares, stores the output tile and resets counters[tile] to 0
for the next launch (stream order makes the reset visible to it). Nothing ever waits: a program
that is not last simply exits, so no co-residency assumption is needed. A workspace must not be
shared by launches that can run concurrently (two streams); NormLinearWorkspace is owned by one
FusedKernels and used on one stream.

Layers (DESIGN.md section 1): _rms_norm_linear_kernel (@triton.jit) -> rms_norm_linear launcher
(checks, pick_config, grid, workspace) -> torch.ops.fusedpar.rms_norm_linear (fake impl; used
under torch.compile) ; rms_norm_linear_reference is the plain-PyTorch definition.

CPU: set TRITON_INTERPRET=1 before this module is first imported; test in fp16/fp32.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from fusedpar.kernels._host import cdiv, next_pow2

__all__ = [
    "MAX_ROWS",
    "NormLinearConfig",
    "NormLinearWorkspace",
    "decode_linear",
    "pick_config",
    "rms_norm_linear",
    "rms_norm_linear_reference",
    "use_fused",
]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ROWS = 64  # the kernel holds one [BLOCK_M = next_pow2(M), BLOCK_N] tile of rows: decode sizes only
_SMEM_BYTES = 227 * 1024


@triton.jit
def _rms_norm_linear_kernel(
    x_ptr,
    g_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    part_ptr,  # SPLIT_K > 1: fp32 [tiles * SPLIT_K, BLOCK_M * BLOCK_N] partial accumulators
    part_ss_ptr,  # SPLIT_K > 1: fp32 [tiles * SPLIT_K, BLOCK_M] partial sums of squares
    counters_ptr,  # SPLIT_K > 1: int32 [tiles], 0 between launches
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_wk,
    stride_om,
    k_per,  # K elements per split, a multiple of BLOCK_K
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # k_per * SPLIT_K == K: no K masks
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,  # feed the MMA fp32 x * g and fp32 W (fp16 / fp32 inputs)
    HAS_NORM: tl.constexpr,  # False: out = x @ W^T (+ bias), the plain split-K GEMM
):
    pid = tl.program_id(0)
    tile = pid // SPLIT_K
    k_lo = (pid % SPLIT_K) * k_per
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_wn = tl.where(n_ok, offs_n, 0)  # clamp, do not mask: the extra columns are never stored
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tl.where(row_ok, rows, 0).to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + offs_wn.to(tl.int64)[None, :] * stride_wn

    # g is loaded as a [BLOCK_M, BLOCK_K] broadcast (row stride 0), not as a [BLOCK_K] vector: one
    # bf16 per thread is below cp.async's 4 bytes, so the pipeliner left the vector load a blocking
    # global round trip in every K step (sm_90 TTGIR); the tile is prefetched like x and W.
    g_rows = g_ptr + rows[:, None] * 0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Squares accumulate elementwise and are summed over K once after the loop: a row sum per K
    # step (cross-thread shuffles in the weight-streaming loop) made the kernel ~1.4x slower.
    sq = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for kk in range(0, k_per, BLOCK_K):
        k = k_lo + kk + offs_k
        if EVEN_K:
            xv = tl.load(x_rows + k[None, :], mask=row_ok[:, None], other=0.0)
            wv = tl.load(w_cols + k[:, None] * stride_wk)
        else:
            k_ok = k < K
            xv = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wv = tl.load(w_cols + k[:, None] * stride_wk, mask=k_ok[:, None], other=0.0)
        if HAS_NORM:
            if EVEN_K:
                gv = tl.load(g_rows + k[None, :]).to(tl.float32)
            else:
                gv = tl.load(g_rows + k[None, :], mask=k[None, :] < K, other=0.0).to(tl.float32)
            xf = xv.to(tl.float32)
            sq += xf * xf
            h = xf * gv
            if DOT_FP32:
                acc = tl.dot(h, wv.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(h.to(wv.dtype), wv, acc)
        else:
            acc = tl.dot(xv, wv, acc, input_precision="ieee" if DOT_FP32 else "tf32")

    ss = tl.sum(sq, axis=1)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    out_mask = row_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        y = acc * (1.0 / tl.sqrt(ss / K + eps))[:, None] if HAS_NORM else acc
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_wn).to(tl.float32)[None, :]
        tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        TILE: tl.constexpr = BLOCK_M * BLOCK_N
        offs_tile = rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(part_ptr + pid.to(tl.int64) * TILE + offs_tile, acc)
        tl.store(part_ss_ptr + pid * BLOCK_M + rows, ss)
        # Every thread's partial stores precede the ticket (barrier + release at GPU scope).
        tl.debug_barrier()
        ticket = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            # Last contributor: the acquire above saw every partial; the barrier orders this CTA's
            # loads after it, and .cg reads them from L2 (L1 is not coherent).
            tl.debug_barrier()
            first = tile * SPLIT_K
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # fixed order: the same bits whatever the arrival order
                total += tl.load(part_ptr + (first + s).to(tl.int64) * TILE + offs_tile, cache_modifier=".cg")
                ss += tl.load(part_ss_ptr + (first + s) * BLOCK_M + rows, cache_modifier=".cg")
            y = total * (1.0 / tl.sqrt(ss / K + eps))[:, None] if HAS_NORM else total
            if HAS_BIAS:
                y += tl.load(bias_ptr + offs_wn).to(tl.float32)[None, :]
            tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(counters_ptr + tile, 0, sem="relaxed", scope="gpu")


# Triton decides interpreter vs compiler when @triton.jit runs (see gemm.py).
_INTERPRETED = not isinstance(_rms_norm_linear_kernel, JITFunction)


@dataclass(frozen=True)
class NormLinearConfig:
    """Tiling of one launch: a program per (BLOCK_N output columns, K range); split_k K ranges per
    column tile (1 = none: the program owns all of K and stores the output itself)."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


def _fits(block_m: int, block_n: int, block_k: int, stages: int, elem: int) -> bool:
    return stages * (block_m + block_n) * block_k * elem <= _SMEM_BYTES


def pick_config(m: int, n: int, k: int, *, dtype: torch.dtype, num_sms: int, interpret: bool) -> NormLinearConfig:
    """Tiling for out[m, n] = norm(x[m, k]) @ W[n, k]^T.

    Interpreter: 16-column tiles, 32-deep K steps, K split in 3 where K has >= 3 steps, so CPU tests
    see the split protocol, ragged columns and ragged K.
    GPU (weight-read bound): the widest of 128 / 64 / 32-column tiles that gives >= 0.6 x #SMs
    tiles, unsplit (gate_up-like shapes); narrower outputs (the qkv shard, 2560 columns) take
    64-column tiles and the largest split that keeps tiles x split <= #SMs with >= 1024 of K per
    range, so that most SMs stream a share of the weight. BLOCK_K 256 for 16-row tiles of <= 64
    columns, else 128; 4 warps; as many stages (<= 5) as fit. To be confirmed by
    perf/bench_norm_linear.py's sweep (the values in use are the ones it measured best).
    """
    block_m = max(16, next_pow2(m))
    if interpret:
        block_n, block_k = 16, 32
        split = 3 if cdiv(k, block_k) >= 3 else 1
        return NormLinearConfig(block_n, block_k, split, num_warps=4, num_stages=1)
    elem = 4 if dtype == torch.float32 else dtype.itemsize
    block_n = 32
    for cand in (128, 64):
        if cdiv(n, cand) >= 0.6 * num_sms:
            block_n = cand
            break
    split = 1
    if cdiv(n, block_n) < 0.6 * num_sms:
        block_n = 64
        tiles = cdiv(n, block_n)
        split = max(1, min(num_sms // tiles, k // 1024))
    block_k = 256 if (block_m <= 16 and block_n <= 64) else 128
    if elem == 4:
        block_k //= 2
    stages = 5
    while stages > 2 and not _fits(block_m, block_n, block_k, stages, elem):
        stages -= 1
    return NormLinearConfig(block_n, block_k, split, num_warps=4, num_stages=stages)


def _k_per(k: int, cfg: NormLinearConfig) -> int:
    return cdiv(cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k


class NormLinearWorkspace:
    """Split-K scratch of rms_norm_linear, allocated once (outside any CUDA-graph capture) and reused:
    fp32 partials and int32 tile counters (zero between launches; each launch's last contributors
    reset the ones it used). Use one workspace per stream."""

    def __init__(self, device: torch.device | str, *, part_elems: int, tiles: int):
        self.part = torch.empty(max(1, part_elems), dtype=torch.float32, device=device)
        self.part_ss = torch.empty(max(1, cdiv(part_elems, 16)), dtype=torch.float32, device=device)
        self.counters = torch.zeros(max(1, tiles), dtype=torch.int32, device=device)

    @classmethod
    def for_shapes(cls, device: torch.device | str, shapes: list[tuple[int, int, int]], dtype: torch.dtype,
                   *, num_sms: int | None = None) -> NormLinearWorkspace:
        """Big enough for every (m, n, k) in shapes at pick_config's tiling (and any m' <= m)."""
        device = torch.device(device)
        if num_sms is None:
            num_sms = _num_sms(device)
        part = tiles = 0
        for m, n, k in shapes:
            for rows in {r for r in (1, 17, 33, m) if r <= m}:  # one per BLOCK_M (16 / 32 / 64)
                cfg = pick_config(rows, n, k, dtype=dtype, num_sms=num_sms, interpret=_INTERPRETED)
                p, t = _scratch(rows, n, cfg)
                part, tiles = max(part, p), max(tiles, t)
        return cls(device, part_elems=part, tiles=tiles)


def _scratch(m: int, n: int, cfg: NormLinearConfig) -> tuple[int, int]:
    """(fp32 partial elements, counters) one launch needs (0, 0 without split)."""
    if cfg.split_k == 1:
        return 0, 0
    tiles = cdiv(n, cfg.block_n)
    return tiles * cfg.split_k * max(16, next_pow2(m)) * cfg.block_n, tiles


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 16
    return _cuda_num_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


ROUTE_MAX_ROWS = 16


def use_fused(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the decoder layer should take rms_norm_linear for this GEMM: a bf16 CUDA step of at
    most ROUTE_MAX_ROWS rows (where perf/bench_norm_linear.py measured it ahead of the Triton
    RMSNorm + cuBLAS pair). Decided from shapes alone, so every rank agrees."""
    return x.is_cuda and x.dtype == torch.bfloat16 and weight.dtype == x.dtype and x.shape[0] <= ROUTE_MAX_ROWS


def _check(x, g, w, bias, out) -> None:
    """g None: the plain GEMM (decode_linear)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"rms_norm_linear: x must be 2-D [rows, K] with contiguous rows, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    m, k = x.shape
    g_dtype = x.dtype if g is None else g.dtype
    if x.dtype not in _SUPPORTED_DTYPES or g_dtype != x.dtype or w.dtype != x.dtype:
        raise TypeError(f"rms_norm_linear: x, norm weight and weight must share a dtype in {_SUPPORTED_DTYPES}, "
                        f"got {x.dtype} / {g_dtype} / {w.dtype}")
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"rms_norm_linear: {m} rows; the fused decode kernel takes 1..{MAX_ROWS} "
                         f"(use rms_norm + F.linear for larger steps)")
    if g is not None and (g.shape != (k,) or g.stride(0) != 1):
        raise ValueError(f"rms_norm_linear: norm weight must be a contiguous [{k}], got {tuple(g.shape)}")
    if w.dim() != 2 or w.shape[1] != k:
        raise ValueError(f"rms_norm_linear: weight must be [N, {k}] (nn.Linear orientation), got {tuple(w.shape)}")
    n = w.shape[0]
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or bias.stride(0) != 1):
        raise ValueError(f"rms_norm_linear: bias must be a contiguous [{n}] {x.dtype}, got {tuple(bias.shape)} "
                         f"{bias.dtype}")
    if out is not None and (out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1):
        raise ValueError(f"rms_norm_linear: out must be [{m}, {n}] {x.dtype} with contiguous rows, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    devices = {t.device for t in (x, g, w, bias, out) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"rms_norm_linear: all tensors must be on one device, got {sorted(map(str, devices))}")


def _launch(x, g, w, bias, eps, out, workspace, config) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    if x.device.type == "cpu" and not _INTERPRETED:
        raise RuntimeError("rms_norm_linear got CPU tensors but Triton compiles for a GPU: set TRITON_INTERPRET=1 "
                           "before fusedpar.kernels.norm_linear is first imported to use the CPU interpreter")
    cfg = config or pick_config(m, n, k, dtype=x.dtype, num_sms=_num_sms(x.device), interpret=_INTERPRETED)
    if cfg.split_k < 1 or cfg.block_k < 16 or cfg.block_n < 16:
        raise ValueError(f"rms_norm_linear: bad config {cfg}")
    block_m = max(16, next_pow2(m))
    k_per = _k_per(k, cfg)
    split = cdiv(k, k_per)  # no empty K range (a config may ask for more splits than K has steps)
    part_elems, tiles = _scratch(m, n, NormLinearConfig(cfg.block_n, cfg.block_k, split))
    if split > 1:
        if workspace is None:
            workspace = NormLinearWorkspace(x.device, part_elems=part_elems, tiles=tiles)
        elif (workspace.part.numel() < part_elems or workspace.part_ss.numel() < split * tiles * block_m
              or workspace.counters.numel() < tiles or workspace.part.device != x.device):
            raise ValueError(
                f"rms_norm_linear: workspace too small for [{m}, {k}] x [{n}, {k}] at {cfg}: needs {part_elems} "
                f"partial elements and {tiles} counters on {x.device}, has {workspace.part.numel()} / "
                f"{workspace.counters.numel()} on {workspace.part.device}")
        part, part_ss, counters = workspace.part, workspace.part_ss, workspace.counters
    else:
        part = part_ss = counters = x  # unused
    grid = (cdiv(n, cfg.block_n) * split,)
    # x * g in fp16 could overflow: fp32 MMA operands there (and for fp32 inputs, exact products)
    dot_fp32 = x.dtype == torch.float32 or (g is not None and x.dtype != torch.bfloat16)
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        _rms_norm_linear_kernel[grid](
            x, g if g is not None else x, w, bias if bias is not None else w, out, part, part_ss, counters,
            m, n, k, x.stride(0), w.stride(0), w.stride(1), out.stride(0), k_per, float(eps),
            BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split, EVEN_K=k_per * split == k,
            HAS_BIAS=bias is not None, DOT_FP32=dot_fp32, HAS_NORM=g is not None,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out


@torch.library.custom_op("fusedpar::rms_norm_linear", mutates_args=())
def _rms_norm_linear_op(x: torch.Tensor, g: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                        eps: float) -> torch.Tensor:
    """rms_norm_linear into a new tensor, split-K scratch allocated per call (torch.compile path)."""
    out = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    return _launch(x, g, w, bias, eps, out, None, None)


@_rms_norm_linear_op.register_fake
def _rms_norm_linear_fake(x, g, w, bias, eps):
    _check(x, g, w, bias, None)
    return x.new_empty((x.shape[0], w.shape[0]))


def rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, eps: float, *,
                    bias: torch.Tensor | None = None, workspace: NormLinearWorkspace | None = None,
                    config: NormLinearConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(rms_norm(x, norm_weight, eps), weight, bias) in one launch (module docstring).

    x [M <= MAX_ROWS, K] (contiguous rows), norm_weight [K], weight [N, K] (any strides: shift views
    welcome), bias [N] or None; returns [M, N] in x's dtype (or writes `out`). workspace: the
    split-K scratch to reuse (required for CUDA-graph capture of a split launch to stay allocation
    free; without it a split launch allocates one).
    """
    _check(x, norm_weight, weight, bias, out)
    if torch.compiler.is_compiling() and out is None and workspace is None and config is None:
        return torch.ops.fusedpar.rms_norm_linear(x, norm_weight, weight, bias, float(eps))
    if out is None:
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    return _launch(x, norm_weight, weight, bias, eps, out, workspace, config)


def decode_linear(x: torch.Tensor, weight: torch.Tensor, *, bias: torch.Tensor | None = None,
                  workspace: NormLinearWorkspace | None = None, config: NormLinearConfig | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for a decode-sized x (<= MAX_ROWS rows) with the same kernel and
    split-K as rms_norm_linear, minus the norm."""
    _check(x, None, weight, bias, out)
    if out is None:
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    return _launch(x, None, weight, bias, 0.0, out, workspace, config)


def rms_norm_linear_reference(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, eps: float,
                              bias: torch.Tensor | None = None) -> torch.Tensor:
    """The two-step definition the fused kernel replaces: RMSNorm (HF roundings), then F.linear."""
    from fusedpar.layers.functional import rms_norm

    return torch.nn.functional.linear(rms_norm(x, norm_weight, eps), weight, bias)
