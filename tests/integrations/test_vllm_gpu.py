"""The vLLM plugin on the GPU build of vLLM (marked gpu; skipped without vLLM; a test needs its engines' GPUs).

Runs as one process, not under torchrun (each engine starts its own workers):
    python -m pytest -m gpu tests/integrations/test_vllm_gpu.py
Tiny random Llama / Qwen3 checkpoints; every engine in its own process (vllm_engine.py), greedy,
fusedpar at shift_threshold 8 (prefills base, decodes shift) against plain vLLM with the same
settings:
  fp32 (TRITON_ATTN, eager), prefix caching and chunked prefill on (64-token steps mix prefill
       chunks with decodes): identical tokens, logprobs within 1e-3
  bf16 (vLLM's default backend), compiled, CUDA graphs (vLLM's for shift steps, fusedpar's for base
       steps), fused kernels: tokens identical up to the
       first near-tie, logprobs within bf16 rounding before it, and vLLM's JIT monitor (active after
       warm-up) names no fusedpar kernel compiled while serving
  4 GPUs: SP=4 with 2 kv heads (kv heads replicated in shift mode), eager, fp32
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _skip_reason() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vllm (GPU build) is not installed"
    if "WORLD_SIZE" in os.environ:
        return "runs as one process (python -m pytest -m gpu tests/integrations/test_vllm_gpu.py), not under torchrun"
    if _gpus() < 1:
        return "needs a GPU"
    return None


def _need_gpus(n: int) -> None:
    if _gpus() < n:
        pytest.skip(f"needs {n} GPUs")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    import torch
    import transformers

    out = {}
    for i, (family, cfg_cls, model_cls) in enumerate((
            ("llama", transformers.LlamaConfig, transformers.LlamaForCausalLM),
            ("qwen3", transformers.Qwen3Config, transformers.Qwen3ForCausalLM))):
        cfg = cfg_cls(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                      initializer_range=0.05, tie_word_embeddings=False)
        torch.manual_seed(200 + i)
        path = tmp_path_factory.mktemp(f"vllm_gpu_{family}")
        model_cls(cfg).to(torch.float32).save_pretrained(path)
        out[family] = str(path)
    return out


def _prompts() -> list[list[list[int]]]:
    import random

    rng = random.Random(7)
    ids = lambda n: [rng.randrange(5, 1000) for _ in range(n)]  # noqa: E731
    first = [ids(n) for n in (3, 9, 17, 40, 77, 130, 6, 211)]
    second = [first[5] + ids(30), first[7][:100] + ids(9), ids(1), ids(66)]  # cached prefixes
    return [first, second]


def _engines(tmp_path, model: str, fusedpar: dict, **spec) -> tuple[dict, dict]:
    """(plain, fusedpar): one engine each, in processes of their own; side by side on disjoint GPUs
    when there are twice the GPUs an engine needs (engine start-up dominates the test's time)."""
    world = spec.get("tensor_parallel_size", 2)
    _need_gpus(world)
    gpus = [str(g) for g in range(_gpus())]
    side_by_side = len(gpus) >= 2 * world

    def start(i: int, name: str, section: dict | None):
        d = tmp_path / name
        d.mkdir()
        (d / "spec.json").write_text(json.dumps({
            "model": model, "fusedpar": section, "batches": _prompts(), "max_tokens": 12, "logprobs": True,
            "max_model_len": 1024, **spec}))
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "NCCL_NVLS_ENABLE": "0",
               "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
        if side_by_side:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i * world:(i + 1) * world])
        cmd = [sys.executable, "-m", "tests.integrations.vllm_engine", str(d / "spec.json"), str(d / "out.json")]
        return d, subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    def finish(d, proc) -> dict:
        try:
            log = proc.communicate(timeout=600)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            log = proc.communicate()[0]
            pytest.fail(f"{d.name} engine did not finish within 600 s:\n{log[-8000:]}")
        if proc.returncode != 0:
            pytest.fail(f"{d.name} engine exited with {proc.returncode}:\n{log[-8000:]}")
        return {**json.loads((d / "out.json").read_text()), "log": log}

    cases = (("plain", None), ("fusedpar", fusedpar))
    if side_by_side:
        started = [start(i, *case) for i, case in enumerate(cases)]
        plain, fp = (finish(*x) for x in started)
    else:
        plain, fp = (finish(*start(i, *case)) for i, case in enumerate(cases))
    return plain, fp


def _fusedpar_kernel_names() -> set[str]:
    import importlib
    import pkgutil

    import triton

    import fusedpar.kernels

    names = set()
    for info in pkgutil.walk_packages(fusedpar.kernels.__path__, "fusedpar.kernels."):
        module = importlib.import_module(info.name)
        names |= {n for n, v in vars(module).items() if isinstance(v, triton.runtime.jit.JITFunction)}
    assert "_qkv_all_to_all_kernel" in names, names
    return names


def _max_logprob_gap(a: dict, b: dict, upto_first_difference: bool) -> tuple[float, int]:
    """(largest |logprob difference| over compared tokens, number of prompts whose tokens differ)."""
    gap, differing = 0.0, 0
    for ta, tb, la, lb in zip(a["tokens"], b["tokens"], a["logprobs"], b["logprobs"], strict=True):
        for xa, xb, pa, pb in zip(ta, tb, la, lb, strict=True):
            n = len(xa)
            if xa != xb:
                differing += 1
                n = next(i for i, (u, v) in enumerate(zip(xa, xb, strict=True)) if u != v)
                if not upto_first_difference:
                    n = len(xa)
            gap = max([gap] + [abs(u - v) for u, v in zip(pa[:n], pb[:n], strict=True)])
    return gap, differing


def _stats_ok(result: dict, world: int) -> dict:
    for per_batch in result["stats"]:
        assert [s["rank"] for s in per_batch] == list(range(world))
        first = {k: v for k, v in per_batch[0].items() if k != "rank"}
        assert all({k: v for k, v in s.items() if k != "rank"} == first for s in per_batch[1:])
    s = result["stats"][0][0]
    assert s["base_steps"] >= 1 and s["shift_steps"] >= 1, s
    return s


FP32 = {"dtype": "float32", "enforce_eager": True, "engine_args": {"attention_config": {"backend": "TRITON_ATTN"},
                                            "enable_prefix_caching": True, "max_num_batched_tokens": 64,
                                            "max_num_seqs": 16}}  # vLLM: batched tokens >= sequences


@pytest.mark.parametrize("family", ["qwen3"])  # Llama's layers are Qwen3's minus q/k norms (CPU tests: both)
def test_fp32_matches_plain_with_prefix_caching_and_chunked_prefill(models, tmp_path, family):
    plain, fp = _engines(tmp_path, models[family], {"sequence_parallel_size": 2, "shift_threshold": 8}, **FP32)
    assert fp["tokens"] == plain["tokens"]
    gap, _ = _max_logprob_gap(fp, plain, upto_first_difference=False)
    assert gap <= 1e-3, gap  # fp32 sums in another order; a wrong row or head is off by O(1)
    s = _stats_ok(fp, 2)
    assert s["fused_kernels"] is False  # fp32: plain collectives in base mode


def test_bf16_compiled_graphs_fused_kernels_no_jit_while_serving(models, tmp_path):
    args = {"dtype": "bfloat16", "engine_args": {"compilation_config": {"max_cudagraph_capture_size": 8}}}
    plain, fp = _engines(tmp_path, models["qwen3"], {"sequence_parallel_size": 2, "shift_threshold": 8}, **args)
    gap, differing = _max_logprob_gap(fp, plain, upto_first_difference=True)
    assert gap <= 0.1, gap  # bf16 rounding of a different reduction order
    assert differing <= 2, (differing, fp["tokens"], plain["tokens"])
    s = _stats_ok(fp, 2)
    assert s["fused_kernels"] is True and s["shift_compiled"] is True, s
    assert s["base_graph_buckets"] >= 1, s  # base steps replayed CUDA graphs
    names = _fusedpar_kernel_names()
    compiled_late = [line for line in fp["log"].splitlines()
                     if "during inference" in line and any(n in line for n in names)]
    assert not compiled_late, compiled_late


def test_kv_heads_replicated_on_four_gpus(models, tmp_path):
    args = {"dtype": "float32", "tensor_parallel_size": 4, "enforce_eager": True,
            "engine_args": {"attention_config": {"backend": "TRITON_ATTN"}}}
    plain, fp = _engines(tmp_path, models["qwen3"], {"sequence_parallel_size": 4, "shift_threshold": 8}, **args)
    assert fp["tokens"] == plain["tokens"]
    gap, _ = _max_logprob_gap(fp, plain, upto_first_difference=False)
    assert gap <= 1e-3, gap
    s = _stats_ok(fp, 4)
    assert (s["sequence_parallel_size"], s["base_tensor_parallel_size"]) == (4, 1), s

