"""nn.Modules that compose kernels and collectives per mode, and their plain-PyTorch references."""

from fusedpar.layers.config import DecoderConfig, random_decoder_weights, weight_shapes
from fusedpar.layers.decoder import ShiftParallelDecoderLayer, StepState
from fusedpar.layers.host_tier import HostKVTier, SwapHandle
from fusedpar.layers.kv_cache import PagedKVCache
from fusedpar.layers.kv_reshard import migrate_kv
from fusedpar.layers.layout_policy import (
    AutoPolicy,
    LayoutPolicy,
    LoadPolicy,
    PrefillDecodePolicy,
    ShiftThresholdPolicy,
    StepFacts,
    StepTimeCurve,
)
from fusedpar.layers.reference import DenseDecoderStack
from fusedpar.layers.stack import ShiftParallelStack
from fusedpar.layers.step_plan import DEFAULT_SHIFT_THRESHOLD, StepBatch, StepModeRule, padded_token_count
from fusedpar.layers.step_times import measure_step_times, stack_step_times
from fusedpar.layers.weights import ShardedDecoderWeights

__all__ = [
    "DEFAULT_SHIFT_THRESHOLD",
    "AutoPolicy",
    "DecoderConfig",
    "DenseDecoderStack",
    "HostKVTier",
    "LayoutPolicy",
    "LoadPolicy",
    "PagedKVCache",
    "PrefillDecodePolicy",
    "ShardedDecoderWeights",
    "ShiftParallelDecoderLayer",
    "ShiftParallelStack",
    "ShiftThresholdPolicy",
    "StepBatch",
    "StepFacts",
    "StepModeRule",
    "StepState",
    "StepTimeCurve",
    "SwapHandle",
    "measure_step_times",
    "migrate_kv",
    "padded_token_count",
    "random_decoder_weights",
    "stack_step_times",
    "weight_shapes",
]
