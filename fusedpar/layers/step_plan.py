"""Per-step planning: what is in the step (StepBatch) and which mode runs it (StepModeRule).

StepModeRule answers base or shift per step; the layout policies of fusedpar.layers.layout_policy
answer which declared ParallelLayout runs the step (ShiftThresholdPolicy applies this rule)."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from fusedpar.layouts import StepMode, check_mode

# Steps of more tokens than this run in base mode. The value lies between the layer benchmark's
# 512-token point (a shift step beats a base step) and its 2048-token point (base beats shift);
# Llama-3-70B layer, bf16, 4x H200: perf/bench_layer.py; perf/results/layer.json.
DEFAULT_SHIFT_THRESHOLD = 1024


@dataclass(frozen=True)
class StepBatch:
    """The sequences of one forward step, tokens packed in this order.

    query_lens[i]: new tokens of sequence i in this step (prefill chunk or 1 for decode);
    context_lens[i]: tokens of sequence i already in the KV cache before the step.
    """

    seq_ids: tuple[int, ...]
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]

    def __post_init__(self):
        # ints only (numpy ints are taken as the ints they are); a float or bool length would be
        # truncated or counted as 1 somewhere downstream. Stored as tuples: the batch stays hashable.
        for name in ("seq_ids", "query_lens", "context_lens"):
            values = getattr(self, name)
            if type(values) is tuple and set(map(type, values)) <= {int}:
                continue  # the common case, checked cheaply: a step's batch is built on the host per step
            try:
                ints = tuple(operator.index(v) for v in values if not isinstance(v, bool))
            except TypeError:
                ints = ()
            if len(ints) != len(values):
                raise ValueError(f"StepBatch {name} must be ints, got {tuple(values)!r}")
            object.__setattr__(self, name, ints)
        n = len(self.seq_ids)
        if not (len(self.query_lens) == len(self.context_lens) == n) or n == 0:
            raise ValueError(
                f"StepBatch needs equal, non-empty seq_ids/query_lens/context_lens, got lengths "
                f"{len(self.seq_ids)}/{len(self.query_lens)}/{len(self.context_lens)}"
            )
        if len(set(self.seq_ids)) != n:
            raise ValueError(f"StepBatch seq_ids must be unique, got {self.seq_ids}")
        if min(self.query_lens) < 1 or min(self.context_lens) < 0:
            raise ValueError(
                f"StepBatch needs query_lens >= 1 and context_lens >= 0, got {self.query_lens} / {self.context_lens}"
            )

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Absolute position of every packed token, [num_tokens] int64."""
        q = torch.tensor(self.query_lens, dtype=torch.int64)
        start_of_seq = torch.repeat_interleave(torch.cumsum(q, 0) - q, q)  # packed index of each seq's first token
        context = torch.repeat_interleave(torch.tensor(self.context_lens, dtype=torch.int64), q)
        return (torch.arange(self.num_tokens, dtype=torch.int64) - start_of_seq + context).to(device)

    def after(self) -> StepBatch:
        """The context lengths once this step is done (handy for building the next decode step)."""
        return StepBatch(self.seq_ids, self.query_lens,
                         tuple(q + c for q, c in zip(self.query_lens, self.context_lens, strict=True)))


def padded_token_count(num_tokens: int, sp: int) -> int:
    """Smallest multiple of sp that holds num_tokens: base mode splits tokens evenly over SP."""
    return -(-num_tokens // sp) * sp


class StepModeRule:
    """Mode per step from the step's token count alone: StepMode.SHIFT (TP over all P ranks) when
    num_tokens <= threshold, else StepMode.BASE (SP x TP). Every rank sees the same scheduled
    batch, so every rank reaches the same answer without communicating.

    threshold=None uses DEFAULT_SHIFT_THRESHOLD; use 0 for "always base" (static SP x TP) and a
    huge number for "always shift". With sp == 1 both modes are the same computation, so the
    rule always answers shift (no padding, one group).
    """

    def __init__(self, threshold: int | None = None):
        threshold = DEFAULT_SHIFT_THRESHOLD if threshold is None else threshold
        if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0:
            raise ValueError(f"shift threshold must be an int >= 0, got {threshold!r}")
        self.threshold = threshold

    @classmethod
    def always(cls, mode: str) -> StepModeRule:
        """The rule that answers `mode` ("base" / "shift" or a StepMode) for every step with sp > 1."""
        return cls(0 if check_mode(mode) is StepMode.BASE else 2**62)

    def mode(self, num_tokens: int, sp: int) -> StepMode:
        if num_tokens < 1:
            raise ValueError(f"a step needs at least one token, got {num_tokens}")
        if sp < 1:
            raise ValueError(f"sp must be >= 1, got {sp}")
        if sp == 1:
            return StepMode.SHIFT
        return StepMode.SHIFT if num_tokens <= self.threshold else StepMode.BASE

    def __repr__(self) -> str:
        return f"StepModeRule(threshold={self.threshold})"
