"""Which FP8 engine runs, chosen from the flags. It sits above the engines (fp8_te.py, fp8_msamp.py,
fp8_torchao.py), which sit above the interface they implement (fp8.py).

--msamp (or --fp8-engine msamp) -> MS-AMP; --fp8-engine te / --transformer-impl transformer_engine ->
Transformer Engine; --fp8-engine torchao -> torchao; --fp8-engine auto (the default) -> Transformer Engine
where it can run here, else torchao.
"""

from __future__ import annotations

import argparse

from megatron_ds.precision.fp8 import ENGINES, FP8Engine, fp8_requested, options_from_args


def engine_class(name: str) -> type[FP8Engine]:
    if name == "torchao":
        from megatron_ds.precision.fp8_torchao import TorchaoEngine
        return TorchaoEngine
    if name == "te":
        from megatron_ds.precision.fp8_te import TransformerEngine
        return TransformerEngine
    if name == "msamp":
        from megatron_ds.precision.fp8_msamp import MSAMPEngine
        return MSAMPEngine
    raise ValueError(f"unknown FP8 engine {name!r}; one of {ENGINES}")


def engine_name(args: argparse.Namespace) -> str:
    """Which engine the flags select (see the module docstring); auto resolves on this machine."""
    if args.msamp:
        return "msamp"
    if args.fp8_engine != "auto":
        return args.fp8_engine
    if args.transformer_impl == "transformer_engine":
        return "te"
    options = options_from_args(args)
    return "te" if engine_class("te")(options).missing() is None else "torchao"


def engine_from_args(args: argparse.Namespace) -> FP8Engine | None:
    """The FP8 engine the flags ask for, or None without FP8."""
    if fp8_requested(args) is None:
        return None
    return engine_class(engine_name(args))(options_from_args(args))
