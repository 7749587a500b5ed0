"""The loop's position: what a checkpoint must restore for training to continue exactly.

The loop owns one TrainState and hands it to the checkpointer, which saves ``state_dict()`` and
restores with ``load_state_dict()``; a new field here is saved and restored with no other edit.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class TrainState:
    iteration: int = 0  # optimizer steps taken
    consumed_train_samples: int = 0  # where the next global batch starts in the training set
    consumed_valid_samples: int = 0  # where the next evaluation starts in the validation set

    def advance(self, samples: int) -> None:
        """One optimizer step over ``samples`` training samples has been taken."""
        self.iteration += 1
        self.consumed_train_samples += samples

    def state_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def load_state_dict(self, state: dict) -> None:
        names = [f.name for f in fields(self)]
        missing, unknown = sorted(set(names) - set(state)), sorted(set(state) - set(names))
        if missing or unknown:
            raise ValueError(f"TrainState.load_state_dict: missing {missing}, unknown {unknown}")
        for f in fields(self):
            setattr(self, f.name, type(f.default)(state[f.name]))
