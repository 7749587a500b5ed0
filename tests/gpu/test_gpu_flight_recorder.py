"""On a GPU: the NCCL flight recorder mds turns on before the process group exists records NCCL collectives,
and the hang report's dump writes them (runtime/flight_recorder.py; the CPU suite covers gloo)."""

import pickle
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


def test_nccl_flight_recorder_dump_lists_the_collectives(tmp_path):
    if not torch.cuda.is_available():
        pytest.fail("no CUDA device: run the gpu-marked tests on the GPU machine")
    script = f"""
import os, torch, torch.distributed as dist
from megatron_ds.runtime import flight_recorder
flight_recorder.enable(os.environ, {str(tmp_path)!r})
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1)
value = torch.ones(4, device="cuda")
for _ in range(3):
    dist.all_reduce(value)
torch.cuda.synchronize()
print(flight_recorder.dump({str(tmp_path)!r}, 0))
dist.destroy_process_group()
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    from megatron_ds.runtime.watchdog import trace_path

    path = trace_path(tmp_path, 0)
    assert result.stdout.strip().splitlines()[-1] == f"flight recorder: {path} (3 collectives, backend nccl)", \
        result.stdout + result.stderr[-2000:]
    entries = pickle.loads(path.read_bytes())["entries"]
    assert [e["profiling_name"] for e in entries] == ["nccl:all_reduce"] * 3
