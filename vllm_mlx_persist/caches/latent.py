"""MLA latents packed in 8 or 4 bits in blocks (hot tier and disk): an option of `ModelCodec`
(`latent_bits`, issue #24 item 5). Off by default.

Multi-head latent attention multiplies the cached latent and rope key directly, never through a
quantized op, so the live cache stays mlx-lm's `KVCache` in the model's dtype: it is the per-turn
float mirror, rebuilt by dequantizing the stored blocks when a turn starts (`ModelCodec.build`).
Only blocks are packed (`ModelCodec.token_arrays` / `slice`), so the turn's own tokens are float
while it runs and quantized once it is committed; decode runs at the float cache's speed.

The quantizer is plain min-max affine per token and group of the last axis: codes in [0, 2^bits - 1],
scale (max - min) / (2^bits - 1) and bias = min in float32. Not `mx.quantize`: a commit packs the
whole live cache again (`token_arrays`), tokens reloaded from blocks included, so the quantizer must
give back the same codes for values it dequantized itself, and `mx.quantize` does not (its zero-point
adjustment moves a re-quantized 4-bit value by up to a step). Min-max does, because the group's
minimum and maximum are grid points. Codes are uint8 (4-bit: two per byte, low nibble first), so a
token is packed on its own and blocks slice and concatenate along the token axis as before.
"""

from __future__ import annotations

import mlx.core as mx

LATENT_BITS = (4, 8)
LATENT_GROUP_SIZE = 64


def latent_group(dim: int) -> int:
    """The group size for a latent part of `dim` channels: 64, else 32 when 64 does not divide it,
    else the whole dimension."""
    for g in (LATENT_GROUP_SIZE, 32):
        if dim % g == 0:
            return g
    return dim


def quantize_latent(x: mx.array, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """(codes uint8, scales float32, biases float32) of `x` (..., D): codes (..., D) for 8 bits,
    (..., D / 2) for 4 bits; scales and biases (..., D / group)."""
    if bits not in LATENT_BITS:
        raise ValueError(f"latent bits must be one of {LATENT_BITS}, got {bits}")
    D = x.shape[-1]
    if bits == 4 and D % 2:
        raise ValueError(f"4-bit latents need an even dimension, got {D}")
    g = latent_group(D)
    xg = x.astype(mx.float32).reshape(*x.shape[:-1], D // g, g)
    lo = xg.min(axis=-1, keepdims=True)
    hi = xg.max(axis=-1, keepdims=True)
    levels = (1 << bits) - 1
    scale = (hi - lo) / levels
    safe = mx.where(scale > 0, scale, mx.ones_like(scale))
    q = mx.clip(mx.round((xg - lo) / safe), 0, levels).astype(mx.uint8).reshape(x.shape)
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    return q, scale[..., 0], lo[..., 0]


def dequantize_latent(codes: mx.array, scales: mx.array, biases: mx.array, bits: int,
                      dtype: mx.Dtype = mx.float32) -> mx.array:
    """The values `quantize_latent` packed, in `dtype`."""
    if bits == 4:
        lo, hi = codes & 0x0F, codes >> 4
        codes = mx.stack([lo, hi], axis=-1).reshape(*codes.shape[:-1], codes.shape[-1] * 2)
    D = codes.shape[-1]
    g = D // scales.shape[-1]
    q = codes.astype(mx.float32).reshape(*codes.shape[:-1], D // g, g)
    x = q * scales[..., None] + biases[..., None]
    return x.reshape(codes.shape).astype(dtype)


def latent_nbytes_per_element(bits: int, dim: int) -> float:
    """Stored bytes per latent element: the codes plus a float32 scale and bias per group."""
    return bits / 8 + 8 / latent_group(dim)
