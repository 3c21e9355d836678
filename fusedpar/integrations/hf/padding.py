"""Padding and positions: which columns of an HF call are real tokens, where they sit, and HF's
values at the padded ones.

Tokens whose attention_mask is 0 never enter a fusedpar step. Within a sequence fusedpar numbers
real tokens 0, 1, 2, ...: what generate passes (position_ids = cumsum(attention_mask) - 1). A plain
forward gives a left-padded row HF positions p, p+1, ...; RoPE attention depends only on position
differences, so a constant shift per row changes nothing. Refused, naming the row:
- position ids not consecutive within a row, or shifting between calls (right padding followed
  by more tokens): NotImplementedError;
- a continuing call whose attention_mask re-masks a cached token or unmasks a cached padding
  column (the paged cache holds only the tokens that were real when cached): NotImplementedError;
- a sliding-window row whose real tokens span more attention_mask columns than the window (HF's
  window counts columns), or a row over max_seq_len: ValueError.
Padded positions get HF's SDPA values (_fill_padding): each runs after the step as a side query
through every layer, attending to its row's real tokens in earlier columns (within the window)
without being a key itself; one that sees no real token (left padding) has a zero attention output
in HF, so its value is its embedding through the layers' MLPs alone, computed once per token id.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .cache import ShiftParallelCache
from .spec import HFModelSpec

if TYPE_CHECKING:
    from .runtime import _Runtime


def _real_columns(state: ShiftParallelCache, attention_mask: torch.Tensor | None, b: int, s: int) -> torch.Tensor:
    """The call's new real columns, [b, s] CPU bool, after checking attention_mask's shape and that it
    repeats, over the cached columns, the mask they were cached under (_check_cached_columns)."""
    past = state.width
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise NotImplementedError("fusedpar.integrations.hf: only 2D attention masks [batch, past + seq] "
                                      f"are supported, got shape {tuple(attention_mask.shape)}")
        if tuple(attention_mask.shape) != (b, past + s):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; expected ({b}, {past + s}) "
                             f"= (batch, {past} cached columns + {s} new)")
        # the cached columns are compared where the mask lives (one bool comes back to the host)
        if past and not torch.equal(attention_mask[:, :past].bool(), state.columns_on(attention_mask.device)):
            _check_cached_columns(state, attention_mask[:, :past].to("cpu").bool(), given=True)
        return attention_mask[:, past:].to("cpu").bool()
    # HF: every column real, the cached ones included
    if past and not bool(state.columns.all()):
        _check_cached_columns(state, torch.ones((b, past), dtype=torch.bool), given=False)
    return torch.ones((b, s), dtype=torch.bool)


def _hf_positions(position_ids: torch.Tensor | None, b: int, s: int, past: int) -> torch.Tensor:
    """HF positions of the new tokens, [b, s] CPU: explicit, or what the HF model would compute."""
    if position_ids is None:
        return (torch.arange(s) + past).expand(b, s)
    pos = position_ids.to("cpu")
    if pos.dim() == 1:
        pos = pos[None]
    if pos.dim() != 2 or pos.shape[1] != s or pos.shape[0] not in (1, b):
        raise NotImplementedError(f"position_ids of shape {tuple(position_ids.shape)} (expected [batch, {s}])")
    return pos.expand(b, s)


def _check_positions(state: ShiftParallelCache, pos: torch.Tensor, new: torch.Tensor, q_lens: list[int]):
    """Per-row offset HF position - fusedpar position of the new real tokens; raise unless constant.

    fusedpar position of the j-th new real token of row i = state.cached[i] + j. The offset must
    be the same for all of a row's new tokens (consecutive positions) and equal to the offset its
    earlier tokens had; then RoPE attention is identical to HF's.
    """
    if new.shape[1] == 1:  # one column per row (a decode step): its offset, without tensor work
        lo = hi = [p - c for p, c in zip(pos[:, 0].tolist(), state.cached, strict=True)]
    else:
        ours = torch.tensor(state.cached, dtype=torch.long)[:, None] + new.long().cumsum(1) - 1
        off = torch.where(new, pos.long() - ours, 0)
        big = torch.iinfo(torch.long).max
        lo = torch.where(new, off, big).min(1).values.tolist()
        hi = torch.where(new, off, -big).max(1).values.tolist()
    offsets = list(state.offsets)
    for i, q in enumerate(q_lens):
        if not q:
            continue
        if lo[i] != hi[i]:
            raise NotImplementedError(
                f"row {i}: position_ids of its real tokens are not consecutive ({pos[i][new[i]].tolist()[:16]}); "
                "fusedpar numbers each sequence's tokens 0, 1, 2, ... (equal to HF up to a constant shift per row)"
            )
        if offsets[i] is not None and offsets[i] != lo[i]:
            raise NotImplementedError(
                f"row {i}: its positions shift by {lo[i] - offsets[i]} against its cached tokens (padding between "
                "real tokens, e.g. right padding followed by more tokens, or a left-padded prompt cached without "
                "position_ids and continued by generate, which numbers real tokens from 0); such a row cannot be "
                "matched"
            )
        offsets[i] = lo[i]
    return offsets


def _check_limits(spec: HFModelSpec, state: ShiftParallelCache, new: torch.Tensor, q_lens: list[int],
                  all_real: bool) -> list[int | None]:
    """Per row: at most max_seq_len tokens, and (sliding-window models) real tokens spanning at most
    the window's columns. Returns the rows' first real columns (ShiftParallelCache.first_col)."""
    b, s = new.shape
    past = state.width
    limit, window = spec.max_seq_len, spec.sliding_window
    if limit is not None:
        for i in range(b):
            if state.cached[i] + q_lens[i] > limit:
                raise ValueError(
                    f"row {i} would hold {state.cached[i] + q_lens[i]} tokens, over max_seq_len={limit}"
                    + (f" (sliding_window={window}: longer sequences would leave the window)"
                       if window is not None else "")
                )
    # HF's sliding window counts attention_mask columns (key column > query column - window), not
    # real tokens: a row with masked columns between its real tokens leaves the window sooner.
    first_col = list(state.first_col)
    for i in range(b) if window is not None else ():
        if not q_lens[i]:
            continue
        real_cols = range(s) if all_real else new[i].nonzero().flatten().tolist()
        if first_col[i] is None:
            first_col[i] = past + real_cols[0]
        span = past + real_cols[-1] - first_col[i] + 1
        if span > window:
            raise ValueError(
                f"row {i}: its {state.cached[i] + q_lens[i]} real tokens span {span} attention_mask columns "
                f"(masked columns between them), over sliding_window={window}: the model's window counts "
                f"columns, and fusedpar's full attention equals it only while a row spans at most {window}"
            )
    return first_col


def _fill_padding(rt: _Runtime, state: ShiftParallelCache, embeds: torch.Tensor, new: torch.Tensor, pos: torch.Tensor,
                  offsets: list, input_ids: torch.Tensor | None, out: torch.Tensor,
                  layer_outputs: list[torch.Tensor], local: range | None = None) -> None:
    """Write HF's (SDPA) output at this call's padded positions into out (and layer_outputs).

    After the step every real token's k/v is cached, so each padded position runs as a side query
    (ShiftParallelDecoderLayer.side_queries): it attends to the real tokens of its row in columns
    before its own (within the sliding window, if any) and is no key itself, as in HF's SDPA, where
    its mask column is 0. A padding query that sees no real token (left padding: what generate and
    tokenizers use for decoder-only models) gets a zero attention output there, so its state is its
    embedding through the layers' MLPs alone, whatever its position: run once per token id. Runs
    after the stack, so no real position depends on it. Cost: one reference-path pass over the
    layers for the call's distinct blind ids plus every padding query that sees a real token (those
    that see the same tokens - a right-padded row's - attend in one call per layer; generate's left
    padding costs one row).
    new: [b, s] CPU bool, the call's real columns; pos: [b, s] CPU, HF position ids; offsets: HF -
    fusedpar position per row; local: the rows this rank's replica runs (data parallel; None: all), whose
    padded positions are the only ones written."""
    past = state.width
    real = torch.cat([state.columns, new], dim=1)
    before = F.pad(real.long().cumsum(1), (1, 0))  # before[i, c]: real columns of row i in [0, c)
    padded = ~new
    if local is not None:
        padded[:local.start], padded[local.stop:] = False, False
    rows, cols = padded.nonzero(as_tuple=True)
    if not rows.numel():  # the same on every rank of the replica (its rows, the same call)
        return
    col = past + cols
    hi = before[rows, col]
    window = rt.spec.sliding_window
    # HF's window: key column > query column - window
    lo = before[rows, (col - window + 1).clamp_min(0)] if window is not None else torch.zeros_like(hi)
    blind = hi == lo
    # queries that see a real token, one each; the blind ones, one per token id
    seeing = (~blind).nonzero().flatten()
    blind_at = blind.nonzero().flatten()
    if input_ids is not None and blind_at.numel():
        _, blind_group = torch.unique(input_ids.cpu()[rows[blind_at], cols[blind_at]], return_inverse=True)
    else:
        blind_group = torch.arange(blind_at.numel())
    n_blind = int(blind_group.max()) + 1 if blind_at.numel() else 0
    source = torch.empty(rows.numel(), dtype=torch.long)  # padded position -> row of x
    source[blind_at] = blind_group
    source[seeing] = n_blind + torch.arange(seeing.numel())
    picked = torch.empty(n_blind + seeing.numel(), dtype=torch.long)  # row of x -> a padded position
    picked[source] = torch.arange(rows.numel())  # blind duplicates hold one embedding: any may land
    visible = [(-1, 0, 0)] * n_blind
    positions = torch.zeros(n_blind + seeing.numel(), dtype=torch.long)
    for r, p in enumerate(seeing.tolist(), n_blind):
        i = int(rows[p])
        visible.append((state.seq_ids[i], int(lo[p]), int(hi[p])))
        positions[r] = int(pos[i, cols[p]]) - offsets[i]  # a row that sees a real token has an offset
    dev = embeds.device
    rows_d, cols_d = rows.to(dev), cols.to(dev)
    x = embeds[rows_d[picked.to(dev)], cols_d[picked.to(dev)]]
    source = source.to(dev)
    positions = positions.to(dev)
    for li, layer in enumerate(rt.stack.layers):
        x = layer.side_queries(x, positions, visible, rt.kv)
        if li < len(layer_outputs):
            layer_outputs[li][rows_d, cols_d] = x[source].to(layer_outputs[li].dtype)
    out[rows_d, cols_d] = x[source].to(out.dtype)


def _check_cached_columns(state: ShiftParallelCache, seen: torch.Tensor, given: bool) -> None:
    """The attention_mask over the cached columns must be the one they were cached under.

    An HF cache keeps every column's k/v (padding included) and the mask of each call decides
    which of them attend; the paged cache keeps only the real tokens. A call that re-masks a
    cached token, or unmasks a cached padding column (e.g. no attention_mask, or an all-ones one,
    after a left-padded prompt), would attend differently in HF: refuse it rather than differ."""
    if torch.equal(seen, state.columns):
        return
    row = int((seen != state.columns).any(1).nonzero()[0])
    diff = (seen[row] != state.columns[row]).nonzero().flatten().tolist()
    now_real = [c for c in diff if seen[row, c]]
    now_pad = [c for c in diff if not seen[row, c]]
    what = []
    if now_real:
        what.append(f"marks cached padding column(s) {now_real[:8]} as real")
    if now_pad:
        what.append(f"masks cached real token column(s) {now_pad[:8]}")
    how = "" if given else " (no attention_mask: HF would take every cached column as real)"
    raise NotImplementedError(
        f"fusedpar.integrations.hf: row {row}: this call's attention_mask {' and '.join(what)}{how}; "
        f"the sharded cache holds only the tokens that were real when cached ({int(state.columns[row].sum())} of "
        f"{state.width} columns in this row) and cannot change which cached tokens attend: pass the earlier "
        "calls' attention_mask extended by the new columns"
    )
