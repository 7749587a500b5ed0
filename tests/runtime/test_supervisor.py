"""The supervisor with a rank it cannot reap: it names the rank and ends the job instead of hanging; and with
ranks that stop alike (a FINAL exit code): the last one still says why before the job ends.

The unreapable rank is real: a tracer in another session seizes it (ptrace), so once the rank
dies its exit is reported to the tracer only, and the supervisor's waitpid keeps saying "running"
for as long as the tracer lives (the kernel's rule: a zombie ptracee is visible only to its tracer).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runtime_helpers import clean_env

pytestmark = pytest.mark.slow
PY = sys.executable

RANK = """
import ctypes, os, signal, sys, time
out, rank, on_term = sys.argv[1], os.environ["RANK"], sys.argv[2]
if rank == "1" and on_term == "exit0":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
open(f"{out}/pid_{rank}", "w").write(str(os.getpid()))  # once the handler is in place
if rank == "0":
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)  # PR_SET_PTRACER, PR_SET_PTRACER_ANY (Yama, if any)
    me = os.getpid()
    if os.fork() == 0:
        os.setsid()  # out of the rank's process group: the supervisor's killpg does not reach the tracer
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # nor should it hold the test's pipes open
            os.dup2(null, fd)
        seized = libc.ptrace(0x4206, me, None, None) == 0  # PTRACE_SEIZE, and never waitpid on it
        note = str(os.getpid()) if seized else f"ptrace failed: errno {ctypes.get_errno()}"
        open(f"{out}/tracer.tmp", "w").write(note)
        os.rename(f"{out}/tracer.tmp", f"{out}/tracer")
        while True:
            signal.pause()
    time.sleep(300)
else:
    while not os.path.exists(f"{out}/tracer"):
        time.sleep(0.05)
    if on_term == "fail":
        sys.exit(3)
    time.sleep(300)
"""

DRIVER = """
import os, sys
from megatron_ds.runtime.supervisor import RankSpec, supervise
out, script, on_term = sys.argv[1:]
specs = [RankSpec(rank=r, local_rank=r, argv=[sys.executable, script, out, on_term], env=dict(os.environ, RANK=str(r)))
         for r in range(2)]
sys.exit(supervise(specs, grace=1, reap_wait=2))
"""


def _wait_for(path: Path, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists(), f"{path.name} never appeared"
    return path.read_text()


@pytest.mark.parametrize("case, expected", [("fail", 3), ("exit0", 128 + signal.SIGKILL)])
def test_an_unreapable_rank_is_named_and_the_job_still_ends(tmp_path, case, expected):
    """Rank 0 cannot be reaped. "fail": rank 1 exits 3, the job ends with 3; "exit0": a TERM from outside,
    rank 1 leaves cleanly, and the job ends with 137 (rank 0 never reported an exit)."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    proc = subprocess.Popen([PY, "-c", DRIVER, str(tmp_path), str(script), case], env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    tracer = None
    try:
        note = _wait_for(tmp_path / "tracer")
        _wait_for(tmp_path / "pid_1")
        assert note.isdigit(), note
        tracer = int(note)
        start = time.monotonic()
        if case == "exit0":
            proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)  # grace 1 s + reap_wait 2 s; the old supervisor never returned
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if tracer is not None:
            os.kill(tracer, signal.SIGKILL)  # lets rank 0's exit reach init, which reaps it
    rank0 = int((tmp_path / "pid_0").read_text())
    assert proc.returncode == expected, stderr
    assert elapsed < 20, f"took {elapsed:.1f} s"
    assert f"rank 0 (local rank 0, pid {rank0}) could not be reaped 2 s after SIGKILL" in stderr, stderr
    assert "held, e.g. by a tracer" in stderr, stderr
    assert stderr.count("SIGKILL\n") == 1, f"SIGKILL sent more than once:\n{stderr}"


STOPS_ALIKE = """
import os, sys, time
code = int(sys.argv[1])
if os.environ["RANK"] == "0":
    time.sleep(1.5)  # reaches the shared stop later than rank 1, then says why (no SIGTERM handler: TERM ends it)
    print("rank 0: stopped at the same step", flush=True)
sys.exit(code)
"""


@pytest.mark.parametrize("code, said", [(65, True), (74, True), (1, False)])
def test_ranks_that_stop_alike_finish_their_last_line(tmp_path, code, said):
    """Rank 1 exits first. With a FINAL code (65: a non-finite loss, 74: a refused save) rank 0, stopping at the
    same point, prints its line and exits by itself; with an ordinary failure (1) it is stopped at once."""
    script = tmp_path / "rank.py"
    script.write_text(STOPS_ALIKE)
    driver = ("import os, sys\nfrom megatron_ds.runtime.supervisor import RankSpec, supervise\n"
              f"specs = [RankSpec(r, r, [sys.executable, {str(script)!r}, '{code}'], dict(os.environ, RANK=str(r)))"
              " for r in range(2)]\nsys.exit(supervise(specs, grace=5))\n")
    started = time.monotonic()
    result = subprocess.run([PY, "-c", driver], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == code, result.stderr
    assert ("rank 0: stopped at the same step" in result.stdout) is said, result.stdout + result.stderr
    assert "still alive at the grace deadline" not in result.stderr, result.stderr
    assert time.monotonic() - started < 5, "rank 0 ended within the grace, and the job with it"
    waiting = "waiting up to 5 s for 1 other rank(s) to stop there too"
    assert (waiting in result.stderr) is said, result.stderr
