"""One seam for numeric precision: the DeepSpeed config section, the parameter dtype, and the place
where FP8 (Transformer Engine / MS-AMP) will later wrap the linear layers.

The training loop asks a Precision object and never branches on bf16/fp16 itself, so adding FP8 means
adding a Precision here, not touching the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Hook for FP8: a Transformer Engine / MS-AMP precision swaps or wraps linears here.

        bf16/fp16/fp32 need nothing: DeepSpeed casts the module and keeps fp32 master weights.
        """
        return model


def from_args(args) -> Precision:
    """The Precision that --bf16 / --fp16 (or neither: fp32) and the loss-scale flags describe."""
    common = dict(
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
    )
    if args.bf16:
        return Precision("bf16", torch.bfloat16, **common)
    if args.fp16:
        return Precision("fp16", torch.float16, **common)
    return Precision("fp32", torch.float32, **common)
