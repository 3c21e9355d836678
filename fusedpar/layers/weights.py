"""One rank's decoder weights: base shards plus zero-copy shift views."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedpar.layers.config import DecoderConfig, weight_shapes
from fusedpar.layers.fp8_weights import FP8Weight, build_fp8_shard
from fusedpar.layouts import WEIGHT_NAMES, ParallelLayout, StepMode, WeightShard

REPLICATED = ("input_norm", "post_norm", "q_norm", "k_norm")
QKV_BIAS_SOURCES = {"q": "q_bias", "k": "k_bias", "v": "v_bias"}  # qkv segment source -> its bias


def build_shard(full: dict[str, torch.Tensor], shard: WeightShard) -> torch.Tensor:
    """Concatenate the shard's global segments (rows for dim "out", columns for "in") into one tensor.

    A 1-D source (a bias) takes dim "out" segments as elements: the bias of a row-sharded weight.
    """
    dim = shard.torch_dim
    pieces = [full[seg.source].narrow(dim, seg.start, seg.size) for seg in shard.base]
    return torch.cat(pieces, dim=dim).contiguous()


@dataclass
class ShardedDecoderWeights:
    """base[name]: this rank's base shard; shift[name]: a narrow() view into it (no copy).

    Shapes (P = sp*tp, q/kv = local heads per rank, hd = head_dim, I = intermediate):
      base qkv [SP*(q+2kv)*hd, d]   shift qkv [(q+2kv)*hd, d]   (rows = block s)
      base gate_up [SP*2*I/P, d]    shift gate_up [2*I/P, d]
      base o [d, SP*q*hd]           shift o [d, q*hd]           (columns, strided view)
      base down [d, I/TP]           shift down [d, I/P]
      base qkv_bias [SP*(q+2kv)*hd] shift qkv_bias [(q+2kv)*hd]  (only with cfg.qkv_bias)
    qkv_bias holds the q/k/v bias entries of exactly the base qkv rows, in the same order, so
    F.linear(h, base qkv, base qkv_bias) is exact before the all-to-all, and after it every token
    of this rank holds its own block, whose bias is the shift view.
    """

    base: dict[str, torch.Tensor | FP8Weight]  # FP8Weight where the checkpoint's weights are FP8 (plain path)
    shift: dict[str, torch.Tensor | FP8Weight]
    replicated: dict[str, torch.Tensor]

    @classmethod
    def from_full(
        cls, cfg: DecoderConfig, layout: ParallelLayout, rank: int, full: dict[str, torch.Tensor]
    ) -> ShardedDecoderWeights:
        expected = weight_shapes(cfg)
        missing = sorted(set(expected) - set(full))
        if missing:
            raise ValueError(f"decoder weights missing {missing}")
        for name, shape in expected.items():
            if tuple(full[name].shape) != shape:
                raise ValueError(f"weight {name!r} has shape {tuple(full[name].shape)}, config expects {shape}")
        if not cfg.qkv_bias:
            stray = sorted(set(QKV_BIAS_SOURCES.values()) & set(full))
            if stray:
                raise ValueError(f"decoder weights hold {stray} but the config has qkv_bias=False")
        shard_map = layout.weight_shards(cfg.dims)
        base, shift = {}, {}
        for name in WEIGHT_NAMES:
            shard = shard_map.shard(rank, name)
            fp8 = [isinstance(full[seg.source], FP8Weight) for seg in shard.base]
            if any(fp8) and not all(fp8):
                raise ValueError(f"the {name} shard joins FP8 and unquantised sources "
                                 f"{sorted({seg.source for seg in shard.base})}: quantise all of them or none")
            base[name] = build_fp8_shard(full, shard) if all(fp8) else build_shard(full, shard)
            lo, hi = shard.shift
            shift[name] = base[name].narrow(shard.torch_dim, lo, hi - lo)
        if cfg.qkv_bias:
            shard = shard_map.shard(rank, "qkv")
            base["qkv_bias"] = build_shard({src: full[b] for src, b in QKV_BIAS_SOURCES.items()}, shard)
            lo, hi = shard.shift
            shift["qkv_bias"] = base["qkv_bias"].narrow(0, lo, hi - lo)
        replicated = {n: full[n].clone() for n in REPLICATED if n in full}
        return cls(base, shift, replicated)

    @classmethod
    def viewing(cls, held: ShardedDecoderWeights, cfg: DecoderConfig, held_layout: ParallelLayout,
                layout: ParallelLayout, rank: int) -> ShardedDecoderWeights:
        """`layout`'s weights on `rank` as views of `held` (the rank's weights for `held_layout`): no copy.

        Raises ValueError when a shard of `layout` is not one contiguous range of the held shard (see
        fusedpar.layouts.view_range); with the canonical rank order, a replica's SP = P shard holds every
        SP x TP shard of the same replica size that way."""
        from fusedpar.layouts import view_range

        have, want = held_layout.weight_shards(cfg.dims), layout.weight_shards(cfg.dims)
        base, shift = {}, {}
        sources = [(name, name) for name in WEIGHT_NAMES]
        if cfg.qkv_bias:
            sources.append(("qkv_bias", "qkv"))
        for key, shard_name in sources:
            h, w = have.shard(rank, shard_name), want.shard(rank, shard_name)
            span = view_range(h.base, w.base)
            if span is None:
                raise ValueError(f"rank {rank}: the {shard_name} shard of {layout!r} is not one contiguous range of "
                                 f"the {held_layout!r} shard it holds, so it cannot be a view")
            dim = 0 if key == "qkv_bias" else w.torch_dim
            base[key] = held.base[key].narrow(dim, span[0], span[1] - span[0])
            lo, hi = w.shift
            shift[key] = base[key].narrow(dim, lo, hi - lo)
        return cls(base, shift, held.replicated)

    def weights(self, mode: str) -> dict[str, torch.Tensor]:
        return self.base if mode == StepMode.BASE else self.shift

    def storage_bytes(self) -> int:
        """Bytes of distinct storages behind base and shift (shift views must add nothing).

        With qkv_bias this is the four weight shards (WeightShardMap.base_bytes) plus the bias
        rows of the qkv shard; the replicated norms are not counted.
        """
        seen = {}
        for w in (*self.base.values(), *self.shift.values()):
            for t in (w.q, w.scale) if isinstance(w, FP8Weight) else (w,):
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())
