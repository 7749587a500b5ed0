"""A rank's progress reports: the watchdog's only input (watchdog.py says what it does with them).

Under the node supervisor ($MDS_WATCHDOG_DIR set), each report rewrites this rank's fixed-size
record file in place (one pwrite, no rename: cheap enough for every step) and the supervisor
polls it; faulthandler is registered on SIGUSR2 so the supervisor can ask for this rank's stacks.
Without a supervisor (one task per GPU under a scheduler), a daemon thread in this rank checks the
same record; past its allowance it dumps every thread's stack and ends the process with HANG_EXIT
(the main thread may be blocked inside a collective and can do nothing itself).

    progress = Progress.start(rank, Timeouts(step=None))   # phase 'starting'
    progress.step(iteration)                              # after each finished step
    with progress.phase("saving", iteration): ...         # evaluating, saving: their own allowance
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from collections import deque

from megatron_ds.runtime.watchdog import (DUMP_SIGNAL, ENV_DIR, HANG_EXIT, Record, Timeouts, progress_path,
                                          stacks_path)

RECENT_STEPS = 20  # step times kept for the median


class Progress:
    def __init__(self, rank: int, timeouts: Timeouts, directory: str | None, self_watch: bool,
                 check_every: float = 1.0):
        self.rank, self.timeouts, self.directory = rank, timeouts, directory
        self.step_times: deque[float] = deque(maxlen=RECENT_STEPS)
        self.current = Record(rank, os.getpid(), "starting", 0, time.time(), timeouts.allowance("starting", []))
        self.last_step_end: float | None = None
        self.fd = self.stacks = None
        self.stopped = threading.Event()
        if directory is not None:
            self.fd = os.open(progress_path(directory, rank), os.O_WRONLY | os.O_CREAT, 0o644)
            self.stacks = open(stacks_path(directory, rank), "ab")
            faulthandler.register(DUMP_SIGNAL, file=self.stacks, all_threads=True, chain=False)
        self._write()
        self.thread = None
        if self_watch and timeouts.enabled:
            self.thread = threading.Thread(target=self._watch, args=(check_every,), name="mds-watchdog", daemon=True)
            self.thread.start()

    @classmethod
    def start(cls, rank: int, timeouts: Timeouts) -> Progress:
        """Report to the node supervisor when one set $MDS_WATCHDOG_DIR, else watch ourselves."""
        directory = os.environ.get(ENV_DIR)
        return cls(rank, timeouts, directory, self_watch=directory is None)

    @classmethod
    def null(cls) -> Progress:
        """Reports that go nowhere (a trainer driven from Python, with no watchdog)."""
        return cls(0, Timeouts(step=0), None, self_watch=False)

    # -- reports ------------------------------------------------------------------------------------

    def _report(self, phase: str, iteration: int) -> None:
        steps = list(self.step_times)
        self.current = Record(self.rank, self.current.pid, phase, iteration, time.time(),
                              self.timeouts.allowance(phase, steps))
        self._write()

    def _write(self) -> None:
        if self.fd is not None:
            os.pwrite(self.fd, self.current.encode(), 0)

    def step(self, iteration: int) -> None:
        """A training step finished. Step times are measured between consecutive steps only."""
        now = time.perf_counter()
        if self.last_step_end is not None:
            self.step_times.append(now - self.last_step_end)
        self.last_step_end = now
        self._report("step", iteration)

    @contextlib.contextmanager
    def phase(self, name: str, iteration: int):
        """A long phase (evaluating, saving) with its own allowance; the next step is timed from its end."""
        self._report(name, iteration)
        try:
            yield
        finally:
            self.last_step_end = time.perf_counter()
            self._report("step", iteration)

    def close(self) -> None:
        self.stopped.set()
        if self.fd is not None:
            faulthandler.unregister(DUMP_SIGNAL)
            os.close(self.fd)
            self.stacks.close()
            self.fd = None

    # -- self watch (no supervisor) -----------------------------------------------------------------

    def _watch(self, every: float) -> None:
        while not self.stopped.wait(every):
            record = self.current
            late = record.overdue(time.time())
            if late > 0:
                self._give_up(record)

    def _give_up(self, record: Record) -> None:
        print(f"mds watchdog: HANG: rank {record.rank} made no progress for {time.time() - record.time:.0f} s "
              f"(allowance {record.allowance:g} s in phase '{record.phase}', last iteration {record.iteration}); "
              f"stacks of every thread follow; exiting with {HANG_EXIT} so the scheduler ends the job",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(HANG_EXIT)
