"""Cross entropy over vocabulary-parallel logits: the full-vocabulary logits never exist on one rank.

Each rank holds logits for its vocabulary slice [start, end). Three all-reduces of per-token
scalars (max, target logit, sum of exponentials) give the exact loss; the backward is local
(softmax minus one-hot on the slice). Work is done in fp32 on one working copy of the local logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ds.parallel.layers import tp_rank, tp_size


def _all_reduce(x: torch.Tensor, op, group) -> torch.Tensor:
    if tp_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_logits: torch.Tensor, labels: torch.Tensor, group) -> torch.Tensor:
        vocab_local = local_logits.size(-1)
        start = tp_rank(group) * vocab_local
        # One fp32 working copy (a no-op cast for fp32 input is followed by an out-of-place subtract,
        # so the caller's tensor is never modified).
        logits = local_logits.float()
        max_logit = _all_reduce(logits.max(dim=-1).values, dist.ReduceOp.MAX, group)
        logits = logits - max_logit.unsqueeze(-1) if logits is local_logits else logits.sub_(max_logit.unsqueeze(-1))

        outside = (labels < start) | (labels >= start + vocab_local)
        local_labels = (labels - start).masked_fill(outside, 0)
        target = logits.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        target = _all_reduce(target, dist.ReduceOp.SUM, group)

        probs = logits.exp_()
        sum_exp = _all_reduce(probs.sum(dim=-1), dist.ReduceOp.SUM, group)
        loss = torch.log(sum_exp) - target
        probs.div_(sum_exp.unsqueeze(-1))  # softmax over the full vocabulary, our slice of it

        ctx.save_for_backward(probs, local_labels, outside)
        ctx.input_dtype = local_logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        probs, local_labels, outside = ctx.saved_tensors
        grad = probs  # d loss / d logit = softmax - one_hot(label); reuse the saved buffer
        hit = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -hit.unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, labels: torch.Tensor, group=None) -> torch.Tensor:
    """Per-token fp32 loss from logits split over the vocabulary.

    local_logits: [..., V/tp] (this rank's contiguous vocabulary slice, any float dtype);
    labels: [...] int64 global token ids. Returns [...] fp32, equal on every TP rank.
    Forward: three all-reduces of per-token scalars over ``group``. Backward: local, no communication.
    The backward reuses the saved softmax in place, so it may run only once (no retain_graph).
    """
    return _VocabParallelCrossEntropy.apply(local_logits, labels, group)
