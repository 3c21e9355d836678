"""The scheduler of an engine whose every step is a DP step (layout "dp{P}", policy "dp").

`DPScheduler` is vLLM's Scheduler with
  - placement: the i-th request the engine admits is served by rank i % P for its whole life;
  - per-rank KV pools: `kv_cache_manager` is a dp_kv.RoutingKVCacheManager of P managers over N / P
    DP blocks each (N: vLLM's TP block count, the same on every rank), so vLLM's scheduling runs once
    per step over all requests and every allocation lands in the pool of the request's rank;
  - the step's tag: each SchedulerOutput carries `fusedpar_dp` (a DPTag: the rank of every scheduled
    request, and the new DP blocks each rank must zero), pickled with it to the workers, which keep
    their own requests (dp_worker.py);
  - no preemption: vLLM preempts by recompute and picks its victim among all running requests, which
    with per-rank pools may be on another rank than the full pool; in this version a preemption is an
    error (give the engine more KV cache or fewer concurrent requests).
The token budget (max_num_batched_tokens) and max_num_seqs stay engine-wide, as in TP.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.scheduler import Scheduler

from .config import FusedparConfigError
from .dp_kv import RoutingKVCacheManager

TAG = "fusedpar_dp"


@dataclass(frozen=True)
class DPTag:
    """What a DP step tells the workers beyond vLLM's SchedulerOutput.

    ranks: request id -> rank for every request scheduled in the step; zero: rank -> the DP block ids
    of that rank's pool that vLLM wants zeroed before the step (each is P TP blocks on that rank);
    size: P."""

    ranks: dict[str, int]
    size: int
    zero: dict[int, list[int]] = field(default_factory=dict)


class DPScheduler(Scheduler):
    """vLLM's Scheduler with per-rank placement and KV pools (see the module docstring)."""

    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs):
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        P = vllm_config.parallel_config.tensor_parallel_size
        n = kv_cache_config.num_blocks
        if n % P or n // P < 2:
            raise FusedparConfigError(
                f"fusedpar cannot run this engine: the DP layout needs the KV cache's block count ({n}) divisible "
                f"by tensor_parallel_size={P} with at least 2 DP blocks per rank (one is vLLM's null block)")
        self.dp_size = P
        self.placement: dict[str, int] = {}
        self._admitted = 0
        pool_config = dataclasses.replace(kv_cache_config, num_blocks=n // P)
        pools = [self._make_pool(pool_config) for _ in range(P)]
        self.kv_cache_manager = RoutingKVCacheManager(pools, self.placement)

    def _make_pool(self, kv_cache_config) -> KVCacheManager:
        # the arguments of vLLM's own manager (Scheduler.__init__), on one rank's N / P DP blocks
        return KVCacheManager(
            kv_cache_config=kv_cache_config,
            max_model_len=self.max_model_len,
            max_in_flight_tokens=self.vllm_config.max_in_flight_tokens,
            enable_caching=False,
            use_eagle=self.use_eagle_block_drop,
            num_prefill_lookahead=self.num_prefill_lookahead,
            log_stats=self.log_stats,
            enable_kv_cache_events=self.enable_kv_cache_events,
            dcp_world_size=self.dcp_world_size,
            pcp_world_size=1,
            scheduler_block_size=self.block_size,
            hash_block_size=self.hash_block_size,
            metrics_collector=self.kv_metrics_collector,
            watermark=self.scheduler_config.watermark,
        )

    def add_request(self, request) -> None:
        if request.request_id not in self.placement and request.request_id not in self.requests:
            self.placement[request.request_id] = self._admitted % self.dp_size
            self._admitted += 1
        super().add_request(request)

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        zero = self.kv_cache_manager.take_new_block_ids_by_rank()
        tag = DPTag(ranks={rid: self.placement[rid] for rid in out.num_scheduled_tokens}, size=self.dp_size,
                    zero=zero if self.needs_kv_cache_zeroing else {})
        setattr(out, TAG, tag)
        return out

    def _preempt_request(self, request, *args, **kwargs) -> None:
        pools = self.kv_cache_manager.pools
        raise RuntimeError(
            f"fusedpar DP: vLLM would preempt request {request.request_id} (rank "
            f"{self.placement.get(request.request_id)}); preemption with per-rank KV pools is not supported "
            f"in this version. KV usage per rank: {[round(p.usage, 3) for p in pools]} of "
            f"{pools[0].kv_cache_config.num_blocks} DP blocks each; give the engine more KV cache "
            "(VLLM_CPU_KVCACHE_SPACE / gpu_memory_utilization) or lower max_num_seqs")

    def _free_blocks(self, request) -> None:
        super()._free_blocks(request)
        self.placement.pop(request.request_id, None)
