"""Every random number generator a rank uses, captured and restored so that resume is exact.

Dropout masks after a resume must be the ones the uninterrupted run drew. A rank's randomness
lives in four global generators, and these are what we capture: python's ``random``, numpy's
global generator, torch's default CPU generator and every CUDA device's default generator.

That is all there is. The per-tensor-parallel-rank streams (dropout on this rank's attention heads)
keep no state of their own: ``megatron_ds.parallel.random.tp_rank_rng`` derives each one, per call,
from one draw of the default CPU generator and runs on a forked copy, so restoring the default
generators restores them too. (Weights are initialised from generators seeded by parameter name,
and the data order is a function of the seed and the consumed samples: neither needs saving.)
Pipeline stages are seeded apart (seed + 100 x stage) and a rank's CUDA states are its own, so each
rank writes and restores a small file of its own.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def rng_file_name(rank: int) -> str:
    return f"mds_rng_rank{rank:05d}.pt"


def capture() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def restore(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
