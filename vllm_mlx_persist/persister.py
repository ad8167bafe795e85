"""The one writer of the disk tier: saves, erasures and the disk budget, in order, on one thread.

The pool hands it numpy copies of a turn's new blocks and the agent's manifest; it writes the blocks,
then the manifest (so a manifest only ever names durable blocks), retries failed saves in the
background with back-off, and erases least recently used agents when the disk budget or the TTL says
so. Its queue is bounded in bytes and never makes the caller wait: a save that finds it full is
dropped and counted (the pool keeps the blocks unsaved in memory; the agent's next save writes them).
Disk usage, quarantined files included, is counted as files come and go, so `stats()` never walks
the disk.

Owns the disk index (disk_index.py: agents, block sizes, references from manifests on disk and from
saves still queued), the disk budget and TTL (disk_budget.py), the job queue and its thread. A block
named by a queued save's manifest, and an agent with a save queued or a request in flight, are never
erased by the budget or the TTL; pinned agents never. Threads: `save`, `erase`, `set_pinned`, `touch`, `begin_use`/`end_use` and `stats` may be called from
any thread (its lock is held for bookkeeping only); the jobs run on the persister thread, which only
sees numpy arrays, bytes and files, and calls `on_erased` and a save's `on_durable` without its lock.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional

from .cache_root import erase_elsewhere, other_model_dirs
from .disk_budget import SWEEP_INTERVAL_S, DiskBudget
from .disk_format import BlockData, Manifest
from .disk_index import DiskAgent, DiskIndex
from .store import DiskStore

log = logging.getLogger("vllm_mlx_persist.persister")

RETRY_DELAYS_S = (1.0, 5.0, 30.0)  # a failed save is retried this many times, after these delays
MAX_RETRYING = 8  # failed saves kept for retry at once (each holds its blocks' bytes)

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
        retry_clock: Callable[[], float] = time.monotonic,
    ):
        self.store = store
        self.queue_bytes = queue_bytes
        self.retry_delays = retry_delays
        self.clock = clock  # wall-clock time of last uses and of the TTL (a test may move it on)
        # when a failed save's retry is due (a test may hold it still: the retry waits until it moves on)
        self.retry_clock = retry_clock
        self.on_erased = on_erased or (lambda namespace: None)
        self.index = DiskIndex()  # under self._cv
        self.counts = dict.fromkeys(
            ["saves", "save_failures", "saves_dropped", "retries", "blocks_written", "bytes_written",
             "agents_erased", "budget_erasures", "ttl_erasures", "other_dirs_removed", "saves_superseded",
             "quarantine_removed", "budget_blocked", "erased_elsewhere"], 0)
        self._cv = threading.Condition()
        self.budget = DiskBudget(store, self.index, self._cv, self.counts, self._erase, clock, disk_budget, ttl_s)
        self._ready: list[_Job] = []  # heap by (due, seq)
        self._pending_bytes = 0
        self._retrying = 0
        self._seq = itertools.count()
        self._closed = False
        self._idle = True
        self._thread = threading.Thread(target=self._loop, name="vllm-mlx-persist-writer", daemon=True)
        self._thread.start()

    # ---- start-up -------------------------------------------------------------------------------

    def load(self) -> list[Manifest]:
        """Read every manifest (small) and index it; block sizes, other models' directories and the
        budget follow on the persister thread, so start-up does not wait for a directory walk."""
        sized = sorted(self.store.list_sized_manifests(), key=lambda ms: ms[0].updated_at)
        with self._cv:
            for m, size in sized:
                self.index.index(m, size)
        self._submit(self._scan_job, 0)
        return [m for m, _ in sized]

    def _scan_job(self, job: _Job) -> None:
        sizes = self.store.block_file_sizes()
        with self._cv:
            live = set(self.index.block_refs)
            for b, n in sizes.items():
                if b in live:
                    self.index.set_size(b, n)
        removed = self.store.gc(live)  # unreferenced blocks (e.g. of a crashed turn) and stale temp files
        if removed:
            log.info("removed %d unreferenced block file(s)", removed)
        others = other_model_dirs(self.store.root, self.store.dir.name)
        with self._cv:
            self.index.other_dirs, self.index.other_bytes = others, sum(d[1] for d in others)
        self.budget.sweep()

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
            self.index.hold(manifest, +1)
            self.index.freshen(blocks, +1)
            return self._submit(self._save_job, nbytes, (manifest, blocks, dead, on_durable))

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
            self.index.touch(namespace, self.clock())

    def begin_use(self, namespace: str) -> None:
        with self._cv:
            self.index.begin_use(namespace)

    def end_use(self, namespace: str) -> None:
        with self._cv:
            self.index.end_use(namespace)

    def disk_agent(self, namespace: str) -> Optional[DiskAgent]:
        with self._cv:
            a = self.index.agents.get(namespace)
            return None if a is None else DiskAgent(list(a.block_ids), a.last_used, a.pinned, a.n_tokens)

    def saving(self, bid: str) -> bool:
        """Whether a queued save that has not failed carries the block's data: it is on its way to
        the disk (the pool keeps such a block in memory until it is durable). Any thread."""
        with self._cv:
            return bid in self.index.fresh

    def block_size_of(self, bid: str) -> int:
        """A block file's size from the index; for one not indexed (yet), the mean indexed size
        (64 KiB when none is). No I/O."""
        with self._cv:
            return self.index.block_size_of(bid)

    def agent_disk_bytes(self, namespace: str) -> int:
        with self._cv:
            return self.index.agent_disk_bytes(namespace)

    def stats(self) -> dict:
        """Counters only (no file system access); safe from any thread."""
        store_counts = self.store.counts()
        with self._cv:
            return {
                **self.counts,
                "disk_bytes": self.index.disk_bytes(self.store.quarantine.bytes),
                "disk_budget_bytes": self.budget.disk_budget,
                "disk_agents": len(self.index.agents),
                "disk_blocks": len(self.index.block_sizes),
                "write_queue_bytes": self._pending_bytes,
                "write_queue_jobs": len(self._ready),
                "saves_retrying": self._retrying,
                **{k: store_counts[k] for k in ("read_errors", "quarantined")},
            }

    # ---- lifecycle ------------------------------------------------------------------------------

    def sweep(self) -> Future:
        """Check the TTL and the disk budget now (after the jobs queued before), not at the next
        minute's sweep."""
        def job(j: _Job) -> None:
            self.budget.sweep()
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
                    now = self.retry_clock()
                    if self._ready and self._ready[0].due <= now:
                        job = heapq.heappop(self._ready)
                    elif self._closed:  # what was due has run; pending retries are given up
                        self._give_up_retries()
                        return
                    elif self.budget.due():
                        break
                    else:
                        due = self._ready[0].due - now if self._ready else SWEEP_INTERVAL_S
                        self._cv.wait(min(due, SWEEP_INTERVAL_S))
            if job is None:
                self._safe(self.budget.sweep)
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
                self.index.hold(job.args[0], -1)
                if not job.attempts:
                    self.index.freshen(job.args[1], -1)
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
            self.index.hold(job.args[0], -1)
            if not job.attempts:
                self.index.freshen(job.args[1], -1)
        self._cv.notify_all()
        return True

    def _save_job(self, job: _Job) -> None:
        manifest, blocks, dead, on_durable = job.args
        with self._cv:
            # A retry that runs after a newer turn of the same agent was saved must not put the older
            # manifest back over it (that lost the newer, acknowledged turn at the next start).
            superseded = self.index.saved_order.get(manifest.namespace, -1) > job.order
        try:
            sizes = {}
            for b in blocks:  # a superseded turn's blocks still go: the newer manifest may name them
                written = self.store.write_block(b)
                sizes[b.block_id] = written or self.store.block_file_size(b.block_id)
                if written:
                    self.counts["blocks_written"] += 1
                    self.counts["bytes_written"] += written
            with self._cv:
                current = self.index.agents.get(manifest.namespace)
                if current is not None:
                    manifest.pinned = current.pinned
            if not superseded:
                manifest_size = self.store.write_manifest(manifest)
        except OSError as e:
            self.counts["save_failures"] += 1
            self._retry_or_drop(job, e)
            return
        if superseded:
            self.counts["saves_superseded"] += 1
            with self._cv:
                self._release(job)  # its own manifest no longer holds its blocks
                for bid, n in sizes.items():
                    if bid in self.index.block_refs:
                        self.index.set_size(bid, n)
                unnamed = self._unkept([job])
            for b in unnamed:
                self.store.delete_block(b)
            self._finish(job, False)
            return
        with self._cv:
            self.index.saved_order[manifest.namespace] = job.order
        on_durable()
        self.counts["saves"] += 1
        with self._cv:
            for bid, n in sizes.items():
                self.index.set_size(bid, n)
            old = self.index.index(manifest, manifest_size)  # the manifest on disk now names what the queued save did
            gone = [b for b in set(dead) | set(old) if not self.index.named(b) and b in self.index.block_sizes]
            for b in gone:
                self.index.drop_size(b)
        for b in gone:
            self.store.delete_block(b)
        self.budget.enforce()  # before the turn is acknowledged: a completed response never finds the disk over budget
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
                    self.index.freshen(job.args[1], -1)  # failed once: the pool may drop its copy
                job.due = self.retry_clock() + self.retry_delays[job.attempts]
                job.attempts += 1
                job.seq = next(self._seq)
                self.counts["retries"] += 1
                heapq.heappush(self._ready, job)
        if not can_retry:
            self._finish(job, False)
            with self._cv:
                unkept = [] if self._closed else self._unkept([job])  # at close, the next start's gc
            for b in unkept:
                self.store.delete_block(b)
            return
        log.warning("saving agent %r failed (%s); retry %d in %.0f s", job.args[0].namespace, error,
                    job.attempts, self.retry_delays[job.attempts - 1])

    def _unkept(self, jobs: list[_Job]) -> list[str]:
        """(lock held) Saves leaving the queue without their manifest (superseded, given up, or dropped
        by an erasure): the blocks only they kept, which no manifest on disk nor queued save names now,
        taken out of the index for the caller to delete. Those their manifests named (an earlier save
        that stopped naming one left its file for them) and those they carried (an attempt may have
        written some)."""
        out = []
        for b in dict.fromkeys(b for j in jobs for b in [*j.args[0].block_ids, *(d.block_id for d in j.args[1])]):
            if not self.index.named(b):
                self.index.drop_size(b)
                out.append(b)
        return out

    def _erase_job(self, job: _Job) -> None:
        namespace, why = job.args
        self._finish(job, self._erase(namespace, why, job.order))

    def _erase(self, namespace: str, why: str, before: Optional[int] = None) -> bool:
        """Erase the agent's files and the saves of it queued before the erasure (`before`: its job's
        submission order; None: every one). A save queued after it is a turn of the agent made anew
        (the pool stores no turn of a request in flight during the erasure): it stays."""
        with self._cv:
            # a save of this agent still waiting for its retry must not bring it back
            stale = [j for j in self._ready if j.run == self._save_job and j.args[0].namespace == namespace
                     and (before is None or j.order < before)]
            for j in stale:
                self._ready.remove(j)
                self._release(j)
            heapq.heapify(self._ready)
            agent, gone = self.index.forget(namespace)
            gone += [b for b in self._unkept(stale) if b not in gone]
        for j in stale:
            if not j.future.done():
                j.future.set_result(False)
        on_disk = agent is not None or self.store.manifest_path(namespace).exists()
        if on_disk:  # said before the files go: a process killed meanwhile leaves the reason in the log
            log.info("erased agent %r (%s)", namespace, why)
        self.store.delete_agent(namespace, gone)
        if why == "request":  # the user's erasure: the agent's files under other models' directories too
            removed, freed = erase_elsewhere(self.store.root, self.store.dir.name, namespace)
            if removed:
                if not on_disk:
                    log.info("erased agent %r (%s, under other models' directories)", namespace, why)
                on_disk = True
                self.counts["erased_elsewhere"] += removed
                with self._cv:
                    self.index.other_bytes = max(0, self.index.other_bytes - freed)
        if on_disk:
            self.counts["agents_erased"] += 1
            with self._cv:  # a turn queued after the erasure is of the agent made anew: memory keeps it
                anew = before is not None and any(j.run == self._save_job and j.args[0].namespace == namespace
                                                  and j.order > before for j in self._ready)
            if not anew:
                self.on_erased(namespace)
        return on_disk

    def _pin_job(self, job: _Job) -> None:
        namespace, pinned = job.args
        with self._cv:
            agent = self.index.agents.get(namespace)
            if agent is not None:
                agent.pinned = pinned
        m = self.store.read_manifest(namespace)
        if m is None:
            self._finish(job, False)
            return
        m.pinned = pinned
        size = self.store.write_manifest(m)
        with self._cv:
            self.index.resize_manifest(namespace, size)
        self._finish(job, True)
