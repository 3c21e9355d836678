"""Per-rank KV pools behind vLLM's one `Scheduler.kv_cache_manager` (the "dp{P}" layout).

A DP request needs all kv heads of its tokens on its own rank: P times the bytes of a TP block.
DP block d of rank r is TP blocks [P d, P d + P) of rank r's buffer (a zero-copy view with all kv
heads, the same block size in tokens: dp_runner.dp_kv_view), so each rank's buffer of N TP blocks
holds a pool of N / P DP blocks. `RoutingKVCacheManager` holds one vLLM `KVCacheManager` per rank,
each over N / P blocks with ids in [0, N / P) (its own null block 0), and routes every call the
scheduler makes by the request it names, through the scheduler's placement (request id -> rank).
Calls that name no request either visit every pool (new_step_starts, take_events, usage) or read
configuration every pool shares (coordinator's block sizes). A call this class does not know is an
AttributeError naming it (so getattr(..., default) still works), never a silent answer from one pool.

Block ids are pool-local and mean DP blocks; the worker of the owning rank reads them through the DP
view, so slot mapping, block tables and hashes keep vLLM's meaning. The ids vLLM wants zeroed are
kept per rank (`take_new_block_ids_by_rank`): the scheduler puts them in the step's tag.
"""

from __future__ import annotations

from collections.abc import Mapping

# attributes every pool has alike (configuration, empty results): read from pool 0
_SHARED = ("empty_kv_cache_blocks", "kv_cache_config", "num_kv_cache_groups", "enable_caching", "log_stats",
           "max_model_len", "mamba_shared_prefix_checkpoint", "retained_hit_group_ids", "watermark_blocks",
           "kv_cache_event_metadata", "create_kv_cache_blocks", "truncate_computed_blocks", "use_eagle")


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
            return getattr(self._owner.pools[0].coordinator, name)
        raise AttributeError(f"fusedpar DP: vLLM read kv_cache_manager.coordinator.{name}, which the per-rank KV "
                           "pools do not route")


class RoutingKVCacheManager:
    """One vLLM KVCacheManager per rank, behind the interface the scheduler calls (module docstring).

    pools: the managers, pool r on rank r; placement: request id -> rank (the scheduler's, read live).
    """

    def __init__(self, pools: list, placement: Mapping[str, int]):
        self.pools = pools
        self.placement = placement
        self.coordinator = _RoutingCoordinator(self)

    def pool_of(self, request_id: str):
        rank = self.placement.get(request_id)
        if rank is None:
            raise RuntimeError(f"fusedpar DP: request {request_id!r} has no rank (it was never placed)")
        return self.pools[rank]

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
        return self.pool_of(running_request_id).get_num_common_prefix_blocks(running_request_id)

    # ---- every pool ------------------------------------------------------------------------------
    def new_step_starts(self) -> None:
        for pool in self.pools:
            pool.new_step_starts()

    def take_events(self) -> list:
        return [e for pool in self.pools for e in pool.take_events()]

    @property
    def usage(self) -> float:
        return sum(pool.usage for pool in self.pools) / len(self.pools)

    def make_prefix_cache_stats(self):
        stats = [pool.make_prefix_cache_stats() for pool in self.pools]
        return stats[0]  # prefix caching is off with a DP layout: every pool's are empty

    def reset_prefix_cache(self) -> bool:
        return all([pool.reset_prefix_cache() for pool in self.pools])

    def take_new_block_ids(self) -> list[int]:
        """vLLM's flat list for the SchedulerOutput: empty, since ids mean nothing without their rank; the
        scheduler takes them per rank (take_new_block_ids_by_rank) into the step's tag."""
        return []

    def take_new_block_ids_by_rank(self) -> dict[int, list[int]]:
        return {r: ids for r, pool in enumerate(self.pools) if (ids := pool.take_new_block_ids())}

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
            return getattr(self.pools[0], name)
        raise AttributeError(f"fusedpar DP: vLLM used kv_cache_manager.{name}, which the per-rank KV pools do not "
                           "route (a feature refused with a DP layout, or a vLLM version this plugin does not know)")
