"""In-job restarts (--max-restarts N, torchrun's name): run the node's ranks again after a failure or a hang.

The ranks get the same command line, so a run with --load resumes from its `latest` checkpoint.
Not restarted: success, the FINAL exit codes (a configuration error, exit 2; a non-finite loss or gradient
norm, exit 65; a save the disk refused, exit 74: a restart from `latest` would end the same way, or refuse the
same save again after the steps since `latest` were trained once more), and a stop asked for from outside
(TERM/INT to the launcher). A restart loop, i.e. SAME_FAILURE_LIMIT
attempts in a row failing the same way at the same iteration, gives up with its cause.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from megatron_ds.runtime.watchdog import HANG_EXIT

CONFIG_ERROR = 2
NONFINITE_EXIT = 65  # sysexits' EX_DATAERR: the run's numbers went bad (training/nonfinite.py)
SAVE_FAILED = 74  # megatron_ds.checkpoint.SAVE_FAILED_EXIT (runtime imports no training package)
FINAL = {CONFIG_ERROR: "a configuration error", NONFINITE_EXIT: "a non-finite loss or gradient norm",
         SAVE_FAILED: "a save the disk refused"}
SAME_FAILURE_LIMIT = 2


@dataclass(frozen=True)
class Failure:
    """How one attempt ended: exit code, the rank blamed, the furthest iteration reported."""

    code: int
    rank: int | None
    iteration: int | None

    def describe(self) -> str:
        what = "hang detected by the watchdog" if self.code == HANG_EXIT else f"exit code {self.code}"
        where = f" of rank {self.rank}" if self.rank is not None else ""
        at = f" at iteration {self.iteration}" if self.iteration is not None else " before the first iteration"
        return f"{what}{where}{at}"

    def same_as(self, other: Failure) -> bool:
        return (self.code, self.iteration) == (other.code, other.iteration)


class RestartPolicy:
    def __init__(self, max_restarts: int):
        self.max_restarts = max_restarts
        self.failures: list[Failure] = []

    @property
    def restarts(self) -> int:
        return max(0, len(self.failures) - 1)

    def should_restart(self, failure: Failure, stopped_from_outside: bool) -> bool:
        """Record the failure; True when the ranks should run again (the reason is logged either way)."""
        self.failures.append(failure)
        if failure.code in FINAL and self.max_restarts > 0 and not stopped_from_outside:
            _log(f"no restart after {FINAL[failure.code]} ({failure.describe()}): a restart from latest would "
                 "end the same way")
            return False
        if stopped_from_outside or self.max_restarts <= 0:
            return False
        recent = self.failures[-SAME_FAILURE_LIMIT:]
        if len(recent) == SAME_FAILURE_LIMIT and all(f.same_as(recent[-1]) for f in recent):
            _log(f"restart loop: {SAME_FAILURE_LIMIT} attempts in a row ended with the same failure "
                 f"({failure.describe()}); giving up")
            return False
        if self.restarts >= self.max_restarts:
            _log(f"no restart left (--max-restarts {self.max_restarts} used); last failure: {failure.describe()}")
            return False
        _log(f"restart {self.restarts + 1}/{self.max_restarts} after {failure.describe()}")
        return True


def _log(message: str) -> None:
    print(f"mds launch: {message}", file=sys.stderr, flush=True)
