"""Fleet tier: KV blocks and agent manifests in Redis, shared by every server serving one model.

Runtime module: numpy and bytes only, never MLX. Layout, conflict rule, sizing and faults are in
docs/fleet.md. The interface the pool (or persister) calls, and on which thread:

    tier = RemoteTier(url, fingerprint, block_source=...,   # start-up; connects lazily, never raises
                      cluster=False)                        # for an unreachable Redis; cluster=True:
                                                            # a Redis Cluster (any node's URL)
    tier.get_manifest(agent) -> RemoteManifest | None       # any thread; at most read_timeout_s
    tier.get_block(block_id) -> BlockData | None            # any thread; at most read_timeout_s;
                                                            # verified exactly as a disk block
    tier.get_blocks(block_ids) -> list[BlockData]           # any thread; pipelined round trips of
                                                            # bounded size, each at most read_timeout_s;
                                                            # the blocks up to the first one not served
    tier.put(manifest, blocks=None) -> bool                 # any thread; never blocks: queues the
                                                            # upload, False when dropped (queue full)
    tier.erase(agent) -> bool                               # any thread; never blocks: queued ahead
                                                            # of the bound, retried until done or close()
    tier.flush(timeout) -> bool                             # wait for queued writes (tests, shutdown)
    tier.stats() -> dict                                    # O(1) counters
    tier.close(timeout)                                     # flush within the bound, stop the threads

`get_*` return None for every failure (absent, refused, Redis down or slow, breaker open): the
caller treats it as a miss and carries on from memory and local disk. `put` is meant to be called
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
import json
import logging
import re
import threading
import time
import weakref
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from .store import (_BLOCK_FORMAT, FORMAT_VERSION, BadBlockError, BlockData, Manifest, _check_block_id,
                    _check_branches, decode_block, encode_block)

logger = logging.getLogger("vllm_mlx_persist.remote")

# The version of everything this tier writes to Redis: key layout, block values, manifest fields and
# body. It names the keyspace (vmp:<fingerprint[:32]>:r2:...), and a build reads and writes only its
# own, so builds of different versions sharing one Redis never see each other's values.
# Rule (docs/fleet.md, "Versions"): a build may write into keyspace rN only what every build that
# reads rN accepts; any change an older reader of rN would refuse (a new block checksum kind or
# store.FORMAT_VERSION, a manifest field it cannot ignore, another key layout) bumps it.
REMOTE_FORMAT_VERSION = 2
# The block checksum kinds every r2 reader verifies (store.decode_block): the only ones r2 may hold.
BLOCK_CHECKSUM_KINDS = ("crc32", "sha256")

_MANIFEST_FORMAT = "vllm-mlx-persist.remote-manifest"
_MODEL_FORMAT = "vllm-mlx-persist.remote-model"

BlockSource = Callable[[str], Union[BlockData, bytes, None]]

# Manifests live in a hash: v (version), n (n_tokens), d (digest of the block ids), e ("1": erased,
# a tombstone), body (the checked JSON manifest). One key per agent, so the script works unchanged
# on Redis Cluster.
#   ARGV: base version the writer last published (-1: none), n_tokens, ids digest, body, ttl (0: none)
#   returns {status, version}: 1 published, 2 the same blocks were already there, 0 kept the other
#   (longer or as long) history, 3 refused: erased since this writer last published
_PUT_LUA = """
local cur = redis.call('HMGET', KEYS[1], 'v', 'n', 'd', 'e')
local base = tonumber(ARGV[1])
local v = tonumber(cur[1])
if v then
  if base ~= v then
    if cur[4] == '1' then return {3, v} end
    if cur[3] == ARGV[3] then return {2, v} end
    if tonumber(ARGV[2]) <= (tonumber(cur[2]) or -1) then return {0, v} end
  end
  v = v + 1
else
  v = math.max(base, 0) + 1
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'v', v, 'n', ARGV[2], 'd', ARGV[3], 'body', ARGV[4])
if tonumber(ARGV[5]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[5]) end
return {1, v}
"""

# Replace the manifest by a tombstone one version up.  ARGV: writer's base version, ttl (0: none)
_ERASE_LUA = """
local v = tonumber(redis.call('HGET', KEYS[1], 'v')) or 0
v = math.max(v, tonumber(ARGV[1])) + 1
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'v', v, 'e', '1')
if tonumber(ARGV[2]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return v
"""

# Delete a refused value only if it is still the one we read (not a good copy written meanwhile).
_DEL_IF_LUA = """
local cur = redis.call('GET', KEYS[1])
if cur and redis.sha1hex(cur) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


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
    forked, or one published by an older server)."""

    namespace: str
    block_ids: list[str]
    n_tokens: int
    updated_at: float
    version: int
    erased: bool = False
    branches: list = field(default_factory=list)


@dataclass
class _Put:
    manifest: Manifest
    blocks: dict[str, Union[BlockData, bytes]]
    gen: int
    nbytes: int


@dataclass
class _Erase:
    namespace: str
    attempts: int = 0


@dataclass
class _AgentState:
    seen: int = -1  # the manifest version this server last published (or saw erased); -1: none
    gen: int = 0  # changes on every erasure seen here: queued puts from before it are stale


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


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _newer_block(data: Any) -> Optional[str]:
    """What a block value that failed decode_block says it is, when that is our block format in
    a version or with a checksum kind this build does not know (a value not ours to judge, so not
    to delete); None for anything else (damaged: its header does not parse or its checks fail)."""
    try:
        hlen = int.from_bytes(data[:8], "little")
        if not 0 < hlen <= min(len(data) - 8, 16 << 20):
            return None
        meta = json.loads(bytes(data[8 : 8 + hlen]))["__metadata__"]
        fmt, version, checksum = meta["format"], meta["format_version"], meta["checksum"]
    except (ValueError, TypeError, KeyError, IndexError, RecursionError):
        return None
    if fmt != _BLOCK_FORMAT or not isinstance(version, str) or not isinstance(checksum, str):
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
    return hashlib.sha256(namespace.encode("utf-8")).hexdigest()


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
    for one model fingerprint, in the keyspace of this REMOTE_FORMAT_VERSION. See the module
    docstring for the interface."""

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
        tombstone_ttl_s: int = 86400,
        key_prefix: str = "vmp",
        max_agents: int = 100_000,
        max_erasures: int = 10_000,
        on_erased: Optional[Callable[[str], None]] = None,
        cluster: bool = False,
    ):
        if not isinstance(fingerprint, str) or len(fingerprint) < 32:
            raise ValueError("fingerprint must be a string of at least 32 characters")
        if queue_max < 1 or read_threads < 1 or max_attempts < 1 or fetch_blocks < 1 or fetch_bytes < 1:
            raise ValueError("queue_max, read_threads, max_attempts, fetch_blocks and fetch_bytes must be at least 1")
        redis, Retry, NoBackoff = _import_redis()
        # RedisClusterException (not a RedisError): no node of a Cluster reachable, slots not covered;
        # ClusterError: CLUSTERDOWN (a master failed, full coverage required), redirections exhausted.
        cluster_errors = (redis.exceptions.RedisClusterException, redis.exceptions.ClusterError)
        self._redis_errors = (redis.exceptions.RedisError, OSError, *cluster_errors)
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
        self._prefix = f"{key_prefix}:{fingerprint[:32]}:r{REMOTE_FORMAT_VERSION}:"
        self._model_key = self._prefix + "model"
        self._model_value = _canonical({"format": _MODEL_FORMAT, "remote_version": REMOTE_FORMAT_VERSION,
                                        "format_version": FORMAT_VERSION, "fingerprint": fingerprint})
        self._model_ok = False
        self._disabled: Optional[str] = None  # why the tier refuses to run (another model's keys)
        self._warned: set[str] = set()  # kinds of refusal already logged at WARNING
        no_script = redis.exceptions.NoScriptError
        self._put_script = _Lua(_PUT_LUA, no_script)
        self._erase_script = _Lua(_ERASE_LUA, no_script)
        self._del_if_script = _Lua(_DEL_IF_LUA, no_script)
        self._breaker = _Breaker(breaker_failures, breaker_open_s)
        self._connected: Optional[bool] = None  # None: no command answered or failed yet

        self._lock = threading.Lock()  # counters, agent states
        self._agents: "OrderedDict[str, _AgentState]" = OrderedDict()
        self._pending_erase: dict[str, int] = {}  # namespace -> erasures queued
        self._gen_counter = 0
        self._c = dict.fromkeys(
            ["puts", "puts_published", "puts_same", "puts_kept_other", "puts_erased", "puts_stale", "puts_incomplete",
             "put_failures", "dropped", "blocks_uploaded", "blocks_present", "bytes_up", "gets", "fetch_round_trips", "hits",
             "misses", "refused", "foreign", "bytes_down", "manifest_gets", "manifest_hits", "erases",
             "erases_done", "errors", "timeouts", "skipped"], 0)

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
        return self._prefix + "b:" + _check_block_id(block_id)

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
        """The agent's manifest in Redis (erased=True for a tombstone); None when absent, refused
        or unreachable within read_timeout_s."""
        key = self.manifest_key(namespace)
        with self._lock:
            self._c["manifest_gets"] += 1
            if namespace in self._pending_erase:
                return None  # erased here, not yet in Redis: never serve it back
        raw = self._bounded_read(lambda: self._client.hmget(key, "v", "e", "body"))
        if raw is _FAILED:
            return None
        v, e, body = raw
        if v is None:
            return None
        try:
            version = int(v)
        except ValueError:
            self._count("refused")
            logger.warning("fleet: manifest of an agent has a bad version %r; ignored", v[:32])
            return None
        if e == b"1":
            self._saw_erased(namespace, version)
            return RemoteManifest(namespace, [], 0, 0.0, version, erased=True)
        m = self._parse_manifest(body, namespace)
        if m is None:
            self._count("refused")
            return None
        self._count("manifest_hits")
        branches = m.branches or [{"block_ids": list(m.block_ids), "n_tokens": m.n_tokens, "links": [[0, namespace]]}]
        return RemoteManifest(m.namespace, m.block_ids, m.n_tokens, m.updated_at, version, branches=branches)

    def get_block(self, block_id: str) -> Optional[BlockData]:
        """The block, verified exactly as a disk block (store.decode_block); None when absent,
        refused (damaged or another block's: deleted from Redis if unchanged), of a format this
        build cannot read (left alone) or unreachable in time."""
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
        """A value read from Redis as a block, or None: absent; refused (damaged: deleted if
        unchanged, so a put can store a good copy); or not ours to judge (a newer format of ours:
        left in place)."""
        if raw is None:
            self._count("misses")
            return None
        try:
            block = decode_block(raw, block_id)
        except BadBlockError as e:
            newer = _newer_block(raw)
            if newer is not None:
                self._count("foreign")
                self._warn_once("block-foreign", "fleet: block %s in Redis is %s, which this build cannot read; "
                                "left in place (a build of another format wrote it into this keyspace; "
                                "further ones: debug log)", block_id, newer)
                return None
            self._count("refused")
            logger.warning("fleet: refused block %s from Redis (%s); deleting it", block_id, e)
            digest = hashlib.sha1(raw).hexdigest()
            self._bounded_read(lambda: self._del_if_script(self._client, [key], [digest]))
            return None
        with self._lock:
            self._c["hits"] += 1
            self._c["bytes_down"] += len(raw)
            self._block_size_seen = max(self._block_size_seen, len(raw))
        return block

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
        except self._redis_errors as e:
            self._failed("errors", e, transport=isinstance(e, self._transport_errors))
            return _FAILED
        self._succeeded()
        return result

    # ---- writes (queued) --------------------------------------------------------------------------

    def put(self, manifest: Manifest, blocks: Optional[Mapping[str, Union[BlockData, bytes]]] = None) -> bool:
        """Queue publishing `manifest` after the blocks it names (from `blocks`, else block_source);
        False when dropped (queue full by count or bytes, tier closed or disabled)."""
        _agent_key(manifest.namespace)
        for b in manifest.block_ids:
            _check_block_id(b)
        if manifest.branches is not None:
            _check_branches(manifest.branches, set(manifest.block_ids))
        blocks = dict(blocks or {})
        nbytes = sum(_block_nbytes(b) for b in blocks.values())
        with self._cond:
            self._c["puts"] += 1
            if (self._closing or self._disabled or self._q_puts >= self.queue_max
                    or (self._q_puts and self._q_bytes + nbytes > self.queue_max_bytes)):
                self._c["dropped"] += 1
                return False
            st = self._agent(manifest.namespace)
            self._q.append(_Put(manifest, blocks, st.gen, nbytes))
            self._q_puts += 1
            self._q_bytes += nbytes
            self._cond.notify()
        return True

    def erase(self, namespace: str) -> bool:
        """Queue erasing the agent from Redis (manifest replaced by a tombstone one version up, so a
        put from before the erasure cannot bring it back); queued puts for it are discarded. Not
        bounded by queue_max; retried until done or close(). False if it cannot be queued."""
        _agent_key(namespace)
        with self._cond:
            self._c["erases"] += 1
            if self._closing or len(self._pending_erase) >= self.max_erasures:
                self._c["errors"] += 1
                logger.error("fleet: cannot queue the erasure of an agent (closing or %d pending)",
                             len(self._pending_erase))
                return False
            self._bump_gen(namespace)
            self._pending_erase[namespace] = self._pending_erase.get(namespace, 0) + 1
            self._q.append(_Erase(namespace))
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
        """The manifest version this server last published, adopted or saw erased; -1: none."""
        with self._lock:
            st = self._agents.get(namespace)
            return -1 if st is None else st.seen

    def adopt(self, namespace: str, version: int) -> None:
        """This server now holds the agent's manifest `version` (fetched from Redis) as its own
        history: its next put for the agent is a sequential successor of that version."""
        with self._lock:
            st = self._agent(namespace)
            st.seen = max(st.seen, int(version))

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

    def _saw_erased(self, namespace: str, version: int) -> None:
        with self._lock:
            st = self._agent(namespace)
            if version > st.seen:  # a new erasure: queued puts from before it must not revive it
                st.seen = version
                self._bump_gen(namespace)

    def _warn_once(self, kind: str, msg: str, *args: Any) -> None:
        """Log at WARNING the first time, then at DEBUG: values that keep coming must not flood the log."""
        with self._lock:
            first = kind not in self._warned
            self._warned.add(kind)
        (logger.warning if first else logger.debug)(msg, *args)

    def _ensure_model(self, client: Any) -> None:
        """Check once per connection life that these keys belong to this exact model (as model.json
        does on disk); a mismatch disables the tier rather than serve another model's KV."""
        if self._model_ok:
            return
        if self._disabled:
            raise RemoteUnavailable(self._disabled)
        pipe = client.pipeline(transaction=False)
        pipe.set(self._model_key, self._model_value, nx=True)
        pipe.get(self._model_key)
        _, theirs = pipe.execute()
        if theirs != self._model_value:
            self._disabled = (f"refused: Redis keys {self._prefix}* belong to another model or format "
                              f"({(theirs or b'')[:200]!r}); the fleet tier is off")
            logger.error("fleet: %s", self._disabled)
            raise RemoteUnavailable(self._disabled)
        self._model_ok = True

    def _parse_manifest(self, body: Optional[bytes], namespace: str) -> Optional[Manifest]:
        try:
            d = json.loads(body)
            checksum = d.pop("checksum")
            if checksum != "sha256:" + hashlib.sha256(_canonical(d)).hexdigest():
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
                _check_block_id(b)
            branches = d.get("branches")  # absent: one plain chain (and every older server's manifest)
            if branches is not None:
                _check_branches(branches, set(ids))
                if branches[-1]["n_tokens"] != n:
                    raise ValueError("n_tokens is not the newest branch's")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            logger.warning("fleet: refused a manifest from Redis: %s", e)
            return None
        return Manifest(namespace, list(ids), n, float(ts), branches=branches)

    def _manifest_body(self, m: Manifest) -> bytes:
        d = {"format": _MANIFEST_FORMAT, "format_version": FORMAT_VERSION, "fingerprint": self.fingerprint,
             "namespace": m.namespace, "block_ids": list(m.block_ids), "n_tokens": int(m.n_tokens),
             "updated_at": float(m.updated_at)}
        if m.branches is not None:  # optional, as on disk: plain manifests read as before everywhere
            d["branches"] = m.branches
        d["checksum"] = "sha256:" + hashlib.sha256(_canonical(d)).hexdigest()
        return _canonical(d)

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

    def _do(self, item: Union[_Put, _Erase]) -> bool:
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
                else:
                    self._put_now(item)
                self._succeeded()
                return False
            except RemoteUnavailable:
                break
            except self._redis_errors as e:
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
        with self._lock:
            base = self._agent(namespace).seen
        v = int(self._erase_script(self._write_client, [self.manifest_key(namespace)],
                                   [base, self.tombstone_ttl_s]))
        with self._lock:
            st = self._agent(namespace)
            st.seen = max(st.seen, v)  # puts queued after the erasure may recreate the agent
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
        # Blocks first: which does Redis lack? (EXPIRE doubles as EXISTS and keeps a live agent's
        # blocks from expiring.) Single-key commands only, so this works on Redis Cluster too.
        keys = [self.block_key(b) for b in m.block_ids]
        pipe = self._write_client.pipeline(transaction=False)
        for k in keys:
            if self.block_ttl_s > 0:
                pipe.expire(k, self.block_ttl_s)
            else:
                pipe.exists(k)
        present = pipe.execute()
        self._count("blocks_present", sum(1 for there in present if there))
        for bid, key, there in zip(m.block_ids, keys, present):
            if there:
                continue
            value = self._block_bytes(bid, p.blocks.get(bid))
            if value is None:
                self._count("puts_incomplete")
                logger.warning("fleet: block %s of an agent is in neither the put nor the local store; "
                               "manifest not published", bid)
                return
            self._write_client.set(key, value, nx=True, ex=self.block_ttl_s if self.block_ttl_s > 0 else None)
            with self._lock:
                self._c["blocks_uploaded"] += 1
                self._c["bytes_up"] += len(value)
                self._block_size_seen = max(self._block_size_seen, len(value))
        # The erasure check and the base version are read together: an erasure seen after this point
        # has a version above `base`, so the script refuses this put.
        with self._lock:
            if self._stale(p, locked=True):
                return
            st = self._agent(m.namespace)
            base = st.seen
        digest = self._digest(m)
        status, version = self._put_script(
            self._write_client, [self.manifest_key(m.namespace)],
            [base, int(m.n_tokens), digest, self._manifest_body(m), self.manifest_ttl_s])
        status, version = int(status), int(version)
        with self._lock:
            if status in (1, 2):
                st.seen = version
            self._c[{1: "puts_published", 2: "puts_same", 0: "puts_kept_other", 3: "puts_erased"}[status]] += 1
        if status == 3 and self.on_erased is not None:
            # Another server erased the agent. The owner drops it locally; from then on its puts for
            # this agent id start a new history (without a callback they stay refused: no revival).
            self._saw_erased(m.namespace, version)
            try:
                self.on_erased(m.namespace)
            except Exception:
                logger.exception("fleet: on_erased callback failed")

    @staticmethod
    def _digest(m: Manifest) -> str:
        """What makes two puts 'the same history' for the script: the block ids, and the branches
        when there are any (a plain manifest's digest is what older servers compute)."""
        text = "\n".join(m.block_ids)
        if m.branches is not None:
            text += "\n" + _canonical(m.branches).decode()
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
        except BadBlockError as e:
            logger.warning("fleet: local block %s is damaged (%s); not uploaded", block_id, e)
            return None
        return raw


__all__ = ["RemoteTier", "RemoteManifest", "BlockSource"]
