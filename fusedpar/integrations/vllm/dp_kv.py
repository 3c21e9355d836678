"""The KV pools behind vLLM's one `Scheduler.kv_cache_manager` in an engine with a "dp{P}" layout.

A DP request needs all kv heads of its tokens on its own rank: P times the bytes of a TP block.
DP block d of rank r is TP blocks [P d, P d + P) of rank r's buffer (a zero-copy view with all kv
heads, the same block size in tokens: dp_runner.dp_kv_view). `KVSplit` divides each rank's buffer of
N TP blocks into disjoint id ranges: with a TP/SP class (policies "priority", "load", "auto") the TP pool holds TP
blocks [0, T) of every rank and the DP pools DP blocks [T / P, N / P); without one (policy "dp") the
DP pools hold the whole buffer. `RoutingKVCacheManager` holds one vLLM `KVCacheManager` per DP rank
(ids [0, N_dp), its own null block 0, DP blocks dp_offset + id of the buffer) and, with the TP/SP
class, one over the T TP blocks (ids are TP block ids as vLLM means them), and routes every call the
scheduler makes by the request it names, through the scheduler's placement (request id -> rank, or
TP_CLASS). A request stays in its pool for its life: prefix hits and allocations never cross pools.
Calls that name no request either visit every pool (new_step_starts, take_events, usage) or read
configuration every pool shares (coordinator's block sizes). A call this class does not know is an
AttributeError naming it (so getattr(..., default) still works), never a silent answer from one pool.

Block ids of a DP pool are pool-local and mean DP blocks; the worker of the owning rank adds the DP
pools' offset (dp_worker.own_output) and reads them through the DP view, so slot mapping, block
tables and hashes keep vLLM's meaning. The ids vLLM wants zeroed are kept per rank for the DP pools
(`take_new_block_ids_by_rank`: the scheduler puts them in the step's tag) and flat for the TP pool
(vLLM's own list in the SchedulerOutput).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .config import FusedparConfigError

TP_CLASS = -1  # the placement of a TP/SP-class request (DP ranks are 0 .. P - 1)

# attributes every pool has alike (configuration, empty results): read from pool 0
_SHARED = ("empty_kv_cache_blocks", "kv_cache_config", "num_kv_cache_groups", "enable_caching", "log_stats",
           "max_model_len", "mamba_shared_prefix_checkpoint", "retained_hit_group_ids", "watermark_blocks",
           "kv_cache_event_metadata", "create_kv_cache_blocks", "truncate_computed_blocks", "use_eagle")


@dataclass(frozen=True)
class KVSplit:
    """One rank's buffer of `total` TP blocks divided among the pools: the TP pool on TP blocks [0, tp_blocks)
    (0 without a TP/SP class), each DP pool on DP blocks [dp_offset, dp_offset + dp_blocks); size: P."""

    total: int
    size: int
    tp_blocks: int
    dp_blocks: int

    @property
    def dp_offset(self) -> int:
        return self.tp_blocks // self.size

    @classmethod
    def of(cls, num_blocks: int, size: int, *, tp_class: bool) -> KVSplit:
        """Half the buffer for the TP pool (rounded down to whole DP blocks), the rest for the DP pools, when
        there is a TP/SP class (equal token capacity: a TP block holds block_size tokens of all P ranks, a DP
        block the same tokens of one rank); else all of it for the DP pools. FusedparConfigError naming the
        block count when a pool would get fewer than 2 blocks (one is vLLM's null block) or the count is not
        divisible by P."""
        P = size
        tp_blocks = P * (num_blocks // (2 * P)) if tp_class else 0
        split = cls(num_blocks, P, tp_blocks, (num_blocks - tp_blocks) // P)
        problems = []
        if num_blocks % P:
            problems.append(f"the KV cache's block count ({num_blocks}) divisible by tensor_parallel_size={P} (a DP "
                            "block is P TP blocks)")
        if split.dp_blocks < 2:
            problems.append(f"at least 2 DP blocks per rank (one is vLLM's null block), got {split.dp_blocks} of "
                            f"{num_blocks} TP blocks")
        if tp_class and tp_blocks < 2:
            problems.append(f"at least 2 TP blocks for the TP/SP class's pool (half the buffer), got {tp_blocks} of "
                            f"{num_blocks}")
        if problems:
            raise FusedparConfigError("fusedpar cannot run this engine: the DP layout needs " + "; ".join(problems))
        return split


class KVTooLargeError(ValueError):
    """A request whose full KV need no pool of the engine can ever hold, refused when the engine admits it."""


def outgrows_dp_pool(split: KVSplit, block_size: int, request_id: str, prompt_tokens: int, max_tokens: int,
                     max_model_len: int) -> bool:
    """Whether a request's full KV need (prompt_tokens + max_tokens, at most max_model_len, in blocks of
    block_size tokens) is more than one DP pool can ever hold (its blocks but vLLM's null block): such a
    request must be served where the ranks pool their memory, the TP/SP class. KVTooLargeError naming the
    request, its need and the capacity of every pool when none can hold it (an engine without a TP/SP class,
    or a TP pool too small as well)."""
    tokens = min(prompt_tokens + max_tokens, max_model_len)
    need = -(-tokens // block_size)
    dp_capacity = split.dp_blocks - 1
    if need <= dp_capacity:
        return False
    tp_capacity = split.tp_blocks - 1 if split.tp_blocks else 0
    if split.tp_blocks and need <= tp_capacity:
        return True
    pools = (f"one DP pool holds {dp_capacity} blocks ({dp_capacity * block_size} tokens)")
    if split.tp_blocks:
        pools += f" and the TP/SP class's pool {tp_capacity} blocks ({tp_capacity * block_size} tokens)"
        fix = "give the engine more KV cache or lower max_tokens"
    else:
        pools += "; policy \"dp\" has no TP/SP class to pool the ranks' memory"
        fix = 'give the engine more KV cache, lower max_tokens, or use policy "priority" or "load"'
    raise KVTooLargeError(
        f"fusedpar DP: request {request_id!r} needs KV for {tokens} tokens (prompt {prompt_tokens} + max_tokens "
        f"{max_tokens}, at most max_model_len={max_model_len}) = {need} blocks of {block_size} tokens, but {pools}; "
        f"{fix}")


class _RoutingCoordinator:
    """`kv_cache_manager.coordinator` as the scheduler and engine core read it: shared configuration from
    pool 0, per-request questions routed."""

    def __init__(self, owner: RoutingKVCacheManager):
        self._owner = owner

    def get_num_blocks_to_allocate(self, *, request_id: str, **kwargs):
        return self._owner.pool_of(request_id).coordinator.get_num_blocks_to_allocate(request_id=request_id,
                                                                                        **kwargs)

    def __getattr__(self, name):
        if name in ("single_type_managers", "enable_partial_hash_hits", "eagle_group_ids", "block_size",
                    "num_reprefillable_tokens"):
            return getattr(self._owner.dp_pools[0].coordinator, name)
        raise AttributeError(f"fusedpar DP: vLLM read kv_cache_manager.coordinator.{name}, which the per-rank KV "
                           "pools do not route")


class RoutingKVCacheManager:
    """One vLLM KVCacheManager per DP rank and one for the TP/SP class, behind the interface the scheduler
    calls (module docstring).

    dp_pools: the DP ranks' managers, pool r on rank r; placement: request id -> rank or TP_CLASS (the
    scheduler's, read live); tp_pool: the TP/SP class's manager, None without the class.
    """

    def __init__(self, dp_pools: list, placement: Mapping[str, int], tp_pool=None):
        self.dp_pools = dp_pools
        self.tp_pool = tp_pool
        self.pools = [*dp_pools, tp_pool] if tp_pool is not None else list(dp_pools)
        self.placement = placement
        self.coordinator = _RoutingCoordinator(self)

    def pool_of(self, request_id: str):
        rank = self.placement.get(request_id)
        if rank is None:
            raise RuntimeError(f"fusedpar DP: request {request_id!r} has no rank (it was never placed)")
        if rank == TP_CLASS:
            if self.tp_pool is None:
                raise RuntimeError(f"fusedpar DP: request {request_id!r} is in the TP/SP class of an engine without "
                                   "one")
            return self.tp_pool
        return self.dp_pools[rank]

    # ---- routed by request -----------------------------------------------------------------------
    def get_computed_blocks(self, request):
        return self.pool_of(request.request_id).get_computed_blocks(request)

    def allocate_slots(self, request, *args, **kwargs):
        return self.pool_of(request.request_id).allocate_slots(request, *args, **kwargs)

    def free(self, request) -> None:
        self.pool_of(request.request_id).free(request)

    def pop_blocks_for_free(self, request):
        return self.pool_of(request.request_id).pop_blocks_for_free(request)

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        self.pool_of(request.request_id).cache_blocks(request, num_computed_tokens)

    def estimate_cached_tokens(self, request) -> int:
        return self.pool_of(request.request_id).estimate_cached_tokens(request)

    def record_prefix_cache_stats(self, request, num_hits: int) -> None:
        self.pool_of(request.request_id).record_prefix_cache_stats(request, num_hits)

    def prefix_cache_lookup_enabled(self, request) -> bool:
        return self.pool_of(request.request_id).prefix_cache_lookup_enabled(request)

    def finalize_partial_tail_offloads(self, request):
        return self.pool_of(request.request_id).finalize_partial_tail_offloads(request)

    def get_blocks(self, request_id: str):
        return self.pool_of(request_id).get_blocks(request_id)

    def get_block_ids(self, request_id: str):
        return self.pool_of(request_id).get_block_ids(request_id)

    def get_block_ids_for_computed_tokens(self, request_id: str, **kwargs):
        return self.pool_of(request_id).get_block_ids_for_computed_tokens(request_id=request_id, **kwargs)

    def remove_skipped_blocks(self, request_id: str, *args, **kwargs) -> None:
        self.pool_of(request_id).remove_skipped_blocks(request_id, *args, **kwargs)

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        self.pool_of(request_id).record_blocks_for_zeroing(request_id, start_token)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """No block is common to every request of a step (vLLM's cascade-attention prefix): a step's requests span
        pools, prefix caching is off, and the request vLLM asks with (its first running one) may be of the class the
        step leaves out."""
        return [0] * self.dp_pools[0].num_kv_cache_groups

    # ---- every pool ------------------------------------------------------------------------------
    def new_step_starts(self) -> None:
        for pool in self.pools:
            pool.new_step_starts()

    def take_events(self) -> list:
        return [e for pool in self.pools for e in pool.take_events()]

    @property
    def usage(self) -> float:
        """Used blocks over all blocks, every pool's counted once (a TP block spans the ranks, a DP block is one
        rank's P TP blocks: both are block_size tokens of the buffer's P ranks)."""
        sizes = [pool.kv_cache_config.num_blocks for pool in self.pools]
        return sum(pool.usage * n for pool, n in zip(self.pools, sizes, strict=True)) / sum(sizes)

    def make_prefix_cache_stats(self):
        stats = [pool.make_prefix_cache_stats() for pool in self.pools]
        return stats[0]  # prefix caching is off with a DP layout: every pool's are empty

    def reset_prefix_cache(self) -> bool:
        return all([pool.reset_prefix_cache() for pool in self.pools])

    def take_new_block_ids(self) -> list[int]:
        """vLLM's flat list for the SchedulerOutput: the TP pool's (TP block ids, every rank zeroes them); the
        DP pools' ids mean nothing without their rank: the scheduler takes them per rank
        (take_new_block_ids_by_rank) into the step's tag."""
        return self.tp_pool.take_new_block_ids() if self.tp_pool is not None else []

    def take_new_block_ids_by_rank(self) -> dict[int, list[int]]:
        return {r: ids for r, pool in enumerate(self.dp_pools) if (ids := pool.take_new_block_ids())}

    def take_kv_cache_block_copies(self):
        copies, retained = [], []
        for pool in self.pools:
            c, kept = pool.take_kv_cache_block_copies()
            copies += c
            retained += kept
        if copies:
            raise RuntimeError(f"fusedpar DP: vLLM asked for {len(copies)} copy-on-write KV block copies, which the "
                               "per-rank pools cannot express (prefix caching is off with a DP layout)")
        return copies, retained

    def take_boundary_state_offloads(self) -> dict:
        merged: dict = {}
        for pool in self.pools:
            merged.update(pool.take_boundary_state_offloads())
        return merged

    def __getattr__(self, name):
        if name in _SHARED:
            return getattr(self.dp_pools[0], name)
        raise AttributeError(f"fusedpar DP: vLLM used kv_cache_manager.{name}, which the per-rank KV pools do not "
                           "route (a feature refused with a DP layout, or a vLLM version this plugin does not know)")
