"""The GPT, top to bottom: norms, rotary embeddings, attention, MLP, transformer layer, the pipeline
pieces (EmbeddingStage, TransformerLayer, FinalNorm, OutputHead) and GPTModel composed of them.

GPT-2 style: learned positions, LayerNorm, GeLU, tied input/output embeddings, biases.
LLaMA style: rope, RMSNorm, SwiGLU, grouped-query attention, untied output, no biases.

Layout: activations between pieces are ONE tensor [s, b, h] (sequence first, as Megatron), or
[s/tp, b, h] sequence shards when ``config.sequence_parallel``; that is what pipeline stages send.
Tokens and labels are [b, s]. Logits are this rank's vocabulary slice [s, b, V/tp]; labels go to
``lm_loss``, never through the stages.

The model depends only on its arguments: the tensor-parallel process group is passed in
(``GPTModel(config, tp_group=...)``, ``gpt_stage_specs(config, tp_group=...)``, ``lm_loss(logits,
labels, group)``) and handed down to every piece; None means TP=1, so no process group is needed.
Nothing here reads a global parallel state. Each weight is drawn from a generator seeded by
(config.seed, layer number, name) on the full matrix and then sliced, so TP=N and PP=N build the
same model as one process does. Modules are built in ``config.params_dtype``, on the CPU (their drawn
weights on the GPU inside ``weights_drawn_on``); ``.to(device)`` gathers the rest (deepspeed.initialize does).

For the training loop:
- Sequence parallelism needs no call after backward: weights replicated over TP but used on
  sequence shards (norms, row-parallel biases, learned positions; marked ``sequence_parallel``)
  get their gradient summed over TP inside backward (``tp_replicated``), so any ZeRO stage works.
- Seed the default RNG identically on the TP ranks (Megatron: seed + 100 * pp_rank): hidden
  dropout on replicated activations must draw the same mask there. Under SP each rank keeps its
  rows of the full-sequence mask; attention dropout (on this rank's heads) draws from a per-rank
  stream derived from the shared one. Both replay under activation checkpointing.
- Logits stay in the params dtype; the loss is computed in fp32 chunk by chunk (no full fp32 copy).

DeepSpeed-Ulysses (``GPTModel(config, sp_group=...)``, TP = PP = 1): tokens and labels are this rank's
contiguous slice [b, s/sp] of the sequence, activations [s/sp, b, h]; positions (learned and rotary)
are those of the slice (offset sp_rank * s/sp); attention runs through ``attention.ulysses_attention``. Hidden
dropout keeps this slice's rows of the full-sequence mask (the single-process mask, as under SP);
attention dropout, on this rank's heads after the all-to-all, draws from a per-SP-rank stream. The
per-token loss comes back for the FULL sequence [b, s] on every SP rank (an all-gather whose backward
keeps this rank's slice), so its mean is the full-sequence mean, and each rank's backward carries
exactly its own tokens' share: DeepSpeed then sums gradients over SP and averages over DP.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_ds.model.attention import CoreAttention, check_ulysses_heads, ulysses_attention
from megatron_ds.model.compiled import CompiledForward
from megatron_ds.model.config import GPTConfig
from megatron_ds.model.moe import MoEStats
from megatron_ds.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_ds.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    seeded_normal,
    sequence_parallel_dropout,
    tp_replicated,
)
from megatron_ds.parallel.mappings import (
    all_gather_sequence,
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_sequence,
    tp_rank,
    tp_size,
)
from megatron_ds.parallel.overlap import inductor_options, prepare_group
from megatron_ds.parallel.random import tp_rank_rng


def _checked(config: GPTConfig, tp_group):
    """``tp_group`` after checking that the shape splits over its size (None: TP=1)."""
    config.validate(tp_size(tp_group))
    return tp_group


def _init(config: GPTConfig, layer_number: int, name: str, *, scaled: bool = False):
    """N(0, init_method_std), divided by sqrt(2 * num_layers) for the projections that feed the
    residual stream (attention output, MLP output), as Megatron's scaled_init_method_normal."""
    std = config.init_method_std / (math.sqrt(2.0 * config.num_layers) if scaled else 1.0)
    return seeded_normal(std, config.seed, layer_number, name)


class Norm(nn.Module):
    """LayerNorm or RMSNorm over the hidden dim; replicated over TP.

    Under sequence parallelism each rank normalises its own sequence shard, so the weight's
    gradient is a partial sum: ``tp_replicated`` all-reduces it over TP during backward, and the
    parameters carry ``sequence_parallel=True``.
    """

    def __init__(self, config: GPTConfig, group):
        super().__init__()
        self.group, self.sequence_parallel = group, config.sequence_parallel
        self.rms, self.eps = config.normalization == "RMSNorm", config.norm_epsilon
        h, dtype = config.hidden_size, config.params_dtype
        self.weight = nn.Parameter(torch.ones(h, dtype=dtype))
        self.bias = None if self.rms else nn.Parameter(torch.zeros(h, dtype=dtype))
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = tp_replicated(self.weight, self.group, self.sequence_parallel)
        if self.rms:
            xf = x.float()  # the mean of squares in fp32 even for bf16 activations
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * weight
        bias = tp_replicated(self.bias, self.group, self.sequence_parallel)
        return F.layer_norm(x, (x.size(-1),), weight, bias, self.eps)


def rotary_tables(seq_length: int, head_dim: int, base: float, device,
                  first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [s, 1, 1, d] in fp32 for positions first .. first + s - 1 (first > 0: a Ulysses slice), as
    ``apply_rotary`` takes them: [cos, cos] and [-sin, sin] over the two halves of d.

    Made once per (s, d, base, device, first) and shared by every layer, which takes them as inputs of its compiled
    graph: computed inside it, inductor folded them into the rotation, a pow, cos and sin per element of q and of
    (repeated) k, in the forward and again in the backward. Not a buffer, which a later .bfloat16() would round.
    Callers must not modify them."""
    return _rotary_tables(seq_length, head_dim, float(base), torch.device(device), first)


@functools.lru_cache(maxsize=64)
def _rotary_tables(seq_length: int, head_dim: int, base: float, device: torch.device,
                   first: int) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode(False), torch.no_grad():  # ordinary tensors, usable by training after an evaluation
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
        positions = torch.arange(first, first + seq_length, device=device, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)[:, None, None, :]  # [s, 1, 1, d/2]: pair i turns by angle i
        cos, sin = angles.cos(), angles.sin()
        return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + d/2]) of x [s, b, n, d] (the GPT-NeoX / LLaMA-HF convention) in fp32, with
    ``rotary_tables``: x * [cos, cos] + [x2, x1] * [-sin, sin], the same products and sums, element by element, as
    x * [cos, cos] + [-x2, x1] * [sin, sin]. The halves swap by a roll, an index that inductor folds into the one
    element-wise kernel; the concatenation [-x2, x1] it may store first as an fp32 copy of x."""
    xf = x.float()
    return (xf * cos + xf.roll(x.size(-1) // 2, dims=-1) * sin).to(x.dtype)


class SelfAttention(nn.Module):
    """Causal self-attention; heads split over TP (fused QKV column-parallel, output row-parallel).

    The fused QKV weight is [q; k; v] (sizes nq*d, nkv*d, nkv*d); each of the three is split over TP
    on its own, so a rank holds nq/tp query heads and the nkv/tp kv heads they use.
    With ``sp_group`` (Ulysses) x is this rank's sequence slice and the core runs between the all-to-alls of
    ``ulysses_attention``.
    """

    def __init__(self, config: GPTConfig, layer_number: int, group, sp_group=None):
        super().__init__()
        h, d, tp = config.hidden_size, config.head_dim, tp_size(group)
        q_size, kv_size = config.num_attention_heads * d, config.num_key_value_heads * d
        self.group, self.head_dim, self.sequence_parallel = group, d, config.sequence_parallel
        self.local_q_heads = config.num_attention_heads // tp
        self.local_kv_heads = config.num_key_value_heads // tp
        self.rope_base = config.rotary_base if config.position_embedding_type == "rope" else None
        self.rotary_dim = config.rotary_dim
        self.recompute_core = False  # set by its TransformerLayer (selective recompute)
        common = dict(group=group, bias=config.add_bias_linear, sequence_parallel=config.sequence_parallel,
                      params_dtype=config.params_dtype, overlap=config.tp_comm_overlap)
        # q, k and v from three GEMMs on the fused weight's rows, as SwiGLU's gate and up (see ColumnParallelLinear)
        separate = config.tp_comm_overlap not in ("chunked", "pipeline")
        self.qkv = ColumnParallelLinear(h, q_size + 2 * kv_size, splits=[q_size, kv_size, kv_size],
                                        init=_init(config, layer_number, "attention.qkv"), separate_outputs=separate,
                                        **common)
        self.core = CoreAttention(config.attention_backend, config.attention_dropout, config.params_dtype)
        self.sp_group = sp_group if tp_size(sp_group) > 1 else None
        if self.sp_group is not None:
            check_ulysses_heads(config.num_attention_heads, config.num_key_value_heads, tp_size(sp_group))
        self.proj = RowParallelLinear(q_size, h, init=_init(config, layer_number, "attention.proj", scaled=True),
                                      **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(self.core_for()(*self.heads(x)))

    def rope(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The rotary tables (cos, sin) for ``heads(x)``, None without rope. TransformerLayer looks them up outside
        its compiled forward and passes them in, so the compiled graph reads them instead of computing them."""
        if self.rope_base is None:
            return None
        s = x.size(0) * (tp_size(self.group) if self.sequence_parallel else 1)  # heads() sees the full sequence
        first = tp_rank(self.sp_group) * s  # Ulysses: this slice's place in the sequence
        return rotary_tables(s, self.rotary_dim, self.rope_base, x.device, first)

    def heads(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as [b, s, heads, d] (rotated under RoPE) from x [s, b, h] (this rank's sequence shard under SP);
        ``rope``: ``self.rope(x)``, looked up here when not given."""
        if self.rope_base is not None and rope is None:
            rope = self.rope(x)
        qkv = self.qkv(x)  # [s, b, (nq + 2 nkv) / tp * d] or its three parts, full sequence even under SP
        d, nq, nkv = self.head_dim, self.local_q_heads, self.local_kv_heads
        # an FP8 engine's linear in qkv's place returns the fused output
        q, k, v = qkv if isinstance(qkv, tuple) else qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
        s, b = q.shape[:2]
        q, k, v = q.view(s, b, nq, d), k.view(s, b, nkv, d), v.view(s, b, nkv, d)
        if self.rope_base is not None:
            r = self.rotary_dim  # --rotary-percent: only the first r dims of each head rotate
            cos, sin = rope
            q, k = (torch.cat([apply_rotary(t[..., :r], cos, sin), t[..., r:]], dim=-1) if r < d
                    else apply_rotary(t, cos, sin) for t in (q, k))
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)

    def project(self, out: torch.Tensor) -> torch.Tensor:
        """The row-parallel output projection of the core's [b, s, heads, d], back to [s, b, h]."""
        b, s = out.shape[:2]
        return self.proj(out.transpose(0, 1).reshape(s, b, self.local_q_heads * self.head_dim))

    def core_for(self):
        """The core to call. Attention dropout acts on this rank's heads only (TP, or Ulysses after its all-to-all),
        so it draws from a stream of the rank's own: seeding one cannot be traced, and a compiled layer calls that
        core eagerly. The caller calls it from its own top level, so that the break leaves two whole graphs (a
        break deeper down split the layer into many, some gather/GEMM pairs of torch's asynchronous TP apart)."""
        if self.training and self.core.dropout > 0 and tp_size(self._heads_group) > 1:
            return self._core_on_rank_stream
        return self._core

    @property
    def _heads_group(self):
        """The ranks that split the heads: Ulysses' after its all-to-all, else TP's."""
        return self.sp_group if self.sp_group is not None else self.group

    def _core_on_rank_stream(self, q, k, v) -> torch.Tensor:
        """Runs eagerly inside compiled layers: see keep_rank_stream_core_eager."""
        with tp_rank_rng(self._heads_group, q.device):
            return self._core(q, k, v)

    def _core(self, q, k, v) -> torch.Tensor:
        if self.sp_group is not None:
            return ulysses_attention(self._local_core, q, k, v, self.sp_group)  # core on nq/sp heads
        return self._local_core(q, k, v)  # [b, s, nq, d]

    def _local_core(self, q, k, v) -> torch.Tensor:
        if self.recompute_core and torch.is_grad_enabled():  # selective recompute: keep no [s, s] scores
            return checkpoint(self.core, q, k, v, use_reentrant=False)
        return self.core(q, k, v)


@functools.cache
def keep_rank_stream_core_eager() -> None:
    """torch.compiler.disable on SelfAttention._core_on_rank_stream, once, by the first layer that compiles. As a
    decorator it imported dynamo (~1 s: sympy, inductor) into every process that imports the model, compiled or
    not: the launcher validating flags, every CPU rank, every conversion."""
    SelfAttention._core_on_rank_stream = torch.compiler.disable(SelfAttention._core_on_rank_stream)


class MLP(nn.Module):
    """h -> ffn -> h; ffn split over TP. GeLU (exact, or its tanh approximation), or SwiGLU with a fused
    [gate; up] column-parallel weight."""

    def __init__(self, config: GPTConfig, layer_number: int, group):
        super().__init__()
        h, f = config.hidden_size, config.ffn_hidden_size
        self.swiglu = config.swiglu
        self.gelu_approximate = "tanh" if config.openai_gelu else "none"
        common = dict(group=group, bias=config.add_bias_linear, sequence_parallel=config.sequence_parallel,
                      params_dtype=config.params_dtype, overlap=config.tp_comm_overlap)
        # SwiGLU: gate and up from two GEMMs on the fused weight's halves (see ColumnParallelLinear), where the
        # layer makes one GEMM call (not under the chunked or pipelined TP overlaps)
        separate = self.swiglu and config.tp_comm_overlap not in ("chunked", "pipeline")
        self.fc1 = ColumnParallelLinear(h, 2 * f if self.swiglu else f, splits=[f, f] if self.swiglu else None,
                                        init=_init(config, layer_number, "mlp.fc1"), separate_outputs=separate,
                                        **common)
        self.fc2 = RowParallelLinear(f, h, init=_init(config, layer_number, "mlp.fc2", scaled=True), **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation(self.fc1(x)))

    def activation(self, y: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Between fc1 and fc2: SwiGLU of fc1's [gate; up] (two tensors, or one fused, as an FP8 engine's linear in
        fc1's place returns it), or GELU. Also what an MoE layer's stacked experts apply (training/moe.py)."""
        if self.swiglu:
            gate, up = y if isinstance(y, tuple) else y.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(y, approximate=self.gelu_approximate)


def mlp_for_layer(config: GPTConfig, layer_number: int, group, moe_mlp=None) -> nn.Module:
    """The dense MLP, or for an expert layer (model/moe.py's rule) ``moe_mlp(config, layer_number, group,
    num_experts)``: an [s, b, h] -> [s, b, h] module with ``is_moe``, ``aux_loss`` and ``tokens_dropped``
    (training/moe.py builds DeepSpeed's)."""
    experts = config.experts_per_layer[layer_number - 1]
    if experts <= 1:
        return MLP(config, layer_number, group)
    if moe_mlp is None:
        raise ValueError(f"layer {layer_number} has {experts} experts: pass moe_mlp, the expert layer's builder")
    return moe_mlp(config, layer_number, group, experts)


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then + drop(mlp(norm(x))). [s, b, h] -> [s, b, h].

    ``layer_number`` counts from 1 (Megatron) and seeds this layer's weights; ``tp_group`` splits
    its heads and ffn (None: TP=1). ``recompute``, from the builder's ``recompute_plan``: "full" recomputes
    the block in backward, "selective" only its core attention (non-reentrant checkpoints); with
    ``torch_compile`` its norms, GeLU, dropout and residual adds run as fused kernels. The config's options
    are applied as the layer is built: ``tp_comm_overlap`` goes to its parallel linears, and with ``halves`` or
    ``torch_compile`` chooses the forward it runs (``body``); nothing is set on the layer afterwards.
    """

    def __init__(self, config: GPTConfig, layer_number: int, tp_group=None, sp_group=None, moe_mlp=None,
                 recompute: str | None = None):
        super().__init__()
        self.group = group = _checked(config, tp_group)
        self.layer_number = layer_number
        self.sequence_parallel = config.sequence_parallel
        self.sp_group = sp_group
        self.dropout = config.hidden_dropout
        self.input_norm = Norm(config, group)
        self.attention = SelfAttention(config, layer_number, group, sp_group)
        self.post_attention_norm = Norm(config, group)
        self.mlp = mlp_for_layer(config, layer_number, group, moe_mlp)
        self.recompute = recompute
        self.attention.recompute_core = recompute == "selective"
        self.body = self._body(config)

    def _body(self, config: GPTConfig):
        """The forward this layer runs, chosen once from its config: ``--tp-comm-overlap halves`` interleaves the
        micro batch's two halves; ``--torch-compile`` compiles it (one graph for every layer: parameters are graph
        inputs, not constants), and runs it eager again, with one warning, if compiling fails."""
        body = self._halves_forward if config.tp_comm_overlap == "halves" else self._forward
        if not config.torch_compile:
            return body
        keep_rank_stream_core_eager()
        prepare_group(config.tp_comm_overlap, self.group)
        options = inductor_options(config.tp_comm_overlap)
        if getattr(self.mlp, "is_moe", False):
            attention = CompiledForward(self._attention_block, options, what="attention graph of the expert layers")
            return functools.partial(self._expert_layer_forward, attention)
        return CompiledForward(body, options)

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return sequence_parallel_dropout(x, self.dropout, self.training, self.group)
        return sequence_parallel_dropout(x, self.dropout, self.training, self.sp_group)  # Ulysses, or plain

    def _forward(self, x: torch.Tensor, *rope: torch.Tensor) -> torch.Tensor:
        """``rope``: the attention's rotary tables (cos, sin), or nothing without rope (see ``forward``). One frame
        on purpose: where the core runs eager (SelfAttention.core_for), dynamo breaks the graph there, and a break
        inside a nested call would break it at the call instead (TP=2 with dropout: 7 graphs, not 3)."""
        attention = self.attention  # its three steps called from here: see SelfAttention.core_for
        heads = attention.heads(self.input_norm(x), rope or None)
        x = x + self._drop(attention.project(attention.core_for()(*heads)))
        return x + self._drop(self.mlp(self.post_attention_norm(x)))

    def _attention_block(self, x: torch.Tensor, *rope: torch.Tensor) -> torch.Tensor:
        """The first half of ``_forward``: an expert layer's compiled graph."""
        heads = self.attention.heads(self.input_norm(x), rope or None)
        return x + self._drop(self.attention.project(self.attention.core_for()(*heads)))

    def _expert_layer_forward(self, attention_block, x: torch.Tensor, *rope: torch.Tensor) -> torch.Tensor:
        """An expert layer under --torch-compile: DeepSpeed's gate reads the experts' capacity on the host, which
        would break the layer's graph in every layer, so the attention block runs compiled (one graph for every
        expert layer) and the MoE block eager after it; the dense layers between compile whole."""
        x = attention_block(x, *rope)
        return x + self._drop(self.mlp(self.post_attention_norm(x)))

    def _halves_forward(self, x: torch.Tensor, *rope: torch.Tensor) -> torch.Tensor:
        """``--tp-comm-overlap halves``: the same block on the two halves of the micro batch, in an order that puts
        a GEMM of one half after each collective of the other (the compiler's passes then issue the collective
        early and wait late, parallel/overlap.py): B's first gather beside A's QKV GEMM, A's scatter beside B's
        projection, B's MLP gather beside A's MLP and A's MLP scatter beside B's. Both cores run back to back:
        under TP with dropout they run eagerly between two graphs (SelfAttention.core_for), and a graph
        boundary between A's projection and its scatter's consumer would wait for the scatter there."""
        if x.size(1) < 2:  # nothing to split
            return self._forward(x, *rope)
        attention, core = self.attention, self.attention.core_for()
        xa, xb = x.tensor_split(2, dim=1)  # halves of the batch: the same positions, the same tables
        qa = attention.heads(self.input_norm(xa), rope or None)
        qb = attention.heads(self.input_norm(xb), rope or None)
        ca, cb = core(*qa), core(*qb)
        ya = xa + self._drop(attention.project(ca))
        yb = xb + self._drop(attention.project(cb))
        ma = self.mlp(self.post_attention_norm(ya))
        mb = self.mlp(self.post_attention_norm(yb))
        return torch.cat([ya + self._drop(ma), yb + self._drop(mb)], dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rope = self.attention.rope(x)  # looked up here, eagerly: the (compiled) body takes the tables as inputs
        args = (x,) if rope is None else (x, *rope)
        if self.recompute == "full" and torch.is_grad_enabled():
            return checkpoint(self.body, *args, use_reentrant=False)
        return self.body(*args)


def recompute_plan(config: GPTConfig, stage_layers: list[int] | None = None) -> tuple[list[str | None], int]:
    """Megatron's activation recompute, decided here only: (the mode of each layer in order, the chunk).

    selective = core attention of every layer; full + block = the first recompute_num_layers layers of
    each stage; full + uniform = every layer. ``stage_layers``: the layer count of each pipeline stage,
    where each layer checkpoints itself (chunk 1). None: GPTModel's one stage, which checkpoints full +
    uniform chunks of recompute_num_layers > 1 layers itself (one kept input per chunk), so those layers
    do not recompute."""
    granularity, method, count = config.recompute_granularity, config.recompute_method, config.recompute_num_layers
    if stage_layers is None:
        if (granularity, method) == ("full", "uniform") and count > 1:
            return [None] * config.num_layers, count
        stage_layers = [config.num_layers]
    block = (granularity, method) == ("full", "block")
    modes = [("full" if index < count else None) if block else granularity
             for layers in stage_layers for index in range(layers)]
    return modes, 1


class EmbeddingStage(nn.Module):
    """tokens [b, s] -> hidden [s, b, h] ([s/tp, b, h] under SP): vocab-parallel word embeddings,
    plus learned positions when configured, then dropout.

    ``module(hidden, logits=True)`` is the tied output head: this rank's vocabulary slice
    [s, b, V/tp] computed with the same weight. It goes through ``__call__`` on purpose, so module
    hooks (ZeRO-3 gathers a partitioned weight in them) see the second use of the weight too.
    On the last pipeline stage build it with ``positions=False``: only the word embedding weight
    is tied (``.weight``, what DeepSpeed's tied_weight_attr names). ``tp_group`` splits the
    vocabulary (None: TP=1). With ``sp_group`` (Ulysses) tokens are this rank's slice and take the
    positions of that slice.
    """

    def __init__(self, config: GPTConfig, tp_group=None, positions: bool = True, sp_group=None):
        super().__init__()
        self.group = _checked(config, tp_group)
        self.sp_group = sp_group
        self.sequence_parallel = config.sequence_parallel
        self.dropout = config.hidden_dropout
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, group=self.group,
                                                      init=_init(config, 0, "word_embeddings"),
                                                      params_dtype=config.params_dtype)
        self.position_embeddings = None
        if positions and config.position_embedding_type == "learned_absolute":
            full = _init(config, 0, "position_embeddings")((config.max_position_embeddings, config.hidden_size))
            self.position_embeddings = nn.Parameter(full.to(config.params_dtype))
            self.position_embeddings.sequence_parallel = config.sequence_parallel

    @property
    def weight(self) -> nn.Parameter:
        """The word embedding table (this rank's vocabulary rows); tied with the output head."""
        return self.word_embeddings.weight

    def forward(self, x: torch.Tensor, logits: bool = False) -> torch.Tensor:
        return self._logits(x) if logits else self._embed(x)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.size(1)
        x = self.word_embeddings(tokens.t())  # partial sums [s, b, h]: rows this rank owns
        if self.sequence_parallel:
            x = reduce_scatter_sequence(x, self.group)  # [s/tp, b, h]
            first = tp_rank(self.group) * x.size(0)
        else:
            x = reduce_from_tp(x, self.group)
            first = tp_rank(self.sp_group) * s  # Ulysses: tokens are the slice [first, first + s)
        if self.position_embeddings is not None:
            if s * tp_size(self.sp_group) > self.position_embeddings.size(0):
                raise ValueError(f"sequence length {s * tp_size(self.sp_group)} exceeds --max-position-embeddings "
                                 f"{self.position_embeddings.size(0)}")
            positions = tp_replicated(self.position_embeddings, self.group, self.sequence_parallel)
            x = x + positions[first:first + x.size(0)].unsqueeze(1)
        if self.sequence_parallel:
            return sequence_parallel_dropout(x, self.dropout, self.training, self.group)
        return sequence_parallel_dropout(x, self.dropout, self.training, self.sp_group)  # Ulysses, or plain

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [s(/tp), b, h] -> local logits [s, b, V/tp] with the tied word embedding weight."""
        x = all_gather_sequence(hidden, self.group) if self.sequence_parallel else copy_to_tp(hidden, self.group)
        return F.linear(x, self.word_embeddings.weight)


class FinalNorm(nn.Module):
    """The norm after the last layer. [s, b, h] -> [s, b, h].

    With ``torch_compile`` an RMSNorm runs compiled, as the layers' norms do: eager it is some eight kernels forward
    and more backward over fp32 copies of the whole [s, b, h] activation (LayerNorm is one fused kernel either way)."""

    def __init__(self, config: GPTConfig, tp_group=None):
        super().__init__()
        self.norm = Norm(config, _checked(config, tp_group))
        compiled = config.torch_compile and config.normalization == "RMSNorm"
        self.body = CompiledForward(self._forward) if compiled else self._forward

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)  # through __call__: module hooks (ZeRO-3's gather) see the norm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.body(hidden)


class OutputHead(nn.Module):
    """Untied output layer: hidden [s(/tp), b, h] -> local logits [s, b, V/tp] (column-parallel, no bias)."""

    def __init__(self, config: GPTConfig, tp_group=None):
        super().__init__()
        self.linear = ColumnParallelLinear(config.hidden_size, config.vocab_size, group=_checked(config, tp_group),
                                           bias=False, sequence_parallel=config.sequence_parallel,
                                           init=_init(config, config.num_layers + 1, "output_layer"),
                                           params_dtype=config.params_dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden)


def lm_loss(local_logits: torch.Tensor, labels: torch.Tensor, group, *,
            overwrite_logits: bool = False) -> torch.Tensor:
    """Per-token fp32 loss [b, s] from local logits [s, b, V/tp] and labels [b, s].

    ``group`` is the TP group the logits' vocabulary is split over (None: TP=1, full logits).
    Loss masking and averaging are the caller's. ``overwrite_logits``: the caller never reads the logits again,
    so the backward writes their gradient over them (one logits-sized buffer less at the memory peak).
    """
    return vocab_parallel_cross_entropy(local_logits, labels.t(), group, overwrite_logits=overwrite_logits).t()


class GPTModel(nn.Module):
    """EmbeddingStage -> TransformerLayer x L -> FinalNorm -> logits (tied) or OutputHead (untied).

    ``tp_group``: the tensor-parallel process group this rank's slice belongs to; None builds the
    whole model (TP=1), whatever process groups exist. ``sp_group``: the Ulysses group (None: off).
    ``forward(tokens [b, s], labels [b, s] | None)``: per-token loss [b, s] fp32 with labels, else
    this rank's logits [b, s, V/tp]. Under Ulysses tokens and labels are this rank's slice [b, s/sp];
    the loss is still [b, s] (gathered over SP), the logits [b, s/sp, V].
    """

    def __init__(self, config: GPTConfig, tp_group=None, sp_group=None, moe_mlp=None):
        super().__init__()
        self.config = config
        self.tp_group = _checked(config, tp_group)
        if tp_size(sp_group) > 1 and tp_size(tp_group) > 1:
            raise ValueError("DeepSpeed-Ulysses (sp_group) runs with TP = 1, as in Megatron-DeepSpeed")
        self.sp_group = sp_group
        self.embedding = EmbeddingStage(config, tp_group, sp_group=sp_group)
        modes, self.recompute_chunk = recompute_plan(config)
        self.layers = nn.ModuleList(TransformerLayer(config, n, tp_group, sp_group, moe_mlp, modes[n - 1])
                                    for n in range(1, config.num_layers + 1))
        self.moe_stats = MoEStats([layer.mlp for layer in self.layers])  # the loop reads the last forward's
        self.final_norm = FinalNorm(config, tp_group)
        self.output_head = None if config.tied_embeddings else OutputHead(config, tp_group)

    @property
    def attention_backend(self) -> str:
        """The attention kernel that runs (resolved from config.attention_backend at build time)."""
        return self.layers[0].attention.core.resolved_backend

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embedding(tokens)
        if self.recompute_chunk > 1 and torch.is_grad_enabled():
            n = self.recompute_chunk
            for start in range(0, len(self.layers), n):
                hidden = checkpoint(self._run_layers, hidden, start, start + n, use_reentrant=False)
        else:
            hidden = self._run_layers(hidden, 0, len(self.layers))
        hidden = self.final_norm(hidden)
        logits = self.embedding(hidden, logits=True) if self.output_head is None else self.output_head(hidden)
        if labels is None:
            return logits.transpose(0, 1)
        # Ulysses: [b, s/sp] -> [b, s]; backward keeps this rank's columns (the mean's gradient is replicated)
        return gather_from_tp(lm_loss(logits, labels, self.tp_group, overwrite_logits=True), self.sp_group)


    def _run_layers(self, hidden: torch.Tensor, start: int, end: int) -> torch.Tensor:
        for layer in self.layers[start:end]:
            hidden = layer(hidden)
        return hidden


def tied_head_forward(module: EmbeddingStage, hidden: torch.Tensor) -> torch.Tensor:
    """The tied head of a pipeline: ``module(hidden, logits=True)`` (DeepSpeed's forward_fn form)."""
    return module(hidden, logits=True)


@dataclass(frozen=True)
class StageSpec:
    """One pipeline piece, DeepSpeed-neutral: ``module_class(*args, **kwargs)`` builds it.

    ``tied_key`` names pieces that share a weight (``tied_weight_attr``) across stages, i.e.
    DeepSpeed's TiedLayerSpec(key, module_class, *args, forward_fn=..., tied_weight_attr=...);
    ``forward_fn(module, x)`` replaces ``module(x)`` when set (the tied head calls ``logits``).
    """

    kind: str  # "embedding" | "layer" | "final_norm" | "head"
    module_class: type
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    tied_key: str | None = None
    tied_weight_attr: str = "weight"
    forward_fn: object = None

    def build(self) -> nn.Module:
        return self.module_class(*self.args, **self.kwargs)

    def __call__(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Run ``module`` (built from this spec) the way the pipeline will."""
        return self.forward_fn(module, x) if self.forward_fn is not None else module(x)


def gpt_stage_specs(config: GPTConfig, tp_group=None, stage_layers: list[int] | None = None) -> list[StageSpec]:
    """The pieces of GPTModel in order; running them one after another equals GPTModel(config, tp_group).
    ``stage_layers``: the layer count of each pipeline stage (default: one stage), for ``recompute_plan``.

    Every piece gets ``tp_group`` as its ``tp_group`` keyword argument (None: TP=1). Input of the
    first piece: tokens [b, s]; between pieces: hidden [s, b, h] ([s/tp, b, h] under SP); output
    of the last: local logits [s, b, V/tp] for ``lm_loss(logits, labels, tp_group)``.

    Under sequence parallelism the activations sent between stages DIFFER per TP rank (each holds
    its sequence shard), so DeepSpeed's pipeline must not split them over TP: set its config
    ``"pipeline": {"pipe_partitioned": false, "grad_partitioned": false}`` (both default to true and
    assume TP-replicated activations; with them a TP=2 x PP=2 SP run computes a wrong loss).
    """
    _checked(config, tp_group)

    def on_group(**kwargs) -> dict:  # a fresh dict per spec: no spec shares mutable arguments
        return {"tp_group": tp_group, **kwargs}

    tied = "embed" if config.tied_embeddings else None
    specs = [StageSpec("embedding", EmbeddingStage, (config,), on_group(), tied_key=tied)]
    modes, _ = recompute_plan(config, stage_layers or [config.num_layers])
    specs += [StageSpec("layer", TransformerLayer, (config, n), on_group(recompute=modes[n - 1]))
              for n in range(1, config.num_layers + 1)]
    specs.append(StageSpec("final_norm", FinalNorm, (config,), on_group()))
    if tied:
        specs.append(StageSpec("head", EmbeddingStage, (config,), on_group(positions=False), tied_key=tied,
                               forward_fn=tied_head_forward))
    else:
        specs.append(StageSpec("head", OutputHead, (config,), on_group()))
    return specs
