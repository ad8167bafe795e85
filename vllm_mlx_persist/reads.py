"""Block reads off the worker thread: read-ahead for arriving requests, and the hot-set restore.

Owns the reader threads, the restore thread and the reads waiting for their lookup, bounded in bytes:
- read-ahead (`start`: a request arrived, or a lookup reads ahead of its walk) holds at most
  `budget` bytes of results nobody has taken yet, each for at most PREFETCH_TTL_S;
- the restore (`restore`: after a restart, the most recently used agents' blocks) holds what fits
  `room()`, the hot tier's free bytes, and reads only while `idle()` says no request is served.
Results are numpy (disk_format.BlockData); nothing here touches MLX or the pool's state.
Threads: every method from any thread; one small lock of its own, never held across I/O or a wait.
Lock order: the pool's lock, then this one (never the other way).
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional, Sequence

from .disk_format import BlockData
from .store import DiskStore

PREFETCH_TTL_S = 60.0  # read-ahead results nobody took (a rejected request) expire
RESTORE_IDLE_S = 0.2  # the restore reads only when no request is served and none came this recently
# Block reads (open, read, crc32: all release the GIL) run in parallel on this many threads.
READER_THREADS = max(2, min(4, os.cpu_count() or 2))


class Reads:
    """Reads of block files ahead of their use, bounded in bytes (see the module docstring)."""

    def __init__(self, store: DiskStore, budget: int, size_of: Callable[[str], int], stats: dict):
        self.store = store
        self.stats = stats  # the pool's counters: blocks_prefetched, blocks_restored, read_ahead_over_budget
        self.budget = budget  # bytes of read-ahead results waiting to be taken, at most
        self.size_of = size_of  # a block's file size, or an estimate (no I/O: called under locks)
        self._lock = threading.Lock()
        self._ahead: "OrderedDict[str, tuple[Future, float, int]]" = OrderedDict()  # id -> (read, t, bytes)
        self._ahead_bytes = 0
        self._restored: "OrderedDict[str, tuple[Future, int]]" = OrderedDict()  # most recent agent first
        self.restored_bytes = 0
        self._readers = ThreadPoolExecutor(READER_THREADS, thread_name_prefix="vllm-mlx-persist-reader")
        self._restorer = ThreadPoolExecutor(1, thread_name_prefix="vllm-mlx-persist-restore")
        self._restore_stop = threading.Event()
        self.last_arrival = 0.0  # monotonic time of the last request's read-ahead
        for key in ("blocks_prefetched", "blocks_restored", "read_ahead_over_budget"):
            stats.setdefault(key, 0)

    # ---- read-ahead -----------------------------------------------------------------------------

    def start(self, block_ids: Sequence[str], arrival: bool = False) -> int:
        """Start reading these blocks (not already being read) within the byte budget; returns how
        many were started. `arrival`: a request's read-ahead (the restore then pauses)."""
        now = time.monotonic()
        started = 0
        with self._lock:
            if arrival:
                self.last_arrival = now
            self._expire(now)
            for bid in block_ids:
                if bid in self._ahead or bid in self._restored:
                    continue
                size = self.size_of(bid)
                if self._ahead and self._ahead_bytes + size > self.budget:
                    self.stats["read_ahead_over_budget"] += 1
                    break
                try:
                    future = self._readers.submit(self.store.read_block, bid)
                except RuntimeError:  # closing
                    break
                self._ahead[bid] = (future, now, size)
                self._ahead_bytes += size
                started += 1
        return started

    def take(self, bid: str) -> tuple[Future, str]:
        """The read of `bid`: a pending one (read-ahead or restore), else one started now (not
        counted in the budget: its caller consumes it at once). Returns (future, where from:
        "prefetched", "restored" or "read")."""
        with self._lock:
            entry = self._ahead.pop(bid, None)
            if entry is not None:
                self._ahead_bytes -= entry[2]
                self.stats["blocks_prefetched"] += 1
                return entry[0], "prefetched"
            restored = self._restored.pop(bid, None)
            if restored is not None:
                self.restored_bytes -= restored[1]
                self.stats["blocks_restored"] += 1
                return restored[0], "restored"
        try:
            return self._readers.submit(self.store.read_block, bid), "read"
        except RuntimeError:  # closing: a miss
            f: Future = Future()
            f.set_result(None)
            return f, "read"

    def pending(self, block_ids: Sequence[str]) -> list[Future]:
        """The reads of these blocks still running."""
        out = []
        with self._lock:
            for bid in block_ids:
                entry = self._ahead.get(bid) or self._restored.get(bid)
                if entry is not None and not entry[0].done():
                    out.append(entry[0])
        return out

    def has(self, bid: str) -> bool:
        with self._lock:
            return bid in self._ahead or bid in self._restored

    def cancel(self, block_ids: Sequence[str], restored: bool = True) -> None:
        """Drop the pending reads of these blocks (their agent is gone, or its lookup did not need
        them); `restored=False`: read-ahead only."""
        with self._lock:
            for bid in block_ids:
                entry = self._ahead.pop(bid, None)
                if entry is not None:
                    self._ahead_bytes -= entry[2]
                    entry[0].cancel()
                if not restored:
                    continue
                restored_entry = self._restored.pop(bid, None)
                if restored_entry is not None:
                    self.restored_bytes -= restored_entry[1]
                    restored_entry[0].cancel()

    def _expire(self, now: float) -> None:
        cutoff = now - PREFETCH_TTL_S
        while self._ahead:
            bid, (future, t, size) = next(iter(self._ahead.items()))
            if t > cutoff:
                break
            future.cancel()
            del self._ahead[bid]
            self._ahead_bytes -= size

    def expire(self) -> None:
        with self._lock:
            self._expire(time.monotonic())

    # ---- hot-set restore --------------------------------------------------------------------------

    def restore(self, plan: list[str], room: Callable[[], int], idle: Callable[[], bool],
                wanted: Callable[[str], bool]) -> Optional[Future]:
        """Read `plan`'s blocks one by one on the restore thread while their sizes fit `room()`
        (free bytes of the hot tier, restored ones counted), each once `idle()` and if still
        `wanted` (cold); a second call stops the first. Returns the restore's future (None when
        closing). The callables must not take the pool's lock (lock order)."""
        with self._lock:
            self._restore_stop.set()
            self._restore_stop = stop = threading.Event()
        try:
            return self._restorer.submit(self._restore, plan, room, idle, wanted, stop)
        except RuntimeError:
            return None

    def _restore(self, plan: list[str], room: Callable[[], int], idle: Callable[[], bool],
                 wanted: Callable[[str], bool], stop: threading.Event) -> None:
        for bid in plan:
            size = self.store.block_file_size(bid)
            while not (idle() and time.monotonic() - self.last_arrival >= RESTORE_IDLE_S):
                if stop.wait(RESTORE_IDLE_S / 4):
                    return
            with self._lock:
                if stop.is_set():
                    return
                if size == 0 or bid in self._restored or bid in self._ahead or not wanted(bid):
                    continue
                if size > room():
                    return
                future: Future = Future()
                future.set_running_or_notify_cancel()  # started: a lookup now waits for it, never repeats it
                self._restored[bid] = (future, size)
                self.restored_bytes += size
            try:
                future.set_result(self.store.read_block(bid))
            except BaseException as e:  # read_block returns None for a bad file; this is a bug or a dying thread
                future.set_exception(e)

    def shrink_restored(self, over: int) -> None:
        """Drop restored-but-untaken blocks, least recent agent first, until `over` bytes are freed."""
        with self._lock:
            while self._restored and over > 0:
                bid, (future, size) = self._restored.popitem(last=True)
                future.cancel()
                self.restored_bytes -= size
                over -= size

    def restored_ids(self) -> list[str]:
        with self._lock:
            return list(self._restored)

    # ---- lifecycle --------------------------------------------------------------------------------

    def clear(self) -> None:
        """Drop every pending read and stop the restore."""
        with self._lock:
            self._restore_stop.set()
            for future, _, _ in self._ahead.values():
                future.cancel()
            for future, _ in self._restored.values():
                future.cancel()
            self._ahead.clear()
            self._restored.clear()
            self._ahead_bytes = self.restored_bytes = 0

    def close(self) -> None:
        self.clear()
        self._readers.shutdown(wait=False, cancel_futures=True)
        self._restorer.shutdown(wait=False, cancel_futures=True)

    def snapshot(self) -> dict:
        with self._lock:
            return {"prefetch_pending": len(self._ahead), "prefetch_bytes": self._ahead_bytes,
                    "prefetch_budget_bytes": self.budget, "restored_pending": len(self._restored),
                    "restored_bytes": self.restored_bytes}


def read_result(future: Future, timeout: float) -> tuple[Optional[BlockData], Optional[str]]:
    """(data, None) from a read; (None, why) for a read that timed out, failed or found a bad file."""
    from concurrent.futures import TimeoutError as FutureTimeout

    try:
        data = future.result(timeout)
    except FutureTimeout:
        return None, "timeout"
    except Exception as e:  # CancelledError, a reader that died: a miss
        return None, f"{type(e).__name__}: {e}"
    return (data, None) if data is not None else (None, "bad file")
