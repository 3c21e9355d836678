"""The README's quickstarts run as written: each python block on 2 gloo processes started the way
torchrun starts them (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT), checked against the
unsharded model."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2
MAX_CORE_LINES = 10
MAX_HF_LINES = 5


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(code: str, timeout: float = 300) -> list[dict]:
    """Run `code` on WORLD processes; each prints one JSON line prefixed RESULT: as its last act."""
    port = _free_port()
    procs = []
    for rank in range(WORLD):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    results = []
    try:
        for rank, p in enumerate(procs):
            out, _ = p.communicate(timeout=timeout)
            assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{out[-4000:]}"
            line = [x for x in out.splitlines() if x.startswith("RESULT:")]
            assert line, f"rank {rank} printed no result:\n{out[-4000:]}"
            results.append(json.loads(line[-1][len("RESULT:"):]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


def test_readme_has_the_core_and_hf_quickstarts_within_their_size():
    blocks = _python_blocks()
    assert len(blocks) >= 2, "README.md needs the core and the HF quickstart as python blocks"
    core, hf = blocks[0], blocks[1]
    assert len([x for x in core.splitlines() if x.strip()]) <= MAX_CORE_LINES
    assert len([x for x in hf.splitlines() if x.strip()]) <= MAX_HF_LINES


CORE_CHECK = """
from fusedpar.layers import DenseDecoderStack
ref = DenseDecoderStack(cfg, weights)
want = ref.forward(x, fp.StepBatch(seq_ids=(0,), query_lens=(40,), context_lens=(0,)))
want_next = ref.forward(out[-1:], fp.StepBatch(seq_ids=(0,), query_lens=(1,), context_lens=(40,)))
err = max(float((got - ref).abs().max() / ref.abs().max()) for got, ref in ((out, want), (nxt, want_next)))
import json
print("RESULT:" + json.dumps({"err": err, "steps": dict(stack.steps), "shape": list(nxt.shape)}))
dist.destroy_process_group()
"""


def test_core_quickstart_runs_as_written_and_matches_the_unsharded_stack():
    results = _run_ranks(_python_blocks()[0] + CORE_CHECK)
    for rank, res in enumerate(results):
        assert res["err"] < 1e-5, f"rank {rank}: relative error {res['err']:.2e} against DenseDecoderStack"
        assert res["steps"] == {"base": 1, "shift": 1}, f"rank {rank}: {res['steps']}"
        assert res["shape"] == [1, 64]


HF_PRELUDE = """
import torch, torch.distributed as dist, transformers
dist.init_process_group("gloo")
config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config).eval()
input_ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
torch.manual_seed(0)
want = transformers.LlamaForCausalLM(config).eval().generate(input_ids, max_new_tokens=8, do_sample=False)
"""

HF_CHECK = """
import json
print("RESULT:" + json.dumps({"same": torch.equal(out, want), "tokens": out.tolist()}))
dist.destroy_process_group()
"""


def test_hf_quickstart_runs_as_written_and_gives_the_unsharded_tokens():
    pytest.importorskip("transformers")
    results = _run_ranks(HF_PRELUDE + _python_blocks()[1] + HF_CHECK)
    for rank, res in enumerate(results):
        assert res["same"], f"rank {rank}: generate differs from the unsharded model"
    assert results[0]["tokens"] == results[1]["tokens"]


def test_fusedpar_exports_the_quickstart_names():
    import fusedpar

    for name in re.findall(r"\bfp\.([A-Za-z_]+)", _python_blocks()[0]):
        assert hasattr(fusedpar, name), f"fusedpar does not export {name}"
