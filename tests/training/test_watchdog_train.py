"""Hangs and restarts of `entrypoint train --nproc-per-node 2`, as a user meets them: real ranks, gloo on CPU.

A SIGSTOPped rank (what a rank stuck in a kernel, a dead NFS mount or a deadlock looks like from outside)
must be found, named and stopped within the watchdog's timeout + 15 s, with exit code 124; a slow start
must not trip the watchdog; a SIGKILLed rank with --max-restarts resumes from `latest` and reproduces the
uninterrupted run's losses bitwise.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ENTRYPOINT = os.path.join(os.path.dirname(sys.executable), "entrypoint")
HANG_EXIT = 124
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MDS_WATCHDOG_DIR")


def train_argv(corpus, out: Path, iters: int, *extra: str) -> list[str]:
    return [ENTRYPOINT, "train", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "64", "--max-position-embeddings", "64", "--data-path", corpus.prefix,
            "--vocab-file", corpus.vocab_file, "--merge-file", corpus.merge_file, "--tokenizer-type",
            "GPT2BPETokenizer", "--split", "98,2,0", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", str(iters), "--lr", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--seed", "7", "--log-interval", "1", "--eval-iters", "0", "--metrics-file", str(out / "metrics.jsonl"),
            "--nproc-per-node", "2", *extra]


def env_for(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    env["TMPDIR"] = str(tmp)  # the supervisor's watchdog directory (mds-watchdog-*) lands here
    return env


def iterations(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if '"lm_loss"' in line]


def wait_for_iteration(proc: subprocess.Popen, metrics: Path, iteration: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = iterations(metrics)
        if done and done[-1]["iteration"] >= iteration:
            return
        assert proc.poll() is None, f"training ended early ({proc.returncode}):\n{proc.communicate()[1][-4000:]}"
        time.sleep(0.05)
    raise AssertionError(f"iteration {iteration} not reached in {timeout} s")


def rank_pid(tmp: Path, rank: int) -> int:
    (directory,) = tmp.glob("mds-watchdog-*")
    return json.loads((directory / f"rank{rank}.progress").read_bytes())["pid"]


def finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def test_sigstopped_rank_is_named_stacks_dumped_and_the_job_stops_with_124(tmp_path, demo_corpus):
    timeout = 8
    proc = subprocess.Popen(train_argv(demo_corpus, tmp_path, 100000, "--watchdog-timeout", str(timeout)),
                            cwd=tmp_path, env=env_for(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    wait_for_iteration(proc, tmp_path / "metrics.jsonl", 10)
    stopped = rank_pid(tmp_path, 1)
    os.kill(stopped, signal.SIGSTOP)
    start = time.monotonic()
    _, stderr = finish(proc, timeout + 60)
    detected = time.monotonic() - start
    print(f"\nSIGSTOP -> job ended in {detected:.1f} s (--watchdog-timeout {timeout})")
    assert proc.returncode == HANG_EXIT, f"exit code {proc.returncode}\n{stderr[:3000]}\n...\n{stderr[-5000:]}"
    assert detected <= timeout + 15, f"took {detected:.1f} s\n{stderr[-4000:]}"
    assert re.search(rf"stuck rank: 1: pid {stopped} did not answer the stack dump request; process state T: "
                     r"stopped .*it cannot dump its own stacks", stderr), stderr[-4000:]
    assert "stuck rank: 0" not in stderr
    stacks = Path(re.search(r"stacks of rank 0: (\S+)", stderr).group(1))
    text = stacks.read_text()
    # waiting for rank 1 inside a collective of the loop: a step's all_reduce or, when rank 1 stopped between
    # steps, a log point's all_gather (the stragglers' gather), as CI once showed
    assert "torch/distributed" in text and "loop.py" in text and ("all_reduce" in text or "all_gather" in text), text
    assert "stacks of rank 1:" not in stderr  # a stopped process cannot write them
    assert f"exit code {HANG_EXIT}" in stderr
    assert not _alive(stopped)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_slow_start_and_saving_do_not_trip_a_short_watchdog(tmp_path, demo_corpus):
    """Start-up (imports, DeepSpeed, process groups: many seconds here) and saving have their own allowance:
    a 1 s step timeout stops nothing in a healthy run."""
    metrics = tmp_path / "metrics.jsonl"
    start = time.monotonic()
    proc = subprocess.Popen(train_argv(demo_corpus, tmp_path, 30, "--watchdog-timeout", "1", "--save",
                                       str(tmp_path / "ckpt"), "--save-interval", "10"),
                            cwd=tmp_path, env=env_for(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    wait_for_iteration(proc, metrics, 1)
    first_step = time.monotonic() - start
    _, stderr = finish(proc, 300)
    assert proc.returncode == 0, stderr[-4000:]
    assert first_step > 2, f"the first step came {first_step:.1f} s after launch: too soon to show that start-up " \
                           "outlasts the 1 s timeout"
    assert "HANG" not in stderr
    assert [r["iteration"] for r in iterations(metrics)] == list(range(1, 31))
    assert not list(tmp_path.glob("mds-watchdog-*")), "a successful run leaves no watchdog directory"


def test_sigkilled_rank_restarts_from_latest_and_matches_the_uninterrupted_run(tmp_path, demo_corpus):
    iters = 120
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    reference = subprocess.run(train_argv(demo_corpus, reference_dir, iters), cwd=reference_dir,
                               env=env_for(reference_dir), capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-4000:]
    want = {r["iteration"]: r["lm_loss"] for r in iterations(reference_dir / "metrics.jsonl")}

    run_dir = tmp_path / "restarted"
    run_dir.mkdir()
    ckpt = str(run_dir / "ckpt")
    proc = subprocess.Popen(train_argv(demo_corpus, run_dir, iters, "--save", ckpt, "--load", ckpt, "--save-interval",
                                       "20", "--max-restarts", "1"),
                            cwd=run_dir, env=env_for(run_dir), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    wait_for_iteration(proc, run_dir / "metrics.jsonl", 30)
    os.kill(rank_pid(run_dir, 1), signal.SIGKILL)
    _, stderr = finish(proc, 300)
    assert proc.returncode == 0, stderr[-4000:]
    restart = re.search(r"restart 1/1 after exit code 137 of rank 1 at iteration (\d+)", stderr)
    assert restart, stderr[-4000:]
    records = iterations(run_dir / "metrics.jsonl")
    # the second attempt starts logging right after the checkpoint it resumed from
    starts = [i for i in range(1, len(records)) if records[i]["iteration"] <= records[i - 1]["iteration"]]
    assert len(starts) == 1, [r["iteration"] for r in records]
    first_resumed = records[starts[0]]["iteration"]
    assert first_resumed - 1 in (20, 40, 60, 80, 100) and first_resumed <= int(restart.group(1)) + 1, \
        (first_resumed, restart.group(0))
    got = {r["iteration"]: r["lm_loss"] for r in records[starts[0]:]}
    assert sorted(got) == list(range(first_resumed, iters + 1))
    assert {i: got[i] for i in got} == {i: want[i] for i in got}  # bitwise: same floats after the resume point


def test_one_process_with_max_restarts_runs_supervised_and_resumes_from_latest(tmp_path, demo_corpus):
    """No launcher and no --nproc-per-node: with --max-restarts the one rank runs as a supervised child (it ran in
    the entrypoint's own process before, where the flag could do nothing), so a killed rank resumes from `latest`."""
    ckpt = str(tmp_path / "ckpt")
    argv = train_argv(demo_corpus, tmp_path, 40, "--save", ckpt, "--load", ckpt, "--save-interval", "10",
                      "--max-restarts", "1")
    at = argv.index("--nproc-per-node")
    del argv[at:at + 2]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env_for(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    wait_for_iteration(proc, tmp_path / "metrics.jsonl", 15)
    os.kill(rank_pid(tmp_path, 0), signal.SIGKILL)
    _, stderr = finish(proc, 300)
    assert proc.returncode == 0, stderr[-4000:]
    assert re.search(r"spawning 1 local rank\(s\) \(.*; started as a supervised child for --max-restarts 1\)",
                     stderr), stderr[-4000:]
    assert re.search(r"restart 1/1 after exit code 137 of rank 0 at iteration \d+", stderr), stderr[-4000:]
    records = iterations(tmp_path / "metrics.jsonl")
    starts = [i for i in range(1, len(records)) if records[i]["iteration"] <= records[i - 1]["iteration"]]
    assert len(starts) == 1 and records[starts[0]]["iteration"] - 1 in (10, 20, 30), [r["iteration"] for r in records]
    assert records[-1]["iteration"] == 40
