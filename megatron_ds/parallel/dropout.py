"""Hidden dropout whose mask is a hash of one random key and each element's place in the full activation.

Why not torch's dropout: its mask is a stream of random numbers, so a sequence shard [s/tp, b, h] can only
reproduce the unsharded run's mask by drawing the whole sequence's and keeping its rows (tp x the numbers),
and backward needs the mask kept in memory (one byte per element, 3.2 GB per GPT-1.3B micro-batch of 16).
Here the mask is a pure function of (key, coordinates in the full tensor): a shard computes only its own
rows, yet SP on equals SP off exactly; and backward recomputes it from the key instead of reading it back.
Inside a compiled layer the hash is plain integer arithmetic that inductor fuses into the residual/norm
kernels around it; eager callers on a GPU get the same arithmetic as one compiled kernel (``_fused``).

The key (two 32-bit halves) is drawn from the default generator of x's device, once per call: TP ranks,
which share that generator's state, draw the same key; activation checkpointing, which restores it, replays
the same mask. The hash is two rounds of a 32-bit integer mixer (Wellons' lowbias32 form) in int32 arithmetic, the
GPU's native width (int64, emulated there, made the step 3.7% slower), keyed by one half each round.
"""

from __future__ import annotations

import functools
import os
from typing import Sequence

import torch
import torch.nn.functional as F

from megatron_ds.parallel.mappings import tp_rank, tp_size

# MDS_HASH_DROPOUT=0 steps back to torch's dropout (a stream of random numbers, the full sequence's drawn under SP)
HASH_MASKS = os.environ.get("MDS_HASH_DROPOUT", "1") != "0"


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mixer on int32 (every output bit depends on every input bit). Multiplies wrap, as int32
    arithmetic does on every torch backend; the masks make the right shifts logical."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x21F0AAAD
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * 0x735A2D97
    return x ^ ((x >> 15) & 0x1FFFF)


def _positions(shape: Sequence[int], full_shape: Sequence[int], start: Sequence[int], device) -> torch.Tensor:
    """int64 [shape]: each element's flat index in a contiguous tensor of ``full_shape``, this piece starting at
    ``start`` (broadcast sums of one arange per dimension, which a compiler fuses into the consumer)."""
    index = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for dim in reversed(range(len(shape))):
        view = [1] * len(shape)
        view[dim] = shape[dim]
        along = torch.arange(start[dim], start[dim] + shape[dim], dtype=torch.int64, device=device)
        index = index + (along * stride).view(view)
        stride *= full_shape[dim]
    return index


def _low31(x: torch.Tensor) -> torch.Tensor:
    return (x & 0x7FFFFFFF).to(torch.int32)


def _keep(key: torch.Tensor, index: torch.Tensor, p: float) -> torch.Tensor:
    """bool: keep the element (probability 1 - p, to 2**-31). Two rounds, each keyed by 31 bits of the key; the
    index's bits above 31 enter the second."""
    bits = _mix32(_mix32(_low31(index) ^ _low31(key)) ^ _low31(index >> 31) ^ _low31(key >> 31))
    return (bits & 0x7FFFFFFF) >= round(p * 2**31)


def _apply(x, key, p: float, full_shape, start) -> torch.Tensor:
    """x with the mask applied and the kept elements scaled by 1 / (1 - p), computed as torch's dropout does it
    (in fp32, rounded once to x's dtype)."""
    keep = _keep(key, _positions(x.shape, full_shape, start, x.device), p)
    return torch.where(keep, x * (1.0 / (1.0 - p)), torch.zeros((), dtype=x.dtype, device=x.device))


@functools.lru_cache(maxsize=None)
def _fused():
    """``_apply`` compiled once on its own, for eager callers on a GPU (as separate eager kernels the hash would
    cost a dozen passes over int64 tensors); None where it cannot compile."""
    try:
        return torch.compile(_apply, dynamic=True)
    except Exception:  # noqa: BLE001 - an old torch without inductor: the eager arithmetic is the same
        return None


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):
        return compiler.is_compiling()
    return torch._dynamo.is_compiling()


def _masked(x, key, p: float, full_shape, start) -> torch.Tensor:
    if x.is_cuda and not _compiling() and _fused() is not None:
        return _fused()(x, key, p, tuple(full_shape), tuple(start))
    return _apply(x, key, p, full_shape, start)


class _HashDropout(torch.autograd.Function):
    """Saves the key, not the mask: backward applies the same mask to the gradient."""

    @staticmethod
    def forward(ctx, x, key, p, full_shape, start):
        ctx.save_for_backward(key)
        ctx.p, ctx.full_shape, ctx.start = p, full_shape, start
        return _masked(x, key, p, full_shape, start)

    @staticmethod
    def backward(ctx, grad):
        (key,) = ctx.saved_tensors
        return _masked(grad, key, ctx.p, ctx.full_shape, ctx.start), None, None, None, None


def draw_key(device: torch.device) -> torch.Tensor:
    """One int64 from the default generator of ``device``: the mask's key (its halves key the two rounds)."""
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)


def hash_dropout(x: torch.Tensor, p: float, training: bool = True, full_shape: Sequence[int] | None = None,
                 start: Sequence[int] | None = None, key: torch.Tensor | None = None) -> torch.Tensor:
    """Dropout of ``x``, a piece of a tensor of ``full_shape`` (default: x's own) starting at ``start`` (default:
    the origin): the mask of each element is the one the whole tensor would get there."""
    if not training or p == 0.0:
        return x
    if not 0.0 < p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    full_shape = tuple(x.shape if full_shape is None else full_shape)
    start = tuple([0] * x.dim() if start is None else start)
    if len(full_shape) != x.dim() or len(start) != x.dim() or any(
            s < 0 or s + n > f for s, n, f in zip(start, x.shape, full_shape)):
        raise ValueError(f"a piece of shape {tuple(x.shape)} at {start} does not lie in a tensor of {full_shape}")
    key = draw_key(x.device) if key is None else key
    return _HashDropout.apply(x, key, p, full_shape, start)


def sequence_parallel_dropout(x: torch.Tensor, p: float, training: bool, group) -> torch.Tensor:
    """Hidden dropout of x [s/n, ...], this rank's rows of the activation the n ranks of ``group`` (TP under SP,
    Ulysses' group) split by sequence; None or one rank: x is whole. The mask is the unsharded run's."""
    n = tp_size(group)
    if not training or p == 0.0:
        return x
    if not HASH_MASKS:
        return _stream_dropout(x, p, n, tp_rank(group) if n > 1 else 0)
    if n == 1:
        return hash_dropout(x, p)
    return hash_dropout(x, p, full_shape=(x.size(0) * n, *x.shape[1:]),
                        start=(tp_rank(group) * x.size(0),) + (0,) * (x.dim() - 1))


def _stream_dropout(x: torch.Tensor, p: float, n: int, rank: int) -> torch.Tensor:
    """torch's dropout; for a shard, the full sequence's mask drawn from the shared stream and this shard's rows
    kept (tp x the random numbers)."""
    if n == 1:
        return F.dropout(x, p, True)
    full = torch.empty((x.size(0) * n, *x.shape[1:]), dtype=x.dtype, device=x.device).bernoulli_(1.0 - p)
    return x * full.chunk(n, dim=0)[rank] / (1.0 - p)
