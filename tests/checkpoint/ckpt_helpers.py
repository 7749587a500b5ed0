"""Helpers for the checkpoint tests: start real rank processes (gloo on CPU), `entrypoint` runs as a user
types them (the launcher variables of the test's own environment removed), and read their metrics."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from megatron_ds.runtime.rendezvous import hosted_store

DRIVER = Path(__file__).with_name("engine_driver.py")
ENTRYPOINT = os.path.join(os.path.dirname(sys.executable), "entrypoint")
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "SLURM_PROCID", "SLURM_NTASKS", "PMI_RANK", "OMPI_COMM_WORLD_RANK")
GPT = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
       "--max-position-embeddings", "32"]


class Ranks:
    """One process per rank, each with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* set, around a rendezvous store served
    here (what a launcher does)."""

    def __init__(self, argv: list[str], world: int, cwd: Path, log_name: str = "run"):
        self._scope = contextlib.ExitStack()
        store = self._scope.enter_context(hosted_store())
        self.logs = [cwd / f"{log_name}.rank{r}.log" for r in range(world)]
        self.procs = []
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", **store.rank_env,
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
            raise AssertionError(f"ranks did not finish in {timeout}s:\n{self.output()}") from None
        finally:
            self._scope.close()

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


def val_losses(metrics_file: Path) -> dict[int, float]:
    """{iteration: val_loss} from a JSONL metrics file."""
    records = (json.loads(line) for line in metrics_file.read_text().splitlines())
    return {r["iteration"]: r["val_loss"] for r in records if "val_loss" in r}


def metrics(cwd: Path) -> tuple[dict[int, float], dict[int, float]]:
    """({iteration: lm_loss}, {iteration: val_loss}) of a run directory (its metrics.jsonl)."""
    return losses(cwd / "metrics.jsonl"), val_losses(cwd / "metrics.jsonl")


def env() -> dict[str, str]:
    """The test's environment without launcher variables (the launcher serves the rendezvous), one thread per
    rank."""
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    return dict(clean, OMP_NUM_THREADS="1")


def train_argv(corpus, ranks: int, flags: list[str], *, iters: int = 10, model: list[str] = GPT) -> list[str]:
    """`entrypoint train` on the embedded corpus: batch 4 (micro 2), cosine LR, eval every 5, metrics.jsonl."""
    argv = [ENTRYPOINT, "train", *model, "--data-path", corpus.prefix, "--vocab-file", corpus.vocab_file,
            "--merge-file", corpus.merge_file, "--tokenizer-type", "GPT2BPETokenizer", "--split", "98,2,0",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(iters), "--lr", "1e-3",
            "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--min-lr", "1e-4", "--seed", "7",
            "--log-interval", "1", "--eval-interval", "5", "--eval-iters", "1", "--metrics-file", "metrics.jsonl",
            *flags]
    return argv + (["--nproc-per-node", str(ranks)] if ranks > 1 else [])


def run(argv: list[str], cwd: Path, code: int | None = 0, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a command in ``cwd`` (created); assert its exit code (``code=None``: any failure)."""
    cwd.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(argv, cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout)
    ok = result.returncode != 0 if code is None else result.returncode == code
    assert ok, f"exit {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


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


def rank_pids(supervisor: subprocess.Popen, ranks: int, timeout: float = 120) -> dict[int, int]:
    """{rank: pid} of the ranks `entrypoint train --nproc-per-node` spawned."""
    found: dict[int, int] = {}

    def scan() -> bool:
        try:
            children = Path(f"/proc/{supervisor.pid}/task/{supervisor.pid}/children").read_text().split()
        except OSError:
            return False
        for pid in map(int, children):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for item in environ:
                if item.startswith(b"RANK="):
                    found[int(item[5:])] = pid
        return len(found) == ranks

    wait_for(scan, timeout, "the ranks to start")
    return found
