"""The tier's writer: one daemon thread runs puts, erasures and block deletions in order, from a queue
bounded by count and bytes, with retries, back-off and the breaker; a manifest is replaced only by a
compare-and-set (a Lua script on its one key, so it works unchanged on Redis Cluster) after the rules
of manifests.py judged the value it read. Callers (any thread) never wait: they queue."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence, Union

from ..disk_format import BlockData, FormatError, Manifest, check_block_id, check_branches, decode_block, encode_block
from . import manifests as rules
from .auth import Tagger
from .connection import Connection, Lua, RemoteUnavailable
from .eras import Eras
from .keyspace import Keyspace, agent_key_of
from .manifests import FIELDS, Manifests
from .settings import FleetSettings
from .state import TierState

logger = logging.getLogger("vllm_mlx_persist.fleet")

BlockSource = Callable[[str], Union[BlockData, bytes, None]]

_CAS_TRIES = 16  # re-reads of a manifest that changed under one put or erasure before giving up

# Write a manifest key only if it is still the value the writer read and judged: its id (field i,
# fresh random for every value written; '' when absent or missing). One key, so it works unchanged
# on Redis Cluster. The rules (which put wins, tombstones) are applied by the writer in Python,
# where the value's tag can be checked; this script only makes the decision atomic.
#   ARGV: the id read, ttl (0: none), then the new value's field/value pairs. 1: written, 0: changed.
_CAS_LUA = """
local cur = redis.call('HGET', KEYS[1], 'i') or ''
if cur ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
if tonumber(ARGV[2]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return 1
"""


@dataclass
class _Put:
    manifest: Manifest
    blocks: dict[str, Union[BlockData, bytes]]
    gen: int
    nbytes: int
    base_digest: Optional[str] = None  # the history this turn continued (see put's `base`)
    era: str = ""  # this server's era for the agent when queued (changes only with gen)


@dataclass
class _Erase:
    namespace: str
    attempts: int = 0


@dataclass
class _Drop:
    """Blocks a forget edit superseded (the agent's manifest no longer names them)."""

    block_ids: list[str]


class _Conflict(Exception):
    """A manifest changed under one put or erasure _CAS_TRIES times in a row (retried with back-off)."""


def _block_nbytes(b: Union[BlockData, bytes]) -> int:
    if isinstance(b, (bytes, bytearray, memoryview)):
        return len(b)
    return int(b.tokens.nbytes) + sum(int(a.nbytes) for a in b.arrays.values())


class Writer:
    """`put`, `erase`, `drop_blocks` queue; `flush` waits; `close` stops. `block_source(block_id)`:
    the local disk, for blocks a put names that Redis lacks and the put does not carry. `on_erased(
    agent, erasure)`: a put found the agent erased by another server (called on this thread).
    `on_erase_done(agent, erasure)`: an erasure's tombstone is in Redis. `on_put_done(manifest)`: Redis
    holds everything the put's record holds (published, merged, already there), or the agent was
    erased since it was queued (this thread). `branches`, `keep_continued`: what a merged manifest
    keeps (manifests.merged)."""

    def __init__(self, settings: FleetSettings, keys: Keyspace, tagger: Tagger, manifests: Manifests,
                 conn: Connection, eras: Eras, state: TierState, *, block_source: Optional[BlockSource] = None,
                 on_erased: Optional[Callable[[str, str], None]] = None,
                 on_erase_done: Optional[Callable[[str, str], None]] = None,
                 on_put_done: Optional[Callable[[Manifest], None]] = None, branches: int = 4,
                 keep_continued: bool = False):
        self.keys, self.tagger, self.manifests = keys, tagger, manifests
        self.conn, self.eras, self._state = conn, eras, state
        self.block_source = block_source
        self.on_erased = on_erased
        self.on_erase_done = on_erase_done
        self.on_put_done = on_put_done
        self.queue_max, self.queue_max_bytes = settings.queue_max, settings.queue_max_bytes
        self.max_attempts, self.backoff_s, self.backoff_max_s = (settings.max_attempts, settings.backoff_s,
                                                                 settings.backoff_max_s)
        self.block_ttl_s, self.manifest_ttl_s = settings.block_ttl_s, settings.manifest_ttl_s
        self.tombstone_ttl_s = settings.tombstone_ttl_s
        self.branches = max(1, int(branches))  # a merged manifest keeps this many (the pool's `branches`)
        self.keep_continued = keep_continued  # a model with bounded sliding windows: see chain.merge_branches
        self._cas_script = Lua(_CAS_LUA, conn.no_script)

        self._q: deque = deque()
        self._q_puts = 0
        self._puts_of: dict[str, int] = {}  # agent -> its puts queued or running
        self._q_bytes = 0
        self._busy = False
        self._cond = state.cond
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="vllm-mlx-persist-remote-writer", daemon=True)
        self._thread.start()

    # ---- the callers' side (any thread, never waits) ------------------------------------------------

    def put(self, manifest: Manifest, blocks: Optional[Mapping[str, Union[BlockData, bytes]]] = None,
            base: Optional[Manifest] = None) -> bool:
        """Queue publishing `manifest` after the blocks it names (from `blocks`, else block_source);
        False when dropped (queue full by count or bytes, tier closed or disabled). `base`: the
        agent's history this turn continued (its manifest before the turn): a put whose base is the
        value in Redis is its sequential successor even when this server forgot having published
        it (a restart). A put that is no successor is merged with the value in Redis by recency
        (docs/fleet.md, "Which update wins")."""
        agent_key_of(manifest.namespace)
        for b in manifest.block_ids:
            check_block_id(b)
        if manifest.branches is not None:
            check_branches(manifest.branches, set(manifest.block_ids), allow_empty=manifest.record_fields)
        blocks = dict(blocks or {})
        nbytes = sum(_block_nbytes(b) for b in blocks.values())
        with self._cond:
            self._state.c["puts"] += 1
            if (self._closing or self.conn.disabled or self._q_puts >= self.queue_max
                    or (self._q_puts and self._q_bytes + nbytes > self.queue_max_bytes)):
                self._state.c["dropped"] += 1
                return False
            st = self.eras.agent(manifest.namespace)
            self._q.append(_Put(manifest, blocks, st.gen, nbytes,
                                rules.digest(base) if base is not None else None, st.era))
            self._q_puts += 1
            self._q_bytes += nbytes
            self._puts_of[manifest.namespace] = self._puts_of.get(manifest.namespace, 0) + 1
            self._cond.notify()
        return True

    def erase(self, namespace: str, ident: Optional[str] = None) -> bool:
        """Queue erasing the agent from Redis (manifest replaced by a tombstone one version up, so a
        put from before the erasure cannot bring it back); queued puts for it are discarded. This
        server's era for the agent is the new tombstone's id from now on (its later histories follow
        it). Not bounded here (the fleet's outbox bounds the erasures pending, and refuses new ones at
        its bound); retried until done or close(). False if it cannot be queued (closing).
        `ident`: the tombstone's id, chosen by the caller (an erasure kept in the fleet's outbox)."""
        agent_key_of(namespace)
        with self._cond:
            self._state.c["erases"] += 1
            if self._closing:
                self._state.c["errors"] += 1
                logger.error("fleet: cannot queue the erasure of an agent (closing)")
                return False
            self.eras.erasing(namespace, ident)
            self._q.append(_Erase(namespace))
            self._cond.notify()
        return True

    def drop_blocks(self, block_ids: Sequence[str]) -> bool:
        """Queue deleting blocks from Redis now rather than at their TTL: a span directive's forget
        superseded them (queued after the put of the manifest that no longer names them). A fork of
        the agent on another server that still names one reads a miss there. False if not queued."""
        ids = list(block_ids)
        for b in ids:
            check_block_id(b)
        if not ids:
            return True
        with self._cond:
            if self._closing or self.conn.disabled:
                return False
            self._q.append(_Drop(ids))
            self._cond.notify()
        return True

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued write has been done or given up; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._q or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float) -> bool:
        """Stop taking writes, finish queued ones within `timeout` (one attempt each, none while the
        breaker is open), count the rest as dropped, and stop the thread (`join` waits for it).
        False when it was closed already."""
        with self._cond:
            if self._state.stop:
                return False
            self._closing = True
            self._cond.notify_all()
        self.flush(timeout)
        with self._cond:
            self._state.stop = True
            left = [i for i in self._q if isinstance(i, _Put)]
            erasures = [i.namespace for i in self._q if isinstance(i, _Erase)]
            self._state.c["dropped"] += len(left)
            self._q.clear()
            self._q_puts = self._q_bytes = 0
            self._puts_of.clear()
            self._cond.notify_all()
        if erasures:
            logger.error("fleet: %d agent erasure(s) could not reach Redis before shutdown", len(erasures))
            self._state.count("errors", len(erasures))
        return True

    def join(self, timeout: float) -> None:
        self._thread.join(timeout=max(1.0, timeout))

    def putting(self, namespace: str) -> bool:
        """Whether a put of the agent is queued or running (any thread)."""
        with self._cond:
            return namespace in self._puts_of

    def room(self) -> int:
        """Puts the queue takes now (by count)."""
        with self._cond:
            return 0 if self._closing else max(0, self.queue_max - self._q_puts)

    def queued(self) -> tuple[int, int]:
        """(lock held) Writes queued, and the bytes of block data they carry."""
        return len(self._q), self._q_bytes

    # ---- the writer thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._q and not self._state.stop:
                    self._cond.wait()
                if self._state.stop:
                    return
                item = self._q.popleft()
                if isinstance(item, _Put):
                    self._q_puts -= 1
                    self._q_bytes -= item.nbytes
                self._busy = True
            try:
                requeue = self._do(item)
            except Exception:  # a bug must not kill the writer thread
                logger.exception("fleet: writer job failed")
                requeue = False
                self._state.count("errors")
            with self._cond:
                if requeue and not self._state.stop:
                    self._q.append(item)
                elif isinstance(item, _Put):
                    ns = item.manifest.namespace
                    left = self._puts_of.get(ns, 0) - 1
                    if left > 0:
                        self._puts_of[ns] = left
                    else:
                        self._puts_of.pop(ns, None)
                self._busy = False
                self._cond.notify_all()

    def _do(self, item: Union[_Put, _Erase, _Drop]) -> bool:
        """Run one write with retries and back-off; True to requeue it (an erasure not yet done)."""
        conn = self.conn
        for attempt in range(self.max_attempts):
            if not conn.breaker.allow():
                if self._closing:
                    break
                self._sleep(conn.breaker.wait_s())
                if self._state.stop:
                    break
            try:
                conn.ensure_model(conn.write_client)
                if isinstance(item, _Erase):
                    self._erase_now(item.namespace)
                elif isinstance(item, _Drop):
                    for b in item.block_ids:  # one key per call: a cluster's keys lie in many slots
                        self._state.count("blocks_deleted", int(conn.write_client.delete(self.keys.block(b))))
                else:
                    self._put_now(item)
                conn.succeeded()
                return False
            except RemoteUnavailable:
                break
            except (*conn.redis_errors, _Conflict) as e:
                conn.failed("errors", e, transport=isinstance(e, conn.transport_errors))
                if self._closing:
                    break
                self._sleep(min(self.backoff_max_s, self.backoff_s * 2 ** attempt))
        if isinstance(item, _Erase):
            item.attempts += 1
            if self._closing or conn.disabled:
                logger.error("fleet: an agent erasure could not reach Redis before shutdown")
                return False
            return True  # an erasure is never given up while the server runs
        self._state.count("put_failures")
        return False

    def _sleep(self, s: float) -> None:
        with self._cond:
            if not self._closing:
                self._cond.wait_for(lambda: self._closing, timeout=s)

    def _erase_now(self, namespace: str) -> None:
        key = self.keys.manifest(namespace)
        client, eras = self.conn.write_client, self.eras
        for _ in range(_CAS_TRIES):
            cur = self.manifests.judge(key, client.hmget(key, *FIELDS))
            with self._state.lock:
                st = eras.agent(namespace)
                base = st.seen_v
                if not st.era:  # forgotten since erase() chose it (the agents' bound)
                    st.era = secrets.token_hex(8)
                # The id erase() chose, of the latest erasure queued here: an earlier one retried
                # after it writes the same tombstone, so this server's era is what Redis holds.
                ident = st.era
            seen = ident  # the value this server holds once done: its tombstone
            if cur.state == "ok" and cur.erased and cur.ident == ident:
                version = cur.version  # written already (its reply was lost, or a later erasure's)
                break
            theirs = self.manifests.parse(cur.body, namespace) if cur.state == "ok" and not cur.erased else None
            if theirs is not None and theirs.era == ident:
                # written already, and a history begun on it since (the outbox sent it again after a
                # restart): that history is newer than the erasure, and stays; not this server's, so
                # its next put merges with it.
                version, seen = cur.version, ""
                break
            if cur.state in ("refused", "foreign"):
                self.manifests.refused(cur, "replaced by an erasure")
            # One version above anything this server or Redis knew of the agent. An erasure replaces
            # whatever is there, a value it cannot judge included: the agent's owner asked for it.
            version = max(cur.version if cur.state == "ok" else -1, base, 0) + 1
            fields = self.manifests.fields(key, version, ident, True)
            if int(self._cas_script(client, [key], [cur.raw_id, self.tombstone_ttl_s, *fields])):
                break
        else:
            raise _Conflict(f"an agent's manifest changed under its erasure {_CAS_TRIES} times")
        with self._state.lock:
            eras.erased(namespace, version, seen)
            self._state.c["erases_done"] += 1
        if self.on_erase_done is not None:
            try:
                self.on_erase_done(namespace, ident)
            except Exception:
                logger.exception("fleet: on_erase_done callback failed")

    def _put_now(self, p: _Put) -> None:
        m = p.manifest
        if self._stale(p):  # erased since: nothing of it may reach Redis, and nothing needs to
            self._put_done(m)
            return
        key = self.keys.manifest(m.namespace)
        client, state, eras = self.conn.write_client, self._state, self.eras
        # Blocks first: which does Redis lack? (EXPIRE doubles as EXISTS and keeps a live agent's
        # blocks from expiring.) The manifest's current value comes in the same round trip. Single-key
        # commands only, so this works on Redis Cluster too.
        keys = [self.keys.block(b) for b in m.block_ids]
        pipe = client.pipeline(transaction=False)
        for k in keys:
            if self.block_ttl_s > 0:
                pipe.expire(k, self.block_ttl_s)
            else:
                pipe.exists(k)
        pipe.hmget(key, *FIELDS)
        *present, values = pipe.execute()
        state.count("blocks_present", sum(1 for there in present if there))
        for bid, bkey, there in zip(m.block_ids, keys, present):
            if there:
                continue
            value = self._block_bytes(bid, p.blocks.get(bid))
            if value is None:
                state.count("puts_incomplete")
                logger.warning("fleet: block %s of an agent is in neither the put nor the local store; "
                               "manifest not published", bid)
                return
            value = self.tagger.wrap_block(bkey, value)
            client.set(bkey, value, nx=True, ex=self.block_ttl_s if self.block_ttl_s > 0 else None)
            with state.lock:
                state.c["blocks_uploaded"] += 1
                state.c["bytes_up"] += len(value)
                state.block_size_seen = max(state.block_size_seen, len(value))
        digest, body = rules.digest(m), self.manifests.body(m, p.era)
        for attempt in range(_CAS_TRIES):
            if attempt:  # changed since it was read: judge the new value
                values = client.hmget(key, *FIELDS)
            cur = self.manifests.judge(key, values)
            theirs = self.manifests.parse(cur.body, m.namespace) if cur.state == "ok" and not cur.erased else None
            # The erasure check and the base are read together: an erasure this server makes or sees
            # after this point changes the value (or the base), so the compare-and-set refuses.
            with state.lock:
                stale = self._stale(p, locked=True)
                st = eras.agent(m.namespace)
                seen_v, seen_id = st.seen_v, st.seen_id
            if stale:
                self._put_done(m)
                return
            cur_era = cur.ident if cur.erased else (theirs.era or "") if theirs is not None else ""
            outcome, version = rules.decide(cur, seen_v, seen_id, digest, p.base_digest, p.era, cur_era)
            value = m  # what is written: the put, or (a concurrent update) the put merged with the current
            if outcome == "merge":
                value = rules.merged(m, theirs, self.branches, self.keep_continued, p.blocks)
                if value is None:
                    outcome = "kept"
            if outcome not in ("publish", "merge", "outdated"):
                break
            d, b = (digest, body) if value is m else (rules.digest(value), self.manifests.body(value, p.era))
            ident = secrets.token_hex(8)
            fields = self.manifests.fields(key, version, ident, False, int(value.n_tokens), d, b)
            if int(self._cas_script(client, [key], [cur.raw_id, self.manifest_ttl_s, *fields])):
                if cur.state == "refused":
                    self.manifests.refused(cur, "replaced by a put")
                break
        else:
            raise _Conflict(f"an agent's manifest changed under its put {_CAS_TRIES} times")
        with state.lock:
            # A merged value holding another server's branches is not this server's history: its
            # next put merges again (until a sync fetches them), so it never drops them unseen.
            if outcome in ("publish", "outdated") or (outcome == "merge" and rules.content(value) <= rules.content(m)):
                st.seen_v, st.seen_id = version, ident
            elif outcome == "same":  # the same history already there: this server holds it too
                st.seen_v, st.seen_id = cur.version, cur.ident
            state.c[{"publish": "puts_published", "merge": "puts_merged", "same": "puts_same",
                     "kept": "puts_kept_other", "erased": "puts_erased", "foreign": "puts_foreign",
                     "outdated": "puts_outdated"}[outcome]] += 1
            # Another server erased the agent after this one last looked (a tombstone, or a history
            # of a newer era on top of it). The owner drops its copy and then calls
            # erased_locally(agent, erasure); until then every put of the agent is refused here. Not
            # when an erasure was made or met here since the put was judged: that one decides.
            met = outcome == "erased" and st.gen == p.gen and m.namespace not in eras.pending_erase
            if met:
                eras.meet_erasure(st, cur.version, cur_era)
        if outcome == "foreign":
            self.manifests.refused(cur, "a put left it alone")
            return
        if met and self.on_erased is not None:
            try:
                self.on_erased(m.namespace, cur_era)
            except Exception:
                logger.exception("fleet: on_erased callback failed")
        # Written, merged or held already; or the agent erased by another server (nothing of it may
        # come back): what the put's record holds needs no other put.
        self._put_done(m)

    def _put_done(self, m: Manifest) -> None:
        if self.on_put_done is not None:
            try:
                self.on_put_done(m)
            except Exception:
                logger.exception("fleet: on_put_done callback failed")

    def _stale(self, p: _Put, locked: bool = False) -> bool:
        """Whether the put's agent was erased (here, or seen erased) after the put was queued."""
        if not locked:
            with self._state.lock:
                return self._stale(p, locked=True)
        if self.eras.agent(p.manifest.namespace).gen != p.gen or p.manifest.namespace in self.eras.pending_erase:
            self._state.c["puts_stale"] += 1
            return True
        return False

    def _block_bytes(self, block_id: str, given: Union[BlockData, bytes, None]) -> Optional[bytes]:
        """The block file's bytes, verified before they leave this server."""
        data = given
        if data is None and self.block_source is not None:
            try:
                data = self.block_source(block_id)
            except Exception as e:  # the local store's trouble is a missing block here, not a crash
                logger.warning("fleet: block_source(%s) failed: %s", block_id, e)
                data = None
        if data is None:
            return None
        if isinstance(data, BlockData):
            if data.block_id != block_id:
                raise ValueError(f"put: block {data.block_id} given for id {block_id}")
            return encode_block(data)
        raw = bytes(data)
        try:
            decode_block(raw, block_id)
        except FormatError as e:
            logger.warning("fleet: local block %s is damaged (%s); not uploaded", block_id, e)
            return None
        return raw
