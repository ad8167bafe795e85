"""The packed storage under the 4-bit caches (`caches.q4`): (packed uint32, scales, biases) tuples.

Its formats (the bits and group sizes mlx quantizes to, a cache's key format and the tag its
meta_state names it by) and its writes: quantize new tokens and append them, the storage grown in
`step` chunks, a sliding window's leading tokens dropped first (the bound is `caches.q4`'s module
docstring's). Worker thread only (MLX work).
"""

from __future__ import annotations

import weakref
from typing import Optional

import mlx.core as mx

from .key_formats import LayerKeys, key_bits

QTuple = tuple  # (packed uint32, scales, biases), each (B, n_kv_heads, T, ·)

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)


def _check_format(bits: int, group_size: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")


def _alloc(like: QTuple, B: int, T: int) -> QTuple:
    """Zeros shaped like the components of `like`, with batch B and length T."""
    return tuple(mx.zeros((B, x.shape[1], T, x.shape[3]), dtype=x.dtype) for x in like)


def _regrow(q: QTuple, lo: int, hi: int, cap: int) -> QTuple:
    """Tokens [lo, hi) moved to the front of new storage of `cap` tokens (zeros after them)."""
    return tuple(
        mx.concatenate([x[:, :, lo:hi], mx.zeros((*x.shape[:2], cap - (hi - lo), x.shape[3]), x.dtype)], axis=2)
        for x in q
    )


def _window_slack(cache) -> int:
    """Tokens a sliding-window cache may hold beyond its window between two drops: drops copy
    the window, so they come at most once per `slack` decode steps."""
    return min(cache.step, cache.window)


def _window_drop(cache, held: int, S: int) -> int:
    """Leading tokens a sliding-window cache holding `held` tokens drops before writing S more:
    none while the result fits window + slack, else all but the last `window`."""
    if held + S <= cache.window + _window_slack(cache):
        return 0
    return max(0, held - cache.window)


def _capacity(cache, held: int, S: int) -> int:
    """Storage tokens to allocate for `held` kept tokens and S new ones: grown in `step` chunks,
    and for a sliding window no more than window + slack unless this write needs it."""
    cap = held + (cache.step + S - 1) // cache.step * cache.step
    if getattr(cache, "window", None) is not None:
        cap = min(cap, max(cache.window + _window_slack(cache), held + S))
    return cap


def _append(cache, prev: int, keys: mx.array, values: mx.array, drop: int = 0,
            ) -> tuple[QTuple, QTuple, QTuple, QTuple]:
    """Quantize `keys`/`values` and write them after the first `prev` stored tokens of `cache`,
    less the `drop` leading ones (moved out first), growing the storage in `cache.step` chunks.
    Returns the (possibly new) storage tuples and the quantized new tokens."""
    S = keys.shape[2]
    fmt = cache.key_format
    if fmt is not None:
        keys, values = fmt.encode(keys), fmt.encode_values(values)
    qk = mx.quantize(keys, group_size=cache.group_size, bits=key_bits(cache))
    if fmt is not None and fmt.scales16 and qk[1].dtype == mx.float32:
        qk = [qk[0], qk[1].astype(mx.float16), qk[2].astype(mx.float16)]
    qv = mx.quantize(values, group_size=cache.group_size, bits=cache.bits)
    k, v = cache.keys, cache.values
    if k is None or drop or prev + S > k[0].shape[2]:
        n = _capacity(cache, prev - drop, S)
        if k is None:
            k, v = _alloc(qk, keys.shape[0], n), _alloc(qv, keys.shape[0], n)
        else:
            k, v = _regrow(k, drop, prev, n), _regrow(v, drop, prev, n)
    at = prev - drop
    for dst, src in zip(k + v, qk + qv):
        dst[:, :, at : at + S] = src
    return k, v, qk, qv


# The per-step paths index the 4-D (B, n_kv_heads, T, .) arrays as `x[:, :, a:b]`: MLX parses an
# index with `...` in about twice the time (~10 against ~5 us), which a decode step pays ~16 times a
# layer.
def _qmap(fn, *qs: QTuple) -> QTuple:
    return tuple(fn(*xs) for xs in zip(*qs))


def _qslice(q: QTuple, end: int) -> QTuple:
    return tuple(x[:, :, :end] for x in q)


def _qnbytes(q: Optional[QTuple]) -> int:
    return 0 if q is None else sum(x.nbytes for x in q)


def _same_keys(a: Optional[LayerKeys], b: Optional[LayerKeys]) -> bool:
    """Whether two caches' key formats store keys alike (None: the cache's own bits, plain)."""
    return a is b or (a is not None and a.same(b))


def _key_format(key_format: Optional[LayerKeys], bits: int) -> Optional[LayerKeys]:
    """None for a plain format of the cache's own bits (what every cache without one means)."""
    if key_format is not None and key_format.transform is None and key_format.values is None and key_format.bits == bits:
        return None
    if key_format is not None:
        _check_format(key_format.bits, 64)
    return key_format


# Calibrated key formats (their scales and centre are the model's, not a cache's state) by the token
# their caches' meta_state names: from_state in this process finds the same format; elsewhere it refuses.
_CALIBRATED: "weakref.WeakValueDictionary[str, LayerKeys]" = weakref.WeakValueDictionary()


def _key_format_tag(kf: LayerKeys) -> str:
    """"kf:bits:transform:values:s16:token" (token: a calibrated format's registration, else empty)."""
    token = ""
    if kf.scales is not None:
        token = str(id(kf))
        _CALIBRATED.setdefault(token, kf)
    return f"kf:{kf.bits}:{kf.transform or ''}:{kf.values or ''}:{int(kf.scales16)}:{token}"


def _key_format_of(tag: str) -> LayerKeys:
    """The key format a meta_state tag names; ValueError for a calibrated one this process does not hold."""
    _, bits, transform, values, s16, token = tag.split(":")
    if transform in ("scaled", "centred"):
        kf = _CALIBRATED.get(token)
        if kf is None or (kf.bits, kf.transform) != (int(bits), transform):
            raise ValueError(f"a cache of key format k{bits} {transform} cannot be rebuilt here: its scales are "
                             "the model's calibration (the server's cache root keeps it), not the cache's state")
        return kf
    return LayerKeys(int(bits), transform or None, None, values or None, None, bool(int(s16)))
