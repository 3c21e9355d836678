"""The decoder model's forward in a DP step: this rank's own requests, full weights, no collective.

With sequence_parallel_size = P the base shard of every projection is the full weight on every rank
(layers.py), so a DP step runs the whole model on the rank's own tokens:

    hidden = full embedding(input_ids)                      (DPTables: the vocab shards, gathered)
    per decoder layer, vLLM's own norms and rotary embedding, and
        q|k|v = x @ base qkv, reordered from the shard's SP blocks to q | k | v of all heads
        attention over this rank's DP KV view (all kv heads, `dp_kv_view`), written at the step's
            slots and read through its block table: the metadata vLLM built for the step (the ids
            are DP block ids of the rank's pool, dp_kv.py)
        o = attn @ base o;  gate|up = x @ base gate_up (reordered);  down = silu(gate) * up @ base down
    final norm; logits = hidden @ full lm_head (`logits`).

Attention is plain torch (gather the request's blocks, causal softmax per request): vLLM's CPU
kernels take their scheduler metadata sized for the TP head count; a DP kernel path is later work.
The embedding and lm_head tables are gathered once after load (DPTables), which costs
(P - 1) / P x (vocab x hidden) bytes per table per rank; running them vocab-parallel over all
ranks' tokens (no extra bytes, one all-gather per step) is later work.
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


class DPTables:
    """The full embedding and lm_head tables of one rank (vLLM holds vocab shards): gathered once,
    collectively, after the weights are loaded (`gather`, every rank together)."""

    def __init__(self, root, tp_group):
        embed = root.model.embed_tokens
        self.embed = tp_group.all_gather(embed.weight.data, dim=0)
        lm_head = root.lm_head
        self.lm_head = self.embed if lm_head.weight is embed.weight else tp_group.all_gather(lm_head.weight.data,
                                                                                            dim=0)
        lp = root.logits_processor
        self.vocab, self.scale, self.soft_cap = lp.org_vocab_size, lp.scale, lp.soft_cap
        self.bias = getattr(lm_head, "bias", None)
        if self.bias is not None:
            raise RuntimeError("fusedpar DP: an lm_head with a bias is not supported")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.lm_head)[..., : self.vocab]
        if self.soft_cap is not None:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        if self.scale != 1.0:
            logits = logits * self.scale
        return logits

    def nbytes(self) -> int:
        both = {id(t): t for t in (self.embed, self.lm_head)}
        return sum(t.numel() * t.element_size() for t in both.values())


class DPRunner:
    """The DP-step forward of one decoder model (module docstring); `tables` is set by the worker after
    load (dp_worker.DPWorker.load_model)."""

    def __init__(self, worker, inner, layers, norm, attns, P: int):
        self.worker, self.inner, self.norm = worker, inner, norm
        self.layers = [DPLayer(layer, attn, P) for layer, attn in zip(layers, attns, strict=True)]
        self.tables: DPTables | None = None
        self.ran = False

    def forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None, **kwargs):
        from vllm.forward_context import get_forward_context

        if intermediate_tensors is not None or kwargs:
            raise RuntimeError(f"fusedpar DP: the decoder model got {sorted(kwargs)} / intermediate tensors")
        if self.tables is None:
            raise RuntimeError("fusedpar DP: a DP step before the full vocab tables were gathered")
        hidden = inputs_embeds if inputs_embeds is not None else F.embedding(input_ids, self.tables.embed)
        metadata = get_forward_context().attn_metadata
        residual = None
        for dp_layer in self.layers:
            meta = metadata[dp_layer.attn.layer_name]
            hidden, residual = dp_layer.forward(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        self.ran = True
        return hidden
