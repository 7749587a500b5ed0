"""What the installed torch can do for us, decided once and named in errors (the MS-AMP image runs torch 2.1)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def compile_problem() -> str | None:
    """Why torch.compile of our layers and kernels cannot be used with this torch, or None.

    One compiled graph shared by every layer needs dynamo's inlining of nn modules (default from torch
    2.5); torch 2.1's inductor fails on the layer outright. Tested: 2.11 (CUDA) and 2.13 (CPU).
    """
    major, minor = (int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if (major, minor) < (2, 5):
        return (f"needs torch >= 2.5 (found {torch.__version__}): one compiled graph shared by every layer needs "
                "dynamo's inlining of nn modules, and torch 2.1's inductor fails on this layer")
    return None
