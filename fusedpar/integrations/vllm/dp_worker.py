"""The worker of an engine with a "dp{P}" layout (policies "dp", "priority", "load", "auto").

`DPWorker` is the platform worker (vLLM's CPUWorker in this version) that
  - after loading the weights sets up the DP step's embedding and logits on vLLM's vocab shards
    (dp_runner.DPVocab: collective in every DP step);
  - per step reads the step's mode from the scheduler's tag (dp_scheduler.DPTag), the same on every
    rank; a TP step (the TP/SP class's requests, policies "priority", "load", "auto") runs as vLLM broadcast
    it, through the plugin's base / shift path over the TP pool;
  - in a DP step keeps only its own requests of the broadcast SchedulerOutput (`own_output`, from the
    scheduler's tag, dp_scheduler.DPTag) and runs them: vLLM's model runner builds the inputs, the
    slot mapping and the attention metadata from its own requests' DP block ids, and the model's
    forward is the DP runner's (announced to the plugin's worker state: `expect_dp_step`);
  - in a TP step that moves requests from DP ranks into the TP/SP class (the tag's moves) copies their KV
    into its TP blocks before the forward (dp_move.move_kv, collective over the TP group); the source
    rank drops the request's DP-step state, and every rank takes it as the new request the scheduler
    made of it (dp_scheduler.as_new_request); in a DP step that moves requests from the TP/SP class to DP
    ranks, every rank sends its kv-head group of their TP blocks to the destination rank, which writes them
    into its DP blocks (dp_move.move_kv_to_dp), every rank drops their TP-step state, and the destination
    takes each as a new request; a peer that dies or stalls during a move fails it on every other rank within
    a bounded time (dp_move.guarded: KVMoveError naming the move and the peer);
  - zeroes the DP blocks vLLM asked for on this rank as the P TP blocks each one is;
  - records the step for `stats(llm)`: steps, tokens and requests per class, switches between DP and TP
    steps, KV bytes moved, and tokens computed again that an earlier step had computed
    (counters.ClassLedger).
The requests of the class a step leaves out stay in vLLM's model runner's cached states (its
persistent batch drops them for the step and takes them back when they are scheduled again), with
their block ids and computed tokens.
A rank without requests in a step runs no forward (vLLM's model runner answers with an empty output)
but takes part in the embedding's and logits' collectives of the others (DPVocab.idle); the
executor (dp_executor.py) merges every rank's answer.
"""

from __future__ import annotations

import dataclasses

from vllm.v1.core.sched.output import CachedRequestData
from vllm.v1.worker.cpu_worker import CPUWorker

from .dp_scheduler import TAG, TP_STEP, DPTag


def _shifted(block_ids, offset: int):
    """A request's block ids per KV cache group (vLLM's tuple of lists, or None), each moved by `offset`."""
    if block_ids is None or not offset:
        return block_ids
    return tuple([b + offset for b in ids] for ids in block_ids)


def own_output(so, tag: DPTag, rank: int):
    """The SchedulerOutput `so` of a DP step restricted to the requests of `rank`, their block ids moved from
    their pool's ids to DP blocks of the buffer (tag.dp_offset); a new object, `so` unchanged."""
    mine = {rid for rid, r in tag.ranks.items() if r == rank}
    c = so.scheduled_cached_reqs
    keep = [i for i, rid in enumerate(c.req_ids) if rid in mine]
    off = tag.dp_offset

    def pick(values: list) -> list:
        # per-request lists; vLLM leaves new_token_ids empty unless pipeline parallel needs it
        return [values[i] for i in keep] if len(values) == len(c.req_ids) else values

    cached = CachedRequestData(
        req_ids=[c.req_ids[i] for i in keep],
        resumed_req_ids={rid for rid in c.resumed_req_ids if rid in mine},
        new_token_ids=pick(c.new_token_ids),
        all_token_ids={rid: ids for rid, ids in c.all_token_ids.items() if rid in mine},
        new_block_ids=[_shifted(ids, off) for ids in pick(c.new_block_ids)],
        num_computed_tokens=pick(c.num_computed_tokens),
        num_output_tokens=pick(c.num_output_tokens),
    )
    num_scheduled = {rid: n for rid, n in so.num_scheduled_tokens.items() if rid in mine}
    P = tag.size
    # a DP block is P TP blocks; the TP pool's blocks to zero (vLLM's flat list) are every rank's
    zero = [*(so.new_block_ids_to_zero or ()), *(P * (off + d) + j for d in tag.zero.get(rank, ()) for j in range(P))]
    return dataclasses.replace(
        so,
        scheduled_new_reqs=[dataclasses.replace(r, block_ids=_shifted(r.block_ids, off))
                            for r in so.scheduled_new_reqs if r.req_id in mine],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        scheduled_spec_decode_tokens={k: v for k, v in so.scheduled_spec_decode_tokens.items() if k in mine},
        scheduled_encoder_inputs={k: v for k, v in so.scheduled_encoder_inputs.items() if k in mine},
        new_block_ids_to_zero=zero or None,
    )


def computed_tokens(so) -> dict[str, int]:
    """Each scheduled request's computed tokens before the step, as the SchedulerOutput `so` tells them."""
    c = so.scheduled_cached_reqs
    return {**{r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs},
            **dict(zip(c.req_ids, c.num_computed_tokens, strict=True))}


class DPWorker(CPUWorker):
    """vLLM's CPU worker running DP steps (module docstring)."""

    def load_model(self, *args, **kwargs):
        out = super().load_model(*args, **kwargs)
        from vllm.distributed import get_tp_group

        from .dp_runner import DPVocab

        hooks = self._fp_state().model
        if hooks.dp_runner is None:
            raise RuntimeError("fusedpar DP: the model was built without fusedpar's hooks")
        hooks.dp_runner.vocab = DPVocab(hooks.root, hooks.decoder_model, get_tp_group())
        return out

    def execute_model(self, scheduler_output):
        tag = getattr(scheduler_output, TAG, None)
        if tag is None:
            if scheduler_output.total_num_scheduled_tokens:
                raise RuntimeError("fusedpar DP: a step without the DP scheduler's tag (scheduler_cls is not "
                                   "fusedpar's DPScheduler)")
            return super().execute_model(scheduler_output)
        state = self._fp_state()
        from vllm.distributed import get_tensor_model_parallel_rank

        if tag.mode == TP_STEP:
            state.classes.record(TP_STEP, scheduler_output.num_scheduled_tokens, computed_tokens(scheduler_output),
                                 scheduler_output.finished_req_ids,
                                 engine_step=bool(scheduler_output.total_num_scheduled_tokens))
            if tag.moves:
                scheduler_output = self._move_in(scheduler_output, tag, get_tensor_model_parallel_rank())
            return super().execute_model(scheduler_output)

        rank = get_tensor_model_parallel_rank()
        arrived = {m.request_id for m in tag.moves if m.rank == rank}
        if tag.moves:  # every rank drops the moved requests' TP-step state; their destination takes them as new
            self._move_out(tag, rank)
            scheduler_output = dataclasses.replace(
                scheduler_output, finished_req_ids=set(scheduler_output.finished_req_ids) | {m.request_id
                                                                                             for m in tag.moves})
        own = own_output(scheduler_output, tag, rank)
        state.classes.record(tag.mode, own.num_scheduled_tokens, computed_tokens(own), own.finished_req_ids - arrived,
                             engine_step=bool(scheduler_output.total_num_scheduled_tokens))
        if own.total_num_scheduled_tokens:
            state.expect_dp_step()
        elif scheduler_output.total_num_scheduled_tokens:  # the other ranks' embedding and logits need this one
            dep = state.deployment
            state.model.dp_runner.vocab.idle(dep.hidden_size, dep.dtype, dep.device)
        return super().execute_model(own)

    def _run_moves(self, tag: DPTag, rank: int, into_tp: bool, move) -> None:
        """Run the step's KV moves, move(tp_group, timeout) -> bytes written on this rank, bounded and settled
        (dp_move.guarded: KVMoveError when a peer dies or stalls), and count them in this rank's stats."""
        from vllm.distributed import get_tp_group

        from .dp_move import group_settle, guarded, move_timeout

        state = self._fp_state()
        tp, timeout = get_tp_group(), move_timeout(self.vllm_config.parallel_config.distributed_timeout_seconds)
        state.classes.kv_bytes_moved += guarded(lambda: move(tp, timeout), group_settle(tp, timeout), tag.moves,
                                                into_tp, rank, tag.size, timeout)
        state.classes.moved.update(m.request_id for m in tag.moves)

    def _move_in(self, so, tag: DPTag, rank: int):
        """Copy the KV of the step's moves into this rank's TP blocks; the SchedulerOutput the model runner gets:
        on a source rank the moved requests are finished first (vLLM's model runner drops their DP-step state,
        then takes them as the step's new requests)."""
        from .dp_move import group_scatter, move_kv

        attns = [layer.attn for layer in self._fp_state().model.dp_runner.layers]

        def write(layer: int, key, value, slots) -> None:  # the backend's own KV write (its block layout)
            attn = attns[layer]
            attn.impl.do_kv_cache_update(attn, key, value, attn.kv_cache, slots)

        self._run_moves(tag, rank, True, lambda tp, timeout: move_kv(
            tag.moves, [a.kv_cache for a in attns], tag.size, tag.dp_offset, rank, group_scatter(tp, timeout), write))
        mine = {m.request_id for m in tag.moves if m.rank == rank}
        return dataclasses.replace(so, finished_req_ids=set(so.finished_req_ids) | mine) if mine else so

    def _move_out(self, tag: DPTag, rank: int) -> None:
        """Gather the KV of a DP step's moves (from the TP/SP class to DP ranks) into their destination ranks' DP
        blocks (dp_move.move_kv_to_dp: collective over the TP group)."""
        from .dp_move import block_layout, group_gather, move_kv_to_dp

        attns = [layer.attn for layer in self._fp_state().model.dp_runner.layers]
        caches = [a.kv_cache for a in attns]
        if getattr(self, "_fp_block_layout", None) is None:
            attn = attns[0]

            def write_into(cache, key, value, slots) -> None:  # the backend's own KV write, probed once
                attn.impl.do_kv_cache_update(attn, key, value, cache, slots)

            self._fp_block_layout = block_layout(write_into, caches[0].shape[1:], caches[0].dtype, caches[0].device)
        self._run_moves(tag, rank, False, lambda tp, timeout: move_kv_to_dp(
            tag.moves, caches, tag.size, tag.dp_offset, rank, group_gather(tp, timeout), self._fp_block_layout))

    def fusedpar_kv_move_seconds(self, sizes) -> list[float]:
        """Seconds of one KV move of each size in `sizes` (bytes), the slowest rank's (dp_move.time_moves);
        collective: the executor calls it on every rank."""
        import torch
        import torch.distributed as dist
        from vllm.distributed import get_tensor_model_parallel_rank, get_tp_group

        from .dp_move import group_gather, group_scatter, time_moves

        tp = get_tp_group()
        seconds = torch.tensor(time_moves(group_scatter(tp), group_gather(tp), tp.world_size,
                                          get_tensor_model_parallel_rank(), sizes), dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=tp.cpu_group)
        return seconds.tolist()

    def _fp_state(self):
        from .state import _require_state

        return _require_state(self)
