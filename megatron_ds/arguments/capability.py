"""What this machine and the flags allow, read by the derivations (resolver.py) and the rules (rules.py) alike:
a CUDA GPU, the FP8 engine, whether mds compiles the layers."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_ds.parallel.state import ParallelDims


def cuda_gpu_visible() -> bool:
    """A CUDA build of torch and an NVIDIA GPU for this process, found without initialising CUDA (the launcher
    validates before it spawns the ranks)."""
    import torch

    from megatron_ds.runtime.bootstrap import visible_gpus

    return torch.version.cuda is not None and visible_gpus() > 0


def fp8_engine(args: argparse.Namespace) -> str | None:
    """The FP8 engine the flags select (auto resolved on this machine), None without FP8."""
    from megatron_ds.precision.fp8 import fp8_requested
    from megatron_ds.precision.fp8_select import engine_name

    return engine_name(args, args.transformer_impl) if fp8_requested(args) is not None else None


def compile_off_reason(args: argparse.Namespace, dims: ParallelDims) -> str | None:
    """Why mds does not compile the layers of this layout, or None: the one list behind both the default
    (eager there, with one notice) and the refusal of an explicit --torch-compile (same words)."""
    from megatron_ds.torch_support import compile_problem

    if (why := compile_problem(dims.tp)) is not None:
        return why
    file_zero = (getattr(args, "ds_config_file", None) or {}).get("zero_optimization") or {}  # set in validate
    if args.zero_stage == 3 and file_zero.get("memory_efficient_linear", False):
        return ("not with zero_optimization.memory_efficient_linear true in --deepspeed_config (dynamo traces "
                "ZeRO-3's linear autograd Function wrongly: input gradients lost; mds sets it false when compiling)")
    if fp8_engine(args) == "msamp":
        return "not with MS-AMP (its FP8 weights are ScalingTensor objects, not torch tensors)"
    return None
