"""How an attention layer stores its keys (issue #33): their bits and an optional fixed transform.

Outlier key channels (Qwen2-like models) cost 4-bit per-token groups most of their levels. The
served answers, per layer (`LayerKeys`):

* `bits=8` (`k8v4`): keys packed in 8 bits, values in the cache's bits (4): 1.4x the bytes of
  4-bit K and V (docs/quality.md has the capacity table).
* `transform="scaled"`: keys divided by calibrated per-channel scales before quantizing; queries are
  multiplied by them at attention time (q . k = (q * s) . (k / s)), so no dequantize step changes.
* `transform="hadamard"`: keys rotated by the orthonormal Hadamard matrix H of the head dimension
  before quantizing (an outlier is spread over every channel); queries are rotated by the same H at
  attention time (q . k = (q H) . (k H), H orthonormal). No extra bytes.

* `transform="centred"` (issue #43): keys minus a calibrated per-channel mean (`center`), divided by
  per-channel `scales` that balance the queries' and the keys' channel sizes, then rotated by H.
  Queries are multiplied by the scales and rotated: (q s) H . ((k - c) / s) H = q . k - q . c, the
  same shift of every score of a query, which softmax ignores (layers with attention sinks, whose
  extra logit does not shift, never get it: `key_calibration`). The mean is what 4-bit groups along
  a token cannot absorb: a channel's offset shared by every token.

* `scales16`: the packed keys' scales and biases stored in float16 where the model's float32 would
  double them (a 6-bit key of a 64-wide group: 7 bits with float32 scales, 6.5 with float16); read
  back widened, exactly. The centred formats use it: their keys are centred and rotated, so a 16-bit
  scale's relative error (5e-4) is far below a level.

* `values="hadamard"`: values rotated by H before quantizing (issue #43: on SmolLM2 the 4-bit
  values' loss, +0.87% with float keys, falls to about a quarter), the attention output rotated back
  (softmax(qK) (V H) H = softmax(qK) V). No extra bytes; values are read nowhere but in attention.

What a cache stores, its blocks and their float copies (mirror, carried floats) are the
*transformed* keys and values: attention reads them with transformed queries (`queries`) and gives
its output back through `output`; a splice that moves keys by RoPE undoes the key transform first
(`decode`), rotates, and redoes it (`encode`), and leaves the values as they are.

Owns nothing mutable but a memo of its scales per query head: a `LayerKeys` is immutable, built
once at start-up (the backend factory, after `key_calibration` chose the format), and shared by
every cache of its layer (`copy` and `deepcopy` return the object itself, so batches compare it by
identity). Any thread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
import numpy as np

# The `key_format` option's values. "auto": measured at load (key_calibration.choose).
KEY_FORMATS = ("auto", "q4", "k4v4r", "k5v4r", "k5v4c", "k56v4c", "k6v4c", "k8v4", "k8v4r", "scaled", "hadamard")
TRANSFORMS = (None, "scaled", "hadamard", "centred")
VALUE_TRANSFORMS = (None, "hadamard")


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Sylvester-Hadamard matrix of order n (a power of two)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two head dimension, got {n}")
    h = np.ones((1, 1), dtype=np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.float32(math.sqrt(n))


def _rotate(x: mx.array) -> mx.array:
    """`x @ hadamard(D)` along the last axis, float32: MLX's fast Walsh-Hadamard transform (the same
    Sylvester matrix, O(D log D) instead of a dense matmul). Its own inverse (the matrix is symmetric
    and orthonormal)."""
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two head dimension, got {n}")
    return mx.hadamard_transform(x.astype(mx.float32), scale=1.0 / math.sqrt(n))


@dataclass(frozen=True, eq=False)
class LayerKeys:
    """One layer's key storage: `bits` of the packed keys, and `transform` (None, "scaled",
    "hadamard" or "centred"); "scaled" and "centred" hold `scales`, (n_kv_heads, 1, head_dim)
    float32, the divisors; "centred" also `center`, the same shape, the mean taken out."""

    bits: int = 4
    transform: Optional[str] = None
    scales: Optional[mx.array] = field(default=None, repr=False)
    values: Optional[str] = None  # None or "hadamard": how the layer's values are stored
    center: Optional[mx.array] = field(default=None, repr=False)
    scales16: bool = False  # the packed keys' scales and biases kept in float16 (of a float32 model)
    # `scales` repeated for each query head, by queries per KV head: made at the first use, the same
    # values whoever makes them (one fewer op per layer and step than broadcasting them per call)
    _query_scales: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.transform not in TRANSFORMS:
            raise ValueError(f"key transform must be one of {TRANSFORMS}, got {self.transform!r}")
        if (self.transform in ("scaled", "centred")) != (self.scales is not None):
            raise ValueError("a scaled or centred key format needs its scales, and only they")
        if (self.transform == "centred") != (self.center is not None):
            raise ValueError("a centred key format needs its center, and only it")
        if self.center is not None and self.center.shape != self.scales.shape:
            raise ValueError(f"center {self.center.shape} and scales {self.scales.shape} differ in shape")
        if self.values not in VALUE_TRANSFORMS:
            raise ValueError(f"value transform must be one of {VALUE_TRANSFORMS}, got {self.values!r}")

    def __copy__(self) -> "LayerKeys":
        return self

    def __deepcopy__(self, memo: dict) -> "LayerKeys":
        return self

    @property
    def name(self) -> str:
        """Short tag: "k4", "k8", "k4 scaled", "k4 hadamard", "k8 v-hadamard"."""
        return f"k{self.bits}" + (f" {self.transform}" if self.transform else "") + \
            (f" v-{self.values}" if self.values else "") + (" s16" if self.scales16 else "")

    def same(self, other: Optional["LayerKeys"]) -> bool:
        """Whether caches under `self` and `other` store keys and values alike (they may batch together)."""
        return other is self or (other is not None and self.transform is None and other.transform is None
                                 and other.bits == self.bits and other.values == self.values
                                 and other.scales16 == self.scales16)

    def encode(self, keys: mx.array) -> mx.array:
        """Keys (B, n_kv_heads, T, D) as stored (before quantizing), in their dtype."""
        if self.transform is None:
            return keys
        if self.transform == "scaled":
            return (keys.astype(mx.float32) / self.scales).astype(keys.dtype)
        if self.transform == "centred":
            return _rotate((keys.astype(mx.float32) - self.center) / self.scales).astype(keys.dtype)
        return _rotate(keys).astype(keys.dtype)

    def decode(self, keys: mx.array) -> mx.array:
        """Stored (dequantized) keys back to the model's keys: `encode` undone, float32."""
        keys = keys.astype(mx.float32)
        if self.transform is None:
            return keys
        if self.transform == "scaled":
            return keys * self.scales
        if self.transform == "centred":
            return _rotate(keys) * self.scales + self.center
        return _rotate(keys)

    def queries(self, queries: mx.array) -> mx.array:
        """Queries (B, n_q_heads, L, D) that attend on the stored keys as the originals did on the
        model's keys; the identity without a transform."""
        if self.transform is None:
            return queries
        if self.transform == "hadamard":
            return _rotate(queries).astype(queries.dtype)
        n_rep = queries.shape[1] // self.scales.shape[0]
        s = self._query_scales.get(n_rep)
        if s is None:
            s = self._query_scales[n_rep] = mx.repeat(self.scales, n_rep, axis=0)  # (n_q_heads, 1, D)
        q = queries.astype(mx.float32) * s
        return (_rotate(q) if self.transform == "centred" else q).astype(queries.dtype)

    def encode_values(self, values: mx.array) -> mx.array:
        """Values (B, n_kv_heads, T, D) as stored (before quantizing), in their dtype."""
        return values if self.values is None else _rotate(values).astype(values.dtype)

    def output(self, out: mx.array) -> mx.array:
        """Attention output over the stored values back to the model's: `encode_values` undone along
        the last axis (the rotation is its own inverse)."""
        return out if self.values is None else _rotate(out).astype(out.dtype)

    def digest(self) -> str:
        """What model identity records of it: the tag, and for scales (and a center) a hash of their
        bytes (blocks written under other scales are another format)."""
        if self.scales is None:
            return self.name
        import hashlib

        h = hashlib.sha256(np.array(self.scales).tobytes())
        if self.center is not None:
            h.update(np.array(self.center).tobytes())
        return f"{self.name} {h.hexdigest()[:16]}"


PLAIN4 = LayerKeys(4)


def key_bits(cache) -> int:
    """The bits of a 4-bit cache's keys (its own `bits` unless its `key_format` says otherwise)."""
    fmt = getattr(cache, "key_format", None)
    return cache.bits if fmt is None else fmt.bits


def transformed(cache) -> Optional[LayerKeys]:
    """The cache's key format when it transforms keys (queries must follow) or values (the output
    must be rotated back), else None."""
    fmt = getattr(cache, "key_format", None)
    return fmt if fmt is not None and (fmt.transform is not None or fmt.values is not None) else None


def balance_scales(keys: mx.array, query_rms: mx.array, center: mx.array) -> mx.array:
    """A centred format's scales from calibration keys (n_kv_heads, T, D, after RoPE), the RMS of the
    queries per channel over each KV head's query heads (n_kv_heads, D) and the keys' `center`
    (n_kv_heads, 1, D; `key_calibration.rope_center`): divisors s with s^2 = rms(k - center) / rms(q),
    geometric mean 1 per head, (n_kv_heads, 1, D) float32.
    Those scales minimise (sum q_i^2 s_i^2)(sum k_i^2 / s_i^2), the score error of keys quantized
    after an orthonormal rotation, whose error is spread evenly over the channels: key channels the
    queries barely read get fewer levels."""
    krms = mx.sqrt(mx.mean((keys.astype(mx.float32) - center.astype(mx.float32)) ** 2, axis=1, keepdims=True))
    ratio = mx.maximum(krms, 1e-6) / mx.maximum(query_rms.astype(mx.float32)[:, None, :], 1e-6)
    s = mx.sqrt(ratio)
    return s / mx.exp(mx.mean(mx.log(s), axis=-1, keepdims=True))


def channel_scales(keys: mx.array) -> mx.array:
    """Per-channel key scales from calibration keys (n_kv_heads, T, D), as the cache holds them
    (after RoPE): each channel's RMS over the tokens, normalised to mean 1 per head and floored at
    1e-3; (n_kv_heads, 1, D) float32 (what tools/quality/kv_formats.py simulates)."""
    k = keys.astype(mx.float32)
    rms = mx.sqrt(mx.mean(k * k, axis=1))  # (H, D)
    s = rms / mx.maximum(mx.mean(rms, axis=-1, keepdims=True), 1e-12)
    return mx.maximum(s, 1e-3)[:, None, :]
