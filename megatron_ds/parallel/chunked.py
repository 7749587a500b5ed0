"""Sequence-parallel GEMMs split by the ranks' sequence chunks, so each collective runs beside a GEMM
(``--tp-comm-overlap chunked``).

Under sequence parallelism every forward collective feeds, or is fed by, its own GEMM: the all-gather in front of
a column-parallel linear and the reduce-scatter behind a row-parallel one. Nothing else is independent of them,
so ``reorder`` cannot hide them (bench/RESULTS.md: ~25 ms of a 400 ms GPT-6.7B TP=2 step). Taken
apart by sequence chunk, each has a GEMM that does not need it:

- gather -> GEMM: this rank's chunk is here already. Its GEMM runs while the all-gather brings the others'
  chunks, whose GEMMs follow; the outputs land in rank order (inductor writes each GEMM into its slice of one
  buffer, no copy).
- GEMM -> reduce-scatter: first the partial sums for the other ranks' chunks, sent by an all-to-all while the
  GEMM for this rank's own chunk runs; then the partials received are added to it.

The same GEMMs on the same rows and the same sums (in another order), so the same model. The schedule comes from
inductor's reordering passes (the ``reorder`` ones; parallel/overlap.py), which issue each collective early and
wait late: the code below only puts an independent GEMM where they can use it. Autograd takes both apart the
same way in backward (the exchange's gradient is the reverse exchange, run beside the own chunk's GEMMs).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_ds.parallel.mappings import all_gather_sequence, exchange_rows, tp_rank, tp_size

Gemm = Callable[[torch.Tensor], torch.Tensor]


def gather_then_gemm(x: torch.Tensor, gemm: Gemm, group) -> torch.Tensor:
    """``gemm(all_gather(x))`` over dim 0 with this rank's chunk computed while the others arrive.
    x: this rank's [s/tp, ...] sequence chunk; returns the [s, ...] output."""
    n, me = tp_size(group), tp_rank(group)
    if n == 1:
        return gemm(x)
    gathered = all_gather_sequence(x, group)  # its wait sinks to the first GEMM that reads it
    own = gemm(x)  # needs no communication: runs while the others' chunks arrive
    rows = x.size(0)
    return torch.cat([own if q == me else gemm(gathered[q * rows:(q + 1) * rows]) for q in range(n)])


def gemm_then_scatter(x: torch.Tensor, gemm: Gemm, group) -> torch.Tensor:
    """``reduce_scatter(gemm(x))`` over dim 0 with the exchange of partial sums beside this rank's own GEMM.
    x: the full [s, ...] input; returns the summed [s/tp, ...] chunk of this rank."""
    n, me = tp_size(group), tp_rank(group)
    if n == 1:
        return gemm(x)
    if x.size(0) % n:
        raise ValueError(f"cannot reduce-scatter dim 0 of size {x.size(0)} over {n} tensor-parallel ranks")
    rows = x.size(0) // n
    chunks = x.split(rows)
    others = [q for q in range(n) if q != me]
    parts = [gemm(chunks[q]) for q in others]  # this rank's columns' partial sums for the others' chunks
    partials = parts[0] if n == 2 else torch.cat(parts)
    counts = [0 if q == me else rows for q in range(n)]
    received = exchange_rows(partials, counts, counts, group)  # theirs for this rank's chunk, in rank order
    own = gemm(chunks[me])
    return own + received.unflatten(0, (n - 1, rows)).sum(0)
