"""A stand-in for Settings in tests of one function: only the fields given, each in the section that owns it."""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace

from megatron_ds.arguments.settings import SECTIONS

OWNER = {f.name: name for name, cls in SECTIONS.items() for f in fields(cls)}


def sections(**flat) -> SimpleNamespace:
    """``sections(zero_stage=1, micro_batch_size=2)`` -> .optimizer.zero_stage, .layout.micro_batch_size."""
    grouped = {name: {} for name in SECTIONS}
    for key, value in flat.items():
        grouped[OWNER[key]][key] = value
    return SimpleNamespace(**{name: SimpleNamespace(**values) for name, values in grouped.items()})
