"""`jaxserve quantize`: a float model -> a quantized Model that models.checkpoint saves as is."""

from __future__ import annotations

import dataclasses

from jaxserve.quantization.core import QuantSpec
from jaxserve.quantization.methods import get_method
from jaxserve.quantization.paths import INT8_CHANNEL, refuse_moe
from jaxserve.quantization.rtn import quantize_head


def spec_from_args(bits: int, group_size: int | None, symmetric: bool) -> QuantSpec:
    """--bits/--group-size -> QuantSpec. No group size: 128 for int4, per channel for int8."""
    if group_size is None:
        group_size = 128 if bits == 4 else 0
    if group_size == 0:
        if bits == 4:
            raise ValueError("int4 weights are per group (the int4 kernel's layout): "
                             "pass --group-size 32, 64 or 128")
        return QuantSpec(bits=8, granularity="channel", symmetric=symmetric)
    return QuantSpec(bits=bits, granularity="group", group_size=group_size, symmetric=symmetric)


def path_for(spec: QuantSpec, activation_bits: int) -> str:
    """The inference path (paths.PATHS) that serves weights quantized with `spec`."""
    if activation_bits == 8:
        if spec.bits != 8 or spec.granularity == "group":
            raise ValueError("W8A8 (--activation-bits 8) needs int8 per-channel weights: "
                             "--bits 8 without --group-size (or --group-size 0)")
        return "w8a8"
    return "w4a16" if spec.bits == 4 else "w8a16"


def quantize_model(model, method: str, spec: QuantSpec, activation_bits: int = 16,
                   calibration=None):
    """Runs `method` (methods.METHODS) on the float model; returns the quantized Model.

    int8 paths also get an int8 per-channel LM head (RTN), as `quantization="w8a16"/"w8a8"`
    gives a float model at load time; int4 keeps the float head.
    """
    if getattr(model, "quantization", None) is not None:
        raise ValueError(f"{model.source} is already quantized ({model.quantization}); "
                         "quantize the float model")
    path = path_for(spec, activation_bits)
    refuse_moe(model.config, f"quantization ({method}, {path})")
    fn = get_method(method)
    params = fn(model, spec, calibration)
    if spec.bits == 8:
        params = quantize_head(params, INT8_CHANNEL)
    return dataclasses.replace(model, params=params, quantization=path, raw={})
