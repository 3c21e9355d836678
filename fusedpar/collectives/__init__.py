"""How bytes move: ParallelContext (all groups, created once) and the plain collectives."""

from fusedpar.collectives.agreement import check_agreement, tensor_checksum
from fusedpar.collectives.comm import (
    all_gather_rows,
    all_reduce_sum,
    head_to_seq_all_to_all,
    seq_to_head_all_to_all,
)
from fusedpar.collectives.context import CommGroup, ParallelContext
from fusedpar.collectives.weight_reshard import Held, reshard_weight

__all__ = [
    "CommGroup",
    "Held",
    "ParallelContext",
    "all_gather_rows",
    "all_reduce_sum",
    "check_agreement",
    "head_to_seq_all_to_all",
    "reshard_weight",
    "seq_to_head_all_to_all",
    "tensor_checksum",
]
