"""Every random number generator a rank uses, captured and restored so that resume is exact.

Dropout masks and data shuffles after a resume must be the ones the uninterrupted run drew:
python's ``random``, numpy's global generator, torch's CPU generator, every CUDA device's
generator, and the model's tensor-parallel RNG tracker when the model has one. Each rank keeps its
own states (TP ranks draw different dropout masks), so each rank writes a small file of its own.
"""

from __future__ import annotations

import importlib
import random

import numpy as np
import torch


def rng_file_name(rank: int) -> str:
    return f"mds_rng_rank{rank:05d}.pt"


def _tracker():
    """The model's TP RNG tracker (an object with get_states/set_states), if the model defines one."""
    for module_name in ("megatron_ds.parallel.random", "megatron_ds.model.random"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        getter = getattr(module, "get_rng_tracker", None) or getattr(module, "get_cuda_rng_tracker", None)
        if getter is not None:
            tracker = getter()
            if hasattr(tracker, "get_states") and hasattr(tracker, "set_states"):
                return tracker
    return None


def capture() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    tracker = _tracker()
    if tracker is not None:
        state["tracker"] = tracker.get_states()
    return state


def restore(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    tracker = _tracker()
    if tracker is not None and state.get("tracker") is not None:
        tracker.set_states(state["tracker"])
