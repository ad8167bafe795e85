"""How the disk tier touches a file: durable fsync (`F_FULLFSYNC` on macOS), reads that never follow
a symlink nor block on a FIFO or device and refuse anything but a regular file, exact reads, and the
cache's private modes. Used by store.py, quarantine.py and cache_root.py; numpy-free, any thread."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

# Never follow a symlink, never block on a FIFO or device: the file type is checked after opening.
_O_READ = (os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
           | getattr(os, "O_NOFOLLOW", 0))
# The cache holds conversations in recoverable form (token ids, and KV that can be decoded back to
# tokens), so it is private to its owner like ~/.ssh: directories 0700, files 0600.
DIR_MODE, FILE_MODE = 0o700, 0o600


class BadFile(Exception):
    """A file failed its checks; carries the reason for the quarantine log."""


def fsync(fd: int) -> None:
    """Flush a file to stable storage. On macOS `fsync` only reaches the drive's cache;
    `F_FULLFSYNC` flushes the drive too (as SQLite does), so a power loss keeps what we acked."""
    if _FULLFSYNC is not None:
        try:
            fcntl.fcntl(fd, _FULLFSYNC)
            return
        except OSError:  # file systems without it (e.g. some network mounts): plain fsync
            pass
    os.fsync(fd)


_FULLFSYNC = getattr(fcntl, "F_FULLFSYNC", None)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: memoryview) -> None:
    while len(data):
        n = os.write(fd, data)
        data = data[n:]


def open_regular(path: Path) -> tuple[int, int]:
    """Open `path` for reading; returns (fd, size). FileNotFoundError when absent; BadFile when it
    is a symlink, FIFO, socket, device or directory (opened non-blocking, so none of them can hang)."""
    try:
        fd = os.open(path, _O_READ)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):  # O_NOFOLLOW on a symlink; a socket
            raise BadFile(f"not a regular file ({e.strerror})") from None
        raise
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise BadFile(f"not a regular file (mode {stat.filemode(st.st_mode)})")
    return fd, st.st_size


def read_exact(fd: int, size: int, offset: int = 0) -> bytearray:
    """`size` bytes from `offset`; BadFile if the file ends first."""
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    os.lseek(fd, offset, os.SEEK_SET)
    while got < size:
        n = os.readv(fd, [view[got:]])
        if n == 0:
            raise BadFile(f"file shrank while reading ({got} of {size} bytes)")
        got += n
    return buf


def read_capped(path: Path, cap: int) -> bytes:
    """A whole small file's bytes: FileNotFoundError when absent; BadFile when it is not a regular
    file (open_regular) or holds more than `cap` bytes."""
    fd, size = open_regular(path)
    try:
        if size > cap:
            raise BadFile(f"{size} bytes, over the {cap}-byte cap")
        return bytes(read_exact(fd, size))
    finally:
        os.close(fd)
