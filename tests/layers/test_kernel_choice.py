"""fusedpar.layers.kernel_choice: the fused-kernels and CUDA-graphs rule both adapters follow."""

import pytest
import torch

from fusedpar.layers.kernel_choice import choose_cuda_graphs, choose_fused_kernels

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


class Refused(Exception):
    pass


def refuse(why):
    return Refused(" | ".join(why))


def test_auto_takes_the_fused_kernels_on_cuda_in_half_precision_only():
    for dtype in (torch.bfloat16, torch.float16):
        assert choose_fused_kernels(None, device=CUDA, dtype=dtype)
        assert not choose_fused_kernels(None, device=CPU, dtype=dtype)
    assert not choose_fused_kernels(None, device=CUDA, dtype=torch.float32)  # fp32 stays exact
    assert not choose_fused_kernels(None, device=CUDA, dtype=torch.bfloat16, blockers=["head_dim=8"])
    assert not choose_fused_kernels(False, device=CUDA, dtype=torch.bfloat16)


def test_a_request_runs_fp32_unless_half_only_and_names_every_blocker():
    assert choose_fused_kernels(True, device=CUDA, dtype=torch.float32)
    with pytest.raises(Refused) as e:
        choose_fused_kernels(True, device=CPU, dtype=torch.float32, half_only=True, blockers=["head_dim=8"],
                             subject="the engine", refuse=refuse)
    assert str(e.value) == ("the engine is on cpu (fused kernels need CUDA) | dtype torch.float32 (fused kernels: "
                            "bf16 / fp16) | head_dim=8")
    with pytest.raises(ValueError, match=r"fused=True is not possible: the model is on cpu"):
        choose_fused_kernels(True, device=CPU, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fused_kernels must be None, True or False, got 'yes'"):
        choose_fused_kernels("yes", device=CUDA, dtype=torch.bfloat16, name="fused_kernels")


def test_graphs_need_the_fused_kernels_and_no_blocker():
    assert choose_cuda_graphs(None, use_fused=True) and not choose_cuda_graphs(None, use_fused=False)
    assert not choose_cuda_graphs(None, use_fused=True, blockers=["enforce_eager"])
    assert not choose_cuda_graphs(False, use_fused=True) and choose_cuda_graphs(True, use_fused=True)
    with pytest.raises(Refused, match=r"^the fused kernels are off \| base TP=2$"):
        choose_cuda_graphs(True, use_fused=False, blockers=["base TP=2"], refuse=refuse)
