"""When vLLM's compiled model (the shift path) is traced: at a step large enough to trace at.

The compiled (shift) path must be traced at a token count that torch does not specialize on.
vLLM marks the token dimension dynamic and traces the decoder model once, at its first compiled
call, with dynamo's guards dropped. A dimension of size 0 or 1 is specialized (a constant) even
when marked dynamic, so a trace taken at a one-token step is a graph for exactly one token, and
with no guard left it is replayed for every later shift step: a multi-token shift step then
writes past buffers sized for one row. Plain vLLM traces at its profile run (max_num_batched_tokens
tokens); with fusedpar that run is a base step, which bypasses the compiled model, so without
`before_first_trace` the first compiled call would be the first shift step the workload happens
to send, often a one-token decode.
"""

from __future__ import annotations

import logging

from fusedpar.layouts import StepMode

logger = logging.getLogger("vllm.fusedpar")

MIN_TRACE_TOKENS = 2


def decoder_compiled(decoder_model) -> bool:
    """Whether vLLM runs `decoder_model` compiled and has traced it."""
    m = decoder_model
    if m is None or getattr(m, "do_not_compile", True):
        return False
    return bool(getattr(m, "compiled", False) or getattr(m, "aot_compiled_fn", None) is not None)


def shift_trace_pending(decoder_model, threshold: int) -> bool:
    """Whether vLLM will compile the decoder model for shift steps and has not traced it yet
    (threshold 0: every step is a base step, nothing runs the compiled model)."""
    m = decoder_model
    return threshold > 0 and m is not None and not getattr(m, "do_not_compile", True) and not decoder_compiled(m)


def before_first_trace(fc, decoder_model, threshold: int, mode: StepMode, num_tokens: int, compile_shift) -> None:
    """Before the compiled path is traced (call it only while shift_trace_pending, outside graph
    captures): a base step traces it first, on its own inputs (the profile run: the size and the
    inputs plain vLLM traces with); a shift step too small to trace at runs vLLM's eager model
    instead, and the trace waits for a step that can take it.

    fc: vLLM's forward context; compile_shift: a callable that runs the decoder model on this step's
    inputs through vLLM's compiled path, with the layers in shift mode (or None)."""
    if mode is StepMode.BASE and compile_shift is not None and num_tokens >= MIN_TRACE_TOKENS:
        logger.info("fusedpar: tracing vLLM's compiled model (shift mode) at this %d-token base step, "
                    "before running it in base mode", num_tokens)
        compile_shift()  # the layers are in shift mode: vLLM's TP = P model, output dropped
        if shift_trace_pending(decoder_model, threshold):
            raise RuntimeError("fusedpar: running the decoder model through vLLM's compiled path did not "
                               "compile it; the shift path would be traced later at an arbitrary size")
    elif mode is StepMode.SHIFT and num_tokens < MIN_TRACE_TOKENS:
        fc.skip_compiled = True  # vLLM's own eager model: the same shift math, nothing traced
