"""perf/serve_bench.py on CPU (gloo ranks, a tiny fp32 model, a few dozen short requests): every
policy serves every request, and its greedy tokens are the unsharded model's. The clock is the
simulated one (--fixed-step-s), so the schedule and the policies' switches do not depend on the
machine's speed (auto's do: it reads measured step-time curves; only its tokens are checked)."""

from __future__ import annotations

import importlib
import itertools
import json
import sys
from pathlib import Path

import pytest
import torch

PERF = Path(__file__).resolve().parents[2] / "perf"


@pytest.fixture
def serve_bench(monkeypatch):
    """perf/serve_bench.py imported with perf/ first on sys.path (sys.path and sys.modules restored after)."""
    monkeypatch.setattr(sys, "path", [str(PERF), *sys.path])
    before = set(sys.modules)
    yield importlib.import_module("serve_bench")
    for name in set(sys.modules) - before:
        if str(getattr(sys.modules[name], "__file__", None) or "").startswith(str(PERF)):
            del sys.modules[name]


def reference_tokens(sb, opts: dict, requests: list, seed: int) -> dict[int, list[int]]:
    """Greedy tokens of every request (prompts of `seed`) from the unsharded oracle (DenseDecoderStack),
    one request at a time: the whole prompt in one step, then one token per step."""
    from _serve.engine import greedy, head_weights, layer_weights
    from _serve.trace import prompt_ids

    from fusedpar.layers import DenseDecoderStack, StepBatch

    cfg = sb.decoder_config(opts)
    cpu, dtype = torch.device("cpu"), torch.float32
    weights = [layer_weights(cfg, i, opts["seed"], dtype, cpu) for i in range(opts["layers"])]
    embed, norm, head = head_weights(cfg, opts["vocab"], opts["seed"], dtype, cpu)
    out = {}
    for r in requests:
        dense = DenseDecoderStack(cfg, weights)
        ids = prompt_ids(r, opts["vocab"], seed)
        h = dense.forward(embed[ids], StepBatch((0,), (r.prompt_len,), (0,)))
        toks = [int(greedy(h[-1:], norm, head, cfg.rms_norm_eps)[0])]
        while len(toks) < r.output_len:
            ctx = r.prompt_len + len(toks) - 1
            h = dense.forward(embed[torch.tensor([toks[-1]])], StepBatch((0,), (1,), (ctx,)))
            toks.append(int(greedy(h, norm, head, cfg.rms_norm_eps)[0]))
        out[r.rid] = toks
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_every_policy_serves_every_request_with_the_unsharded_tokens(serve_bench, tmp_path, world):
    argv = ["--cpu", "--world", str(world), "--requests", "32", "--prompt", "3,30", "--output", "1,10",
            "--max-batch-tokens", "16", "--block-size", "4", "--kv-blocks", "1024", "--low-seconds", "0.5",
            "--burst-seconds", "1", "--rate-scale", "8", "--priority-frac", "0.2", "--shift-threshold", "6",
            "--load-low", "2", "--load-high", "5", "--host-tier-tokens", "120", "--curve-points", "1,8,16",
            "--fixed-step-s", "0.01", "--progress-s", "60", "--saturate", "6",
            "--out", str(tmp_path / "serve.json"), "--tokens-out", str(tmp_path / "tok.json")]
    assert serve_bench.main(argv) == 0
    opts = serve_bench.resolve(serve_bench.parser().parse_args(argv))
    want = reference_tokens(serve_bench, opts, serve_bench.trace_of(opts)[0], opts["seed"])
    flood = serve_bench.flood_of(opts)  # the saturated run: 6 requests at t = 0, prompts of seed + 1
    assert len(flood) == 6 and {r.arrival for r in flood} == {0.0}
    want_flood = reference_tokens(serve_bench, opts, flood, opts["seed"] + 1)
    got = json.loads((tmp_path / "tok.json").read_text())
    records = json.loads((tmp_path / "serve.json").read_text())
    assert [r["policy"] for r in records] == list(serve_bench.POLICIES)
    cases = [r["case"].removesuffix(" tiny") for r in records]
    assert set(got) == {*cases, *(f"{c} saturated" for c in cases)}
    for policy, tokens in got.items():
        expect = want_flood if policy.endswith(" saturated") else want
        assert {int(k): v for k, v in tokens.items()} == expect, policy
    for r in records:
        where = r["case"]
        assert r["served"] == r["requests"] == 32, where
        assert r["bench"] == "serve" and r["world"] == world and r["baseline_ms"] > 0 and r["fused_ms"] > 0, where
        assert r["ttft_p99_ms"] >= r["ttft_p50_ms"] > 0 and r["prio_requests"] > 0, where
        assert sum(r["steps"].values()) > 0 and r["throughput_burst_tok_s"] > 0, where
        sat = r["saturated"]
        assert sat["served"] == sat["requests"] == 6 and sum(sat["steps"].values()) > 0, where
        assert r["saturated_tok_s"] == pytest.approx(sat["output_tokens"] / sat["makespan_s"]), where
        assert sat["output_tokens"] == sum(len(v) for v in want_flood.values()), where
    by = {r["policy"]: r for r in records}
    assert set(by["shift"]["steps"]) == {"sp", "tp"}  # both sides of the threshold ran
    assert by["load"]["switches"].get("tp->dp", 0) > 0 and set(by["load"]["steps"]) == {"dp", "tp"}  # KV migrated
    assert by["pd"]["switches"].get("dp->tp", 0) > 0 and by["pd"]["switches"].get("tp->dp", 0) > 0
    assert set(by["pd"]["steps"]) == {"dp", "tp"} and by["pd"]["swap_s"] > 0
    curves = by["auto"]["curves_ms"]  # each layout up to one step's tokens: 16 per replica
    assert [n for n, _ in curves["tp"]] == [1, 8, 16] and [n for n, _ in curves["dp"]] == [1, 8, 16, 16 * world]
    decode = by["auto"]["decode_curves_ms"]  # decode steps of 1, 8 and 16 sequences (max_seqs 16), every layout
    assert {k: [n for n, _ in v] for k, v in decode.items()} == {k: [1, 8, 16] for k in ("tp", "sp", "dp")}
    assert all(ms > 0 for v in decode.values() for _, ms in v)


def test_flood_is_seeded_and_arrives_at_once(serve_bench):
    from _serve.trace import TraceSpec, make_flood, make_trace

    spec = TraceSpec(requests=50, seed=3, prompt=(5, 9), output=(2, 4), priority_frac=0.5)
    flood = make_flood(spec, 40)
    assert flood == make_flood(spec, 40) and [r.rid for r in flood] == list(range(40))
    assert {r.arrival for r in flood} == {0.0} and {r.priority for r in flood} == {0, 1}
    assert all(5 <= r.prompt_len <= 9 and 2 <= r.output_len <= 4 for r in flood)
    trace, _ = make_trace(spec)  # its own draws: not the trace's first requests
    assert [(r.prompt_len, r.output_len) for r in flood] != [(r.prompt_len, r.output_len) for r in trace[:40]]
    with pytest.raises(ValueError, match="flood needs >= 1 request"):
        make_flood(spec, 0)


@pytest.mark.parametrize("cap", [1, 5, 16, 64, 65, 100, 256])
def test_decode_graphs_cover_every_resident_batch(serve_bench, cap):
    from _serve.engine import decode_sizes

    sizes = decode_sizes(cap)
    assert sizes == tuple(sorted(set(sizes))) and sizes[-1] == cap and sizes[0] == 1
    assert all(b / a <= 2 for a, b in itertools.pairwise(sizes))  # a batch pads to < 2x its size
