"""Cross entropy over vocabulary-parallel logits: the full-vocabulary logits never exist on one rank.

Each rank holds logits for its vocabulary slice [start, end). Three all-reduces of per-token
scalars (max, target logit, sum of exponentials) give the exact loss; the backward is local
(softmax minus one-hot on the slice).

Memory: the math is fp32, but bf16/fp16 logits are never copied to fp32 as a whole. The forward
works on chunks of tokens (fp32 temporaries of one chunk at a time) and keeps only per-token
scalars; the backward recomputes the softmax chunk by chunk from the saved logits (in their own
dtype) and writes the gradient straight into a tensor of that dtype. Chunking changes no number:
each token's reductions are the same whatever the chunk size. A caller that never reads the logits
again (the model's own loss) lets the backward write the gradient over them (``overwrite_logits``):
one logits-sized buffer less at the memory peak, 3 GiB for GPT-1.3B at micro batch 16, B x s x V x 2
bytes in general, more for large vocabularies.

Speed: on CUDA the two passes over the logits (sum of exponentials; softmax minus one-hot) run as
``torch.compile``d kernels over the whole tensor: each reads the logits once in their own dtype and
keeps the fp32 math in registers (measured on one H200 for 32768 tokens x 50304: see
bench/RESULTS.md). Elsewhere, or where compiling fails (reported once), the same functions run eagerly
on chunks, as they do on torch < 2.5. Both paths compute every element with the same formula.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.distributed as dist

from megatron_ds.compile_costs import FirstCallTimer
from megatron_ds.env_settings import FUSED_CROSS_ENTROPY
from megatron_ds.parallel.mappings import tp_rank, tp_size
from megatron_ds.torch_support import compile_problem

# Elements of fp32 working memory per chunk (64M = 256 MiB): large enough that a chunk is a few big
# kernels, small next to the logits of a real batch (16 x 2048 tokens x 50304 = 1.6G elements).
CHUNK_ELEMENTS = 1 << 26


def _all_reduce(x: torch.Tensor, op, group) -> torch.Tensor:
    if tp_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _row_chunks(n_rows: int, vocab_local: int, chunk_elements: int):
    step = max(1, chunk_elements // max(1, vocab_local))
    return [(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_logits: torch.Tensor, labels: torch.Tensor, group, chunk_elements: int,
                fused: bool, overwrite_logits: bool) -> torch.Tensor:
        ctx.fused, ctx.overwrite_logits = fused, overwrite_logits
        vocab_local = local_logits.size(-1)
        start = tp_rank(group) * vocab_local
        logits = local_logits.reshape(-1, vocab_local)  # a view for the contiguous logits a linear layer gives
        flat_labels = labels.reshape(-1)
        outside = (flat_labels < start) | (flat_labels >= start + vocab_local)
        local_labels = (flat_labels - start).masked_fill(outside, 0)
        chunks = _row_chunks(logits.size(0), vocab_local, chunk_elements)

        # max is exact in any float dtype; the subtractions below promote to fp32 inside the kernel
        max_logit = _all_reduce(logits.amax(dim=-1).float(), dist.ReduceOp.MAX, group)

        target = logits.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).float() - max_logit
        target = _all_reduce(target.masked_fill(outside, 0.0), dist.ReduceOp.SUM, group)

        sum_exp = _run_fused("sum_exp", logits, max_logit) if ctx.fused else None
        if sum_exp is None:
            sum_exp = torch.empty_like(max_logit)
            for a, b in chunks:  # out of place: the caller's logits are never modified (fp32 ones neither)
                sum_exp[a:b] = _sum_exp(logits[a:b], max_logit[a:b])
        _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
        loss = torch.log(sum_exp) - target

        ctx.save_for_backward(local_logits, max_logit, sum_exp, local_labels, outside)
        ctx.chunks = chunks
        return loss.view(labels.shape)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        local_logits, max_logit, sum_exp, local_labels, outside = ctx.saved_tensors
        logits = local_logits.reshape(-1, local_logits.size(-1))
        grad_loss = grad_loss.reshape(-1).float()
        scale = grad_loss / sum_exp  # softmax = exp(logit - max) / sum_exp, times the incoming gradient
        minus_hit = -(grad_loss * (~outside).float())
        # each element's gradient needs only that element's logit: written over it, nothing is read twice
        kernel = "softmax_minus_hit_over" if ctx.overwrite_logits else "softmax_minus_hit"
        grad = _run_fused(kernel, logits, max_logit, scale, local_labels, minus_hit) if ctx.fused else None
        if grad is None:
            grad = logits if ctx.overwrite_logits else torch.empty_like(logits)
            for a, b in ctx.chunks:  # d loss / d logit = softmax - one_hot(label), recomputed chunk by chunk
                grad[a:b] = _softmax_minus_hit(logits[a:b], max_logit[a:b], scale[a:b], local_labels[a:b],
                                               minus_hit[a:b])
        return grad.view(local_logits.shape), None, None, None, None, None


def _sum_exp(logits: torch.Tensor, max_logit: torch.Tensor) -> torch.Tensor:
    """Per row, sum(exp(logit - max)) in fp32. A bf16/fp16 - fp32 subtraction computes in fp32 (no fp32
    copy of the logits first) and is out of place."""
    return torch.sub(logits, max_logit.unsqueeze(-1)).exp().sum(dim=-1)


def _softmax_minus_hit(logits, max_logit, scale, local_labels, minus_hit) -> torch.Tensor:
    """exp(logit - max) * scale, plus minus_hit at each row's label column, in the logits' dtype."""
    probs = torch.sub(logits, max_logit.unsqueeze(-1)).exp() * scale.unsqueeze(-1)
    hit = torch.arange(logits.size(-1), device=logits.device) == local_labels.unsqueeze(-1)
    return torch.where(hit, probs + minus_hit.unsqueeze(-1), probs).to(logits.dtype)


def _softmax_minus_hit_over(logits, max_logit, scale, local_labels, minus_hit) -> torch.Tensor:
    """_softmax_minus_hit written over ``logits`` (compiled, one kernel that loads and stores each element in
    place: no temporary of the logits' size)."""
    return logits.copy_(_softmax_minus_hit(logits, max_logit, scale, local_labels, minus_hit))


@functools.lru_cache(maxsize=None)
def _compiled(name: str):
    """A kernel compiled once per process (the batch fixes the shapes: no recompiles)."""
    kernels = {"sum_exp": _sum_exp, "softmax_minus_hit": _softmax_minus_hit,
               "softmax_minus_hit_over": _softmax_minus_hit_over}
    return FirstCallTimer("cross entropy", torch.compile(kernels[name], dynamic=False))


_compile_failed = False


def fused_default(logits: torch.Tensor) -> bool:
    """Fused by default on CUDA; MDS_FUSED_CROSS_ENTROPY=0 turns it off, =1 forces it (tests on CPU)."""
    forced = FUSED_CROSS_ENTROPY.get()
    return logits.is_cuda if forced is None else forced


def _run_fused(name: str, *args) -> torch.Tensor | None:
    """The compiled kernel's result, or None (then the caller runs the eager chunks)."""
    global _compile_failed
    if _compile_failed or compile_problem():  # an older torch: the eager chunks
        return None
    try:
        return _compiled(name)(*args)
    except torch.cuda.OutOfMemoryError:  # (torch.OutOfMemoryError is newer than torch 2.1)
        raise
    except Exception as err:  # an inductor/triton problem must not stop training: the eager path is exact
        _compile_failed = True
        print(f"mds: fused cross entropy unavailable ({type(err).__name__}: {str(err).splitlines()[0][:200]}); "
              "using the chunked eager kernels", file=sys.stderr, flush=True)
        return None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, labels: torch.Tensor, group=None, *,
                                 chunk_elements: int = CHUNK_ELEMENTS, fused: bool | None = None,
                                 overwrite_logits: bool = False) -> torch.Tensor:
    """Per-token fp32 loss from logits split over the vocabulary.

    local_logits: [..., V/tp] (this rank's contiguous vocabulary slice, any float dtype);
    labels: [...] int64 global token ids. Returns [...] fp32, equal on every TP rank.
    Forward: three all-reduces of per-token scalars over ``group``. Backward: local, no communication.
    ``chunk_elements`` bounds the fp32 working memory of the eager path (tokens per chunk =
    chunk_elements // (V/tp)); ``fused`` (default: ``fused_default``) uses the compiled kernels.
    ``overwrite_logits``: the backward writes the gradient over ``local_logits`` (a non-leaf that the caller
    never reads again) instead of into a new tensor of their size. A second backward through the same graph
    then fails with autograd's in-place error rather than computing from overwritten values.
    """
    fused = fused_default(local_logits) if fused is None else fused
    if overwrite_logits and local_logits.is_leaf and local_logits.requires_grad:  # (no backward, nothing written)
        raise ValueError("overwrite_logits needs logits computed in the graph (a leaf tensor's values are the "
                         "caller's, and its .grad would share their memory)")
    return _VocabParallelCrossEntropy.apply(local_logits, labels, group, chunk_elements, fused, overwrite_logits)
