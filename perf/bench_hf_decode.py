"""Benchmark: HF generate on fusedpar's adapter, decode steps replayed as CUDA graphs vs eager (TPOT).

    torchrun --nproc-per-node N perf/bench_hf_decode.py [--layers 32] [--batches 1,8] [--out FILE]

A random bf16 Llama-3-8B-shaped model (hidden 4096, 32 q / 8 kv heads, MLP 14336, vocab 128256;
--layers sets the depth; no download), built on every rank from one seed, parallelized twice on the
same layout (--sp, default pure TP over all GPUs): `cuda_graphs=None` (the fused path's default:
decode graphs) and `cuda_graphs=False` (every step eager). Per batch size, left-padded prompts of
--prompt tokens, greedy: a warm-up generate of --new-tokens (captures the graph, compiles every
Triton specialisation), then TPOT = (time of generate(new) - time of generate(1)) / (new - 1),
median of --repeats, max over ranks; the prefill and generate's setup cancel out. Greedy tokens of
the two are printed (random weights give flat logits, where a bf16 near-tie may part them), and
the logits of 16 decode steps fed the same tokens (teacher forcing) are compared, with each other
and with the unsharded HF model's (built again from the seed): the scale of bf16 rounding through
the layers. A third parallelized copy with check_inputs=False times the per-call agreement check
(calls.py: one all-gather and one device-to-host copy per step): check_inputs_ms / _pct in the records.

Records (perf/results/hf_decode.json): bench hf_decode_tpot, tokens = batch rows, baseline = the
same adapter eager, fused_ms = with graphs, speedup = eager / graphs, roofline_pct = 100 * floor /
fused_ms with floor = this rank's decoder shard + the replicated lm_head read once per step at
the bandwidth of a 1 GiB device copy measured in this run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench
import shapes

_bench.add_repo_to_path()

BASELINE = "fusedpar HF adapter, every decode step eager (cuda_graphs=False), same layout and kernels"


def build_model(args, device):
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = shapes.shape("llama8b")
    cfg = LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
                      max_position_embeddings=8192, tie_word_embeddings=False)
    torch.manual_seed(0)  # every rank builds the same weights (parallelize needs them identical)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The model, layout and generate-length options."""
    p.add_argument("--layers", type=int, default=32, help="decoder layers (Llama-3-8B: 32)")
    p.add_argument("--sp", type=int, default=1, help="SP of the layout (TP = world / SP)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per row")
    p.add_argument("--new-tokens", type=int, default=64, help="generated tokens per timed generate")


def start(args):
    """torchrun + NCCL: (rank, world, this rank's GPU, the ParallelLayout of --sp with TP = world / SP)."""
    from fusedpar.layouts import ParallelLayout

    local, rank, world = _bench.init_distributed()
    return rank, world, torch.device("cuda", local), ParallelLayout(world, sp=args.sp, tp=world // args.sp)


def copy_bandwidth(device) -> float:
    """Bytes per second of a 1 GiB device copy (read + write)."""
    src = torch.empty(1 << 29, dtype=torch.int16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 10 * 2 * src.numel() * src.element_size() / (start.elapsed_time(end) * 1e-3)


def timed_generate(pm, ids, mask, new: int) -> tuple[float, torch.Tensor]:
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    out = pm.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                      pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def tpot_ms(pm, ids, mask, new: int, repeats: int) -> tuple[float, torch.Tensor]:
    timed_generate(pm, ids, mask, new)  # warm-up: graph capture, Triton compiles
    samples, out = [], None
    for _ in range(repeats):
        t1, _ = timed_generate(pm, ids, mask, 1)
        tn, out = timed_generate(pm, ids, mask, new)
        samples.append((tn - t1) / (new - 1) * 1e3)
    return _bench.max_over_ranks(statistics.median(samples)), out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def forced_logits(pm, seq: torch.Tensor, prompt: int, steps: int) -> torch.Tensor:
    """Logits [steps, b, vocab] of `steps` decode steps that feed seq's own tokens after its first
    `prompt` (teacher forcing): both models see the same tokens, whatever either would pick."""
    out = pm(seq[:, :prompt], use_cache=True)
    past, logits = out.past_key_values, []
    for t in range(steps):
        out = pm(seq[:, prompt + t : prompt + t + 1], past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits.append(out.logits[:, -1].float())
    return torch.stack(logits)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--repeats", type=int, default=3, help="timed generates per batch (median)")
    p.add_argument("--out", default="perf/results/hf_decode.json")
    args = p.parse_args()
    if not _bench.torchrun_available():
        print("bench_hf_decode: needs CUDA GPUs and a torchrun launch; nothing to do")
        return 0
    from fusedpar.integrations.hf import parallelize, resident_decoder_bytes

    rank, world, device, lay = start(args)
    bw = _bench.max_over_ranks(-copy_bandwidth(device)) * -1  # the slowest rank's
    models = {}
    for name, graphs, check in (("graphs", None, True), ("eager", False, True), ("unchecked", None, False)):
        model = build_model(args, device)
        models[name] = parallelize(model, lay, shift_threshold=64, cuda_graphs=graphs, check_inputs=check)
        torch.cuda.empty_cache()
    pm = models["graphs"]
    shard = resident_decoder_bytes(pm)
    head = pm.lm_head.weight.numel() * pm.lm_head.weight.element_size()
    floor_ms = (shard + head) / bw * 1e3
    gpu = torch.cuda.get_device_name(device)
    common = {"bench": "hf_decode_tpot", "world": world, "gpu": gpu, "baseline": BASELINE,
              **_bench.run_info(world)}
    if rank == 0:
        print(f"bench_hf_decode: {gpu} x{world}, {lay}, Llama-3-8B shape x {args.layers} layers, bf16; decoder shard "
              f"{shard / 2**30:.2f} GiB + lm_head {head / 2**30:.2f} GiB per rank, copy {bw / 1e9:.0f} GB/s, floor "
              f"{floor_ms:.2f} ms per step", flush=True)
    records = []
    gen = torch.Generator().manual_seed(1)
    for b in (int(x) for x in args.batches.split(",")):
        ids = torch.randint(1, 32000, (b, args.prompt), generator=gen).to(device)
        mask = torch.ones_like(ids)
        mask[1:, : args.prompt // 4] = 0  # rows 1.. left-padded by a quarter: generate's usual batch
        res = {name: tpot_ms(m, ids, mask, args.new_tokens, args.repeats) for name, m in models.items()}
        (g_ms, g_out), (e_ms, e_out), (u_ms, _) = res["graphs"], res["eager"], res["unchecked"]
        same = bool(torch.equal(g_out, e_out))
        # Tokens may part at a near-tie (random weights give flat logits; the graphs' split-KV tiling,
        # chosen for their max_context, rounds the attention's fp32 sums in another order), so the
        # logits are compared on the same tokens: the graph model's greedy continuation, unpadded.
        seq = torch.cat([ids[:, -args.prompt // 2 :], g_out[:, args.prompt :]], dim=1)
        fl = {name: forced_logits(m, seq, args.prompt // 2, 16) for name, m in models.items() if name != "unchecked"}
        ref = build_model(args, device)  # the unsharded model, HF's own attention and cache: the scale of
        with torch.no_grad():            # bf16 rounding differences through this many layers
            fl["unsharded"] = forced_logits(ref, seq, args.prompt // 2, 16)
        del ref
        torch.cuda.empty_cache()

        err, g_ref, e_ref = (rel_err(fl[a], fl[b]) for a, b in (("graphs", "eager"), ("graphs", "unsharded"),
                                                                 ("eager", "unsharded")))
        graph_replays = models["graphs"].fusedpar_stack.graph_steps
        rec = {**common, "case": f"Llama-3-8B shape x{args.layers} layers, batch {b}, {lay}", "tokens": b,
               "baseline_ms": e_ms, "fused_ms": g_ms, "speedup": e_ms / g_ms, "roofline_pct": 100 * floor_ms / g_ms,
               "baseline_roofline_pct": 100 * floor_ms / e_ms, "floor_ms": floor_ms, "prompt_tokens": args.prompt,
               "new_tokens": args.new_tokens, "tokens_equal": same, "forced_logits_rel_err": err,
               "forced_logits_rel_err_vs_unsharded": {"graphs": g_ref, "eager": e_ref},
               "graph_replays": graph_replays, "tpot_unchecked_ms": u_ms, "check_inputs_ms": g_ms - u_ms,
               "check_inputs_pct": 100 * (g_ms - u_ms) / u_ms,
               "graph_captures": models["graphs"]._fusedpar.graph_captures}
        records.append(rec)
        if rank == 0:
            print(f"  batch {b:3d}: TPOT graphs {g_ms:7.2f} ms  eager {e_ms:7.2f} ms  ({e_ms / g_ms:.2f}x)  "
                  f"roofline {rec['roofline_pct']:.0f}% / {rec['baseline_roofline_pct']:.0f}%  tokens equal {same}  "
                  f"teacher-forced logits rel err {err:.1e} (vs the unsharded HF model: graphs {g_ref:.1e}, eager "
                  f"{e_ref:.1e})  graph replays so far {graph_replays}  input check {g_ms - u_ms:+.3f} ms "
                  f"({100 * (g_ms - u_ms) / u_ms:+.1f}%)",
                  flush=True)
    if rank == 0:
        _bench.write_records(records, args.out)
    _bench.finish_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
