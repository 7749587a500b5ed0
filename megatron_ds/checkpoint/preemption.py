"""Stop every rank at the same iteration when a signal or the time limit says so.

Slurm (``--signal=USR1@120`` or ``TERM``) and our launcher may signal one rank or all of them.
The handler only sets a flag; once per step every rank calls ``should_stop()``, which takes the
MAX of the flags over the world group. So all ranks see the same answer at the same iteration,
save one checkpoint together and exit 0, and a rank that was never signalled does not wait forever
in a collective for one that left.

Usage in a loop (mds's own wraps it, with the training length and --exit-interval, in
``StopConditions``, megatron_ds/training/loop.py)::

    stop = StopAgreement(handle_signals=args.exit_signal_handler,
                         exit_duration_mins=args.exit_duration_in_mins)
    stop.install()
    while iteration < train_iters:
        train_step(); iteration += 1
        if (reason := stop.should_stop()) is not None:
            save(...); print(reason); return 0
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")


class StopAgreement:
    """A signal flag and a deadline, agreed on by all ranks with one all_reduce(MAX) per step."""

    def __init__(self, *, handle_signals: bool = True, exit_duration_mins: float | None = None,
                 start_time: float | None = None, signals: tuple[str, ...] = DEFAULT_SIGNALS, group=None):
        self.handle_signals = handle_signals
        self.exit_duration_s = None if exit_duration_mins is None else float(exit_duration_mins) * 60.0
        self.start_time = process_start_time() if start_time is None else start_time
        self.signals = tuple(getattr(signal, name) for name in signals)
        self.group = group
        self.received: int = 0  # number of the last signal received on this rank, 0 if none
        self._previous: dict[int, object] = {}

    def install(self) -> StopAgreement:
        """Replace the handlers of the stop signals by one that only records the signal (main thread)."""
        if self.handle_signals:
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _on_signal(self, signum, frame) -> None:  # async-signal context: set a flag, nothing else
        self.received = signum

    def _local_flags(self) -> list[int]:
        timed_out = self.exit_duration_s is not None and time.time() - self.start_time >= self.exit_duration_s
        return [self.received, int(timed_out)]

    def should_stop(self) -> str | None:
        """Collective (every rank, every step): the reason to stop now, the same on all ranks, or None."""
        flags = self._local_flags()
        if dist.is_initialized():
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" \
                else torch.device("cpu")
            tensor = torch.tensor(flags, dtype=torch.int64, device=device)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
            flags = [int(v) for v in tensor.tolist()]
        signum, timed_out = flags
        if signum:
            return f"received {signal.Signals(signum).name} (on this rank or another): saving and exiting"
        if timed_out:
            return f"--exit-duration-in-mins {self.exit_duration_s / 60:g} reached: saving and exiting"
        return None


def process_start_time() -> float:
    """When this process started (epoch seconds), so --exit-duration-in-mins counts start-up and
    checkpoint loading too, as Megatron's does; the current time where /proc cannot tell."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command name may contain spaces
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime in clock ticks
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def announce(reason: str) -> None:
    """Print the stop reason once (rank 0)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[mds] {reason}", file=sys.stderr, flush=True)
