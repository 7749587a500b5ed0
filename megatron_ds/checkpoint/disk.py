"""The disk under a save: how much a save needs, how much is free, and what a failed write was.

A full disk, a failing one (EIO) or a read-only one must not end a run with a torch traceback: every write of
a save goes through ``write_file``, the first error a rank meets is kept in its ``Failures`` (the rank keeps
walking through the save, so that every rank still meets the same collectives), and the ranks then agree on
what failed. Filesystem code: torch only to serialize.
"""

from __future__ import annotations

import errno
import os
import shutil
import time

import torch

from megatron_ds.checkpoint import layout as paths
from megatron_ds.checkpoint import metadata as meta
from megatron_ds.env_settings import TEST_SLOW_SAVE

SAVE_FAILED_EXIT = 74  # sysexits.h EX_IOERR: an input/output error, not a usage error (2) nor a crash (1)


class SaveError(RuntimeError):
    """A save that could not be written: the message names the path, the space needed and free, and the
    checkpoint that stays `latest`. Rank 0 prints it as one line when the ranks agree on it; the CLI exits
    SAVE_FAILED_EXIT."""


def os_error(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc``: torch.save reports a failed write of a file object as a RuntimeError
    ("unexpected pos ...") whose context is the OSError (ENOSPC, EIO, ...)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def describe(exc: BaseException, path: str) -> str:
    """'No space left on device writing PATH' (the errno's words), or the error itself when it has none."""
    found = os_error(exc)
    if found is not None and found.errno is not None:
        where = found.filename or path
        return f"{os.strerror(found.errno)} (errno {errno.errorcode.get(found.errno, found.errno)}) writing {where}"
    return f"{type(exc).__name__}: {exc} writing {path}"


def write_file(state, path: str, *, zipfile: bool = True) -> None:
    """torch.save ``state`` to ``path`` through a file object (so a failed write keeps its errno) and fsync it:
    only the writer can make its bytes durable."""
    with open(path, "wb") as f:
        torch.save(state, f, _use_new_zipfile_serialization=zipfile)
        f.flush()
        os.fsync(f.fileno())
    time.sleep(TEST_SLOW_SAVE.get())  # tests only: a save that a test can kill mid-write


class Failures:
    """The first error this rank met during one save ("what, writing where"); later writes are skipped."""

    def __init__(self):
        self.first: str | None = None

    def attempt(self, path: str, write, *args, **kwargs) -> None:
        """``write(*args, **kwargs)`` unless a write already failed; its error is kept instead of raised."""
        if self.first is not None:
            return
        try:
            write(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any failed write: kept, agreed on, reported as one line
            self.first = describe(exc, path)


def free_bytes(directory: str) -> int | None:
    """Bytes free to this user on the filesystem of ``directory`` (or of its nearest existing parent)."""
    probe = os.path.abspath(directory)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def last_save_bytes(save_dir: str) -> int | None:
    """The size of the checkpoint `latest` names (its manifest's total), or None when there is none."""
    tag = paths.read_latest(save_dir)
    if tag is None:
        return None
    try:
        return sum(meta.read(os.path.join(save_dir, tag))["files"].values())
    except Exception:  # noqa: BLE001 - a missing or broken checkpoint: estimate from the tensors instead
        return None


def human(size: float | None) -> str:
    """1.5 MB, 21.1 GB: the sizes a user compares with `df -h`."""
    if size is None:
        return "an unknown amount"
    unit = next((u for u, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)) if size >= scale), "B")
    scale = {"TB": 1e12, "GB": 1e9, "MB": 1e6, "KB": 1e3, "B": 1}[unit]
    return f"{size / scale:.1f} {unit}" if unit != "B" else f"{int(size)} B"
