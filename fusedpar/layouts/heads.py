"""Head placement: which q and kv heads each rank computes and caches, in base and shift mode.

Contract: h q heads, h_kv kv heads on a replica of P = SP*TP ranks need h_kv | h, P | h, and
h_kv | P or P | h_kv. TP alone need not fit h_kv.

The two modes are derived independently, so that tests prove KV-cache invariance rather than
assume it:

- base (SP x TP): TP shard t of the weights holds q heads [t*h/TP, (t+1)*h/TP). The Ulysses
  all-to-all cuts the shard's head columns into SP equal chunks in column order and delivers
  chunk s to SP rank s; kv heads follow their q heads:
  * TP | h_kv or h_kv | TP: the shard holds the kv heads plain TP would give it (a contiguous
    range, or one replicated head); SP rank s receives its 1/SP of them, or, when the shard has
    fewer kv heads than SP ranks, the one its q heads attend to, (s * n_kv_shard) // SP.
  * otherwise (then h_kv | P, e.g. 6 q / 2 kv heads on SP=2 x TP=3) the shard's q heads
    straddle kv groups; each SP chunk lies inside one group (h/P divides h/h_kv), and SP rank s
    receives that group's kv head: the shard carries each SP block's own kv columns.
- shift (TP = P = SP*TP over the replica, natural rank order): plain TP=P sharding.

With the canonical rank order (local rank r = t*SP + s) both give rank r the q heads
[r*h/P, (r+1)*h/P) and the same kv heads, in the same order: one KV cache serves both modes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fusedpar.layouts._checks import StepMode, check_mode, positive_int

if TYPE_CHECKING:
    from fusedpar.layouts.grid import ParallelLayout


def tp_kv_heads(num_kv_heads: int, tp: int, t: int) -> tuple[int, ...]:
    """kv heads of TP shard t under plain tensor parallelism (replicated when tp > num_kv_heads)."""
    if tp <= num_kv_heads:
        per = num_kv_heads // tp
        return tuple(range(t * per, (t + 1) * per))
    return ((t * num_kv_heads) // tp,)


def head_count_problems(num_q_heads: int, num_kv_heads: int, sp: int, tp: int) -> list[str]:
    """Every constraint (h, h_kv) breaks on an SP x TP replica, one message each (empty: placeable).
    Only P = sp*tp matters; tp is taken to name it. Non-positive counts or sizes raise ValueError."""
    positive_int("num_q_heads", num_q_heads)
    positive_int("num_kv_heads", num_kv_heads)
    positive_int("sp", sp)
    positive_int("tp", tp)
    P = sp * tp
    problems = []
    if num_q_heads % num_kv_heads:
        problems.append(
            f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads} (GQA groups must be equal)"
        )
    if num_q_heads % P:
        problems.append(
            f"num_q_heads={num_q_heads} is not divisible by sp*tp={sp}*{tp}={P}: every rank of a replica "
            "computes an equal chunk of q heads"
        )
    if num_kv_heads % P and P % num_kv_heads:
        problems.append(
            f"num_kv_heads={num_kv_heads} is neither a multiple nor a divisor of sp*tp={sp}*{tp}={P}: kv heads "
            "are either split evenly or replicated evenly across the replica"
        )
    return problems


def check_head_counts(num_q_heads: int, num_kv_heads: int, sp: int, tp: int) -> None:
    """Raise ValueError naming every constraint (h, h_kv) breaks on an SP x TP replica."""
    problems = head_count_problems(num_q_heads, num_kv_heads, sp, tp)
    if problems:
        raise ValueError("; ".join(problems))


class HeadPlacement:
    """Global head ids per rank and mode, in the order the rank's attention and KV cache hold them."""

    def __init__(self, layout: ParallelLayout, num_q_heads: int, num_kv_heads: int):
        check_head_counts(num_q_heads, num_kv_heads, layout.sp, layout.tp)
        self.layout = layout
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads

    @property
    def group_size(self) -> int:
        """q heads per kv head (GQA group)."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def q_heads_per_rank(self) -> int:
        return self.num_q_heads // self.layout.replica_size

    @property
    def kv_heads_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.layout.replica_size)

    @property
    def kv_replication(self) -> int:
        """How many ranks of a replica cache each kv head (1 = no replication)."""
        return max(1, self.layout.replica_size // self.num_kv_heads)

    def kv_head_of(self, q_head: int) -> int:
        return q_head // self.group_size

    def q_heads(self, rank: int, mode: str) -> tuple[int, ...]:
        if check_mode(mode) is StepMode.SHIFT:
            return self._shift_q(rank)
        return self._base_q(rank)

    def kv_heads(self, rank: int, mode: str) -> tuple[int, ...]:
        if check_mode(mode) is StepMode.SHIFT:
            return self._shift_kv(rank)
        return self._base_kv(rank)

    def q_to_kv_index(self, rank: int, mode: str = StepMode.BASE) -> tuple[int, ...]:
        """For each q head the rank holds, the index of its kv head in kv_heads(rank, mode)."""
        kv = self.kv_heads(rank, mode)
        return tuple(kv.index(self.kv_head_of(q)) for q in self.q_heads(rank, mode))

    # base: TP shard of the weights, then what the SP all-to-all delivers ------------------------
    def _base_shard_q(self, t: int) -> tuple[int, ...]:
        per = self.num_q_heads // self.layout.tp
        return tuple(range(t * per, (t + 1) * per))

    def _base_q(self, rank: int) -> tuple[int, ...]:
        c = self.layout.coords(rank)
        shard = self._base_shard_q(c.tp)
        per = len(shard) // self.layout.sp
        return shard[c.sp * per:(c.sp + 1) * per]

    def _base_kv(self, rank: int) -> tuple[int, ...]:
        c = self.layout.coords(rank)
        h_kv, tp = self.num_kv_heads, self.layout.tp
        if h_kv % tp and tp % h_kv:  # the shard straddles kv groups; this SP chunk lies inside one
            return (self._base_q(rank)[0] // self.group_size,)
        shard = tp_kv_heads(h_kv, tp, c.tp)
        m, sp = len(shard), self.layout.sp
        if m >= sp:
            per = m // sp
            return shard[c.sp * per:(c.sp + 1) * per]
        return (shard[(c.sp * m) // sp],)

    # shift: plain TP over the replica's P ranks in natural order --------------------------------
    def _shift_q(self, rank: int) -> tuple[int, ...]:
        r = self.layout.coords(rank).local
        per = self.num_q_heads // self.layout.replica_size
        return tuple(range(r * per, (r + 1) * per))

    def _shift_kv(self, rank: int) -> tuple[int, ...]:
        r = self.layout.coords(rank).local
        return tp_kv_heads(self.num_kv_heads, self.layout.replica_size, r)

    def __repr__(self) -> str:
        return f"HeadPlacement({self.layout!r}, num_q_heads={self.num_q_heads}, num_kv_heads={self.num_kv_heads})"
