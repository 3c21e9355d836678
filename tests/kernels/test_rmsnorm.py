"""fusedpar.kernels.rmsnorm vs the plain-PyTorch RMSNorm (HF semantics): interpreter fp16/fp32 on
CPU, bf16 on a GPU; odd row counts and hidden sizes, strided rows, poisoned outputs."""

from __future__ import annotations

import pytest
import torch

from fusedpar.kernels.rmsnorm import add_rms_norm, rms_norm, rms_norm_reference
from fusedpar.testing.gpu import local_device

# max |kernel - reference| / max |reference|: the reduction order differs, the roundings do not
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
CPU_DTYPES = (torch.float32, torch.float16)


def _inputs(rows, hidden, dtype, device, seed, row_stride=None):
    g = torch.Generator().manual_seed(seed)
    width = row_stride or hidden
    x = (3 * torch.randn(rows, width, generator=g)).to(dtype).to(device)[:, :hidden]
    d = torch.randn(rows, hidden, generator=g).to(dtype).to(device)
    w = (1 + 0.3 * torch.randn(hidden, generator=g)).to(dtype).to(device)
    return x, d, w


def _assert_close(got, want, dtype, what):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{what}: non-finite values (unwritten poisoned elements?)"
    err = ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()
    where = int((got.double() - want.double()).abs().argmax())
    assert err < TOL[dtype], f"{what}: rel error {err:.3g} >= {TOL[dtype]} (worst flat index {where})"


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(("rows", "hidden", "row_stride"), [(1, 64, None), (7, 96, None), (13, 80, 100),
                                                           (3, 1000, None), (5, 257, 300)])
def test_rms_norm_matches_reference(dtype, rows, hidden, row_stride):
    x, _, w = _inputs(rows, hidden, dtype, "cpu", seed=rows * hidden, row_stride=row_stride)
    out = torch.full((rows, hidden), float("nan"), dtype=dtype)
    got = rms_norm(x, w, 1e-6, out=out)
    assert got is out
    _assert_close(got, rms_norm_reference(x, w, 1e-6), dtype, f"rms_norm {dtype} [{rows}, {hidden}]")


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 32), (9, 96), (6, 130)])
def test_add_rms_norm_matches_reference(dtype, rows, hidden):
    x, d, w = _inputs(rows, hidden, dtype, "cpu", seed=7 + rows)
    x0, d0 = x.clone(), d.clone()
    s, y = add_rms_norm(x, d, w, 1e-5)
    want_s = x + d
    assert torch.equal(s, want_s), "the residual sum must round exactly like torch's add"
    _assert_close(y, rms_norm_reference(want_s, w, 1e-5), dtype, f"add_rms_norm {dtype} [{rows}, {hidden}]")
    assert torch.equal(x, x0) and torch.equal(d, d0), "inputs must not be modified"


def test_rms_norm_rejects_bad_inputs():
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match=r"weight must be \[16\]"):
        rms_norm(x, torch.ones(8), 1e-6)
    with pytest.raises(TypeError, match="share a dtype"):
        rms_norm(x, torch.ones(16, dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError, match="2-D"):
        rms_norm(x[None], torch.ones(16), 1e-6)
    with pytest.raises(ValueError, match="delta must match"):
        add_rms_norm(x, torch.randn(3, 16), torch.ones(16), 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "hidden"), [(1, 8192), (37, 5120), (4096, 8192), (5, 2056)])
def test_gpu_rms_norm_bf16(rows, hidden):
    dev = local_device()
    if dev.type != "cuda":
        pytest.skip("needs CUDA")
    x, d, w = _inputs(rows, hidden, torch.bfloat16, dev, seed=rows)
    y = rms_norm(x, w, 1e-6, out=torch.full_like(x, float("nan")))
    _assert_close(y, rms_norm_reference(x, w, 1e-6), torch.bfloat16, f"bf16 [{rows}, {hidden}]")
    s, y2 = add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(s, x + d)
    _assert_close(y2, rms_norm_reference(x + d, w, 1e-6), torch.bfloat16, f"bf16 add [{rows}, {hidden}]")
