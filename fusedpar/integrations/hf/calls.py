"""Per-call agreement: every rank of a replica must call forward with the same inputs and settings.

Ranks that differ (another prompt on one rank, another max_new_tokens in generate, so that one rank
makes a forward call the others do not) would mix their activations silently, or hang or abort in
a collective whose shapes differ. Before the first collective of each forward call, the ranks
exchange one fixed-size row of int64 (shapes, cache width, settings, and hashes of the inputs,
computed on the device) and compare it; any difference raises ValueError on every rank, naming
each field, the ranks and their values. Cost: one all-gather of FIELDS int64 over the replica and
one device-to-host copy per call (`parallelize(..., check_inputs=False)` turns it off).
"""

from __future__ import annotations

import torch

from fusedpar.collectives import all_gather_rows
from fusedpar.collectives.agreement import disagreement

FIELDS = ("batch", "new columns", "cached columns", "input ids / embeddings (hash)", "attention_mask (hash)",
          "position_ids (hash)", "use_cache", "output_hidden_states", "logits_to_keep")
_ABSENT = -1
_MULT = 0x9E3779B1  # odd multiplier: position-dependent weights, so permuted inputs hash differently


def content_hash(t: torch.Tensor | None) -> torch.Tensor:
    """A 0-d int64 tensor on t's device: sum over elements of (bit pattern) * (1 + index) * _MULT,
    wrapping; equal tensors hash equal on any device; no host sync."""
    if t is None:
        return torch.tensor(_ABSENT, dtype=torch.int64)
    flat = t.detach().reshape(-1)
    if flat.is_floating_point():
        flat = flat.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    flat = flat.to(torch.int64)
    weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.int64) * _MULT
    return (flat * weights).sum()


def fingerprint(*, batch: int, new: int, cached: int, inputs: torch.Tensor, attention_mask, position_ids,
                use_cache: bool, output_hidden_states: bool, logits_to_keep, device: torch.device) -> torch.Tensor:
    """The row [len(FIELDS)] of int64 this rank contributes, on `device`."""
    keep = logits_to_keep if isinstance(logits_to_keep, int) else -2 - int(content_hash(logits_to_keep))
    head = torch.tensor([batch, new, cached], dtype=torch.int64, device=device)
    hashes = torch.stack([content_hash(x).to(device) for x in (inputs, attention_mask, position_ids)])
    tail = torch.tensor([int(use_cache), int(output_hidden_states), keep], dtype=torch.int64, device=device)
    return torch.cat([head, hashes, tail])


def check_call(row: torch.Tensor, group, what: str = "fusedpar.integrations.hf: forward") -> None:
    """Gather every rank's fingerprint row over `group` (a CommGroup) and raise ValueError on every rank
    unless all rows are equal. Collective."""
    if group.size == 1:
        return
    rows = all_gather_rows(row.view(1, -1), group).cpu().tolist()
    show = lambda v: "absent" if v == _ABSENT else str(v)  # noqa: E731
    problems = [p for i, name in enumerate(FIELDS)
                if (p := disagreement(name, [r[i] for r in rows], group.ranks, show)) is not None]
    if problems:
        raise ValueError(f"{what}: the ranks of this replica made different calls ({' | '.join(problems)}); every "
                         "rank must call forward / generate with the same inputs and settings")
