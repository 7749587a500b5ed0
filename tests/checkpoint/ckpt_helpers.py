"""Helpers for the checkpoint tests: start real rank processes (gloo on CPU) and read their metrics."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

DRIVER = Path(__file__).with_name("engine_driver.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """One process per rank, each with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* set (what a launcher does)."""

    def __init__(self, argv: list[str], world: int, cwd: Path, log_name: str = "run"):
        port = free_port()
        self.logs = [cwd / f"{log_name}.rank{r}.log" for r in range(world)]
        self.procs = []
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
            with open(self.logs[rank], "w") as log:
                self.procs.append(subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                   start_new_session=True))

    def wait(self, timeout: float = 180) -> list[int]:
        deadline = time.time() + timeout
        try:
            return [p.wait(timeout=max(1, deadline - time.time())) for p in self.procs]
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"ranks did not finish in {timeout}s:\n{self.output()}")

    def signal(self, signum: int, ranks: list[int] | None = None) -> None:
        for rank in ranks if ranks is not None else range(len(self.procs)):
            self.procs[rank].send_signal(signum)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def output(self, rank: int | None = None) -> str:
        ranks = [rank] if rank is not None else range(len(self.logs))
        return "\n".join(f"--- rank {r} ---\n" + self.logs[r].read_text()[-4000:] for r in ranks)


def run_driver(args: list[str], world: int, cwd: Path, log_name: str = "run", timeout: float = 180) -> str:
    ranks = Ranks([sys.executable, str(DRIVER), *args], world, cwd, log_name)
    codes = ranks.wait(timeout)
    assert codes == [0] * world, f"exit codes {codes}\n{ranks.output()}"
    return ranks.output(0)


def losses(metrics_file: Path) -> dict[int, float]:
    """{iteration: loss} from a JSONL metrics file (the last line per iteration wins)."""
    out = {}
    for line in metrics_file.read_text().splitlines():
        record = json.loads(line)
        if "loss" in record or "lm_loss" in record:
            out[record["iteration"]] = record.get("lm_loss", record.get("loss"))
    return out


def wait_for(predicate, timeout: float, what: str, ranks: Ranks | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if ranks is not None and any(p.poll() is not None for p in ranks.procs):
            raise AssertionError(f"a rank exited while waiting for {what}:\n{ranks.output()}")
        time.sleep(0.05)
    if ranks is not None:
        ranks.kill()
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
