"""Span directives served: what the backend's `fetch` does for a request that declared an edit mode.

`SpanDirectives` is owned by the backend (one per server) and called on the worker thread from
`fetch` (`serve`: the `usage.kv_edit` report, and for an amortize request the splice) and from
`load` (`probe`); `lookup_mode` is pure bookkeeping any thread may call. A spliced turn is a branch
of the agent's record of its generation: `serve` sets `request._vmp_store_as` to (generation, rotation
counts), which the backend's `store` hands to the pool's commit.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from ..chain import lcp
from ..namespace import spliced_seed
from . import rotations
from .plan import ModelSplicing, Splice, snap
from .request import AMORTIZE, FORGET, explain
from .request import report as kv_edit_report
from .rotations import Segments, clip

log = logging.getLogger("vllm_mlx_persist")


class SpanDirectives:
    """A server's span directives: `options` is its `kv_edit` option (request.parse_option)."""

    def __init__(self, model: Any, tokenizer: Any, codec: Any, options: dict, block_size: int):
        self.model, self.tokenizer, self.codec = model, tokenizer, codec
        self.opts = options
        self.block_size = block_size
        self._splicing: Optional[ModelSplicing] = None  # probed at load (worker; probe)

    @property
    def enabled(self) -> bool:
        return self.opts["enabled"]

    def lookup_mode(self, mode: Optional[str]) -> Optional[str]:
        """The mode the pool's lookup runs under: kv_edit.enabled false serves amortize requests as
        exact ones, spliced histories unseen."""
        return None if mode == AMORTIZE and not self.enabled else mode

    def serve(self, request: Any, mode: str, m: Any, pool: Any) -> Any:
        """`usage.kv_edit` for a request that declared an edit mode (the seam reports
        `request.cache_usage`); for an amortize request the splice allows, the spliced CacheLookup."""
        prompt = m.prompt if m.prompt is not None else list(request.prompt_token_ids)  # as it is served
        n_prompt = len(prompt)
        if mode == FORGET:
            report = kv_edit_report(FORGET, True, m.num_tokens, n_prompt, superseded_branches=m.superseded)
        elif not self.enabled:
            report = kv_edit_report(AMORTIZE, False, m.num_tokens, n_prompt, fallback="disabled",
                                    detail=explain("disabled", options=self.opts))
        else:
            self.probe()
            gen, honest, counts = self._source(m)
            if gen:  # the lookup reused a spliced history: this turn continues it, in its generation
                request._vmp_store_as = (gen, clip(counts, m.num_tokens))
            plans = self._splicing.decide(m.stored, prompt, self.opts)
            done, used, over = (plans, [], 0) if isinstance(plans, str) else self._splice(request, m, prompt, plans,
                                                                                          counts, pool)
            reused = m.num_tokens - honest  # spliced tokens read back from a spliced history
            if not isinstance(done, str):
                report = kv_edit_report(AMORTIZE, True, honest, n_prompt, spliced=reused + sum(n for _, n in used))
                report["plan"] = [{"stub_tokens": p.stub, "run_tokens": n, "delta": p.delta, "boundary": p.boundary}
                                  for p, n in used]
                report["over_budget_tokens"] = over
                request.cache_usage = {"kv_edit": report}
                log.info("[persist_q4] kv_edit %s", report)
                return done
            fallback = None if reused > 0 and done == "no_edit" else done
            report = kv_edit_report(AMORTIZE, reused > 0, honest, n_prompt, spliced=reused, fallback=fallback,
                                    detail=fallback and explain(fallback, options=self.opts, exact=lcp(m.stored or (),
                                                                                                      prompt),
                                                                stored=len(m.stored or ()),
                                                                layer=self._splicing.refused_layer))
            if over:
                report["over_budget_tokens"] = over
        request.cache_usage = {"kv_edit": report}
        log.info("[persist_q4] kv_edit %s", report)
        return None

    def probe(self) -> None:
        """(worker) What this model allows a splice (`ModelSplicing.probe`: the layers' own attention
        at a few positions, tens of ms), once: at load, or at the first amortize request."""
        if self._splicing is not None:
            return
        try:
            self._splicing = ModelSplicing.probe(self.model, self.tokenizer, self.codec.has_state)
        except Exception as e:  # a model the probe cannot drive is never spliced
            self._splicing = ModelSplicing(None, self.codec.has_state, f"probe failed: {type(e).__name__}")
        log.info("persist_q4: amortize on this model: %s", self._splicing.summary())

    def _source(self, m: Any) -> tuple[int, int, Segments]:
        """(generation, honest tokens, rotation counts) of an amortize lookup's source: one of the
        agent's honest branches (generation 0, every reused token honest, none rotated) or one of its
        spliced ones (only the tokens before its first spliced block are honest: where its chain
        begins the seed of a spliced generation)."""
        if m.source is None:
            return 0, m.num_tokens, ()
        agent, branch = m.source
        if not branch.spliced:
            return 0, m.num_tokens, ()
        seeds = {spliced_seed(agent.namespace, g) for g in range(1, branch.generation + 1)}
        first = next((i for i, seed in branch.links if seed in seeds), 0) * self.block_size
        counts = branch.rotations or rotations.legacy(branch.generation, first, branch.n_tokens)
        return branch.generation, min(m.num_tokens, first), counts

    def _splice(self, request: Any, m: Any, prompt: list[int], plans: list, counts: Segments,
                pool: Any) -> tuple[Any, list, int]:
        """(CacheLookup, [(piece, run tokens)], run tokens over the rotation budget) for the splices of
        a request (one per edit, left to right), or (the reason it is served as exact, [], over).
        `prompt`: as served (the stored tokens where the lookup matched the client's by text).

        A run's tokens already rotated `max_rotations` times (`counts`, per token) are re-prefilled
        instead of moved: the run is cut into the pieces that may move (rotations.pieces). The turn
        is stored as a branch of the agent whose generation is the highest count the new history
        holds (chain.Branch.generation): its ids are seeded apart from any honest prefill's
        (namespace.spliced_seed), and only amortize requests of the agent are served from it, so no
        exact or forget lookup, other agent's fork or other server's exact request is ever served
        spliced K/V."""
        from vllm_mlx.cache_backend import CacheLookup

        from . import splice

        if not splice.supported(self.codec):
            return "splice_not_built", [], 0
        opts = self.opts
        stretches: list[tuple[int, int, int, str]] = []  # (at, stored at, length, boundary): what may move
        over = 0
        points = self._splicing.points(opts)
        for plan in plans:
            n_run = min(plan.length, len(prompt) - 1 - plan.at)  # a token is always left to prefill
            if n_run < opts["min_run_tokens"]:
                break  # the rest of the prompt is prefilled
            got, late = rotations.split_run(counts, plan.src, n_run, opts["max_rotations"], opts["min_run_tokens"])
            over += late
            for off, k in got:
                if off == 0:  # the plan's own start: a realignment point (and its recomputed tokens)
                    stretches.append((plan.at, plan.src, k, plan.boundary))
                    continue
                # a stretch after tokens over the rotation budget starts at the next realignment
                # point in it, never inside a template tag; the tokens before it are prefilled
                cut = snap(points, prompt, plan.at + off, k, opts["min_run_tokens"], opts["recompute_tokens"])
                if cut is not None:
                    at, k2, kind = cut
                    over += k - k2
                    stretches.append((at, plan.src + (at - plan.at), k2, kind))
                else:
                    over += k
        if not stretches:
            return ("rotation_budget" if over else "no_realignment"), [], over
        runs, end = [], m.num_tokens
        for at, stored_at, k, kind in stretches:
            run = pool.run_arrays(m.source, stored_at, stored_at + k)
            if run is None:
                return "unreadable", [], over
            k = self.codec.run_length(run)  # bounded sliding windows: cut to where theirs is held
            if k >= opts["min_run_tokens"]:  # else prefilled, with what lies before the next piece
                # a piece's stub: all that is prefilled before it (stubs, over-budget stretches)
                runs.append((Splice(end, at, stored_at, k, kind), run))
                end = at + k
        if not runs:
            return "window_not_held", [], over
        pieces = [p for p, _ in runs]
        cache = m.cache if m.cache is not None else self.codec.make_cache()
        cache, n = splice.apply_all(self.model, self.codec, self._splicing.verdicts, cache, m.num_tokens, prompt,
                                    runs)
        new = rotations.normalize(clip(counts, m.num_tokens) + tuple(
            seg for p in pieces for seg in rotations.moved(counts, p.src, p.length, p.at, p.delta)))
        request._vmp_store_as = (max(1, rotations.peak(new)), new)
        pool.stats["kv_edit_splices"] += 1
        cached = m.num_tokens + sum(p.length for p in pieces)
        lookup = CacheLookup(cache=cache, num_tokens=n, hit_type="splice", cached_tokens=cached,
                             prompt_token_ids=m.prompt)  # matched by text: served as the stored tokens
        return (lookup,
                [(p, p.length) for p in pieces], over)
