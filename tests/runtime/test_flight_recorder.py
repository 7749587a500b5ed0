"""torch's collective flight recorder: switched on before the process group exists, dumped on request.

This torch (CPU build) has the backend-neutral recorder, so the dump runs for real on gloo; the NCCL path
(_dump_nccl_trace, TORCH_NCCL_TRACE_BUFFER_SIZE on older torch) is untested here (no GPU)."""

import pickle
import subprocess
import sys

import torch._C._distributed_c10d as c10d
from runtime_helpers import clean_env

from megatron_ds.runtime import flight_recorder
from megatron_ds.runtime.watchdog import trace_path


def test_enable_sets_the_buffer_this_torch_reads_and_leaves_user_settings_alone(tmp_path):
    env = {}
    flight_recorder.enable(env, str(tmp_path))
    neutral = hasattr(c10d, "_dump_fr_trace")
    buffer_env = flight_recorder.FR_BUFFER_ENV if neutral else flight_recorder.NCCL_BUFFER_ENV
    dump_env = flight_recorder.FR_DUMP_FILE_ENV if neutral else flight_recorder.NCCL_DUMP_FILE_ENV
    assert env == {buffer_env: flight_recorder.BUFFER_ENTRIES, dump_env: str(tmp_path / "nccl_trace_rank_")}
    for users in ({"TORCH_NCCL_TRACE_BUFFER_SIZE": "10"}, {"TORCH_FR_BUFFER_SIZE": "0"}):
        env = dict(users)
        flight_recorder.enable(env, str(tmp_path))
        assert env == users
    env = {}
    flight_recorder.enable(env, None)  # no watchdog directory: the buffer only
    assert list(env) == [buffer_env]


def test_dump_without_a_process_group_says_so(tmp_path):
    assert flight_recorder.dump(tmp_path, 0) == "flight recorder: skipped (no process group yet)"
    assert not list(tmp_path.iterdir())


def test_dump_of_a_gloo_group_lists_its_collectives(tmp_path):
    """A real one-rank gloo group in its own process (the buffer size must be set before the group exists)."""
    script = f"""
import os, torch, torch.distributed as dist
from megatron_ds.runtime import flight_recorder
flight_recorder.enable(os.environ, {str(tmp_path)!r})
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
value = torch.ones(4)
for _ in range(3):
    dist.all_reduce(value)
print(flight_recorder.dump({str(tmp_path)!r}, 0))
"""
    result = subprocess.run([sys.executable, "-c", script], env=clean_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    note = result.stdout.strip()
    if not hasattr(c10d, "_dump_fr_trace"):  # an older CPU torch records NCCL only: one line says so
        assert note == "flight recorder: skipped (backend gloo: this torch records NCCL collectives only)"
        return
    path = trace_path(tmp_path, 0)
    assert note == f"flight recorder: {path} (3 collectives, backend gloo)"
    assert "deprecated" not in result.stderr  # the variable this torch reads, not the old name
    entries = pickle.loads(path.read_bytes())["entries"]
    assert [e["profiling_name"] for e in entries] == ["gloo:all_reduce"] * 3
    assert [e["collective_seq_id"] for e in entries] == [1, 2, 3]
