"""Disk tier: the I/O of content-addressed block files and per-agent manifests, durable and self-checking.

Owns the files under a cache root: atomic durable writes (tmp, fsync, rename, directory fsync),
reads that refuse anything but a regular file within its size cap, quarantine, GC, erasure, and the
root's lock. What the bytes mean is `disk_format`'s. A `DiskStore` is used by the persister thread
(writes, GC, erasure), the reader threads (block and manifest reads) and the worker at start-up;
its counters are under its own lock. numpy and bytes only: no MLX here. The durability protocol is
described in docs/disk-format.md.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import shutil
import stat
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, Optional

from .disk_format import (AGENTS_DIR, BLOCK_ID_RE, BLOCK_SUFFIX, BLOCKS_DIR, DIR_NAME_RE, FORMAT_VERSION,
                          MAX_BLOCK_BYTES, MAX_MANIFEST_BYTES, MAX_MODEL_JSON_BYTES, MODEL_DIR_RE, MODEL_JSON,
                          QUARANTINE_DIR, TMP_DIR, BlockData, Manifest, block_chunks, block_metadata,
                          block_relpath, canonical_json, decode_block, decode_manifest, decode_model_json,
                          described_size, encode_manifest, encode_model_json, header_length, lenient_block_ids,
                          manifest_name, MANIFEST_SUFFIX, FormatError)
from .namespace import LEGACY_GENERATIONS, spliced_seed

logger = logging.getLogger("vllm_mlx_persist.store")

# Never follow a symlink, never block on a FIFO or device: the file type is checked after opening.
_O_READ = (os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)
           | getattr(os, "O_NOFOLLOW", 0))
# A tmp file of a live process is left alone at open unless it is at least this old.
STALE_TMP_S = 3600.0
# The cache holds conversations in recoverable form (token ids, and KV that can be decoded back to
# tokens), so it is private to its owner like ~/.ssh: directories 0700, files 0600.
_DIR_MODE, _FILE_MODE = 0o700, 0o600
# Quarantined files are kept for inspection, but not forever: pruned at open past either bound.
QUARANTINE_KEEP_S = 7 * 86400.0
QUARANTINE_KEEP_FILES = 256

_TMP_RE = re.compile(r"[a-z]+\.(\d+)\.[0-9a-f]{32}\.tmp")


class StoreError(Exception):
    """The store cannot be opened or used as asked (not a bad cache file: those are misses)."""


class ModelMismatchError(StoreError):
    """The model directory belongs to another model fingerprint or another format version."""


class StoreWriteError(OSError):
    """A write failed (full disk, file too large, I/O error, permission); nothing partial is visible.

    The caller keeps the data in memory and may retry later. errno is the underlying one.
    """


class _BadFile(Exception):
    """Internal: a file failed its checks; carries the reason for the quarantine log."""


# ---------------------------------------------------------------------------------------------
# Small helpers


def _fsync(fd: int) -> None:
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

# Fault injection (faults.py): None unless VLLM_MLX_PERSIST_FAULT is set, so the cost when off is
# one global lookup per step. Only the reliability campaigns set it.
_FAULT = None
if os.environ.get("VLLM_MLX_PERSIST_FAULT"):
    from .faults import from_env as _fault_from_env

    _FAULT = _fault_from_env()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        _fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        n = os.write(fd, data)
        data = data[n:]


def _open_regular(path: Path) -> tuple[int, int]:
    """Open `path` for reading; returns (fd, size). FileNotFoundError when absent; _BadFile when it
    is a symlink, FIFO, socket, device or directory (opened non-blocking, so none of them can hang)."""
    try:
        fd = os.open(path, _O_READ)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):  # O_NOFOLLOW on a symlink; a socket
            raise _BadFile(f"not a regular file ({e.strerror})") from None
        raise
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _BadFile(f"not a regular file (mode {stat.filemode(st.st_mode)})")
    return fd, st.st_size


def _read_exact(fd: int, size: int, offset: int = 0) -> bytearray:
    """`size` bytes from `offset`; _BadFile if the file ends first."""
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    os.lseek(fd, offset, os.SEEK_SET)
    while got < size:
        n = os.readv(fd, [view[got:]])
        if n == 0:
            raise _BadFile(f"file shrank while reading ({got} of {size} bytes)")
        got += n
    return buf


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


# ---------------------------------------------------------------------------------------------
# DiskStore


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
            Path(root).mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
        except FileExistsError:
            raise StoreError(f"cache directory {root} exists and is not a directory") from None
        except OSError as e:
            raise StoreError(f"cannot create the cache directory {root}: {e.strerror or e}") from None
        self.root = Path(root).resolve()
        st = os.stat(self.root)
        if st.st_mode & 0o077 and st.st_uid == os.getuid():  # a root made before, or by hand
            os.chmod(self.root, _DIR_MODE)
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
            fd = os.open(path, flags | getattr(os, "O_NONBLOCK", 0), _FILE_MODE)
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


class DiskStore:
    """Content-addressed 4-bit KV blocks and per-agent manifests under `root / fingerprint[:32]`.

    Thread-safe: every file appears atomically (tmp, fsync, rename, dir fsync). Bad files found on
    read are moved to quarantine/ and reported as a miss; write failures raise StoreWriteError.
    """

    def __init__(self, root: Path, fingerprint: str, model_info: dict, format_info: dict):
        if not isinstance(fingerprint, str) or len(fingerprint) < 32 or not DIR_NAME_RE.fullmatch(fingerprint[:32]):
            raise ValueError("fingerprint must be a string of at least 32 characters from [A-Za-z0-9._-]")
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.model_dir = self.dir = self.root / fingerprint[:32]
        self.blocks_dir = self.dir / BLOCKS_DIR
        self.agents_dir = self.dir / AGENTS_DIR
        self.quarantine_dir = self.dir / QUARANTINE_DIR
        self.tmp_dir = self.dir / TMP_DIR
        self.max_block_bytes = MAX_BLOCK_BYTES
        self._lock = threading.Lock()
        # Directories this process created whose own entry (in their parent) is not known durable yet:
        # the fsync of the parent failed, or has not run. Every write into one syncs the parent first.
        self._unsynced_dirs: set[Path] = set()
        self._counts = {"block_writes": 0, "block_write_skips": 0, "block_reads": 0, "block_misses": 0,
                        "manifest_writes": 0, "manifest_reads": 0, "quarantined": 0,
                        "write_errors": 0, "read_errors": 0, "bytes_written": 0, "bytes_read": 0}
        try:
            self._open_model_dir(model_info, format_info)
        except OSError as e:
            raise StoreError(f"cannot open the cache directory {self.dir}: {e}") from e
        self._clean_tmp(max_age_live=STALE_TMP_S)
        self.quarantine_bytes = 0  # counted as files are moved aside and removed (the disk budget's)
        self._prune_quarantine()

    # -- model directory --------------------------------------------------------------------

    def _open_model_dir(self, model_info: dict, format_info: dict) -> None:
        self.root.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
        created = not self.dir.exists()
        self.dir.mkdir(mode=_DIR_MODE, exist_ok=True)
        if created:
            _fsync_dir(self.root)
        for d in (self.blocks_dir, self.agents_dir, self.quarantine_dir, self.tmp_dir):
            if not d.exists():
                d.mkdir(mode=_DIR_MODE, exist_ok=True)
                _fsync_dir(self.dir)
        path = self.dir / MODEL_JSON
        try:
            raw = self._read_model_json(path)
        except _BadFile as e:
            raise StoreError(
                f"{path} is unreadable ({e}); cannot tell which model this cache belongs to. "
                f"Remove {self.dir} to start this model's cache afresh."
            ) from None
        if raw is None:
            body = encode_model_json(self.fingerprint, model_info, format_info, time.time())
            try:
                self._atomic_write(path, [memoryview(body)], "model")
            except StoreWriteError as e:
                raise StoreError(f"cannot write {path}: {e}") from e
            return
        try:
            info = decode_model_json(raw)
            theirs_fp, theirs_v = info["fingerprint"], info["format_version"]
        except ValueError as e:
            raise StoreError(
                f"{path} is unreadable ({e}); cannot tell which model this cache belongs to. "
                f"Remove {self.dir} to start this model's cache afresh."
            ) from None
        if theirs_fp != self.fingerprint:
            raise ModelMismatchError(
                f"cache directory {self.dir} belongs to model fingerprint {str(theirs_fp)[:64]!r}, "
                f"not {self.fingerprint[:64]!r} (same 32-character prefix): refusing to serve another "
                f"model's cache. Use another cache root or remove that directory."
            )
        if theirs_v != FORMAT_VERSION:
            raise ModelMismatchError(
                f"cache directory {self.dir} has disk format version {theirs_v!r}; this build reads "
                f"version {FORMAT_VERSION}. Remove the directory (or use another cache root) to rebuild it."
            )
        if canonical_json(info.get("format_info")) != canonical_json(json.loads(json.dumps(format_info, default=str))):
            logger.warning("%s: format_info differs from the one recorded (%s); fingerprint matches, continuing",
                           self.dir, info.get("format_info"))

    @staticmethod
    def _read_model_json(path: Path) -> Optional[bytes]:
        """model.json's bytes, None when absent; _BadFile when not a regular file or over the cap."""
        try:
            fd, size = _open_regular(path)
        except FileNotFoundError:
            return None
        try:
            if size > MAX_MODEL_JSON_BYTES:
                raise _BadFile(f"{size} bytes, over the {MAX_MODEL_JSON_BYTES}-byte cap")
            return bytes(_read_exact(fd, size))
        finally:
            os.close(fd)

    # -- paths, tmp files, quarantine ------------------------------------------------------

    def block_path(self, block_id: str) -> Path:
        return self.blocks_dir / block_relpath(block_id)

    def manifest_path(self, namespace: str) -> Path:
        return self.agents_dir / manifest_name(namespace)

    def _tmp_path(self, kind: str) -> Path:
        return self.tmp_dir / f"{kind}.{os.getpid()}.{uuid.uuid4().hex}.tmp"

    def _atomic_write(self, dest: Path, chunks: list[memoryview], kind: str) -> int:
        """Write chunks to a unique tmp file, fsync, rename onto dest, fsync dest's directory.

        Any OSError removes the tmp file and is raised as StoreWriteError.
        """
        tmp = self._tmp_path(kind)
        fd = -1
        size = sum(len(c) for c in chunks)
        try:
            self._sync_parents(dest)
            _FAULT and _FAULT("open")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), _FILE_MODE)
            for c in chunks:
                _FAULT and _FAULT("write")
                _write_all(fd, c)
            _FAULT and _FAULT("fsync")
            _fsync(fd)
            os.close(fd)
            fd = -1
            _FAULT and _FAULT("rename")
            os.replace(tmp, dest)
            _FAULT and _FAULT("dirsync")
            _fsync_dir(dest.parent)
        except OSError as e:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
            try:
                os.unlink(tmp)
            except OSError:
                pass
            with self._lock:
                self._counts["write_errors"] += 1
            raise StoreWriteError(e.errno or errno.EIO, f"writing {dest.name}: {e.strerror or e}", str(dest)) from e
        return size

    def _sync_parents(self, dest: Path) -> None:
        """Make `dest`'s directory exist with a durable entry in its parent (creating it if needed).

        Marked before mkdir and cleared only after the parent's fsync succeeds, so a failed fsync is
        retried by the next write into that directory, by any thread."""
        d = dest.parent
        if d not in self._unsynced_dirs and d.is_dir():
            return
        self._unsynced_dirs.add(d)
        d.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
        _FAULT and _FAULT("dirsync")
        _fsync_dir(d.parent)
        self._unsynced_dirs.discard(d)

    def _quarantine(self, path: Path, reason: str, fd: Optional[int] = None) -> None:
        """Move a bad file aside (never deleted, never served) and log why."""
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f".{time.time_ns() % 10**9:09d}"
        dest = self.quarantine_dir / f"{path.name}.{stamp}"
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
            self.quarantine_bytes += cur.st_size if stat.S_ISREG(cur.st_mode) else 0
        logger.warning("quarantined %s -> %s: %s", path, dest.name, reason)

    def _prune_quarantine(self, keep: bool = True) -> int:
        """Delete quarantined files older than QUARANTINE_KEEP_S, and all but the newest
        QUARANTINE_KEEP_FILES (`keep=False`: every one); returns how many were deleted."""
        # Any entry counts, not only regular files: FIFOs, symlinks and directories are quarantined too.
        try:
            entries = sorted(((e.stat(follow_symlinks=False).st_mtime, e.path, e.is_dir(follow_symlinks=False),
                               e.stat(follow_symlinks=False).st_size if e.is_file(follow_symlinks=False) else 0)
                              for e in os.scandir(self.quarantine_dir)), reverse=True)
        except OSError:
            return 0
        cutoff = time.time() - QUARANTINE_KEEP_S if keep else float("inf")
        old = [(path, is_dir) for i, (mtime, path, is_dir, _) in enumerate(entries)
               if i >= QUARANTINE_KEEP_FILES or mtime < cutoff]
        kept = sum(size for i, (mtime, _, _, size) in enumerate(entries)
                   if i < QUARANTINE_KEEP_FILES and mtime >= cutoff)
        for path, _ in (o for o in old if o[1]):
            shutil.rmtree(path, ignore_errors=True)
        removed = _remove_files([path for path, is_dir in old if not is_dir], "old quarantined file(s)",
                                self.quarantine_dir)
        with self._lock:
            self.quarantine_bytes = kept
        return removed + sum(1 for o in old if o[1])

    def clear_quarantine(self) -> int:
        """Delete every quarantined file (the disk budget reclaims them first); returns how many."""
        return self._prune_quarantine(keep=False)

    def _clean_tmp(self, max_age_live: float) -> int:
        """Remove tmp files of dead processes, and any older than max_age_live seconds."""
        now, leftovers = time.time(), []
        try:
            entries = list(os.scandir(self.tmp_dir))
        except OSError:
            return 0
        for e in entries:
            m = _TMP_RE.fullmatch(e.name)
            try:
                if not (m and _pid_alive(int(m.group(1))) and now - e.stat().st_mtime < max_age_live):
                    leftovers.append(e.path)
            except OSError:
                pass
        return _remove_files(leftovers, "leftover temp file(s)", self.tmp_dir)

    # -- blocks ------------------------------------------------------------------------------

    def write_block(self, block: BlockData) -> int:
        """Write a block durably; returns bytes written, 0 when a valid copy already exists.

        "Valid copy" is checked cheaply: its header has this format version, id and checksum and the
        file has the expected size (the data is verified on read).
        """
        chunks, checksum, total = block_chunks(block)
        path = self.block_path(block.block_id)
        if total > self.max_block_bytes:  # could never be read back
            with self._lock:
                self._counts["write_errors"] += 1
            raise StoreWriteError(errno.EFBIG, f"writing {path.name}: {total} bytes, over the "
                                  f"{self.max_block_bytes}-byte block cap", str(path))
        if self._existing_block_matches(path, checksum, total):
            # A valid copy is not yet a durable one: an attempt whose directory fsync failed (or a
            # process that died before it) leaves the file renamed into place. The caller writes a
            # manifest naming the block once this returns, so its entry is synced first (~0.15 ms
            # on a clean directory here, against ~1.7 ms for a write's; skips happen on retries).
            try:
                self._sync_parents(path)
                _FAULT and _FAULT("dirsync")
                _fsync_dir(path.parent)
            except OSError as e:
                with self._lock:
                    self._counts["write_errors"] += 1
                raise StoreWriteError(e.errno or errno.EIO, f"syncing the directory of {path.name}: "
                                      f"{e.strerror or e}", str(path)) from e
            with self._lock:
                self._counts["block_write_skips"] += 1
            return 0
        written = self._atomic_write(path, chunks, "block")
        with self._lock:
            self._counts["block_writes"] += 1
            self._counts["bytes_written"] += written
        return written

    def _existing_block_matches(self, path: Path, checksum: str, total: int) -> bool:
        try:
            fd, size = _open_regular(path)
        except _BadFile as e:  # a FIFO, symlink or directory: moved aside, then the write replaces it
            self._quarantine(path, str(e))
            return False
        except OSError:
            return False
        try:
            if size != total:
                return False
            meta = block_metadata(_read_exact(fd, header_length(_read_exact(fd, 8), size), 8))
            return meta.get("format_version") == str(FORMAT_VERSION) and meta.get("checksum") == checksum
        except (OSError, ValueError, _BadFile):
            return False
        finally:
            os.close(fd)

    def has_block(self, block_id: str) -> bool:
        """Whether a block file exists (not verified: read_block does that)."""
        return self.block_path(block_id).is_file()

    def read_block(self, block_id: str) -> Optional[BlockData]:
        """The block, verified; None when absent or bad (a bad file is quarantined)."""
        path = self.block_path(block_id)
        try:
            fd, size = _open_regular(path)
        except FileNotFoundError:
            with self._lock:
                self._counts["block_misses"] += 1
            return None
        except _BadFile as e:  # a FIFO, device, symlink or directory: moved aside unopened
            self._quarantine(path, str(e))
            with self._lock:
                self._counts["block_misses"] += 1
            return None
        except OSError as e:  # not the file's fault (EMFILE, EACCES...): a miss, file kept
            logger.warning("cannot open %s: %s", path, e)
            return None
        try:
            try:
                _check_block_size(fd, size, self.max_block_bytes)  # before reading the data
                _FAULT and _FAULT("read")
                block = decode_block(_read_exact(fd, size), block_id)
            except OSError as e:  # the device failed (EIO...), not the bytes: a miss, the file is kept
                logger.warning("cannot read %s: %s", path, e)
                with self._lock:
                    self._counts["read_errors"] += 1
                    self._counts["block_misses"] += 1
                return None
            except Exception as e:  # untrusted bytes: whatever the parser did not foresee is a bad file
                self._quarantine(path, _reason(e), fd)
                with self._lock:
                    self._counts["block_misses"] += 1
                return None
        finally:
            os.close(fd)
        with self._lock:
            self._counts["block_reads"] += 1
            self._counts["bytes_read"] += size
        return block

    def quarantine_block(self, block_id: str, reason: str) -> None:
        """Move aside a block file that passed its own checks but that the caller refused."""
        self._quarantine(self.block_path(block_id), reason)

    def delete_block(self, block_id: str) -> None:
        try:
            os.unlink(self.block_path(block_id))
        except FileNotFoundError:
            pass

    def iter_block_ids(self) -> Iterator[str]:
        """Ids of all block files on disk (names only; not verified)."""
        try:
            shards = list(os.scandir(self.blocks_dir))
        except FileNotFoundError:
            return
        for shard in shards:
            if not shard.is_dir(follow_symlinks=False):  # gc must never delete through a symlink
                continue
            try:
                files = list(os.scandir(shard.path))
            except OSError:
                continue
            for f in files:
                if f.name.endswith(BLOCK_SUFFIX):
                    bid = f.name[: -len(BLOCK_SUFFIX)]
                    if BLOCK_ID_RE.fullmatch(bid) and bid[:2] == shard.name:
                        yield bid

    # -- manifests ---------------------------------------------------------------------------

    def write_manifest(self, m: Manifest) -> None:
        """Write an agent's manifest durably. Write the blocks it names first."""
        data = encode_manifest(m)
        if len(data) > MAX_MANIFEST_BYTES:  # could never be read back
            raise StoreWriteError(errno.EFBIG, f"manifest of {len(m.block_ids)} blocks is {len(data)} bytes, "
                                  f"over the {MAX_MANIFEST_BYTES}-byte manifest cap", str(self.manifest_path(m.namespace)))
        self._atomic_write(self.manifest_path(m.namespace), [memoryview(data)], "manifest")
        with self._lock:
            self._counts["manifest_writes"] += 1

    def read_manifest(self, namespace: str) -> Optional[Manifest]:
        """The agent's manifest, verified; None when absent or bad (a bad file is quarantined)."""
        return self._read_manifest_file(self.manifest_path(namespace), namespace)

    def _read_manifest_file(self, path: Path, namespace: Optional[str]) -> Optional[Manifest]:
        try:
            fd, size = _open_regular(path)
        except FileNotFoundError:
            return None
        except _BadFile as e:  # a FIFO, device, symlink or directory: moved aside unopened
            self._quarantine(path, str(e))
            return None
        except OSError as e:
            logger.warning("cannot open %s: %s", path, e)
            return None
        try:
            try:
                if size > MAX_MANIFEST_BYTES:
                    raise _BadFile(f"{size} bytes, over the {MAX_MANIFEST_BYTES}-byte manifest cap")
                _FAULT and _FAULT("read")
                m = decode_manifest(bytes(_read_exact(fd, size)))
                if path.name != manifest_name(m.namespace):
                    raise _BadFile(f"file name does not match its namespace {m.namespace[:64]!r}")
                if namespace is not None and m.namespace != namespace:
                    raise _BadFile("namespace mismatch")
            except OSError as e:  # the device failed, not the bytes: skipped this time, kept
                logger.warning("cannot read %s: %s", path, e)
                with self._lock:
                    self._counts["read_errors"] += 1
                return None
            except Exception as e:  # untrusted bytes: whatever the parser did not foresee is a bad file
                self._quarantine(path, _reason(e), fd)
                return None
        finally:
            os.close(fd)
        with self._lock:
            self._counts["manifest_reads"] += 1
        return m

    def delete_manifest(self, namespace: str) -> None:
        path = self.manifest_path(namespace)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        try:
            _fsync_dir(path.parent)
        except OSError:
            pass

    def list_manifests(self) -> list[Manifest]:
        """Every valid manifest; bad ones are quarantined and skipped."""
        out = []
        try:
            entries = sorted(e.name for e in os.scandir(self.agents_dir))
        except FileNotFoundError:
            return out
        for name in entries:
            if name.endswith(".json"):
                m = self._read_manifest_file(self.agents_dir / name, None)
                if m is not None:
                    out.append(m)
        return out

    # -- housekeeping ------------------------------------------------------------------------

    def gc(self, live_block_ids: set[str]) -> int:
        """Delete block files named neither by `live_block_ids` nor by any manifest on disk, and
        stale tmp files; returns the number of block files deleted.

        Blocks written but not yet named by a manifest must be in `live_block_ids` (or run gc on the
        persister thread, which orders it after pending writes).
        """
        live = set(live_block_ids)
        for m in self.list_manifests():
            live.update(m.block_ids)
        deleted = 0
        for bid in list(self.iter_block_ids()):
            if bid not in live:
                self.delete_block(bid)
                deleted += 1
        self._clean_tmp(max_age_live=STALE_TMP_S)
        if deleted:
            logger.info("gc: deleted %d unreferenced block file(s)", deleted)
        return deleted

    def block_file_sizes(self) -> dict[str, int]:
        """Size in bytes of every block file, by id (one directory walk: start-up and offline use)."""
        sizes = {}
        for bid in self.iter_block_ids():
            try:
                sizes[bid] = self.block_path(bid).stat().st_size
            except OSError:
                pass
        return sizes

    def block_file_size(self, block_id: str) -> int:
        try:
            return self.block_path(block_id).stat().st_size
        except OSError:
            return 0

    def delete_agent(self, namespace: str, block_ids: list[str]) -> None:
        """Erase an agent durably: its manifest first (so no reader follows it to missing blocks),
        then the given blocks (those no other manifest names), then the directories' entries."""
        path = self.manifest_path(namespace)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        shards = set()
        for bid in block_ids:
            try:
                os.unlink(self.block_path(bid))
                shards.add(self.block_path(bid).parent)
            except FileNotFoundError:
                pass
        for d in (path.parent, *shards):
            try:
                _fsync_dir(d)
            except OSError:
                pass

    def erase_elsewhere(self, namespace: str) -> tuple[int, int]:
        """Erase the agent under every other model (or format) directory of the root, as
        `erase_agent_files`; returns (directories it was in, bytes freed)."""
        found = freed = 0
        for path, _, _ in self.other_model_dirs(sizes=False):
            n = erase_agent_files(path, namespace)
            if n >= 0:
                found, freed = found + 1, freed + n
        return found, freed

    def other_model_dirs(self, sizes: bool = True) -> list[tuple[Path, int, float]]:
        """(path, bytes, last modified) of the other model/format directories under the root,
        oldest first: what a disk budget reclaims before any agent of this model."""
        out = []
        for path in model_dirs(self.root):
            if path.name != self.dir.name:
                total, newest = _tree_usage(path) if sizes else (0, 0.0)
                out.append((path, total, newest))
        return sorted(out, key=lambda t: t[2])

    @classmethod
    def open_existing(cls, model_dir: Path) -> "DiskStore":
        """Open a model directory from what its model.json records (offline tools: no model loaded)."""
        model_dir = Path(model_dir)
        try:
            info = json.loads((model_dir / MODEL_JSON).read_bytes())
            return cls(model_dir.parent, info["fingerprint"], info.get("model_info") or {},
                       info.get("format_info") or {})
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise StoreError(f"{model_dir}: not a readable cache directory ({type(e).__name__}: {e})") from None

    def _usage(self) -> dict[str, tuple[int, int]]:
        """(files, bytes) per area, by scanning the directory."""
        def scan(d: Path, depth: int) -> tuple[int, int]:
            n = b = 0
            try:
                entries = list(os.scandir(d))
            except OSError:
                return 0, 0
            for e in entries:
                try:
                    if depth and e.is_dir(follow_symlinks=False):
                        dn, db = scan(Path(e.path), depth - 1)
                        n, b = n + dn, b + db
                    elif e.is_file(follow_symlinks=False):
                        n, b = n + 1, b + e.stat(follow_symlinks=False).st_size
                except OSError:
                    pass
            return n, b

        return {"blocks": scan(self.blocks_dir, 1), "agents": scan(self.agents_dir, 0),
                "tmp": scan(self.tmp_dir, 0), "quarantine": scan(self.quarantine_dir, 0)}

    def disk_bytes(self) -> int:
        """Bytes of every file in this model directory (blocks, manifests, tmp, quarantine)."""
        model = (self.dir / MODEL_JSON)
        base = model.stat().st_size if model.exists() else 0
        return base + sum(b for _, b in self._usage().values())

    def counts(self) -> dict:
        """The counters only (no file system access): O(1), any thread."""
        with self._lock:
            return dict(self._counts)

    def stats(self) -> dict:
        usage = self._usage()
        with self._lock:
            counts = dict(self._counts)
        out: dict[str, Any] = {"dir": str(self.dir), "format_version": FORMAT_VERSION}
        for area, (n, b) in usage.items():
            out[f"{area}_files"] = n
            out[f"{area}_bytes"] = b
        out["disk_bytes"] = self.disk_bytes()
        out.update(counts)
        return out


def erase_agent_files(model_dir: Path, namespace: str) -> int:
    """Erase an agent from a model directory of any model or disk-format version, durably: its
    manifest, then the block files it names that no other manifest there names. Manifests are read
    leniently (JSON with a `block_ids` list), so directories this build cannot serve are erased too;
    a manifest that cannot be read names nothing. Returns the bytes freed, or -1 when the agent has
    no manifest there. Nothing else may write the directory meanwhile (its server's persister
    thread, or the root's lock held offline)."""
    agents_dir, blocks_dir = Path(model_dir) / AGENTS_DIR, Path(model_dir) / BLOCKS_DIR
    # The agent's record, and its spliced histories as the layout before the record kept them: each
    # under a manifest of its own (namespace.legacy_spliced), a directory no server has migrated yet.
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
            _fsync_dir(d)
        except OSError:
            pass
    return freed


def _lenient_block_ids(path: Path) -> Optional[set[str]]:
    """The block ids a manifest file names, read without its checks; None when there is no such
    file, an empty set when it cannot be read."""
    try:
        fd, size = _open_regular(path)
    except FileNotFoundError:
        return None
    except (OSError, _BadFile):
        return set() if os.path.lexists(path) else None
    try:
        return lenient_block_ids(bytes(_read_exact(fd, min(size, MAX_MANIFEST_BYTES))))
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


def _reason(e: Exception) -> str:
    """Quarantine reason for an exception raised while checking a file."""
    if isinstance(e, (_BadFile, FormatError, OSError)):
        return str(e) or type(e).__name__
    return f"{type(e).__name__}: {e}"[:300]


def _check_block_size(fd: int, size: int, cap: int) -> None:
    """Check a block file's size against the cap and against the size its header describes,
    reading only the header: an oversized or padded file is refused before its data is read."""
    if size > cap:
        raise _BadFile(f"{size} bytes, over the {cap}-byte block cap")
    hlen = header_length(_read_exact(fd, min(size, 8)), size)
    described = described_size(hlen, _read_exact(fd, hlen, 8))
    if described != size:
        raise _BadFile(f"the header describes a {described}-byte file, the file has {size} bytes")
