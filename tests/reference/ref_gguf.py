"""HF transformers' own GGUF loading, as the reference for models/gguf_loader.py.

Request: {"files": [{"path": str, "tensors": "all" | [names], "rows": {name: [row, ...]}}]}.
Writes arrays "<i>/<name>" (fp32 state-dict tensors, or only the listed rows of a big one) and JSON
{"files": [{"shapes": {name: shape}, "config": {...}}]}.
"""

import os

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from common import load_request, save


def main():
    req = load_request()
    arrays, files = {}, []
    for i, spec in enumerate(req["files"]):
        path = spec["path"]
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
        state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
        wanted = list(state) if spec.get("tensors", "all") == "all" else spec["tensors"]
        for name in wanted:
            arrays[f"{i}/{name}"] = state[name]
        for name, rows in spec.get("rows", {}).items():
            arrays[f"{i}/{name}@rows"] = state[name][np.asarray(rows)]
        c = model.config
        rope = getattr(c, "rope_parameters", None) or {}
        files.append({
            "shapes": {k: list(v.shape) for k, v in state.items()},
            "config": {
                "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size,
                "num_layers": c.num_hidden_layers, "num_heads": c.num_attention_heads,
                "num_kv_heads": c.num_key_value_heads, "head_dim": getattr(c, "head_dim", None),
                "rms_norm_eps": c.rms_norm_eps,
                "rope_theta": rope.get("rope_theta", getattr(c, "rope_theta", None)),
                "max_position_embeddings": c.max_position_embeddings,
                "tie_word_embeddings": bool(c.tie_word_embeddings),
                "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id,
            },
        })
    save(arrays, {"files": files})


if __name__ == "__main__":
    main()
