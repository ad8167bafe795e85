"""The float decode mirror of the batched 4-bit cache (`caches.q4.BatchQ4KVCache`): `DecodeMirror`.

Float (keys, values) laid out exactly like the packed storage, built on the first decode-sized
update and then following every write, move and growth of it, within the budget of the cache's
`floats.FloatCopies` (which also counts it); started from the rows' carried floats on merge, and
handed back to a row on extract. Worker thread only (MLX work).
"""

from __future__ import annotations

import copy
from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache

from .dequant import dequantize, widened
from .packed import QTuple, _qslice, _regrow


class DecodeMirror:
    """The float decode mirror's upkeep, a base of `BatchQ4KVCache`, whose storage it mirrors:
    it reads the cache's `keys`, `values`, `_idx`, `bits`, `key_bits`, `group_size`, `window`
    and `float_copies`."""

    _mirror: Optional[tuple] = None  # class default: from_state builds objects without __init__
    _mirror_refused = False  # the budget refused this cache's mirror (counted once, retried each step)

    def float_kv(self) -> Optional[tuple[mx.array, mx.array]]:
        """The mirror's (keys, values) up to the write index, or None when there is no mirror."""
        if self._mirror is None:
            return None
        fk, fv = self._mirror
        return fk[:, :, : self._idx], fv[:, :, : self._idx]

    @property
    def mirror_nbytes(self) -> int:
        m = self._mirror
        return 0 if m is None else m[0].nbytes + m[1].nbytes

    def _set_mirror(self, mirror: Optional[tuple]) -> None:
        self._mirror = mirror
        self.float_copies.track_mirror(self, mirror is not None)

    def _float_bytes(self, B: int, T: int, like: Optional["DecodeMirror"] = None) -> int:
        """Bytes of a float mirror of B rows and T tokens (K and V, the scales' dtype)."""
        like = like or self
        per = sum(q[0].shape[1] * (q[0].shape[3] * 32 // bits) * q[1].dtype.size
                  for q, bits in ((like.keys, self.key_bits), (like.values, self.bits)))
        return B * T * per

    def _mirror_fits(self, nbytes: int, released: int = 0) -> bool:
        """Whether `nbytes` more mirror bytes fit the budget once `released` bytes are given back."""
        copies = self.float_copies
        budget = copies.decode_float_budget_bytes()
        return budget > 0 and copies.decode_float_bytes() - released + nbytes <= budget

    def dequantize(self, q: QTuple, bits: Optional[int] = None) -> mx.array:
        """Float values of packed components of `bits` (default: the values'; keys: `key_bits`)."""
        bits = self.bits if bits is None else bits
        if q[0].size == 0:  # mx.dequantize cannot reshape an empty array
            B, H, T, P = q[0].shape
            return mx.zeros((B, H, T, P * 32 // bits), dtype=q[1].dtype)
        return dequantize(q, self.group_size, bits)

    def dequantize_keys(self, q: QTuple) -> mx.array:
        """Float keys, as stored (transformed, if the key format transforms them), in the values'
        dtype (keys' scales kept in 16 bits are widened first, exactly)."""
        return self.dequantize(widened(q, self.values), self.key_bits)

    def _mirror_build(self) -> None:
        if self.keys is None or self.float_copies.decode_float_budget_bytes() == 0:
            return
        B, _, cap, _ = self.keys[0].shape
        if self._mirror_fits(self._float_bytes(B, cap)):
            self._set_mirror((self.dequantize_keys(self.keys), self.dequantize(self.values)))
            self.float_copies.mirror_counts["builds"] += 1
            self._mirror_refused = False
        elif not self._mirror_refused:
            self.float_copies.mirror_counts["refused"] += 1
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
                self.float_copies.mirror_counts["refused"] += 1
                return
            fk, fv = _regrow((fk, fv), drop, prev, cap)
            self._set_mirror((fk, fv))
        # K and V apart: with `dequantize`'s few ops, joining them for one call (3 concatenations and
        # 2 slices) cost more than it saved.
        dk, dv = self.dequantize_keys(qk), self.dequantize(qv)
        fk[:, :, prev - drop : self._idx] = dk
        fv[:, :, prev - drop : self._idx] = dv

    def __deepcopy__(self, memo) -> "DecodeMirror":
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

    def _extract_floats(self, idx: int, pad: int) -> Optional[tuple[mx.array, mx.array]]:
        """Row idx's mirror, for the pool to carry to the row's next turn (`CarriedFloats`). One row:
        views (mlx-lm empties the batch right after extracting its last row, so they pin no more
        than that row's buffer). Several: a copy, evaluated now so that it holds none of the batch's
        buffer (its in-place decode writes would then copy the whole buffer every step); only when
        the carry budget could keep it."""
        fk, fv = self._mirror
        if fk.shape[0] == 1:
            return fk[..., pad : self._idx, :], fv[..., pad : self._idx, :]
        if self._float_bytes(1, self._idx - pad) > self.float_copies.carry_float_budget_bytes():
            return None
        out = tuple(mx.contiguous(x[idx : idx + 1, :, pad : self._idx]) for x in (fk, fv))
        mx.eval(out)
        return out

    def _adopt_floats(self, caches: Sequence[QuantizedKVCache], padding: List[int], lengths: List[int]) -> None:
        """Start the mirror from the rows' carried floats (`Q4KVCache.floats`) when any row has
        them and it fits the decode budget: one row's as they are (views), several laid out like
        the packed storage, the rows without any dequantized (what the first update would do)."""
        rows = [getattr(c, "floats", None) if n else None for c, n in zip(caches, lengths)]
        if self.window is not None or all(f is None for f in rows):
            return
        B, T = len(caches), self._idx
        counts = self.float_copies.mirror_counts
        if not self._mirror_fits(self._float_bytes(B, T)):
            counts["refused"] += 1
            self._mirror_refused = True
            return
        counts["carried"] += 1
        if B == 1:
            self._set_mirror(tuple(x[:, :, :T] for x in rows[0]))
            return
        dtype = self.keys[1].dtype
        mirror = tuple(mx.zeros((B, q[0].shape[1], T, q[0].shape[3] * 32 // bits), dtype=dtype)
                       for q, bits in ((self.keys, self.key_bits), (self.values, self.bits)))
        for i, (f, c, p, n) in enumerate(zip(rows, caches, padding, lengths)):
            if n == 0:
                continue
            if f is None:
                f = (self.dequantize_keys(_qslice(c.keys, n)), self.dequantize(_qslice(c.values, n)))
            for dst, x in zip(mirror, f):
                dst[i : i + 1, :, p : p + n] = x[..., :n, :]
        self._set_mirror(mirror)
