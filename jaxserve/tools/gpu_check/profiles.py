"""What the GPU check runs: the GPU profile (H200 sizes) and the tiny CPU dry-run profile, the
model configurations each uses, and the H200's nominal figures the measurements are held to."""

from __future__ import annotations

import dataclasses

from pallas_kernels.cases import ATTENTION_MODELS, INT4_MODEL_SHAPES


# B/s: H200 device copy bandwidth, as measured on the H200 machine (docs/peers.md)
NOMINAL_BW = 4.3e12
NOMINAL_BF16_FLOPS = 790e12  # FLOP/s, H200 dense bf16 (docs/peers.md)
L2_BYTES = 50 * 2**20        # H200 L2; timed inputs cycle through > 2x this so reads hit HBM
TOKEN_LOW = 100              # random prompt ids start here (skips special tokens)
# Default --time-budget on a GPU: with jax's start (~15 s), the bundle and the watchdog's grace
# (WATCHDOG_GRACE_S) the command ends inside 8 minutes, so `timeout_s=540` leaves a margin.
GPU_BUDGET_S = 380.0
DRY_BUDGET_S = 1200.0        # a CPU dry run is not on the clock; interpreted kernels are slow
# Past budget + this, a watchdog thread writes the report and the bundle from what finished and
# exits, even while the main thread is stuck inside a compile (no Python-level check reaches it).
WATCHDOG_GRACE_S = 60.0
SECTION_GRACE_S = 15.0       # a section overrunning its cap by this is interrupted


def model_configs(dry: bool) -> dict:
    from models.config import ModelConfig, RopeScaling
    if dry:  # same head layouts (K, G, Dh) as the real models, tiny widths and depths
        return {
            "llama3_8b": ModelConfig(vocab_size=512, hidden_size=512, intermediate_size=256,
                                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128,
                                     max_position_embeddings=256),
            "smollm2": ModelConfig(vocab_size=512, hidden_size=576, intermediate_size=256,
                                   num_layers=2, num_heads=9, num_kv_heads=3, head_dim=64,
                                   tie_word_embeddings=True, max_position_embeddings=256)}
    return {
        "llama3_8b": ModelConfig(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
            num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
            rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=8192),
            max_position_embeddings=8192, bos_token_id=128000, eos_token_ids=(128009,)),
        "smollm2": ModelConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
            num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
            max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
            eos_token_ids=(2,))}


ATTN_HEADS = {m: heads[:3] for m, heads in ATTENTION_MODELS.items()}  # (K, G, Dh)
INT4_SHAPES = INT4_MODEL_SHAPES


@dataclasses.dataclass(frozen=True)
class Profile:
    interpret: bool
    backend: str                 # engine attention/linear backend
    attn_cases: tuple            # (model, block_size, batch)
    max_context: int
    int4_cases: tuple            # (model, K, N, M)
    iters: int                   # calls per timing sample
    reps: int                    # samples; the median is reported
    copy_bytes: int
    matmul_n: int
    max_layers: int              # timed attention caches cycle through up to this many layers
    max_copies: int              # timed int4/dense weights cycle through up to this many copies
    e2e_batches: tuple
    # Engine variants per model, in order: (quantization or None for bf16, backend for both
    # attention and linears). The Pallas engine beside the XLA one is the end-to-end baseline.
    e2e_variants: tuple
    e2e_variants_8b: tuple
    prompt_len: int
    new_tokens: int
    max_model_len: int
    block_size: int = 16
    # Ragged steps (model, block_size, max_context, decode rows): one mixed step each.
    ragged_cases: tuple = ()
    # Checked only: (model, block_size, max_context, decode rows, dtype, min cache GiB).
    ragged_extra_cases: tuple = ()
    # Multi-LoRA (SGMV) kernel, checked and timed: (model, K, N, tokens, slots, rank), bf16.
    lora_cases: tuple = ()
    # MoE grouped matmul, timed: (model, experts E, K, N, tokens, top_k), bf16 activations.
    gmm_cases: tuple = ()
    defaults_prompts: int = 4    # plain LLM() run: prompts of prompt_len, new_tokens each
    # (section, seconds): a section starts only with this much budget left (8B init + compiles).
    section_min_s: tuple = ()
    # (section, seconds): a section's own cap. Its loops stop starting work at it; past it plus
    # SECTION_GRACE_S the driver interrupts the section (SIGALRM) and records what it had.
    section_cap_s: tuple = ()
    variant_min_s: float = 0.0   # an engine variant (bf16, int4) starts only with this left
    trace_batch: int = 64        # decode_trace: rows decoding while the profiler runs
    trace_steps: int = 6         # decode_trace: warm decode steps traced
    launch_chain: tuple = (16, 128)  # launch_floor: tiny dependent kernels per jitted chain


GPU_PROFILE = Profile(
    interpret=False, backend="pallas",
    attn_cases=tuple((mo, bs, b) for mo in ATTN_HEADS for bs in (16, 32) for b in (1, 64)),
    max_context=4096,
    int4_cases=tuple((mo, k, n, m) for mo, shapes in INT4_SHAPES.items() for k, n in shapes
                     for m in (1, 64)),
    iters=20, reps=7, copy_bytes=2 << 30, matmul_n=8192, max_layers=32, max_copies=64,
    e2e_batches=(1, 64), prompt_len=136, new_tokens=64,
    # "pallas": the kernels on Mosaic GPU (gpu_kernels auto on an H200); "pallas/triton": the
    # same engine with them on Triton, side by side; "/unfused": without the fused linears.
    e2e_variants=((None, "pallas"), (None, "pallas/triton"), (None, "pallas/triton/unfused"),
                  (None, "xla"), ("int4", "pallas"), ("int4", "pallas/triton"),
                  ("int4", "xla")),
    e2e_variants_8b=((None, "pallas"), ("int4", "pallas"), (None, "pallas/triton"),
                     (None, "pallas/triton/unfused"), ("int4", "pallas/triton"),
                     (None, "xla"), ("int4", "xla")),
    max_model_len=256, ragged_cases=(("llama3_8b", 16, 2048, 48),),
    ragged_extra_cases=(("smollm2", 16, 1024, 8, "float32", 0.0),
                        ("llama3_8b", 16, 2048, 8, "bfloat16", 4.5)),
    # SmolLM2's up projection at a decode batch and a 256-token step; an 8B MLP projection.
    lora_cases=(("smollm2", 576, 1536, 16, 4, 16), ("smollm2", 576, 1536, 256, 4, 16),
                ("llama3_8b", 4096, 14336, 256, 4, 16)),
    # OLMoE's gate/up projection (64 experts, D 2048 -> F 1024, top-8) at a decode batch of 16
    # tokens (128 rows) and a 512-token prefill chunk (4096 rows).
    gmm_cases=(("olmoe", 64, 2048, 1024, 16, 8), ("olmoe", 64, 2048, 1024, 512, 8)),
    # llm_defaults warms up every bucket (its construct_s is that start-up cost).
    section_min_s=(("e2e_llama3_8b", 90.0), ("llm_defaults", 60.0), ("hf_peer", 20.0)),
    # Kernel work first and bounded, so the engine sections keep most of the budget.
    # The caps before the 8B model sum to 290 s of the 380: it keeps its 90 s at worst.
    section_cap_s=(("bandwidth", 20.0), ("kernel_correctness", 50.0), ("kernel_tests", 60.0),
                   ("kernel_timings", 45.0), ("launch_floor", 15.0), ("e2e_smollm2", 75.0),
                   ("decode_trace", 25.0), ("e2e_llama3_8b", 110.0), ("llm_defaults", 60.0),
                   ("hf_peer", 30.0)),
    variant_min_s=20.0)

# CPU: the same code paths through the Pallas interpreter, each at a fraction of a second of
# work. Cases cover both head layouts, both block sizes, the split (batch 1) and batched paths;
# compile time, not run time, is what costs here, so the grids are not cross products.
DRY_PROFILE = Profile(
    interpret=True, backend="pallas-interpret",
    attn_cases=(("smollm2", 16, 4), ("llama3_8b", 32, 1)), max_context=64,
    int4_cases=(("smollm2", 128, 256, 1), ("llama3_8b", 256, 128, 4)),
    iters=2, reps=2, copy_bytes=8 << 20, matmul_n=256, max_layers=2, max_copies=2,
    e2e_batches=(2,), prompt_len=20, new_tokens=6,
    # Each path once: the Pallas and the XLA engine in bf16, int4 weights through the kernel.
    e2e_variants=((None, "pallas-interpret"), (None, "xla")),
    e2e_variants_8b=(("int4", "pallas-interpret"),),
    max_model_len=64, ragged_cases=(("smollm2", 16, 64, 4),),
    # The large-cache case at a few MiB: the same code path; the > 4 GiB indexing itself is
    # compiled deviceless in tests/kernels/test_ragged_paged_attention.py.
    ragged_extra_cases=(("smollm2", 16, 64, 2, "float32", 0.0),
                        ("llama3_8b", 16, 64, 2, "bfloat16", 1 / 256)),
    lora_cases=(("smollm2", 576, 192, 8, 3, 8),),
    # 4 tokens' top-2 of 8 experts (8 rows): Mosaic's 8-row items, two 64-column blocks and
    # two K steps; int8 and bf16, each kernel in a second or so interpreted.
    gmm_cases=(("olmoe", 8, 128, 128, 4, 2),),
    defaults_prompts=2, trace_batch=2, trace_steps=3, launch_chain=(4, 16),
    section_cap_s=(("kernel_tests", 60.0),))
