"""Spawn the local ranks of one node and supervise them (the one-task-per-node launch mode).

Each rank runs in its own session (process group), so stopping a rank also stops whatever it
started. When one rank fails the others get SIGTERM, then SIGKILL once a shared grace deadline
passes; every group is reaped, and the exit code is the first failed rank's (signal N -> 128+N).
A rank that exits with one of the FINAL codes (a configuration error, a non-finite loss, a refused
save) stopped where every rank stops alike, and rank 0 prints why: the others get the grace to end
by themselves before the SIGTERM, so that line is never cut off.
SIGTERM, SIGINT and SIGUSR1 received by the supervisor are forwarded to every rank.

A rank that is still not reaped `reap_wait` seconds (default 30) after its SIGKILL (a process in
uninterruptible sleep on a hung filesystem or driver, or one whose exit a tracer holds) is named
in an error and left behind: the supervisor returns the exit code anyway (137 when no rank had
failed), so the job ends rather than hangs.

Hangs (watchdog.py): ranks that report progress are watched; when every live reporting rank is
past its allowance, every rank's stacks are dumped, the stuck rank(s) named, the ranks stopped as
above, and the exit code is HANG_EXIT (124).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from megatron_ds.env_settings import WATCHDOG_DIR
from megatron_ds.runtime.restarts import FINAL
from megatron_ds.runtime.watchdog import HANG_EXIT, Verdict, Watchdog

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
STOPPING = (signal.SIGTERM, signal.SIGINT)
_PR_SET_PDEATHSIG = 1
REAP_WAIT = 30.0  # seconds after SIGKILL before an unreaped rank is given up on
_STATES = {"D": "uninterruptible sleep: a hung filesystem, device or driver call",
           "Z": "exited, but its exit is held, e.g. by a tracer"}


@dataclass
class RankSpec:
    rank: int
    local_rank: int
    argv: list[str]
    env: dict[str, str]
    cpus: tuple[int, ...] | None = None


def exit_code(returncode: int) -> int:
    """Popen's -N (killed by signal N) becomes the shell's 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def _child_setup(cpus: tuple[int, ...] | None):
    """Runs in the child between fork and exec: die with the supervisor, bind CPUs."""
    def setup() -> None:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
        if cpus:
            os.sched_setaffinity(0, cpus)
    return setup


def _log(message: str) -> None:
    print(f"mds launch: {message}", file=sys.stderr, flush=True)


class _Output:
    """Copies a rank's merged stdout/stderr to our stdout, optionally labelled and teed to a file."""

    lock = threading.Lock()

    def __init__(self, spec: RankSpec, pipe, label: bool, tee_dir: str | None):
        self.prefix = f"[rank{spec.rank}] ".encode() if label else b""
        self.file = open(Path(tee_dir) / f"rank{spec.rank}.log", "wb") if tee_dir else None
        self.tail: deque[bytes] = deque(maxlen=20)  # shown with the root cause when this rank fails
        self.thread = threading.Thread(target=self._pump, args=(pipe,), daemon=True)
        self.thread.start()

    def _pump(self, pipe) -> None:
        out = sys.stdout.buffer
        for line in iter(pipe.readline, b""):
            self.tail.append(line)
            with self.lock:
                out.write(self.prefix + line)
                out.flush()
            if self.file:
                self.file.write(line)
                self.file.flush()
        pipe.close()

    def close(self) -> None:
        self.thread.join(timeout=5)
        if self.file:
            self.file.close()


class Supervisor:
    def __init__(self, specs: list[RankSpec], *, grace: float = 5.0, signal_grace: float | None = None,
                 label: bool = False, tee_dir: str | None = None, reap_wait: float = REAP_WAIT,
                 watch_dir: str | None = None):
        self.specs, self.grace, self.label, self.tee_dir = specs, grace, label, tee_dir
        # ranks report progress into watch_dir (None: no hang watchdog)
        self.watchdog = Watchdog(Path(watch_dir), [s.rank for s in specs]) if watch_dir else None
        self.hang: Verdict | None = None
        self.reap_wait = reap_wait
        # after a TERM/INT from outside, ranks may need longer than `grace` (e.g. to save a checkpoint)
        self.signal_grace = grace if signal_grace is None else signal_grace
        self.procs: list[subprocess.Popen] = []
        self.outputs: list[_Output] = []
        self.failure: tuple[RankSpec, int] | None = None
        self.stop_deadline: float | None = None
        self.kill_deadline: float | None = None  # set by the one SIGKILL: reaping waits no longer
        self.abandoned: list[int] = []  # indices of ranks that could not be reaped
        self.received: list[int] = []

    # -- signals: forward at once; TERM/INT also start the shared stop deadline
    def _on_signal(self, signum, _frame) -> None:
        self.received.append(signum)
        self._signal_all(signum)
        if signum in STOPPING and self.stop_deadline is None:
            self.stop_deadline = time.monotonic() + self.signal_grace

    def _signal_all(self, signum: int, only_live: bool = True) -> None:
        for proc in self.procs:
            if only_live and proc.poll() is not None:
                continue
            try:
                os.killpg(proc.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def _start(self) -> None:
        piped = self.label or self.tee_dir is not None
        if self.tee_dir:
            Path(self.tee_dir).mkdir(parents=True, exist_ok=True)
        for spec in self.specs:
            env = spec.env if self.watchdog is None else {**spec.env, WATCHDOG_DIR.name: str(self.watchdog.directory)}
            self.procs.append(subprocess.Popen(
                spec.argv, env=env, start_new_session=True, preexec_fn=_child_setup(spec.cpus),
                stdout=subprocess.PIPE if piped else None, stderr=subprocess.STDOUT if piped else None))
        if piped:  # threads only after every fork: preexec_fn and threads do not mix
            self.outputs = [_Output(s, p.stdout, self.label, self.tee_dir) for s, p in zip(self.specs, self.procs)]

    def _wait_live(self, until: float) -> None:
        while any(p.poll() is None for p in self.procs) and time.monotonic() < until:
            time.sleep(0.05)

    def _stopped_alike(self) -> bool:
        """The first failure is a FINAL exit: that rank stopped where every rank stops, and rank 0 says why."""
        return self.failure is not None and self.failure[1] in FINAL

    def _close(self) -> None:
        """TERM the live ranks, wait against one deadline, KILL the rest (once: a KILL is never lost).
        After a FINAL exit the others first get the grace to end by themselves."""
        if self._stopped_alike() and self.stop_deadline is None:
            self._wait_live(time.monotonic() + self.grace)
        if self.stop_deadline is None:
            self.stop_deadline = time.monotonic() + self.grace
            self._signal_all(signal.SIGTERM)
        self._wait_live(self.stop_deadline)
        if any(p.poll() is None for p in self.procs) and self.kill_deadline is None:
            stragglers = [s.rank for s, p in zip(self.specs, self.procs) if p.poll() is None]
            _log(f"rank(s) {stragglers} still alive at the grace deadline after SIGTERM: SIGKILL")
            self._signal_all(signal.SIGKILL)
            self.kill_deadline = time.monotonic() + self.reap_wait

    def _abandon_unreaped(self) -> None:
        """Name each rank still unreaped after its SIGKILL and stop waiting for it."""
        for index, (spec, proc) in enumerate(zip(self.specs, self.procs)):
            if proc.poll() is not None or index in self.abandoned:
                continue
            self.abandoned.append(index)
            try:
                state = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                state = "?"
            _log(f"ERROR: rank {spec.rank} (local rank {spec.local_rank}, pid {proc.pid}) could not be reaped "
                 f"{self.reap_wait:g} s after SIGKILL (process state {state}: {_STATES.get(state, 'unknown')}); "
                 f"leaving it behind so the job ends. Check that node for pid {proc.pid}.")
            if self.failure is None:
                self.failure = (spec, 128 + signal.SIGKILL)

    def run(self) -> int:
        in_main = threading.current_thread() is threading.main_thread()
        previous = {s: signal.signal(s, self._on_signal) for s in FORWARDED} if in_main else {}
        try:
            self._start()
            while True:
                codes = [p.poll() for p in self.procs]
                for spec, code in zip(self.specs, codes):
                    if code not in (None, 0) and self.failure is None:
                        self.failure = (spec, exit_code(code))
                        self._report()
                        self._close()
                if self.watchdog is not None and self.failure is None and self.stop_deadline is None:
                    live = {s.rank for s, c in zip(self.specs, codes) if c is None}
                    overdue = self.watchdog.overdue(live)
                    if overdue:
                        self._on_hang(overdue)
                if self.stop_deadline is not None and time.monotonic() >= self.stop_deadline:
                    self._close()
                if all(c is not None for c in codes):
                    break
                if self.kill_deadline is not None and time.monotonic() >= self.kill_deadline:
                    self._abandon_unreaped()
                    break
                time.sleep(0.05)
        finally:
            self._signal_all(signal.SIGKILL, only_live=False)  # grandchildren left in a rank's group
            left = [p for i, p in enumerate(self.procs) if p.poll() is None and i not in self.abandoned]
            for proc in left:  # only when run() is left by an exception
                proc.kill()
            deadline = time.monotonic() + self.reap_wait
            while any(p.poll() is None for p in left) and time.monotonic() < deadline:
                time.sleep(0.05)
            self._abandon_unreaped()
            for output in self.outputs:
                output.close()
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return self.failure[1] if self.failure else 0

    def _on_hang(self, overdue) -> None:
        """No rank made progress in time: dump stacks, name the stuck rank(s), stop everything, exit HANG_EXIT."""
        self.hang = self.watchdog.investigate(overdue)
        _log(self.hang.describe("--watchdog-timeout") + f"\nstopping the job: exit code {HANG_EXIT}")
        blamed = sorted(self.hang.stuck) or [overdue[0].rank]
        self.failure = (next(s for s in self.specs if s.rank == blamed[0]), HANG_EXIT)
        self._close()

    def _report(self) -> None:
        spec, code = self.failure
        how = f"killed by signal {code - 128} (exit {code})" if code > 128 else f"exited with code {code}"
        after = f" after the launcher received signal {self.received[0]}" if self.received else ""
        others = len([p for p in self.procs if p.poll() is None])
        index = self.specs.index(spec)
        stopping = (f"waiting up to {self.grace:g} s for {others} other rank(s) to stop there too"
                    if self._stopped_alike() else f"stopping {others} other rank(s)")
        _log(f"root cause: rank {spec.rank} (local rank {spec.local_rank}, pid {self.procs[index].pid}) "
             f"{how}{after}; {stopping}")
        if self.outputs:  # its last lines, once its pipe has drained
            self.outputs[index].thread.join(timeout=2)
            tail = b"".join(self.outputs[index].tail).decode(errors="replace").rstrip()
            if tail:
                _log(f"last output of rank {spec.rank}:\n" + tail)


def supervise(specs: list[RankSpec], *, grace: float = 5.0, signal_grace: float | None = None, label: bool = False,
              tee_dir: str | None = None, reap_wait: float = REAP_WAIT, watch_dir: str | None = None) -> int:
    """Run every rank to the end (or to the first failure or hang) and return the launcher's exit code."""
    return Supervisor(specs, grace=grace, signal_grace=signal_grace, label=label, tee_dir=tee_dir,
                      reap_wait=reap_wait, watch_dir=watch_dir).run()
