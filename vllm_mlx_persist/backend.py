"""The `persist_q4` cache backend: the contract vllm-mlx's scheduler calls (see patches/).

Thin on purpose: options, start-up checks and logging here; the cache math lives in `q4cache`,
blocks and tiers in `pool`, files in `store`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional

from .caches import ModelCodec
from .identity import model_fingerprint
from .persister import Persister
from .pool import BlockPool
from .q4cache import PREFILL_ATTENTION_MODES, install_attention_fix, set_prefill_attention
from .store import FORMAT_VERSION, CacheDirLock, DiskStore, StoreError

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
    "prefill_attention": "auto",  # see q4cache.set_prefill_attention
}


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vllm-mlx-persist"


def parse_options(options: Optional[dict]) -> dict[str, Any]:
    """Merge user options over DEFAULTS; unknown keys and bad values raise ValueError."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown persist_q4 option(s) {unknown}; known: {sorted(DEFAULTS)}")
    opts = {**DEFAULTS, **options}
    try:
        for key in ("hot_mb", "disk_mb", "write_timeout_s"):
            opts[key] = float(opts[key])
        for key in ("bits", "group_size", "block_size"):
            opts[key] = int(opts[key])
        if opts["ttl_hours"] is not None:
            opts["ttl_hours"] = float(opts["ttl_hours"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"bad persist_q4 option value: {e}") from None
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
    if not isinstance(opts["durable_writes"], bool):
        raise ValueError("persist_q4 durable_writes must be true or false")
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


def _refuse(e: ValueError) -> ValueError:
    """Make the start-up failure that `e` causes print as one line; returns `e` to raise."""
    logging.getLogger("uvicorn.error").addFilter(_OneLineRefusal(str(e).strip()))
    return e


class PersistQ4Backend:
    """Per-agent persistent 4-bit prefix cache for vllm-mlx's continuous-batching scheduler."""

    def __init__(self, *, model: Any, tokenizer: Any, config: Any = None, options: Optional[dict] = None):
        try:
            opts = parse_options(options)
            # Refuses, naming the model type and the reason, the few models that cannot work.
            self.codec = ModelCodec.for_model(model, opts["bits"], opts["group_size"])
        except ValueError as e:
            raise _refuse(e)
        install_attention_fix()  # after the model's module is imported: it rebinds the SDPA dispatcher
        set_prefill_attention(opts["prefill_attention"])
        self.model, self.tokenizer, self.opts = model, tokenizer, opts
        self.bits, self.group_size = opts["bits"], opts["group_size"]
        self.cache_dir: Path = opts["cache_dir"]
        try:  # here, not with the pool: a second server on the same directory fails at start-up
            self._dir_lock = CacheDirLock(self.cache_dir)
        except (StoreError, OSError) as e:
            raise _refuse(ValueError(f"persist_q4: {e}")) from None
        self._pool: Optional[BlockPool] = None
        self.disk_error: Optional[str] = None  # why the disk tier is off, when it is
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
            persister = None
            if store is not None:
                ttl = opts["ttl_hours"]
                persister = Persister(store, disk_budget=int(opts["disk_mb"] * 2**20),
                                      ttl_s=None if ttl is None else ttl * 3600.0,
                                      queue_bytes=max(64 << 20, int(opts["hot_mb"] * 2**20) // 4))
            self._pool = BlockPool(
                fingerprint=self.fingerprint,
                n_layers=n_layers,
                bits=self.bits,
                group_size=self.group_size,
                block_size=opts["block_size"],
                hot_bytes=int(opts["hot_mb"] * 2**20),
                persister=persister,
                durable_writes=opts["durable_writes"],
                write_timeout_s=opts["write_timeout_s"],
                codec=self.codec,
            )
            log.info(
                "persist_q4: %d-bit KV, group %d, blocks of %d tokens, hot tier %.0f MB, prefill attention %s, "
                "dir %s (model %s)",
                self.bits, self.group_size, opts["block_size"], opts["hot_mb"], opts["prefill_attention"],
                store.model_dir if store else "none", self.fingerprint[:16],
            )
        return self._pool

    @property
    def loaded_pool(self) -> Optional[BlockPool]:
        """The pool if it has been built (by the worker), else None; for other threads."""
        return self._pool

    def fetch(self, request: Any):
        """Longest reusable prefix of the request's prompt in its agent's namespace."""
        from vllm_mlx.cache_backend import CacheLookup

        namespace = getattr(request, "cache_namespace", None)
        cache, n, tier = self.pool.lookup(namespace, list(request.prompt_token_ids),
                                          getattr(request, "request_id", None))
        agent = namespace or "<anonymous>"
        if cache is None:
            log.info("[persist_q4] agent=%s MISS prompt=%d", agent, len(request.prompt_token_ids))
            return None
        log.info("[persist_q4] agent=%s HIT %s cached=%d prompt=%d", agent, tier, n, len(request.prompt_token_ids))
        return CacheLookup(cache=cache, num_tokens=n, hit_type=tier)

    def prefetch(self, namespace: str) -> None:
        """Start reading the agent's cold blocks from disk; any thread (see plugin.py)."""
        if self._pool is not None:
            self._pool.prefetch(namespace)

    def make_prompt_cache(self, request: Any = None) -> list:
        """A fresh 4-bit cache: every sequence in the batch must have one (homogeneous batch)."""
        return self.codec.make_cache()

    def validate(self, cache: list) -> bool:
        return self.codec.is_cache(cache)

    def store(self, request: Any, token_ids: list[int], cache: Any) -> bool:
        """Record the finished sequence's cache (prompt + output) under the request's agent."""
        if callable(cache):
            cache = cache()
        if not self.validate(cache or []):
            return False
        try:
            n = self.pool.commit(getattr(request, "cache_namespace", None), token_ids, cache,
                                 getattr(request, "request_id", None))
        except Exception:  # a failed store must never take the server down; the turn is just not cached
            log.exception("persist_q4: storing the cache of request %s failed", getattr(request, "request_id", "?"))
            return False
        return n > 0

    def on_request_finished(self, request: Any, aborted: bool) -> None:
        # fetch hands out copies, so no block is held; only the in-flight mark is dropped
        if self._pool is not None and getattr(request, "request_id", None) is not None:
            self._pool.finish(request.request_id)

    def get_stats(self) -> dict:
        if self._pool is None:  # stats are read from the HTTP thread; never build the pool there
            return {"backend": "persist_q4"}
        disk = {"disk_tier": "disabled", "disk_error": self.disk_error} if self.disk_error else {"disk_tier": "on"}
        # "health" is what the seam copies into /health (as "cache_backend"): small, O(1).
        return {"backend": "persist_q4", "fingerprint": self.fingerprint[:16], **disk,
                "health": {"backend": "persist_q4", **disk}, **self._pool.snapshot()}

    def clear(self) -> None:
        if self._pool is not None:
            self._pool.clear()

    def load(self) -> int:
        n = self.pool.load_manifests()
        log.info("persist_q4: %d agents on disk", n)
        return n

    def save(self) -> bool:
        if self._pool is not None:
            self._pool.flush()
        return True

    def close(self) -> None:
        self.closed = True
        if self._pool is not None:
            self._pool.close()
        self._dir_lock.release()
