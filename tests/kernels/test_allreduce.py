"""One-shot all-reduce: CPU emulation (Triton interpreter, EmulatedWorld) and GPU (torchrun, `-m gpu`).

CPU: every emulated rank runs the real kernel; random inputs (never zeros), poisoned (NaN)
outputs, odd sizes, fp32-accumulation reference computed in float64 with a per-dtype bound,
plus the protocol itself: bitwise-identical outputs on every rank, double buffering against a
slow reader, flag waits that really gate, epochs that advance once per launch.
GPU: `torchrun --nproc-per-node N -m pytest -m gpu tests/kernels/test_allreduce.py`: bf16 on a
real SymmetricWorkspace against NCCL, eager and replayed from a CUDA graph of 10 calls.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusedpar.collectives.symmetric import COUNTER_EPOCH, EmulatedWorld, SymmetricWorkspace
from fusedpar.kernels import allreduce as ar
from fusedpar.kernels import routing
from fusedpar.kernels._host import INTERPRETED
from fusedpar.kernels._sync import routing_as_captured
from fusedpar.kernels.allreduce import (
    AllReduceOptions,
    OneShotConfig,
    all_reduce,
    launch_one_shot_all_reduce,
    one_shot_all_reduce,
    one_shot_capacity_bytes,
)
from fusedpar.testing.allreduce_emulation import one_shot_all_reduce_emulated
from fusedpar.testing.dist import TwinRankGroup
from fusedpar.testing.gpu import all_ranks_ok, world_group_or_skip
from fusedpar.testing.numerics import assert_close, poison_
from tests.profile import examples

# Half a unit in the last place of each output dtype, relative: the rounding of the final store.
_HALF_ULP = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


def _inputs(world_size: int, shape, dtype, seed: int) -> list[torch.Tensor]:
    """Per-rank random inputs, never all zeros, exactly representable in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=g) + 0.25).to(dtype) for _ in range(world_size)]


def _fp32_sequential(inputs: list[torch.Tensor]) -> torch.Tensor:
    """What the kernel computes: fp32 sum in rank order 0..W-1, before the final rounding."""
    acc = torch.zeros(inputs[0].shape, dtype=torch.float32)
    for x in inputs:
        acc += x.float()
    return acc


def _check_sum(outs: list[torch.Tensor], inputs: list[torch.Tensor], *, rounding_ulps: float = 1.0) -> None:
    """Every rank's output: finite, identical bits on all ranks, within the fp32-sum bound of the fp64 sum.

    Bound per element: rounding_ulps half-ulps of the output dtype (the final store) plus W fp32
    rounding errors of the partial sums, each at most 2^-24 * sum|x|.
    """
    dtype = inputs[0].dtype
    W = len(inputs)
    ref64 = torch.zeros(inputs[0].shape, dtype=torch.float64)
    abs_sum = torch.zeros(inputs[0].shape, dtype=torch.float64)
    for x in inputs:
        ref64 += x.double()
        abs_sum += x.double().abs()
    for r, out in enumerate(outs):
        assert out.shape == inputs[0].shape and out.dtype == dtype
        assert not out.isnan().any(), f"rank {r}: NaN in the output (an element was never written)"
        assert torch.equal(out, outs[0]), f"rank {r}'s result differs from rank 0's: ranks would diverge"
    atol = W * 2.0**-24 * float(abs_sum.max()) if abs_sum.numel() else 0.0
    assert_close(
        outs[0], ref64, dtype=dtype, name="one-shot sum", atol=atol, rtol=rounding_ulps * _HALF_ULP[dtype] * 1.0001
    )


def _poisoned_like(inputs):
    return [poison_(torch.empty_like(x)) for x in inputs]


# --------------------------------------------------------------------------- CPU emulation


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("numel", [1, 7, 1000, 4099])
def test_one_shot_sums_every_rank(world_size, dtype, numel):
    world = EmulatedWorld(world_size, 64 * 1024)
    inputs = _inputs(world_size, (numel,), dtype, seed=numel * 10 + world_size)
    outs = one_shot_all_reduce_emulated(world, inputs, outs=_poisoned_like(inputs))
    _check_sum(outs, inputs)
    # Round-to-nearest of the fp32 sequential sum, bit for bit (fp16/fp32: the interpreter rounds
    # like the GPU).
    assert torch.equal(outs[0], _fp32_sequential(inputs).to(dtype))
    assert all(world[r].epoch() == 1 and world[r].status() == 0 for r in range(world_size))


@pytest.mark.parametrize("world_size", [2, 3])
def test_registered_op_runs_both_phases_in_one_launch(world_size):
    # "staggered": the last rank runs torch.ops.fusedpar.one_shot_all_reduce (copy-in, flags,
    # wait and reduce in one launch: the GPU code path) while its peers run phase by phase.
    world = EmulatedWorld(world_size, 16 * 1024)
    inputs = _inputs(world_size, (1000,), torch.float16, seed=7)
    outs = one_shot_all_reduce_emulated(world, inputs, outs=_poisoned_like(inputs), schedule="staggered")
    _check_sum(outs, inputs)


def test_bf16_within_one_ulp():
    # The interpreter rounds fp32 -> bf16 by truncation (GPUs round to nearest even), so allow a
    # full ulp here; the GPU test holds bf16 to half an ulp.
    world = EmulatedWorld(2, 16 * 1024)
    inputs = _inputs(2, (1000,), torch.bfloat16, seed=3)
    outs = one_shot_all_reduce_emulated(world, inputs, outs=_poisoned_like(inputs))
    _check_sum(outs, inputs, rounding_ulps=2.0 if INTERPRETED else 1.0)


def test_any_shape_and_strides_in_any_shape_out():
    world = EmulatedWorld(2, 16 * 1024)
    base = _inputs(2, (5, 3, 7), torch.float32, seed=11)
    inputs = [b.transpose(0, 2) for b in base]  # non-contiguous [7, 3, 5]
    outs = one_shot_all_reduce_emulated(world, inputs, outs=[poison_(torch.empty(7, 3, 5)) for _ in range(2)])
    _check_sum(outs, [x.contiguous() for x in inputs])


def test_consecutive_calls_alternate_slots_and_advance_epochs():
    W, n = 2, 600  # 3 tiles of 256 on 3 programs
    world = EmulatedWorld(W, 8 * 1024)
    slot = one_shot_capacity_bytes(world[0])
    calls = [_inputs(W, (n,), torch.float32, seed=100 + c) for c in range(3)]
    for c, inputs in enumerate(calls, start=1):
        outs = one_shot_all_reduce_emulated(world, inputs)
        _check_sum(outs, inputs)
        for r in range(W):
            assert world[r].epoch() == c
            # Launch with epoch c wrote slot c % 2 of its own buffer ...
            assert torch.equal(world[r].view(torch.float32, n, byte_offset=(c % 2) * slot), inputs[r])
            # ... and flag word [block, src] of every rank holds c for the 3 programs used.
            flags = world.signals[r].view(world[r].max_blocks, W)
            assert (flags[:3] == c).all() and not flags[3:].any()
        if c >= 2:  # the other slot still holds the previous call's data
            prev = calls[c - 2]
            for r in range(W):
                assert torch.equal(world[r].view(torch.float32, n, byte_offset=((c - 1) % 2) * slot), prev[r])


def test_double_buffering_protects_a_slow_reader():
    # Rank 0 finishes call 1 and starts call 2 (overwriting its buffer) before rank 1 has read
    # rank 0's call-1 data. With one buffer rank 1 would sum call-2 data; with epoch-parity slots
    # it must still see call 1.
    W, n = 2, 300
    world = EmulatedWorld(W, 8 * 1024)
    c1 = _inputs(W, (n,), torch.float16, seed=21)
    c2 = _inputs(W, (n,), torch.float16, seed=22)
    o1 = _poisoned_like(c1)
    o2 = _poisoned_like(c2)
    launch_one_shot_all_reduce(c1[0], world[0], o1[0], reduce=False)
    launch_one_shot_all_reduce(c1[1], world[1], o1[1], reduce=False)
    launch_one_shot_all_reduce(c1[0], world[0], o1[0], copy_in=False)  # rank 0 done with call 1
    launch_one_shot_all_reduce(c2[0], world[0], o2[0], reduce=False)  # rank 0 publishes call 2
    launch_one_shot_all_reduce(c1[1], world[1], o1[1], copy_in=False)  # slow rank 1 reads call 1
    _check_sum(o1, c1)
    launch_one_shot_all_reduce(c2[1], world[1], o2[1], reduce=False)
    launch_one_shot_all_reduce(c2[1], world[1], o2[1], copy_in=False)
    launch_one_shot_all_reduce(c2[0], world[0], o2[0], copy_in=False)
    _check_sum(o2, c2)
    assert [world[r].status() for r in range(W)] == [0, 0]


@pytest.mark.parametrize("use_flags", [True, False])
def test_flag_wait_really_gates_the_reduce(use_flags):
    # Rank 0 reduces before rank 1 has copied in. With flags the bounded spin of the interpreter
    # times out and says so; without flags rank 0 silently reads rank 1's poisoned (NaN) slot.
    world = EmulatedWorld(2, 8 * 1024)
    inputs = _inputs(2, (100,), torch.float32, seed=5)
    out = poison_(torch.empty(100))
    launch_one_shot_all_reduce(inputs[0], world[0], out, reduce=False, use_flags=use_flags)
    launch_one_shot_all_reduce(inputs[0], world[0], out, copy_in=False, use_flags=use_flags)
    if use_flags:
        assert world[0].status() == 1, "rank 0 passed its flag wait although rank 1 never signalled"
    else:
        assert world[0].status() == 0 and out.isnan().all()


def test_emulated_driver_reports_a_missing_flag():
    world = EmulatedWorld(2, 8 * 1024)
    inputs = _inputs(2, (100,), torch.float32, seed=6)
    # Ranks that disagree on the epoch (as if rank 1 had skipped a call) must not pass the wait:
    # rank 0 expects epoch 2, rank 1 only ever publishes epoch 1.
    world[0].counters[COUNTER_EPOCH] = 1
    with pytest.raises(RuntimeError, match="never came"):
        one_shot_all_reduce_emulated(world, inputs)


def test_flags_off_is_still_correct_when_phased():
    world = EmulatedWorld(4, 16 * 1024)
    inputs = _inputs(4, (777,), torch.float16, seed=8)
    outs = one_shot_all_reduce_emulated(world, inputs, outs=_poisoned_like(inputs), use_flags=False)
    _check_sum(outs, inputs)
    assert not any(s.any() for s in world.signals), "USE_FLAGS=False must not touch flag words"


def test_single_rank_op_inplace_and_out():
    t = EmulatedWorld(1, 8 * 1024)[0]
    x = _inputs(1, (333,), torch.float32, seed=9)[0]
    assert torch.equal(one_shot_all_reduce(x, t), x)
    y = x.clone()
    assert one_shot_all_reduce(y, t, out=y) is y and torch.equal(y, x)
    out = poison_(torch.empty(333))
    assert one_shot_all_reduce(x, t, out=out) is out and torch.equal(out, x)
    assert t.epoch() == 3
    assert one_shot_all_reduce(torch.empty(0), t).numel() == 0 and t.epoch() == 3


def test_registered_ops_pass_opcheck():
    t = EmulatedWorld(1, 8 * 1024)[0]
    x = _inputs(1, (100,), torch.float32, seed=10)[0]
    slot = one_shot_capacity_bytes(t)
    meta = (0, 1, slot, t.max_blocks, 256, 1, 4, True)
    torch.library.opcheck(
        torch.ops.fusedpar.one_shot_all_reduce.default, (x, t.buffer_ptrs, t.signal_ptrs, t.counters, *meta)
    )
    out = torch.empty(100)
    torch.library.opcheck(
        torch.ops.fusedpar.one_shot_all_reduce_out.default,
        (x, t.buffer_ptrs, t.signal_ptrs, t.counters, out, *meta),
    )


def test_traces_into_one_graph_node():
    t = EmulatedWorld(1, 8 * 1024)[0]
    x = _inputs(1, (100,), torch.float32, seed=12)[0]
    f = torch.compile(lambda a: one_shot_all_reduce(a, t) * 2.0, backend="aot_eager", fullgraph=True)
    assert torch.equal(f(x), x * 2.0)


def test_argument_errors():
    t = EmulatedWorld(2, 1024)[0]
    cap = one_shot_capacity_bytes(t)
    assert cap == 512
    with pytest.raises(ValueError, match="exceed"):
        one_shot_all_reduce(torch.ones(cap // 4 + 1), t)
    with pytest.raises(ValueError, match="supports"):
        one_shot_all_reduce(torch.ones(4, dtype=torch.int32), t)
    with pytest.raises(ValueError, match="out must match"):
        one_shot_all_reduce(torch.ones(4), t, out=torch.empty(5))
    with pytest.raises(ValueError, match="nothing to do"):
        launch_one_shot_all_reduce(torch.ones(4), t, torch.empty(4), copy_in=False, reduce=False)
    with pytest.raises(ValueError, match="inputs for 2 ranks"):
        one_shot_all_reduce_emulated(EmulatedWorld(2, 1024), [torch.ones(4)])


@settings(max_examples=examples(8), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    numel=st.integers(min_value=1, max_value=3000),
    world_size=st.sampled_from([2, 3, 4]),
    dtype=st.sampled_from([torch.float16, torch.float32]),
    schedule=st.sampled_from(["phased", "staggered"]),
    seed=st.integers(0, 2**16),
)
def test_one_shot_property_over_sizes(numel, world_size, dtype, schedule, seed):
    world = EmulatedWorld(world_size, 32 * 1024, max_blocks=3)  # slot 16 KiB >= 3000 fp32
    inputs = _inputs(world_size, (numel,), dtype, seed=seed)
    outs = one_shot_all_reduce_emulated(
        world, inputs, outs=_poisoned_like(inputs), schedule=schedule, config=OneShotConfig(128, 1, 8)
    )
    _check_sum(outs, inputs)


# ------------------------------------------------------------------- all_reduce size routing


def test_all_reduce_routes_small_messages_to_one_shot():
    world = EmulatedWorld(2, 16 * 1024)
    inputs = _inputs(2, (500,), torch.float32, seed=13)
    group = SimpleNamespace(size=2, pg=None)
    outs = _poisoned_like(inputs)
    launch_one_shot_all_reduce(inputs[1], world[1], outs[1], reduce=False)  # the peer's copy-in
    x0 = inputs[0].clone()
    outs[0] = all_reduce(x0, group, world[0])
    launch_one_shot_all_reduce(inputs[1], world[1], outs[1], copy_in=False)
    _check_sum(outs, inputs)
    assert torch.equal(x0, inputs[0]), "inplace=False must leave x untouched"
    assert world[0].epoch() == 1


def test_all_reduce_routes_large_messages_and_no_workspace_to_nccl():
    pg = TwinRankGroup()  # stands for NCCL: the process group's own allreduce, then wait()
    group = SimpleNamespace(size=2, pg=pg)
    world = EmulatedWorld(2, 4 * 1024)
    x = torch.randn(1000)  # 4000 bytes > one slot (2048)
    y = all_reduce(x, group, world[0])
    assert pg.calls[0] is y and y is not x and pg.calls[1:] == ["waited"] and torch.equal(y, 2 * x)
    small = torch.randn(10)
    y = all_reduce(small, group, world[0], options=AllReduceOptions(max_one_shot_bytes=16))  # over the threshold
    assert len(pg.calls) == 4 and torch.equal(y, 2 * small)
    z = small.clone()
    assert all_reduce(z, group, None, inplace=True) is z and torch.equal(z, 2 * small)
    assert pg.calls[-2] is z and pg.calls[-1] == "waited"
    assert world[0].epoch() == 0, "the NCCL path must not launch the one-shot kernel"


def test_nccl_fallback_is_synchronous_and_needs_no_work():
    """sum_over_group_ passes dist.all_reduce's synchronous options (asyncOp=False: NCCL runs it on
    the caller's stream instead of its own, fenced by events) and accepts NCCL's answer to them, no
    work object (calling wait() on NCCL's None answer failed before)."""
    pg = TwinRankGroup(returns_work=False)
    x = torch.randn(33)
    y = ar.sum_over_group_(x.clone(), pg)
    assert torch.equal(y, 2 * x) and pg.calls == [y]
    z = all_reduce(x, SimpleNamespace(size=2, pg=pg), None)
    assert torch.equal(z, 2 * x) and pg.calls[-1] is z


def test_all_reduce_size_one_and_mismatched_workspace():
    x = torch.randn(5)
    y = all_reduce(x, SimpleNamespace(size=1, pg=None))
    assert torch.equal(y, x) and y is not x
    assert all_reduce(x, SimpleNamespace(size=1, pg=None), inplace=True) is x
    with pytest.raises(ValueError, match="spans 2 ranks"):
        all_reduce(x, SimpleNamespace(size=4, pg=None), EmulatedWorld(2, 1024)[0])


# --------------------------------------------------------------------------- GPU (torchrun)


@pytest.fixture(scope="module")
def gpu_world(nccl_world):
    """The WORLD process group (NCCL, from tests/conftest.py's torchrun session), or a clean skip."""
    return world_group_or_skip(nccl_world)


@pytest.fixture(scope="module")
def gpu_workspace(gpu_world):
    return SymmetricWorkspace(gpu_world, 4 << 20)  # two 2 MiB slots


def _gpu_check(out: torch.Tensor, x: torch.Tensor, what: str) -> str | None:
    """None if `out` is this rank's one-shot result for inputs x (all ranks); else a message."""
    import torch.distributed as dist

    W = dist.get_world_size()
    gathered = [torch.empty_like(x) for _ in range(W)]
    dist.all_gather(gathered, x)
    outs = [torch.empty_like(out) for _ in range(W)]
    dist.all_gather(outs, out)
    nccl = x.clone()
    dist.all_reduce(nccl)
    inputs = [g.cpu() for g in gathered]
    try:
        _check_sum([o.cpu() for o in outs], inputs)
    except AssertionError as e:
        return f"{what}: {e}"
    # NCCL rounds each partial sum to the input dtype (W-1 roundings, each at most half an ulp of
    # a partial sum <= sum|x|): same sum, bounded distance, checked elementwise.
    abs_sum = torch.stack([t.double().abs() for t in inputs]).sum(0)
    diff = (out.cpu().double() - nccl.cpu().double()).abs()
    allowed = _HALF_ULP[x.dtype] * (2 * nccl.cpu().double().abs() + W * abs_sum) + 1e-30
    if not bool((diff <= allowed).all()):
        i = int((diff - allowed).argmax())
        return f"{what}: differs from NCCL at {i}: ours {out.reshape(-1)[i].item()} NCCL {nccl.reshape(-1)[i].item()}"
    return None


def _rank_input(shape, dtype, salt: int) -> torch.Tensor:
    import torch.distributed as dist

    g = torch.Generator(device="cuda").manual_seed(1000 * dist.get_rank() + salt)
    return (torch.randn(shape, generator=g, device="cuda") + 0.25).to(dtype)


@pytest.mark.gpu
def test_gpu_one_shot_eager_matches_nccl(gpu_world, gpu_workspace):
    errors = []
    for numel in (1, 7, 4099, 8192, 65536, 262144, 1 << 20):  # up to 2 MiB bf16 (one full slot)
        x = _rank_input((numel,), torch.bfloat16, salt=numel)
        out = one_shot_all_reduce(x, gpu_workspace)
        err = _gpu_check(out, x, f"eager numel={numel}")
        if err:
            errors.append(err)
    x = _rank_input((64, 8192), torch.float16, salt=1)
    err = _gpu_check(one_shot_all_reduce(x, gpu_workspace), x, "eager fp16 [64, 8192]")
    if err:
        errors.append(err)
    assert all_ranks_ok(not errors), "\n".join(errors)


@pytest.mark.gpu
def test_gpu_kernel_uses_vector_loads_and_system_scope_atomics(gpu_world, gpu_workspace):
    x = _rank_input((8192,), torch.bfloat16, salt=2)
    out = torch.empty_like(x)
    compiled = launch_one_shot_all_reduce(x, gpu_workspace.table, out)
    torch.cuda.synchronize()
    ptx = compiled.asm["ptx"]
    problems = [
        what
        for what, needle in (
            ("16-byte vector loads", ".v4"),
            ("system-scope atomics", ".sys"),
            ("acquire", "acquire"),
            ("release", "release"),
        )
        if needle not in ptx
    ]
    assert all_ranks_ok(not problems), f"PTX lacks: {problems}"


@pytest.mark.gpu
def test_gpu_one_shot_in_cuda_graph(gpu_world, gpu_workspace):
    # 10 calls of two sizes (different grids) captured once, replayed with fresh inputs: the
    # device-side epoch must advance 11 per replay (10 + one call with an output allocated in
    # capture) and every output must be right each time.
    sizes = [4096 if i % 2 else 3 * 8192 + 5 for i in range(10)]
    xs = [_rank_input((n,), torch.bfloat16, salt=i) for i, n in enumerate(sizes)]
    outs = [torch.empty_like(x) for x in xs]
    for x, out in zip(xs, outs, strict=True):  # compile outside capture
        one_shot_all_reduce(x, gpu_workspace, out=out)
    torch.cuda.synchronize()
    epoch0 = gpu_workspace.table.epoch()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, out in zip(xs, outs, strict=True):
            one_shot_all_reduce(x, gpu_workspace, out=out)
        allocated = one_shot_all_reduce(xs[0], gpu_workspace)  # out allocated inside capture
    torch.cuda.synchronize()
    errors = []
    for rep in range(3):
        for i, x in enumerate(xs):
            x.copy_(_rank_input(x.shape, x.dtype, salt=100 * (rep + 1) + i))
        graph.replay()
        torch.cuda.synchronize()
        for i, (x, out) in enumerate(zip(xs, outs, strict=True)):
            err = _gpu_check(out, x, f"graph replay {rep} call {i}")
            if err:
                errors.append(err)
        err = _gpu_check(allocated, xs[0], f"graph replay {rep} allocated out")
        if err:
            errors.append(err)
        want = epoch0 + 11 * (rep + 1)
        if gpu_workspace.table.epoch() != want:
            errors.append(f"epoch {gpu_workspace.table.epoch()} after replay {rep}, want {want}")
    assert all_ranks_ok(not errors), "\n".join(errors[:5])


@pytest.mark.gpu
def test_gpu_all_reduce_routes_by_size(gpu_world, gpu_workspace):
    """One-shot for small messages only as a CUDA graph would run it (eager, NCCL's launch is
    cheaper); NCCL above the routing table's all_reduce_one_shot_max_bytes either way; and inside
    a real capture."""
    errors = []
    # (numel, route as captured, expect one-shot): 8 KiB and 2 MiB of bf16
    for numel, captured, one_shot in ((4096, False, False), (4096, True, True), (1 << 20, True, False),
                                      (1 << 20, False, False)):
        x = _rank_input((numel,), torch.bfloat16, salt=numel + 7 + captured)
        before = gpu_workspace.table.epoch()
        if captured:
            with routing_as_captured():
                out = all_reduce(x, gpu_world, gpu_workspace)
        else:
            out = all_reduce(x, gpu_world, gpu_workspace)
        torch.cuda.synchronize()
        what = f"numel={numel} as_captured={captured}"
        if (gpu_workspace.table.epoch() == before + 1) != one_shot:
            errors.append(f"{what}: expected one_shot={one_shot}")
        if one_shot:
            err = _gpu_check(out, x, f"all_reduce {what}")
        else:
            # Routed to NCCL, which accumulates in bf16 (no fp32 bound applies): it must be
            # exactly what a plain NCCL all-reduce returns.
            nccl = x.clone()
            torch.distributed.all_reduce(nccl)
            err = None if torch.equal(out, nccl) else f"{what}: NCCL route differs from NCCL"
        if err:
            errors.append(err)
    # A real capture routes an 8 KiB message to the one-shot: one epoch per replay, right sums.
    x = _rank_input((4096,), torch.bfloat16, salt=99)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), routing_as_captured():
        all_reduce(x, gpu_world, gpu_workspace)  # warm-up: the kernel the capture launches is compiled
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_out = all_reduce(x, gpu_world, gpu_workspace)
    before = gpu_workspace.table.epoch()
    poison_(captured_out)
    graph.replay()
    torch.cuda.synchronize()
    if gpu_workspace.table.epoch() != before + 1:
        errors.append(f"captured replay: epoch {gpu_workspace.table.epoch()}, want {before + 1} (one-shot)")
    err = _gpu_check(captured_out, x, "all_reduce in a captured graph")
    if err:
        errors.append(err)
    assert all_ranks_ok(not errors), "\n".join(errors)
    assert routing.thresholds(x.device, gpu_world.size()).all_reduce_one_shot_max_bytes == 256 * 1024
