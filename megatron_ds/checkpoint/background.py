"""--async-save (Megatron-LM's name): a save that stops training only for the copy of its tensors to host memory.

The save runs as a synchronous one does up to the point where DeepSpeed hands each file's state dict to its
checkpoint engine (checkpointing._routed_writes): there every tensor is copied to host memory, pinned on a GPU,
and the state dict of copies is kept. Storages that several tensors share (views into ZeRO's flat buffers, tied
weights) stay shared and each copy keeps its device's name, so torch.save later writes the bytes a synchronous
save writes. A thread then writes the files (torch.save, fsync) and commits them as a synchronous save does
(checkpointing.commit) over a gloo group of their own: `latest` moves only when every rank's files are durable.

Why a thread, not a forked process: the writer spends its time in file writes and fsync, which release the
GIL, so the training thread runs on; a fork of a process holding a CUDA context, NCCL's threads and tens of GB
would copy its page tables at every save and could not share the process group; and a SIGKILL ends the writer
with the run, so a killed run loses only the save in flight (its .tmp- directory, removed by the next save),
never `latest`. One save at a time: the next save and the end of training wait for the one in flight and raise
its SaveError on every rank. The pinned buffers are kept for the next save (pinning memory is slow).
"""

from __future__ import annotations

import datetime
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from megatron_ds.checkpoint import disk

_origin: dict[int, str] = {}  # data_ptr of a host copy -> the location torch.save names for the original


def _location(storage) -> str | None:
    """torch.save's tagger for the host copies: the original's device ('cuda:0'), as a synchronous save says."""
    return _origin.get(storage.data_ptr()) if storage.device.type == "cpu" else None


torch.serialization.register_package(1, _location, lambda obj, location: None)


class Snapshot:
    """Host copies of the tensors of state dicts: one copy per storage, reusing the pinned buffers of the last
    save in the same order (the state dicts of one run keep their shapes)."""

    def __init__(self, buffers: list[torch.Tensor]):
        self.spare, self.used, self.copies, self.seen = list(buffers), [], {}, {}
        self.origin: dict[int, str] = {}  # for _location, while this snapshot's buffers are written

    def take(self, obj):
        """``obj`` with every tensor replaced by its host copy and every container rebuilt (training goes on
        changing the originals); other leaves are immutable or not changed by training. An object met twice is
        copied once, so pickle writes the same references as for the originals."""
        if not isinstance(obj, (torch.Tensor, np.ndarray, dict, list, tuple)):
            return obj
        if id(obj) in self.seen:
            return self.seen[id(obj)][1]
        if isinstance(obj, torch.Tensor):
            copy = self._tensor(obj)
        elif isinstance(obj, np.ndarray):
            copy = obj.copy()
        elif isinstance(obj, dict):
            copy = obj.copy()  # keeps OrderedDict / defaultdict
            for key, value in obj.items():
                copy[key] = self.take(value)
            if getattr(obj, "__dict__", None):  # a module state dict's _metadata
                copy.__dict__.update(obj.__dict__)
        elif isinstance(obj, list):
            copy = [self.take(v) for v in obj]
        elif type(obj) is tuple:
            copy = tuple(self.take(v) for v in obj)
        else:
            return obj  # torch.Size, named tuples: immutable
        self.seen[id(obj)] = (obj, copy)  # the original kept alive: its id stays its own
        return copy

    def _buffer(self, nbytes: int, pin: bool) -> torch.Tensor:
        if self.spare and self.spare[0].numel() == nbytes and self.spare[0].is_pinned() == pin:
            buffer = self.spare.pop(0)
        else:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.used.append(buffer)
        return buffer

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes(), str(storage.device))
        host = self.copies.get(key)
        if host is None:
            host = self._buffer(storage.nbytes(), pin=storage.device.type == "cuda")
            whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            host.copy_(whole, non_blocking=True)
            if storage.device.type != "cpu":
                self.origin[host.untyped_storage().data_ptr()] = str(storage.device)
            self.copies[key] = host
        copy = torch.empty(0, dtype=tensor.dtype).set_(host.untyped_storage(), tensor.storage_offset(),
                                                         tensor.size(), tensor.stride())
        if isinstance(tensor, torch.nn.Parameter):
            return torch.nn.Parameter(copy, requires_grad=tensor.requires_grad)
        return copy.requires_grad_(tensor.requires_grad)

    def done(self) -> list[torch.Tensor]:
        """Wait for the copies (the device-to-host copy is the part of the save that stops training)."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        self.seen.clear()  # the originals (DeepSpeed's GPU clones under PP among them) go now, not at the next save
        self.copies.clear()
        return self.used


class Writer:
    """The background writer of one run's saves (checkpointing.save drives it)."""

    def __init__(self, timeout_minutes: float = 120.0):
        self.timeout = datetime.timedelta(minutes=timeout_minutes)  # the slowest rank's write, at worst
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.group = None
        self.buffers: list[torch.Tensor] = []
        self.files: list[tuple[object, str]] = []
        self.snapshot: Snapshot | None = None

    def snapshot_sink(self, zipfile: bool):
        """The sink for checkpointing._routed_writes: keep a host copy of each file's state dict."""
        if self.group is None and dist.is_initialized():  # collective: every rank saves at the same iteration
            self.group = dist.new_group(backend="gloo", timeout=self.timeout)
        self.zipfile, self.snapshot, self.files = zipfile, Snapshot(self.buffers), []

        def keep(state_dict, path):
            self.files.append((self.snapshot.take(state_dict), path))
        return keep

    def start(self, job, commit) -> None:
        """Write the kept files and ``commit(group)`` in the background."""
        self.buffers = self.snapshot.done()
        job.stalled_s = time.perf_counter() - job.started  # what training waited for: the copies are done
        _origin.clear()  # only live buffers are named: a freed address may come back as a CPU tensor's
        _origin.update(self.snapshot.origin)
        files, self.files = self.files, []
        self.thread = threading.Thread(target=self._run, args=(job, files, commit), name="mds-async-save",
                                       daemon=True)
        self.thread.start()

    def _run(self, job, files, commit) -> None:
        try:
            for state_dict, path in files:
                job.failures.attempt(path, disk.write_file, state_dict, path, zipfile=self.zipfile)
            files.clear()
            commit(self.group)
        except BaseException as exc:  # noqa: BLE001 - raised in the training thread by wait()
            self.error = exc

    def wait(self) -> None:
        """Block until the save in flight is committed; raise its error (SaveError: on every rank)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        error, self.error = self.error, None
        if error is not None:
            raise error
