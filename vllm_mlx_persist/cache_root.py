"""The cache root, above its model directories: one server's lock on it, its model directories (of
any model or disk-format version), the others' sizes for the disk budget, and an agent erased from
any of them (the API's erasure, and `vllm-mlx-persist agents rm` offline). Files only, never MLX;
the persister thread, or the root's lock held offline."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import stat
import threading
from pathlib import Path
from typing import Optional

from .disk_format import (AGENTS_DIR, BLOCKS_DIR, MANIFEST_SUFFIX, MAX_MANIFEST_BYTES, MODEL_DIR_RE, MODEL_JSON,
                          block_relpath, lenient_block_ids, manifest_name)
from .files import DIR_MODE, FILE_MODE, BadFile, fsync_dir, open_regular, read_exact
from .namespace import LEGACY_GENERATIONS, spliced_seed
from .store import StoreError

logger = logging.getLogger("vllm_mlx_persist.store")


class CacheDirLock:
    """An exclusive lock on a cache root, held by one server process for its whole life.

    Two servers on one cache directory would garbage-collect each other's not-yet-named blocks and
    overwrite each other's agent manifests. `flock` is released by the kernel when the process
    dies, SIGKILL included, so a crash never leaves a stale lock. Within one process the lock is
    shared (a backend rebuilt after an idle unload must not lock itself out).
    """

    _held: dict[Path, list] = {}  # resolved root -> [fd, users]
    _guard = threading.Lock()

    def __init__(self, root: Path):
        try:
            Path(root).mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        except FileExistsError:
            raise StoreError(f"cache directory {root} exists and is not a directory") from None
        except OSError as e:
            raise StoreError(f"cannot create the cache directory {root}: {e.strerror or e}") from None
        self.root = Path(root).resolve()
        st = os.stat(self.root)
        if st.st_mode & 0o077 and st.st_uid == os.getuid():  # a root made before, or by hand
            os.chmod(self.root, DIR_MODE)
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise StoreError(f"cache directory {self.root} is not writable by this user (uid {os.getuid()})")
        self._released = False
        with self._guard:
            entry = self._held.get(self.root)
            if entry is None:
                entry = self._held[self.root] = [self._acquire(), 0]
            entry[1] += 1

    def _acquire(self) -> int:
        path = self.root / ".lock"
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(path, flags | getattr(os, "O_NONBLOCK", 0), FILE_MODE)
        except OSError as e:
            raise StoreError(f"cannot lock the cache directory: {path}: {e.strerror or e}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise StoreError(f"cannot lock the cache directory: {path} is not a regular file; remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StoreError(f"cannot lock the cache directory {self.root}: {e}") from e
            raise StoreError(
                f"cache directory {self.root} is in use by another server (pid {holder}); give each "
                f"server its own cache_dir (--cache-backend-options '{{\"cache_dir\": ...}}')"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def release(self) -> None:
        """Drop this holder; the last one in the process closes the descriptor, freeing the lock."""
        with self._guard:
            if self._released:
                return
            self._released = True
            entry = self._held[self.root]
            entry[1] -= 1
            if entry[1] == 0:
                os.close(entry[0])
                del self._held[self.root]


def model_dirs(root: Path) -> list[Path]:
    """The model directories of a cache root (named as one, holding a model.json), by name, of any
    model or disk-format version; none when the root cannot be listed."""
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    return sorted(Path(e.path) for e in entries
                  if MODEL_DIR_RE.fullmatch(e.name) and e.is_dir(follow_symlinks=False)
                  and os.path.exists(os.path.join(e.path, MODEL_JSON)))


def other_model_dirs(root: Path, own: str, sizes: bool = True) -> list[tuple[Path, int, float]]:
    """(path, bytes, last modified) of the model/format directories under `root` but `own` (a
    directory's name), oldest first: what a disk budget reclaims before any agent of this model."""
    out = []
    for path in model_dirs(root):
        if path.name != own:
            total, newest = _tree_usage(path) if sizes else (0, 0.0)
            out.append((path, total, newest))
    return sorted(out, key=lambda t: t[2])


def erase_elsewhere(root: Path, own: str, namespace: str) -> tuple[int, int]:
    """Erase the agent under every model (or format) directory of `root` but `own` (a directory's
    name), as `erase_agent_files`; returns (directories it was in, bytes freed)."""
    found = freed = 0
    for path, _, _ in other_model_dirs(root, own, sizes=False):
        n = erase_agent_files(path, namespace)
        if n >= 0:
            found, freed = found + 1, freed + n
    return found, freed


def erase_agent_files(model_dir: Path, namespace: str) -> int:
    """Erase an agent from a model directory of any model or disk-format version, durably: its
    manifest, then the block files it names that no other manifest there names. Manifests are read
    leniently (JSON with a `block_ids` list), so directories this build cannot serve are erased too;
    a manifest that cannot be read names nothing. Returns the bytes freed, or -1 when the agent has
    no manifest there. Nothing else may write the directory meanwhile (its server's persister
    thread, or the root's lock held offline)."""
    agents_dir, blocks_dir = Path(model_dir) / AGENTS_DIR, Path(model_dir) / BLOCKS_DIR
    # The agent's record, and its spliced histories as the layout before the record kept them: each
    # under a manifest of its own (namespace.legacy_spliced), in a directory no server has migrated yet.
    targets = {manifest_name(ns) for ns in [namespace] + [spliced_seed(namespace, g)
                                                          for g in range(1, LEGACY_GENERATIONS + 1)]}
    found = {t: _lenient_block_ids(agents_dir / t) for t in targets}
    found = {t: ids for t, ids in found.items() if ids is not None}
    if not found:
        return -1
    mine = set().union(*found.values())
    others: set[str] = set()
    try:
        names = [e.name for e in os.scandir(agents_dir) if e.name.endswith(MANIFEST_SUFFIX) and e.name not in found]
    except OSError:
        names = []
    for name in names:
        others.update(_lenient_block_ids(agents_dir / name) or ())
    freed = 0
    for target in (agents_dir / t for t in found):
        try:
            freed += os.lstat(target).st_size
            os.unlink(target)
        except FileNotFoundError:
            pass
        except OSError as e:  # a directory where a manifest should be: moved out of the way, then removed
            logger.warning("erasing %s: %s", target, e)
            shutil.rmtree(target, ignore_errors=True)
    shards = set()
    for bid in mine - others:
        path = blocks_dir / block_relpath(bid)
        try:
            size = os.lstat(path).st_size
            os.unlink(path)
            freed += size
            shards.add(path.parent)
        except FileNotFoundError:
            pass
    for d in (agents_dir, *shards):
        try:
            fsync_dir(d)
        except OSError:
            pass
    return freed


def _lenient_block_ids(path: Path) -> Optional[set[str]]:
    """The block ids a manifest file names, read without its checks; None when there is no such
    file, an empty set when it cannot be read."""
    try:
        fd, size = open_regular(path)
    except FileNotFoundError:
        return None
    except (OSError, BadFile):
        return set() if os.path.lexists(path) else None
    try:
        return lenient_block_ids(bytes(read_exact(fd, min(size, MAX_MANIFEST_BYTES))))
    except OSError:
        return set()
    finally:
        os.close(fd)


def _tree_usage(path: Path) -> tuple[int, float]:
    """(bytes, newest mtime) of the regular files below `path` (symlinks are not followed)."""
    total, newest = 0, 0.0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(dirpath, f))
            except OSError:
                continue
            total += st.st_size
            newest = max(newest, st.st_mtime)
    return total, newest
