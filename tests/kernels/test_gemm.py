"""Tests of the persistent Triton GEMM, fusedpar.kernels.gemm: C = A @ W^T over strided views.

Without a GPU they run on the Triton interpreter (conftest.py sets TRITON_INTERPRET=1) in fp16
and fp32 (the interpreter cannot tl.dot bf16); bf16 and Llama-sized shapes are `gpu` tests.
Every check compares against a float64 product, with outputs pre-filled with NaN so an element
the kernel never writes fails.
"""

from __future__ import annotations

import importlib
import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusedpar.kernels import gemm
from fusedpar.kernels._host import INTERPRETED
from fusedpar.kernels.gemm import launch as gemm_launch
from fusedpar.kernels.gemm import ops as gemm_ops
from fusedpar.testing.gpu import local_device
from fusedpar.testing.numerics import assert_close, poison_
from tests.profile import examples

HAS_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRETED),
    reason="no CUDA and fusedpar.kernels.gemm was imported without TRITON_INTERPRET=1",
)


DEVICE = local_device()  # under torchrun each rank takes its own GPU
CPU_DTYPES = (torch.float16, torch.float32)
WEIGHT_KINDS = ("contiguous", "row_view", "col_view", "transposed")


def _randn(shape, dtype, gen, scale=1.0, device=DEVICE) -> torch.Tensor:
    """Standard normal (never all zeros) times scale, drawn in fp32 on the CPU for reproducibility."""
    return (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype)


def make_weight(kind: str, n: int, k: int, dtype, gen, device=DEVICE, blocks: int = 3) -> torch.Tensor:
    """A [n, k] weight (entries ~ N(0, 1/k), so outputs are O(1)) stored as `kind`.

    row_view: rows [n, 2n) of a [blocks*n, k] base (column-parallel shift view; offset pointer).
    col_view: columns [k, 2k) of a [n, blocks*k] base (row-parallel shift view; stride(0) = blocks*k).
    transposed: a [k, n] tensor's .T (stride (1, n)).
    """
    scale = 1.0 / math.sqrt(max(k, 1))
    if kind == "contiguous":
        return _randn((n, k), dtype, gen, scale, device)
    if kind == "row_view":
        return _randn((blocks * n, k), dtype, gen, scale, device).narrow(0, n, n)
    if kind == "col_view":
        return _randn((n, blocks * k), dtype, gen, scale, device).narrow(1, k, k)
    if kind == "transposed":
        return _randn((k, n), dtype, gen, scale, device).T
    raise ValueError(kind)


def reference(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return a.double() @ w.double().T


def run_and_check(a, w, *, name, out_dtype=None, config=None):
    out = poison_(torch.empty((a.shape[0], w.shape[0]), dtype=out_dtype or a.dtype, device=a.device))
    if config is None:
        result = gemm.matmul(a, w, out=out)
        assert result is out
    else:
        gemm_launch._launch(a, w, out, gemm.GemmConfig(*config))
    assert_close(out, reference(a, w), dtype=out.dtype, name=name)
    return out


ODD_SHAPES = [  # (M, N, K): ragged against 32x32x32 and 128x256x64 tiles; K % 32 != 0 included
    (1, 24, 16),
    (7, 40, 40),
    (33, 72, 96),
    (100, 24, 40),
    (100, 72, 96),
    (33, 40, 16),
    (1, 72, 96),
    (7, 24, 96),
]


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize(("m", "n", "k"), ODD_SHAPES)
def test_odd_shapes(m, n, k, dtype):
    gen = torch.Generator().manual_seed(m * 10_000 + n * 100 + k)
    a = _randn((m, k), dtype, gen)
    w = make_weight("contiguous", n, k, dtype, gen)
    run_and_check(a, w, name=f"C[{m},{n}] K={k}")


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("kind", WEIGHT_KINDS[1:])
@pytest.mark.parametrize(("m", "n", "k"), [(33, 40, 40), (100, 72, 96)])
def test_strided_weights(m, n, k, kind, dtype):
    gen = torch.Generator().manual_seed(7)
    a = _randn((m, k), dtype, gen)
    w = make_weight(kind, n, k, dtype, gen)
    if kind == "col_view":
        assert not w.is_contiguous()
    run_and_check(a, w, name=f"{kind} C[{m},{n}] K={k}")


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_strided_a_and_out_view_writes_only_its_window(dtype):
    m, n, k = 37, 50, 72
    gen = torch.Generator().manual_seed(3)
    a = _randn((m, 2 * k + 3), dtype, gen).narrow(1, 3, k)  # non-contiguous rows of A
    w = make_weight("col_view", n, k, dtype, gen)
    big = poison_(torch.empty((m + 2, 3 * n), dtype=dtype, device=DEVICE))
    out = big[1 : m + 1, n : 2 * n]
    assert gemm.matmul(a, w, out=out) is out
    assert_close(out, reference(a, w), dtype=dtype, name="out view")
    outside = torch.ones_like(big, dtype=torch.bool)
    outside[1 : m + 1, n : 2 * n] = False
    assert big[outside].isnan().all(), "kernel wrote outside its [M, N] output window"


def test_transposed_output_and_fp32_out_from_fp16():
    m, n, k = 45, 33, 80
    gen = torch.Generator().manual_seed(5)
    a = _randn((m, k), torch.float16, gen)
    w = make_weight("row_view", n, k, torch.float16, gen)
    out = poison_(torch.empty((n, m), dtype=torch.float32, device=DEVICE)).T  # stride (1, m)
    gemm.matmul(a, w, out=out)
    # fp32 output keeps the fp32 accumulator: only accumulation-order error remains.
    assert_close(out, reference(a, w), dtype=torch.float32, name="fp32 out")


@pytest.mark.parametrize(
    "config",
    [
        (16, 16, 16, 1, 4, 1),  # many tiles per program, plain row-major order
        (32, 16, 64, 3, 4, 1),  # GROUP_M=3: last swizzle group ragged; K=80 not a multiple of 64
        (64, 32, 16, 8, 4, 1),  # GROUP_M larger than the number of tile rows; K multiple of 16
        (16, 32, 32, 3, 4, 1, False, False),  # nested tile and K loops (FLATTEN off), pointer loads
        (32, 32, 32, 2, 4, 1, False, True, 16),  # 48-wide tiles (two column blocks): N=72 ends inside block 2
        (16, 16, 16, 3, 4, 1, False, True, 16),  # 32-wide split tiles, N=72 ends inside block 1 of tile 3
        (32, 16, 64, 1, 4, 1, False, False, 16),  # split tiles, nested loops, K=80 ragged against 64
    ],
    ids=lambda c: "x".join(map(str, c[:3])) + f"-g{c[3]}",
)
def test_explicit_tilings(config):
    if HAS_CUDA:
        pytest.skip("explicit tilings are an interpreter check of the tile schedule")
    gen = torch.Generator().manual_seed(11)
    m, n, k = 100, 72, 80
    a = _randn((m, k), torch.float16, gen)
    w = make_weight("col_view", n, k, torch.float16, gen)
    run_and_check(a, w, name=f"tiling {config}", config=config)


TMA_SHAPES = [(1, 24, 16), (33, 40, 40), (100, 72, 96), (37, 50, 72)]  # K % 8 == 0: 16-byte rows in fp16


def _count_descriptors(monkeypatch) -> list:
    made = []
    real = gemm_launch.tma_descriptors

    def counting(*args):
        made.append(args[2:])
        return real(*args)

    monkeypatch.setattr(gemm_launch, "tma_descriptors", counting)
    return made


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("kind", WEIGHT_KINDS[:3])
@pytest.mark.parametrize(("m", "n", "k"), TMA_SHAPES)
def test_tma_loads(m, n, k, kind, dtype, monkeypatch):
    """The TMA mainloop (descriptor tile loads, zero fill past every edge) on ragged shapes and the
    shift views; 32x32x32 tiles on the interpreter, so M, N and K all have partial tiles."""
    gen = torch.Generator().manual_seed(m * 7 + n + k)
    a = _randn((m, k), dtype, gen)
    w = make_weight(kind, n, k, dtype, gen)
    assert gemm.tma_compatible(a, w)
    made = _count_descriptors(monkeypatch)
    for flatten in (True, False):  # one fused tile x K loop, or the nested loops
        cfg = (32, 32, 32, 2, 4, 1, True, flatten) if not HAS_CUDA else (64, 128, 64, 8, 4, 3, True, flatten)
        run_and_check(a, w, name=f"tma {kind} C[{m},{n}] K={k} flatten={flatten}", config=cfg)
    # two column blocks per tile (the second through its own descriptor), 48 columns on the interpreter
    cfg2 = (32, 32, 32, 2, 4, 1, True, True, 16) if not HAS_CUDA else (128, 128, 64, 8, 8, 4, True, True, 32)
    run_and_check(a, w, name=f"tma split tile {kind} C[{m},{n}] K={k}", config=cfg2)
    assert made == [tuple(cfg[:3])] * 2 + [tuple(cfg2[:3])], "the TMA path did not run"


def test_tma_config_falls_back_where_descriptors_cannot_work(monkeypatch):
    """A TMA config on operands TMA cannot read (transposed weight; K = 36 rows of 72 bytes) still
    gives the right result: the launcher takes the pointer loads."""
    gen = torch.Generator().manual_seed(9)
    a = _randn((40, 36), torch.float16, gen)
    made = _count_descriptors(monkeypatch)
    cfg = (32, 32, 32, 2, 4, 1, True) if not HAS_CUDA else (64, 128, 64, 8, 4, 3, True)
    for kind in ("transposed", "contiguous"):
        w = make_weight(kind, 24, 36, torch.float16, gen)
        assert not gemm.tma_compatible(a, w)
        run_and_check(a, w, name="tma fallback", config=cfg)
    assert made == []


def test_tma_compatible_names_the_rules():
    x = torch.zeros((8, 64), dtype=torch.float16, device=DEVICE)
    assert gemm.tma_compatible(x)
    assert not gemm.tma_compatible(x.T)  # stride 1 must be the last dim
    assert not gemm.tma_compatible(x[:, 1:9])  # base 2 bytes past a 16-byte boundary
    assert gemm.tma_compatible(x[:, 8:16])
    assert not gemm.tma_compatible(torch.zeros((8, 4), dtype=torch.float16, device=DEVICE))  # 8-byte rows


def test_empty_dims():
    gen = torch.Generator().manual_seed(0)
    a = _randn((0, 16), torch.float32, gen)
    assert gemm.matmul(a, make_weight("contiguous", 8, 16, torch.float32, gen)).shape == (0, 8)
    # K = 0: the empty sum, all zeros (and every element written).
    a = _randn((5, 0), torch.float32, gen)
    w = _randn((8, 0), torch.float32, gen)
    out = poison_(torch.empty((5, 8), device=DEVICE))
    gemm.matmul(a, w, out=out)
    assert (out == 0).all()


@settings(max_examples=examples(15), deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    m=st.integers(1, 80),
    n=st.integers(1, 80),
    k=st.integers(1, 80),
    dtype=st.sampled_from(CPU_DTYPES),
    kind=st.sampled_from(WEIGHT_KINDS),
    seed=st.integers(0, 2**16),
)
def test_property_shapes(m, n, k, dtype, kind, seed):
    gen = torch.Generator().manual_seed(seed)
    a = _randn((m, k), dtype, gen)
    w = make_weight(kind, n, k, dtype, gen)
    run_and_check(a, w, name=f"{kind} C[{m},{n}] K={k} {dtype}")


def test_harness_catches_an_unwritten_element():
    """Self-check of the poison + assert_close harness: one element left NaN must fail, by index."""
    gen = torch.Generator().manual_seed(8)
    a = _randn((6, 16), torch.float32, gen)
    w = make_weight("contiguous", 5, 16, torch.float32, gen)
    out = gemm.matmul(a, w)
    out[4, 2] = float("nan")
    with pytest.raises(AssertionError, match=r"worst at index \(4, 2\): actual=nan"):
        assert_close(out, reference(a, w), dtype=torch.float32)


def test_no_out_returns_contiguous_result_of_input_dtype():
    gen = torch.Generator().manual_seed(1)
    a = _randn((9, 40), torch.float16, gen)
    w = make_weight("col_view", 24, 40, torch.float16, gen)
    c = gemm.matmul(a, w)
    assert c.shape == (9, 24) and c.dtype == torch.float16 and c.is_contiguous()
    assert_close(c, reference(a, w), dtype=torch.float16)
    assert_close(gemm.matmul_reference(a.float(), w.float()), reference(a, w), dtype=torch.float32)


@pytest.mark.parametrize(
    ("a_shape", "w_shape", "a_dtype", "w_dtype", "out", "exc", "match"),
    [
        ((4, 8), (6, 9), torch.float32, torch.float32, None, ValueError, r"a \(4, 8\).*w \(6, 9\)"),
        ((4, 8), (6, 8), torch.float16, torch.float32, None, TypeError, "share one dtype"),
        ((2, 4, 8), (6, 8), torch.float32, torch.float32, None, ValueError, "2-D"),
        ((4, 8), (6, 8), torch.int32, torch.int32, None, TypeError, "share one dtype"),
        ((4, 8), (6, 8), torch.float32, torch.float32, ((4, 5), torch.float32), ValueError, r"\(4, 6\)"),
        ((4, 8), (6, 8), torch.float32, torch.float32, ((4, 6), torch.float16), TypeError, "out dtype"),
    ],
)
def test_bad_arguments_name_the_shapes(a_shape, w_shape, a_dtype, w_dtype, out, exc, match):
    a = torch.ones(a_shape, dtype=a_dtype, device=DEVICE)
    w = torch.ones(w_shape, dtype=w_dtype, device=DEVICE)
    out_t = None if out is None else torch.empty(out[0], dtype=out[1], device=DEVICE)
    with pytest.raises(exc, match=match):
        gemm.matmul(a, w, out=out_t)


def test_cpu_tensors_without_interpreter_fail_clearly(monkeypatch):
    monkeypatch.setattr(gemm_launch, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        gemm.matmul(torch.ones(2, 16), torch.ones(3, 16))


def test_fake_impl_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty((1000, 8192), dtype=torch.bfloat16, device=DEVICE)
        w = torch.empty((1280, 4 * 8192), dtype=torch.bfloat16, device=DEVICE).narrow(1, 8192, 8192)
        c = torch.ops.fusedpar.matmul(a, w)
        assert c.shape == (1000, 1280) and c.dtype == torch.bfloat16 and c.device == a.device
        with pytest.raises(ValueError, match="inner dims"):
            torch.ops.fusedpar.matmul(a, w.T)


def test_opcheck():
    gen = torch.Generator().manual_seed(2)
    a = _randn((9, 40), torch.float32, gen)
    w = make_weight("col_view", 24, 40, torch.float32, gen)
    torch.library.opcheck(torch.ops.fusedpar.matmul.default, (a, w))
    out = torch.empty((9, 24), device=DEVICE)
    torch.library.opcheck(torch.ops.fusedpar.matmul_out.default, (a, w, out))


def test_torch_compile_sees_one_op():
    gen = torch.Generator().manual_seed(4)
    a = _randn((17, 40), torch.float32, gen)
    w = make_weight("col_view", 24, 40, torch.float32, gen)

    def f(a, w):
        return gemm.matmul(a, w) * 2.0

    # aot_eager: the graph is captured (fullgraph => no break at the op) but not code-generated,
    # so this needs no C++ compiler on the CPU CI box.
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert_close(compiled(a, w), 2.0 * reference(a, w), dtype=torch.float32)


def test_reimport_is_idempotent():
    importlib.reload(gemm_ops)  # registers the torch.library ops again
    module = importlib.reload(gemm)
    gen = torch.Generator().manual_seed(6)
    a = _randn((5, 16), torch.float32, gen)
    w = make_weight("contiguous", 8, 16, torch.float32, gen)
    assert_close(module.matmul(a, w), reference(a, w), dtype=torch.float32)


@pytest.mark.parametrize(
    ("dtype", "out_dtype"),
    [(torch.float16, None), (torch.bfloat16, None), (torch.bfloat16, torch.float32), (torch.float32, None)],
    ids=str,
)
@pytest.mark.parametrize("m", (1, 16, 64, 65, 256, 1000, 16384))
def test_gpu_configs_fit_hopper_shared_memory(m, dtype, out_dtype):
    """The GPU tilings (not runnable here) are legal: tl.dot needs every block dim >= 16 and a
    power of two, and the operand ring buffers plus the epilogue tile fit in 227 KiB."""
    in_bytes = torch.empty((), dtype=dtype).element_size()
    out_bytes = torch.empty((), dtype=out_dtype or dtype).element_size()
    for (n, k), tma in itertools.product(((2560, 8192), (8192, 2048), (14336, 8192), (8192, 7168), (5120, 6400),
                                          (24, 40)), (False, True)):
        cfg = gemm.pick_config(m, n, k, dtype=dtype, out_dtype=out_dtype, num_sms=132, interpret=False, tma=tma)
        for block in (cfg.block_m, cfg.block_n, cfg.block_k, *([cfg.block_n2] if cfg.block_n2 else [])):
            assert block >= 16 and block & (block - 1) == 0, cfg
        operands = cfg.num_stages * (cfg.block_m + cfg.tile_n) * cfg.block_k * in_bytes
        epilogue = cfg.block_m * cfg.tile_n * out_bytes
        # TMA builds share the epilogue's buffer with the ring (128x256x64, 4 stages: 224 KiB
        # compiled, more than this sum): test_sm90_compile checks their real shared memory.
        assert cfg.tma or operands + epilogue <= 227 * 1024, (cfg, operands, epilogue)
        assert cfg.block_n2 == 0 or (tma and cfg.tma), cfg  # split tiles only with TMA loads


# ---- GPU only ---------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("kind", ("contiguous", "row_view", "col_view"))
@pytest.mark.parametrize("m", (1, 64, 1000))
def test_gpu_llama_shapes(m, kind, dtype):
    """Llama-70B-like per-rank shapes (N=1280, K=8192); views are shift block 1 of 4."""
    n, k = 1280, 8192
    gen = torch.Generator().manual_seed(m)
    a = _randn((m, k), dtype, gen)
    w = make_weight(kind, n, k, dtype, gen, blocks=4)
    out = run_and_check(a, w, name=f"{kind} C[{m},{n}] K={k} {dtype}")
    # Same-precision agreement with cuBLAS as a second opinion (both round the same fp32 sums).
    assert_close(out, gemm.matmul_reference(a, w), dtype=dtype, name="vs cuBLAS")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("flatten", (True, False), ids=("flat", "nested"))
@pytest.mark.parametrize("kind", ("contiguous", "row_view", "col_view"))
@pytest.mark.parametrize("m", (200, 1000))
def test_gpu_tma_mainloop(m, kind, flatten):
    """bf16 TMA tilings (flattened and nested tile loop, one or two column blocks per tile) on ragged
    Llama-sized shapes."""
    dtype = torch.bfloat16
    n, k = 1320, 8192
    gen = torch.Generator().manual_seed(m + flatten)
    a = _randn((m, k), dtype, gen)
    w = make_weight(kind, n, k, dtype, gen, blocks=4)
    for cfg in ((128, 128, 64, 8, 8, 4, True, flatten), (128, 256, 64, 8, 8, 3, True, flatten),
                (64, 256, 64, 8, 4, 4, True, flatten, 64)):  # split tiles: 320 columns, N ends inside block 2
        out = run_and_check(a, w, name=f"{kind} C[{m},{n}] K={k} {cfg}", config=cfg)
        assert_close(out, gemm.matmul_reference(a, w), dtype=dtype, name="vs cuBLAS")


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_replay():
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    a = _randn((64, 8192), dtype, gen)
    w = make_weight("col_view", 1280, 8192, dtype, gen, blocks=4)
    out = torch.empty((64, 1280), dtype=dtype, device=DEVICE)
    gemm.matmul(a, w, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm.matmul(a, w, out=out)
    a.copy_(_randn((64, 8192), dtype, gen))
    poison_(out)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, reference(a, w), dtype=dtype, name="graph replay")


@pytest.mark.gpu
@gpu
def test_gpu_torch_compile_inductor():
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(1)
    a = _randn((300, 4096), dtype, gen)
    w = make_weight("row_view", 1024, 4096, dtype, gen, blocks=4)
    compiled = torch.compile(lambda a, w: gemm.matmul(a, w) + 1.0, fullgraph=True)
    assert_close(compiled(a, w), reference(a, w) + 1.0, dtype=dtype, name="inductor")
