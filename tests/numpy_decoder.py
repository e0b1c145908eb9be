"""A brute-force numpy decoder over a Flax params tree: the reference for features whose HF
model is not at hand in a dense form (the whole-projection q/k norm of OLMoE is inside a MoE).

Written from the papers' equations, not from models/llama.py: float64, one loop per layer,
plain RoPE (rotate-half), softmax over the causal mask.
"""

import numpy as np


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, theta):  # x [T, N, Dh]
    t, _, dh = x.shape
    inv = 1.0 / theta ** (np.arange(0, dh, 2) / dh)  # [Dh/2]
    ang = np.arange(t)[:, None] * inv  # [T, Dh/2]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., :dh // 2], x[..., dh // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _attention(h, p, c):
    t = h.shape[0]
    q = h @ p["attn"]["q_proj"]["kernel"]  # [T, H * Dh]
    k = h @ p["attn"]["k_proj"]["kernel"]  # [T, K * Dh]
    v = (h @ p["attn"]["v_proj"]["kernel"]).reshape(t, c.num_kv_heads, c.head_dim)
    if c.qk_norm == "full":
        q = _rms(q, p["attn"]["q_norm"]["scale"], c.rms_norm_eps)
        k = _rms(k, p["attn"]["k_norm"]["scale"], c.rms_norm_eps)
    q, k = q.reshape(t, c.num_heads, c.head_dim), k.reshape(t, c.num_kv_heads, c.head_dim)
    if c.qk_norm == "per_head":
        q = _rms(q, p["attn"]["q_norm"]["scale"], c.rms_norm_eps)
        k = _rms(k, p["attn"]["k_norm"]["scale"], c.rms_norm_eps)
    q, k = _rope(q, c.rope_theta), _rope(k, c.rope_theta)
    g = c.num_heads // c.num_kv_heads
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)  # [T, H, Dh]
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(c.head_dim)
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("hts,shd->thd", probs, v).reshape(t, -1)
    return out @ p["attn"]["o_proj"]["kernel"]


def forward(params, config, ids) -> np.ndarray:
    """Logits `[T, V]` (float64) of the causal decoder `config` with `params` over `ids`."""
    import jax
    params = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    c = config
    x = params["embedding"][np.asarray(ids)]  # [T, D]
    for i in range(c.num_layers):
        p = jax.tree.map(lambda a: a[i], params["layers"])
        x = x + _attention(_rms(x, p["input_norm"]["scale"], c.rms_norm_eps), p, c)
        h = _rms(x, p["post_norm"]["scale"], c.rms_norm_eps)
        gate, up = h @ p["mlp"]["gate_proj"]["kernel"], h @ p["mlp"]["up_proj"]["kernel"]
        x = x + (gate / (1 + np.exp(-gate)) * up) @ p["mlp"]["down_proj"]["kernel"]
    x = _rms(x, params["final_norm"]["scale"], c.rms_norm_eps)
    head = params["embedding"].T if c.tie_word_embeddings else params["lm_head"]["kernel"]
    return x @ head
