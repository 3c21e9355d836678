"""Per-call agreement: every rank of a replica must call forward with the same inputs and settings.

Ranks that differ (another prompt on one rank, another max_new_tokens in generate, so that one rank
makes a forward call the others do not) would mix their activations silently, or hang or abort in
a collective whose shapes differ. Each forward call is checked in two parts:

  shape   batch, new and cached columns, use_cache, output_hidden_states, logits_to_keep: host
          integers, all-gathered on the host before the call's first collective (HostExchange:
          shared memory on one host, gloo otherwise) and compared at once. A difference here would
          hang the call, so it always raises first.
  content hashes of input ids / embeddings, attention_mask and position_ids, computed on the
          device and all-gathered there. A call that starts or extends sequences by more than one
          column compares them before it runs. A decode call (one new column on a live cache) does
          not wait for the device: its hashes are compared LAG calls later (or when generate
          returns), so a decode step costs no host-device synchronisation, only one small
          collective on each side.

Any difference raises ValueError on every rank (all compare the same gathered rows at the same
call), naming each field, the ranks and their values. `parallelize(..., check_inputs=False)` turns
the check off.
"""

from __future__ import annotations

import datetime
from collections import deque

import torch

from fusedpar.collectives import CommGroup, all_gather_rows
from fusedpar.collectives.agreement import disagreement
from fusedpar.collectives.host_exchange import HostExchange

SHAPE_FIELDS = ("batch", "new columns", "cached columns", "use_cache", "output_hidden_states", "logits_to_keep")
CONTENT_FIELDS = ("input ids / embeddings (hash)", "attention_mask (hash)", "position_ids (hash)")
LAG = 2  # decode calls: contents compared this many calls later
_ABSENT = -1
_MULT = 0x9E3779B1  # odd multiplier: position-dependent weights, so permuted inputs hash differently
_WHAT = "fusedpar.integrations.hf: forward"


def content_hash(t: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """A 0-d int64 tensor on `device`: sum over elements of (bit pattern) * (1 + index) * _MULT,
    wrapping; equal tensors hash equal on any device; no host sync."""
    if t is None:
        return torch.full((), _ABSENT, dtype=torch.int64, device=device)
    flat = t.detach().reshape(-1)
    if flat.is_floating_point():
        flat = flat.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    flat = flat.to(torch.int64)
    weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.int64) * _MULT
    return (flat * weights).sum().to(device)


def _raise_if_different(fields: tuple[str, ...], rows: list[list[int]], ranks) -> None:
    show = lambda v: "absent" if v == _ABSENT else str(v)  # noqa: E731
    problems = [p for i, name in enumerate(fields)
                if (p := disagreement(name, [r[i] for r in rows], ranks, show)) is not None]
    if problems:
        raise ValueError(f"{_WHAT}: the ranks of this replica made different calls ({' | '.join(problems)}); every "
                         "rank must call forward / generate with the same inputs and settings")


class CallChecker:
    """The per-call check of one group of ranks that must make the same calls (see the module doc).

    group: the ranks (device collectives); host: the same ranks on a gloo group (CPU tensors);
    timeout: of the host exchange. Collective: every rank of the group builds it together and calls
    `check` once per forward call, before its first other collective.
    """

    def __init__(self, group: CommGroup, host: CommGroup, timeout: datetime.timedelta | float):
        if group.ranks != host.ranks:
            raise ValueError(f"CallChecker: device group {group.ranks} and host group {host.ranks} differ")
        self.group = group
        self.shapes = HostExchange(host, len(SHAPE_FIELDS), timeout)
        self.calls = 0
        # (call index, gathered hashes [G, 3] (pinned host copy on CUDA), event or None)
        self.pending: deque[tuple[int, torch.Tensor, torch.cuda.Event | None]] = deque()

    def check(self, *, batch: int, new: int, cached: int, inputs: torch.Tensor, attention_mask, position_ids,
              use_cache: bool, output_hidden_states: bool, logits_to_keep, decode: bool,
              device: torch.device) -> None:
        if self.group.size == 1:
            return
        self.calls += 1
        keep = logits_to_keep if isinstance(logits_to_keep, int) else -2 - int(content_hash(logits_to_keep, "cpu"))
        rows = self.shapes.all_gather([batch, new, cached, int(use_cache), int(output_hidden_states), keep])
        try:
            _raise_if_different(SHAPE_FIELDS, rows, self.group.ranks)
        except ValueError:
            self.pending.clear()
            raise
        mine = torch.stack([content_hash(x, device) for x in (inputs, attention_mask, position_ids)])
        gathered = all_gather_rows(mine.view(1, -1), self.group)
        if device.type == "cuda":
            host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            host.copy_(gathered, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.pending.append((self.calls, host, event))
        else:
            self.pending.append((self.calls, gathered, None))
        self._compare(upto=self.calls - LAG if decode else self.calls)

    def flush(self) -> None:
        """Compare every pending call's contents now (generate calls this when it returns)."""
        self._compare(upto=self.calls)

    def _compare(self, upto: int) -> None:
        while self.pending and self.pending[0][0] <= upto:
            _, rows, event = self.pending.popleft()
            if event is not None:
                event.synchronize()
            try:
                _raise_if_different(CONTENT_FIELDS, rows.tolist(), self.group.ranks)
            except ValueError:
                self.pending.clear()
                raise
