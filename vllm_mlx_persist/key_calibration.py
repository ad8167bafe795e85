"""The `key_format` option resolved at load: per layer, how the 4-bit caches store keys (issue #33).

`resolve` turns the option into one `caches.key_formats.LayerKeys` per layer (None for layers
without 4-bit K/V). Fixed formats need no measurement but "scaled", whose per-channel scales are
calibrated on the model's own keys. "auto" measures: the model reads a short calibration text (a
fixed paragraph, tokenized by the model's own tokenizer: no data set) once on float caches and once
per candidate format on the served 4-bit caches; a candidate's *predicted change* is the larger of
its perplexity change on that text and exp(mean KL(float || format)) - 1 (KL is what perplexity
moves by on text the model predicts well, and never negative: a lucky text does not hide a loss).
It picks the cheapest candidate (bytes/token, then compute) predicted within `LIMIT_PCT`:

  q4 (4-bit K and V) < scaled (+ one multiply of the queries) < hadamard (+ a head_dim matmul of
  queries and keys) < k5v4r (keys rotated and packed in 5 bits, values rotated: 1.1x q4's bytes) < mixed (8-bit keys
  on the layers whose keys quantize worst, 4-bit elsewhere) < k8v4 (8-bit keys everywhere) < k8v4r
  (8-bit keys, values rotated: the same bytes, + a rotation of values and attention output)

"Rotated" is the Hadamard rotation along the head dimension (power-of-two head dims only): it spreads
an outlier channel over all of them, and rotated values lose a quarter of what plain 4-bit values
lose on SmolLM2 (issue #43, docs/quality.md).

and, when none is within the limit, the cheapest one predicted within 10% (at least 0.1 point)
of the best (where no key format helps, the loss is not the keys': q4). What it measured is returned as a dict
(get_stats' `key_format`, the start-up log line).

MLX work: runs on the worker thread (the backend resolves on first use), once; keeps nothing.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from typing import Any, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from .caches.codec import ModelCodec
from .caches.key_formats import LayerKeys, channel_scales, hadamard
from .caches.kinds import Q4
from .caches.q4 import Q4KVCache

log = logging.getLogger("vllm_mlx_persist")

LIMIT_PCT = 1.0  # a format is acceptable when its predicted perplexity change is at most this
CALIBRATION_TOKENS = 384
# The formats with rotated values (power-of-two head dims): option -> every 4-bit layer's format.
ROTATED = {"k5v4r": LayerKeys(5, "hadamard", values="hadamard"), "k8v4r": LayerKeys(8, values="hadamard")}
# Shares of the 4-bit layers given 8-bit keys in the "mixed" candidates, worst-quantized first.
MIXED_SHARES = (0.25, 0.5)
ORDER = ("q4", "scaled", "hadamard", "k5v4r", "mixed", "k8v4", "k8v4r")
# With no candidate within the limit, the cheapest predicted within this much of the best one.
NEAR_FRACTION, NEAR_PCT = 0.1, 0.1

CALIBRATION_TEXT = """\
The old lighthouse keeper climbed the stairs every evening at dusk. He carried a small lamp, a
notebook and a pencil, and he wrote down the time, the wind, the colour of the sea and the names of
the ships that passed. Over forty years the notebooks filled three shelves. Nobody asked to read
them, but when the harbour office needed to know how often the fog came in October, or which month
brought the strongest storms, they came to him, and he found the answer in a few minutes.

def moving_average(values, width):
    \"\"\"Return the mean of each window of `width` consecutive values.\"\"\"
    if width <= 0:
        raise ValueError("width must be positive")
    total = sum(values[:width])
    out = [total / width]
    for i in range(width, len(values)):
        total += values[i] - values[i - width]
        out.append(total / width)
    return out

Permission is hereby granted, free of charge, to any person obtaining a copy of this software and
associated documentation files, to deal in the software without restriction, including without
limitation the rights to use, copy, modify, merge, publish, distribute, and sell copies of it.
Q: What is the capital of France? A: Paris. Q: How many days are in a leap year? A: 366.
In 1969 two astronauts walked on the Moon while a third orbited above; the mission lasted eight
days, and the samples they brought back are still studied in laboratories around the world today.
"""


def calibration_tokens(tokenizer: Any, n: int = CALIBRATION_TOKENS) -> list[int]:
    """The calibration text in the model's own tokens, repeated up to n tokens."""
    ids = tokenizer.encode(CALIBRATION_TEXT)
    ids = list(getattr(ids, "ids", ids))  # a `tokenizers.Tokenizer` gives an Encoding
    if not ids:
        raise ValueError("the tokenizer gives no tokens for the calibration text")
    while len(ids) < n:
        ids += ids
    return ids[:n]


def _q4_layers(codec: ModelCodec) -> list[int]:
    return [l for l, k in enumerate(codec.kinds) if k == Q4]


def rotatable_values(model: Any) -> bool:
    """Whether the model's value head dimension is a power of two (a Hadamard rotation needs it)."""
    from .caches.kinds import _head_dims

    dims = _head_dims(model)
    d = dims.get("value head_dim", dims.get("head_dim", dims.get("key head_dim", 0)))
    return d > 0 and d & (d - 1) == 0


def uniform(codec: ModelCodec, fmt: Optional[LayerKeys]) -> list[Optional[LayerKeys]]:
    """`fmt` on every 4-bit layer, None elsewhere."""
    return [fmt if k == Q4 else None for k in codec.kinds]


def float_keys(model: Any, tokens: Sequence[int]) -> dict[int, mx.array]:
    """Layer -> its keys (n_kv_heads, T, D) for `tokens`, as a float cache holds them (after RoPE),
    for the layers whose mlx-lm cache has plain `keys`; and the logits, under key -1."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([list(tokens)]), cache=cache)
    out: dict[int, mx.array] = {-1: logits[0].astype(mx.float32)}
    for l, c in enumerate(cache):
        keys = getattr(c, "keys", None)
        if isinstance(keys, mx.array) and keys.ndim == 4:
            out[l] = keys[0, :, : c.offset if hasattr(c, "offset") else keys.shape[2], :]
    mx.eval(list(out.values()))
    return out


def scaled_formats(codec: ModelCodec, keys: dict[int, mx.array], bits: int = 4) -> list[Optional[LayerKeys]]:
    """Per-channel scaled keys, calibrated on `keys` (float_keys), for every 4-bit layer."""
    out: list[Optional[LayerKeys]] = []
    for l, k in enumerate(codec.kinds):
        if k != Q4 or l not in keys:
            out.append(None)
            continue
        s = channel_scales(keys[l])
        mx.eval(s)
        out.append(LayerKeys(bits, "scaled", s))
    return out


def key_errors(codec: ModelCodec, keys: dict[int, mx.array]) -> dict[int, float]:
    """Per 4-bit layer, the relative error of its keys quantized as the values are (bits, group)."""
    out = {}
    for l in _q4_layers(codec):
        if l not in keys:
            continue
        k = keys[l].astype(mx.float32)
        r = mx.dequantize(*mx.quantize(k, group_size=codec.group_size, bits=codec.bits),
                          group_size=codec.group_size, bits=codec.bits)
        out[l] = (mx.sqrt(mx.sum((r - k) ** 2)) / mx.maximum(mx.sqrt(mx.sum(k * k)), 1e-12)).item()
    return out


def measure(model: Any, codec: ModelCodec, tokens: Sequence[int], formats: list[Optional[LayerKeys]],
            ref_logits: mx.array) -> dict[str, float]:
    """The calibration text read on the served caches of `formats` against the float logits:
    perplexity change (%), mean KL (nats/token) and the predicted change (%)."""
    cache = codec.with_key_formats(formats).make_cache()
    logits = model(mx.array([list(tokens)]), cache=cache)[0].astype(mx.float32)
    target = mx.array(list(tokens[1:]))
    lp_ref = ref_logits[:-1] - mx.logsumexp(ref_logits[:-1], axis=-1, keepdims=True)
    lp = logits[:-1] - mx.logsumexp(logits[:-1], axis=-1, keepdims=True)
    nll_ref = -mx.take_along_axis(lp_ref, target[:, None], axis=-1).mean()
    nll = -mx.take_along_axis(lp, target[:, None], axis=-1).mean()
    kl = (mx.exp(lp_ref) * (lp_ref - lp)).sum(axis=-1).mean()
    mx.eval(nll_ref, nll, kl)
    ppl = (math.exp(nll.item() - nll_ref.item()) - 1) * 100
    kl_pct = (math.exp(max(kl.item(), 0.0)) - 1) * 100
    return {"ppl_change_pct": round(ppl, 3), "kl": round(kl.item(), 6), "predicted_pct": round(max(ppl, kl_pct), 3)}


def bytes_per_token(codec: ModelCodec, formats: Sequence[Optional[LayerKeys]], n_kv_heads: int, head_dim: int,
                    scale_bytes: Optional[int] = None) -> float:
    """Bytes one token's K and V take in the 4-bit layers (packed + a scale and a bias per group,
    in the model's dtype unless `scale_bytes`)."""
    total = 0.0
    scale_bytes = codec.latent_dtype.size if scale_bytes is None else scale_bytes
    per_group = 2 * scale_bytes * (head_dim // codec.group_size)
    for l in _q4_layers(codec):
        kb = codec.bits if formats[l] is None else formats[l].bits
        total += n_kv_heads * (head_dim * (kb + codec.bits) / 8 + 2 * per_group)
    return total


def _kv_shape(keys: dict[int, mx.array]) -> tuple[int, int]:
    k = next(v for l, v in keys.items() if l >= 0)
    return int(k.shape[0]), int(k.shape[-1])


def resolve(option: str, model: Any, tokenizer: Any, codec: ModelCodec,
            limit_pct: float = LIMIT_PCT) -> tuple[list[Optional[LayerKeys]], dict[str, Any]]:
    """Per-layer key formats for the `key_format` option, and what was measured (for get_stats)."""
    t0 = time.perf_counter()
    if option == "q4" or Q4 not in codec.kinds:
        return uniform(codec, None), {"option": option, "chosen": "q4"}
    if option == "k8v4":
        return uniform(codec, LayerKeys(8)), {"option": option, "chosen": "k8v4"}
    if option in ROTATED:
        return uniform(codec, ROTATED[option]), {"option": option, "chosen": option}
    if option == "hadamard":
        return uniform(codec, LayerKeys(codec.bits, "hadamard")), {"option": option, "chosen": "hadamard"}
    tokens = calibration_tokens(tokenizer)
    keys = float_keys(model, tokens)
    if option == "scaled":
        return scaled_formats(codec, keys, codec.bits), {
            "option": option, "chosen": "scaled", "calibration_tokens": len(tokens),
            "s": round(time.perf_counter() - t0, 3)}
    if option != "auto":
        raise ValueError(f"unknown key_format {option!r}")
    ref = keys.pop(-1)
    n_kv, D = _kv_shape(keys)
    errors = key_errors(codec, keys)
    worst = sorted(errors, key=lambda l: -errors[l])
    candidates: list[tuple[str, list[Optional[LayerKeys]]]] = [("q4", uniform(codec, None)),
                                                               ("scaled", scaled_formats(codec, keys, codec.bits))]
    if D & (D - 1) == 0:
        candidates.append(("hadamard", uniform(codec, LayerKeys(codec.bits, "hadamard"))))
    k8 = LayerKeys(8)
    for n in sorted({max(1, round(share * len(worst))) for share in MIXED_SHARES}):
        if n < len(worst):
            top = set(worst[:n])
            candidates.append((f"mixed:{n}", [k8 if l in top else None for l in range(codec.n_layers)]))
    candidates.append(("k8v4", uniform(codec, k8)))
    if rotatable_values(model) and D & (D - 1) == 0:
        candidates += [(name, uniform(codec, fmt)) for name, fmt in ROTATED.items()]
    measured: dict[str, dict[str, Any]] = {}
    chosen = None
    # Cheapest first: stop at the first within the limit (bytes first, then compute).
    ranked = sorted(candidates, key=lambda c: (bytes_per_token(codec, c[1], n_kv, D),
                                               ORDER.index(c[0].split(":")[0])))
    for name, formats in ranked:
        m = measure(model, codec, tokens, formats, ref)
        m["bytes_per_token"] = bytes_per_token(codec, formats, n_kv, D)
        if name.startswith("mixed"):
            m["k8_layers"] = sorted(l for l, f in enumerate(formats) if f is not None)
        measured[name] = m
        if m["predicted_pct"] <= limit_pct:
            chosen = (name, formats)
            break
    within = chosen is not None
    if chosen is None:
        # None within the limit: the cheapest close to the best (where no key format helps, the
        # loss is the values' or the model's own: q4), measured in cost order as above.
        name = near_best([(n, measured[n]["predicted_pct"]) for n, _ in ranked])
        chosen = next(c for c in candidates if c[0] == name)
    report = {"option": "auto", "chosen": chosen[0].split(":")[0], "limit_pct": limit_pct, "within_limit": within,
              "calibration_tokens": len(tokens), "measured": measured,
              "key_rel_error": {str(l): round(e, 4) for l, e in errors.items()},
              "s": round(time.perf_counter() - t0, 3)}
    if chosen[0].startswith("mixed"):
        report["k8_layers"] = measured[chosen[0]]["k8_layers"]
    return chosen[1], report


def calibration_params(limit_pct: float = LIMIT_PCT) -> dict[str, Any]:
    """Everything a calibration's choice depends on besides the model (key_choice.py's file key)."""
    return {"text": hashlib.sha256(CALIBRATION_TEXT.encode()).hexdigest(), "tokens": CALIBRATION_TOKENS,
            "order": ORDER, "mixed": MIXED_SHARES, "near": (NEAR_FRACTION, NEAR_PCT), "limit_pct": limit_pct}


def scale_shapes(model: Any, codec: ModelCodec) -> list[Optional[tuple[int, ...]]]:
    """Per layer: None without 4-bit keys, else the shape scaled keys' scales have there,
    (n_kv_heads, 1, head_dim), from one token read on float caches (() where unknown)."""
    keys = float_keys(model, [0])
    return [None if k != Q4 else ((int(keys[l].shape[0]), 1, int(keys[l].shape[-1])) if l in keys else ())
            for l, k in enumerate(codec.kinds)]


def near_best(predicted: Sequence[tuple[str, float]]) -> str:
    """Of (name, predicted %) in cost order, the first predicted within NEAR_FRACTION (at least
    NEAR_PCT points) of the best."""
    best = min(p for _, p in predicted)
    near = best + max(NEAR_FRACTION * abs(best), NEAR_PCT)
    return next(n for n, p in predicted if p <= near)


def identity(formats: Sequence[Optional[LayerKeys]]) -> Optional[str]:
    """What model identity records of the per-layer formats (None when every layer is plain q4):
    blocks written under one never read under another."""
    tags = [None if f is None else f.digest() for f in formats]
    if all(t is None for t in tags):
        return None
    return ";".join(f"{l}={t}" for l, t in enumerate(tags) if t is not None)


def describe(report: dict[str, Any]) -> str:
    """One line for the start-up log."""
    chosen = report.get("chosen")
    if "error" in report:
        return f"key format {chosen}: key_format={report.get('option')} failed ({report['error']})"
    if report.get("option") != "auto" or "measured" not in report:
        again = ", remembered" if "remembered" in report else ""
        return f"key format {chosen} (option key_format={report.get('option')}{again})"
    m = report.get("measured", {})
    parts = ", ".join(f"{n} {v['predicted_pct']:+.2f}% ({v['bytes_per_token']:.0f} B/token)" for n, v in m.items())
    extra = f" on layers {report['k8_layers']}" if "k8_layers" in report else ""
    verdict = (f"predicted perplexity change within {report['limit_pct']}%" if report.get("within_limit", True)
               else f"none predicted within {report['limit_pct']}%: the cheapest near the best")
    again = f"; remembered in {report['remembered']}, not measured again" if "remembered" in report else ""
    return (f"key format {chosen}{extra} chosen by auto ({verdict}, measured on {report['calibration_tokens']} calibration tokens in "
            f"{report['s']:.1f} s: {parts}{again})")


__all__ = ["LIMIT_PCT", "calibration_tokens", "describe", "hadamard", "identity", "measure", "resolve"]
