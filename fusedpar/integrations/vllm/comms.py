"""The communicators of the base-mode stages, and their warm-up.

`BaseComms` builds fusedpar's ParallelContext (the SP, base-TP, shift and DP groups; collective:
every rank constructs the same layers in the same order, so every rank gets here together) and
the plain communicator at once; nothing else holds process groups. The fused communicator is
built collectively at the first base step (vLLM's memory-profiling run, at max_num_batched_tokens),
which also compiles its kernels for every row count a base step can have and, where base steps
run as CUDA graphs, captures them (so vLLM's memory profile sees their memory).
"""

from __future__ import annotations

import logging

import torch

from fusedpar.collectives import ParallelContext
from fusedpar.layers.comm import PlainComm, select

logger = logging.getLogger("vllm.fusedpar")


class BaseComms:
    """The base-mode stages' communicators of one worker.

    deployment: its deployment.Deployment; model: its hooks.ModelHooks (the base runner, whose
    graphs are captured, and the linear layers, whose first decoder layer the warm-up runs).
    """

    def __init__(self, deployment, model):
        self.deployment, self.model = deployment, model
        self.ctx = ParallelContext(deployment.layout, device=deployment.device)  # collective
        self.plain = PlainComm(self.ctx)  # base-mode stages on cuBLAS + torch.distributed
        self._fused = None

    def comm(self, x: torch.Tensor):
        """The communicator of the base-mode stages on x: FusedComm where it takes x, else PlainComm."""
        return select(x, self.fused(), self.plain)

    def fused(self):
        """fusedpar.layers.comm.FusedComm for the base mode (None: plain torch collectives only); the
        first call builds it, collectively, and compiles or captures what base steps run."""
        dep = self.deployment
        if not dep.use_fused:
            return None
        if self._fused is None:
            from fusedpar.kernels.ulysses import UlyssesOptions
            from fusedpar.layers.comm import FusedComm, FusedOptions

            # The fused o kernel (one launch) at every size: no NCCL call inside a base graph, and eager
            # base steps are bound by host time where the routing table's GPU times tie
            options = FusedOptions(ulysses=UlyssesOptions(o_proj_fused_rows=((1, None),)))
            self._fused = FusedComm(self.ctx, dep.decoder_config(), max_tokens=dep.fused_max_tokens(),
                                    dtype=dep.dtype, options=options)
            if dep.buckets:
                self._capture_graphs()  # an eager pass per bucket first: compiles what the graphs replay
            else:
                self._warm_up()
        return self._fused

    def _capture_graphs(self) -> None:
        from vllm.platforms import current_platform

        from .base_runner import BaseGraphs

        dep, runner = self.deployment, self.model.runner
        place, hd, buckets = dep.placement, dep.dims.head_dim, dep.buckets
        reserved = torch.cuda.memory_reserved(self.ctx.device)
        graphs = BaseGraphs(runner, buckets, hidden_size=dep.hidden_size, q_width=place.q_heads_per_rank * hd,
                            kv_width=place.kv_heads_per_rank * hd, dtype=dep.dtype, device=self.ctx.device,
                            pool=current_platform.get_global_graph_pool())
        seconds = graphs.capture_all()
        runner.graphs = graphs
        grown = (torch.cuda.memory_reserved(self.ctx.device) - reserved) / 2**30
        logger.info("fusedpar: base steps captured as CUDA graphs for %d row buckets (%d..%d rows per rank, "
                    "%d graphs each) in %.1f s; reserved memory +%.2f GiB (vLLM's graph pool, shared with its "
                    "own graphs)", len(buckets), buckets[0], buckets[-1], len(runner.attns) + 1, seconds, grown)

    def _warm_up(self) -> None:
        from .base_step import warm_up_fused

        first = self.model.first_layer()
        rows = self.deployment.base_rows()
        seconds = warm_up_fused(self._fused, rows, first["qkv"], first["o"], first["down"])
        logger.info("fusedpar: base-mode kernels compiled for %d row counts (%d..%d rows per rank) in %.1f s",
                    len(rows), rows[0], rows[-1], seconds)
