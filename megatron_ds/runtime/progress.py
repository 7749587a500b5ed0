"""A rank's progress reports: the watchdog's only input (watchdog.py says what it does with them).

Under the node supervisor ($MDS_WATCHDOG_DIR set), each report rewrites this rank's fixed-size
record file in place (one pwrite, no rename: cheap enough for every step) and the supervisor
polls it; faulthandler is registered on SIGUSR2 so the supervisor can ask for this rank's stacks, and
the same signal dumps torch's collective flight recorder next to them (flight_recorder.py).
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
import signal
import sys
import tempfile
import threading
import time
from collections import deque

from megatron_ds.env_settings import WATCHDOG_DIR
from megatron_ds.runtime import flight_recorder
from megatron_ds.runtime.watchdog import DUMP_SIGNAL, HANG_EXIT, Record, Timeouts, progress_path, stacks_path

RECENT_STEPS = 20  # step times kept for the median


class Progress:
    def __init__(self, rank: int, timeouts: Timeouts, directory: str | None, self_watch: bool,
                 check_every: float = 1.0):
        self.rank, self.timeouts, self.directory = rank, timeouts, directory
        self.step_times: deque[float] = deque(maxlen=RECENT_STEPS)
        self.current = Record(rank, os.getpid(), "starting", 0, time.time(), timeouts.allowance("starting", []))
        self.last_step_end: float | None = None
        self.fd = self.stacks = self.wakeup = None
        self.stopped = threading.Event()
        if directory is not None:
            self.fd = os.open(progress_path(directory, rank), os.O_WRONLY | os.O_CREAT, 0o644)
            self.stacks = open(stacks_path(directory, rank), "ab")
            self._arm_dump()
        self._write()
        self.thread = None
        if self_watch and timeouts.enabled:
            self.thread = threading.Thread(target=self._watch, args=(check_every,), name="mds-watchdog", daemon=True)
            self.thread.start()

    @classmethod
    def start(cls, rank: int, timeouts: Timeouts) -> Progress:
        """Report to the node supervisor when one set $MDS_WATCHDOG_DIR, else watch ourselves."""
        directory = WATCHDOG_DIR.get()
        flight_recorder.enable(os.environ, directory)  # read when the process group is created, after this
        return cls(rank, timeouts, directory, self_watch=directory is None)

    @classmethod
    def null(cls) -> Progress:
        """Reports that go nowhere (a trainer driven from Python, with no watchdog)."""
        return cls(0, Timeouts(step=0), None, self_watch=False)

    # -- the supervisor's dump request (SIGUSR2) ------------------------------------------------------

    def _arm_dump(self) -> None:
        """On DUMP_SIGNAL: every thread's stacks, then the flight recorder, into the watchdog directory.

        faulthandler writes the stacks from C, even while the main thread is blocked in a collective.
        The flight recorder needs Python, which the main thread cannot run then, so faulthandler chains
        to Python's own handler, whose C half writes the signal number to the wakeup pipe at once, and
        a thread waiting on that pipe dumps the recorder.
        """
        chain = threading.current_thread() is threading.main_thread()  # signals are set up there only
        if chain:
            read_fd, write_fd = os.pipe()
            os.set_blocking(write_fd, False)
            self.previous_handler = signal.signal(DUMP_SIGNAL, lambda *_: None)
            if signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False) != -1:  # someone else's: leave it
                signal.set_wakeup_fd(signal.set_wakeup_fd(-1))
                signal.signal(DUMP_SIGNAL, self.previous_handler)
                os.close(read_fd)
                os.close(write_fd)
                chain = False
            else:
                self.wakeup = write_fd
                threading.Thread(target=self._dump_on_request, args=(read_fd,), name="mds-dump", daemon=True).start()
        faulthandler.register(DUMP_SIGNAL, file=self.stacks, all_threads=True, chain=chain)

    def _dump_on_request(self, read_fd: int) -> None:
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            while data := pipe.read(64):
                if DUMP_SIGNAL in data:
                    note = flight_recorder.dump(self.directory, self.rank)
                    self.stacks.write(f"\n{note}\n".encode())
                    self.stacks.flush()

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
            if self.wakeup is not None and threading.current_thread() is threading.main_thread():
                signal.set_wakeup_fd(-1)  # with the pipe's one writer closed, the dump thread ends
                signal.signal(DUMP_SIGNAL, self.previous_handler)
                os.close(self.wakeup)
                self.wakeup = None
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
        note = flight_recorder.dump(tempfile.mkdtemp(prefix=f"mds-watchdog-rank{record.rank}-"), record.rank)
        print(f"mds watchdog: {note}", file=sys.stderr, flush=True)
        os._exit(HANG_EXIT)
