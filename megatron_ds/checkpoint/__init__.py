"""Checkpoint files: save/load, exact resume, preemption, and the records (metadata, split records, merged
shards) that megatron_ds.convert reads to export, import and reshard them. Knows nothing of training.

The training loop owns its TrainState and a ``Checkpointer(engine, flags)``: ``load(state)`` once at
start, ``save(state)`` when ``due(iteration)`` (--save-interval) and at exit; the checkpointer
records ``state.state_dict()`` and restores it with ``state.load_state_dict``; ``finish()`` waits for a
--async-save in flight. A save the disk refuses raises ``SaveError`` (exit SAVE_FAILED_EXIT). ``StopAgreement``
(preemption.py) decides, collectively, when a signal or the time limit stops the run.
"""

from megatron_ds.checkpoint.checkpointing import Checkpointer, load, resolve, save
from megatron_ds.checkpoint.disk import SAVE_FAILED_EXIT, SaveError
from megatron_ds.checkpoint.metadata import CheckpointError
from megatron_ds.checkpoint.preemption import StopAgreement

__all__ = ["SAVE_FAILED_EXIT", "CheckpointError", "Checkpointer", "SaveError", "StopAgreement", "load", "resolve",
           "save"]
