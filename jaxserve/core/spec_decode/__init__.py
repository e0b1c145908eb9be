"""Speculative decoding, host side (no jax): the config, the n-gram proposer, verification of a
row's sampled tokens against its drafts, and the acceptance bookkeeping (docs/speculative.md)."""
