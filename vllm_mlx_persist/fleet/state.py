"""What the parts of one RemoteTier share: one lock (the writer's queue waits on it as a condition),
the counters, the largest block value seen, whether the tier is stopped, and refusals logged once.
Any thread; the lock is held for bookkeeping only, never across I/O. One lock for the counters, the
agents' states (eras.py) and the write queue (writer.py), so that what one part decides under it
(a put queued, an erasure met) is ordered with what the others do."""

from __future__ import annotations

import logging
import threading
from typing import Any

logger = logging.getLogger("vllm_mlx_persist.fleet")

COUNTERS = ("puts", "puts_published", "puts_merged", "puts_same", "puts_kept_other", "puts_erased", "puts_stale",
            "puts_outdated", "puts_incomplete", "put_failures", "dropped", "blocks_uploaded", "blocks_present",
            "bytes_up", "gets", "fetch_round_trips", "hits", "misses", "refused", "refused_mac", "foreign",
            "puts_foreign", "bytes_down", "manifest_gets", "manifest_hits", "erases", "erases_done", "errors",
            "timeouts", "skipped", "blocks_deleted")


class TierState:
    def __init__(self) -> None:
        self.lock = threading.Lock()  # counters, agent states, the write queue
        self.cond = threading.Condition(self.lock)
        self.c = dict.fromkeys(COUNTERS, 0)
        self.block_size_seen = 0  # the largest block value read or written: sizes fetch round trips
        self.stop = False  # close() has stopped the tier: no more reads or writes
        self._warned: set[str] = set()  # kinds of refusal already logged at WARNING

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.c[name] += n

    def warn_once(self, kind: str, msg: str, *args: Any) -> None:
        """Log at WARNING the first time, then at DEBUG: a planted or foreign value must not be able
        to flood the log."""
        with self.lock:
            first = kind not in self._warned
            self._warned.add(kind)
        (logger.warning if first else logger.debug)(msg, *args)
