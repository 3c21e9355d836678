"""Every perf/ script and tool imports on CPU without running (no work at import), and
perf/report.py's output is deterministic and touches README.md only between its markers."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

PERF = Path(__file__).resolve().parents[1] / "perf"
SCRIPTS = sorted(p for p in [*PERF.glob("*.py"), *(PERF / "tools").glob("*.py")])


@pytest.fixture
def perf_on_path(monkeypatch):
    """perf/ first on sys.path (the scripts import their siblings); sys.path and sys.modules restored after."""
    monkeypatch.setattr(sys, "path", [str(PERF), *sys.path])
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:  # the perf modules only; libraries they loaded stay
        if str(getattr(sys.modules[name], "__file__", None) or "").startswith(str(PERF)):
            del sys.modules[name]


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(PERF)))
def test_script_imports_without_running(path, perf_on_path, capsys):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # as `python perf/x.py` has it: dataclasses look their module up
    spec.loader.exec_module(module)
    assert capsys.readouterr().out == "", f"{path.name} printed at import"
    if path.name not in ("_bench.py", "_plots.py", "shapes.py"):
        assert callable(getattr(module, "main", None)), f"{path.name} has no main()"


def test_shapes_are_the_models(perf_on_path):
    shapes = importlib.import_module("shapes")
    s = shapes.shape("llama70b")
    assert (s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.layers) == (8192, 64, 8, 128, 28672, 80)
    s = shapes.shape("qwen32b")
    assert (s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.layers) == (5120, 64, 8, 128, 25600, 64)
    s = shapes.shape("llama8b")
    assert (s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.layers) == (4096, 32, 8, 128, 14336, 32)
    kw = shapes.decoder_config_kwargs("qwen32b")
    assert kw["hidden_size"] == 5120 and kw["qk_norm"] is True
    with pytest.raises(ValueError, match="unknown model shape"):
        shapes.shape("gpt5")


def test_report_is_deterministic_and_keeps_readme_outside_markers(perf_on_path, tmp_path):
    report = importlib.import_module("report")
    records = report.load()
    assert report.performance_md(records) == report.performance_md(report.load())
    doc = report.performance_md(records)
    assert "do not edit by hand" in doc and "python perf/report.py" in doc
    summary = report.summary_md(records)
    readme = tmp_path / "README.md"
    text = f"# title\n\nintro\n\n{report.BEGIN}\nold table\n{report.END}\n\nrest\n"
    readme.write_text(text)
    args = ["--no-plots", "--doc", str(tmp_path / "performance.md"), "--readme", str(readme)]
    assert report.main(args) == 0
    got = readme.read_text()
    assert got == f"# title\n\nintro\n\n{report.BEGIN}\n{summary}{report.END}\n\nrest\n"
    assert (tmp_path / "performance.md").read_text() == doc
    assert report.main([*args, "--check"]) == 0
    readme.write_text(got.replace("| model_ttft", "| model_ttft (edited)"))
    assert report.main([*args, "--check"]) == 1
    plain = tmp_path / "PLAIN.md"
    plain.write_text("# no markers\n")
    assert report.main(["--no-plots", "--doc", str(tmp_path / "p.md"), "--readme", str(plain)]) == 0
    assert plain.read_text() == "# no markers\n"


def test_bench_reshard_smoke_runs_on_cpu_and_writes_valid_records(tmp_path):
    """perf/bench_reshard.py --smoke (2 gloo processes, tiny shapes) executes every measurement and writes
    records of the committed schema (tests/test_perf_records.py), its own checks passing."""
    import json
    import subprocess

    from tests.test_perf_records import BENCHES, NUMBERS, STRINGS

    out = tmp_path / "reshard.json"
    run = subprocess.run([sys.executable, str(PERF / "bench_reshard.py"), "--smoke", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = json.loads(out.read_text())
    assert {r["bench"] for r in records} == BENCHES["reshard"]
    for r in records:
        where = f"{r['bench']} {r['case']}"
        for key in NUMBERS:
            assert isinstance(r[key], int | float) and r[key] > 0, f"{where}: {key} = {r[key]!r}"
        for key in STRINGS:
            assert isinstance(r[key], str) and r[key], f"{where}: {key} = {r[key]!r}"
        assert r["speedup"] == pytest.approx(r["baseline_ms"] / r["fused_ms"], rel=1e-9), where
        assert r["world"] == 2 and r.get("values_ok", True) is True, where
    switch = {r["case"]: r for r in records if r["bench"] == "reshard_switch"}
    assert set(switch) == {"sp2->tp2", "tp2->sp2"}
    assert all(r["weight_bytes_moved"] == 0 and r["kv_moves"] == 0 for r in switch.values())
    assert switch["tp2->sp2"]["baseline_bytes_moved"] > 0  # undeclared: TP shards fetch the SP=2 (full) rows
    kv = [r for r in records if r["bench"] == "reshard_kv"]
    assert {r["case"] for r in kv} == {"dp2->tp2", "tp2->dp2"} and all(r["bytes"] > 0 for r in kv)
    assert any(r["baseline"].startswith("re-prefill") for r in kv)


def test_vllm_steady_tpot_leaves_out_the_batch_prefill_steps(perf_on_path):
    """bench_vllm's batch TPOT: only the window where every request decodes (no prefill step of a
    later request inside), per request time over its tokens there, median over requests."""
    steady_tpot = importlib.import_module("bench_vllm").steady_tpot
    # request a: first token at t=1, then one token per 0.01 s; request b: first token at t=1.5 (its prefill
    # was a 0.5 s step that also delayed a: a's tokens 2.. arrive from t=1.5), one per 0.01 s, both 51 tokens
    a = [(1.0, 1)] + [(1.5 + 0.01 * i, 2 + i) for i in range(50)]
    b = [(1.5 + 0.01 * i, 1 + i) for i in range(51)]
    assert steady_tpot([{"marks": a}, {"marks": b}]) == pytest.approx(0.01)
    # the per-request TPOT of a, (finish - first) / (n - 1), carries the 0.5 s step
    assert (a[-1][0] - a[0][0]) / 50 > 0.019
    assert steady_tpot([{"marks": a}, {"marks": [(3.0, 1), (3.1, 2)]}]) is None  # no common window
