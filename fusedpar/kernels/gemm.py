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

Sections: device helpers and kernel -> tiling (GemmConfig, pick_config) -> checks and TMA
descriptors -> launcher -> registered ops `torch.ops.fusedpar.matmul` / `matmul_out` (fake impls:
torch.compile and CUDA graphs see one opaque node) -> `matmul` and its reference.

CPU: under TRITON_INTERPRET=1 (set before the first import) the kernel runs on the interpreter,
which cannot tl.dot bf16: interpret fp16/fp32, test bf16 on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fusedpar.kernels._host import INTERPRETED, SUPPORTED_DTYPES, cdiv, check_out_overlap, next_pow2, require_pow2
from fusedpar.kernels._sync import device_guard, sm_count

__all__ = ["GemmConfig", "load_k_tile", "load_w_tile", "matmul", "matmul_reference", "pick_config",
           "require_one_block", "split_w_descriptor", "tile_coords", "tma_compatible", "tma_descriptors"]

SMEM_BYTES = 227 * 1024  # Hopper: dynamic shared memory per CTA


# ================================================================================ device side


@triton.jit
def tile_coords(tile_id, num_pid_in_group, num_pid_m, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of linear tile `tile_id` in the GROUP_M-swizzled order.

    Tiles are numbered in groups of GROUP_M tile rows; inside a group the order is column-major,
    so consecutive tiles (which run concurrently on neighbouring programs) share W tiles and a
    narrow band of A rows. The last group may have fewer than GROUP_M rows (ragged M).
    """
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def load_k_tile(a_ptr, w_ptr, offs_am, offs_wn, offs_k_base, ki, K, stride_am, stride_ak, stride_wk, stride_wn,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """K step `ki` of the persistent GEMMs by pointer loads: the A tile [rows offs_am, BLOCK_K] and the
    B = W^T tile [BLOCK_K, cols offs_wn] (W read in place through its strides). Past K both are zero,
    so the tail adds nothing; offs_am / offs_wn must already be clamped to valid rows. Inlined by
    Triton, so the software pipeliner sees the loads in the caller's loop."""
    offs_k = ki * BLOCK_K + offs_k_base
    a_ptrs = a_ptr + (offs_am[:, None] * stride_am + offs_k[None, :] * stride_ak)
    b_ptrs = w_ptr + (offs_k[:, None] * stride_wk + offs_wn[None, :] * stride_wn)
    if EVEN_K:
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
    else:
        k_left = K - ki * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k_base[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k_base[:, None] < k_left, other=0.0)
    return a, b


@triton.jit
def load_w_tile(w_ptr, offs_wn, offs_k_base, ki, K, stride_wk, stride_wn, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr):
    """K step `ki`'s B = W^T tile [BLOCK_K, cols offs_wn] alone (zero past K), as in load_k_tile."""
    offs_k = ki * BLOCK_K + offs_k_base
    b_ptrs = w_ptr + (offs_k[:, None] * stride_wk + offs_wn[None, :] * stride_wn)
    if EVEN_K:
        return tl.load(b_ptrs)
    return tl.load(b_ptrs, mask=offs_k_base[:, None] < K - ki * BLOCK_K, other=0.0)


@triton.jit
def _persistent_matmul_kernel(
    a_ptr,
    w_ptr,
    c_ptr,
    a_desc,  # TMA descriptors of a [M, K] and w [N, K] (block [BLOCK_M|BLOCK_N, BLOCK_K]); None unless TMA
    w_desc,
    w2_desc,  # TMA descriptor of w with block [BLOCK_N2, BLOCK_K]; None unless TMA and BLOCK_N2 > 0
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_wn,
    stride_wk,
    stride_cm,
    stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr,
    EVEN_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    TMA: tl.constexpr = False,
    FLATTEN: tl.constexpr = True,
    BLOCK_N2: tl.constexpr = 0,
):
    """C[M, N] = A[M, K] @ W[N, K]^T with fp32 accumulation; every operand arbitrarily strided.

    W is read as B = W^T, a [K, N] matrix with strides (stride_wk, stride_wn): no transpose is
    materialised, and the same code serves row views, column views and transposed storage.
    NUM_SMS is the stride of the persistent loop (the device's SM count); the grid may be smaller
    when there are fewer tiles than SMs, in which case each program runs exactly one tile.
    EVEN_K: K % BLOCK_K == 0, so the K loop needs no mask.
    INPUT_PRECISION: "ieee" for fp32 inputs (exact fp32 products, like torch's default of no
    TF32); for fp16/bf16 Triton ignores it.
    TMA: the K loop reads A and W tiles through the tensor descriptors a_desc / w_desc (Hopper's
    bulk tensor copies: one instruction per tile, no address math in the loop, zero fill past the
    M/N/K edges so no masks) instead of per-thread pointer loads. Needs both operands row-major
    in K (stride 1) with 16-byte aligned bases and row strides (`tma_compatible`).
    FLATTEN: fuse the tile loop and the K loop into one loop for the software pipeliner (the
    next tile's loads are in flight during this tile's epilogue); False keeps them nested (with
    TMA loads the qkv kernel's fastest tiling at 1024 rows per rank).
    BLOCK_N2: a second, narrower column block per tile, so one tile is BLOCK_M x (BLOCK_N + BLOCK_N2)
    with two accumulators (Triton blocks are powers of two; 256 + 64 = 320 columns is not), against
    wave quantisation: N = 2560 (Llama-70B / Qwen3-32B qkv at TP=4) and 5120 in 64 x 320 tiles give
    128 or 256 tiles at 1024-2048 rows (~97% of 132 SMs), where 128 x 256 tiles fill 61%.
    0 = one block (pick_config says when it picks two). Triton's Hopper warp specialisation is not
    offered: with 4 warps it failed to build the qkv kernel, with 8 it leaves the loop unpartitioned.
    """
    start_pid = tl.program_id(axis=0)
    TILE_N: tl.constexpr = BLOCK_N + BLOCK_N2
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, TILE_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    num_pid_in_group = GROUP_M * num_pid_n

    # A second tile counter for the epilogue, as in Triton's persistent-matmul tutorial, which
    # works around a pipelining bug (seen on Blackwell) with a value used both by the loads and
    # by the epilogue of the flattened loop: the epilogue recomputes its tile coordinates.
    tile_id_c = start_pid - NUM_SMS

    offs_k_base = tl.arange(0, BLOCK_K)

    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=FLATTEN):
        pid_m, pid_n = tile_coords(tile_id, num_pid_in_group, num_pid_m, GROUP_M)
        offs_am = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_wn = pid_n * TILE_N + tl.arange(0, BLOCK_N)
        # Ragged M/N edges: clamp out-of-range rows/columns to index 0 (always valid memory)
        # instead of masking them, so the K-loop loads carry at most a K mask; the extra
        # results land in rows/columns of the accumulator that the store masks off.
        offs_am = tl.where(offs_am < M, offs_am, 0)
        offs_wn = tl.where(offs_wn < N, offs_wn, 0)
        accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if BLOCK_N2 > 0:
            offs_wn2 = pid_n * TILE_N + BLOCK_N + tl.arange(0, BLOCK_N2)
            offs_wn2 = tl.where(offs_wn2 < N, offs_wn2, 0)
            accumulator2 = tl.zeros((BLOCK_M, BLOCK_N2), dtype=tl.float32)

        for ki in range(k_tiles):
            if TMA:
                a = a_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
                b = w_desc.load([pid_n * TILE_N, ki * BLOCK_K]).T
                if BLOCK_N2 > 0:
                    b2 = w2_desc.load([pid_n * TILE_N + BLOCK_N, ki * BLOCK_K]).T
            else:
                a, b = load_k_tile(a_ptr, w_ptr, offs_am, offs_wn, offs_k_base, ki, K, stride_am, stride_ak,
                                    stride_wk, stride_wn, BLOCK_K, EVEN_K)
                if BLOCK_N2 > 0:
                    b2 = load_w_tile(w_ptr, offs_wn2, offs_k_base, ki, K, stride_wk, stride_wn, BLOCK_K, EVEN_K)
            accumulator = tl.dot(a, b, accumulator, input_precision=INPUT_PRECISION)
            if BLOCK_N2 > 0:
                accumulator2 = tl.dot(a, b2, accumulator2, input_precision=INPUT_PRECISION)

        tile_id_c += NUM_SMS
        pid_m, pid_n = tile_coords(tile_id_c, num_pid_in_group, num_pid_m, GROUP_M)
        offs_cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_cn = pid_n * TILE_N + tl.arange(0, BLOCK_N)
        c_ptrs = c_ptr + (offs_cm[:, None] * stride_cm + offs_cn[None, :] * stride_cn)
        c_mask = (offs_cm[:, None] < M) & (offs_cn[None, :] < N)
        tl.store(c_ptrs, accumulator.to(c_ptr.dtype.element_ty), mask=c_mask)
        if BLOCK_N2 > 0:
            offs_cn2 = pid_n * TILE_N + BLOCK_N + tl.arange(0, BLOCK_N2)
            c2_ptrs = c_ptr + (offs_cm[:, None] * stride_cm + offs_cn2[None, :] * stride_cn)
            c2_mask = (offs_cm[:, None] < M) & (offs_cn2[None, :] < N)
            tl.store(c2_ptrs, accumulator2.to(c_ptr.dtype.element_ty), mask=c2_mask)


# ==================================================================================== tiling


@dataclass(frozen=True)
class GemmConfig:
    """Compile-time tiling of one launch (Triton specialises the kernel on these)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False  # TMA tile loads (only where tma_compatible holds; else the launcher uses pointers)
    flatten: bool = True  # one fused tile x K loop (see the kernel's FLATTEN)
    block_n2: int = 0  # a second column block per tile: tiles are block_m x (block_n + block_n2)

    def __post_init__(self) -> None:
        # Checked once here rather than per launch: every kernel that takes a GemmConfig needs these,
        # and a bad value otherwise surfaces as a Triton error from inside the kernel (or an empty grid).
        require_pow2("GemmConfig", block_m=self.block_m, block_n=self.block_n, block_k=self.block_k,
                     num_warps=self.num_warps)
        if self.block_n2:
            require_pow2("GemmConfig", block_n2=self.block_n2)
        if self.group_m < 1 or self.num_stages < 1:
            raise ValueError(f"GemmConfig: group_m={self.group_m} and num_stages={self.num_stages} must be >= 1")

    @property
    def tile_n(self) -> int:
        return self.block_n + self.block_n2


def require_one_block(cfg: GemmConfig, op: str) -> None:
    """Raise unless `cfg` tiles with one column block: split tiles (block_n2) are for the plain GEMM
    and qkv_all_to_all; the other fused kernels' epilogues address BLOCK_N-wide tiles."""
    if cfg.block_n2:
        raise ValueError(
            f"{op}: GemmConfig block_n2={cfg.block_n2} (tiles of block_n + block_n2 columns) is supported by "
            f"fusedpar.matmul and qkv_all_to_all only; pass block_n2=0"
        )


# Every launch asks for its tiling: cached, since running the heuristic per call costs tens of us of host
# time, as much as the launch itself; arguments are ints, dtypes and bools.
@functools.lru_cache(maxsize=4096)
def pick_config(
    m: int,
    n: int,
    k: int,
    *,
    dtype: torch.dtype,
    out_dtype: torch.dtype | None = None,
    num_sms: int,
    interpret: bool,
    tma: bool = False,
) -> GemmConfig:
    """Block sizes for C[m, n] = A[m, k] @ W[n, k]^T (A, W of `dtype`; C of `out_dtype`).

    Interpreter: 32x32x32 tiles, GROUP_M=2, so CPU tests are quick yet still see several tiles,
    ragged edges and more than one swizzle group per program.

    GPU (tuned on H200 over the Llama-3-70B and Qwen3-32B TP=4 shapes with perf/tools/tune_gemm.py; the
    chosen tilings' times: perf/bench_gemm.py, perf/results/gemm.json). A config
    needs num_stages * (BLOCK_M + BLOCK_N) * BLOCK_K * 2 + BLOCK_M * BLOCK_N * 2 bytes of the 227 KiB
    of shared memory per CTA.
      - m <= 64 (decode): weight-read bound, so the grid must cover the SMs: BLOCK_M = next power
        of two >= m (min 16); BLOCK_N the widest of 128/64/32 that still gives >= 0.6 x #SMs
        column tiles; BLOCK_K 256 (m <= 16, BLOCK_N <= 64) or 128; 4 warps; as many stages (<= 5)
        as fit.
      - otherwise by wave quantisation of 128x256 tiles (the fastest tile when it fills the
        machine): 128x256x64 (8 warps, 3 stages) when those tiles fill their waves >= 84% or form
        one wave of >= 60% of the SMs; else 128x128x64 (4 warps, 5 stages) when that gives >= 0.6 x
        #SMs tiles; else 64x128x128 (4 warps, 4 stages). fp32 output never takes 128x256 (its
        epilogue tile alone is 128 KiB).
      - tma=True (16-bit operands that `tma_compatible` accepts), m > 64: TMA loads and the best
        score of four tiles, score = wave fill (tiles / (waves * #SMs)) x the tile's own efficiency:
        128x256x64 (8 warps, 4 stages) 1.0, 128x128x64 (4 warps, 5 stages) 0.97, 64x128x128 (4
        warps, 4 stages) 0.82, and the split tile 64 x (256 + 64) (BLOCK_N2; 4 warps, 4 stages,
        nested loop) 0.91: where both fill their waves (N = 5120 x 2048 rows) 128x128 is
        faster. With N and K both >= 4096 the split tile takes GROUP_M = 16 (all 16 tile rows of
        1024 rows in one swizzle group); narrower or shallower shapes keep 8.
    fp32 inputs halve BLOCK_K so the operand buffers keep the same byte size.
    Not offered, slower on these shapes: cutting K so narrow-N GEMMs fill every SM,
    stream-K (every SM starts at its own K offset, so shared operands no longer meet in L2), and
    a lockstep split-K of the last partial wave (its fp32 partial round trip costs more than the
    fuller wave gains).
    """
    if interpret:
        return GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=1, tma=tma)
    in_bytes = dtype.itemsize
    out_bytes = (out_dtype or dtype).itemsize

    def tiles(block_m: int, block_n: int) -> int:
        return cdiv(m, block_m) * cdiv(n, block_n)

    def wave_fill(t: int) -> float:
        return t / (cdiv(t, num_sms) * num_sms)

    if tma and m > 64 and in_bytes == 2:
        choices = [(0.97, GemmConfig(128, 128, 64, group_m=8, num_warps=4, num_stages=5, tma=True)),
                   (0.82, GemmConfig(64, 128, 128, group_m=8, num_warps=4, num_stages=4, tma=True))]
        if out_bytes <= 2:  # fp32 out: the 128x256 epilogue tile alone is 128 KiB
            choices.insert(0, (1.0, GemmConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=4, tma=True)))
            choices.append((0.91, GemmConfig(64, 256, 64, group_m=8, num_warps=4, num_stages=4, tma=True,
                                             flatten=False, block_n2=64)))
        best = max(choices, key=lambda c: c[0] * wave_fill(tiles(c[1].block_m, c[1].tile_n)))[1]
        if best.block_n2 and n >= 4096 and k >= 4096:
            best = dataclasses.replace(best, group_m=16)  # see the docstring: wide, deep split-tile GEMMs
        return best

    def max_stages(bm: int, bn: int, bk: int, cap: int = 5) -> int:
        per_stage = (bm + bn) * bk * max(2, in_bytes)
        return max(2, min(cap, (SMEM_BYTES - bm * bn * out_bytes) // per_stage))

    if m <= 64:
        block_m = max(16, next_pow2(m))
        block_n = next((bn for bn in (128, 64) if cdiv(n, bn) >= 0.6 * num_sms), 32)
        block_k = 256 if (m <= 16 and block_n <= 64) else 128
        cfg = GemmConfig(block_m, block_n, block_k, group_m=8, num_warps=4,
                         num_stages=max_stages(block_m, block_n, block_k))
    else:
        t256 = tiles(128, 256)
        if out_bytes <= 2 and (wave_fill(t256) >= 0.84 or 0.6 * num_sms <= t256 <= num_sms):
            cfg = GemmConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3)
        elif tiles(128, 128) >= 0.6 * num_sms:
            cfg = GemmConfig(128, 128, 64, group_m=8, num_warps=4, num_stages=max_stages(128, 128, 64))
        else:
            cfg = GemmConfig(64, 128, 128, group_m=8, num_warps=4, num_stages=max_stages(64, 128, 128, cap=4))
    if in_bytes == 4:
        cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)
    return cfg


# ====================================================================== checks and descriptors


def _max_offset(t: torch.Tensor) -> int:
    """Largest element offset the kernel forms from t's base pointer."""
    return sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True))


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


# ================================================================================== launcher


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
        if _max_offset(t) >= 2**31:
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


# ============================================================================= registered ops
# torch.library.custom_op re-registers cleanly when this module is re-imported (the new
# definition replaces the old one), so import has no side effect beyond these registrations.


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


# ================================================================================= public API


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
