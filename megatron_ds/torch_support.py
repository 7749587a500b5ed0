"""What the installed torch can do for us, decided once and named in errors (the MS-AMP image runs torch 2.1)."""

from __future__ import annotations

import functools
import os

import torch

ALLOW_TP_COMPILE = "MDS_ALLOW_TP_COMPILE"  # test switch: =1 lifts the TP > 1 refusal below (GPU tests, the probe)


@functools.lru_cache(maxsize=None)
def _torch_problem() -> str | None:
    major, minor = (int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if (major, minor) < (2, 5):
        return (f"needs torch >= 2.5 (found {torch.__version__}): one compiled graph shared by every layer needs "
                "dynamo's inlining of nn modules, and torch 2.1's inductor fails on this layer")
    return None


def compile_problem(tp: int = 1) -> str | None:
    """Why torch.compile of our layers (and, with tp=1, kernels) cannot be used here, or None.

    One compiled graph shared by every layer needs dynamo's inlining of nn modules (default from torch
    2.5); torch 2.1's inductor fails on the layer outright. Tested: 2.11 (CUDA) and 2.13 (CPU).
    Layers with tensor-parallel collectives compiled on CUDA trained off the TP=1 loss curve (tests/gpu:
    tp2_compile and tp2_sp_compile 9.4e-2 off on 2 x H200, torch 2.11, with the in-place c10d collectives
    that parallel/mappings.py no longer uses: pytorch#180642, a torch 2.11 regression reproduced on CPU);
    refused until a 2-GPU run of those tests passes.
    MDS_ALLOW_TP_COMPILE=1 lifts that refusal, for those tests and bench/compile_tp_probe.py only.
    """
    if _torch_problem() is not None:
        return _torch_problem()
    if tp > 1 and os.environ.get(ALLOW_TP_COMPILE) != "1":
        return (f"not with --tensor-model-parallel-size {tp} yet: compiled tensor-parallel layers trained off the "
                "TP=1 loss curve on 2 x H200 with torch 2.11 (pytorch#180642; mds now avoids it, pending a 2-GPU "
                "test); it works with data, pipeline and ZeRO parallelism")
    return None
