"""Loads each model file named on stdin and prints what happened, one JSON line per file.

Run by tests/modeling/test_malformed_models.py in a child process under an address-space cap
(RLIMIT_AS, set by the parent before this starts): a loader that tries a huge allocation gets a
MemoryError here instead of swapping the machine, a crash shows as the child's exit status,
and a hang as its timeout. Input: JSON list of {"kind": "gguf" | "hf" | "config", "path"}.
"""

from __future__ import annotations

import json
import sys
import traceback


def load(kind: str, path: str) -> str:
    if kind == "gguf":
        from models.gguf_loader import read_gguf
        read_gguf(path)
    elif kind == "hf":
        from models.hf_loader import read_hf_checkpoint
        read_hf_checkpoint(path)
    else:
        from models.config_io import load_config
        load_config(path)
    return "loaded"


def main() -> int:
    for case in json.load(sys.stdin):
        try:
            load(case["kind"], case["path"])
            row = {"outcome": "loaded"}
        except Exception as e:  # noqa: BLE001 - classifying every failure is the point
            row = {"outcome": "error", "type": type(e).__name__,
                   "mro": [c.__name__ for c in type(e).__mro__], "message": str(e)[:2000],
                   "where": traceback.format_exc(limit=-2)[-600:]}
        print(json.dumps({**case, **row}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
