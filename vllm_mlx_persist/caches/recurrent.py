"""Recurrent state (SSM / linear attention) that knows its position and keeps checkpoints.

`StateCache` is mlx-lm's `ArraysCache` (full precision, batched natively by `BatchGenerator`) plus
what persisting needs, since the state cannot be trimmed back to an earlier token:

* `pos`: per row, how many real tokens the state has consumed (counted in `advance`, which every
  mlx-lm SSM/linear-attention layer calls once per forward; right padding is excluded through
  `lengths`).
* a snapshot of the state after the last multi-token chunk of the prefill. `BatchGenerator`
  prefills all but the last prompt token, then decodes one token per step, so at extraction the
  snapshot is the state at `len(prompt) - 1`: exactly the reuse limit of a resent or extended prompt.

`checkpoints()` of an extracted cache gives both (snapshot, final state) as (position, arrays).

Multi-token steps during decoding (vllm-mlx's MTP verify of [primary, draft]) are not a prefill:
once a row has taken a one-token step, no later step snapshots it. If such a step is undone by
assigning `state` (vllm-mlx's MTP reject restores the state it copied before the verify, then
re-feeds the primary), the positions go back with it, after checking that the assigned arrays
are the state from before that step. Any other assignment during decoding leaves the positions
unknown (`LOST`): no checkpoint of that state is given, and a cache whose every layer is a state
then reports a negative length, which the pool refuses to store.
"""

from __future__ import annotations

import logging
from typing import List, Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

Checkpoint = tuple  # (position, [arrays of shape (1, ...)])
LOST = -(1 << 40)  # a position no longer known; stays negative whatever is added to it

log = logging.getLogger("vllm_mlx_persist")


def _cat(a: Optional[mx.array], b: Optional[mx.array], na: int, nb: int) -> Optional[mx.array]:
    """Concatenate two per-row state arrays on axis 0; a missing side is zeros (mlx-lm's initial state)."""
    like = a if a is not None else b
    if like is None:
        return None
    a = a if a is not None else mx.zeros((na, *like.shape[1:]), like.dtype)
    b = b if b is not None else mx.zeros((nb, *like.shape[1:]), like.dtype)
    return mx.concatenate([a, b])


class StateCache(ArraysCache):
    """`ArraysCache` with per-row positions and a prefill-end snapshot (see module docstring)."""

    def __init__(self, size: int, left_padding: Optional[List[int]] = None):
        super().__init__(size, left_padding)
        self.pos: list[int] = [0] * (len(left_padding) if left_padding else 1)
        self.snap: list = [None] * size
        self.snap_pos: list[int] = list(self.pos)
        # per row: it took a one-token step (its prefill is over): a multi-token step is a verify
        self.decoding: list[bool] = [False] * len(self.pos)
        self._before: Optional[tuple] = None  # (state, pos) before the step being written
        self._undo: Optional[tuple] = None  # (state, pos) before the last step, if it was a verify

    @property
    def batch_size(self) -> int:
        return len(self.pos)

    def __setitem__(self, idx: int, value: mx.array) -> None:
        if getattr(self, "_before", 0) is None:  # a layer writes its new state, then calls advance()
            self._before = (list(self.cache), list(self.pos))
        self.cache[idx] = value

    def advance(self, N: int) -> None:
        if self.lengths is not None:
            inc = mx.clip(self.lengths, 0, N).tolist()
        elif self.left_padding is not None:
            inc = (N - mx.clip(self.left_padding, 0, N)).tolist()
        else:
            inc = [N] * len(self.pos)
        self._undo = self._before if N > 1 and any(self.decoding) else None
        self._before = None
        self.pos = [p + i for p, i in zip(self.pos, inc)]
        super().advance(N)
        if N == 1:
            self.decoding = [True] * len(self.pos)
        elif not any(self.decoding):  # a prefill chunk: remember where it left the state
            self.snap, self.snap_pos = list(self.cache), list(self.pos)
        elif not all(self.decoding):  # rows still prefilling beside decoding ones (not seen in mlx-lm)
            keep = [not d for d in self.decoding]
            self.snap = [_rows(keep, c, s) for c, s in zip(self.cache, self.snap)]
            self.snap_pos = [p if k else q for k, p, q in zip(keep, self.pos, self.snap_pos)]

    @property
    def state(self) -> list:
        return self.cache

    @state.setter
    def state(self, v: list) -> None:
        """Replace the state (mlx-lm's `from_state`, vllm-mlx's MTP reject); see the module docstring
        for what happens to the positions."""
        prev, self.cache = getattr(self, "cache", None), list(v)
        if not hasattr(self, "pos"):  # from_state on an instance built without __init__
            return
        undo, self._undo, self._before = getattr(self, "_undo", None), None, None
        if prev is not None and len(prev) == len(self.cache) and all(a is b for a, b in zip(prev, self.cache)):
            return  # the same arrays put back
        if undo is not None and _same_state(undo[0], self.cache):
            self.pos = list(undo[1])
            return
        log.warning("persist_q4: a recurrent state was replaced other than by undoing the last multi-token "
                    "decoding step; its position is unknown and it is not kept as a checkpoint")
        self.pos = [LOST] * len(self.pos)

    @classmethod
    def merge(cls, caches: List["StateCache"]) -> "StateCache":
        n, B = len(caches[0].cache), len(caches)
        out = cls(n)
        out.pos = [c.pos[0] for c in caches]
        for e in range(n):
            init = next((c.cache[e] for c in caches if c.cache[e] is not None), None)
            if init is None:
                continue
            rows = [c.cache[e] if c.cache[e] is not None else mx.zeros((1, *init.shape[1:]), init.dtype)
                    for c in caches]
            out.cache[e] = mx.concatenate(rows) if B > 1 else rows[0]
        # No left padding: a state has no time axis, and mlx-lm's ArraysCache.make_mask would let
        # a zero left padding mask override the right-padding `lengths` during prefill.
        out.snap, out.snap_pos = list(out.cache), list(out.pos)
        out.decoding = [False] * B  # merged caches are prompts about to be prefilled
        return out

    def filter(self, batch_indices) -> None:
        idx = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        sel = mx.array(idx, dtype=mx.int32)
        super().filter(sel)
        self.snap = [s[sel] if s is not None else None for s in self.snap]
        self.pos = [self.pos[i] for i in idx]
        self.snap_pos = [self.snap_pos[i] for i in idx]
        self.decoding = [self.decoding[i] for i in idx]
        self._before = self._undo = None

    def extend(self, other: "StateCache") -> None:
        na, nb = len(self.pos), len(other.pos)
        self.cache = [_cat(a, b, na, nb) for a, b in zip(self.cache, other.cache)]
        self.snap = [_cat(a, b, na, nb) for a, b in zip(self.snap, other.snap)]
        cat = lambda a, b, fill: _cat(a, b, na, nb) if (a is not None or b is not None) else None
        if self.lengths is not None or other.lengths is not None:
            self.lengths = cat(self.lengths, other.lengths, 0)
        if self.left_padding is not None or other.left_padding is not None:
            self.left_padding = cat(self.left_padding, other.left_padding, 0)
        self.pos += other.pos
        self.snap_pos += other.snap_pos
        self.decoding = self.decoding + other.decoding
        self._before = self._undo = None

    def extract(self, idx: int) -> "StateCache":
        out = StateCache(len(self.cache))
        out.cache = [c[idx : idx + 1] if c is not None else None for c in self.cache]
        out.pos = [self.pos[idx]]
        out.snap = [s[idx : idx + 1] if s is not None else None for s in self.snap]
        out.snap_pos = [self.snap_pos[idx]]
        out.decoding = [self.decoding[idx]]
        return out

    def checkpoints(self) -> list[Checkpoint]:
        """(position, state arrays) of a one-row cache: the prefill-end snapshot and the current state."""
        out, lost = [], self.pos[0] < 0  # LOST: the prefill snapshot is still good
        if 0 < self.snap_pos[0] and (lost or self.snap_pos[0] < self.pos[0]) and all(s is not None for s in self.snap):
            out.append((self.snap_pos[0], list(self.snap)))
        if self.pos[0] > 0 and all(c is not None for c in self.cache):
            out.append((self.pos[0], list(self.cache)))
        return out

    @classmethod
    def from_checkpoint(cls, pos: int, arrays: list) -> "StateCache":
        out = cls(len(arrays))
        out.cache = list(arrays)
        out.pos, out.snap, out.snap_pos = [pos], list(arrays), [pos]
        return out

    def empty(self) -> bool:
        return self.cache[0] is None


def _rows(keep: list[bool], new: Optional[mx.array], old: Optional[mx.array]) -> Optional[mx.array]:
    """`new`'s rows where `keep`, `old`'s elsewhere."""
    if new is None or old is None:
        return new if old is None else old
    mask = mx.array(keep).reshape(-1, *([1] * (new.ndim - 1)))
    return mx.where(mask, new, old)


def _same_state(a: list, b: list) -> bool:
    """Whether two state lists hold the same arrays (by value: a restore assigns copies)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x is None or y is None:
            if x is not y:
                return False
        elif x is not y and (x.shape != y.shape or not mx.array_equal(x, y).item()):
            return False
    return True
