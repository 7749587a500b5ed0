"""An ordered map over worker processes that can always be stopped at once.

``multiprocessing.Pool`` shares one result pipe between its workers. Terminating it while a
worker is half-way through sending a large result leaves the pool's result thread waiting for
the rest of that message forever: an interrupted preprocess hung that way. Here every worker has
its own pair of pipes, task k goes to worker k mod N and results are read back in the same order,
so nothing is shared and stopping is just killing the workers. A worker that dies is reported,
never waited for.
"""

from __future__ import annotations

import multiprocessing
import queue
import signal
import threading
import traceback
from typing import Callable, Iterable, Iterator


class WorkerError(RuntimeError):
    """A worker raised or died; the message names it and carries its traceback or exit code."""


def _serve(tasks, results, parent_ends, initializer, initargs, function) -> None:
    """A worker: a thread receives tasks as soon as they are sent (so the parent's send never waits
    on our sends), the main thread runs them in order and sends each answer back."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent decides
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for end in parent_ends:  # inherited through fork; holding them would hide the parent's exit from others
        end.close()
    try:
        if initializer is not None:
            initializer(*initargs)
    except BaseException:
        results.send((False, traceback.format_exc()))
        return
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def receive():
        try:
            while True:
                task = tasks.recv()
                inbox.put(task)
                if task is None:
                    return
        except (EOFError, OSError):  # the parent is gone
            inbox.put(None)

    threading.Thread(target=receive, daemon=True).start()
    while (task := inbox.get()) is not None:
        try:
            answer = (True, function(task))
        except BaseException:
            answer = (False, traceback.format_exc())
        try:
            results.send(answer)
        except (BrokenPipeError, OSError):
            return


class OrderedWorkers:
    """``map(tasks)`` yields ``function(task)`` in task order, computed by ``workers`` processes with at
    most ``depth`` tasks queued per worker. Use as a context manager: leaving normally stops the
    workers politely, leaving on an exception (or KeyboardInterrupt) kills them."""

    def __init__(self, workers: int, function: Callable, initializer: Callable | None = None,
                 initargs: tuple = (), depth: int = 2, context=None):
        ctx = context or multiprocessing.get_context(
            "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
        self.depth = depth
        self._procs, self._tasks, self._results = [], [], []
        fork = ctx.get_start_method() == "fork"
        try:
            for _ in range(workers):  # pipes made one worker at a time, so no child inherits another's ends
                task_r, task_w = ctx.Pipe(duplex=False)
                result_r, result_w = ctx.Pipe(duplex=False)
                inherited = self._tasks + self._results + [task_w, result_r] if fork else []
                proc = ctx.Process(target=_serve, daemon=True, name="mds-worker",
                                   args=(task_r, result_w, inherited, initializer, initargs, function))
                proc.start()
                self._procs.append(proc)
                self._tasks.append(task_w)
                self._results.append(result_r)
                task_r.close()
                result_w.close()
        except BaseException:
            self.kill()
            raise

    def map(self, tasks: Iterable) -> Iterator:
        tasks = iter(tasks)
        n = len(self._procs)
        sent = received = 0
        for task in tasks:  # fill every worker's queue
            self._send(sent % n, task)
            sent += 1
            if sent == n * self.depth:
                break
        while received < sent:
            answer = self._receive(received % n)
            received += 1
            for task in tasks:  # at most one: keep the queue full
                self._send(sent % n, task)
                sent += 1
                break
            yield answer

    def _send(self, i: int, task) -> None:
        try:
            self._tasks[i].send(task)
        except (BrokenPipeError, OSError):
            raise WorkerError(self._died(i)) from None

    def _receive(self, i: int):
        try:
            ok, value = self._results[i].recv()
        except (EOFError, OSError):
            raise WorkerError(self._died(i)) from None
        if not ok:
            raise WorkerError(f"worker {i} (pid {self._procs[i].pid}) failed:\n{value}")
        return value

    def _died(self, i: int) -> str:
        proc = self._procs[i]
        proc.join(timeout=5)
        code = proc.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return f"worker {i} (pid {proc.pid}) {how} before returning its task"

    def close(self) -> None:
        """Tell the workers there is no more work and wait for them."""
        for conn in self._tasks:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=30)
        self.kill()  # any that did not leave

    def kill(self) -> None:
        for proc in self._procs:
            if proc.exitcode is None:
                proc.kill()
        for proc in self._procs:
            proc.join()
        for conn in self._tasks + self._results:
            conn.close()

    def __enter__(self) -> OrderedWorkers:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.kill()
