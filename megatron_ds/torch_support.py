"""What the installed torch can do for us, decided once and named in errors (the MS-AMP image runs torch 2.1)."""

from __future__ import annotations

import functools

import torch

from megatron_ds.env_settings import ALLOW_TP_COMPILE, TP_COLLECTIVES

_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def torch_version() -> tuple[int, int]:
    """(major, minor) of the installed torch (a constant: compiled code may call it)."""
    return _VERSION


@functools.lru_cache(maxsize=None)
def _torch_problem() -> str | None:
    if torch_version() < (2, 5):
        return (f"needs torch >= 2.5 (found {torch.__version__}): one compiled graph shared by every layer needs "
                "dynamo's inlining of nn modules, and torch 2.1's inductor fails on this layer")
    return None


def compile_problem(tp: int = 1) -> str | None:
    """Why torch.compile of our layers (and, with tp=1, kernels) cannot be used here, or None.

    One compiled graph shared by every layer needs dynamo's inlining of nn modules (default from torch
    2.5); torch 2.1's inductor fails on the layer outright. Tested: 2.11 (CUDA) and 2.13 (CPU).
    Tensor-parallel layers compile with torch's functional collectives (parallel/mappings.py): with the
    in-place c10d ones, torch 2.11 routes the gradients of our autograd Functions wrongly (pytorch#180642;
    TP=2 trained 9.4e-2 off eager on 2 x H200), so forcing those (MDS_TP_COLLECTIVES=inplace) refuses TP > 1.
    tests/gpu test_tp_compile_matches_eager: TP=2 and TP=2+SP compiled within 1.7e-3 of eager on 2 x H200.
    """
    if _torch_problem() is not None:
        return _torch_problem()
    if tp > 1 and TP_COLLECTIVES.get() == "inplace" and not ALLOW_TP_COMPILE.get():
        return (f"not with --tensor-model-parallel-size {tp} and {TP_COLLECTIVES.name}=inplace: torch mis-routes the "
                "gradients of in-place collectives inside compiled autograd Functions (pytorch#180642)")
    return None
