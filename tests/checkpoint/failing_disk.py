"""A disk that starts failing: a FUSE filesystem (mfusepy over libfuse3) that passes every call through to a
backing directory until BUDGET bytes have been written through it, then answers every write with EIO, as a
disk with bad sectors does. Reading, renaming and removing keep working.

Why our own filesystem: ENOSPC has a small tmpfs and EROFS a read-only mount, but no kernel filesystem gives
EIO on demand here (device-mapper's `error` and `flakey` targets need a device-mapper driver, which containers
lack), and a patched `open` or `os.write` would not test the real path (torch.save, fsync, the errno kept).

    python failing_disk.py BACKING MOUNTPOINT BUDGET    # serves in the foreground until MOUNTPOINT is unmounted
"""

from __future__ import annotations

import errno
import os
import sys

import mfusepy as fuse

STAT = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_ino", "st_blocks", "st_blksize")
STATVFS = ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_favail", "f_namemax")


class FailingDisk(fuse.Operations):
    use_ns = True  # times in nanoseconds, as os.stat gives them

    def __init__(self, backing: str, budget: int):
        self.backing, self.left = backing, budget

    def _real(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def getattr(self, path, fh=None):
        st = os.lstat(self._real(path))
        times = {key: getattr(st, key + "_ns") for key in ("st_atime", "st_mtime", "st_ctime")}
        return {key: getattr(st, key) for key in STAT} | times

    def statfs(self, path):
        st = os.statvfs(self._real(path))
        return {key: getattr(st, key) for key in STATVFS}

    def readdir(self, path, fh):
        return [".", "..", *os.listdir(self._real(path))]

    def create(self, path, mode, flags=os.O_WRONLY):
        return os.open(self._real(path), flags | os.O_CREAT, mode)

    def open(self, path, flags):
        return os.open(self._real(path), flags)

    def read(self, path, size, offset, fh):
        return os.pread(fh, size, offset)

    def write(self, path, data, offset, fh):
        if len(data) > self.left:
            self.left = 0
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        self.left -= len(data)
        return os.pwrite(fh, data, offset)

    def truncate(self, path, length, fh=None):
        os.truncate(fh if fh is not None else self._real(path), length)

    def fsync(self, path, datasync, fh):
        os.fsync(fh)

    def flush(self, path, fh):
        return 0

    def release(self, path, fh):
        os.close(fh)

    def mkdir(self, path, mode):
        os.mkdir(self._real(path), mode)

    def rmdir(self, path):
        os.rmdir(self._real(path))

    def unlink(self, path):
        os.unlink(self._real(path))

    def rename(self, old, new):
        os.replace(self._real(old), self._real(new))

    def chmod(self, path, mode):
        os.chmod(self._real(path), mode)

    def utimens(self, path, times=None):
        os.utime(self._real(path), ns=times)


if __name__ == "__main__":
    backing, mountpoint, budget = sys.argv[1:]
    fuse.FUSE(FailingDisk(os.path.abspath(backing), int(budget)), mountpoint, foreground=True, nothreads=True)
