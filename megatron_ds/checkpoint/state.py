"""Fallback TrainState for callers without the training loop (tests, tools); the loop has its own."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
