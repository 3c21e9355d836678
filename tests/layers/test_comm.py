"""fusedpar.layers.comm on CPU (gloo): PlainComm's stages against the collectives they are made of,
FusedComm without workspaces falling back to them, and `select`."""

import pytest
import torch
import torch.nn.functional as F

from fusedpar.testing.dist import run_distributed
from tests.conftest import decode_gemm_rows


def _stages(rank, world, sp, tp, dtype):
    from fusedpar.collectives import ParallelContext, all_reduce_sum, head_to_seq_all_to_all, seq_to_head_all_to_all
    from fusedpar.kernels.reference import blocked_swiglu
    from fusedpar.layers import DecoderConfig
    from fusedpar.layers.comm import FusedComm, PlainComm, select
    from fusedpar.layouts import ParallelLayout
    from fusedpar.testing.scenarios import FallbackFusedComm

    ctx = ParallelContext(ParallelLayout(world, sp=sp, tp=tp))
    cfg = DecoderConfig(hidden_size=16, num_q_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=32)
    gen = torch.Generator().manual_seed(rank)  # different operands per rank
    plain = PlainComm(ctx)
    fused = FallbackFusedComm(ctx, cfg, max_tokens=8, dtype=dtype)  # no workspaces
    m, blk, d = 3, 16, 16
    h = torch.randn(m, d, generator=gen).to(dtype)
    x = torch.randn(m, d, generator=gen).to(dtype)
    w_qkv = torch.randn(sp * blk, d, generator=gen).to(dtype)
    bias = torch.randn(sp * blk, generator=gen).to(dtype)
    attn = torch.randn(sp * m, 8, generator=gen).to(dtype)
    w_o = torch.randn(d, sp * 8, generator=gen).to(dtype)
    gate_up = torch.randn(m, 2 * 8 * sp, generator=gen).to(dtype)
    w_down = torch.randn(d, 8 * sp, generator=gen).to(dtype)
    out = {}
    for name, comm in (("plain", plain), ("fused", fused)):
        assert comm.o_target("base", m) is None and not comm.fuses_residual(m, w_o, "shift")
        out[name] = (
            comm.qkv(h, w_qkv, "base", bias),
            comm.qkv(h, w_qkv[:blk], "shift", bias[:blk]),
            comm.o_proj(attn, w_o, "base", residual=x),
            comm.o_proj(attn[:m], w_o[:, :8], "shift"),
            comm.row_parallel(gate_up, w_down, "base", residual=x, swiglu_block=8),
        )
    want = (
        seq_to_head_all_to_all(F.linear(h, w_qkv, bias), ctx.sp),
        F.linear(h, w_qkv[:blk], bias[:blk]),
        x + all_reduce_sum(F.linear(head_to_seq_all_to_all(attn, ctx.sp), w_o), ctx.tp),
        all_reduce_sum(F.linear(attn[:m], w_o[:, :8]), ctx.shift),
        x + all_reduce_sum(F.linear(blocked_swiglu(gate_up, 8), w_down), ctx.tp),
    )
    for name, got in out.items():
        for i, (g, e) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(g, e), f"{name} stage {i}"
    assert select(h, None, fused, plain) is plain  # FusedComm takes CUDA tensors only
    assert not fused.should_use(h) and plain.should_use(h)
    with pytest.raises(ValueError, match="no communicator"):
        select(h, fused)
    with pytest.raises(ValueError, match="needs CUDA"):
        FusedComm(ctx, cfg, max_tokens=8, dtype=dtype)
    return True


@pytest.mark.parametrize(("sp", "tp"), [(2, 1), (1, 2)])
def test_plain_stages_are_the_collectives_and_fused_comm_falls_back_to_them(sp, tp):
    assert run_distributed(_stages, 2, sp, tp, torch.float32) == [True, True]


# ---- the decode GEMM's routes (one process: a group of one has no peer to reach) --------------------------


def _one_rank_fused_comm():
    """A FusedComm of a one-rank layout without workspaces, built without a process group: the state its
    stages read (the groups' sizes), so they run here on the Triton interpreter."""
    from types import SimpleNamespace

    from fusedpar.layers.comm import FusedComm, PlainComm
    from fusedpar.layouts import StepMode

    group = SimpleNamespace(size=1, rank=0)
    ctx = SimpleNamespace(sp=group, tp=group, shift=group, attention_group=lambda mode: group)
    comm = FusedComm.__new__(FusedComm)  # the state only: building one needs CUDA symmetric memory
    comm.ctx, comm.plain, comm.dtype = ctx, PlainComm(ctx), torch.bfloat16
    comm.qkv_ws = comm.o_ws = comm.tp_allreduce_ws = None
    comm.gemm_ar_ws = {StepMode.BASE: None, StepMode.SHIFT: None}
    return comm


@pytest.fixture
def skinny_calls(monkeypatch):
    """Records every gemv.skinny_matmul call (a's rows, w's shape, swiglu_block) and hands the kernel a
    NaN-filled output, so an element it never writes fails the comparison; the routing table routes every
    size the decode GEMM takes there."""
    from fusedpar.kernels import gemv
    from fusedpar.kernels.gemv.launch import out_columns
    from fusedpar.testing.numerics import poison_

    calls, real = [], gemv.skinny_matmul

    def poisoned(a, w, out=None, *, swiglu_block=0):
        calls.append((a.shape[0], tuple(w.shape), swiglu_block))
        if out is None:
            out = a.new_empty((a.shape[0], out_columns(w, swiglu_block)))
        return real(a, w, poison_(out), swiglu_block=swiglu_block)

    monkeypatch.setattr(gemv, "skinny_matmul", poisoned)
    with decode_gemm_rows(gemv.MAX_M):
        yield calls


def _operands(rows, dtype, seed, *, d=48, blocks=2, block=12):
    """Hidden states, a residual, qkv weight and bias, a blocked gate_up weight, a down weight (scaled to
    outputs of order 1), fresh per case."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    return dict(h=rand(rows, d), x=rand(rows, d), w_qkv=rand(40, d, scale=d ** -0.5), bias=rand(40),
                w_gate_up=rand(blocks * 2 * block, d, scale=d ** -0.5),
                w_down=rand(d, blocks * block, scale=(blocks * block) ** -0.5), block=block)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows", [1, 3, 17, 64])
def test_decode_sized_gemms_run_on_the_decode_gemm_and_match_the_plain_stages(rows, dtype, skinny_calls):
    """FusedComm's GEMMs with nothing to exchange (column_parallel with and without SwiGLU, qkv without the
    all-to-all, row_parallel over a group of one) on the decode GEMM, against PlainComm's stages (F.linear
    + blocked SwiGLU) within the dtype's rounding."""
    from fusedpar.kernels.reference import blocked_swiglu
    from fusedpar.testing.numerics import assert_close

    comm = _one_rank_fused_comm()
    o = _operands(rows, dtype, seed=rows * 10 + (dtype == torch.float16))
    h, x, block = o["h"], o["x"], o["block"]
    gate_up = F.linear(h.float(), o["w_gate_up"].float())
    act_ref = blocked_swiglu(gate_up.to(dtype), block)
    got = {
        "column_parallel": comm.column_parallel(h, o["w_gate_up"]),
        "column_parallel+swiglu": comm.column_parallel(h, o["w_gate_up"], swiglu_block=block),
        "qkv shift": comm.qkv(h, o["w_qkv"], "shift"),
        "qkv base, bias": comm.qkv(h, o["w_qkv"], "base", o["bias"]),
        "row_parallel": comm.row_parallel(act_ref, o["w_down"], "shift", residual=x),
        "row_parallel+swiglu": comm.row_parallel(gate_up.to(dtype), o["w_down"], "base", swiglu_block=block),
    }
    want = {
        "column_parallel": gate_up,
        "column_parallel+swiglu": blocked_swiglu(gate_up, block),
        "qkv shift": F.linear(h.float(), o["w_qkv"].float()),
        "qkv base, bias": F.linear(h.float(), o["w_qkv"].float(), o["bias"].float()),
        "row_parallel": x.float() + F.linear(act_ref.float(), o["w_down"].float()),
        "row_parallel+swiglu": F.linear(act_ref.float(), o["w_down"].float()),
    }
    for name, g in got.items():
        assert g.dtype == dtype, name
        assert_close(g, want[name], dtype=dtype, name=name)
    d, n_gu = h.shape[1], o["w_gate_up"].shape[0]
    assert skinny_calls == [(rows, (n_gu, d), 0), (rows, (n_gu, d), block), (rows, (40, d), 0), (rows, (40, d), 0),
                            (rows, (d, n_gu // 2), 0), (rows, (d, n_gu // 2), 0)]


def test_other_gemms_stay_on_the_plain_stages(skinny_calls):
    """More rows than the decode GEMM takes, fp32, FP8 weights and a group of more than one rank keep
    PlainComm's GEMMs: the same results bit for bit."""
    from types import SimpleNamespace

    from fusedpar.kernels.fp8 import FP8Scheme
    from fusedpar.kernels.gemv import MAX_M
    from fusedpar.layers.fp8_weights import FP8Weight

    comm = _one_rank_fused_comm()
    plain = comm.plain
    for rows, dtype in ((MAX_M + 1, torch.bfloat16), (3, torch.float32)):
        o = _operands(rows, dtype, seed=rows)
        h, x, block = o["h"], o["x"], o["block"]
        assert torch.equal(comm.column_parallel(h, o["w_gate_up"], swiglu_block=block),
                           plain.column_parallel(h, o["w_gate_up"], swiglu_block=block))
        assert torch.equal(comm.qkv(h, o["w_qkv"], "shift", o["bias"]), plain.qkv(h, o["w_qkv"], "shift", o["bias"]))
        act = plain.column_parallel(h, o["w_gate_up"], swiglu_block=block)
        assert torch.equal(comm.row_parallel(act, o["w_down"], "shift", residual=x),
                           plain.row_parallel(act, o["w_down"], "shift", residual=x))
    o = _operands(3, torch.bfloat16, seed=5)
    fp8 = FP8Weight.quantize(o["w_gate_up"].float(), FP8Scheme("channel"))
    assert torch.equal(comm.column_parallel(o["h"], fp8, swiglu_block=o["block"]),
                       plain.column_parallel(o["h"], fp8, swiglu_block=o["block"]))
    assert skinny_calls == []

    # a group of two: row_parallel reduces (no workspace here: PlainComm's reduce); the GEMMs with nothing to
    # exchange still route
    reduced = []
    comm.ctx = SimpleNamespace(sp=comm.ctx.sp, attention_group=lambda mode: SimpleNamespace(size=2))
    comm.plain = SimpleNamespace(row_parallel=lambda act, w, mode, residual=None: reduced.append(mode) or act)
    act = comm.column_parallel(o["h"], o["w_gate_up"], swiglu_block=o["block"])
    assert comm.qkv(o["h"], o["w_qkv"], "shift").shape == (3, 40) and len(skinny_calls) == 2
    assert comm.row_parallel(act, o["w_down"], "shift") is act and reduced == ["shift"]
    assert len(skinny_calls) == 2


def test_a_routing_entry_without_the_decode_gemm_measurement_keeps_every_gemm_on_the_plain_stages(monkeypatch):
    """decode_gemm_max_rows 0 (an entry of a GPU where perf/tools/bench_gemv.py has not shown the decode GEMM
    ahead of cuBLAS; CPU takes DEFAULT's) sends nothing to it; a limit routes up to that many rows."""
    from fusedpar.kernels import gemv, routing

    calls = []
    monkeypatch.setattr(gemv, "skinny_matmul", lambda a, w, out=None, *, swiglu_block=0: calls.append(a.shape[0]))
    comm = _one_rank_fused_comm()
    o = _operands(3, torch.bfloat16, seed=9)
    entry = routing.thresholds(o["h"].device, 1)
    plain = comm.plain
    with decode_gemm_rows(0):
        assert torch.equal(comm.column_parallel(o["h"], o["w_gate_up"], swiglu_block=o["block"]),
                           plain.column_parallel(o["h"], o["w_gate_up"], swiglu_block=o["block"]))
        assert torch.equal(comm.qkv(o["h"], o["w_qkv"], "shift"), plain.qkv(o["h"], o["w_qkv"], "shift"))
        act = plain.column_parallel(o["h"], o["w_gate_up"], swiglu_block=o["block"])
        assert torch.equal(comm.row_parallel(act, o["w_down"], "shift", residual=o["x"]),
                           plain.row_parallel(act, o["w_down"], "shift", residual=o["x"]))
    assert calls == []
    if entry.decode_gemm_max_rows == 0:  # the table as shipped for this device
        comm.column_parallel(o["h"], o["w_gate_up"])
        assert calls == []
    with decode_gemm_rows(2):
        comm.column_parallel(o["h"][:2], o["w_gate_up"])
        comm.column_parallel(o["h"], o["w_gate_up"])
    assert calls == [2]
