"""Tensor-parallel layers whose weights are sliced from one full, seeded matrix.

Every layer is handed an ``init`` callable that returns the FULL tensor for a shape; the layer
keeps only this rank's slice. Given the same init, TP=N holds exactly the slices of TP=1's weights,
so the two are equal by construction (at the cost of drawing the full matrix once; on the GPU when training
there: ``weights_drawn_on``).

The column- and row-parallel linears take the ``--tp-comm-overlap`` mode (``overlap``, parallel/overlap.py) when
they are built: under ``chunked`` a sequence-parallel linear splits its GEMM by the ranks' sequence chunks so its
collective runs beside a GEMM (parallel/chunked.py); under ``pipeline`` a column-parallel linear adds its bias after
the GEMM, for torch's asynchronous TP. Other modes change nothing here.

Parameter attributes, read by the optimizer side (DeepSpeed's grad-norm, checkpoint converters):
- ``tensor_model_parallel``: sliced over TP; ``partition_dim`` and ``partition_splits`` say how
  (see ``slice_chunks``);
- ``sequence_parallel``: replicated over TP but used on sequence shards; its gradient is already
  summed over TP inside backward (see ``tp_replicated``).

The precision seam: each parallel linear runs its local matrix multiply through a child ``local``,
a plain ``nn.Linear`` (``LocalGEMM``) holding this rank's weight slice. An FP8 engine swaps that child
for its own linear (torchao's Float8Linear, Transformer Engine's, MS-AMP's); the TP communication
around it stays here. Its weight is therefore named ``<layer>.local.weight`` (``qkv.local.weight``);
checkpoints written with the older ``<layer>.weight`` names still load (a load_state_dict pre-hook).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megatron_ds.parallel.chunked import gather_then_gemm, gemm_then_scatter
from megatron_ds.parallel.mappings import (
    all_gather_sequence,
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_sequence,
    tp_rank,
    tp_size,
)

Init = Callable[[tuple[int, ...]], torch.Tensor]


_draw_device: torch.device | None = None  # where seeded_normal draws (None: the CPU); see weights_drawn_on


@contextlib.contextmanager
def weights_drawn_on(device: torch.device | None):
    """Inside this block seeded_normal draws on ``device`` and its tensors stay there: each rank slices its TP
    part on the GPU and its parameters are born on it.

    Why: the CPU draws serially (~0.2 s per 10^8 numbers), so every rank spent ~35 s drawing GPT-6.7B's full
    matrices before training could start; a GPU draws them in well under a second. Copying the full fp32
    matrices back to the host to slice them there cost as much again (TP=4 GPT-13B: 52 GB per rank, four ranks
    at once). The numbers come from that device's generator: equal for every TP/PP layout on one kind of
    machine, not equal to the CPU's draw.
    """
    global _draw_device
    saved, _draw_device = _draw_device, device
    try:
        yield
    finally:
        _draw_device = saved


def seeded_normal(std: float, *key: object) -> Init:
    """Init drawing N(0, std) from a generator seeded by ``key`` (e.g. (seed, layer_number, name)).

    The stream depends on the key only, never on which other parameters were built before, so a
    pipeline stage that builds only its own layers gets the same weights as the full model.
    """
    digest = hashlib.sha256(repr(key).encode()).digest()

    def init(shape: tuple[int, ...]) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=torch.float32)
        if tensor.is_meta:  # a model built for its shapes only (torch 2.1 cannot draw meta tensors from a generator)
            return tensor
        device = _draw_device or tensor.device
        if device.type != "cpu":
            tensor = torch.empty(shape, dtype=torch.float32, device=device)
        generator = torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        return tensor.normal_(0.0, std, generator=generator)

    return init


def slice_chunks(full: torch.Tensor, splits: Sequence[int], dim: int, size: int, rank: int) -> torch.Tensor:
    """TP rank ``rank`` of ``size``'s part of ``full`` along ``dim``, a concatenation of chunks of ``splits`` sizes.

    Each chunk is split over TP on its own and the local pieces are concatenated again: a fused
    [q; k; v] or [gate; up] matrix thus keeps all its chunks on every rank. Parameters record
    their ``partition_dim`` and ``partition_splits``, so converters can undo this.
    """
    pieces = []
    for chunk in full.split(list(splits), dim=dim):
        if chunk.size(dim) % size:
            raise ValueError(f"a weight chunk of size {chunk.size(dim)} cannot be split over {size} "
                             "tensor-parallel ranks")
        pieces.append(chunk.chunk(size, dim=dim)[rank])
    return torch.cat(pieces, dim=dim).contiguous()


def _slice(full: torch.Tensor, splits: Sequence[int], dim: int, group) -> torch.Tensor:
    return slice_chunks(full, splits, dim, tp_size(group), tp_rank(group))


def _param(tensor: torch.Tensor, dtype: torch.dtype, **attrs: object) -> nn.Parameter:
    p = nn.Parameter(tensor.to(dtype))
    for name, value in attrs.items():
        setattr(p, name, value)
    return p


def tp_replicated(weight: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """A TP-replicated weight as used in the forward: under sequence parallelism each rank sees only
    its sequence shard, so the weight's gradient must be summed over TP; ``copy_to_tp`` does that in
    the backward (forward: identity, backward: all-reduce), so p.grad is complete after backward
    whatever DeepSpeed does with it next (ZeRO 2/3 included). No call after backward is needed."""
    return copy_to_tp(weight, group) if sequence_parallel else weight


def sequence_parallel_dropout(x: torch.Tensor, p: float, training: bool, group) -> torch.Tensor:
    """Dropout on a sequence shard [s/tp, ...] that draws the FULL sequence's mask and keeps our rows.

    Every TP rank shares the default RNG state (as Megatron seeds it), so plain dropout would give
    each shard the same pattern; drawing the full mask costs tp x the random numbers but gives
    exactly the mask of the unsharded run (SP on == SP off, with dropout) and replays under
    activation checkpointing like any torch dropout.
    """
    n = tp_size(group)
    if not training or p == 0.0 or n == 1:
        return F.dropout(x, p, training)
    full = torch.empty((x.size(0) * n, *x.shape[1:]), dtype=x.dtype, device=x.device).bernoulli_(1.0 - p)
    keep = full.chunk(n, dim=0)[tp_rank(group)]
    return x * keep / (1.0 - p)


class LocalGEMM(nn.Linear):
    """This rank's matrix multiply y = x W^T (+ b): an ``nn.Linear`` over a given weight slice, so an
    FP8 engine that replaces ``nn.Linear`` modules can replace it (the parameter objects, with their
    TP attributes, move to the replacement). Built without ``nn.Linear``'s random initialisation.

    ``bias_apart``: add the bias after the GEMM instead of inside it (addmm), for torch's asynchronous TP,
    which fuses an all-gather with a plain GEMM only (parallel/overlap.py). ``outputs``: row counts of the weight's
    chunks; the forward then returns one tensor per chunk, each from its own GEMM (see ColumnParallelLinear). Not
    for a weight ZeRO-3 partitions (``ds_id``): it frees the gathered weight after the layer's forward and gathers
    it again for the backward, and autograd would hold the chunk GEMMs' views, the whole gathered weight, in
    between; there the chunks are cut from the one GEMM's output."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, *, bias_apart: bool = False,
                 outputs: Sequence[int] | None = None):
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.register_parameter("bias", bias)
        self.bias_apart = bias_apart
        self.outputs = list(outputs) if outputs else None

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if self.outputs:
            if hasattr(self.weight, "ds_id"):  # ZeRO-3 (see above): one GEMM, its output cut
                return super().forward(x).split(self.outputs, dim=-1)
            biases = self.bias.split(self.outputs) if self.bias is not None else [None] * len(self.outputs)
            return tuple(F.linear(x, w, b) for w, b in zip(self.weight.split(self.outputs), biases))
        if self.bias_apart and self.bias is not None:
            return F.linear(x, self.weight) + self.bias
        return super().forward(x)


def _rename_legacy_keys(names: Sequence[str]):
    """A load_state_dict pre-hook that reads ``<prefix><name>`` (older checkpoints) as ``<prefix>local.<name>``."""

    def hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for name in names:
            old, new = prefix + name, prefix + "local." + name
            if old in state_dict and new not in state_dict:
                state_dict[new] = state_dict.pop(old)

    return hook


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split by rows (output features) over TP: each rank computes its output slice.

    ``splits`` declares a fused weight made of chunks (e.g. q, k, v sizes) each split on its own.
    Input: [s, b, in] replicated (or [s/tp, b, in] sequence shards when ``sequence_parallel``,
    gathered here). Output: [s, b, out/tp], or the full [s, b, out] with ``gather_output``.
    ``overlap``: the ``--tp-comm-overlap`` mode (``chunked`` and ``pipeline`` change this layer; see the top).
    ``separate_outputs``: return one output per split, each from its own GEMM on its rows of the same fused weight
    (the parameter and the checkpoint layout stay as they are). The backward then has each part's gradient as its
    own tensor, where one fused output makes inductor build a masked 'cat' kernel that reads its inputs twice
    (SwiGLU's [gate; up]: 0.76 against 0.41 ms per GPT-1.3B-sized layer at micro batch 16 on an H200; QKV with
    rope: 0.53 against 0.19).
    """

    def __init__(self, input_size: int, output_size: int, *, init: Init, group=None, bias: bool = True,
                 splits: Sequence[int] | None = None, sequence_parallel: bool = False,
                 gather_output: bool = False, params_dtype: torch.dtype = torch.float32, overlap: str | None = None,
                 separate_outputs: bool = False):
        super().__init__()
        splits = list(splits or [output_size])
        if sum(splits) != output_size:
            raise ValueError(f"splits {splits} must add up to output_size {output_size}")
        if separate_outputs and (gather_output or overlap in ("chunked", "pipeline") or len(splits) < 2):
            raise ValueError("separate_outputs needs a fused weight (splits) and one GEMM call: not with "
                             f"gather_output or --tp-comm-overlap chunked/pipeline (got overlap={overlap!r})")
        if gather_output and len(splits) > 1:
            raise ValueError("gather_output is for a single (unfused) weight: gathered chunks would interleave")
        self.group, self.sequence_parallel, self.gather_output = group, sequence_parallel, gather_output
        self.chunked = overlap == "chunked"
        weight = _param(_slice(init((output_size, input_size)), splits, 0, group), params_dtype,
                        tensor_model_parallel=True, partition_dim=0, partition_splits=splits)
        local_bias = (_param(torch.zeros(output_size // tp_size(group)), params_dtype,
                             tensor_model_parallel=True, partition_dim=0, partition_splits=splits)
                      if bias else None)
        # the bias is per output column: it goes with the GEMM (after it, for asynchronous TP's fused gather + GEMM)
        self.local = LocalGEMM(weight, local_bias, bias_apart=overlap == "pipeline",
                               outputs=[n // tp_size(group) for n in splits] if separate_outputs else None)
        self._register_load_state_dict_pre_hook(_rename_legacy_keys(("weight", "bias")))

    @property
    def weight(self) -> nn.Parameter:
        return self.local.weight

    @property
    def bias(self) -> nn.Parameter | None:
        return self.local.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if self.sequence_parallel and self.chunked:
            y = gather_then_gemm(x, self.local, self.group)
        else:
            x = all_gather_sequence(x, self.group) if self.sequence_parallel else copy_to_tp(x, self.group)
            y = self.local(x)
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split by columns (input features) over TP: each rank adds a partial sum.

    Input: [s, b, in/tp] (the output of a ColumnParallelLinear). Output: [s, b, out] summed over TP,
    or [s/tp, b, out] sequence shards (reduce-scatter) when ``sequence_parallel``. The bias is
    replicated and added after the reduction. ``overlap``: the ``--tp-comm-overlap`` mode (``chunked`` changes this
    layer; see the top).
    """

    def __init__(self, input_size: int, output_size: int, *, init: Init, group=None, bias: bool = True,
                 sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32,
                 overlap: str | None = None):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.chunked = overlap == "chunked"
        weight = _param(_slice(init((output_size, input_size)), [input_size], 1, group), params_dtype,
                        tensor_model_parallel=True, partition_dim=1, partition_splits=[input_size])
        self.local = LocalGEMM(weight, None)  # a partial sum: the bias is added once, after the reduction
        self.bias = (_param(torch.zeros(output_size), params_dtype, sequence_parallel=sequence_parallel)
                     if bias else None)
        self._register_load_state_dict_pre_hook(_rename_legacy_keys(("weight",)))

    @property
    def weight(self) -> nn.Parameter:
        return self.local.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel and self.chunked:
            y = gemm_then_scatter(x, self.local, self.group)
        elif self.sequence_parallel:
            y = reduce_scatter_sequence(self.local(x), self.group)
        else:
            y = reduce_from_tp(self.local(x), self.group)
        if self.bias is not None:
            y = y + tp_replicated(self.bias, self.group, self.sequence_parallel)
        return y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by rows (vocabulary) over TP: each rank looks up the ids it owns.

    ``forward`` returns this rank's partial embeddings (zeros for ids another rank owns), of shape
    tokens.shape + (h,); the caller sums them over TP (``reduce_from_tp``) after any transpose, so
    the one all-reduce happens on the layout it wants.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init: Init, group=None,
                 params_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.group = group
        n, r = tp_size(group), tp_rank(group)
        if num_embeddings % n:
            raise ValueError(f"vocabulary size {num_embeddings} is not divisible by {n} tensor-parallel ranks")
        self.vocab_start = r * num_embeddings // n
        self.vocab_end = (r + 1) * num_embeddings // n
        self.weight = _param(_slice(init((num_embeddings, embedding_dim)), [num_embeddings], 0, group),
                             params_dtype, tensor_model_parallel=True, partition_dim=0,
                             partition_splits=[num_embeddings])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tp_size(self.group) == 1:
            return F.embedding(tokens, self.weight)
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        return F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)

    def full(self, tokens: torch.Tensor) -> torch.Tensor:
        """Complete embeddings, summed over TP (forward: all-reduce, backward: identity)."""
        return reduce_from_tp(self(tokens), self.group)
