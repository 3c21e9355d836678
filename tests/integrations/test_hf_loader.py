"""fusedpar.integrations.hf.load_parallel: a local safetensors checkpoint read straight into shards (loader.py).

One spawn (gloo, 2 CPU ranks, fp32) runs every load_parallel case; each test checks one case:
- a checkpoint holding tensors its config.json has no place for (a layer beyond
  num_hidden_layers, an o_proj bias the config does not enable) must be refused naming the keys,
  not loaded without them; the per-layer RoPE tables of old checkpoints are ignored as
  from_pretrained ignores them;
- a missing tensor or shard file, or a layout for another world size, is refused before any tensor
  data is read (a big checkpoint would otherwise be read for minutes before the error);
- a directory without config.json says so; dtype="auto" / "float32" are taken as from_pretrained
  takes them;
- kv-head replication (MQA, TP=2) from a sharded checkpoint: logits equal parallelize(full
  model)'s bit for bit and the unsharded model's within 1e-4, every rank holds only its shard,
  nothing is left on the meta device.
In-process: CheckpointReader checks an index against its files. Loading per family and layout,
with the bytes each rank reads: test_hf.py (loader_* cases).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from fusedpar.layouts import ParallelLayout  # noqa: E402
from fusedpar.testing.dist import run_distributed  # noqa: E402
from fusedpar.testing.scenarios import rel_error  # noqa: E402
from tests.integrations.hf_models import left_padded, make_model  # noqa: E402
from tests.integrations.hf_workers import case_results, run_named  # noqa: E402

REL_TOL = 1e-4
SEED = 3


# ---- checkpoints (written by the parent process) --------------------------------------------------
def _edit(path, drop=(), add=None):
    """Rewrite a single-file checkpoint without `drop` and with `add` (name -> tensor)."""
    file = path / "model.safetensors"
    state = safetensors_torch.load_file(file)
    for key in drop:
        del state[key]
    state.update(add or {})
    safetensors_torch.save_file(state, file, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = {}

    def save(name, family, dtype=torch.float32, max_shard_size="50GB", **overrides):
        path = tmp_path_factory.mktemp(name)
        make_model(family, seed=SEED, **overrides).to(dtype).save_pretrained(path, max_shard_size=max_shard_size)
        paths[name] = str(path)
        return path

    _edit(save("extra_layer", "llama"), add={"model.layers.2.mlp.up_proj.weight": torch.zeros(128, 64)})
    _edit(save("extra_bias", "llama"), add={"model.layers.0.self_attn.o_proj.bias": torch.ones(64)})
    _edit(save("old_inv_freq", "llama"), add={"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)})
    _edit(save("missing", "llama"), drop=["model.layers.1.mlp.up_proj.weight"])
    path = save("missing_file", "llama", max_shard_size="60KB")
    sorted(path.glob("*.safetensors"))[-1].unlink()
    (save("no_config", "llama") / "config.json").unlink()
    save("bf16", "llama", dtype=torch.bfloat16)
    path = save("mqa_sharded", "llama", num_key_value_heads=1, max_shard_size="60KB")
    assert len(list(path.glob("*.safetensors"))) >= 3
    return paths


# ---- per-rank bodies ------------------------------------------------------------------------------
def _logits(model, ids, mask):
    with torch.no_grad():
        return model(ids, attention_mask=mask, use_cache=False).logits[mask.bool()]


def _refused(path, layout, **kwargs) -> dict:
    """load_parallel that must raise: the exception and the tensor bytes read before it."""
    from tests.integrations.hf_workers import _CountingOpen, _load_counting_reads

    try:
        _load_counting_reads(path, layout, dtype=torch.float32, device="cpu", progress=False, **kwargs)
    except Exception as e:  # any type: the test names the one it expects
        return {"type": type(e).__name__, "message": str(e), "bytes_read": sum(_CountingOpen.reads.values())}
    return {"type": None, "message": "loaded", "bytes_read": sum(_CountingOpen.reads.values())}


def _shard_shape(shard, hidden: int) -> tuple[int, int]:
    """Rows of a column-parallel weight (dim 0) or columns of a row-parallel one (dim 1)."""
    return (shard.size, hidden) if shard.torch_dim == 0 else (hidden, shard.size)


def _mqa_sharded(path, layout, rank) -> dict:
    from fusedpar.integrations.hf import load_parallel, parallelize

    ids, mask = left_padded([7, 5, 10], 256, seed=1)
    ref = make_model("llama", seed=SEED, num_key_value_heads=1)
    want = _logits(ref, ids, mask)
    full = _logits(parallelize(make_model("llama", seed=SEED, num_key_value_heads=1), layout, shift_threshold=4),
                   ids, mask)
    pm = load_parallel(path, layout, dtype=torch.float32, device="cpu", shift_threshold=4, progress=False)
    got = _logits(pm, ids, mask)
    layer = pm.fusedpar_stack.layers[0]
    cfg = pm.fusedpar_spec.decoder
    shards = layout.weight_shards(cfg.dims)
    tensors = [*pm.named_parameters(), *pm.named_buffers()]
    tensors += [(f"layer.{k}", t) for k, t in {**layer.w.base, **layer.w.replicated}.items()]
    return {
        "equal_to_parallelize": torch.equal(got, full), "err": rel_error(got, want),
        "meta": [n for n, t in tensors if t.device.type == "meta"],
        "shapes": {k: tuple(t.shape) for k, t in layer.w.base.items()},
        "expected_shapes": {k: _shard_shape(shards.shard(rank, k), cfg.hidden_size) for k in layer.w.base},
        "kv_heads": layer.kv_heads,
    }


def _dtype_names(path, layout, names=("auto", "float32")) -> dict:
    """dtype as from_pretrained takes it: "auto" = the config's (bfloat16 here), a dtype's name; float32
    logits against from_pretrained(dtype=float32) (unsharded, and parallelized)."""
    from fusedpar.integrations.hf import load_parallel, parallelize

    out = {}
    for name in names:
        try:
            pm = load_parallel(path, layout, dtype=name, device="cpu", shift_threshold=4, progress=False)
            out[name] = str(next(pm.parameters()).dtype)
        except Exception as e:  # recorded for the test's message
            out[name] = f"{type(e).__name__}: {e}"
    if out[names[-1]] == "torch.float32":
        ids, mask = left_padded([7, 5, 10], 256, seed=1)
        ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        want = _logits(ref, ids, mask)
        got = _logits(pm, ids, mask)
        out["err"] = rel_error(got, want)
        full = parallelize(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
                           layout, shift_threshold=4)
        out["equal_to_parallelize"] = torch.equal(got, _logits(full, ids, mask))
    return out


def run_loader_cases(rank: int, world: int, paths: dict) -> dict:
    tp2 = ParallelLayout(world, tp=2)
    cases = {
        "extra_layer": lambda: _refused(paths["extra_layer"], tp2),
        "extra_bias": lambda: _refused(paths["extra_bias"], tp2),
        "missing": lambda: _refused(paths["missing"], tp2),
        "missing_file": lambda: _refused(paths["missing_file"], tp2),
        "no_config": lambda: _refused(paths["no_config"], tp2),
        "world_mismatch": lambda: _refused(paths["missing"], ParallelLayout(4, sp=2, tp=2)),
        "threshold_bool": lambda: _refused(paths["old_inv_freq"], tp2, shift_threshold=True),
        "old_inv_freq": lambda: _dtype_names(paths["old_inv_freq"], tp2, names=(torch.float32,)),
        "dtype_names": lambda: _dtype_names(paths["bf16"], tp2),
        "mqa_sharded": lambda: _mqa_sharded(paths["mqa_sharded"], tp2, rank),
    }
    return run_named(cases, rank, seed=None)


@pytest.fixture(scope="module")
def results(checkpoints):
    return run_distributed(run_loader_cases, 2, checkpoints, timeout=300)


# ---- loader tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "key"), [
    ("extra_layer", "model.layers.2.mlp.up_proj.weight"),
    ("extra_bias", "model.layers.0.self_attn.o_proj.bias"),
])
def test_loader_refuses_tensors_the_config_has_no_place_for(results, name, key):
    """Loading would silently drop them (a different model than the checkpoint's)."""
    for res in case_results(results, name):
        assert res["type"] == "ValueError", res
        assert key in res["message"] and "no place for" in res["message"], res
        assert res["bytes_read"] == 0, res


def test_loader_ignores_old_per_layer_rope_tables(results):
    """rotary_emb.inv_freq of old checkpoints: from_pretrained drops it silently, and so does the loader."""
    for res in case_results(results, "old_inv_freq"):
        assert res[torch.float32] == "torch.float32", res
        assert res["err"] < REL_TOL and res["equal_to_parallelize"], res


@pytest.mark.parametrize(
    ("case", "exc", "fragments"),
    [
        ("missing", "ValueError", ("model.layers.1.mlp.up_proj.weight", "missing")),  # a tensor the config needs
        ("missing_file", "FileNotFoundError", ("names files that are not there", "-of-")),  # a shard the index names
        ("world_mismatch", "ValueError", ("layout.world_size=4", "world size is 2")),
    ],
)
def test_loader_refuses_before_reading(results, case, exc, fragments):
    """A checkpoint or layout the loader cannot use fails naming the problem before any tensor data is read."""
    for res in case_results(results, case):
        assert res["type"] == exc, res
        assert all(f in res["message"] for f in fragments), res
        assert res["bytes_read"] == 0, f"{case}: read {res['bytes_read']} bytes before noticing"


def test_loader_without_config_json(results):
    for res in case_results(results, "no_config"):
        assert res["type"] == "FileNotFoundError" and "config.json" in res["message"], res


def test_loader_threshold_bool_refused(results):
    for res in case_results(results, "threshold_bool"):
        assert res["type"] == "ValueError" and "shift threshold" in res["message"], res
        assert res["bytes_read"] == 0, res


def test_loader_dtype_names(results):
    """A bf16 checkpoint: "auto" keeps bf16; "float32" upcasts and matches from_pretrained(dtype=float32)."""
    for res in case_results(results, "dtype_names"):
        assert res["auto"] == "torch.bfloat16" and res["float32"] == "torch.float32", res
        assert res["err"] < REL_TOL and res["equal_to_parallelize"], res


def test_loader_kv_replication_sharded_checkpoint(results):
    """1 kv head over TP=2 (each rank keeps a copy of it), checkpoint in >= 3 files."""
    per_rank = case_results(results, "mqa_sharded")
    for res in per_rank:
        assert res["equal_to_parallelize"] and res["err"] < REL_TOL, res
        assert res["meta"] == [], res
        assert res["shapes"] == res["expected_shapes"], res
        assert res["shapes"]["qkv"][0] < 64 + 2 * 8, "qkv shard is not smaller than the full q/k/v rows"
    assert [r["kv_heads"] for r in per_rank] == [(0,), (0,)]


def test_reader_checks_the_index_against_the_files(tmp_path):
    """An index that places a tensor in a file that does not hold it fails when the reader opens the
    checkpoint (before any tensor is read), naming the tensor and the file, not mid-load."""
    import json

    from fusedpar.integrations.hf.loader import CheckpointReader

    make_model("llama", seed=SEED).save_pretrained(tmp_path, max_shard_size="60KB")
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2
    with CheckpointReader(tmp_path) as reader:  # the untouched index is accepted
        assert "model.layers.1.mlp.down_proj.weight" in reader
    name = "model.layers.1.mlp.down_proj.weight"
    wrong = next(f for f in files if f != index["weight_map"][name])
    index["weight_map"][name] = wrong
    index_path.write_text(json.dumps(index))
    want = rf"places 1 tensor\(s\) in files that do not hold them: {name} \(in {wrong}\)"
    with pytest.raises(ValueError, match=want):
        CheckpointReader(tmp_path)
