"""ShiftParallelCache: the past_key_values of a parallelized model, bookkeeping only.

The k/v tensors live in one core PagedKVCache per parallelized model (this rank's kv heads, shared
by both modes, grown before a step that does not fit); this transformers `Cache` maps batch rows to
fusedpar sequences and records what each row has cached.
- A call without past_key_values (or with an empty HF cache, as generate passes first) starts new
  sequences and frees the previous live ones; a call with use_cache=False uses temporary sequences.
- Only the most recent cache can be continued, and copies of it: `copy.deepcopy(cache)` (HF's
  prompt-reuse recipe) forks its sequences (new ones holding a copy of its k/v). A fork is freed
  when a later call starts new sequences or, once every rank of the replica has garbage-collected
  it, at the next step that would otherwise grow the cache: the pools stay identical on every rank
  with no per-step collective.
- A continuing call's attention_mask must repeat, over the cached columns, the mask they were
  cached under (the paged cache holds only real tokens; padding.py).
- Beam search and assisted decoding (reorder / crop / batch selection) raise NotImplementedError.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache

if TYPE_CHECKING:
    from .runtime import _Runtime

__all__ = ["ShiftParallelCache"]


class ShiftParallelCache(Cache):
    """past_key_values of a parallelized model: bookkeeping only, the k/v live in the paged cache.

    seq_ids[i]: fusedpar sequence of batch row i; cached[i]: its real tokens in the cache;
    width: columns seen so far (what HF calls the cache's sequence length: attention masks of
    later calls are this wide plus the new tokens); offsets[i]: HF position minus fusedpar
    position of row i (constant for a valid row, see padding.py); first_col[i]: the
    column of row i's first real token (sliding-window models only: their window counts columns);
    columns: bool [rows, width] CPU, which columns were real tokens when they were cached (a later
    call's attention_mask must repeat it over those columns: the cache holds only real tokens, so
    it can neither mask a cached token nor attend to a padding one, as an HF cache could).
    """

    def __init__(self, runtime: _Runtime, seq_ids: list[int]):
        super().__init__(layers=[])
        self._runtime = runtime
        self.seq_ids = list(seq_ids)
        self.cached = [0] * len(seq_ids)
        self.offsets: list[int | None] = [None] * len(seq_ids)
        self.first_col: list[int | None] = [None] * len(seq_ids)
        self.columns = torch.zeros((len(seq_ids), 0), dtype=torch.bool)
        self._columns_dev: torch.Tensor | None = None  # `columns` where the masks live (columns_on)
        self.width = 0
        self.released = False

    def columns_on(self, device: torch.device) -> torch.Tensor:
        """`columns` on `device`, kept there and extended with it, so that checking a decode step's
        mask copies only its new columns to the host, not the whole [rows, width] mask."""
        dev = self._columns_dev
        if dev is None or dev.device != device or dev.shape != self.columns.shape:
            dev = self._columns_dev = self.columns.to(device)
        return dev

    def _append_columns(self, new: torch.Tensor) -> None:
        self.columns = torch.cat([self.columns, new], dim=1)
        if self._columns_dev is not None:
            self._columns_dev = torch.cat([self._columns_dev, new.to(self._columns_dev.device)], dim=1)

    def __deepcopy__(self, memo):
        """copy.deepcopy(past_key_values), as HF's prompt-reuse recipe does: a fork (new sequences
        holding a copy of this cache's k/v); this cache stays as it is and can be continued too."""
        return self._runtime.fork(self)

    def __repr__(self) -> str:
        return (f"ShiftParallelCache(rows={len(self.seq_ids)}, width={self.width}, cached={self.cached}, "
                f"released={self.released})")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return True

    @property
    def batch_size(self) -> int:
        return len(self.seq_ids)

    def release(self) -> None:
        """Free this cache's sequences in the paged cache (idempotent)."""
        if not self.released:
            self._runtime.release(self)

    def reset(self) -> None:
        self.release()

    def _unsupported(self, what: str):
        raise NotImplementedError(
            f"fusedpar.integrations.hf: {what} is not supported by the sharded KV cache "
            "(greedy and sampling generate work; beam search and assisted decoding do not)"
        )

    def update(self, *args, **kwargs):
        self._unsupported("Cache.update (running HF attention layers on this cache)")

    def reorder_cache(self, beam_idx):
        self._unsupported("reordering the cache (beam search)")

    def crop(self, tokens_to_remove):
        self._unsupported("cropping the cache (assisted decoding)")

    def batch_repeat_interleave(self, repeats):
        self._unsupported("batch_repeat_interleave")

    def batch_select_indices(self, indices):
        self._unsupported("batch_select_indices")
