"""Tiny models and fixed inputs shared by the tests and the scripts: a random Llama of a few
shapes (tiny_models), the same with a real BPE tokenizer and chat template (tiny_chat), the
engine the engine-state views are measured on (engine_state), and the structured-output test
schemas (structured_schemas). Nothing here runs on import; the real model is never loaded.
Helpers only the tests use stay in tests/."""
