"""Cross entropy over vocabulary-parallel logits: the full-vocabulary logits never exist on one rank.

Each rank holds logits for its vocabulary slice [start, end). Three all-reduces of per-token
scalars (max, target logit, sum of exponentials) give the exact loss; the backward is local
(softmax minus one-hot on the slice).

Memory: the math is fp32, but bf16/fp16 logits are never copied to fp32 as a whole. The forward
works on chunks of tokens (fp32 temporaries of one chunk at a time) and keeps only per-token
scalars; the backward recomputes the softmax chunk by chunk from the saved logits (in their own
dtype) and writes the gradient straight into a tensor of that dtype. Chunking changes no number:
each token's reductions are the same whatever the chunk size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ds.parallel.layers import tp_rank, tp_size

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
    def forward(ctx, local_logits: torch.Tensor, labels: torch.Tensor, group, chunk_elements: int) -> torch.Tensor:
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

        sum_exp = torch.empty_like(max_logit)
        for a, b in chunks:  # out of place: the caller's logits are never modified (fp32 ones neither)
            sum_exp[a:b] = _shifted(logits[a:b], max_logit[a:b]).exp_().sum(dim=-1)
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
        grad = torch.empty_like(logits)
        for a, b in ctx.chunks:  # d loss / d logit = softmax - one_hot(label), recomputed chunk by chunk
            probs = _shifted(logits[a:b], max_logit[a:b]).exp_().mul_(scale[a:b, None])
            probs.scatter_add_(-1, local_labels[a:b, None], minus_hit[a:b, None])
            grad[a:b] = probs
        return grad.view(local_logits.shape), None, None, None


def _shifted(logits: torch.Tensor, max_logit: torch.Tensor) -> torch.Tensor:
    """fp32 (logits - max) in one kernel: a bf16/fp16 - fp32 subtraction computes in fp32 (no fp32 copy
    of the logits first), and is out of place."""
    return torch.sub(logits, max_logit.unsqueeze(-1))


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, labels: torch.Tensor, group=None, *,
                                 chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """Per-token fp32 loss from logits split over the vocabulary.

    local_logits: [..., V/tp] (this rank's contiguous vocabulary slice, any float dtype);
    labels: [...] int64 global token ids. Returns [...] fp32, equal on every TP rank.
    Forward: three all-reduces of per-token scalars over ``group``. Backward: local, no communication.
    ``chunk_elements`` bounds the fp32 working memory (tokens per chunk = chunk_elements // (V/tp)).
    """
    return _VocabParallelCrossEntropy.apply(local_logits, labels, group, chunk_elements)
