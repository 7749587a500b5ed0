"""FP8 training: the options the Megatron / MS-AMP flags give and the interface every engine implements.

An engine makes the local matrix multiplies of the transformer layers FP8: the ``local`` child
(``LocalGEMM``, a plain ``nn.Linear``) of every column/row-parallel linear inside a TransformerLayer.
The tensor-parallel communication around it, the embedding, the output head and the norms stay in
the high precision (--bf16 / --fp16). We write no FP8 GEMM or scaling code: the engines are the
libraries' (fp8_torchao.py, fp8_te.py, fp8_msamp.py), each behind the small interface below;
fp8_select.py, above them all, chooses the one that runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

ENGINES = ("te", "msamp", "torchao")
# torch._scaled_mm (torchao) and Transformer Engine need every GEMM dimension to be a multiple of 16.
FP8_DIM_MULTIPLE = 16
# FP8 tensor-core GEMMs: Ada (8.9) and Hopper (9.0) and later.
FP8_GEMM_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class FP8Options:
    """What the FP8 flags say, with Megatron-LM's meanings and defaults."""

    format: str = "hybrid"  # e4m3: e4m3 everywhere; hybrid: e4m3 forward, e5m2 gradients
    margin: int = 0  # delayed scaling: scale = 2^-margin x max / amax (Transformer Engine)
    interval: int = 1  # delayed scaling: steps between scale updates (Transformer Engine; deprecated upstream)
    amax_history_len: int = 1  # delayed scaling: amax values remembered (Transformer Engine)
    amax_compute_algo: str = "most_recent"  # delayed scaling: most_recent | max over that history
    recipe: str | None = None  # --fp8-recipe as given (None: the engine's own; TE delayed, torchao tensorwise)
    msamp_opt_level: str = "O2"  # MS-AMP: O1 FP8 weights/grads, O2 + low-bit Adam moments, O3 + FP8 ZeRO


class FP8Engine:
    """One FP8 library behind the seam. Subclasses set ``name`` and implement ``missing`` and ``convert``."""

    name = "?"
    needs_fp8_gemm = True  # False where the engine runs (with higher-precision GEMMs) on GPUs without FP8 ones

    def __init__(self, options: FP8Options):
        self.options = options

    def missing(self) -> str | None:
        """What this machine lacks to run the engine (a library, a version), or None when it can run."""
        raise NotImplementedError

    def convert(self, model: nn.Module, state=None) -> nn.Module:
        """Swap the local GEMMs of ``model`` (``local_gemms``) for the engine's FP8 linears. ``state``: the
        run's ParallelState (None in a single process), for an engine that communicates while converting."""
        raise NotImplementedError

    def build_optimizer(self, param_groups: list[dict], lr: float, betas: tuple[float, float],
                        eps: float) -> torch.optim.Optimizer | None:
        """The engine's own optimizer over ``param_groups`` (MS-AMP: LBAdamW), or None for mds's AdamW."""
        return None

    def deepspeed_initialize(self):
        """The function that builds the DeepSpeed engine: ``deepspeed.initialize`` unless the engine brings its
        own integration (MS-AMP: ``msamp.deepspeed.initialize``), with the same keyword arguments."""
        import deepspeed

        return deepspeed.initialize

    def describe(self) -> str:
        """For the start-up line: the engine and its recipe."""
        return self.name

    def notes(self, given: set[str]) -> list[str]:
        """Start-up notes for the flags (``given``: those on the command line) this engine ignores."""
        return []


def local_gemms(model: nn.Module) -> dict[str, nn.Module]:
    """{qualified name: LocalGEMM} for the parallel linears inside transformer layers (not the output head)."""
    from megatron_ds.model.gpt import TransformerLayer
    from megatron_ds.parallel.layers import ColumnParallelLinear, LocalGEMM, RowParallelLinear

    inside = set()
    for layer in model.modules():
        if isinstance(layer, TransformerLayer):
            inside.update(id(m.local) for m in layer.modules()
                          if isinstance(m, (ColumnParallelLinear, RowParallelLinear)))
    return {name: m for name, m in model.named_modules() if id(m) in inside and isinstance(m, LocalGEMM)}


def fp8_gemm_refusal(capability: tuple[int, int] | None) -> str | None:
    """Why a device of this compute capability (None: no GPU) cannot run FP8 GEMMs, or None when it can."""
    if capability is None:
        return "no GPU is visible: FP8 matrix multiplies need a GPU of compute capability >= 8.9 (Ada, Hopper)"
    if tuple(capability) < FP8_GEMM_CAPABILITY:
        return (f"the GPU has compute capability {capability[0]}.{capability[1]}; FP8 matrix multiplies need "
                ">= 8.9 (Ada, Hopper or later)")
    return None


def fp8_options(precision) -> FP8Options:
    """The FP8 options of a PrecisionSettings (arguments/settings.py), or of the flags while validation checks them:
    the same names, so this layer needs neither."""
    return FP8Options(format=precision.fp8_format or "hybrid", margin=precision.fp8_margin,
                      interval=precision.fp8_interval, amax_history_len=precision.fp8_amax_history_len,
                      amax_compute_algo=precision.fp8_amax_compute_algo, recipe=precision.fp8_recipe,
                      msamp_opt_level=precision.msamp_opt_level)


def fp8_requested(precision) -> str | None:
    """The flag that turned FP8 on (--fp8-format, --fp8-e4m3, --fp8-hybrid, --msamp), or None for no FP8
    (``precision``: the precision section, or the flags during validation)."""
    if precision.msamp:
        return "--msamp"
    if precision.fp8_engine == "msamp":
        return "--fp8-engine"
    if precision.fp8_format is not None:
        return precision.fp8_format_flag or "--fp8-format"
    return None


def device_capability() -> tuple[int, int] | None:
    """Compute capability of the first visible GPU, None without one; never initialises CUDA in this process
    (the launcher validates before it spawns the ranks): nvidia-smi, else a child Python asks torch."""
    import shutil
    import subprocess
    import sys

    from megatron_ds.runtime.bootstrap import visible_gpus

    if visible_gpus() == 0:
        return None
    if torch.cuda.is_initialized():
        return torch.cuda.get_device_capability()
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=60).stdout.split()
            major, minor = out[0].split(".")
            return int(major), int(minor)
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            pass
    probe = ("import torch; c = torch.cuda.get_device_capability() if torch.cuda.is_available() else None; "
             "print('%d %d' % c if c else 'none')")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300).stdout.split()
    return (int(out[0]), int(out[1])) if len(out) == 2 else None
