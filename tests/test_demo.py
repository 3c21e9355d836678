"""The `fusedpar demo` main job: real short runs (built-in model, a saved checkpoint, a deliberate
fault that the check must catch), its --help, and impossible options rejected before any process starts.

Runs use 2 processes and a 1-layer model (a few seconds each after transformers is imported);
the default 4-process run is the same code with W=4 (its modes are checked without spawning).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusedpar.demo import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ("mode", "TTFT ms", "TPOT ms", "tokens/s", "steps base/shift", "max |logit err|", "check")
MODES_2 = ("static TP=2", "static SP=2", "shift SP=2 <-> TP=2")
DP_MODES_2 = ("static DP=2", "DP=2 <-> TP=2", "prefill SP=2 -> decode DP=2")


def _table(out: str) -> dict[str, str]:
    """mode label -> its table row."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if all(c in line for c in COLUMNS))
    rows = {}
    for line in lines[start + 2:]:
        if not line.strip():
            break
        label = next((m for m in sorted(MODES_2 + DP_MODES_2, key=len, reverse=True) if line.startswith(m)),
                     line.split("  ")[0])
        rows[label] = line
    return rows


def _steps(row: str) -> tuple[int, int]:
    base, shift = row.split(" / ")
    return int(base.split()[-1]), int(shift.split()[0])


def test_demo_runs_every_mode_and_matches(capfd):
    """Every default mode: static TP, static SP, shift, static DP, DP <-> TP mid-decode, prefill SP -> decode DP."""
    pytest.importorskip("transformers")
    assert main(["demo", "--world-size", "2", "--layers", "1"]) == 0
    out = capfd.readouterr().out
    rows = _table(out)
    assert set(rows) == set(MODES_2 + DP_MODES_2)
    for label in MODES_2 + DP_MODES_2:
        assert f"{label}: running" in out and f"{label}: done" in out  # progress per mode
        assert rows[label].rstrip().endswith("ok"), rows[label]
    # prefills (200 and 480 tokens) run base under the default threshold 64, decode steps shift
    assert _steps(rows["static TP=2"]) == (0, 32)
    assert _steps(rows["static SP=2"]) == (32, 0)
    assert _steps(rows["shift SP=2 <-> TP=2"]) == (2, 30)
    # a replica of one rank (DP=2) has no SP: its steps count as shift whatever the threshold; the switching modes
    # count the steps of both layouts: 32 in all
    assert _steps(rows["static DP=2"]) == (0, 32)
    assert _steps(rows["DP=2 <-> TP=2"]) == (0, 32)
    assert _steps(rows["prefill SP=2 -> decode DP=2"]) == (2, 30)
    # the timed run switches twice per phase (into the prefill layout, then the decode layout), and moves the
    # KV of the live requests at each decode switch (the finished ones are released before the next prefill)
    for label in DP_MODES_2[1:]:
        line = next(x for x in out.splitlines() if x.startswith(f"{label}: "))
        assert "4 live switches, 0 weight bytes and " in line and " 0.00 MiB" not in line, line
    assert "All modes match the unsharded model." in out


def test_demo_catches_a_wrong_shard(capfd):
    """One rank's o_proj shard off by 1% in one mode: that row fails, the others pass, exit 1."""
    pytest.importorskip("transformers")
    assert main(["demo", "--world-size", "2", "--layers", "1", "--no-dp", "--inject-fault", "static SP=2"]) == 1
    out = capfd.readouterr().out
    rows = _table(out)
    assert "FAIL" in rows["static SP=2"] and "logits" in rows["static SP=2"]
    for label in ("static TP=2", "shift SP=2 <-> TP=2"):
        assert rows[label].rstrip().endswith("ok"), rows[label]
    assert "MISMATCH" in out


def test_demo_with_a_local_checkpoint(tmp_path, capfd):
    """--model: a tiny random Qwen3 (tied embeddings, q/k norm) saved as sharded safetensors."""
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from tests.integrations.hf_models import make_model

    make_model("qwen3", seed=3, max_position_embeddings=512).save_pretrained(tmp_path, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert main(["demo", "--world-size", "2", "--model", str(tmp_path), "--no-dp"]) == 0
    out = capfd.readouterr().out
    assert f"{tmp_path} (qwen3, 2 layers" in out
    rows = _table(out)
    assert set(rows) == set(MODES_2) and all(r.rstrip().endswith("ok") for r in rows.values())


def test_default_run_has_the_mixed_layout_and_the_dp_modes_too():
    """No arguments: 4 processes, static TP=4, static SP=4, shift SP=4 <-> TP=4 and SP=2xTP=2 <-> TP=4, then
    static DP=4, DP=4 <-> TP=4 and prefill SP=4 -> decode DP=4 (--no-dp: without the last three)."""
    pytest.importorskip("transformers")
    from fusedpar.demo import _validate

    args = build_parser().parse_args(["demo", "--no-dp"])
    modes, what = _validate(args, args.parser)
    assert [(m.label, m.sp, m.tp) for m in modes] == [
        ("static TP=4", 1, 4), ("static SP=4", 4, 1), ("shift SP=4 <-> TP=4", 4, 1),
        ("shift SP=2xTP=2 <-> TP=4", 2, 2)]
    assert modes[1].threshold == 0 and modes[2].threshold == modes[3].threshold == 64
    assert "4 layers, hidden 256, 16 q / 4 kv heads" in what
    args = build_parser().parse_args(["demo", "--sp", "2", "--threshold", "8", "--no-dp"])
    modes, _ = _validate(args, args.parser)
    assert [(m.label, m.sp, m.tp, m.threshold) for m in modes][2:] == [("shift SP=2xTP=2 <-> TP=4", 2, 2, 8)]
    args = build_parser().parse_args(["demo"])
    modes, _ = _validate(args, args.parser)
    assert [(m.label, m.sp, m.tp, m.decode, m.switch_after) for m in modes][4:] == [
        ("static DP=4", 1, 1, None, 0), ("DP=4 <-> TP=4", 1, 4, (1, 1), 4),
        ("prefill SP=4 -> decode DP=4", 4, 1, (1, 1), 0)]
    # on GPUs the data-parallel modes are opt-in (--dp)
    from fusedpar.demo import _modes

    for argv, n in ((["--device", "cuda"], 4), (["--device", "cuda", "--dp"], 7)):
        args = build_parser().parse_args(["demo", *argv])
        assert len(_modes(args, args.parser)) == n, argv


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for option in ("--world-size", "--sp", "--tp", "--threshold", "--device", "--model", "--no-check", "--rtol",
                   "--layers", "--seed", "--dp", "--no-dp"):
        assert option in out
    for fact in ("default 4", "default 64", "--sp x --tp must equal", "one process per GPU", "bf16",
                 "local Hugging Face checkpoint", "memory of the whole model", "Exit status", "static DP=W",
                 "DP=W <-> TP=W", "prefill SP=W -> decode DP=W", "halfway through its decode", "moving the live KV",
                 "off with --device cuda"):
        assert fact in out, fact
    assert "--inject-fault" not in out  # a test hook, not an option for users


def test_help_numbers_match_the_workload():
    from fusedpar.demo_workload import WORKLOAD

    help_text = " ".join(build_parser().parse_args(["demo"]).parser.format_help().split())
    assert sorted(p.prompt_tokens for p in WORKLOAD) == [200, 480]
    assert "(200 and 480 tokens)" in help_text
    assert "3 long prompts (237, 150, 93 tokens) generating 8 tokens each" in help_text
    assert WORKLOAD[0].prompt_lens == (237, 150, 93) and WORKLOAD[0].new_tokens == 8
    assert len(WORKLOAD[1].prompt_lens) == 16 and WORKLOAD[1].new_tokens == 24
    assert (min(WORKLOAD[1].prompt_lens), max(WORKLOAD[1].prompt_lens)) == (5, 20)


@pytest.mark.parametrize(("argv", "message"), [
    (["--sp", "3"], "--sp 3 does not divide --world-size 4 (the TP degree would be 4 / 3)"),
    (["--tp", "8"], "--tp 8 does not divide --world-size 4 (the SP degree would be 4 / 8)"),
    (["--sp", "2", "--tp", "4"], "--sp 2 x --tp 4 = 8 must equal --world-size 4"),
    (["--tp", "4"], "--sp 1 (--tp 4) makes the shift mode static TP=4"),
    (["--rtol", "inf"], "--rtol must be > 0 and finite (got inf)"),
    (["--seed", str(2**64)], "--seed must be in [0, 2**62)"),
    (["--wrold-size", "4"], "unrecognized arguments: --wrold-size 4"),
    (["--world-size", "3"], "intermediate_size=512 is not divisible by sp*tp=1*3=3"),
    (["--world-size", "32"], "num_q_heads=16 is not divisible by sp*tp=1*32=32"),
    (["--world-size", "1"], "--world-size must be >= 2 (got 1)"),
    (["--threshold", "-1"], "--threshold must be >= 0 (got -1)"),
    (["--model", "/nonexistent/ckpt"], "--model /nonexistent/ckpt: not a local checkpoint directory"),
    (["--model", ".", "--layers", "2"], "--layers applies to the built-in model only"),
])
def test_impossible_options_fail_before_spawning(argv, message, capsys, monkeypatch):
    pytest.importorskip("transformers")
    import fusedpar.testing.dist as dist_mod

    def no_spawn(*a, **k):
        raise AssertionError("processes were started")

    monkeypatch.setattr(dist_mod, "run_distributed", no_spawn)
    with pytest.raises(SystemExit) as e:
        main(["demo", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "usage: fusedpar demo" in err


def test_cuda_world_larger_than_the_gpu_count_is_rejected(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit) as e:
        main(["demo", "--device", "cuda", "--world-size", "4"])
    assert e.value.code == 2
    assert "--world-size 4 needs 4 GPUs, this machine has 2" in capsys.readouterr().err


def test_summary_flags_rank_disagreement_and_unchecked_runs():
    """The table logic on synthetic per-rank results: --no-check rows, and ranks that chose different tokens."""
    from fusedpar.demo import _summarise, _table
    from fusedpar.demo_workload import DemoJob, Mode, ModeResult

    job = DemoJob(modes=(Mode("a", 2, 1, 0), Mode("b", 1, 2, 10**9)), check=False)

    def result(label, tokens="t"):
        r = ModeResult(label, prefill_s=[0.1, 0.05], decode_s=[[0.01] * 7, [0.02] * 23],
                       steps={"base": 32, "shift": 0}, digest="d", token_digest=tokens)
        return r

    per_rank = [[result("a"), result("b")], [result("a"), result("b", tokens="other")]]
    rows = _summarise(job, per_rank)
    assert rows[0]["ok"] and not rows[1]["ok"]
    text = _table(rows)
    assert "not checked" in text and "ok (ranks agree)" in text and "FAIL: ranks chose different tokens" in text
    # TTFT: 3 requests at 100 ms and 16 at 50 ms; TPOT: 3 at 10 ms and 16 at 20 ms
    assert rows[0]["ttft"] == pytest.approx((3 * 0.1 + 16 * 0.05) / 19)
    assert rows[0]["tpot"] == pytest.approx((3 * 0.01 + 16 * 0.02) / 19)


def test_cli_help_does_not_import_torch_or_transformers():
    code = ("import sys; from fusedpar.demo import build_parser; build_parser().format_help(); "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["False", "False"]
    out = subprocess.run([sys.executable, "-m", "fusedpar", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and "demo" in out.stdout


def test_reference_check_fails_on_a_non_finite_logit():
    """A NaN logit at a prompt position (whose argmax picks no token) must fail the check: max() of
    Python floats dropped it, so the row read as exact."""
    pytest.importorskip("transformers")
    from fusedpar.demo_workload import DemoJob, Mode, ModeResult, build_full_model, check_against_reference, prompts

    job = DemoJob(modes=(Mode("fake", 1, 1, 0),), layers=1)
    model = build_full_model(job, torch.device("cpu"))
    exact, poisoned, logits = ModeResult("exact"), ModeResult("poisoned"), []
    with torch.no_grad():
        for j, phase in enumerate(job.workload):
            for p in prompts(phase, 1024, job.seed + 1 + j):
                ids = torch.tensor([p])
                gen = model.generate(ids, max_new_tokens=phase.new_tokens, do_sample=False,
                                     attention_mask=torch.ones_like(ids))[0, len(p):].tolist()
                exact.tokens.append(gen)
                poisoned.tokens.append(gen)
                logits.append(model(input_ids=torch.tensor([p + gen[:-1]])).logits[0].float())
    bad = [t.clone() for t in logits]
    bad[0][0, 0] = float("nan")
    check_against_reference(job, [exact, poisoned], [logits, bad], torch.device("cpu"), 1024, lambda msg: None)
    assert exact.max_abs_err == 0.0 and exact.token_mismatches == 0
    assert poisoned.max_abs_err == float("inf"), poisoned.max_abs_err
