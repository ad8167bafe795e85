"""When attention on 4-bit K/V runs on float copies, and the process-wide budgets those copies live in.

mlx's CPU kernels for quantized matmuls are several times slower than the float SDPA, so on the CPU
the 4-bit caches (`caches.q4`) attend on exact float copies of their K/V, `dequantize(packed)`:
4-bit numerics, float speed. Storage, blocks and disk stay 4-bit. This module owns the policy and
the bookkeeping of those copies, not the copies themselves (each cache holds its own):

* the prefill attention mode (`set_prefill_attention`, `dequantize_for`): whether a chunk of many
  queries attends on a transient dequantized copy;
* the budget of the batch caches' float *decode mirrors* (`set_decode_float_budget`) and the
  registry of live mirrors it is counted over (`track_mirror`, `decode_float_bytes`);
* the budget of the float copies carried from one turn to the agent's next (`CarriedFloats`,
  `carry_floats`, `set_carry_float_budget`), least recently used first out.

Threads: the settings are written at start-up (the backend factory); the worker builds, grows and
drops mirrors and carried copies; `get_stats` on the HTTP thread reads the byte counts. The mirror
registry and the carried copies are under their own locks; the counters are plain ints (stats).
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


def dequantize_for(n_queries: int) -> bool:
    """Whether attention for a chunk of `n_queries` queries runs on dequantized K/V (the mode above)."""
    if n_queries < DEQUANT_MIN_QUERIES or _prefill_attention == "quantized":
        return False
    return _prefill_attention == "dequantized" or mx.default_device().type == mx.DeviceType.cpu


# ---- float decode mirrors ------------------------------------------------------------------------
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
_MIRRORS: "weakref.WeakSet[Any]" = weakref.WeakSet()  # the BatchQ4KVCaches holding a mirror
_MIRRORS_LOCK = threading.Lock()  # get_stats reads the set from the HTTP thread
# Mirrors built (by dequantizing), started from carried floats (no dequantization; see
# CarriedFloats), and not built or dropped because the budget was full (for get_stats).
MIRROR_COUNTS = {"builds": 0, "carried": 0, "refused": 0}


def _checked_mb(option: str, mb: Any) -> Any:
    """`mb` if it is "auto" or a number of MB >= 0, else ValueError naming the option."""
    if mb != "auto" and (isinstance(mb, bool) or not isinstance(mb, (int, float)) or not mb >= 0):
        raise ValueError(f"{option} must be \"auto\" or a number >= 0; got {mb!r}")
    return mb


def _budget_bytes(mb: Any, auto_mb: int) -> int:
    """A budget of `mb` MB in bytes; "auto": `auto_mb` when MLX's default device is the CPU, else 0."""
    if mb == "auto":
        mb = auto_mb if mx.default_device().type == mx.DeviceType.cpu else 0
    return int(mb * 2**20)


def set_decode_float_budget(mb: Any) -> None:
    """Process-wide budget for float decode mirrors, in MB: a number >= 0 (0: off) or "auto"
    (DECODE_FLOAT_AUTO_MB when MLX's default device is the CPU, else 0). Existing mirrors are kept;
    the budget applies to the next build or growth."""
    global _decode_float_mb
    _decode_float_mb = _checked_mb("decode_float_mb", mb)


def decode_float_budget_bytes() -> int:
    """The budget `set_decode_float_budget` resolves to on the current default device."""
    return _budget_bytes(_decode_float_mb, DECODE_FLOAT_AUTO_MB)


def track_mirror(cache: Any, held: bool) -> None:
    """Count `cache`'s mirror (its `mirror_nbytes`) against the budget while `held`, until it is
    freed: the registry holds it weakly, so a cache mlx-lm lets go of gives its share back."""
    with _MIRRORS_LOCK:
        if held:
            _MIRRORS.add(cache)
        else:
            _MIRRORS.discard(cache)


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
    _carry_float_mb = _checked_mb("carry_float_mb", mb)


def carry_float_budget_bytes() -> int:
    """The budget `set_carry_float_budget` resolves to on the current default device."""
    return _budget_bytes(_carry_float_mb, CARRY_FLOAT_AUTO_MB)


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
