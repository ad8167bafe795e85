"""The `persist_q4` cache backend: the contract vllm-mlx's scheduler calls (see patches/).

Thin on purpose: it wires the parts together at start-up and forwards each call of the contract.
Its options live in `options`, its one-line start-up refusals in `refusal`, its warm-up in
`warmup`, and `futures` builds what `ready()` returns; the cache classes and attention are in
`caches/`, blocks and tiers in `pool`, files in `store`, span directives in `kv_edit` / `amortize`
/ `splice`. The factory runs on the event-loop thread at start-up; `fetch`, `store`, `load` and the
pool's first build on the worker; `prefetch` and `ready` on the event loop; `get_stats` on the HTTP
thread (it never builds the pool).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Optional

from . import rotations
from .amortize import ModelSplicing, Splice
from .caches import ModelCodec
from .caches.attention import install_attention_fix
from .caches.floats import (
    CARRY_COUNTS,
    MIRROR_COUNTS,
    carry_float_budget_bytes,
    carry_float_bytes,
    decode_float_budget_bytes,
    decode_float_bytes,
    set_carry_float_budget,
    set_decode_float_budget,
    set_prefill_attention,
)
from .disk_format import FORMAT_VERSION
from .futures import when_all, with_deadline
from .identity import model_fingerprint
from .kv_edit import AMORTIZE, FORGET
from .kv_edit import report as kv_edit_report
from .match_decode import MatchDecoder
from .namespace import AMORTIZED_SEPARATOR, amortized_namespace, amortized_of, edit_mode, split_namespace
from .options import parse_options
from .pool import READ_TIMEOUT_S, BlockPool
from .refusal import refuse
from .rotations import Segments, clip
from .store import CacheDirLock, DiskStore, StoreError
from .warmup import warm_up

log = logging.getLogger("vllm_mlx_persist")


def _check_redis_client() -> None:
    try:
        import redis  # noqa: F401
    except ImportError:
        raise ValueError('persist_q4: remote_url is set but the Redis client is not installed: '
                         'pip install "vllm-mlx-persist[fleet]"') from None


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
            self.codec = ModelCodec.for_model(model, opts["bits"], opts["group_size"], bounded=True,
                                              latent_bits=opts["latent_bits"])
        except ValueError as e:
            raise refuse(e)
        install_attention_fix()  # after the model's module is imported: it rebinds the SDPA dispatcher
        set_prefill_attention(opts["prefill_attention"])
        set_decode_float_budget(opts["decode_float_mb"])
        set_carry_float_budget(opts["carry_float_mb"])
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
        self.fleet = None  # fleet.Fleet, built with the pool when remote_url is set
        self.disk_error: Optional[str] = None  # why the disk tier is off, when it is
        # The engine holds a finished response at most this long for its turn's write (seam contract).
        self.durable_timeout_s = opts["write_timeout_s"]
        # the engine admits a request once its blocks are read (ready()), waiting at most this long
        self.ready_timeout_s = READ_TIMEOUT_S + (opts["remote_wait_s"] if opts.get("remote_url") else 0.0)
        self.warmup: dict[str, Any] = {}  # what `load()`'s warm-up did, for get_stats
        self._splicing: Optional[ModelSplicing] = None  # probed at load (worker; _probe_splicing)
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
            if opts["latent_bits"] is not None:  # other blocks: kept apart (another model directory)
                cache_format["latent_bits"] = opts["latent_bits"]
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
                spliced_generations=opts["kv_edit"]["max_rotations"],
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
        mode = edit_mode(getattr(request, "cache_namespace", None))
        request._vmp_store_as = None  # set again below where this lookup makes the turn a spliced one
        # kv_edit.enabled false: amortize requests are exact ones, spliced histories unseen
        lookup_mode = None if mode == AMORTIZE and not self.opts["kv_edit"]["enabled"] else mode
        t0 = time.perf_counter()
        m = self.pool.match(namespace, list(request.prompt_token_ids), getattr(request, "request_id", None),
                            fork_from=parent, wait_fleet=not getattr(request, "_vmp_fleet_waited", False),
                            edit=lookup_mode)
        agent = namespace or "<anonymous>"
        if mode is not None:
            spliced = self._report_edit(request, mode, m)
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

    def _report_edit(self, request: Any, mode: str, m: Any) -> Any:
        """`usage.kv_edit` for a request that declared an edit mode (the seam reports
        `request.cache_usage`); for an amortize request the splice allows, the spliced CacheLookup."""
        prompt = m.prompt if m.prompt is not None else list(request.prompt_token_ids)  # as it is served
        n_prompt = len(prompt)
        if mode == FORGET:
            report = kv_edit_report(FORGET, True, m.num_tokens, n_prompt, superseded_branches=m.superseded)
        elif not self.opts["kv_edit"]["enabled"]:
            report = kv_edit_report(AMORTIZE, False, m.num_tokens, n_prompt, fallback="disabled")
        else:
            self._probe_splicing()
            src, gen, honest, counts = self._source(m)
            if gen:  # the lookup reused a spliced history: this turn continues it, there
                request._vmp_store_as = (src, None, False, clip(counts, m.num_tokens))
            plans = self._splicing.decide(m.stored, prompt, self.opts["kv_edit"])
            done, used, over = (plans, [], 0) if isinstance(plans, str) else self._splice(request, m, prompt, plans,
                                                                                          src, counts)
            reused = m.num_tokens - honest  # spliced tokens read back from a spliced history
            if not isinstance(done, str):
                report = kv_edit_report(AMORTIZE, True, honest, n_prompt, spliced=reused + sum(n for _, n in used))
                report["plan"] = [{"stub_tokens": p.stub, "run_tokens": n, "delta": p.delta} for p, n in used]
                report["over_budget_tokens"] = over
                request.cache_usage = {"kv_edit": report}
                log.info("[persist_q4] kv_edit %s", report)
                return done
            report = kv_edit_report(AMORTIZE, reused > 0, honest, n_prompt, spliced=reused,
                                    fallback=None if reused > 0 and done == "no_edit" else done)
            if over:
                report["over_budget_tokens"] = over
        request.cache_usage = {"kv_edit": report}
        log.info("[persist_q4] kv_edit %s", report)
        return None

    def _probe_splicing(self) -> None:
        """(worker) What this model allows a splice (`ModelSplicing.probe`: the layers' own attention
        at a few positions, tens of ms), once: at load, or at the first amortize request."""
        if self._splicing is not None:
            return
        try:
            self._splicing = ModelSplicing.probe(self.model, self.tokenizer, self.codec.has_state)
        except Exception as e:  # a model the probe cannot drive is never spliced
            self._splicing = ModelSplicing(None, self.codec.has_state, f"probe failed: {type(e).__name__}")
        log.info("persist_q4: amortize on this model: %s", self._splicing)

    def _source(self, m: Any) -> tuple[Optional[str], int, int, Segments]:
        """(namespace, generation, honest tokens, rotation counts) of an amortize lookup's source: the
        agent's own history (generation 0, every reused token honest, none rotated) or one of its
        spliced histories (only the tokens before its first spliced block are honest)."""
        if m.source is None:
            return None, 0, m.num_tokens, ()
        agent, branch = m.source
        am = amortized_of(agent.namespace)
        if am is None:
            return agent.namespace, 0, m.num_tokens, ()
        first = next((i for i, ns in branch.links if AMORTIZED_SEPARATOR in ns), 0) * self.opts["block_size"]
        counts = branch.rotations or rotations.legacy(am[1], first, branch.n_tokens)
        return agent.namespace, am[1], min(m.num_tokens, first), counts

    def _splice(self, request: Any, m: Any, prompt: list[int], plans: list, src: Optional[str], counts: Segments,
                ) -> tuple[Any, list, int]:
        """(CacheLookup, [(piece, run tokens)], run tokens over the rotation budget) for the splices of
        a request (one per edit, left to right), or (the reason it is served as exact, [], over).
        `prompt`: as served (the stored tokens where the lookup matched the client's by text).

        A run's tokens already rotated `max_rotations` times (`counts`, per token) are re-prefilled
        instead of moved: the run is cut into the pieces that may move (rotations.pieces). The turn
        is stored as a fork of its source under the agent's spliced namespace whose generation is
        the highest count the new history holds (namespace.amortized_namespace): no request can
        name it, its ids are seeded apart from any honest prefill's, and only amortize requests of
        the agent look there, so no exact or forget lookup, other agent's fork or other server's
        exact request is ever served spliced K/V."""
        from vllm_mlx.cache_backend import CacheLookup

        from . import splice

        if not splice.supported(self.codec):
            return "splice_not_built", [], 0
        opts = self.opts["kv_edit"]
        stretches: list[tuple[int, int, int]] = []  # (at, stored at, length): what may move
        over = 0
        for plan in plans:
            n_run = min(plan.length, len(prompt) - 1 - plan.at)  # a token is always left to prefill
            if n_run < opts["min_run_tokens"]:
                break  # the rest of the prompt is prefilled
            got, late = rotations.split_run(counts, plan.src, n_run, opts["max_rotations"], opts["min_run_tokens"])
            over += late
            stretches += [(plan.at + off, plan.src + off, k) for off, k in got]
        if not stretches:
            return ("rotation_budget" if over else "no_realignment"), [], over
        runs, end = [], m.num_tokens
        for at, stored_at, k in stretches:
            run = self.pool.run_arrays(m.source, stored_at, stored_at + k)
            if run is None:
                return "unreadable", [], over
            k = self.codec.run_length(run)  # bounded sliding windows: cut to where theirs is held
            if k >= opts["min_run_tokens"]:  # else prefilled, with what lies before the next piece
                # a piece's stub: all that is prefilled before it (stubs, over-budget stretches)
                runs.append((Splice(end, at, stored_at, k), run))
                end = at + k
        if not runs:
            return "window_not_held", [], over
        pieces = [p for p, _ in runs]
        cache = m.cache if m.cache is not None else self.codec.make_cache()
        cache, n = splice.apply_all(self.model, self.codec, self._splicing.verdicts, cache, m.num_tokens, prompt,
                                    runs)
        new = rotations.normalize(clip(counts, m.num_tokens) + tuple(
            seg for p in pieces for seg in rotations.moved(counts, p.src, p.length, p.at, p.delta)))
        target = amortized_namespace(split_namespace(getattr(request, "cache_namespace", None))[0],
                                     max(1, rotations.peak(new)))
        # The same generation as its source: a new branch of it, continuing its chain.
        request._vmp_store_as = (target, None if target == src else src, True, new)
        self.pool.stats["kv_edit_splices"] += 1
        cached = m.num_tokens + sum(p.length for p in pieces)
        lookup = CacheLookup(cache=cache, num_tokens=n, hit_type="splice", cached_tokens=cached,
                             prompt_token_ids=m.prompt)  # matched by text: served as the stored tokens
        return (lookup,
                [(p, p.length) for p in pieces], over)

    def prefetch(self, namespace: str) -> None:
        """Start reading the cold blocks a request's lookup needs from disk (and syncing them with the
        fleet), given its cache namespace (`_lookup_names`); any thread (see plugin.py)."""
        if self._pool is not None:
            for ns in self._lookup_names(namespace):
                if self.fleet is not None:
                    self.fleet.prefetch(ns)
                self._pool.prefetch(ns)

    def _lookup_names(self, namespace: Optional[str]) -> list[str]:
        """The namespaces a request's lookup reads: its agent, the fork parent, and for an amortize
        request the agent's spliced namespaces (pool.spliced_namespaces)."""
        names = [ns for ns in split_namespace(namespace) if ns is not None]
        if names and edit_mode(namespace) == AMORTIZE and self.opts["kv_edit"]["enabled"] and self._pool is not None:
            names += self._pool.spliced_namespaces(names[0])
        return names

    def ready(self, request: Any) -> Optional[Future]:
        """A future done once the disk reads (and the Redis sync) the request's lookup needs are done,
        or None. The engine awaits it before admitting the request (seam: EngineCore.add_request), so
        the worker's fetch finds the blocks read instead of stalling every running sequence on them."""
        pool = self._pool
        if pool is None:
            return None
        names = self._lookup_names(getattr(request, "cache_namespace", None))
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
            spliced = False
            counts = ()
            if getattr(request, "_vmp_store_as", None) is not None:  # a spliced history (see _splice)
                namespace, parent, spliced, counts = request._vmp_store_as
            n, durable = self.pool.commit_async(namespace, token_ids, cache, getattr(request, "request_id", None),
                                                fork_from=parent, spliced=spliced, rotations=counts)
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
        if self.opts["kv_edit"]["enabled"]:
            self._probe_splicing()  # so the first amortize request does not pay it
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
