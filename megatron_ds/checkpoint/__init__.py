"""Checkpoint save/load, exact resume, preemption and export.

The training loop calls ``load(engine, args)`` once at start and ``save(engine, args, state)`` every
--save-interval and at exit; ``StopAgreement`` (preemption.py) decides, collectively, when to stop.
"""

from megatron_ds.checkpoint.checkpointing import load, resolve, save
from megatron_ds.checkpoint.metadata import CheckpointError
from megatron_ds.checkpoint.preemption import StopAgreement

__all__ = ["CheckpointError", "StopAgreement", "load", "resolve", "save"]
