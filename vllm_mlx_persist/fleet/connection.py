"""The tier's link to Redis: a read client and a write client (one attempt per command, every socket
operation bounded; a Redis Cluster's made at first use), the error classes, the breaker, whether
Redis answered lately, and the check that the keyspace is this model's. Any thread."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from typing import Any, Callable, Optional, Sequence

from ..disk_format import canonical_json
from .auth import Tagger
from .keyspace import Keyspace
from .settings import FleetSettings
from .state import TierState

logger = logging.getLogger("vllm_mlx_persist.fleet")

# Delete a refused value only if it is still the one we read (not a good copy written meanwhile).
DEL_IF_LUA = """
local cur = redis.call('GET', KEYS[1])
if cur and redis.sha1hex(cur) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RemoteUnavailable(Exception):
    """Internal: Redis could not be reached (or the tier is disabled); the operation was not done."""


class Breaker:
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


def import_redis():
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


class LazyClient:
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


class Lua:
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


def redact(url: str) -> str:
    """The URL without credentials (user:password@ and a password= query option)."""
    head, sep, tail = url.partition("://")
    if sep and "@" in tail.split("/", 1)[0]:
        tail = "***@" + tail.split("@", 1)[1]
    return re.sub(r"(?i)(password=)[^&]*", r"\1***", head + sep + tail)


def check_cluster_url(url: str, redis: Any) -> None:
    """Refuse at start-up what redis-py's cluster client would refuse at every command."""
    try:
        parsed = redis.connection.parse_url(url)
    except ValueError as e:
        raise ValueError(f"bad Redis URL: {e}") from None
    if "path" in parsed or parsed.get("db", 0) != 0:
        raise ValueError("a Redis Cluster URL is redis:// or rediss:// to any node, database 0 "
                         "(Cluster has no unix sockets and no other databases)")


class Connection:
    """The clients (`client` for reads, `write_client` for the writer thread), what counts as a
    Redis failure, and the link's health: the breaker, `connected` (None: no command answered or
    failed yet) and `disabled` (why the tier refuses to run: another model's keys)."""

    def __init__(self, settings: FleetSettings, keys: Keyspace, tagger: Tagger, state: TierState):
        redis, Retry, NoBackoff = import_redis()
        # RedisClusterException (not a RedisError): no node of a Cluster reachable, slots not covered;
        # ClusterError: CLUSTERDOWN (a master failed, full coverage required), redirections exhausted.
        cluster_errors = (redis.exceptions.RedisClusterException, redis.exceptions.ClusterError)
        self.redis_errors = (redis.exceptions.RedisError, OSError, *cluster_errors)
        self.timeout_errors = (redis.exceptions.TimeoutError, TimeoutError)
        self.transport_errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError,
                                 *cluster_errors)
        self.no_script = redis.exceptions.NoScriptError
        url = settings.url
        self.cluster = bool(settings.cluster)
        if self.cluster:
            check_cluster_url(url, redis)
        # One attempt per command (our breaker and writer retries decide what happens next); every
        # socket operation is bounded. The pool holds at most one connection per thread of ours (on
        # a Cluster: per node; MOVED/ASK redirections are still followed, they are not failures).
        self.client = self._make_client(url, redis, Retry, NoBackoff, settings.read_timeout_s,
                                        settings.connect_timeout_s,
                                        # reads, syncs, the fork checks' reader, the key-format family
                                        settings.read_threads + settings.sync_threads + 4)
        self.write_client = self._make_client(url, redis, Retry, NoBackoff, settings.write_timeout_s,
                                              settings.connect_timeout_s, 1)
        self.url_redacted = redact(url)
        self.keys, self.tagger, self._state = keys, tagger, state
        self.authenticated = tagger.authenticated
        self.del_if_script = Lua(DEL_IF_LUA, self.no_script)
        self.breaker = Breaker(settings.breaker_failures, settings.breaker_open_s)
        self.connected: Optional[bool] = None  # None: no command answered or failed yet
        self.disabled: Optional[str] = None  # why the tier refuses to run (another model's keys)
        self._model_ok = False

    def _make_client(self, url: str, redis: Any, Retry: Any, NoBackoff: Any, timeout: float,
                     connect_timeout: float, max_connections: int) -> Any:
        """A client with one attempt per command and every socket operation bounded; a Cluster's is
        made at its first use (LazyClient)."""
        retry = Retry(NoBackoff(), 0)
        if not self.cluster:
            return redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=connect_timeout,
                                        retry=retry, max_connections=max_connections, health_check_interval=0)

        def make() -> Any:
            # Start from every node the other client has discovered, not only the URL's: the read
            # client is often made later than the write client, and the URL's node may be down by then.
            known = [c._made for c in (getattr(self, "client", None), getattr(self, "write_client", None))
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

        return LazyClient(make)

    # ---- the link's health --------------------------------------------------------------------------

    def failed(self, counter: str, err: Any, transport: bool) -> None:
        self._state.count(counter)
        if transport:
            self.connected = False
            was_open = not self.breaker.allow()
            self.breaker.fail()
            if not was_open and not self.breaker.allow():
                logger.warning("fleet: Redis at %s unreachable (%s); skipping it for %.1fs",
                               self.url_redacted, err, self.breaker.open_s)
        else:
            logger.warning("fleet: Redis error: %s", err)

    def succeeded(self) -> None:
        if not self.connected:
            self.connected = True
        self.breaker.ok()

    def ensure_model(self, client: Any) -> None:
        """Check once per connection life that these keys belong to this exact model (as model.json
        does on disk); a mismatch disables the tier rather than serve another model's KV. A value
        whose tag is missing or wrong is no server's of this version (and secret): it is replaced."""
        if self._model_ok:
            return
        if self.disabled:
            raise RemoteUnavailable(self.disabled)
        keys = self.keys
        for attempt in range(2):
            pipe = client.pipeline(transaction=False)
            pipe.set(keys.model, keys.model_value, nx=True)
            pipe.get(keys.model)
            _, theirs = pipe.execute()
            if theirs == keys.model_value:
                self._model_ok = True
                return
            problem = self._model_tag_problem(theirs)
            if problem is None or (problem == "unknown" and not self.authenticated) or attempt:
                break
            self._state.count("refused")
            self._state.count("refused_mac")
            self._state.warn_once("model-mac", "fleet: %s holds a value whose tag is %s; replacing it",
                                  keys.model, problem)
            self.del_if_script(client, [keys.model], [hashlib.sha1(theirs or b"").hexdigest()])
        self.disabled = (f"refused: Redis keys {keys.prefix}* belong to another model or format "
                         f"({(theirs or b'')[:300]!r}); the fleet tier is off")
        logger.error("fleet: %s", self.disabled)
        raise RemoteUnavailable(self.disabled)

    def _model_tag_problem(self, value: Optional[bytes]) -> Optional[str]:
        """None if `value` is a model record tagged as this tier tags (so a real other model's)."""
        try:
            d = json.loads(value)
            tag = d.pop("tag").encode()
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            return "missing"
        return self.tagger.check(tag, b"model", self.keys.model, [canonical_json(d)])

    def close(self) -> None:
        for client in (self.client, self.write_client):
            try:
                client.close()
            except Exception:  # closing sockets of a dead Redis: nothing to do
                pass
