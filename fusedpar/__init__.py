"""fusedpar: fused parallel transformer layers that switch between sequence parallelism (SP)
and tensor parallelism (TP) from one forward step to the next (Shift Parallelism).

Imports run one way: layouts <- collectives <- kernels <- layers <- integrations.
`import fusedpar` loads only the pure-Python layouts; torch-backed names load on first use.
"""

from fusedpar.layouts import HeadPlacement, ModelDims, ParallelLayout, RankCoords, WeightShardMap

__version__ = "0.1.0"

_LAZY = {
    "ParallelContext": "fusedpar.collectives",
    "DecoderConfig": "fusedpar.layers",
    "PagedKVCache": "fusedpar.layers",
    "ShiftParallelDecoderLayer": "fusedpar.layers",
    "ShiftParallelStack": "fusedpar.layers",
    "StepBatch": "fusedpar.layers",
    "StepModeRule": "fusedpar.layers",
    "random_decoder_weights": "fusedpar.layers",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fusedpar' has no attribute {name!r}")


__all__ = ["HeadPlacement", "ModelDims", "ParallelLayout", "RankCoords", "WeightShardMap", *_LAZY]
