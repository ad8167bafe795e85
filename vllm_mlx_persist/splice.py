"""Span directives, amortize: executing a splice (issue #21). MLX, on the worker thread.

Given the exact prefix's cache (from the pool), the model prefills the stub, and the stored run's
arrays are appended with their keys moved by Δ (`rope_shift.shift_arrays`: values untouched). Only
models whose every layer is a linear 4-bit cache (`Q4`, no sliding window) are spliced here; others
are served as exact (`supported` says which).
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx

from .amortize import Splice
from .caches import ModelCodec
from .q4cache import Q4, Q4KVCache
from .rope_shift import LayerShift, shift_arrays

_PARTS = ("q", "s", "b")


def supported(codec: ModelCodec) -> bool:
    """Whether this module can splice the codec's caches (every layer a linear Q4 cache)."""
    return all(k == Q4 for k in codec.kinds) and not codec.windows


def apply(model: Any, codec: ModelCodec, verdicts: Sequence[LayerShift], cache: list, covered: int,
          prompt: Sequence[int], plan: Splice, run: dict) -> tuple[list, int]:
    """The cache for `prompt[:plan.at + n]`: `cache` covers prompt[:covered] (covered <= plan.exact);
    the model prefills prompt[covered:plan.at], then the stored run (`run`: a block-style array map
    of n tokens, stored at plan.src) follows, its keys moved by plan.delta. Returns (cache, tokens)."""
    stub = list(prompt[covered:plan.at])
    if stub:
        mx.eval(model(mx.array([stub]), cache=cache))
    moved = shift_arrays(run, plan.delta, codec.kinds, verdicts, codec.bits, codec.group_size)
    n = moved["0.k.q"].shape[2]
    out = []
    for layer, c in enumerate(cache):
        held = c.to_arrays() if c.keys is not None else None
        parts = []
        for x in ("k", "v"):
            new = tuple(moved[f"{layer}.{x}.{p}"] for p in _PARTS)
            old = held[0 if x == "k" else 1] if held is not None else None
            parts.append(new if old is None else tuple(mx.concatenate([a, b], axis=2) for a, b in zip(old, new)))
        out.append(Q4KVCache.from_arrays(parts[0], parts[1], codec.bits, codec.group_size, offset=plan.at + n))
    mx.eval([a for c in out for side in c.to_arrays() for a in side])
    return out, plan.at + n
