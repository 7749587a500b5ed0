"""OrderedWorkers: results in task order, failures named, and stopping never hangs (real processes)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_ds.data.workers import OrderedWorkers, WorkerError


def square_slowly(x):
    time.sleep(0.001 * (x % 3))  # workers finish out of order
    return x * x


def fail_on_seven(x):
    if x == 7:
        raise ValueError("seven is bad")
    return x


def die_on_five(x):
    if x == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def big_answer(x):
    return bytes(4 << 20)  # far larger than a pipe buffer: the worker is mid-send most of the time


def set_offset(value):
    global OFFSET
    OFFSET = value


def add_offset(x):
    return x + OFFSET


def test_results_come_back_in_task_order():
    with OrderedWorkers(3, square_slowly, depth=2) as workers:
        assert list(workers.map(range(50))) == [x * x for x in range(50)]
        assert list(workers.map([])) == []  # reusable, and an empty input is fine


def test_initializer_runs_in_every_worker():
    with OrderedWorkers(2, add_offset, set_offset, (100,)) as workers:
        assert list(workers.map(range(4))) == [100, 101, 102, 103]


def test_a_worker_exception_names_it_and_carries_the_traceback():
    with pytest.raises(WorkerError, match=r"failed:(.|\n)*ValueError: seven is bad"):
        with OrderedWorkers(2, fail_on_seven) as workers:
            list(workers.map(range(20)))


def test_a_killed_worker_is_reported_not_waited_for():
    start = time.monotonic()
    with pytest.raises(WorkerError, match="killed by signal 9 before returning its task"):
        with OrderedWorkers(2, die_on_five) as workers:
            list(workers.map(range(20)))
    assert time.monotonic() - start < 10


def test_leaving_mid_send_kills_every_worker_at_once():
    """The hang multiprocessing.Pool.terminate() can hit: workers half-way through sending big results."""
    for _ in range(5):
        workers = OrderedWorkers(2, big_answer, depth=2)
        procs = list(workers._procs)
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            with workers:
                for i, _ in enumerate(workers.map(range(100))):
                    if i == 3:
                        raise KeyboardInterrupt
        assert time.monotonic() - start < 10
        assert all(p.exitcode is not None for p in procs)


def test_workers_leave_when_the_parent_is_killed(tmp_path):
    script = textwrap.dedent("""
        import sys, time
        from megatron_ds.data.workers import OrderedWorkers
        workers = OrderedWorkers(3, abs)
        print(" ".join(str(p.pid) for p in workers._procs), flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 3
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.05)
    assert not alive, f"workers {alive} outlived their parent"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has left (its parent is gone)
    except FileNotFoundError:
        return False
