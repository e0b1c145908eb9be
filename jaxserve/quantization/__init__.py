"""Weight quantization: the formulas and weight pytree (core), and ways to fill it (rtn, ...)."""

from jaxserve.quantization.core import (QuantSpec, compute_qparams, dequantize_codes,
                                        dequantize_weight, quantize, quantize_with, to_weight)
from jaxserve.quantization.rtn import pick_group_size, quantize_params_int4

__all__ = ["QuantSpec", "compute_qparams", "dequantize_codes", "dequantize_weight",
           "pick_group_size", "quantize", "quantize_params_int4", "quantize_with", "to_weight"]
