"""Float values of the 4-bit caches' packed components, exactly `mx.dequantize`'s (`dequantize`),
unpacked with a few byte ops on the CPU; `widened`: 16-bit key scales in the values' dtype.

Read by the batch cache's float decode mirror (`caches.mirror`) and the dispatch fix
(`caches.attention`). Worker thread only (MLX work).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .packed import QTuple

# Bits whose packed words split into whole bytes: `dequantize` unpacks them with a few byte ops
# (the shifts of each level within its byte).
_BYTE_SHIFTS = {2: (0, 2, 4, 6), 4: (0, 4), 8: None}
# Bits whose eight levels fill `bits` bytes (3, 5, 6: the bit stream, lowest bits first, crosses
# bytes): the bytes joined into one 64-bit word, then each level shifted out of it.
_STREAM_BITS = (3, 5, 6)
_shift_arrays: dict = {}
_exact: dict = {}  # (bits, group_size, dtype) -> whether the unpacking below equals mx.dequantize (CPU)


def _unpack(w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> mx.array:
    """`mx.dequantize` for 2, 3, 4, 5, 6 and 8 bits in a handful of ops: the uint32 words viewed as bytes
    (little-endian, the lowest bits first, as mx.quantize packs them), each byte shifted into its
    levels, then `levels * scales + biases` in the scales' dtype, the arithmetic of mx.dequantize's
    CPU fallback, which builds the levels with about 50 ops for 4 bits: on a decode step's one new
    token per layer those ops, not the data, were the cost."""
    *lead, P = w.shape
    D = P * 32 // bits
    levels = w.view(mx.uint8)
    if bits in _STREAM_BITS:
        shifts = _shift_arrays.get(bits)
        if shifts is None:
            shifts = _shift_arrays[bits] = (mx.array([8 * i for i in range(bits)], dtype=mx.uint64),
                                            mx.array([bits * j for j in range(8)], dtype=mx.uint64))
        words = (levels.reshape(*lead, D // 8, bits).astype(mx.uint64) << shifts[0]).sum(axis=-1)
        levels = (words[..., None] >> shifts[1]) & ((1 << bits) - 1)
    elif _BYTE_SHIFTS[bits] is not None:
        shifts = _shift_arrays.get(bits)
        if shifts is None:
            shifts = _shift_arrays[bits] = mx.array(_BYTE_SHIFTS[bits], dtype=mx.uint8)
        levels = (levels[..., None] >> shifts) & ((1 << bits) - 1)
    groups = D // group_size
    if groups == 1:  # one group per row (head_dim == group_size): scales broadcast as they are
        return levels.reshape(*lead, D).astype(scales.dtype) * scales + biases
    levels = levels.reshape(*lead, groups, group_size).astype(scales.dtype)
    return (levels * scales[..., None] + biases[..., None]).reshape(*lead, D)


def _unpack_exact(bits: int, group_size: int, dtype) -> bool:
    """Whether `_unpack` gives mx.dequantize's values bit for bit on the CPU, for this format
    and scales dtype: checked once on values spread over every level of several groups."""
    key = (bits, group_size, dtype)
    ok = _exact.get(key)
    if ok is None:
        x = (mx.sin(mx.arange(4 * 3 * 2 * group_size, dtype=mx.float32) * 0.37) * 5
             + mx.arange(4 * 3 * 2 * group_size) % 7).reshape(4, 3, 2 * group_size).astype(dtype)
        q = mx.quantize(x, group_size=group_size, bits=bits)
        a, u = mx.dequantize(*q, group_size=group_size, bits=bits), _unpack(*q, group_size, bits)
        raw = mx.uint32 if dtype.size == 4 else mx.uint16
        ok = a.dtype == u.dtype and a.shape == u.shape and bool(mx.array_equal(a.view(raw), u.view(raw)).item())
        _exact[key] = ok
    return ok


def dequantize(q: QTuple, group_size: int, bits: int) -> mx.array:
    """Float values of packed (uint32, scales, biases) components, exactly `mx.dequantize`'s. On the
    CPU, 2- to 8-bit components are unpacked with a few byte ops (`_unpack`, checked bit for
    bit against mx.dequantize once per format); a decode step dequantizes each layer's new token, so
    mx.dequantize's op count showed in every step. Elsewhere (a GPU's kernel), mx.dequantize."""
    w, scales, biases = q
    if ((bits in _BYTE_SHIFTS or bits in _STREAM_BITS) and w.shape[-1] * 32 // bits % group_size == 0
            and mx.default_device().type == mx.DeviceType.cpu
            and _unpack_exact(bits, group_size, scales.dtype)):
        return _unpack(w, scales, biases, group_size, bits)
    return mx.dequantize(w, scales, biases, group_size=group_size, bits=bits)


def widened(q: QTuple, like: Optional[QTuple]) -> QTuple:
    """Packed keys whose scales and biases are kept in 16 bits (`LayerKeys.scales16`) with them in
    the dtype of `like`'s (the values'), exactly; anything else as it is."""
    if like is None or q[1].dtype == like[1].dtype:
        return q
    return (q[0], q[1].astype(like[1].dtype), q[2].astype(like[1].dtype))
