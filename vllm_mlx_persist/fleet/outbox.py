"""The fleet's pending removals on the local disk: an erasure acknowledged to a client is durable here
before the acknowledgement, and stays until its tombstone is in Redis, so a server killed (-9) before
the writer reached Redis queues it again when it starts (docs/fleet.md, "The merge rules").

One small JSON file per agent (`<sha256(agent)[:32]>.json`: {"agent", "era"}: the erasure's tombstone
id, chosen before it is queued, so a retry after a restart writes the same tombstone), written
atomically (temporary file, fsync, rename, directory fsync). Bounded by the tier's `max_erasures`
(the writer refuses more erasures pending at once). A file that does not parse is set aside, logged.
Any thread; its own lock is never held across I/O of another file than the one it writes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Optional

from ..disk_format import check_era
from ..files import fsync, fsync_dir

log = logging.getLogger("vllm_mlx_persist.fleet")

OUTBOX_DIR = "fleet-outbox"


class Outbox:
    """Pending erasures of one model directory's agents (see the module docstring)."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock = threading.Lock()  # orders add/done of one agent; I/O of one file at a time

    def _path(self, namespace: str) -> Path:
        return self.dir / (hashlib.sha256(namespace.encode()).hexdigest()[:32] + ".json")

    def add(self, namespace: str, era: str) -> None:
        """Durably record that erasing `namespace` (tombstone id `era`) is pending; OSError if not."""
        check_era(era)
        path = self._path(namespace)
        tmp = path.with_suffix(".tmp")
        data = json.dumps({"agent": namespace, "era": era}, sort_keys=True).encode()
        with self._lock:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, data)
                fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            fsync_dir(self.dir)

    def done(self, namespace: str, era: str) -> None:
        """The tombstone `era` of `namespace` is in Redis: forget it (unless a later erasure replaced it)."""
        path = self._path(namespace)
        with self._lock:
            try:
                entry = _read(path)
            except ValueError:
                entry = None
            if entry is not None and entry[1] != era:
                return  # a later erasure of the agent is pending
            try:
                path.unlink()
            except FileNotFoundError:
                return
            fsync_dir(self.dir)

    def pending(self) -> list[tuple[str, str]]:
        """Every pending erasure: (agent, era)."""
        out = []
        for p in sorted(self.dir.glob("*.json")):
            try:
                entry = _read(p)
            except ValueError:
                log.error("fleet: a pending erasure in %s does not parse; set aside", p)
                try:
                    os.replace(p, p.with_suffix(".bad"))
                except OSError:
                    pass
                continue
            if entry is not None:
                out.append(entry)
        return out


def _read(path: Path) -> Optional[tuple[str, str]]:
    """(agent, era) of a pending erasure's file; None when absent; ValueError when it does not parse."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(str(e)) from None
    try:
        d = json.loads(raw)
        agent, era = d["agent"], d["era"]
        if not isinstance(agent, str) or not agent:
            raise ValueError("agent")
        check_era(era)
        return agent, era
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(str(e)) from None
