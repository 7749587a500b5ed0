"""torch's collective flight recorder, dumped next to a hung rank's stacks.

torch keeps a ring buffer of each rank's last collectives (which one, which group, its sequence
number, whether it started and completed) when its buffer size is set before the process group
exists: TORCH_NCCL_TRACE_BUFFER_SIZE for NCCL (torch >= 2.3), renamed TORCH_FR_BUFFER_SIZE when
the recorder became backend-neutral (torch builds with `_dump_fr_trace`, which also record gloo;
setting the old name there only draws a deprecation warning). enable() sets whichever this torch
reads, unless the user set one, and points torch's own dump-on-timeout file
(TORCH_NCCL_DEBUG_INFO_TEMP_FILE, later TORCH_FR_DUMP_TEMP_FILE) into the watchdog directory.

dump() writes the recorder's pickle (what torch.distributed.flight_recorder's fr_trace analyser
reads) and returns a one-line note: the file, or why nothing was written. On a hang it runs in a
thread (the main thread is blocked in the collective) when the supervisor's SIGUSR2 arrives
(progress.py), or in the rank's own watchdog thread. Tested on CPU with gloo; untested on CUDA.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

from megatron_ds.runtime.watchdog import trace_path

BUFFER_ENTRIES = "2000"  # collectives kept per rank (torch's own examples use 2000)
NCCL_BUFFER_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"
FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
NCCL_DUMP_FILE_ENV = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"  # torch's dump on a NCCL timeout; it appends the rank
FR_DUMP_FILE_ENV = "TORCH_FR_DUMP_TEMP_FILE"  # the same, in torch builds with the backend-neutral recorder


def _c10d():
    import torch._C._distributed_c10d as c10d

    return c10d


def enable(env: dict | os._Environ, directory: str | None) -> None:
    """Turn the recorder on in `env` (before the process group is created); user settings win."""
    if FR_BUFFER_ENV in env or NCCL_BUFFER_ENV in env:
        return
    neutral = hasattr(_c10d(), "_dump_fr_trace")
    env[FR_BUFFER_ENV if neutral else NCCL_BUFFER_ENV] = BUFFER_ENTRIES
    if directory is not None and FR_DUMP_FILE_ENV not in env and NCCL_DUMP_FILE_ENV not in env:
        env[FR_DUMP_FILE_ENV if neutral else NCCL_DUMP_FILE_ENV] = str(Path(directory) / "nccl_trace_rank_")


def _dumper(backend: str):
    """torch's dump function for this backend, or (None, why not)."""
    c10d = _c10d()
    if backend == "nccl" and hasattr(c10d, "_dump_nccl_trace"):
        return c10d._dump_nccl_trace, ""
    if hasattr(c10d, "_dump_fr_trace"):
        return c10d._dump_fr_trace, ""
    return None, f"this torch records {'no flight recorder' if backend == 'nccl' else 'NCCL collectives only'}"


def dump(directory: str | Path, rank: int) -> str:
    """Write this rank's flight recorder into `directory`; returns a one-line note for the stacks file."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return "flight recorder: skipped (no process group yet)"
    backend = str(dist.get_backend())
    dump_fn, why_not = _dumper(backend)
    if dump_fn is None:
        return f"flight recorder: skipped (backend {backend}: {why_not})"
    try:
        data = dump_fn()
    except Exception as err:  # noqa: BLE001 - a failed dump must not hide the stacks or the hang report
        return f"flight recorder: dump failed on backend {backend}: {type(err).__name__}: {err}"
    path = trace_path(directory, rank)
    path.write_bytes(data)
    try:
        entries = len(pickle.loads(data).get("entries", []))
    except Exception:  # noqa: BLE001 - the count is only for the note
        entries = "?"
    if entries == 0:
        return f"flight recorder: {path} is empty (backend {backend}; was {FR_BUFFER_ENV} / {NCCL_BUFFER_ENV} set " \
               f"before the process group was created?)"
    return f"flight recorder: {path} ({entries} collectives, backend {backend})"
