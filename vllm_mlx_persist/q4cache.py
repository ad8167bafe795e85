"""Quantized KV caches that mlx-lm's BatchGenerator can batch without dequantizing.

`Q4KVCache` is the per-sequence cache (a `QuantizedKVCache` with `size()` and `merge()`);
`BatchQ4KVCache` implements the batch-cache contract of mlx-lm's `BatchKVCache` over the three
quantized components (packed uint32, scales, biases). mlx quantizes along the head dimension only,
so every token is quantized on its own: padding, rolling and slicing along the sequence axis are
exact, and a token quantizes the same way however the prompt was chunked or batched.

Models pick mlx-lm's quantized attention path by duck typing (`hasattr(cache, "bits")`), which has
a mask-broadcasting bug under grouped-query attention with a batched mask; `install_attention_fix`
replaces it with ours (see patches/README.md) and, on the CPU, routes multi-token chunks (prefill) through
the fast SDPA on a transient dequantized copy of the layer's K/V (`set_prefill_attention`).

On the CPU, a `BatchQ4KVCache` also keeps a bounded float *decode mirror*: the dequantized values of
its 4-bit K/V, built on its first decode step or short prefill chunk, on which attention runs with the fast
float SDPA (`set_decode_float_budget`).

Attention on a `BatchQ4KVCache` runs row by row on each row's own keys (`batch_attention`), so a
sequence's logits are bit-identical alone and batched, whatever its companions.

Sliding-window layers (`window=w` on both classes; `caches.ModelCodec(bounded=True)` sets it from
the layer's mlx-lm `RotatingKVCache`) hold only their window. The storage stays linear and
right-aligned: before a write of S tokens that would take it past `w + slack` tokens (slack =
min(step, w), so a drop, which copies the window, comes at most once per `slack` decode steps),
every leading column but the last `w` is dropped; `offset` keeps counting. A chunk longer than the
window keeps the `w` tokens before it until it is done (storage `w + S`), and the next write drops.
Masks are built in physical column space with `window_size` (`make_mask` knows the drop the next
update will make), which stays right after a drop because the window is a distance between
columns. Attention reads only the keys a query can see: the last `w - 1` before the chunk (the per
sequence update returns just those; `batch_attention` slices each row the same way, so alone and
batched attend on the same keys). In a batch, rows are aligned at their newest token, so dropping
leading columns drops every row's oldest tokens and shrinks the left padding; in a right-padded
prompt call (`prepare` .. `finalize`) a row whose prompt ended in an earlier chunk keeps its window,
so such a call counts as one chunk for the bound.

What a window cache holds, for building blocks on it (positions are logical token indices):

* `Q4KVCache`: positions [start, offset), `to_arrays()` / `state` give exactly those; always at
  least [max(0, offset - w), offset), at most w + max(slack, the last chunk's length) tokens.
  After a prefill of a fresh cache in one call of S tokens: [0, S) (nothing dropped yet); after a
  chunk of S on a cache holding h tokens: h + S if that fits w + slack, else min(h, w) + S. After
  a decode step, once past w + slack: between w + 1 and w + slack tokens.
* `BatchQ4KVCache`: row b holds [starts()[b], offset[b]); `extract(b)` returns a per-sequence
  cache holding exactly that (every token the row had, nothing re-dropped), with its `start`.
* Reuse at p: `Q4KVCache.from_arrays(keys, values, bits, group_size, window=w, offset=p)` from
  arrays covering [max(0, p - w), p) (more is accepted; only the last w are kept, as views).
  That is all the next token needs (w - 1 of them, in fact), and it continues bit for bit like
  the live cache would. `trim` keeps at least the window before the new end (it trims less and
  says how much). `meta_state` carries `window` and `start`.
"""

from __future__ import annotations

import copy
import sys
import threading
import weakref
from typing import Any, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base as _mlx_base
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    RotatingKVCache,
    QuantizedKVCache,
    _BaseCache,
    dynamic_roll,
    make_prompt_cache,
)

QTuple = tuple  # (packed uint32, scales, biases), each (B, n_kv_heads, T, ·)

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)

# Models (mlx-lm 0.31.3) whose attention reads what `update_and_fetch` returns with something other
# than the shared `base.scaled_dot_product_attention` dispatcher, so (packed, scales, biases)
# tuples would crash them or be misread.
_OWN_ATTENTION = "its attention computes the scores itself instead of using the shared SDPA"
_BYPASS_DISPATCHER = {
    "gemma2": _OWN_ATTENTION,
    "olmo": _OWN_ATTENTION,
    "plamo2": "its attention calls mx.fast.scaled_dot_product_attention directly",
    "gemma3n": "its layers share K/V across layers through the cache objects",
    "recurrent_gemma": "its attention reads the rotating cache's ring layout",
}
# Multi-head latent attention (MLA): the model multiplies the cached latent and rope key directly
# (`q_pe @ k_pe.T`, `q_nope @ kv_latent.T`), so no quantized op reads them: those layers keep
# mlx-lm's own full-precision KVCache (model dtype), persisted as is.
MLA_MODEL_TYPES = {"deepseek_v3", "deepseek_v32", "glm4_moe_lite", "kimi_linear", "longcat_flash"}

# Layer kinds (see vllm_mlx_persist/caches): what the cache of one layer is and how blocks hold it.
Q4, FULL, STATE, LIST = "q4", "full", "state", "list"


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
        mx.concatenate([x[..., lo:hi, :], mx.zeros((*x.shape[:2], cap - (hi - lo), x.shape[3]), x.dtype)], axis=2)
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
    qk = mx.quantize(keys, group_size=cache.group_size, bits=cache.bits)
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
        dst[..., at : at + S, :] = src
    return k, v, qk, qv


def _qmap(fn, *qs: QTuple) -> QTuple:
    return tuple(fn(*xs) for xs in zip(*qs))


def _qslice(q: QTuple, end: int) -> QTuple:
    return tuple(x[..., :end, :] for x in q)


def _qnbytes(q: Optional[QTuple]) -> int:
    return 0 if q is None else sum(x.nbytes for x in q)


class Q4KVCache(QuantizedKVCache):
    """Per-sequence quantized KV cache that BatchGenerator can merge into a `BatchQ4KVCache`.

    `keys`/`values` are (packed uint32, scales, biases) tuples shaped (1, n_kv_heads, capacity, ·)
    holding logical positions [start, offset) at `[..., :offset - start, :]`.

    `window=None`: a plain cache, `start` is always 0. With a `window` (a sliding-window layer),
    the storage keeps at least the last `window` tokens, [max(0, offset - window), offset), and at
    most window + slack (see the module docstring) or, right after a longer chunk, window + that
    chunk; `offset` keeps counting (RoPE reads it).
    """

    window: Optional[int] = None
    start = 0
    # Float (keys, values) holding exactly the dequantized values of positions [0, offset), carried
    # from an earlier turn (see `CarriedFloats`), which `BatchQ4KVCache.merge` takes as the batch's
    # float mirror instead of dequantizing. Never stored or persisted; any write drops it.
    floats: Optional[tuple] = None

    def __init__(self, group_size: int = 64, bits: int = 4, window: Optional[int] = None):
        _check_format(bits, group_size)
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        super().__init__(group_size=group_size, bits=bits)
        self.window = window
        self.start = 0
        self.floats = None

    @property
    def held(self) -> int:
        """Tokens in storage: logical positions [start, offset)."""
        return self.offset - self.start

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[QTuple, QTuple]:
        # Not the parent's: it sizes packed storage as `dim // (32 // bits)`, which is wrong for
        # 5 and 6 bits at head_dim 128.
        S = keys.shape[2]
        self.floats = None
        if self.window is None:
            self.keys, self.values, _, _ = _append(self, self.offset, keys, values)
            self.offset += S
            return _qslice(self.keys, self.offset), _qslice(self.values, self.offset)
        drop = _window_drop(self, self.held, S)
        past = min(self.held - drop, self.window - 1)
        self.keys, self.values, _, _ = _append(self, self.held, keys, values, drop)
        self.start += drop
        self.offset += S
        # Only what this chunk's queries can see: window - 1 keys before its first one.
        lo, hi = self.held - S - past, self.held
        return tuple(x[..., lo:hi, :] for x in self.keys), tuple(x[..., lo:hi, :] for x in self.values)

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        if self.window is None:
            return super().make_mask(N, return_array=return_array, window_size=window_size)
        window_size = window_size or self.window
        if window_size > self.window:
            raise ValueError(f"a mask window of {window_size} on a cache that keeps {self.window}")
        past = min(self.held - _window_drop(self, self.held, N), self.window - 1)
        if N == 1 and window_size == self.window:
            return None  # the update returns exactly the keys this query sees
        return create_causal_mask(N, offset=past, window_size=window_size)

    def trim(self, n: int) -> int:
        """Drop the last n tokens; a window cache keeps at least the window before its new end."""
        if self.window is not None and self.start > 0:
            n = min(n, self.held - self.window)
        n = max(0, min(self.offset, n))
        self.offset -= n
        self.floats = None
        return n

    def size(self) -> int:
        return self.offset

    @property
    def state(self):
        return (None, None) if self.keys is None else self.to_arrays()

    @state.setter
    def state(self, v) -> None:
        self.keys, self.values = v
        self.floats = None

    # mlx-lm 0.32 dropped meta_state and takes from_state(state); ours keeps both forms working.
    @property
    def meta_state(self):
        extra = () if self.window is None else (self.window, self.start)
        return tuple(map(str, (self.offset, self.group_size, self.bits) + extra))

    @meta_state.setter
    def meta_state(self, v) -> None:
        self.offset, self.group_size, self.bits = map(int, v[:3])
        self.window, self.start = (int(v[3]), int(v[4])) if len(v) > 3 else (None, 0)

    @classmethod
    def from_state(cls, state, meta_state=None) -> "Q4KVCache":
        keys, values = state[:2]
        if meta_state is None:
            return cls.from_arrays(keys, values, *state[3:5][::-1]) if len(state) == 5 else cls.from_arrays(keys, values, 4, 64)
        obj = cls(group_size=int(meta_state[1]), bits=int(meta_state[2]))
        obj.keys, obj.values = keys, values
        obj.meta_state = meta_state
        return obj

    @classmethod
    def merge(cls, caches: Sequence["Q4KVCache"]) -> "BatchQ4KVCache":
        return BatchQ4KVCache.merge(caches)

    @classmethod
    def from_arrays(
        cls, keys: QTuple, values: QTuple, bits: int, group_size: int,
        window: Optional[int] = None, offset: Optional[int] = None,
    ) -> "Q4KVCache":
        """A cache holding the given (1, n_kv_heads, T, ·) components as the tokens just before
        `offset` (default T): positions [offset - T, offset).

        With a `window`, the arrays must cover [max(0, offset - window), offset), what the next
        token needs; the cache keeps only the last `window` of them. Without one they must start
        at position 0."""
        if len(keys) != 3 or len(values) != 3:
            raise ValueError("keys and values must be (packed, scales, biases) tuples")
        T = keys[0].shape[2]
        if any(x.ndim != 4 or x.shape[2] != T for x in (*keys, *values)):
            raise ValueError("all components must be 4-D with the same length on axis 2")
        if keys[0].dtype != mx.uint32 or values[0].dtype != mx.uint32:
            raise ValueError("packed components must be uint32")
        offset = T if offset is None else offset
        start = offset - T
        if start < 0 or (start > 0 and (window is None or T < window)):
            need = "[0" if window is None else f"[{max(0, offset - window)}"
            raise ValueError(f"arrays of {T} tokens ending at {offset} do not cover {need}, {offset})")
        c = cls(group_size=group_size, bits=bits, window=window)
        lo = T - window if window is not None and T > window else 0
        # Fresh array objects (views, no copy) so that in-place writes after a trim never reach
        # the caller's arrays.
        c.keys, c.values = (tuple(x[..., lo:T, :] for x in q) for q in (keys, values))
        c.offset, c.start = offset, start + lo
        return c

    def to_arrays(self) -> tuple[QTuple, QTuple]:
        """(keys, values) components of the tokens held, positions [start, offset) (views)."""
        if self.keys is None:
            raise ValueError("empty cache")
        return _qslice(self.keys, self.held), _qslice(self.values, self.held)

    @property
    def nbytes(self) -> int:
        return _qnbytes(self.keys) + _qnbytes(self.values)


# ---- float decode mirror --------------------------------------------------------------------------
#
# mlx's CPU `quantized_matmul(transpose=True)` costs ~3x a float matmul of the same shape (see
# docs/performance.md), so on the CPU a batch cache in prefill or decode keeps beside its 4-bit K/V a float
# copy holding exactly `dequantize(packed)` (every token, each new token included) and
# attention runs on that copy with mx.fast.scaled_dot_product_attention: 4-bit KV numerics, float
# speed. Storage, blocks, disk and everything `extract` returns stay 4-bit.
#
# Accounting rule: a mirror's bytes count against the process-wide budget for exactly as long as
# the BatchQ4KVCache holding it is alive and keeps it. Each operation that creates, grows, shrinks
# (filter), moves (extend) or drops a mirror checks the budget explicitly before allocating; the
# bytes in use are the sum over the live mirrors, kept in a WeakSet, so a batch cache that mlx-lm
# simply lets go of (it clears its cache list when the last sequence finishes) releases its share
# when it is freed, without a __del__. A mirror that would not fit is dropped (or never built) and
# that cache decodes on the 4-bit matmuls as before; never an error.

DECODE_FLOAT_AUTO_MB = 1024  # "auto" on a CPU; 0 (off) on a GPU, where quantized attention is fast
_decode_float_mb: Any = "auto"
_MIRRORS: "weakref.WeakSet[BatchQ4KVCache]" = weakref.WeakSet()
_MIRRORS_LOCK = threading.Lock()  # get_stats reads the set from the HTTP thread
# Mirrors built (by dequantizing), started from carried floats (no dequantization; see
# CarriedFloats), and not built or dropped because the budget was full (for get_stats).
MIRROR_COUNTS = {"builds": 0, "carried": 0, "refused": 0}


def set_decode_float_budget(mb: Any) -> None:
    """Process-wide budget for float decode mirrors, in MB: a number >= 0 (0: off) or "auto"
    (DECODE_FLOAT_AUTO_MB when MLX's default device is the CPU, else 0). Existing mirrors are kept;
    the budget applies to the next build or growth."""
    global _decode_float_mb
    if mb != "auto" and (isinstance(mb, bool) or not isinstance(mb, (int, float)) or not mb >= 0):
        raise ValueError(f"decode_float_mb must be \"auto\" or a number >= 0; got {mb!r}")
    _decode_float_mb = mb


def decode_float_budget_bytes() -> int:
    """The budget `set_decode_float_budget` resolves to on the current default device."""
    mb = _decode_float_mb
    if mb == "auto":
        mb = DECODE_FLOAT_AUTO_MB if mx.default_device().type == mx.DeviceType.cpu else 0
    return int(mb * 2**20)


def decode_float_bytes() -> int:
    """Bytes held by the float decode mirrors of all live batch caches."""
    with _MIRRORS_LOCK:
        caches = list(_MIRRORS)
    return sum(c.mirror_nbytes for c in caches)


# ---- float copies carried between turns ----------------------------------------------------------
#
# A returning agent's turn used to dequantize its whole history, every layer, for its first prefill
# chunk (the mirror build above): on the CPU that cost more than the two float copies vllm-mlx's
# default cache makes of the same history (docs/performance.md, "A hot turn of a long agent"). The
# mirror a turn ends with already holds those values, so the pool keeps it, as views, beside the
# turn's 4-bit blocks (`CarriedFloats`, held by the committed run), and the agent's next turn starts
# its batch mirror from it. Exactly `dequantize(packed)`: hot and reloaded turns attend on the same
# values. Bounded by a process-wide budget of its own; least recently used copies go first, and a
# copy lives no longer than the run of hot blocks that holds it.

CARRY_FLOAT_AUTO_MB = 1024  # "auto" on a CPU; 0 (off) on a GPU, like the decode mirror
_carry_float_mb: Any = "auto"
_CARRIED: "weakref.WeakValueDictionary[int, CarriedFloats]" = weakref.WeakValueDictionary()
_CARRY_LOCK = threading.Lock()
_carry_clock = 0
# Copies kept, used by a lookup, dropped for a newer one, and not kept because they did not fit.
CARRY_COUNTS = {"kept": 0, "used": 0, "evicted": 0, "refused": 0}


def set_carry_float_budget(mb: Any) -> None:
    """Process-wide budget for float copies carried between turns, in MB: a number >= 0 (0: off)
    or "auto" (CARRY_FLOAT_AUTO_MB when MLX's default device is the CPU, else 0). Applies to the
    next copy kept; a smaller budget drops the least recently used copies then."""
    global _carry_float_mb
    if mb != "auto" and (isinstance(mb, bool) or not isinstance(mb, (int, float)) or not mb >= 0):
        raise ValueError(f"carry_float_mb must be \"auto\" or a number >= 0; got {mb!r}")
    _carry_float_mb = mb


def carry_float_budget_bytes() -> int:
    """The budget `set_carry_float_budget` resolves to on the current default device."""
    mb = _carry_float_mb
    if mb == "auto":
        mb = CARRY_FLOAT_AUTO_MB if mx.default_device().type == mx.DeviceType.cpu else 0
    return int(mb * 2**20)


def carry_float_bytes() -> int:
    """Bytes of the float copies carried between turns that are alive."""
    with _CARRY_LOCK:
        return sum(c.nbytes for c in _CARRIED.values())


class CarriedFloats:
    """Per 4-bit layer, float (keys, values) of a stored turn's positions [0, n): exactly the
    dequantized values of its 4-bit K/V (the turn's float mirror, as views). Kept by whoever holds
    the turn's 4-bit arrays (the pool's committed run); `take` gives them to the next turn's
    caches. Dropped when evicted for a newer copy or when its holder goes."""

    def __init__(self, layers: dict[int, tuple[mx.array, mx.array]], n: int):
        self.layers: Optional[dict[int, tuple[mx.array, mx.array]]] = layers
        self.n = n
        self.nbytes = sum(k.nbytes + v.nbytes for k, v in layers.values())
        self.used = 0

    def take(self, n: int) -> Optional[dict[int, tuple[mx.array, mx.array]]]:
        """Views of positions [0, n) per layer (n <= self.n), or None once evicted."""
        global _carry_clock
        with _CARRY_LOCK:
            layers = self.layers
            if layers is None or n > self.n:
                return None
            _carry_clock += 1
            self.used = _carry_clock
            CARRY_COUNTS["used"] += 1
        return {l: (k[..., :n, :], v[..., :n, :]) for l, (k, v) in layers.items()}


def carry_floats(layers: dict[int, tuple[mx.array, mx.array]], n: int) -> Optional[CarriedFloats]:
    """Keep float copies of a stored turn's first n positions within the budget, dropping the least
    recently used others to make room; None when they cannot fit (or there are none)."""
    global _carry_clock
    if not layers:
        return None
    layers = {l: (k[..., :n, :], v[..., :n, :]) for l, (k, v) in layers.items()}
    carried = CarriedFloats(layers, n)
    budget = carry_float_budget_bytes()
    with _CARRY_LOCK:
        if carried.nbytes > budget:
            CARRY_COUNTS["refused"] += 1
            return None
        live = sorted(_CARRIED.values(), key=lambda c: c.used)
        used = sum(c.nbytes for c in live)
        for old in live:
            if used + carried.nbytes <= budget:
                break
            used -= old.nbytes
            old.layers = None
            _CARRIED.pop(id(old), None)
            CARRY_COUNTS["evicted"] += 1
        _carry_clock += 1
        carried.used = _carry_clock
        _CARRIED[id(carried)] = carried
        CARRY_COUNTS["kept"] += 1
    return carried


class BatchQ4KVCache(_BaseCache):
    """Batched quantized KV cache: `BatchKVCache`'s contract over (packed, scales, biases).

    Sequences are left-padded; `_idx` is the physical write index, `offset[b]` the logical
    position of sequence b. Without a window, `offset[b]` is the physical index minus the row's
    left padding. With a `window` (a sliding-window layer), whole leading columns are dropped
    (see `Q4KVCache`): rows are aligned at their newest token, so the last columns are every row's
    most recent tokens; row b then holds positions [offset[b] - (_idx - left_padding[b]), offset[b]).

    `_mirror` is the optional float decode mirror (see above): (keys, values) float arrays laid out
    exactly like the packed storage (same rows, same capacity), built on the first decode-sized
    update and then following every operation on the packed storage.
    """

    step = 256
    window: Optional[int] = None
    _mirror: Optional[tuple] = None  # class default: from_state builds objects without __init__
    _mirror_refused = False  # the budget refused this cache's mirror (counted once, retried each step)
    # Per-row token counts of the right-padded prompt call in progress (prepare .. finalize) and
    # the write index it started at: which queries of a chunk are real tokens (`real_queries`).
    _lengths: Optional[List[int]] = None
    _lengths_at = 0

    def __init__(self, left_padding: List[int], bits: int = 4, group_size: int = 64,
                 window: Optional[int] = None):
        _check_format(bits, group_size)
        self.keys: Optional[QTuple] = None
        self.values: Optional[QTuple] = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-l for l in left_padding])
        self._idx = 0
        self._right_padding = None
        self.bits = bits
        self.group_size = group_size
        self.window = window

    def _drop(self, S: int) -> int:
        """Leading columns the next update of S tokens drops (always 0 without a window). In a
        right-padded prompt call, a row whose prompt ended earlier keeps its last window too."""
        if self.window is None or self.keys is None:
            return 0
        drop = _window_drop(self, self._idx, S)
        if drop and self._lengths is not None:
            end = min(self._idx, self._lengths_at + min(self._lengths))
            drop = max(0, min(drop, end - self.window))
        return drop

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[QTuple, QTuple]:
        prev, S = self._idx, keys.shape[2]
        cap = 0 if self.keys is None else self.keys[0].shape[2]
        drop = self._drop(S)
        self.keys, self.values, qk, qv = _append(self, prev, keys, values, drop)
        if drop:
            self.left_padding = mx.maximum(self.left_padding - drop, 0)
            self._lengths_at -= drop
        self.offset += S
        self._idx += S - drop
        if self._mirror is not None:
            self._mirror_write(prev, cap, qk, qv, drop)
        elif S < DEQUANT_MIN_QUERIES or (S < MIRROR_PREFILL_MAX_QUERIES and _dequantize_for(S)):
            # decode, or a short prefill chunk (a returning agent's new text, a prompt's last chunk)
            # whose attention would dequantize all of the layer's K/V anyway: dequantize once into
            # the mirror, which the chunk's attention reads and the decode steps keep (such a turn
            # dequantized twice before). Full-size chunks of a long prompt attend on a transient
            # copy instead, so a cold prefill holds no float copy of the whole history.
            self._mirror_build()
        return _qslice(self.keys, self._idx), _qslice(self.values, self._idx)

    # -- float decode mirror --

    def float_kv(self) -> Optional[tuple[mx.array, mx.array]]:
        """The mirror's (keys, values) up to the write index, or None when there is no mirror."""
        if self._mirror is None:
            return None
        fk, fv = self._mirror
        return fk[..., : self._idx, :], fv[..., : self._idx, :]

    @property
    def mirror_nbytes(self) -> int:
        m = self._mirror
        return 0 if m is None else m[0].nbytes + m[1].nbytes

    def _set_mirror(self, mirror: Optional[tuple]) -> None:
        self._mirror = mirror
        with _MIRRORS_LOCK:
            if mirror is None:
                _MIRRORS.discard(self)
            else:
                _MIRRORS.add(self)

    def _float_bytes(self, B: int, T: int, like: Optional["BatchQ4KVCache"] = None) -> int:
        """Bytes of a float mirror of B rows and T tokens (K and V, the scales' dtype)."""
        like = like or self
        per = sum(q[0].shape[1] * (q[0].shape[3] * 32 // self.bits) * q[1].dtype.size
                  for q in (like.keys, like.values))
        return B * T * per

    def _mirror_fits(self, nbytes: int, released: int = 0) -> bool:
        """Whether `nbytes` more mirror bytes fit the budget once `released` bytes are given back."""
        budget = decode_float_budget_bytes()
        return budget > 0 and decode_float_bytes() - released + nbytes <= budget

    def _dequantize(self, q: QTuple) -> mx.array:
        if q[0].size == 0:  # mx.dequantize cannot reshape an empty array
            B, H, T, P = q[0].shape
            return mx.zeros((B, H, T, P * 32 // self.bits), dtype=q[1].dtype)
        return mx.dequantize(*q, group_size=self.group_size, bits=self.bits)

    def _mirror_build(self) -> None:
        if self.keys is None or decode_float_budget_bytes() == 0:
            return
        B, _, cap, _ = self.keys[0].shape
        if self._mirror_fits(self._float_bytes(B, cap)):
            self._set_mirror((self._dequantize(self.keys), self._dequantize(self.values)))
            MIRROR_COUNTS["builds"] += 1
            self._mirror_refused = False
        elif not self._mirror_refused:
            MIRROR_COUNTS["refused"] += 1
            self._mirror_refused = True

    def _mirror_write(self, prev: int, old_cap: int, qk: QTuple, qv: QTuple, drop: int = 0) -> None:
        """Follow an update that wrote [prev - drop, _idx) after dropping `drop` leading columns,
        the new tokens quantized as `qk`/`qv`: move and grow like the packed storage did, then
        write their dequantized values."""
        fk, fv = self._mirror
        cap = self.keys[0].shape[2]
        if cap != old_cap or drop:
            if not self._mirror_fits(self._float_bytes(fk.shape[0], cap), released=self.mirror_nbytes):
                self._set_mirror(None)
                MIRROR_COUNTS["refused"] += 1
                return
            fk, fv = _regrow((fk, fv), drop, prev, cap)
            self._set_mirror((fk, fv))
        if all(a.shape == b.shape for a, b in zip(qk, qv)):
            # K and V in one call: mx.dequantize costs ~150 us per call on the CPU whatever its
            # size (a composite of several ops), and it is elementwise, so the values are the same.
            both = self._dequantize(tuple(mx.concatenate([a, b]) for a, b in zip(qk, qv)))
            dk, dv = both[: fk.shape[0]], both[fk.shape[0] :]
        else:
            dk, dv = self._dequantize(qk), self._dequantize(qv)
        fk[..., prev - drop : self._idx, :] = dk
        fv[..., prev - drop : self._idx, :] = dv

    def __deepcopy__(self, memo) -> "BatchQ4KVCache":
        """A copy that shares the mirror's buffers, as it shares the packed ones (a deep copy of an
        mx.array is a new array on the same data; MLX copies a shared buffer on its first write).
        mlx-lm deep-copies a prompt batch when it splits it and then empties or filters the
        original, so nothing is copied: copying the mirror here (`mx.array`) cost a full float copy
        of the history per layer on every turn, and, when two copies did not fit the budget, a
        second dequantization on the first decode step. Counted for each holder while both live."""
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            if k != "_mirror":
                setattr(new, k, copy.deepcopy(v, memo))
        if self._mirror is not None:
            new._set_mirror(tuple(copy.deepcopy(x, memo) for x in self._mirror))
        return new

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("Left padding can only be added to an empty BatchQ4KVCache")
            left_padding = mx.array(left_padding)
            self.left_padding += left_padding
            self.offset -= left_padding
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)
            if lengths is not None:
                self._lengths, self._lengths_at = [int(n) for n in lengths], self._idx

    def finalize(self) -> None:
        if self._right_padding is not None:
            pad = self._right_padding
            roll = lambda x: dynamic_roll(x, pad[:, None], axis=2)
            self.keys, self.values = tuple(map(roll, self.keys)), tuple(map(roll, self.values))
            if self._mirror is not None:
                self._set_mirror(tuple(map(roll, self._mirror)))
            self.offset -= pad
            self.left_padding += pad
            self._right_padding = None
        self._lengths = None

    @property
    def state(self):
        k, v = self.keys, self.values
        if k is not None and self._idx < k[0].shape[2]:
            k, v = _qslice(k, self._idx), _qslice(v, self._idx)
        return k, v, self.offset, self.left_padding

    @state.setter
    def state(self, v) -> None:
        self.keys, self.values, self.offset, self.left_padding = v
        self._idx = 0 if self.keys is None else self.keys[0].shape[2]
        if self._mirror is not None:
            self._set_mirror(None)  # it mirrored the storage just replaced

    @property
    def meta_state(self):
        extra = () if self.window is None else (self.window,)
        return tuple(map(str, (self.bits, self.group_size) + extra))

    @meta_state.setter
    def meta_state(self, v) -> None:
        self.bits, self.group_size = map(int, v[:2])
        self.window = int(v[2]) if len(v) > 2 else None
        self._right_padding = None
        self._lengths = None

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last n tokens of every row; with a window, each row that has dropped tokens
        keeps at least the window before its new end."""
        n = min(self._idx, n)
        if self.window is not None and self.keys is not None:
            held = self._idx - self.left_padding
            dropped = self.offset > held
            if mx.any(dropped).item():
                n = max(0, min(n, mx.where(dropped, held, self._idx).min().item() - self.window))
        self._idx -= n
        self.offset -= n
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs) -> mx.array:
        if self.window is None:
            return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)
        # In the physical columns the next update leaves (after its drop): the window is a
        # distance between columns, the same for every row whatever was dropped before.
        window = kwargs.get("window_size") or self.window
        if window > self.window:
            raise ValueError(f"a mask window of {window} on a cache that keeps {self.window}")
        drop = self._drop(N)
        return create_causal_mask(N, offset=self._idx - drop, window_size=window,
                                  left_padding=mx.maximum(self.left_padding - drop, 0))

    def starts(self) -> List[int]:
        """Per row, the first logical position held: row b covers [starts()[b], offset[b])."""
        return (self.offset - (self._idx - self.left_padding)).tolist()

    def real_queries(self, n: int, start: int) -> List[int]:
        """Per row, how many of the `n` tokens written at [start, start + n) are real: all of them,
        except in a right-padded prompt call, where row b has only its own length's worth."""
        B = self.offset.shape[0]
        if self._lengths is None:
            return [n] * B
        done = start - self._lengths_at
        return [max(0, min(n, length - done)) for length in self._lengths]

    def filter(self, batch_indices) -> None:
        """In-place: keep only the given batch rows, then drop the common left padding."""
        if not isinstance(batch_indices, mx.array):
            batch_indices = mx.array(list(batch_indices), dtype=mx.int32)
        if batch_indices.tolist() == list(range(self.offset.shape[0])):
            # Every row in order (mlx-lm's split of a prompt batch whose rows all start decoding):
            # a gather would copy the packed storage and the mirror for nothing.
            self._shift_left_padding()
            return
        if self.keys is not None:
            self.keys = tuple(x[batch_indices] for x in self.keys)
            self.values = tuple(x[batch_indices] for x in self.values)
        if self._mirror is not None:
            rows = batch_indices.size
            self._set_mirror(tuple(x[batch_indices] for x in self._mirror) if rows else None)
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        if self._lengths is not None:
            self._lengths = [self._lengths[i] for i in batch_indices.tolist()]
        self._shift_left_padding()

    def _shift_left_padding(self) -> None:
        """Drop the left padding every row has."""
        min_left_pad = self.left_padding.min().item() if self.left_padding.size else 0
        if min_left_pad > 0:
            if self.keys is not None:
                self.keys = tuple(x[..., min_left_pad:, :] for x in self.keys)
                self.values = tuple(x[..., min_left_pad:, :] for x in self.values)
            if self._mirror is not None:
                self._set_mirror(tuple(x[..., min_left_pad:, :] for x in self._mirror))
            self._idx -= min_left_pad
            self.left_padding -= min_left_pad

    def extend(self, other: "BatchQ4KVCache") -> None:
        """In-place: append `other`'s rows, right-justifying both to the larger `_idx`."""
        self._check_compatible(other)
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return

        like = self if self.keys is not None else other
        max_idx = max(self._idx, other._idx)
        max_size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        # The mirror follows when either side has one and the joined one fits; a side without one
        # is dequantized (once, what its own first decode step would do).
        mirrored = self._mirror is not None or other._mirror is not None
        if mirrored:
            B = self.offset.shape[0] + other.offset.shape[0]
            released = self.mirror_nbytes + other.mirror_nbytes
            mirrored = self._mirror_fits(self._float_bytes(B, max_size, like), released)
            MIRROR_COUNTS["refused"] += not mirrored

        def pad(c: "BatchQ4KVCache"):
            k, v, f = c.keys, c.values, c._mirror
            if k is None:  # an empty side still has rows: give them zero-length storage
                Bc = c.offset.shape[0]
                k, v = _alloc(like.keys, Bc, 0), _alloc(like.values, Bc, 0)
                f = None
            if mirrored and f is None:
                f = (like._dequantize(k), like._dequantize(v))
            left = max_idx - c._idx
            right = max_size - k[0].shape[2] - left
            if right < 0:
                k, v = _qslice(k, right), _qslice(v, right)
                f = f and _qslice(f, right)
                right = 0
            if left or right:
                widths = [(0, 0), (0, 0), (left, right), (0, 0)]
                k = tuple(mx.pad(x, widths) for x in k)
                v = tuple(mx.pad(x, widths) for x in v)
                f = f and tuple(mx.pad(x, widths) for x in f)
            return k, v, f, c.offset, c.left_padding + left

        (k1, v1, f1, o1, l1), (k2, v2, f2, o2, l2) = pad(self), pad(other)
        cat = lambda a, b: mx.concatenate([a, b], axis=0)
        self.keys, self.values = _qmap(cat, k1, k2), _qmap(cat, v1, v2)
        self.offset, self.left_padding = cat(o1, o2), cat(l1, l2)
        self._idx = max_idx
        other._set_mirror(None)  # moved into self (or dropped): `other` is consumed
        self._set_mirror(_qmap(cat, f1, f2) if mirrored else None)

    def extract(self, idx: int) -> Q4KVCache:
        """A contiguous per-sequence copy of row `idx`'s valid tokens (with a window: every token
        the row holds, positions [starts()[idx], offset[idx]))."""
        cache = Q4KVCache(group_size=self.group_size, bits=self.bits, window=self.window)
        if self.keys is None:
            return cache
        pad = self.left_padding[idx].item()
        take = lambda x: mx.contiguous(x[idx : idx + 1, :, pad : self._idx])
        cache.keys = tuple(map(take, self.keys))
        cache.values = tuple(map(take, self.values))
        cache.offset = self._idx - pad
        if self.window is not None:
            cache.offset = self.offset[idx].item()
            cache.start = cache.offset - (self._idx - pad)
        elif self._mirror is not None:
            cache.floats = self._extract_floats(idx, pad)
        return cache

    def _extract_floats(self, idx: int, pad: int) -> Optional[tuple[mx.array, mx.array]]:
        """Row idx's mirror, for the pool to carry to the row's next turn (`CarriedFloats`). One row:
        views (mlx-lm empties the batch right after extracting its last row, so they pin no more
        than that row's buffer). Several: a copy, evaluated now so that it holds none of the batch's
        buffer (its in-place decode writes would then copy the whole buffer every step); only when
        the carry budget could keep it."""
        fk, fv = self._mirror
        if fk.shape[0] == 1:
            return fk[..., pad : self._idx, :], fv[..., pad : self._idx, :]
        if self._float_bytes(1, self._idx - pad) > carry_float_budget_bytes():
            return None
        out = tuple(mx.contiguous(x[idx : idx + 1, :, pad : self._idx]) for x in (fk, fv))
        mx.eval(out)
        return out

    @classmethod
    def merge(cls, caches: Sequence[QuantizedKVCache]) -> "BatchQ4KVCache":
        """Left-pad per-sequence quantized caches into one batch cache."""
        bits, group_size = caches[0].bits, caches[0].group_size
        window = getattr(caches[0], "window", None)
        for c in caches:
            if (c.bits, c.group_size) != (bits, group_size):
                raise ValueError(
                    f"cannot batch caches with different formats: {c.bits}-bit/group "
                    f"{c.group_size} vs {bits}-bit/group {group_size}"
                )
            if getattr(c, "window", None) != window:
                raise ValueError(f"cannot batch caches with windows {getattr(c, 'window', None)} and {window}")
        # `offset`, not `size()`: a plain QuantizedKVCache reports size() == 0. Tokens held, not
        # positions: a window cache holds [start, offset).
        lengths = [c.offset - getattr(c, "start", 0) if c.keys is not None else 0 for c in caches]
        max_length = max(lengths)
        if max_length == 0:
            return cls([0] * len(caches), bits, group_size, window)

        padding = [max_length - l for l in lengths]
        src = next(c for c in caches if c.keys is not None)
        B = len(caches)
        if B == 1:
            # One sequence (a returning agent's prompt, usually): its arrays as they are, no copy;
            # the first write grows them into new storage (_append), so they are never written.
            cache = cls([0], bits, group_size, window)
            cache.keys, cache.values = _qslice(src.keys, max_length), _qslice(src.values, max_length)
            cache.offset = mx.array([src.offset])
            cache._idx = max_length
            cache._adopt_floats(caches, padding, lengths)
            return cache
        keys, values = _alloc(src.keys, B, max_length), _alloc(src.values, B, max_length)
        for i, (p, c) in enumerate(zip(padding, caches)):
            if lengths[i] == 0:
                continue
            n = lengths[i]
            for dst, s in zip(keys + values, c.keys + c.values):
                dst[i : i + 1, :, p : p + n] = s[..., :n, :]

        cache = cls(padding, bits, group_size, window)
        cache.keys, cache.values = keys, values
        cache.offset = mx.array([c.offset if c.keys is not None else 0 for c in caches])
        cache._idx = max_length
        cache._adopt_floats(caches, padding, lengths)
        return cache

    def _adopt_floats(self, caches: Sequence[QuantizedKVCache], padding: List[int], lengths: List[int]) -> None:
        """Start the mirror from the rows' carried floats (`Q4KVCache.floats`) when any row has
        them and it fits the decode budget: one row's as they are (views), several laid out like
        the packed storage, the rows without any dequantized (what the first update would do)."""
        rows = [getattr(c, "floats", None) if n else None for c, n in zip(caches, lengths)]
        if self.window is not None or all(f is None for f in rows):
            return
        B, T = len(caches), self._idx
        if not self._mirror_fits(self._float_bytes(B, T)):
            MIRROR_COUNTS["refused"] += 1
            self._mirror_refused = True
            return
        MIRROR_COUNTS["carried"] += 1
        if B == 1:
            self._set_mirror(tuple(x[..., :T, :] for x in rows[0]))
            return
        dtype = self.keys[1].dtype
        mirror = tuple(mx.zeros((B, q[0].shape[1], T, q[0].shape[3] * 32 // self.bits), dtype=dtype)
                       for q in (self.keys, self.values))
        for i, (f, c, p, n) in enumerate(zip(rows, caches, padding, lengths)):
            if n == 0:
                continue
            if f is None:
                f = (self._dequantize(_qslice(c.keys, n)), self._dequantize(_qslice(c.values, n)))
            for dst, x in zip(mirror, f):
                dst[i : i + 1, :, p : p + n] = x[..., :n, :]
        self._set_mirror(mirror)

    def _check_compatible(self, other: "BatchQ4KVCache") -> None:
        if not isinstance(other, BatchQ4KVCache):
            raise TypeError(f"cannot extend BatchQ4KVCache with {type(other).__name__}")
        if (other.bits, other.group_size) != (self.bits, self.group_size):
            raise ValueError("cannot extend a batch cache with one of a different format")
        if other.window != self.window:
            raise ValueError(f"cannot extend a batch cache of window {self.window} with one of {other.window}")

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """The 4-bit storage and, while there is one, the float decode mirror."""
        return _qnbytes(self.keys) + _qnbytes(self.values) + self.mirror_nbytes


# ---- attention fix -------------------------------------------------------------------------------


# mlx's CPU `quantized_matmul` has no BLAS path: its cost grows linearly with the number of query
# rows, so a 2048-token prefill chunk over 4k cached tokens takes ~5x as long as the fast SDPA on the
# dequantized K/V (measured in docs/design.md). From this many queries per step on, dequantizing the
# layer's K/V (a temporary freed right after the op; the cache itself stays quantized) is cheaper.
DEQUANT_MIN_QUERIES = 4
# Prefill chunks shorter than this build the float mirror (see BatchQ4KVCache.update_and_fetch);
# vllm-mlx's prefill chunks are 2048 tokens, so only a prompt's last chunk or a short one does.
MIRROR_PREFILL_MAX_QUERIES = 512
PREFILL_ATTENTION_MODES = ("auto", "quantized", "dequantized")
_prefill_attention = "auto"


def set_prefill_attention(mode: str) -> None:
    """How attention reads 4-bit K/V for chunks of >= DEQUANT_MIN_QUERIES queries.

    "quantized": always mlx's quantized matmuls. "dequantized": dequantize the layer's K/V for the
    op, then the fast SDPA. "auto" (default): dequantized on the CPU, quantized on a GPU. Decode
    steps (fewer queries) always use the quantized matmuls.
    """
    global _prefill_attention
    if mode not in PREFILL_ATTENTION_MODES:
        raise ValueError(f"prefill_attention must be one of {PREFILL_ATTENTION_MODES}; got {mode!r}")
    _prefill_attention = mode


def _dequantize_for(n_queries: int) -> bool:
    if n_queries < DEQUANT_MIN_QUERIES or _prefill_attention == "quantized":
        return False
    return _prefill_attention == "dequantized" or mx.default_device().type == mx.DeviceType.cpu


def _gqa_mask(mask: Any, B: int, n_kv: int, n_rep: int) -> Any:
    """A mask for (B, n_kv, n_rep, L, T) scores, from mlx-lm's (L, T) or 4-D (B|1, 1|n_q, L, T)."""
    if not isinstance(mask, mx.array) or mask.ndim != 4:
        return mask
    if mask.shape[1] == 1:
        return mx.expand_dims(mask, -3)
    return mask.reshape(mask.shape[0], n_kv, n_rep, *mask.shape[2:])


def _sdpa_with_sinks(queries, q_keys, q_values, scale, mask, sinks, group_size, bits):
    """mlx-lm's quantized SDPA with the GQA mask broadcast right (batched and per-head masks) and
    optional attention sinks: one extra logit per query head that joins the softmax and contributes
    no value (what mx.fast.scaled_dot_product_attention does with sinks).

    Grouped-query attention without broadcasting the packed K/V: the n_rep query heads of a KV head
    become n_rep * L rows of one quantized matmul against that head's K/V (mlx-lm expands the K/V to
    5-D instead, which mlx's CPU kernels handle 10-25% slower; same arithmetic, same result)."""
    B, n_q, L, D = queries.shape
    n_kv = q_keys[0].shape[-3]
    n_rep = n_q // n_kv
    queries = (queries * scale).reshape(B, n_kv, n_rep * L, D)
    scores = mx.quantized_matmul(queries, *q_keys, transpose=True, group_size=group_size, bits=bits)
    T = scores.shape[-1]
    scores = scores.reshape(B, n_kv, n_rep, L, T)
    if isinstance(mask, str):
        mask = mx.arange(T - L, T)[:, None] >= mx.arange(T)[None]
    mask = _gqa_mask(mask, B, n_kv, n_rep)
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    if sinks is None:
        probs = mx.softmax(scores, axis=-1, precise=True)
    else:
        sink = sinks.astype(scores.dtype).reshape(n_kv, n_rep, 1, 1)
        sink = mx.broadcast_to(sink, scores.shape[:-1] + (1,))
        probs = mx.softmax(mx.concatenate([sink, scores], axis=-1), axis=-1, precise=True)[..., 1:]
    probs = probs.reshape(B, n_kv, n_rep * L, T)
    out = mx.quantized_matmul(probs, *q_values, transpose=False, group_size=group_size, bits=bits)
    return out.reshape(B, n_q, L, out.shape[-1])


def _make_fixed(original):
    def quantized_scaled_dot_product_attention(
        queries: mx.array,
        q_keys: tuple[mx.array, mx.array, mx.array],
        q_values: tuple[mx.array, mx.array, mx.array],
        scale: float,
        mask: Optional[mx.array],
        group_size: int = 64,
        bits: int = 8,
        sinks: Optional[mx.array] = None,
    ) -> mx.array:
        if _dequantize_for(queries.shape[2]):
            keys = mx.dequantize(*q_keys, group_size=group_size, bits=bits)
            values = mx.dequantize(*q_values, group_size=group_size, bits=bits)
            return mx.fast.scaled_dot_product_attention(
                queries, keys, values, scale=scale, mask=mask, sinks=sinks
            )
        # Always ours, not mlx-lm's: it takes sinks and per-head masks (mlx-lm 0.32 still
        # mis-broadcasts those), fixes 0.31's batched GQA mask, and is faster on the CPU.
        return _sdpa_with_sinks(queries, q_keys, q_values, scale, mask, sinks, group_size, bits)

    quantized_scaled_dot_product_attention._vllm_mlx_persist_original = original
    return quantized_scaled_dot_product_attention


def _row_mask(mask: Any, b: int, B: int, n: int, start: int, end: int) -> Any:
    """Row b's part of a batch mask: its `n` real queries against its keys [start, end)."""
    if not isinstance(mask, mx.array):
        return mask  # None or "causal": the same meaning on the row's own keys
    if mask.ndim == 4 and mask.shape[0] == B and B > 1:
        mask = mask[b : b + 1]
    if mask.shape[-1] > 1:
        mask = mask[..., start:end]
    return mask[..., :n, :] if mask.ndim >= 2 and mask.shape[-2] > 1 else mask


def _attend_row(queries, keys: QTuple, values: QTuple, mirror, cache: "BatchQ4KVCache", n_batch: int,
                scale: float, mask: Any, sinks: Any, row=lambda x: x) -> mx.array:
    """Attention of one row's real queries on its own keys (`row` slices them out of the batch's
    K/V, packed or mirrored): the same ops whatever the batch.

    The kernel is chosen from the row's query count, not the batch chunk's (a row's short tail
    batched with a long chunk gets the kernel it gets alone): the float SDPA on the dequantized K/V
    (the mirror, or a transient copy: the same values) for chunks the CPU dequantizes and for
    decode-sized rows when there is a mirror, or would be one (`n_batch` too long to build it);
    else mlx's quantized matmuls."""
    n = queries.shape[2]
    use_float = _dequantize_for(n) or (n < DEQUANT_MIN_QUERIES and (
        mirror is not None or (n_batch >= DEQUANT_MIN_QUERIES and decode_float_budget_bytes() > 0)))
    if not use_float:
        kw = {} if sinks is None else {"sinks": sinks}  # mlx-lm's own function has no sinks
        return _mlx_base.quantized_scaled_dot_product_attention(
            queries, tuple(map(row, keys)), tuple(map(row, values)), scale=scale, mask=mask,
            group_size=cache.group_size, bits=cache.bits, **kw
        )
    if mirror is None:
        fk, fv = cache._dequantize(tuple(map(row, keys))), cache._dequantize(tuple(map(row, values)))
    else:
        fk, fv = row(mirror[0]), row(mirror[1])
    return mx.fast.scaled_dot_product_attention(queries, fk, fv, scale=scale, mask=mask, sinks=sinks)


def batch_attention(queries: mx.array, keys: QTuple, values: QTuple, cache: "BatchQ4KVCache",
                    scale: float, mask: Any, sinks: Any = None) -> mx.array:
    """Attention on a `BatchQ4KVCache`, batch-invariant: each row attends with its real queries on
    its own keys only (no left padding, no right-padded queries), so its result is bit for bit what
    it is with no companions. Attending on the padded batch at once changes the float rounding on
    BLAS kernels whose sums depend on the reduction's length and alignment (OpenBLAS: the value
    matmul's sum over the keys, the score matmul's row count): logits ~1e-6 apart, a different
    greedy token wherever the top two are that close (docs/design.md, "Batch invariance")."""
    B, _, L, _ = queries.shape
    end = cache.size()
    mirror = cache.float_kv()
    starts = cache.left_padding.tolist()
    reals = cache.real_queries(L, end - L)
    window = cache.window
    if B == 1 and starts[0] == 0 and reals[0] == L and (window is None or end - L < window):
        return _attend_row(queries, keys, values, mirror, cache, L, scale, mask, sinks)
    outs = []
    for b, (start, n) in enumerate(zip(starts, reals)):
        if n == 0:  # a row whose prompt ended in an earlier chunk of this call: padding only
            outs.append(None)
            continue
        stop = end - (L - n)
        if window is not None:
            # Only the keys the row's first query can see: the same keys alone and batched,
            # whatever each cache has dropped so far.
            start = max(start, stop - n - (window - 1))
        out = _attend_row(
            queries[b : b + 1, :, :n], keys, values, mirror, cache, L, scale,
            _row_mask(mask, b, B, n, start, stop), sinks, row=lambda x: x[b : b + 1, :, start:stop, :],
        )
        outs.append(out if n == L else mx.pad(out, [(0, 0), (0, 0), (0, L - n), (0, 0)]))
    if B == 1 and outs[0] is not None:  # one row whose first keys were dropped or sliced off
        return outs[0]
    like = next(o for o in outs if o is not None)
    zeros = mx.zeros_like(like)
    return mx.concatenate([zeros if o is None else o for o in outs], axis=0)


def _make_dispatcher(original):
    """base.scaled_dot_product_attention, with quantized caches going to our quantized SDPA, which
    takes sinks (mlx-lm's dispatcher raises for sinks on a quantized cache), and batch caches to
    `batch_attention` (per row, on the float decode mirror when there is one)."""

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if isinstance(cache, BatchQ4KVCache):
            return batch_attention(queries, keys, values, cache, scale, mask, sinks)
        if hasattr(cache, "bits"):
            kw = {} if sinks is None else {"sinks": sinks}  # mlx-lm's own function has no sinks
            return _mlx_base.quantized_scaled_dot_product_attention(
                queries, keys, values, scale=scale, mask=mask,
                group_size=cache.group_size, bits=cache.bits, **kw,
            )
        return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention._vllm_mlx_persist_original = original
    return scaled_dot_product_attention


def mask_needs_fix(qsdpa=None) -> bool:
    """Whether mlx-lm's quantized SDPA mis-broadcasts a batched (B, 1, L, T) mask under GQA.

    mlx-lm 0.31.3 does (shape error for B != n_kv_heads, silently wrong for B == n_kv_heads);
    0.32.x fixed it upstream, and wrapping the fixed function again crashes batched decode. Probed
    on tiny arrays (B == n_kv_heads, the silent case) against the dequantized reference, not by version.
    """
    qsdpa = qsdpa or getattr(
        _mlx_base.quantized_scaled_dot_product_attention, "_vllm_mlx_persist_original",
        _mlx_base.quantized_scaled_dot_product_attention,
    )
    B, n_q, n_kv, L, T, D = 2, 4, 2, 1, 4, 64
    q = mx.arange(B * n_q * L * D, dtype=mx.float32).reshape(B, n_q, L, D) % 7 / 7
    kv = mx.arange(B * n_kv * T * D, dtype=mx.float32).reshape(B, n_kv, T, D) % 5 / 5
    qk = mx.quantize(kv, group_size=64, bits=8)
    qv = mx.quantize(kv[..., ::-1], group_size=64, bits=8)
    mask = mx.array([[True, True, True, True], [False, False, False, True]]).reshape(B, 1, L, T)
    deq = lambda x: mx.repeat(mx.dequantize(*x, group_size=64, bits=8), n_q // n_kv, axis=1)
    want = mx.fast.scaled_dot_product_attention(q, deq(qk), deq(qv), scale=0.125, mask=mask)
    try:
        got = qsdpa(mx.array(q), qk, qv, scale=0.125, mask=mask, group_size=64, bits=8)
        return mx.abs(got - want).max().item() > 1e-3
    except ValueError:
        return True


def _model_modules():
    return [m for name, m in list(sys.modules.items()) if name.startswith("mlx_lm.models.") and m is not None]


def install_attention_fix() -> None:
    """Patch mlx-lm's quantized SDPA (idempotent) with ours: batched and per-head GQA masks (mlx-lm
    0.31 mis-broadcasts them, see `mask_needs_fix`), dequantized prefill on the CPU, attention sinks,
    and a GQA layout that mlx's CPU kernels run faster.

    `base.quantized_scaled_dot_product_attention` is looked up as a module global at call time.
    The dispatcher `scaled_dot_product_attention` is imported by name into each model module, so it
    is replaced in base and in every loaded mlx_lm.models module that bound it (call this after
    loading the model).
    """
    current = _mlx_base.quantized_scaled_dot_product_attention
    if not hasattr(current, "_vllm_mlx_persist_original"):
        _mlx_base.quantized_scaled_dot_product_attention = _make_fixed(current)
    dispatcher = _mlx_base.scaled_dot_product_attention
    original = getattr(dispatcher, "_vllm_mlx_persist_original", dispatcher)
    if dispatcher is original:
        dispatcher = _make_dispatcher(original)
        _mlx_base.scaled_dot_product_attention = dispatcher
    for m in _model_modules():
        if getattr(m, "scaled_dot_product_attention", None) is original:
            m.scaled_dot_product_attention = dispatcher


def uninstall_attention_fix() -> None:
    """Undo `install_attention_fix` (for tests)."""
    current = _mlx_base.quantized_scaled_dot_product_attention
    original = getattr(current, "_vllm_mlx_persist_original", None)
    if original is not None:
        _mlx_base.quantized_scaled_dot_product_attention = original
    dispatcher = _mlx_base.scaled_dot_product_attention
    original = getattr(dispatcher, "_vllm_mlx_persist_original", None)
    if original is not None:
        for m in _model_modules():
            if getattr(m, "scaled_dot_product_attention", None) is dispatcher:
                m.scaled_dot_product_attention = original


# ---- model support -------------------------------------------------------------------------------


class UnsupportedModelError(ValueError):
    """The model cannot run on a batched quantized KV cache."""


def _model_type(model: nn.Module) -> str:
    args = getattr(model, "args", None)
    model_type = getattr(model, "model_type", None) or getattr(args, "model_type", None)
    return str(model_type or type(model).__module__)


def _head_dims(model: nn.Module) -> dict[str, int]:
    """Key/value head dimensions from the model args (what the cache quantizes along)."""
    args = getattr(model, "args", None)
    if args is None:
        return {}
    nope, rope = getattr(args, "qk_nope_head_dim", None), getattr(args, "qk_rope_head_dim", None)
    if nope is not None and rope is not None:
        dims = {"key head_dim": nope + rope}
        v = getattr(args, "v_head_dim", None)
        if v is not None:
            dims["value head_dim"] = v
        return dims
    head_dim = getattr(args, "head_dim", None)
    model_type = getattr(args, "model_type", "")
    if head_dim is None or model_type == "qwen2":  # qwen2 ignores args.head_dim
        hidden = getattr(args, "hidden_size", None)
        heads = getattr(args, "num_attention_heads", None)
        if not hidden or not heads:
            return {}
        head_dim = hidden // heads
    return {"head_dim": head_dim}


def layer_kinds(model: nn.Module, group_size: int) -> list:
    """Per layer, the cache kind persist_q4 gives it; raise `UnsupportedModelError` for a model
    that cannot run on it, with the model type and the reason.

    Q4: plain attention (`KVCache`) and sliding-window attention (`RotatingKVCache`, keep 0; every
    such model asks for its mask with `window_size`, `layer_windows` gives the window). FULL: MLA
    layers' `KVCache`. STATE: `ArraysCache` (SSM / linear attention). (LIST, [kinds]): a `CacheList`.
    """
    model_type = _model_type(model)

    def refuse(reason: str):
        raise UnsupportedModelError(
            f"model type {model_type!r} cannot use the persist_q4 cache: {reason}"
        )

    if model_type in _BYPASS_DISPATCHER:
        refuse(_BYPASS_DISPATCHER[model_type])
    try:
        caches = make_prompt_cache(model)
    except Exception as e:  # a model whose make_cache fails is not one we can serve either
        refuse(f"could not build its prompt cache ({type(e).__name__}: {e})")
    mla = model_type in MLA_MODEL_TYPES

    def kind(i: int, c) -> Any:
        if type(c) is KVCache:
            return FULL if mla else Q4
        if type(c) is RotatingKVCache and not mla:
            if c.keep:
                refuse(f"layer {i} uses a RotatingKVCache that keeps {c.keep} tokens")
            return Q4
        if type(c) is ArraysCache:
            return STATE
        if type(c) is CacheList:
            sub = [kind(i, s) for s in c.caches]
            if any(k != FULL for k in sub):
                refuse(f"layer {i} uses a CacheList of {[type(s).__name__ for s in c.caches]}")
            return (LIST, sub)
        refuse(f"layer {i} uses a {type(c).__name__}, which persist_q4 does not batch")

    kinds = [kind(i, c) for i, c in enumerate(caches)]
    if Q4 in kinds:
        for name, dim in _head_dims(model).items():
            if dim % group_size != 0:
                refuse(f"{name} {dim} is not a multiple of the quantization group size {group_size}")
    return kinds


def layer_windows(model: nn.Module) -> dict[int, int]:
    """Layer -> window of each sliding-window layer (its mlx-lm cache is a `RotatingKVCache`)."""
    return {l: c.max_size for l, c in enumerate(make_prompt_cache(model)) if type(c) is RotatingKVCache}


def check_model_supported(model: nn.Module, group_size: int) -> None:
    """Raise `UnsupportedModelError` unless persist_q4 can serve the model (see `layer_kinds`)."""
    layer_kinds(model, group_size)


def make_q4_prompt_cache(model: nn.Module, bits: int = 4, group_size: int = 64,
                         bounded: bool = False) -> list[Q4KVCache]:
    """One fresh `Q4KVCache` per layer, for models whose layers are all of the Q4 kind (plain and
    sliding-window attention); `caches.ModelCodec` builds the caches of every other model.
    `bounded`: sliding-window layers hold only their window (else every token, masked)."""
    _check_format(bits, group_size)
    kinds = layer_kinds(model, group_size)
    if any(k != Q4 for k in kinds):
        raise UnsupportedModelError(
            f"model type {_model_type(model)!r} has non-attention or latent layers; use caches.ModelCodec"
        )
    windows = layer_windows(model) if bounded else {}
    return [Q4KVCache(group_size=group_size, bits=bits, window=windows.get(l)) for l in range(len(kinds))]
