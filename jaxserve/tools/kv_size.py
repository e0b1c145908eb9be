"""KV-cache size arithmetic from a model config: `jaxserve kv-size MODEL --batch B --seq-len S`.

K and V are stored for every layer, token and *KV* head:

    bytes = 2 * B * S * layers * kv_heads * (head_dim * dtype_bytes + scale_bytes)

(scale_bytes: 4 for the int8 cache's float32 scale per token and KV head, else 0.)

The textbook formula `2 * B * S * layers * d_model * p` assumes every query head has its own K
and V (no grouped-query attention, head_dim * heads == d_model); with GQA it overstates the
cache by heads / kv_heads.
"""

from __future__ import annotations

import dataclasses

from models.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1, "int8": 1}
# Bytes per (token, KV head) of K and again of V besides the elements: the int8 cache's float32
# scales (jaxserve/runtime/kv_quant.py SCALE_BYTES; no jax here, so the number is repeated and
# tests/kernels/test_kv_int8.py checks the two agree).
SCALE_BYTES = {"int8": 4}


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    return DTYPE_BYTES[dtype]


def kv_cache_bytes(config: ModelConfig, batch: int, seq_len: int, nbytes: int,
                   scale_bytes: int = 0) -> int:
    return batch * seq_len * config.kv_bytes_per_token(nbytes, scale_bytes)


def textbook_kv_bytes(config: ModelConfig, batch: int, seq_len: int, nbytes: int) -> int:
    return 2 * batch * seq_len * config.num_layers * config.hidden_size * nbytes


@dataclasses.dataclass(frozen=True)
class KVSize:
    batch: int
    seq_len: int
    dtype: str
    bytes_per_token: int
    total_bytes: int
    textbook_bytes: int
    budget: int | None
    fit_contiguous: int | None  # sequences of seq_len that fit the budget, stored densely
    fit_paged: int | None       # with the paged cache: whole blocks, minus the null block
    block_size: int

    def lines(self, config: ModelConfig) -> list[str]:
        c = config
        out = [f"model: {c.num_layers} layers, d_model {c.hidden_size}, {c.num_heads} heads, "
               f"{c.num_kv_heads} KV heads, head_dim {c.head_dim}; dtype {self.dtype}",
               f"per token: 2*{c.num_layers}*{c.num_kv_heads}*{c.head_dim}*"
               f"{DTYPE_BYTES[self.dtype]}"
               + (f" + 2*{c.num_layers}*{c.num_kv_heads}*{SCALE_BYTES[self.dtype]} (scales)"
                  if self.dtype in SCALE_BYTES else "")
               + f" = {self.bytes_per_token:,} bytes",
               f"KV cache for batch {self.batch} x {self.seq_len} tokens: "
               f"{self.total_bytes:,} bytes ({_human(self.total_bytes)})",
               f"textbook 2*B*S*L*d_model*p: {self.textbook_bytes:,} bytes "
               f"({_human(self.textbook_bytes)}), "
               f"{self.textbook_bytes / self.total_bytes:.2f}x the real figure"]
        if self.budget is not None:
            out.append(f"budget {self.budget:,} bytes ({_human(self.budget)}) holds "
                       f"{self.fit_contiguous} sequences of {self.seq_len} tokens "
                       f"({self.fit_paged} in the paged cache with block_size "
                       f"{self.block_size}, null block included)")
        return out


def kv_size(config: ModelConfig, batch: int, seq_len: int, dtype: str = "float16",
            budget: int | None = None, block_size: int = 16) -> KVSize:
    for name, value in (("batch", batch), ("seq_len", seq_len), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if budget is not None and (not isinstance(budget, int) or budget < 0):
        raise ValueError(f"budget is a byte count >= 0, got {budget!r}")
    nbytes, scale_bytes = dtype_bytes(dtype), SCALE_BYTES.get(dtype, 0)
    per_token = config.kv_bytes_per_token(nbytes, scale_bytes)
    fit_contiguous = fit_paged = None
    if budget is not None:
        fit_contiguous = budget // (seq_len * per_token)
        usable_blocks = max(0, budget // (block_size * per_token) - 1)
        fit_paged = usable_blocks // -(-seq_len // block_size)
    return KVSize(batch, seq_len, dtype, per_token,
                  kv_cache_bytes(config, batch, seq_len, nbytes, scale_bytes),
                  textbook_kv_bytes(config, batch, seq_len, nbytes), budget, fit_contiguous,
                  fit_paged, block_size)


def _human(n: int) -> str:
    return f"{n / 1e9:.2f} GB = {n / 2**30:.2f} GiB" if n >= 1e8 else f"{n / 1e6:.2f} MB"
