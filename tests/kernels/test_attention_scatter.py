"""The return all-to-all done by the attention's stores: paged_attention(scatter=...) + scattered_o_proj.

CPU (Triton interpreter, EmulatedWorld): every emulated SP rank runs the real attention kernels
with a ScatterOut pointing at every rank's staging buffer (which starts poisoned: NaN bytes),
then the arrival barrier (every rank's publish, then every rank's wait) and the o GEMM. The
oracle is the float64 attention of tests/kernels/test_attention.py's Run on each rank, permuted
by the all-to-all reference of tests/kernels/test_ulysses.py, then the float64 GEMM. Batches mix
prefill chunks and decodes with odd lengths; the step's padding rows (n_pad - n) must come out
zero; split-KV launches store through the combine kernel; nothing may be written past the
staging region.
GPU: `torchrun --nproc-per-node 4 -m pytest -m gpu tests/kernels/test_attention_scatter.py`: bf16
with real peer stores over NVLink against the local-output attention + NCCL all-to-all + GEMM.
"""

from __future__ import annotations

import math

import pytest
import torch

from fusedpar.collectives.symmetric import COUNTER_EPOCH, EmulatedWorld
from fusedpar.kernels import attention
from fusedpar.kernels._host import INTERPRETED
from fusedpar.kernels.attention import AttentionConfig, ScatterOut
from fusedpar.kernels.ulysses import o_proj_workspace_bytes, o_scatter_target
from fusedpar.testing.numerics import assert_close
from fusedpar.testing.ulysses_emulation import emulated_check, scattered_o_proj_emulated
from tests.kernels.test_attention import Case, Run, out_tolerance
from tests.kernels.test_ulysses import head_to_seq_reference

pytestmark = pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(),
                                reason="needs the Triton interpreter (TRITON_INTERPRET=1) or a GPU")

TAIL = 512  # staging bytes past the data region: must stay poisoned


def _weights(W: int, n: int, C: int, dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn((n, W * C), generator=g) / math.sqrt(W * C)).to(dtype) for _ in range(W)]


def _scatter_step(W: int, seqs, *, nq: int, nkv: int, hd: int, dtype, extra_pad: int = 0,
                  config: AttentionConfig | None = None, seed: int = 0, n_out: int = 24):
    """Every emulated rank's scattering attention, then scattered_o_proj; returns what to check."""
    n = sum(q for q, _ in seqs)
    m = -(-n // W) + extra_pad  # rows per rank of the padded step
    C = nq * hd
    runs = [Run(Case(seqs, nq, nkv, hd, page=4, dtype=dtype, pad_rows=W * m - n, seed=seed + r)) for r in range(W)]
    world = EmulatedWorld(W, o_proj_workspace_bytes(m, C, W, dtype) + TAIL)
    for r in range(W):
        target = o_scatter_target(world[r], m, C, dtype)
        assert target.col_offset == r * C and target.local.shape == (m, W * C)
        assert runs[r].launch(out=None, scatter=target, config=config) is None
    ws = _weights(W, n_out, C, dtype, seed)
    outs = scattered_o_proj_emulated(world, ws, tokens=m, num_tokens=n, c=C)
    return runs, world, ws, outs, m, n, C


def _check(runs, world, ws, outs, m, n, C, dtype) -> None:
    W = world.world_size
    attn_refs = [r.oracle()[0] for r in runs]  # [W*m, C] fp64, padding rows zero
    staged_refs = head_to_seq_reference(attn_refs)  # what each rank's o GEMM must read: [m, W*C]
    tol = out_tolerance(dtype)
    for r in range(W):
        staged = o_scatter_target(world[r], m, C, dtype).local
        assert not staged.isnan().any(), f"rank {r}: a staging element was never stored (NaN poison left)"
        assert_close(staged, staged_refs[r], dtype=dtype, name=f"rank {r} staging", **tol)
        first_pad = min(m, max(0, n - r * m))
        assert (staged[first_pad:] == 0).all(), f"rank {r}: padding rows {first_pad}.. of the staging are not zero"
        assert_close(outs[r], staged_refs[r] @ ws[r].double().T, dtype=dtype, name=f"rank {r} o-projection")
        tail = world.buffers[r][o_proj_workspace_bytes(m, C, W, dtype):]
        assert bool((tail == 0xFF).all()), f"rank {r}: stored past the staging region"
        assert world[r].status() == 0
        assert int(world[r].counters[COUNTER_EPOCH]) == 1


@pytest.mark.parametrize("dtype", (torch.float16, torch.float32), ids=str)
@pytest.mark.parametrize(("W", "extra_pad"), [(2, 0), (4, 0), (4, 2), (3, 1)])
def test_scatter_stores_the_return_all_to_all(W, extra_pad, dtype):
    """Varlen prefill with context + decodes; tokens 22 = not a multiple of W (padding rows), and with
    extra_pad whole padding rows on the last ranks (a rank may own padding only)."""
    seqs = [(1, 9), (13, 0), (1, 0), (7, 5)]
    _check(*_scatter_step(W, seqs, nq=4, nkv=2, hd=16, dtype=dtype, extra_pad=extra_pad, seed=W), dtype)


@pytest.mark.parametrize(
    "config",
    [AttentionConfig(16, 16, 1, num_splits=3), AttentionConfig(16, 16, 4, num_splits=2, page_prefetch=False)],
    ids=["decode-split3", "prefill-split2"],
)
def test_scatter_through_the_combine_kernel(config):
    """Split-KV: the partials are merged by the combine kernel, which is then the one storing remotely."""
    if not INTERPRETED:
        pytest.skip("explicit tilings are an interpreter check of the schedule")
    seqs = [(1, 50), (1, 17), (1, 0), (1, 33), (1, 8)] if config.block_q == 1 else [(1, 50), (3, 17), (12, 30)]
    _check(*_scatter_step(4, seqs, nq=8, nkv=2, hd=16, dtype=torch.float16, config=config, seed=7),
           torch.float16)


def test_scatter_with_kv_replication_and_qk_norm():
    """One kv head per rank (G = nq) and a pure decode batch small enough for the in-launch cache write."""
    seqs = [(1, 21), (1, 3), (1, 0)]
    _check(*_scatter_step(2, seqs, nq=4, nkv=1, hd=32, dtype=torch.float16, seed=11), torch.float16)


def test_consecutive_steps_reuse_the_staging_and_advance_the_epoch():
    W, dtype, nq, hd = 2, torch.float16, 4, 16
    C, m = nq * hd, 6
    world = EmulatedWorld(W, o_proj_workspace_bytes(m, C, W, dtype) + TAIL)
    for step, seqs in enumerate(([(5, 0), (6, 2)], [(1, 11), (8, 0), (2, 3)])):
        n = sum(q for q, _ in seqs)  # 11 of 12 rows: one padding row each step
        runs = [Run(Case(seqs, nq, 2, hd, page=4, dtype=dtype, pad_rows=W * m - n, seed=10 * step + r))
                for r in range(W)]
        for r in range(W):
            runs[r].launch(out=None, scatter=o_scatter_target(world[r], m, C, dtype))
        ws = _weights(W, 8, C, dtype, step)
        outs = scattered_o_proj_emulated(world, ws, tokens=m, num_tokens=n, c=C)
        staged = head_to_seq_reference([r.oracle()[0] for r in runs])
        for r in range(W):
            assert_close(outs[r], staged[r] @ ws[r].double().T, dtype=dtype, name=f"step {step} rank {r}")
            assert int(world[r].counters[COUNTER_EPOCH]) == step + 1


def test_missing_arrival_is_reported():
    """A rank whose peer never published: its bounded wait gives up and the driver raises."""
    from fusedpar.kernels.ulysses.launch import launch_o_arrival

    W, dtype, C, m = 2, torch.float16, 32, 2
    world = EmulatedWorld(W, o_proj_workspace_bytes(m, C, W, dtype))
    launch_o_arrival(world[0], wait=False)  # rank 1 never publishes
    launch_o_arrival(world[0], publish=False)
    assert world[0].status() != 0
    with pytest.raises(RuntimeError, match="never came"):
        emulated_check(world, "scattered_o_proj")


def test_scatter_argument_errors():
    r = Run(Case([(3, 2), (2, 0)], 4, 2, 16, page=4, dtype=torch.float16, pad_rows=1))
    W, m, C = 2, 3, 64
    world = EmulatedWorld(W, o_proj_workspace_bytes(m, C, W, torch.float16))
    good = o_scatter_target(world[1], m, C, torch.float16)
    with pytest.raises(ValueError, match="exactly one of out and scatter"):
        r.launch(scatter=good)  # Run.launch passes its own out too
    bad = [
        (ScatterOut(good.peer_ptrs.to(torch.int32), good.local, m, C), "int64"),
        (ScatterOut(good.peer_ptrs, good.local.float(), m, C), "local must be"),
        (ScatterOut(good.peer_ptrs, good.local, 2, C), "num_tokens <= W \\* m"),
        (ScatterOut(good.peer_ptrs, good.local, m, C + 1), "do not fit"),
    ]
    for target, match in bad:
        with pytest.raises(ValueError, match=match):
            r.launch(out=None, scatter=target)
    with pytest.raises(ValueError, match=r"need \d+ bytes"):
        o_scatter_target(world[0], m + 1, C, torch.float16)


def test_registered_ops_compile_and_match_eager():
    """Under torch.compile the scattering attention and the arrival barrier are registered ops
    (fullgraph: no break), with the eager result."""
    from fusedpar.kernels import ulysses

    W, dtype, nq, hd = 2, torch.float16, 4, 16
    C, m, seqs = nq * hd, 4, [(5, 0), (3, 4)]
    runs = [Run(Case(seqs, nq, 2, hd, page=4, dtype=dtype, pad_rows=0, seed=r)) for r in range(W)]
    world = EmulatedWorld(W, o_proj_workspace_bytes(m, C, W, dtype))
    ws = _weights(W, 8, C, dtype, 3)
    for r in range(W):
        runs[r].launch(out=None, scatter=o_scatter_target(world[r], m, C, dtype))
    eager = scattered_o_proj_emulated(world, ws, tokens=m, num_tokens=8, c=C)

    def attend(run, target):
        attention.paged_attention(
            run.qkv, num_tokens=8, num_q_heads=nq, cu_seqlens_q=run.cu, context_lens=run.ctx,
            block_tables=run.block_tables, k_cache=run.k_cache, v_cache=run.v_cache, slots=run.slots,
            positions=run.positions, max_query_len=5, max_kv_len=7, eps=1e-6, rope_theta=10000.0, scatter=target,
        )
        return run.k_cache.sum()

    compiled_attend = torch.compile(attend, backend="aot_eager", fullgraph=True)
    for r in range(W):
        compiled_attend(runs[r], o_scatter_target(world[r], m, C, dtype))
    for r in range(W):
        ulysses.launch.launch_o_arrival(world[r], wait=False)
    compiled_o = torch.compile(
        lambda w, table: ulysses.scattered_o_proj(w, table, tokens=m, num_tokens=8, c=C),
        backend="aot_eager", fullgraph=True)
    for r in range(W):
        # the registered arrival op publishes again (same epoch, harmless) and waits
        got = compiled_o(ws[r], world[r])
        assert_close(got, eager[r].double(), dtype=dtype, name=f"compiled rank {r}")
        assert world[r].status() == 0


# ================================================================================== GPU


def _gpu_seqs(n: int) -> list[tuple[int, int]]:
    """A mixed batch of n new tokens: a long prefill, a chunk on a cached context, three decodes."""
    return [(n - 10, 0), (7, 37), (1, 300), (1, 0), (1, 17)]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [13, 1024])
def test_gpu_scatter_matches_local_attention_and_nccl(nccl_world, m):
    """Llama-70B per-rank heads at SP = world (16 q / 2 kv heads of 128 at 4 ranks), bf16, real peer
    stores: the staged rows equal the local-output attention sent through NCCL's all-to-all (same
    kernel arithmetic, so bit for bit), the GEMM equals the plain one, and the local attention
    matches the fp64 oracle. Two rounds on one workspace (the reuse and the epoch)."""
    import torch.distributed as dist

    from fusedpar.collectives import comm
    from fusedpar.collectives.symmetric import SymmetricWorkspace
    from fusedpar.kernels.ulysses import scattered_o_proj
    from fusedpar.testing.gpu import all_ranks_ok, world_group_or_skip

    group = world_group_or_skip(nccl_world)
    W, rank = dist.get_world_size(), dist.get_rank()
    nq, nkv, hd, dtype = 64 // W, max(1, 8 // W), 128, torch.bfloat16
    C, n = nq * hd, W * m - 3
    sp = type("SP", (), {"size": W, "pg": group})()
    region = o_proj_workspace_bytes(m, C, W, dtype)
    ws = SymmetricWorkspace(group, region + 4096)
    errors = []
    for rnd in range(2):
        run = Run(Case(_gpu_seqs(n), nq, nkv, hd, page=16, dtype=dtype, pad_rows=W * m - n, seed=97 * rank + rnd,
                       device=torch.device("cuda", torch.cuda.current_device())))
        g = torch.Generator(device="cuda").manual_seed(31 * rank + rnd)
        w_o = (torch.randn((8192 // W * 2, W * C), generator=g, device="cuda") / math.sqrt(W * C)).to(dtype)
        ws.table.buffer.fill_(0xFF)  # NaN: a row nobody stores stays NaN
        dist.barrier()  # nobody stores before every poison fill is done (the layer's qkv exchange does this)
        assert run.launch(out=None, scatter=o_scatter_target(ws, m, C, dtype)) is None
        got = scattered_o_proj(w_o, ws, tokens=m, num_tokens=n, c=C)
        staged = o_scatter_target(ws, m, C, dtype).local.clone()
        local = run.launch()  # the same attention into a local buffer (rewrites the same cache slots)
        want = comm.head_to_seq_all_to_all(local, sp)
        torch.cuda.synchronize()
        if staged.isnan().any():
            errors.append(f"m={m} round {rnd}: NaN left in the staging (a row was never stored)")
        elif not torch.equal(staged, want):
            errors.append(f"m={m} round {rnd}: staged rows differ from attention + NCCL all-to-all by "
                          f"{(staged.float() - want.float()).abs().max().item():.3g}")
        if not torch.equal(got, torch.nn.functional.linear(want, w_o)):
            errors.append(f"m={m} round {rnd}: o-projection differs from F.linear on the NCCL result")
        if not bool((ws.table.buffer[region:] == 0xFF).all()):
            errors.append(f"m={m} round {rnd}: stored past the staging region")
        if ws.table.status() != 0:
            errors.append(f"m={m} round {rnd}: the arrival wait timed out")
        try:
            run.check(local, name=f"m={m} round {rnd}")
        except AssertionError as e:
            errors.append(str(e))
    assert all_ranks_ok(not errors), "\n".join(errors)
