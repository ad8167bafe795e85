"""When attention on 4-bit K/V runs on float copies, and the budgets those copies live in.

mlx's CPU kernels for quantized matmuls are several times slower than the float SDPA, so on the CPU
the 4-bit caches (`caches.q4`) attend on exact float copies of their K/V, `dequantize(packed)`:
4-bit numerics, float speed. Storage, blocks and disk stay 4-bit. A `FloatCopies` owns the policy
and the bookkeeping of those copies, not the copies themselves (each cache holds its own):

* the prefill attention mode (`set_prefill_attention`, `dequantize_for`): whether a chunk of many
  queries attends on a transient dequantized copy;
* the budget of the batch caches' float *decode mirrors* (`set_decode_float_budget`) and the
  registry of live mirrors it is counted over (`track_mirror`, `decode_float_bytes`);
* the budget of the float copies carried from one turn to the agent's next (`carry_floats`,
  `CarriedFloats`, `set_carry_float_budget`), least recently used first out.

Who owns one: the backend builds one from its options (`PersistQ4Backend.float_copies`) and hands
it to its `caches.ModelCodec`, which gives it to every cache it makes; a batch cache takes its rows'
(`BatchQ4KVCache.merge`) and keeps it through extend/filter/extract. A codec built without one
makes its own (`FloatCopies()`, the defaults); a cache built with none (mlx-lm's `from_state`,
tools, quality simulations) uses `DEFAULT`, whose settings are the defaults and cannot be changed.
Tests build their own. Nothing here is module-level mutable state but `DEFAULT`'s bookkeeping.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Optional

import mlx.core as mx

# mlx's CPU `quantized_matmul` has no BLAS path: its cost grows linearly with the number of query
# rows, so a 2048-token prefill chunk over 4k cached tokens takes ~5x as long as the fast SDPA on the
# dequantized K/V (measured in docs/design.md). From this many queries per step on, dequantizing the
# layer's K/V (a temporary freed right after the op; the cache itself stays quantized) is cheaper.
DEQUANT_MIN_QUERIES = 4
# Prefill chunks shorter than this build the float mirror (see BatchQ4KVCache.update_and_fetch);
# vllm-mlx's prefill chunks are 2048 tokens, so only a prompt's last chunk or a short one does.
MIRROR_PREFILL_MAX_QUERIES = 512
PREFILL_ATTENTION_MODES = ("auto", "quantized", "dequantized")

# ---- float decode mirrors ------------------------------------------------------------------------
#
# mlx's CPU `quantized_matmul(transpose=True)` costs ~3x a float matmul of the same shape (see
# docs/performance.md), so on the CPU a batch cache in prefill or decode keeps beside its 4-bit K/V a float
# copy holding exactly `dequantize(packed)` (every token, each new token included) and
# attention runs on that copy with mx.fast.scaled_dot_product_attention: 4-bit KV numerics, float
# speed. Storage, blocks, disk and everything `extract` returns stay 4-bit.
#
# Accounting rule: a mirror's bytes count against its `FloatCopies`' budget for exactly as long as
# the BatchQ4KVCache holding it is alive and keeps it. Each operation that creates, grows, shrinks
# (filter), moves (extend) or drops a mirror checks the budget explicitly before allocating; the
# bytes in use are the sum over the live mirrors, kept in a WeakSet, so a batch cache that mlx-lm
# simply lets go of (it clears its cache list when the last sequence finishes) releases its share
# when it is freed, without a __del__. A mirror that would not fit is dropped (or never built) and
# that cache decodes on the 4-bit matmuls as before; never an error.
DECODE_FLOAT_AUTO_MB = 1024  # "auto" on a CPU; 0 (off) on a GPU, where quantized attention is fast

# ---- float copies carried between turns ----------------------------------------------------------
#
# A returning agent's turn used to dequantize its whole history, every layer, for its first prefill
# chunk (the mirror build above): on the CPU that cost more than the two float copies vllm-mlx's
# default cache makes of the same history (docs/performance.md, "A hot turn of a long agent"). The
# mirror a turn ends with already holds those values, so the pool keeps it, as views, beside the
# turn's 4-bit blocks (`CarriedFloats`, held by the committed run), and the agent's next turn starts
# its batch mirror from it. Exactly `dequantize(packed)`: hot and reloaded turns attend on the same
# values. Bounded by a budget of its own; least recently used copies go first, and a copy lives no
# longer than the run of hot blocks that holds it.
CARRY_FLOAT_AUTO_MB = 1024  # "auto" on a CPU; 0 (off) on a GPU, like the decode mirror


def _checked_mb(option: str, mb: Any) -> Any:
    """`mb` if it is "auto" or a number of MB >= 0, else ValueError naming the option."""
    if mb != "auto" and (isinstance(mb, bool) or not isinstance(mb, (int, float)) or not mb >= 0):
        raise ValueError(f"{option} must be \"auto\" or a number >= 0; got {mb!r}")
    return mb


def _checked_mode(mode: str) -> str:
    if mode not in PREFILL_ATTENTION_MODES:
        raise ValueError(f"prefill_attention must be one of {PREFILL_ATTENTION_MODES}; got {mode!r}")
    return mode


def _budget_bytes(mb: Any, auto_mb: int) -> int:
    """A budget of `mb` MB in bytes; "auto": `auto_mb` when MLX's default device is the CPU, else 0."""
    if mb == "auto":
        mb = auto_mb if mx.default_device().type == mx.DeviceType.cpu else 0
    return int(mb * 2**20)


class FloatCopies:
    """The settings and bookkeeping of the float copies one set of 4-bit caches attends on: the
    prefill attention mode, the decode-mirror budget and its registry of live mirrors, the carried
    floats' budget and the copies kept under it, and their counters (for get_stats).

    Owned by whoever builds it (the backend, from its options; a codec for itself; a test); held by
    every cache built under it, which checks its budgets and registers its mirror here. Never
    copied: `copy.deepcopy` of a cache shares it.

    Threads: the settings are written by the owner before the caches use them (the backend factory
    at start-up; a test between steps); the worker builds, grows and drops mirrors and carried
    copies; `get_stats` on the HTTP thread reads the byte counts and counters. The mirror registry
    and the carried copies are under their own locks; the counters are plain ints (stats).
    """

    def __init__(self, prefill_attention: str = "auto", decode_float_mb: Any = "auto",
                 carry_float_mb: Any = "auto", *, fixed: bool = False):
        """Settings as the backend options of the same names; `fixed`: the setters refuse (`DEFAULT`)."""
        self.prefill_attention = _checked_mode(prefill_attention)
        self.decode_float_mb = _checked_mb("decode_float_mb", decode_float_mb)
        self.carry_float_mb = _checked_mb("carry_float_mb", carry_float_mb)
        self._fixed = fixed
        self._mirrors: "weakref.WeakSet[Any]" = weakref.WeakSet()  # the BatchQ4KVCaches holding a mirror
        self._mirrors_lock = threading.Lock()  # get_stats reads the set from the HTTP thread
        # Mirrors built (by dequantizing), started from carried floats (no dequantization; see
        # CarriedFloats), and not built or dropped because the budget was full.
        self.mirror_counts = {"builds": 0, "carried": 0, "refused": 0}
        self._carried: "weakref.WeakValueDictionary[int, CarriedFloats]" = weakref.WeakValueDictionary()
        self._carry_lock = threading.Lock()
        self._carry_clock = 0
        # Copies kept, used by a lookup, dropped for a newer one, and not kept because they did not fit.
        self.carry_counts = {"kept": 0, "used": 0, "evicted": 0, "refused": 0}

    def __copy__(self) -> "FloatCopies":
        return self  # an owner of budgets: a copied cache counts against the same ones

    def __deepcopy__(self, memo: dict) -> "FloatCopies":
        return self

    def __repr__(self) -> str:
        return (f"FloatCopies(prefill_attention={self.prefill_attention!r}, decode_float_mb="
                f"{self.decode_float_mb!r}, carry_float_mb={self.carry_float_mb!r})")

    def _writable(self) -> None:
        if self._fixed:
            raise RuntimeError("floats.DEFAULT's settings are fixed: build a FloatCopies with the ones "
                               "you need and hand it to the caches (ModelCodec(float_copies=...))")

    # ---- prefill attention ----

    def set_prefill_attention(self, mode: str) -> None:
        """How attention reads 4-bit K/V for chunks of >= DEQUANT_MIN_QUERIES queries.

        "quantized": always mlx's quantized matmuls. "dequantized": dequantize the layer's K/V for the
        op, then the fast SDPA. "auto" (default): dequantized on the CPU, quantized on a GPU. Decode
        steps (fewer queries) always use the quantized matmuls.
        """
        self._writable()
        self.prefill_attention = _checked_mode(mode)

    def dequantize_for(self, n_queries: int) -> bool:
        """Whether attention for a chunk of `n_queries` queries runs on dequantized K/V (the mode above)."""
        mode = self.prefill_attention
        if n_queries < DEQUANT_MIN_QUERIES or mode == "quantized":
            return False
        return mode == "dequantized" or mx.default_device().type == mx.DeviceType.cpu

    # ---- float decode mirrors ----

    def set_decode_float_budget(self, mb: Any) -> None:
        """Budget for the float decode mirrors, in MB: a number >= 0 (0: off) or "auto"
        (DECODE_FLOAT_AUTO_MB when MLX's default device is the CPU, else 0). Existing mirrors are
        kept; the budget applies to the next build or growth."""
        self._writable()
        self.decode_float_mb = _checked_mb("decode_float_mb", mb)

    def decode_float_budget_bytes(self) -> int:
        """The decode-mirror budget on the current default device."""
        return _budget_bytes(self.decode_float_mb, DECODE_FLOAT_AUTO_MB)

    def track_mirror(self, cache: Any, held: bool) -> None:
        """Count `cache`'s mirror (its `mirror_nbytes`) against the budget while `held`, until it is
        freed: the registry holds it weakly, so a cache mlx-lm lets go of gives its share back."""
        with self._mirrors_lock:
            if held:
                self._mirrors.add(cache)
            else:
                self._mirrors.discard(cache)

    def decode_float_bytes(self) -> int:
        """Bytes held by the float decode mirrors of the live batch caches under this object."""
        with self._mirrors_lock:
            caches = list(self._mirrors)
        return sum(c.mirror_nbytes for c in caches)

    # ---- float copies carried between turns ----

    def set_carry_float_budget(self, mb: Any) -> None:
        """Budget for the float copies carried between turns, in MB: a number >= 0 (0: off) or
        "auto" (CARRY_FLOAT_AUTO_MB when MLX's default device is the CPU, else 0). Applies to the
        next copy kept; a smaller budget drops the least recently used copies then."""
        self._writable()
        self.carry_float_mb = _checked_mb("carry_float_mb", mb)

    def carry_float_budget_bytes(self) -> int:
        """The carried floats' budget on the current default device."""
        return _budget_bytes(self.carry_float_mb, CARRY_FLOAT_AUTO_MB)

    def carry_float_bytes(self) -> int:
        """Bytes of the carried float copies under this object that are alive."""
        with self._carry_lock:
            return sum(c.nbytes for c in self._carried.values())

    def carry_floats(self, layers: dict[int, tuple[mx.array, mx.array]], n: int) -> Optional["CarriedFloats"]:
        """Keep float copies of a stored turn's first n positions within the budget, dropping the
        least recently used others to make room; None when they cannot fit (or there are none)."""
        if not layers:
            return None
        layers = {l: (k[..., :n, :], v[..., :n, :]) for l, (k, v) in layers.items()}
        carried = CarriedFloats(layers, n, self)
        budget = self.carry_float_budget_bytes()
        with self._carry_lock:
            if carried.nbytes > budget:
                self.carry_counts["refused"] += 1
                return None
            live = sorted(self._carried.values(), key=lambda c: c.used)
            used = sum(c.nbytes for c in live)
            for old in live:
                if used + carried.nbytes <= budget:
                    break
                used -= old.nbytes
                old.layers = None
                self._carried.pop(id(old), None)
                self.carry_counts["evicted"] += 1
            self._carry_clock += 1
            carried.used = self._carry_clock
            self._carried[id(carried)] = carried
            self.carry_counts["kept"] += 1
        return carried

    def _take(self, carried: "CarriedFloats", n: int) -> Optional[dict[int, tuple[mx.array, mx.array]]]:
        """`CarriedFloats.take`, under the lock that eviction takes."""
        with self._carry_lock:
            layers = carried.layers
            if layers is None or n > carried.n:
                return None
            self._carry_clock += 1
            carried.used = self._carry_clock
            self.carry_counts["used"] += 1
        return {l: (k[..., :n, :], v[..., :n, :]) for l, (k, v) in layers.items()}


class CarriedFloats:
    """Per 4-bit layer, float (keys, values) of a stored turn's positions [0, n): exactly the
    dequantized values of its 4-bit K/V (the turn's float mirror, as views). Kept by whoever holds
    the turn's 4-bit arrays (the pool's committed run), counted by the `FloatCopies` that kept it
    (`carry_floats`); `take` gives them to the next turn's caches. Dropped when evicted for a newer
    copy or when its holder goes."""

    def __init__(self, layers: dict[int, tuple[mx.array, mx.array]], n: int, owner: FloatCopies):
        self.layers: Optional[dict[int, tuple[mx.array, mx.array]]] = layers
        self.n = n
        self.nbytes = sum(k.nbytes + v.nbytes for k, v in layers.values())
        self.used = 0
        self.owner = owner

    def take(self, n: int) -> Optional[dict[int, tuple[mx.array, mx.array]]]:
        """Views of positions [0, n) per layer (n <= self.n), or None once evicted."""
        return self.owner._take(self, n)


# For caches built with no FloatCopies (mlx-lm's `from_state`, tools, simulations): the defaults, fixed.
DEFAULT = FloatCopies(fixed=True)
