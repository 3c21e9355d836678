"""The GPU build of a kernel, checked without a GPU: compile it for sm_90 (PTX, then cubin by the
ptxas that ships with Triton) in a subprocess that does not interpret.

CPU tests run every kernel on the Triton interpreter, which never builds the GPU code: a path
that exists only on the GPU (bf16 tl.dot, inline PTX such as the qkv timeline's %globaltimer)
would first fail on a GPU machine. This catches build errors there, not numerics.
"""

from __future__ import annotations

import textwrap

import pytest

from fusedpar.kernels.fp8 import NO_FP8_SCALES
from tests.kernels.sm90_build import build_for_sm90

_COMPILE = textwrap.dedent(
    """
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from fusedpar.kernels import ulysses

    spec = json.loads(sys.argv[1])
    fn = ulysses.kernels._qkv_all_to_all_kernel
    names = list(fn.arg_names)
    consts = spec["constexprs"]
    missing = [n for n in names if n not in consts and n not in spec["types"]]
    assert not missing, f"no type given for {missing}"
    tuples = {n: v for n, v in consts.items() if isinstance(v, list)}  # a tuple argument, all constexprs
    sig = {n: ("constexpr",) * len(tuples[n]) if n in tuples else "constexpr" if n in consts else spec["types"][n]
           for n in names}
    constexprs = {(names.index(n),): v for n, v in consts.items() if n not in tuples}
    constexprs.update({(names.index(n), i): v for n, t in tuples.items() for i, v in enumerate(t)})
    src = ASTSource(fn, sig, constexprs=constexprs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=spec["options"])
    ptx = k.asm["ptx"]
    print(json.dumps({"ptx_globaltimer": ptx.count("%globaltimer"), "cubin_bytes": len(k.asm["cubin"]),
                      "tma_loads": ptx.count("cp.async.bulk.tensor"), "shared": k.metadata.shared}))
    """
)

_QKV_TYPES = {"x_ptr": "*bf16", "w_ptr": "*bf16", "buffer_ptrs": "*i64", "signal_ptrs": "*i64",
              "counters_ptr": "*i64", "timeline_ptr": "*i64", "rank": "i32", "M": "i32", "BLK": "i32", "K": "i32",
              "stride_xm": "i32", "stride_xk": "i32", "stride_wn": "i32", "stride_wk": "i32"}


def _qkv_constexprs(timeline: bool, tma: bool, split: bool) -> dict:
    consts = {"WORLD": 4, "WORLD_P2": 4, "BLOCK_M": 64 if split else 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8,
              "NUM_SMS": 132, "EVEN_K": True, "INPUT_PRECISION": "tf32", "EPOCH_AHEAD": 1, "SEND_READY": True,
              "PRODUCE": True, "WAIT": True, "USE_FLAGS": True, "SPIN_LIMIT": 1 << 25, "TIMELINE": timeline,
              "TMA": tma, "FLATTEN": not tma, "BLOCK_N2": 64 if split else 0, "ROTATE": split,
              # no FP8 (tests/kernels/test_fp8_fused.py builds the FP8 variant)
              "fp8_scales": list(NO_FP8_SCALES), "FP8": False, "SCALE_IN_LOOP": False, "OUT_DTYPE": None}
    if not tma:
        consts.update(x_desc=None, w_desc=None)  # what the launcher passes without TMA
    if not (tma and split):
        consts.update(w2_desc=None)  # ... and without a TMA split tile
    return consts


# (timeline, TMA, split 64 x (256 + 64) tiles as pick_qkv_config picks them at 512-1024 rows; those build with
# the rotated tile order, as the launcher picks it at 1024 rows)
@pytest.mark.parametrize(("timeline", "tma", "split"),
                         [(False, False, False), (True, False, False), (False, True, False), (False, True, True),
                          (False, False, True)])
def test_qkv_kernel_builds_for_sm90_in_bf16(tmp_path, timeline, tma, split):
    bm = 64 if split else 128
    types = dict(_QKV_TYPES, x_desc=f"tensordesc<bf16[{bm}, 64]>", w_desc="tensordesc<bf16[256, 64]>",
                 w2_desc="tensordesc<bf16[64, 64]>")
    options = {"num_warps": 4, "num_stages": 4} if split else {"num_warps": 8, "num_stages": 3}
    spec = {"types": types, "constexprs": _qkv_constexprs(timeline, tma, split), "options": options}
    got = build_for_sm90(_COMPILE, spec, tmp_path)
    assert got["cubin_bytes"] > 10_000, got
    assert got["shared"] <= 227 * 1024, got  # Hopper's shared memory per block: a launch would fail above it
    # The timeline reads the clock at its four points; without it the build has no clock read at all.
    assert got["ptx_globaltimer"] == (4 if timeline else 0), got
    # TMA: the K loop's tiles come in by bulk tensor copies; without it, by none.
    assert (got["tma_loads"] > 0) == tma, got


_GEMM_COMPILE = textwrap.dedent(
    """
    import json, sys
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from fusedpar.kernels import gemm
    from fusedpar.kernels.gemm import kernels as gemm_kernels

    fn = gemm_kernels._persistent_matmul_kernel
    names = list(fn.arg_names)
    out = []
    seen = set()
    for m, n, k in json.loads(sys.argv[1]):
        cfg = gemm.pick_config(m, n, k, dtype=torch.bfloat16, num_sms=132, interpret=False, tma=True)
        if cfg in seen:
            continue
        seen.add(cfg)
        types = {"a_ptr": "*bf16", "w_ptr": "*bf16", "c_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
                 "stride_am": "i32", "stride_wn": "i32", "stride_cm": "i32",
                 "a_desc": f"tensordesc<bf16[{cfg.block_m}, {cfg.block_k}]>",
                 "w_desc": f"tensordesc<bf16[{cfg.block_n}, {cfg.block_k}]>",
                 "w2_desc": f"tensordesc<bf16[{max(cfg.block_n2, 16)}, {cfg.block_k}]>"}
        consts = {"stride_ak": 1, "stride_wk": 1, "stride_cn": 1, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                  "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m, "NUM_SMS": 132, "EVEN_K": True,
                  "INPUT_PRECISION": "tf32", "TMA": cfg.tma, "FLATTEN": cfg.flatten,
                  "BLOCK_N2": cfg.block_n2}
        sig = {n_: "constexpr" if n_ in consts else types[n_] for n_ in names}
        # what the launcher's specialisation sees: 16-byte aligned pointers and dims divisible by 16
        attrs = {(names.index(n_),): [["tt.divisibility", 16]] for n_ in types if n_.endswith("ptr") or n_ in "MNK"}
        src = ASTSource(fn, sig, constexprs={(names.index(n_),): v for n_, v in consts.items()}, attrs=attrs)
        kern = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        out.append({"config": repr(cfg), "shared": kern.metadata.shared,
                    "tma_loads": kern.asm["ptx"].count("cp.async.bulk.tensor")})
    print(json.dumps(out))
    """
)


def test_gemm_tma_picks_build_for_sm90_within_shared_memory(tmp_path):
    """Every TMA tiling pick_config returns on the Llama-70B / Qwen3-32B TP=4 shapes builds for sm_90
    with TMA loads and fits Hopper's 227 KiB of shared memory (a launch would fail otherwise)."""
    shapes = [(m, n, k) for m in (1024, 2048, 4096, 16384)
              for n, k in ((2560, 8192), (8192, 2048), (14336, 8192), (8192, 7168), (2560, 5120), (5120, 6400))]
    built = build_for_sm90(_GEMM_COMPILE, shapes, tmp_path)
    # 128x256, 128x128 and the split 64x(256+64) tilings (with two swizzle groups) occur on these shapes
    assert len(built) == 4, built
    assert any("block_n2=64" in b["config"] for b in built), built
    for b in built:
        assert b["tma_loads"] > 0 and b["shared"] <= 227 * 1024, b


_ATTN_COMPILE = textwrap.dedent(
    """
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from fusedpar.kernels import ulysses
    from fusedpar.kernels.attention import kernels as attention

    def build(fn, types, consts, num_warps, num_stages=2):
        names = list(fn.arg_names)
        missing = [n for n in names if n not in consts and n not in types]
        assert not missing, f"{fn.__name__}: no type given for {missing}"
        sig = {n: "constexpr" if n in consts else types[n] for n in names}
        src = ASTSource(fn, sig, constexprs={(names.index(n),): v for n, v in consts.items()})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                           "num_stages": num_stages})
        loads = [line.split("ld.global")[1] for line in k.asm["ptx"].splitlines() if "ld.global" in line]
        return {"cubin_bytes": len(k.asm["cubin"]), "shared": k.metadata.shared,
                "i64_loads": sum(ld.split()[0].endswith(".b64") for ld in loads)}

    scatter = json.loads(sys.argv[1])
    ptr = {n: "*bf16" for n in ("qkv_ptr", "out_ptr", "k_cache_ptr", "v_cache_ptr", "inv_freq_ptr", "q_norm_ptr",
                                "k_norm_ptr")}
    ptr.update({n: "*fp32" for n in ("cos_ptr", "sin_ptr", "part_acc_ptr", "part_m_ptr", "part_l_ptr")})
    ptr.update({n: "*i32" for n in ("block_tables_ptr", "cu_seqlens_ptr", "context_lens_ptr", "positions_ptr",
                                    "slots_ptr")})
    ptr["out_peers_ptr"] = "*i64"
    ints = {n: "i32" for n in ("stride_qkv", "stride_out", "stride_blk", "stride_tok", "stride_head", "stride_bt",
                               "stride_rope", "num_seqs", "num_tokens", "num_tiles", "split_len", "bt_keys",
                               "rows_per_rank", "out_col0")}
    ints.update(qk_scale="fp32", eps="fp32")
    out = {}
    # the base-mode prefill tiling (pick_config's for 16 q / 2 kv heads of 128; its q pre-rotated by the
    # write kernel it waits for) and a split decode above FUSED_WRITE_MAX_SEQS (per-token q prologue, then
    # the wait for the write kernel's keys)
    for name, consts, warps, stages in (
        ("prefill", dict(NQ=16, G=8, HD=128, PAGE=16, BLOCK_M=128, BLOCK_N=64, BLOCK_Q=16, ONE_TOKEN_PER_SEQ=False,
                         HAS_Q_NORM=False, ROPE=0, SPLIT=False, DOT_PRECISION="tf32", WRITE_NEW_KV=False,
                         HAS_K_NORM=False, PAGE_PREFETCH=True, Q_BY_TOKEN=False, PDL=1, LAUNCH_DEPENDENTS=False),
         8, 3),
        ("decode_split", dict(NQ=16, G=8, HD=128, PAGE=16, BLOCK_M=16, BLOCK_N=64, BLOCK_Q=1, ONE_TOKEN_PER_SEQ=True,
                              HAS_Q_NORM=True, ROPE=3, SPLIT=True, DOT_PRECISION="tf32", WRITE_NEW_KV=False,
                              HAS_K_NORM=True, PAGE_PREFETCH=True, Q_BY_TOKEN=True, PDL=2, LAUNCH_DEPENDENTS=True),
         4, 3),
    ):
        out[name] = build(attention._attention_kernel, {**ptr, **ints}, dict(consts, SCATTER=scatter), warps, stages)
    combine_types = {"part_acc_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "out_ptr": "*bf16",
                     "out_peers_ptr": "*i64", "stride_out": "i32", "num_tokens": "i32", "num_splits": "i32",
                     "rows_per_rank": "i32", "out_col0": "i32"}
    out["combine"] = build(attention._combine_kernel, combine_types,
                           dict(NQ=16, HD=128, SPLITS_P2=8, SCATTER=scatter, PDL=True), 2)
    out["arrival"] = build(ulysses.kernels._o_arrival_kernel,
                           {"signal_ptrs": "*i64", "counters_ptr": "*i64", "rank": "i32"},
                           dict(WORLD=4, WORLD_P2=4, PUBLISH=True, WAIT=True, SPIN_LIMIT=1 << 25), 1)
    print(json.dumps(out))
    """
)


@pytest.mark.parametrize("scatter", [False, True], ids=["local_out", "scatter"])
def test_attention_kernels_build_for_sm90_in_bf16(tmp_path, scatter):
    """The attention kernel (base-mode prefill tiling, split decode), the combine kernel and the o
    arrival barrier build for sm_90; the scattering variant loads the destination table (int64 peer
    addresses), the local one loads no 64-bit word at all, and both fit Hopper's shared memory."""
    built = build_for_sm90(_ATTN_COMPILE, scatter, tmp_path)
    for name, b in built.items():
        assert b["cubin_bytes"] > 1000 and b["shared"] <= 227 * 1024, (name, b)
    for name in ("prefill", "combine"):
        assert (built[name]["i64_loads"] > 0) == scatter, (name, built[name])
    assert built["decode_split"]["i64_loads"] == 0, built  # split programs store fp32 partials locally


_ATTENTION_COMPILE = textwrap.dedent(
    r"""
    import json, re, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from fusedpar.kernels.attention import kernels as attention

    FLOAT_PTRS = {"inv_freq_ptr", "cos_ptr", "sin_ptr", "part_acc_ptr", "part_m_ptr", "part_l_ptr"}
    INT32_PTRS = {"block_tables_ptr", "cu_seqlens_ptr", "context_lens_ptr"}
    INT64_PTRS = {"positions_ptr", "slots_ptr", "out_peers_ptr"}

    def arg_type(name):
        if name.endswith("_ptr"):
            return ("*fp32" if name in FLOAT_PTRS else "*i32" if name in INT32_PTRS
                    else "*i64" if name in INT64_PTRS else "*bf16")
        return "fp32" if name in ("qk_scale", "eps") else "i32"

    out = []
    for kernel, consts, options in json.loads(sys.argv[1]):
        fn = getattr(attention, kernel)
        names = list(fn.arg_names)
        sig = {n: "constexpr" if n in consts else arg_type(n) for n in names}
        src = ASTSource(fn, sig, constexprs={(names.index(n),): v for n, v in consts.items()})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
        got = {k: ptx.count(k) for k in ("sin.approx.f32", "cos.approx.f32", "griddepcontrol.wait",
                                         "griddepcontrol.launch_dependents")}
        # the global loads the code issues before the wait, in program text order
        ops = [m.group(1) for m in re.finditer(r"^\s*(?:@%p\d+\s+)?(ld\.global\S*|griddepcontrol\.wait)", ptx, re.M)]
        got["loads_before_wait"] = ops[: ops.index("griddepcontrol.wait")] if "griddepcontrol.wait" in ops else None
        out.append(got)
    print(json.dumps(out))
    """
)


def test_attention_fast_rope_and_pdl_build_for_sm90(tmp_path):
    """The attention paths that only a GPU runs build for sm_90 in bf16: ROPE_THETA_FAST's inline
    cos/sin.approx.f32, the write kernel's PDL trigger and the attention kernel's PDL wait (before q,
    or after its per-token q prologue), and the decode launch that writes its own new keys (no write
    kernel, so no wait). Each build holds the instructions it should and none it should not."""
    fast = 3  # attention.config.ROPE_THETA_FAST (not imported here: the module is interpreted in this process)
    write = {"NQ": 16, "NQ_P2": 16, "NKV": 2, "NKV_P2": 2, "HD": 128, "PAGE": 16, "HAS_Q_NORM": True,
             "HAS_K_NORM": True, "ROPE": fast, "WRITE_KV": True, "WRITE_Q": True, "LAUNCH_DEPENDENTS": True}
    attend = {"NQ": 16, "G": 8, "HD": 128, "PAGE": 16, "BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_Q": 16,
              "ONE_TOKEN_PER_SEQ": False, "HAS_Q_NORM": True, "ROPE": fast, "SPLIT": False,
              "DOT_PRECISION": "tf32", "WRITE_NEW_KV": False, "HAS_K_NORM": True, "PAGE_PREFETCH": True,
              "SCATTER": False, "Q_BY_TOKEN": True, "PDL": 2, "LAUNCH_DEPENDENTS": False}
    prefill = {"num_warps": 8, "num_stages": 3}
    specs = [
        ("_write_kv_kernel", write, {"num_warps": 4}),
        ("_attention_kernel", attend, prefill),  # in-kernel q, then wait for the write kernel's keys
        ("_attention_kernel", attend | {"HAS_Q_NORM": False, "ROPE": 0, "Q_BY_TOKEN": False, "PDL": 1}, prefill),
        ("_attention_kernel", attend | {"BLOCK_M": 16, "BLOCK_Q": 1, "ONE_TOKEN_PER_SEQ": True, "SPLIT": True,
                                        "WRITE_NEW_KV": True, "PDL": 0, "LAUNCH_DEPENDENTS": True},
         {"num_warps": 4, "num_stages": 2}),
        ("_combine_kernel", {"NQ": 16, "HD": 128, "SPLITS_P2": 64, "SCATTER": False, "PDL": True}, {"num_warps": 2}),
    ]
    write_ptx, in_kernel_q, prerotated_q, fused_decode, combine = build_for_sm90(_ATTENTION_COMPILE, specs, tmp_path)
    assert write_ptx["sin.approx.f32"] and write_ptx["cos.approx.f32"], write_ptx
    assert write_ptx["griddepcontrol.launch_dependents"] and not write_ptx["griddepcontrol.wait"], write_ptx
    assert in_kernel_q["sin.approx.f32"] and in_kernel_q["griddepcontrol.wait"], in_kernel_q
    assert prerotated_q["griddepcontrol.wait"] and not prerotated_q["sin.approx.f32"], prerotated_q
    # A GPU test cannot see a read ahead of the wait when the write grid happens to finish first, so the
    # placement is checked here: before it, the pre-rotated path only finds its sequence and context
    # length (a few scalar loads; the q scratch, the block table and K/V come after), and the combine
    # kernel loads nothing.
    before = prerotated_q["loads_before_wait"]
    assert len(before) <= 8 and set(before) <= {"ld.global.b32"}, before
    assert combine["griddepcontrol.wait"] and combine["loads_before_wait"] == [], combine
    assert fused_decode["sin.approx.f32"] and not fused_decode["griddepcontrol.wait"], fused_decode
    assert fused_decode["griddepcontrol.launch_dependents"], "a split launch lets its combine kernel start early"
