"""Key outlier channels put into a trained llama (`vllm-mlx-persist quality`, family llama_outliers).

`add_key_outliers` makes the keys Qwen2-like (a few channels far larger than the rest) without
changing the float model; `key_channel_stats` measures the keys' per-channel RMS, the ratio the
report shows and the per-channel scales the "scaled" key format divides by.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Outliers:
    """Key outlier channels put into a trained llama: in every KV head, `pairs` RoPE channel
    pairs (the lowest-frequency ones, where real models' key outliers sit) are multiplied by
    `scale` in k_proj and divided by it in q_proj for every query head sharing that KV head. Every
    score q.k is unchanged (RoPE rotates each pair as a whole, and the product of the two factors
    is 1), so the float model is the same model; only the keys' magnitudes differ."""

    pairs: int = 2
    scale: float = 16.0


def outlier_channels(head_dim: int, pairs: int) -> list[int]:
    """The channels of the `pairs` lowest-frequency RoPE pairs (mlx-lm's non-traditional RoPE
    rotates channel i with i + head_dim / 2; frequency falls with i)."""
    half = head_dim // 2
    lows = list(range(half - pairs, half))
    return sorted(lows + [i + half for i in lows])


def add_key_outliers(model: Any, spec: Outliers) -> None:
    """Apply `spec` to a llama-architecture `model` in place (see `Outliers`)."""
    import mlx.core as mx

    args = model.args
    D = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    n_kv, n_q = args.num_key_value_heads, args.num_attention_heads
    if getattr(args, "rope_traditional", False):
        raise ValueError("outlier channels are placed for non-traditional RoPE")
    chans = outlier_channels(D, spec.pairs)
    k_gain = np.ones(n_kv * D, dtype=np.float32)
    q_gain = np.ones(n_q * D, dtype=np.float32)
    for h in range(n_kv):
        k_gain[[h * D + c for c in chans]] = spec.scale
    for g in range(n_q):
        h = g // (n_q // n_kv)
        q_gain[[g * D + c for c in chans]] = 1.0 / spec.scale
    for layer in model.model.layers:
        a = layer.self_attn
        a.k_proj.weight = a.k_proj.weight * mx.array(k_gain)[:, None]
        a.q_proj.weight = a.q_proj.weight * mx.array(q_gain)[:, None]
        for lin, gain in ((a.k_proj, k_gain), (a.q_proj, q_gain)):
            if "bias" in lin:
                lin.bias = lin.bias * mx.array(gain)
    mx.eval(model.parameters())


def key_channel_stats(model: Any, windows: np.ndarray) -> dict[str, Any]:
    """Per quantized layer, the keys' per-channel RMS over `windows` (n, L) as the cache holds them
    (after RoPE), as (n_kv_heads, 1, head_dim) mlx arrays ("scales": calibrated per-channel key
    scales, normalised to mean 1 per head), and the ratio of the largest channel RMS to the median
    one, per layer and head ("max_over_median")."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    sums: dict[int, Any] = {}
    count = 0
    for w in windows:
        cache = make_prompt_cache(model)
        model(mx.array(w[None]), cache=cache)
        for l, c in enumerate(cache):
            if type(c) is KVCache:
                k = c.keys[0, :, : c.offset, :]  # (H, T, D)
                sq = (k * k).sum(axis=1)
                sums[l] = sq if l not in sums else sums[l] + sq
        count += len(w)
    scales, ratios = [], []
    for l in range(len(make_prompt_cache(model))):
        if l not in sums:
            scales.append(None)
            continue
        rms = mx.sqrt(sums[l] / count)  # (H, D)
        mx.eval(rms)
        r = np.array(rms)
        ratios.append((r.max(axis=1) / np.median(r, axis=1)).round(2).tolist())
        scales.append(mx.array((r / r.mean(axis=1, keepdims=True))[:, None, :]))
    return {"scales": scales, "max_over_median": ratios}
