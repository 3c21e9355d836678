"""Benchmark: live re-sharding between layouts (weights, KV) and the host KV tier, on P GPUs.

Llama-3-8B shape by default (32 layers, 32 q / 8 kv heads of 128, hidden 4096, MLP 14336, bf16);
W = world size, SP = (sp=W), TP = (tp=W), DP = (dp=W, one GPU per replica). Live sequences:
--seqs sequences of --tokens tokens. Four groups of records (bench names):

  reshard_switch   switch between declared layouts SP <-> TP: every rank holds the union of the
                   declared set's shards (holdings), so every target weight is a view (reshard_weight
                   finds it: weight_bytes_moved = 0) and the kv plan moves nothing. fused = that switch,
                   with each layout's views and each pair's kv plan built once beforehand (Declared; the
                   switch selects them); baseline = the same switch with only the source layout's shards
                   held (weight_plan's pieces, planned beforehand, fetched point to point over NCCL).
                   Both: wall time (device synchronised at both ends), with host_ms (until the call
                   returns) and device_ms (CUDA events) beside. No floor: roofline_pct null.
  reshard_kv       migrate_kv of the live sequences' KV, DP <-> TP, on CUDA through a symmetric staging
                   holding the busiest receiver's KV (exchange "push": rows stored straight from the
                   sender's pool into the receiver's staging; all_to_all_path_ms: the same migration
                   through NCCL's all-to-all, the path without a staging). baseline = NCCL all_to_all_single
                   moving as many bytes into each rank as the migration's busiest receiver gets, timed
                   in the same run; roofline = those bytes at the NCCL all-to-all bus bandwidth of a
                   256 MiB message (measured here) over the migration time. A second record per case
                   (baseline "re-prefill") times prefilling the same sequences in the target layout on
                   the plain stack (unfused torch + NCCL), where it fits (--no-prefill skips it).
                   op_split_ms: one more migration under torch.profiler, ms per op on rank 0 (kernel
                   time on CUDA): how the time divides between gathers, the exchange and the scatters;
                   host_split_ms: the same run's self CPU time per op (the host work feeding them).
  reshard_swap     host tier (fusedpar.layers.host_tier): swap_out of the live sequences under TP,
                   swap_in under TP, swap_in under DP (re-sharding through the host: heads fetched from
                   their writers). baseline = one plain torch copy of the same bytes (the busiest
                   rank's) between a device tensor and a pinned host tensor, same direction;
                   roofline_pct = baseline / fused * 100 (the plain copy's bandwidth is the floor);
                   op_split_ms as for reshard_kv (the row moves, the copies, the transfers).
  reshard_overlap  a loop of --gemms bf16 GEMMs (--gemm-n cubed) on the compute stream, alone (baseline)
                   and while a swap_out / a swap_in of the live sequences runs on the tier's side stream
                   (fused); both times from CUDA events on the compute stream around the GEMMs only.
                   speedup < 1 is the slowdown the swap causes; the swap's own time is in swap_ms.

Protocol: every sample starts after a device synchronisation and a barrier; median of --iters
samples per rank (after --warmup), max over ranks. State the samples change (caches, the tier) is
rebuilt before each sample, untimed.

Records (rank 0 writes --out, a JSON list) carry the keys of every benchmark (bench, case, tokens =
live tokens, world, gpu, baseline, baseline_ms, fused_ms, speedup = baseline_ms / fused_ms,
roofline_pct, torch, triton, commit, date, command) plus bytes, host_ms / device_ms, GB/s.

Usage (GPU machine, repo root):
    torchrun --nproc-per-node 4 perf/bench_reshard.py [--seqs 8 --tokens 2048] [--out perf/results/reshard.json]
    python perf/bench_reshard.py --smoke [--out /tmp/reshard.json]   # CPU: 2 gloo processes, tiny shapes
Without CUDA or torchrun (and without --smoke) it prints a message and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # setup, timing and records shared by the benchmarks
import shapes

_bench.add_repo_to_path()  # run as a script from anywhere

SMOKE = dict(layers=2, heads=8, kv_heads=2, head_dim=8, hidden=32, intermediate=64, seqs=4, tokens=9,
             block=4, iters=2, warmup=1, gemms=2, gemm_n=64)


class Env:
    """The rank's device, and timing that is max over ranks of per-rank medians."""

    def __init__(self, rank: int, world: int, device: torch.device, iters: int, warmup: int):
        self.rank, self.world, self.device, self.iters, self.warmup = rank, world, device, iters, warmup
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def max(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def time(self, fn: Callable[[], object], setup: Callable[[], object] | None = None) -> dict[str, float]:
        """{"wall", "host", "device"} ms of fn (setup untimed before each sample)."""
        samples: dict[str, list[float]] = {"wall": [], "host": [], "device": []}
        for i in range(self.warmup + self.iters):
            if setup is not None:
                setup()
            self.sync()
            dist.barrier()
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            if self.cuda:
                end.record()
            self.sync()
            t2 = time.perf_counter()
            if i >= self.warmup:
                samples["wall"].append((t2 - t0) * 1e3)
                samples["host"].append((t1 - t0) * 1e3)
                samples["device"].append(start.elapsed_time(end) if self.cuda else (t2 - t0) * 1e3)
        return {k: self.max(statistics.median(v)) for k, v in samples.items()}


def op_split_ms(env: Env, fn: Callable[[], object]) -> tuple[dict[str, float], dict[str, float]]:
    """One more call of fn under torch.profiler, on this rank: (op name -> its summed kernel time in ms
    on CUDA (CPU time on CPU), op name -> its self CPU time in ms), each with the ops above 1% of its
    total. Where a migration's time goes: the gathers, the exchange, the scatters, and the host work
    that feeds them."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.cuda else [])
    env.sync()
    dist.barrier()
    with profile(activities=acts) as prof:
        fn()
        env.sync()
    device, host = {}, {}
    for ev in prof.key_averages():
        us = ev.self_device_time_total if env.cuda else ev.self_cpu_time_total
        if us > 0:
            device[ev.key] = us / 1e3
        if ev.self_cpu_time_total > 0:
            host[ev.key] = ev.self_cpu_time_total / 1e3

    def top(d: dict[str, float]) -> dict[str, float]:
        total = sum(d.values())
        return {k: round(v, 4) for k, v in sorted(d.items(), key=lambda kv: -kv[1]) if v >= 0.01 * total}

    return top(device), top(host)


def _layouts(world: int):
    from fusedpar.layouts import ParallelLayout

    return {"sp": ParallelLayout(world, sp=world), "tp": ParallelLayout(world, tp=world), "dp": ParallelLayout(world)}


def _name(key: str, world: int) -> str:
    return f"{key}{world}"


def _held_weights(layouts, dims, rank: int, hidden: int, layers: int, env: Env, dtype):
    """Per layer, weight name -> Held: the union of `layouts`' shards of this rank (values irrelevant)."""
    from fusedpar.collectives.weight_reshard import Held
    from fusedpar.layouts import holdings
    from fusedpar.layouts.shards import WEIGHT_NAMES

    held = holdings(layouts, dims)[rank]
    dims_of = {name: layouts[0].weight_shards(dims).shard(rank, name).torch_dim for name in WEIGHT_NAMES}
    out = []
    for _ in range(layers):
        per = {}
        for name in WEIGHT_NAMES:
            size = sum(s.size for s in held[name])
            shape = (size, hidden) if dims_of[name] == 0 else (hidden, size)
            per[name] = Held(torch.empty(shape, dtype=dtype, device=env.device), held[name], dims_of[name])
        out.append(per)
    return out


def switch(weights, plan, target_map, rank: int) -> tuple[list, int]:
    """Every layer's every weight for the target layout: (tensors, bytes received)."""
    from fusedpar.collectives.weight_reshard import reshard_weight
    from fusedpar.layouts.shards import WEIGHT_NAMES

    got, received = [], 0
    for per in weights:
        for name in WEIGHT_NAMES:
            t, r = reshard_weight(name, rank, per[name], target_map.shard(rank, name).base, plan)
            got.append(t)
            received += r
    return got, received


class Declared:
    """What a switch among declared layouts needs, built once (as parallelize does): per layout the rank's
    weight tensors for it (views of the held union: reshard_weight moves nothing) and per ordered pair
    the KV plan of the live sequences. A switch selects them: no planning, no view derivation, and a KV
    migration only where the plan moves something (never between SP x TP splits of one replica)."""

    def __init__(self, layouts, weights, dims, rank: int, live: dict[int, tuple[int, int]]):
        from fusedpar.layouts import kv_plan, weight_plan

        self.views, self.moved = {}, {}
        for lay in layouts:
            self.views[lay], self.moved[lay] = switch(weights, weight_plan(layouts, lay, dims),
                                                      lay.weight_shards(dims), rank)
        self.kv = {(a, b): kv_plan(a, b, dims, live) for a in layouts for b in layouts if a != b}

    def switch(self, src, dst) -> tuple[list, int, int]:
        """(dst's weight tensors, weight bytes moved, kv moves)."""
        if self.kv[(src, dst)]:
            raise NotImplementedError("a switch that moves KV: measured by reshard_kv (migrate_kv)")
        return self.views[dst], self.moved[dst], 0


def measure_switch(env: Env, cfg: dict, dtype, common: dict, live_tokens: int) -> list[dict]:
    from fusedpar.layouts import ModelDims, weight_plan

    lays = _layouts(env.world)
    dims = ModelDims(cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["intermediate"])
    live = {s: (0, 0) for s in range(cfg["seqs"])}
    records = []
    for a, b in (("sp", "tp"), ("tp", "sp")):
        src, dst = lays[a], lays[b]
        res = {}
        # fused: both layouts declared, everything prebuilt; baseline: only src's shards held, the pieces
        # of dst fetched at the switch (weight_plan, a pure function of the layouts, computed ahead)
        weights = _held_weights([src, dst], dims, env.rank, cfg["hidden"], cfg["layers"], env, dtype)
        declared = Declared([src, dst], weights, dims, env.rank, live)
        got: list = [None]

        def fused(declared=declared, src=src, dst=dst, got=got):
            got[0] = declared.switch(src, dst)

        res["declared"] = env.time(fused)
        _, moved, kv_moves = got[0]
        res["declared"]["bytes"] = env.max(moved)
        del weights, declared, fused
        got.clear()
        _empty_cache(env)
        weights = _held_weights([src], dims, env.rank, cfg["hidden"], cfg["layers"], env, dtype)
        plan, fetched = weight_plan([src], dst, dims), [0]

        def undeclared(weights=weights, plan=plan, dst=dst, fetched=fetched):
            _, fetched[0] = switch(weights, plan, dst.weight_shards(dims), env.rank)

        res["undeclared"] = env.time(undeclared) | {"bytes": env.max(fetched[0])}
        del weights, undeclared
        _empty_cache(env)
        d, u = res["declared"], res["undeclared"]
        records.append({**common, "bench": "reshard_switch", "case": f"{_name(a, env.world)}->{_name(b, env.world)}",
                        "tokens": live_tokens, "baseline": f"undeclared switch ({_name(a, env.world)} shards held; "
                        "weight_plan pieces over the process group)",
                        "baseline_ms": u["wall"], "fused_ms": d["wall"], "speedup": u["wall"] / d["wall"],
                        "roofline_pct": None, "weight_bytes_moved": d["bytes"], "kv_moves": kv_moves,
                        "host_ms": d["host"], "device_ms": d["device"], "baseline_bytes_moved": u["bytes"],
                        "baseline_host_ms": u["host"], "baseline_device_ms": u["device"]})
    return records


def _kv_values(cfg: dict, seq: int, heads, dtype, device):
    """k, v [layers, tokens, len(heads), head_dim] of a sequence: the same values of a head whichever rank asks."""
    g = torch.Generator(device=device).manual_seed(7 + seq)
    shape = (cfg["layers"], cfg["tokens"], cfg["kv_heads"], cfg["head_dim"])
    idx = torch.tensor(list(heads), device=device)
    return tuple(torch.randn(shape, generator=g, device=device).to(dtype).index_select(2, idx) for _ in range(2))


def _pool(env: Env, cfg: dict, heads, num_blocks: int, dtype):
    from fusedpar.layers.kv_cache import PagedKVCache

    return PagedKVCache(num_layers=cfg["layers"], kv_heads=tuple(heads), head_dim=cfg["head_dim"],
                        block_size=cfg["block"], num_blocks=num_blocks, dtype=dtype, device=env.device)


def _fill(cache, cfg, seqs, dtype, env):
    for s in seqs:
        cache.fill(s, *_kv_values(cfg, s, cache.kv_heads, dtype, env.device))


def measure_kv(env: Env, cfg: dict, dtype, common: dict, link_bps: float, prefill: bool) -> list[dict]:
    from fusedpar.collectives.symmetric import SymmetricWorkspace
    from fusedpar.layers.kv_reshard import migrate_kv, push_staging_bytes
    from fusedpar.layouts import ModelDims, kv_plan

    lays, W = _layouts(env.world), env.world
    dims = ModelDims(cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["intermediate"])
    seqs = list(range(cfg["seqs"]))
    per_seq_blocks = -(-cfg["tokens"] // cfg["block"])
    # in 1-head blocks: a DP replica's sequences with every kv head, or every sequence with a TP rank's heads
    blocks = max(-(-len(seqs) // W) * cfg["kv_heads"], len(seqs) * max(1, cfg["kv_heads"] // W)) * per_seq_blocks
    blocks += cfg["kv_heads"]
    base = _pool(env, cfg, (0,), blocks, dtype)  # one pool, viewed per layout
    plans = {}
    for a, b in (("dp", "tp"), ("tp", "dp")):
        rep = {s: (s % lays[a].dp, s % lays[b].dp) for s in seqs}
        plans[a, b] = rep, kv_plan(lays[a], lays[b], dims, rep)
    # the staging the library's migration pushes through: the busiest receiver's KV of every layer
    per_token = 2 * cfg["layers"] * cfg["head_dim"] * torch.finfo(dtype).bits // 8
    tokens = dict.fromkeys(seqs, cfg["tokens"])
    most = max(push_staging_bytes(plan, tokens, W, per_token) for _, plan in plans.values())
    staging = SymmetricWorkspace(dist.group.WORLD, most) if env.cuda else None
    records = []
    for a, b in (("dp", "tp"), ("tp", "dp")):
        src, dst = lays[a], lays[b]
        rep, plan = plans[a, b]
        heads = src.head_placement(dims.num_q_heads, dims.num_kv_heads).kv_heads(env.rank, "base")
        target_heads = dst.head_placement(dims.num_q_heads, dims.num_kv_heads).kv_heads(env.rank, "base")
        sequences = {s: (src.coords(env.rank).dp == rep[s][0], dst.coords(env.rank).dp == rep[s][1], cfg["tokens"])
                     for s in seqs}
        state: dict = {}

        def setup(heads=heads, src=src, rep=rep, state=state):
            cache = base.reinterpret(heads)
            _fill(cache, cfg, [s for s in seqs if src.coords(env.rank).dp == rep[s][0]], dtype, env)
            state["cache"] = cache

        def fn(plan=plan, target_heads=target_heads, sequences=sequences, state=state, staging=staging):
            state["new"], state["received"] = migrate_kv(state["cache"], env.rank, plan, target_heads, sequences,
                                                         staging=staging)

        t = env.time(fn, setup)
        via_a2a = env.time(functools.partial(fn, staging=None), setup)["wall"] if staging is not None else None
        setup()
        split, host_split = op_split_ms(env, fn)
        # check (no assert: a benchmark reports): the migrated KV is the sequences' values
        ok = all(torch.equal(state["new"].gather(1, s)[0], _kv_values(cfg, s, target_heads, dtype, env.device)[0][1])
                 for s in seqs if sequences[s][1])
        received = env.max(state["received"])
        state.clear()
        # NCCL all-to-all moving `received` bytes into each rank
        n = max(W, int(received * W / max(W - 1, 1)) // 2 // W * W)
        send = torch.empty(n, dtype=torch.bfloat16, device=env.device)
        recv = torch.empty_like(send)
        a2a = env.time(lambda send=send, recv=recv: dist.all_to_all_single(recv, send))
        send = recv = None
        case = f"{_name(a, W)}->{_name(b, W)}"
        floor_ms = received / link_bps * 1e3
        rec = {**common, "bench": "reshard_kv", "case": case, "tokens": len(seqs) * cfg["tokens"],
               "baseline": "NCCL all_to_all_single of the same bytes per rank", "baseline_ms": a2a["wall"],
               "fused_ms": t["wall"], "speedup": a2a["wall"] / t["wall"], "roofline_pct": 100.0 * floor_ms / t["wall"],
               "bytes": received, "gbps": received / (t["wall"] * 1e-3) / 1e9,
               "a2a_gbps": received / (a2a["wall"] * 1e-3) / 1e9, "host_ms": t["host"], "device_ms": t["device"],
               "op_split_ms": split, "host_split_ms": host_split, "exchange": "push" if staging else "all_to_all",
               "all_to_all_path_ms": via_a2a,
               "values_ok": bool(env.max(0.0 if ok else 1.0) == 0.0)}
        records.append(rec)
        if prefill:
            try:
                pf, path = measure_prefill(env, cfg, dtype, dst, [s for s in seqs if sequences[s][1]])
                _empty_cache(env)
            except Exception as exc:  # unattended run: note it, keep the other records
                rec["reprefill_error"] = f"{type(exc).__name__}: {exc}"[:500]
                env.sync()
                dist.barrier()
            else:
                records.append({**rec, "baseline": f"re-prefill in {_name(b, W)} ({path}, eager)",
                                "baseline_ms": pf, "speedup": pf / t["wall"]})
    return records


def measure_prefill(env: Env, cfg: dict, dtype, layout, seqs: list[int]) -> tuple[float, str]:
    """(ms to prefill `seqs` (cfg tokens each) in `layout`, max over ranks; the stack's path). On CUDA the
    benchmarks' plain baseline (cuBLAS + NCCL, Triton attention: _bench.enable_stack(fused=False)); where
    that cannot be set up, and on CPU, the unfused torch stack."""
    from fusedpar.collectives import ParallelContext
    from fusedpar.layers import DecoderConfig, ShiftParallelStack, StepBatch, random_decoder_weights

    dc = DecoderConfig(hidden_size=cfg["hidden"], num_q_heads=cfg["heads"], num_kv_heads=cfg["kv_heads"],
                       head_dim=cfg["head_dim"], intermediate_size=cfg["intermediate"], rope_theta=500000.0)
    ctx = ParallelContext(layout, device=env.device)
    w = {k: v.to(dtype) for k, v in random_decoder_weights(dc, seed=3, device=env.device).items()}
    stack = ShiftParallelStack.from_full_weights(dc, ctx, [w] * cfg["layers"])
    del w
    n = len(seqs) * cfg["tokens"]
    path = "unfused torch stack"
    if env.cuda:
        try:
            _bench.enable_stack(stack, max_tokens=max(n, cfg["tokens"]), fused=False)
            path = "plain cuBLAS + NCCL stack, Triton attention"
        except Exception as exc:  # every rank fails alike (same shapes): go on unfused
            print(f"rank {env.rank}: re-prefill on the plain stack unavailable ({type(exc).__name__}: {exc})"[:300])
            torch.cuda.synchronize()
            dist.barrier()
    cache = stack.make_cache(block_size=cfg["block"], num_blocks=max(1, n // cfg["block"] + len(seqs)), dtype=dtype)
    x = torch.randn(max(n, 1), cfg["hidden"], device=env.device).to(dtype)[:n]
    batch = StepBatch(tuple(seqs), (cfg["tokens"],) * len(seqs), (0,) * len(seqs))

    def fn():
        if seqs:
            stack(x, batch, cache, mode="shift" if layout.sp == 1 else "base")

    def setup():
        for s in seqs:
            cache.free(s)

    return env.time(fn, setup)["wall"], path


def _plain_copy_ms(env: Env, nbytes: int, to_host: bool) -> float:
    nel = max(1, int(nbytes) // 2)
    dev = torch.empty(nel, dtype=torch.bfloat16, device=env.device)
    host = torch.empty(nel, dtype=torch.bfloat16, pin_memory=env.cuda)
    if to_host:
        return env.time(lambda: host.copy_(dev, non_blocking=True))["wall"]
    return env.time(lambda: dev.copy_(host, non_blocking=True))["wall"]


def measure_swap(env: Env, cfg: dict, dtype, common: dict) -> list[dict]:
    from fusedpar.layers.host_tier import HostKVTier

    lays, W = _layouts(env.world), env.world
    tp, dp = lays["tp"], lays["dp"]
    seqs = list(range(cfg["seqs"]))
    nb = -(-cfg["tokens"] // cfg["block"])
    tier = HostKVTier(rank=env.rank, world_size=W, num_layers=cfg["layers"], num_q_heads=cfg["heads"],
                      num_kv_heads=cfg["kv_heads"], head_dim=cfg["head_dim"], block_size=cfg["block"],
                      num_blocks=2 * len(seqs) * nb * cfg["kv_heads"] // W + 2 * cfg["kv_heads"], dtype=dtype,
                      device=env.device)
    tp_heads = tp.head_placement(cfg["heads"], cfg["kv_heads"]).kv_heads(env.rank, "base")
    dp_heads = dp.head_placement(cfg["heads"], cfg["kv_heads"]).kv_heads(env.rank, "base")
    base = _pool(env, cfg, (0,), len(seqs) * nb * cfg["kv_heads"] + cfg["kv_heads"], dtype)
    out_args = {s: (0, cfg["tokens"]) for s in seqs}
    state: dict = {}

    def fresh_tp():
        tier.drop(list(tier.sequences))
        state["cache"] = base.reinterpret(tp_heads)
        _fill(state["cache"], cfg, seqs, dtype, env)

    def swapped_out():
        fresh_tp()
        tier.swap_out(out_args, state["cache"], tp).synchronize()
        state["target"] = {"tp": base.reinterpret(tp_heads), "dp": base.reinterpret(dp_heads)}

    def out():
        tier.swap_out(out_args, state["cache"], tp).synchronize()

    def into(key, layout, replicas):
        def fn():
            tier.swap_in(replicas, state["target"][key], layout).synchronize()
        return fn

    block_bytes = tier.bytes_per_block
    fresh_tp()
    written = env.max(nb * block_bytes * sum(1 for s in seqs for h in tp_heads
                                             if tier.writer_map(tp, 0, s)[h] == env.rank))
    tier.drop(list(tier.sequences))
    in_tp = env.max(nb * block_bytes * len(tp_heads) * len(seqs))
    in_dp = env.max(nb * block_bytes * len(dp_heads) * sum(1 for s in seqs if s % W == env.rank))
    cases = [("swap_out tp", out, fresh_tp, written, True),
             ("swap_in tp", into("tp", tp, {s: 0 for s in seqs}), swapped_out, in_tp, False),
             (f"swap_in tp->dp{W}", into("dp", dp, {s: s % W for s in seqs}), swapped_out, in_dp, False)]
    records = []
    for case, fn, setup, nbytes, to_host in cases:
        direction = "device -> pinned host" if to_host else "pinned host -> device"
        t = env.time(fn, setup)
        setup()
        split, host_split = op_split_ms(env, fn)
        ok = True  # check (no assert: a benchmark reports): the last sample's swapped-in KV is the sequences'
        if not to_host:
            key = "dp" if "dp" in case else "tp"
            target = state["target"][key]
            ok = all(torch.equal(target.gather(0, s)[1], _kv_values(cfg, s, target.kv_heads, dtype, env.device)[1][0])
                     for s in target.block_tables)
        plain = _plain_copy_ms(env, nbytes, to_host)
        records.append({**common, "bench": "reshard_swap", "case": case.replace("tp", f"tp{W}", 1),
                        "tokens": len(seqs) * cfg["tokens"],
                        "baseline": "plain torch copy of the same bytes, " + direction,
                        "baseline_ms": plain, "fused_ms": t["wall"], "speedup": plain / t["wall"],
                        "roofline_pct": 100.0 * plain / t["wall"], "bytes": nbytes,
                        "gbps": nbytes / (t["wall"] * 1e-3) / 1e9, "plain_gbps": nbytes / (plain * 1e-3) / 1e9,
                        "host_ms": t["host"], "device_ms": t["device"], "op_split_ms": split,
                        "host_split_ms": host_split, "values_ok": bool(env.max(0.0 if ok else 1.0) == 0.0)})
    # the overlap of a swap with a GEMM loop on the compute stream
    n = cfg["gemm_n"]
    a = torch.randn(n, n, device=env.device).to(torch.bfloat16 if env.cuda else torch.float32)
    gemm_times: list[float] = []

    def gemms():
        if env.cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
        t0 = time.perf_counter()
        for _ in range(cfg["gemms"]):
            torch.matmul(a, a)
        if env.cuda:
            e.record()
            e.synchronize()
            gemm_times.append(s.elapsed_time(e))
        else:
            gemm_times.append((time.perf_counter() - t0) * 1e3)

    def gemm_ms(fn, setup=None) -> tuple[float, float]:
        gemm_times.clear()
        wall = env.time(fn, setup)["wall"]
        return env.max(statistics.median(gemm_times[env.warmup:])), wall

    alone, _ = gemm_ms(gemms)
    swaps = {"swap_out": (lambda: tier.swap_out(out_args, state["cache"], tp), fresh_tp),
             "swap_in": (lambda: tier.swap_in({s: 0 for s in seqs}, state["target"]["tp"], tp), swapped_out)}
    for name, (swap, setup) in swaps.items():
        def fn(swap=swap):
            handle = swap()
            gemms()
            handle.synchronize()

        with_swap, wall = gemm_ms(fn, setup)
        swap_alone = env.time(lambda swap=swap: swap().synchronize(), setup)["wall"]
        records.append({**common, "bench": "reshard_overlap", "case": f"gemm || {name} tp{W}",
                        "tokens": len(seqs) * cfg["tokens"], "baseline": f"{cfg['gemms']} GEMMs {n}^3 alone",
                        "baseline_ms": alone, "fused_ms": with_swap, "speedup": alone / with_swap,
                        "roofline_pct": 100.0 * alone / with_swap, "swap_ms": swap_alone, "wall_ms": wall})
    tier.drop(list(tier.sequences))
    state.clear()
    return records


def run(rank: int, world: int, args: dict) -> list[dict]:
    """Every record of this run (each rank computes the same list; rank 0's is written)."""
    device = torch.device("cuda", torch.cuda.current_device()) if not args["smoke"] else torch.device("cpu")
    cfg = dict(SMOKE) if args["smoke"] else dict(
        layers=args["layers"], heads=args["shape"].heads, kv_heads=args["shape"].kv_heads,
        head_dim=args["shape"].head_dim, hidden=args["shape"].hidden, intermediate=args["shape"].intermediate,
        seqs=args["seqs"], tokens=args["tokens"], block=16, iters=args["iters"], warmup=args["warmup"],
        gemms=args["gemms"], gemm_n=args["gemm_n"])
    env = Env(rank, world, device, cfg["iters"], cfg["warmup"])
    dtype = torch.float32 if args["smoke"] else torch.bfloat16
    link_bps = _link_bps(env, 1 << 16 if args["smoke"] else _bench.LINK_BYTES)
    common = {"world": world, "gpu": torch.cuda.get_device_name() if env.cuda else "cpu",
              **_bench.run_info(None if args["smoke"] else world), "model": args["model_name"],
              "layers": cfg["layers"], "link_gbps": link_bps / 1e9}
    records = measure_switch(env, cfg, dtype, common, cfg["seqs"] * cfg["tokens"])
    _empty_cache(env)
    records += measure_kv(env, cfg, dtype, common, link_bps, prefill=not args["no_prefill"])
    _empty_cache(env)
    records += measure_swap(env, cfg, dtype, common)
    _empty_cache(env)
    return records


def _empty_cache(env: Env) -> None:
    if env.cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _link_bps(env: Env, nbytes: int) -> float:
    """All-to-all bus bandwidth (bytes into a rank from its peers per second) of an nbytes message per rank."""
    send = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=env.device)
    recv = torch.empty_like(send)
    ms = env.time(lambda: dist.all_to_all_single(recv, send))["wall"]
    return (env.world - 1) / env.world * nbytes / (ms * 1e-3)


def _smoke_worker(rank: int, world: int, args: dict) -> list[dict]:
    return run(rank, world, args)


def _print(records: list[dict]) -> None:
    print(f"{'bench':<16}{'case':<22}{'baseline ms':>12}{'fused ms':>10}{'speedup':>9}{'%roof':>7}  baseline")
    for r in records:
        roof = "-" if r["roofline_pct"] is None else f"{r['roofline_pct']:.0f}%"
        print(f"{r['bench']:<16}{r['case']:<22}{r['baseline_ms']:>12.3f}{r['fused_ms']:>10.3f}{r['speedup']:>9.2f}"
              f"{roof:>7}  {r['baseline']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama8b", help="a perf/shapes.py key")
    p.add_argument("--layers", type=int, default=None, help="default: the model's")
    p.add_argument("--seqs", type=int, default=8, help="live sequences")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per live sequence")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gemms", type=int, default=40, help="GEMMs per overlap sample")
    p.add_argument("--gemm-n", type=int, default=8192)
    p.add_argument("--no-prefill", action="store_true", help="skip the re-prefill baseline")
    p.add_argument("--smoke", action="store_true", help="CPU, 2 gloo processes, tiny shapes (seconds)")
    p.add_argument("--world", type=int, default=2, help="--smoke processes")
    p.add_argument("--out", default="perf/results/reshard.json")
    a = p.parse_args(argv)
    shape = shapes.shape(a.model)
    args = {"smoke": a.smoke, "shape": shape, "model_name": shape.name, "layers": a.layers or shape.layers,
            "seqs": a.seqs, "tokens": a.tokens, "iters": a.iters, "warmup": a.warmup, "gemms": a.gemms,
            "gemm_n": a.gemm_n, "no_prefill": a.no_prefill}
    if a.smoke:
        from fusedpar.testing.dist import run_distributed

        records = run_distributed(_smoke_worker, a.world, args, timeout=300)[0]
    elif _bench.torchrun_available():
        _, rank, world = _bench.init_distributed()
        records = run(rank, world, args)
        if rank != 0:
            _bench.finish_distributed()
            return 0
    else:
        print("bench_reshard: needs CUDA GPUs and torchrun (torchrun --nproc-per-node N ...), or --smoke; skipped")
        return 0
    _print(records)
    _bench.write_records(records, a.out)
    if not a.smoke:
        _bench.finish_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
