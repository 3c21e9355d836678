"""Generate docs/performance.md, its plots and README.md's summary from perf/results/*.json.

    python perf/report.py            # write docs/performance.md, the README summary, the plots
    python perf/report.py --check    # exit 1 if docs/performance.md or the README summary is stale

docs/performance.md: per benchmark and bench name, a table of fused vs baseline (ms, speedup,
% of the roofline floor where the records have it), with the GPU, torch / triton, dates and commit
stated once per table; sweep records (tiling searches) are counted, not listed. README.md: the
lines between `<!-- performance:begin -->` and `<!-- performance:end -->` become a short summary
table (min / median / max speedup of the fused path per bench name); without the markers README.md is left alone.
Plots (perf/_plots.py, needs matplotlib) go to perf/results/*.png; --check and --no-plots skip them.
The output depends on the records alone (no clock, sorted keys), so the same records give the same
text. Importing this module does nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "perf" / "results"
DOC = REPO / "docs" / "performance.md"
README = REPO / "README.md"
BEGIN, END = "<!-- performance:begin -->", "<!-- performance:end -->"
COMMAND = "python perf/report.py"

# file stem -> (title, what the fused side is, the benchmark script); the order of the document
BENCHMARKS = {
    "gemm": ("GEMM", "fusedpar.kernels.gemm (Triton, one GPU) on the per-rank TP=4 layer GEMMs",
             "perf/bench_gemm.py"),
    "gemm_fp8": ("FP8 GEMM", "fusedpar.kernels.fp8 (Triton, one GPU): activation quantisation + e4m3 GEMM on the "
                 "per-rank TP=4 layer GEMMs, per-channel and 128 x 128 block scales", "perf/bench_gemm.py --fp8"),
    "qkv_all_to_all": ("QKV projection + Ulysses all-to-all",
                       "fused qkv_all_to_all: GEMM tiles stored into the owners' symmetric buffers",
                       "perf/bench_qkv_all_to_all.py"),
    "all_to_all_o_proj": ("Ulysses return all-to-all + o projection",
                          "fused all_to_all_o_proj (and with the attention in front)",
                          "perf/bench_all_to_all_o_proj.py"),
    "gemm_all_reduce": ("Row-parallel GEMM + all-reduce", "fused gemm_all_reduce (eager and in CUDA graphs)",
                        "perf/bench_gemm_all_reduce.py"),
    "one_shot_all_reduce": ("One-shot all-reduce", "fusedpar.kernels.allreduce one-shot (Triton, symmetric memory)",
                            "perf/bench_one_shot_all_reduce.py"),
    "attention": ("Paged attention", "fused RoPE + KV-cache write + paged attention (Triton, one GPU)",
                  "perf/bench_attention.py"),
    "layer": ("Decoder layer", "one decoder layer per step in each mode", "perf/bench_layer.py"),
    "model": ("Whole model", "TTFT, TPOT and throughput of a whole random-weight model", "perf/model_bench.py"),
    "decode": ("Decode step of one TP rank", "one TP rank's decode step (the rank's shard, one GPU) on the fusedpar "
               "stack's decode graphs; speedup = plain vLLM TP=1 on the same shard / fusedpar", "perf/bench_decode.py"),
    "hf_decode": ("Hugging Face generate", "HF generate TPOT with decode CUDA graphs vs eager",
                  "perf/bench_hf_decode.py"),
    "reshard": ("Re-sharding and the host KV tier",
                "declared-layout switches, KV migration between layouts, host-tier swaps and their overlap with GEMMs",
                "perf/bench_reshard.py"),
    "serve": ("Bursty-traffic serving", "layout policies over one bursty trace (continuous batching over the "
              "fusedpar stack); speedup = static TP's p50 TTFT / the policy's", "perf/serve_bench.py"),
    "vllm": ("vLLM plugin", "vLLM with fusedpar (SP <-> TP) against plain vLLM TP=P, vLLM's engine API, dummy weights",
             "perf/bench_vllm.py"),
    "vllm_serve": ("Bursty-traffic serving in vLLM", "serve_bench's bursty trace through vLLM's engine, one engine per "
                   "case (plain vLLM TP=P and DP=P, fusedpar's layouts and policies); speedup = plain vLLM TP=P's p50 "
                   "TTFT / the case's", "perf/bench_vllm_serve.py"),
}
# bench names whose records compare two plain paths (no fused side): in the document, not the summary
REFERENCE_ONLY = {"layer_plain_sp"}
PLOTS = {"speedup_vs_tokens.png": "gemm", "layer_ms_vs_tokens.png": "layer", "model_bars.png": "model",
         "serve_timeline.png": "serve", "serve_timeline_dp.png": "serve", "serve_timeline_auto.png": "serve"}
# serve_timeline*.png: drawn by perf/serve_bench.py (--plot) with its records, one per call of policies


def load(results: Path = RESULTS) -> dict[str, list[dict]]:
    """file stem -> its records, for every perf/results/*.json, sorted by name."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(results.glob("*.json"))}


def _num(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not v.is_integer():
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return str(int(v))


def _span(values: list[str]) -> str:
    vals = sorted(set(values))
    return vals[0] if len(vals) == 1 else f"{vals[0]} .. {vals[-1]}"


def _machine(recs: list[dict]) -> str:
    """GPU, versions, dates and commit of a table's records, stated once."""
    gpus = ", ".join(f"{w}x {g}" for w, g in sorted({(r["world"], r["gpu"]) for r in recs}))
    torch_v = _span([r.get("torch", "?") for r in recs])
    triton_v = _span([r.get("triton", "?") for r in recs])
    dates = _span([r["date"][:10] for r in recs])
    commits = sorted({r["commit"] for r in recs if r.get("commit")})
    missing = sum(1 for r in recs if not r.get("commit"))
    commit = ", ".join(commits) if commits else "not recorded"
    if commits and missing:
        commit += f" ({missing} records without one)"
    return f"GPU: {gpus}; torch {torch_v}, triton {triton_v}; date {dates}; commit: {commit}."


def _table(recs: list[dict]) -> list[str]:
    shown = [r for r in recs if not r.get("sweep")]
    baselines = sorted({r.get("baseline", "") for r in shown if "error" not in r})
    one_baseline = len(baselines) == 1
    has_roof = any(r.get("roofline_pct") is not None for r in shown)
    head = ["case", "tokens"] + ([] if one_baseline else ["baseline"]) + ["baseline ms", "fused ms", "speedup"]
    head += ["% roofline"] if has_roof else []
    lines = [f"Baseline: {baselines[0]}." if one_baseline else "Baselines: per row.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in shown:
        if "error" in r:
            cells = [r.get("case", ""), _num(r.get("tokens"))] + [""] * (len(head) - 3) + [
                "error: " + r["error"].splitlines()[0][:80].replace("|", "/")]
        else:
            cells = [r["case"], _num(r["tokens"])] + ([] if one_baseline else [r["baseline"]])
            cells += [_num(r["baseline_ms"]), _num(r["fused_ms"]), f"{r['speedup']:.2f}x"]
            if has_roof:
                roof = r.get("roofline_pct")
                cells.append("-" if roof is None else f"{roof:.0f}%")
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |")
    swept = len(recs) - len(shown)
    if swept:
        lines += ["", f"{swept} sweep records (tiling searches) in the same file are not listed."]
    return lines


def _serve_table(recs: list[dict]) -> list[str]:
    """Per policy of a serving run: latency percentiles, throughput per load phase, layouts and switches."""
    def ms(v) -> str:
        return "-" if v is None else f"{v:.1f}"

    def tok(v) -> str:
        return "-" if v is None else f"{v:.0f}"

    traces = sorted({json.dumps(r.get("trace", {}), sort_keys=True) for r in recs})
    trace = json.loads(traces[0]) if len(traces) == 1 else {}
    lines = [f"Per policy ({recs[0].get('model')} x{recs[0].get('layers')} layers, {recs[0].get('dtype')}; trace: "
             + (", ".join(f"{k} {v}" for k, v in sorted(trace.items())) if trace else "per record") + "; clock: "
             + str(recs[0].get("clock")) + "). Latencies in ms, throughput in output tokens/s.", "",
             "| policy | GPUs | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | tok/s low | tok/s burst | tok/s peak "
             "| tok/s saturated | steps per layout | switches | switching s |", "|" + "---|" * 13]
    for r in recs:
        steps = ", ".join(f"{k} {v}" for k, v in sorted(r.get("steps", {}).items()))
        gpus = f"{r.get('world')}x {str(r.get('gpu', '?')).removeprefix('NVIDIA ').split(' ')[0]}"
        cells = [r["case"], gpus, *(ms(r.get(f"{k}_ms")) for k in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")),
                 *(tok(r.get(f"{k}_tok_s")) for k in ("throughput_low", "throughput_burst", "peak_throughput",
                                                      "saturated")),
                 steps, str(r.get("switches_total", 0)), f"{r.get('switch_s', 0):.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _vllm_serve_table(recs: list[dict]) -> list[str]:
    """Per case of a vLLM serving run: latencies, throughput, the ratios to plain vLLM TP=P / DP=P, the plugin's
    counters."""
    def num(v, fmt: str) -> str:
        return "-" if v is None else fmt.format(v)

    lines = ["Per case. Latencies in ms, throughput in output tokens/s; TTFT and TPOT ratios: the case / plain vLLM "
             "TP=P, throughput ratio: the case / plain vLLM DP=P.", "",
             "| case | GPUs | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | TPOT p50 low load | tok/s peak "
             "| tok/s saturated | TTFT p50 / TP | TPOT p50 low / TP | saturated / DP | steps per layout | switches "
             "| KV bytes moved | recomputed tokens |", "|" + "---|" * 16]
    for r in recs:
        fp, ratios = r.get("fusedpar") or {}, r.get("ratios") or {}
        gpus = f"{r.get('world')}x {str(r.get('gpu', '?')).removeprefix('NVIDIA ').split(' ')[0]}"
        steps = ", ".join(f"{k} {v}" for k, v in sorted(fp.get("steps", {}).items()))
        cells = [r.get("label", r["case"]), gpus,
                 *(num(r.get(f"{k}_ms"), "{:.1f}") for k in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99",
                                                              "tpot_p50_low")),
                 num(r.get("peak_throughput_tok_s"), "{:.0f}"), num(r.get("saturated_tok_s"), "{:.0f}"),
                 *(num(ratios.get(k), "{:.2f}") for k in ("ttft_p50_vs_tp", "tpot_p50_low_vs_tp", "saturated_vs_dp")),
                 steps or "-", *(num(fp.get(k), "{}") for k in ("switches", "kv_bytes_moved", "recomputed_tokens"))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _by_bench(recs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in recs:
        out.setdefault(r["bench"], []).append(r)
    return out


def _order(records: dict[str, list[dict]]) -> list[str]:
    return [s for s in BENCHMARKS if s in records] + sorted(s for s in records if s not in BENCHMARKS)


def performance_md(records: dict[str, list[dict]]) -> str:
    lines = ["# Performance", "",
             "<!-- Generated by perf/report.py from perf/results/*.json: do not edit by hand. -->",
             f"Generated from `perf/results/*.json` by `{COMMAND}`; do not edit by hand "
             "(`python perf/report.py --check` fails when this page is stale).", "",
             "Each benchmark times fusedpar's fused path against the plain path it replaces, in the same "
             "process on the same inputs: speedup = baseline ms / fused ms (throughput: fused tokens/s / "
             "baseline tokens/s); % roofline = the floor of the work (GEMM FLOPs at the measured cuBLAS "
             "peak, bytes at the measured HBM or link bandwidth) over the fused time. How each benchmark "
             "measures: perf/README.md and the scripts' docstrings.", ""]
    for stem in _order(records):
        title, what, script = BENCHMARKS.get(stem, (stem, "", ""))
        lines += [f"## {title}", "", f"`perf/results/{stem}.json`" + (f", from `{script}`: {what}." if script else "."),
                  ""]
        for png, owner in PLOTS.items():
            if owner == stem:
                lines += [f"![{png}](../perf/results/{png})", ""]
        for bench, recs in _by_bench(records[stem]).items():
            lines += [f"### {bench}", "", _machine(recs), "", *_table(recs), ""]
            if bench == "serve":
                lines += [*_serve_table(recs), ""]
            if bench == "vllm_serve":
                lines += [*_vllm_serve_table(recs), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


SUMMARY = {  # end-to-end benches for the README: what a user sees (per-kernel tables: docs/performance.md)
    "model_ttft": "time to first token, 4096-token prompt",
    "model_tpot": "time per output token, decode in CUDA graphs",
    "model_throughput": "tokens/s of a mixed batch",
    "hf_decode_tpot": "HF generate, decode graphs vs eager",
    "vllm_ttft": "vLLM, time to first token over prompt lengths (default shift_threshold)",
    "vllm_tpot": "vLLM, time per output token, batch 1 and 32",
    "vllm_throughput": "vLLM, 64 x (2000 + 250) tokens",
}


def summary_md(records: dict[str, list[dict]]) -> str:
    lines = [f"End to end, fused stack over its baseline (generated by `{COMMAND}` from `perf/results/`; every "
             "kernel and shape in [docs/performance.md](docs/performance.md)):", "",
             "| benchmark | baseline | GPU | speedup (min / median / max) |", "|---|---|---|---|"]
    for stem in _order(records):
        for bench, recs in _by_bench(records[stem]).items():
            if bench not in SUMMARY:
                continue
            kept = [r for r in recs if not r.get("sweep") and "error" not in r
                    and not (bench.startswith(("model_", "vllm_")) and not r["case"].startswith("fusedpar "))]
            for world in sorted({r["world"] for r in kept}):  # one row per machine size
                lines.append(_summary_row(bench, [r for r in kept if r["world"] == world]))
    return "\n".join(lines) + "\n"


def _summary_row(bench: str, ok: list[dict]) -> str:
    """One README row: the speedups of `ok` (one bench, one machine size)."""
    sp = [r["speedup"] for r in ok]
    gpus = ", ".join(f"{w}x {g}" for w, g in sorted({(r["world"], r["gpu"]) for r in ok}))
    span = (f"{sp[0]:.2f}x" if len(sp) == 1
            else f"{min(sp):.2f}x / {statistics.median(sp):.2f}x / {max(sp):.2f}x")
    baselines = sorted({str(r.get("baseline", "")).split(" (")[0] for r in ok})
    models = ", ".join(sorted({str(r["model"]) for r in ok if r.get("model")}))
    what = f"{SUMMARY[bench]} ({models})" if models else SUMMARY[bench]
    return f"| {bench}: {what} | {'; '.join(baselines)} | {gpus} | {span} |"


def with_summary(readme: str, summary: str) -> str | None:
    """README text with the lines between the markers replaced by `summary`; None without markers."""
    if BEGIN not in readme or END not in readme or readme.index(BEGIN) > readme.index(END):
        return None
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{summary}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if an output is out of date")
    p.add_argument("--no-plots", action="store_true", help="leave the PNGs alone")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--doc", type=Path, default=DOC)
    p.add_argument("--readme", type=Path, default=README)
    args = p.parse_args(argv)
    records = load(args.results)
    doc = performance_md(records)
    readme_old = args.readme.read_text() if args.readme.is_file() else ""
    readme_new = with_summary(readme_old, summary_md(records))
    if readme_new is None:
        print(f"{args.readme}: no {BEGIN} / {END} markers; left alone")
    if args.check:
        stale = []
        if not args.doc.is_file() or args.doc.read_text() != doc:
            stale.append(str(args.doc))
        if readme_new is not None and readme_new != readme_old:
            stale.append(f"{args.readme} (performance summary)")
        if stale:
            print(f"out of date: {', '.join(stale)}; run `{COMMAND}`", file=sys.stderr)
            return 1
        print("docs/performance.md and the README summary match perf/results")
        return 0
    args.doc.parent.mkdir(parents=True, exist_ok=True)
    args.doc.write_text(doc)
    print(f"wrote {args.doc}")
    if readme_new is not None and readme_new != readme_old:
        args.readme.write_text(readme_new)
        print(f"wrote the performance summary in {args.readme}")
    if not args.no_plots:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import _plots

        written = _plots.draw(records, args.results)
        if written is None:
            print("plots skipped: matplotlib is not installed (pip install matplotlib)")
        for path in written or ():
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
