"""The `key_format` option resolved at load: per layer, how the 4-bit caches store keys (issue #33).

`resolve` turns the option into one `caches.key_formats.LayerKeys` per layer (None for layers
without 4-bit K/V). Fixed formats need no measurement but "scaled", whose per-channel scales are
calibrated on the model's own keys (and the centred formats). "auto" measures: the scaled and centred
candidates are fitted on a short calibration text (a fixed paragraph, tokenized by the model's own
tokenizer: no data set) read on float caches; then a second fixed text (`MEASURE_TEXT`, English prose)
is read once on float caches and once per candidate format on the served 4-bit caches; a candidate's
*predicted change* is exp(mean KL(float || format)) - 1: KL is what perplexity moves by on text the
model predicts well, never negative (a lucky text does not hide a loss), and far steadier than the
perplexity change of 384 tokens, which swung by +-0.8 points around it on SmolLM2 (it is reported
beside it). On SmolLM2's held-out text the predictions agree with the measured perplexity change
within 0.75 points or 25% (docs/quality.md; tests/test_real_quality.py checks it).
It measures the candidates cheapest first (bytes/token, then compute), every candidate of one cost
before the next cost, and stops after the first cost with one predicted within `LIMIT_PCT`:

  q4 (4-bit K and V) = scaled (+ one multiply of the queries) = hadamard (+ a head_dim rotation of
  queries and keys) = k4v4r (keys and values rotated: + a rotation of values and attention output)
  < k5v4c (5-bit keys centred, balanced and rotated, 16-bit key scales, values
  rotated: 1.05x q4's bytes on a float32 model) < k5v4r (keys rotated and packed in 5 bits, values
  rotated: 1.1x) < k56v4c (k5v4c with 6-bit keys on the layers that lose most, within 1.15x) < k6v4c
  (6-bit: 1.15x) < mixed / mixedr (8-bit keys on the layers whose keys quantize worst, 4-bit
  elsewhere; mixedr with every value rotated) < k8v4 (8-bit keys everywhere) = k8v4r (8-bit keys,
  values rotated)

At every key cost there is a candidate with rotated values (issue #50: on Gemma 3 270M the values
carry most of the 4-bit error). `choose` never serves a candidate that another of equal or fewer
bytes measured better: of the cheapest cost within the limit, the best measured (ties: the least
compute).

"Rotated" is the Hadamard rotation along the head dimension (power-of-two head dims only): it spreads
an outlier channel over all of them, and rotated values lose a quarter of what plain 4-bit values
lose on SmolLM2 (issue #43, docs/quality.md). "Centred" takes out what a rotation cannot spread: a
channel's offset shared by every token (per-token groups spend their range on it); the queries'
sizes come from the same float pass, through the attention dispatcher.

When none is within the limit, the cheapest predicted within 10% (at least 0.1 point) of the best,
among the candidates no cheaper-or-equal one beats (where no key format helps, the loss is not the
keys': q4). What it measured is returned as a dict
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
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from .caches.codec import ModelCodec
from .caches.attention import observing_queries
from .caches.key_formats import LayerKeys, balance_scales, channel_scales, hadamard
from .caches.kinds import Q4
from .caches.q4 import Q4KVCache
from .kv_edit.rope_shift import probe_model

log = logging.getLogger("vllm_mlx_persist")

LIMIT_PCT = 1.0  # a format is acceptable when its predicted perplexity change is at most this
CALIBRATION_TOKENS = 384
# The formats with rotated values (power-of-two head dims): option -> every 4-bit layer's format.
ROTATED = {"k4v4r": LayerKeys(4, "hadamard", values="hadamard"), "k5v4r": LayerKeys(5, "hadamard", values="hadamard"),
           "k8v4r": LayerKeys(8, values="hadamard")}
# Shares of the 4-bit layers given 8-bit keys in the "mixed" candidates, worst-quantized first.
MIXED_SHARES = (0.25, 0.5)
# The centred formats (key_formats: keys centred, balanced against the queries and rotated; values
# rotated), calibrated like `scaled`: option -> key bits. On SmolLM2 k6v4c is +0.66% on 8k held-out
# tokens at 1.15x q4's bytes (k8v4r: +0.61% at 1.40x); on 16 short chat prompts its greedy replies
# start as the float cache's 13 times (k8v4r 15, k8v4 13; docs/quality.md, issue #43).
CENTRED = {"k5v4c": 5, "k6v4c": 6}
# "k56v4c": k5v4c with 6-bit keys on the layers whose 5-bit keys lose most, as many as keep the
# bytes per token within this many times q4's (issue #43's cost bound).
MIX_BUDGET = 1.15
CENTER_HORIZON = 8192  # positions a centred format's center is averaged over (rope_center)
# The options resolve() calibrates on the model (key_choice remembers what they chose).
CALIBRATED = ("auto", "scaled", *CENTRED, "k56v4c")
ORDER = ("q4", "scaled", "hadamard", "k4v4r", "k5v4c", "k5v4r", "k56v4c", "k6v4c", "mixed", "mixedr", "k8v4",
         "k8v4r")
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


# What auto measures its candidates on (issue #43): plain expository prose, apart from the text the
# scaled and centred formats are fitted on. CALIBRATION_TEXT (code, a license, lists, a story) moved
# every format's KL on SmolLM2 to about twice what held-out English text measures (q4 0.29 against
# 0.15, k8v4r 0.018 against 0.006), so every prediction was ~2x pessimistic; on this text they
# agree with 8k held-out tokens within 0.75 points or 25% (q4 0.142 against 0.142, k6v4c 0.0073
# against 0.0077; docs/quality.md).
MEASURE_TEXT = """\
A cache keeps a copy of data close to where it is used, so that a second request for the same data
can be answered without repeating the work that produced it. The idea appears at every level of a
computer. The processor keeps recently used memory in small, fast caches beside each core; the
operating system keeps recently read file blocks in memory; a web browser keeps pages and images it
has already downloaded; and a database keeps the results of frequent queries. In each case the cache
is smaller than the data behind it, so it must decide what to keep and what to discard when it is
full. A common policy is to discard the entry that was used least recently, on the assumption that
data used a long time ago is less likely to be needed again soon.

Every cache also has to answer the question of freshness. When the original data changes, a copy in
the cache may become stale. Some systems give each entry a lifetime after which it is discarded;
others send a message to every cache that holds a copy when the original is modified; still others
check the original on each use, which saves transfer time but not the round trip. The right choice
depends on how often the data changes, how expensive it is to fetch, and how much harm a stale answer
would do.

The module described here provides a small, thread-safe cache for the results of function calls. A
function decorated with it remembers the value it returned for each combination of arguments. When
it is called again with the same arguments, the stored value is returned at once. The number of
entries can be limited; when the limit is reached, the least recently used entry is removed. The
cache can be cleared explicitly, and statistics about hits and misses are available for tuning.
Arguments must be hashable, because they are used as keys in a dictionary. Keyword arguments given in
a different order are treated as different calls, and so are arguments that compare equal but have
different types, unless the cache is told to ignore types.
"""


def calibration_tokens(tokenizer: Any, n: int = CALIBRATION_TOKENS, text: str = CALIBRATION_TEXT) -> list[int]:
    """The calibration text (or `text`) in the model's own tokens, repeated up to n tokens; what the
    tokenizer puts before every text (Gemma's BOS) comes once, at the start, as in a served prompt."""
    ids = _encode(tokenizer, text, True)
    body = _encode(tokenizer, text, False)
    if not body:
        raise ValueError("the tokenizer gives no tokens for the calibration text")
    head = ids[:len(ids) - len(body)] if ids[len(ids) - len(body):] == body else []
    out = list(head)
    while len(out) < n:
        out += body
    return out[:n]


def _encode(tokenizer: Any, text: str, specials: bool) -> list[int]:
    try:
        ids = tokenizer.encode(text, add_special_tokens=specials)
    except TypeError:  # an encode without the keyword: it adds nothing
        ids = tokenizer.encode(text)
    return list(getattr(ids, "ids", ids))  # a `tokenizers.Tokenizer` gives an Encoding


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


def float_keys(model: Any, tokens: Sequence[int],
               query_rms: Optional[dict[int, mx.array]] = None) -> dict[int, mx.array]:
    """Layer -> its keys (n_kv_heads, T, D) for `tokens`, as a float cache holds them (after RoPE),
    for the layers whose mlx-lm cache has plain `keys`; and the logits, under key -1. With
    `query_rms`, also fills it: layer -> the RMS of each query channel over the tokens and each KV
    head's query heads, (n_kv_heads, D), for the layers whose attention takes no sinks (read
    through the installed attention dispatcher; empty without it)."""
    cache = make_prompt_cache(model)
    layer_of = {id(c): l for l, c in enumerate(cache)}
    seen: dict[int, tuple[mx.array, bool]] = {}

    def observe(c: Any, queries: mx.array, sinks: Any) -> None:
        if id(c) in layer_of:
            seen[layer_of[id(c)]] = (queries, sinks is not None)

    with observing_queries(observe):
        logits = model(mx.array([list(tokens)]), cache=cache)
    out: dict[int, mx.array] = {-1: logits[0].astype(mx.float32)}
    for l, c in enumerate(cache):
        keys = getattr(c, "keys", None)
        if isinstance(keys, mx.array) and keys.ndim == 4:
            out[l] = keys[0, :, : c.offset if hasattr(c, "offset") else keys.shape[2], :]
    if query_rms is not None:
        for l, (q, has_sinks) in seen.items():
            if l in out and not has_sinks:
                n_kv, D = out[l].shape[0], out[l].shape[-1]
                if q.shape[-1] == D and q.shape[1] % n_kv == 0:
                    g = q[0].astype(mx.float32).reshape(n_kv, -1, D)
                    query_rms[l] = mx.sqrt(mx.mean(g * g, axis=1))
    mx.eval(list(out.values()) + list((query_rms or {}).values()))
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


def _rope(x: mx.array, params: Any, sign: int) -> mx.array:
    """x (n, T, D): token t's rotary slice rotated by sign * t positions (RoPE of `params`)."""
    lead, rot = x[..., :params.start], x[..., params.start:]
    rot = mx.fast.rope(rot[None], params.dims, traditional=params.traditional, base=params.base,
                       scale=sign * params.scale, offset=0, freqs=params.freqs)[0]
    return mx.concatenate([lead, rot], axis=-1) if params.start else rot


def rope_center(keys: mx.array, shift: Any, horizon: int = CENTER_HORIZON) -> Optional[mx.array]:
    """Where a layer's keys (n_kv_heads, T, D, after RoPE at positions 0..T-1) sit on average at
    every position up to `horizon`: each channel's offset before RoPE (the keys rotated back by
    their positions, averaged), rotated to each position in [0, horizon) and averaged. RoPE turns
    an offset with the position, so the mean of a short calibration text misplaces it at later
    positions (SmolLM2: 6-bit keys centred on 384 tokens' mean lost twice what 1024 tokens' did);
    fast-turning channels average out here, slow ones keep their offset. (n_kv_heads, 1, D), or
    None where RoPE cannot be undone (`kv_edit.rope_shift`'s verdict `refuse`)."""
    k = keys.astype(mx.float32)
    slot = shift.slots[0] if shift is not None and shift.slots else None
    if slot is None or slot.kind == "refuse":
        return None
    if slot.kind == "static":
        return mx.mean(k, axis=1, keepdims=True)
    offset = mx.mean(_rope(k, slot.params, -1), axis=1, keepdims=True)
    spread = _rope(mx.broadcast_to(offset, (k.shape[0], horizon, k.shape[-1])), slot.params, 1)
    return mx.mean(spread, axis=1, keepdims=True)


# What each fixed option rotates (a Hadamard rotation needs a power-of-two head dimension).
ROTATES_KEYS = ("hadamard", "k4v4r", "k5v4r", *CENTRED, "k56v4c")
ROTATES_VALUES = ("k4v4r", "k5v4r", "k8v4r", *CENTRED, "k56v4c")


def option_obstacle(option: str, model: Any, codec: ModelCodec) -> Optional[str]:
    """Why this model cannot take the `key_format` option, naming the layer and the property, or
    None; from the model's shapes and parameters alone (no MLX work: the backend factory asks it at
    start-up, where a refusal stops the server). "auto" and "q4" fit every model."""
    from .caches.kinds import _head_dims

    if option in ("auto", "q4"):
        return None
    q4 = _q4_layers(codec)
    if not q4:
        return "no layer stores 4-bit keys and values (its layers are latent, recurrent or convolution state)"
    dims = _head_dims(model)
    key_dim = dims.get("key head_dim", dims.get("head_dim"))
    value_dim = dims.get("value head_dim", dims.get("head_dim"))
    for what, dim, rotated in (("key", key_dim, ROTATES_KEYS), ("value", value_dim, ROTATES_VALUES)):
        if option in rotated and dim is not None and (dim < 1 or dim & (dim - 1)):
            return (f"layer {q4[0]}: its {what} head dimension is {dim}, not a power of two "
                    f"(key_format {option} rotates the {what}s by a Hadamard matrix of that order)")
    if option in CALIBRATED and option != "scaled":
        layers = getattr(model, "layers", None)
        layers = model.model.layers if layers is None else layers
        for l in q4:
            if any(name.split(".")[-1] == "sinks" for name, _ in tree_flatten(layers[l].parameters())):
                return (f"layer {l}: its attention takes sinks, whose logit does not shift with the "
                        f"scores (key_format {option} centres keys, which shifts every score of a query)")
    return None


def centred_obstacle(codec: ModelCodec, keys: dict[int, mx.array], query_rms: dict[int, mx.array]) -> Optional[str]:
    """Why the centred formats cannot be calibrated on this model ("layer L: ..."), or None. They
    need, on every 4-bit layer, the calibration keys and the queries' channel sizes: a layer with
    attention sinks has no query sizes (shifting its scores by q . center is not free beside a sink's
    logit, which does not shift), and a Hadamard rotation needs a power-of-two head dimension."""
    for l in _q4_layers(codec):
        if l not in keys:
            return f"layer {l}: its cache holds no plain keys to calibrate on"
        D = int(keys[l].shape[-1])
        if D & (D - 1):
            return f"layer {l}: head dimension {D} is not a power of two (the Hadamard rotation needs one)"
        if l not in query_rms:
            return (f"layer {l}: its attention takes sinks (or its queries were not seen), so shifting every "
                    "score of a query by the same amount is not free there")
    return None


def centred_formats(codec: ModelCodec, keys: dict[int, mx.array], query_rms: dict[int, mx.array],
                    bits: int, shifts: Sequence[Any]) -> Optional[list[Optional[LayerKeys]]]:
    """Centred, balanced, rotated `bits`-bit keys and rotated values on every 4-bit layer, calibrated
    on `keys` and `query_rms` (float_keys) and the layers' RoPE (`shifts`: rope_shift.probe_model);
    None where `centred_obstacle` names a layer that cannot take them. A layer whose RoPE the probe
    cannot undo is centred on the calibration keys' plain mean (any center is exact: it shifts
    every score of a query alike; the RoPE-aware one only quantizes later positions better)."""
    if centred_obstacle(codec, keys, query_rms) is not None:
        return None
    out: list[Optional[LayerKeys]] = []
    for l, k in enumerate(codec.kinds):
        if k != Q4:
            out.append(None)
            continue
        center = rope_center(keys[l], shifts[l]) if l < len(shifts) else None
        if center is None:
            center = mx.mean(keys[l].astype(mx.float32), axis=1, keepdims=True)
        scales = balance_scales(keys[l], query_rms[l], center)
        mx.eval(center, scales)
        out.append(LayerKeys(bits, "centred", scales, values="hadamard", center=center, scales16=True))
    return out


def score_error(fmt: LayerKeys, keys: mx.array, query_rms: mx.array, group_size: int) -> float:
    """How much a layer's attention scores move when its keys (n_kv_heads, T, D) are stored in
    `fmt`: the key error weighted per channel by the queries' mean square, relative to the keys'."""
    k = keys.astype(mx.float32)[None]
    back = fmt.decode(mx.dequantize(*mx.quantize(fmt.encode(k), group_size=group_size, bits=fmt.bits),
                                    group_size=group_size, bits=fmt.bits))
    w = (query_rms.astype(mx.float32) ** 2)[None, :, None, :]
    return (mx.sum(w * (back - k) ** 2) / mx.maximum(mx.sum(w * k * k), 1e-12)).item()


def centred_mix(codec: ModelCodec, five: list[Optional[LayerKeys]], six: list[Optional[LayerKeys]],
                keys: dict[int, mx.array], query_rms: dict[int, mx.array],
                budget: float = MIX_BUDGET) -> list[Optional[LayerKeys]]:
    """k56v4c: `five` (k5v4c) with `six`'s 6-bit keys on the layers whose 5-bit scores move most,
    worst first, as many as keep the bytes per token within `budget` times q4's."""
    n_kv, D = _kv_shape(keys)
    limit = budget * bytes_per_token(codec, uniform(codec, None), n_kv, D)
    err = {l: score_error(f, keys[l], query_rms[l], codec.group_size) for l, f in enumerate(five) if f is not None}
    out = list(five)
    for l in sorted(err, key=lambda l: -err[l]):
        trial = out[:l] + [six[l]] + out[l + 1:]
        if bytes_per_token(codec, trial, n_kv, D) > limit + 1e-9:
            break
        out = trial
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
    """`tokens` read on the served caches of `formats` against the float logits: perplexity change
    (%), mean KL (nats/token) and the predicted change (%), exp(KL) - 1."""
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
    return {"ppl_change_pct": round(ppl, 3), "kl": round(kl.item(), 6), "predicted_pct": round(kl_pct, 3)}


def bytes_per_token(codec: ModelCodec, formats: Sequence[Optional[LayerKeys]], n_kv_heads: int, head_dim: int,
                    scale_bytes: Optional[int] = None) -> float:
    """Bytes one token's K and V take in the 4-bit layers (packed + a scale and a bias per group,
    in the model's dtype unless `scale_bytes`; keys' in 16 bits where the format says so)."""
    total = 0.0
    scale_bytes = codec.latent_dtype.size if scale_bytes is None else scale_bytes
    groups = head_dim // codec.group_size
    for l in _q4_layers(codec):
        f = formats[l]
        kb = codec.bits if f is None else f.bits
        key_scale = min(2, scale_bytes) if f is not None and f.scales16 else scale_bytes
        total += n_kv_heads * (head_dim * (kb + codec.bits) / 8 + 2 * groups * (key_scale + scale_bytes))
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
    if option not in ("auto", "scaled", "k56v4c") and option not in CENTRED:
        raise ValueError(f"unknown key_format {option!r}")
    tokens = calibration_tokens(tokenizer)
    query_rms: dict[int, mx.array] = {}
    keys = float_keys(model, tokens, query_rms)
    if option == "scaled":
        return scaled_formats(codec, keys, codec.bits), {
            "option": option, "chosen": "scaled", "calibration_tokens": len(tokens),
            "s": round(time.perf_counter() - t0, 3)}
    centred: dict[str, Optional[list[Optional[LayerKeys]]]] = {}
    obstacle = centred_obstacle(codec, keys, query_rms) if rotatable_values(model) else \
        "the value head dimension is not a power of two (the Hadamard rotation needs one)"
    if obstacle is None:
        shifts = probe_model(model)
        centred = {name: centred_formats(codec, keys, query_rms, bits, shifts) for name, bits in CENTRED.items()}
        centred["k56v4c"] = centred_mix(codec, centred["k5v4c"], centred["k6v4c"], keys, query_rms)
        if option == "auto" and all(f is None or f.bits == 6 for f in centred["k56v4c"]):
            del centred["k56v4c"]  # the budget holds 6-bit keys everywhere: k6v4c itself
    if option != "auto":
        if obstacle is not None:
            raise ValueError(f"persist_q4 key_format {option} cannot be served on this model: {obstacle}")
        report = {"option": option, "chosen": option, "calibration_tokens": len(tokens),
                  "s": round(time.perf_counter() - t0, 3)}
        if option == "k56v4c":
            report["k6_layers"] = [l for l, f in enumerate(centred[option]) if f is not None and f.bits == 6]
        return centred[option], report
    keys.pop(-1)
    measured_on = calibration_tokens(tokenizer, text=MEASURE_TEXT)
    ref = float_keys(model, measured_on)[-1]
    n_kv, D = _kv_shape(keys)
    errors = key_errors(codec, keys)
    candidates = auto_candidates(model, codec, keys, errors, centred)
    measured: dict[str, dict[str, Any]] = {}
    # Cheapest first (bytes, then compute), every candidate of one cost measured before the next
    # cost is tried: the choice is never one a candidate of the same bytes measured better.
    ranked = sorted(candidates, key=lambda c: (_cost(codec, c[1], n_kv, D), ORDER.index(c[0].split(":")[0])))
    for i, (name, formats) in enumerate(ranked):
        m = measure(model, codec, measured_on, formats, ref)
        m["bytes_per_token"] = bytes_per_token(codec, formats, n_kv, D)
        if name.startswith("mixed"):
            m["k8_layers"] = sorted(l for l, f in enumerate(formats) if f is not None and f.bits == 8)
        if name == "k56v4c":
            m["k6_layers"] = [l for l, f in enumerate(formats) if f is not None and f.bits == 6]
        measured[name] = m
        last_of_cost = i + 1 == len(ranked) or \
            _cost(codec, ranked[i + 1][1], n_kv, D) != _cost(codec, formats, n_kv, D)
        if last_of_cost and any(v["predicted_pct"] <= limit_pct for v in measured.values()):
            break
    name, within = choose([(n, measured[n]["bytes_per_token"], measured[n]["predicted_pct"]) for n, _ in ranked
                           if n in measured], limit_pct)
    chosen = next(c for c in candidates if c[0] == name)
    report = {"option": "auto", "chosen": chosen[0].split(":")[0], "limit_pct": limit_pct, "within_limit": within,
              "calibration_tokens": len(tokens), "measured": measured,
              "key_rel_error": {str(l): round(e, 4) for l, e in errors.items()},
              "s": round(time.perf_counter() - t0, 3)}
    if obstacle is not None:
        report["centred_skipped"] = obstacle
    if chosen[0].startswith("mixed"):
        report["k8_layers"] = measured[chosen[0]]["k8_layers"]
    return chosen[1], report


def auto_candidates(model: Any, codec: ModelCodec, keys: dict[int, mx.array], errors: dict[int, float],
                    centred: dict[str, Optional[list[Optional[LayerKeys]]]]) -> list[tuple[str, list]]:
    """What auto measures: at each key cost a format with plain and one with rotated values where the
    head dimension allows (issue #50: on Gemma 3 the values carry most of the 4-bit error, 8-bit keys
    +2.86% with plain values, +0.02% with rotated ones), "mixed:n"/"mixedr:n" with 8-bit keys on the
    n layers whose keys quantize worst, and the centred formats (`centred`, where calibrated)."""
    D = _kv_shape(keys)[1]
    rotatable = rotatable_values(model) and D & (D - 1) == 0
    worst = sorted(errors, key=lambda l: -errors[l])
    out: list[tuple[str, list]] = [("q4", uniform(codec, None)), ("scaled", scaled_formats(codec, keys, codec.bits))]
    if D & (D - 1) == 0:
        out.append(("hadamard", uniform(codec, LayerKeys(codec.bits, "hadamard"))))
    k8, k8r = LayerKeys(8), ROTATED["k8v4r"]
    for n in sorted({max(1, round(share * len(worst))) for share in MIXED_SHARES}):
        if n < len(worst):
            top = set(worst[:n])
            out.append((f"mixed:{n}", [k8 if l in top else None for l in range(codec.n_layers)]))
            if rotatable:
                out.append((f"mixedr:{n}", [None if k != Q4 else k8r if l in top else ROTATED["k4v4r"]
                                            for l, k in enumerate(codec.kinds)]))
    out.append(("k8v4", uniform(codec, k8)))
    if rotatable:
        out += [(name, uniform(codec, fmt)) for name, fmt in ROTATED.items()]
        out += [(name, fmts) for name, fmts in centred.items() if fmts is not None]
    return out


def _cost(codec: ModelCodec, formats: Sequence[Optional[LayerKeys]], n_kv: int, D: int) -> float:
    """Bytes per token, rounded so that formats of one cost compare equal."""
    return round(bytes_per_token(codec, formats, n_kv, D), 6)


def choose(measured: Sequence[tuple[str, float, float]], limit_pct: float = LIMIT_PCT) -> tuple[str, bool]:
    """Of (name, bytes per token, predicted %) in cost order (bytes, then compute), auto's choice and
    whether it is within `limit_pct`. Only candidates no other beats are eligible: one is out when
    another of equal or fewer bytes is predicted lower (or the same, earlier in the order). Of
    those, the cheapest within the limit; with none within it, the cheapest predicted within
    NEAR_FRACTION (at least NEAR_PCT points) of the best (where no key format helps, the loss is the
    values' or the model's own: q4)."""
    rows = list(measured)

    def beaten(i: int) -> bool:
        _, b, p = rows[i]
        return any(ob <= b + 1e-6 and (op < p or (op == p and j < i)) for j, (_, ob, op) in enumerate(rows) if j != i)

    front = [r for i, r in enumerate(rows) if not beaten(i)]
    within = next((n for n, _, p in front if p <= limit_pct), None)
    if within is not None:
        return within, True
    return near_best([(n, p) for n, _, p in front]), False


def calibration_params(limit_pct: float = LIMIT_PCT) -> dict[str, Any]:
    """Everything a calibration's choice depends on besides the model (key_choice.py's file key)."""
    return {"text": hashlib.sha256(CALIBRATION_TEXT.encode()).hexdigest(), "tokens": CALIBRATION_TOKENS,
            "measure_text": hashlib.sha256(MEASURE_TEXT.encode()).hexdigest(),
            "order": ORDER, "mixed": MIXED_SHARES, "near": (NEAR_FRACTION, NEAR_PCT), "limit_pct": limit_pct,
            "centred": {"horizon": CENTER_HORIZON, "mix_budget": MIX_BUDGET}}


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
