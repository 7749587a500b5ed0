"""Named model sizes for `--preset`: the shapes users already know by name.

Sources (facts, not code): the GPT-3 paper (Brown et al. 2020, table 2.1) for the GPT-3 family, the
ALCF Megatron-DeepSpeed helper scripts (`ALCF/model.sh`, keyed by MODEL_SIZE_KEY) for GPT1_5B, GPT25B,
GPT30B, GPT33B and GPT145B, and the LLaMA / Llama 2 papers for the LLAMA_* sizes.
Where the two GPT sources disagree we keep head dimensions the kernels like (64..128):
GPT1_3B uses 16 heads (head dim 128) as Megatron's examples do, GPT13B uses 5120 hidden / 40 heads.
ALCF's GPT25B is 64 layers x 6144 hidden x 64 heads (their script's active setting; ~29B parameters
with a 50k vocabulary, i.e. the same shape as their GPT30B). Explicit flags always win over a preset.
"""

from __future__ import annotations

# Fields are argparse destinations; anything not listed keeps its flag/default value.
_GPT = dict(seq_length=2048, max_position_embeddings=2048)
_LLAMA = dict(
    normalization="RMSNorm",
    swiglu=True,
    position_embedding_type="rope",
    untie_embeddings_and_output_weights=True,
    disable_bias_linear=True,
)


def _gpt(layers: int, hidden: int, heads: int) -> dict:
    return dict(_GPT, num_layers=layers, hidden_size=hidden, num_attention_heads=heads)


def _llama(layers: int, hidden: int, heads: int, ffn: int, kv_heads: int | None, seq: int) -> dict:
    shape = dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=ffn)
    if kv_heads is not None:
        shape["num_key_value_heads"] = kv_heads
    return dict(_LLAMA, seq_length=seq, max_position_embeddings=seq, **shape)


PRESETS: dict[str, dict] = {
    # GPT-3 family (paper).
    "GPT125M": _gpt(12, 768, 12),
    "GPT350M": _gpt(24, 1024, 16),
    "GPT760M": _gpt(24, 1536, 16),
    "GPT1_3B": _gpt(24, 2048, 16),
    "GPT2_7B": _gpt(32, 2560, 32),
    "GPT6_7B": _gpt(32, 4096, 32),
    "GPT13B": _gpt(40, 5120, 40),
    "GPT175B": _gpt(96, 12288, 96),
    # ALCF helper-script sizes.
    "GPT1_5B": _gpt(48, 1536, 24),
    "GPT25B": _gpt(64, 6144, 64),
    "GPT30B": _gpt(64, 6144, 64),
    "GPT33B": _gpt(80, 6144, 64),
    "GPT145B": _gpt(80, 12288, 96),
    # LLaMA (7B/13B as Llama 2 with 4k context; 70B with grouped-query attention, 8 KV heads).
    "LLAMA_7B": _llama(32, 4096, 32, 11008, None, 4096),
    "LLAMA_13B": _llama(40, 5120, 40, 13824, None, 4096),
    "LLAMA_70B": _llama(80, 8192, 64, 28672, 8, 4096),
    # Tiny sizes for tests and the demo (CPU-friendly).
    "TINY": dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, max_position_embeddings=64),
    "GPT_TINY": dict(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128, max_position_embeddings=128),
    "LLAMA_TINY": _llama(2, 64, 4, 176, 2, 64),
}


def preset(name: str) -> dict:
    """The flag values of preset `name` (case-insensitive); KeyError lists the known names."""
    for key, values in PRESETS.items():
        if key.lower() == name.lower():
            return dict(values)
    raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
