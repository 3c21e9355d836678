"""FP8 checkpoints in the Hugging Face adapter (fusedpar/integrations/hf/fp8.py): load_parallel and parallelize.

The checkpoints are made here from tiny random models: each projection weight quantised with the FP8
reference (fusedpar.kernels.fp8), stored as e4m3 beside its fp32 scales in the two formats real FP8
checkpoints use (transformers' fine-grained `weight_scale_inv`, compressed-tensors' `weight_scale`).
The oracle is the unsharded model with the same FP8 weights, each projection computed by the FP8
reference math (dynamic activation scales), in fp32 on one process.

Every rank's shards (base and shift views) must equal the oracle's weights cut by the shard map bit for
bit, scales included. The layer math itself is exact in float64 (tests/layers/test_fp8_decoder.py); here,
in fp32, a summation-order difference can flip one e4m3 rounding of an activation, so logits are held to
FP8 rounding, well below the dense model's distance, and greedy tokens must be equal.
A layout cutting inside a scale block, static activation scales and other quantizations are refused
before any tensor data is read.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from fusedpar.integrations.hf.fp8 import FP8_WEIGHTS, fp8_format  # noqa: E402
from fusedpar.kernels.fp8 import FP8Scheme  # noqa: E402
from fusedpar.layers.fp8_weights import FP8Weight  # noqa: E402
from fusedpar.layouts import ParallelLayout  # noqa: E402
from fusedpar.testing.dist import run_distributed  # noqa: E402
from fusedpar.testing.scenarios import rel_error  # noqa: E402
from tests.integrations.hf_models import left_padded, make_model  # noqa: E402
from tests.integrations.hf_workers import case_results, run_named  # noqa: E402

SEED = 5
# an fp32 summation-order difference flipping an e4m3 rounding, or (per-channel scales under TP) activations
# scaled per token over a rank's columns instead of the whole row
FP8_ROUNDING = 0.05
PROJ = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
        "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
FINE_GRAINED = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}


def _compressed(strategy: str, **weights) -> dict:
    acts = {"type": "float", "num_bits": 8, "dynamic": True, "symmetric": True, "strategy": "token"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": acts, "weights": {
                "type": "float", "num_bits": 8, "dynamic": False, "symmetric": True, "strategy": strategy,
                **weights}}}}


CHECKPOINTS = {  # name -> (family, quantization_config, scheme, scale tensor name)
    "block_qwen3": ("qwen3", FINE_GRAINED, FP8Scheme("block", (16, 16)), "weight_scale_inv"),
    "channel_llama": ("llama", _compressed("channel"), FP8Scheme("channel"), "weight_scale"),
    "tensor_qwen3": ("qwen3", {"quant_method": "fp8", "activation_scheme": "dynamic"}, FP8Scheme("tensor"),
                     "weight_scale_inv"),
    "coarse_block_qwen3": ("qwen3", {**FINE_GRAINED, "weight_block_size": [48, 16]}, FP8Scheme("block", (48, 16)),
                           "weight_scale_inv"),
}


# ---- the oracle and the checkpoints ----------------------------------------------------------------
class _ReferenceFP8Linear(torch.nn.Module):
    def __init__(self, w: FP8Weight):
        super().__init__()
        self.w = w

    def forward(self, x):
        return self.w.linear(x)


def _quantized(name: str, checkpoints: dict = CHECKPOINTS, **shape) -> tuple[torch.nn.Module, dict[str, FP8Weight]]:
    """The dense model of checkpoint `name` (make_model with the `shape` overrides) and its FP8 weights."""
    family, _, scheme, _ = checkpoints[name]
    model = make_model(family, seed=SEED, **shape)
    weights = {}
    for i, layer in enumerate(model.model.layers):
        for n in FP8_WEIGHTS:
            weights[f"model.layers.{i}.{PROJ[n]}"] = FP8Weight.quantize(layer.get_submodule(PROJ[n]).weight.detach(),
                                                                        scheme)
    return model, weights


def oracle(name: str, checkpoints: dict = CHECKPOINTS, **shape) -> torch.nn.Module:
    """The unsharded FP8 model: every projection on the FP8 reference math."""
    model, weights = _quantized(name, checkpoints, **shape)
    for key, w in weights.items():
        parent, _, child = key.rpartition(".")
        setattr(model.get_submodule(parent), child, _ReferenceFP8Linear(w))
    return model


def write_checkpoint(name: str, path, checkpoints: dict = CHECKPOINTS, **shape) -> None:
    _, qc, scheme, scale_name = checkpoints[name]
    model, weights = _quantized(name, checkpoints, **shape)
    model.config.quantization_config = qc
    model.save_pretrained(path)
    file = path / "model.safetensors"
    state = safetensors_torch.load_file(file)
    for key, w in weights.items():
        state[f"{key}.weight"] = w.q
        scale = w.scale.reshape(()) if scheme.weight == "tensor" and scale_name == "weight_scale_inv" else w.scale
        state[f"{key}.{scale_name}"] = scale.contiguous()
    safetensors_torch.save_file(state, file, metadata={"format": "pt"})
    assert json.loads((path / "config.json").read_text())["quantization_config"] == qc


def transformers_fp8_model(name: str) -> torch.nn.Module:
    """The model as transformers' FP8 quantizer holds it on a GPU: FP8Linear modules with e4m3 weights."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    _, qc, scheme, _ = CHECKPOINTS[name]
    model, weights = _quantized(name)
    model.config.quantization_config = qc
    for key, w in weights.items():
        parent, _, child = key.rpartition(".")
        n, k = w.shape
        mod = FP8Linear(k, n, block_size=tuple(scheme.block) if scheme.weight == "block" else None)
        mod.weight = torch.nn.Parameter(w.q, requires_grad=False)
        mod.weight_scale_inv = torch.nn.Parameter(w.scale.reshape(mod.weight_scale_inv.shape), requires_grad=False)
        setattr(model.get_submodule(parent), child, mod)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = {}
    for name in CHECKPOINTS:
        path = tmp_path_factory.mktemp(name)
        write_checkpoint(name, path)
        paths[name] = str(path)
    return paths


# ---- per-rank bodies ----------------------------------------------------------------------------------
def _logits(model, ids, mask):
    with torch.no_grad():
        return model(ids, attention_mask=mask, use_cache=False).logits[mask.bool()]


def _greedy(model, ids, mask, new_tokens=6):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=0)[:, ids.shape[1]:]


def _shards_equal(pm, name: str, layout: ParallelLayout, rank: int) -> list[str]:
    """Every FP8 base shard and shift view of every layer against the oracle's weights cut by the shard
    map: the weights' bytes, the scales and their tiles; the names of those that differ."""
    from fusedpar.layers.fp8_weights import build_fp8_shard, fp8_shift_view

    _, weights = _quantized(name)
    shards = layout.weight_shards(pm.fusedpar_spec.decoder.dims)
    differ = []
    for i, layer in enumerate(pm.fusedpar_stack.layers):
        full = {n: weights[f"model.layers.{i}.{PROJ[n]}"] for n in FP8_WEIGHTS}
        for wname, got in layer.w.base.items():
            shard = shards.shard(rank, wname)
            want = build_fp8_shard(full, shard)
            for kind, g, w in (("base", got, want), ("shift", layer.w.shift[wname], fp8_shift_view(want, shard))):
                if not (g.tile == w.tile and torch.equal(g.q.view(torch.uint8), w.q.view(torch.uint8))
                        and torch.equal(g.scale, w.scale)):
                    differ.append(f"layer {i} {wname} {kind}")
    return differ


def _loaded(path: str, name: str, layout: ParallelLayout, rank: int) -> dict:
    from fusedpar.integrations.hf import load_parallel

    ids, mask = left_padded([7, 5, 10], 256, seed=1)
    ref = oracle(name)
    pm = load_parallel(path, layout, dtype=torch.float32, device="cpu", shift_threshold=4, progress=False)
    layer = pm.fusedpar_stack.layers[0]
    dense = make_model(CHECKPOINTS[name][0], seed=SEED)
    want = _logits(ref, ids, mask)
    got = _logits(pm, ids, mask)
    return {"err": rel_error(got, want), "dense_err": rel_error(_logits(dense, ids, mask), want),
            "tokens_equal": torch.equal(_greedy(pm, ids, mask), _greedy(ref, ids, mask)),
            "fp8": sorted(k for k, w in layer.w.base.items() if isinstance(w, FP8Weight)),
            "shards_differ": _shards_equal(pm, name, layout, rank), "logits": got}


def _refused(path: str, layout: ParallelLayout) -> dict:
    from tests.integrations.hf_workers import _CountingOpen, _load_counting_reads

    try:
        _load_counting_reads(path, layout, dtype=torch.float32, device="cpu", progress=False)
    except Exception as e:  # any type: the test names the one it expects
        return {"type": type(e).__name__, "message": str(e), "bytes_read": sum(_CountingOpen.reads.values())}
    return {"type": None, "message": "loaded", "bytes_read": sum(_CountingOpen.reads.values())}


def _in_memory(name: str, layout: ParallelLayout, loaded_logits: torch.Tensor) -> dict:
    from fusedpar.integrations.hf import parallelize

    ids, mask = left_padded([7, 5, 10], 256, seed=1)
    pm = parallelize(transformers_fp8_model(name), layout, shift_threshold=4)
    return {"equal_to_load_parallel": torch.equal(_logits(pm, ids, mask), loaded_logits)}


def run_fp8_cases(rank: int, world: int, paths: dict) -> dict:
    sp2, tp2 = ParallelLayout(world, sp=2), ParallelLayout(world, tp=2)
    out = run_named({
        "block_sp2": lambda: _loaded(paths["block_qwen3"], "block_qwen3", sp2, rank),
        "block_tp2": lambda: _loaded(paths["block_qwen3"], "block_qwen3", tp2, rank),
        "channel_sp2": lambda: _loaded(paths["channel_llama"], "channel_llama", sp2, rank),
        "channel_tp2": lambda: _loaded(paths["channel_llama"], "channel_llama", tp2, rank),
        "tensor_sp2": lambda: _loaded(paths["tensor_qwen3"], "tensor_qwen3", sp2, rank),
        "coarse_block_tp2": lambda: _refused(paths["coarse_block_qwen3"], tp2),
    }, rank, seed=None)
    if "logits" in out["block_sp2"]:
        out["in_memory"] = run_named({"in_memory": lambda: _in_memory("block_qwen3", sp2, out["block_sp2"]["logits"])},
                                     rank, seed=None)["in_memory"]
    for res in out.values():
        res.pop("logits", None)
    return out


@pytest.fixture(scope="module")
def results(checkpoints):
    return run_distributed(run_fp8_cases, 2, checkpoints, timeout=300)


# ---- loading -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["block_sp2", "block_tp2", "channel_sp2", "tensor_sp2"])
def test_fp8_checkpoints_load_exact_shards_and_match_the_unsharded_fp8_model(results, case):
    """Every projection held as e4m3 shards equal to the oracle's bit for bit; the oracle's greedy tokens,
    and its logits within FP8 rounding, much closer than the dense model's."""
    for res in case_results(results, case):
        assert res["fp8"] == ["down", "gate_up", "o", "qkv"] and res["shards_differ"] == [], res
        assert res["err"] < FP8_ROUNDING and res["err"] < res["dense_err"] / 3, res
        assert res["tokens_equal"], res


def test_parallelize_of_transformers_fp8_modules_equals_load_parallel(results):
    """A model holding transformers' FP8Linear modules (as its FP8 quantizer loads one on a GPU) shards to
    the same weights and scales as the checkpoint read by load_parallel: identical logits."""
    for res in case_results(results, "in_memory"):
        assert res["equal_to_load_parallel"], res


def test_a_layout_cutting_inside_scale_blocks_is_refused_before_reading(results):
    for res in case_results(results, "coarse_block_tp2"):
        assert res["type"] == "UnsupportedModelError", res
        assert "inside their 48x16 scale blocks" in res["message"], res
        assert res["bytes_read"] == 0, res


# ---- formats (no processes) ------------------------------------------------------------------------
@pytest.mark.parametrize(("qc", "weight", "block", "scale_name"), [
    (FINE_GRAINED, "block", (16, 16), "weight_scale_inv"),
    ({"quant_method": "fp8"}, "tensor", (128, 128), "weight_scale_inv"),
    (_compressed("channel"), "channel", (128, 128), "weight_scale"),
    (_compressed("tensor"), "tensor", (128, 128), "weight_scale"),
])
def test_fp8_formats(qc, weight, block, scale_name):
    fmt, problems = fp8_format(qc)
    assert problems == [] and (fmt.scheme.weight, fmt.scheme.block, fmt.scale_name) == (weight, block, scale_name)


def test_compressed_tensors_block_weights_need_group_activations():
    block = _compressed("block", block_structure=[128, 128])
    group = block["config_groups"]["group_0"]["input_activations"]
    assert fp8_format(block) == (None, ["compressed-tensors activation strategy 'token' for block weights (want "
                                        "'group' with group_size 128)"])
    group.update(strategy="group", group_size=128)
    fmt, problems = fp8_format(block)
    assert problems == [] and (fmt.scheme.weight, fmt.scheme.block) == ("block", (128, 128))


def test_dequantized_fp8_models_are_plain():
    assert fp8_format({**FINE_GRAINED, "dequantize": True}) == (None, [])
    assert fp8_format(None) == (None, [])


@pytest.mark.parametrize(("qc", "needles"), [
    ({**FINE_GRAINED, "activation_scheme": "static"}, ["activation_scheme='static'"]),
    ({**FINE_GRAINED, "weight_block_size": [128]}, ["weight_block_size=[128]"]),
    ({**FINE_GRAINED, "modules_to_not_convert": ["model.layers.0.mlp.down_proj"]}, ["modules_to_not_convert"]),
    ({"quant_method": "awq", "bits": 4}, ["quant_method='awq'", "supported: 'fp8'"]),
    ({**_compressed("channel", num_bits=4, type="int")}, ["type 'int' with 4 bits"]),
    ({**_compressed("group")}, ["weight strategy 'group'"]),
    ({**_compressed("channel"), "kv_cache_scheme": {"num_bits": 8}}, ["FP8 KV cache"]),
])
def test_unsupported_quantizations_are_named(qc, needles):
    fmt, problems = fp8_format(qc)
    assert fmt is None and problems, problems
    assert all(any(n in p for p in problems) for n in needles), problems


def test_weight_only_compressed_tensors_fp8_is_refused():
    qc = _compressed("channel")
    qc["config_groups"]["group_0"]["input_activations"] = None
    assert fp8_format(qc)[1] == ["compressed-tensors FP8 weights without activation quantization (weight-only FP8)"]


def test_inspect_model_refuses_layouts_that_cut_scale_blocks_and_fused_fp8():
    from fusedpar.integrations.hf.model import fused_decision
    from fusedpar.integrations.hf.spec import UnsupportedModelError, inspect_model

    model = make_model("qwen3", seed=SEED)
    model.config.quantization_config = CHECKPOINTS["coarse_block_qwen3"][1]
    with pytest.raises(UnsupportedModelError) as e:
        inspect_model(model, ParallelLayout(2, tp=2))
    assert "cuts FP8 weights inside their 48x16 scale blocks" in str(e.value)
    model.config.quantization_config = FINE_GRAINED
    spec = inspect_model(model, ParallelLayout(2, tp=2))
    assert spec.fp8.scheme == FP8Scheme("block", (16, 16)) and spec.dtype == torch.float32
    with pytest.raises(UnsupportedModelError, match="FP8 weights"):
        fused_decision(spec, torch.device("cpu"), True)
