"""CUDA / NCCL check of fusedpar.integrations.hf (not collected by pytest; needs GPUs).

    torchrun --nproc-per-node 2 -m tests.integrations.hf_gpu_check      # or 4 GPUs

Each rank builds the same tiny random model on its GPU, records the unsharded logits and greedy
tokens, parallelizes it and compares (fp32 with TF32 off: 1e-4 relative at the real and at the
padded positions, left and right padding; bf16: reported, tokens
may legitimately diverge once a near-tie flips; the reference path, then the fused kernels
for bf16 models with head_dim 16, Qwen2's q/k/v bias and llama3 RoPE included). Also loads a
sharded checkpoint with load_parallel straight onto the GPU, and switches a fused model between TP and
DP mid-generation (its KV pushed through the symmetric staging). Rank 0 prints one line per case;
exits 1 on a fp32 mismatch.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from fusedpar.layouts import ParallelLayout
from tests.integrations.hf_models import left_padded, make_model, right_padded


def _err(a, b, real):
    a, b = a.float()[real], b.float()[real]
    return ((a - b).abs().max() / b.abs().max()).item()


def _same_on_all_ranks(t: torch.Tensor) -> bool:
    digest = hashlib.sha256(t.detach().float().cpu().numpy().tobytes()).hexdigest()
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, digest)
    return len(set(got)) == 1


def _compare(model, pm_factory, device, label, strict):
    ids, mask = left_padded([7, 5, 10], model.config.vocab_size, seed=2)
    ids, mask = ids.to(device), mask.to(device)
    real = mask.bool()
    greedy = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    ref = model(ids, attention_mask=mask, use_cache=False).logits
    ref_gen = model.generate(ids, attention_mask=mask, **greedy)
    r_ids, r_mask = right_padded(ids, mask)
    ref_right = model(r_ids, attention_mask=r_mask, use_cache=False).logits
    pm = pm_factory(model)
    out = pm(ids, attention_mask=mask, use_cache=False).logits
    right = pm(r_ids, attention_mask=r_mask, use_cache=False).logits
    before = dict(pm.fusedpar_stack.steps)
    gen = pm.generate(ids, attention_mask=mask, **greedy)
    steps = {m: pm.fusedpar_stack.steps[m] - before[m] for m in before}
    err = _err(out, ref, real)
    # left padding: HF's SDPA gives those queries a zero attention output; right padding: they
    # attend to the row's earlier real tokens
    left_pad_err, right_err = _err(out, ref, ~real), _err(right, ref_right, torch.ones_like(real))
    pad_err = max(left_pad_err, right_err)
    same_tokens = bool(torch.equal(gen, ref_gen))
    identical = _same_on_all_ranks(out) and _same_on_all_ranks(gen)
    ok = identical and (not strict or (err < 1e-4 and pad_err < 1e-4 and same_tokens))
    if dist.get_rank() == 0:
        print(f"{label:42s} rel err {err:.2e}  left-padded {left_pad_err:.2e}  right-padded call "
              f"{right_err:.2e}  tokens equal {same_tokens}  "
              f"ranks identical {identical}  "
              f"steps {steps}  {'ok' if ok else 'FAIL'}", flush=True)
    return ok


def _generate_timed(pm, ids, mask, new_tokens):
    """generate greedily with per-step logits; returns (sequences, logits [steps, b, vocab], ms per token)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = pm.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                      do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / new_tokens
    return out.sequences, torch.stack(out.logits), ms


def _comparable_steps(gs, es, gl, el) -> tuple[int, float]:
    """(steps whose logits are comparable, tie gap). Step t's logits come from identical inputs while
    every earlier greedy token agrees, so the logits are compared up to and including the first step
    whose tokens differ; there the two runs' choices must be a near tie in the eager logits (the gap
    between the two tokens' logits, relative to max |logit|; 0 when every token agrees): rounding
    differences (a one-shot fp32 reduce in graphs, NCCL in eager) may flip a tie, nothing else may."""
    steps = min(len(gl), len(el))
    new_g, new_e = gs[:, -steps:], es[:, -steps:]
    differ = (new_g != new_e).any(dim=0).nonzero()
    if differ.numel() == 0:
        return steps, 0.0
    t = int(differ[0])
    row = int((new_g[:, t] != new_e[:, t]).nonzero()[0])
    logits = el[t, row].float()
    gap = (logits[new_e[row, t]] - logits[new_g[row, t]]).abs().item() / logits.abs().max().item()
    return t + 1, gap


def _graphs_vs_eager(family, overrides, lay, device, block_size) -> bool:
    """The same bf16 model parallelized twice, decode steps replayed as CUDA graphs (the default on
    the fused path) and eager (cuda_graphs=False): per-step logits agree (the graphs' split-KV tiling
    is chosen for their max_context, so fp32 sums may round differently: bf16 tolerance), greedy
    tokens are reported, the graph model replayed graphs and the eager one none; a small block_size
    makes the cache grow while decoding (the graphs are recaptured on the grown cache). Prints ms per
    generated token both ways (a tiny model: host launch cost dominates, which is what graphs remove)."""
    from fusedpar.integrations.hf import parallelize

    pms = {}
    for name, graphs in (("graphs", None), ("eager", False)):
        model = make_model(family, seed=1, dtype=torch.bfloat16, **overrides).to(device)
        pms[name] = parallelize(model, lay, shift_threshold=8, block_size=block_size, cuda_graphs=graphs)
        assert pms[name].fusedpar_stack.fused is not None, "fused path not enabled"
    ok = True
    for rows in ([7, 5, 10], [6]):
        ids, mask = left_padded(rows, pms["eager"].config.vocab_size, seed=4)
        ids, mask = ids.to(device), mask.to(device)
        res = {}
        for name, pm in pms.items():
            # warm-up of the same length: captures this batch size's graph (and any recapture as the
            # cache grows), and compiles every Triton specialisation the eager steps meet (integer
            # arguments are specialised on divisibility by 16, so a growing context meets new ones)
            _generate_timed(pm, ids, mask, 48)
            before = pm.fusedpar_stack.graph_steps
            seqs, logits, ms = _generate_timed(pm, ids, mask, 48)
            res[name] = (seqs, logits, ms, pm.fusedpar_stack.graph_steps - before)
        (gs, gl, gms, greplays), (es, el, ems, ereplays) = res["graphs"], res["eager"]
        steps, tie = _comparable_steps(gs, es, gl, el)
        err = ((gl[:steps].float() - el[:steps].float()).abs().max() / el[:steps].float().abs().max()).item()
        same = bool(torch.equal(gs, es))
        identical = _same_on_all_ranks(gl) and _same_on_all_ranks(gs)
        heads = _head_graphs_match(pms["graphs"], device)
        case_ok = identical and err < 5e-2 and tie < 5e-2 and greplays >= 47 and ereplays == 0 and heads
        ok &= case_ok
        if dist.get_rank() == 0:
            rt = pms["graphs"]._fusedpar
            diverged = "" if same else f" (from step {steps}: a near tie, gap {tie:.1e} of max |logit|)"
            print(f"GRAPHS {family} {lay} rows {rows} block {block_size}: logits rel err vs eager {err:.2e}  tokens "
                  f"equal {same}{diverged}  ranks identical {identical}  replays {greplays}/{ereplays}  captures "
                  f"{rt.graph_captures} (cache {rt.kv.num_blocks} blocks)  ms/token graphs {gms:.2f} eager "
                  f"{ems:.2f} ({ems / gms:.2f}x)  head graphs {sorted(rt.heads)} match {heads}  "
                  f"{'ok' if case_ok else 'FAIL'}", flush=True)
    return ok


def _graphs_after_inference_mode(lay, device) -> bool:
    """Graphs first captured inside torch.inference_mode() (stack and norm + lm_head graphs, their
    static buffers) keep working in a generate outside it, with the same tokens and logits."""
    from fusedpar.integrations.hf import parallelize

    pm = parallelize(make_model("llama", seed=2, dtype=torch.bfloat16, hidden_size=128).to(device), lay,
                     shift_threshold=8)
    ids, mask = left_padded([5, 9], pm.config.vocab_size, seed=6)
    ids, mask = ids.to(device), mask.to(device)
    with torch.inference_mode():
        inside, inside_logits, _ = _generate_timed(pm, ids, mask, 12)
    replays = pm.fusedpar_stack.graph_steps
    outside, outside_logits, _ = _generate_timed(pm, ids, mask, 12)
    ok = (torch.equal(inside, outside) and torch.equal(inside_logits, outside_logits)
          and pm.fusedpar_stack.graph_steps > replays > 0 and bool(pm._fusedpar.heads))
    if dist.get_rank() == 0:
        print(f"GRAPHS after inference_mode {lay}: tokens and logits equal {ok}, replays {replays} then "
              f"{pm.fusedpar_stack.graph_steps - replays}  {'ok' if ok else 'FAIL'}", flush=True)
    return ok


def _head_graphs_match(pm, device) -> bool:
    """Each captured final norm + lm_head graph (used by decode steps that replayed a stack graph) gives
    the eager modules' logits on fresh random hidden states, of fewer rows than its size."""
    rt = pm._fusedpar
    if not rt.heads:
        return False
    gen = torch.Generator(device=device).manual_seed(5)
    ok = True
    for size in sorted(rt.heads):
        h = torch.randn((max(1, size - 1), 1, pm.config.hidden_size), generator=gen, device=device,
                        dtype=torch.bfloat16)
        rt.replayed = size
        got = rt.head_logits(pm, h)
        rt.replayed = None
        with torch.no_grad():
            want = pm.lm_head(pm.model.norm(h))
        ok &= got is not None and got.shape == want.shape and _rel_err(got, want) < 1e-2
    return ok


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _reshard_through_staging(device) -> bool:
    """model.reshard on the fused path (bf16, CUDA): TP -> DP -> TP -> DP -> TP in the middle of greedy
    decoding of a left-padded batch; each switch moves the live KV through the model's symmetric staging
    (the push path of migrate_kv). Logits within 5e-2 of the unsharded model at every step (fed the
    parallel model's own greedy tokens), KV received on every rank, the staging made."""
    from fusedpar.integrations.hf import parallelize

    world = dist.get_world_size()
    tp, dp = ParallelLayout(world, tp=world), ParallelLayout(world, dp=world)
    ref = make_model("qwen3", seed=5, dtype=torch.bfloat16).to(device)
    pm = parallelize(make_model("qwen3", seed=5, dtype=torch.bfloat16).to(device), tp, shift_threshold=8,
                     reshard_layouts=[dp])
    ids, mask = left_padded([9, 6, 11, 7], vocab=ref.config.vocab_size, seed=8)
    ids, mask = ids.to(device), mask.to(device)
    with torch.no_grad():
        out = pm(ids, attention_mask=mask, use_cache=True)
        logits, past, seq, m, received = [out.logits], out.past_key_values, ids, mask, 0
        for lay in (dp, tp, dp, tp):
            received += pm.reshard(lay)["kv_bytes_received"]
            nxt = logits[-1][:, -1:].argmax(-1)
            seq, m = torch.cat([seq, nxt], 1), torch.cat([m, torch.ones_like(nxt)], 1)
            out = pm(nxt, attention_mask=m, past_key_values=past, use_cache=True)
            logits.append(out.logits)
            past = out.past_key_values
        want = ref(seq, attention_mask=m, use_cache=False).logits
    real = mask.bool()
    errs = [_rel_err(logits[0][real], want[:, :ids.shape[1]][real])]
    errs += [_rel_err(got, want[:, ids.shape[1] + i:ids.shape[1] + i + 1]) for i, got in enumerate(logits[1:])]
    staged = pm._fusedpar.staging is not None
    flag = torch.tensor([int(max(errs) < 5e-2 and staged and received > 0)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if dist.get_rank() == 0:
        print(f"RESHARD fused qwen3 bfloat16 tp<->dp x4 through the staging: max err {max(errs):.2e}, "
              f"staging {staged}, received {received} bytes on rank 0: {'ok' if flag.item() else 'FAIL'}",
              flush=True)
    return bool(flag.item())


def main() -> int:
    from fusedpar.integrations.hf import load_parallel, parallelize

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    world, device = dist.get_world_size(), torch.device("cuda", local)
    layouts = [(world, 1), (1, world)] + ([(2, world // 2)] if world >= 4 else [])
    ok = True
    for family in ("llama", "qwen2", "qwen3"):
        for dtype in (torch.float32, torch.bfloat16):
            for sp, tp in layouts:
                model = make_model(family, seed=1, dtype=dtype).to(device)
                lay = ParallelLayout(world, sp=sp, tp=tp)
                ok &= _compare(model, lambda m, lay=lay: parallelize(m, lay, shift_threshold=8, fused=False), device,
                               f"{family} {str(dtype)[6:]} sp={sp} tp={tp}", strict=dtype == torch.float32)
    # fused kernels (auto-enabled for bf16 on CUDA; head_dim 16): same checks, tokens reported;
    # qwen2 (q/k/v bias) and llama3 RoPE (cos/sin tables) included
    llama3 = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    for name, family, overrides in (("llama", "llama", dict(hidden_size=128)), ("qwen3", "qwen3", {}),
                                    ("qwen2", "qwen2", dict(hidden_size=128)),
                                    ("llama3rope", "llama", dict(hidden_size=128, rope_parameters=llama3))):
        for sp, tp in layouts:
            lay = ParallelLayout(world, sp=sp, tp=tp)
            model = make_model(family, seed=1, dtype=torch.bfloat16, **overrides).to(device)

            def fused_factory(m, lay=lay):
                pm = parallelize(m, lay, shift_threshold=8)  # fused=None: auto
                assert pm.fusedpar_stack.fused is not None, "fused path not enabled"
                return pm

            ok &= _compare(model, fused_factory, device, f"FUSED {name} bfloat16 sp={sp} tp={tp}", strict=False)
    # decode steps as CUDA graphs (the fused path's default) against the same model eager
    for sp, tp in layouts:
        lay = ParallelLayout(world, sp=sp, tp=tp)
        ok &= _graphs_vs_eager("llama", dict(hidden_size=128), lay, device, block_size=16)
    ok &= _graphs_vs_eager("qwen3", {}, ParallelLayout(world, sp=world, tp=1), device, block_size=4)
    ok &= _graphs_after_inference_mode(ParallelLayout(world, sp=1, tp=world), device)
    ok &= _reshard_through_staging(device)
    # loader: a sharded checkpoint written by rank 0, read in slices by every rank onto its GPU
    path = [tempfile.mkdtemp(prefix="fusedpar_ckpt_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    if dist.get_rank() == 0:
        make_model("qwen2", seed=3).save_pretrained(path[0], max_shard_size="60KB")
    dist.barrier()
    from transformers import AutoModelForCausalLM

    for dtype in (torch.float32, torch.bfloat16):
        ref = AutoModelForCausalLM.from_pretrained(path[0], dtype=dtype).to(device).eval()
        lay = ParallelLayout(world, sp=2 if world % 2 == 0 else 1, tp=max(1, world // 2))
        ok &= _compare(ref, lambda m, lay=lay, dtype=dtype: load_parallel(
            path[0], lay, dtype=dtype, shift_threshold=8, progress=False, fused=False), device,
            f"load_parallel qwen2 {str(dtype)[6:]} {lay}", strict=dtype == torch.float32)
        if dist.get_rank() == 0:
            print(f"  memory allocated on rank 0 after load: {torch.cuda.memory_allocated() / 2**20:.1f} MiB")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
