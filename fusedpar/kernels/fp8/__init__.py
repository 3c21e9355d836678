"""FP8 (e4m3) weights and activations: the scale schemes of real checkpoints and their plain-PyTorch
reference (reference.py), the math every FP8 kernel and layer is tested against."""

from fusedpar.kernels.fp8.reference import (
    E4M3,
    E4M3_MAX,
    FP8Scheme,
    dequantize,
    fp8_linear,
    fp8_linear_tiles,
    quantize_activation,
    quantize_weight,
)

__all__ = ["E4M3", "E4M3_MAX", "FP8Scheme", "dequantize", "fp8_linear", "fp8_linear_tiles", "quantize_activation",
           "quantize_weight"]
