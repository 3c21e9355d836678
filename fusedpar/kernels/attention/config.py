"""Tiling and launch constants of paged attention: AttentionConfig, pick_config, AttentionOptions.

pick_config maps one launch's shape (head dim, GQA group, sequences, kv heads, query / kv length
bounds, dtype, SM count) to an AttentionConfig; AttentionOptions carries an explicit one through the
public router (tests, tuning and A/B measurements). The GPU choices were tuned on an H200 with
perf/bench_attention.py (hd 128, 16 q / 2 kv heads, bf16, 16-token pages, CUDA graphs); its records,
sweeps included ("sweep": true): perf/results/attention.json.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedpar.kernels._host import cdiv, next_pow2

# RoPE modes (the kernels' ROPE constexpr). ROPE_THETA_FAST is ROPE_THETA with the GPU's
# cos.approx/sin.approx.f32 (absolute error ~2**-20.5 on the reduced angle, far below bf16/fp16
# rounding): the launcher's choice for bf16/fp16 on an NVIDIA GPU; fp32 and the interpreter keep
# ROPE_THETA (libdevice / numpy cos and sin).
ROPE_NONE, ROPE_THETA, ROPE_TABLES, ROPE_THETA_FAST = 0, 1, 2, 3
# rope_theta mode reduces each fp32 angle by a two-constant 2*pi that is exact only below 2**16 turns
# (~411k rad; the angle of position p is up to p): beyond that the cached keys drift (7e-2 abs at
# position 1M). Steps that reach further pass cos/sin tables (fusedpar.layers.decoder.needs_rope_tables).
ROPE_THETA_MAX_KV_LEN = 6 * 2**16

# Decode batches of up to this many sequences write their new k/v inside the attention launch
# (WRITE_NEW_KV: one launch fewer); from 16 on the extra prologue in every program costs more than the
# launch it saves. Chosen with perf/bench_attention.py's decode cases at 4096-token contexts
# (perf/results/attention.json keeps the resulting times, not the A/B).
FUSED_WRITE_MAX_SEQS = 8

# The SM count pick_config assumes under the interpreter. Larger than the shared
# fusedpar.kernels._host.INTERPRETER_NUM_SMS (4, sized for persistent grids): the split-KV heuristic
# aims at ~4 programs per SM, and 16 "SMs" make the CPU tests' decode batches (a handful of
# sequences x kv heads) split their keys several ways, so the combine kernel runs.
ATTENTION_INTERPRETER_NUM_SMS = 16
MAX_SPLITS = 64


@dataclass(frozen=True)
class AttentionConfig:
    """Compile-time tiling of one attention launch.

    block_m: q-tile rows (= block_q tokens x G heads, a power of two >= 16); block_n: keys per K/V
    tile (a power of two >= 16); block_q: tokens per q tile; num_splits: key-range splits (1 = no
    split, no combine kernel).
    prerotate_q: with RoPE and/or a q norm, _write_kv_kernel computes rope(norm_q(q)) once per token
    into a [num_tokens, nq hd] scratch (cache dtype) that the attention kernel reads instead of
    transforming q itself (same rounding, same result); ignored without RoPE and q norm.
    page_prefetch: load each K/V tile's block-table entries one tile ahead, so Triton's pipeliner can
    keep num_stages - 1 K/V tiles in flight; a pure decode launch then runs one masked loop
    (_attend_decode_tiles). False keeps the plain loops (a tiling choice perf/bench_attention.py sweeps).
    pdl: when a write kernel runs first, launch the attention kernel as its programmatic dependent
    (sm_90+ NVIDIA GPUs, a Triton with gdc_wait), and likewise a split launch's combine kernel after
    the attention kernel. False launches them back to back.
    """

    block_m: int
    block_n: int
    block_q: int
    num_warps: int = 4
    num_stages: int = 2
    num_splits: int = 1
    prerotate_q: bool = False
    page_prefetch: bool = True
    pdl: bool = True


@dataclass(frozen=True)
class AttentionOptions:
    """Tuning overrides of one paged_attention call (None everywhere = the launcher's own choices).

    config: an explicit tiling instead of pick_config's (such a call launches the kernels directly,
    also under torch.compile, where the registered ops take no tiling).
    """

    config: AttentionConfig | None = None


def pick_config(
    *,
    head_dim: int,
    group: int,
    num_seqs: int,
    num_kv_heads: int,
    max_query_len: int,
    max_kv_len: int,
    dtype: torch.dtype,
    num_sms: int,
    interpret: bool,
) -> AttentionConfig:
    """Tiling for one launch.

    Decode (max_query_len == 1): block_q = 1, block_m = max(16, next_pow2(G)) (one token's G heads;
      tl.dot needs M >= 16, and decode is bound by the K/V bytes, read once per kv head), block_n 64,
      4 warps, 2 stages (more stages were slower at 8 sequences x 4096 tokens); q transformed in the kernel (a
      memory round trip would cost more than the tiny per-program prologue).
    Prefill/mixed: block_m 128 with block_q = 128 // G tokens, block_n 64, 8 warps, 3 stages,
      prerotate_q (the in-kernel q prologue's live registers slow the whole main loop, which costs
      more than the scratch round trip). hd 256 or fp32: block_m 64, block_n 32,
      4 warps, 2 stages, inside 227 KiB of shared memory.
    Split-KV when every sequence fits one q tile and the (sequence, kv head) programs cannot fill the
      GPU: ~4 programs per SM in whole waves, at most one split per key tile and MAX_SPLITS.
    Interpreter: small tiles (16/32 rows, 16 keys) so CPU tests cover many tiles and splits.
    page_prefetch is on everywhere (dataclass default).
    """
    big = head_dim > 128 or dtype == torch.float32
    if interpret:
        block_m, block_n, warps, stages = (16 if max_query_len == 1 else 32), 16, 4, 1
        block_m = max(block_m, next_pow2(group))
    elif max_query_len == 1:
        block_m, block_n, warps, stages = max(16, next_pow2(group)), (32 if big else 64), 4, (3 if big else 2)
    else:
        block_m = max(64 if big else 128, next_pow2(group))
        block_n, warps, stages = (32, 4, 2) if big else (64, 8, 3)
    block_q = 1 if max_query_len == 1 else max(1, block_m // group)

    splits = 1
    if max_query_len <= block_q:
        programs = num_seqs * num_kv_heads
        # Nearest whole number of waves of ~4 CTAs per SM (a rounded-up count can leave a
        # mostly idle last wave: 128 programs x 3 splits on 132 SMs is 1.45 waves).
        want = max(1, round(4 * num_sms / programs))
        splits = max(1, min(want, cdiv(max(max_kv_len, 1), block_n), MAX_SPLITS))
    # Interpreter too: CPU tests of prefill batches then run the pre-rotated path the GPU runs.
    return AttentionConfig(block_m, block_n, block_q, warps, stages, splits, prerotate_q=max_query_len > 1)
