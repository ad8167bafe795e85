"""The `persist_q4` cache backend: the contract vllm-mlx's scheduler calls (see patches/).

Thin on purpose: options, start-up checks and logging here; the cache math lives in `q4cache`,
blocks and tiers in `pool`, files in `store`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from concurrent.futures import Future, InvalidStateError
from pathlib import Path
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

from .caches import ModelCodec
from .caches.attention import install_attention_fix
from .caches.floats import (
    CARRY_COUNTS,
    DEQUANT_MIN_QUERIES,
    MIRROR_COUNTS,
    PREFILL_ATTENTION_MODES,
    carry_float_budget_bytes,
    carry_float_bytes,
    decode_float_budget_bytes,
    decode_float_bytes,
    set_carry_float_budget,
    set_decode_float_budget,
    set_prefill_attention,
)
from .disk_format import FORMAT_VERSION
from .identity import model_fingerprint
from .match_decode import MatchDecoder
from .namespace import split_namespace
from .pool import READ_TIMEOUT_S, BlockPool
from .store import CacheDirLock, DiskStore, StoreError

log = logging.getLogger("vllm_mlx_persist")

DEFAULTS: dict[str, Any] = {
    "cache_dir": None,  # default: $XDG_CACHE_HOME/vllm-mlx-persist, else ~/.cache/vllm-mlx-persist
    "hot_mb": 2048.0,  # hot-tier budget: bytes of 4-bit blocks kept in memory
    "bits": 4,
    "group_size": 64,
    "block_size": 256,
    "durable_writes": True,  # a turn's blocks are on disk before its response completes
    "disk_mb": 16384.0,  # disk-tier budget for the whole cache root (see docs/operations.md)
    "ttl_hours": None,  # erase agents unused for this long (None: never)
    "write_timeout_s": 30.0,  # longest a turn waits for its write (a hung disk); then it goes on uncached
    "prefill_attention": "auto",  # see caches.floats.set_prefill_attention
    "decode_float_mb": "auto",  # float decode mirror budget, MB (auto: 1024 on a CPU, 0 on a GPU)
    "carry_float_mb": "auto",  # float copies carried to agents' next turns, MB (auto: 1024 on a CPU, 0 on a GPU)
    "branches": 4,  # diverging continuations kept per agent (least recently used goes first)
    "match_text": True,  # reuse past tokens that differ but decode to the same text (re-tokenized replies)
    "warmup": True,  # run the model once at start-up (PersistQ4Backend.warm_up)
    "restore": True,  # at start-up, read the most recently used agents' blocks up to hot_mb (in the background)
    # The fleet tier (docs/fleet.md): Redis shared by several servers; None: off.
    "remote_url": None,  # redis://[user:password@]host:6379/0, rediss://... (TLS), unix:///path.sock
    "remote_cluster": False,  # remote_url is a node of a Redis Cluster (its client discovers the rest)
    "remote_timeout_s": 2.0,  # longest one Redis read may take
    "remote_wait_s": 3.0,  # longest a request waits for its agent's fetch from Redis; then it goes on
    "remote_queue_mb": 1024.0,  # block data waiting for upload, at most (then uploads are dropped)
    "remote_fetch_mb": 16.0,  # block data asked for in one pipelined Redis round trip, about
    "remote_block_ttl_hours": 168.0,  # blocks expire in Redis unless used (refreshed on every use)
    "remote_manifest_ttl_hours": 720.0,  # also how long an erasure's tombstone holds (docs/fleet.md)
    # A file holding the fleet's shared secret (or env VLLM_MLX_PERSIST_FLEET_SECRET; never inline,
    # where it would show in the command line): every value in Redis then carries an HMAC.
    "remote_secret_file": None,
}

# Warm-up at start-up (see PersistQ4Backend.warm_up): one prefill chunk on the dequantized path
# (>= DEQUANT_MIN_QUERIES queries), then a few batched decode steps on the quantized one.
WARMUP_TOKENS = max(16, 2 * DEQUANT_MIN_QUERIES)
WARMUP_STEPS = 3


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vllm-mlx-persist"


def parse_options(options: Optional[dict]) -> dict[str, Any]:
    """Merge user options over DEFAULTS; unknown keys and bad values raise ValueError."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(DEFAULTS))
    if "remote_secret" in unknown:
        raise ValueError("persist_q4 remote_secret is not taken inline (the command line is visible to every "
                         "user of the machine): put it in a file named by remote_secret_file, or in the "
                         "environment variable VLLM_MLX_PERSIST_FLEET_SECRET")
    if unknown:
        raise ValueError(f"unknown persist_q4 option(s) {unknown}; known: {sorted(DEFAULTS)}")
    opts = {**DEFAULTS, **options}
    try:
        for key in ("hot_mb", "disk_mb", "write_timeout_s", "remote_timeout_s", "remote_wait_s",
                    "remote_queue_mb", "remote_fetch_mb", "remote_block_ttl_hours", "remote_manifest_ttl_hours"):
            opts[key] = float(opts[key])
        for key in ("bits", "group_size", "block_size", "branches"):
            opts[key] = int(opts[key])
        if opts["ttl_hours"] is not None:
            opts["ttl_hours"] = float(opts["ttl_hours"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"bad persist_q4 option value: {e}") from None
    for key in ("decode_float_mb", "carry_float_mb"):
        mb = opts[key]
        if mb == "auto":
            continue
        try:
            mb = float(mb) if not isinstance(mb, bool) else -1.0
        except (TypeError, ValueError):
            mb = -1.0
        if not 0 <= mb < float("inf"):
            raise ValueError(f"persist_q4 {key} must be \"auto\" or a number of MB >= 0; got {opts[key]!r}")
        opts[key] = mb
    if opts["disk_mb"] <= 0 or opts["write_timeout_s"] <= 0 or (opts["ttl_hours"] is not None and opts["ttl_hours"] <= 0):
        raise ValueError("persist_q4 disk_mb, write_timeout_s and ttl_hours must be > 0")
    if opts["bits"] not in (2, 3, 4, 5, 6, 8):
        raise ValueError(f"persist_q4 bits must be one of 2, 3, 4, 5, 6, 8; got {opts['bits']}")
    if opts["group_size"] not in (32, 64, 128):
        raise ValueError(f"persist_q4 group_size must be 32, 64 or 128; got {opts['group_size']}")
    if opts["block_size"] < 16 or opts["hot_mb"] < 0:
        raise ValueError("persist_q4 block_size must be >= 16 and hot_mb >= 0")
    if opts["prefill_attention"] not in PREFILL_ATTENTION_MODES:
        raise ValueError(
            f"persist_q4 prefill_attention must be one of {PREFILL_ATTENTION_MODES}; "
            f"got {opts['prefill_attention']!r}"
        )
    for key in ("durable_writes", "match_text", "warmup", "restore", "remote_cluster"):
        if not isinstance(opts[key], bool):
            raise ValueError(f"persist_q4 {key} must be true or false")
    if not 1 <= opts["branches"] <= 64:
        raise ValueError(f"persist_q4 branches must be 1 to 64; got {opts['branches']}")
    url = opts["remote_url"]
    if url is not None and (not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://"))):
        raise ValueError("persist_q4 remote_url must be a redis://, rediss:// or unix:// URL")
    if opts["remote_cluster"] and url is not None and (
            url.startswith("unix://") or urlsplit(url).path.strip("/") not in ("", "0")):
        raise ValueError("persist_q4 remote_cluster needs a redis:// or rediss:// URL of any node, database 0 "
                         "(a Redis Cluster has no unix sockets and no other databases)")
    if min(opts["remote_timeout_s"], opts["remote_wait_s"], opts["remote_queue_mb"], opts["remote_fetch_mb"],
           opts["remote_block_ttl_hours"], opts["remote_manifest_ttl_hours"]) <= 0:
        raise ValueError("persist_q4 remote_* time-outs, sizes and TTLs must be > 0")
    secret_file = opts["remote_secret_file"]
    if secret_file is not None:
        if not isinstance(secret_file, str) or not secret_file:
            raise ValueError("persist_q4 remote_secret_file must be the path of a file holding the fleet secret")
        opts["remote_secret_file"] = os.path.expanduser(secret_file)
    opts["cache_dir"] = Path(os.path.expanduser(opts["cache_dir"])) if opts["cache_dir"] else default_cache_dir()
    return opts


class _OneLineRefusal(logging.Filter):
    """uvicorn logs a failed start-up as the whole traceback; for a refusal of ours the message says
    everything, so that record is reduced to it (other records pass untouched)."""

    def __init__(self, message: str):
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg
        if isinstance(msg, str) and msg.startswith("Traceback") and msg.rstrip().endswith(self.message):
            record.msg, record.args, record.exc_info, record.exc_text = self.message, (), None, None
        return True


def _check_redis_client() -> None:
    try:
        import redis  # noqa: F401
    except ImportError:
        raise ValueError('persist_q4: remote_url is set but the Redis client is not installed: '
                         'pip install "vllm-mlx-persist[fleet]"') from None


def _refuse(e: ValueError) -> ValueError:
    """Make the start-up failure that `e` causes print as one line; returns `e` to raise."""
    logging.getLogger("uvicorn.error").addFilter(_OneLineRefusal(str(e).strip()))
    return e


class PersistQ4Backend:
    """Per-agent persistent 4-bit prefix cache for vllm-mlx's continuous-batching scheduler."""

    def __init__(self, *, model: Any, tokenizer: Any, config: Any = None, options: Optional[dict] = None):
        try:
            opts = parse_options(options)
            self._remote_secret: Optional[bytes] = None  # kept out of opts, which may be shown
            if opts["remote_url"] is not None:
                _check_redis_client()
                from .remote import load_secret
                self._remote_secret = load_secret(opts["remote_secret_file"])
            # Refuses, naming the model type and the reason, the few models that cannot work.
            self.codec = ModelCodec.for_model(model, opts["bits"], opts["group_size"], bounded=True)
        except ValueError as e:
            raise _refuse(e)
        install_attention_fix()  # after the model's module is imported: it rebinds the SDPA dispatcher
        set_prefill_attention(opts["prefill_attention"])
        set_decode_float_budget(opts["decode_float_mb"])
        set_carry_float_budget(opts["carry_float_mb"])
        self.model, self.tokenizer, self.opts = model, tokenizer, opts
        self._match_decoder: Optional[MatchDecoder] = None  # built on first use, on the worker
        self.bits, self.group_size = opts["bits"], opts["group_size"]
        self.cache_dir: Path = opts["cache_dir"]
        try:  # here, not with the pool: a second server on the same directory fails at start-up
            self._dir_lock = CacheDirLock(self.cache_dir)
        except (StoreError, OSError) as e:
            raise _refuse(ValueError(f"persist_q4: {e}")) from None
        self._pool: Optional[BlockPool] = None
        self.fleet = None  # fleet.Fleet, built with the pool when remote_url is set
        self.disk_error: Optional[str] = None  # why the disk tier is off, when it is
        # The engine holds a finished response at most this long for its turn's write (seam contract).
        self.durable_timeout_s = opts["write_timeout_s"]
        # the engine admits a request once its blocks are read (ready()), waiting at most this long
        self.ready_timeout_s = READ_TIMEOUT_S + (opts["remote_wait_s"] if opts.get("remote_url") else 0.0)
        self.warmup: dict[str, Any] = {}  # what `load()`'s warm-up did, for get_stats
        self.closed = False

    @property
    def pool(self) -> BlockPool:
        """The pool, built on first use. The factory runs on the event-loop thread, but hashing the
        weights is MLX work, which belongs on the worker thread that calls everything else.

        The model's directory under the root is only known here, after hashing: if it cannot be used
        (bad model.json, another model's or format version's, unreadable) the server serves with an
        in-memory cache only and says why in get_stats(), rather than fail every request."""
        if self._pool is None:
            opts = self.opts
            cache_format = {
                "format_version": FORMAT_VERSION,
                "bits": self.bits,
                "group_size": self.group_size,
                "block_size": opts["block_size"],
            }
            self.fingerprint = model_fingerprint(self.model, self.tokenizer, cache_format)
            n_layers = self.codec.n_layers
            model_type = getattr(getattr(self.model, "args", None), "model_type", None)
            try:
                store = DiskStore(self.cache_dir, self.fingerprint,
                                  {"model_type": model_type, "n_layers": n_layers}, cache_format)
            except StoreError as e:
                store, self.disk_error = None, str(e)
                log.error("persist_q4: disk tier DISABLED, agents are cached in memory only: %s", e)
            ttl = opts["ttl_hours"]
            self._pool = BlockPool(
                fingerprint=self.fingerprint,
                n_layers=n_layers,
                bits=self.bits,
                group_size=self.group_size,
                block_size=opts["block_size"],
                hot_bytes=int(opts["hot_mb"] * 2**20),
                store=store,
                disk_budget=int(opts["disk_mb"] * 2**20),
                persister_options={"ttl_s": None if ttl is None else ttl * 3600.0,
                                   "queue_bytes": max(64 << 20, int(opts["hot_mb"] * 2**20) // 4)},
                durable_writes=opts["durable_writes"],
                write_timeout_s=opts["write_timeout_s"],
                codec=self.codec,
                branches=opts["branches"],
                decode=self._decode if opts["match_text"] else None,
                fleet=self._fleet_factory() if opts["remote_url"] is not None and store is not None else None,
            )
            self.fleet = self._pool.fleet
            if opts["remote_url"] is not None and store is None:
                log.error("persist_q4: fleet tier OFF: it needs the local disk tier, which is disabled")
            log.info(
                "persist_q4: %d-bit KV, group %d, blocks of %d tokens, hot tier %.0f MB, prefill attention %s, "
                "float decode mirror %.0f MB, carried floats %.0f MB, dir %s (model %s)",
                self.bits, self.group_size, opts["block_size"], opts["hot_mb"], opts["prefill_attention"],
                decode_float_budget_bytes() / 2**20, carry_float_budget_bytes() / 2**20,
                store.model_dir if store else "none", self.fingerprint[:16],
            )
        return self._pool

    def _decode(self, tokens: list[int]) -> str:
        """Text for matching by text: equal only when the model reads the same (match_decode.py);
        the tokenizer's own decode cleans up spaces, hides bad bytes and spells control tokens."""
        if self._match_decoder is None:
            self._match_decoder = MatchDecoder(self.tokenizer)
        return self._match_decoder(tokens)

    def _fleet_factory(self) -> Callable[[BlockPool], Any]:
        """What builds the fleet tier's glue for the pool (BlockPool(fleet=...))."""
        from .fleet import Fleet
        from .remote import RemoteTier

        opts = self.opts

        def tier(**callbacks: Any) -> RemoteTier:
            return RemoteTier(
                opts["remote_url"], self.fingerprint,
                read_timeout_s=opts["remote_timeout_s"],
                queue_max_bytes=int(opts["remote_queue_mb"] * 2**20),
                fetch_bytes=max(1, int(opts["remote_fetch_mb"] * 2**20)),
                block_ttl_s=int(opts["remote_block_ttl_hours"] * 3600),
                manifest_ttl_s=int(opts["remote_manifest_ttl_hours"] * 3600),
                cluster=opts["remote_cluster"], secret=self._remote_secret, **callbacks)

        def build(pool: BlockPool) -> Fleet:
            fleet = Fleet(pool, tier, wait_s=opts["remote_wait_s"], write_timeout_s=opts["write_timeout_s"])
            t = fleet.tier
            log.info("persist_q4: fleet tier on: %s%s (requests wait for it at most %.1fs; %s)", t.url_redacted,
                     " (Redis Cluster)" if t.cluster else "", opts["remote_wait_s"],
                     f"authenticated, key id {t.key_id}" if t.authenticated else "UNAUTHENTICATED")
            return fleet

        return build

    @property
    def loaded_pool(self) -> Optional[BlockPool]:
        """The pool if it has been built (by the worker), else None; for other threads."""
        return self._pool

    def fetch(self, request: Any):
        """Longest reusable prefix of the request's prompt in its agent's namespace."""
        from vllm_mlx.cache_backend import CacheLookup

        namespace, parent = split_namespace(getattr(request, "cache_namespace", None))
        t0 = time.perf_counter()
        m = self.pool.match(namespace, list(request.prompt_token_ids), getattr(request, "request_id", None),
                            fork_from=parent, wait_fleet=not getattr(request, "_vmp_fleet_waited", False))
        agent = namespace or "<anonymous>"
        if m.cache is None:
            log.info("[persist_q4] agent=%s MISS prompt=%d", agent, len(request.prompt_token_ids))
            return None
        log.info("[persist_q4] agent=%s HIT %s%s cached=%d prompt=%d in %.1f ms%s", agent, m.tier,
                 f" from parent {parent}" if m.forked else "", m.num_tokens, len(request.prompt_token_ids),
                 (time.perf_counter() - t0) * 1e3,
                 f" (matched by text; served as {len(m.prompt)} stored tokens)" if m.prompt is not None else "")
        if m.prompt is not None:
            # The prompt differs from the stored tokens but decodes to the same text: it is served
            # as the tokens the cache holds (the seam replaces request.prompt_token_ids).
            return CacheLookup(cache=m.cache, num_tokens=m.num_tokens, hit_type=m.tier, prompt_token_ids=m.prompt)
        return CacheLookup(cache=m.cache, num_tokens=m.num_tokens, hit_type=m.tier)

    def prefetch(self, namespace: str) -> None:
        """Start reading the agent's cold blocks from disk; any thread (see plugin.py)."""
        if self._pool is not None:
            for ns in split_namespace(namespace):
                if ns is not None:
                    if self.fleet is not None:
                        self.fleet.prefetch(ns)
                    self._pool.prefetch(ns)

    def ready(self, request: Any) -> Optional[Future]:
        """A future done once the disk reads (and the Redis sync) the request's lookup needs are done,
        or None. The engine awaits it before admitting the request (seam: EngineCore.add_request), so
        the worker's fetch finds the blocks read instead of stalling every running sequence on them."""
        pool = self._pool
        if pool is None:
            return None
        names = [ns for ns in split_namespace(getattr(request, "cache_namespace", None)) if ns is not None]
        if not names:
            return None
        reads = lambda: when_all(pool.pending_reads(names))  # noqa: E731 - after the sync registered its blocks
        if self.fleet is None:
            return reads()
        # The Redis part is awaited here, off the worker, at most remote_wait_s (then the request is
        # served from what is local); the worker's lookup then does not wait for it again.
        request._vmp_fleet_waited = True
        syncs = [f for f in map(self.fleet.pending, names) if f is not None]
        return when_all([with_deadline(when_all(syncs), self.fleet.wait_s)] if syncs else [], then=reads)

    def make_prompt_cache(self, request: Any = None) -> list:
        """A fresh 4-bit cache: every sequence in the batch must have one (homogeneous batch)."""
        return self.codec.make_cache()

    def validate(self, cache: list) -> bool:
        return self.codec.is_cache(cache)

    def store(self, request: Any, token_ids: list[int], cache: Any) -> Any:
        """Record the finished sequence's cache (prompt + output) under the request's agent."""
        if callable(cache):
            cache = cache()
        if not self.validate(cache or []):
            return False
        try:
            namespace, parent = split_namespace(getattr(request, "cache_namespace", None))
            n, durable = self.pool.commit_async(namespace, token_ids, cache, getattr(request, "request_id", None),
                                                fork_from=parent)
        except Exception:  # a failed store must never take the server down; the turn is just not cached
            log.exception("persist_q4: storing the cache of request %s failed", getattr(request, "request_id", "?"))
            return False
        if durable is not None and self.opts["durable_writes"]:
            # The writer thread makes the turn durable while the batch goes on; the patched engine
            # holds this request's final output until then (at most durable_timeout_s).
            return durable
        return n > 0

    def on_request_finished(self, request: Any, aborted: bool) -> None:
        # fetch hands out copies, so no block is held; only the in-flight mark is dropped
        if self._pool is not None and getattr(request, "request_id", None) is not None:
            self._pool.finish(request.request_id)

    def get_stats(self) -> dict:
        warm = {f"warmup_{k}": v for k, v in self.warmup.items()}
        if self._pool is None:  # stats are read from the HTTP thread; never build the pool there
            return {"backend": "persist_q4", **warm}
        disk = {"disk_tier": "disabled", "disk_error": self.disk_error} if self.disk_error else {"disk_tier": "on"}
        # "health" is what the seam copies into /health (as "cache_backend"): small, O(1).
        out = {"backend": "persist_q4", "fingerprint": self.fingerprint[:16], **disk,
               "health": {"backend": "persist_q4", **disk}, **self._pool.snapshot(), **warm,
               "decode_float_bytes": decode_float_bytes(), "decode_float_budget_bytes": decode_float_budget_bytes(),
               "decode_float_builds": MIRROR_COUNTS["builds"], "decode_float_refused": MIRROR_COUNTS["refused"],
               "decode_float_from_carry": MIRROR_COUNTS["carried"], "carry_float_bytes": carry_float_bytes(),
               "carry_float_budget_bytes": carry_float_budget_bytes(),
               **{f"carry_float_{k}": v for k, v in CARRY_COUNTS.items()}}
        if self.fleet is not None:
            out["remote"] = self.fleet.stats()
        return out

    def clear(self) -> None:
        if self._pool is not None:
            self._pool.clear()

    def load(self) -> int:
        """At server start, on the worker thread: read the agents' manifests, then warm up."""
        n = self.pool.load_manifests()
        if self.opts["restore"]:
            self.pool.restore_hot_set()  # in the background: start-up does not wait for it
        log.info("persist_q4: %d agents on disk", n)
        if self.opts["warmup"]:
            self.warm_up()
        return n

    def warm_up(self) -> dict:
        """Run the model once over a tiny prompt through fresh 4-bit caches, so that the first
        request after a (re)start does not pay first-use costs (allocations, compiled functions,
        the quantize / dequantized-prefill / batched-decode kernels): two sequences of
        WARMUP_TOKENS and one fewer are prefilled in one chunk each (the dequantized path), merged
        the way BatchGenerator merges them, and decoded WARMUP_STEPS steps (the float decode mirror
        when its budget allows, else the quantized path).
        Bounded (a few dozen tokens of KV), stored nowhere, never fatal; returns what it did."""
        import mlx.core as mx
        from mlx_lm.generate import _merge_caches

        t0 = time.perf_counter()
        try:
            n = WARMUP_TOKENS
            prompts = [list(range(1, n + 1)), list(range(2, n + 1))]
            caches = []
            for p in prompts:
                cache = self.make_prompt_cache()
                mx.eval(self.model(mx.array([p]), cache=cache))
                caches.append(cache)
            batch = _merge_caches(caches)
            y = mx.array([[1], [2]])
            for _ in range(WARMUP_STEPS):
                y = mx.argmax(self.model(y, cache=batch)[:, -1:, :], axis=-1)
                mx.eval(y)
            del caches, batch
            mx.clear_cache()  # give the warm-up's buffers back: it keeps nothing
            self.warmup = {"runs": self.warmup.get("runs", 0) + 1, "s": round(time.perf_counter() - t0, 3),
                           "tokens": sum(map(len, prompts)) + 2 * WARMUP_STEPS}
            log.info("persist_q4: warm-up ran the 4-bit prefill and batched decode paths in %.2f s",
                     self.warmup["s"])
        except Exception as e:  # a model that cannot warm up will say so on its first request
            self.warmup = {"runs": self.warmup.get("runs", 0), "error": f"{type(e).__name__}: {e}"}
            log.warning("persist_q4: warm-up failed (%s); serving without it", self.warmup["error"])
        return self.warmup

    def save(self) -> bool:
        if self._pool is not None:
            self._pool.flush()
        return True

    def close(self) -> None:
        self.closed = True
        if self._pool is not None:
            self._pool.close()  # with its fleet tier
        self._dir_lock.release()


def when_all(futures: list[Future], then: Optional[Callable[[], Optional[Future]]] = None) -> Optional[Future]:
    """A future done once every one of `futures` is done (whatever their outcome) and then the one
    `then()` returns, if any; None when there is nothing left to wait for."""
    pending = [f for f in futures if not f.done()]
    if not pending:
        return then() if then is not None else None
    out: Future = Future()
    left, lock = [len(pending)], threading.Lock()

    def finish(_: Any = None) -> None:
        _resolve(out)

    def one(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        try:
            nxt = then() if then is not None else None
        except Exception:  # readiness is a hint: never an error
            nxt = None
        if nxt is None:
            finish()
        else:
            nxt.add_done_callback(finish)

    for f in pending:
        f.add_done_callback(one)
    return out


def with_deadline(future: Optional[Future], seconds: float) -> Optional[Future]:
    """A future done when `future` is, or `seconds` from now, whichever comes first: a timer of the
    running event loop (ready() is called on it), so no thread waits. Without a loop: `future`."""
    if future is None:
        return None
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return future
    out: Future = Future()
    future.add_done_callback(lambda _: _resolve(out))
    loop.call_later(seconds, _resolve, out)
    return out


def _resolve(future: Future) -> None:
    try:
        future.set_result(None)
    except InvalidStateError:  # the other of two callers got there first
        pass
