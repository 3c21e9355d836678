"""Tests of the decode GEMM, fusedpar.kernels.gemv: C = A @ W^T for 1 to 64 rows of A, its K steps
shared over the programs (whole tiles, split-K, stream-K), optionally with a SwiGLU epilogue.

Without a GPU they run on the Triton interpreter (conftest.py sets TRITON_INTERPRET=1): fp16 and fp32
through tl.dot, bf16 through the CUDA-core product path (the interpreter cannot tl.dot bf16). GPU
tests (`gpu`) run bf16 and fp16 on the rank shard shapes and a CUDA-graph replay. Every check compares
against a float64 product, with outputs pre-filled with NaN so an element never written fails.
"""

from __future__ import annotations

import itertools
import textwrap

import pytest
import torch

from fusedpar.kernels import gemv
from fusedpar.kernels._host import INTERPRETED
from fusedpar.kernels.gemv import config as gemv_config
from fusedpar.kernels.gemv import launch as gemv_launch
from fusedpar.kernels.reference import blocked_swiglu
from fusedpar.testing.gpu import local_device
from fusedpar.testing.numerics import assert_close, poison_
from tests.kernels.sm90_build import build_for_sm90
from tests.kernels.test_gemm import _randn, make_weight, reference

HAS_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRETED),
    reason="no CUDA and fusedpar.kernels.gemv was imported without TRITON_INTERPRET=1",
)

DEVICE = local_device()
# The interpreter runs bf16 through the tl.sum product path (pick_config: dot=False).
CPU_DTYPES = (torch.float16, torch.float32, torch.bfloat16)
GPU_DTYPES = (torch.bfloat16, torch.float16)
DECODE_ROWS = (1, 3, 8, 17, 33, 64)
WEIGHT_KINDS = ("contiguous", "row_view", "col_view", "transposed")


def run_and_check(a, w, *, name, out_dtype=None, config=None):
    out = poison_(torch.empty((a.shape[0], w.shape[0]), dtype=out_dtype or a.dtype, device=a.device))
    if config is None:
        assert gemv.skinny_matmul(a, w, out=out) is out
    else:
        gemv_launch._launch(a, w, out, config)
    assert_close(out, reference(a, w), dtype=out.dtype, name=name)
    return out


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("m", DECODE_ROWS)
def test_decode_rows(m, dtype):
    """The picked config, then stream-K over 5 programs (on the interpreter: 16 x 32 tiles, 3 N tiles x 4
    K steps, the last ragged: runs of 2-3 steps, tiles shared by 2 programs; N = 37 ends inside tile 3)."""
    n, k = 37, 100
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    a = _randn((m, k), dtype, gen)
    w = make_weight("contiguous", n, k, dtype, gen)
    run_and_check(a, w, name=f"C[{m},{n}] K={k} {dtype}")
    picked = gemv.pick_config(m, n, k, dtype=dtype, num_sms=4 if INTERPRETED else 132, interpret=INTERPRETED)
    stream_k = gemv.SkinnyConfig(picked.block_n, picked.block_k, 5, picked.num_warps, picked.num_stages, picked.dot)
    _, k_steps, units, _, _ = gemv_config.schedule(n, k, picked.block_n, picked.block_k, 5)
    assert not gemv_config.tiles_are_whole(units, k_steps, 5)
    run_and_check(a, w, name=f"stream-K C[{m},{n}] K={k} {dtype}", config=stream_k)


@pytest.mark.parametrize("dot", (True, False), ids=("dot", "fma"))
@pytest.mark.parametrize("kind", WEIGHT_KINDS[1:])
@pytest.mark.parametrize("m", (3, 33))
def test_strided_weights(m, kind, dot):
    dtype = torch.float16
    n, k = 29, 72
    gen = torch.Generator().manual_seed(m + len(kind))
    a = _randn((m, k), dtype, gen)
    w = make_weight(kind, n, k, dtype, gen)
    if kind == "col_view":
        assert not w.is_contiguous()
    for programs in (2, 5):  # whole tiles (2 N tiles), stream-K
        cfg = gemv.SkinnyConfig(16, 32, programs, num_warps=4, num_stages=2, dot=dot)
        if HAS_CUDA:
            cfg = gemv.SkinnyConfig(16, 32, programs, num_warps=4, num_stages=3, dot=dot)
        run_and_check(a, w, name=f"{kind} C[{m},{n}] K={k} programs={programs} dot={dot}", config=cfg)


@pytest.mark.parametrize(
    ("block_n", "block_k", "programs", "dot"),
    [
        (16, 16, 3, True),  # 3 N tiles, one program each: stored directly, no reduce pass
        (16, 16, 1, True),  # one program runs every tile in turn (3 segments), all whole
        (32, 16, 10, True),  # split-K: 2 tiles x 5 steps of 16 (EVEN_K), one step per program
        (16, 64, 4, False),  # stream-K, K = 80 ragged against 64: 6 units over 4 programs
        (16, 32, 7, True),  # stream-K: 9 units over 7 programs, tiles shared by up to 3
        (16, 32, 500, True),  # more programs asked than units: capped at 9
        (64, 128, 4, False),  # one N tile wider than N, one K step: a single program runs
    ],
)
def test_explicit_configs(block_n, block_k, programs, dot):
    if HAS_CUDA:
        pytest.skip("explicit small tilings are an interpreter check of the split schedule")
    gen = torch.Generator().manual_seed(block_n + block_k + programs)
    a = _randn((17, 80), torch.float16, gen)
    w = make_weight("col_view", 45, 80, torch.float16, gen)
    cfg = gemv.SkinnyConfig(block_n, block_k, programs, num_warps=4, num_stages=1, dot=dot)
    run_and_check(a, w, name=f"config {cfg}", config=cfg)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_strided_a_and_out_view_writes_only_its_window(dtype):
    m, n, k = 9, 30, 72
    gen = torch.Generator().manual_seed(3)
    a = _randn((m, 2 * k + 3), dtype, gen).narrow(1, 3, k)  # non-contiguous rows of A
    w = make_weight("col_view", n, k, dtype, gen)
    big = poison_(torch.empty((m + 2, 3 * n), dtype=dtype, device=DEVICE))
    out = big[1 : m + 1, n : 2 * n]
    assert gemv.skinny_matmul(a, w, out=out) is out
    assert_close(out, reference(a, w), dtype=dtype, name="out view")
    outside = torch.ones_like(big, dtype=torch.bool)
    outside[1 : m + 1, n : 2 * n] = False
    assert big[outside].isnan().all(), "kernel wrote outside its [M, N] output window"


def test_transposed_fp32_out_from_fp16():
    m, n, k = 5, 33, 80
    gen = torch.Generator().manual_seed(5)
    a = _randn((m, k), torch.float16, gen)
    w = make_weight("row_view", n, k, torch.float16, gen)
    out = poison_(torch.empty((n, m), dtype=torch.float32, device=DEVICE)).T  # stride (1, m)
    gemv.skinny_matmul(a, w, out=out)
    assert_close(out, reference(a, w), dtype=torch.float32, name="fp32 out")


def swiglu_reference(a: torch.Tensor, w: torch.Tensor, block: int) -> torch.Tensor:
    return blocked_swiglu(reference(a, w), block)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize(("blocks", "block"), [(1, 24), (2, 13)])
@pytest.mark.parametrize("m", (1, 17))
def test_swiglu_epilogue(m, blocks, block, dtype):
    """out = silu(gate) * up of the gate_up GEMM, W in per-block [gate | up] chunks (13 rows: output tiles
    straddle the blocks), through the picked config and stream-K over 7 programs (split tiles: the
    reduce pass applies the activation)."""
    k = 72
    gen = torch.Generator().manual_seed(m + blocks * 100 + block)
    a = _randn((m, k), dtype, gen)
    w = make_weight("row_view", blocks * 2 * block, k, dtype, gen)
    expected = swiglu_reference(a, w, block)
    picked = gemv.pick_config(m, blocks * block, k, dtype=dtype, num_sms=4 if INTERPRETED else 132,
                              interpret=INTERPRETED)
    for cfg in (None, gemv.SkinnyConfig(16, 32, 7, 4, picked.num_stages, picked.dot)):
        out = poison_(torch.empty((m, blocks * block), dtype=dtype, device=DEVICE))
        if cfg is None:
            assert gemv.skinny_matmul(a, w, out=out, swiglu_block=block) is out
        else:
            gemv_launch._launch(a, w, out, cfg, swiglu_block=block)
        assert_close(out, expected, dtype=dtype, name=f"swiglu {cfg}")
    assert_close(gemv.skinny_matmul(a, w, swiglu_block=block), expected, dtype=dtype, name="swiglu, new out")


def test_swiglu_block_must_divide_the_rows():
    a = torch.ones((2, 16), device=DEVICE)
    with pytest.raises(ValueError, match=r"swiglu_block=5 .* 24 rows a multiple of 2 I"):
        gemv.skinny_matmul(a, torch.ones((24, 16), device=DEVICE), swiglu_block=5)
    with pytest.raises(ValueError, match=r"\[M, N / 2\] \(SwiGLU\) = \(2, 12\)"):
        gemv.skinny_matmul(a, torch.ones((24, 16), device=DEVICE), out=torch.empty((2, 24), device=DEVICE),
                           swiglu_block=6)


def test_takes_decode_sized_half_precision_gemms_of_plain_weights():
    """takes: the layers' routing predicate, from shapes and dtypes alone (the CPU tensors here stand for any
    device)."""
    from fusedpar.kernels.fp8 import FP8Scheme
    from fusedpar.layers.fp8_weights import FP8Weight

    def t(m, n=48, k=32, dtype=torch.bfloat16, w_dtype=None, k_w=None, block=0):
        return gemv.takes(torch.empty((m, k), dtype=dtype), torch.empty((n, k_w or k), dtype=w_dtype or dtype),
                          block)

    for dtype in (torch.bfloat16, torch.float16):
        assert all(t(m, dtype=dtype) for m in (1, 3, 17, gemv.MAX_M))
    assert not t(0) and not t(gemv.MAX_M + 1)  # no rows; a batch for the persistent GEMM
    assert not t(4, dtype=torch.float32) and not t(4, dtype=torch.float64)  # fp32 stays on the plain GEMM
    assert not t(4, w_dtype=torch.float16)  # mixed dtypes
    assert not t(4, k_w=31)  # inner dims differ: the plain GEMM reports it
    assert t(4, n=48, block=12) and t(4, n=48, block=24) and not t(4, n=48, block=5) and not t(4, block=-1)
    assert not gemv.takes(torch.empty((4, 32, 1), dtype=torch.bfloat16), torch.empty((48, 32), dtype=torch.bfloat16))
    fp8 = FP8Weight.quantize(torch.randn(48, 32), FP8Scheme("channel"))
    assert not gemv.takes(torch.empty((4, 32), dtype=torch.bfloat16), fp8)  # the FP8 GEMMs take those


def test_deterministic_across_runs():
    """Partials of shared tiles are summed in program order: repeated runs agree bit for bit."""
    gen = torch.Generator().manual_seed(12)
    m, n, k = 4, 40, 96 if INTERPRETED else 8192
    a = _randn((m, k), torch.float16, gen)
    w = make_weight("contiguous", n, k, torch.float16, gen)
    first = gemv.skinny_matmul(a, w)
    for _ in range(3):
        assert torch.equal(gemv.skinny_matmul(a, w), first)


def test_no_out_returns_contiguous_result_of_input_dtype():
    gen = torch.Generator().manual_seed(1)
    a = _randn((2, 40), torch.float16, gen)
    w = make_weight("col_view", 24, 40, torch.float16, gen)
    c = gemv.skinny_matmul(a, w)
    assert c.shape == (2, 24) and c.dtype == torch.float16 and c.is_contiguous()
    assert_close(c, reference(a, w), dtype=torch.float16)


def test_empty_dims():
    gen = torch.Generator().manual_seed(0)
    assert gemv.skinny_matmul(_randn((0, 16), torch.float32, gen), _randn((8, 16), torch.float32, gen)).shape == (0, 8)
    out = poison_(torch.empty((5, 8), device=DEVICE))
    gemv.skinny_matmul(_randn((5, 0), torch.float32, gen), _randn((8, 0), torch.float32, gen), out=out)
    assert (out == 0).all()  # K = 0: the empty sum


def test_bad_arguments_list_every_violation():
    a = torch.ones((65, 8), dtype=torch.float16, device=DEVICE)
    w = torch.ones((6, 9), dtype=torch.float32, device=DEVICE)
    out = torch.empty((65, 5), dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError) as info:
        gemv.skinny_matmul(a, w, out=out)
    msg = str(info.value)
    for part in ("M=65 rows, more than the 64", "a.shape[1]=8 must equal w.shape[1]=9", "share one dtype",
                 r"[M, N] = (65, 6)", "got (65, 5)", "torch.int32"):
        assert part in msg, (part, msg)
    with pytest.raises(ValueError, match="2-D"):
        gemv.skinny_matmul(torch.ones((2, 3, 8), device=DEVICE), torch.ones((6, 8), device=DEVICE))


def test_out_overlapping_an_operand_is_refused():
    a = torch.ones((4, 16), dtype=torch.float32, device=DEVICE)
    w = torch.ones((4, 16), dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="overlaps a"):
        gemv.skinny_matmul(a, w, out=a[:, :4])


def test_config_checks():
    with pytest.raises(ValueError, match="block_n=48"):
        gemv.SkinnyConfig(48, 128, 1)
    with pytest.raises(ValueError, match="programs=0"):
        gemv.SkinnyConfig(64, 128, 0)


@pytest.mark.parametrize("m", (1, 16, 17, 32, 33, 64))
@pytest.mark.parametrize(("n", "k"), [(1280, 8192), (2560, 8192), (8192, 1024), (5120, 2048), (3200, 5120),
                                      (5120, 6400), (12800, 5120), (57344 // 8, 8192), (24, 40)])
def test_gpu_table_fills_the_sms_and_fits_hopper(m, n, k):
    """The GPU tilings (not runnable here): the operand ring fits 227 KiB, and the busiest SM's share of
    W is near the even share (all K steps / 132 SMs of an H100) or a whole N tile's K steps."""
    for dtype, swiglu in ((torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)):
        cfg = gemv.pick_config(m, n, k, dtype=dtype, num_sms=132, interpret=False, swiglu=swiglu)
        assert cfg.dot
        assert gemv_config.shared_memory_bytes(cfg, m, dtype.itemsize, swiglu) <= gemv_config.SMEM_BYTES, cfg
        programs, k_steps, units, _, _ = gemv_config.schedule(n, k, cfg.block_n, cfg.block_k, cfg.programs)
        assert programs == cfg.programs
        busiest = -(-programs // 132) * -(-units // programs)
        assert busiest <= max(1.3 * units / 132 + 2, k_steps), (cfg, busiest, units / 132)


def test_schedule_counts_segments_and_slots():
    # 4 N tiles x 8 steps over 12 programs of 2-3 units: a program touches at most 2 tiles; the bound
    # on the programs sharing one tile (its workspace slots) is 1 + cdiv(8 - 1, 2) = 5.
    assert gemv_config.schedule(64, 256, 16, 32, 12) == (12, 8, 32, 2, 5)
    assert gemv_config.tiles_are_whole(32, 8, 4) and gemv_config.tiles_are_whole(32, 8, 2)
    assert not gemv_config.tiles_are_whole(32, 8, 12) and not gemv_config.tiles_are_whole(32, 8, 8 * 4 // 3)


def test_choose_programs():
    # 128 whole tiles on 132 SMs: no split (a reduce pass would cost more than 4 idle SMs).
    assert gemv.choose_programs(8192, 2048, 64, 256, slots=132, min_steps=2) == 128
    # 200 tiles: two waves of whole tiles lose to stream-K over the 132 SMs.
    assert gemv.choose_programs(12800, 5120, 64, 256, slots=132, min_steps=2) == 132
    # 20 tiles x 32 steps: split-K into 6 parts (120 programs) or stream-K (132), never 20.
    assert gemv.choose_programs(1280, 8192, 64, 256, slots=132, min_steps=2) in (120, 132)


_SM90_BUILD = textwrap.dedent(
    """
    import json, re, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from fusedpar.kernels.gemv import kernels

    results = []
    for spec in json.loads(sys.argv[1]):
        fn = getattr(kernels, spec["kernel"])
        names = list(fn.arg_names)
        consts = spec["constexprs"]
        sig = {n: "constexpr" if n in consts else spec["types"].get(n, "i32") for n in names}
        # what the launcher's specialisation gives real arguments: 16-byte aligned pointers, and sizes and
        # strides that are multiples of 16 (the shard shapes' are)
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in spec["divisible"]}
        src = ASTSource(fn, sig, constexprs={(names.index(n),): v for n, v in consts.items()}, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=spec["options"])
        ptx = k.asm["ptx"]
        results.append({"cubin_bytes": len(k.asm["cubin"]), "shared": k.metadata.shared,
                        "wgmma": ptx.count("wgmma.mma_async"), "cp_async": len(re.findall(r"cp\\.async\\.c[ag]", ptx))})
    print(json.dumps(results))
    """
)


def _build_for_sm90(tmp_path, specs: list[dict]) -> list[dict]:
    """Build each spec's kernel for sm_90 (PTX, then cubin by Triton's ptxas) in one subprocess that does
    not interpret; per build: cubin size, shared memory, wgmma and cp.async instruction counts."""
    return build_for_sm90(_SM90_BUILD, specs, tmp_path)


def test_gpu_tilings_build_for_sm90_pipelined(tmp_path):
    """Each GPU table row's bf16 build for Hopper, plain and with the SwiGLU epilogue, and the reduce pass
    (the interpreter never builds GPU code): tensor cores (wgmma), the W / A loads pipelined through
    shared memory (cp.async), and that ring within 227 KiB."""
    cases, specs = [], []
    for m, swiglu in itertools.product((1, 32, 64), (False, True)):
        cfg = gemv.pick_config(m, 2560, 5120, dtype=torch.bfloat16, num_sms=132, interpret=False, swiglu=swiglu)
        cases.append((m, swiglu, cfg))
        specs.append({
            "kernel": "_skinny_partial_kernel",
            "types": {"a_ptr": "*bf16", "w_ptr": "*bf16", "c_ptr": "*bf16", "ws_ptr": "*fp32"},
            "constexprs": {"BLOCK_M": cfg.block_m(m), "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "EVEN_K": True,
                           "DOT": True, "INPUT_PRECISION": "tf32", "SWIGLU": swiglu, "stride_ak": 1, "stride_wk": 1,
                           "stride_cn": 1},
            "divisible": ["a_ptr", "w_ptr", "c_ptr", "ws_ptr", "N", "K", "stride_am", "stride_wn", "stride_cm"],
            "options": {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages},
        })
    specs += [{"kernel": "_skinny_reduce_kernel", "types": {"ws_ptr": "*fp32", "out_ptr": "*bf16"},
               "constexprs": {"BLOCK_N": 64, "BLOCK": 1024, "SWIGLU": swiglu, "stride_on": 1},
               "divisible": ["ws_ptr", "out_ptr"], "options": {"num_warps": 4}} for swiglu in (False, True)]
    got = _build_for_sm90(tmp_path, specs)
    for (m, swiglu, cfg), g in zip(cases, got, strict=False):
        assert g["cubin_bytes"] > 5_000, (m, swiglu, g)
        assert g["wgmma"] > 0 and g["cp_async"] > 0, (m, swiglu, cfg, g)
        assert g["shared"] <= gemv_config.SMEM_BYTES, (m, swiglu, cfg, g)
        assert g["shared"] >= 0.9 * gemv_config.shared_memory_bytes(cfg, m, 2, swiglu), (m, swiglu, cfg, g)
    assert all(g["cubin_bytes"] > 5_000 for g in got[len(cases):]), got


def test_fake_impl_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty((8, 8192), dtype=torch.bfloat16, device=DEVICE)
        w = torch.empty((1280, 4 * 8192), dtype=torch.bfloat16, device=DEVICE).narrow(1, 8192, 8192)
        c = torch.ops.fusedpar.skinny_matmul(a, w)
        assert c.shape == (8, 1280) and c.dtype == torch.bfloat16 and c.device == a.device
        assert torch.ops.fusedpar.skinny_matmul(a, w, 320).shape == (8, 640)
        with pytest.raises(ValueError, match="inner dims"):
            torch.ops.fusedpar.skinny_matmul(a, w.T)


def test_opcheck():
    gen = torch.Generator().manual_seed(2)
    a = _randn((3, 40), torch.float32, gen)
    w = make_weight("col_view", 24, 40, torch.float32, gen)
    torch.library.opcheck(torch.ops.fusedpar.skinny_matmul.default, (a, w))
    out = torch.empty((3, 24), device=DEVICE)
    torch.library.opcheck(torch.ops.fusedpar.skinny_matmul_out.default, (a, w, out))
    torch.library.opcheck(torch.ops.fusedpar.skinny_matmul.default, (a, w, 6))


def test_torch_compile_sees_one_op():
    gen = torch.Generator().manual_seed(4)
    a = _randn((5, 40), torch.float32, gen)
    w = make_weight("col_view", 24, 40, torch.float32, gen)
    compiled = torch.compile(lambda a, w: gemv.skinny_matmul(a, w) * 2.0, backend="aot_eager", fullgraph=True)
    assert_close(compiled(a, w), 2.0 * reference(a, w), dtype=torch.float32)


# ---- GPU only ---------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

# Rank shard shapes (N, K): Qwen3-32B TP=4 qkv / o / gate_up / down, Llama-3-70B TP=8 qkv / down,
# and one odd shape.
GPU_SHAPES = [(2560, 5120), (5120, 2048), (12800, 5120), (5120, 6400), (1280, 8192), (8192, 3584), (1001, 4099)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize(("n", "k"), GPU_SHAPES)
@pytest.mark.parametrize("m", DECODE_ROWS)
def test_gpu_rank_shapes(m, n, k, dtype):
    gen = torch.Generator().manual_seed(m * 7 + n + k)
    a = _randn((m, k), dtype, gen)
    for kind in ("contiguous", "col_view"):
        w = make_weight(kind, n, k, dtype, gen, blocks=4)
        out = run_and_check(a, w, name=f"{kind} C[{m},{n}] K={k} {dtype}")
        # Same-precision agreement with cuBLAS as a second opinion.
        assert_close(out, torch.nn.functional.linear(a, w), dtype=dtype, name="vs cuBLAS")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize(("blocks", "block"), [(1, 3200), (1, 3584), (4, 800)])  # Qwen3-32B / Llama-70B shards
@pytest.mark.parametrize("m", (1, 8, 33, 64))
def test_gpu_swiglu_epilogue(m, blocks, block, dtype):
    k = 5120
    gen = torch.Generator().manual_seed(m + block)
    a = _randn((m, k), dtype, gen)
    w = make_weight("row_view", blocks * 2 * block, k, dtype, gen, blocks=4)
    out = poison_(torch.empty((m, blocks * block), dtype=dtype, device=DEVICE))
    gemv.skinny_matmul(a, w, out=out, swiglu_block=block)
    assert_close(out, swiglu_reference(a, w, block), dtype=dtype, name=f"swiglu C[{m},{blocks}x{block}] {dtype}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("m", (1, 33))
def test_gpu_every_table_row_and_fma_path(m, dtype):
    """Each GPU table tiling and the CUDA-core path, forced, over whole tiles, split-K and stream-K."""
    n, k = 1320, 4160
    gen = torch.Generator().manual_seed(m)
    a = _randn((m, k), dtype, gen)
    w = make_weight("row_view", n, k, dtype, gen, blocks=4)
    for _, bn, bk, warps, stages, _, _ in gemv.GPU_TABLE:
        n_tiles = -(-n // bn)
        for programs in (n_tiles, 3 * n_tiles, 132, 250):  # whole tiles, split-K, stream-K
            for dot in (True, False) if m == 1 else (True,):
                cfg = gemv.SkinnyConfig(bn, bk, programs, num_warps=warps, num_stages=stages, dot=dot)
                if gemv_config.shared_memory_bytes(cfg, m, 2) > gemv_config.SMEM_BYTES:
                    continue  # a row for fewer rows of A (its ring would not fit at m = 33)
                run_and_check(a, w, name=f"C[{m},{n}] K={k} {cfg}", config=cfg)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", (1, 64))
def test_gpu_cuda_graph_replay(m):
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    a = _randn((m, 8192), dtype, gen)
    w = make_weight("col_view", 1280, 8192, dtype, gen, blocks=4)
    num_sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    # 20 N tiles of 64: the picked config splits them, so the reduce pass is captured too
    assert gemv.pick_config(m, 1280, 8192, dtype=dtype, num_sms=num_sms, interpret=False).programs > 20
    out = torch.empty((m, 1280), dtype=dtype, device=DEVICE)
    gemv.skinny_matmul(a, w, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv.skinny_matmul(a, w, out=out)
    for _ in range(2):
        a.copy_(_randn((m, 8192), dtype, gen))
        poison_(out)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, reference(a, w), dtype=dtype, name="graph replay")
