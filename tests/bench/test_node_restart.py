"""bench/node.py restart on the CPU: a rank SIGKILLed at step 7 under --max-restarts 1 comes back from the step-5
checkpoint, step 6 is logged again, timed from the kill, and the resumed losses equal the uninterrupted run's."""

from __future__ import annotations

import json
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
