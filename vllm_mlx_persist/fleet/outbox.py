"""The fleet's pending removals on the local disk: an erasure acknowledged to a client is durable here
before the acknowledgement, and stays until its tombstone is in Redis, so a server killed (-9) before
the writer reached Redis queues it again when it starts (docs/fleet.md, "The merge rules").

One small JSON file per pending erasure, `<sha256(agent)[:32]>-<sha256(era)[:16]>.json`: {"agent",
"era": the erasure's tombstone id, chosen before it is queued, so a retry after a restart writes the
same tombstone; "at": when it was recorded, ns}, written atomically (temporary file, fsync, rename,
directory fsync). A later erasure of the same agent removes the earlier ones' files once its own is
durable (as its tombstone supersedes theirs); a kill in between leaves both, queued again oldest first.
Bounded by the tier's `max_erasures` (the writer refuses more erasures pending at once). A file that
does not parse is set aside, logged.

Any thread, no lock across I/O: an erasure is its own file, so concurrent adds and dones touch different
files (of one agent's, an add removes only older ones); a small lock orders the times ("at" only grows,
whatever the clock does).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Optional

from ..disk_format import check_era
from ..files import fsync, fsync_dir

log = logging.getLogger("vllm_mlx_persist.fleet")

OUTBOX_DIR = "fleet-outbox"


def _digest(text: str, n: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


class Outbox:
    """Pending erasures of one model directory's agents (see the module docstring)."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Times only increase, even if the clock steps back: the newest erasure sorts last.
        self._last_at = max((e[2] for e in map(_read_quietly, self.dir.glob("*.json")) if e), default=0)
        self._at_lock = threading.Lock()  # guards _last_at only (no I/O under it)

    def _now(self) -> int:
        with self._at_lock:
            self._last_at = max(time.time_ns(), self._last_at + 1)
            return self._last_at

    def _path(self, namespace: str, era: str) -> Path:
        return self.dir / f"{_digest(namespace, 32)}-{_digest(era, 16)}.json"

    def add(self, namespace: str, era: str) -> None:
        """Durably record that erasing `namespace` (tombstone id `era`) is pending; OSError if not."""
        check_era(era)
        path = self._path(namespace, era)
        at = self._now()
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, json.dumps({"agent": namespace, "era": era, "at": at}, sort_keys=True).encode())
            fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(self.dir)
        for other in self.dir.glob(f"{_digest(namespace, 32)}-*.json"):  # the erasures this one supersedes
            try:
                entry = _read(other)
            except ValueError:
                continue  # pending() sets it aside
            if other != path and entry is not None and entry[2] < at:
                _unlink(other)

    def done(self, namespace: str, era: str) -> None:
        """The tombstone `era` of `namespace` is in Redis: forget it (a later erasure's file stays)."""
        _unlink(self._path(namespace, era))

    def pending(self) -> list[tuple[str, str]]:
        """Every pending erasure, oldest first: (agent, era)."""
        out = []
        for p in self.dir.glob("*.json"):
            try:
                entry = _read(p)
            except ValueError:
                log.error("fleet: a pending erasure in %s does not parse; set aside", p)
                try:
                    os.replace(p, p.with_suffix(".bad"))
                except OSError:
                    pass
                continue
            if entry is None:
                continue
            named = self._path(entry[0], entry[1])
            if p != named:  # one agent's single file of before (`<sha256(agent)[:32]>.json`): renamed
                try:
                    os.replace(p, named)
                except OSError:
                    pass
            out.append(entry)
        return [(agent, era) for agent, era, _ in sorted(out, key=lambda e: e[2])]


def _read_quietly(path: Path) -> Optional[tuple[str, str, int]]:
    try:
        return _read(path)
    except ValueError:
        return None


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        return
    fsync_dir(path.parent)


def _read(path: Path) -> Optional[tuple[str, str, int]]:
    """(agent, era, at) of a pending erasure's file; None when absent; ValueError when it does not parse."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(str(e)) from None
    try:
        d = json.loads(raw)
        agent, era, at = d["agent"], d["era"], d.get("at", 0)  # files of before "at" sort first
        if not isinstance(agent, str) or not agent or not isinstance(at, int):
            raise ValueError("agent")
        check_era(era)
        return agent, era, at
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(str(e)) from None
