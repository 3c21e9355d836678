"""Base shards + shift views: zero extra bytes, and the shift view is plain TP=P sharding."""

import dataclasses

import pytest
import torch

from fusedpar import ParallelLayout
from fusedpar.layers import DecoderConfig, ShardedDecoderWeights, random_decoder_weights
from fusedpar.layouts import WEIGHT_NAMES


def _plain_tp_shift(cfg, full, r, P):
    """Rank r's weights under plain TP=P, computed from first principles (not from the shard map)."""
    hd, qh = cfg.head_dim, cfg.num_q_heads // P
    kv = list(range(r * cfg.num_kv_heads // P, (r + 1) * cfg.num_kv_heads // P)) if cfg.num_kv_heads >= P \
        else [(r * cfg.num_kv_heads) // P]
    kv_rows = torch.cat([torch.arange(k * hd, (k + 1) * hd) for k in kv])
    I = cfg.intermediate_size // P
    return {
        "qkv": torch.cat([full["q"][r * qh * hd:(r + 1) * qh * hd], full["k"][kv_rows], full["v"][kv_rows]]),
        "o": full["o"][:, r * qh * hd:(r + 1) * qh * hd],
        "gate_up": torch.cat([full["gate"][r * I:(r + 1) * I], full["up"][r * I:(r + 1) * I]]),
        "down": full["down"][:, r * I:(r + 1) * I],
    }


@pytest.mark.parametrize(("world", "sp", "tp", "h", "hkv"),
                         [(2, 2, 1, 8, 4), (2, 1, 2, 8, 2), (4, 2, 2, 8, 2), (4, 4, 1, 4, 1), (8, 2, 2, 8, 8),
                          (6, 3, 2, 12, 6)])
def test_shift_views_share_storage_and_equal_plain_tp(world, sp, tp, h, hkv):
    P = sp * tp
    cfg = DecoderConfig(hidden_size=16, num_q_heads=h, num_kv_heads=hkv, head_dim=4, intermediate_size=4 * P)
    full = random_decoder_weights(cfg, seed=3)
    layout = ParallelLayout(world, sp=sp, tp=tp)
    shard_map = layout.weight_shards(cfg.dims)
    for rank in range(world):
        w = ShardedDecoderWeights.from_full(cfg, layout, rank, full)
        expected = _plain_tp_shift(cfg, full, layout.coords(rank).local, P)
        for name in WEIGHT_NAMES:
            base, shift = w.base[name], w.shift[name]
            assert shift.untyped_storage().data_ptr() == base.untyped_storage().data_ptr(), name
            assert base.data_ptr() <= shift.data_ptr() < base.data_ptr() + base.nbytes
            assert torch.equal(shift, expected[name]), f"rank {rank} {name}: shift view is not the TP=P shard"
        base_bytes = sum(t.nbytes for t in w.base.values())
        assert w.storage_bytes() == base_bytes == shard_map.base_bytes(rank, cfg.hidden_size, 4)


def test_base_shard_is_plain_tp_when_sp_is_one():
    cfg = DecoderConfig(hidden_size=16, num_q_heads=8, num_kv_heads=4, head_dim=4, intermediate_size=16)
    full = random_decoder_weights(cfg, seed=5)
    layout = ParallelLayout(2, tp=2)
    for rank in range(2):
        w = ShardedDecoderWeights.from_full(cfg, layout, rank, full)
        expected = _plain_tp_shift(cfg, full, rank, 2)
        for name in WEIGHT_NAMES:
            assert torch.equal(w.base[name], expected[name])


def test_weight_shape_mismatch_is_reported():
    cfg = DecoderConfig(hidden_size=16, num_q_heads=8, num_kv_heads=4, head_dim=4, intermediate_size=16)
    full = random_decoder_weights(cfg, seed=5)
    full["k"] = full["k"][:-1]
    with pytest.raises(ValueError, match=r"'k' has shape \(15, 16\).*\(16, 16\)"):
        ShardedDecoderWeights.from_full(cfg, ParallelLayout(2, tp=2), 0, full)
    del full["k"]
    with pytest.raises(ValueError, match="missing"):
        ShardedDecoderWeights.from_full(cfg, ParallelLayout(2, tp=2), 0, full)


@pytest.mark.parametrize(("world", "sp", "tp", "h", "hkv"), [(4, 2, 2, 8, 2), (4, 4, 1, 4, 1), (6, 3, 2, 12, 6)])
def test_qkv_bias_follows_the_qkv_rows_and_its_shift_view_is_zero_copy(world, sp, tp, h, hkv):
    P = sp * tp
    cfg = DecoderConfig(hidden_size=16, num_q_heads=h, num_kv_heads=hkv, head_dim=4, intermediate_size=4 * P,
                        qkv_bias=True)
    full = random_decoder_weights(cfg, seed=7)
    assert {n: tuple(full[n].shape) for n in ("q_bias", "k_bias", "v_bias")} == {
        "q_bias": (cfg.q_size,), "k_bias": (cfg.kv_size,), "v_bias": (cfg.kv_size,)}
    # Tag every weight row with its bias: column 0 of row j = bias[j]. Then in any shard, column 0
    # of the qkv rows must equal the bias entries, whatever order the rows were gathered in.
    for p in "qkv":
        full[p] = full[p].clone()
        full[p][:, 0] = full[f"{p}_bias"]
    layout = ParallelLayout(world, sp=sp, tp=tp)
    shard_map = layout.weight_shards(cfg.dims)
    for rank in range(world):
        w = ShardedDecoderWeights.from_full(cfg, layout, rank, full)
        base, shift = w.base["qkv_bias"], w.shift["qkv_bias"]
        assert base.dim() == 1 and torch.equal(base, w.base["qkv"][:, 0])
        assert torch.equal(shift, w.shift["qkv"][:, 0])
        # zero-copy: the shift bias is a view into the base bias storage, at the qkv shift rows
        assert shift.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        lo, hi = shard_map.shard(rank, "qkv").shift
        assert shift.data_ptr() == base.data_ptr() + lo * base.element_size() and shift.numel() == hi - lo
        # plain TP=P bias for the shift view, from first principles
        expected = _plain_tp_shift(cfg, full, layout.coords(rank).local, P)["qkv"][:, 0]
        assert torch.equal(shift, expected)
        # byte accounting: the four weight shards plus one bias entry per qkv shard row
        bias_bytes = shard_map.shard(rank, "qkv").size * 4
        assert base.nbytes == bias_bytes
        assert w.storage_bytes() == sum(t.nbytes for t in w.base.values()) == \
            shard_map.base_bytes(rank, cfg.hidden_size, 4) + bias_bytes


def test_bias_weights_need_qkv_bias_in_the_config():
    cfg = DecoderConfig(hidden_size=16, num_q_heads=8, num_kv_heads=4, head_dim=4, intermediate_size=16)
    full = random_decoder_weights(dataclasses.replace(cfg, qkv_bias=True), seed=5)
    with pytest.raises(ValueError, match=r"\['k_bias', 'q_bias', 'v_bias'\] but the config has qkv_bias=False"):
        ShardedDecoderWeights.from_full(cfg, ParallelLayout(2, tp=2), 0, full)
    bias_cfg = dataclasses.replace(cfg, qkv_bias=True)
    del full["v_bias"]
    with pytest.raises(ValueError, match=r"missing \['v_bias'\]"):
        ShardedDecoderWeights.from_full(bias_cfg, ParallelLayout(2, tp=2), 0, full)


def test_random_weights_without_bias_are_unchanged_by_bias_configs():
    """Biases are drawn last: adding qkv_bias leaves every other seeded weight as it was."""
    cfg = DecoderConfig(hidden_size=16, num_q_heads=8, num_kv_heads=4, head_dim=4, intermediate_size=16,
                        qk_norm=True)
    plain = random_decoder_weights(cfg, seed=9)
    biased = random_decoder_weights(dataclasses.replace(cfg, qkv_bias=True), seed=9)
    assert set(biased) - set(plain) == {"q_bias", "k_bias", "v_bias"}
    assert all(torch.equal(plain[n], biased[n]) for n in plain)
