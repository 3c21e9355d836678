"""The fused layer path (ShiftParallelDecoderLayer.fused_fwd) on CPU: gloo processes, the Triton
attention on the interpreter, and the communicators that run on CPU: PlainComm, FusedComm without
workspaces (FallbackFusedComm: every stage falls back to its PlainComm), and a PlainComm whose base
mode takes FusedComm's scatter plan (o_target + o_proj_scattered).

It checks the layer's own fused-path logic, which the GPU tests (test_fused_gpu.py) can only
check under torchrun: the q/k/v bias, the scaled-RoPE cos/sin tables handed to the attention
kernel, the SwiGLU block width handed to the down projection and both residual branches around
the o projection, and base mode's two plans for the return all-to-all (a local attention output,
or the attention storing its rows through a ScatterOut), in base, shift and mixed steps against
the fp64 oracle. In fp16 it checks which GEMMs the layer hands to the decode GEMM
(fusedpar.kernels.gemv) and that the layer stays as accurate as on PlainComm.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from fusedpar.collectives import all_reduce_sum, head_to_seq_all_to_all
from fusedpar.layers import DecoderConfig
from fusedpar.layers.comm import FusedComm, PlainComm
from fusedpar.testing.dist import run_distributed
from fusedpar.testing.scenarios import FallbackFusedComm, Step, run_layer_scenario

# conftest sets TRITON_INTERPRET=1 when there is no CUDA; with CUDA the gloo ranks' CPU tensors
# cannot reach compiled Triton kernels (test_fused_gpu.py covers that machine)
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the fused layer path on CPU needs the Triton interpreter (TRITON_INTERPRET=1)")

REL_TOL = 1e-5  # fp32 (Triton attention on the interpreter, fp32 cos/sin tables) vs fp64; ~3e-7 seen

STEPS = [
    Step(((0, 7), (1, 4)), "base"),  # 11 tokens: SP=2 pads to 12
    Step(((0, 1), (1, 1)), "shift"),
    Step(((2, 5), (0, 2)), "base"),
    Step(((0, 1), (1, 1), (2, 1)), "shift"),
]


class ResidualInShiftComm(PlainComm):
    """PlainComm that reports a fused residual epilogue in shift mode, so shift steps take the layer's
    residual-in-o_proj branch and base steps the add + norm one."""

    def __init__(self, ctx, cfg):
        super().__init__(ctx)
        self.cfg = cfg

    def fuses_residual(self, rows, w, mode):
        return mode == "shift"


def _plain_fused_comm(ctx, cfg):
    return FallbackFusedComm(ctx, cfg, max_tokens=64, dtype=torch.float32)


class ScatteringOps(ResidualInShiftComm):
    """The same with FusedComm's default base-mode plan: the attention kernel stores its rows
    through a ScatterOut and o_proj_scattered GEMMs the staged rows. Processes share no memory
    here, so the attention stores every destination rank's share into a local part (NaN-poisoned:
    a row it fails to store stays NaN) and o_proj_scattered ships each part to its rank over gloo,
    then zero-fills the padding rows as fusedpar.kernels.ulysses.scattered_o_proj does."""

    def o_target(self, mode, rows):
        from fusedpar.kernels.attention import ScatterOut

        if mode != "base" or self.ctx.sp.size == 1:
            return None
        W, s = self.ctx.sp.size, self.ctx.sp.rank
        self.c = self.ctx.layout.head_placement(self.cfg.num_q_heads, self.cfg.num_kv_heads).q_heads_per_rank \
            * self.cfg.head_dim
        self.parts = torch.full((W, rows, W * self.c), float("nan"), dtype=torch.float32)
        ptrs = torch.tensor([self.parts[g].data_ptr() for g in range(W)], dtype=torch.int64)
        return ScatterOut(peer_ptrs=ptrs, local=self.parts[s], rows_per_rank=rows, col_offset=s * self.c)

    def o_proj_scattered(self, w, rows, num_tokens):
        W, s, c = self.ctx.sp.size, self.ctx.sp.rank, self.c
        sent = torch.cat([self.parts[g][:, s * c:(s + 1) * c] for g in range(W)])  # row g*m + r -> rank g
        staging = head_to_seq_all_to_all(sent, self.ctx.sp)
        staging[min(rows, max(0, num_tokens - s * rows)):] = 0.0
        return all_reduce_sum(F.linear(staging, w), self.ctx.tp)


def _run(rank, world, cfg, sp, tp, ops):
    from tests.conftest import _fix_interpreter_for_numpy_2_4

    _fix_interpreter_for_numpy_2_4()  # spawned ranks do not run conftest
    return run_layer_scenario(rank, world, cfg, sp, tp, STEPS, fused_ops=ops).to_dict()


TABLE = tuple(500.0 ** (-2 * i / 16) / (1 + i) for i in range(8))
BASE_CFG = dict(hidden_size=32, num_q_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=16, rope_theta=500.0)


@pytest.mark.parametrize("extra", [
    dict(qkv_bias=True, rope_inv_freq=TABLE, rope_attention_scaling=0.8),  # Qwen2 bias + yarn-like RoPE
    dict(qk_norm=True),  # plain RoPE from rope_theta (attention_step), no bias
], ids=["bias_rope_table", "plain"])
@pytest.mark.parametrize("ops", [_plain_fused_comm, ResidualInShiftComm, ScatteringOps],
                         ids=["fused_comm_plain", "local_attn_out", "scatter"])
def test_fused_layer_path_matches_oracle(extra, ops):
    cfg = DecoderConfig(**BASE_CFG, **extra)
    for r in run_distributed(_run, 2, cfg, 2, 1, ops):
        for i, (rec, step) in enumerate(zip(r["steps"], STEPS, strict=True)):
            assert rec["mode"] == step.mode
            assert rec["rel_error"] < REL_TOL, f"rank {r['rank']} step {i} ({rec['mode']}): {rec['rel_error']:.3g}"
        assert r["cache_rel_error"] < REL_TOL
        assert r["cache_rows_written"] == 2 * sum(q for s in STEPS for _, q in s.seqs)


def test_spin_timeouts_names_the_workspaces_whose_wait_gave_up():
    """FusedComm.spin_timeouts reads every workspace's STATUS counter (a bounded flag wait that gave up)."""
    from types import SimpleNamespace

    def ws(status):
        return SimpleNamespace(table=SimpleNamespace(status=lambda: status))

    fk = FusedComm.__new__(FusedComm)  # the state only: building one needs CUDA symmetric memory
    fk.qkv_ws, fk.o_ws, fk.tp_allreduce_ws = ws(0), ws(1), None
    fk.gemm_ar_ws = {"base": None, "shift": ws(1)}
    assert fk.spin_timeouts() == ["all_to_all_o_proj", "gemm_all_reduce[shift]"]
    fk.o_ws, fk.gemm_ar_ws = ws(0), {"base": ws(0), "shift": None}
    assert fk.spin_timeouts() == []


# ---- half precision: the decode-sized GEMMs on the decode GEMM ---------------------------------------------

HALF_REL_TOL = 5e-3  # fp16 layers vs the fp64 oracle


def _half_plain_comm(ctx, cfg):
    return PlainComm(ctx)


def _half_fused_comm(ctx, cfg):
    return FallbackFusedComm(ctx, cfg, max_tokens=64, dtype=torch.float16)


def _run_counting(rank, world, cfg, sp, tp, ops):
    """The scenario in fp16, with the number of gemv.skinny_matmul calls it made (the routing table routing
    every size the decode GEMM takes there)."""
    from tests.conftest import _fix_interpreter_for_numpy_2_4

    _fix_interpreter_for_numpy_2_4()  # spawned ranks do not run conftest
    from fusedpar.kernels import gemv

    calls, real = [], gemv.skinny_matmul

    def counted(a, w, out=None, *, swiglu_block=0):
        calls.append(swiglu_block)
        return real(a, w, out, swiglu_block=swiglu_block)

    from tests.conftest import decode_gemm_rows

    gemv.skinny_matmul = counted
    try:
        with decode_gemm_rows(gemv.MAX_M):
            res = run_layer_scenario(rank, world, cfg, sp, tp, STEPS, dtype=torch.float16, fused_ops=ops).to_dict()
    finally:
        gemv.skinny_matmul = real
    return res, calls


# swiglu_block of each decode-GEMM call of one layer and step, in call order: qkv, then o and down over a group
# of one, and gate_up with SwiGLU (the layer's block width: intermediate_size / (SP * TP))
@pytest.mark.parametrize(("sp", "tp", "per_layer_step"), [(1, 1, [0, 0, 16, 0]), (1, 2, [0, 8])],
                         ids=["one_rank", "tp2"])
def test_half_precision_decode_gemms_take_the_decode_gemm_and_match_the_plain_path(sp, tp, per_layer_step):
    """fp16 layers on a FusedComm without workspaces: the qkv and gate_up GEMMs (SwiGLU in the epilogue, the
    layer's block width) and, over a group of one, the o and down GEMMs run on the decode GEMM; the layer
    output is as accurate against the fp64 oracle as the PlainComm layer path's."""
    cfg = DecoderConfig(**BASE_CFG, qkv_bias=True)
    world = sp * tp
    plain = run_distributed(_run_counting, world, cfg, sp, tp, _half_plain_comm)
    fused = run_distributed(_run_counting, world, cfg, sp, tp, _half_fused_comm)
    for (f, f_calls), (p, p_calls) in zip(fused, plain, strict=True):
        assert p_calls == []
        assert f_calls == per_layer_step * 2 * len(STEPS), f_calls  # two layers
        for i, (rf, rp) in enumerate(zip(f["steps"], p["steps"], strict=True)):
            where = f"rank {f['rank']} step {i} ({rf['mode']})"
            assert rf["rel_error"] < HALF_REL_TOL, f"{where}: {rf['rel_error']:.3g}"
            assert rf["rel_error"] < 2 * rp["rel_error"] + 1e-3, \
                f"{where}: {rf['rel_error']:.3g} vs plain {rp['rel_error']:.3g}"
        assert f["cache_rel_error"] < HALF_REL_TOL
