"""What a base-mode step changes in vLLM's eager decoder modules, and the warm-up of its kernels.

Kernels (`BaseKernels`): with torch.compile (vLLM's default on CUDA) vLLM configures its custom ops
(RMSNorm through vllm.ir, rotary embedding, SiluAndMul) for inductor: their PyTorch-native forms,
which inductor fuses inside the compiled graph. A base step runs the decoder eagerly, where those
native forms would cost one kernel launch per elementwise op. For the duration of a base step the
ops dispatch to the kernels vLLM's own eager mode uses (forward_cuda, the vllm_c providers of the
vllm.ir ops); `end` restores vLLM's choice, so the compiled graph (shift steps) never sees a change.

SwiGLU: in base mode the gate_up projection returns the base shard's blocked layout
[rows, SP x (gate c | up c)] (no reordering copy); every MLP's SiluAndMul then runs on the view
[rows, SP, 2c] -> [rows, SP, c], which is [rows, SP*c]: the down projection's base input.

Warm-up (`warm_up_fused`): every row count a base step can have runs through the fused
communicator's stages once, so that Triton compiles each kernel variant while the engine starts,
not while it serves.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence

import torch

from fusedpar.layouts import StepMode

logger = logging.getLogger("vllm.fusedpar")


def _overrides(mod, name: str) -> bool:
    from vllm.model_executor.custom_op import CustomOp

    return getattr(type(mod), name, None) is not getattr(CustomOp, name, None)


def _direct_rms_norm(mod, fallback):
    """vLLM's RMSNorm on its CUDA kernels called directly (what its vllm_c IR provider runs, without
    two dispatcher round trips per call); other dtypes through `fallback`."""
    rms_norm, fused_add = torch.ops._C.rms_norm, torch.ops._C.fused_add_rms_norm
    eps = mod.variance_epsilon

    def forward(x: torch.Tensor, residual: torch.Tensor | None = None):
        w = mod.weight
        if x.dtype != w.dtype or (residual is not None and residual.dtype != x.dtype):
            return fallback(x, residual)
        if residual is None:
            out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
            rms_norm(out, x, w, eps)
            return out
        fused_add(x, residual, w, eps)  # in place: x <- norm(x + residual), residual <- x + residual
        return x, residual

    return forward


def _has_direct_rms_norm(mod) -> bool:
    return (type(mod).__name__ == "RMSNorm" and getattr(mod, "variance_size_override", 0) is None
            and getattr(mod, "has_weight", False) and hasattr(torch.ops._C, "fused_add_rms_norm"))


def _blocked_act(act, sp: int):
    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        return act(x.view(rows, sp, -1)).view(rows, -1)

    return forward


class BaseKernels:
    """The per-module forward methods of a base step; `begin` installs them, `end` restores vLLM's.

    acts: the SiluAndMul modules of the MLPs whose gate_up projection fusedpar holds (blocked layout).
    cuda: also switch the other custom ops to their CUDA kernels (on CPU they keep vLLM's choice).
    """

    def __init__(self, decoder_model: torch.nn.Module, acts: list, sp: int, cuda: bool):
        from vllm.model_executor.custom_op import CustomOp

        act_ids = {id(a) for a in acts}
        self.swaps: list[tuple[torch.nn.Module, object, object]] = []
        for mod in decoder_model.modules():
            if not isinstance(mod, CustomOp):
                continue
            vllms = mod._forward_method
            fast = mod.forward_cuda if cuda and _overrides(mod, "forward_cuda") else vllms
            if cuda and _has_direct_rms_norm(mod):
                fast = _direct_rms_norm(mod, fast)
            if id(mod) in act_ids:
                self.swaps.append((mod, vllms, _blocked_act(fast, sp)))
            elif fast is not vllms:
                self.swaps.append((mod, vllms, fast))
        missing = act_ids - {id(m) for m, _, _ in self.swaps}
        if missing:
            raise RuntimeError(f"fusedpar: {len(missing)} MLP activation(s) are not vLLM custom ops (SiluAndMul)")
        self.ir_ops = self._ir_ops() if cuda else []
        self._stack: contextlib.ExitStack | None = None

    @staticmethod
    def _ir_ops() -> list[tuple[object, list[str]]]:
        """The vllm.ir ops with a vllm_c kernel, each with the priority vLLM's eager mode gives it."""
        try:
            from vllm.ir.op import IrOp
        except ImportError:  # vLLM without the IR layer: RMSNorm's forward_cuda is its kernel
            return []
        out = []
        for op in IrOp.registry.values():
            impl = op.impls.get("vllm_c")
            if impl is not None and impl.supported and "native" in op.impls:
                out.append((op, ["vllm_c", "native"]))
        return out

    def begin(self) -> None:
        self.end()
        for mod, _, base in self.swaps:
            mod._forward_method = base
        stack = contextlib.ExitStack()
        for op, priority in self.ir_ops:
            stack.enter_context(op.set_priority(priority))
        self._stack = stack

    def end(self) -> None:
        if self._stack is None:
            return
        for mod, vllms, _ in self.swaps:
            mod._forward_method = vllms
        self._stack.close()
        self._stack = None

    def describe(self) -> str:
        names = sorted({type(m).__name__ for m, _, _ in self.swaps})
        ir = sorted(getattr(op, "name", "?") for op, _ in self.ir_ops)
        return f"{len(self.swaps)} custom-op modules ({', '.join(names)}), IR ops {ir}"


def warm_up_fused(comm, rows: Sequence[int], qkv, o_proj, down) -> float:
    """Run the base stages of FusedComm `comm` once per row count in `rows` with zero inputs and the
    weights of one decoder layer (qkv / o_proj / down: fusedpar's linear layers). Collective: every
    rank passes the same rows. Returns the seconds it took."""
    if len(rows) == 0:
        return 0.0
    t0 = last = time.perf_counter()
    sp = comm.ctx.sp.size
    m_max = rows[-1]
    w_qkv, w_o, w_down = qkv.weight, o_proj.weight, down.weight
    dev, dt = w_qkv.device, w_qkv.dtype
    h = torch.zeros(m_max, w_qkv.shape[1], device=dev, dtype=dt)
    attn = torch.zeros(m_max * sp, w_o.shape[1] // sp, device=dev, dtype=dt)
    act = torch.zeros(m_max, w_down.shape[1], device=dev, dtype=dt)
    for i, m in enumerate(rows):
        comm.qkv(h[:m], w_qkv, StepMode.BASE, qkv.bias)
        comm.o_proj(attn[: m * sp], w_o, StepMode.BASE)
        comm.row_parallel(act[:m], w_down, StepMode.BASE)
        now = time.perf_counter()
        if now - last > 10:
            logger.info("fusedpar: compiling the base-mode kernels: %d of %d row counts", i + 1, len(rows))
            last = now
    torch.cuda.synchronize(dev)
    return time.perf_counter() - t0
