"""The loop's position, what a checkpoint must restore to continue exactly."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainState:
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0

    def state_dict(self) -> dict:
        return dict(iteration=self.iteration, consumed_train_samples=self.consumed_train_samples,
                    consumed_valid_samples=self.consumed_valid_samples)

    def load_state_dict(self, state: dict) -> None:
        for key in ("iteration", "consumed_train_samples", "consumed_valid_samples"):
            setattr(self, key, int(state[key]))
