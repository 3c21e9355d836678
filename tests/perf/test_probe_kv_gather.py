"""perf/tools/probe_kv_gather.py on CPU (Triton interpreter, tiny shapes): every variant it times (the
library's move_kv_rows, the flat-index torch ops) equals torch's index_select / index_copy_ along the
token-row dim bit for bit on fragmented block tables, so its timings compare the same work."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

PERF = Path(__file__).resolve().parents[2] / "perf"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernels need the interpreter on CPU")
def test_every_variant_matches_index_select_and_index_copy(monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", [str(PERF), *sys.path])
    spec = importlib.util.spec_from_file_location("probe_kv_gather", PERF / "tools" / "probe_kv_gather.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    assert probe.main(["--smoke"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "MISMATCH" not in out and out.count("move_kv_rows") == 2, out
