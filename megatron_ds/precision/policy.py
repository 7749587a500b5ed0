"""One seam for numeric precision: the DeepSpeed config section, the parameter dtype, and the FP8 engine
(None, or a torchao / Transformer Engine / MS-AMP engine: precision/fp8.py) that swaps the linear layers' GEMMs.

The training loop asks a Precision object and never branches on bf16/fp16/FP8 itself. FP8 runs beside
bf16 or fp16: parameters, master weights and DeepSpeed's sections are theirs, only the GEMMs are FP8.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_ds.precision.fp8 import FP8Engine
from megatron_ds.precision.fp8_select import engine_for


@dataclass(frozen=True)
class Precision:
    name: str  # "fp32" | "bf16" | "fp16"
    params_dtype: torch.dtype
    # fp16 loss scaling (Megatron flag meanings): static when loss_scale is set, else dynamic.
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    notes: tuple[str, ...] = field(default_factory=tuple)
    fp8: FP8Engine | None = None  # the engine that makes the transformer layers' GEMMs FP8

    def describe(self) -> str:
        """For the start-up line: 'bf16', or 'bf16 + FP8 torchao (float8 tensorwise ...)'."""
        return self.name if self.fp8 is None else f"{self.name} + FP8 {self.fp8.describe()}"

    @property
    def uses_loss_scaling(self) -> bool:
        return self.name == "fp16"

    def deepspeed_config(self) -> dict:
        """The bf16/fp16 sections DeepSpeed expects (both present so a user file cannot half-enable one)."""
        if self.name == "bf16":
            return {"bf16": {"enabled": True}, "fp16": {"enabled": False}}
        if self.name == "fp16":
            # DeepSpeed: loss_scale 0 means dynamic; initial_scale_power is log2 of the initial scale.
            power = max(0, int(round(torch.log2(torch.tensor(self.initial_loss_scale)).item())))
            return {
                "bf16": {"enabled": False},
                "fp16": {
                    "enabled": True,
                    "loss_scale": float(self.loss_scale or 0.0),
                    "initial_scale_power": power,
                    "loss_scale_window": self.loss_scale_window,
                    "hysteresis": self.hysteresis,
                    "min_loss_scale": self.min_loss_scale,
                },
            }
        return {"bf16": {"enabled": False}, "fp16": {"enabled": False}}

    def wrap_model(self, model: torch.nn.Module, state=None) -> torch.nn.Module:
        """FP8: the engine swaps the transformer layers' local GEMMs for its own (before DeepSpeed and before
        the first forward, so --torch-compile traces the FP8 modules).

        bf16/fp16/fp32 need nothing: DeepSpeed casts the module and keeps fp32 master weights.
        """
        return model if self.fp8 is None else self.fp8.convert(model, state)


def precision_from(precision, transformer_impl: str) -> Precision:
    """The Precision that a PrecisionSettings (arguments/settings.py) describes: --bf16 / --fp16 (or neither: fp32),
    the loss-scale flags and the FP8 engine (``transformer_impl``: the model section's, for --fp8-engine auto)."""
    common = dict(
        loss_scale=precision.loss_scale,
        initial_loss_scale=precision.initial_loss_scale,
        min_loss_scale=precision.min_loss_scale,
        loss_scale_window=precision.loss_scale_window,
        hysteresis=precision.hysteresis,
        fp8=engine_for(precision, transformer_impl),
    )
    if precision.bf16:
        return Precision("bf16", torch.bfloat16, **common)
    if precision.fp16:
        return Precision("fp16", torch.float16, **common)
    return Precision("fp32", torch.float32, **common)
