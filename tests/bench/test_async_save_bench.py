"""bench/async_save.py on CPU with the tiny preset: plumbing only (numbers on CPU mean nothing). The GPU stage must
find a record with every stall, the write time and the steps during it, and nothing left in the save directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_async_save_bench_records_each_stall(tmp_path):
    cmd = [sys.executable, str(REPO / "bench" / "async_save.py"), "--name", "cpu_tiny", "--presets", "TINY",
           "--device", "cpu", "--results-dir", str(tmp_path / "results"), "--save-dir", str(tmp_path / "ckpt")]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (row,) = json.loads((tmp_path / "results" / "cpu_tiny.json").read_text())["rows"]
    for key in ("sync_stall_s", "async_first_stall_s", "async_stall_s", "async_write_s", "async_end_wait_s",
                "async_step_s_while_writing", "step_s"):
        assert row[key] > 0 or key == "async_end_wait_s", (key, row)
    assert row["checkpoint_bytes"] > 0 and row["async_steps_while_writing"] >= 1
    assert not (tmp_path / "ckpt").exists()
