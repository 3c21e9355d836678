"""The committed benchmark records in perf/results/ keep one schema, and docs/performance.md is
generated from them.

Every file in perf/results/*.json is one benchmark's JSON list of records with the keys bench, case,
tokens, world, gpu, baseline, baseline_ms, fused_ms, speedup, roofline_pct (a positive number, or
null where the benchmark has no floor for that record), torch, triton, date, command, and commit
(the git commit measured; required of records dated from COMMIT_REQUIRED_FROM on, when the benches
started writing it). These tests read the committed files, so a benchmark change that drops or nulls
a key fails in CI, not in a reader's table.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "perf" / "results"
# file stem -> the bench names its records may carry; every perf/results/*.json must be listed
BENCHES = {
    "gemm": {"gemm"},
    "gemm_fp8": {"gemm_fp8"},
    "qkv_all_to_all": {"qkv_all_to_all"},
    "all_to_all_o_proj": {"all_to_all_o_proj"},
    "gemm_all_reduce": {"gemm_all_reduce"},
    "one_shot_all_reduce": {"one_shot_all_reduce"},
    "attention": {"attention_prefill", "attention_decode"},
    "layer": {"layer_base", "layer_shift", "layer_shift_policy", "layer_plain_sp"},
    "model": {"model_ttft", "model_tpot", "model_throughput"},
    "hf_decode": {"hf_decode_tpot"},
    "decode": {"decode"},
    "vllm": {"vllm_ttft", "vllm_tpot", "vllm_throughput", "vllm_online"},
    "vllm_serve": {"vllm_serve"},
    "reshard": {"reshard_switch", "reshard_kv", "reshard_swap", "reshard_overlap"},
    "serve": {"serve"},
}
# world sizes of each benchmark's committed records: the single-GPU ops 1, the others the machines they ran on
WORLD = {"gemm": {1}, "gemm_fp8": {1}, "attention": {1}, "decode": {1}, "hf_decode": {2}, "vllm": {2, 4},
         "reshard": {2, 4}, "serve": {2, 4}}
# GPUs of each benchmark's committed records (default H200; the machine is named in every record and table)
GPUS = {"serve": ("H200", "H100"), "reshard": ("H200", "H100"), "gemm_fp8": ("H200", "H100"),
        "decode": ("H200", "H100"), "vllm_serve": ("H200", "H100")}
NUMBERS = ("tokens", "world", "baseline_ms", "fused_ms", "speedup")
STRINGS = ("bench", "case", "gpu", "baseline", "torch", "triton", "date", "command")
COMMIT_REQUIRED_FROM = "2026-11-27"
COMMIT = re.compile(r"[0-9a-f]{7,40}(\+dirty)?")
# roofline_pct may be null only in these benches (a step mix with no single floor)
# reshard: a layout switch (views) has no floor; serve, vllm_serve: latencies of a whole trace
ROOFLINE_OPTIONAL = {"model", "vllm", "reshard", "serve", "vllm_serve"}
# benchmarks whose records the next GPU run writes (perf/run_gpu.sh has their item): their file may be
# missing until then; once there it is checked like every other
AWAITING_FIRST_RUN = {"gemm_fp8", "decode", "vllm_serve"}


def _records(stem: str) -> list[dict]:
    path = RESULTS / f"{stem}.json"
    if stem in AWAITING_FIRST_RUN and not path.is_file():
        pytest.skip(f"{path.name}: written by its benchmark's first GPU run (perf/run_gpu.sh)")
    assert path.is_file(), f"{path} is missing"
    records = json.loads(path.read_text())
    assert isinstance(records, list) and records, f"{path}: want a non-empty JSON list"
    return records


def _where(stem: str, i: int, rec: dict) -> str:
    return f"{stem}.json record {i} ({rec.get('case')!r}, tokens {rec.get('tokens')})"


def _positive(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def test_every_results_file_is_a_known_benchmark():
    stems = {p.stem for p in RESULTS.glob("*.json")}
    missing = set(BENCHES) - stems - AWAITING_FIRST_RUN
    assert stems <= set(BENCHES) and not missing, f"unknown {sorted(stems - set(BENCHES))}, missing {sorted(missing)}"
    others = sorted(p.name for p in RESULTS.iterdir() if p.suffix not in (".json", ".png"))
    assert not others, f"perf/results keeps the benchmarks' JSON and the report's plots only: {others}"


@pytest.mark.parametrize("stem", BENCHES)
def test_records_have_every_key(stem):
    for i, rec in enumerate(_records(stem)):
        where = _where(stem, i, rec)
        assert rec.get("bench") in BENCHES[stem], f"{where}: bench {rec.get('bench')!r}"
        for key in NUMBERS:
            assert _positive(rec.get(key)), f"{where}: {key} = {rec.get(key)!r}"
        roof = rec.get("roofline_pct", "missing")
        assert _positive(roof) or (roof is None and stem in ROOFLINE_OPTIONAL), f"{where}: roofline_pct = {roof!r}"
        for key in STRINGS:
            assert isinstance(rec.get(key), str) and rec[key], f"{where}: {key} = {rec.get(key)!r}"
        date = datetime.fromisoformat(rec["date"])
        if "commit" in rec or date.date().isoformat() >= COMMIT_REQUIRED_FROM:
            assert isinstance(rec.get("commit"), str) and COMMIT.fullmatch(rec["commit"]), \
                f"{where}: commit = {rec.get('commit')!r}"


@pytest.mark.parametrize("stem", BENCHES)
def test_speedup_is_baseline_over_fused(stem):
    for i, rec in enumerate(_records(stem)):
        want = rec["baseline_ms"] / rec["fused_ms"]
        assert rec["speedup"] == pytest.approx(want, rel=1e-9), f"{_where(stem, i, rec)}: {rec['speedup']} vs {want}"


@pytest.mark.parametrize("stem", BENCHES)
def test_records_are_from_the_target_machine(stem):
    want_world = WORLD.get(stem, {4})
    for i, rec in enumerate(_records(stem)):
        assert rec["world"] in want_world, f"{_where(stem, i, rec)}: world {rec['world']}"
        assert any(g in rec["gpu"] for g in GPUS.get(stem, ("H200",))), f"{_where(stem, i, rec)}: gpu {rec['gpu']!r}"


@pytest.mark.parametrize("stem", BENCHES)
def test_records_name_no_machine_paths(stem):
    """Commands name the repo's paths or $OUT, never a machine's own folders."""
    for i, rec in enumerate(_records(stem)):
        assert "/root/" not in rec["command"] and "/tmp/" not in rec["command"], f"{_where(stem, i, rec)}"


def test_performance_doc_is_generated_from_the_records():
    """docs/performance.md is perf/report.py's output for the committed records, never hand-edited."""
    run = subprocess.run([sys.executable, str(REPO / "perf" / "report.py"), "--check"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
