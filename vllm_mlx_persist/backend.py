"""The `persist_q4` cache backend: the contract vllm-mlx's scheduler calls (see patches/).

Thin on purpose: it wires the parts together at start-up and forwards each call of the contract.
Its options live in `options`, its one-line start-up refusals in `refusal`, its warm-up in
`warmup`, and `futures` builds what `ready()` returns; the cache classes and attention are in
`caches/`, blocks and tiers in `pool`, files in `store`, span directives in `kv_edit/` (its `serve`:
what `fetch` does for a request that declared one). The factory runs on the event-loop thread at
start-up; `fetch`, `store`, `load` and the pool's first build on the worker; `prefetch` and `ready` on
the event loop; `get_stats` on the HTTP thread (it never builds the pool).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Optional

from .cache_root import CacheDirLock
from .caches import ModelCodec
from .caches.attention import install_attention_fix
from .caches.floats import FloatCopies
from .caches.kinds import FULL, Q4
from .disk_format import FORMAT_VERSION
from .futures import when_all, with_deadline
from .identity import model_digest, model_fingerprint
from . import key_choice
from .key_calibration import CALIBRATED, calibration_params, option_obstacle, scale_shapes
from .key_calibration import describe as describe_keys
from .key_calibration import identity as keys_identity
from .key_calibration import resolve as resolve_keys
from .kv_edit.serve import SpanDirectives
from .match_decode import MatchDecoder
from .namespace import Route
from .options import parse_options
from .pool import READ_TIMEOUT_S, BlockPool
from .refusal import refuse
from .store import DiskStore, StoreError
from .warmup import warm_up

log = logging.getLogger("vllm_mlx_persist")


def prefill_one_prompt_per_call(config: Any) -> None:
    """Have the scheduler's BatchGenerator prefill one prompt per model call (its prefill_batch_size,
    which it reads from `config` when it builds the generator, after this factory ran).

    Several prompts in one call are right-padded into one matrix, and BLAS rounds a row of the
    model's projections differently with the number of rows (OpenBLAS here): ~1e-7 on the float
    K/V, which a float cache carries as noise but 4-bit quantization turns into a whole level
    wherever a value sits that close to a level boundary (logprobs 1e-4..3e-3 apart instead of
    ~3e-6). One prompt per call computes a row's prompt exactly as alone: the same chunks of the
    same tokens (docs/design.md, "Batch invariance")."""
    size = getattr(config, "prefill_batch_size", None)
    if isinstance(size, int) and size > 1:
        log.info("persist_q4: prefilling one prompt per model call (prefill_batch_size %d -> 1), so that an "
                 "answer does not depend on the prompts prefilled with it; option batch_prefill: true keeps %d",
                 size, size)
        config.prefill_batch_size = 1


class PersistQ4Backend:
    """Per-agent persistent 4-bit prefix cache for vllm-mlx's continuous-batching scheduler.

    Owns the budgets of the float copies its 4-bit caches attend on (`float_copies`, built from the
    options prefill_attention, decode_float_mb and carry_float_mb), which its codec hands to every
    cache it makes; get_stats reads their byte counts and counters. Also owns the key_format
    option's resolution (`key_report`, set once on the worker before any cache is made: the
    codec's per-layer key formats, caches/key_formats.py), part of the model identity."""

    def __init__(self, *, model: Any, tokenizer: Any, config: Any = None, options: Optional[dict] = None):
        try:
            opts = parse_options(options)
            # The fleet tier's settings (its secret kept out of opts, which may be shown), or None.
            self.fleet_settings = None
            if opts["remote_url"] is not None:
                from .fleet import FleetSettings

                self.fleet_settings = FleetSettings.from_options(opts)
            # The float copies the 4-bit caches attend on: their prefill mode and budgets, for every
            # cache the codec makes; get_stats reads their byte counts (HTTP thread).
            self.float_copies = FloatCopies(opts["prefill_attention"], opts["decode_float_mb"], opts["carry_float_mb"])
            # Refuses, naming the model type and the reason, the few models that cannot work.
            self.codec = ModelCodec.for_model(model, opts["bits"], opts["group_size"], bounded=True,
                                              latent_bits=opts["latent_bits"], float_copies=self.float_copies)
            _check_key_format(opts, model, self.codec)
        except ValueError as e:
            raise refuse(e)
        install_attention_fix()  # after the model's module is imported: it rebinds the SDPA dispatcher
        if not opts["batch_prefill"]:
            prefill_one_prompt_per_call(config)
        self.model, self.tokenizer, self.opts = model, tokenizer, opts
        self._match_decoder: Optional[MatchDecoder] = None  # built on first use, on the worker
        self.bits, self.group_size = opts["bits"], opts["group_size"]
        self.cache_dir: Path = opts["cache_dir"]
        try:  # here, not with the pool: a second server on the same directory fails at start-up
            self._dir_lock = CacheDirLock(self.cache_dir)
        except (StoreError, OSError) as e:
            raise refuse(ValueError(f"persist_q4: {e}")) from None
        self._pool: Optional[BlockPool] = None
        self.fleet = None  # fleet.Fleet, built with the pool when remote_url is set (fleet_settings)
        self.disk_error: Optional[str] = None  # why the disk tier is off, when it is
        # The engine holds a finished response at most this long for its turn's write (seam contract).
        self.durable_timeout_s = opts["write_timeout_s"]
        # the engine admits a request once its blocks are read (ready()), waiting at most this long
        self.ready_timeout_s = READ_TIMEOUT_S + (opts["remote_wait_s"] if opts.get("remote_url") else 0.0)
        self.warmup: dict[str, Any] = {}  # what `load()`'s warm-up did, for get_stats
        # The key_format option resolved per layer (`_resolve_keys`, on the worker: "auto" and "scaled"
        # run the model); until then the codec's caches store keys like values. Read by get_stats.
        self.key_report: Optional[dict] = None
        self._keys_error: Optional[RuntimeError] = None  # an explicit key_format that calibration refused
        self._q4_fp: Optional[str] = None  # the model identity with q4 keys, hashed once (worker)
        self._model_digest: Optional[str] = None  # the weights' hash both fingerprints share (worker)
        # span directives (kv_edit/): a request's usage.kv_edit, and an amortize request's splice
        self.edits = SpanDirectives(model, tokenizer, self.codec, opts["kv_edit"], opts["block_size"])
        self.closed = False

    @property
    def pool(self) -> BlockPool:
        """The pool, built on first use. The factory runs on the event-loop thread, but hashing the
        weights is MLX work, which belongs on the worker thread that calls everything else.

        The model's directory under the root is only known here, after hashing: if it cannot be used
        (bad model.json, another model's or format version's, unreadable) the server serves with an
        in-memory cache only and says why in get_stats(), rather than fail every request."""
        if self._pool is None:
            self._resolve_keys()
            opts = self.opts
            cache_format = self._cache_format()
            keys_id = keys_identity(self.codec.key_formats)
            if keys_id is not None:  # keys stored otherwise: another model directory (q4's is unchanged)
                cache_format["key_format"] = keys_id
                self.fingerprint = model_fingerprint(self.model, self.tokenizer, cache_format, self._digest())
            else:
                self.fingerprint = self._q4_fingerprint()
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
                fleet=self._fleet_factory() if self.fleet_settings is not None and store is not None else None,
                removal_ttl_s=opts["remote_manifest_ttl_hours"] * 3600.0,
                fork_policy=opts["fork_policy"],
            )
            self.fleet = self._pool.fleet
            if opts["remote_url"] is not None and store is None:
                log.error("persist_q4: fleet tier OFF: it needs the local disk tier, which is disabled")
            log.info("persist_q4: %s", describe_keys(self.key_report))
            log.info(
                "persist_q4: %d-bit KV, group %d, blocks of %d tokens, hot tier %.0f MB, prefill attention %s, "
                "float decode mirror %.0f MB, carried floats %.0f MB, dir %s (model %s)",
                self.bits, self.group_size, opts["block_size"], opts["hot_mb"], opts["prefill_attention"],
                self.float_copies.decode_float_budget_bytes() / 2**20,
                self.float_copies.carry_float_budget_bytes() / 2**20,
                store.model_dir if store else "none", self.fingerprint[:16],
            )
        return self._pool

    def _cache_format(self) -> dict:
        """What the model identity records of the cache format, keys stored as q4."""
        cache_format = {"format_version": FORMAT_VERSION, "bits": self.bits, "group_size": self.group_size,
                        "block_size": self.opts["block_size"]}
        if self.opts["latent_bits"] is not None:  # other blocks: kept apart (another model directory)
            cache_format["latent_bits"] = self.opts["latent_bits"]
        return cache_format

    def _q4_fingerprint(self) -> str:
        """The model identity with keys stored as q4 (hashed once: the key choice's file and the pool)."""
        if self._q4_fp is None:
            self._q4_fp = model_fingerprint(self.model, self.tokenizer, self._cache_format(), self._digest())
        return self._q4_fp

    def _digest(self) -> str:
        """The model's digest (identity.model_digest: every weight hashed), once (worker)."""
        if self._model_digest is None:
            self._model_digest = model_digest(self.model, self.tokenizer)
        return self._model_digest

    def _resolve_keys(self) -> None:
        """Resolve the key_format option into the codec's per-layer key formats, once, before any
        cache is made (worker thread: "auto", "scaled" and the centred formats run the model on a calibration text,
        unless this model's choice is remembered in the cache root: key_choice.py)."""
        if self.key_report is not None:
            return
        option = self.opts["key_format"]
        if self._keys_error is not None:
            raise self._keys_error
        try:
            if option in CALIBRATED and Q4 in self.codec.kinds:
                formats, report = self._remembered_keys(option)
            else:
                formats, report = resolve_keys(option, self.model, self.tokenizer, self.codec)
        except Exception as e:
            if option != "auto":
                # An explicit format is never served as q4 instead (issue #50). The factory refused
                # what the model's shapes rule out; what only calibration finds fails every cache.
                log.error("persist_q4: key_format %s cannot be served: %s: %s", option, type(e).__name__, e)
                self._keys_error = RuntimeError(f"persist_q4 key_format {option} cannot be served: {e}")
                raise self._keys_error from e
            # auto: keys are then stored like values, and the stats say why
            log.exception("persist_q4: key_format auto could not be resolved; keys stored as q4")
            formats = [None] * self.codec.n_layers
            report = {"option": option, "chosen": "q4", "error": f"{type(e).__name__}: {e}"}
        self.codec.key_formats = formats  # in place: SpanDirectives holds this codec too
        self.key_report = report

    def _remembered_keys(self, option: str) -> tuple[list, dict]:
        """A calibrating option's per-layer formats: read back from the cache root when this model
        and calibration chose before, else measured and remembered there."""
        # What the choice depends on: the model, bits and group size; not the block size (a server
        # with block_size 32 read no choice made at 256, and calibrated for minutes).
        calibrated_on = {"bits": self.bits, "group_size": self.group_size, "latent_bits": self.opts["latent_bits"]}
        fingerprint = model_fingerprint(self.model, self.tokenizer, calibrated_on, self._digest())
        key = key_choice.choice_key(fingerprint, option, calibration_params())
        got = key_choice.load(self.cache_dir, key, scale_shapes(self.model, self.codec))
        if got is not None:
            return got
        formats, report = resolve_keys(option, self.model, self.tokenizer, self.codec)
        key_choice.save(self.cache_dir, key, formats, report)
        return formats, report

    def _decode(self, tokens: list[int]) -> str:
        """Text for matching by text: equal only when the model reads the same (match_decode.py);
        the tokenizer's own decode cleans up spaces, hides bad bytes and spells control tokens."""
        if self._match_decoder is None:
            self._match_decoder = MatchDecoder(self.tokenizer)
        return self._match_decoder(tokens)

    def _fleet_factory(self) -> Callable[[Any], Any]:
        """What builds the fleet tier's glue over the pool as the fleet sees it (BlockPool(fleet=...):
        fleet_view.FleetView, a fleet.FleetPool)."""
        from .fleet import Fleet, RemoteTier

        settings = self.fleet_settings

        def build(pool: Any) -> Fleet:
            # The weights' keyspaces of every key format (fleet/family.py): q4's fingerprint is theirs.
            family = (self._q4_fingerprint(), str((self.key_report or {}).get("chosen") or self.opts["key_format"]))
            fleet = Fleet(pool, lambda **callbacks: RemoteTier(settings, self.fingerprint, **callbacks), family)
            t = fleet.tier
            log.info("persist_q4: fleet tier on: %s%s (requests wait for it at most %.1fs; %s)", t.url_redacted,
                     " (Redis Cluster)" if t.cluster else "", settings.wait_s,
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

        route = route_of(request)
        namespace, parent, mode = route.agent, route.fork_from, route.edit
        request._vmp_store_as = None  # set again by edits.serve where this lookup makes the turn a spliced one
        t0 = time.perf_counter()
        m = self.pool.match(namespace, list(request.prompt_token_ids), getattr(request, "request_id", None),
                            fork_from=parent, wait_fleet=not getattr(request, "_vmp_fleet_waited", False),
                            edit=self.edits.lookup_mode(mode))
        agent = namespace or "<anonymous>"
        if mode is not None:
            spliced = self.edits.serve(request, mode, m, self.pool)
            if spliced is not None:
                return spliced
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

    def prefetch(self, route: Route) -> None:
        """Start reading the cold blocks a request's lookup needs from disk (and syncing them with the
        fleet): its agent's and its fork parent's; any thread (see plugin.py)."""
        if self._pool is not None:
            for ns in _lookup_names(route):
                if self.fleet is not None:
                    self.fleet.prefetch(ns)
                self._pool.prefetch(ns)

    def may_fork(self, parent: str) -> bool:
        """Whether a request may fork `parent` (the `fork_policy` option and the parent's setting, with
        a fleet tier as Redis holds it: one bounded read, pool.BlockPool.may_fork); any thread. Before
        the pool exists only an open policy allows it."""
        pool = self._pool
        if pool is None:
            return self.opts["fork_policy"] == "open"
        return pool.may_fork(parent)

    def removal_room(self) -> bool:
        """Whether a new removal (a forget) may be acknowledged: False when the fleet tier's pending
        removals are at their bound (fleet.Fleet.removal_room). Any thread, no I/O."""
        pool = self._pool
        fleet = pool.fleet if pool is not None else None
        return fleet is None or fleet.removal_room()

    def ready(self, request: Any) -> Optional[Future]:
        """A future done once the disk reads (and the Redis sync) the request's lookup needs are done,
        or None. The engine awaits it before admitting the request (seam: EngineCore.add_request), so
        the worker's fetch finds the blocks read instead of stalling every running sequence on them."""
        pool = self._pool
        if pool is None:
            return None
        names = _lookup_names(route_of(request))
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
        self._resolve_keys()
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
            route = route_of(request)
            generation, counts = getattr(request, "_vmp_store_as", None) or (0, ())  # a spliced turn (kv_edit.serve)
            n, durable = self.pool.commit_async(route.agent, token_ids, cache, getattr(request, "request_id", None),
                                                fork_from=route.fork_from, generation=generation, rotations=counts)
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
        keys = {} if self.key_report is None else {"key_format": self.key_report}
        if self._pool is None:  # stats are read from the HTTP thread; never build the pool there
            return {"backend": "persist_q4", **warm, **keys}
        disk = {"disk_tier": "disabled", "disk_error": self.disk_error} if self.disk_error else {"disk_tier": "on"}
        # "health" is what the seam copies into /health (as "cache_backend"): small, O(1).
        fc = self.float_copies
        mirrors = fc.mirror_counts
        out = {"backend": "persist_q4", "fingerprint": self.fingerprint[:16], **disk,
               "health": {"backend": "persist_q4", **disk}, **self._pool.snapshot(), **warm,
               "decode_float_bytes": fc.decode_float_bytes(),
               "decode_float_budget_bytes": fc.decode_float_budget_bytes(),
               "decode_float_builds": mirrors["builds"], "decode_float_refused": mirrors["refused"],
               "decode_float_from_carry": mirrors["carried"], "carry_float_bytes": fc.carry_float_bytes(),
               "carry_float_budget_bytes": fc.carry_float_budget_bytes(),
               **{f"carry_float_{k}": v for k, v in fc.carry_counts.items()}, **keys}
        if self.fleet is not None:
            out["remote"] = self.fleet.stats()
            if out["remote"].get("mixed_key_formats"):  # servers of these weights that share no K/V with this one
                out["health"]["fleet_key_formats"] = out["remote"]["key_formats"]
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
        if self.edits.enabled:
            self.edits.probe()  # so the first amortize request does not pay it
        return n

    def warm_up(self) -> dict:
        """Run the model once through fresh 4-bit caches (warmup.py), so that the first request after
        a (re)start does not pay first-use costs; never fatal; returns what it did (for get_stats)."""
        self.warmup = warm_up(self.model, self.make_prompt_cache, self.warmup.get("runs", 0))
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


def _check_key_format(opts: dict, model: Any, codec: ModelCodec) -> None:
    """Refuse at start-up an option this model cannot honour, naming the layer and the property: a
    fixed key_format (key_calibration.option_obstacle; never served as q4 instead), or latent_bits
    on a model without MLA latents."""
    why = option_obstacle(opts["key_format"], model, codec)
    if why is not None:
        raise ValueError(f"persist_q4 key_format {opts['key_format']} cannot be served on this model: {why}")
    if opts["latent_bits"] is not None and not any(k == FULL or (isinstance(k, tuple) and FULL in k[1])
                                                   for k in codec.kinds):
        raise ValueError(f"persist_q4 latent_bits {opts['latent_bits']} needs layers that cache MLA latents; "
                         "this model has none")


def route_of(request: Any) -> Route:
    """A request's route, parsed once from the cache_namespace the seam carries (kept on the request)."""
    route = getattr(request, "_vmp_route", None)
    if route is None:
        route = Route.parse(getattr(request, "cache_namespace", None))
        try:
            request._vmp_route = route
        except AttributeError:  # a request object without a __dict__: parsed again next time
            pass
    return route


def _lookup_names(route: Route) -> list[str]:
    """The agents a request's lookup reads: its own, and the parent it forks from."""
    return [ns for ns in (route.agent, route.fork_from) if ns is not None]
