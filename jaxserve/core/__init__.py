"""Host-side engine logic in plain Python and numpy: never imports jax (tests/repo/test_layers.py).

sequence (one request's tokens and status), scheduler (who runs each step), block_manager and
prefix_cache (KV blocks, reference counts, copy-on-write, cached prefixes), request_state and
beam_search (what the engine does with each sampled token), sampling_params, outputs.
"""
