"""Disk tier: the I/O of content-addressed block files and per-agent manifests, durable and self-checking.

Owns the files of one model directory under a cache root: atomic durable writes (tmp, fsync, rename,
directory fsync), reads that refuse anything but a regular file within its size cap, GC, erasure;
bad files go to its quarantine (quarantine.py). The root itself (its lock, the other models'
directories) is cache_root.py's, file primitives are files.py's. What the bytes mean is `disk_format`'s. A `DiskStore` is used by the persister thread
(writes, GC, erasure), the reader threads (block and manifest reads) and the worker at start-up;
its counters are under its own lock. numpy and bytes only: no MLX here. The durability protocol is
described in docs/disk-format.md.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator, Optional

from .disk_format import (AGENTS_DIR, BLOCK_ID_RE, BLOCK_SUFFIX, BLOCKS_DIR, DIR_NAME_RE, FORMAT_VERSION,
                          MAX_BLOCK_BYTES, MAX_MANIFEST_BYTES, MAX_MODEL_JSON_BYTES, MODEL_JSON,
                          QUARANTINE_DIR, TMP_DIR, BlockData, Manifest, block_chunks, block_metadata,
                          block_relpath, canonical_json, decode_block, decode_manifest, decode_model_json,
                          described_size, encode_manifest, encode_model_json, header_length,
                          manifest_name, FormatError)
from .files import DIR_MODE, FILE_MODE, BadFile, fsync, fsync_dir, open_regular, read_capped, read_exact, write_all
from .quarantine import STALE_TMP_S, Quarantine, clean_tmp

logger = logging.getLogger("vllm_mlx_persist.store")


class StoreError(Exception):
    """The store cannot be opened or used as asked (not a bad cache file: those are misses)."""


class ModelMismatchError(StoreError):
    """The model directory belongs to another model fingerprint or another format version."""


class StoreWriteError(OSError):
    """A write failed (full disk, file too large, I/O error, permission); nothing partial is visible.

    The caller keeps the data in memory and may retry later. errno is the underlying one.
    """


# Fault injection (faults.py): None unless VLLM_MLX_PERSIST_FAULT is set, so the cost when off is
# one global lookup per step. Only the reliability campaigns set it.
_FAULT = None
if os.environ.get("VLLM_MLX_PERSIST_FAULT"):
    from .faults import from_env as _fault_from_env

    _FAULT = _fault_from_env()


# ---------------------------------------------------------------------------------------------
# DiskStore


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
        clean_tmp(self.tmp_dir, STALE_TMP_S)
        self.quarantine = Quarantine(self.quarantine_dir, self._lock, self._counts)
        self.quarantine.prune()

    # -- model directory --------------------------------------------------------------------

    def _open_model_dir(self, model_info: dict, format_info: dict) -> None:
        self.root.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        created = not self.dir.exists()
        self.dir.mkdir(mode=DIR_MODE, exist_ok=True)
        if created:
            fsync_dir(self.root)
        for d in (self.blocks_dir, self.agents_dir, self.quarantine_dir, self.tmp_dir):
            if not d.exists():
                d.mkdir(mode=DIR_MODE, exist_ok=True)
                fsync_dir(self.dir)
        path = self.dir / MODEL_JSON
        try:
            raw = self._read_model_json(path)
        except BadFile as e:
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
        """model.json's bytes, None when absent; BadFile when not a regular file or over the cap."""
        try:
            return read_capped(path, MAX_MODEL_JSON_BYTES)
        except FileNotFoundError:
            return None

    # -- paths, durable writes ---------------------------------------------------------------

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
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
            for c in chunks:
                _FAULT and _FAULT("write")
                write_all(fd, c)
            _FAULT and _FAULT("fsync")
            fsync(fd)
            os.close(fd)
            fd = -1
            _FAULT and _FAULT("rename")
            os.replace(tmp, dest)
            _FAULT and _FAULT("dirsync")
            fsync_dir(dest.parent)
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
        d.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        _FAULT and _FAULT("dirsync")
        fsync_dir(d.parent)
        self._unsynced_dirs.discard(d)





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
                fsync_dir(path.parent)
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
            fd, size = open_regular(path)
        except BadFile as e:  # a FIFO, symlink or directory: moved aside, then the write replaces it
            self.quarantine.move(path, str(e))
            return False
        except OSError:
            return False
        try:
            if size != total:
                return False
            meta = block_metadata(read_exact(fd, header_length(read_exact(fd, 8), size), 8))
            return meta.get("format_version") == str(FORMAT_VERSION) and meta.get("checksum") == checksum
        except (OSError, ValueError, BadFile):
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
            fd, size = open_regular(path)
        except FileNotFoundError:
            with self._lock:
                self._counts["block_misses"] += 1
            return None
        except BadFile as e:  # a FIFO, device, symlink or directory: moved aside unopened
            self.quarantine.move(path, str(e))
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
                block = decode_block(read_exact(fd, size), block_id)
            except OSError as e:  # the device failed (EIO...), not the bytes: a miss, the file is kept
                logger.warning("cannot read %s: %s", path, e)
                with self._lock:
                    self._counts["read_errors"] += 1
                    self._counts["block_misses"] += 1
                return None
            except Exception as e:  # untrusted bytes: whatever the parser did not foresee is a bad file
                self.quarantine.move(path, _reason(e), fd)
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
        self.quarantine.move(self.block_path(block_id), reason)

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

    def write_manifest(self, m: Manifest) -> int:
        """Write an agent's manifest durably (returns its size). Write the blocks it names first."""
        data = encode_manifest(m)
        if len(data) > MAX_MANIFEST_BYTES:  # could never be read back
            raise StoreWriteError(errno.EFBIG, f"manifest of {len(m.block_ids)} blocks is {len(data)} bytes, "
                                  f"over the {MAX_MANIFEST_BYTES}-byte manifest cap", str(self.manifest_path(m.namespace)))
        self._atomic_write(self.manifest_path(m.namespace), [memoryview(data)], "manifest")
        with self._lock:
            self._counts["manifest_writes"] += 1
        return len(data)

    def read_manifest(self, namespace: str) -> Optional[Manifest]:
        """The agent's manifest, verified; None when absent or bad (a bad file is quarantined)."""
        return self._read_manifest_file(self.manifest_path(namespace), namespace)

    def _read_manifest_file(self, path: Path, namespace: Optional[str]) -> Optional[Manifest]:
        got = self._read_sized_manifest(path, namespace)
        return None if got is None else got[0]

    def _read_sized_manifest(self, path: Path, namespace: Optional[str]) -> Optional[tuple[Manifest, int]]:
        """The manifest at `path` and its file's size, verified; None when absent or bad."""
        try:
            fd, size = open_regular(path)
        except FileNotFoundError:
            return None
        except BadFile as e:  # a FIFO, device, symlink or directory: moved aside unopened
            self.quarantine.move(path, str(e))
            return None
        except OSError as e:
            logger.warning("cannot open %s: %s", path, e)
            return None
        try:
            try:
                if size > MAX_MANIFEST_BYTES:
                    raise BadFile(f"{size} bytes, over the {MAX_MANIFEST_BYTES}-byte manifest cap")
                _FAULT and _FAULT("read")
                m = decode_manifest(bytes(read_exact(fd, size)))
                if path.name != manifest_name(m.namespace):
                    raise BadFile(f"file name does not match its namespace {m.namespace[:64]!r}")
                if namespace is not None and m.namespace != namespace:
                    raise BadFile("namespace mismatch")
            except OSError as e:  # the device failed, not the bytes: skipped this time, kept
                logger.warning("cannot read %s: %s", path, e)
                with self._lock:
                    self._counts["read_errors"] += 1
                return None
            except Exception as e:  # untrusted bytes: whatever the parser did not foresee is a bad file
                self.quarantine.move(path, _reason(e), fd)
                return None
        finally:
            os.close(fd)
        with self._lock:
            self._counts["manifest_reads"] += 1
        return m, size

    def delete_manifest(self, namespace: str) -> None:
        path = self.manifest_path(namespace)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        try:
            fsync_dir(path.parent)
        except OSError:
            pass

    def list_manifests(self) -> list[Manifest]:
        """Every valid manifest; bad ones are quarantined and skipped."""
        return [m for m, _ in self.list_sized_manifests()]

    def list_sized_manifests(self) -> list[tuple[Manifest, int]]:
        """Every valid manifest with its file's size (the disk budget counts it as read, not as
        encoded again); bad ones are quarantined and skipped."""
        out = []
        try:
            entries = sorted(e.name for e in os.scandir(self.agents_dir))
        except FileNotFoundError:
            return out
        for name in entries:
            if name.endswith(".json"):
                got = self._read_sized_manifest(self.agents_dir / name, None)
                if got is not None:
                    out.append(got)
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
        clean_tmp(self.tmp_dir, STALE_TMP_S)
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
                fsync_dir(d)
            except OSError:
                pass



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


def _reason(e: Exception) -> str:
    """Quarantine reason for an exception raised while checking a file."""
    if isinstance(e, (BadFile, FormatError, OSError)):
        return str(e) or type(e).__name__
    return f"{type(e).__name__}: {e}"[:300]


def _check_block_size(fd: int, size: int, cap: int) -> None:
    """Check a block file's size against the cap and against the size its header describes,
    reading only the header: an oversized or padded file is refused before its data is read."""
    if size > cap:
        raise BadFile(f"{size} bytes, over the {cap}-byte block cap")
    hlen = header_length(read_exact(fd, min(size, 8)), size)
    described = described_size(hlen, read_exact(fd, hlen, 8))
    if described != size:
        raise BadFile(f"the header describes a {described}-byte file, the file has {size} bytes")
