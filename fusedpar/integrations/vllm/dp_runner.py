"""The decoder model's forward in a DP step: this rank's own requests, full weights; no collective but
the vocab-parallel embedding's and logits' (DPVocab).

With sequence_parallel_size = P the base shard of every projection is the full weight on every rank
(layers.py), so a DP step runs the whole model on the rank's own tokens:

    hidden = embedding(input_ids)          (DPVocab: vLLM's vocab shards over every rank's tokens)
    per decoder layer, vLLM's own norms and rotary embedding, and
        q|k|v = x @ base qkv, reordered from the shard's SP blocks to q | k | v of all heads
        attention over this rank's DP KV view (all kv heads, `dp_kv_view`), written at the step's
            slots and read through its block table: the metadata vLLM built for the step (the ids
            are DP block ids of the rank's pool, dp_kv.py)
        o = attn @ base o;  gate|up = x @ base gate_up (reordered);  down = silu(gate) * up @ base down
    final norm; logits of the rank's rows (DPVocab.logits: its vocab slice of every rank's rows, gathered).

Attention is plain torch (gather the request's blocks, causal softmax per request): vLLM's CPU
kernels take their scheduler metadata sized for the TP head count; a DP kernel path is later work.
The embedding and lm_head stay vLLM's vocab shards (no extra weight bytes): a DP step runs them
over the step's tokens of all ranks, as TP does (all-gathers of the ids and of the sampled rows,
vLLM's embedding all-reduce, an all-gather of the logits over the vocab), so every rank takes part
in every DP step, a rank without requests too (DPVocab.idle).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dp_kv_view(kv_tp: torch.Tensor, P: int) -> torch.Tensor:
    """Rank's DP view of one layer's TP KV cache [N, h, bs, 2 hd] -> [N / P, P h, bs, 2 hd]: DP block d
    is TP blocks [P d, P d + P), all kv heads. Zero-copy; needs the layer-compact layout vLLM's CPU
    backend has (LBHNC: each layer's blocks contiguous)."""
    n, h, bs, c = kv_tp.shape
    if n % P or not kv_tp.is_contiguous():
        raise RuntimeError(f"fusedpar DP: a layer's KV cache {tuple(kv_tp.shape)} (strides {kv_tp.stride()}) is "
                           f"not {P} x DP blocks of contiguous TP blocks")
    return kv_tp.view(n // P, P * h, bs, c)


def _order(segments, names: tuple[str, ...]) -> torch.Tensor | None:
    """Column order that turns a base shard's output (its segments in order) into the full weight's
    natural order (names[0] columns, then names[1], ...); None when it already is."""
    pos, starts = 0, []
    for seg in segments:
        starts.append((names.index(seg.source), seg.start, seg.size, pos))
        pos += seg.size
    idx = [torch.arange(p, p + n) for _, _, n, p in sorted(starts)]
    order = torch.cat(idx)
    return None if torch.equal(order, torch.arange(pos)) else order


class DPLayer:
    """One decoder layer's pieces for a DP step: vLLM's modules, the full weights (base shards) and the
    column orders of the fused projections."""

    def __init__(self, layer, attn, P: int):
        self.layer, self.attn, self.P = layer, attn, P
        sa, mlp = layer.self_attn, layer.mlp
        self.qkv, self.o, self.gate_up, self.down = sa.qkv_proj, sa.o_proj, mlp.gate_up_proj, mlp.down_proj
        for mod in (self.o, self.down):
            if _order(mod._fp_shard.base, (mod._fp_kind,)) is not None or mod.weight.shape[1] != sum(
                    s.size for s in mod._fp_shard.base):
                raise RuntimeError(f"fusedpar DP: {mod.prefix}'s base shard is not the full weight")
        self.qkv_order = _order(self.qkv._fp_shard.base, ("q", "k", "v"))
        self.gate_up_order = _order(self.gate_up._fp_shard.base, ("gate", "up"))
        self.q_norm, self.k_norm = getattr(sa, "q_norm", None), getattr(sa, "k_norm", None)
        self.hd = attn.head_size
        self.num_q = attn.num_heads * P
        self.num_kv = attn.num_kv_heads * P
        self.scale = attn.impl.scale

    def forward(self, positions, hidden, residual, meta):
        layer = self.layer
        if residual is None:
            residual = hidden
            hidden = layer.input_layernorm(hidden)
        else:
            hidden, residual = layer.input_layernorm(hidden, residual)
        qkv = F.linear(hidden, self.qkv.weight, self.qkv.bias)
        if self.qkv_order is not None:
            qkv = qkv.index_select(1, self.qkv_order.to(qkv.device))
        hd, n = self.hd, hidden.shape[0]
        q, k, v = qkv.split([self.num_q * hd, self.num_kv * hd, self.num_kv * hd], dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(n, self.num_q, hd)).reshape(n, -1)
            k = self.k_norm(k.reshape(n, self.num_kv, hd)).reshape(n, -1)
        q, k = layer.self_attn.rotary_emb(positions, q, k)
        out = self.attention(q, k, v, meta)
        hidden = F.linear(out, self.o.weight)
        if self.o.bias is not None:
            hidden = hidden + self.o.bias
        hidden, residual = layer.post_attention_layernorm(hidden, residual)
        gu = F.linear(hidden, self.gate_up.weight, self.gate_up.bias)
        if self.gate_up_order is not None:
            gu = gu.index_select(1, self.gate_up_order.to(gu.device))
        gate, up = gu.chunk(2, dim=-1)
        hidden = F.linear(F.silu(gate) * up, self.down.weight)
        if self.down.bias is not None:
            hidden = hidden + self.down.bias
        return hidden, residual

    def attention(self, q, k, v, meta) -> torch.Tensor:
        """Causal attention of the step's tokens over this rank's DP KV pool (module docstring)."""
        hd, n = self.hd, q.shape[0]
        kv = dp_kv_view(self.attn.kv_cache, self.P)
        bs = kv.shape[2]
        slots = meta.slot_mapping[:n].long()
        blk, off = slots // bs, slots % bs
        kv[blk, :, off, :hd] = k.reshape(n, self.num_kv, hd).to(kv.dtype)
        kv[blk, :, off, hd:] = v.reshape(n, self.num_kv, hd).to(kv.dtype)
        out = torch.empty(n, self.num_q, hd, dtype=q.dtype, device=q.device)
        qs = q.reshape(n, self.num_q, hd)
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        group = self.num_q // self.num_kv
        for i, seq_len in enumerate(seq_lens[:len(starts) - 1]):
            a, b = starts[i], starts[i + 1]
            if b <= a:
                continue
            nblk = -(-seq_len // bs)
            ctx = kv[meta.block_table[i, :nblk].long()]  # [nblk, H, bs, 2hd]
            ctx = ctx.permute(1, 0, 2, 3).reshape(self.num_kv, nblk * bs, 2 * hd)[:, :seq_len]
            keys = ctx[..., :hd].repeat_interleave(group, dim=0).to(q.dtype)
            vals = ctx[..., hd:].repeat_interleave(group, dim=0).to(q.dtype)
            qi = qs[a:b].transpose(0, 1)  # [Hq, nq, hd]
            scores = torch.matmul(qi, keys.transpose(1, 2)) * self.scale  # [Hq, nq, seq]
            q_pos = torch.arange(seq_len - (b - a), seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] > q_pos[:, None]
            scores.masked_fill_(mask, float("-inf"))
            out[a:b] = torch.matmul(scores.softmax(dim=-1), vals).transpose(0, 1)
        return out.reshape(n, self.num_q * hd)


def gather_rows(x: torch.Tensor, tp_group) -> tuple[torch.Tensor, list[int]]:
    """Every rank's rows of `x` (rank order) on every rank, and each rank's row count; ranks may hold
    different counts (0 included): one all-gather of the counts, one of the rows padded to the largest."""
    counts = tp_group.all_gather(torch.tensor([x.shape[0]], dtype=torch.float32, device=x.device), dim=0)
    counts = [int(c) for c in counts.tolist()]
    most = max(counts)
    padded = F.pad(x, (0, 0) * (x.dim() - 1) + (0, most - x.shape[0]))
    rows = tp_group.all_gather(padded, dim=0).split(most, dim=0) if most else [padded] * len(counts)
    return torch.cat([r[:n] for r, n in zip(rows, counts, strict=True)]), counts


class DPVocab:
    """Embedding and logits of a DP step on vLLM's vocab shards (no extra weight bytes): as in a TP step,
    every rank embeds the step's tokens of all ranks (vLLM's VocabParallelEmbedding: masked lookup +
    all-reduce) and computes its vocab slice of the logits of every rank's rows (all-gathered over the
    vocab); each keeps its own rows. Collective: every rank takes part in every DP step, a rank without
    requests through `idle` (the same collectives, in the same order, on zero rows)."""

    def __init__(self, root, inner, tp_group):
        self.root, self.tp = root, tp_group
        self.embed_module = getattr(inner, "embed_input_ids", None) or inner.get_input_embeddings()
        lp = root.logits_processor
        self.vocab, self.scale, self.soft_cap = lp.org_vocab_size, lp.scale, lp.soft_cap
        if getattr(root.lm_head, "bias", None) is not None:
            raise RuntimeError("fusedpar DP: an lm_head with a bias is not supported")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids, counts = gather_rows(input_ids.reshape(-1, 1).float(), self.tp)
        hidden = self.embed_module(ids.reshape(-1).long())
        start = sum(counts[: self.tp.rank_in_group])
        return hidden[start:start + input_ids.shape[0]]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        rows, counts = gather_rows(hidden, self.tp)
        local = F.linear(rows, self.root.lm_head.weight)  # [all rows, this rank's vocab slice]
        logits = self.tp.all_gather(local, dim=-1)[..., : self.vocab]
        if self.soft_cap is not None:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        if self.scale != 1.0:
            logits = logits * self.scale
        start = sum(counts[: self.tp.rank_in_group])
        return logits[start:start + hidden.shape[0]]

    def idle(self, hidden_size: int, dtype: torch.dtype, device) -> None:
        """A rank's part in a DP step that has no request of it: the embedding's and the logits' collectives."""
        self.embed(torch.empty(0, dtype=torch.long, device=device))
        self.logits(torch.empty(0, hidden_size, dtype=dtype, device=device))


class DPRunner:
    """The DP-step forward of one decoder model (module docstring); `vocab` is set by the worker once
    vLLM's process groups and weights are there (dp_worker.DPWorker.load_model)."""

    def __init__(self, worker, inner, layers, norm, attns, P: int):
        self.worker, self.inner, self.norm = worker, inner, norm
        self.layers = [DPLayer(layer, attn, P) for layer, attn in zip(layers, attns, strict=True)]
        self.vocab: DPVocab | None = None
        self.ran = False

    def forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        from vllm.forward_context import get_forward_context

        if intermediate_tensors is not None or kwargs:
            raise RuntimeError(f"fusedpar DP: the decoder model got {sorted(kwargs)} / intermediate tensors")
        if self.vocab is None or inputs_embeds is not None:
            raise RuntimeError("fusedpar DP: a DP step without token ids or before the worker set up its vocab")
        hidden = self.vocab.embed(input_ids)
        metadata = get_forward_context().attn_metadata
        residual = None
        for dp_layer in self.layers:
            meta = metadata[dp_layer.attn.layer_name]
            hidden, residual = dp_layer.forward(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        self.ran = True
        return hidden
