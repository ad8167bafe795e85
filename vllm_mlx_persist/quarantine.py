"""Files the disk tier no longer serves: a file that failed its checks is moved into the model
directory's quarantine/ (never deleted at once, never served), kept for inspection within bounds and
counted in bytes (the disk budget reclaims them first); temp files of dead processes are removed.
Any thread (the store's lock guards the counters)."""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import threading
import time
from pathlib import Path
from typing import Optional

logger = logging.getLogger("vllm_mlx_persist.store")

# A tmp file of a live process is left alone at open unless it is at least this old.
STALE_TMP_S = 3600.0
# Quarantined files are kept for inspection, but not forever: pruned at open past either bound.
QUARANTINE_KEEP_S = 7 * 86400.0
QUARANTINE_KEEP_FILES = 256

_TMP_RE = re.compile(r"[a-z]+\.(\d+)\.[0-9a-f]{32}\.tmp")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def _remove_files(paths: list[str], what: str, directory: Path) -> int:
    """Unlink `paths`, skipping any already gone or not removable; log and return the count."""
    removed = 0
    for path in paths:
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass
    if removed:
        logger.info("removed %d %s from %s", removed, what, directory)
    return removed


class Quarantine:
    """The model directory's quarantine/: `move` a bad file there, `prune` it at open, `clear` it
    for the disk budget; `bytes` it holds. `lock` and `counts` are the store's (its "quarantined"
    counter)."""

    def __init__(self, directory: Path, lock: threading.Lock, counts: dict):
        self.dir, self._lock, self._counts = directory, lock, counts
        self.bytes = 0  # counted as files are moved aside and removed (the disk budget's)

    def move(self, path: Path, reason: str, fd: Optional[int] = None) -> None:
        """Move a bad file aside (never deleted, never served) and log why."""
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f".{time.time_ns() % 10**9:09d}"
        dest = self.dir / f"{path.name}.{stamp}"
        try:
            cur = os.lstat(path)
            if fd is not None:
                # Only move the file we actually read, not a good copy renamed over it meanwhile.
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) != (cur.st_dev, cur.st_ino):
                    logger.warning("%s failed its checks (%s) but was replaced meanwhile; left alone", path, reason)
                    return
            os.replace(path, dest)
        except FileNotFoundError:
            return  # someone else moved or deleted it first
        except OSError as e:
            logger.warning("%s failed its checks (%s) and could not be quarantined: %s", path, reason, e)
            return
        with self._lock:
            self._counts["quarantined"] += 1
            self.bytes += cur.st_size if stat.S_ISREG(cur.st_mode) else 0
        logger.warning("quarantined %s -> %s: %s", path, dest.name, reason)

    def prune(self, keep: bool = True) -> int:
        """Delete quarantined files older than QUARANTINE_KEEP_S, and all but the newest
        QUARANTINE_KEEP_FILES (`keep=False`: every one); returns how many were deleted."""
        # Any entry counts, not only regular files: FIFOs, symlinks and directories are quarantined too.
        try:
            entries = sorted(((e.stat(follow_symlinks=False).st_mtime, e.path, e.is_dir(follow_symlinks=False),
                               e.stat(follow_symlinks=False).st_size if e.is_file(follow_symlinks=False) else 0)
                              for e in os.scandir(self.dir)), reverse=True)
        except OSError:
            return 0
        cutoff = time.time() - QUARANTINE_KEEP_S if keep else float("inf")
        old = [(path, is_dir) for i, (mtime, path, is_dir, _) in enumerate(entries)
               if i >= QUARANTINE_KEEP_FILES or mtime < cutoff]
        kept = sum(size for i, (mtime, _, _, size) in enumerate(entries)
                   if i < QUARANTINE_KEEP_FILES and mtime >= cutoff)
        for path, _ in (o for o in old if o[1]):
            shutil.rmtree(path, ignore_errors=True)
        removed = _remove_files([path for path, is_dir in old if not is_dir], "old quarantined file(s)", self.dir)
        with self._lock:
            self.bytes = kept
        return removed + sum(1 for o in old if o[1])

    def clear(self) -> int:
        """Delete every quarantined file (the disk budget reclaims them first); returns how many."""
        return self.prune(keep=False)


def clean_tmp(tmp_dir: Path, max_age_live: float) -> int:
    """Remove tmp files of dead processes, and any older than max_age_live seconds."""
    now, leftovers = time.time(), []
    try:
        entries = list(os.scandir(tmp_dir))
    except OSError:
        return 0
    for e in entries:
        m = _TMP_RE.fullmatch(e.name)
        try:
            if not (m and _pid_alive(int(m.group(1))) and now - e.stat().st_mtime < max_age_live):
                leftovers.append(e.path)
        except OSError:
            pass
    return _remove_files(leftovers, "leftover temp file(s)", tmp_dir)
