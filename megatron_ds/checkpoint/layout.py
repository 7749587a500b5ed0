"""Where checkpoints live on disk and how one becomes visible atomically.

A save directory looks like Megatron-DeepSpeed's::

    <save>/iter_0000005/            one complete checkpoint (DeepSpeed's files + ours)
    <save>/latest                   "iter_0000005" (DeepSpeed reads this tag file)
    <save>/latest_checkpointed_iteration.txt   "5" (Megatron's tracker file)
    <save>/.tmp-iter_0000010/       a save in progress: never loaded, removed by the next save

A checkpoint is written under a temporary name, every file is fsynced, then the directory is
renamed into place and ``latest`` is replaced through a temporary file and ``os.replace``. A
process killed at any instant therefore leaves either the old or the new checkpoint visible, never
a half-written one. Pure filesystem code: no torch, no DeepSpeed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil

LATEST = "latest"
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".old-"
_TAG = re.compile(r"^iter_(\d{7,})$")


def tag_for(iteration: int) -> str:
    """Megatron's directory name for an iteration: iter_0000005."""
    return f"iter_{iteration:07d}"


def iteration_of(tag: str) -> int | None:
    match = _TAG.match(tag)
    return int(match.group(1)) if match else None


def tmp_tag_for(iteration: int) -> str:
    return TMP_PREFIX + tag_for(iteration)


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in ``path`` durable (a no-op where directories can't be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file and directory under root, deepest first."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_file(os.path.join(dirpath, name))
        fsync_dir(dirpath)


def write_text_atomic(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` so that a reader sees the old or the new content, never a mix."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def read_latest(save_dir: str) -> str | None:
    """The tag ``latest`` names, or None when there is no ``latest`` file (falls back to Megatron's tracker)."""
    path = os.path.join(save_dir, LATEST)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            tag = f.read(4096).decode("utf-8", "replace").strip()
        return tag or None
    tracker = os.path.join(save_dir, MEGATRON_TRACKER)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        if text.isdigit():
            return tag_for(int(text))
    return None


def publish(save_dir: str, tmp_tag: str, tag: str) -> None:
    """Rename a fully written ``tmp_tag`` directory to ``tag`` and point ``latest`` at it.

    Called on one rank after every rank has written and fsynced its files. If ``tag`` already
    exists (a run resumed from an earlier checkpoint and reached the same iteration again), the
    old one is moved aside first and deleted only after ``latest`` names the new one.
    """
    final, trash = os.path.join(save_dir, tag), os.path.join(save_dir, TRASH_PREFIX + tag)
    existed = os.path.exists(final)
    try:
        if existed:
            shutil.rmtree(trash, ignore_errors=True)
            os.rename(final, trash)
        os.rename(os.path.join(save_dir, tmp_tag), final)
        fsync_dir(save_dir)
        write_text_atomic(os.path.join(save_dir, LATEST), tag)
    except BaseException:  # e.g. no space left for `latest`: undo, so that the old checkpoint stays whole and named
        if existed and os.path.isdir(trash):
            shutil.rmtree(final, ignore_errors=True)
            os.rename(trash, final)
        elif not existed:
            shutil.rmtree(final, ignore_errors=True)
        raise
    iteration = iteration_of(tag)
    if iteration is not None:
        write_text_atomic(os.path.join(save_dir, MEGATRON_TRACKER), str(iteration))
    if existed:
        shutil.rmtree(trash, ignore_errors=True)


def list_checkpoints(save_dir: str) -> list[tuple[int, str]]:
    """(iteration, tag) of every complete checkpoint directory, oldest first."""
    if not os.path.isdir(save_dir):
        return []
    found = []
    for name in os.listdir(save_dir):
        iteration = iteration_of(name)
        if iteration is not None and os.path.isdir(os.path.join(save_dir, name)):
            found.append((iteration, name))
    return sorted(found)


def remove_stale_temporaries(save_dir: str) -> list[str]:
    """Delete leftovers of saves that were killed (.tmp-*, .old-*); returns what was removed."""
    removed = []
    if not os.path.isdir(save_dir):
        return removed
    latest = read_latest(save_dir)
    keep = None  # the moved-aside copy is the only one of `latest` when a re-save died between its renames
    if latest is not None and not os.path.isdir(os.path.join(save_dir, latest)):
        keep = TRASH_PREFIX + latest
    for name in os.listdir(save_dir):
        if name == keep:
            continue
        if name.startswith((TMP_PREFIX, TRASH_PREFIX)) and os.path.isdir(os.path.join(save_dir, name)):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
            removed.append(name)
    return removed


def prune(save_dir: str, keep_last: int) -> list[str]:
    """Delete all but the newest ``keep_last`` checkpoints, never the one ``latest`` names."""
    if keep_last is None or keep_last <= 0:
        return []
    latest = read_latest(save_dir)
    checkpoints = list_checkpoints(save_dir)
    doomed = [tag for _, tag in checkpoints[:-keep_last] if tag != latest]
    for tag in doomed:
        shutil.rmtree(os.path.join(save_dir, tag), ignore_errors=True)
    if doomed:
        fsync_dir(save_dir)
    return doomed
