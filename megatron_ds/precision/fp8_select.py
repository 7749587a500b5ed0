"""Which FP8 engine runs, chosen from the flags. It sits above the engines (fp8_te.py, fp8_msamp.py,
fp8_torchao.py), which sit above the interface they implement (fp8.py).

--msamp (or --fp8-engine msamp) -> MS-AMP; --fp8-engine te / --transformer-impl transformer_engine ->
Transformer Engine; --fp8-engine torchao -> torchao; --fp8-engine auto (the default) -> Transformer Engine
where it can run here, else torchao.
"""

from __future__ import annotations

from megatron_ds.precision.fp8 import ENGINES, FP8Engine, fp8_options, fp8_requested


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


def engine_name(precision, transformer_impl: str) -> str:
    """Which engine the precision section selects (see the module docstring); auto resolves on this machine.
    ``transformer_impl``: the model section's --transformer-impl (transformer_engine asks for its FP8)."""
    if precision.msamp:
        return "msamp"
    if precision.fp8_engine != "auto":
        return precision.fp8_engine
    if transformer_impl == "transformer_engine":
        return "te"
    return "te" if engine_class("te")(fp8_options(precision)).missing() is None else "torchao"


def engine_for(precision, transformer_impl: str) -> FP8Engine | None:
    """The FP8 engine a PrecisionSettings asks for, or None without FP8."""
    if fp8_requested(precision) is None:
        return None
    return engine_class(engine_name(precision, transformer_impl))(fp8_options(precision))
