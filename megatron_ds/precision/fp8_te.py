"""Transformer Engine FP8 (``transformer_engine.pytorch``): the NGC image's engine. Selection and validation only.

Selected by --fp8-engine te or --transformer-impl transformer_engine (and by auto where it can run).
mds does not drive Transformer Engine yet (swapping each LocalGEMM for ``te.Linear`` with the same
weight and running it under ``fp8_autocast`` with a ``DelayedScaling`` recipe built from --fp8-format,
--fp8-margin, --fp8-interval, --fp8-amax-history-len, --fp8-amax-compute-algo): until it does, a run
that selects it is refused at validation with the reason, and auto picks torchao.
"""

from __future__ import annotations

import importlib.util

from torch import nn

from megatron_ds.precision.fp8 import FP8Engine


def installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


class TransformerEngine(FP8Engine):
    name = "te"

    def missing(self) -> str | None:
        if not installed():
            return ("Transformer Engine is not installed (transformer_engine is not importable); it ships in the "
                    "NGC PyTorch image; or use --fp8-engine torchao")
        return ("Transformer Engine is installed, but mds does not drive it yet (FP8 through Transformer Engine is "
                "planned, issue 14); use --fp8-engine torchao")

    def convert(self, model: nn.Module) -> nn.Module:
        raise RuntimeError(self.missing())

    def describe(self) -> str:
        o = self.options
        return (f"te (Transformer Engine delayed scaling, {o.format}, margin {o.margin}, amax history "
                f"{o.amax_history_len}, {o.amax_compute_algo})")
