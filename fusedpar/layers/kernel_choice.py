"""Whether a model runs on the fused kernels, and whether its steps replay CUDA graphs: the one rule
both adapters (fusedpar.integrations.hf, fusedpar.integrations.vllm) follow.

A request is None ("auto"), True (required) or False (never). Auto takes the path when nothing
blocks it; True takes it or raises the adapter's error naming every blocker; False never takes it.
Each adapter adds the blockers of its own runtime (head_dim for the HF stack's attention kernel,
base TP or vLLM's graph settings for the vLLM plugin) and its own error class and wording.

Fused kernels are blocked off CUDA. In auto they also need half precision (bf16 / fp16): fp32 stays
on the exact path, tl.dot would round its inputs to TF32. `half_only` makes any other dtype a blocker
even when requested (where the adapter's fused path has no fp32 variant). CUDA graphs need the fused
kernels (a graph holds no NCCL call; the graphs capture the fused kernels).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

HALF_PRECISION = (torch.bfloat16, torch.float16)

Refusal = Callable[[list[str]], Exception]


def _decide(name: str, request: bool | None, blockers: list[str], refuse: Refusal | None, *, auto: bool = True) -> bool:
    if request is not None and not isinstance(request, bool):
        raise ValueError(f"{name} must be None, True or False, got {request!r}")
    if request is False:
        return False
    if request is None:
        return auto and not blockers
    if blockers:
        if refuse is None:
            raise ValueError(f"{name}=True is not possible: " + "; ".join(blockers))
        raise refuse(blockers)
    return True


def choose_fused_kernels(request: bool | None, *, device: torch.device, dtype: torch.dtype,
                         blockers: Sequence[str] = (), half_only: bool = False, refuse: Refusal | None = None,
                         subject: str = "the model", name: str = "fused") -> bool:
    """Whether to run on the fused kernels (see the module docstring).

    subject names what runs (in the CUDA blocker's text); blockers: the adapter's own; refuse(why)
    builds the error raised for a True request that something blocks (default: a ValueError); name:
    the argument's name in the ValueErrors."""
    why = []
    if device.type != "cuda":
        why.append(f"{subject} is on {device} (fused kernels need CUDA)")
    if half_only and dtype not in HALF_PRECISION:
        why.append(f"dtype {dtype} (fused kernels: bf16 / fp16)")
    why.extend(blockers)
    return _decide(name, request, why, refuse, auto=dtype in HALF_PRECISION)


def choose_cuda_graphs(request: bool | None, *, use_fused: bool, blockers: Sequence[str] = (),
                       refuse: Refusal | None = None, name: str = "cuda_graphs") -> bool:
    """Whether steps replay CUDA graphs: they capture the fused kernels, so not without them; blockers:
    the adapter's own. refuse / name as for choose_fused_kernels."""
    why = [] if use_fused else ["the fused kernels are off"]
    why.extend(blockers)
    return _decide(name, request, why, refuse)
