"""SwiGLU of the blocked gate_up output (fusedpar.kernels.swiglu) vs the plain-PyTorch definition.

CPU: the Triton interpreter in fp16/fp32 on random inputs, odd widths and row counts, strided
(non-contiguous) inputs, several [gate | up] blocks, NaN-poisoned outputs. GPU (pytest -m gpu):
bf16, the Llama-70B / Qwen3-32B MLP widths at P = 4 and base blocks.
"""

from __future__ import annotations

import pytest
import torch

from fusedpar.kernels._host import INTERPRETED
from fusedpar.kernels.swiglu import silu_mul, silu_mul_reference
from fusedpar.testing.numerics import poison_

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or INTERPRETED),
    reason="no CUDA and fusedpar.kernels.swiglu was imported without TRITON_INTERPRET=1",
)

# The kernel and torch compute silu(g) in fp32 with different exp implementations, then round
# twice in the dtype: a few units of the dtype's roundoff apart at most.
TOL = {torch.float16: dict(rtol=2e-3, atol=1e-5), torch.float32: dict(rtol=1e-5, atol=1e-7),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1e-4)}


def _gate_up(rows: int, blocks: int, block: int, dtype, device="cpu", seed=0, strided=False) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    width = blocks * 2 * block
    full = torch.randn((rows, width + (7 if strided else 0)), generator=g, device=device).mul_(3.0).to(dtype)
    return full[:, 3 : 3 + width] if strided else full


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(("rows", "blocks", "block"), [(1, 1, 40), (5, 3, 17), (33, 2, 600), (2, 4, 1)])
@pytest.mark.parametrize("strided", [False, True])
def test_matches_reference(dtype, rows, blocks, block, strided):
    gu = _gate_up(rows, blocks, block, dtype, seed=rows + blocks + block, strided=strided)
    out = poison_(torch.empty((rows, blocks * block), dtype=dtype))
    got = silu_mul(gu, block, out=out)
    assert got is out and not got.isnan().any(), "unwritten output elements"
    torch.testing.assert_close(got, silu_mul_reference(gu, block), **TOL[dtype])
    # the layout: block b's gate and up chunks, not one [gate | up] split of the whole row
    g, u = gu.float().reshape(rows, blocks, 2, block).unbind(2)
    torch.testing.assert_close(got.float(), (torch.nn.functional.silu(g) * u).reshape(rows, -1),
                               rtol=2 * TOL[dtype]["rtol"], atol=1e-3)


def test_empty_and_errors():
    assert silu_mul(torch.empty((0, 8)), 4).shape == (0, 4)
    with pytest.raises(ValueError, match="multiple of 2 \\* block"):
        silu_mul(torch.randn(3, 10), 3)
    with pytest.raises(ValueError, match="2-D"):
        silu_mul(torch.randn(3, 2, 8), 4)
    with pytest.raises(TypeError, match="dtype"):
        silu_mul(torch.ones(3, 8, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="out must be"):
        silu_mul(torch.randn(3, 8), 4, out=torch.empty(3, 5))


@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "blocks", "block"), [(1, 1, 7168), (8, 1, 6400), (1000, 4, 7168), (333, 4, 6400)])
def test_gpu_bf16(rows, blocks, block):
    gu = _gate_up(rows, blocks, block, torch.bfloat16, device="cuda", seed=rows, strided=True)
    out = poison_(torch.empty((rows, blocks * block), dtype=torch.bfloat16, device="cuda"))
    got = silu_mul(gu, block, out=out)
    assert not got.isnan().any()
    torch.testing.assert_close(got, silu_mul_reference(gu, block), **TOL[torch.bfloat16])
