"""Fleet tier: KV blocks and agent manifests in Redis, shared by every server serving one model.

Runtime module: numpy and bytes only, never MLX. Layout, versions, authentication, conflict rule,
sizing and faults are in docs/fleet.md. The interface the pool (or persister) calls, and on which thread:

    tier = RemoteTier(url, fingerprint, block_source=...,   # start-up; connects lazily, never raises
                      secret=None,                          # for an unreachable Redis; secret: bytes
                      cluster=False)                        # shared by the fleet, every value carries
                                                            # an HMAC; cluster=True: a Redis Cluster
    tier.get_manifest(agent) -> RemoteManifest | None       # any thread; at most read_timeout_s;
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
    tier.erase(agent) -> bool                               # any thread; never blocks: queued ahead
                                                            # of the bound, retried until done or close()
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
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import stat
import threading
import time
import weakref
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from .chain import (Removal, branches_of, manifest_of, merge_branches, merge_removals, removals_of,
                    same_branches, surviving_removals)
from .disk_format import (BLOCK_FORMAT, FORMAT_VERSION, MAX_REMOVALS, BlockData, FormatError, Manifest, agent_key,
                          block_metadata, canonical_json, check_block_id, check_branches, check_era, check_removals,
                          decode_block, encode_block, header_length)

logger = logging.getLogger("vllm_mlx_persist.remote")

# The version of everything this tier writes to Redis: key layout, block values, manifest fields and
# body, tags. It names the keyspace (vmp:<fingerprint[:32]>:r2:...), and a build reads and writes
# only its own, so builds of different versions sharing one Redis never see each other's values.
# Rule (docs/fleet.md, "Versions"): a build may write into keyspace rN only what every build that
# reads rN accepts; any change an older reader of rN would refuse (a new block checksum kind or
# disk_format.FORMAT_VERSION, a manifest field it cannot ignore, another tag or MAC layout) bumps it.
# r3: a manifest is the agent's whole record, with spliced branches ("generation") and removal records
# an r2 reader would ignore (serving spliced K/V as honest, merging removed branches back).
REMOTE_FORMAT_VERSION = 3
# The block checksum kinds every r2 reader verifies (disk_format.decode_block): the only ones r2 may hold.
BLOCK_CHECKSUM_KINDS = ("crc32", "sha256")

# The fleet's shared secret, from this environment variable or a file (backend option
# remote_secret_file), never from the command line. Shorter secrets are refused.
SECRET_ENV = "VLLM_MLX_PERSIST_FLEET_SECRET"
MIN_SECRET_BYTES = 16

_MANIFEST_FORMAT = "vllm-mlx-persist.remote-manifest"
_MODEL_FORMAT = "vllm-mlx-persist.remote-model"
_TAG_KINDS = ("sha256", "hmac-sha256")  # a manifest's tag: unkeyed without a secret, HMAC with one
_MAC_MAGIC = b"vmp-hmac"  # an authenticated block value ends with this and its 32-byte HMAC
_MAC_TRAILER = len(_MAC_MAGIC) + 32
_FIELDS = ("v", "i", "e", "n", "d", "body", "m")  # a manifest hash's fields (docs/fleet.md)
_CAS_TRIES = 16  # re-reads of a manifest that changed under one put or erasure before giving up
_READ_IDS = 4  # versions -> ids of the last manifests read per agent, for adopt()

BlockSource = Callable[[str], Union[BlockData, bytes, None]]

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

# Delete a refused value only if it is still the one we read (not a good copy written meanwhile).
_DEL_IF_LUA = """
local cur = redis.call('GET', KEYS[1])
if cur and redis.sha1hex(cur) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def load_secret(secret_file: Optional[str] = None, environ: Optional[Mapping[str, str]] = None) -> Optional[bytes]:
    """The fleet's shared secret: the content of `secret_file`, or the environment variable
    SECRET_ENV, surrounding whitespace stripped; None when neither is set. ValueError when both are
    set, the file cannot be read, or the secret is shorter than MIN_SECRET_BYTES."""
    env = os.environ if environ is None else environ
    from_env = env.get(SECRET_ENV)
    if secret_file is not None and from_env is not None:
        raise ValueError(f"persist_q4: the fleet secret is set twice (remote_secret_file and {SECRET_ENV}); set one")
    if secret_file is not None:
        try:
            with open(secret_file, "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                secret = f.read(1 << 16).strip()
        except OSError as e:
            raise ValueError(f"persist_q4: cannot read remote_secret_file: {e}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning("fleet: remote_secret_file %s is open to other users (mode %o); chmod 600 it",
                           secret_file, stat.S_IMODE(mode))
        where = "remote_secret_file"
    elif from_env is not None:
        secret, where = from_env.strip().encode(), SECRET_ENV
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"persist_q4: the fleet secret ({where}) has {len(secret)} bytes; at least "
                         f"{MIN_SECRET_BYTES} are needed (e.g. openssl rand -hex 32)")
    return secret


class _Tagger:
    """Tags binding a value to its Redis key: HMAC-SHA256 under a key derived from the fleet's
    secret, or without a secret plain sha256 (catches damage, but anyone can recompute it)."""

    def __init__(self, secret: Optional[bytes]):
        self.kind = "hmac-sha256" if secret else "sha256"
        self._key = hmac.digest(secret, b"vllm-mlx-persist fleet mac 1", "sha256") if secret else None
        # Names the keyspace: servers with different secrets never read each other's values.
        self.key_id = hmac.digest(secret, b"vllm-mlx-persist fleet key id 1", "sha256").hex()[:16] if secret else None

    def digest(self, domain: bytes, key: str, parts: Sequence[Union[bytes, memoryview]]) -> bytes:
        h = hmac.new(self._key, digestmod="sha256") if self._key is not None else hashlib.sha256()
        for part in (domain, key.encode(), *parts):  # length-prefixed: no two splits hash alike
            h.update(len(part).to_bytes(8, "big"))
            h.update(part)
        return h.digest()

    def tag(self, domain: bytes, key: str, parts: Sequence[bytes]) -> bytes:
        return self.kind.encode() + b":" + self.digest(domain, key, parts).hex().encode()

    def check(self, tag: Optional[bytes], domain: bytes, key: str, parts: Sequence[bytes]) -> Optional[str]:
        """None if `tag` is this tier's tag of the value under `key`; else 'missing', 'wrong' (of
        another kind than ours, e.g. unauthenticated, or not matching) or 'unknown' (a kind this
        build does not know)."""
        if not tag:
            return "missing"
        kind, sep, _ = tag.partition(b":")
        if not sep or kind.decode("ascii", "replace") not in _TAG_KINDS:
            return "unknown"
        return None if hmac.compare_digest(tag, self.tag(domain, key, parts)) else "wrong"


_FAILED = object()  # a read that did not reach Redis (as opposed to a key that is absent)


class RemoteUnavailable(Exception):
    """Internal: Redis could not be reached (or the tier is disabled); the operation was not done."""


@dataclass
class RemoteManifest:
    """An agent's manifest as Redis holds it. `erased`: a tombstone (no blocks).

    `block_ids` lists every block the manifest names (newest branch first), `n_tokens` is the
    newest branch's, and `branches` is the agent's branches, least recently used first, in the
    disk manifest's schema ({"block_ids", "n_tokens", "links"}, docs/disk-format.md): one plain
    chain seeded with the agent for a manifest without branches (an agent that never branched or
    forked). `ident` names this very value (fresh for every value written); `seen`: this server
    already holds it (published or adopted it, or, for a tombstone, erased its copy because of it).

    `era`: the erasure the value's history follows (the id of the tombstone it was started on; ''
    none; a tombstone's is its own id). `erasure`: an erasure this server has not acted on, which it
    must act on before it uses the value (erase its copy, then `erased_locally(agent, erasure)`): an
    unseen tombstone's id, or the era of a history started after an erasure this server never
    acted on. `outdated`: a history from before the erasure this server's histories follow (it
    says none while this server's era is one): nothing of it may be used, and this server's next
    put replaces it (docs/fleet.md, Erasure)."""

    namespace: str
    block_ids: list[str]
    n_tokens: int
    updated_at: float
    version: int
    erased: bool = False
    branches: list = field(default_factory=list)
    ident: str = ""
    seen: bool = False
    era: str = ""
    erasure: str = ""
    outdated: bool = False
    removals: tuple[Removal, ...] = ()  # content forget edits removed (chain.Removal): merges apply them
    spliced_cleared: float = 0.0  # spliced branches used at or before this are removed too


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


@dataclass
class _AgentState:
    # The value this server last published, adopted, or erased its copy for: a put whose base it is
    # succeeds it (a sequential successor). Compared by id, never by version alone: versions start
    # again from the writer's memory once a key expires, so equal versions can be different values.
    seen_v: int = -1
    seen_id: str = ""
    # The newest erasure met (a tombstone, or a history of another era: read, or refusing a put) that
    # this server has not yet erased its copy for (erased_locally): until then every put of the
    # agent is refused by it.
    tomb_v: int = -1
    tomb_id: str = ""
    # The erasure this server's histories of the agent follow: the id of the last tombstone it wrote
    # (its own erasure) or erased its copy for; '' none. Every put carries it (docs/fleet.md, Erasure).
    era: str = ""
    read: dict = field(default_factory=dict)  # version -> id of the last live manifests read (adopt)
    gen: int = 0  # changes on every erasure seen here: queued puts from before it are stale


@dataclass
class _Current:
    """A manifest key's value as the writer or a reader found it, judged: `state` is 'absent',
    'ok', 'refused' (its tag is missing or wrong, or it is malformed: not a value of this fleet) or
    'foreign' (a tag of a kind this build does not know, without a secret: left alone)."""

    state: str
    raw_id: bytes = b""  # its i field as stored: what the compare-and-set expects
    version: int = -1
    ident: str = ""
    erased: bool = False
    n_tokens: int = -1
    digest: str = ""
    body: Optional[bytes] = None
    why: str = ""


class _Conflict(Exception):
    """A manifest changed under one put or erasure _CAS_TRIES times in a row (retried with back-off)."""


class _Breaker:
    """After `failures` consecutive transport failures, refuse calls for `open_s` seconds; then let
    calls through again (one more failure reopens it at once, a success closes it)."""

    def __init__(self, failures: int, open_s: float):
        self.failures, self.open_s = failures, open_s
        self._fails, self._open_until, self.opens = 0, 0.0, 0
        self._lock = threading.Lock()

    def allow(self) -> bool:
        return time.monotonic() >= self._open_until

    def wait_s(self) -> float:
        return max(0.0, self._open_until - time.monotonic())

    def ok(self) -> None:
        self._fails = 0

    def fail(self) -> None:
        with self._lock:
            self._fails += 1
            if self._fails >= self.failures:
                self._open_until = time.monotonic() + self.open_s
                self.opens += 1


def _block_nbytes(b: Union[BlockData, bytes]) -> int:
    if isinstance(b, (bytes, bytearray, memoryview)):
        return len(b)
    return int(b.tokens.nbytes) + sum(int(a.nbytes) for a in b.arrays.values())


def _content(m: Manifest) -> set:
    """A manifest's branches as a set of (block ids, tokens), recency and order aside."""
    return {(tuple(br.block_ids), br.n_tokens) for br in branches_of(m)}


def _newer_block(data: Any) -> Optional[str]:
    """What a block value that failed decode_block says it is, when that is our block format in
    a version or with a checksum kind this build does not know (a value not ours to judge, so not
    to delete); None for anything else (damaged: its header does not parse or its checks fail)."""
    try:
        meta = block_metadata(data[8 : 8 + header_length(data[:8], len(data))])
        fmt, version, checksum = meta["format"], meta["format_version"], meta["checksum"]
    except (FormatError, KeyError):
        return None
    if fmt != BLOCK_FORMAT or not isinstance(version, str) or not isinstance(checksum, str):
        return None
    if version != str(FORMAT_VERSION) and version.isdigit():
        return f"block format version {version}"
    kind, sep, _ = checksum.partition(":")
    if sep and re.fullmatch(r"[a-z0-9][a-z0-9-]{0,31}", kind) and kind not in BLOCK_CHECKSUM_KINDS:
        return f"a block with a {kind} checksum"
    return None


def _agent_key(namespace: str) -> str:
    if not isinstance(namespace, str) or not namespace:
        raise ValueError("agent id (namespace) must be a non-empty string")
    return agent_key(namespace)


def _import_redis():
    try:
        import redis
        import redis.cluster
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError:
        raise ImportError(
            "remote_url is set but the Redis client is not installed: "
            'pip install "vllm-mlx-persist[fleet]" (or: pip install "redis>=5")'
        ) from None
    return redis, Retry, NoBackoff


class _LazyClient:
    """A client made at its first use, then kept: redis-py's RedisCluster connects in its constructor
    (it discovers the nodes and slots), and the tier must start, and keep trying, without Redis. A
    failed construction raises to the caller (a transport failure) and is tried again next time."""

    def __init__(self, make: Callable[[], Any]):
        self._make, self._made, self._lock = make, None, threading.Lock()

    def get(self) -> Any:
        made = self._made
        if made is None:
            with self._lock:
                if self._made is None:
                    self._made = self._make()
                made = self._made
        return made

    def __getattr__(self, name: str) -> Any:
        return getattr(self.get(), name)

    def close(self) -> None:
        if self._made is not None:
            self._made.close()


class _Lua:
    """A Lua script on one key: EVALSHA, and EVAL on a script-cache miss (which caches it there).
    Unlike redis-py's Script (SCRIPT LOAD, sent to every primary of a Cluster), it only ever talks
    to the key's own node, so one Cluster node down does not stop scripts on the others."""

    def __init__(self, text: str, no_script: type):
        self.text, self.sha, self._no_script = text, hashlib.sha1(text.encode()).hexdigest(), no_script

    def __call__(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except self._no_script:
            return client.eval(self.text, len(keys), *keys, *args)


class RemoteTier:
    """Blocks (content-addressed, SET NX) and per-agent manifests (versioned, compare-and-set by a
    Lua script) in one Redis, or a Redis Cluster with `cluster=True` (every command touches one key),
    for one model fingerprint, in the keyspace of this REMOTE_FORMAT_VERSION (and of the secret's key
    id when there is one). With `secret`, every value carries an HMAC-SHA256 bound to its key and a
    value without a valid one is never used. See the module docstring for the interface."""

    def __init__(
        self,
        url: str,
        fingerprint: str,
        *,
        block_source: Optional[BlockSource] = None,
        read_timeout_s: float = 2.0,
        connect_timeout_s: float = 0.5,
        write_timeout_s: float = 10.0,
        queue_max: int = 256,
        queue_max_bytes: int = 1 << 30,
        max_attempts: int = 4,
        backoff_s: float = 0.2,
        backoff_max_s: float = 5.0,
        breaker_failures: int = 3,
        breaker_open_s: float = 5.0,
        read_threads: int = 2,
        fetch_blocks: int = 16,
        fetch_bytes: int = 16 << 20,
        block_ttl_s: int = 7 * 86400,
        manifest_ttl_s: int = 30 * 86400,
        tombstone_ttl_s: Optional[int] = None,
        key_prefix: str = "vmp",
        max_agents: int = 100_000,
        max_erasures: int = 10_000,
        on_erased: Optional[Callable[[str, str], None]] = None,
        cluster: bool = False,
        secret: Union[bytes, str, None] = None,
        branches: int = 4,
        keep_continued: bool = False,
    ):
        if not isinstance(fingerprint, str) or len(fingerprint) < 32:
            raise ValueError("fingerprint must be a string of at least 32 characters")
        # A tombstone must outlive every manifest it may have replaced, or a server still holding
        # that history could publish it again once the tombstone is gone (docs/fleet.md, Erasure).
        if tombstone_ttl_s is None:
            tombstone_ttl_s = manifest_ttl_s
        if manifest_ttl_s > 0 and 0 < tombstone_ttl_s < manifest_ttl_s or manifest_ttl_s <= 0 < tombstone_ttl_s:
            raise ValueError("tombstone_ttl_s must be at least manifest_ttl_s (0: no TTL for either)")
        if isinstance(secret, str):
            secret = secret.encode()
        if secret is not None and len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the fleet secret must have at least {MIN_SECRET_BYTES} bytes")
        if queue_max < 1 or read_threads < 1 or max_attempts < 1 or fetch_blocks < 1 or fetch_bytes < 1:
            raise ValueError("queue_max, read_threads, max_attempts, fetch_blocks and fetch_bytes must be at least 1")
        redis, Retry, NoBackoff = _import_redis()
        # RedisClusterException (not a RedisError): no node of a Cluster reachable, slots not covered;
        # ClusterError: CLUSTERDOWN (a master failed, full coverage required), redirections exhausted.
        cluster_errors = (redis.exceptions.RedisClusterException, redis.exceptions.ClusterError)
        self._redis_errors = (redis.exceptions.RedisError, OSError, *cluster_errors)
        self._timeout_errors = (redis.exceptions.TimeoutError, TimeoutError)
        self._transport_errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError,
                                  *cluster_errors)
        self.cluster = bool(cluster)
        if self.cluster:
            self._check_cluster_url(url, redis)
        # One attempt per command (our breaker and writer retries decide what happens next); every
        # socket operation is bounded. The pool holds at most one connection per thread of ours (on
        # a Cluster: per node; MOVED/ASK redirections are still followed, they are not failures).
        self._client = self._make_client(url, redis, Retry, NoBackoff, read_timeout_s, connect_timeout_s,
                                         read_threads + 2)
        self._write_client = self._make_client(url, redis, Retry, NoBackoff, write_timeout_s, connect_timeout_s,
                                               1)
        self.url_redacted = self._redact(url)
        self.fingerprint = fingerprint
        self.block_source = block_source
        self.read_timeout_s = read_timeout_s
        self.fetch_blocks, self.fetch_bytes = fetch_blocks, fetch_bytes
        self._block_size_seen = 0  # the largest block value read or written: sizes fetch round trips
        self.queue_max, self.queue_max_bytes = queue_max, queue_max_bytes
        self.max_attempts, self.backoff_s, self.backoff_max_s = max_attempts, backoff_s, backoff_max_s
        self.block_ttl_s, self.manifest_ttl_s, self.tombstone_ttl_s = block_ttl_s, manifest_ttl_s, tombstone_ttl_s
        self.max_agents, self.max_erasures = max_agents, max_erasures
        self.on_erased = on_erased
        self.branches = max(1, int(branches))  # a merged manifest keeps this many (the pool's `branches`)
        self.keep_continued = keep_continued  # a model with bounded sliding windows: see chain.merge_branches
        self._tagger = _Tagger(secret or None)
        self.authenticated = secret is not None
        self.key_id = self._tagger.key_id
        self._prefix = (f"{key_prefix}:{fingerprint[:32]}:r{REMOTE_FORMAT_VERSION}:"
                        + (f"k{self.key_id}:" if self.key_id else ""))
        self._model_key = self._prefix + "model"
        model = {"format": _MODEL_FORMAT, "remote_version": REMOTE_FORMAT_VERSION, "format_version": FORMAT_VERSION,
                 "fingerprint": fingerprint, "auth": self._tagger.kind}
        model["tag"] = self._tagger.tag(b"model", self._model_key, [canonical_json(model)]).decode()
        self._model_value = canonical_json(model)
        self._model_ok = False
        self._disabled: Optional[str] = None  # why the tier refuses to run (another model's keys)
        self._warned: set[str] = set()  # kinds of refusal already logged at WARNING
        no_script = redis.exceptions.NoScriptError
        self._cas_script = _Lua(_CAS_LUA, no_script)
        self._del_if_script = _Lua(_DEL_IF_LUA, no_script)
        self._breaker = _Breaker(breaker_failures, breaker_open_s)
        self._connected: Optional[bool] = None  # None: no command answered or failed yet

        self._lock = threading.Lock()  # counters, agent states
        self._agents: "OrderedDict[str, _AgentState]" = OrderedDict()
        self._pending_erase: dict[str, int] = {}  # namespace -> erasures queued
        self._gen_counter = 0
        self._c = dict.fromkeys(
            ["puts", "puts_published", "puts_merged", "puts_same", "puts_kept_other", "puts_erased", "puts_stale",
             "puts_outdated", "puts_incomplete", "put_failures", "dropped", "blocks_uploaded", "blocks_present",
             "bytes_up", "gets", "fetch_round_trips", "hits", "misses", "refused", "refused_mac", "foreign",
             "puts_foreign", "bytes_down", "manifest_gets", "manifest_hits", "erases", "erases_done", "errors",
             "timeouts", "skipped", "blocks_deleted"], 0)

        self._q: deque = deque()
        self._q_puts = 0
        self._q_bytes = 0
        self._busy = False
        self._cond = threading.Condition(self._lock)
        self._closing = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="vllm-mlx-persist-remote-writer", daemon=True)
        self._thread.start()
        self._readers = ThreadPoolExecutor(read_threads, thread_name_prefix="vllm-mlx-persist-remote-reader")
        self._read_slots = threading.BoundedSemaphore(read_threads)
        # The writer is a daemon thread: give queued writes a short, bounded chance at exit.
        ref = weakref.ref(self)
        self._atexit = lambda: (t := ref()) is not None and t.close(2.0)
        atexit.register(self._atexit)
        if self.authenticated:
            logger.info("fleet: values in Redis are authenticated (HMAC-SHA256, key id %s; keyspace %s*)",
                        self.key_id, self._prefix)
        else:
            logger.warning("fleet: the fleet tier is UNAUTHENTICATED: anyone who can write to this Redis can plant "
                           "KV that this server serves, or erase agents; set %s or remote_secret_file on every "
                           "server (docs/fleet.md, Authentication)", SECRET_ENV)

    def _make_client(self, url: str, redis: Any, Retry: Any, NoBackoff: Any, timeout: float,
                     connect_timeout: float, max_connections: int) -> Any:
        """A client with one attempt per command and every socket operation bounded; a Cluster's is
        made at its first use (_LazyClient)."""
        retry = Retry(NoBackoff(), 0)
        if not self.cluster:
            return redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=connect_timeout,
                                        retry=retry, max_connections=max_connections, health_check_interval=0)

        def make() -> Any:
            # Start from every node the other client has discovered, not only the URL's: the read
            # client is often made later than the write client, and the URL's node may be down by then.
            known = [c._made for c in (getattr(self, "_client", None), getattr(self, "_write_client", None))
                     if c is not None and c._made is not None]
            nodes = [redis.cluster.ClusterNode(n.host, n.port) for c in known[:1] for n in c.get_nodes()]
            # The constructor sends COMMAND to a "default node" (the first primary), and only a retry
            # moves it to another: allow two there, so one dead primary cannot keep the client from
            # being made; then no retries, as for a single Redis.
            client = redis.cluster.RedisCluster.from_url(
                url, startup_nodes=nodes, socket_timeout=timeout, socket_connect_timeout=connect_timeout,
                retry=Retry(NoBackoff(), 2), max_connections=max_connections)
            client.set_retry(retry)
            return client

        return _LazyClient(make)

    @staticmethod
    def _check_cluster_url(url: str, redis: Any) -> None:
        """Refuse at start-up what redis-py's cluster client would refuse at every command."""
        try:
            parsed = redis.connection.parse_url(url)
        except ValueError as e:
            raise ValueError(f"bad Redis URL: {e}") from None
        if "path" in parsed or parsed.get("db", 0) != 0:
            raise ValueError("a Redis Cluster URL is redis:// or rediss:// to any node, database 0 "
                             "(Cluster has no unix sockets and no other databases)")

    # ---- keys -----------------------------------------------------------------------------------

    def block_key(self, block_id: str) -> str:
        return self._prefix + "b:" + check_block_id(block_id)

    def manifest_key(self, namespace: str) -> str:
        return self._prefix + "a:" + _agent_key(namespace)

    @staticmethod
    def _redact(url: str) -> str:
        """The URL without credentials (user:password@ and a password= query option)."""
        head, sep, tail = url.partition("://")
        if sep and "@" in tail.split("/", 1)[0]:
            tail = "***@" + tail.split("@", 1)[1]
        return re.sub(r"(?i)(password=)[^&]*", r"\1***", head + sep + tail)

    # ---- reads (any thread, bounded) ------------------------------------------------------------

    def get_manifest(self, namespace: str) -> Optional[RemoteManifest]:
        """The agent's manifest in Redis (erased=True for a tombstone), judged against this server's
        era (RemoteManifest: erasure, outdated); None when absent, refused, not ours or unreachable
        within read_timeout_s."""
        key = self.manifest_key(namespace)
        with self._lock:
            self._c["manifest_gets"] += 1
            if namespace in self._pending_erase:
                return None  # erased here, not yet in Redis: never serve it back
            gen = self._agent(namespace).gen
        raw = self._bounded_read(lambda: self._client.hmget(key, *_FIELDS))
        if raw is _FAILED:
            return None
        cur = self._judge_manifest(key, raw)
        if cur.state == "absent":
            return None
        if cur.state != "ok":
            self._refused_manifest(cur, "read")
            return None
        m = None if cur.erased else self._parse_manifest(cur.body, namespace)
        if m is None and not cur.erased:
            self._count("refused")
            return None
        era = cur.ident if m is None else (m.era or "")
        with self._lock:
            st = self._agent(namespace)
            if st.gen != gen:
                # An erasure here, or one met, while this read ran: the value is judged against an
                # era that is no longer this server's. A miss; the next read judges it afresh.
                return None
            mine = st.era
            # Another era: a tombstone, or a history started after an erasure this server never
            # acted on (its copy predates it); none ('') while this server's has one: a history
            # from before the erasure this server's histories follow.
            erasure = era if era and not self._meet_erasure(st, cur.version, era) else ""
            if m is None:
                return RemoteManifest(namespace, [], 0, 0.0, cur.version, erased=True, ident=cur.ident,
                                      seen=not erasure, era=era, erasure=erasure)
            self._c["manifest_hits"] += 1
            st.read[cur.version] = cur.ident
            while len(st.read) > _READ_IDS:
                del st.read[next(iter(st.read))]
            seen = st.seen_id == cur.ident
        branches = m.branches if m.branches is not None else [
            {"block_ids": list(m.block_ids), "n_tokens": m.n_tokens, "links": [[0, namespace]]}]
        return RemoteManifest(m.namespace, m.block_ids, m.n_tokens, m.updated_at, cur.version, branches=branches,
                              ident=cur.ident, seen=seen, era=era, erasure=erasure, outdated=not era and bool(mine),
                              removals=removals_of(m), spliced_cleared=m.spliced_cleared or 0.0)

    def get_block(self, block_id: str) -> Optional[BlockData]:
        """The block, verified exactly as a disk block (disk_format.decode_block), and its MAC with a
        secret; None when absent, refused (damaged, another block's, or without a valid MAC: deleted
        from Redis if unchanged), of a format this build cannot read (left alone) or unreachable in time."""
        got = self.get_blocks([block_id])
        return got[0] if got else None

    def get_blocks(self, block_ids: Sequence[str], max_bytes: Optional[int] = None) -> list[BlockData]:
        """The blocks in order, each verified as `get_block` does, up to the first one absent,
        refused or not read in time, or once `max_bytes` of block data are held: the list is then
        shorter than asked. Read in pipelined round trips of at most `fetch_blocks` blocks and about
        `fetch_bytes` bytes (estimated from the largest block seen; one block until one was), each
        bounded by read_timeout_s."""
        keys = [self.block_key(b) for b in block_ids]
        out: list[BlockData] = []
        held = 0
        while len(out) < len(keys) and (max_bytes is None or held < max_bytes):
            seen = self._block_size_seen
            n = max(1, min(self.fetch_blocks, self.fetch_bytes // seen)) if seen else 1
            batch = keys[len(out) : len(out) + n]
            with self._lock:
                self._c["gets"] += len(batch)
                self._c["fetch_round_trips"] += 1
            raws = self._bounded_read(lambda: self._get_many(batch))
            if raws is _FAILED:
                return out
            for key, raw in zip(batch, raws):
                if max_bytes is not None and held >= max_bytes:
                    return out
                block = self._verify(block_ids[len(out)], key, raw)
                if block is None:
                    return out
                out.append(block)
                held += block.nbytes
        return out

    def _get_many(self, keys: list[str]) -> list:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            if self.block_ttl_s > 0:
                pipe.getex(key, ex=self.block_ttl_s)  # a hit keeps the block alive
            else:
                pipe.get(key)
        return pipe.execute()

    def _verify(self, block_id: str, key: str, raw: Optional[bytes]) -> Optional[BlockData]:
        """A value read from Redis as a block, or None: absent; refused (its MAC missing or wrong, or
        damaged: deleted if unchanged, so a put can store a good copy); or not ours to judge (a
        newer format of ours: left in place)."""
        if raw is None:
            self._count("misses")
            return None
        data, problem = self._unwrap_block(key, raw)
        if problem is not None:
            self._count("refused_mac")
            self._warn_once("block-mac", "fleet: refused a block from Redis whose MAC is %s (written without "
                            "this fleet's secret, or damaged); deleting it (further ones: debug log)", problem)
            self._refuse_block(block_id, key, raw, f"MAC {problem}", quiet=True)
            return None
        try:
            block = decode_block(data, block_id)
        except FormatError as e:
            newer = _newer_block(data)
            if newer is not None:
                self._count("foreign")
                self._warn_once("block-foreign", "fleet: block %s in Redis is %s, which this build cannot read; "
                                "left in place (a build of another format wrote it into this keyspace; "
                                "further ones: debug log)", block_id, newer)
                return None
            self._refuse_block(block_id, key, raw, str(e))
            return None
        with self._lock:
            self._c["hits"] += 1
            self._c["bytes_down"] += len(raw)
            self._block_size_seen = max(self._block_size_seen, len(raw))
        return block

    def _refuse_block(self, block_id: str, key: str, raw: bytes, why: str, quiet: bool = False) -> None:
        self._count("refused")
        (logger.debug if quiet else logger.warning)("fleet: refused block %s from Redis (%s); deleting it",
                                                    block_id, why)
        digest = hashlib.sha1(raw).hexdigest()
        self._bounded_read(lambda: self._del_if_script(self._client, [key], [digest]))

    def _unwrap_block(self, key: str, raw: bytes) -> tuple[Any, Optional[str]]:
        """(the block file inside a value, None), or (None, why its MAC is refused)."""
        if not self.authenticated:
            return raw, None
        if len(raw) < _MAC_TRAILER or raw[-_MAC_TRAILER:-32] != _MAC_MAGIC:
            return None, "missing"
        data = memoryview(raw)[:-_MAC_TRAILER]  # no copy: the block's arrays are views of it
        if not hmac.compare_digest(raw[-32:], self._tagger.digest(b"block", key, [data])):
            return None, "wrong"
        return data, None

    def _wrap_block(self, key: str, raw: bytes) -> bytes:
        """The value stored for a block file: the file, and with a secret its MAC bound to the key."""
        if not self.authenticated:
            return raw
        return b"".join((raw, _MAC_MAGIC, self._tagger.digest(b"block", key, [raw])))

    def _bounded_read(self, fn: Callable[[], Any]) -> Any:
        """Run a Redis read on a reader thread; _FAILED on any failure or after read_timeout_s."""
        if self._disabled or self._stop or not self._breaker.allow():
            self._count("skipped")
            return _FAILED
        if not self._read_slots.acquire(blocking=False):
            self._count("skipped")  # every reader is stuck on a slow Redis: do not queue behind it
            return _FAILED

        def job() -> Any:
            try:
                self._ensure_model(self._client)
                return fn()
            finally:
                self._read_slots.release()

        try:
            fut = self._readers.submit(job)
        except RuntimeError:  # executor shut down by close()
            self._read_slots.release()
            self._count("skipped")
            return _FAILED
        try:
            result = fut.result(timeout=self.read_timeout_s)
        except FutureTimeout:
            self._failed("timeouts", "read timed out after %.2fs" % self.read_timeout_s, transport=True)
            return _FAILED
        except RemoteUnavailable:
            self._count("skipped")
            return _FAILED
        except self._redis_errors as e:  # the socket's own time-out may fire first: still a time-out
            self._failed("timeouts" if isinstance(e, self._timeout_errors) else "errors", e,
                         transport=isinstance(e, self._transport_errors))
            return _FAILED
        self._succeeded()
        return result

    # ---- writes (queued) --------------------------------------------------------------------------

    def put(self, manifest: Manifest, blocks: Optional[Mapping[str, Union[BlockData, bytes]]] = None,
            base: Optional[Manifest] = None) -> bool:
        """Queue publishing `manifest` after the blocks it names (from `blocks`, else block_source);
        False when dropped (queue full by count or bytes, tier closed or disabled). `base`: the
        agent's history this turn continued (its manifest before the turn): a put whose base is the
        value in Redis is its sequential successor even when this server forgot having published
        it (a restart). A put that is no successor is merged with the value in Redis by recency
        (docs/fleet.md, "Which update wins")."""
        _agent_key(manifest.namespace)
        for b in manifest.block_ids:
            check_block_id(b)
        if manifest.branches is not None:
            check_branches(manifest.branches, set(manifest.block_ids), allow_empty=manifest.record_fields)
        blocks = dict(blocks or {})
        nbytes = sum(_block_nbytes(b) for b in blocks.values())
        with self._cond:
            self._c["puts"] += 1
            if (self._closing or self._disabled or self._q_puts >= self.queue_max
                    or (self._q_puts and self._q_bytes + nbytes > self.queue_max_bytes)):
                self._c["dropped"] += 1
                return False
            st = self._agent(manifest.namespace)
            self._q.append(_Put(manifest, blocks, st.gen, nbytes, self._digest(base) if base is not None else None,
                                st.era))
            self._q_puts += 1
            self._q_bytes += nbytes
            self._cond.notify()
        return True

    def erase(self, namespace: str) -> bool:
        """Queue erasing the agent from Redis (manifest replaced by a tombstone one version up, so a
        put from before the erasure cannot bring it back); queued puts for it are discarded. This
        server's era for the agent is the new tombstone's id from now on (its later histories follow
        it). Not bounded by queue_max; retried until done or close(). False if it cannot be queued."""
        _agent_key(namespace)
        with self._cond:
            self._c["erases"] += 1
            if self._closing or len(self._pending_erase) >= self.max_erasures:
                self._c["errors"] += 1
                logger.error("fleet: cannot queue the erasure of an agent (closing or %d pending)",
                             len(self._pending_erase))
                return False
            self._bump_gen(namespace)
            st = self._agent(namespace)
            # The tombstone's id is chosen now: turns made after this call follow this erasure. An
            # erasure met earlier and not yet acknowledged is superseded (erased_locally refuses it).
            st.era, st.tomb_v, st.tomb_id = secrets.token_hex(8), -1, ""
            self._pending_erase[namespace] = self._pending_erase.get(namespace, 0) + 1
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
            if self._closing or self._disabled:
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

    def close(self, timeout: float = 10.0) -> None:
        """Stop taking writes, finish queued ones within `timeout` (one attempt each, none while the
        breaker is open), count the rest as dropped, and stop the threads. Idempotent."""
        with self._cond:
            if self._stop:
                return
            self._closing = True
            self._cond.notify_all()
        self.flush(timeout)
        with self._cond:
            self._stop = True
            left = [i for i in self._q if isinstance(i, _Put)]
            erasures = [i.namespace for i in self._q if isinstance(i, _Erase)]
            self._c["dropped"] += len(left)
            self._q.clear()
            self._q_puts = self._q_bytes = 0
            self._cond.notify_all()
        if erasures:
            logger.error("fleet: %d agent erasure(s) could not reach Redis before shutdown", len(erasures))
            self._count("errors", len(erasures))
        atexit.unregister(self._atexit)
        self._thread.join(timeout=max(1.0, timeout))
        self._readers.shutdown(wait=False, cancel_futures=True)
        for client in (self._client, self._write_client):
            try:
                client.close()
            except Exception:  # closing sockets of a dead Redis: nothing to do
                pass

    # ---- this server's view of an agent (O(1), no Redis) -------------------------------------------

    def seen_version(self, namespace: str) -> int:
        """The version of the manifest this server last published, adopted or erased its copy
        for; -1: none."""
        with self._lock:
            st = self._agents.get(namespace)
            return -1 if st is None else st.seen_v

    def adopt(self, namespace: str, version: int) -> None:
        """This server now holds the agent's manifest `version`, as get_manifest returned it, as its
        own history: its next put for the agent is a sequential successor of that value. (A version
        this tier did not read lately, or older than what it holds, is ignored.)"""
        with self._lock:
            st = self._agent(namespace)
            ident = st.read.get(int(version))
            if ident is not None and int(version) >= st.seen_v:
                st.seen_v, st.seen_id = int(version), ident

    def release(self, namespace: str) -> None:
        """This server no longer holds the agent's history (it erased its copy: a local space
        decision, or before erased_locally): its next put is nobody's sequential successor, so it
        merges with what Redis holds instead of replacing it."""
        with self._lock:
            st = self._agents.get(namespace)
            if st is not None:
                st.seen_id = ""

    def erased_locally(self, namespace: str, ident: str) -> bool:
        """This server has erased its copy of the agent (memory and disk, durable) because of the
        erasure `ident` (RemoteManifest.erasure, or on_erased's second argument). Until this is
        called every put of the agent meets that erasure and is refused; from now on this server's
        era for the agent is `ident`: a put starts a new history on top of that tombstone, or joins
        the history of that era in Redis. Puts queued before are discarded. False (nothing changes)
        if a newer erasure has been met or made here since: its own erasure follows."""
        with self._lock:
            st = self._agent(namespace)
            if not ident or ident != st.tomb_id or namespace in self._pending_erase:
                return False
            # Onto a tombstone its id is the base (a successor starts a new history); a history of
            # that era in Redis is no base of this server's: its next put merges with it.
            st.seen_v, st.seen_id = st.tomb_v, st.tomb_id
            st.era = st.tomb_id
            st.tomb_v, st.tomb_id = -1, ""
            self._bump_gen(namespace)
            return True

    def era(self, namespace: str) -> str:
        """The erasure this server's histories of the agent follow: the id of the last tombstone it
        wrote or erased its copy for ('' none, or forgotten). Stamped in the local manifests (a
        restart tells it back with known_era); every put carries it."""
        with self._lock:
            st = self._agents.get(namespace)
            return "" if st is None else st.era

    def known_era(self, namespace: str, era: Optional[str]) -> None:
        """Start-up: this server's copy of the agent on its disk follows erasure `era` (its local
        manifest says so). Ignored when this tier already knows an era for the agent (it is newer)."""
        if era:
            check_era(era)
            with self._lock:
                st = self._agent(namespace)
                if not st.era:
                    st.era = era

    # ---- stats ---------------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Counters and state (O(1))."""
        with self._lock:
            out: dict[str, Any] = dict(self._c)
            out["queue_depth"] = len(self._q)
            out["queue_bytes"] = self._q_bytes
            out["erasures_pending"] = len(self._pending_erase)
        out["breaker_opens"] = self._breaker.opens
        out["breaker_open"] = not self._breaker.allow()
        out["connected"] = bool(self._connected) and self._breaker.allow() and not self._disabled
        out["state"] = self._disabled or ("ok" if out["connected"] else
                                          "not contacted yet" if self._connected is None else "unreachable")
        out["url"] = self.url_redacted
        out["authenticated"] = self.authenticated
        out["key_id"] = self.key_id
        out["keyspace"] = self._prefix
        return out

    # ---- internals: bookkeeping ---------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] += n

    def _failed(self, counter: str, err: Any, transport: bool) -> None:
        self._count(counter)
        if transport:
            self._connected = False
            was_open = not self._breaker.allow()
            self._breaker.fail()
            if not was_open and not self._breaker.allow():
                logger.warning("fleet: Redis at %s unreachable (%s); skipping it for %.1fs",
                               self.url_redacted, err, self._breaker.open_s)
        else:
            logger.warning("fleet: Redis error: %s", err)

    def _succeeded(self) -> None:
        if not self._connected:
            self._connected = True
        self._breaker.ok()

    def _agent(self, namespace: str) -> _AgentState:
        """This server's state for an agent (LRU-bounded; a forgotten one is simply 'never seen')."""
        st = self._agents.get(namespace)
        if st is None:
            st = self._agents[namespace] = _AgentState()
            if len(self._agents) > self.max_agents:
                self._agents.popitem(last=False)
        else:
            self._agents.move_to_end(namespace)
        return st

    def _bump_gen(self, namespace: str) -> None:
        self._gen_counter += 1
        self._agent(namespace).gen = self._gen_counter

    def _meet_erasure(self, st: _AgentState, version: int, ident: str) -> bool:
        """(lock held) Erasure `ident` (a tombstone's id, or the era of a history: read, or refusing a
        put; `version`: that value's) was met: whether this server already acted on it (it is this
        server's era). A new one is remembered until erased_locally; puts queued before it are stale
        (it would refuse them)."""
        if ident == st.era:
            return True
        if ident != st.tomb_id:
            st.tomb_v, st.tomb_id = version, ident
            self._gen_counter += 1
            st.gen = self._gen_counter
        return False

    def _warn_once(self, kind: str, msg: str, *args: Any) -> None:
        """Log at WARNING the first time, then at DEBUG: a planted or foreign value must not be able
        to flood the log."""
        with self._lock:
            first = kind not in self._warned
            self._warned.add(kind)
        (logger.warning if first else logger.debug)(msg, *args)

    def _ensure_model(self, client: Any) -> None:
        """Check once per connection life that these keys belong to this exact model (as model.json
        does on disk); a mismatch disables the tier rather than serve another model's KV. A value
        whose tag is missing or wrong is no server's of this version (and secret): it is replaced."""
        if self._model_ok:
            return
        if self._disabled:
            raise RemoteUnavailable(self._disabled)
        for attempt in range(2):
            pipe = client.pipeline(transaction=False)
            pipe.set(self._model_key, self._model_value, nx=True)
            pipe.get(self._model_key)
            _, theirs = pipe.execute()
            if theirs == self._model_value:
                self._model_ok = True
                return
            problem = self._model_tag_problem(theirs)
            if problem is None or (problem == "unknown" and not self.authenticated) or attempt:
                break
            self._count("refused")
            self._count("refused_mac")
            self._warn_once("model-mac", "fleet: %s holds a value whose tag is %s; replacing it",
                            self._model_key, problem)
            self._del_if_script(client, [self._model_key], [hashlib.sha1(theirs or b"").hexdigest()])
        self._disabled = (f"refused: Redis keys {self._prefix}* belong to another model or format "
                          f"({(theirs or b'')[:300]!r}); the fleet tier is off")
        logger.error("fleet: %s", self._disabled)
        raise RemoteUnavailable(self._disabled)

    def _model_tag_problem(self, value: Optional[bytes]) -> Optional[str]:
        """None if `value` is a model record tagged as this tier tags (so a real other model's)."""
        try:
            d = json.loads(value)
            tag = d.pop("tag").encode()
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            return "missing"
        return self._tagger.check(tag, b"model", self._model_key, [canonical_json(d)])

    def _judge_manifest(self, key: str, values: Sequence[Optional[bytes]]) -> _Current:
        """A manifest key's fields (_FIELDS, as HMGET returns them), judged."""
        v, i, e, n, d, body, tag = values
        if all(x is None for x in values):
            return _Current("absent")
        raw_id = i or b""
        problem = self._tagger.check(tag, b"manifest", key, [x or b"" for x in values[:-1]])
        if problem == "unknown" and not self.authenticated:
            return _Current("foreign", raw_id, why="a tag of an unknown kind")
        if problem is not None:
            return _Current("refused", raw_id, why=f"its tag is {problem}")
        try:
            erased = e == b"1"
            cur = _Current("ok", raw_id, int(v), raw_id.decode("ascii"), erased, 0 if erased else int(n),
                           (d or b"").decode("ascii"), body)
            if not cur.ident or e not in (b"0", b"1") or (not erased and body is None):
                raise ValueError("missing fields")
            check_era(cur.ident)  # a tombstone's id becomes an era, stamped in local manifests
        except (TypeError, ValueError) as err:
            return _Current("refused", raw_id, why=f"malformed ({err})")
        return cur

    def _refused_manifest(self, cur: _Current, where: str) -> None:
        if cur.state == "foreign":
            self._count("foreign")
            self._warn_once("manifest-foreign", "fleet: a manifest in Redis has %s; left alone (%s; further "
                            "ones: debug log)", cur.why, where)
            return
        with self._lock:
            self._c["refused"] += 1
            if cur.why.startswith("its tag"):
                self._c["refused_mac"] += 1
        self._warn_once("manifest-refused", "fleet: refused a manifest from Redis: %s (%s; written without this "
                        "fleet's secret, or damaged; further ones: debug log)", cur.why, where)

    def _manifest_fields(self, key: str, version: int, ident: str, erased: bool, n_tokens: int = 0,
                         digest: str = "", body: bytes = b"") -> list[bytes]:
        """The field/value pairs of a manifest (or, `erased`, a tombstone: no n, d, body) with its tag."""
        vals = [str(version).encode(), ident.encode(), b"1" if erased else b"0"]
        vals += [b"", b"", b""] if erased else [str(n_tokens).encode(), digest.encode(), body]
        out: list[bytes] = []
        for name, val in zip(_FIELDS, vals):
            if val or name in ("v", "i", "e"):
                out += [name.encode(), val]
        return out + [b"m", self._tagger.tag(b"manifest", key, vals)]

    def _parse_manifest(self, body: Optional[bytes], namespace: str) -> Optional[Manifest]:
        try:
            d = json.loads(body)
            checksum = d.pop("checksum")
            if checksum != "sha256:" + hashlib.sha256(canonical_json(d)).hexdigest():
                raise ValueError("checksum mismatch")
            if d.get("format") != _MANIFEST_FORMAT or d.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"format {d.get('format')!r} version {d.get('format_version')!r}")
            if d.get("fingerprint") != self.fingerprint:
                raise ValueError("another model's manifest")
            if d.get("namespace") != namespace:
                raise ValueError("another agent's manifest")
            ids, n, ts = d["block_ids"], d["n_tokens"], d["updated_at"]
            if not isinstance(ids, list) or not isinstance(n, int) or not isinstance(ts, (int, float)):
                raise ValueError("malformed fields")
            for b in ids:
                check_block_id(b)
            branches = d.get("branches")  # absent: one plain chain (and every older server's manifest)
            removals, cleared, forkable = d.get("removals"), d.get("spliced_cleared"), d.get("forkable")
            if branches is not None:
                check_branches(branches, set(ids), allow_empty=True)  # a record may keep only removals
                if (branches[-1]["n_tokens"] if branches else 0) != n:
                    raise ValueError("n_tokens is not the newest branch's")
            era = d.get("era")  # absent: a history that never met an erasure (and every older server's)
            if era is not None:
                check_era(era)
            if removals is not None:
                check_removals(removals)
            if cleared is not None and (isinstance(cleared, bool) or not isinstance(cleared, (int, float))):
                raise ValueError("malformed spliced_cleared")
            if forkable is not None and not isinstance(forkable, bool):
                raise ValueError("malformed forkable")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            logger.warning("fleet: refused a manifest from Redis: %s", e)
            return None
        return Manifest(namespace, list(ids), n, float(ts), branches=branches, era=era, removals=removals,
                        spliced_cleared=cleared, forkable=forkable)

    def _manifest_body(self, m: Manifest, era: Optional[str] = None) -> bytes:
        """A manifest's body as Redis holds it; `era` (default: the manifest's) the erasure its history follows."""
        d = {"format": _MANIFEST_FORMAT, "format_version": FORMAT_VERSION, "fingerprint": self.fingerprint,
             "namespace": m.namespace, "block_ids": list(m.block_ids), "n_tokens": int(m.n_tokens),
             "updated_at": float(m.updated_at)}
        if m.branches is not None:  # optional, as on disk: plain manifests read as before everywhere
            d["branches"] = m.branches
        era = m.era if era is None else era
        if era:  # optional too: every r2 reader before it ignores it (docs/fleet.md, Versions)
            d["era"] = era
        for name in ("removals", "spliced_cleared", "forkable"):  # the record's (r3), each optional
            if getattr(m, name) is not None:
                d[name] = getattr(m, name)
        d["checksum"] = "sha256:" + hashlib.sha256(canonical_json(d)).hexdigest()
        return canonical_json(d)

    # ---- internals: the writer thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._q and not self._stop:
                    self._cond.wait()
                if self._stop:
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
                self._count("errors")
            with self._cond:
                if requeue and not self._stop:
                    self._q.append(item)
                self._busy = False
                self._cond.notify_all()

    def _do(self, item: Union[_Put, _Erase, _Drop]) -> bool:
        """Run one write with retries and back-off; True to requeue it (an erasure not yet done)."""
        for attempt in range(self.max_attempts):
            if not self._breaker.allow():
                if self._closing:
                    break
                self._sleep(self._breaker.wait_s())
                if self._stop:
                    break
            try:
                self._ensure_model(self._write_client)
                if isinstance(item, _Erase):
                    self._erase_now(item.namespace)
                elif isinstance(item, _Drop):
                    for b in item.block_ids:  # one key per call: a cluster's keys lie in many slots
                        self._count("blocks_deleted", int(self._write_client.delete(self.block_key(b))))
                else:
                    self._put_now(item)
                self._succeeded()
                return False
            except RemoteUnavailable:
                break
            except (*self._redis_errors, _Conflict) as e:
                self._failed("errors", e, transport=isinstance(e, self._transport_errors))
                if self._closing:
                    break
                self._sleep(min(self.backoff_max_s, self.backoff_s * 2 ** attempt))
        if isinstance(item, _Erase):
            item.attempts += 1
            if self._closing or self._disabled:
                logger.error("fleet: an agent erasure could not reach Redis before shutdown")
                return False
            return True  # an erasure is never given up while the server runs
        self._count("put_failures")
        return False

    def _sleep(self, s: float) -> None:
        with self._cond:
            if not self._closing:
                self._cond.wait_for(lambda: self._closing, timeout=s)

    def _erase_now(self, namespace: str) -> None:
        key = self.manifest_key(namespace)
        for _ in range(_CAS_TRIES):
            cur = self._judge_manifest(key, self._write_client.hmget(key, *_FIELDS))
            with self._lock:
                st = self._agent(namespace)
                base = st.seen_v
                if not st.era:  # forgotten since erase() chose it (the agents' bound)
                    st.era = secrets.token_hex(8)
                # The id erase() chose, of the latest erasure queued here: an earlier one retried
                # after it writes the same tombstone, so this server's era is what Redis holds.
                ident = st.era
            if cur.state == "ok" and cur.erased and cur.ident == ident:
                version = cur.version  # written already (its reply was lost, or a later erasure's)
                break
            if cur.state in ("refused", "foreign"):
                self._refused_manifest(cur, "replaced by an erasure")
            # One version above anything this server or Redis knew of the agent. An erasure replaces
            # whatever is there, a value it cannot judge included: the agent's owner asked for it.
            version = max(cur.version if cur.state == "ok" else -1, base, 0) + 1
            fields = self._manifest_fields(key, version, ident, True)
            if int(self._cas_script(self._write_client, [key], [cur.raw_id, self.tombstone_ttl_s, *fields])):
                break
        else:
            raise _Conflict(f"an agent's manifest changed under its erasure {_CAS_TRIES} times")
        with self._lock:
            st = self._agent(namespace)
            st.seen_v, st.seen_id = version, ident  # puts queued after the erasure may recreate the agent
            st.tomb_v, st.tomb_id = -1, ""
            left = self._pending_erase.get(namespace, 1) - 1
            if left > 0:
                self._pending_erase[namespace] = left
            else:
                self._pending_erase.pop(namespace, None)
            self._c["erases_done"] += 1

    def _put_now(self, p: _Put) -> None:
        m = p.manifest
        if self._stale(p):
            return
        key = self.manifest_key(m.namespace)
        # Blocks first: which does Redis lack? (EXPIRE doubles as EXISTS and keeps a live agent's
        # blocks from expiring.) The manifest's current value comes in the same round trip. Single-key
        # commands only, so this works on Redis Cluster too.
        keys = [self.block_key(b) for b in m.block_ids]
        pipe = self._write_client.pipeline(transaction=False)
        for k in keys:
            if self.block_ttl_s > 0:
                pipe.expire(k, self.block_ttl_s)
            else:
                pipe.exists(k)
        pipe.hmget(key, *_FIELDS)
        *present, values = pipe.execute()
        self._count("blocks_present", sum(1 for there in present if there))
        for bid, bkey, there in zip(m.block_ids, keys, present):
            if there:
                continue
            value = self._block_bytes(bid, p.blocks.get(bid))
            if value is None:
                self._count("puts_incomplete")
                logger.warning("fleet: block %s of an agent is in neither the put nor the local store; "
                               "manifest not published", bid)
                return
            value = self._wrap_block(bkey, value)
            self._write_client.set(bkey, value, nx=True, ex=self.block_ttl_s if self.block_ttl_s > 0 else None)
            with self._lock:
                self._c["blocks_uploaded"] += 1
                self._c["bytes_up"] += len(value)
                self._block_size_seen = max(self._block_size_seen, len(value))
        digest, body = self._digest(m), self._manifest_body(m, p.era)
        for attempt in range(_CAS_TRIES):
            if attempt:  # changed since it was read: judge the new value
                values = self._write_client.hmget(key, *_FIELDS)
            cur = self._judge_manifest(key, values)
            theirs = self._parse_manifest(cur.body, m.namespace) if cur.state == "ok" and not cur.erased else None
            # The erasure check and the base are read together: an erasure this server makes or sees
            # after this point changes the value (or the base), so the compare-and-set refuses.
            with self._lock:
                if self._stale(p, locked=True):
                    return
                st = self._agent(m.namespace)
                seen_v, seen_id = st.seen_v, st.seen_id
            cur_era = cur.ident if cur.erased else (theirs.era or "") if theirs is not None else ""
            outcome, version = self._decide(cur, seen_v, seen_id, digest, p.base_digest, p.era, cur_era)
            value = m  # what is written: the put, or (a concurrent update) the put merged with the current
            if outcome == "merge":
                value = self._merged(m, theirs, p.blocks)
                if value is None:
                    outcome = "kept"
            if outcome not in ("publish", "merge", "outdated"):
                break
            d, b = (digest, body) if value is m else (self._digest(value), self._manifest_body(value, p.era))
            ident = secrets.token_hex(8)
            fields = self._manifest_fields(key, version, ident, False, int(value.n_tokens), d, b)
            if int(self._cas_script(self._write_client, [key], [cur.raw_id, self.manifest_ttl_s, *fields])):
                if cur.state == "refused":
                    self._refused_manifest(cur, "replaced by a put")
                break
        else:
            raise _Conflict(f"an agent's manifest changed under its put {_CAS_TRIES} times")
        with self._lock:
            # A merged value holding another server's branches is not this server's history: its
            # next put merges again (until a sync fetches them), so it never drops them unseen.
            if outcome in ("publish", "outdated") or (outcome == "merge" and _content(value) <= _content(m)):
                st.seen_v, st.seen_id = version, ident
            elif outcome == "same":  # the same history already there: this server holds it too
                st.seen_v, st.seen_id = cur.version, cur.ident
            self._c[{"publish": "puts_published", "merge": "puts_merged", "same": "puts_same",
                     "kept": "puts_kept_other", "erased": "puts_erased", "foreign": "puts_foreign",
                     "outdated": "puts_outdated"}[outcome]] += 1
            # Another server erased the agent after this one last looked (a tombstone, or a history
            # of a newer era on top of it). The owner drops its copy and then calls
            # erased_locally(agent, erasure); until then every put of the agent is refused here. Not
            # when an erasure was made or met here since the put was judged: that one decides.
            met = outcome == "erased" and st.gen == p.gen and m.namespace not in self._pending_erase
            if met:
                self._meet_erasure(st, cur.version, cur_era)
        if outcome == "foreign":
            self._refused_manifest(cur, "a put left it alone")
        elif met and self.on_erased is not None:
            try:
                self.on_erased(m.namespace, cur_era)
            except Exception:
                logger.exception("fleet: on_erased callback failed")

    @staticmethod
    def _decide(cur: _Current, seen_v: int, seen_id: str, digest: str, base_digest: Optional[str] = None,
                era: str = "", cur_era: str = "") -> tuple[str, int]:
        """Which update wins (docs/fleet.md): (outcome, version), outcome one of publish (as that
        version), merge (a concurrent update: the union of both histories by recency, as that
        version), same, erased (a tombstone, or a history of another era: an erasure this server
        has not acted on), outdated (a history from before the erasure this put's era follows:
        replaced, as that version), foreign (a value this build cannot judge: left alone). `era`:
        the put's; `cur_era`: the current value's (a tombstone's is its own id)."""
        if cur.state == "foreign":
            return "foreign", -1
        if cur.state != "ok":  # absent, or no value of this fleet's (refused): as if absent
            return "publish", max(seen_v, 0) + 1
        if cur_era != era:
            if cur.erased or cur_era:  # an erasure this server never acted on: its copy predates it
                return "erased", cur.version
            return "outdated", cur.version + 1  # no era: none of it may come back
        if cur.ident == seen_id or cur.erased:  # a sequential successor (onto its own era's tombstone: a new history)
            return "publish", cur.version + 1
        if cur.digest == digest:
            return "same", cur.version
        if base_digest is not None and cur.digest == base_digest:  # it continued what Redis holds
            return "publish", cur.version + 1
        return "merge", cur.version + 1

    def _merged(self, m: Manifest, theirs: Optional[Manifest],
                blocks: Optional[Mapping[str, Union[BlockData, bytes]]] = None) -> Optional[Manifest]:
        """The put's record merged with the current manifest's (`theirs`, parsed): branches by
        recency (chain.merge_branches: a branch another holds goes, the `branches` most recently used
        stay), then what either side's removal records remove goes (removals win; a grown partial
        tail is told by the tokens of the put's `blocks`), as a manifest; None when that is the
        current manifest itself (a late put of turns it already holds). A current body that does
        not parse (None) is no history to keep: the put as it is."""
        if theirs is None:
            return m
        old = branches_of(theirs)
        removals = merge_removals(removals_of(theirs), removals_of(m), MAX_REMOVALS, 0.0)
        cleared = max(theirs.spliced_cleared or 0.0, m.spliced_cleared or 0.0)
        merged = merge_branches(old, branches_of(m), self.branches,  # on equal last use, the put's is newer
                                continued=not self.keep_continued)
        given = {b: d.tokens for b, d in (blocks or {}).items() if isinstance(d, BlockData)}
        merged = surviving_removals(merged, removals, cleared, given.get)
        if (same_branches(merged, old) and set(removals) == set(removals_of(theirs))
                and cleared == (theirs.spliced_cleared or 0.0)):
            return None
        return manifest_of(m.namespace, merged, m.pinned, max(m.updated_at, theirs.updated_at), removals=removals,
                           spliced_cleared=cleared, forkable=m.forkable if m.forkable is not None else theirs.forkable)

    @staticmethod
    def _digest(m: Manifest) -> str:
        """What makes two puts 'the same history' for the script: the block ids, and the branches
        when there are any, without their last uses (recency is not history; and so a digest is
        what servers from before last uses compute)."""
        text = "\n".join(m.block_ids)
        if m.branches is not None:
            text += "\n" + canonical_json([{k: v for k, v in br.items() if k != "last_used"}
                                        for br in m.branches]).decode()
        record = {k: getattr(m, k) for k in ("removals", "spliced_cleared", "forkable") if getattr(m, k) is not None}
        if record:  # what a record holds besides branches is history too (a removal must be published)
            text += "\n" + canonical_json(record).decode()
        return hashlib.sha256(text.encode()).hexdigest()

    def _stale(self, p: _Put, locked: bool = False) -> bool:
        """Whether the put's agent was erased (here, or seen erased) after the put was queued."""
        if not locked:
            with self._lock:
                return self._stale(p, locked=True)
        if self._agent(p.manifest.namespace).gen != p.gen or p.manifest.namespace in self._pending_erase:
            self._c["puts_stale"] += 1
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


__all__ = ["RemoteTier", "RemoteManifest", "BlockSource"]
