"""Tests of the FP8 kernels, fusedpar.kernels.fp8: dynamic e4m3 activation quantisation and the scaled GEMM,
against the plain-PyTorch reference (fusedpar.kernels.fp8.reference).

Without a GPU they run on the Triton interpreter (conftest.py sets TRITON_INTERPRET=1), which loads,
converts and multiplies e4m3 (tl.dot on e4m3 operands with an fp32 accumulator): the same kernel code
as on the GPU, in 32x32x32 tiles. Quantisation must match the reference bit for bit (codes and scales);
GEMM outputs are pre-filled with NaN and compared with a float64 product of the dequantised operands
at the output dtype's tolerance (the kernel sums exact e4m3 products in fp32), and with the reference's
fp8_linear. The GPU build of every tiling the launcher picks is compiled for sm_90 here too; `gpu`
tests run the kernels on Hopper at the TP=4 shapes of Llama-3-70B and Qwen3-32B.
"""

from __future__ import annotations

import math
import textwrap

import pytest
import torch
import triton
import triton.language as tl

from fusedpar.kernels import fp8
from fusedpar.kernels._host import INTERPRETED
from fusedpar.kernels.fp8 import E4M3, FP8Scheme, quantize_activation, quantize_weight
from fusedpar.kernels.fp8 import kernels as fp8_kernels
from fusedpar.kernels.fp8 import launch as fp8_launch
from fusedpar.kernels.gemm import GemmConfig
from fusedpar.layers.fp8_weights import FP8Weight
from fusedpar.testing.gpu import local_device
from fusedpar.testing.numerics import assert_close, poison_
from tests.kernels.sm90_build import build_for_sm90

HAS_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRETED),
    reason="no CUDA and fusedpar.kernels.fp8 was imported without TRITON_INTERPRET=1",
)

DEVICE = local_device()
OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# block (16, 32): several block rows and K groups inside the interpreter's 32x32 tiles (GPU: the kernel's
# smallest K step, 32)
SCHEMES = [FP8Scheme("tensor"), FP8Scheme("channel"), FP8Scheme("block", (128, 128)), FP8Scheme("block", (16, 32))]
IDS = ["tensor", "channel", "block128", "block16x32"]
ODD_SHAPES = [  # (M, N, K): ragged against 32x32x32 tiles and 128-wide blocks; K % 32 != 0 included
    (1, 24, 16),
    (7, 40, 96),
    (33, 72, 200),
    (70, 130, 300),
    (65, 17, 160),
]


def _randn(shape, gen, scale=1.0, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


def _activations(m, k, gen, dtype, spread=0.5) -> torch.Tensor:
    """Rows and columns of different magnitudes (e^(spread * N(0, 1)) apart: per-token and per-group scales
    matter), one all-zero row (the 1e-12 floor) where there is room. The GEMM tests keep outputs O(1), as
    the default tolerances assume; the quantisation tests spread wider."""
    x = _randn((m, k), gen) * torch.exp(torch.randn(m, 1, generator=gen) * spread).to(DEVICE)
    x = x * torch.exp(torch.randn(1, k, generator=gen) * spread).to(DEVICE)
    if m > 2:
        x[m // 2] = 0
    return x.to(dtype)


def _weight(n, k, gen, scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantised [n, k] weight (entries ~ N(0, 1/k) with per-row magnitudes) and its scales."""
    w = _randn((n, k), gen, 1 / math.sqrt(k)) * torch.exp(torch.randn(n, 1, generator=gen)).to(DEVICE)
    return quantize_weight(w, scheme)


def _oracle(qx, sx, x_group, qw, sw, w_tile, bias=None) -> torch.Tensor:
    """float64 (qx * sx) @ (qw * sw)^T (+ bias)."""
    y = fp8.dequantize(qx, sx, (1, x_group), torch.float64) @ fp8.dequantize(qw, sw, w_tile, torch.float64).T
    return y if bias is None else y + bias.double()


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


# ---- quantisation ------------------------------------------------------------------------------


@triton.jit
def _round_probe_kernel(x_ptr, q_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(q_ptr + offs, fp8_kernels._round_e4m3(tl.load(x_ptr + offs)).to(tl.float8e4nv))


def test_rounding_to_e4m3_is_torchs_cast():
    """_round_e4m3 on every finite e4m3 value, the midpoints between neighbours (ties to even), values one
    fp32 ulp either side of them, and a spread of random values: the same codes as torch's cast."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).float()
    vals = codes[~codes.isnan()].unique()  # sorted, -448 .. 448 with one 0
    mids = (vals[1:].double() + vals[:-1].double()) / 2
    mids = mids.float()
    assert torch.equal(mids.double(), (vals[1:].double() + vals[:-1].double()) / 2)  # exact in fp32
    gen = torch.Generator().manual_seed(0)
    rand = torch.randn(2048, generator=gen) * torch.exp(torch.randn(2048, generator=gen) * 3)
    x = torch.cat([vals, -vals, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e3)),
                   rand.clamp(-448, 448), torch.tensor([0.0, -0.0, 2.0**-10, -(2.0**-10), 2.0**-11 * 3])])
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(n - x.numel())]).to(DEVICE)
    q = torch.empty(n, dtype=E4M3, device=DEVICE)
    _round_probe_kernel[(1,)](x, q, N=n)
    want = x.to(E4M3)
    bad = (_bits(q) != _bits(want)).nonzero().flatten()
    assert bad.numel() == 0, [(float(x[i]), float(q[i].float()), float(want[i].float())) for i in bad[:5]]


@pytest.mark.parametrize("dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
@pytest.mark.parametrize(("m", "k"), [(1, 16), (7, 96), (33, 200), (5, 1100), (3, 2500)])
def test_quantize_matches_the_reference_bit_for_bit(m, k, scheme, dtype):
    """Codes and scales equal quantize_activation's, per token (K up to 2.4 x the row kernel's 1024-wide
    steps) and per token group (short last groups); outputs poisoned first."""
    gen = torch.Generator().manual_seed(m * 1000 + k)
    x = _activations(m, k, gen, dtype, spread=2.0)
    group = scheme.activation_tile(k)
    q_shape, s_shape = fp8_launch.quantize_shapes(x, group)
    q = torch.full(q_shape, 0x7F, dtype=torch.uint8, device=DEVICE).view(E4M3)  # 0x7f: e4m3 NaN
    s = poison_(torch.empty(s_shape, device=DEVICE))
    fp8_launch._launch_quantize(x, group, q, s)
    want_q, want_s = quantize_activation(x, scheme)
    assert s.shape == want_s.shape and torch.equal(s, want_s)
    assert torch.equal(_bits(q), _bits(want_q))
    # the public op returns the same
    q2, s2 = fp8.fp8_quantize(x, group)
    assert torch.equal(_bits(q2), _bits(want_q)) and torch.equal(s2, want_s)


@pytest.mark.parametrize("group", [16, 48, 128])
def test_quantize_strided_input_and_odd_groups(group):
    """A column view of a wider tensor (row stride != K), groups that are not powers of two."""
    gen = torch.Generator().manual_seed(group)
    base = _activations(9, 3 * 150, gen, torch.bfloat16, spread=2.0)
    x = base.narrow(1, 150, 150)
    q, s = fp8.fp8_quantize(x, group)
    want_q, want_s = fp8.reference._quantize(x, (1, group))
    assert torch.equal(_bits(q), _bits(want_q)) and torch.equal(s, want_s)


# ---- the scaled GEMM ---------------------------------------------------------------------------


def run_mm(qx, sx, x_group, qw, sw, w_tile, out_dtype, bias=None, config=None) -> torch.Tensor:
    out = poison_(torch.empty((qx.shape[0], qw.shape[0]), dtype=out_dtype, device=qx.device))
    fp8_launch._launch_mm(qx, sx, qw, sw, w_tile, x_group, bias, out, config)
    return out


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
@pytest.mark.parametrize(("m", "n", "k"), ODD_SHAPES)
def test_scaled_mm_odd_shapes(m, n, k, scheme, out_dtype):
    gen = torch.Generator().manual_seed(m * 10_000 + n * 100 + k)
    x = _activations(m, k, gen, torch.float32)
    qw, sw = _weight(n, k, gen, scheme)
    qx, sx = quantize_activation(x, scheme)
    w_tile, group = scheme.weight_tile((n, k)), scheme.activation_tile(k)
    out = run_mm(qx, sx, group, qw, sw, w_tile, out_dtype)
    assert_close(out, _oracle(qx, sx, group, qw, sw, w_tile), dtype=out_dtype, name=f"C[{m},{n}] K={k}")


@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
@pytest.mark.parametrize("dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize(("m", "n", "k"), [(7, 40, 96), (70, 130, 300)])
def test_fp8_matmul_is_the_reference_linear(m, n, k, dtype, scheme):
    """The public op (quantise + GEMM, bias, leading dims) against fp8_linear in the input dtype."""
    gen = torch.Generator().manual_seed(m + n + k)
    x = _activations(m, k, gen, dtype).reshape(1, m, k)
    qw, sw = _weight(n, k, gen, scheme)
    bias = _randn((n,), gen, dtype=dtype)
    y = fp8.fp8_matmul(x, qw, sw, scheme, bias)
    assert y.shape == (1, m, n) and y.dtype == dtype
    qx, sx = quantize_activation(x[0], scheme)
    want = _oracle(qx, sx, scheme.activation_tile(k), qw, sw, scheme.weight_tile((n, k)), bias)
    assert_close(y[0], want, dtype=dtype, name="vs float64")
    assert_close(y, fp8.fp8_linear(x, qw, sw, scheme, bias), dtype=dtype, name="vs fp8_linear")


@pytest.mark.parametrize("kind", ["rows", "columns"])
def test_kernel_linear_of_shard_views(kind):
    """FP8Weight.kernel_linear of a block-scaled weight's shard view (its scales with it) against the
    reference path; a scale per input column is refused by name."""
    gen = torch.Generator().manual_seed(5)
    base = FP8Weight.quantize(_randn((96, 128), gen), FP8Scheme("block", (32, 32)))
    w = base.narrow(0, 32, 64) if kind == "rows" else base.narrow(1, 64, 64)
    x = _activations(9, w.shape[1], gen, torch.float32)
    bias = _randn((w.shape[0],), gen)
    assert_close(w.kernel_linear(x, bias), w.reference_linear(x, bias), dtype=torch.float32, name=kind)
    with pytest.raises(ValueError, match="kernel_linear: the FP8 kernels do not take"):
        w.unit_tiles(1).kernel_linear(x)


@pytest.mark.parametrize("config", [(16, 32, 16, 1), (32, 16, 64, 3), (64, 64, 32, 8)])
@pytest.mark.parametrize("scheme", SCHEMES[1:], ids=IDS[1:])
def test_other_tilings(scheme, config):
    """Tilings other than the interpreter's default: BLOCK_K 16 (inside the 32-wide groups) and 64 (lowered
    by the launcher to fit the 32-column block groups), swizzle groups of 1, 3 and 8."""
    m, n, k = 70, 100, 224
    gen = torch.Generator().manual_seed(11)
    x = _activations(m, k, gen, torch.float32)
    qw, sw = _weight(n, k, gen, scheme)
    qx, sx = quantize_activation(x, scheme)
    w_tile, group = scheme.weight_tile((n, k)), scheme.activation_tile(k)
    bm, bn, bk, gm = config
    out = run_mm(qx, sx, group, qw, sw, w_tile, torch.float32, config=GemmConfig(bm, bn, bk, group_m=gm))
    assert_close(out, _oracle(qx, sx, group, qw, sw, w_tile), dtype=torch.float32, name=str(config))


@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
@pytest.mark.parametrize("kind", ["row_view", "col_view", "transposed"])
def test_strided_weight_views(scheme, kind):
    """TP shard / shift views read in place with their scales (FP8Weight.narrow): rows [n, 2n) and columns
    [k, 2k) of a 3x larger weight (block-aligned), and a transposed weight (stride (1, N))."""
    n, k, m = 128, 128, 37  # block-aligned views of the 128 x 128 blocks too
    gen = torch.Generator().manual_seed(5)
    if kind == "row_view":
        w = FP8Weight.quantize(_randn((3 * n, k), gen), scheme).narrow(0, n, n)
    elif kind == "col_view":
        w = FP8Weight.quantize(_randn((n, 3 * k), gen), scheme).narrow(1, k, k)
    else:
        base = FP8Weight.quantize(_randn((n, k), gen), scheme)
        w = FP8Weight(base.q.T.contiguous().T, base.scale, base.tile)
        assert w.q.stride() == (1, n)
    x = _activations(m, k, gen, torch.float32)
    qx, sx = fp8.fp8_quantize(x, w.tile[1])
    out = run_mm(qx, sx, w.tile[1], w.q, w.scale, w.tile, torch.float32)
    assert_close(out, _oracle(qx, sx, w.tile[1], w.q, w.scale, w.tile), dtype=torch.float32, name=kind)
    # the reference rounds each dequantised operand to fp32 before its fp32 product: two fp32 results apart
    assert_close(out, w.reference_linear(x), dtype=torch.float32, atol=1e-4, rtol=1e-4, name=f"{kind} vs reference")


def test_strided_out_view_writes_only_its_window():
    m, n, k = 37, 50, 96
    gen = torch.Generator().manual_seed(3)
    scheme = FP8Scheme("block", (16, 32))
    qw, sw = _weight(n, k, gen, scheme)
    qx, sx = quantize_activation(_activations(m, k, gen, torch.float32), scheme)
    big = poison_(torch.empty((m + 2, 3 * n), device=DEVICE))
    out = big[1 : m + 1, n : 2 * n]
    fp8_launch._launch_mm(qx, sx, qw, sw, (16, 32), 32, None, out)
    assert_close(out, _oracle(qx, sx, 32, qw, sw, (16, 32)), dtype=torch.float32, name="out view")
    outside = torch.ones_like(big, dtype=torch.bool)
    outside[1 : m + 1, n : 2 * n] = False
    assert big[outside].isnan().all(), "kernel wrote outside its [M, N] output window"


def test_mixed_tiles_and_groups():
    """A per-token activation scale against block weight scales, and 1 x 64 groups against 32 x 32 weight
    tiles (the scales change at different K steps on the two sides): the general tile math."""
    m, n, k = 20, 70, 192
    gen = torch.Generator().manual_seed(9)
    x = _activations(m, k, gen, torch.float32)
    qw, sw = quantize_weight(_randn((n, k), gen), FP8Scheme("block", (32, 32)))
    for group in (k, 64):
        qx, sx = fp8.fp8_quantize(x, group)
        out = run_mm(qx, sx, group, qw, sw, (32, 32), torch.float32)
        assert_close(out, _oracle(qx, sx, group, qw, sw, (32, 32)), dtype=torch.float32, name=f"group {group}")
        y = fp8.fp8_matmul_tiles(x, qw, sw, (32, 32), group)
        assert_close(y, fp8.fp8_linear_tiles(x, qw, sw, (32, 32), group), dtype=torch.float32, name="tiles")


def test_empty_and_single():
    qw, sw = quantize_weight(torch.randn(24, 32, device=DEVICE), FP8Scheme("channel"))
    y = fp8.fp8_matmul(torch.randn(0, 32, device=DEVICE), qw, sw, FP8Scheme("channel"))
    assert y.shape == (0, 24)
    x = torch.randn(1, 32, device=DEVICE)
    assert_close(fp8.fp8_matmul(x, qw, sw, FP8Scheme("channel")), fp8.fp8_linear(x, qw, sw, FP8Scheme("channel")),
                 dtype=torch.float32)


def test_harness_catches_an_unwritten_element():
    """Self-check of the poison + assert_close harness: one element left NaN must fail, by index."""
    gen = torch.Generator().manual_seed(8)
    scheme = FP8Scheme("channel")
    qw, sw = _weight(5, 32, gen, scheme)
    qx, sx = quantize_activation(_randn((6, 32), gen), scheme)
    out = run_mm(qx, sx, 32, qw, sw, (1, 32), torch.float32)
    out[4, 2] = float("nan")
    with pytest.raises(AssertionError, match=r"worst at index \(4, 2\): actual=nan"):
        assert_close(out, _oracle(qx, sx, 32, qw, sw, (1, 32)), dtype=torch.float32)


# ---- errors ------------------------------------------------------------------------------------


def test_every_violated_constraint_is_listed():
    qx = torch.zeros(4, 40, dtype=torch.bfloat16, device=DEVICE)
    qw = torch.zeros(6, 40, dtype=E4M3, device=DEVICE)
    with pytest.raises(ValueError) as e:
        fp8.fp8_scaled_mm(qx, torch.ones(4, 2, dtype=torch.float64, device=DEVICE), qw,
                          torch.ones(3, 1, device=DEVICE), (1, 40), 20, torch.ones(5, device=DEVICE), torch.int8)
    msg = str(e.value)
    for part in ("qx dtype torch.bfloat16 must be torch.float8_e4m3fn", "x_scale dtype torch.float64",
                 "output dtype torch.int8",
                 "w_scale (3, 1) must be [ceil(N / 1), ceil(K / 40)] = (6, 1)", "activation group's 20",
                 "bias must be [N] = [6]"):
        assert part in msg, (part, msg)
    with pytest.raises(ValueError, match=r"inner dims differ: qx \(4, 40\).*qw \(6, 48\)"):
        fp8.fp8_scaled_mm(qx.to(E4M3), torch.ones(4, 1, device=DEVICE), torch.zeros(6, 48, dtype=E4M3, device=DEVICE),
                          torch.ones(6, 1, device=DEVICE), (1, 48), 40)
    with pytest.raises(ValueError, match=r"x dtype torch.int32"):
        fp8.fp8_quantize(torch.zeros(2, 8, dtype=torch.int32, device=DEVICE), 8)


def test_block_view_must_start_on_a_block_boundary():
    """A view of a block-scaled weight cut inside a block (FP8Weight.narrow refuses to make one; a raw view
    can be passed): refused by name, with the offending row and column."""
    scheme = FP8Scheme("block", (32, 32))
    qw, sw = quantize_weight(torch.randn(128, 128, device=DEVICE) / 8, scheme)
    x = torch.randn(3, 64, device=DEVICE)
    view = qw[16:80, 48:112]
    with pytest.raises(ValueError, match=r"starts at row 16, inside a 32-row scale block.*starts at column 48"):
        fp8.fp8_matmul(x, view, sw[:2, :2], scheme)
    # on the boundaries it runs, with the scales of the blocks it covers
    ok, ok_scales = qw[32:96, 64:128], sw[1:3, 2:4]
    y = fp8.fp8_matmul(x, ok, ok_scales, scheme)
    qx, sx = quantize_activation(x, scheme)
    assert_close(y, _oracle(qx, sx, 32, ok, ok_scales, (32, 32)), dtype=torch.float32)


def test_cpu_tensors_without_interpreter_fail_clearly(monkeypatch):
    monkeypatch.setattr(fp8_launch, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        fp8.fp8_quantize(torch.ones(2, 16), 16)


# ---- ops: fake impls, opcheck, torch.compile ---------------------------------------------------


def test_fake_impls_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty((1000, 8192), dtype=torch.bfloat16, device=DEVICE)
        qw = torch.empty((2560, 4 * 8192), dtype=E4M3, device=DEVICE).narrow(1, 8192, 8192)
        sw = torch.empty((20, 64), device=DEVICE)
        y = torch.ops.fusedpar.fp8_linear(x, qw, sw, 128, 128, 128, None)
        assert y.shape == (1000, 2560) and y.dtype == torch.bfloat16
        q, s = torch.ops.fusedpar.fp8_quantize(x, 128)
        assert q.shape == (1000, 8192) and q.dtype == E4M3 and s.shape == (1000, 64) and s.dtype == torch.float32
        c = torch.ops.fusedpar.fp8_scaled_mm(q, s, qw, sw, 128, 128, 128, None, torch.float16)
        assert c.shape == (1000, 2560) and c.dtype == torch.float16
        with pytest.raises(ValueError, match=r"w_scale \(20, 64\) must be"):
            torch.ops.fusedpar.fp8_linear(x, qw, sw, 1, 8192, 8192, None)


def test_opcheck():
    gen = torch.Generator().manual_seed(2)
    scheme = FP8Scheme("block", (16, 32))
    x = _activations(9, 64, gen, torch.float32)
    qw, sw = _weight(24, 64, gen, scheme)
    # not test_schema: it multiplies tensors elementwise to detect mutation, which torch has no e4m3 kernel for
    utils = ("test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.fusedpar.fp8_quantize.default, (x, 32), test_utils=utils)
    qx, sx = fp8.fp8_quantize(x, 32)
    torch.library.opcheck(torch.ops.fusedpar.fp8_scaled_mm.default, (qx, sx, qw, sw, 16, 32, 32, None, torch.float32),
                          test_utils=utils)
    torch.library.opcheck(torch.ops.fusedpar.fp8_linear.default, (x, qw, sw, 16, 32, 32, None), test_utils=utils)


def test_torch_compile_sees_one_op():
    gen = torch.Generator().manual_seed(4)
    scheme = FP8Scheme("channel")
    x = _activations(17, 64, gen, torch.float32)
    qw, sw = _weight(24, 64, gen, scheme)
    compiled = torch.compile(lambda x: fp8.fp8_matmul(x, qw, sw, scheme) * 2.0, backend="aot_eager", fullgraph=True)
    assert_close(compiled(x), 2.0 * fp8.fp8_linear(x, qw, sw, scheme), dtype=torch.float32)


# ---- the GPU build, without a GPU --------------------------------------------------------------

# (N, K) of one TP=4 rank of Llama-3-70B and Qwen3-32B: qkv, o, gate_up, down
TP4_SHAPES = ((2560, 8192), (8192, 2048), (14336, 8192), (8192, 7168), (2560, 5120), (5120, 2048), (12800, 5120),
              (5120, 6400))

_COMPILE = textwrap.dedent(
    """
    import json, sys
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from fusedpar.kernels.fp8 import kernels, pick_fp8_config

    def build(fn, types, consts, aligned, opts):
        names = list(fn.arg_names)
        missing = [n for n in names if n not in consts and n not in types]
        assert not missing, f"{fn.__name__}: no type given for {missing}"
        sig = {n: "constexpr" if n in consts else types[n] for n in names}
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        src = ASTSource(fn, sig, constexprs={(names.index(n),): v for n, v in consts.items()}, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
        ptx = k.asm["ptx"].splitlines()
        return {"shared": k.metadata.shared, "cubin_bytes": len(k.asm["cubin"]),
                "tma_loads": sum("cp.async.bulk.tensor" in line for line in ptx),
                "wgmma_e4m3": sum("wgmma" in line and "e4m3" in line for line in ptx),
                "div_rn": sum("div.rn.f32" in line for line in ptx)}

    out = {"mm": [], "quant": []}
    seen = set()
    for m, n, k in json.loads(sys.argv[1]):
        for in_loop in (False, True):
            cfg = pick_fp8_config(m, n, k, out_dtype=torch.bfloat16, num_sms=132, interpret=False, tma=m > 64)
            if (cfg, in_loop) in seen:
                continue
            seen.add((cfg, in_loop))
            types = {"a_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "c_ptr": "*bf16", "as_ptr": "*fp32",
                     "ws_ptr": "*fp32", "bias_ptr": "*bf16"}
            types.update({n_: "i32" for n_ in ("M", "N", "K", "W_TILE_N", "W_TILE_K", "X_GROUP", "stride_am",
                                               "stride_wn", "stride_cm", "stride_asm", "stride_asg", "stride_wsn",
                                               "stride_wsk")})
            types["a_desc"] = f"tensordesc<fp8e4nv[{cfg.block_m}, {cfg.block_k}]>"
            types["w_desc"] = f"tensordesc<fp8e4nv[{cfg.block_n}, {cfg.block_k}]>"
            consts = {"stride_ak": 1, "stride_wk": 1, "stride_cn": 1, "BLOCK_M": cfg.block_m,
                      "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m, "NUM_SMS": 132,
                      "EVEN_K": True, "SCALE_IN_LOOP": in_loop, "HAS_BIAS": True, "TMA": cfg.tma,
                      "FLATTEN": cfg.flatten}
            if not cfg.tma:
                consts.update(a_desc=None, w_desc=None)
            r = build(kernels._fp8_matmul_kernel, types, consts,
                      ["a_ptr", "w_ptr", "c_ptr", "M", "N", "K", "stride_am", "stride_wn", "stride_cm"],
                      {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
            out["mm"].append(dict(r, config=repr(cfg), in_loop=in_loop, m=m))
    qtypes = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "K": "i32", "stride_xm": "i32",
              "stride_xk": "i32", "stride_qm": "i32", "stride_sm": "i32", "GROUP": "i32", "num_groups": "i32"}
    for one_block in (True, False):  # what the launcher picks for K <= 8192 and above
        out["quant"].append(build(kernels._quantize_rows_kernel, qtypes, {"BLOCK": 8192, "ONE_BLOCK": one_block}, [],
                                  {"num_warps": 16}))
    out["quant"].append(build(kernels._quantize_groups_kernel, qtypes, {"GROUPS_PER_PROG": 16, "GROUP_P2": 128}, [],
                              {"num_warps": 4}))
    print(json.dumps(out))
    """
)


def test_gpu_builds_for_sm90_within_shared_memory(tmp_path):
    """Every tiling pick_fp8_config returns on the TP=4 rank shapes (decode to 16384 tokens), with the scales
    in the epilogue and per K step, builds for sm_90 and fits Hopper's 227 KiB of shared memory; from 128
    rows the K loop reads by TMA and multiplies on e4m3 wgmma. The quantisers build with IEEE divisions."""
    shapes = [(m, n, k) for m in (1, 16, 64, 128, 1024, 4096, 16384) for n, k in TP4_SHAPES]
    built = build_for_sm90(_COMPILE, shapes, tmp_path, timeout=900)
    assert len(built["mm"]) >= 8, built
    for b in built["mm"]:
        assert b["cubin_bytes"] > 10_000 and b["shared"] <= 227 * 1024, b
        if b["m"] > 64:
            assert b["tma_loads"] > 0 and b["wgmma_e4m3"] > 0, b
    for b in built["quant"]:
        assert b["cubin_bytes"] > 1_000 and b["div_rn"] > 0, b


def test_gpu_configs_are_legal():
    for m in (1, 7, 16, 64, 65, 512, 4096, 16384):
        for (n, k), out_dtype in zip(TP4_SHAPES, (torch.bfloat16, torch.float16, torch.float32) * 3, strict=False):
            cfg = fp8.pick_fp8_config(m, n, k, out_dtype=out_dtype, num_sms=132, interpret=False, tma=m > 64)
            for block in (cfg.block_m, cfg.block_n, cfg.block_k):
                assert block >= 16 and block & (block - 1) == 0, cfg
            assert cfg.block_k == 128, cfg  # one 128-wide block group per K step
            ring = cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k
            assert ring + cfg.block_m * cfg.block_n * out_dtype.itemsize <= 227 * 1024, cfg


# ---- GPU only ----------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("scheme", [FP8Scheme("channel"), FP8Scheme("block"), FP8Scheme("tensor")],
                         ids=["channel", "block128", "tensor"])
@pytest.mark.parametrize(("n", "k"), [(2560, 8192), (8192, 7168), (5120, 6400)])
@pytest.mark.parametrize("m", (1, 16, 64, 65, 300, 1000, 4096))
def test_gpu_tp4_shapes(m, n, k, scheme):
    """Per-rank TP=4 shapes of Llama-3-70B (qkv, down) and Qwen3-32B (down) through the public op in bf16:
    quantisation bit for bit, the GEMM against float64 and against the reference's fp8_linear."""
    gen = torch.Generator().manual_seed(m + n)
    x = _activations(m, k, gen, torch.bfloat16)
    qw, sw = _weight(n, k, gen, scheme)
    group = scheme.activation_tile(k)
    q, s = fp8.fp8_quantize(x, group)
    want_q, want_s = quantize_activation(x, scheme)
    assert torch.equal(_bits(q), _bits(want_q)) and torch.equal(s, want_s)
    out = run_mm(q, s, group, qw, sw, scheme.weight_tile((n, k)), torch.bfloat16)
    assert_close(out, _oracle(q, s, group, qw, sw, scheme.weight_tile((n, k))), dtype=torch.bfloat16, name="mm")
    y = fp8.fp8_matmul(x, qw, sw, scheme)
    assert_close(y, fp8.fp8_linear(x, qw, sw, scheme), dtype=torch.bfloat16, name="vs fp8_linear")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("scheme", [FP8Scheme("channel"), FP8Scheme("block")], ids=["channel", "block128"])
@pytest.mark.parametrize("kind", ["row_view", "col_view"])
@pytest.mark.parametrize("m", (1, 200, 1000))
def test_gpu_shift_views_and_fp8_weight_linear(m, kind, scheme):
    """Shift-mode views (block 1 of 4 rows / columns of a Llama-70B-sized base) through
    FP8Weight.kernel_linear against its reference path."""
    n, k = 1280, 8192
    gen = torch.Generator().manual_seed(m)
    if kind == "row_view":
        w = FP8Weight.quantize(_randn((4 * n, k), gen), scheme).narrow(0, n, n)
    else:
        w = FP8Weight.quantize(_randn((n, 4 * k), gen), scheme).narrow(1, k, k)
    x = _activations(m, k, gen, torch.bfloat16)
    bias = _randn((n,), gen, dtype=torch.bfloat16)
    assert_close(w.kernel_linear(x, bias), w.reference_linear(x, bias), dtype=torch.bfloat16, name=kind)


@pytest.mark.gpu
@gpu
def test_gpu_other_tilings_and_fp32_out():
    """The TMA tilings and the pointer path at one shape, fp32 output (no output rounding: only fp32
    accumulation order is left between kernel and float64)."""
    m, n, k = 1000, 1320, 4096
    gen = torch.Generator().manual_seed(1)
    for scheme in (FP8Scheme("channel"), FP8Scheme("block")):
        qw, sw = _weight(n, k, gen, scheme)
        qx, sx = quantize_activation(_activations(m, k, gen, torch.bfloat16), scheme)
        w_tile, group = scheme.weight_tile((n, k)), scheme.activation_tile(k)
        want = _oracle(qx, sx, group, qw, sw, w_tile)
        for cfg in (GemmConfig(128, 256, 128, num_warps=8, num_stages=3, tma=True),
                    GemmConfig(128, 128, 128, num_warps=4, num_stages=4, tma=True),
                    GemmConfig(64, 128, 128, num_warps=4, num_stages=4),
                    GemmConfig(16, 64, 128, num_warps=4, num_stages=4)):
            out_dtype = torch.float32 if cfg.block_n < 256 else torch.bfloat16  # 128x256: 16-bit outputs only
            out = run_mm(qx, sx, group, qw, sw, w_tile, out_dtype, config=cfg)
            # fp32: K = 4096 fp32 sums in two orders, so a little above the default fp32 tolerance
            tol = {"atol": 1e-4, "rtol": 1e-4} if out_dtype == torch.float32 else {}
            assert_close(out, want, dtype=out_dtype, name=f"{scheme.weight} {cfg}", **tol)


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_replay():
    scheme = FP8Scheme("block")
    gen = torch.Generator().manual_seed(0)
    qw, sw = _weight(1280, 8192, gen, scheme)
    x = _activations(64, 8192, gen, torch.bfloat16)
    fp8.fp8_matmul(x, qw, sw, scheme)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8.fp8_matmul(x, qw, sw, scheme)
    x.copy_(_activations(64, 8192, gen, torch.bfloat16))
    poison_(y)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(y, fp8.fp8_linear(x, qw, sw, scheme), dtype=torch.bfloat16, name="graph replay")


@pytest.mark.gpu
@gpu
def test_gpu_torch_compile_inductor():
    scheme = FP8Scheme("channel")
    gen = torch.Generator().manual_seed(1)
    qw, sw = _weight(1024, 4096, gen, scheme)
    x = _activations(300, 4096, gen, torch.bfloat16)
    compiled = torch.compile(lambda x: fp8.fp8_matmul(x, qw, sw, scheme) + 1.0, fullgraph=True)
    assert_close(compiled(x), fp8.fp8_linear(x, qw, sw, scheme) + 1.0, dtype=torch.bfloat16, name="inductor")
