"""nn.Modules that compose kernels and collectives per mode, and their plain-PyTorch references."""

from fusedpar.layers.config import DecoderConfig, random_decoder_weights, weight_shapes
from fusedpar.layers.decoder import ShiftParallelDecoderLayer, StepState
from fusedpar.layers.kv_cache import PagedKVCache
from fusedpar.layers.policy import DEFAULT_SHIFT_THRESHOLD, ShiftPolicy, StepBatch, padded_token_count
from fusedpar.layers.reference import DenseDecoderStack
from fusedpar.layers.reshard import migrate_kv
from fusedpar.layers.stack import ShiftParallelStack
from fusedpar.layers.weights import ShardedDecoderWeights

__all__ = [
    "DEFAULT_SHIFT_THRESHOLD",
    "DecoderConfig",
    "DenseDecoderStack",
    "PagedKVCache",
    "ShardedDecoderWeights",
    "ShiftParallelDecoderLayer",
    "ShiftParallelStack",
    "ShiftPolicy",
    "StepBatch",
    "StepState",
    "migrate_kv",
    "padded_token_count",
    "random_decoder_weights",
    "weight_shapes",
]
