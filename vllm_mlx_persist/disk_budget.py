"""The disk budget and the TTL: what leaves the disk when the cache root uses more than `disk_budget`
bytes (quarantined files counted), or when an agent has not been used for `ttl_s`. Runs on the
persister thread only (after every save, at start-up's scan, and every SWEEP_INTERVAL_S), reading
the persister's index under its lock, and erasing through the persister."""

from __future__ import annotations

import logging
import shutil
import threading
import time
from typing import Callable, Optional

from .disk_index import DiskIndex
from .store import DiskStore

log = logging.getLogger("vllm_mlx_persist.persister")

SWEEP_INTERVAL_S = 60.0  # how often an idle persister checks the TTL


class DiskBudget:
    """`enforce()`: erase until the disk fits; `sweep()`: the TTL, then the budget. `erase(namespace,
    why)`: the persister's erasure (manifest first, then the blocks only it named); `counts`: the
    persister's counters."""

    def __init__(self, store: DiskStore, index: DiskIndex, lock: threading.Condition, counts: dict,
                 erase: Callable[[str, str], bool], clock: Callable[[], float], disk_budget: int,
                 ttl_s: Optional[float]):
        self.store, self.index, self._cv, self.counts, self._erase = store, index, lock, counts, erase
        self.clock = clock
        self.disk_budget = disk_budget
        self.ttl_s = ttl_s
        self._blocked_logged = False
        self.last_sweep = time.time()

    def due(self) -> bool:
        """Whether the next sweep is due (the persister thread's idle loop)."""
        return time.time() - self.last_sweep >= SWEEP_INTERVAL_S

    def enforce(self) -> None:
        """Erase until the disk fits the budget: quarantined files first, then other models'
        directories, then the least recently used agents, never one that is pinned, has a request in
        flight or a save queued (when only those are left, the disk stays over budget: counted as
        `budget_blocked` and logged once)."""
        index = self.index
        while True:
            with self._cv:
                if index.disk_bytes(self.store.quarantine.bytes) <= self.disk_budget:
                    self._blocked_logged = False
                    return
                quarantined = self.store.quarantine.bytes > 0
                path = victim = None
                if not quarantined and index.other_dirs:
                    path, size, _ = index.other_dirs.pop(0)
                elif not quarantined:
                    victim = index.budget_victim()
                    if victim is None:
                        self.counts["budget_blocked"] += 1
                        if not self._blocked_logged:
                            self._blocked_logged = True
                            log.warning("disk budget: %d bytes used of %d, and every agent left is pinned or in "
                                        "use; pinned agents are never erased",
                                        index.disk_bytes(self.store.quarantine.bytes), self.disk_budget)
                        return
            if quarantined:
                self.counts["quarantine_removed"] += self.store.quarantine.clear()
            elif path is not None:
                with self._cv:
                    index.other_bytes -= size
                shutil.rmtree(path, ignore_errors=True)
                self.counts["other_dirs_removed"] += 1
                log.info("disk budget: removed another model's cache directory %s", path)
            else:
                self.counts["budget_erasures"] += 1
                self._erase(victim, "disk budget")

    def sweep(self) -> None:
        """Erase agents unused for longer than the TTL (pinned and in-use agents excepted)."""
        self.last_sweep = time.time()
        if self.ttl_s is not None:
            cutoff = self.clock() - self.ttl_s
            with self._cv:
                expired = self.index.expired(cutoff)
            for ns in expired:
                self.counts["ttl_erasures"] += 1
                self._erase(ns, "ttl")
        self.enforce()
