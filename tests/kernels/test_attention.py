"""Tests of the paged flash-attention kernels, fusedpar.kernels.attention.

Without a GPU they run on the Triton interpreter (conftest.py sets TRITON_INTERPRET=1) in fp16 and
fp32; bf16, head_dim 128 and Llama-70B per-rank shapes are `gpu` tests.

The oracle is float64 and built from the reference layer's own math (fusedpar.kernels.reference:
rms_norm, rope_cos_sin/apply_rope, causal_gqa_attention), with one deliberate rounding step: new
k/v are rounded to the cache dtype when stored and q to the model dtype before the products, as
both the kernel and ShiftParallelDecoderLayer._attention do. Every run poisons what must not be
touched: padding rows of qkv, the output buffer, every cache slot that holds neither a cached
context token nor a new token, and unused block-table entries are NaN (or point at NaN blocks),
so a stray read or a forgotten write fails; cache slots outside `slots` must stay bit-identical.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusedpar.kernels import attention
from fusedpar.kernels._host import INTERPRETED
from fusedpar.kernels.attention import AttentionConfig, AttentionOptions, paged_attention
from fusedpar.kernels.attention import config as attention_config
from fusedpar.kernels.attention import launch as attention_launch
from fusedpar.kernels.attention import ops as attention_ops
from fusedpar.kernels.reference import apply_rope, causal_gqa_attention, rms_norm, rope_cos_sin
from fusedpar.layers.attention import attention_step, step_metadata
from fusedpar.layers.decoder import StepState
from fusedpar.layers.kv_cache import PagedKVCache
from fusedpar.layers.step_plan import StepBatch, padded_token_count
from fusedpar.testing.gpu import local_device
from fusedpar.testing.numerics import assert_close, poison_
from tests.profile import examples

HAS_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRETED),
    reason="no CUDA and fusedpar.kernels.attention was imported without TRITON_INTERPRET=1",
)


DEVICE = local_device()  # under torchrun each rank takes its own GPU
CPU_DTYPES = (torch.float16, torch.float32)
EPS = 1e-6
THETA = 10000.0


def out_tolerance(dtype: torch.dtype) -> dict:
    """Output tolerance vs the float64 oracle.

    Half precision: P is rounded to the model dtype before the P @ V product (FlashAttention's
    choice, and the reference's probs.to(v.dtype)), an error of up to one unit of rounding of each
    probability times |v| (|v| reaches ~4 for N(0, 1) data): 2 units of fp16 / 2 of bf16.
    fp32: RoPE angles are position * inv_freq in fp32 (as vLLM's cos/sin cache), ~1 ulp of the angle.
    """
    return {
        torch.float16: dict(atol=2e-3, rtol=2e-3),
        torch.float32: dict(atol=2e-5, rtol=2e-5),
        torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
    }[dtype]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern view (NaN-exact comparisons)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


# ---- one attention call: inputs, oracle, checks ---------------------------------------------------


@dataclass
class Case:
    seqs: list[tuple[int, int]]  # (new tokens, cached context) per sequence
    nq: int
    nkv: int
    hd: int
    page: int
    dtype: torch.dtype
    qk_norm: bool = False
    rope: str | None = "theta"  # "theta" | "tables" | None
    pad_rows: int = 0
    view: bool = False  # qkv / out are views into larger buffers (row stride > width, column offset)
    seed: int = 0
    device: torch.device = DEVICE

    @property
    def num_tokens(self) -> int:
        return sum(q for q, _ in self.seqs)


class Run:
    """Builds the inputs of one paged_attention call on a scattered paged cache, and its oracle."""

    def __init__(self, c: Case):
        self.c = c
        g = torch.Generator().manual_seed(c.seed)
        dev, dt = c.device, c.dtype
        n, rows = c.num_tokens, c.num_tokens + c.pad_rows
        need = [-(-(q + ctx) // c.page) for q, ctx in c.seqs]
        spare = 2
        num_blocks = sum(need) + spare
        perm = torch.randperm(num_blocks, generator=g)  # scattered, shuffled physical blocks
        self.tables, off = [], 0
        for k in need:
            self.tables.append(perm[off : off + k])
            off += k
        nan_block = int(perm[-1])  # a spare block, all NaN: unused table entries point at it
        bt = torch.full((len(c.seqs), max(need) + 1), nan_block, dtype=torch.int32)
        for i, t in enumerate(self.tables):
            bt[i, : len(t)] = t.to(torch.int32)

        shape = (num_blocks, c.page, c.nkv, c.hd)
        k_cache = torch.randn(shape, generator=g)
        v_cache = torch.randn(shape, generator=g)
        live = torch.zeros(num_blocks * c.page, dtype=torch.bool)  # slots holding cached context
        for t, (_, ctx) in zip(self.tables, c.seqs, strict=True):
            live[self._slots_of(t, 0, ctx)] = True
        for cache in (k_cache, v_cache):
            cache.view(-1, c.nkv, c.hd)[~live] = float("nan")
        self.k_cache, self.v_cache = k_cache.to(dev, dt), v_cache.to(dev, dt)
        self.k_before, self.v_before = self.k_cache.clone(), self.v_cache.clone()

        width = (c.nq + 2 * c.nkv) * c.hd
        qkv = torch.randn((rows, width), generator=g)
        qkv[n:] = float("nan")  # padding rows: must never be read
        if c.view:  # a window of a larger receive buffer: row stride 2*width+8, column offset 8
            big = torch.full((rows + 1, 2 * width + 8), float("nan"))
            big[1:, 8 : 8 + width] = qkv
            self.qkv = big.to(dev, dt)[1:, 8 : 8 + width]
            self.out_big = poison_(torch.empty((rows + 2, 3 * c.nq * c.hd), device=dev, dtype=dt))
            self.out = self.out_big[1 : rows + 1, c.nq * c.hd : 2 * c.nq * c.hd]
        else:
            self.qkv = qkv.to(dev, dt)
            self.out = poison_(torch.empty((rows, c.nq * c.hd), device=dev, dtype=dt))
        self.q_norm = (1 + 0.2 * torch.randn(c.hd, generator=g)).to(dev, dt) if c.qk_norm else None
        self.k_norm = (1 + 0.2 * torch.randn(c.hd, generator=g)).to(dev, dt) if c.qk_norm else None

        q_lens = [q for q, _ in c.seqs]
        self.cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        self.ctx = torch.tensor([ctx for _, ctx in c.seqs], dtype=torch.int32, device=dev)
        self.block_tables = bt.to(dev)
        self.positions = torch.cat([torch.arange(ctx, ctx + q) for q, ctx in c.seqs]).to(dev)
        self.slots = torch.cat(
            [self._slots_of(t, ctx, ctx + q) for t, (q, ctx) in zip(self.tables, c.seqs, strict=True)]
        ).to(dev)
        self.cos = self.sin = None
        if c.rope == "tables":  # fp32 tables with NaN rows for the padding tokens
            cos, sin = rope_cos_sin(self.positions, c.hd, THETA, torch.float32)
            pad = torch.full((c.pad_rows, c.hd), float("nan"), device=dev)
            self.cos, self.sin = torch.cat((cos, pad)), torch.cat((sin, pad))

    def _slots_of(self, table: torch.Tensor, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        return table[pos // self.c.page] * self.c.page + pos % self.c.page

    def launch(self, **overrides) -> torch.Tensor:
        c = self.c
        kwargs = dict(
            num_tokens=c.num_tokens,
            num_q_heads=c.nq,
            cu_seqlens_q=self.cu,
            context_lens=self.ctx,
            block_tables=self.block_tables,
            k_cache=self.k_cache,
            v_cache=self.v_cache,
            slots=self.slots,
            positions=self.positions,
            q_norm=self.q_norm,
            k_norm=self.k_norm,
            eps=EPS,
            rope_theta=THETA if c.rope == "theta" else None,
            rope_cos=self.cos,
            rope_sin=self.sin,
            out=self.out,
        )
        config = overrides.pop("config", None)
        if config is not None:
            kwargs["options"] = AttentionOptions(config=config)
        kwargs.update(overrides)
        return paged_attention(self.qkv, **kwargs)

    def oracle(self):
        """(out [rows, nq*hd] fp64 with zero padding rows, expected k_cache, expected v_cache)."""
        c = self.c
        n, hd = c.num_tokens, c.hd
        x = self.qkv[:n].double()
        q, k, v = x.split([c.nq * hd, c.nkv * hd, c.nkv * hd], dim=1)
        q, k, v = q.reshape(n, c.nq, hd), k.reshape(n, c.nkv, hd), v.reshape(n, c.nkv, hd)
        if c.qk_norm:
            q, k = rms_norm(q, self.q_norm.double(), EPS), rms_norm(k, self.k_norm.double(), EPS)
        if c.rope is not None:
            if c.rope == "theta":
                cos, sin = rope_cos_sin(self.positions, hd, THETA, torch.float64)
            else:
                cos, sin = self.cos[:n].double(), self.sin[:n].double()
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_exp, v_exp = self.k_before.clone(), self.v_before.clone()
        k_exp.view(-1, c.nkv, hd)[self.slots] = k.to(c.dtype)
        v_exp.view(-1, c.nkv, hd)[self.slots] = v.to(c.dtype)
        q = q.to(c.dtype).double()
        kv_index = torch.arange(c.nq, device=c.device) // (c.nq // c.nkv)
        out = torch.zeros((n + c.pad_rows, c.nq, hd), dtype=torch.float64, device=c.device)
        start = 0
        for t, (ql, ctx) in zip(self.tables, c.seqs, strict=True):
            rows = self._slots_of(t, 0, ctx + ql).to(c.device)
            kc = k_exp.view(-1, c.nkv, hd)[rows].double()
            vc = v_exp.view(-1, c.nkv, hd)[rows].double()
            out[start : start + ql] = causal_gqa_attention(q[start : start + ql], kc, vc, kv_index, hd**-0.5)
            start += ql
        return out.reshape(n + c.pad_rows, c.nq * hd), k_exp, v_exp

    def check(self, out: torch.Tensor, *, name: str = "") -> None:
        c = self.c
        n = c.num_tokens
        ref, k_exp, v_exp = self.oracle()
        assert out.data_ptr() == self.out.data_ptr()
        tag = f"{name} {c}"
        assert_close(out[:n], ref[:n], dtype=c.dtype, name=f"attention {tag}", **out_tolerance(c.dtype))
        assert (out[n:] == 0).all(), f"padding rows of out must be zero: {tag}"
        if c.view:  # nothing written outside the out window
            outside = torch.ones(self.out_big.shape, dtype=torch.bool, device=c.device)
            outside[1 : n + c.pad_rows + 1, c.nq * c.hd : 2 * c.nq * c.hd] = False
            assert self.out_big[outside].isnan().all(), f"wrote outside the out view: {tag}"
        written = torch.zeros(self.k_cache.numel() // (c.nkv * c.hd), dtype=torch.bool, device=c.device)
        written[self.slots] = True
        for name_, got, exp, before in (
            ("k", self.k_cache, k_exp, self.k_before),
            ("v", self.v_cache, v_exp, self.v_before),
        ):
            g2, e2, b2 = (t.view(-1, c.nkv, c.hd) for t in (got, exp, before))
            assert torch.equal(_bits(g2[~written]), _bits(b2[~written])), f"{name_} cache changed outside slots: {tag}"
            # fp32 transform vs fp64 oracle may round the stored k one unit differently.
            assert_close(g2[written], e2[written], dtype=c.dtype, name=f"{name_} cache {tag}")


def run_case(case: Case, config: AttentionConfig | None = None, name: str = "") -> Run:
    r = Run(case)
    out = r.launch(config=config)
    r.check(out, name=name)
    return r


def _random_seqs(gen: torch.Generator, count: int, max_q: int = 40, max_ctx: int = 40) -> list[tuple[int, int]]:
    q = torch.randint(1, max_q + 1, (count,), generator=gen).tolist()
    ctx = torch.randint(0, max_ctx + 1, (count,), generator=gen).tolist()
    return list(zip(q, ctx, strict=True))


# ---- CPU (interpreter) and GPU: correctness --------------------------------------------------------

GQA = [(4, 4), (4, 2), (8, 2), (4, 1)]  # (nq, nkv): G = 1, 2, 4, and kv replication (nkv = 1)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("hd", [16, 32])
@pytest.mark.parametrize(("nq", "nkv"), GQA, ids=lambda v: str(v))
def test_varlen_prefill_with_context(nq, nkv, hd, dtype):
    """Mixed batch: fresh prefills, chunks continuing a cached context, and decodes, odd lengths."""
    gen = torch.Generator().manual_seed(nq * 100 + nkv * 10 + hd)
    seqs = [(1, 9), *_random_seqs(gen, 3), (1, 0)]
    run_case(Case(seqs, nq, nkv, hd, page=4, dtype=dtype, pad_rows=3, seed=hd + nq))


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize(("nq", "nkv", "page"), [(4, 2, 4), (8, 2, 16), (4, 1, 8), (2, 2, 5)])
def test_decode_scattered_cache(nq, nkv, page, dtype):
    """One new token per sequence against long, scattered contexts; the heuristic splits the keys."""
    gen = torch.Generator().manual_seed(page)
    seqs = [(1, int(c)) for c in torch.randint(1, 90, (5,), generator=gen)]
    r = run_case(Case(seqs, nq, nkv, 16, page=page, dtype=dtype, seed=page))
    assert attention.pick_config(
        head_dim=16, group=nq // nkv, num_seqs=5, num_kv_heads=nkv, max_query_len=1,
        max_kv_len=max(c for _, c in seqs) + 1, dtype=dtype, num_sms=attention_config.ATTENTION_INTERPRETER_NUM_SMS,
        interpret=True,
    ).num_splits > 1, "the interpreter heuristic should exercise split-KV here"
    del r


@pytest.mark.parametrize(
    "config",
    [
        AttentionConfig(16, 16, 1, num_splits=1),  # no split
        AttentionConfig(16, 16, 1, num_splits=3),  # 3 splits: the combine kernel
        AttentionConfig(32, 32, 1, num_splits=7),  # more splits than key tiles: empty splits
        AttentionConfig(16, 16, 4, num_splits=2),  # prefill tiles + split (mixed batch)
        AttentionConfig(64, 16, 16, num_splits=1),  # big q tiles: block_q * G < block_m rows
        # The same without page_prefetch (the plain loops, kept for A/B measurements).
        AttentionConfig(16, 16, 1, num_splits=1, page_prefetch=False),
        AttentionConfig(16, 16, 1, num_splits=3, page_prefetch=False),
        AttentionConfig(32, 32, 1, num_splits=7, page_prefetch=False),
        AttentionConfig(16, 16, 4, num_splits=2, page_prefetch=False),
    ],
    ids=lambda c: f"m{c.block_m}n{c.block_n}q{c.block_q}s{c.num_splits}{'' if c.page_prefetch else '-plain_loops'}",
)
def test_explicit_tilings_and_splits(config):
    if HAS_CUDA:
        pytest.skip("explicit tilings are an interpreter check of the schedule")
    seqs = [(1, 50), (3, 17), (1, 0), (12, 30)] if config.block_q > 1 else [(1, 50), (1, 17), (1, 0)]
    run_case(Case(seqs, 8, 2, 16, page=8, dtype=torch.float16, pad_rows=1, seed=config.num_splits), config=config)


@pytest.mark.parametrize("page_prefetch", [False, True], ids=["attend_tiles", "page_prefetch"])
def test_underestimated_max_kv_len_is_still_correct(page_prefetch):
    """max_kv_len only shapes the split-KV schedule: the last split runs to each sequence's end."""
    if HAS_CUDA:
        pytest.skip("explicit tilings are an interpreter check of the schedule")
    r = Run(Case([(1, 70), (1, 33), (1, 5)], 4, 2, 16, page=4, dtype=torch.float32, seed=10))
    cfg = AttentionConfig(16, 16, 1, num_splits=3, page_prefetch=page_prefetch)
    out = r.launch(config=cfg, max_kv_len=20, max_query_len=1)
    r.check(out)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("rope", ["theta", "tables", None])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_qk_norm_and_rope_modes(qk_norm, rope, dtype):
    seqs = [(9, 0), (1, 21), (5, 4)]
    run_case(Case(seqs, 4, 2, 32, page=4, dtype=dtype, qk_norm=qk_norm, rope=rope, pad_rows=2, seed=3))


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_receive_buffer_views_and_padding(dtype):
    """qkv is a window of a larger receive buffer and out a window of a larger send buffer."""
    run_case(Case([(7, 3), (1, 12), (13, 0)], 8, 2, 16, page=4, dtype=dtype, qk_norm=True, pad_rows=5,
                  view=True, seed=4))


def test_head_dim_64():
    run_case(Case([(11, 6), (1, 33)], 4, 2, 64, page=16, dtype=torch.float16, qk_norm=True, pad_rows=1, seed=5))


def test_negative_slot_skips_the_cache_write():
    """slot < 0 marks a non-token (CUDA-graph padding of a decode batch): no cache write."""
    r = Run(Case([(1, 10), (1, 5)], 4, 2, 16, page=4, dtype=torch.float32, seed=6))
    slots = r.slots.clone()
    skipped = int(slots[1])
    slots[1] = -1
    r.launch(slots=slots)
    flat_k, flat_before = r.k_cache.view(-1, 2, 16), r.k_before.view(-1, 2, 16)
    assert torch.equal(_bits(flat_k[skipped]), _bits(flat_before[skipped]))
    assert not torch.equal(_bits(flat_k[int(slots[0])]), _bits(flat_before[int(slots[0])]))


def test_write_kv_false_reads_what_an_earlier_call_wrote():
    r = Run(Case([(6, 2), (1, 9)], 4, 2, 16, page=4, dtype=torch.float32, qk_norm=True, seed=7))
    first = r.launch().clone()
    second = r.launch(write_kv=False, slots=None, out=None)
    assert torch.equal(first, second)


def test_default_out_and_inferred_bounds():
    """No out, no max_*_len: a new contiguous output, bounds read from the metadata (one sync)."""
    r = Run(Case([(5, 1), (1, 3)], 4, 1, 16, page=4, dtype=torch.float32, pad_rows=2, seed=8))
    out = r.launch(out=None)
    assert out.shape == r.out.shape and out.is_contiguous()
    r.out = out
    r.check(out)


# ---- pre-rotated q (AttentionConfig.prerotate_q) ----------------------------------------------------


class _LaunchSpy:
    """Stands in for a Triton kernel object: records each launch's keyword (constexpr) arguments, then
    launches the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.calls, self.tensor_args = kernel, [], []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append(kwargs)
            # shapes and dtypes only: holding the tensors would keep the launcher's scratch alive
            self.tensor_args.append([(a.shape, a.dtype) if isinstance(a, torch.Tensor) else None for a in args])
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.fixture
def spies(monkeypatch):
    """(write kernel spy, attention kernel spy): which path each launch took."""
    write, attend = _LaunchSpy(attention_launch._write_kv_kernel), _LaunchSpy(attention_launch._attention_kernel)
    monkeypatch.setattr(attention_launch, "_write_kv_kernel", write)
    monkeypatch.setattr(attention_launch, "_attention_kernel", attend)
    return write, attend


@pytest.mark.parametrize("page_prefetch", [False, True], ids=["attend_tiles", "page_prefetch"])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize(("qk_norm", "rope", "splits"), [(True, "theta", 3), (False, "tables", 1), (True, None, 7)])
def test_decode_writes_the_new_kv_inside_the_attention_launch(qk_norm, rope, splits, dtype, page_prefetch, spies):
    """Pure decode batch: no write kernel; the attention program whose key range holds the new position
    stores the normed/roped k and raw v and attends to them from registers. Output and cache match the
    oracle for 1, 3 (combine) and 7 (more splits than key tiles: empty splits) key ranges."""
    if HAS_CUDA:
        pytest.skip("explicit tilings are an interpreter check of the schedule")
    write, attend = spies
    seqs = [(1, 50), (1, 17), (1, 0), (1, 31)]  # context 0: the new key is the only key
    r = Run(Case(seqs, 8, 2, 16, page=8, dtype=dtype, qk_norm=qk_norm, rope=rope, pad_rows=1, seed=splits))
    out = r.launch(config=AttentionConfig(16, 16, 1, num_splits=splits, page_prefetch=page_prefetch))
    r.check(out)
    assert write.calls == [], "decode must not launch the write kernel"
    assert attend.calls[-1]["WRITE_NEW_KV"] and attend.calls[-1]["HAS_K_NORM"] == qk_norm
    assert attend.calls[-1]["PAGE_PREFETCH"] is page_prefetch
    # A prefill row in the batch (or write_kv=False) keeps the write kernel.
    r2 = Run(Case([(1, 50), (3, 17)], 8, 2, 16, page=8, dtype=dtype, seed=1))
    r2.check(r2.launch(config=AttentionConfig(16, 16, 4, num_splits=2)))
    assert len(write.calls) == 1 and not attend.calls[-1]["WRITE_NEW_KV"]


@pytest.mark.parametrize("page_prefetch", [False, True], ids=["attend_tiles", "page_prefetch"])
def test_decode_above_the_fused_write_limit_keeps_the_write_kernel(page_prefetch, spies):
    """More than FUSED_WRITE_MAX_SEQS decode sequences: the separate write kernel (measured faster there).
    The attention launch then reads the new key from the cache (the decode loop's range includes it)."""
    if HAS_CUDA:
        pytest.skip("explicit tilings are an interpreter check of the schedule")
    write, attend = spies
    n = attention.FUSED_WRITE_MAX_SEQS
    for seqs, fused in ((n, True), (n + 1, False)):
        r = Run(Case([(1, 3 + 5 * i) for i in range(seqs)], 4, 2, 16, page=4, dtype=torch.float32, seed=seqs))
        r.check(r.launch(config=AttentionConfig(16, 16, 1, num_splits=2, page_prefetch=page_prefetch)))
        assert attend.calls[-1]["WRITE_NEW_KV"] is fused and (len(write.calls) == 1) is not fused
        write.calls.clear()


def test_decode_negative_slot_still_attends_to_its_own_key():
    """slot < 0 (a CUDA-graph padding row): nothing is stored, but the row's output still uses its own
    new key and value (from registers), so it equals the oracle rather than reading a stale slot."""
    if HAS_CUDA:
        pytest.skip("explicit tilings are an interpreter check of the schedule")
    r = Run(Case([(1, 10), (1, 5), (1, 23)], 4, 2, 16, page=4, dtype=torch.float32, qk_norm=True, seed=16))
    ref, _, _ = r.oracle()
    slots = r.slots.clone()
    skipped = int(slots[1])
    slots[1] = -1
    out = r.launch(slots=slots, config=AttentionConfig(16, 16, 1, num_splits=2))
    n = r.c.num_tokens
    assert_close(out[:n], ref[:n], dtype=r.c.dtype, name="decode with a negative slot", **out_tolerance(r.c.dtype))
    flat_k, flat_before = r.k_cache.view(-1, 2, 16), r.k_before.view(-1, 2, 16)
    assert torch.equal(_bits(flat_k[skipped]), _bits(flat_before[skipped]))


def test_rope_theta_refuses_steps_past_its_angle_range():
    """rope_theta's fp32 angle reduction is exact only below ROPE_THETA_MAX_KV_LEN positions (a probe
    measured 7e-2 abs error in the cached keys at position 1M): a step whose max_kv_len reaches past
    it is refused before anything runs, and the same step with cos/sin tables runs."""
    r = Run(Case([(3, 5), (1, 9)], 4, 2, 16, page=4, dtype=torch.float32, seed=21))
    too_far = attention.ROPE_THETA_MAX_KV_LEN + 1
    with pytest.raises(ValueError, match=f"accurate for positions below {attention.ROPE_THETA_MAX_KV_LEN}.*"
                                         f"max_kv_len={too_far}: pass rope_cos/rope_sin tables"):
        r.launch(max_kv_len=too_far)
    assert torch.equal(_bits(r.k_cache), _bits(r.k_before)) and torch.equal(_bits(r.v_cache), _bits(r.v_before))
    t = Run(Case([(3, 5), (1, 9)], 4, 2, 16, page=4, dtype=torch.float32, rope="tables", seed=21))
    ref, _, _ = t.oracle()
    out = t.launch(max_kv_len=too_far, config=AttentionConfig(16, 16, 1, num_splits=1))
    n = t.c.num_tokens
    assert_close(out[:n], ref[:n], dtype=t.c.dtype, name="tables past the theta range", **out_tolerance(t.c.dtype))


def _prefill_config(group: int, prerotate: bool, **kw) -> AttentionConfig:
    """The interpreter's prefill tiling with prerotate_q set explicitly."""
    return AttentionConfig(32, 16, 32 // group, 4, 1, prerotate_q=prerotate, **kw)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize(("nq", "group"), [(8, 4), (6, 3)], ids=["G4_per_token_q", "G3_per_row_q"])
@pytest.mark.parametrize(
    ("qk_norm", "rope"), [(True, "theta"), (True, "tables"), (False, "theta"), (True, None), (False, None)]
)
def test_prerotated_q_is_bit_identical_to_in_kernel_q(qk_norm, rope, nq, group, dtype, spies):
    """Varlen prefill with cached context (and a decode row): q normed/roped by the write kernel into a
    cache-dtype scratch vs in the attention prologue. Both match the oracle, and they agree bit for bit
    (output and cache): each rounds the fp32 transform of q to the cache dtype before the dot. Without
    RoPE and q norm the flag changes nothing (no scratch, no q work in the write kernel).
    The in-kernel prologue has two forms: a power-of-two G loads the tile as [tokens, G, hd] and
    evaluates each token's cos/sin once (Q_BY_TOKEN); any other G transforms it row by row."""
    if HAS_CUDA:
        pytest.skip("bit identity is an interpreter check (GPU reductions may order the RMSNorm sum differently)")
    write, attend = spies
    case = Case([(9, 0), (1, 21), (13, 7), (6, 4)], nq, 2, 16, page=4, dtype=dtype, qk_norm=qk_norm, rope=rope,
                pad_rows=2, seed=12)
    transformed = qk_norm or rope is not None
    results = []
    for prerotate in (False, True):
        write.calls.clear()
        attend.calls.clear()
        r = Run(case)  # same seed: the same inputs and poisoned buffers for both paths
        out = r.launch(config=_prefill_config(group, prerotate))
        r.check(out, name=f"prerotate_q={prerotate}")
        pre = prerotate and transformed
        assert [c["WRITE_Q"] for c in write.calls] == [pre] and write.calls[0]["WRITE_KV"]
        assert attend.calls[0]["HAS_Q_NORM"] == (qk_norm and not pre)
        want_rope = attention_config.ROPE_NONE if pre or rope is None else write.calls[0]["ROPE"]
        assert attend.calls[0]["ROPE"] == want_rope
        assert attend.calls[0]["Q_BY_TOKEN"] == (transformed and not pre and group == 4)
        assert attend.calls[0]["PDL"] == 0 and not write.calls[0]["LAUNCH_DEPENDENTS"], "no PDL in the interpreter"
        results.append((out.clone(), r.k_cache.clone(), r.v_cache.clone()))
    for name, a, b in zip(("out", "k_cache", "v_cache"), *results, strict=True):
        assert torch.equal(_bits(a), _bits(b)), f"{name}: prerotated q differs from the in-kernel q path"


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("page", [4, 16, 5])
def test_page_prefetch_is_bit_identical_to_the_plain_loops(page, dtype, spies):
    """AttentionConfig.page_prefetch only moves the block-table loads a tile earlier: a varlen prefill
    batch with cached contexts and a decode row (unmasked and masked loops, tiles spanning several pages
    or part of one, a page size that does not divide the tile) matches the oracle and equals the plain
    loops bit for bit. Unused table entries point at a NaN block, so reading one for a live key fails;
    (23, 6)'s second q tile has a masked range of two key tiles, the second partly past the tile's last
    position (loaded, then causally masked: its pages must still be real)."""
    if HAS_CUDA:
        pytest.skip("explicit tilings are an interpreter check of the schedule")
    _, attend = spies
    case = Case([(9, 0), (1, 21), (13, 7), (6, 33), (23, 6)], 8, 2, 16, page=page, dtype=dtype, qk_norm=True,
                pad_rows=2, seed=13 + page)
    outs = []
    for prefetch in (False, True):
        r = Run(case)
        out = r.launch(config=_prefill_config(4, True, page_prefetch=prefetch, num_splits=1))
        r.check(out, name=f"page_prefetch={prefetch}")
        assert attend.calls[-1]["PAGE_PREFETCH"] is prefetch
        outs.append(_bits(out.clone()))
    assert torch.equal(outs[0], outs[1]), "page_prefetch changed the result bits"


def test_pick_config_prerotates_prefill_only():
    """Prefill/mixed launches pre-rotate q (GPU and interpreter alike, so CPU layer tests run that
    path); decode keeps the in-kernel prologue."""
    for interpret in (False, True):
        for max_query_len, want in ((1, False), (2, True), (300, True), (4096, True)):
            cfg = attention.pick_config(head_dim=128, group=8, num_seqs=4, num_kv_heads=2, max_query_len=max_query_len,
                                        max_kv_len=4096, dtype=torch.bfloat16, num_sms=132, interpret=interpret)
            assert cfg.prerotate_q is want, (interpret, max_query_len, cfg)
    assert AttentionConfig(16, 16, 1, 4, 2, 3).prerotate_q is False, "positional fields keep their order"


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_prerotated_q_without_cache_write(dtype, spies):
    """write_kv=False (the new k/v are already cached, here by a first call) with prerotate_q: the write
    kernel runs for q only, and leaves both caches bit-identical."""
    write, attend = spies
    r = Run(Case([(7, 3), (1, 12), (10, 0)], 8, 2, 16, page=4, dtype=dtype, qk_norm=True, pad_rows=3, seed=13))
    r.launch(config=_prefill_config(4, False))
    k_after, v_after = r.k_cache.clone(), r.v_cache.clone()
    poison_(r.out)
    write.calls.clear()
    out = r.launch(write_kv=False, slots=None, config=_prefill_config(4, True))
    assert [(c["WRITE_KV"], c["WRITE_Q"]) for c in write.calls] == [(False, True)]
    assert not attend.calls[-1]["HAS_Q_NORM"] and attend.calls[-1]["ROPE"] == attention_config.ROPE_NONE
    assert torch.equal(_bits(r.k_cache), _bits(k_after)) and torch.equal(_bits(r.v_cache), _bits(v_after))
    r.check(out)


def test_prerotated_q_negative_slot_skips_only_the_cache_write(spies):
    """A negative slot with prerotate_q: the row's k/v are not written, its q still is. The row's k/v
    were cached by a first call and its K/V columns are then poisoned, so a write would put NaN into
    the cache (and into every output row that sees that key); the row's own output must still be
    right, which needs its pre-rotated q."""
    write, _ = spies
    r = Run(Case([(6, 3), (5, 0)], 8, 2, 16, page=4, dtype=torch.float32, qk_norm=True, pad_rows=1, seed=14))
    ref, _, _ = r.oracle()  # before the K/V columns are poisoned
    r.launch(config=_prefill_config(4, False))
    k_after, v_after = r.k_cache.clone(), r.v_cache.clone()
    row, nq, hd = 8, r.c.nq, r.c.hd  # token 2 of the second sequence: later rows attend to its key
    slots = r.slots.clone()
    slots[row] = -1
    r.qkv[row, nq * hd :] = float("nan")
    poison_(r.out)
    write.calls.clear()
    out = r.launch(slots=slots, config=_prefill_config(4, True))
    assert [(c["WRITE_KV"], c["WRITE_Q"]) for c in write.calls] == [(True, True)]
    assert torch.equal(_bits(r.k_cache), _bits(k_after)) and torch.equal(_bits(r.v_cache), _bits(v_after))
    n = r.c.num_tokens
    assert_close(out[:n], ref[:n], dtype=r.c.dtype, name="negative slot + prerotate_q", **out_tolerance(r.c.dtype))
    assert (out[n:] == 0).all()


@settings(max_examples=examples(10), deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqs=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=1, max_size=4),
    nkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 4]),
    hd=st.sampled_from([16, 32]),
    page=st.sampled_from([1, 4, 5, 16]),
    dtype=st.sampled_from(CPU_DTYPES),
    qk_norm=st.booleans(),
    pad_rows=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_property_random_batches(seqs, nkv, group, hd, page, dtype, qk_norm, pad_rows, seed):
    run_case(Case(seqs, nkv * group, nkv, hd, page=page, dtype=dtype, qk_norm=qk_norm, pad_rows=pad_rows,
                  seed=seed))


# ---- the layer contract: attention_step on PagedKVCache, base and shift inputs on one cache ---------


def _reference_attention(qkv, step, cache, layer, q_norm, k_norm, nq, hd):
    """ShiftParallelDecoderLayer._attention, verbatim in float64 on a float64 mirror cache."""
    n, nkv = qkv.shape[0], len(cache.kv_heads)
    q, k, v = qkv.split([nq * hd, nkv * hd, nkv * hd], dim=1)
    q, k, v = q.reshape(n, nq, hd), k.reshape(n, nkv, hd), v.reshape(n, nkv, hd)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, EPS), rms_norm(k, k_norm, EPS)
    cos, sin = rope_cos_sin(step.positions, hd, THETA, q.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    cache.write(layer, step.slots, k, v)
    out = torch.empty((n, nq, hd), dtype=qkv.dtype, device=qkv.device)
    kv_index = torch.arange(nq, device=qkv.device) // (nq // nkv)
    start = 0
    for sid, ql in zip(step.batch.seq_ids, step.batch.query_lens, strict=True):
        kc, vc = cache.gather(layer, sid)
        out[start : start + ql] = causal_gqa_attention(q[start : start + ql], kc, vc, kv_index, hd**-0.5)
        start += ql
    return out.reshape(n, nq * hd)


@pytest.mark.parametrize(("nq", "nkv", "qk_norm"), [(8, 2, True), (4, 1, False)])
def test_attention_step_base_and_shift_steps_share_one_cache(nq, nkv, qk_norm):
    """Steps alternate base-mode input (padded to SP=4 rows, padding NaN) and shift-mode input
    (exact rows) on one PagedKVCache with shuffled blocks; each matches the layer reference, and
    the cache ends equal to the reference's."""
    dtype, hd, layers, layer = torch.float32, 16, 2, 1
    gen = torch.Generator().manual_seed(nq + nkv)
    mk = dict(num_layers=layers, kv_heads=tuple(range(nkv)), head_dim=hd, block_size=4, num_blocks=64)
    cache = PagedKVCache(**mk, dtype=dtype, device=DEVICE)
    mirror = PagedKVCache(**mk, dtype=torch.float64, device=DEVICE)
    order = torch.randperm(64, generator=gen).tolist()
    cache._free, mirror._free = list(order), list(order)  # same scattered blocks in both
    for c in (cache, mirror):
        c.k.fill_(float("nan"))  # never-written slots must never be read
        c.v.fill_(float("nan"))
    q_norm = (1 + 0.2 * torch.randn(hd, generator=gen)).to(DEVICE) if qk_norm else None
    k_norm = (1 + 0.2 * torch.randn(hd, generator=gen)).to(DEVICE) if qk_norm else None
    width = (nq + 2 * nkv) * hd
    kv_index = torch.arange(nq, device=DEVICE) // (nq // nkv)

    lengths: dict[int, int] = {}
    steps = [("base", ((0, 13), (1, 6))), ("shift", ((0, 1), (1, 1))), ("base", ((2, 9), (0, 1), (1, 1))),
             ("shift", ((2, 1), (0, 1), (1, 3)))]
    for mode, seqs in steps:
        ids, q_lens = tuple(s for s, _ in seqs), tuple(q for _, q in seqs)
        batch = StepBatch(ids, q_lens, tuple(lengths.get(s, 0) for s in ids))
        for s, q in seqs:
            lengths[s] = lengths.get(s, 0) + q
        slots, ref_slots = cache.begin_step(batch), mirror.begin_step(batch)
        assert torch.equal(slots, ref_slots)
        n = batch.num_tokens
        rows = padded_token_count(n, 4) if mode == "base" else n
        step = StepState(mode, batch, rows, batch.positions(DEVICE), slots)
        qkv = torch.full((rows, width), float("nan"), dtype=dtype, device=DEVICE)
        qkv[:n] = torch.randn((n, width), generator=gen).to(DEVICE)
        md = step_metadata(batch, cache)
        out = attention_step(qkv, step, cache, layer, q_norm=q_norm, k_norm=k_norm, eps=EPS, rope_theta=THETA,
                             kv_index=kv_index, metadata=md if mode == "base" else None)
        assert out.shape == (rows, nq * hd)
        ref = _reference_attention(qkv[:n].double(), step, mirror, layer, None if q_norm is None else q_norm.double(),
                                   None if k_norm is None else k_norm.double(), nq, hd)
        assert_close(out[:n], ref, dtype=dtype, name=f"{mode} step {seqs}", **out_tolerance(dtype))
        assert (out[n:] == 0).all()
    for sid in lengths:
        for t, (got, exp) in enumerate(zip(cache.gather(layer, sid), mirror.gather(layer, sid), strict=True)):
            assert_close(got, exp, dtype=dtype, name=f"seq {sid} {'kv'[t]} cache")
    assert cache.k[0].isnan().all(), "attention_step wrote into another layer"


def test_step_metadata_layout_and_errors():
    cache = PagedKVCache(num_layers=1, kv_heads=(0,), head_dim=16, block_size=4, num_blocks=16, dtype=torch.float32)
    first = StepBatch((7, 3), (5, 2), (0, 0))
    cache.begin_step(first)
    batch = StepBatch((3, 9, 7), (1, 6, 1), (2, 0, 5))
    with pytest.raises(ValueError, match=r"sequence 9 has 0 cache blocks but needs 2.*begin_step"):
        step_metadata(batch, cache)
    cache.begin_step(batch)
    md = step_metadata(batch, cache, "cpu")
    assert md.cu_seqlens_q.tolist() == [0, 1, 7, 8]
    assert md.context_lens.tolist() == [2, 0, 5]
    assert md.block_tables.dtype == torch.int32 and md.block_tables.shape == (3, 2)
    assert md.block_tables.tolist() == [cache.block_tables[3] + [0], cache.block_tables[9], cache.block_tables[7]]
    assert (md.num_tokens, md.max_query_len, md.max_kv_len) == (8, 6, 6)


def test_kv_index_must_be_the_contiguous_gqa_map():
    attention.check_kv_index([0, 0, 1, 1], 4, 2)
    attention.check_kv_index(torch.zeros(4, dtype=torch.long), 4, 1)
    with pytest.raises(ValueError, match="not the contiguous GQA map"):
        attention.check_kv_index([0, 1, 0, 1], 4, 2)


# ---- arguments, ops, configs -------------------------------------------------------------------


def _small_run(**case) -> Run:
    base = dict(seqs=[(3, 2), (1, 4)], nq=4, nkv=2, hd=16, page=4, dtype=torch.float32, seed=9)
    base.update(case)
    return Run(Case(**base))


@pytest.mark.parametrize(
    ("overrides", "exc", "match"),
    [
        (dict(num_q_heads=3), ValueError, "multiple of the cache's 2 kv heads"),
        (dict(num_q_heads=2), ValueError, r"expected \(nq \+ 2 nkv\) \* hd"),
        (dict(num_tokens=99), ValueError, r"num_tokens=99 must be in \[0, rows="),
        (dict(slots=None), ValueError, "write_kv needs slots"),
        (dict(positions=None), ValueError, "needs positions"),
        (dict(rope_cos=torch.zeros(4, 16)), ValueError, "not both"),
        (dict(q_norm=torch.ones(8)), ValueError, r"q_norm must be a contiguous \[hd=16\]"),
        (dict(out=torch.empty(4, 63)), ValueError, r"out must be \[rows, nq \* hd\]"),
        (dict(cu_seqlens_q=torch.tensor([0, 3, 4])), TypeError, "cu_seqlens_q must be a contiguous int32"),
        (dict(context_lens=torch.zeros(3, dtype=torch.int32)), ValueError, r"context_lens must be \[2\]"),
        (dict(v_cache=torch.zeros(3, 4, 2, 16)), ValueError, "equal shapes and strides"),
        (dict(k_cache=torch.zeros(3, 4, 2, 24), v_cache=torch.zeros(3, 4, 2, 24)), ValueError, "power of two"),
    ],
)
def test_bad_arguments_say_what_is_wrong(overrides, exc, match):
    r = _small_run()
    overrides = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in overrides.items()}
    with pytest.raises(exc, match=match):
        r.launch(**overrides)


def test_dtype_mismatch_between_qkv_and_cache():
    r = _small_run()
    with pytest.raises(TypeError, match="must equal qkv dtype"):
        paged_attention(r.qkv.half(), num_tokens=4, num_q_heads=4, cu_seqlens_q=r.cu, context_lens=r.ctx,
                        block_tables=r.block_tables, k_cache=r.k_cache, v_cache=r.v_cache, slots=r.slots)


def test_cpu_tensors_without_interpreter_fail_clearly(monkeypatch):
    if HAS_CUDA:
        pytest.skip("CPU-only check")
    r = _small_run()
    monkeypatch.setattr(attention_launch, "INTERPRETED", False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        r.launch()


def _op_args(r: Run):
    return (r.cu, r.ctx, r.block_tables, r.slots, r.positions, None, None, None, None)


def _op_kwargs(r: Run):
    return dict(num_tokens=r.c.num_tokens, num_q_heads=r.c.nq, max_query_len=3, max_kv_len=5, scale=0.25,
                eps=EPS, rope_theta=THETA, write_kv=True)


def test_fake_impls_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    r = _small_run(pad_rows=3)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = {k: mode.from_tensor(getattr(r, k)) for k in ("qkv", "k_cache", "v_cache", "cu", "ctx",
                                                             "block_tables", "slots", "positions", "out")}
        out = torch.ops.fusedpar.paged_attention(
            fake["qkv"], fake["k_cache"], fake["v_cache"], fake["cu"], fake["ctx"], fake["block_tables"],
            fake["slots"], fake["positions"], None, None, None, None, **_op_kwargs(r))
        assert out.shape == (7, 64) and out.dtype == r.c.dtype
        torch.ops.fusedpar.paged_attention_out(
            fake["qkv"], fake["out"], fake["k_cache"], fake["v_cache"], fake["cu"], fake["ctx"],
            fake["block_tables"], fake["slots"], fake["positions"], None, None, None, None, **_op_kwargs(r))
        with pytest.raises(ValueError, match="expected"):
            torch.ops.fusedpar.paged_attention(
                fake["qkv"][:, :-16], fake["k_cache"], fake["v_cache"], fake["cu"], fake["ctx"],
                fake["block_tables"], fake["slots"], fake["positions"], None, None, None, None, **_op_kwargs(r))


def test_opcheck():
    r = _small_run(pad_rows=1)
    torch.library.opcheck(
        torch.ops.fusedpar.paged_attention.default,
        (r.qkv, r.k_cache, r.v_cache, *_op_args(r)), _op_kwargs(r),
        test_utils=("test_schema", "test_faketensor"),
    )
    torch.library.opcheck(
        torch.ops.fusedpar.paged_attention_out.default,
        (r.qkv, r.out, r.k_cache, r.v_cache, *_op_args(r)), _op_kwargs(r),
        test_utils=("test_schema", "test_faketensor"),
    )


def test_torch_compile_sees_one_op():
    r = _small_run()

    def f(qkv, k_cache, v_cache):
        return torch.ops.fusedpar.paged_attention(qkv, k_cache, v_cache, *_op_args(r), **_op_kwargs(r)) * 2.0

    eager = f(r.qkv, r.k_cache, r.v_cache)
    # aot_eager: the graph is captured (fullgraph => no break at the op) but not code-generated.
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(r.qkv, r.k_cache, r.v_cache), eager)


def test_public_call_eager_launches_directly_and_compiles_to_the_op():
    """paged_attention skips the op dispatcher in eager mode (host cost) but must still reach
    torch.compile as the registered op (a Triton launch cannot be traced), with equal results."""
    r = _small_run()
    kw = dict(num_tokens=r.c.num_tokens, num_q_heads=r.c.nq, cu_seqlens_q=r.cu, context_lens=r.ctx,
              block_tables=r.block_tables, slots=r.slots, positions=r.positions, max_query_len=3, max_kv_len=5,
              scale=0.25, eps=EPS, rope_theta=THETA)

    def f(qkv, k_cache, v_cache):
        return attention.paged_attention(qkv, k_cache=k_cache, v_cache=v_cache, **kw) * 2.0

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    k_eager, v_eager = r.k_cache.clone(), r.v_cache.clone()
    eager = f(r.qkv, k_eager, v_eager)
    direct = torch.ops.fusedpar.paged_attention(r.qkv, r.k_cache.clone(), r.v_cache.clone(), *_op_args(r),
                                                **_op_kwargs(r)) * 2.0
    assert torch.equal(eager, direct)
    k_comp, v_comp = r.k_cache.clone(), r.v_cache.clone()
    got = torch.compile(f, backend=backend, fullgraph=True)(r.qkv, k_comp, v_comp)
    assert len(graphs) == 1 and "fusedpar.paged_attention" in graphs[0].code, graphs[0].code if graphs else None
    assert torch.equal(got, eager)
    for got_cache, want_cache in ((k_comp, k_eager), (v_comp, v_eager)):  # the new k/v were written
        torch.testing.assert_close(got_cache, want_cache, rtol=0, atol=0, equal_nan=True)  # NaN: unused slots
    assert not torch.equal(torch.nan_to_num(k_eager), torch.nan_to_num(r.k_cache))


def test_reimport_is_idempotent():
    importlib.reload(attention_ops)  # registers the torch.library ops again
    module = importlib.reload(attention)
    r = _small_run()
    out = module.paged_attention(r.qkv, num_tokens=4, num_q_heads=4, cu_seqlens_q=r.cu, context_lens=r.ctx,
                                 block_tables=r.block_tables, k_cache=r.k_cache, v_cache=r.v_cache, slots=r.slots,
                                 positions=r.positions, rope_theta=THETA, out=r.out)
    r.check(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("hd", [64, 128, 256])
@pytest.mark.parametrize(("group", "max_query_len"), [(1, 1), (8, 1), (16, 1), (8, 4096), (1, 4096), (5, 300)])
def test_gpu_configs_fit_hopper_shared_memory(group, max_query_len, hd, dtype):
    """The GPU tilings (not runnable here) are legal: tl.dot block dims are powers of two >= 16, the
    q tile holds block_q * G rows, and q + num_stages K/V tiles fit in 227 KiB of shared memory."""
    for num_seqs, max_kv_len in ((1, 4097), (64, 4097), (2, 300)):
        cfg = attention.pick_config(head_dim=hd, group=group, num_seqs=num_seqs, num_kv_heads=2,
                                    max_query_len=max_query_len, max_kv_len=max_kv_len, dtype=dtype, num_sms=132,
                                    interpret=False)
        for block in (cfg.block_m, cfg.block_n):
            assert block >= 16 and block & (block - 1) == 0, cfg
        assert 1 <= cfg.block_q * group <= cfg.block_m, cfg
        elem = torch.empty((), dtype=dtype).element_size()
        smem = cfg.block_m * hd * elem + cfg.num_stages * 2 * cfg.block_n * hd * elem
        assert smem <= 227 * 1024, (cfg, smem)
        assert 1 <= cfg.num_splits <= 64
        if max_query_len == 1 and num_seqs == 1:
            assert cfg.num_splits > 1, "a single long decode must split its keys to use the GPU"


# ---- GPU only ------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
LLAMA70B_RANK_HEADS = [(16, 2), (8, 1)]  # per rank: TP=4 (16 q / 2 kv); P=8 (8 q / 1 kv, replicated)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("nq", "nkv"), LLAMA70B_RANK_HEADS)
def test_gpu_small_batches_vs_fp64(nq, nkv, dtype):
    gen = torch.Generator().manual_seed(nq)
    for i, (seqs, qk_norm) in enumerate((
        (_random_seqs(gen, 6, max_q=300, max_ctx=700), True),
        ([(1, int(c)) for c in torch.randint(1, 3000, (9,), generator=gen)], False),  # decode, split-KV
        ([(777, 0)], False),
    )):
        run_case(Case(seqs, nq, nkv, 128, page=16, dtype=dtype, qk_norm=qk_norm, pad_rows=3, view=i == 0, seed=i))


def _sdpa(q, k, v, causal):
    """q [B, Hq, Lq, d], k/v [B, Hkv, Lk, d] -> [B, Hq, Lq, d] with the flash backend when it applies."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("q_path", ["raw", "in-kernel", "prerotated"])
@pytest.mark.parametrize(("nq", "nkv"), LLAMA70B_RANK_HEADS)
def test_gpu_prefill_4096_vs_sdpa(nq, nkv, q_path):
    """bf16, hd 128: one 4096-token prefill with padded rows, on the default tiling.
    raw: no RoPE/norm, so SDPA sees the same q/k/v and the new k must be cached verbatim.
    in-kernel / prerotated: q/k RMSNorm + RoPE, with q transformed in the attention prologue
    (prerotate_q=False) or by the write kernel (True); SDPA gets q/k transformed by the reference
    functions in fp32 and rounded to bf16 (what the kernel attends with and caches)."""
    hd, n, page = 128, 4096, 16
    raw = q_path == "raw"
    r = Run(Case([(n, 0)], nq, nkv, hd, page=page, dtype=torch.bfloat16, qk_norm=not raw,
                 rope=None if raw else "theta", pad_rows=8, seed=1))
    cfg = attention.pick_config(head_dim=hd, group=nq // nkv, num_seqs=1, num_kv_heads=nkv, max_query_len=n,
                                max_kv_len=n, dtype=torch.bfloat16,
                                num_sms=torch.cuda.get_device_properties(DEVICE).multi_processor_count,
                                interpret=False)
    out = r.launch(config=dataclasses.replace(cfg, prerotate_q=q_path == "prerotated"))
    q, k, v = r.qkv[:n].split([nq * hd, nkv * hd, nkv * hd], dim=1)
    if not raw:
        q, k = q.float().reshape(n, nq, hd), k.float().reshape(n, nkv, hd)
        q, k = rms_norm(q, r.q_norm.float(), EPS), rms_norm(k, r.k_norm.float(), EPS)
        cos, sin = rope_cos_sin(r.positions, hd, THETA, torch.float32)
        q = apply_rope(q, cos, sin).to(torch.bfloat16).reshape(n, nq * hd)
        k = apply_rope(k, cos, sin).to(torch.bfloat16).reshape(n, nkv * hd)
    ref = _sdpa(*(t.reshape(1, n, -1, hd).transpose(1, 2) for t in (q, k, v)), causal=True)
    ref = ref.transpose(1, 2).reshape(n, nq * hd)
    assert _rel(out[:n], ref) < 1e-2
    assert (out[:n].float() - ref.float()).abs().max().item() < 5e-2
    assert (out[n:] == 0).all()
    k_cached = r.k_cache.view(-1, nkv * hd)[r.slots]
    if raw:
        assert torch.equal(k_cached, k), "the new k must be cached verbatim without RoPE/norm"
    else:
        assert_close(k_cached, k, dtype=torch.bfloat16, name="cached k")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("nq", "nkv"), LLAMA70B_RANK_HEADS)
def test_gpu_decode_64x4096_vs_sdpa(nq, nkv):
    """bf16, hd 128: 64 sequences x 4096 cached tokens in shuffled 16-token blocks, one new token each."""
    hd, b, ctx = 128, 64, 4096
    r = Run(Case([(1, ctx)] * b, nq, nkv, hd, page=16, dtype=torch.bfloat16, rope=None, seed=2))
    out = r.launch()
    q = r.qkv[:, : nq * hd].reshape(b, nq, 1, hd)
    rows = torch.stack([r._slots_of(t, 0, ctx + 1) for t in r.tables]).to(DEVICE)  # [b, ctx+1]
    kc = r.k_cache.view(-1, nkv, hd)[rows].transpose(1, 2)  # [b, nkv, ctx+1, hd]
    vc = r.v_cache.view(-1, nkv, hd)[rows].transpose(1, 2)
    ref = _sdpa(q, kc, vc, causal=False).reshape(b, nq * hd)
    assert _rel(out, ref) < 1e-2
    assert (out.float() - ref.float()).abs().max().item() < 5e-2


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_replay_matches_eager():
    r = Run(Case([(1, 1000), (1, 37), (1, 2500)], 16, 2, 128, page=16, dtype=torch.bfloat16, qk_norm=True, seed=3))
    assert torch.cuda.current_device() == DEVICE.index, "the capture stream must be on the tensors' GPU"
    eager = r.launch().clone()
    stream = torch.cuda.Stream(device=DEVICE)
    stream.wait_stream(torch.cuda.current_stream(DEVICE))
    with torch.cuda.stream(stream):
        r.launch()  # warm-up on the side stream (compiles nothing new; caches inv_freq)
    torch.cuda.current_stream(DEVICE).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        r.launch(max_query_len=1, max_kv_len=4096)  # host bounds: no device sync inside the capture
    r.out.fill_(float("nan"))  # after the capture: only the replay can write the output
    graph.replay()
    torch.cuda.synchronize(DEVICE)
    assert_close(r.out, eager, dtype=torch.bfloat16, **out_tolerance(torch.bfloat16))


_PDL_BATCHES = {
    "prefill": [(128, 0), (97, 300), (128, 0), (1, 50), (200, 16)],  # write kernel -> attention
    "decode12": [(1, 300 + 97 * i) for i in range(12)],  # write kernel -> split attention -> combine
    "decode2": [(1, 3000), (1, 41)],  # attention writing its own keys (no write kernel) -> combine
}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("batch", "prerotate"), [("prefill", False), ("prefill", True), ("decode12", False),
                                                  ("decode2", False)])
@pytest.mark.parametrize(("nq", "nkv"), [*LLAMA70B_RANK_HEADS, (12, 2)])
def test_gpu_pdl_launch_matches_back_to_back_and_survives_capture(nq, nkv, prerotate, batch, spies, monkeypatch):
    """AttentionConfig.pdl: the attention grid starts while the write kernel runs (a short varlen
    prefill with cached context, where that overlap is the point, or a decode batch above
    FUSED_WRITE_MAX_SEQS) and waits for it before reading q (pre-rotated) or the new keys (in-kernel
    q); a split launch's combine kernel starts under the attention grid and waits for its partials.
    The launches really are programmatic (the spies see launch_pdl and the wait/trigger flags), and
    same kernels, same arithmetic: PDL on and off agree bit for bit, both match the oracle, and so
    does a CUDA-graph replay of the PDL launch (the graph keeps the programmatic edges). Before the
    PDL run the blocks of the launcher's scratch (q scratch, split partials) are refilled with NaN, so
    a read ahead of the wait cannot find the first run's values there; the new cache slots start as
    NaN in every run. (A read ahead of the wait only shows when it beats the write grid, which this
    GPU may not let happen: with the pre-rotated q's wait removed this test still passed on an H200;
    tests/kernels/test_sm90_compile.py checks the waits and where they sit in the PTX.)
    (12, 2): G = 6 takes the row-wise q prologue. Decode transforms q in the kernel (pick_config's
    decode choice)."""
    if torch.cuda.get_device_capability(DEVICE)[0] < 9 or not attention_launch._device_has_pdl(DEVICE):
        pytest.skip("PDL needs sm_90+ and a Triton with gdc_wait: the launcher runs the kernels back to back")
    write, attend = spies
    combine = _LaunchSpy(attention_launch._combine_kernel)
    monkeypatch.setattr(attention_launch, "_combine_kernel", combine)
    seqs = _PDL_BATCHES[batch]
    case = Case(seqs, nq, nkv, 128, page=16, dtype=torch.bfloat16, qk_norm=True, pad_rows=3, seed=nq)
    max_q, max_kv = max(q for q, _ in seqs), max(q + c for q, c in seqs)
    cfg = attention.pick_config(head_dim=128, group=nq // nkv, num_seqs=len(seqs), num_kv_heads=nkv,
                                max_query_len=max_q, max_kv_len=max_kv, dtype=torch.bfloat16,
                                num_sms=torch.cuda.get_device_properties(DEVICE).multi_processor_count,
                                interpret=False)
    cfg = dataclasses.replace(cfg, prerotate_q=prerotate)
    if max_q == 1:
        assert cfg.num_splits > 1, cfg  # the combine kernel runs
    outs = []
    for pdl in (False, True):
        if pdl:  # the scratch blocks the launcher allocated (and freed) in the first run: NaN now
            shapes = ([attend.tensor_args[-1][0]] if prerotate else []) + attend.tensor_args[-1][12:15]
            poison = [torch.full(shape, float("nan"), dtype=dtype, device=DEVICE) for shape, dtype in shapes]
            del poison
        for spy in (write, attend, combine):
            spy.calls.clear()
        r = Run(case)
        out = r.launch(config=dataclasses.replace(cfg, pdl=pdl))
        r.check(out, name=f"pdl={pdl}")
        outs.append((out.clone(), r.k_cache.clone()))
        wrote = bool(write.calls)
        assert wrote == (batch != "decode2"), "the write kernel runs unless decode writes its own keys"
        a = attend.calls[-1]
        assert a.get("launch_pdl", False) == (pdl and wrote), a
        assert a["PDL"] == (0 if not (pdl and wrote) else 1 if prerotate else 2), a["PDL"]
        if wrote:
            assert write.calls[-1]["LAUNCH_DEPENDENTS"] == pdl
        split = a["SPLIT"]
        assert split == (max_q == 1), "decode splits its keys here, the prefill does not"
        assert a["LAUNCH_DEPENDENTS"] == (pdl and split)
        assert [(c["PDL"], c.get("launch_pdl", False)) for c in combine.calls] == ([(pdl, pdl)] if split else [])
        fast_or_none = (attention_config.ROPE_NONE, attention_config.ROPE_THETA_FAST)
        assert a["ROPE"] in fast_or_none, "bf16 RoPE uses the fast cos/sin"
    assert torch.equal(_bits(outs[0][0]), _bits(outs[1][0])), "PDL changed the attention output"
    assert torch.equal(_bits(outs[0][1]), _bits(outs[1][1])), "PDL changed the cached keys"

    r = Run(case)
    pdl_cfg = dataclasses.replace(cfg, pdl=True)
    r.launch(config=pdl_cfg, max_query_len=max_q, max_kv_len=max_kv)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        r.launch(config=pdl_cfg, max_query_len=max_q, max_kv_len=max_kv)
    r.out.fill_(float("nan"))
    for cache, before in ((r.k_cache, r.k_before), (r.v_cache, r.v_before)):
        cache.copy_(before)  # the replay must write the new keys again before attending to them
    graph.replay()
    torch.cuda.synchronize(DEVICE)
    r.check(r.out, name="pdl graph replay")
    assert torch.equal(_bits(r.out), _bits(outs[1][0])), "the replay differs from the eager PDL launch"


@pytest.mark.gpu
@gpu
def test_gpu_batch_counts_compile_no_new_variant(monkeypatch):
    """A serving loop's batches differ in their counts (sequences, tokens, q tiles: 1, multiples of 16,
    others) under one tiling: only the first batch of a tiling may compile kernels (a compile is
    seconds of host time inside a step), and every batch still matches its oracle."""
    import triton

    from fusedpar.kernels._host import next_pow2

    compiled = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook",
                        lambda *a, **kw: compiled.append(kw.get("repr", "?").split("[")[0]))
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    gen = torch.Generator().manual_seed(11)
    batches = [[(200, 0)], [(160, 32)] * 16, [(129, 7), (300, 0), (1, 64)], [(256, 16)] * 2 + [(1, 33)] * 15,
               _random_seqs(gen, 5, max_q=400, max_ctx=300), [(1, 3000 + 7 * i) for i in range(16)],
               [(1, 3100 + 5 * i) for i in range(17)]]
    seen, checked = set(), 0
    for i, seqs in enumerate(batches):
        cfg = attention.pick_config(head_dim=128, group=8, num_seqs=len(seqs), num_kv_heads=2,
                                    max_query_len=max(q for q, _ in seqs), max_kv_len=max(q + c for q, c in seqs),
                                    dtype=torch.bfloat16, num_sms=sms, interpret=False)
        tiling = (dataclasses.replace(cfg, num_splits=next_pow2(cfg.num_splits)), all(q == 1 for q, _ in seqs))
        before = len(compiled)
        run_case(Case(seqs, 16, 2, 128, page=16, dtype=torch.bfloat16, qk_norm=True, seed=i), name=f"batch {i}")
        if tiling in seen:
            checked += 1
            assert len(compiled) == before, f"batch {i} ({len(seqs)} sequences) compiled {compiled[before:]}"
        seen.add(tiling)
    assert checked >= 3, f"only {checked} batches reused a tiling: the check saw too little"
