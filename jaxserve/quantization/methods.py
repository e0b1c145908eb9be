"""Weight quantization methods by name: `(model, spec, calibration) -> params`.

Each takes a loaded float Model, a QuantSpec and calibration data (None for methods that need
none) and returns the model's params with every decoder linear kernel replaced by its quantized
pytree (core.py). `jaxserve quantize --method NAME` looks methods up here; GPTQ and AWQ register
in their own modules.
"""

from __future__ import annotations

from typing import Any, Callable

from jaxserve.quantization.core import QuantSpec
from jaxserve.quantization.rtn import rtn

Method = Callable[[Any, QuantSpec, Any], dict]

METHODS: dict[str, Method] = {"rtn": rtn}


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"quantization method {name!r} is not available in this build "
                         f"(available: {', '.join(sorted(METHODS))})")
    return METHODS[name]
