"""The GPT shape and options, shared by every piece of the model (and by the FLOPs count)."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields

import torch

from megatron_ds.model.moe import MoEConfigError, check_moe_of, experts_per_layer
from megatron_ds.parallel.overlap import MODES as OVERLAP_MODES
from megatron_ds.torch_support import compile_problem


class ModelConfigError(ValueError):
    """A model shape that cannot be built: the message names the flag and the rule, `flag` is the flag to change."""

    def __init__(self, message: str, flag: str | None = None):
        super().__init__(message)
        self.flag = flag


def default_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """4h; swiglu has three matrices, so 2/3 of 4h keeps the MLP's parameter count (Megatron: floor to 64)."""
    return 4 * hidden_size if not swiglu else int(4 * hidden_size * 2 / 3 / 64) * 64


def _need(ok: bool, flag: str | None, message: str) -> None:
    if not ok:
        raise ModelConfigError(message, flag)


def _need_divisible(flag: str, value: int, by_flag: str, by: int, why: str) -> None:
    _need(value % by == 0, flag, f"{flag} {value} must be divisible by {by_flag} {by} ({why}); "
                                 f"{value} is not divisible by {by_flag} {by}")


def check_shape(*, num_layers: int, hidden_size: int, num_attention_heads: int, seq_length: int,
                num_key_value_heads: int | None = None, ffn_hidden_size: int | None = None,
                max_position_embeddings: int | None = None, swiglu: bool = False,
                position_embedding_type: str = "learned_absolute", normalization: str = "LayerNorm",
                rotary_percent: float = 1.0, sequence_parallel: bool = False, torch_compile: bool = False,
                tp: int = 1) -> None:
    """The shape rules that need no vocabulary, at tensor-parallel size tp (None fields take GPTConfig's defaults).

    GPTConfig.validate runs them with the rest; argument validation runs them alone, before the tokenizer
    (and so the padded vocabulary) exists. Raises ModelConfigError naming the flag.
    """
    heads = num_attention_heads
    kv = heads if num_key_value_heads is None else num_key_value_heads
    ffn = default_ffn_hidden_size(hidden_size, swiglu) if ffn_hidden_size is None else ffn_hidden_size
    positions = seq_length if max_position_embeddings is None else max_position_embeddings
    for flag, value in (("--num-layers", num_layers), ("--hidden-size", hidden_size),
                        ("--num-attention-heads", heads), ("--seq-length", seq_length),
                        ("--num-key-value-heads", kv), ("--ffn-hidden-size", ffn)):
        _need(value >= 1, flag, f"{flag} must be >= 1, got {value}")
    tp_flag = "--tensor-model-parallel-size"
    _need_divisible("--hidden-size", hidden_size, "--num-attention-heads", heads,
                    "every attention head has the same width")
    _need_divisible("--num-attention-heads", heads, tp_flag, tp, "each tensor-parallel rank holds whole heads")
    _need(heads % kv == 0, "--num-key-value-heads",
          f"--num-attention-heads {heads} must be divisible by --num-key-value-heads {kv}: grouped-query attention "
          f"shares each key/value head among a whole group of query heads, so --num-key-value-heads must divide "
          f"--num-attention-heads {heads}")
    _need_divisible("--num-key-value-heads", kv, tp_flag, tp,
                    "each tensor-parallel rank holds whole key/value heads")
    _need_divisible("--ffn-hidden-size", ffn, tp_flag, tp, "each tensor-parallel rank holds an equal slice of the MLP")
    _need(not sequence_parallel or seq_length % tp == 0, "--sequence-parallel",
          f"--sequence-parallel needs --seq-length {seq_length} divisible by {tp_flag} {tp}")
    _need(position_embedding_type in ("learned_absolute", "rope"), "--position-embedding-type",
          f"--position-embedding-type must be learned_absolute or rope, got {position_embedding_type!r}")
    head_dim = hidden_size // heads
    _need(position_embedding_type != "rope" or head_dim % 2 == 0, "--position-embedding-type",
          f"rotary embeddings need an even head dim (--hidden-size / --num-attention-heads = {head_dim})")
    rotary = rotary_dim(head_dim, rotary_percent)
    _need(position_embedding_type != "rope" or (rotary >= 2 and rotary % 2 == 0), "--rotary-percent",
          f"--rotary-percent {rotary_percent} of head dim {head_dim} rotates {rotary} dims: an even number >= 2 needed")
    _need(normalization in ("LayerNorm", "RMSNorm"), "--normalization",
          f"--normalization must be LayerNorm or RMSNorm, got {normalization!r}")
    _need(seq_length <= positions, "--seq-length",
          f"--seq-length {seq_length} exceeds --max-position-embeddings {positions}")
    _need(not torch_compile or compile_problem(tp) is None, "--torch-compile", f"--torch-compile {compile_problem(tp)}")


def recompute_of(granularity: str | None, method: str | None, checkpoint_activations: bool = False,
                 recompute_activations: bool = False) -> tuple[str | None, str | None]:
    """Megatron's switches in its recompute terms: --recompute-activations is selective, --checkpoint-activations
    (without a granularity) full and, unless given, uniform."""
    if recompute_activations:
        return "selective", method
    if checkpoint_activations and granularity is None:
        return "full", method or "uniform"
    return granularity, method


def check_recompute(granularity: str | None, method: str | None, num_layers: int) -> None:
    """Activation recompute, Megatron's terms: full (uniform or block) or selective (the core attention only)."""
    _need(granularity in (None, "full", "selective"), "--recompute-granularity",
          f"--recompute-granularity must be full or selective, got {granularity!r}")
    _need(granularity != "full" or method in ("uniform", "block"), "--recompute-granularity",
          "--recompute-granularity full needs --recompute-method uniform or block")
    _need(granularity != "selective" or method is None, "--recompute-method",
          "--recompute-method applies to --recompute-granularity full only (selective recomputes the core "
          "attention of every layer)")
    _need(granularity is not None or method is None, "--recompute-method",
          "--recompute-method needs --recompute-granularity full")
    _need(num_layers >= 1, "--recompute-num-layers", f"--recompute-num-layers must be >= 1, got {num_layers}")


def check_overlap(mode: str | None, torch_compile: bool, sequence_parallel: bool) -> None:
    """--tp-comm-overlap is a schedule the compiler makes (halves also runs eagerly, as the compiled run's twin);
    pipeline and chunked split the sequence-parallel collectives."""
    flag = "--tp-comm-overlap"
    _need(mode in (None, *OVERLAP_MODES), flag, f"{flag} must be one of {', '.join(OVERLAP_MODES)}, got {mode!r}")
    _need(mode in (None, "halves") or torch_compile, flag,
          f"{flag} {mode}: the overlap is scheduled by torch.compile, which is off here (--no-torch-compile, or "
          "eager by default: CPU, ROCm, or a layout mds does not compile); give --torch-compile or drop the flag")
    _need(mode not in ("pipeline", "chunked") or sequence_parallel, flag,
          f"{flag} {mode} splits the sequence-parallel all-gathers and reduce-scatters: it needs "
          "--sequence-parallel (reorder works without)")


SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "num_key_value_heads",
                "ffn_hidden_size", "max_position_embeddings", "swiglu", "position_embedding_type", "normalization",
                "rotary_percent", "sequence_parallel", "torch_compile")


def shape_of(values) -> dict:
    """check_shape's arguments from a GPTConfig or from parsed flags (their names are the same)."""
    return {name: getattr(values, name) for name in SHAPE_FIELDS}


def pad_vocab_size(orig: int, divisible_by: int, tp: int) -> int:
    """Megatron's padding: round up to a multiple of divisible_by x TP so every TP slice is equal."""
    multiple = divisible_by * tp
    return ((orig + multiple - 1) // multiple) * multiple


def rotary_dim(head_dim: int, rotary_percent: float) -> int:
    """Dimensions of each head that rotary embeddings rotate (Megatron: int(head dim x --rotary-percent))."""
    return int(head_dim * rotary_percent)


def _weights(flag: str, default=MISSING):
    """A field that shapes the weights (a checkpoint records it; a load compares it), with the flag that sets it."""
    return field(default=default, metadata={"flag": flag})


@dataclass
class GPTConfig:
    num_layers: int = _weights("--num-layers")
    hidden_size: int = _weights("--hidden-size")
    num_attention_heads: int = _weights("--num-attention-heads")
    vocab_size: int  # already padded (Megatron pads to a multiple of 128 * tp)
    seq_length: int
    max_position_embeddings: int | None = _weights("--max-position-embeddings", None)  # defaults to seq_length
    num_key_value_heads: int | None = _weights("--num-key-value-heads", None)  # GQA; None: = heads (plain MHA)
    ffn_hidden_size: int | None = _weights("--ffn-hidden-size", None)  # None: 4h, or the swiglu rule (__post_init__)
    position_embedding_type: str = _weights("--position-embedding-type", "learned_absolute")  # or "rope"
    rotary_base: int = 10000
    rotary_percent: float = 1.0  # fraction of each head's dims that rotate (the first ones)
    normalization: str = _weights("--normalization", "LayerNorm")  # or "RMSNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = _weights("--swiglu", False)
    openai_gelu: bool = False  # GeLU's tanh approximation (Megatron's --openai-gelu and fused bias-GeLU, GPT-2's)
    add_bias_linear: bool = _weights("--disable-bias-linear", True)
    untie_embeddings_and_output_weights: bool = _weights("--untie-embeddings-and-output-weights", False)
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    attention_backend: str = "auto"  # auto | flash2 | sdpa | reference
    sequence_parallel: bool = False
    # Activation recompute, Megatron's terms: granularity None | "full" | "selective" (core attention only);
    # method for full: "uniform" (every layer, chunks of recompute_num_layers) | "block" (first N of a stage).
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int = 1
    checkpoint_activations: bool = False  # the older switch: = full, uniform
    torch_compile: bool = False  # each TransformerLayer's forward through torch.compile (fused element-wise work)
    tp_comm_overlap: str | None = None  # reorder | pipeline | chunked | wgrad: TP collectives overlap compute
                                        # (overlap.py)
    params_dtype: torch.dtype = torch.float32
    seed: int = 1234
    # Mixture of Experts (Megatron-DeepSpeed's flags; model/moe.py): experts of each expert layer (one number, or
    # one per expert layer), every expert_interval-th layer carries them; the gate's options go to DeepSpeed's MoE.
    num_experts: tuple[int, ...] = (1,)
    expert_interval: int = 2
    moe_expert_parallel_size: int = 1
    topk: int = 1
    moe_loss_coeff: float = 0.1
    moe_train_capacity_factor: float = 1.0
    moe_eval_capacity_factor: float = 1.0
    moe_min_capacity: int = 4
    moe_token_dropping: bool = True
    moe_top2_2nd_expert_sampling: bool = True
    mlp_type: str = "standard"  # residual: PR-MoE's dense MLP beside the experts

    def __post_init__(self) -> None:
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = default_ffn_hidden_size(self.hidden_size, self.swiglu)
        self.recompute_granularity, self.recompute_method = recompute_of(
            self.recompute_granularity, self.recompute_method, self.checkpoint_activations)
        self.num_experts = tuple(self.num_experts)
        self.validate()

    @property
    def experts_per_layer(self) -> list[int]:
        """Experts of each layer, layer 1 first (1: the dense MLP)."""
        return experts_per_layer(self.num_layers, self.num_experts, self.expert_interval)

    @property
    def moe(self) -> bool:
        return max(self.num_experts) > 1

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        return rotary_dim(self.head_dim, self.rotary_percent)

    def validate(self, tp: int = 1) -> None:
        """Raise ModelConfigError naming the flag when this shape cannot run at tensor-parallel size tp."""
        check_shape(**shape_of(self), tp=tp)
        check_recompute(self.recompute_granularity, self.recompute_method, self.recompute_num_layers)
        _need(self.vocab_size >= 1, None, f"--vocab-size must be >= 1, got {self.vocab_size}")
        _need(self.vocab_size % tp == 0, None,
              f"padded vocabulary size {self.vocab_size} must be divisible by --tensor-model-parallel-size {tp}")
        _need(self.attention_backend in ("auto", "flash2", "sdpa", "reference"), "--attention-backend",
              f"attention backend must be auto, flash2, sdpa or reference, got {self.attention_backend!r}")
        _need(self.params_dtype in (torch.float32, torch.bfloat16, torch.float16), None,
              f"params_dtype must be float32, bfloat16 or float16, got {self.params_dtype}")
        check_overlap(self.tp_comm_overlap, self.torch_compile, self.sequence_parallel)
        try:
            check_moe_of(self)
        except MoEConfigError as err:
            raise ModelConfigError(str(err), err.flag) from None

    @property
    def tied_embeddings(self) -> bool:
        return not self.untie_embeddings_and_output_weights

    def forward_flops_per_token(self) -> tuple[float, float]:
        """Forward FLOPs per token of one transformer layer and of the output head (the vocabulary GEMM).

        A matmul of [m, k] x [k, n] is 2mkn FLOPs. Attention scores and values are counted over the
        full sequence (Megatron's convention, causal masking not discounted).
        """
        h, s, d = self.hidden_size, self.seq_length, self.head_dim
        qkv = 2 * h * d * (self.num_attention_heads + 2 * self.num_key_value_heads)
        scores_and_values = 2 * 2 * s * self.num_attention_heads * d
        projection = 2 * h * h
        mlp = 2 * h * self.ffn_hidden_size * (3 if self.swiglu else 2)
        return qkv + scores_and_values + projection + mlp, 2 * h * self.vocab_size

    def flops_per_token(self) -> float:
        """Megatron model FLOPs per trained token: forward + backward (= 3x forward), no recompute. Expert layers
        count the MLPs a token runs (top-k), the gate and, with --mlp-type residual, the dense MLP and its mixing."""
        layer, head = self.forward_flops_per_token()
        return 3.0 * (self.num_layers * layer + head + sum(self._moe_extra(n)[1] for n in self.experts_per_layer))

    def expert_parameters(self) -> int:
        """Parameters of every expert MLP of every MoE layer (0 for a dense model): the part that expert parallelism
        divides over its ranks and whose ZeRO state shards over the expert-data-parallel ranks only."""
        params = self._mlp_sizes()[0]
        return sum(n * params for n in self.experts_per_layer if n > 1)

    def _mlp_sizes(self) -> tuple[int, int]:
        """(parameters, forward FLOPs per token) of one dense MLP."""
        h, f, bias = self.hidden_size, self.ffn_hidden_size, self.add_bias_linear
        mlp_in = f * (2 if self.swiglu else 1)
        return h * mlp_in + f * h + bias * (mlp_in + h), 2 * h * self.ffn_hidden_size * (3 if self.swiglu else 2)

    def _moe_extra(self, experts: int) -> tuple[int, float]:
        """(parameters, forward FLOPs per token) an expert layer of ``experts`` adds to the dense layer."""
        if experts <= 1:
            return 0, 0.0
        h = self.hidden_size
        params, flops = self._mlp_sizes()
        extra_params = (experts - 1) * params + h * experts  # the other experts; the gate (no bias)
        extra_flops = (self.topk - 1) * flops + 2 * h * experts
        if self.mlp_type == "residual":  # the dense MLP beside the experts, and its two mixing coefficients
            extra_params += params + 2 * h + 2
            extra_flops += flops + 2 * h * 2
        return extra_params, extra_flops

    def head_cost_in_layers(self) -> float:
        """The output head's FLOPs in transformer layers: what the last pipeline stage runs on top of its
        layers (parallel/pipeline_split.py)."""
        layer, head = self.forward_flops_per_token()
        return head / layer

    def num_parameters(self, *, include_embeddings: bool = True) -> int:
        """Parameters of the whole (unsharded) model; a tied output head is counted once."""
        h, f, d = self.hidden_size, self.ffn_hidden_size, self.head_dim
        bias = self.add_bias_linear
        norm = h * (2 if self.normalization == "LayerNorm" else 1)
        qkv_out = d * (self.num_attention_heads + 2 * self.num_key_value_heads)
        mlp_in = f * (2 if self.swiglu else 1)
        layer = (2 * norm + h * qkv_out + h * h + h * mlp_in + f * h
                 + bias * (qkv_out + h + mlp_in + h))
        total = self.num_layers * layer + norm + sum(self._moe_extra(n)[0] for n in self.experts_per_layer)
        if include_embeddings:
            total += self.vocab_size * h
            if self.position_embedding_type == "learned_absolute":
                total += self.max_position_embeddings * h
            if not self.tied_embeddings:
                total += self.vocab_size * h
        return total


def weight_flags() -> dict[str, str]:
    """GPTConfig's fields that shape the weights -> the flag that sets each (their `_weights` declaration)."""
    return {f.name: f.metadata["flag"] for f in fields(GPTConfig) if "flag" in f.metadata}
