"""Calibration data for GPTQ and AWQ: token sequences from a user's text file or the built-in text.

The built-in text (calibration_text.py) is written for this project, so calibrating needs no
download and no dataset licence. Sequences are non-overlapping windows of `seq_len` tokens, each
starting with BOS when the tokenizer adds one, so every window looks like the start of a prompt.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

from jaxserve.quantization.calibration_text import CALIBRATION_TEXT

DEFAULT_SEQ_LEN = 128
DEFAULT_MAX_SEQS = 32


@dataclasses.dataclass(frozen=True, eq=False)
class Calibration:
    """Token windows `tokens [S, T]` (int32) and where they came from (for logs and reports)."""

    tokens: np.ndarray
    source: str

    def __post_init__(self):
        if self.tokens.ndim != 2 or self.tokens.size == 0:
            raise ValueError(f"calibration tokens must be a non-empty [S, T] array, got shape "
                             f"{self.tokens.shape}")

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.size)


def windows(ids, seq_len: int, max_seqs: int | None = None, bos: int | None = None) -> np.ndarray:
    """Non-overlapping windows [S, seq_len] of `ids` (BOS first in each when given)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    body = seq_len - (bos is not None)
    ids = np.asarray(ids, np.int32)
    count = ids.size // body
    if max_seqs is not None:
        count = min(count, max_seqs)
    if count == 0:
        raise ValueError(f"the text has {ids.size} tokens: fewer than one window of {seq_len}; "
                         "give a longer text or a smaller seq_len")
    out = ids[:count * body].reshape(count, body)  # [S, T - bos]
    if bos is not None:
        out = np.concatenate([np.full((count, 1), bos, np.int32), out], axis=1)  # [S, T]
    return out


def from_text(tokenizer, text: str, seq_len: int = DEFAULT_SEQ_LEN,
              max_seqs: int | None = DEFAULT_MAX_SEQS, source: str = "text") -> Calibration:
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: pass Calibration(tokens=...) directly")
    bos = tokenizer.bos_token_id if tokenizer.add_bos else None
    return Calibration(windows(tokenizer.encode(text), seq_len, max_seqs, bos), source)


def load_calibration(model, path: str | pathlib.Path | None = None,
                     seq_len: int = DEFAULT_SEQ_LEN,
                     max_seqs: int | None = DEFAULT_MAX_SEQS) -> Calibration:
    """Calibration windows from the UTF-8 text file at `path`, or from the built-in text."""
    if path is None:
        return from_text(model.tokenizer, CALIBRATION_TEXT, seq_len, max_seqs, "built-in text")
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"calibration file {str(path)!r} does not exist")
    return from_text(model.tokenizer, path.read_text(encoding="utf-8"), seq_len, max_seqs,
                     str(path))


def random_calibration(vocab_size: int, num_seqs: int = 8, seq_len: int = 32,
                       seed: int = 0) -> Calibration:
    """Uniform random token windows: for tests on tokenizer-less random models."""
    rng = np.random.default_rng(seed)
    return Calibration(rng.integers(0, vocab_size, (num_seqs, seq_len), dtype=np.int32),
                       f"random(seed={seed})")
