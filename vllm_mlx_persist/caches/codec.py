"""What a block holds for each layer kind, and how a per-sequence cache is cut into blocks and
rebuilt from them. The pool calls only this module for per-layer work.

A block's arrays are one flat name -> array map (the disk format stores it as is):

* Q4 layer l (plain or sliding-window attention, `Q4KVCache`): `l.k.q l.k.s l.k.b l.v.q l.v.s l.v.b`,
  each (1, n_kv_heads, n_tokens, .). The keys as the layer's key format stores them
  (`key_formats[l]`, caches/key_formats.py: 8-bit, scaled or rotated; the format is part of the
  model identity, so a directory's blocks are all of one format). By default sliding-window layers keep every token: the window
  is applied by the mask, so a prefix can be reused at any point. With `bounded=True` their live
  caches hold only their window (`windows[l]`): a cache's layer l then holds positions
  `spans(cache)[l]` = [start, offset) only, and `token_arrays` / `slice` give those. A block then
  holds the sliding layers' arrays for its last n_tokens - f tokens only, f = `win.from` (int32
  (1,); absent: 0; n_tokens: none, and their arrays are absent): what the turn's live cache still
  held when it was committed, i.e. the window before the turn's end. A prefix is reused up to the
  last point whose window the blocks hold (`window_reach`): a turn's end, or any point at least a
  window past the start of what a turn held.
* FULL layer l (MLA latent, mlx-lm's `KVCache` in the model's dtype): `l.k l.v`, (1, H, n_tokens, .);
  with the `latent_bits` option, packed instead (caches/latent.py): `l.k.c l.k.s l.k.b l.v.c l.v.s
  l.v.b` (uint8 codes, float32 scales and biases), dequantized into the live float cache on reuse.
* LIST layer l (`CacheList` of FULL caches): `l.j.k l.j.v` for sub-cache j.
* STATE layer l (`StateCache`): no per-token arrays. A block may carry up to MAX_CHECKPOINTS
  recurrent-state checkpoints: `ckpt{c}.pos` (int32 (1,), the position within the block, 1..n:
  the state after that many of the block's tokens) and `l.ckpt{c}.{i}` for each state array i.

16-bit floats travel to numpy as raw uint16 views, named in `dtypes`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import copy

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import CacheList, KVCache

from .floats import CarriedFloats, FloatCopies
from .key_formats import LayerKeys
from .kinds import FULL, LIST, Q4, STATE, layer_kinds, layer_windows
from .latent import LATENT_BITS, dequantize_latent, quantize_latent
from .packed import _same_keys
from .q4 import Q4KVCache
from .recurrent import StateCache

Arrays = dict  # name -> mx.array
_Q4_PARTS = ("k.q", "k.s", "k.b", "v.q", "v.s", "v.b")
_LATENT_PARTS = ("k.c", "k.s", "k.b", "v.c", "v.s", "v.b")
_RAW16 = {mx.bfloat16: "bfloat16"}
# Per block, at most. A checkpoint costs a whole recurrent state (tens of MB for a large hybrid): the
# pool now puts at most its branch's resume point in a block (commit.py); blocks written before
# hold up to two (a turn's prefill end and final state).
MAX_CHECKPOINTS = 2
WIN_FROM = "win.from"  # where a block's sliding-layer arrays begin (bounded windows; see the docstring)


class ModelCodec:
    """Layer kinds of one model and the block <-> cache conversions for them. Every 4-bit cache it
    makes (`make_cache`, `build`) holds its `float_copies`, which also keeps what `carry` keeps."""

    def __init__(self, kinds: Sequence[Any], bits: int = 4, group_size: int = 64,
                 state_sizes: Optional[dict[int, int]] = None, windows: Optional[dict[int, int]] = None,
                 bounded: bool = False, latent_bits: Optional[int] = None, latent_dtype: mx.Dtype = mx.float32,
                 float_copies: Optional[FloatCopies] = None,
                 key_formats: Optional[Sequence[Optional[LayerKeys]]] = None):
        """`latent_bits` (None, 8 or 4): blocks hold FULL (MLA latent) layers packed in that many
        bits, dequantized to `latent_dtype` (the model's) when a cache is built from them.
        `float_copies`: the budgets of the float copies its 4-bit caches attend on (the backend's);
        without one the codec owns its own, with the defaults. `key_formats`: per layer, how its
        Q4 caches store keys (None or absent: like the values)."""
        if latent_bits is not None and latent_bits not in LATENT_BITS:
            raise ValueError(f"latent_bits must be None or one of {LATENT_BITS}, got {latent_bits}")
        self.kinds = list(kinds)
        self.bits, self.group_size = bits, group_size
        self.state_sizes = dict(state_sizes or {})
        self.has_state = STATE in self.kinds
        # Q4 layers with a sliding window -> the window; their live caches hold only it if bounded.
        self.windows = dict(windows or {})
        self.bounded = bounded
        self.latent_bits, self.latent_dtype = latent_bits, latent_dtype
        self.float_copies = FloatCopies() if float_copies is None else float_copies
        self.key_formats: list[Optional[LayerKeys]] = list(key_formats or [None] * len(self.kinds))
        if len(self.key_formats) != len(self.kinds):
            raise ValueError(f"{len(self.key_formats)} key formats for {len(self.kinds)} layers")

    @classmethod
    def for_model(cls, model: Any, bits: int = 4, group_size: int = 64, bounded: bool = False,
                  latent_bits: Optional[int] = None, float_copies: Optional[FloatCopies] = None) -> "ModelCodec":
        """Raises `UnsupportedModelError` (naming the model type and why) for what cannot work."""
        kinds = layer_kinds(model, group_size)
        sizes = {l: len(c.cache) for l, c in enumerate(model.make_cache() if hasattr(model, "make_cache") else [])
                 if kinds[l] == STATE}
        windows = {l: w for l, w in layer_windows(model).items() if kinds[l] == Q4}
        dtype = next((p.dtype for _, p in tree_flatten(model.parameters())
                      if mx.issubdtype(p.dtype, mx.floating)), mx.float32)
        return cls(kinds, bits, group_size, sizes, windows, bounded, latent_bits, dtype, float_copies)

    def with_key_formats(self, key_formats: Sequence[Optional[LayerKeys]]) -> "ModelCodec":
        """The same codec, its Q4 layers storing keys per `key_formats` (one per layer)."""
        other = copy.copy(self)
        other.key_formats = list(key_formats)
        if len(other.key_formats) != len(self.kinds):
            raise ValueError(f"{len(other.key_formats)} key formats for {len(self.kinds)} layers")
        return other

    def key_format(self, l: int) -> Optional[LayerKeys]:
        """How layer l's caches store keys (None: like the values)."""
        return self.key_formats[l]

    def with_float_copies(self, float_copies: FloatCopies) -> "ModelCodec":
        """The same codec, its caches under `float_copies` (a test's or a tool's own budgets)."""
        other = copy.copy(self)
        other.float_copies = float_copies
        return other

    def window(self, l: int) -> Optional[int]:
        """The window layer l's live caches keep, or None when they keep every token."""
        return self.windows.get(l) if self.bounded else None

    @property
    def n_layers(self) -> int:
        return len(self.kinds)

    def window_names(self) -> set[str]:
        """Names of the per-token arrays of bounded sliding-window layers (a block may hold them
        for its last tokens only)."""
        return {f"{l}.{p}" for l in self.windows for p in _Q4_PARTS} if self.bounded else set()

    @staticmethod
    def window_from(arrays: dict) -> int:
        """Where a block's (or its in-memory copy's) sliding-layer arrays begin (0: all its tokens)."""
        f = arrays.get(WIN_FROM)
        return 0 if f is None else int(f[0].item() if isinstance(f, mx.array) else f[0])

    def window_reach(self, used: Sequence[tuple[Arrays, int]]) -> int:
        """The furthest point p <= sum(n) of the used blocks ((arrays, tokens used of each),
        consecutive from position 0) such that the sliding layers' window before p,
        [max(0, p - w), p), is held by them; the sum itself for models without bounded windows."""
        covered = sum(n for _, n in used)
        if not self.window_names():
            return covered
        w = max(self.windows.values())
        best = at = stretch = 0  # stretch: where the run of held positions ending at `at` began
        for arrays, n in used:
            f = min(self.window_from(arrays), n)  # the used part holds [at + f, at + n)
            if f > 0:
                stretch = at + f
            if f < n and (stretch == 0 or at + n - stretch >= w):
                best = at + n
            at += n
        return best

    def reach(self, used: Sequence[tuple[Arrays, int]]) -> int:
        """How far a cache `build` makes from the used blocks reaches: `window_reach`, and on recurrent
        models the last checkpoint at or before it (0: none)."""
        covered = self.window_reach(used)
        if not self.has_state:
            return covered
        best = start = 0
        for arrays, n in used:
            best = max([best] + [start + p for _, p in self.checkpoint_slots(arrays) if start + p <= covered])
            start += n
        return best

    def _gather(self, used: Sequence[tuple[Arrays, int]], name: str, lo: int, windowed: bool) -> mx.array:
        """Positions [lo, end of `used`) of array `name` across consecutive blocks ((arrays, tokens used
        of each), the first at position 0); a windowed block's array starts at its `window_from`."""
        pieces, at = [], 0
        for arrays, n in used:
            if at + n > lo:
                f = self.window_from(arrays) if windowed else 0
                pieces.append(arrays[name][..., max(0, lo - at) - f : n - f, :])
            at += n
        return _concat(pieces)

    def splice_run(self, used: Sequence[tuple[Arrays, int]], lo: int) -> Arrays:
        """A stored run for a splice (span directives): the token arrays of positions [lo, end) of
        consecutive blocks ((arrays, tokens used of each), the first block starting at position 0).
        Bounded sliding layers need only the window before the run's end (positions before lo come
        from the live cache the run is appended to), so theirs cover [max(lo, end - w), end)
        (`win.from`, relative to lo, says where they begin), and end is the furthest block end
        (or the last) whose window the blocks hold; {} when there is none. `run_length` says how
        many tokens it holds."""
        end = sum(n for _, n in used)
        windowed = self.window_names()
        if windowed:
            end = self._run_reach(used, lo)
            if end <= lo:
                return {}
            used = _truncate(used, end)
        a = max(lo, end - max(self.windows.values())) if windowed else lo
        out = {name: self._gather(used, name, a if name in windowed else lo, name in windowed)
               for name in self.token_names()}
        if a > lo:
            out[WIN_FROM] = mx.array([a - lo], dtype=mx.int32)
        return out

    def _run_reach(self, used: Sequence[tuple[Arrays, int]], lo: int) -> int:
        """`window_reach` for a run starting at lo: positions before lo count as held."""
        w = max(self.windows.values())
        best = at = stretch = 0  # stretch: where the held positions ending at `at` began
        for arrays, n in used:
            f = min(self.window_from(arrays), n)  # the block holds [at + f, at + n)
            if f > 0:
                stretch = at + f
            if f < n and at + n > lo and (stretch <= lo or at + n - stretch >= w):
                best = at + n
            at += n
        return best

    def run_length(self, run: Arrays) -> int:
        """Tokens a `splice_run` holds (0 for {})."""
        name = next((x for x in sorted(self.token_names()) if x in run), None)
        if name is None:
            return 0
        return int(run[name].shape[2]) + (self.window_from(run) if name in self.window_names() else 0)

    def unpack_latents(self, arrays: Arrays) -> Arrays:
        """`arrays` with latent-packed FULL layers (`latent_bits`) as the float `l.k`, `l.v` the live
        cache holds (dequantized to `latent_dtype`, as `build` does); the same map without the option."""
        if self.latent_bits is None:
            return arrays
        out = dict(arrays)
        for l, k in enumerate(self.kinds):
            if k == FULL and f"{l}.k.c" in out:
                for x in "kv":
                    parts = [out.pop(f"{l}.{x}.{p}") for p in "csb"]
                    out[f"{l}.{x}"] = dequantize_latent(*parts, self.latent_bits, self.latent_dtype)
        return out

    # ---- live caches --------------------------------------------------------------------------

    def make_cache(self) -> list:
        """A fresh per-sequence cache; every sequence gets the same class per layer (BatchGenerator
        cannot batch mixed classes at one layer)."""
        return [self._fresh(k, l) for l, k in enumerate(self.kinds)]

    def _fresh(self, kind, l: int):
        if kind == Q4:
            return Q4KVCache(group_size=self.group_size, bits=self.bits, window=self.window(l),
                             float_copies=self.float_copies, key_format=self.key_formats[l])
        if kind == FULL:
            return KVCache()
        if kind == STATE:
            return StateCache(self.state_sizes[l])
        return CacheList(*(KVCache() for _ in kind[1]))

    def is_cache(self, cache: list) -> bool:
        if not cache or len(cache) != self.n_layers:
            return False
        want = {Q4: Q4KVCache, FULL: KVCache, STATE: StateCache}
        return all(type(c) is want.get(k if isinstance(k, str) else LIST, CacheList)
                   and (k != Q4 or (c.window == self.window(l)
                                    and _same_keys(c.key_format, _norm(self.key_formats[l], self.bits))))
                   for l, (c, k) in enumerate(zip(cache, self.kinds)))

    def length(self, cache: list) -> int:
        """Tokens the cache covers (all layers agree)."""
        for c, k in zip(cache, self.kinds):
            if k == STATE:
                continue
            if k == Q4 or k == FULL:
                return int(c.offset)
            return int(c.caches[0].offset)
        return int(cache[0].pos[0])

    def spans(self, cache: list) -> list[Optional[tuple[int, int]]]:
        """Per layer, the positions [start, end) whose per-token arrays the cache holds (None for
        STATE layers). Every layer ends at `length(cache)`; only bounded sliding-window layers
        start after 0."""
        out: list = []
        for c, k in zip(cache, self.kinds):
            if k == STATE:
                out.append(None)
            elif k == Q4:
                out.append((int(c.start), int(c.offset)))
            else:
                sub = c if k == FULL else c.caches[0]
                out.append((0, int(sub.offset)))
        return out

    # ---- cache -> blocks ------------------------------------------------------------------------

    def live_checkpoints(self, cache: list, n_valid: int) -> list[tuple[int, list]]:
        """(position, per-STATE-layer arrays) for the checkpoints of an extracted cache at or before
        `n_valid` (a state past the stored tokens is useless)."""
        if not self.has_state:
            return []
        per_layer = [cache[l].checkpoints() for l, k in enumerate(self.kinds) if k == STATE]
        out = []
        for i, (pos, _) in enumerate(per_layer[0]):
            if pos <= n_valid and all(len(p) > i and p[i][0] == pos for p in per_layer):
                out.append((pos, [p[i][1] for p in per_layer]))
        return out

    def block_checkpoints(self, arrays: Arrays, start: int) -> list[tuple[int, list]]:
        """A block's checkpoints as (absolute position, per-STATE-layer arrays)."""
        out = []
        for c in range(MAX_CHECKPOINTS):
            p = arrays.get(f"ckpt{c}.pos")
            if p is None:
                continue
            states = [[arrays[f"{l}.ckpt{c}.{i}"] for i in range(self.state_sizes[l])]
                      for l, k in enumerate(self.kinds) if k == STATE]
            out.append((start + int(p.item()), states))
        return out

    def checkpoint_slots(self, arrays: Arrays) -> list[tuple[int, int]]:
        """(slot c, position within the block) of each checkpoint a block (or its in-memory copy) holds."""
        return [(c, int(arrays[f"ckpt{c}.pos"].item())) for c in range(MAX_CHECKPOINTS) if f"ckpt{c}.pos" in arrays]

    def checkpoint_names(self, c: int) -> set[str]:
        """The names of checkpoint slot c's arrays: its position and every STATE layer's state."""
        return {f"ckpt{c}.pos"} | {f"{l}.ckpt{c}.{i}" for l, k in enumerate(self.kinds) if k == STATE
                                   for i in range(self.state_sizes[l])}

    def token_arrays(self, cache: list) -> Arrays:
        """The per-token arrays of a per-sequence cache (names as in a block), (1, H, T, .) views:
        layer l's cover `spans(cache)[l]`."""
        out: Arrays = {}
        for l, (c, k) in enumerate(zip(cache, self.kinds)):
            if k == Q4:
                keys, values = c.to_arrays()
                out.update({f"{l}.{p}": a for p, a in zip(_Q4_PARTS, keys + values)})
            elif k == FULL and self.latent_bits is not None:
                packed = quantize_latent(_valid(c, c.keys), self.latent_bits) \
                    + quantize_latent(_valid(c, c.values), self.latent_bits)
                out.update({f"{l}.{p}": a for p, a in zip(_LATENT_PARTS, packed)})
            elif k == FULL:  # keys/values directly: `state` differs between mlx-lm 0.31 and 0.32
                out.update({f"{l}.k": _valid(c, c.keys), f"{l}.v": _valid(c, c.values)})
            elif k != STATE:
                for j, sub in enumerate(c.caches):
                    out.update({f"{l}.{j}.k": _valid(sub, sub.keys), f"{l}.{j}.v": _valid(sub, sub.values)})
        return out

    def slice(self, cache: list, start: int, end: int, checkpoints: Sequence[tuple[int, list]] = (),
              whole: Optional[Arrays] = None) -> Arrays:
        """The arrays of the block holding tokens [start, end) of a per-sequence cache, with the
        newest MAX_CHECKPOINTS of `checkpoints` (absolute positions) that fall in (start, end].
        The token arrays are views of `whole` (the cache's token arrays, contiguous, for the names it
        has) or copies. A bounded sliding-window layer gives the part of [start, end) it still holds
        (`win.from` says where it begins)."""
        out: Arrays = {}
        win_from = 0
        spans = self.spans(cache)
        for name, a in self.token_arrays(cache).items():
            if whole is not None and name in whole:
                out[name] = whole[name][..., start:end, :]
                continue
            first = spans[int(name.split(".")[0])][0]
            lo = max(start, first)
            if first > 0:  # a bounded window layer that dropped its oldest positions
                win_from = max(win_from, lo - start)
            if lo < end:
                out[name] = mx.contiguous(a[..., lo - first : end - first, :])
        if win_from:
            for name in self.window_names() & set(out):  # every window layer from the same point
                held = out[name].shape[2]
                if held > end - start - win_from:
                    out[name] = out[name][..., held - (end - start - win_from):, :]
            if win_from >= end - start:
                for name in self.window_names():
                    out.pop(name, None)
            out[WIN_FROM] = mx.array([min(win_from, end - start)], dtype=mx.int32)
        mine = sorted({p: s for p, s in checkpoints if start < p <= end}.items())[-MAX_CHECKPOINTS:]
        state_layers = [l for l, k in enumerate(self.kinds) if k == STATE]
        for c, (p, states) in enumerate(mine):
            out[f"ckpt{c}.pos"] = mx.array([p - start], dtype=mx.int32)
            for l, arrays in zip(state_layers, states):
                out.update({f"{l}.ckpt{c}.{i}": mx.contiguous(a) for i, a in enumerate(arrays)})
        return out

    # ---- blocks -> cache ------------------------------------------------------------------------

    def build(self, used: Sequence[tuple[Arrays, int]], whole: Optional[Arrays] = None,
              floats: Optional[CarriedFloats] = None) -> tuple[Optional[list], int]:
        """A per-sequence cache from the first n tokens of each block in `used` (consecutive from
        position 0). Recurrent models stop at the last checkpoint at or before the end; returns
        (cache, tokens covered), or (None, 0) when nothing can be reused. `whole`: the token arrays
        of `from_numpy_run` when the used blocks are, in order, the start of that run; the cache
        is then views of them, not a concatenation. `floats`: the float copies carried with that
        run (`carry`), given to its 4-bit layers (`Q4KVCache.floats`)."""
        covered = self.window_reach(used)  # bounded sliding layers: up to the last window held
        if covered < sum(n for _, n in used):
            used = _truncate(used, covered)
        state = None
        if self.has_state:
            start, best = 0, None
            for arrays, n in used:
                for p, s in self.block_checkpoints(arrays, start):
                    if p <= covered and (best is None or p > best[0]):
                        best = (p, s)
                start += n  # every block but the last is used whole
            if best is None:
                return None, 0
            covered, state = best
            used = _truncate(used, covered)
        if covered == 0:
            return None, 0

        windowed = self.window_names()

        def cat(name: str, lo: int = 0) -> mx.array:
            """Positions [lo, covered) of `name` (held: window_reach saw to it)."""
            if whole is not None and name in whole:
                return whole[name][..., lo:covered, :]
            return self._gather(used, name, lo, name in windowed)

        cache, si = [], 0
        for l, k in enumerate(self.kinds):
            if k == Q4:
                w = self.window(l)
                lo = 0 if w is None else max(0, covered - w)  # a bounded layer: only its window
                parts = [cat(f"{l}.{p}", lo) for p in _Q4_PARTS]
                cache.append(Q4KVCache.from_arrays(tuple(parts[:3]), tuple(parts[3:]), self.bits, self.group_size,
                                                   window=w, offset=covered, float_copies=self.float_copies,
                                                   key_format=self.key_formats[l]))
            elif k == FULL and self.latent_bits is not None:
                deq = lambda x: dequantize_latent(*(cat(f"{l}.{x}.{p}") for p in "csb"), self.latent_bits,
                                                  self.latent_dtype)
                cache.append(_kv(deq("k"), deq("v")))
            elif k == FULL:
                cache.append(_kv(cat(f"{l}.k"), cat(f"{l}.v")))
            elif k == STATE:
                cache.append(StateCache.from_checkpoint(covered, state[si]))
                si += 1
            else:
                cache.append(CacheList(*(_kv(cat(f"{l}.{j}.k"), cat(f"{l}.{j}.v")) for j in range(len(k[1])))))
        mx.eval([a for _, a in _flat(cache)])
        carried = floats.take(covered) if floats is not None and whole is not None else None
        for l, kv in (carried or {}).items():
            cache[l].floats = kv
        return cache, covered

    def carry(self, cache: list, n: int) -> Optional[CarriedFloats]:
        """The float copies of a stored turn's first n positions, for its next turn: the plain 4-bit
        layers' `Q4KVCache.floats` (what the turn's batch mirror held), kept within the carry
        budget of `float_copies` (`FloatCopies.carry_floats`); None when there are none or they do
        not fit. All layers or none: a layer without would dequantize its history anyway."""
        layers = {}
        for l, (c, k) in enumerate(zip(cache, self.kinds)):
            if k == Q4 and self.window(l) is None:
                f = c.floats
                if f is None or f[0].shape[2] < n:
                    return None
                layers[l] = f
        return self.float_copies.carry_floats(layers, n)

    # ---- disk -----------------------------------------------------------------------------------

    @staticmethod
    def to_numpy(arrays: Arrays) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        out, dtypes = {}, {}
        for name, a in arrays.items():
            if a.dtype in _RAW16:
                dtypes[name] = _RAW16[a.dtype]
                a = a.view(mx.uint16)
            out[name] = np.array(a)
        return out, dtypes

    @staticmethod
    def from_numpy(arrays: dict[str, np.ndarray], dtypes: dict[str, str]) -> Arrays:
        out = {}
        for name, a in arrays.items():
            x = mx.array(a)
            out[name] = x.view(mx.bfloat16) if dtypes.get(name) == "bfloat16" else x
        return out

    def from_numpy_run(self, blocks: Sequence[tuple[dict[str, np.ndarray], dict[str, str]]],
                       ) -> tuple[list[Arrays], Arrays]:
        """Consecutive blocks read from disk, with one copy into MLX per token array: each is
        concatenated in numpy and imported once. Returns each block's arrays (views of the
        imports, plus its own checkpoints) and the imports themselves (for `build`)."""
        names = sorted(self.token_names() - self.window_names())  # window arrays vary per block
        whole: Arrays = {}
        for name in names:
            pieces = [arrays[name] for arrays, _ in blocks]
            x = mx.array(np.concatenate(pieces, axis=2) if len(pieces) > 1 else pieces[0])
            whole[name] = x.view(mx.bfloat16) if blocks[0][1].get(name) == "bfloat16" else x
        out, start = [], 0
        for arrays, dtypes in blocks:
            n = arrays[names[0]].shape[2] if names else 0
            own = self.from_numpy({k: a for k, a in arrays.items() if k not in whole}, dtypes)
            own.update({name: whole[name][..., start : start + n, :] for name in names})
            out.append(own)
            start += n
        return out, whole

    def token_names(self) -> set[str]:
        """Names of the per-token arrays, (1, H, n_tokens, .), that every block holds."""
        want = set()
        for l, k in enumerate(self.kinds):
            if k == Q4:
                want |= {f"{l}.{p}" for p in _Q4_PARTS}
            elif k == FULL and self.latent_bits is not None:
                want |= {f"{l}.{p}" for p in _LATENT_PARTS}
            elif k == FULL:
                want |= {f"{l}.k", f"{l}.v"}
            elif k != STATE:
                want |= {f"{l}.{j}.{x}" for j in range(len(k[1])) for x in "kv"}
        return want

    def valid(self, arrays: dict[str, np.ndarray], n: int) -> bool:
        """Whether a block read from disk has exactly the arrays this model's layers need for n tokens."""
        want = self.token_names()
        windowed = self.window_names()
        f = 0
        if WIN_FROM in arrays:
            p = arrays[WIN_FROM]
            if not windowed or p.shape != (1,) or not 0 < int(p[0]) <= n:
                return False
            f = int(p[0])
            want.add(WIN_FROM)
            if f == n:
                want -= windowed
        for name in want - {WIN_FROM}:
            a = arrays.get(name)
            held = n - f if name in windowed else n
            if a is None or a.ndim != 4 or a.shape[0] != 1 or a.shape[2] != held:
                return False
        for c in range(MAX_CHECKPOINTS):
            p = arrays.get(f"ckpt{c}.pos")
            if p is None:
                continue
            if not self.has_state or p.shape != (1,) or not 0 < int(p[0]) <= n:
                return False
            for l, k in enumerate(self.kinds):
                if k != STATE:
                    continue
                for i in range(self.state_sizes[l]):
                    a = arrays.get(f"{l}.ckpt{c}.{i}")
                    if a is None or a.ndim < 1 or a.shape[0] != 1:
                        return False
                    want.add(f"{l}.ckpt{c}.{i}")
            want.add(f"ckpt{c}.pos")
        return set(arrays) == want


def _norm(fmt: Optional[LayerKeys], bits: int) -> Optional[LayerKeys]:
    """None for a format that stores keys like values of `bits` (what the caches hold then)."""
    return None if fmt is not None and fmt.transform is None and fmt.bits == bits else fmt


def _truncate(used, covered: int):
    out, left = [], covered
    for arrays, n in used:
        if left <= 0:
            break
        out.append((arrays, min(n, left)))
        left -= n
    return out


def _concat(pieces: list) -> mx.array:
    return mx.concatenate(pieces, axis=2) if len(pieces) > 1 else mx.contiguous(pieces[0])


def _valid(c: KVCache, a: mx.array) -> mx.array:
    return a[..., : c.offset, :]


def _kv(keys: mx.array, values: mx.array) -> KVCache:
    c = KVCache()
    c.keys, c.values, c.offset = keys, values, keys.shape[2]
    return c


def _flat(cache: list):
    for l, c in enumerate(cache):
        if isinstance(c, Q4KVCache):
            for a in c.keys + c.values:
                yield l, a
        elif isinstance(c, StateCache):
            for a in c.cache:
                if a is not None:
                    yield l, a
        elif isinstance(c, CacheList):
            for s in c.caches:
                yield l, s.keys
                yield l, s.values
        else:
            yield l, c.keys
            yield l, c.values
