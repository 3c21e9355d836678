"""fusedpar.kernels.norm_linear (RMSNorm fused into the GEMM after it) vs a float64 definition.

The fused kernel scales the fp32 accumulator by each row's 1/rms instead of rounding the normalised
x first, so it differs from rms_norm_linear_reference (HF roundings) by rounding only: both are
compared against the exact float64 value with a tolerance per dtype, relative to the largest
|reference| element. CPU: the Triton interpreter (tests/conftest.py) in fp16 / fp32 on small ragged
shapes, every launch path (split-K or not, ragged or even K, clamped splits, BLOCK_M 16 / 32 / 64),
outputs pre-filled with NaN. GPU (`gpu` marker, torchrun, one GPU per rank): bf16 on the Llama-70B /
Qwen3-32B TP=4 decode shapes, CUDA-graph replay and bitwise determinism of the split-K reduction.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fusedpar.kernels import norm_linear
from fusedpar.kernels._host import cdiv, next_pow2
from fusedpar.kernels.norm_linear import (
    MAX_ROWS,
    NormLinearConfig,
    NormLinearWorkspace,
    pick_config,
    rms_norm_linear,
    rms_norm_linear_reference,
    use_fused,
)
from fusedpar.testing.gpu import local_device

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or norm_linear._INTERPRETED),
    reason="no CUDA and fusedpar.kernels.norm_linear was imported without TRITON_INTERPRET=1",
)

# max |result - float64 reference| / max |float64 reference|. The fused kernel feeds the MMA x * g
# rounded once (fp32 for fp16/fp32 inputs, bf16 for bf16) and rounds the output once; the HF-style
# reference rounds the normalised x twice. Measured worst cases (kernel / reference): fp32 2.9e-7 /
# 4.2e-7, fp16 4.3e-4 / 6.4e-4 (the CASES below), bf16 3.9e-3 / 4.4e-3 (decode shapes on an H200).
TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
CPU_DTYPES = (torch.float16, torch.float32)
EPS = 1e-6


def _inputs(m, n, k, dtype, device="cpu", *, seed, bias=False):
    """x ~ 3 N(0, 1) (a residual stream, never zero), g ~ 1 + 0.3 N(0, 1), W ~ N(0, 1/K), bias ~ 0.5 N(0, 1)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=gen, device=device)

    x = (3 * randn(m, k)).to(dtype)
    g = (1 + 0.3 * randn(k)).to(dtype)
    w = (randn(n, k) / math.sqrt(k)).to(dtype)
    b = (0.5 * randn(n)).to(dtype) if bias else None
    return x, g, w, b


def _reference64(x, g, w, bias=None, eps=EPS):
    """The exact value: F.linear((x * rsqrt(mean(x^2) + eps)) * g, W, bias), all in float64."""
    x64 = x.double()
    h = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * g.double()
    return F.linear(h, w.double(), None if bias is None else bias.double())


def _assert_close(got, want, dtype, what):
    """max |got - want| / max |want| < TOL[dtype], naming the worst (row, column) and its values."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    got64, want64 = got.detach().double().cpu(), want.detach().double().cpu()
    bad = ~torch.isfinite(got64)
    if bad.any():
        rows, cols = bad.nonzero(as_tuple=True)
        raise AssertionError(f"{what}: {int(bad.sum())} of {got64.numel()} non-finite values (unwritten poisoned "
                             f"elements?), first at [{int(rows[0])}, {int(cols[0])}]")
    diff = (got64 - want64).abs()
    err = (diff.max() / want64.abs().max().clamp_min(1e-30)).item()
    if not err < TOL[dtype]:
        r, c = divmod(int(diff.argmax()), want64.shape[1])
        raise AssertionError(f"{what}: rel error {err:.3g} >= {TOL[dtype]} ({dtype}); worst at [{r}, {c}]: got "
                             f"{got64[r, c].item()!r}, want {want64[r, c].item()!r} (max |want| "
                             f"{want64.abs().max().item():.4g}); {int((diff > TOL[dtype] * want64.abs().max()).sum())} "
                             f"elements over")


def _poisoned(m, n, dtype, device="cpu"):
    return torch.full((m, n), float("nan"), dtype=dtype, device=device)


def _launch_path(m, n, k, cfg):
    """(BLOCK_M, effective split, EVEN_K) of a launch, the way the launcher derives them."""
    cfg = cfg or pick_config(m, n, k, dtype=torch.float32, num_sms=16, interpret=norm_linear._INTERPRETED)
    k_per = norm_linear._k_per(k, cfg)
    split = cdiv(k, k_per)
    return max(16, next_pow2(m)), split, k_per * split == k


# ---- CPU (interpreter): fp16 / fp32 ---------------------------------------------------------------

CONFIGS = {
    "default": None,  # interpreter pick_config: 16 x 32 tiles, split 3 where K has >= 3 steps
    "unsplit": NormLinearConfig(block_n=16, block_k=32, split_k=1, num_warps=4, num_stages=1),
    "split2": NormLinearConfig(block_n=32, block_k=16, split_k=2, num_warps=4, num_stages=1),
    "split4": NormLinearConfig(block_n=16, block_k=32, split_k=4, num_warps=4, num_stages=1),
    "split16": NormLinearConfig(block_n=16, block_k=32, split_k=16, num_warps=4, num_stages=1),  # > K steps
}

CASES = [  # (M, N, K, config): N ragged against block_n, K ragged (EVEN_K off) or even, BLOCK_M 16 / 32 / 64
    (1, 37, 33, "default"),  # 2 K steps: no split; ragged K
    (3, 50, 100, "default"),  # asks 3, gets 2 ranges of 64: ragged
    (16, 37, 96, "default"),  # split 3 x 32: EVEN_K
    (17, 50, 96, "unsplit"),  # BLOCK_M 32, EVEN_K without split
    (33, 37, 100, "unsplit"),  # BLOCK_M 64, ragged K without split
    (17, 37, 33, "split2"),  # 32-column tiles, 16-deep steps, 2 ranges of 32: ragged
    (33, 50, 96, "split2"),  # 2 ranges of 48: EVEN_K
    (3, 50, 100, "split4"),  # 4 ranges of 32, the last one 4 deep
    (16, 37, 96, "split4"),  # clamped to 3 ranges: EVEN_K
    (1, 50, 96, "split16"),  # clamped to 3
    (33, 37, 33, "split16"),  # clamped to 2, ragged
]


def test_cases_cover_every_launch_path():
    paths = {_launch_path(m, n, k, CONFIGS[c]) for m, n, k, c in CASES}
    assert {bm for bm, _, _ in paths} == {16, 32, 64}
    assert {(split > 1, even) for _, split, even in paths} == {(False, False), (False, True), (True, False),
                                                              (True, True)}
    clamped = [(m, n, k) for m, n, k, c in CASES
               if CONFIGS[c] is not None and _launch_path(m, n, k, CONFIGS[c])[1] < CONFIGS[c].split_k]
    assert len(clamped) >= 2
    assert all(n % 16 for _, n, _, _ in CASES), "every N should leave a ragged column tile"


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("bias", (False, True), ids=("nobias", "bias"))
@pytest.mark.parametrize(("m", "n", "k", "config"), CASES)
def test_matches_float64_reference(m, n, k, config, bias, dtype):
    x, g, w, b = _inputs(m, n, k, dtype, seed=m * 10_000 + n * 100 + k + bias, bias=bias)
    out = _poisoned(m, n, dtype)
    got = rms_norm_linear(x, g, w, EPS, bias=b, config=CONFIGS[config], out=out)
    assert got is out
    want = _reference64(x, g, w, b)
    what = f"{dtype} [{m}, {k}] x [{n}, {k}]^T {config} bias={bias}"
    _assert_close(got, want, dtype, what)
    # The tolerance is one the two-step definition itself meets (else it is too tight to mean anything).
    _assert_close(rms_norm_linear_reference(x, g, w, EPS, bias=b), want, dtype, f"reference {what}")


def test_returns_new_tensor_without_out():
    x, g, w, _ = _inputs(5, 24, 64, torch.float32, seed=1)
    got = rms_norm_linear(x, g, w, 1e-5)
    assert got.shape == (5, 24) and got.dtype == torch.float32
    _assert_close(got, _reference64(x, g, w, eps=1e-5), torch.float32, "no out")


def test_eps_is_applied():
    """A tiny-norm row: eps dominates mean(x^2), so a kernel that drops or misplaces eps is far off."""
    x, g, w, _ = _inputs(3, 20, 64, torch.float32, seed=2)
    x[1] *= 1e-4
    for eps in (1e-6, 1e-2):
        _assert_close(rms_norm_linear(x, g, w, eps), _reference64(x, g, w, eps=eps), torch.float32, f"eps={eps}")


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("kind", ("col_view", "row_view", "transposed"))
def test_weight_views_match_contiguous(kind, dtype):
    m, n, k = 17, 37, 100
    x, g, w, b = _inputs(m, n, k, dtype, seed=3, bias=True)
    if kind == "col_view":  # row-parallel shift view: stride(0) = K + 12
        big = torch.randn(n, k + 12).to(dtype)
        big[:, 5 : 5 + k] = w
        view = big[:, 5 : 5 + k]
    elif kind == "row_view":  # column-parallel shift view: an offset into a taller matrix
        big = torch.randn(n + 7, k).to(dtype)
        big[3 : 3 + n] = w
        view = big[3 : 3 + n]
    else:  # stride (1, N)
        view = w.T.contiguous().T
    assert torch.equal(view, w) and (kind == "row_view" or not view.is_contiguous())
    for name in ("default", "unsplit"):
        cfg = CONFIGS[name]
        want = rms_norm_linear(x, g, w, EPS, bias=b, config=cfg, out=_poisoned(m, n, dtype))
        got = rms_norm_linear(x, g, view, EPS, bias=b, config=cfg, out=_poisoned(m, n, dtype))
        assert torch.equal(got, want), f"{kind} {name}: differs from the contiguous weight"
        _assert_close(got, _reference64(x, g, w, b), dtype, f"{kind} {name}")


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_workspace_reuse_leaves_counters_zero(dtype):
    """One for_shapes workspace serves repeated launches of any m' <= m at the default split; its
    partials are overwritten (stale NaN partials never leak) and its counters are 0 after each."""
    m, n, k = 17, 50, 96
    ws = NormLinearWorkspace.for_shapes(device="cpu", shapes=[(m, n, k)], dtype=dtype)
    assert not ws.counters.any()
    assert _launch_path(m, n, k, None)[1] == 3
    for i, rows in enumerate((17, 5, 17, 1)):
        ws.part.fill_(float("nan"))
        ws.part_ss.fill_(float("nan"))
        x, g, w, b = _inputs(rows, n, k, dtype, seed=100 + i, bias=i % 2 == 1)
        got = rms_norm_linear(x, g, w, EPS, bias=b, workspace=ws, out=_poisoned(rows, n, dtype))
        _assert_close(got, _reference64(x, g, w, b), dtype, f"call {i} ({rows} rows)")
        assert not ws.counters.any(), f"call {i}: counters left at {ws.counters.tolist()}"
        # Fixed-order reduction: the same bits as a launch that allocates its own scratch.
        assert torch.equal(got, rms_norm_linear(x, g, w, EPS, bias=b)), f"call {i}: workspace changed the bits"


def test_explicit_workspace_for_a_larger_split():
    m, n, k = 16, 37, 100
    cfg = CONFIGS["split4"]
    tiles = cdiv(n, cfg.block_n)
    ws = NormLinearWorkspace("cpu", part_elems=tiles * cfg.split_k * 16 * cfg.block_n, tiles=tiles)
    for i in range(3):
        x, g, w, _ = _inputs(m, n, k, torch.float32, seed=200 + i)
        got = rms_norm_linear(x, g, w, EPS, workspace=ws, config=cfg, out=_poisoned(m, n, torch.float32))
        _assert_close(got, _reference64(x, g, w), torch.float32, f"split4 call {i}")
        assert not ws.counters.any(), f"call {i}: counters left at {ws.counters.tolist()}"
        assert torch.equal(got, rms_norm_linear(x, g, w, EPS, config=cfg))


@pytest.mark.parametrize("config", ("default", "split4"))
def test_deterministic(config):
    x, g, w, b = _inputs(33, 50, 100, torch.float16, seed=5, bias=True)
    first = rms_norm_linear(x, g, w, EPS, bias=b, config=CONFIGS[config])
    second = rms_norm_linear(x, g, w, EPS, bias=b, config=CONFIGS[config])
    assert torch.equal(first, second)


def test_custom_op_matches_launcher():
    """torch.ops.fusedpar.rms_norm_linear (the torch.compile path) gives the launcher's bits."""
    x, g, w, b = _inputs(3, 37, 96, torch.float32, seed=6, bias=True)
    op = torch.ops.fusedpar.rms_norm_linear(x, g, w, b, EPS)
    assert torch.equal(op, rms_norm_linear(x, g, w, EPS, bias=b))


def test_rejects_bad_inputs():
    k, n = 32, 24
    x, g, w, b = _inputs(4, n, k, torch.float32, seed=7, bias=True)
    for rows in (0, MAX_ROWS + 1):
        with pytest.raises(ValueError, match=rf"{rows} rows.*1\.\.{MAX_ROWS}"):
            rms_norm_linear(torch.randn(rows, k), g, w, EPS)
    with pytest.raises(ValueError, match="2-D"):
        rms_norm_linear(x[0], g, w, EPS)
    with pytest.raises(ValueError, match="contiguous rows"):
        rms_norm_linear(torch.randn(4, 2 * k)[:, ::2], g, w, EPS)
    with pytest.raises(TypeError, match="share a dtype"):
        rms_norm_linear(x, g.half(), w, EPS)
    with pytest.raises(TypeError, match="share a dtype"):
        rms_norm_linear(x, g, w.half(), EPS)
    with pytest.raises(TypeError, match="share a dtype"):
        rms_norm_linear(x.double(), g.double(), w.double(), EPS)
    with pytest.raises(ValueError, match=rf"norm weight must be a contiguous \[{k}\]"):
        rms_norm_linear(x, g[:-1], w, EPS)
    with pytest.raises(ValueError, match=rf"weight must be \[N, {k}\]"):
        rms_norm_linear(x, g, w[:, :-1], EPS)
    with pytest.raises(ValueError, match=rf"bias must be a contiguous \[{n}\]"):
        rms_norm_linear(x, g, w, EPS, bias=b[:-1])
    with pytest.raises(ValueError, match=rf"bias must be a contiguous \[{n}\]"):
        rms_norm_linear(x, g, w, EPS, bias=b.half())
    with pytest.raises(ValueError, match=rf"out must be \[4, {n}\]"):
        rms_norm_linear(x, g, w, EPS, out=torch.empty(4, n + 1))
    with pytest.raises(ValueError, match=rf"out must be \[4, {n}\]"):
        rms_norm_linear(x, g, w, EPS, out=torch.empty(4, n, dtype=torch.float16))
    x4, g4, w4, _ = _inputs(4, n, 4 * k, torch.float32, seed=9)  # 4 K steps: split4 really splits
    small = NormLinearWorkspace("cpu", part_elems=16 * 16 * 4 * cdiv(n, 16) - 1, tiles=cdiv(n, 16))
    with pytest.raises(ValueError, match="workspace too small"):
        rms_norm_linear(x4, g4, w4, EPS, workspace=small, config=CONFIGS["split4"])
    with pytest.raises(ValueError, match="workspace too small"):
        rms_norm_linear(x4, g4, w4, EPS, workspace=NormLinearWorkspace("cpu", part_elems=1 << 16, tiles=1),
                        config=CONFIGS["split4"])
    assert not small.counters.any()
    with pytest.raises(ValueError, match="bad config"):
        rms_norm_linear(x, g, w, EPS, config=NormLinearConfig(block_n=16, block_k=32, split_k=0))


GPU_SHAPES = [  # (N, K): Llama-70B / Qwen3-32B TP=4 shards
    (2560, 8192),  # Llama-70B qkv
    (2560, 5120),  # Qwen3-32B qkv
    (14336, 8192),  # Llama-70B gate_up
    (12800, 5120),  # Qwen3-32B gate_up
]


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32), ids=str)
@pytest.mark.parametrize("m", (1, 8, 16, 64))
def test_gpu_configs_are_legal(m, dtype):
    """The H100/H200 tilings (not runnable here): power-of-two blocks >= 16, at most one wave of
    programs, no empty K range, and the operand stages fit 227 KiB of shared memory."""
    elem = dtype.itemsize
    block_m = max(16, next_pow2(m))
    for n, k in GPU_SHAPES:
        cfg = pick_config(m, n, k, dtype=dtype, num_sms=132, interpret=False)
        for block in (cfg.block_n, cfg.block_k):
            assert block >= 16 and block & (block - 1) == 0, (n, k, cfg)
        assert cfg.split_k >= 1 and cfg.num_stages >= 2, (n, k, cfg)
        assert cdiv(n, cfg.block_n) * cfg.split_k <= 132, (n, k, cfg)
        assert cfg.num_stages * (block_m + cfg.block_n) * cfg.block_k * elem <= 227 * 1024, (n, k, cfg)
        assert norm_linear._k_per(k, cfg) * (cfg.split_k - 1) < k, f"empty K range: {(n, k, cfg)}"


def test_interpreter_config():
    assert pick_config(3, 50, 96, dtype=torch.float16, num_sms=16, interpret=True).split_k == 3
    assert pick_config(3, 50, 64, dtype=torch.float16, num_sms=16, interpret=True).split_k == 1


def test_use_fused_is_off_on_cpu_and_for_fp16():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x, _, w, _ = _inputs(4, 16, 32, dtype, seed=8)
        assert not use_fused(x, w), f"CPU {dtype} must not take the fused path"
    if torch.cuda.is_available():
        dev = local_device()
        x, _, w, _ = _inputs(4, 16, 32, torch.float16, dev, seed=8)
        assert not use_fused(x, w)
        xb, wb = x.bfloat16(), w.bfloat16()
        assert use_fused(xb, wb)
        assert not use_fused(xb, w), "mixed dtypes"
        assert not use_fused(torch.zeros(norm_linear.ROUTE_MAX_ROWS + 1, 32, dtype=torch.bfloat16, device=dev), wb)


# ---- GPU: bf16 on the decode shapes ---------------------------------------------------------------


def _cuda_or_skip() -> torch.device:
    dev = local_device()
    if dev.type != "cuda":
        pytest.skip("needs CUDA")
    return dev


DECODE_SHAPES = [(1, 2560, 8192), (8, 2560, 5120), (16, 14336, 8192), (3, 12800, 5120), (64, 2560, 8192),
                 (5, 1000, 3000)]


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "n", "k"), DECODE_SHAPES)
def test_gpu_decode_shapes_bf16(m, n, k):
    dev = _cuda_or_skip()
    dtype = torch.bfloat16
    ws = NormLinearWorkspace.for_shapes(dev, [(m, n, k)], dtype)
    for bias in (False, True):
        x, g, w, b = _inputs(m, n, k, dtype, dev, seed=m + n + k + bias, bias=bias)
        out = _poisoned(m, n, dtype, dev)
        assert rms_norm_linear(x, g, w, EPS, bias=b, workspace=ws, out=out) is out
        want = _reference64(x, g, w, b)
        _assert_close(out, want, dtype, f"bf16 [{m}, {k}] x [{n}, {k}]^T bias={bias}")
        _assert_close(rms_norm_linear_reference(x, g, w, EPS, bias=b), want, dtype, f"reference [{m}, {n}, {k}]")
        assert not ws.counters.any(), f"counters left at {ws.counters.nonzero().flatten().tolist()}"


GPU_SPLITS = [  # explicit split-K tilings on the qkv shapes (pick_config may not split them on 132 SMs)
    (1, 2560, 8192, NormLinearConfig(block_n=64, block_k=256, split_k=3, num_stages=4)),
    (16, 2560, 5120, NormLinearConfig(block_n=64, block_k=256, split_k=3, num_stages=4)),
    (33, 2560, 8192, NormLinearConfig(block_n=64, block_k=128, split_k=5, num_stages=4)),  # ragged ranges
    (7, 1000, 3000, NormLinearConfig(block_n=32, block_k=128, split_k=8, num_stages=3)),  # ragged K
]


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "n", "k", "cfg"), GPU_SPLITS, ids=lambda v: str(v) if isinstance(v, int) else
                         f"s{v.split_k}")
def test_gpu_split_k_bf16_deterministic(m, n, k, cfg):
    dev = _cuda_or_skip()
    dtype = torch.bfloat16
    x, g, w, b = _inputs(m, n, k, dtype, dev, seed=m * k, bias=True)
    part, tiles = norm_linear._scratch(m, n, cfg)
    ws = NormLinearWorkspace(dev, part_elems=part, tiles=tiles)
    want = _reference64(x, g, w, b)
    first = rms_norm_linear(x, g, w, EPS, bias=b, workspace=ws, config=cfg, out=_poisoned(m, n, dtype, dev))
    _assert_close(first, want, dtype, f"bf16 [{m}, {n}, {k}] {cfg}")
    assert not ws.counters.any()
    for _ in range(3):
        again = rms_norm_linear(x, g, w, EPS, bias=b, workspace=ws, config=cfg, out=_poisoned(m, n, dtype, dev))
        assert torch.equal(again, first), "split-K reduction is not bitwise deterministic"
    assert not ws.counters.any()
    unsplit = NormLinearConfig(cfg.block_n, cfg.block_k, 1, cfg.num_warps, cfg.num_stages)
    _assert_close(rms_norm_linear(x, g, w, EPS, bias=b, config=unsplit), want, dtype, "unsplit")


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    """Three launches (two split-K ones sharing a workspace back to back, one default) captured once,
    replayed with fresh inputs in the static x: right results and zeroed counters after each replay."""
    dev = _cuda_or_skip()
    dtype = torch.bfloat16
    m, k = 8, 8192
    x, g, w_qkv, b = _inputs(m, 2560, k, dtype, dev, seed=11, bias=True)
    _, _, w_up, _ = _inputs(m, 14336, k, dtype, dev, seed=12)
    split = NormLinearConfig(block_n=64, block_k=256, split_k=3, num_stages=4)
    default_up = NormLinearWorkspace.for_shapes(dev, [(m, 14336, k)], dtype)  # in case it splits here
    part, tiles = norm_linear._scratch(m, 2560, split)
    ws = NormLinearWorkspace(dev, part_elems=max(part, default_up.part.numel()),
                             tiles=max(tiles, default_up.counters.numel()))
    outs = [torch.empty(m, n, dtype=dtype, device=dev) for n in (2560, 14336, 2560)]

    def step():
        rms_norm_linear(x, g, w_qkv, EPS, bias=b, workspace=ws, config=split, out=outs[0])
        rms_norm_linear(x, g, w_up, EPS, workspace=ws, out=outs[1])
        rms_norm_linear(x, g, w_qkv, EPS, workspace=ws, config=split, out=outs[2])

    side = torch.cuda.Stream(device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm up (compile) outside the capture
        step()
    torch.cuda.current_stream(dev).wait_stream(side)
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize(dev)
    for rep in range(2):
        x.copy_(_inputs(m, 16, k, dtype, dev, seed=20 + rep)[0])
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize(dev)
        wants = (_reference64(x, g, w_qkv, b), _reference64(x, g, w_up), _reference64(x, g, w_qkv))
        for i, (o, want) in enumerate(zip(outs, wants, strict=True)):
            _assert_close(o, want, dtype, f"replay {rep} call {i}")
        assert not ws.counters.any(), f"replay {rep}: counters left at {ws.counters.nonzero().flatten().tolist()}"
