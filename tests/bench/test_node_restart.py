"""bench/node.py on the CPU. restart: a rank SIGKILLed at step 7 under --max-restarts 1 comes back from the step-5
checkpoint, step 6 is logged again, timed from the kill, and the resumed losses equal the uninterrupted run's; the
relaunched ranks' start-up line counts from the relaunch. fits: a site script's variables for a run too large for
the GPUs are refused before any rank starts, and the record says so."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--nproc-per-node", "2", "--tensor-model-parallel-size", "2", "--hidden-dropout", "0",
        "--attention-dropout", "0"]


@pytest.mark.slow
def test_restart_harness_times_the_way_back_and_compares_the_losses(tmp_path):
    cmd = [sys.executable, str(REPO / "bench" / "node.py"), "restart", "--name", "cpu_restart", "--steps", "10",
           "--kill-at", "7", "--save-interval", "5", "--timeout", "240", "--checkpoint-dir", str(tmp_path),
           "--work-dir", str(tmp_path / "work"), "--results-dir", str(tmp_path / "results"), "--", *TINY]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    record = json.loads((tmp_path / "results" / "cpu_restart.json").read_text())
    assert record["status"] == "ok" and record["first_resumed_iteration"] == 6
    assert 0 < record["restart_s"] < record["runs"]["restarted"]["wall_s"]
    assert record["runs"]["restarted"]["killed"] and not record["runs"]["uninterrupted_1"]["killed"]
    # fp32 on gloo: two uninterrupted runs agree bitwise, and so does the resumed one from step 6 on
    assert record["bound_two_uninterrupted_runs"] == 0.0 and record["max_rel_loss_diff_resumed"] == 0.0
    restarted, first = record["losses"]["restarted"], record["losses"]["uninterrupted_1"]
    assert [restarted[str(i)] for i in range(6, 11)] == [first[str(i)] for i in range(6, 11)]
    assert "restart 1/1 after exit code 137 of rank 1" in record["runs"]["restarted"]["log_tail"]
    assert not list(tmp_path.glob("mds_restart_*")), "the checkpoint directory is removed"
    # the relaunched ranks count their start-up from the relaunch, not from the first launch (MDS_STARTED_AT)
    since = re.findall(r"; ([0-9.]+) s since `entrypoint` started", record["runs"]["restarted"]["log_tail"])
    assert since and float(since[-1]) < record["restart_s"], record["runs"]["restarted"]["log_tail"]


def test_fits_records_a_refusal_before_any_rank_starts(tmp_path):
    """ALCF's GPT25B variables on four 140 GiB GPUs (an nvidia-smi that reports them: this machine has none)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nfor i in 1 2 3 4; do echo 143771; done\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    cmd = [sys.executable, str(REPO / "bench" / "node.py"), "fits", "--name", "alcf", "--work-dir", str(tmp_path / "w"),
           "--results-dir", str(tmp_path / "results"), "MODEL_SIZE_KEY=GPT25B", "SEQ_LEN=4096", "MICRO_BATCH=1",
           "SP_TYPE=megatron", "ZERO_STAGE=1", "--", "--bf16", "--nproc-per-node", "4", "--max-position-embeddings",
           "4096", "--distributed-backend", "gloo"]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    record = json.loads((tmp_path / "results" / "alcf.json").read_text())
    assert record["status"] == "ok" and record["refused_before_gpu_work"] and record["exit_code"] == 2, record
    assert "the GPUs here have 140.4 GiB each" in record["stderr_tail"] and record["trained_steps"] == 0
