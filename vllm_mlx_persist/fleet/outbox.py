"""The fleet's pending removals and settings on the local disk: a removal or a setting acknowledged to
a client is durable here before the acknowledgement, and stays until it is in Redis, so a server killed
(-9) before the writer reached Redis sends it again when it starts, and a server that runs sends it
again until it is there (docs/fleet.md, "The merge rules").

Two kinds of entry, one small JSON file each, written atomically (temporary file, fsync, rename,
directory fsync):

- an erasure, `<sha256(agent)[:32]>-<sha256(era)[:16]>.json`: {"agent", "era": the erasure's tombstone
  id, chosen before it is queued, so a retry after a restart writes the same tombstone; "at"};
- a record's publish (a forget's or a setting's), `<sha256(agent)[:32]>-f<random 16 hex>.json`:
  {"kind": "forget", "agent", "mark": the newest removal or setting stamp of the record to publish
  (`publish_mark`), "at"}. What is sent is the agent's record on the local disk (which holds the
  removal or setting, and every later one), and the entry goes once a put of a record whose mark is
  at least its own is in Redis.

"at" is when it was recorded, ns, and only grows (whatever the clock does): start-up queues erasures
oldest first. A later entry of the same agent removes the earlier ones it supersedes once its own is
durable (an erasure supersedes every earlier entry of the agent, a forget's publish the earlier
publishes); a kill in between leaves both. A file that does not parse is set aside, logged.

Bounded: `bound` entries pending (the tier's `max_erasures`), counted in memory (a file that could not
be removed still counts); the callers refuse a new removal or setting at the bound (`full`: HTTP 503)
rather than acknowledge one that may not reach Redis. Removals admitted below the bound whose saves
come after it filled (concurrent requests) still land, so an acknowledged removal stays durable; the
hard cap is twice the bound, where `add_forget` refuses a new agent's entry (`OutboxFull`).

Any thread, no lock across I/O: an entry is its own file, so concurrent adds and dones touch different
files; a small lock guards the times and the count (no I/O under it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..disk_format import Manifest, check_era
from ..files import fsync, fsync_dir

log = logging.getLogger("vllm_mlx_persist.fleet")

OUTBOX_DIR = "fleet-outbox"

# Seams (tests wrap them to check the order of a write's steps, or step the clock).
_fsync = fsync
_fsync_dir = fsync_dir
_replace = os.replace
_clock_ns = time.time_ns


def _digest(text: str, n: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def removal_mark(m: Manifest) -> float:
    """The newest removal a record holds: its newest removal record's stamp, its `spliced_cleared`
    and its `removed_floor` (0.0: none). A put of a record whose mark is at least an entry's carries
    that entry's removal (or a floor that stands for it)."""
    return max([float(r["at"]) for r in m.removals or ()] + [float(m.spliced_cleared or 0.0),
                                                            float(m.removed_floor or 0.0)])


def publish_mark(m: Manifest) -> float:
    """What a record's publish entry waits for: the newest of its removals (`removal_mark`) and of its
    settings' stamps (`settings_at`); 0.0: neither."""
    return max([removal_mark(m)] + [float(t) for t in (m.settings_at or {}).values()])


HARD_CAP = 2  # x bound: room for the saves of removals admitted (503 at the bound) before it filled


class OutboxFull(OSError):
    """A new entry refused at the outbox's bound."""


@dataclass(frozen=True)
class Entry:
    """A pending removal: an erasure (`era` set) or a forget's publish (`mark` set)."""

    agent: str
    at: int
    era: str = ""
    mark: float = 0.0

    @property
    def forget(self) -> bool:
        return not self.era


class Outbox:
    """Pending removals of one model directory's agents (see the module docstring)."""

    def __init__(self, directory: Path, bound: int = 10_000):
        self.dir = Path(directory)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.bound = bound
        self._lock = threading.Lock()  # guards _last_at and _files only (no I/O under it)
        # Every entry's file name -> its entry: the count the bound applies to, and an agent's
        # entries found without listing the directory.
        self._files: dict[str, Entry] = {}
        self._last_at = 0
        self.entries()  # read (and names of before renamed) once
        # Times only increase, even if the clock steps back: the newest entry sorts last.
        self._last_at = max((e.at for e in self._files.values()), default=0)

    def _now(self) -> int:
        with self._lock:
            self._last_at = max(_clock_ns(), self._last_at + 1)
            return self._last_at

    def _path(self, namespace: str, era: str) -> Path:
        return self.dir / f"{_digest(namespace, 32)}-{_digest(era, 16)}.json"

    def __len__(self) -> int:
        with self._lock:
            return len(self._files)

    def _of(self, namespace: str) -> list[tuple[str, Entry]]:
        with self._lock:
            return [(n, e) for n, e in self._files.items() if e.agent == namespace]

    def full(self) -> bool:
        """Whether `bound` removals are pending: a new one is refused (no I/O)."""
        return len(self) >= self.bound

    # ---- recording (before the acknowledgement) ------------------------------------------------------

    def add(self, namespace: str, era: str) -> None:
        """Durably record that erasing `namespace` (tombstone id `era`) is pending; OSError if not."""
        check_era(era)
        at = self._now()
        path = self._path(namespace, era)
        self._write(path, {"agent": namespace, "era": era, "at": at}, Entry(namespace, at, era=era))
        self._drop_older(namespace, path, at, forgets_only=False)  # it supersedes every earlier entry

    def add_forget(self, namespace: str, mark: float) -> None:
        """Durably record that the agent's record, holding removals and settings up to `mark`, must
        reach Redis; OSError if not (OutboxFull at twice the bound, unless it supersedes a pending one
        of the agent's: admission refuses at the bound, saves admitted before it filled still land)."""
        if not isinstance(namespace, str) or not namespace:
            raise ValueError("agent")
        if len(self) >= HARD_CAP * self.bound and not any(e.forget for _, e in self._of(namespace)):
            raise OutboxFull(f"{len(self)} entries pending (bound {self.bound})")
        at = self._now()
        path = self.dir / f"{_digest(namespace, 32)}-f{secrets.token_hex(8)}.json"
        self._write(path, {"kind": "forget", "agent": namespace, "mark": float(mark), "at": at},
                    Entry(namespace, at, mark=float(mark)))
        self._drop_older(namespace, path, at, forgets_only=True)

    def _write(self, path: Path, value: dict, entry: Entry) -> None:
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, json.dumps(value, sort_keys=True).encode())
            _fsync(fd)
        finally:
            os.close(fd)
        _replace(tmp, path)
        _fsync_dir(self.dir)
        with self._lock:
            self._files[path.name] = entry

    def _drop_older(self, namespace: str, path: Path, at: int, forgets_only: bool,
                    erasures_only: bool = False) -> bool:
        """After the entry at `path` is durable: the agent's earlier entries it supersedes go; whether
        all of them went."""
        gone = True
        for name, entry in self._of(namespace):
            if name != path.name and entry.at < at and (entry.forget or not forgets_only) \
                    and not (erasures_only and entry.forget):
                gone = self._unlink(self.dir / name) and gone
        return gone

    # ---- letting go (once in Redis) ----------------------------------------------------------------

    def done(self, namespace: str, era: str) -> None:
        """The tombstone `era` of `namespace` is in Redis: forget it, and first any older erasure of the
        agent still on disk (its removal failed earlier). If one of those stays, this one stays too, so
        the older is never the agent's newest, never sent again (done again at a later drain); a later
        erasure's file stays."""
        path = self._path(namespace, era)
        with self._lock:
            this = self._files.get(path.name)
        if this is not None and not self._drop_older(namespace, path, this.at, forgets_only=False,
                                                     erasures_only=True):
            return
        self._unlink(path)

    def forget_done(self, namespace: str, mark: float) -> None:
        """A put of the agent's record holding removals up to `mark` is in Redis (or the agent was
        erased meanwhile): its forgets' publishes up to `mark` are done."""
        for name, entry in self._of(namespace):
            if entry.forget and entry.mark <= mark:
                self._unlink(self.dir / name)

    def _unlink(self, path: Path) -> bool:
        """Remove an entry's file; one that stays (an OSError) stays counted, and is retried later.
        Whether it is gone."""
        try:
            path.unlink()
        except FileNotFoundError:
            with self._lock:
                self._files.pop(path.name, None)
            return True
        except OSError as e:
            log.error("fleet: a pending entry %s could not be removed (%s); kept pending", path, e)
            return False
        with self._lock:
            self._files.pop(path.name, None)
        _fsync_dir(path.parent)
        return True

    # ---- reading --------------------------------------------------------------------------------------

    def entries(self) -> list[Entry]:
        """Every pending entry, oldest first, read from the directory."""
        out = []
        for p in self.dir.glob("*.json"):
            try:
                entry = _read(p)
            except ValueError:
                log.error("fleet: a pending removal in %s does not parse; set aside", p)
                try:
                    os.replace(p, p.with_suffix(".bad"))
                except OSError:
                    pass
                with self._lock:
                    self._files.pop(p.name, None)
                continue
            if entry is None:
                continue
            if not entry.forget:
                named = self._path(entry.agent, entry.era)
                if p != named:  # one agent's single file of before (`<sha256(agent)[:32]>.json`): renamed
                    try:
                        os.replace(p, named)
                        p = named
                    except OSError:
                        pass
            with self._lock:
                self._files[p.name] = entry
            out.append(entry)
        return sorted(out, key=lambda e: e.at)

    def pending(self) -> list[tuple[str, str]]:
        """Each agent's newest pending erasure, oldest first: (agent, era). An older one still on disk
        (a kill between a newer erasure's write and its removal, or a removal that failed) is
        superseded: sent again it would end what was written after the newer one."""
        return _newest_erasures(self.entries())

    def erasures(self) -> list[tuple[str, str]]:
        """Each agent's newest pending erasure, oldest first: (agent, era) (no I/O; see `pending`)."""
        with self._lock:
            entries = list(self._files.values())
        return _newest_erasures(entries)

    def forgets(self) -> dict[str, float]:
        """The agents whose forget's publish is pending: agent -> the highest mark pending (no I/O)."""
        out: dict[str, float] = {}
        with self._lock:
            entries = list(self._files.values())
        for e in entries:
            if e.forget:
                out[e.agent] = max(out.get(e.agent, 0.0), e.mark)
        return out


def _newest_erasures(entries: list[Entry]) -> list[tuple[str, str]]:
    """Each agent's newest erasure among `entries`, oldest first: (agent, era)."""
    newest: dict[str, Entry] = {}
    for e in entries:
        if not e.forget and (e.agent not in newest or e.at > newest[e.agent].at):
            newest[e.agent] = e
    return [(e.agent, e.era) for e in sorted(newest.values(), key=lambda e: e.at)]


def _read(path: Path) -> Optional[Entry]:
    """A pending removal's file; None when absent; ValueError when it does not parse."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(str(e)) from None
    try:
        d: Any = json.loads(raw)
        agent, at = d["agent"], d.get("at", 0)  # files of before "at" sort first
        if not isinstance(agent, str) or not agent or not isinstance(at, int) or isinstance(at, bool):
            raise ValueError("agent")
        if d.get("kind") == "forget":
            mark = d["mark"]
            if isinstance(mark, bool) or not isinstance(mark, (int, float)):
                raise ValueError("mark")
            return Entry(agent, at, mark=float(mark))
        era = d["era"]
        check_era(era)
        return Entry(agent, at, era=era)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(str(e)) from None
