"""--async-save: the files equal a synchronous save's byte for byte, a SIGKILL during the background write loses
only that save, the next save waits for the one in flight, and an in-job restart from an async checkpoint
continues exactly (bitwise losses, fp32 on CPU with dropout on)."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_helpers import DRIVER, Ranks, env, losses, metrics, rank_pids, run, run_driver, train_argv, wait_for

from megatron_ds.env_settings import TEST_SLOW_RANK

pytestmark = pytest.mark.slow

LAYOUTS = {"zero2": ["--zero-stage", "2"], "pp2": ["--pipeline-model-parallel-size", "2"]}


def _checkpoint_files(ckpt: Path) -> dict[str, bytes]:
    return {str(p.relative_to(ckpt)): p.read_bytes() for p in sorted(ckpt.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_async_files_equal_a_synchronous_saves(name, demo_corpus, tmp_path):
    flags = [*LAYOUTS[name], "--save", "ckpt", "--save-interval", "5"]
    run(train_argv(demo_corpus, 2, flags), tmp_path / "sync")
    run(train_argv(demo_corpus, 2, [*flags, "--async-save"]), tmp_path / "async")
    assert metrics(tmp_path / "async") == metrics(tmp_path / "sync")  # training is not changed by it
    sync, asynchronous = _checkpoint_files(tmp_path / "sync" / "ckpt"), _checkpoint_files(tmp_path / "async" / "ckpt")
    assert sorted(asynchronous) == sorted(sync)
    assert any(name.endswith("model_states.pt") for name in sync) and "latest" in sync
    for file, data in sync.items():
        if file.endswith("mds_checkpoint.json"):  # when it was saved, and the flag itself
            mine, theirs = json.loads(asynchronous[file]), json.loads(data)
            assert mine.pop("saved_at") and theirs.pop("saved_at")
            assert (mine["args"].pop("async_save"), theirs["args"].pop("async_save")) == (True, False)
            for record in (mine, theirs):  # RNG files: below
                record["files"] = {k: v for k, v in record["files"].items() if "mds_rng_rank" not in k}
            assert mine == theirs
        elif "mds_rng_rank" in file:  # python's and numpy's generators are seeded by the OS in every process
            mine, theirs = (torch.load(io.BytesIO(b), weights_only=False) for b in (asynchronous[file], data))
            assert torch.equal(mine["torch"], theirs["torch"]) and mine["cuda"] == theirs["cuda"] is None
            assert mine["python"] != theirs["python"]  # as between any two runs, saved and restored as they are
        else:
            assert asynchronous[file] == data, file  # the same bytes


def test_sigkill_during_the_background_write_loses_only_that_save(tmp_path):
    """Each file takes 2 s to write: training runs on while iteration 5 is written, the save of 10 starts only
    once 5 is published, and a SIGKILL while 10 is written leaves 5 as `latest`; the resume is exact."""
    argv = [sys.executable, str(DRIVER), "--train-iters", "10", "--save", "ckpt", "--save-interval", "5",
            "--async-save", "--slow-save", "2", "--metrics-file", "killed.jsonl"]
    ranks = Ranks(argv, 1, tmp_path, "killed")
    ckpt = tmp_path / "ckpt"
    seen = {}

    def publishes_5_before_writing_10() -> bool:
        tmp10 = ckpt / ".tmp-iter_0000010"
        if tmp10.is_dir():
            assert (ckpt / "latest").is_file() and (ckpt / "latest").read_text() == "iter_0000005"
        if "trained" not in seen and (ckpt / "latest").is_file():
            seen["trained"] = max(losses(tmp_path / "killed.jsonl"))  # when iteration 5 became `latest`
        return tmp10.is_dir() and any(tmp10.iterdir())

    wait_for(publishes_5_before_writing_10, 120, "the background write of iteration 10", ranks)
    ranks.signal(signal.SIGKILL)
    assert ranks.wait(30) == [-signal.SIGKILL]
    assert seen["trained"] == 10  # iterations 6..10 trained while iteration 5 was being written
    killed = losses(tmp_path / "killed.jsonl")
    assert (ckpt / "latest").read_text() == "iter_0000005" and not (ckpt / "iter_0000010").exists()

    out = run_driver(["--train-iters", "10", "--load", "ckpt", "--save", "ckpt", "--async-save",
                      "--metrics-file", "resumed.jsonl"], 1, tmp_path, "resumed")
    assert "resuming from iteration 5 (40 samples)" in out
    assert "removed leftovers of interrupted saves: .tmp-iter_0000010" in out
    assert losses(tmp_path / "resumed.jsonl") == {i: killed[i] for i in range(6, 11)}  # bitwise
    assert (ckpt / "latest").read_text() == "iter_0000010"  # the end of training waited for the last save


def test_in_job_restart_from_an_async_checkpoint_continues_exactly(demo_corpus, tmp_path):
    """Two ranks, --max-restarts 1: rank 1 is SIGKILLed after the async save of iteration 10 is published; the
    restarted ranks resume from it and log the uninterrupted run's losses."""
    flags = ["--save", "ckpt", "--load", "ckpt", "--save-interval", "10", "--eval-iters", "0"]
    run(train_argv(demo_corpus, 2, flags, iters=30), tmp_path / "reference")
    cwd = tmp_path / "restarted"
    cwd.mkdir()
    slow = dict(env(), **{TEST_SLOW_RANK.name: "0:0.3"})  # 0.3 s a step: time to kill it mid-run
    argv = train_argv(demo_corpus, 2, [*flags, "--async-save", "--max-restarts", "1"], iters=30)
    with open(cwd / "log.txt", "w") as log:
        supervisor = subprocess.Popen(argv, cwd=cwd, env=slow, stdout=log, stderr=subprocess.STDOUT)
    try:
        pids = rank_pids(supervisor, 2)
        wait_for(lambda: (cwd / "ckpt" / "latest").is_file() and (cwd / "metrics.jsonl").is_file()
                 and max(metrics(cwd)[0]) >= 13, 180, "the async save of iteration 10 and iteration 13")
        killed_at = max(metrics(cwd)[0])
        os.kill(pids[1], signal.SIGKILL)
        assert supervisor.wait(300) == 0, (cwd / "log.txt").read_text()[-4000:]
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
    output = (cwd / "log.txt").read_text()
    assert re.search(r"restart 1/1 after exit code 137 of rank 1 at iteration \d+", output), output[-4000:]
    records = [r for r in map(json.loads, (cwd / "metrics.jsonl").read_text().splitlines()) if "lm_loss" in r]
    iterations = [r["iteration"] for r in records]
    restart = next(i for i in range(1, len(iterations)) if iterations[i] <= iterations[i - 1])
    assert iterations[restart] == 11 and iterations[restart - 1] >= killed_at, iterations
    resumed = {r["iteration"]: r["lm_loss"] for r in records[restart:]}
    want = metrics(tmp_path / "reference")[0]
    assert resumed == {i: want[i] for i in range(11, 31)}  # bitwise
    assert (cwd / "ckpt" / "latest").read_text() == "iter_0000030"
