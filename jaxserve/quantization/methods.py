"""Weight quantization methods by name: `(model, spec, calibration) -> params`.

Each takes a loaded float Model, a QuantSpec and calibration data (None for methods that need
none) and returns the model's params with every decoder linear kernel replaced by its quantized
pytree (core.py). `jaxserve quantize --method NAME` looks methods up here.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from jaxserve.quantization.core import QuantSpec
from jaxserve.quantization.rtn import rtn

Method = Callable[[Any, QuantSpec, Any], dict]



def _calibrated(method: Callable) -> Method:
    """`calibration` as the CLI gives it (a text file's path, or None for the built-in text)."""
    def run(model, spec: QuantSpec, calibration=None) -> dict:
        if calibration is None or isinstance(calibration, (str, os.PathLike)):
            from jaxserve.quantization.calibration import load_calibration
            if model.tokenizer is None:
                raise ValueError(f"{model.source} has no tokenizer to read calibration text "
                                 "with; give a model with one (or calibration token ids)")
            calibration = load_calibration(model, calibration)
        return method(model, spec, calibration)
    return run


def _gptq(model, spec, calibration):
    from jaxserve.quantization.gptq import gptq_quantize
    return gptq_quantize(model, spec, calibration)


def _awq(model, spec, calibration):
    from jaxserve.quantization.awq import awq_quantize
    return awq_quantize(model, spec, calibration)


METHODS: dict[str, Method] = {"rtn": rtn, "gptq": _calibrated(_gptq), "awq": _calibrated(_awq)}


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"quantization method {name!r} is not available in this build "
                         f"(available: {', '.join(sorted(METHODS))})")
    return METHODS[name]
