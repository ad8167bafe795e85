"""The glue between one server's pool and the fleet tier in Redis (tier.RemoteTier): `Fleet`.

    commits:  a turn durable on local disk (persister thread, end of its save job) -> tier.put
              (queued, never blocks); only the turn's new blocks travel with it, Redis takes the
              rest from the local disk through block_source if it lacks them.
    erasure:  DELETE /v1/agents/ID (pool.erase) -> tier.erase, a tombstone fleet-wide. The disk
              budget and the TTL are this server's space decisions: they erase locally only.
    removals and settings: an erasure, and a record's publish (a saved record holding a removal or
              a setting newer than any this server recorded or published: a forget, a pin, a fork
              setting), are in the outbox (outbox.py) before they are acknowledged; the outbox is
              sent again at start-up and every `outbox_retry_s` while the server runs, and refuses
              new removals and settings at its bound (`removal_room`: HTTP 503).
    lookups:  a request's agent is known (HTTP thread, backend.prefetch) -> a sync job on this
              module's own threads: read the agent's manifest in Redis; an erasure this server has
              not acted on (a tombstone, or a history of a newer era: started on a tombstone this
              server never read) erases the agent locally (then tier.erased_locally, and a history
              is read again); a history from before this server's era is left alone; a history holding
              anything the local one lacks (a branch, or a more recent use of one) has the missing
              blocks of each of its branches fetched (pipelined, verified as disk blocks, and each
              branch's id chain checked with its links: forks included), merged with the local
              branches by recency (chain.merge_branches), saved to local disk through the persister
              (index and budget see them; they are not uploaded again), then registered in the pool
              as COLD blocks on the persister thread, in order with every other write. A history
              the local one already holds costs the manifest read only. pool.lookup waits for that
              job at most `wait_s`, then goes on with what is local.
    local erasure (disk budget, TTL, before erased_locally) -> tier.release: this server's next
              put merges with what Redis holds instead of succeeding it.
    eras:     every local manifest is stamped with the erasure its history follows (`era`, from the
              tier), and a restart tells the tier back (`loaded`), so it survives (docs/fleet.md, Erasure).

It reaches the pool only through `FleetPool` (pool_api.py: BlockPool implements it); the pool calls
`saved`, `superseded`, `era`, `loaded`, `released`, `erase`, `prefetch`, `wait`,
`settings_of`, `agent_info`, `stop` and `close`, the backend `pending`, `wait_s` and `stats`.
Numpy and bytes only, never MLX (the worker thread alone does MLX). Bounds (FleetSettings):
`max_syncs` agents' jobs tracked at once (more are skipped and counted), `sync_threads` threads, the
local write queue's and the tier's own queue bounds. See docs/fleet.md.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Callable, Optional

from ..chain import Branch, Copy, branch_of, cut_branch, limit_branches, surviving_removals
from ..disk_format import BlockData, Manifest
from ..record_settings import RemoteSettings
from .family import Family
from .manifests import RemoteManifest
from .outbox import OUTBOX_DIR, Outbox, publish_mark
from .pool_api import FleetPool
from .tier import RemoteTier

log = logging.getLogger("vllm_mlx_persist.fleet")


# At most this long on the HTTP event loop for a fork parent's settings (settings_of): every stream of
# the server waits meanwhile; past it the local record answers.
ADMISSION_READ_S = 0.5


class Fleet:
    """One server's side of the fleet: when to ask Redis, what to fetch, what to publish."""

    def __init__(self, pool: FleetPool, make_tier: Callable[..., RemoteTier],
                 family: Optional[tuple[str, str]] = None):
        """`make_tier(block_source=, on_erased=, branches=, keep_continued=)`: the RemoteTier, built
        here with this fleet's callbacks (blocks a put lacks come from the local disk, verified; a put
        refused by another server's erasure erases the agent here) and what a merge in Redis keeps:
        the pool's `branches`, and continued branches on a model with bounded sliding windows. The
        tier's settings (FleetSettings) are this fleet's too. `family`: (the weights' fingerprint with
        keys as q4, this server's key format): the keyspaces of other key formats of the same weights
        are watched (a mixed fleet is reported) and erasures reach them too (family.py)."""
        if pool.disk_queue_bytes is None:
            raise ValueError("the fleet tier needs the local disk tier")
        self.pool = pool
        self.counts = dict.fromkeys(
            ["syncs", "syncs_skipped", "syncs_unchanged", "agents_fetched", "blocks_fetched", "tokens_fetched",
             "fetch_incomplete", "fetch_cut_at_budget", "chain_refused", "adopt_skipped", "save_failed",
             "erased_from_fleet", "syncs_outdated", "syncs_republished", "lookup_waits", "lookup_wait_timeouts",
             "lookup_wait_s_max", "forgets_recorded", "forgets_sent_again", "forgets_lost_locally",
             "removals_refused", "settings_reads"], 0)
        self._lock = threading.Lock()
        # Erasures whose tombstone is in this keyspace but not yet in every other key format's
        # (bounded by the outbox): the drain retries only that part (before the tier: its writer calls back).
        self._family_pending: set[tuple[str, str]] = set()
        self.family: Optional[Family] = None
        self.tier = make_tier(block_source=pool.read_disk_block, on_erased=self._erased_elsewhere,
                              on_erase_done=self._erase_done, on_put_done=self._put_done,
                              branches=pool.max_branches, keep_continued=pool.bounded_windows)
        if family is not None:
            self.family = Family(self.tier, *family)
        settings = self.settings = self.tier.settings
        # Removals acknowledged and not yet in Redis, on the local disk: sent again after a restart
        # and while the server runs (the drain thread).
        self.outbox = Outbox(Path(pool.fleet_dir) / OUTBOX_DIR, settings.max_erasures)
        for namespace, era in self.outbox.pending():  # a server killed before its erasures reached Redis
            log.info("fleet: agent %r: its erasure did not reach Redis before the last stop; queued again",
                     namespace)
            self.tier.erase(namespace, era)
        # The newest removal or setting stamp each agent's record holds that is in the outbox or in
        # Redis (bounded; seeded at start-up from the records on disk, see `loaded`): a save holding a
        # newer one records its publish first.
        self._marks: "OrderedDict[str, float]" = OrderedDict()
        self._marks_lock = threading.Lock()
        self.wait_s = settings.wait_s
        self.write_timeout_s = settings.save_timeout_s
        self.max_syncs = settings.max_syncs
        # Block data one sync holds between Redis and the local save, at most (default: the local
        # write queue's byte budget); beyond it the history is cut and the rest prefilled.
        # Memory: threads x this.
        self.max_fetch_bytes = (settings.max_fetch_bytes if settings.max_fetch_bytes is not None
                                else pool.disk_queue_bytes)
        self._syncs: "OrderedDict[str, Future]" = OrderedDict()
        self._exec = ThreadPoolExecutor(settings.sync_threads, thread_name_prefix="vllm-mlx-persist-fleet")
        self._closed = False
        if self.family is not None:
            self._exec.submit(self.family.refresh)  # registers this keyspace; a mixed fleet is logged
        self._drain_wake = threading.Event()
        self._drain_seen: set[str] = set()  # agents whose forget's publish was pending at the last drain
        self._idle_erasures: set[tuple[str, str]] = set()  # erasures pending and not queued at the last drain
        self._drainer = threading.Thread(target=self._drain_loop, name="vllm-mlx-persist-fleet-outbox", daemon=True)
        self._drainer.start()

    # ---- commits and erasure (called by the pool) ------------------------------------------------

    def saved(self, manifest: Manifest, blocks: list[BlockData], base: Optional[Manifest] = None) -> None:
        """A turn is durable locally (persister thread): publish it (`base`: the agent's manifest
        before the turn). Never blocks, never raises (the persister must finish its job whatever
        happens here)."""
        try:
            self._record_removal(manifest)  # before the turn is acknowledged (this runs before)
            self.tier.known_era(manifest.namespace, manifest.era)  # the tier may have forgotten it (its bound)
            self.tier.put(manifest, {b.block_id: b for b in blocks}, base)
        except Exception:
            log.exception("fleet: queueing the upload of agent %r failed", manifest.namespace)

    def _record_removal(self, manifest: Manifest) -> None:
        """A record holding a removal or a setting newer than any recorded or published for the agent
        (a forget, a pin, a fork setting, saved): its publish is pending in the outbox, durably, before
        the put is queued."""
        mark = publish_mark(manifest)
        if mark <= 0.0 or mark <= self._mark(manifest.namespace):
            return
        try:
            self.outbox.add_forget(manifest.namespace, mark)
        except OSError as e:  # still queued: it reaches Redis unless this server dies first
            log.error("fleet: agent %r: recording its removal's or setting's pending publish failed (%s); not "
                      "kept across a restart", manifest.namespace, e)
            return
        self._count("forgets_recorded")
        self._set_mark(manifest.namespace, mark)

    def _mark(self, namespace: str) -> float:
        with self._marks_lock:
            return self._marks.get(namespace, 0.0)

    def _set_mark(self, namespace: str, mark: float) -> None:
        with self._marks_lock:
            if mark > self._marks.get(namespace, 0.0):
                self._marks[namespace] = mark
            self._marks.move_to_end(namespace)
            while len(self._marks) > self.settings.max_agents:
                self._marks.popitem(last=False)

    def _put_done(self, manifest: Manifest) -> None:
        """Tier writer thread: Redis holds the put's record (or the agent was erased since): the
        publishes it carries are done."""
        mark = publish_mark(manifest)
        if mark > 0.0:
            self._set_mark(manifest.namespace, mark)
            self.outbox.forget_done(manifest.namespace, mark)

    def removal_room(self) -> bool:
        """Whether a new removal (an erasure, a forget) or setting may be acknowledged: False (counted)
        when the outbox holds `max_erasures` pending ones; the caller answers 503. Any thread, no I/O."""
        if self.outbox.full():
            self._count("removals_refused")
            return False
        return True

    # ---- the outbox, sent again while the server runs -----------------------------------------------

    def _drain_loop(self) -> None:
        first = True
        while True:
            with self._lock:
                if self._closed:
                    return
            try:
                self.drain(first)
            except Exception:  # never kill the drain thread
                log.exception("fleet: sending the outbox again failed")
            first = False
            self._drain_wake.wait(self.settings.outbox_retry_s)
            self._drain_wake.clear()

    def drain(self, now: bool = False) -> int:
        """Send the outbox's pending removals that no write in flight carries: erasures not queued
        (queued again with their ids) and forgets' publishes (the agent's record on the local disk,
        put again). A publish is sent again only when it was pending at the previous drain too, and no
        put of the agent is queued (`now`: at start-up, at once). Returns how many were queued."""
        sent = 0
        with self._lock:
            family_pending = set(self._family_pending)
        for namespace, ident in sorted(family_pending):  # the tombstone is here: only the other keyspaces
            try:
                self.family.erase(namespace, ident)
            except Exception:
                continue
            with self._lock:
                self._family_pending.discard((namespace, ident))
            family_pending.discard((namespace, ident))
            self.outbox.done(namespace, ident)
        # An erasure not queued at two drains in a row (the writer lets one go between writing its
        # tombstone and removing its file: not queued again for that). Start-up queued every one.
        idle = set()
        for namespace, era in self.outbox.erasures():
            if self.tier.erasing(namespace) or (namespace, era) in family_pending:
                continue
            idle.add((namespace, era))
            if (namespace, era) in self._idle_erasures and self.tier.erase(namespace, era):
                sent += 1
        self._idle_erasures = idle
        forgets = self.outbox.forgets()
        seen, self._drain_seen = self._drain_seen, set(forgets)
        room = max(1, self.tier.room() // 2)  # leave room for the turns' own puts
        for namespace, mark in forgets.items():
            if room <= 0:
                break
            if (not now and namespace not in seen) or self.tier.putting(namespace):
                continue
            m = self.pool.read_record(namespace)
            if m is None or publish_mark(m) < mark:
                # erased since (here or by another server: nothing to send), or evicted by the disk
                # budget or the TTL before its forget reached Redis (docs/fleet.md: a known limit)
                log.warning("fleet: agent %r: its record left the local disk before its forget's publish "
                            "reached Redis", namespace)
                self._count("forgets_lost_locally")
                self.outbox.forget_done(namespace, mark)
                continue
            self.tier.known_era(namespace, m.era)
            if self.tier.put(m):
                sent += 1
                room -= 1
                self._count("forgets_sent_again")
        return sent

    def superseded(self, block_ids: list[str]) -> None:
        """A forget edit's save is durable and its manifest's put queued: delete the blocks it no
        longer names from Redis too. Never raises (persister thread)."""
        try:
            self.tier.drop_blocks(block_ids)
        except Exception:
            log.exception("fleet: queueing the deletion of superseded blocks failed")

    def era(self, namespace: str) -> Optional[str]:
        """The erasure this server's histories of the agent follow (a manifest's `era`; None: none).
        Any thread, the pool's lock held: no I/O."""
        return self.tier.era(namespace) or None

    def loaded(self, manifest: Manifest) -> None:
        """Start-up: the agent's manifest found on the local disk (its era survives the restart). What
        it holds is in Redis or pending in the outbox (recorded before it was acknowledged): its next
        save records no publish again for it."""
        self.tier.known_era(manifest.namespace, manifest.era)
        mark = publish_mark(manifest)
        if mark > 0.0:
            self._set_mark(manifest.namespace, mark)

    def loaded_era(self, namespace: str, era: str) -> None:
        """The agent's record follows erasure `era`, which the tier forgot (its `max_agents` bound):
        tell it back (ignored when the tier knows an era). Any thread, the pool's lock may be held."""
        self.tier.known_era(namespace, era)

    def released(self, namespace: str) -> None:
        """The agent was erased here (any reason; the pool's lock held): it holds no copy any more."""
        self.tier.release(namespace)

    def erase(self, namespace: str) -> bool:
        """Erase fleet-wide (an API erasure, after the local one is durable); True if Redis held a
        live manifest for it (read within the tier's read time-out). The tombstone is queued."""
        m = self.tier.get_manifest(namespace)
        elsewhere = self.family is not None and self.family.holds(namespace)  # another key format's keyspace
        self._erase_durably(namespace)
        return (m is not None and not m.erased) or elsewhere

    def _erase_done(self, namespace: str, ident: str) -> None:
        """Tier writer thread: erasure `ident`'s tombstone is in this keyspace; written to the other
        key formats' keyspaces of the weights too before the outbox lets it go. On a Redis failure
        there it stays pending, and only that part is tried again by the drain (`_family_pending`):
        writing this keyspace's tombstone again could end a history begun since."""
        if self.family is not None:
            try:
                self.family.erase(namespace, ident)
            except Exception as e:
                log.error("fleet: agent %r: its erasure did not reach the keyspaces of other key formats (%s); "
                          "kept pending", namespace, e)
                with self._lock:
                    self._family_pending.add((namespace, ident))
                return
        self.outbox.done(namespace, ident)

    def _erase_durably(self, namespace: str) -> None:
        """Queue the fleet-wide erasure after recording it in the outbox (durable before the caller
        acknowledges the erasure; removed once its tombstone is in Redis)."""
        ident = secrets.token_hex(8)
        try:
            self.outbox.add(namespace, ident)
        except OSError as e:  # still queued: it reaches Redis unless this server dies first
            log.error("fleet: agent %r: recording its pending erasure failed (%s); not kept across a restart",
                      namespace, e)
        self.tier.erase(namespace, ident)

    # ---- lookups ------------------------------------------------------------------------------------

    def prefetch(self, namespace: str) -> None:
        """Start the agent's sync with Redis (any thread; never blocks)."""
        self._start(namespace)

    def settings_of(self, namespace: str) -> Optional[RemoteSettings]:
        """The agent's settings in Redis, for an answer that cannot wait for its sync (a fork's
        admission: the namespace hook, on the HTTP event loop): one manifest read on the admission
        checks' own reader, within min(wait_s, read_timeout_s). None when Redis holds nothing that
        counts (absent, a history from before this server's era, a tombstone already acted on) or
        did not answer in time (its breaker open, cut off): the local record then answers alone.
        Reads no block and changes nothing the agent's sync would not (tier.get_manifest)."""
        with self._lock:
            if self._closed:
                return None
            self.counts["settings_reads"] += 1
        rm = self.tier.get_manifest(namespace, timeout=min(self.wait_s, ADMISSION_READ_S), check=True)
        if rm is None or rm.outdated:
            return None
        if rm.erasure:  # an erasure not acted on here yet: the local record is of the past it ended
            return (RemoteSettings(replaces=True) if rm.erased
                    else RemoteSettings(rm.forkable, dict(rm.settings_at), replaces=True))
        if rm.erased:  # acted on already: a local record is of a history begun since
            return None
        return RemoteSettings(rm.forkable, dict(rm.settings_at))

    def pending(self, namespace: str) -> Optional[Future]:
        """The agent's sync while it runs (it stays there for `wait`), else None; any thread."""
        with self._lock:
            fut = self._syncs.get(namespace)
        return fut if fut is not None and not fut.done() else None

    def wait(self, namespace: str, block: bool = True) -> None:
        """Worker thread, before the pool's lookup: wait for the agent's sync at most `wait_s`
        (starting one if no prefetch did), then go on with what is local. `block=False`: the
        request's admission already waited for it (backend.ready, off the worker): do not wait again."""
        fut = self._start(namespace, consume=True)
        if fut is None or fut.done():
            return
        if not block:
            self._count("lookup_wait_timeouts")
            log.warning("fleet: agent %r: Redis did not answer within %.1fs; serving from local tiers",
                        namespace, self.wait_s)
            return
        t0 = time.monotonic()
        try:
            fut.result(self.wait_s)
        except FutureTimeout:
            self._count("lookup_wait_timeouts")
            log.warning("fleet: agent %r: Redis did not answer within %.1fs; serving from local tiers",
                        namespace, self.wait_s)
        except Exception:  # the job logs its own failures
            pass
        waited = time.monotonic() - t0
        with self._lock:
            self.counts["lookup_waits"] += 1
            self.counts["lookup_wait_s_max"] = max(self.counts["lookup_wait_s_max"], round(waited, 4))

    def _start(self, namespace: str, consume: bool = False) -> Optional[Future]:
        with self._lock:
            if self._closed:
                return None
            fut = self._syncs.get(namespace)
            if fut is not None and (consume or not fut.done()):
                # one sync per request: a running one is shared, a finished one is used once
                if consume:
                    del self._syncs[namespace]
                return fut
            if len(self._syncs) >= self.max_syncs:
                done = next((ns for ns, f in self._syncs.items() if f.done()), None)
                if done is None:
                    self.counts["syncs_skipped"] += 1
                    return None
                del self._syncs[done]
            try:
                fut = self._exec.submit(self._sync, namespace)
            except RuntimeError:  # shutting down
                return None
            self.counts["syncs"] += 1
            if not consume:
                self._syncs[namespace] = fut
            return fut

    def _sync(self, namespace: str) -> None:
        try:
            self._sync_agent(namespace)
        except Exception:  # a bug here must never reach a request
            log.exception("fleet: syncing agent %r failed", namespace)

    def _sync_agent(self, namespace: str) -> None:
        if self.family is not None:
            self.family.refresh()  # at most every family.REFRESH_S
        for _ in range(3):  # again after acting on an erasure: then the agent's history is of its era
            if not self._sync_once(namespace):
                return

    def _sync_once(self, namespace: str) -> bool:
        """One read of the agent's manifest and what follows; True to read it again (this server
        has just acted on an erasure, and the value read may hold a history of that era)."""
        # Before the read: an erasure from here on (an API erasure racing this sync, or the one this
        # sync acts on) makes the pool refuse what this sync fetched, even for an agent it does not know.
        expect = self.pool.agent_version(namespace)
        self.tier.known_era(namespace, self.pool.era_of(namespace))  # one the tier's bounded memory forgot
        rm = self.tier.get_manifest(namespace)
        if rm is None:
            return False
        pool = self.pool
        if rm.erasure:  # a tombstone, or a newer era's history: an erasure this server has not acted on
            self._count("erased_from_fleet")
            log.info("fleet: agent %r was erased on another server; erasing it here", namespace)
            pool.erase(namespace, fleet_wide=False)
            # only now may its puts start afresh (or join the history of that era)
            return self.tier.erased_locally(namespace, rm.erasure) and not rm.erased
        if rm.erased:
            return False
        if rm.outdated:  # from before the erasure this server's copies follow: none of it may come back
            self._count("syncs_outdated")
            return False
        remote = Copy(tuple(self._branches(rm)), rm.removals, rm.spliced_cleared, rm.forkable, rm.settings_at,
                      rm.removed_floor, rm.pinned)
        tokens = self._tokens(pool.removal_blocks(namespace, remote))  # read ahead: no read under the lock
        # Every branch there already held here, as recently used, and every removal: no block is
        # read, and this server now holds that version (its next put succeeds it).
        if pool.holds(namespace, expect, remote, lambda: self.tier.adopt(namespace, rm.version), tokens):
            self._count("syncs_unchanged")
            # ... and when the local record is ahead of it (a put of a removal or a setting that never
            # reached Redis), the record is published again: its put succeeds the version adopted.
            if pool.republish(namespace, remote):
                self._count("syncs_republished")
            return False
        branches, blocks, complete = self._fetch(rm, list(remote.branches))
        if not branches and not remote.removals and not remote.spliced_cleared and (
                remote.forkable is None and not remote.settings_at and not remote.removed_floor):
            return False
        version = rm.version if complete else None
        fut = pool.save_fetched(namespace, Copy(tuple(branches), remote.removals, remote.spliced_cleared,
                                                remote.forkable, remote.settings_at, remote.removed_floor,
                                                remote.pinned), blocks,
                                expect, lambda adopted: self._adopted(adopted, version), tokens)
        with self._lock:
            self.counts["blocks_fetched"] += len(blocks)
        try:
            if fut is not None and not fut.result(self.write_timeout_s):
                self._count("save_failed")
                # the merge is not adopted, but what Redis's removal records remove is served no more
                pool.drop_removed(namespace, remote, tokens)
            elif fut is not None and pool.republish(namespace, remote):
                # the merge kept removals or settings of the local record that Redis's copy lacks (a
                # put of them that never reached it): published now, as a successor of the adopted copy
                self._count("syncs_republished")
        except FutureTimeout:
            log.warning("fleet: agent %r: local save of its fetched blocks not durable after %.0fs",
                        namespace, self.write_timeout_s)
        return False

    def _branches(self, rm: RemoteManifest) -> list[Branch]:
        """The manifest's branches, least recently used first (at most the pool's `branches` honest
        ones and as many spliced ones, the most recent), without those its own removal records
        remove; one without a last use counts as used when the manifest was written."""
        branches = [branch_of(e, rm.namespace, rm.updated_at) for e in rm.branches]
        return limit_branches(surviving_removals(branches, rm.removals, rm.spliced_cleared, lambda b: None),
                              self.pool.max_branches)

    def _tokens(self, block_ids: list[str]) -> dict[str, list[int]]:
        """The tokens of these local blocks, read from the local disk (a removal's tail needs them)."""
        out = {}
        for bid in block_ids:
            data = self.pool.read_disk_block(bid)
            if data is not None:  # else unreadable: the merge then tells by ids alone
                out[bid] = data.tokens.tolist()
        return out

    def _fetch(self, rm: RemoteManifest, remote: list[Branch]) -> tuple[list[Branch], list[BlockData], bool]:
        """Fetch what the local disk lacks of the manifest's branches (`remote`; newest first: it
        matters most, and older ones mostly share its blocks). A branch ends
        at its first block that is missing, refused by the tier, or off its id chain (checked with
        the branch's links, exactly as the pool checks disk blocks); the prefix before it is still
        used. Returns the usable branches (least recently used first), the fetched blocks they
        name, and whether nothing was cut."""
        pool = self.pool
        fetched: dict[str, BlockData] = {}
        held = 0  # bytes of fetched block data, bounded by max_fetch_bytes
        failed: set[str] = set()
        out: list[Branch] = []
        complete = True  # branches beyond the pool's bound are left out as on one server: not a cut
        for br in reversed(remote):
            want: list[str] = []
            for bid in br.block_ids:
                if bid in failed:
                    break
                if bid not in fetched and not pool.has_disk_block(bid):
                    want.append(bid)
            room = self.max_fetch_bytes - held
            got = self.tier.get_blocks(want, max_bytes=room) if room > 0 else []
            fetched.update((d.block_id, d) for d in got)
            held += sum(d.nbytes for d in got)
            if len(got) < len(want):
                failed.add(want[len(got)])
                if held >= self.max_fetch_bytes:
                    self._count("fetch_cut_at_budget")
            n, refused = pool.chain_prefix(br, fetched)
            if refused:
                self._count("chain_refused")
                failed.add(br.block_ids[n])
                log.warning("fleet: block %s of agent %r does not follow its chain; refused", br.block_ids[n][:16],
                            rm.namespace)
            if n < len(br.block_ids):
                complete = False
                self._count("fetch_incomplete")
                br = cut_branch(br, n, pool.block_size)
            if br.block_ids:
                out.append(br)
        out.reverse()
        named = {bid for br in out for bid in br.block_ids}
        return out, [d for bid, d in fetched.items() if bid in named], complete

    def _adopted(self, manifest: Optional[Manifest], version: Optional[int]) -> None:
        """Persister thread, once the fetched agent is durable locally (None: the pool kept its own)."""
        try:
            self._adopted_now(manifest, version)
        except Exception:  # never into the persister's job
            log.exception("fleet: registering a fetched agent failed")

    def _adopted_now(self, manifest: Optional[Manifest], version: Optional[int]) -> None:
        if manifest is None:
            self._count("adopt_skipped")
            return
        with self._lock:
            self.counts["agents_fetched"] += 1
            self.counts["tokens_fetched"] += manifest.n_tokens
        if version is not None:  # this server now holds that version: its next put succeeds it
            self.tier.adopt(manifest.namespace, version)
        mark = publish_mark(manifest)  # what Redis holds: its next save records no publish of it
        if mark > 0.0:
            self._set_mark(manifest.namespace, mark)
        # read the blocks back while the request waits for the worker (page cache: cheap)
        self.pool.prefetch(manifest.namespace)

    def _erased_elsewhere(self, namespace: str, ident: str) -> None:
        """Tier writer thread: a put of ours found the agent erased by another server (erasure
        `ident`: its tombstone, or the era of a history started on it)."""
        self._count("erased_from_fleet")

        def erase_here() -> None:
            try:
                self.pool.erase(namespace, 60.0, False)
            except Exception:  # not erased here: its puts stay refused, and the next one retries this
                log.exception("fleet: erasing agent %r here failed", namespace)
                return
            self.tier.erased_locally(namespace, ident)  # only now may its puts start afresh

        try:
            self._exec.submit(erase_here)
        except RuntimeError:
            pass

    # ---- agent API, stats, shutdown -----------------------------------------------------------------

    def agent_info(self, namespace: str) -> dict:
        """What this server knows of the agent in Redis, without asking it (O(1))."""
        v = self.tier.seen_version(namespace)
        return {"version": v if v >= 0 else None}

    def stats(self) -> dict:
        with self._lock:
            out = dict(self.counts)
            out["syncs_tracked"] = len(self._syncs)
        out.update(self.tier.stats())
        if self.family is not None:
            out.update(self.family.stats())
        out["removals_pending"], out["removals_bound"] = len(self.outbox), self.outbox.bound
        out["wait_s"] = self.wait_s
        return out

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def stop(self) -> None:
        """Start no more syncs (shutdown, before the pool closes). Idempotent."""
        with self._lock:
            self._closed = True
            for fut in self._syncs.values():
                fut.cancel()
            self._syncs.clear()
        self._drain_wake.set()  # the drain thread ends
        self._exec.shutdown(wait=False, cancel_futures=True)

    def close(self, timeout: float = 5.0) -> None:
        """Stop, then send queued writes to Redis within `timeout` and stop the tier. Idempotent."""
        self.stop()
        if self._drainer is not threading.current_thread():
            self._drainer.join(timeout)  # a drain under way ends before the tier closes under it
        self.tier.close(timeout)
