"""fusedpar.layers.comm on CPU (gloo): PlainComm's stages against the collectives they are made of,
FusedComm without workspaces falling back to them, and `select`."""

import pytest
import torch
import torch.nn.functional as F

from fusedpar.testing.dist import run_distributed


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
