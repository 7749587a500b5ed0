"""Learning-rate schedule with Megatron-DeepSpeed's meaning of the flags.

The schedule is a function of how far training has come, counted in samples (or in tokens when a
--lr-*-tokens flag is given), exactly as upstream's OptimizerParamScheduler counts: linear warmup from
0 to --lr, then constant / linear / cosine / inverse-square-root decay to --min-lr at the decay point,
and --min-lr after it. Iteration flags are converted to samples (iterations x global batch).

The update of iteration k uses the rate at the position *before* it, ``(k - 1) x per_step``, as
upstream does (its scheduler is stepped once at construction and after every successful update); an
fp16 step skipped for overflow does not advance the position. So a run with warmup starts at lr 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_ds.arguments.settings import Settings

STYLES = ("constant", "linear", "cosine", "inverse-square-root")
# What a resume does when the checkpoint's schedule differs from the flags (upstream's two flags).
ON_RESUME = ("check", "flags", "checkpoint")
_SHAPE = ("max_lr", "min_lr", "warmup", "decay", "style")


class ScheduleMismatch(ValueError):
    """A resumed schedule whose shape differs from the flags; the message names every difference."""


@dataclass
class LRSchedule:
    max_lr: float
    min_lr: float
    warmup: float  # position (samples or tokens) where warmup ends
    decay: float  # position where decay ends
    style: str = "linear"
    per_step: int = 1  # position gained by one optimizer step: global batch (x seq length when counting tokens)
    position: int = 0  # samples (tokens) consumed by successful optimizer steps so far
    on_resume: str = "check"  # a checkpoint's different shape: refuse it, keep the flags', or take the checkpoint's

    def __post_init__(self):
        if self.style not in STYLES:
            raise ValueError(f"unknown lr decay style {self.style!r} (choose from {', '.join(STYLES)})")
        if self.on_resume not in ON_RESUME:
            raise ValueError(f"on_resume must be one of {ON_RESUME}, got {self.on_resume!r}")

    def lr_at(self, position: float) -> float:
        """The rate at `position` samples (tokens) consumed: upstream's get_lr at num_steps = position."""
        if self.warmup > 0 and position <= self.warmup:
            return self.max_lr * position / self.warmup
        if self.style == "constant":
            return self.max_lr
        if position > self.decay:
            return self.min_lr
        if self.style == "inverse-square-root":
            return max(self.min_lr, self.max_lr * max(self.warmup, 1) ** 0.5 / max(position, 1) ** 0.5)
        span = self.decay - self.warmup
        ratio = 1.0 if span <= 0 else (position - self.warmup) / span
        coeff = 1.0 - ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def current_lr(self) -> float:
        """The rate of the coming optimizer step."""
        return self.lr_at(self.position)

    def advance(self, steps: int = 1) -> None:
        self.position += steps * self.per_step

    def state_dict(self) -> dict:
        return {"position": self.position, **{key: getattr(self, key) for key in _SHAPE}}

    def load_state_dict(self, state: dict) -> None:
        """Restore the position; the shape follows `on_resume` (upstream's default "check" refuses a
        difference, --override-opt_param-scheduler keeps the flags', --use-checkpoint-opt_param-scheduler
        takes the checkpoint's)."""
        if "position" not in state:  # written before the sample-based schedule: a step count, no shape to check
            self.position = int(state["step"]) * self.per_step
            return
        differ = [f"{key} {state[key]!r} in the checkpoint vs {getattr(self, key)!r} from the flags"
                  for key in _SHAPE if state[key] != getattr(self, key)]
        if differ and self.on_resume == "check":
            raise ScheduleMismatch(
                "the checkpoint's learning-rate schedule differs from the flags (" + "; ".join(differ) +
                "): pass --override-opt_param-scheduler to use the flags, or --use-checkpoint-opt_param-scheduler "
                "to use the checkpoint's")
        if self.on_resume == "checkpoint":
            for key in _SHAPE:
                setattr(self, key, state[key])
        self.position = state["position"]


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
        lr = self.schedule.current_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, increment: int = 1, **_ignored) -> None:
        self.schedule.advance(increment)
        self.apply()

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    get_last_lr = get_lr

    def state_dict(self) -> dict:
        return self.schedule.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.schedule.load_state_dict(state)
        self.apply()


def schedule_from(settings: Settings) -> LRSchedule:
    """The schedule of a run's settings: its optimizer section over its global batch and sequence length."""
    return schedule_for(settings.optimizer, global_batch_size=settings.layout.global_batch_size,
                        seq_length=settings.model.seq_length)


def schedule_for(o, *, global_batch_size: int, seq_length: int) -> LRSchedule:
    """The schedule of an OptimizerSettings (or, while validation checks it, the flags: the same names): positions
    in tokens when a --lr-*-tokens flag is given, else samples.

    Iteration flags count in samples (x global batch), --lr-warmup-fraction is a fraction of the decay
    span, and warmup by samples with decay by tokens ends where upstream's does (samples x seq length).
    """
    gbs, seq = global_batch_size, seq_length
    by_tokens = o.lr_decay_tokens is not None or o.lr_warmup_tokens is not None
    unit = seq if by_tokens else 1  # position units per sample

    if o.lr_decay_tokens is not None:
        decay = o.lr_decay_tokens
    elif o.lr_decay_samples is not None:
        decay = o.lr_decay_samples * unit
    else:
        decay = o.lr_decay_iters * gbs * unit
    if o.lr_warmup_tokens is not None:
        warmup = o.lr_warmup_tokens
    elif o.lr_warmup_fraction is not None:
        warmup = o.lr_warmup_fraction * decay
    elif o.lr_warmup_samples:
        warmup = o.lr_warmup_samples * unit
    else:
        warmup = o.lr_warmup_iters * gbs * unit
    on_resume = ("flags" if o.override_opt_param_scheduler else
                 "checkpoint" if o.use_checkpoint_opt_param_scheduler else "check")
    return LRSchedule(max_lr=o.lr, min_lr=o.min_lr, warmup=warmup, decay=decay, style=o.lr_decay_style,
                      per_step=gbs * unit, on_resume=on_resume)
