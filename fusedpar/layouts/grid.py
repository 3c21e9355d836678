"""The rank grid: which global rank plays which (dp, sp, tp) role, and the groups that follow.

Canonical order: P = sp * tp ranks form one model replica; DP replicas are outermost, so
replica d owns ranks d*P .. d*P+P-1. Inside a replica, local rank r has
    s = r % sp      (position in its SP group: SP groups are contiguous)
    t = r // sp     (position in its TP group: TP groups are strided by sp)
and the shift group is the replica's ranks in natural order, which makes the shift config
exactly plain TP=P (vLLM's native order): no logits permutation, no group swapping.

Pipeline parallelism is not implemented, but it has a reserved place: it will be the outermost
axis (pipeline stage p owns ranks p*dp*P .. (p+1)*dp*P-1), so adding it changes no formula
below for pp=1.

Pure Python and integers: nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from fusedpar.layouts._checks import positive_int
from fusedpar.layouts.heads import HeadPlacement
from fusedpar.layouts.shards import ModelDims, WeightShardMap


@dataclass(frozen=True)
class RankCoords:
    """Where one global rank sits in the grid.

    dp: model replica index; sp: index inside its SP group; tp: index inside its TP group
    (= which TP shard of the base weights it holds); local: rank inside the replica
    (= its rank in the shift group, = the head chunk it computes in both modes); pp: reserved, 0.
    """

    dp: int
    sp: int
    tp: int
    local: int
    pp: int = 0


class ParallelLayout:
    """Shard map of one deployment: world_size = dp * sp * tp global ranks.

    >>> lay = ParallelLayout(8, sp=2, tp=2)
    >>> lay.dp, lay.sp_groups, lay.tp_groups
    (2, [[0, 1], [2, 3], [4, 5], [6, 7]], [[0, 2], [1, 3], [4, 6], [5, 7]])
    >>> lay.shift_groups, lay.dp_groups
    ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])
    """

    def __init__(self, world_size: int, *, sp: int = 1, tp: int = 1, dp: int | None = None, pp: int = 1):
        self.world_size = positive_int("world_size", world_size)
        self.sp = positive_int("sp", sp)
        self.tp = positive_int("tp", tp)
        self.pp = positive_int("pp", pp)
        if self.pp != 1:
            raise ValueError(f"pipeline parallelism is not supported yet (pp={pp}); use pp=1")
        per_replica = self.sp * self.tp
        if self.world_size % per_replica:
            raise ValueError(
                f"world_size={world_size} is not divisible by sp*tp={sp}*{tp}={per_replica}: "
                "every model replica needs exactly sp*tp ranks"
            )
        implied_dp = self.world_size // per_replica
        if dp is None:
            dp = implied_dp
        else:
            positive_int("dp", dp)
            if dp * per_replica != self.world_size:
                raise ValueError(
                    f"dp={dp} disagrees with world_size={world_size} and sp*tp={per_replica}: "
                    f"need dp*sp*tp == world_size, i.e. dp={implied_dp}"
                )
        self.dp = dp

    @property
    def replica_size(self) -> int:
        """P = sp * tp: ranks per model replica, and the TP degree of the shift config."""
        return self.sp * self.tp

    def __repr__(self) -> str:
        return f"ParallelLayout(world_size={self.world_size}, sp={self.sp}, tp={self.tp}, dp={self.dp})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ParallelLayout):
            return NotImplemented
        return (self.world_size, self.sp, self.tp, self.dp, self.pp) == (
            other.world_size, other.sp, other.tp, other.dp, other.pp)

    def __hash__(self) -> int:
        return hash((self.world_size, self.sp, self.tp, self.dp, self.pp))

    def _check_rank(self, rank: int) -> int:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")
        return rank

    def coords(self, rank: int) -> RankCoords:
        self._check_rank(rank)
        d, local = divmod(rank, self.replica_size)
        return RankCoords(dp=d, sp=local % self.sp, tp=local // self.sp, local=local)

    def rank_of(self, *, dp: int = 0, sp: int = 0, tp: int = 0) -> int:
        """Inverse of coords()."""
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (dp, sp, tp))
        if not (ok and 0 <= dp < self.dp and 0 <= sp < self.sp and 0 <= tp < self.tp):
            raise ValueError(f"coords (dp={dp}, sp={sp}, tp={tp}) outside {self!r}")
        return dp * self.replica_size + tp * self.sp + sp

    @cached_property
    def sp_groups(self) -> list[list[int]]:
        """Ranks sharing one TP shard of the weights and splitting the tokens; contiguous."""
        return [[self.rank_of(dp=d, sp=s, tp=t) for s in range(self.sp)]
                for d in range(self.dp) for t in range(self.tp)]

    @cached_property
    def tp_groups(self) -> list[list[int]]:
        """Ranks holding the same tokens (base mode) and splitting heads/columns; stride sp."""
        return [[self.rank_of(dp=d, sp=s, tp=t) for t in range(self.tp)]
                for d in range(self.dp) for s in range(self.sp)]

    @cached_property
    def shift_groups(self) -> list[list[int]]:
        """One per replica, natural order: the TP=P group of the shift config."""
        P = self.replica_size
        return [list(range(d * P, (d + 1) * P)) for d in range(self.dp)]

    @cached_property
    def dp_groups(self) -> list[list[int]]:
        """Ranks at the same place of every replica (they hold identical weight shards)."""
        P = self.replica_size
        return [[d * P + local for d in range(self.dp)] for local in range(P)]

    def _group_of(self, groups: list[list[int]], rank: int) -> list[int]:
        self._check_rank(rank)
        for g in groups:
            if rank in g:
                return g
        raise AssertionError("unreachable: groups cover every rank")

    def sp_group_of(self, rank: int) -> list[int]:
        return self._group_of(self.sp_groups, rank)

    def tp_group_of(self, rank: int) -> list[int]:
        return self._group_of(self.tp_groups, rank)

    def shift_group_of(self, rank: int) -> list[int]:
        return self._group_of(self.shift_groups, rank)

    def dp_group_of(self, rank: int) -> list[int]:
        return self._group_of(self.dp_groups, rank)

    def head_placement(self, num_q_heads: int, num_kv_heads: int) -> HeadPlacement:
        """Which attention heads each rank computes and caches, in both modes."""
        return HeadPlacement(self, num_q_heads, num_kv_heads)

    def weight_shards(self, dims: ModelDims) -> WeightShardMap:
        """Per-rank base shard and shift view of the qkv, o, gate_up and down weights."""
        return WeightShardMap(self, dims)
