"""Hang detection: how long a rank may go without progress, and what to do when one does.

Ranks report progress (progress.py) as a small record: the phase they are in ('starting',
'step', 'evaluating', 'saving'), the last finished iteration, the wall time, and the allowance
(seconds) before silence counts as a hang. The allowance adapts to the measured step time:

    step phase:  the fixed --watchdog-timeout when given, else max(FLOOR, FACTOR x median recent step)
    starting, evaluating, saving, and the first MEASURED_STEPS steps: --watchdog-slow-phase-timeout

so compilation, the first steps, evaluation and checkpoint saving get their own (long) allowance,
a job of 50 ms steps notices a hang after FLOOR = 180 s, and one of 10 s steps waits 200 s.

On a hang the node's supervisor asks every local rank for its Python stacks (SIGUSR2, which the
ranks registered with faulthandler; py-spy too where installed) and torch's collective flight
recorder (flight_recorder.py: rankN.flight_recorder.pkl), names the stuck rank(s), stops
the job and exits with HANG_EXIT. Without a supervisor of ours (one task per GPU under Slurm or
mpiexec), each rank's own watchdog thread dumps its stacks and exits with HANG_EXIT, so the
scheduler (srun --kill-on-bad-exit=1) ends the step.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

HANG_EXIT = 124  # as timeout(1): "it timed out"; job scripts may requeue on it
DUMP_SIGNAL = signal.SIGUSR2  # ranks register faulthandler on it: the supervisor asks for stacks with it
FLOOR = 180.0  # seconds: the shortest adaptive step allowance
FACTOR = 20.0  # x the median recent step time
MEASURED_STEPS = 3  # steps timed before the step allowance applies (earlier ones may compile)
SLOW_PHASE = 1800.0  # seconds: start-up, evaluation, saving, first steps
RECORD_BYTES = 256  # each progress record is rewritten in place at this fixed size
RECORDER_WAIT = 5.0  # seconds to wait for the flight recorder note after a rank's stacks arrived
RECORDER_NOTE = b"flight recorder: "  # the line a rank's dump thread appends to its stacks file (progress.py)


@dataclass(frozen=True)
class Timeouts:
    """The allowances before a silent rank counts as hung. step=None: adaptive; step=0: no watchdog."""

    step: float | None = None
    slow_phase: float = SLOW_PHASE

    @property
    def enabled(self) -> bool:
        return self.step != 0

    def allowance(self, phase: str, step_times: list[float]) -> float:
        """Seconds of silence allowed after a report in `phase` (0: not watched)."""
        if not self.enabled:
            return 0.0
        if phase != "step" or len(step_times) < MEASURED_STEPS:
            return max(self.slow_phase, self.step or 0.0)
        if self.step is not None:
            return self.step
        return max(FLOOR, FACTOR * median(step_times))


@dataclass(frozen=True)
class Record:
    """One rank's last progress report."""

    rank: int
    pid: int
    phase: str
    iteration: int
    time: float  # wall clock (time.time()) of the report
    allowance: float

    def overdue(self, now: float) -> float:
        """Seconds past the allowance (<= 0 while in time)."""
        return now - self.time - self.allowance

    def encode(self) -> bytes:
        text = json.dumps(self.__dict__, separators=(",", ":")).encode()
        return text.ljust(RECORD_BYTES - 1) + b"\n"

    @classmethod
    def read(cls, path: Path) -> Record | None:
        try:
            return cls(**json.loads(path.read_bytes()))
        except (OSError, ValueError, TypeError):  # not written yet, or read mid-write: the next poll sees it
            return None


def progress_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.progress"


def stacks_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.stacks"


def trace_path(directory: str | Path, rank: int) -> Path:
    """Where a rank's flight recorder dump goes (flight_recorder.dump)."""
    return Path(directory) / f"rank{rank}.flight_recorder.pkl"


def process_state(pid: int) -> str:
    """The kernel's one-letter state (R, S, D, T, Z...) or '?' when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


STATE_WHY = {"T": "stopped (SIGSTOP or a debugger): it cannot dump its own stacks",
             "t": "stopped by a tracer: it cannot dump its own stacks",
             "D": "in uninterruptible sleep (a hung filesystem, device or driver call)",
             "Z": "exited", "?": "gone"}


@dataclass
class Verdict:
    """What the supervisor found when the watchdog fired."""

    overdue: list[Record]
    stuck: dict[int, str]  # rank -> why it is named
    stacks: dict[int, Path]  # rank -> file with its stacks (absent when it could not dump)
    recorders: dict[int, Path] = field(default_factory=dict)  # rank -> its flight recorder dump, where written

    def describe(self, timeout_note: str) -> str:
        now = time.time()
        each = "; ".join(f"rank {r.rank}: silent {now - r.time:.0f} s, allowance {r.allowance:g} s in phase "
                         f"'{r.phase}', last iteration {r.iteration}"
                         for r in sorted(self.overdue, key=lambda r: r.rank))
        lines = [f"HANG: no rank made progress within its allowance ({timeout_note}): {each}"]
        if self.stuck:
            for rank, why in sorted(self.stuck.items()):
                lines.append(f"stuck rank: {rank}: {why}")
        else:
            lines.append("stuck rank: could not tell which (every rank here waits in a collective: the stuck rank "
                         "may be on another node)")
        for rank, path in sorted(self.stacks.items()):
            lines.append(f"stacks of rank {rank}: {path}")
        for rank, path in sorted(self.recorders.items()):
            lines.append(f"flight recorder of rank {rank}: {path}")
        return "\n".join(lines)


def _in_collective(stacks: str) -> bool:
    return "torch/distributed" in stacks or "deepspeed/comm" in stacks


def dump_stacks(records: dict[int, Record], directory: Path, wait: float = 5.0) -> dict[int, Path]:
    """Ask every rank for its stacks (faulthandler on DUMP_SIGNAL; py-spy too where installed).

    Returns the files that received stacks. A stopped rank cannot answer the signal; py-spy, when
    present, still reads its stacks from outside.
    """
    before = {rank: _size(stacks_path(directory, rank)) for rank in records}
    for record in records.values():
        try:
            os.kill(record.pid, DUMP_SIGNAL)
        except ProcessLookupError:
            pass
    py_spy = shutil.which("py-spy")
    if py_spy:
        for rank, record in records.items():
            with open(stacks_path(directory, rank), "ab") as out:
                out.write(b"\n--- py-spy dump\n")
                out.flush()
                subprocess.run([py_spy, "dump", "--pid", str(record.pid)], stdout=out, stderr=subprocess.STDOUT,
                               timeout=30, check=False)
    # a stopped, exited or kernel-blocked rank cannot answer: wait only for the others
    can_answer = {rank for rank, r in records.items() if process_state(r.pid) not in ("T", "t", "Z", "?")}
    deadline = time.monotonic() + wait
    answered: set[int] = set()
    while time.monotonic() < deadline and not can_answer <= answered:
        for rank in records:
            if _size(stacks_path(directory, rank)) > before[rank]:
                answered.add(rank)
        time.sleep(0.1)
    time.sleep(0.2)  # let a dump that just began finish
    # the flight recorder follows the stacks (a thread in the rank); a rank that is no trainer writes none
    deadline = time.monotonic() + RECORDER_WAIT
    while time.monotonic() < deadline and not all(_noted(stacks_path(directory, r), before[r]) for r in answered):
        time.sleep(0.1)
    return {rank: stacks_path(directory, rank) for rank in sorted(answered)}


def _noted(path: Path, offset: int) -> bool:
    """Whether the flight recorder note arrived after `offset` in a rank's stacks file."""
    try:
        with open(path, "rb") as stacks:
            stacks.seek(offset)
            return RECORDER_NOTE in stacks.read()
    except OSError:
        return False


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def name_stuck(records: dict[int, Record], stacks: dict[int, Path]) -> dict[int, str]:
    """The rank(s) to blame, with the reason, strongest evidence first:

    1. a rank that could not dump its stacks (stopped, in uninterruptible sleep, gone);
    2. a rank whose last iteration is behind the others';
    3. a rank that dumped stacks outside any collective while the others wait inside one.
    """
    stuck = {}
    for rank, record in records.items():
        if rank not in stacks:
            state = process_state(record.pid)
            stuck[rank] = (f"pid {record.pid} did not answer the stack dump request; process state {state}: "
                           f"{STATE_WHY.get(state, 'running but not answering')}")
    if stuck:
        return stuck
    furthest = max(r.iteration for r in records.values())
    behind = {rank: f"did not reach iteration {furthest} (last finished: {r.iteration}, phase '{r.phase}')"
              for rank, r in records.items() if r.iteration < furthest}
    if behind:
        return behind
    texts = {rank: path.read_text(errors="replace") for rank, path in stacks.items()}
    waiting = {rank for rank, text in texts.items() if _in_collective(text)}
    if waiting and len(waiting) < len(texts):
        return {rank: "not inside a collective while the other ranks wait in one (see its stacks)"
                for rank in texts if rank not in waiting}
    return {}


class Watchdog:
    """The supervisor's side: polls the ranks' progress records and decides when the job hangs."""

    def __init__(self, directory: Path, ranks: list[int], *, poll: float = 0.5):
        self.directory, self.ranks, self.poll = Path(directory), ranks, poll
        self.records: dict[int, Record] = {}
        self.next_poll = 0.0

    def overdue(self, live: set[int]) -> list[Record]:
        """The live ranks' records when every one of them is past its allowance, else [].

        Every rank must be silent: one rank saving a checkpoint (a long allowance) while the others
        already wait for it in the next step's collective is progress, not a hang. Ranks that never
        reported are not watched (a command that is no trainer never reports).
        """
        now_mono = time.monotonic()
        if now_mono < self.next_poll:
            return []
        self.next_poll = now_mono + self.poll
        for rank in self.ranks:
            record = Record.read(progress_path(self.directory, rank))
            if record is not None:
                self.records[rank] = record
        watched = [r for rank, r in self.records.items() if rank in live and r.allowance > 0]
        now = time.time()
        if watched and all(r.overdue(now) > 0 for r in watched):
            return watched
        return []

    def investigate(self, overdue: list[Record]) -> Verdict:
        records = {r.rank: r for r in overdue}
        stacks = dump_stacks(records, self.directory)
        recorders = {rank: trace_path(self.directory, rank) for rank in records
                     if trace_path(self.directory, rank).exists()}
        return Verdict(overdue, name_stuck(records, stacks), stacks, recorders)

    def last_iteration(self) -> int | None:
        """The furthest iteration any rank reported (read now: a crash may follow the last poll)."""
        records = [Record.read(progress_path(self.directory, rank)) for rank in self.ranks]
        iterations = [r.iteration for r in records if r is not None]
        return max(iterations) if iterations else None
