"""Weight quantization: the formulas and weight pytree (core), ways to fill it (rtn, methods,
gguf_native), the matmuls that consume it (linear) and the inference paths (paths)."""

from jaxserve.quantization.core import (QuantSpec, compute_qparams, dequantize_codes,
                                        dequantize_weight, quantize, quantize_with, to_weight)
from jaxserve.quantization.methods import METHODS, get_method
from jaxserve.quantization.paths import PATHS, prepare_model
from jaxserve.quantization.rtn import pick_group_size, quantize_params_int4
from models.quantized import Int4Weight, Int8Weight, QuantizedWeight, is_quantized

__all__ = ["METHODS", "PATHS", "Int4Weight", "Int8Weight", "QuantSpec", "QuantizedWeight",
           "compute_qparams", "dequantize_codes", "dequantize_weight", "get_method",
           "is_quantized", "pick_group_size", "prepare_model", "quantize",
           "quantize_params_int4", "quantize_with", "to_weight"]
