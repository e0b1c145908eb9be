"""Shared by the reference scripts; runs under the HF reference Python (torch + transformers)."""

import json
import sys

import numpy as np


def load_request() -> dict:
    with open(sys.argv[1]) as f:
        return json.load(f)


def save(arrays: dict, payload: dict | None = None) -> None:
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    arrays["__json__"] = np.asarray(json.dumps(payload or {}))
    with open(sys.argv[2], "wb") as f:
        np.savez(f, **arrays)
