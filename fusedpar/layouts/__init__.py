"""Who holds what: rank grid, groups, head placement and weight shard maps. Pure Python."""

from fusedpar.layouts._checks import MODES, StepMode, check_mode
from fusedpar.layouts.grid import ParallelLayout, RankCoords
from fusedpar.layouts.heads import HeadPlacement, check_head_counts, head_count_problems
from fusedpar.layouts.reshard_plan import KVMove, Piece, holdings, kv_plan, view_range, weight_plan
from fusedpar.layouts.scale_blocks import check_scale_blocks, scale_block_problems
from fusedpar.layouts.shards import WEIGHT_NAMES, ModelDims, Segment, WeightShard, WeightShardMap, shard_problems

__all__ = [
    "MODES",
    "WEIGHT_NAMES",
    "HeadPlacement",
    "KVMove",
    "ModelDims",
    "ParallelLayout",
    "Piece",
    "RankCoords",
    "Segment",
    "StepMode",
    "WeightShard",
    "WeightShardMap",
    "check_head_counts",
    "check_mode",
    "check_scale_blocks",
    "head_count_problems",
    "holdings",
    "kv_plan",
    "scale_block_problems",
    "shard_problems",
    "view_range",
    "weight_plan",
]
