"""Learning-rate schedule with Megatron's meaning of the flags.

Linear warmup from 0 to --lr over --lr-warmup-iters, then constant / linear / cosine decay to --min-lr
at --lr-decay-iters, and --min-lr after that. `step` counts successful optimizer steps (an fp16 step
skipped for overflow does not advance it), so the schedule is a pure function of that count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class LRSchedule:
    max_lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    style: str = "linear"  # constant | linear | cosine
    step: int = 0

    def __post_init__(self):
        if self.style not in ("constant", "linear", "cosine"):
            raise ValueError(f"unknown lr decay style {self.style!r}")

    def lr_at(self, step: int) -> float:
        """The learning rate for the update that brings the step count to `step` (1-based)."""
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.max_lr * step / self.warmup_steps
        if self.style == "constant":
            return self.max_lr
        if step > self.decay_steps:
            return self.min_lr
        span = self.decay_steps - self.warmup_steps
        ratio = 1.0 if span <= 0 else (step - self.warmup_steps) / span
        if self.style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def next_lr(self) -> float:
        """The learning rate for the coming optimizer step."""
        return self.lr_at(self.step + 1)

    def state_dict(self) -> dict:
        return {"step": self.step, "max_lr": self.max_lr, "min_lr": self.min_lr, "warmup_steps": self.warmup_steps,
                "decay_steps": self.decay_steps, "style": self.style}

    def load_state_dict(self, state: dict) -> None:
        # Only the position is restored: the flags of the resumed run define the schedule's shape.
        self.step = int(state["step"])


class ScheduledLR:
    """An LRSchedule driving an optimizer, with the interface DeepSpeed expects of `lr_scheduler`.

    DeepSpeed calls `step()` after every successful optimizer step (not after an fp16 overflow skip) and
    saves/loads `state_dict()` with its checkpoints, so resume continues the schedule exactly.
    """

    def __init__(self, optimizer, schedule: LRSchedule, apply_now: bool = True):
        self.optimizer, self.schedule = optimizer, schedule
        if apply_now:
            self.apply()

    def apply(self) -> None:
        """Set the learning rate of the coming step on every parameter group."""
        lr = self.schedule.next_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, increment: int = 1, **_ignored) -> None:
        self.schedule.step += increment
        self.apply()

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    get_last_lr = get_lr

    def state_dict(self) -> dict:
        return self.schedule.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.schedule.load_state_dict(state)
        self.apply()


def from_args(args) -> LRSchedule:
    return LRSchedule(max_lr=args.lr, min_lr=args.min_lr, warmup_steps=args.lr_warmup_iters,
                      decay_steps=args.lr_decay_iters, style=args.lr_decay_style)
