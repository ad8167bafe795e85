"""The 4-bit KV cache classes: quantized caches mlx-lm's BatchGenerator can batch without dequantizing.

`Q4KVCache` is the per-sequence cache (a `QuantizedKVCache` with `size()` and `merge()`);
`BatchQ4KVCache` implements the batch-cache contract of mlx-lm's `BatchKVCache` over the three
quantized components (packed uint32, scales, biases). mlx quantizes along the head dimension only,
so every token is quantized on its own: padding, rolling and slicing along the sequence axis are
exact, and a token quantizes the same way however the prompt was chunked or batched.

Attention on them is `caches.attention`'s (the dispatch fix). Each cache holds a
`floats.FloatCopies` (`float_copies`: its codec's, or `floats.DEFAULT`), which decides when attention
runs on float copies of the K/V and bounds those copies: the *decode mirror* a `BatchQ4KVCache`
keeps on the CPU, and the floats a `Q4KVCache` carries from one turn to the agent's next. A batch
cache takes its rows' and hands it to what it extracts; caches under different ones do not batch.
`caches.kinds` decides which layers get these classes. Cache objects are built, updated and read on
the worker thread only (MLX work). Their packed storage and its writes are `caches.packed`'s, the
float values of it `caches.dequant`'s,
and the batch cache's decode mirror `caches.mirror`'s (`DecodeMirror`, its base).

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

from typing import List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import QuantizedKVCache, _BaseCache, dynamic_roll

from .floats import DEFAULT, DEQUANT_MIN_QUERIES, MIRROR_PREFILL_MAX_QUERIES, FloatCopies
from .key_formats import LayerKeys, key_bits
from .kinds import Q4, UnsupportedModelError, layer_kinds, layer_windows, model_type_of
from .mirror import DecodeMirror
from .packed import (QTuple, _alloc, _append, _check_format, _key_format, _key_format_of, _key_format_tag,
                     _qmap, _qnbytes, _qslice, _same_keys, _window_drop)


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
    # The budgets and prefill mode this cache attends under (class default: from_state builds
    # caches without one); a batch merged from it holds the same.
    float_copies: FloatCopies = DEFAULT
    # How keys are stored when not like the values (`caches.key_formats`: 8-bit keys, scaled or
    # Hadamard-rotated keys); None: `bits`, untransformed. Shared, immutable.
    key_format: Optional[LayerKeys] = None

    def __init__(self, group_size: int = 64, bits: int = 4, window: Optional[int] = None,
                 float_copies: Optional[FloatCopies] = None, key_format: Optional[LayerKeys] = None):
        _check_format(bits, group_size)
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        super().__init__(group_size=group_size, bits=bits)
        self.window = window
        self.start = 0
        self.floats = None
        self.float_copies = DEFAULT if float_copies is None else float_copies
        self.key_format = _key_format(key_format, bits)

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

    # mlx-lm 0.32 dropped meta_state and takes from_state(state); ours keeps both forms working. A key
    # format other than plain `bits` is meta_state's last entry (_key_format_tag), so from_state (mlx-lm's
    # load, vllm-mlx's copy of a multimodal prefix cache) reads the keys back as stored.
    @property
    def meta_state(self):
        extra = () if self.window is None else (self.window, self.start)
        tag = () if self.key_format is None else (_key_format_tag(self.key_format),)
        return tuple(map(str, (self.offset, self.group_size, self.bits) + extra)) + tag

    @meta_state.setter
    def meta_state(self, v) -> None:
        v = [x for x in v if not str(x).startswith("kf:")]
        self.offset, self.group_size, self.bits = map(int, v[:3])
        self.window, self.start = (int(v[3]), int(v[4])) if len(v) > 3 else (None, 0)

    @classmethod
    def from_state(cls, state, meta_state=None) -> "Q4KVCache":
        keys, values = state[:2]
        if meta_state is None:
            return cls.from_arrays(keys, values, *state[3:5][::-1]) if len(state) == 5 else cls.from_arrays(keys, values, 4, 64)
        tag = next((str(x) for x in meta_state if str(x).startswith("kf:")), None)
        key_format = None if tag is None else _key_format_of(tag)
        obj = cls(group_size=int(meta_state[1]), bits=int(meta_state[2]), key_format=key_format)
        obj.keys, obj.values = keys, values
        obj.meta_state = meta_state
        return obj

    @classmethod
    def merge(cls, caches: Sequence["Q4KVCache"]) -> "BatchQ4KVCache":
        return BatchQ4KVCache.merge(caches)

    @property
    def key_bits(self) -> int:
        return key_bits(self)

    @classmethod
    def from_arrays(
        cls, keys: QTuple, values: QTuple, bits: int, group_size: int,
        window: Optional[int] = None, offset: Optional[int] = None, float_copies: Optional[FloatCopies] = None,
        key_format: Optional[LayerKeys] = None,
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
        c = cls(group_size=group_size, bits=bits, window=window, float_copies=float_copies, key_format=key_format)
        lo = T - window if window is not None and T > window else 0
        # Fresh array objects (views, no copy) so that in-place writes after a trim never reach
        # the caller's arrays.
        c.keys, c.values = (tuple(x[:, :, lo:T] for x in q) for q in (keys, values))
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


class BatchQ4KVCache(DecodeMirror, _BaseCache):
    """Batched quantized KV cache: `BatchKVCache`'s contract over (packed, scales, biases).

    Sequences are left-padded; `_idx` is the physical write index, `offset[b]` the logical
    position of sequence b. Without a window, `offset[b]` is the physical index minus the row's
    left padding. With a `window` (a sliding-window layer), whole leading columns are dropped
    (see `Q4KVCache`): rows are aligned at their newest token, so the last columns are every row's
    most recent tokens; row b then holds positions [offset[b] - (_idx - left_padding[b]), offset[b]).

    `_mirror` is the optional float decode mirror (`DecodeMirror`): (keys, values) float arrays laid out
    exactly like the packed storage (same rows, same capacity), built on the first decode-sized
    update and then following every operation on the packed storage, within the budget of
    `float_copies` (the rows'), which also counts it.
    """

    step = 256
    window: Optional[int] = None
    # Per-row token counts of the right-padded prompt call in progress (prepare .. finalize) and
    # the write index it started at: which queries of a chunk are real tokens (`real_queries`).
    _lengths: Optional[List[int]] = None
    _lengths_at = 0
    float_copies: FloatCopies = DEFAULT  # class default: from_state builds objects without __init__
    key_format: Optional[LayerKeys] = None  # as `Q4KVCache.key_format`: the rows'

    def __init__(self, left_padding: List[int], bits: int = 4, group_size: int = 64,
                 window: Optional[int] = None, float_copies: Optional[FloatCopies] = None,
                 key_format: Optional[LayerKeys] = None):
        _check_format(bits, group_size)
        self.key_format = _key_format(key_format, bits)
        self.keys: Optional[QTuple] = None
        self.values: Optional[QTuple] = None
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-l for l in left_padding])
        self._idx = 0
        self._right_padding = None
        self.bits = bits
        self.group_size = group_size
        self.window = window
        self.float_copies = DEFAULT if float_copies is None else float_copies

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
        elif S < DEQUANT_MIN_QUERIES or (S < MIRROR_PREFILL_MAX_QUERIES and self.float_copies.dequantize_for(S)):
            # decode, or a short prefill chunk (a returning agent's new text, a prompt's last chunk)
            # whose attention would dequantize all of the layer's K/V anyway: dequantize once into
            # the mirror, which the chunk's attention reads and the decode steps keep (such a turn
            # dequantized twice before). Full-size chunks of a long prompt attend on a transient
            # copy instead, so a cold prefill holds no float copy of the whole history.
            self._mirror_build()
        return _qslice(self.keys, self._idx), _qslice(self.values, self._idx)

    @property
    def key_bits(self) -> int:
        return key_bits(self)

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
            self.float_copies.mirror_counts["refused"] += not mirrored

        def pad(c: "BatchQ4KVCache"):
            k, v, f = c.keys, c.values, c._mirror
            if k is None:  # an empty side still has rows: give them zero-length storage
                Bc = c.offset.shape[0]
                k, v = _alloc(like.keys, Bc, 0), _alloc(like.values, Bc, 0)
                f = None
            if mirrored and f is None:
                f = (like.dequantize_keys(k), like.dequantize(v))
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
        cache = Q4KVCache(group_size=self.group_size, bits=self.bits, window=self.window,
                          float_copies=self.float_copies, key_format=self.key_format)
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


    @classmethod
    def merge(cls, caches: Sequence[QuantizedKVCache]) -> "BatchQ4KVCache":
        """Left-pad per-sequence quantized caches into one batch cache, under their `float_copies`."""
        bits, group_size = caches[0].bits, caches[0].group_size
        window = getattr(caches[0], "window", None)
        copies = getattr(caches[0], "float_copies", DEFAULT)
        keys_as = getattr(caches[0], "key_format", None)
        for c in caches:
            if not _same_keys(getattr(c, "key_format", None), keys_as):
                raise ValueError("cannot batch caches whose keys are stored in different formats")
            if (c.bits, c.group_size) != (bits, group_size):
                raise ValueError(
                    f"cannot batch caches with different formats: {c.bits}-bit/group "
                    f"{c.group_size} vs {bits}-bit/group {group_size}"
                )
            if getattr(c, "window", None) != window:
                raise ValueError(f"cannot batch caches with windows {getattr(c, 'window', None)} and {window}")
            if getattr(c, "float_copies", DEFAULT) is not copies:
                raise ValueError("cannot batch caches under different FloatCopies (their float budgets)")
        # `offset`, not `size()`: a plain QuantizedKVCache reports size() == 0. Tokens held, not
        # positions: a window cache holds [start, offset).
        lengths = [c.offset - getattr(c, "start", 0) if c.keys is not None else 0 for c in caches]
        max_length = max(lengths)
        if max_length == 0:
            return cls([0] * len(caches), bits, group_size, window, copies, keys_as)

        padding = [max_length - l for l in lengths]
        src = next(c for c in caches if c.keys is not None)
        B = len(caches)
        if B == 1:
            # One sequence (a returning agent's prompt, usually): its arrays as they are, no copy;
            # the first write grows them into new storage (_append), so they are never written.
            cache = cls([0], bits, group_size, window, copies, keys_as)
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

        cache = cls(padding, bits, group_size, window, copies, keys_as)
        cache.keys, cache.values = keys, values
        cache.offset = mx.array([c.offset if c.keys is not None else 0 for c in caches])
        cache._idx = max_length
        cache._adopt_floats(caches, padding, lengths)
        return cache

    def _check_compatible(self, other: "BatchQ4KVCache") -> None:
        if not isinstance(other, BatchQ4KVCache):
            raise TypeError(f"cannot extend BatchQ4KVCache with {type(other).__name__}")
        if (other.bits, other.group_size) != (self.bits, self.group_size):
            raise ValueError("cannot extend a batch cache with one of a different format")
        if other.window != self.window:
            raise ValueError(f"cannot extend a batch cache of window {self.window} with one of {other.window}")
        if other.float_copies is not self.float_copies:
            raise ValueError("cannot extend a batch cache with one under different FloatCopies (float budgets)")
        if not _same_keys(other.key_format, self.key_format):
            raise ValueError("cannot extend a batch cache with one whose keys are stored in another format")

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """The 4-bit storage and, while there is one, the float decode mirror."""
        return _qnbytes(self.keys) + _qnbytes(self.values) + self.mirror_nbytes


def make_q4_prompt_cache(model: nn.Module, bits: int = 4, group_size: int = 64, bounded: bool = False,
                         float_copies: Optional[FloatCopies] = None,
                         key_formats: Optional[Sequence[Optional[LayerKeys]]] = None) -> list[Q4KVCache]:
    """One fresh `Q4KVCache` per layer, for models whose layers are all of the Q4 kind (plain and
    sliding-window attention); `caches.ModelCodec` builds the caches of every other model.
    `bounded`: sliding-window layers hold only their window (else every token, masked).
    `float_copies`: the budgets they attend under (default `floats.DEFAULT`)."""
    _check_format(bits, group_size)
    kinds = layer_kinds(model, group_size)
    if any(k != Q4 for k in kinds):
        raise UnsupportedModelError(
            f"model type {model_type_of(model)!r} has non-attention or latent layers; use caches.ModelCodec"
        )
    windows = layer_windows(model) if bounded else {}
    return [Q4KVCache(group_size=group_size, bits=bits, window=windows.get(l), float_copies=float_copies,
                      key_format=key_formats[l] if key_formats else None)
            for l in range(len(kinds))]