"""The fleet tier's Redis side: KV blocks and agent manifests in Redis, shared by every server serving
one model. `RemoteTier` is its front, composing the parts, each one job:

    auth.py        the secret; tags and MACs binding values to their keys
    keyspace.py    where values live (the keyspace of REMOTE_FORMAT_VERSION), the model record
    connection.py  the clients, what counts as a failure, the breaker, the model check
    manifests.py   manifest values: judged, tagged, parsed; which update wins, the merge
    eras.py        this server's view of each agent (what it holds, the erasure it follows)
    reads.py       bounded reads of manifests and blocks, verified
    writer.py      the write queue and its thread: puts, erasures, retries, compare-and-set
    state.py       what they share: one lock, the counters

Runtime code: numpy and bytes only, never MLX. Layout, versions, authentication, conflict rule,
sizing and faults are in docs/fleet.md. The interface the fleet glue (sync.Fleet) calls, and on which
thread:

    tier = RemoteTier(FleetSettings(url, secret=..., cluster=...),  # start-up; connects lazily, never
                      fingerprint, block_source=...)                # raises for an unreachable Redis
    tier.get_manifest(agent, timeout=None, check=False)     # any thread; at most read_timeout_s
                -> RemoteManifest | None                    # (or timeout; check: on the admission
                                                            # checks' own reader);
                                                            # erased=True: a tombstone (.seen: this
                                                            # server already acted on it); .erasure:
                                                            # one to act on before using the value
                                                            # (a tombstone, or a newer era's history);
                                                            # .outdated: from before this server's era
    tier.get_block(block_id) -> BlockData | None            # any thread; at most read_timeout_s;
                                                            # verified exactly as a disk block
    tier.get_blocks(block_ids) -> list[BlockData]           # any thread; pipelined round trips of
                                                            # bounded size, each at most read_timeout_s;
                                                            # the blocks up to the first one not served
    tier.put(manifest, blocks=None, base=None) -> bool      # any thread; never blocks: queues the
                                                            # upload, False when dropped (queue full);
                                                            # a concurrent update is merged with it
    tier.erase(agent, ident=None) -> bool                   # any thread; never blocks: queued (the
                                                            # outbox bounds them), retried until done or
                                                            # close(); on_erase_done(agent, ident) once
                                                            # in Redis; on_put_done(manifest) once a put's
                                                            # record is (or need not be)
    tier.putting(agent) -> bool                             # any thread: a put of it queued or running
    tier.erasing(agent) -> bool                             # any thread: an erasure of it queued
    tier.room() -> int                                      # any thread: puts the queue takes now
    tier.drop_blocks(block_ids) -> bool                     # any thread: a forget's superseded blocks
    tier.erased_locally(agent, ident) -> bool               # any thread: this server dropped its copy
                                                            # because of erasure `ident` (from
                                                            # get_manifest's .erasure or on_erased(agent,
                                                            # ident)); its puts may now start a new
                                                            # history, of that era
    tier.era(agent) -> str                                  # any thread: the erasure this server's
                                                            # histories of the agent follow ('' none):
                                                            # stamped in its local manifests
    tier.known_era(agent, era)                              # start-up: a local manifest's era
    tier.adopt(agent, version)                              # any thread: this server now holds that
                                                            # version (read by get_manifest lately)
    tier.release(agent)                                     # any thread: it holds no copy any more
    tier.seen_version(agent) -> int                         # any thread, O(1): the version it holds
    tier.flush(timeout) -> bool                             # wait for queued writes (tests, shutdown)
    tier.stats() -> dict                                    # O(1) counters
    tier.close(timeout)                                     # flush within the bound, stop the threads

`get_*` return None for every failure (absent, refused, not ours, Redis down or slow, breaker open):
the caller treats it as a miss and carries on from memory and local disk. `put` is meant to be called
once the turn is durable locally (e.g. at the end of the local write job), with the new blocks'
data if at hand; blocks the manifest names that Redis lacks and `blocks` does not hold are read
through `block_source(block_id)` (the local disk), so a dropped put heals at the agent's next one.
No method raises for a Redis fault; only misuse (bad ids, wrong types) raises.

Threads: one daemon writer thread runs puts and erasures in order; `read_threads` daemon threads
run reads so a caller can give up at its deadline even on a hung socket.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from ..disk_format import BlockData, Manifest
from .auth import SECRET_ENV, Tagger
from .connection import Connection
from .eras import Eras
from .keyspace import Keyspace
from .manifests import Manifests, RemoteManifest
from .reads import Reads
from .settings import FleetSettings
from .state import TierState
from .writer import BlockSource, Writer

logger = logging.getLogger("vllm_mlx_persist.fleet")


class RemoteTier:
    """Blocks (content-addressed, SET NX) and per-agent manifests (versioned, compare-and-set by a
    Lua script) in one Redis, or a Redis Cluster (`settings.cluster`: every command touches one key),
    for one model fingerprint, in the keyspace of this REMOTE_FORMAT_VERSION (and of the secret's key
    id when there is one). With `settings.secret`, every value carries an HMAC-SHA256 bound to its key
    and a value without a valid one is never used. See the module docstring for the interface;
    `block_source`, `on_erased`, `branches`, `keep_continued`: writer.Writer's."""

    def __init__(self, settings: FleetSettings, fingerprint: str, *, block_source: Optional[BlockSource] = None,
                 on_erased: Optional[Callable[[str, str], None]] = None,
                 on_erase_done: Optional[Callable[[str, str], None]] = None,
                 on_put_done: Optional[Callable[[Manifest], None]] = None, branches: int = 4,
                 keep_continued: bool = False):
        if not isinstance(fingerprint, str) or len(fingerprint) < 32:
            raise ValueError("fingerprint must be a string of at least 32 characters")
        self.settings, self.fingerprint = settings, fingerprint
        tagger = self.tagger = Tagger(settings.secret or None)
        self.authenticated, self.key_id = tagger.authenticated, tagger.key_id
        keys = self.keys = Keyspace(settings.key_prefix, fingerprint, tagger)
        state = self._state = TierState()
        self.manifests = Manifests(tagger, fingerprint, state)
        conn = self.conn = Connection(settings, keys, tagger, state)
        self.cluster, self.url_redacted = conn.cluster, conn.url_redacted
        eras = self.eras = Eras(state, settings.max_agents)
        self.reads = Reads(settings, keys, tagger, self.manifests, conn, eras, state)
        self.writer = Writer(settings, keys, tagger, self.manifests, conn, eras, state, block_source=block_source,
                             on_erased=on_erased, on_erase_done=on_erase_done, on_put_done=on_put_done,
                             branches=branches,
                             keep_continued=keep_continued)
        # The writer is a daemon thread: give queued writes a short, bounded chance at exit.
        ref = weakref.ref(self)
        self._atexit = lambda: (t := ref()) is not None and t.close(2.0)
        atexit.register(self._atexit)
        if self.authenticated:
            logger.info("fleet: values in Redis are authenticated (HMAC-SHA256, key id %s; keyspace %s*)",
                        self.key_id, keys.prefix)
        else:
            logger.warning("fleet: the fleet tier is UNAUTHENTICATED: anyone who can write to this Redis can plant "
                           "KV that this server serves, or erase agents; set %s or remote_secret_file on every "
                           "server (docs/fleet.md, Authentication)", SECRET_ENV)

    # ---- keys ---------------------------------------------------------------------------------------

    def block_key(self, block_id: str) -> str:
        return self.keys.block(block_id)

    def manifest_key(self, namespace: str) -> str:
        return self.keys.manifest(namespace)

    # ---- reads (any thread, bounded): reads.Reads ------------------------------------------------------

    def get_manifest(self, namespace: str, timeout: Optional[float] = None,
                     check: bool = False) -> Optional[RemoteManifest]:
        return self.reads.get_manifest(namespace, timeout, check)

    def get_block(self, block_id: str) -> Optional[BlockData]:
        return self.reads.get_block(block_id)

    def get_blocks(self, block_ids: Sequence[str], max_bytes: Optional[int] = None) -> list[BlockData]:
        return self.reads.get_blocks(block_ids, max_bytes)

    # ---- writes (queued): writer.Writer ----------------------------------------------------------------

    def put(self, manifest: Manifest, blocks: Optional[Mapping[str, Union[BlockData, bytes]]] = None,
            base: Optional[Manifest] = None) -> bool:
        return self.writer.put(manifest, blocks, base)

    def erase(self, namespace: str, ident: Optional[str] = None) -> bool:
        return self.writer.erase(namespace, ident)

    def drop_blocks(self, block_ids: Sequence[str]) -> bool:
        return self.writer.drop_blocks(block_ids)

    def putting(self, namespace: str) -> bool:
        return self.writer.putting(namespace)

    def erasing(self, namespace: str) -> bool:
        """Whether an erasure of the agent is queued (any thread)."""
        with self._state.lock:
            return namespace in self.eras.pending_erase

    def room(self) -> int:
        return self.writer.room()

    def flush(self, timeout: Optional[float] = None) -> bool:
        return self.writer.flush(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stop taking writes, finish queued ones within `timeout` (one attempt each, none while the
        breaker is open), count the rest as dropped, and stop the threads. Idempotent."""
        if not self.writer.close(timeout):
            return
        atexit.unregister(self._atexit)
        self.writer.join(timeout)
        self.reads.close()
        self.conn.close()

    # ---- this server's view of an agent (O(1), no Redis): eras.Eras -----------------------------------

    def seen_version(self, namespace: str) -> int:
        return self.eras.seen_version(namespace)

    def adopt(self, namespace: str, version: int) -> None:
        self.eras.adopt(namespace, version)

    def release(self, namespace: str) -> None:
        self.eras.release(namespace)

    def erased_locally(self, namespace: str, ident: str) -> bool:
        return self.eras.erased_locally(namespace, ident)

    def era(self, namespace: str) -> str:
        return self.eras.era(namespace)

    def known_era(self, namespace: str, era: Optional[str]) -> None:
        self.eras.known_era(namespace, era)

    # ---- stats -----------------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Counters and state (O(1))."""
        state, conn = self._state, self.conn
        with state.lock:
            out: dict[str, Any] = dict(state.c)
            out["queue_depth"], out["queue_bytes"] = self.writer.queued()
            out["erasures_pending"] = len(self.eras.pending_erase)
        out["breaker_opens"] = conn.breaker.opens
        out["breaker_open"] = not conn.breaker.allow()
        out["connected"] = bool(conn.connected) and conn.breaker.allow() and not conn.disabled
        out["state"] = conn.disabled or ("ok" if out["connected"] else
                                         "not contacted yet" if conn.connected is None else "unreachable")
        out["url"] = self.url_redacted
        out["authenticated"] = self.authenticated
        out["key_id"] = self.key_id
        out["keyspace"] = self.keys.prefix
        return out
