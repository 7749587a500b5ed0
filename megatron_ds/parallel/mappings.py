"""Tensor-parallel communication as conjugate autograd pairs.

Each public helper takes an explicit process group and says what it does forward and backward;
the backward of one is the forward of its partner. With ``group=None`` or a group of one rank
every helper is the identity, so the same model code runs without torch.distributed.

Two pairs work on the last (hidden) dimension, two on the first (sequence) dimension: activations
use the [s, b, h] layout, so sequence parallelism splits dim 0 and each chunk is contiguous. The last pair
is DeepSpeed-Ulysses' all-to-all on batch-first attention heads [b, s, n, d]: sequence slices in, head
groups out, and back.

Inside a compiled graph the collectives are torch's functional ones (a new tensor out, then an explicit wait), on
every backend: they are what dynamo itself emits, so ``--torch-compile`` traces them as they are, and no autograd
Function here mutates a tensor. Eager layers (``--no-torch-compile``, Transformer Engine, MS-AMP) call c10d
directly: the functional wrappers cost host time per call, and eager GPT-2.7B TP=2+SP ran 1.011-1.021x faster
on c10d's (bench/RESULTS.md). The c10d calls write in place or into an output
argument (``all_reduce(x)``, ``all_gather_into_tensor(out, x)``, ``all_gather(parts, x)``); dynamo rewrites them
into in-place copies inside our Functions' forward, which torch 2.11's dynamo differentiates wrongly
(pytorch#180642, fixed for 2.12 by #180921: the gradient goes to the wrong output, zeros arrive). That was the
compiled TP=2 run's smaller gradient on 2 x H200 (torch 2.11); torch 2.13 on CPU matched, and torch 2.11 on CPU
reproduces it with the c10d calls (bench/compile_tp_probe.py --cpu: compiled gradient norm 1.11 vs 1.40 eager,
some gradients zero) and not with the functional ones. DeepSpeed#8491 is the same class of bug. Torch 2.1 keeps
the c10d calls (it cannot compile the layer). Gloo sums 16-bit floats in fp32, as before.
``MDS_TP_COLLECTIVES=functional|inplace`` forces one kind everywhere (inplace: the c10d calls), for tests and
the probe; it is read at the first collective of the process and kept (``forced_kind``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ds.env_settings import TP_COLLECTIVES
from megatron_ds.torch_support import compile_problem

# torch 2.1 cannot compile the layer (nor has torch.compiler.is_compiling), so it keeps the c10d calls
_IS_COMPILING = getattr(torch.compiler, "is_compiling", None) if compile_problem() is None else None
_forced: str | None = None  # MDS_TP_COLLECTIVES once read: "", "functional" or "inplace"


def forced_kind(*, reread: bool = False) -> str:
    """The kind MDS_TP_COLLECTIVES forces ("" for none), read from the environment at the first call and kept, so
    each collective pays one global lookup (a compiled graph: a guard on it); ``reread`` reads it again (tests)."""
    global _forced
    if _forced is None or reread:
        _forced = TP_COLLECTIVES.get()
    return _forced


def _functional() -> bool:
    """Whether this call takes torch's functional collectives: under dynamo's trace (where torch compiles), else
    c10d's; dynamo reads ``is_compiling()`` as a constant, so a compiled graph holds only the functional branch."""
    forced = _forced if _forced is not None else forced_kind()
    if forced:
        return forced == "functional"
    return _IS_COMPILING is not None and _IS_COMPILING()


def tp_size(group) -> int:
    """Ranks in ``group``; 1 for None, so code without torch.distributed runs as TP=1."""
    return 1 if group is None else dist.get_world_size(group)


def tp_rank(group) -> int:
    """This process's rank in ``group``; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


def _is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


def _gloo_16bit(x: torch.Tensor, group) -> bool:
    """gloo with a 16-bit float: it cannot sum those before torch 2.2, nor gather them (see the callers)."""
    return x.dtype in (torch.bfloat16, torch.float16) and _is_gloo(group)


def _waited(x: torch.Tensor) -> torch.Tensor:
    """The collective's result once it has arrived: eager returns a wrapper that would wait at its first use;
    under dynamo the functional collective has already put the wait into the graph."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return x.trigger_wait() if isinstance(x, AsyncCollectiveTensor) else x


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if _gloo_16bit(x, group):
        # gloo before torch 2.2 cannot sum 16-bit floats ("Invalid scalar type"): sum in fp32, round once
        return _all_reduce(x.float(), group).to(x.dtype)
    if _functional():
        from torch.distributed._functional_collectives import all_reduce

        return _waited(all_reduce(x.contiguous(), "sum", group))
    x = x.contiguous().clone()  # never reduce in place into a tensor autograd may still hold
    dist.all_reduce(x, group=group)
    return x


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = tp_size(group)
    if x.size(dim) % n:
        raise ValueError(f"cannot split dim {dim} of size {x.size(dim)} over {n} tensor-parallel ranks")
    return x.chunk(n, dim=dim)[tp_rank(group)].contiguous()


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = tp_size(group)
    x = x.contiguous()
    if _functional():
        import torch.distributed._functional_collectives as fc

        gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor  # the newer name where torch has it
        out = _waited(gather(x, 0, group))  # [n * s, ...]: the ranks' blocks in order along dim 0
        return out if dim == 0 else torch.cat(out.chunk(n, dim=0), dim=dim)
    if dim == 0 and not _is_gloo(group):
        out = torch.empty((n * x.size(0), *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=group)
        return out
    if _gloo_16bit(x, group):
        # gloo rejects 16-bit floats (and int16) in all_gather; moving their bytes is exact
        return _all_gather(x.view(torch.uint8), dim, group).view(x.dtype)
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = tp_size(group)
    if x.size(dim) % n:
        raise ValueError(f"cannot reduce-scatter dim {dim} of size {x.size(dim)} over {n} tensor-parallel ranks")
    if dim == 0 and _functional() and not _gloo_16bit(x, group):
        import torch.distributed._functional_collectives as fc

        reduce_scatter = getattr(fc, "reduce_scatter_single", None) or fc.reduce_scatter_tensor  # likewise
        return _waited(reduce_scatter(x.contiguous(), "sum", 0, group))
    if dim == 0 and not _is_gloo(group):
        x = x.contiguous()
        out = torch.empty((x.size(0) // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x, group=group)
        return out
    # gloo without functional collectives has no reduce-scatter, and sums 16-bit in fp32 (see _all_reduce):
    # all-reduce, then keep our chunk (CPU only).
    return _split(_all_reduce(x, group), dim, group)


def _all_to_all(x: torch.Tensor, send_rows: list[int], recv_rows: list[int], group) -> torch.Tensor:
    """Dim-0 blocks of ``x`` to each rank (``send_rows[q]`` rows to rank q, in rank order); the blocks received,
    ``recv_rows[q]`` rows from rank q, stacked in rank order."""
    x = x.contiguous()
    if _gloo_16bit(x, group):  # as in _all_gather: gloo moves the bytes of a 16-bit float exactly
        return _all_to_all(x.view(torch.uint8), send_rows, recv_rows, group).view(x.dtype)
    if _functional():
        from torch.distributed._functional_collectives import all_to_all_single

        return _waited(all_to_all_single(x, recv_rows, send_rows, group))
    out = torch.empty((sum(recv_rows), *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x, recv_rows, send_rows, group=group)
    return out


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.dim, ctx.group), None, None


class _GatherReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_rows, recv_rows, group):
        ctx.send_rows, ctx.recv_rows, ctx.group = send_rows, recv_rows, group
        return _all_to_all(x, send_rows, recv_rows, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.recv_rows, ctx.send_rows, ctx.group), None, None, None


# --- pair 1: replicated input -> partial outputs (column-parallel in, row-parallel out) ---

def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: identity. Backward: all-reduce the gradient over ``group``.

    Put in front of work that each rank does on its own slice of a replicated input (a
    column-parallel matmul, or a replicated weight used on a sequence shard).
    """
    return x if tp_size(group) == 1 else _Copy.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: all-reduce (sum) over ``group``. Backward: identity."""
    return x if tp_size(group) == 1 else _Reduce.apply(x, group)


# --- pair 2: the last dimension ---

def scatter_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: keep this rank's chunk of the last dim. Backward: all-gather the last dim."""
    return x if tp_size(group) == 1 else _Scatter.apply(x, x.dim() - 1, group)


def gather_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: all-gather the last dim. Backward: keep this rank's chunk of the last dim."""
    return x if tp_size(group) == 1 else _Gather.apply(x, x.dim() - 1, group)


# --- pair 3 and 4: the sequence (first) dimension, for sequence parallelism ---

def scatter_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: keep this rank's chunk of dim 0 (no communication). Backward: all-gather dim 0.

    For an activation that is replicated over ``group`` entering the sequence-parallel region.
    """
    return x if tp_size(group) == 1 else _Scatter.apply(x, 0, group)


def gather_from_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: all-gather dim 0. Backward: keep this rank's chunk of dim 0.

    For leaving the sequence-parallel region into work that is replicated over ``group``
    (its gradient is the same on every rank).
    """
    return x if tp_size(group) == 1 else _Gather.apply(x, 0, group)


def all_gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: all-gather dim 0. Backward: reduce-scatter dim 0.

    In front of a column-parallel matmul: each rank's gradient of the gathered input is a partial
    sum over its output columns, so the backward sums them and hands each rank its sequence chunk.
    """
    return x if tp_size(group) == 1 else _GatherReduceScatter.apply(x, 0, group)


def reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: reduce-scatter dim 0 (sum partial outputs, keep our chunk). Backward: all-gather dim 0.

    After a row-parallel matmul under sequence parallelism (replaces ``reduce_from_tp``).
    """
    return x if tp_size(group) == 1 else _ReduceScatter.apply(x, 0, group)


def exchange_rows(x: torch.Tensor, send_rows: list[int], recv_rows: list[int], group) -> torch.Tensor:
    """Forward: all-to-all of dim-0 blocks (``send_rows[q]`` rows of ``x`` to rank q, ``recv_rows[q]`` from it,
    stacked in rank order). Backward: the same exchange the other way.

    For a reduce-scatter taken apart (parallel/chunked.py): each rank sends the partial sums it made for the
    others' sequence chunks and receives theirs for its own.
    """
    return _Exchange.apply(x, list(send_rows), list(recv_rows), group)


# --- pair 5: DeepSpeed-Ulysses, attention heads [b, s, n, d] ---

def _exchange_blocks(blocks: torch.Tensor, group) -> torch.Tensor:
    """blocks [sp, s, b, m, d]: block q goes to rank q; the result's block q is the one rank q sent us."""
    sp, s = blocks.shape[:2]
    return exchange_rows(blocks.reshape(sp * s, *blocks.shape[2:]), [s] * sp, [s] * sp, group).reshape(blocks.shape)


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: all-to-all from this rank's sequence slice with every head [b, s/sp, n, d] to the whole sequence
    with this rank's block of n/sp heads [b, s, n/sp, d]. Backward: ``heads_to_sequence``.

    Rank r gets heads r*n/sp .. (r+1)*n/sp - 1, so query head i keeps its kv head i // (nq/nkv) whenever nkv
    divides by sp."""
    sp = tp_size(group)
    if sp == 1:
        return x
    b, s, n, d = x.shape
    if n % sp:
        raise ValueError(f"cannot give {sp} sequence-parallel ranks whole heads of {n}")
    got = _exchange_blocks(x.reshape(b, s, sp, n // sp, d).permute(2, 1, 0, 3, 4), group)  # out: head block q
    return got.permute(2, 0, 1, 3, 4).reshape(b, sp * s, n // sp, d)  # in: rank q's slice of our heads


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Forward: the inverse all-to-all, [b, s, n/sp, d] (this rank's heads) to [b, s/sp, n, d] (this rank's
    sequence slice). Backward: ``sequence_to_heads``."""
    sp = tp_size(group)
    if sp == 1:
        return x
    b, full, m, d = x.shape
    if full % sp:
        raise ValueError(f"cannot split a sequence of {full} over {sp} sequence-parallel ranks")
    s = full // sp
    got = _exchange_blocks(x.reshape(b, sp, s, m, d).permute(1, 2, 0, 3, 4), group)  # out: sequence slice q
    return got.permute(2, 1, 0, 3, 4).reshape(b, s, sp * m, d)  # in: rank q's heads of our slice
