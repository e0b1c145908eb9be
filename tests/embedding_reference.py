"""The HF reference that embedding tests share (tests/reference/ref_embeddings_hf.py).

A tiny random Llama of the tiny chat model's shapes (jaxserve/testing/tiny_models.py TINY_CHAT),
made and saved by transformers, and its final hidden states (after the final norm) for a fixed
set of prompts: the tiny tokenizer's encodings of TEXTS, then ID_PROMPTS. Every test calling
`embedding_reference()` gets the same cached result, so torch runs once per change of the
request or script. `hf_embedding` pools them as the engine should (numpy, float64).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib

import numpy as np

from hf_reference import run_reference
from jaxserve.testing.tiny_chat import tiny_tokenizer
from jaxserve.testing.tiny_models import TINY_CHAT

MAX_MODEL_LEN = 256
CONFIG = dict(vocab_size=TINY_CHAT.vocab_size, hidden_size=TINY_CHAT.hidden_size,
              intermediate_size=TINY_CHAT.intermediate_size,
              num_hidden_layers=TINY_CHAT.num_layers, num_attention_heads=TINY_CHAT.num_heads,
              num_key_value_heads=TINY_CHAT.num_kv_heads, head_dim=TINY_CHAT.head_dim,
              max_position_embeddings=TINY_CHAT.max_position_embeddings, rms_norm_eps=1e-5,
              rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=None,
              eos_token_id=0)
TEXTS = ["The capital of France is Paris.", "Hello! How are you today?", "1, 2, 3",
         "Once upon a time there was a quick brown fox. " * 4]
LONG = [(7 * i) % 250 + 3 for i in range(130)]  # chunked: longer than a step's token budget
ID_PROMPTS = [[5, 17, 42, 3, 200, 7, 7, 7, 1], [9], LONG,
              LONG[:96] + [11, 12, 13, 14, 15],  # shares six 16-token blocks with LONG
              [(11 * i) % 251 + 2 for i in range(MAX_MODEL_LEN)]]  # exactly max_model_len


@functools.cache
def text_ids() -> list[list[int]]:
    tok = tiny_tokenizer()
    return [tok.encode(t) for t in TEXTS]


def all_prompts() -> list[list[int]]:
    return text_ids() + ID_PROMPTS


@dataclasses.dataclass(frozen=True)
class EmbeddingReference:
    model_dir: pathlib.Path
    hidden: list[np.ndarray]  # per prompt of all_prompts(): float32 [n, D]

    def of(self, ids: list[int]) -> np.ndarray:
        return self.hidden[all_prompts().index(list(ids))]


@functools.cache
def embedding_reference() -> EmbeddingReference:
    prompts = all_prompts()
    result = run_reference("ref_embeddings_hf", {"config": CONFIG, "seed": 7,
                                                 "prompts": prompts})
    return EmbeddingReference(result["workdir"] / "model",
                              [result[f"hidden/{i}"] for i in range(len(prompts))])


def hf_embedding(hidden: np.ndarray, pooling: str, normalize: bool = True) -> np.ndarray:
    """hidden [n, D] -> the embedding [D]: the last token's or the mean, L2-normalised."""
    h = hidden.astype(np.float64)
    v = h[-1] if pooling == "last" else h.mean(axis=0)
    return v / np.linalg.norm(v) if normalize else v


def load_tiny_chat(dtype: str = "float32"):
    """The reference's saved model, with the tiny chat tokenizer (as the server tests use)."""
    from models import load_model
    model = load_model(embedding_reference().model_dir, dtype=dtype)
    return dataclasses.replace(model, tokenizer=tiny_tokenizer(), source="tiny-chat-hf")
