"""Transformer Engine FP8 (``transformer_engine.pytorch``): the NGC image's engine.

Selected by --fp8-engine te, --transformer-impl transformer_engine, or auto where it imports. Each
LocalGEMM becomes a ``te.Linear`` of the same shape holding the same Parameter objects (our seeded,
TP-sliced weights; TE's own initialisation is overwritten), whose forward runs under ``fp8_autocast``
with a ``DelayedScaling`` recipe built from --fp8-format, --fp8-margin, --fp8-amax-history-len and
--fp8-amax-compute-algo (--fp8-interval only where the installed TE still takes it). TE's tensor
parallelism stays off (tp_size 1): our layers do the communication.

Amax reduction is off (``reduce_amax=False`` where TE has it): each GPU keeps its own amax history,
so no collective runs per GEMM and pipeline stages never wait on each other. TE saves that history
and the scales as ``<layer>.local._extra_state`` in the model's state dict, so checkpoints restore them
(DeepSpeed writes data-parallel rank 0's model states: the other data-parallel ranks resume with its history).

The names used here are listed in ``TE_API`` and checked against TE's sources by tests/precision/test_te_api.py:
TE 1.13 (the NGC image's, in `make test`) and TE 1.1 (the MS-AMP image's, marked upstream_src), which has them all.
In TE 1.1 the extra state is a pickled ``io.BytesIO`` (later versions: a uint8 tensor of pickled bytes, which TE 2.x
loads only with NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1: see ``checkpoint_pickle_trusted``); both load through
DeepSpeed's strict module load, and the weight exporters leave it out (checkpoint/shards.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import inspect
import os

import torch
from torch import nn

from megatron_ds.precision.fp8 import FP8Engine, local_gemms

# Every Transformer Engine name megatron_ds uses: module -> {attribute: keyword arguments used}.
TE_API = {
    "transformer_engine.pytorch": {"Linear": ("in_features", "out_features", "bias", "params_dtype", "device"),
                                   "fp8_autocast": ("enabled", "fp8_recipe")},
    "transformer_engine.common.recipe": {"DelayedScaling": ("margin", "fp8_format", "amax_history_len",
                                                            "amax_compute_algo", "interval", "reduce_amax"),
                                         "Format": ("E4M3", "HYBRID")},
}


# TE >= 2.x refuses to unpickle its delayed-scaling state (amax history and scales, stored as a pickle inside the
# `_extra_state` tensor) unless this is "1". That state reaches it only from a checkpoint's model-states file, which
# DeepSpeed and mds read with torch.load(weights_only=False): the whole file, the pickle in it included, was already
# unpickled and trusted. So the opt-in is set only while TE reads the state in a load, never for the process.
UNSAFE_PICKLE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"


@contextlib.contextmanager
def checkpoint_pickle_trusted():
    before = os.environ.get(UNSAFE_PICKLE_ENV)
    os.environ[UNSAFE_PICKLE_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[UNSAFE_PICKLE_ENV]
        else:
            os.environ[UNSAFE_PICKLE_ENV] = before


def installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def _accepts(cls, name: str) -> bool:
    if dataclasses.is_dataclass(cls):
        return name in {f.name for f in dataclasses.fields(cls)}
    return name in inspect.signature(cls).parameters


class TransformerEngine(FP8Engine):
    name = "te"

    def missing(self) -> str | None:
        if not installed():
            return ("Transformer Engine is not installed (transformer_engine is not importable); it ships in the "
                    "NGC PyTorch image; or use --fp8-engine torchao")
        try:
            import transformer_engine.pytorch  # noqa: F401
        except Exception as exc:
            return f"Transformer Engine is installed but does not import ({type(exc).__name__}: {exc})"
        return None

    def recipe(self):
        """TE's DelayedScaling from the Megatron flags."""
        from transformer_engine.common.recipe import DelayedScaling, Format

        o = self.options
        kwargs = dict(margin=o.margin, fp8_format=Format.E4M3 if o.format == "e4m3" else Format.HYBRID,
                      amax_history_len=o.amax_history_len, amax_compute_algo=o.amax_compute_algo)
        if o.interval != 1 and _accepts(DelayedScaling, "interval"):  # deprecated and unused in TE >= 1.8
            kwargs["interval"] = o.interval
        if _accepts(DelayedScaling, "reduce_amax"):
            kwargs["reduce_amax"] = False
        return DelayedScaling(**kwargs)

    def convert(self, model: nn.Module, state=None) -> nn.Module:
        import transformer_engine.pytorch as te

        recipe = self.recipe()

        class AutocastLinear(te.Linear):
            """te.Linear whose forward (and an activation-recompute replay of it) runs under fp8_autocast. Under
            --torch-compile dynamo leaves it out of the layer's graph (it cannot trace TE's autocast state and
            kernels): the graph breaks at each GEMM, and the norms, attention, GeLU, dropout and residual adds
            between them still compile."""

            @torch.compiler.disable
            def forward(self, x, *args, **kwargs):
                with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
                    return super().forward(x, *args, **kwargs)

            def set_extra_state(self, state):
                with checkpoint_pickle_trusted():
                    return super().set_extra_state(state)

        takes_device = _accepts(te.Linear, "device")
        for name, gemm in local_gemms(model).items():
            parent_name, _, child = name.rpartition(".")
            weight, bias = gemm.weight, gemm.bias
            extra = {"device": weight.device} if takes_device else {}
            layer = AutocastLinear(gemm.in_features, gemm.out_features, bias=bias is not None,
                                   params_dtype=weight.dtype, **extra)
            layer.weight = weight  # ours: seeded, TP-sliced, with its partition attributes
            if bias is not None:
                layer.bias = bias
            setattr(model.get_submodule(parent_name), child, layer)
        return model

    def describe(self) -> str:
        o = self.options
        return (f"te (Transformer Engine delayed scaling, {o.format}, margin {o.margin}, amax history "
                f"{o.amax_history_len}, {o.amax_compute_algo})")

    def notes(self, given: set[str]) -> list[str]:
        recipe = self.options.recipe
        return ([f"note: --fp8-recipe {recipe} applies to torchao; Transformer Engine runs its delayed-scaling "
                 "recipe (--fp8-recipe delayed)"] if recipe not in (None, "delayed") else [])
