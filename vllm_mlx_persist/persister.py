"""The one writer of the disk tier: saves, erasures and the disk budget, in order, on one thread.

The pool hands it numpy copies of a turn's new blocks and the agent's manifest; it writes the blocks,
then the manifest (so a manifest only ever names durable blocks), retries failed saves in the
background with back-off, and erases least recently used agents when the disk budget or the TTL says
so. Its queue is bounded in bytes and never makes the caller wait: a save that finds it full is
dropped and counted (the pool keeps the blocks unsaved in memory; the agent's next save writes them).
Disk usage, quarantined files included, is counted as files come and go, so `stats()` never walks
the disk.

Owns the disk index (agents, block sizes, references from manifests on disk and from saves still
queued), the job queue and its thread. A block named by a queued save's manifest, and an agent with a
save queued or a request in flight, are never erased by the budget or the TTL; pinned agents never.
Threads: `save`, `erase`, `set_pinned`, `touch`, `begin_use`/`end_use` and `stats` may be called from
any thread (its lock is held for bookkeeping only); the jobs run on the persister thread, which only
sees numpy arrays, bytes and files, and calls `on_erased` and a save's `on_durable` without its lock.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import shutil
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional

from .disk_format import BlockData, Manifest
from .store import DiskStore

log = logging.getLogger("vllm_mlx_persist.persister")

RETRY_DELAYS_S = (1.0, 5.0, 30.0)  # a failed save is retried this many times, after these delays
MAX_RETRYING = 8  # failed saves kept for retry at once (each holds its blocks' bytes)
SWEEP_INTERVAL_S = 60.0  # how often an idle persister checks the TTL


@dataclass
class DiskAgent:
    """What the disk holds for one agent: enough to pick budget victims without reading files."""

    block_ids: list[str]
    last_used: float
    pinned: bool = False
    n_tokens: int = 0


@dataclass(order=True)
class _Job:
    due: float
    seq: int
    run: Callable[["_Job"], None] = field(compare=False)
    future: Future = field(compare=False, default_factory=Future)
    nbytes: int = field(compare=False, default=0)
    attempts: int = field(compare=False, default=0)
    args: tuple = field(compare=False, default=())
    finished: bool = field(compare=False, default=False)
    order: int = field(compare=False, default=0)  # submission order (seq changes when it is retried)


class Persister:
    """Bounded, ordered, retrying writer with a disk budget, TTL and O(1) usage counters."""

    def __init__(
        self,
        store: DiskStore,
        *,
        disk_budget: int,
        ttl_s: Optional[float] = None,
        queue_bytes: int = 256 << 20,
        on_erased: Optional[Callable[[str], None]] = None,
        retry_delays: tuple[float, ...] = RETRY_DELAYS_S,
        clock: Callable[[], float] = time.time,
    ):
        self.store = store
        self.disk_budget = disk_budget
        self.ttl_s = ttl_s
        self.queue_bytes = queue_bytes
        self.retry_delays = retry_delays
        self.clock = clock  # wall-clock time of last uses and of the TTL (a test may move it on)
        self.on_erased = on_erased or (lambda namespace: None)
        self.agents: "OrderedDict[str, DiskAgent]" = OrderedDict()  # least recently used first
        self.block_sizes: dict[str, int] = {}
        self._block_bytes = 0  # sum of block_sizes, kept as it changes
        self.block_refs: dict[str, int] = {}  # how many manifests on disk name each block
        self._saved_order: dict[str, int] = {}  # per agent: submission order of its manifest on disk
        self._manifest_bytes = 0  # estimated: manifests are small and rewritten every turn
        self._other_dirs: list = []  # other models' directories under the root, oldest first
        self._other_bytes = 0
        self._live: dict[str, int] = {}  # agents with requests in flight: never erased by the budget
        # What queued (or retrying) saves will name once written: never erased meanwhile.
        self._queued_agents: dict[str, int] = {}
        self._queued_refs: dict[str, int] = {}
        self._fresh: dict[str, int] = {}  # blocks whose data a save not yet failed carries (see `saving`)
        self.counts = dict.fromkeys(
            ["saves", "save_failures", "saves_dropped", "retries", "blocks_written", "bytes_written",
             "agents_erased", "budget_erasures", "ttl_erasures", "other_dirs_removed", "saves_superseded",
             "quarantine_removed", "budget_blocked", "erased_elsewhere"], 0)
        self._blocked_logged = False
        self._cv = threading.Condition()
        self._ready: list[_Job] = []  # heap by (due, seq)
        self._pending_bytes = 0
        self._retrying = 0
        self._seq = itertools.count()
        self._closed = False
        self._idle = True
        self._last_sweep = time.time()
        self._thread = threading.Thread(target=self._loop, name="vllm-mlx-persist-writer", daemon=True)
        self._thread.start()

    # ---- start-up -------------------------------------------------------------------------------

    def load(self) -> list[Manifest]:
        """Read every manifest (small) and index it; block sizes, other models' directories and the
        budget follow on the persister thread, so start-up does not wait for a directory walk."""
        manifests = self.store.list_manifests()
        with self._cv:
            for m in sorted(manifests, key=lambda m: m.updated_at):
                self._index(m)
        self._submit(self._scan_job, 0)
        return manifests

    def _scan_job(self, job: _Job) -> None:
        sizes = self.store.block_file_sizes()
        with self._cv:
            live = set(self.block_refs)
            for b, n in sizes.items():
                if b in live:
                    self._set_size(b, n)
        removed = self.store.gc(live)  # unreferenced blocks (e.g. of a crashed turn) and stale temp files
        if removed:
            log.info("removed %d unreferenced block file(s)", removed)
        others = self.store.other_model_dirs()
        with self._cv:
            self._other_dirs, self._other_bytes = others, sum(d[1] for d in others)
        self._sweep()

    # ---- the caller's side ----------------------------------------------------------------------

    def save(self, manifest: Manifest, blocks: list[BlockData], dead: list[str],
             on_durable: Callable[[], None]) -> Future:
        """Queue a turn: `blocks` (new ones), then `manifest`, then delete `dead` blocks no manifest
        names any more. Never blocks: with the queue over its byte budget the turn is dropped and
        counted. The future is True once durable, False if the save failed (retries go on in the
        background; `on_durable` runs on the writer when one succeeds) or was dropped. Until it is
        settled for good, the agent and every block the manifest names are safe from the budget
        and the TTL."""
        nbytes = sum(a.nbytes for b in blocks for a in b.arrays.values())
        with self._cv:
            if self._closed or (self._pending_bytes and self._pending_bytes + nbytes > self.queue_bytes):
                self.counts["saves_dropped"] += 1
                f: Future = Future()
                f.set_result(False)
                return f
            self._hold(manifest, +1)
            self._freshen(blocks, +1)
            return self._submit(self._save_job, nbytes, (manifest, blocks, dead, on_durable))

    def _hold(self, manifest: Manifest, delta: int) -> None:
        """(lock held) Count (or release) a queued save's agent and the blocks its manifest names."""
        for d, key in ((self._queued_agents, manifest.namespace), *((self._queued_refs, b) for b in manifest.block_ids)):
            n = d.get(key, 0) + delta
            if n > 0:
                d[key] = n
            else:
                d.pop(key, None)

    def _freshen(self, blocks: list[BlockData], delta: int) -> None:
        """(lock held) Count (or release) the blocks a save carries while it has not failed."""
        for b in blocks:
            n = self._fresh.get(b.block_id, 0) + delta
            if n > 0:
                self._fresh[b.block_id] = n
            else:
                self._fresh.pop(b.block_id, None)

    def _named(self, bid: str) -> bool:
        """(lock held) Whether a manifest on disk or a queued save names the block."""
        return bid in self.block_refs or bid in self._queued_refs

    def erase(self, namespace: str) -> Future:
        """Erase an agent's manifest and the blocks only it names, in this model's directory and in
        every other model's under the root; True if it was on disk."""
        return self._submit(self._erase_job, 0, (namespace, "request"))

    def set_pinned(self, namespace: str, pinned: bool) -> Future:
        """Record the pin in the agent's manifest (durably); True if the agent is on disk."""
        return self._submit(self._pin_job, 0, (namespace, pinned))

    def quarantine_block(self, block_id: str, reason: str) -> Future:
        """Move a block file aside (after the writes queued before this call)."""
        def job(j: _Job) -> None:
            self.store.quarantine_block(block_id, reason)
            self._finish(j, True)

        return self._submit(job, 0)

    def touch(self, namespace: str) -> None:
        """The agent was used now (any thread)."""
        with self._cv:
            agent = self.agents.get(namespace)
            if agent is not None:
                agent.last_used = self.clock()
                self.agents.move_to_end(namespace)

    def begin_use(self, namespace: str) -> None:
        with self._cv:
            self._live[namespace] = self._live.get(namespace, 0) + 1

    def end_use(self, namespace: str) -> None:
        with self._cv:
            n = self._live.get(namespace, 0) - 1
            if n > 0:
                self._live[namespace] = n
            else:
                self._live.pop(namespace, None)

    def disk_agent(self, namespace: str) -> Optional[DiskAgent]:
        with self._cv:
            a = self.agents.get(namespace)
            return None if a is None else DiskAgent(list(a.block_ids), a.last_used, a.pinned, a.n_tokens)

    def saving(self, bid: str) -> bool:
        """Whether a queued save that has not failed carries the block's data: it is on its way to
        the disk (the pool keeps such a block in memory until it is durable). Any thread."""
        with self._cv:
            return bid in self._fresh

    def block_size_of(self, bid: str) -> int:
        """A block file's size from the index; for one not indexed (yet), the mean indexed size
        (64 KiB when none is). No I/O."""
        with self._cv:
            n = self.block_sizes.get(bid)
            if n is not None:
                return n
            return self._block_bytes // len(self.block_sizes) if self.block_sizes else 64 << 10

    def agent_disk_bytes(self, namespace: str) -> int:
        with self._cv:
            a = self.agents.get(namespace)
            return 0 if a is None else sum(self.block_sizes.get(b, 0) for b in a.block_ids)

    def stats(self) -> dict:
        """Counters only (no file system access); safe from any thread."""
        store_counts = self.store.counts()
        with self._cv:
            return {
                **self.counts,
                "disk_bytes": self._disk_bytes_locked(),
                "disk_budget_bytes": self.disk_budget,
                "disk_agents": len(self.agents),
                "disk_blocks": len(self.block_sizes),
                "write_queue_bytes": self._pending_bytes,
                "write_queue_jobs": len(self._ready),
                "saves_retrying": self._retrying,
                **{k: store_counts[k] for k in ("read_errors", "quarantined")},
            }

    def _disk_bytes_locked(self) -> int:
        return self._block_bytes + self._manifest_bytes + self._other_bytes + self.store.quarantine_bytes

    # ---- lifecycle ------------------------------------------------------------------------------

    def sweep(self) -> Future:
        """Check the TTL and the disk budget now (after the jobs queued before), not at the next
        minute's sweep."""
        def job(j: _Job) -> None:
            self._sweep()
            self._finish(j, True)

        return self._submit(job, 0)

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait for every job queued before this call (retries not included); False on time-out."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("flush() from the persister thread would deadlock")
        try:
            fut = self._submit(lambda job: self._finish(job, True), 0)
        except RuntimeError:
            return True
        try:
            fut.result(timeout)
            return True
        except Exception:
            return False

    def close(self, timeout: Optional[float] = 30.0) -> None:
        """Run what is queued (pending retries are given up), then stop the thread. Idempotent."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ---- the persister thread -------------------------------------------------------------------

    def _submit(self, run: Callable[[_Job], None], nbytes: int, args: tuple = ()) -> Future:
        with self._cv:
            if self._closed:
                raise RuntimeError("persister is closed")
            job = _Job(0.0, next(self._seq), run, Future(), nbytes, 0, args)
            job.order = job.seq
            self._pending_bytes += nbytes
            heapq.heappush(self._ready, job)
            self._cv.notify_all()
            return job.future

    def _loop(self) -> None:
        while True:
            job = None
            with self._cv:
                while job is None:
                    now = time.monotonic()
                    if self._ready and self._ready[0].due <= now:
                        job = heapq.heappop(self._ready)
                    elif self._closed:  # what was due has run; pending retries are given up
                        self._give_up_retries()
                        return
                    elif time.time() - self._last_sweep >= SWEEP_INTERVAL_S:
                        break
                    else:
                        due = self._ready[0].due - now if self._ready else SWEEP_INTERVAL_S
                        self._cv.wait(min(due, SWEEP_INTERVAL_S))
            if job is None:
                self._safe(self._sweep)
                continue
            try:
                job.run(job)
            except Exception as e:  # a job must never kill the thread
                log.exception("persister job failed")
                self._finish(job, error=e)

    def _safe(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            log.exception("persister housekeeping failed")

    def _give_up_retries(self) -> None:
        """(lock held) Drop the saves still waiting for a retry at close."""
        for job in self._ready:
            job.finished = True
            if job.run == self._save_job:
                self._hold(job.args[0], -1)
                if not job.attempts:
                    self._freshen(job.args[1], -1)
            if not job.future.done():
                job.future.set_result(False)
        self.counts["saves_dropped"] += len(self._ready)
        self._ready.clear()
        self._pending_bytes = self._retrying = 0

    def _finish(self, job: _Job, result=None, error: Optional[BaseException] = None) -> None:
        """The job leaves the queue for good: release its bytes and holds, settle its future (once)."""
        with self._cv:
            self._release(job)
        if not job.future.done():
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)

    def _release(self, job: _Job) -> bool:
        """(lock held) `_finish`'s bookkeeping; False when the job was finished already."""
        if job.finished:
            return False
        job.finished = True
        self._pending_bytes -= job.nbytes
        if job.attempts:
            self._retrying -= 1
        if job.run == self._save_job:
            self._hold(job.args[0], -1)
            if not job.attempts:
                self._freshen(job.args[1], -1)
        self._cv.notify_all()
        return True

    def _save_job(self, job: _Job) -> None:
        manifest, blocks, dead, on_durable = job.args
        with self._cv:
            # A retry that runs after a newer turn of the same agent was saved must not put the older
            # manifest back over it (that lost the newer, acknowledged turn at the next start).
            superseded = self._saved_order.get(manifest.namespace, -1) > job.order
        try:
            sizes = {}
            for b in blocks:  # a superseded turn's blocks still go: the newer manifest may name them
                written = self.store.write_block(b)
                sizes[b.block_id] = written or self.store.block_file_size(b.block_id)
                if written:
                    self.counts["blocks_written"] += 1
                    self.counts["bytes_written"] += written
            with self._cv:
                current = self.agents.get(manifest.namespace)
                if current is not None:
                    manifest.pinned = current.pinned
            if not superseded:
                self.store.write_manifest(manifest)
        except OSError as e:
            self.counts["save_failures"] += 1
            self._retry_or_drop(job, e)
            return
        if superseded:
            self.counts["saves_superseded"] += 1
            with self._cv:
                self._release(job)  # its own manifest no longer holds its blocks
                for bid, n in sizes.items():
                    if bid in self.block_refs:
                        self._set_size(bid, n)
                unnamed = [b for b in sizes if not self._named(b) and b not in self.block_sizes]
            for b in unnamed:
                self.store.delete_block(b)
            self._finish(job, False)
            return
        with self._cv:
            self._saved_order[manifest.namespace] = job.order
        on_durable()
        self.counts["saves"] += 1
        with self._cv:
            for bid, n in sizes.items():
                self._set_size(bid, n)
            old = self._index(manifest)  # the manifest on disk now names what the queued save did
            gone = [b for b in set(dead) | set(old) if not self._named(b) and b in self.block_sizes]
            for b in gone:
                self._drop_size(b)
        for b in gone:
            self.store.delete_block(b)
        self._enforce_budget()  # before the turn is acknowledged: a completed response never finds the disk over budget
        self._finish(job, True)

    def _retry_or_drop(self, job: _Job, error: OSError) -> None:
        with self._cv:
            can_retry = job.attempts < len(self.retry_delays) and not self._closed and (
                job.attempts or self._retrying < MAX_RETRYING)
            if not job.future.done():
                job.future.set_result(False)  # the caller goes on; durability may still come later
            if not can_retry:
                self.counts["saves_dropped"] += 1
                log.warning("turn of agent %r not saved (%s); given up after %d attempt(s)",
                            job.args[0].namespace, error, job.attempts + 1)
            else:
                if not job.attempts:
                    self._retrying += 1
                    self._freshen(job.args[1], -1)  # failed once: the pool may drop its copy
                job.due = time.monotonic() + self.retry_delays[job.attempts]
                job.attempts += 1
                job.seq = next(self._seq)
                self.counts["retries"] += 1
                heapq.heappush(self._ready, job)
        if not can_retry:
            self._finish(job, False)
            return
        log.warning("saving agent %r failed (%s); retry %d in %.0f s", job.args[0].namespace, error,
                    job.attempts, self.retry_delays[job.attempts - 1])

    def _erase_job(self, job: _Job) -> None:
        namespace, why = job.args
        self._finish(job, self._erase(namespace, why))

    def _erase(self, namespace: str, why: str) -> bool:
        with self._cv:
            # a save of this agent still waiting for its retry must not bring it back
            stale = [j for j in self._ready if j.run == self._save_job and j.args[0].namespace == namespace]
            for j in stale:
                self._ready.remove(j)
                self._release(j)
            heapq.heapify(self._ready)
            agent = self.agents.pop(namespace, None)
            self._saved_order.pop(namespace, None)
            ids = agent.block_ids if agent is not None else []
            for b in ids:
                self._unref(b)
            gone = [b for b in ids if not self._named(b)]  # another agent's queued save may name it
            for b in gone:
                self._drop_size(b)
            if agent is not None:
                self._manifest_bytes -= _MANIFEST_ESTIMATE
        for j in stale:
            if not j.future.done():
                j.future.set_result(False)
        on_disk = agent is not None or self.store.manifest_path(namespace).exists()
        if on_disk:  # said before the files go: a process killed meanwhile leaves the reason in the log
            log.info("erased agent %r (%s)", namespace, why)
        self.store.delete_agent(namespace, gone)
        if why == "request":  # the user's erasure: the agent's files under other models' directories too
            removed, freed = self.store.erase_elsewhere(namespace)
            if removed:
                if not on_disk:
                    log.info("erased agent %r (%s, under other models' directories)", namespace, why)
                on_disk = True
                self.counts["erased_elsewhere"] += removed
                with self._cv:
                    self._other_bytes = max(0, self._other_bytes - freed)
        if on_disk:
            self.counts["agents_erased"] += 1
            self.on_erased(namespace)
        return on_disk

    def _pin_job(self, job: _Job) -> None:
        namespace, pinned = job.args
        with self._cv:
            agent = self.agents.get(namespace)
            if agent is not None:
                agent.pinned = pinned
        m = self.store.read_manifest(namespace)
        if m is None:
            self._finish(job, False)
            return
        m.pinned = pinned
        self.store.write_manifest(m)
        self._finish(job, True)

    # ---- index, budget, TTL ---------------------------------------------------------------------

    def _index(self, m: Manifest) -> list[str]:
        """Record `m` as the agent's manifest on disk (lock held); returns the block ids it replaced."""
        old = self.agents.pop(m.namespace, None)
        for b in m.block_ids:
            self.block_refs[b] = self.block_refs.get(b, 0) + 1
        if old is None:
            self._manifest_bytes += _MANIFEST_ESTIMATE
        else:
            for b in old.block_ids:
                self._unref(b)
        last_used = max(m.updated_at, old.last_used if old else 0.0)
        self.agents[m.namespace] = DiskAgent(list(m.block_ids), last_used, m.pinned, m.n_tokens)
        return old.block_ids if old else []

    def _unref(self, bid: str) -> None:
        n = self.block_refs.get(bid, 0) - 1
        if n > 0:
            self.block_refs[bid] = n
        else:
            self.block_refs.pop(bid, None)

    def _set_size(self, bid: str, n: int) -> None:
        self._block_bytes += n - self.block_sizes.get(bid, 0)
        self.block_sizes[bid] = n

    def _drop_size(self, bid: str) -> None:
        self._block_bytes -= self.block_sizes.pop(bid, 0)

    def _enforce_budget(self) -> None:
        """Erase until the disk fits the budget: quarantined files first, then other models'
        directories, then the least recently used agents, never one that is pinned, has a request in
        flight or a save queued (when only those are left, the disk stays over budget: counted as
        `budget_blocked` and logged once)."""
        while True:
            with self._cv:
                if self._disk_bytes_locked() <= self.disk_budget:
                    self._blocked_logged = False
                    return
                quarantined = self.store.quarantine_bytes > 0
                path = victim = None
                if not quarantined and self._other_dirs:
                    path, size, _ = self._other_dirs.pop(0)
                elif not quarantined:
                    busy = self._live.keys() | self._queued_agents.keys()
                    victim = next((ns for ns, a in self.agents.items() if ns not in busy and not a.pinned), None)
                    if victim is None:
                        self.counts["budget_blocked"] += 1
                        if not self._blocked_logged:
                            self._blocked_logged = True
                            log.warning("disk budget: %d bytes used of %d, and every agent left is pinned or in "
                                        "use; pinned agents are never erased", self._disk_bytes_locked(),
                                        self.disk_budget)
                        return
            if quarantined:
                self.counts["quarantine_removed"] += self.store.clear_quarantine()
            elif path is not None:
                with self._cv:
                    self._other_bytes -= size
                shutil.rmtree(path, ignore_errors=True)
                self.counts["other_dirs_removed"] += 1
                log.info("disk budget: removed another model's cache directory %s", path)
            else:
                self.counts["budget_erasures"] += 1
                self._erase(victim, "disk budget")

    def _sweep(self) -> None:
        """Erase agents unused for longer than the TTL (pinned and in-use agents excepted)."""
        self._last_sweep = time.time()
        if self.ttl_s is not None:
            cutoff = self.clock() - self.ttl_s
            with self._cv:
                expired = [ns for ns, a in self.agents.items() if a.last_used < cutoff and not a.pinned
                           and ns not in self._live and ns not in self._queued_agents]
            for ns in expired:
                self.counts["ttl_erasures"] += 1
                self._erase(ns, "ttl")
        self._enforce_budget()


# Bytes counted per manifest: they are a few hundred bytes plus 65 per block id, rewritten every
# turn; an estimate keeps accounting free of stat calls (the budget is about blocks).
_MANIFEST_ESTIMATE = 1024
