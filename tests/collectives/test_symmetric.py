"""PeerTable, EmulatedWorld (CPU, Triton interpreter) and SymmetricWorkspace (GPU, torchrun).

CPU: the emulated world's pointer tables really address every rank's buffer: a Triton kernel
launched "as rank r" stores into a peer's buffer, sets a peer's flag word with a release
atomic, and loads every peer's buffer (docs/design.md, the fused kernels).
GPU (`-m gpu`, under `torchrun --nproc-per-node N -m pytest -m gpu tests/collectives/test_symmetric.py`):
the same kernel on a real SymmetricWorkspace, plus the workspace's tables, views and barrier.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl

from fusedpar.collectives.symmetric import (
    ALIGN_BYTES,
    NUM_COUNTERS,
    EmulatedWorld,
    PeerTable,
    SymmetricWorkspace,
    as_peer_table,
)
from fusedpar.testing.gpu import all_ranks_ok, world_group_or_skip


@triton.jit
def _ring_kernel(buffer_ptrs, signal_ptrs, rank, N, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """Rank r stores (its own first N elements + 1) into region r of peer (r+1) % WORLD, then flags it."""
    offs = tl.arange(0, BLOCK)
    m = offs < N
    dtype = tl.float32
    mine = tl.load(buffer_ptrs + rank).to(tl.pointer_type(dtype))
    nxt = (rank + 1) % WORLD
    dst = tl.load(buffer_ptrs + nxt).to(tl.pointer_type(dtype))
    vals = tl.load(mine + offs, mask=m)
    tl.store(dst + (rank + 1) * N + offs, vals + 1.0, mask=m)
    tl.debug_barrier()
    flags = tl.load(signal_ptrs + nxt).to(tl.pointer_type(tl.int64))
    tl.atomic_xchg(flags + rank, rank + 100, sem="release", scope="sys")


@triton.jit
def _gather_sum_kernel(buffer_ptrs, out_ptr, N, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = sum over ranks p of rank p's buffer element i (fp16 peer loads, fp32 sum)."""
    offs = tl.arange(0, BLOCK)
    m = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for p in tl.static_range(WORLD):
        src = tl.load(buffer_ptrs + p).to(tl.pointer_type(tl.float16))
        acc += tl.load(src + offs, mask=m).to(tl.float32)
    tl.store(out_ptr + offs, acc, mask=m)


# ---------------------------------------------------------------- CPU: EmulatedWorld / PeerTable


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_emulated_world_tables_address_every_rank(world_size):
    world = EmulatedWorld(world_size, 1000, max_blocks=3)
    assert len(world) == world_size
    want_buf = [world[r].buffer.data_ptr() for r in range(world_size)]
    for r in range(world_size):
        t = world[r]
        assert t.rank == r and t.world_size == world_size and t.max_blocks == 3
        assert t.buffer_bytes == 1024  # rounded up to ALIGN_BYTES
        assert t.buffer_ptrs.tolist() == want_buf
        assert t.signal_ptrs.tolist() == [s.data_ptr() for s in world.signals]
        assert t.flag_words == 3 * world_size
        assert world.signals[r].numel() == t.flag_words and not world.signals[r].any()
        assert t.counters.tolist() == [0] * NUM_COUNTERS
        assert t.epoch() == 0 and t.status() == 0
        # Each rank owns its own copy of the tables, as each GPU does.
        assert all(t.buffer_ptrs is not world[q].buffer_ptrs for q in range(world_size) if q != r)
        # Poisoned: reading a slot nobody wrote gives NaN in every float dtype.
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            assert t.view(dtype).isnan().all()


def test_peer_table_view_is_typed_aligned_and_checked():
    t = EmulatedWorld(2, 4096)[1]
    v = t.view(torch.float32, 10, byte_offset=256)
    assert v.dtype == torch.float32 and v.numel() == 10
    assert v.data_ptr() == t.buffer.data_ptr() + 256 and v.data_ptr() % 16 == 0
    v.fill_(3.0)
    assert t.view(torch.float32, 10, 256).eq(3.0).all()
    assert t.view(torch.float16).numel() == 2048
    with pytest.raises(ValueError, match="multiple"):
        t.view(torch.float32, 1, byte_offset=2)
    with pytest.raises(ValueError, match="do not fit"):
        t.view(torch.float32, 1025)


def test_peer_table_validates_its_fields():
    good = EmulatedWorld(2, 256)[0]
    fields = dict(
        rank=0,
        world_size=2,
        buffer=good.buffer,
        buffer_ptrs=good.buffer_ptrs,
        signal_ptrs=good.signal_ptrs,
        counters=good.counters,
        max_blocks=good.max_blocks,
    )
    PeerTable(**fields)
    with pytest.raises(ValueError, match="rank 2"):
        PeerTable(**{**fields, "rank": 2})
    with pytest.raises(ValueError, match="uint8"):
        PeerTable(**{**fields, "buffer": good.buffer.view(torch.int16)})
    with pytest.raises(ValueError, match="buffer_ptrs"):
        PeerTable(**{**fields, "buffer_ptrs": good.buffer_ptrs.to(torch.int32)})
    with pytest.raises(ValueError, match="signal_ptrs"):
        PeerTable(**{**fields, "signal_ptrs": good.signal_ptrs[:1]})
    with pytest.raises(ValueError, match="counters"):
        PeerTable(**{**fields, "counters": torch.zeros(2, dtype=torch.int64)})
    with pytest.raises(ValueError, match="max_blocks"):
        PeerTable(**{**fields, "max_blocks": 0})


def test_as_peer_table_accepts_tables_and_workspace_like_objects():
    t = EmulatedWorld(1, 256)[0]
    assert as_peer_table(t) is t
    assert as_peer_table(SimpleNamespace(table=t)) is t
    with pytest.raises(TypeError, match="PeerTable"):
        as_peer_table(object())


def test_emulated_world_rejects_bad_sizes():
    with pytest.raises(ValueError, match="world_size"):
        EmulatedWorld(0, 256)
    with pytest.raises(ValueError, match="nbytes"):
        EmulatedWorld(2, 0)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_interpreter_peer_stores_loads_and_flags_through_the_tables(world_size):
    n = 37
    world = EmulatedWorld(world_size, (world_size + 1) * n * 4, max_blocks=1)
    g = torch.Generator().manual_seed(world_size)
    inputs = [torch.randn(n, generator=g) for _ in range(world_size)]
    for r in range(world_size):
        world[r].view(torch.float32, n).copy_(inputs[r])
    for r in range(world_size):  # one interpreted "GPU" at a time
        _ring_kernel[(1,)](world[r].buffer_ptrs, world[r].signal_ptrs, r, n, WORLD=world_size, BLOCK=64)
    for r in range(world_size):
        prev = (r - 1) % world_size
        region = world[r].view(torch.float32, n, byte_offset=(prev + 1) * n * 4)
        assert torch.equal(region, inputs[prev] + 1.0), f"rank {r} did not receive rank {prev}'s peer store"
        flags = world.signals[r].tolist()
        assert flags[prev] == prev + 100, f"rank {r}'s flag word from rank {prev}: {flags}"
        assert sum(1 for f in flags if f) == 1, f"rank {r} got flag words it should not have: {flags}"

    # Peer loads in fp16 through the same tables.
    halves = [torch.randn(n, generator=g).half() for _ in range(world_size)]
    for r in range(world_size):
        world[r].view(torch.float16, n).copy_(halves[r])
    out = torch.full((n,), float("nan"))
    _gather_sum_kernel[(1,)](world[0].buffer_ptrs, out, n, WORLD=world_size, BLOCK=64)
    ref = torch.zeros(n)
    for h in halves:
        ref += h.float()
    assert torch.equal(out, ref)


def test_importing_symmetric_does_not_import_torch_symmetric_memory():
    # Import-time side effects are forbidden (CPU builds may lack the extension): the import of
    # torch.distributed._symmetric_memory must happen only inside SymmetricWorkspace().
    code = (
        "import sys, fusedpar.collectives.symmetric as s; print('torch.distributed._symmetric_memory' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


def test_symmetric_workspace_argument_errors_without_allocating():
    with pytest.raises(ValueError, match="nbytes"):
        SymmetricWorkspace(None, 0)
    with pytest.raises(ValueError, match="max_blocks"):
        SymmetricWorkspace(None, 1024, max_blocks=0)
    if not torch.distributed.is_initialized():
        with pytest.raises(RuntimeError, match="initialised"):
            SymmetricWorkspace(None, 1024)


# ------------------------------------------------------------------- GPU: SymmetricWorkspace


@pytest.fixture(scope="module")
def gpu_world(nccl_world):
    """The WORLD process group (NCCL, from tests/conftest.py's torchrun session), or a clean skip."""
    return world_group_or_skip(nccl_world)


@pytest.mark.gpu
def test_gpu_workspace_tables_views_and_barrier(gpu_world):
    import torch.distributed as dist

    W, rank = dist.get_world_size(), dist.get_rank()
    ws = SymmetricWorkspace(gpu_world, 1 << 20, ranks=list(range(W)), max_blocks=16)
    assert ws.rank == rank and ws.world_size == W and ws.buffer_bytes == 1 << 20
    assert ws.flag_bytes % ALIGN_BYTES == 0 and ws.flag_bytes >= 16 * W * 8
    bases = [int(p) for p in ws.handle.buffer_ptrs]
    ok = ws.buffer_ptrs.tolist() == [b + ws.flag_bytes for b in bases] and ws.signal_ptrs.tolist() == bases
    ok &= ws.table.counters.tolist() == [0] * NUM_COUNTERS
    ok &= not ws._raw[: ws.flag_bytes].any().item()

    n = 4099
    ws.view(torch.float32, n).fill_(rank + 1)
    torch.cuda.synchronize()
    ws.barrier()
    for peer in range(W):  # torch's mapping of each peer's data region (storage_offset counts elements)
        peer_view = ws.handle.get_buffer(peer, (4 * n,), torch.uint8, ws.flag_bytes).view(torch.float32)
        ok &= bool(peer_view.eq(peer + 1).all().item())

    # A Triton kernel reads every peer's buffer through the device pointer table.
    ws.barrier()
    ws.view(torch.float16, n).fill_(rank + 1)
    torch.cuda.synchronize()
    ws.barrier()
    out = torch.full((n,), float("nan"), device="cuda")
    _gather_sum_kernel[(1,)](ws.buffer_ptrs, out, n, WORLD=W, BLOCK=8192)
    ok &= bool(out.eq(W * (W + 1) / 2).all().item())
    ws.barrier()
    torch.cuda.synchronize()
    assert all_ranks_ok(ok), f"rank {rank}: workspace tables/views/peer reads wrong"


@pytest.mark.gpu
def test_gpu_workspace_by_group_name_and_rank_check(gpu_world):
    import torch.distributed as dist

    W = dist.get_world_size()
    ws = SymmetricWorkspace(gpu_world.group_name, 4096, max_blocks=4)
    assert ws.world_size == W and ws.ranks == tuple(range(W))
    with pytest.raises(ValueError, match="do not match"):
        SymmetricWorkspace(gpu_world, 4096, ranks=list(reversed(range(W))))
    with pytest.raises(ValueError, match="CUDA"):
        SymmetricWorkspace(gpu_world, 4096, device="cpu")
