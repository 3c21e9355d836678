"""The facts of one forward step, as the layers and the base runner read them.

`Deployment.plan_step` (deployment.py) decides a step's mode and rows. A `Step` is frozen: the worker
replaces its current step as a whole when a step begins and ends (state.WorkerState.begin_step /
end_step), and code that runs the layers outside a step of vLLM's (the base-graph capture) runs
them under a Step of its own (`with worker.running(step):`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedpar.layouts import StepMode


@dataclass(frozen=True)
class Step:
    """mode: how the layers run; num_tokens: the step's tokens (rows of the decoder model's input);
    local_rows: the rows this rank computes in base mode (ceil(num_tokens / SP), with base graphs
    raised to a row bucket); padded_tokens: SP x local_rows in base mode, num_tokens in shift mode;
    counted: whether the step is one of the workload's (stats), not a profile, warm-up or capture run;
    dp: a DP step (layout "dp{P}"): this rank's own requests through dp_runner.DPRunner, no collective."""

    mode: StepMode
    num_tokens: int
    padded_tokens: int
    local_rows: int
    counted: bool = False
    dp: bool = False

    @classmethod
    def dp_step(cls, num_tokens: int) -> Step:
        return cls(StepMode.SHIFT, num_tokens, num_tokens, num_tokens, True, dp=True)

    @classmethod
    def base(cls, num_tokens: int, local_rows: int, sp: int, counted: bool = False) -> Step:
        return cls(StepMode.BASE, num_tokens, local_rows * sp, local_rows, counted)

    @classmethod
    def shift(cls, num_tokens: int, counted: bool = False) -> Step:
        return cls(StepMode.SHIFT, num_tokens, num_tokens, num_tokens, counted)

    @property
    def is_base(self) -> bool:
        return self.mode is StepMode.BASE

    @property
    def padding(self) -> int:
        """Rows added to the step's tokens (base mode); never part of any output."""
        return self.padded_tokens - self.num_tokens


IDLE = Step.shift(0)  # between steps: the layers take vLLM's shift path


def capturing(cuda: bool) -> bool:
    """Whether the running step is a CUDA graph capture (on a capturing stream): not a step of the workload."""
    return cuda and torch.cuda.is_current_stream_capturing()
