"""Span directives, amortize: executing a splice (issue #21). MLX, on the worker thread.

Given the exact prefix's cache (from the pool), the model prefills the stub, and the stored run's
arrays are appended with their keys moved by Δ (`rope_shift.shift_arrays`: values and MLA latents
untouched). Spliced here: 4-bit attention layers (`Q4`), sliding-window ones included (each with
its own RoPE; a bounded one's live cache gets the window before the new end only, which the run
gives for its last window: `ModelCodec.splice_run`), and MLA layers (`FULL`: the cache's "values"
slot holds k_pe; `LIST`: deepseek_v32's latent and indexer caches), latent-packed ones too
(`latent_bits`: the run is dequantized as a reuse would, and only k_pe moves). Recurrent layers are
not (`supported`).
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx

from .plan import Splice
from ..caches import ModelCodec
from mlx_lm.models.cache import CacheList, KVCache

from ..caches.kinds import FULL, Q4
from ..caches.q4 import Q4KVCache
from .rope_shift import LayerShift, shift_arrays

_PARTS = ("q", "s", "b")


def supported(codec: ModelCodec) -> bool:
    """Whether this module can splice the codec's caches (see the module docstring)."""
    return all(k in (Q4, FULL) or (isinstance(k, tuple) and all(x == FULL for x in k[1])) for k in codec.kinds)


def _full(c: KVCache, keys: mx.array, values: mx.array, offset: int) -> KVCache:
    """A float cache holding `c`'s tokens followed by (keys, values)."""
    out = KVCache()
    if c.keys is not None:
        keys = mx.concatenate([c.keys[..., :c.offset, :], keys], axis=2)
        values = mx.concatenate([c.values[..., :c.offset, :], values], axis=2)
    out.keys, out.values, out.offset = keys, values, offset
    return out


def apply_all(model: Any, codec: ModelCodec, verdicts: Sequence[LayerShift], cache: list, covered: int,
              prompt: Sequence[int], plans: Sequence[tuple[Splice, dict]]) -> tuple[list, int]:
    """`apply` for each (plan, run) in turn, left to right: several edits in one request."""
    for plan, run in plans:
        cache, covered = apply(model, codec, verdicts, cache, covered, prompt, plan, run)
    return cache, covered


def apply(model: Any, codec: ModelCodec, verdicts: Sequence[LayerShift], cache: list, covered: int,
          prompt: Sequence[int], plan: Splice, run: dict) -> tuple[list, int]:
    """The cache for `prompt[:plan.at + n]`: `cache` covers prompt[:covered] (covered <= plan.at);
    the model prefills prompt[covered:plan.at], then the stored run (`run`: a block-style array map
    of n tokens, stored at plan.src: `BlockPool.run_arrays`) follows, its keys moved by plan.delta.
    Returns (cache, tokens)."""
    stub = list(prompt[covered:plan.at])
    if stub:
        mx.eval(model(mx.array([stub]), cache=cache))
    n = codec.run_length(run)
    moved = shift_arrays(codec.unpack_latents(run), plan.delta, codec.kinds, verdicts, codec.bits, codec.group_size)
    end = plan.at + n
    # Bounded sliding layers: a run holding only its last window (win.from > 0) is all they keep.
    alone = codec.window_from(moved) > 0
    out: list = []
    for layer, (c, kind) in enumerate(zip(cache, codec.kinds)):
        if kind == Q4:
            w = codec.window(layer)
            held = c.to_arrays() if c.keys is not None and not (alone and w is not None) else None
            parts = []
            for x in ("k", "v"):
                new = tuple(moved[f"{layer}.{x}.{p}"] for p in _PARTS)
                old = held[0 if x == "k" else 1] if held is not None else None
                parts.append(new if old is None else tuple(mx.concatenate([a, b], axis=2) for a, b in zip(old, new)))
            out.append(Q4KVCache.from_arrays(parts[0], parts[1], codec.bits, codec.group_size, window=w, offset=end,
                                             float_copies=codec.float_copies))
        elif kind == FULL:
            out.append(_full(c, moved[f"{layer}.k"], moved[f"{layer}.v"], end))
        else:
            out.append(CacheList(*(_full(sub, moved[f"{layer}.{j}.k"], moved[f"{layer}.{j}.v"], end)
                                   for j, sub in enumerate(c.caches))))
    mx.eval(list(_arrays(out)))
    return out, end


def _arrays(cache: list):
    for c in cache:
        if isinstance(c, Q4KVCache):
            yield from (a for side in c.to_arrays() for a in side)
        elif isinstance(c, CacheList):
            for sub in c.caches:
                yield from (sub.keys, sub.values)
        else:
            yield from (c.keys, c.values)
