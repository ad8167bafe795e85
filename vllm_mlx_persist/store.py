"""Disk tier: content-addressed block files and per-agent manifests, durable and self-checking.

Runs on writer/prefetch threads, so it only sees numpy arrays and bytes: no MLX here.
Layout, file formats and the durability protocol are described in docs/disk-format.md.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import shutil
import stat
import threading
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np

logger = logging.getLogger("vllm_mlx_persist.store")

FORMAT_VERSION = 1

_MODEL_FORMAT = "vllm-mlx-persist.model"
_BLOCK_FORMAT = "vllm-mlx-persist.block"
_MANIFEST_FORMAT = "vllm-mlx-persist.manifest"
_TOKENS = "tokens"
_BLOCK_SUFFIX = ".safetensors"
_MAX_HEADER = 16 << 20
# Size caps checked (from fstat) before a file is read: anything larger is quarantined unread.
# A real block is a few MiB to tens of MiB (64 layers x 8 heads x 256 tokens x head_dim 128 is 18 MiB).
MAX_BLOCK_BYTES = 1 << 30
MAX_MANIFEST_BYTES = 16 << 20  # ~240k block ids
MAX_ERA_CHARS = 128  # a manifest's era: the fleet tier's tombstone id (16 hex digits as written)
_MAX_MODEL_JSON = 1 << 20
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

_BLOCK_ID_RE = re.compile(r"[0-9a-f]{2,128}")
_DIR_NAME_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
_MODEL_DIR_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{31}")
_TMP_RE = re.compile(r"[a-z]+\.(\d+)\.[0-9a-f]{32}\.tmp")

# numpy dtype <-> safetensors dtype code (little-endian only)
_NP_TO_ST = {
    np.dtype(np.bool_): "BOOL", np.dtype(np.uint8): "U8", np.dtype(np.int8): "I8",
    np.dtype("<u2"): "U16", np.dtype("<i2"): "I16", np.dtype("<f2"): "F16",
    np.dtype("<u4"): "U32", np.dtype("<i4"): "I32", np.dtype("<f4"): "F32",
    np.dtype("<u8"): "U64", np.dtype("<i8"): "I64", np.dtype("<f8"): "F64",
}
_ST_TO_NP = {v: k for k, v in _NP_TO_ST.items()}


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


@dataclass
class BlockData:
    block_id: str
    tokens: np.ndarray  # int32 (n,)
    arrays: dict[str, np.ndarray]  # 16-bit floats arrive as uint16 views; real dtype in `dtypes`
    dtypes: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + sum(a.nbytes for a in self.arrays.values())


@dataclass
class Manifest:
    namespace: str
    block_ids: list[str]
    n_tokens: int
    updated_at: float
    pinned: bool = False  # exempt from hot-tier eviction, the disk budget and the TTL
    # The agent's branches, least recently used first, when it has more than one plain chain:
    # [{"block_ids": [...], "n_tokens": n, "links": [[block index, namespace], ...], "last_used": t}]
    # (last_used optional: absent, the manifest's updated_at; chain.branches_of). None: one
    # branch, `block_ids` itself, seeded with the namespace. `block_ids` always lists every block
    # the manifest names (what the disk budget, GC and erasure count).
    branches: Optional[list] = None
    # The erasure the agent's history follows (docs/fleet.md, Erasure): the id of the fleet tier's
    # tombstone it was started on; None: it never met one. Optional, like `pinned` and `branches`.
    era: Optional[str] = None


# ---------------------------------------------------------------------------------------------
# Small helpers


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


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


def _bytes_view(a: np.ndarray) -> memoryview:
    return memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")


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


def _check_block_id(block_id: str) -> str:
    if not isinstance(block_id, str) or not _BLOCK_ID_RE.fullmatch(block_id):
        raise ValueError(f"block id must be 2 to 128 lowercase hex digits, got {block_id!r:.80}")
    return block_id


def _prepare_array(name: str, a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    if a.dtype not in _NP_TO_ST:
        raise ValueError(f"array {name!r}: dtype {a.dtype} cannot be stored (view 16-bit floats as uint16)")
    return np.ascontiguousarray(a)


def _block_checksum(block_id: str, n_tokens: int, dtypes: dict[str, str],
                    tensors: list[tuple[str, str, list[int], memoryview]]) -> str:
    """sha256 over a canonical descriptor (id, n_tokens, dtypes, names/dtypes/shapes) then the data
    of every tensor in name order: covers tokens, arrays and everything the header says about them.
    What blocks written before the crc32 check carry; read, no longer written."""
    h = hashlib.sha256()
    desc = {"block_id": block_id, "n_tokens": n_tokens, "dtypes": dtypes,
            "tensors": [[n, d, s] for n, d, s, _ in tensors]}
    h.update(_canonical(desc))
    for _, _, _, data in tensors:
        h.update(data)
    return "sha256:" + h.hexdigest()


def _block_crc32(block_id: str, n_tokens: int, dtypes: dict[str, str],
                 tensors: list[tuple[str, str, list[int], tuple[int, int]]], data: list[memoryview]) -> str:
    """crc32 over a canonical descriptor (id, n_tokens, dtypes, names/dtypes/shapes/data offsets)
    then the data section as laid out in the file: one pass over contiguous bytes, 2.4x sha256's
    speed on the bench CPU, and zlib releases the GIL for it, so parallel readers verify in parallel."""
    desc = {"block_id": block_id, "n_tokens": n_tokens, "dtypes": dtypes,
            "tensors": [[n, d, s, list(o)] for n, d, s, o in tensors]}
    crc = zlib.crc32(_canonical(desc))
    for chunk in data:
        crc = zlib.crc32(chunk, crc)
    return f"crc32:{crc:08x}"


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
        if not isinstance(fingerprint, str) or len(fingerprint) < 32 or not _DIR_NAME_RE.fullmatch(fingerprint[:32]):
            raise ValueError("fingerprint must be a string of at least 32 characters from [A-Za-z0-9._-]")
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.model_dir = self.dir = self.root / fingerprint[:32]
        self.blocks_dir = self.dir / "blocks"
        self.agents_dir = self.dir / "agents"
        self.quarantine_dir = self.dir / "quarantine"
        self.tmp_dir = self.dir / "tmp"
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
        path = self.dir / "model.json"
        try:
            raw = self._read_model_json(path)
        except _BadFile as e:
            raise StoreError(
                f"{path} is unreadable ({e}); cannot tell which model this cache belongs to. "
                f"Remove {self.dir} to start this model's cache afresh."
            ) from None
        if raw is None:
            info = {"format": _MODEL_FORMAT, "format_version": FORMAT_VERSION, "fingerprint": self.fingerprint,
                    "model_info": model_info, "format_info": format_info, "created_at": time.time()}
            body = json.dumps(info, sort_keys=True, indent=1, default=str).encode()
            try:
                self._atomic_write(path, [memoryview(body)], "model")
            except StoreWriteError as e:
                raise StoreError(f"cannot write {path}: {e}") from e
            return
        try:
            info = json.loads(raw)
            theirs_fp, theirs_v = info["fingerprint"], info["format_version"]
        except (ValueError, KeyError, TypeError, RecursionError) as e:
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
        if _canonical(info.get("format_info")) != _canonical(json.loads(json.dumps(format_info, default=str))):
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
            if size > _MAX_MODEL_JSON:
                raise _BadFile(f"{size} bytes, over the {_MAX_MODEL_JSON}-byte cap")
            return bytes(_read_exact(fd, size))
        finally:
            os.close(fd)

    # -- paths, tmp files, quarantine ------------------------------------------------------

    def block_path(self, block_id: str) -> Path:
        _check_block_id(block_id)
        return self.blocks_dir / block_id[:2] / f"{block_id}{_BLOCK_SUFFIX}"

    @staticmethod
    def agent_key(namespace: str) -> str:
        """File-name key of an agent: sha256 of the namespace, hex (ids never become paths)."""
        if not isinstance(namespace, str):
            raise TypeError("namespace must be a str")
        return hashlib.sha256(namespace.encode("utf-8")).hexdigest()

    def manifest_path(self, namespace: str) -> Path:
        return self.agents_dir / f"{self.agent_key(namespace)}.json"

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
        chunks, checksum, total = _encode_block(block)
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
            n = int.from_bytes(_read_exact(fd, 8), "little")
            if n > _MAX_HEADER or 8 + n > size:
                return False
            meta = json.loads(bytes(_read_exact(fd, n, 8))).get("__metadata__", {})
            return meta.get("format_version") == str(FORMAT_VERSION) and meta.get("checksum") == checksum
        except (OSError, ValueError, AttributeError, RecursionError, _BadFile):
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
                block = _parse_block(_read_exact(fd, size), block_id)
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
                if f.name.endswith(_BLOCK_SUFFIX):
                    bid = f.name[: -len(_BLOCK_SUFFIX)]
                    if _BLOCK_ID_RE.fullmatch(bid) and bid[:2] == shard.name:
                        yield bid

    # -- manifests ---------------------------------------------------------------------------

    def write_manifest(self, m: Manifest) -> None:
        """Write an agent's manifest durably. Write the blocks it names first."""
        if not isinstance(m.namespace, str) or not m.namespace:
            raise ValueError("manifest namespace must be a non-empty string")
        for b in m.block_ids:
            _check_block_id(b)
        body = {"format": _MANIFEST_FORMAT, "format_version": FORMAT_VERSION, "namespace": m.namespace,
                "block_ids": list(m.block_ids), "n_tokens": int(m.n_tokens), "updated_at": float(m.updated_at)}
        if m.pinned:  # optional field: manifests of unpinned agents read the same as before
            body["pinned"] = True
        if m.branches is not None:  # optional too: agents that never branch or fork read as before
            _check_branches(m.branches, set(m.block_ids))
            body["branches"] = m.branches
        if m.era is not None:  # optional too: absent for every history that never met an erasure
            _check_era(m.era)
            body["era"] = m.era
        body["checksum"] = "sha256:" + hashlib.sha256(_canonical(body)).hexdigest()
        data = json.dumps(body, sort_keys=True, ensure_ascii=True).encode()
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
                m = _parse_manifest(bytes(_read_exact(fd, size)))
                if path.name != f"{self.agent_key(m.namespace)}.json":
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
        try:
            entries = list(os.scandir(self.root))
        except OSError:
            return out
        for e in entries:
            if e.name == self.dir.name or not _MODEL_DIR_RE.fullmatch(e.name):
                continue
            if not e.is_dir(follow_symlinks=False) or not os.path.exists(os.path.join(e.path, "model.json")):
                continue
            total, newest = _tree_usage(Path(e.path)) if sizes else (0, 0.0)
            out.append((Path(e.path), total, newest))
        return sorted(out, key=lambda t: t[2])

    @classmethod
    def open_existing(cls, model_dir: Path) -> "DiskStore":
        """Open a model directory from what its model.json records (offline tools: no model loaded)."""
        model_dir = Path(model_dir)
        try:
            info = json.loads((model_dir / "model.json").read_bytes())
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
        model = (self.dir / "model.json")
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
    agents_dir, blocks_dir = Path(model_dir) / "agents", Path(model_dir) / "blocks"
    target = agents_dir / f"{DiskStore.agent_key(namespace)}.json"
    mine = _lenient_block_ids(target)
    if mine is None:
        return -1
    others: set[str] = set()
    try:
        names = [e.name for e in os.scandir(agents_dir) if e.name.endswith(".json") and e.name != target.name]
    except OSError:
        names = []
    for name in names:
        others.update(_lenient_block_ids(agents_dir / name) or ())
    freed = 0
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
        path = blocks_dir / bid[:2] / f"{bid}{_BLOCK_SUFFIX}"
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
        body = json.loads(bytes(_read_exact(fd, min(size, MAX_MANIFEST_BYTES))))
        ids = body.get("block_ids") if isinstance(body, dict) else None
        return {b for b in ids if isinstance(b, str) and _BLOCK_ID_RE.fullmatch(b)} if isinstance(ids, list) else set()
    except (OSError, ValueError, RecursionError):
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


# ---------------------------------------------------------------------------------------------
# Block encoding (pure functions, shared by the disk tier and the fleet tier in remote.py)


class BadBlockError(ValueError):
    """Bytes that are not a valid block file for the requested id (decode_block)."""


def _encode_block(block: BlockData) -> tuple[list[memoryview], str, int]:
    """The block file as (chunks, checksum, total size), straight from the arrays' buffers."""
    block_id = _check_block_id(block.block_id)
    tokens = _prepare_array(_TOKENS, block.tokens)
    if tokens.dtype != np.int32 or tokens.ndim != 1:
        raise ValueError(f"block {block_id}: tokens must be 1-D int32, got {tokens.dtype} {tokens.shape}")
    if _TOKENS in block.arrays:
        raise ValueError(f"block {block_id}: array name {_TOKENS!r} is reserved")
    unknown = set(block.dtypes) - set(block.arrays)
    if unknown:
        raise ValueError(f"block {block_id}: dtypes names arrays it does not have: {sorted(unknown)}")
    arrays = {n: _prepare_array(n, a) for n, a in block.arrays.items()}
    arrays[_TOKENS] = tokens
    dtypes = {str(k): str(v) for k, v in block.dtypes.items()}
    n_tokens = int(tokens.shape[0])

    views = {n: _bytes_view(a) for n, a in arrays.items()}
    # Data section: larger item sizes first so every tensor stays aligned to its item size.
    order = sorted(arrays, key=lambda n: (-arrays[n].dtype.itemsize, n))
    header: dict[str, Any] = {"__metadata__": {
        "format": _BLOCK_FORMAT, "format_version": str(FORMAT_VERSION), "block_id": block_id,
        "n_tokens": str(n_tokens), "dtypes": json.dumps(dtypes, sort_keys=True)}}
    off = 0
    for n in order:
        size = len(views[n])
        header[n] = {"dtype": _NP_TO_ST[arrays[n].dtype], "shape": list(arrays[n].shape),
                     "data_offsets": [off, off + size]}
        off += size
    tensors = [(n, header[n]["dtype"], header[n]["shape"], tuple(header[n]["data_offsets"])) for n in sorted(arrays)]
    checksum = _block_crc32(block_id, n_tokens, dtypes, tensors, [views[n] for n in order])
    header["__metadata__"]["checksum"] = checksum
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * (-(8 + len(hbytes)) % 8)  # data starts 8-byte aligned
    chunks = [memoryview(len(hbytes).to_bytes(8, "little")), memoryview(hbytes)] + [views[n] for n in order]
    return chunks, checksum, 8 + len(hbytes) + off


def encode_block(block: BlockData) -> bytes:
    """The exact bytes write_block puts in the block's file."""
    return b"".join(_encode_block(block)[0])


def decode_block(buf: bytes | bytearray, block_id: str) -> BlockData:
    """Parse and fully verify a block file's bytes, exactly as read_block does; BadBlockError if
    they are not a valid block `block_id`. Arrays are views of `buf` (read-only when it is bytes)."""
    try:
        return _parse_block(buf, block_id)
    except _BadFile as e:
        raise BadBlockError(str(e)) from None


# ---------------------------------------------------------------------------------------------
# Parsing (pure functions: raise _BadFile on anything unexpected)


def _reason(e: Exception) -> str:
    """Quarantine reason for an exception raised while checking a file."""
    if isinstance(e, (_BadFile, OSError)):
        return str(e) or type(e).__name__
    return f"{type(e).__name__}: {e}"[:300]


def _check_block_size(fd: int, size: int, cap: int) -> None:
    """Check a block file's size against the cap and against the size its header describes,
    reading only the header: an oversized or padded file is refused before its data is read."""
    if size > cap:
        raise _BadFile(f"{size} bytes, over the {cap}-byte block cap")
    if size < 8:
        raise _BadFile(f"truncated: {size} bytes")
    hlen = int.from_bytes(_read_exact(fd, 8), "little")
    if hlen > _MAX_HEADER or 8 + hlen > size:
        raise _BadFile(f"header length {hlen} does not fit a {size}-byte file")
    try:
        header = json.loads(bytes(_read_exact(fd, hlen, 8)))
        data_len = max((int(t["data_offsets"][1]) for n, t in header.items() if n != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, RecursionError) as e:
        raise _BadFile(f"bad header: {type(e).__name__}: {e}"[:300]) from None
    if 8 + hlen + data_len != size:
        raise _BadFile(f"the header describes a {8 + hlen + data_len}-byte file, the file has {size} bytes")


def _parse_block(buf: bytes | bytearray, block_id: str) -> BlockData:
    size = len(buf)
    if size < 8:
        raise _BadFile(f"truncated: {size} bytes")
    hlen = int.from_bytes(buf[:8], "little")
    if hlen > _MAX_HEADER or 8 + hlen > size:
        raise _BadFile(f"header length {hlen} does not fit a {size}-byte file")
    try:
        header = json.loads(bytes(buf[8:8 + hlen]))
        meta = header.pop("__metadata__")
        if not isinstance(meta, dict):
            raise TypeError("__metadata__ is not an object")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise _BadFile(f"bad header: {e}") from None
    if meta.get("format") != _BLOCK_FORMAT or meta.get("format_version") != str(FORMAT_VERSION):
        raise _BadFile(f"format {meta.get('format')!r} version {meta.get('format_version')!r}, "
                       f"expected {_BLOCK_FORMAT!r} version {FORMAT_VERSION}")
    if meta.get("block_id") != block_id:
        raise _BadFile(f"file holds block {str(meta.get('block_id'))[:80]!r}, not {block_id!r}")
    try:
        n_tokens = int(meta["n_tokens"])
        dtypes = json.loads(meta["dtypes"])
        checksum = meta["checksum"]
        if not isinstance(dtypes, dict) or not all(isinstance(v, str) for v in dtypes.values()):
            raise TypeError("dtypes is not a name -> str map")
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise _BadFile(f"bad metadata: {e}") from None

    data_start = 8 + hlen
    data_len = size - data_start
    base = memoryview(buf)[data_start:]
    spans, tensors, arrays = [], [], {}  # tensors: (name, dtype, shape, data view, offsets)
    for name in sorted(header):
        t = header[name]
        try:
            dt = _ST_TO_NP[t["dtype"]]
            shape = [int(s) for s in t["shape"]]
            begin, end = (int(x) for x in t["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise _BadFile(f"tensor {name!r}: bad entry ({e})") from None
        if any(s < 0 for s in shape) or not 0 <= begin <= end <= data_len:
            raise _BadFile(f"tensor {name!r}: offsets {begin}..{end} outside the {data_len}-byte data")
        if end - begin != math.prod(shape) * dt.itemsize:
            raise _BadFile(f"tensor {name!r}: {end - begin} bytes for shape {shape} {dt}")
        spans.append((begin, end))
        view = base[begin:end]
        tensors.append((name, t["dtype"], shape, view, (begin, end)))
        arrays[name] = np.frombuffer(view, dtype=dt).reshape(shape) if end > begin else np.zeros(shape, dt)
    # The data section must be covered exactly, without holes or overlaps (as safetensors requires).
    pos = 0
    for begin, end in sorted(spans):
        if begin != pos:
            raise _BadFile("tensor data has holes or overlaps")
        pos = end
    if pos != data_len:
        raise _BadFile(f"data section is {data_len} bytes, tensors cover {pos}")
    if not isinstance(checksum, str) or not checksum.startswith(("crc32:", "sha256:")):
        raise _BadFile(f"unknown checksum {str(checksum)[:40]!r}")
    if checksum.startswith("crc32:"):
        computed = _block_crc32(block_id, n_tokens, dtypes, [(n, d, s, o) for n, d, s, _, o in tensors], [base])
    else:  # written by an earlier build
        computed = _block_checksum(block_id, n_tokens, dtypes, [(n, d, s, v) for n, d, s, v, _ in tensors])
    if computed != checksum:
        raise _BadFile("checksum mismatch")
    tokens = arrays.pop(_TOKENS, None)
    if tokens is None or tokens.dtype != np.int32 or tokens.shape != (n_tokens,):
        raise _BadFile("missing or malformed tokens")
    if set(dtypes) - set(arrays):
        raise _BadFile("dtypes names missing arrays")
    return BlockData(block_id=block_id, tokens=tokens, arrays=arrays, dtypes=dtypes)


def _parse_manifest(raw: bytes) -> Manifest:
    try:
        body = json.loads(raw)
        if not isinstance(body, dict):
            raise TypeError("not an object")
        checksum = body.pop("checksum")
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise _BadFile(f"bad manifest: {e}") from None
    if body.get("format") != _MANIFEST_FORMAT or body.get("format_version") != FORMAT_VERSION:
        raise _BadFile(f"manifest format {body.get('format')!r} version {body.get('format_version')!r}")
    if checksum != "sha256:" + hashlib.sha256(_canonical(body)).hexdigest():
        raise _BadFile("checksum mismatch")
    ns, ids, n, ts = body.get("namespace"), body.get("block_ids"), body.get("n_tokens"), body.get("updated_at")
    pinned = body.get("pinned", False)
    if (not isinstance(ns, str) or not isinstance(ids, list) or not isinstance(n, int)
            or not isinstance(ts, (int, float)) or not isinstance(pinned, bool)
            or not all(isinstance(b, str) and _BLOCK_ID_RE.fullmatch(b) for b in ids)):
        raise _BadFile("malformed manifest fields")
    branches = body.get("branches")
    if branches is not None:
        try:
            _check_branches(branches, set(ids))
        except ValueError as e:
            raise _BadFile(str(e)) from None
    era = body.get("era")
    if era is not None:
        try:
            _check_era(era)
        except ValueError as e:
            raise _BadFile(str(e)) from None
    return Manifest(namespace=ns, block_ids=list(ids), n_tokens=n, updated_at=float(ts), pinned=pinned,
                    branches=branches, era=era)


def _check_era(era: Any) -> None:
    """Raise ValueError unless `era` is a tombstone id as a manifest may carry it."""
    if not isinstance(era, str) or not 0 < len(era) <= MAX_ERA_CHARS or not era.isascii() or not era.isprintable():
        raise ValueError("malformed manifest era")


def _check_branches(branches: Any, named: set) -> None:
    """Raise ValueError unless `branches` is a well-formed list of branches over `named` blocks."""
    if not isinstance(branches, list) or not branches:
        raise ValueError("manifest branches must be a non-empty list")
    for br in branches:
        ids, n, links = (br.get("block_ids"), br.get("n_tokens"), br.get("links")) if isinstance(br, dict) else (None,) * 3
        if (not isinstance(ids, list) or not all(isinstance(b, str) and b in named for b in ids)
                or not isinstance(n, int) or n < 0 or not isinstance(links, list) or not links
                or not all(isinstance(l, list) and len(l) == 2 and isinstance(l[0], int) and isinstance(l[1], str)
                           for l in links)
                or links[0][0] != 0 or [l[0] for l in links] != sorted({l[0] for l in links})):
            raise ValueError("malformed manifest branch")
        used = br.get("last_used", 0.0)  # optional: absent in manifests written before it existed
        if isinstance(used, bool) or not isinstance(used, (int, float)) or not math.isfinite(used):
            raise ValueError("malformed manifest branch: last_used")
