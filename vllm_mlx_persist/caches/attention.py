"""The attention-dispatch fix: mlx-lm's quantized SDPA and its dispatcher, replaced at runtime.

Models pick mlx-lm's quantized attention path by duck typing (`hasattr(cache, "bits")`), which has
a mask-broadcasting bug under grouped-query attention with a batched mask and takes no attention
sinks; `install_attention_fix` replaces it with ours (see patches/README.md). Its dispatcher also,
on the CPU, runs chunks of many queries (prefill) through the fast SDPA on a transient dequantized
copy of the layer's K/V, as the cache's `FloatCopies` says (`float_copies.dequantize_for`, the
prefill attention mode). Attention on a `BatchQ4KVCache` runs row by row on each row's own keys
(`batch_attention`), on its float decode mirror when it has one, so a sequence's logits are
bit-identical alone and batched, whatever its companions.

Owns nothing but the functions it installs into mlx-lm's modules (module globals there, rebound once
at start-up, after the model is loaded, by the backend factory) and the query observer calibration
sets for one float pass; they run on the worker thread.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import mlx.core as mx
from mlx_lm.models import base as _mlx_base

from .dequant import dequantize, widened
from .floats import DEFAULT, DEQUANT_MIN_QUERIES
from .key_formats import key_bits, transformed
from .packed import QTuple
from .q4 import BatchQ4KVCache


# Set only while `observing_queries` runs (key calibration's float pass, on the worker thread).
_query_observer: Optional[Callable[[Any, mx.array, Any], None]] = None


@contextmanager
def observing_queries(callback: Callable[[Any, mx.array, Any], None]) -> Iterator[None]:
    """Within: every attention call through the installed dispatcher first passes (cache, queries,
    sinks) to `callback` (how `key_calibration` learns the queries' channel sizes, and which layers
    have attention sinks)."""
    global _query_observer
    _query_observer = callback
    try:
        yield
    finally:
        _query_observer = None


def _gqa_mask(mask: Any, B: int, n_kv: int, n_rep: int) -> Any:
    """A mask for (B, n_kv, n_rep, L, T) scores, from mlx-lm's (L, T) or 4-D (B|1, 1|n_q, L, T)."""
    if not isinstance(mask, mx.array) or mask.ndim != 4:
        return mask
    if mask.shape[1] == 1:
        return mx.expand_dims(mask, -3)
    return mask.reshape(mask.shape[0], n_kv, n_rep, *mask.shape[2:])


def _sdpa_with_sinks(queries, q_keys, q_values, scale, mask, sinks, group_size, bits, key_bits=None):
    """mlx-lm's quantized SDPA with the GQA mask broadcast right (batched and per-head masks) and
    optional attention sinks: one extra logit per query head that joins the softmax and contributes
    no value (what mx.fast.scaled_dot_product_attention does with sinks).

    Grouped-query attention without broadcasting the packed K/V: the n_rep query heads of a KV head
    become n_rep * L rows of one quantized matmul against that head's K/V (mlx-lm expands the K/V to
    5-D instead, which mlx's CPU kernels handle 10-25% slower; same arithmetic, same result).
    `key_bits`: the keys' bits when they differ from the values' (`caches.key_formats`)."""
    B, n_q, L, D = queries.shape
    n_kv = q_keys[0].shape[-3]
    n_rep = n_q // n_kv
    queries = (queries * scale).reshape(B, n_kv, n_rep * L, D)
    scores = mx.quantized_matmul(queries, *q_keys, transpose=True, group_size=group_size,
                                 bits=bits if key_bits is None else key_bits)
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
    """mlx-lm's quantized SDPA, replaced: always ours, not mlx-lm's: it takes sinks and per-head
    masks (mlx-lm 0.32 still mis-broadcasts those), fixes 0.31's batched GQA mask, and is faster on
    the CPU. Whether a chunk runs on dequantized K/V instead is the dispatcher's call (it has the cache)."""

    def quantized_scaled_dot_product_attention(
        queries: mx.array,
        q_keys: tuple[mx.array, mx.array, mx.array],
        q_values: tuple[mx.array, mx.array, mx.array],
        scale: float,
        mask: Optional[mx.array],
        group_size: int = 64,
        bits: int = 8,
        sinks: Optional[mx.array] = None,
        key_bits: Optional[int] = None,
    ) -> mx.array:
        return _sdpa_with_sinks(queries, q_keys, q_values, scale, mask, sinks, group_size, bits, key_bits)

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
    copies = cache.float_copies
    use_float = copies.dequantize_for(n) or (n < DEQUANT_MIN_QUERIES and (
        mirror is not None or (n_batch >= DEQUANT_MIN_QUERIES and copies.decode_float_budget_bytes() > 0)))
    if not use_float:
        return _quantized(queries, tuple(map(row, keys)), tuple(map(row, values)), cache, scale, mask, sinks)
    if mirror is None:
        fk, fv = cache.dequantize_keys(tuple(map(row, keys))), cache.dequantize(tuple(map(row, values)))
    else:
        fk, fv = row(mirror[0]), row(mirror[1])
    return mx.fast.scaled_dot_product_attention(queries, fk, fv, scale=scale, mask=mask, sinks=sinks)


def _quantized(queries, keys: QTuple, values: QTuple, cache: Any, scale: float, mask: Any, sinks: Any) -> mx.array:
    """The quantized SDPA on packed K/V (mlx-lm's, as installed: ours); keys of other bits than
    the values (8-bit keys) go to ours directly (mlx-lm's takes one `bits`)."""
    kb = key_bits(cache)
    keys = widened(keys, values)  # keys' scales kept in 16 bits (LayerKeys.scales16)
    if kb != cache.bits:
        return _sdpa_with_sinks(queries, keys, values, scale, mask, sinks, cache.group_size, cache.bits, kb)
    kw = {} if sinks is None else {"sinks": sinks}  # mlx-lm's own function has no sinks
    return _mlx_base.quantized_scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=mask, group_size=cache.group_size, bits=cache.bits, **kw
    )


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
    takes sinks (mlx-lm's dispatcher raises for sinks on a quantized cache), or, for a chunk the
    cache's `FloatCopies` dequantizes (prefill on the CPU), to the float SDPA on a transient
    dequantized copy; and batch caches to `batch_attention` (per row, on the float decode mirror
    when there is one)."""

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if _query_observer is not None:
            _query_observer(cache, queries, sinks)
        fmt = transformed(cache)
        if fmt is None:
            return attend(queries, keys, values, cache, scale, mask, sinks)
        # keys stored scaled or rotated: the queries follow; values rotated: so is the output (caches.key_formats)
        return fmt.output(attend(fmt.queries(queries), keys, values, cache, scale, mask, sinks))

    def attend(queries, keys, values, cache, scale, mask, sinks):
        if isinstance(cache, BatchQ4KVCache):
            return batch_attention(queries, keys, values, cache, scale, mask, sinks)
        if hasattr(cache, "bits"):
            # mlx-lm's own QuantizedKVCache has none: the defaults
            if getattr(cache, "float_copies", DEFAULT).dequantize_for(queries.shape[2]):
                fk = dequantize(widened(keys, values), cache.group_size, key_bits(cache))
                fv = dequantize(values, cache.group_size, cache.bits)
                return mx.fast.scaled_dot_product_attention(queries, fk, fv, scale=scale, mask=mask, sinks=sinks)
            return _quantized(queries, keys, values, cache, scale, mask, sinks)
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
    0.31 mis-broadcasts them, see `mask_needs_fix`), attention sinks, and a GQA layout that mlx's CPU
    kernels run faster; and its dispatcher, which adds dequantized prefill on the CPU and batch caches.

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
