"""Random streams that differ per tensor-parallel rank, without a separate state to checkpoint.

Every TP rank shares the default RNG (same seed), which is what replicated work needs: the same
dropout mask on the same activations. Work on this rank's own slice (dropout on its attention
heads) needs independent randomness, else heads h and h + nq/tp share one mask pattern.

``tp_rank_rng`` derives a per-rank seed from one draw of the shared CPU generator and runs the
block on a forked copy of the RNG. The derived stream is a pure function of the shared state, so
torch's activation checkpointing (which saves and restores the default CPU and device RNG
states) replays it exactly, and the shared stream advances the same on every rank.
"""

from __future__ import annotations

import contextlib

import torch

from megatron_ds.parallel.mappings import tp_rank, tp_size

_RANK_STRIDE = 2718  # keeps the derived seeds of neighbouring ranks apart (any odd constant would do)


@contextlib.contextmanager
def tp_rank_rng(group, device: torch.device | None = None):
    """Within the block, the default generators of the CPU and ``device`` follow a stream private to
    this TP rank; after it, they continue the shared stream (one CPU draw further on every rank).
    A no-op without a group or at TP=1. Seeding cannot be traced: compiled code calls it eagerly."""
    if tp_size(group) == 1:
        yield
        return
    base = int(torch.randint(0, 2**62, (1,)).item())  # from the shared CPU stream: equal on all ranks
    seed = (base + _RANK_STRIDE * (tp_rank(group) + 1)) % 2**63
    cuda = device is not None and device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else [], enabled=True):
        torch.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield
