"""fusedpar.integrations.hf: what is refused before any work, and the messages naming what was passed.

In-process (no process group: each check comes before any collective or read): importing the
package without transformers names the extra to install (a subprocess with transformers blocked);
parallelize / load_parallel arguments of the wrong kind (shift_threshold, block_size, fused,
fused_max_tokens, cuda_graphs) raise ValueError naming the value; load_parallel refuses a device
this machine lacks before anything is read or a progress bar starts; a model without a process
group or with meta-device weights is refused.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fusedpar.layouts import ParallelLayout  # noqa: E402
from tests.integrations.hf_models import make_model  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
LAYOUT2 = ParallelLayout(2, sp=2)
LAYOUT4 = ParallelLayout(4, sp=2, tp=2)

# A Python process in which transformers is not installed, as far as imports can tell.
_NO_TRANSFORMERS = """
import sys

class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name == "transformers" or name.startswith("transformers."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _Blocked())
import fusedpar  # the core needs no transformers
try:
    import fusedpar.integrations.hf
except ImportError as e:
    print(f"{type(e).__name__}: {e}")
else:
    print("imported")
"""


def _rejects(model, layout, match, **kw):
    from fusedpar.integrations.hf import UnsupportedModelError, parallelize

    with pytest.raises(UnsupportedModelError, match=match):
        parallelize(model, layout, **kw)


def test_import_without_transformers_names_the_extra():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", _NO_TRANSFORMERS], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ('ImportError: fusedpar.integrations.hf needs transformers: '
                                   'pip install "fusedpar[hf]"'), proc.stdout + proc.stderr


def test_supported_model_needs_process_group_and_real_weights():
    from fusedpar.integrations.hf import UnsupportedModelError, parallelize

    with pytest.raises(RuntimeError, match="init_process_group"):
        parallelize(make_model("llama"), LAYOUT4)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(make_model("llama").config)
    _rejects(meta, LAYOUT4, "meta-device")
    with pytest.raises(ValueError, match="shift threshold"):
        parallelize(make_model("llama"), LAYOUT4, shift_threshold=-1)
    with pytest.raises(UnsupportedModelError, match="fused kernels need CUDA"):
        parallelize(make_model("llama"), LAYOUT4, fused=True)


@pytest.mark.parametrize("threshold", [True, False, 2.0, "8", -1])
def test_shift_threshold_must_be_an_int(threshold):
    """Checked before the process group is: True would otherwise quietly mean threshold 1."""
    from fusedpar.integrations.hf import parallelize

    with pytest.raises(ValueError, match="shift threshold must be an int >= 0"):
        parallelize(make_model("llama"), LAYOUT2, shift_threshold=threshold)


@pytest.mark.parametrize("block_size", [0, -4, 2.0, "16", True, None])
def test_block_size_must_be_a_positive_int(block_size, tmp_path):
    """Refused before any work: parallelize before its process-group check, load_parallel before it
    looks at the path (it would otherwise divide by zero at the first step)."""
    from fusedpar.integrations.hf import load_parallel, parallelize

    want = rf"block_size must be an int >= 1 \(tokens per KV-cache page\), got {re.escape(repr(block_size))}$"
    with pytest.raises(ValueError, match=want):
        parallelize(make_model("llama"), LAYOUT2, block_size=block_size)
    with pytest.raises(ValueError, match=want):
        load_parallel(tmp_path / "absent", LAYOUT2, block_size=block_size)


@pytest.mark.parametrize(("name", "value", "want"), [
    ("fused", "yes", "fused must be None, True or False, got 'yes'"),
    ("fused", 1, "fused must be None, True or False, got 1"),
    ("cuda_graphs", "auto", "cuda_graphs must be None, True or False, got 'auto'"),
    ("fused_max_tokens", 0, "fused_max_tokens must be an int >= 1, got 0"),
    ("fused_max_tokens", 4096.0, "fused_max_tokens must be an int >= 1, got 4096.0"),
])
def test_arguments_of_the_wrong_kind_are_named(name, value, want, tmp_path):
    from fusedpar.integrations.hf import load_parallel, parallelize

    with pytest.raises(ValueError, match=f"^{re.escape(want)}$"):
        parallelize(make_model("llama"), LAYOUT2, **{name: value})
    with pytest.raises(ValueError, match=f"^{re.escape(want)}$"):
        load_parallel(tmp_path / "absent", LAYOUT2, **{name: value})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_model("llama", seed=3).save_pretrained(path)
    return path


@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_load_parallel_refuses_cuda_without_cuda(device, checkpoint, monkeypatch, capsys):
    """Named before any work: no read, no progress bar (it failed after the bar, on the first copy)."""
    from fusedpar.integrations.hf import load_parallel

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=f"device={re.escape(repr(device))}, but CUDA is not available"):
        load_parallel(checkpoint, LAYOUT2, device=device, progress=True)
    assert capsys.readouterr().err == ""


def test_load_parallel_refuses_a_cuda_device_index_this_machine_lacks(checkpoint, monkeypatch):
    from fusedpar.integrations.hf import load_parallel

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"device='cuda:2', but this machine has 2 CUDA device\(s\)"):
        load_parallel(checkpoint, LAYOUT2, device="cuda:2")


def test_load_parallel_refuses_a_device_that_is_no_device(checkpoint):
    from fusedpar.integrations.hf import load_parallel

    with pytest.raises(ValueError, match="device='gpu' is not a torch device"):
        load_parallel(checkpoint, LAYOUT2, device="gpu")
