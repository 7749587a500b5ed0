"""The GPT shape and options, shared by every piece of the model (and by the FLOPs count)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ds.torch_support import compile_problem


class ModelConfigError(ValueError):
    """A model shape that cannot be built (the message names the flag and the rule)."""


@dataclass
class GPTConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int  # already padded (Megatron pads to a multiple of 128 * tp)
    seq_length: int
    max_position_embeddings: int | None = None  # defaults to seq_length
    num_key_value_heads: int | None = None  # GQA; None means = num_attention_heads (plain MHA)
    ffn_hidden_size: int | None = None  # None: 4h, or Megatron's LLaMA rule for swiglu (see __post_init__)
    position_embedding_type: str = "learned_absolute"  # or "rope"
    rotary_base: int = 10000
    normalization: str = "LayerNorm"  # or "RMSNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    add_bias_linear: bool = True
    untie_embeddings_and_output_weights: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    attention_backend: str = "auto"  # auto | flash2 | sdpa | reference
    sequence_parallel: bool = False
    checkpoint_activations: bool = False
    torch_compile: bool = False  # each TransformerLayer's forward through torch.compile (fused element-wise work)
    params_dtype: torch.dtype = torch.float32
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.ffn_hidden_size is None:
            # swiglu has three matrices; 2/3 of 4h keeps the MLP's parameter count (Megatron: floor to 64).
            self.ffn_hidden_size = (4 * self.hidden_size if not self.swiglu
                                    else int(4 * self.hidden_size * 2 / 3 / 64) * 64)
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def validate(self, tp: int = 1) -> None:
        """Raise ModelConfigError naming the flag when this shape cannot run at tensor-parallel size tp."""
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ModelConfigError(message)

        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length",
                     "num_key_value_heads", "ffn_hidden_size"):
            need(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        need(self.hidden_size % self.num_attention_heads == 0,
             f"--hidden-size {self.hidden_size} must be divisible by --num-attention-heads {self.num_attention_heads}")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             f"--num-attention-heads {self.num_attention_heads} must be divisible by "
             f"--num-key-value-heads {self.num_key_value_heads}")
        need(self.position_embedding_type in ("learned_absolute", "rope"),
             f"--position-embedding-type must be learned_absolute or rope, got {self.position_embedding_type!r}")
        need(self.position_embedding_type != "rope" or self.head_dim % 2 == 0,
             f"rotary embeddings need an even head dim (--hidden-size / --num-attention-heads = {self.head_dim})")
        need(self.normalization in ("LayerNorm", "RMSNorm"),
             f"--normalization must be LayerNorm or RMSNorm, got {self.normalization!r}")
        need(self.attention_backend in ("auto", "flash2", "sdpa", "reference"),
             f"attention backend must be auto, flash2, sdpa or reference, got {self.attention_backend!r}")
        need(self.max_position_embeddings >= self.seq_length,
             f"--max-position-embeddings {self.max_position_embeddings} must be >= --seq-length {self.seq_length}")
        need(self.params_dtype in (torch.float32, torch.bfloat16, torch.float16),
             f"params_dtype must be float32, bfloat16 or float16, got {self.params_dtype}")
        tp_flag = f"--tensor-model-parallel-size {tp}"
        need(self.num_attention_heads % tp == 0,
             f"--num-attention-heads {self.num_attention_heads} must be divisible by {tp_flag}")
        need(self.num_key_value_heads % tp == 0,
             f"--num-key-value-heads {self.num_key_value_heads} must be divisible by {tp_flag}")
        need(self.ffn_hidden_size % tp == 0,
             f"--ffn-hidden-size {self.ffn_hidden_size} must be divisible by {tp_flag}")
        need(self.vocab_size % tp == 0,
             f"padded vocabulary size {self.vocab_size} must be divisible by {tp_flag}")
        need(not self.sequence_parallel or self.seq_length % tp == 0,
             f"--sequence-parallel needs --seq-length {self.seq_length} divisible by {tp_flag}")
        need(not self.torch_compile or compile_problem(tp) is None, f"--torch-compile {compile_problem(tp)}")

    @property
    def tied_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    def flops_per_token(self) -> float:
        """Megatron model FLOPs per trained token: forward + backward (= 3x forward), no recompute.

        A matmul of [m, k] x [k, n] is 2mkn FLOPs. Attention scores and values are counted over the
        full sequence (Megatron's convention, causal masking not discounted).
        """
        h, s, d = self.hidden_size, self.seq_length, self.head_dim
        qkv = 2 * h * d * (self.num_attention_heads + 2 * self.num_key_value_heads)
        scores_and_values = 2 * 2 * s * self.num_attention_heads * d
        projection = 2 * h * h
        mlp = 2 * h * self.ffn_hidden_size * (3 if self.swiglu else 2)
        logits = 2 * h * self.vocab_size
        forward = self.num_layers * (qkv + scores_and_values + projection + mlp) + logits
        return 3.0 * forward

    def num_parameters(self, *, include_embeddings: bool = True) -> int:
        """Parameters of the whole (unsharded) model; a tied output head is counted once."""
        h, f, d = self.hidden_size, self.ffn_hidden_size, self.head_dim
        bias = self.add_bias_linear
        norm = h * (2 if self.normalization == "LayerNorm" else 1)
        qkv_out = d * (self.num_attention_heads + 2 * self.num_key_value_heads)
        mlp_in = f * (2 if self.swiglu else 1)
        layer = (2 * norm + h * qkv_out + h * h + h * mlp_in + f * h
                 + bias * (qkv_out + h + mlp_in + h))
        total = self.num_layers * layer + norm
        if include_embeddings:
            total += self.vocab_size * h
            if self.position_embedding_type == "learned_absolute":
                total += self.max_position_embeddings * h
            if not self.tied_embeddings:
                total += self.vocab_size * h
        return total
