"""`python -m vllm_mlx_persist.tools.bench.decode`: batched decode on 4-bit caches against mlx-lm's
BatchKVCache, in one process, interleaved (a tool; the server never imports it).

For each batch size and context length it builds per-sequence caches of slightly different lengths
(so the batch is left-padded, as in a server) from one float prefill of the project's own model,
merges them with `BatchKVCache.merge` (float, vllm-mlx's default) and `BatchQ4KVCache.merge`
(persist_q4: "q4" with the float decode mirror off, "q4+mirror" with it on), and times greedy decode
steps of the real model forward on each, alternating the systems rep by rep. Reports median step
time, the q4/float and q4+mirror/float tok/s ratios per rep (median and range), the CPU time of
the first q4+mirror step (it builds the mirror: one dequantization of the batch's K/V), and a per-op
profile of one attention layer's decode work (cache update, mask, attention).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, KVCache

from ...caches.floats import FloatCopies
from ...caches.attention import install_attention_fix
from ...caches.q4 import BatchQ4KVCache, Q4KVCache
from ..models.build import SIZES, build_model

_ROW_STAGGER = 7  # row i is i * 7 tokens shorter than row 0: a left-padded batch


def _prefill(model, n_layers: int, T: int) -> list[KVCache]:
    cache = [KVCache() for _ in range(n_layers)]
    tokens = mx.array([[(i * 31 + 7) % 1000 + 1 for i in range(T)]])
    for s in range(0, T, 512):
        model(tokens[:, s : s + 512], cache=cache)
        mx.eval([c.keys for c in cache])
    return cache


def _rows(full: list[KVCache], B: int, T: int, bits: int, group_size: int):
    """Per-sequence float and 4-bit caches of lengths T, T-7, T-14, ... (copies, no shared storage)."""
    fl, q4 = [], []
    for i in range(B):
        n = T - i * _ROW_STAGGER
        f_row, q_row = [], []
        for c in full:
            k, v = mx.array(c.keys[..., :n, :]), mx.array(c.values[..., :n, :])
            kc = KVCache()
            kc.update_and_fetch(k, v)
            f_row.append(kc)
            q = Q4KVCache.from_arrays(mx.quantize(k, group_size, bits), mx.quantize(v, group_size, bits),
                                      bits, group_size)
            q_row.append(q)
        fl.append(f_row)
        q4.append(q_row)
    return fl, q4


def _under(rows: list[list[Q4KVCache]], copies: FloatCopies) -> list[list[Q4KVCache]]:
    """The same 4-bit rows (views of their arrays, no copy) under `copies`' budgets."""
    return [[Q4KVCache.from_arrays(*c.to_arrays(), c.bits, c.group_size, float_copies=copies) for c in r]
            for r in rows]


def _merge(rows, cls) -> list:
    return [cls.merge([r[l] for r in rows]) for l in range(len(rows[0]))]


def _decode(model, cache: list, B: int, steps: int, warm: int = 2) -> tuple[float, float, float]:
    """Median wall and process-CPU seconds per greedy decode step (model forward + argmax,
    evaluated), and the first step's CPU seconds. CPU time is the steadier figure on a machine
    shared with other work."""
    y = mx.array([[1 + b] for b in range(B)])
    ts, cs, first = [], [], None
    for i in range(warm + steps):
        t, c = time.perf_counter(), time.process_time()
        logits = model(y, cache=cache)
        y = mx.argmax(logits[:, -1:, :], axis=-1)
        mx.eval(y)
        if first is None:
            first = time.process_time() - c
        if i >= warm:
            ts.append(time.perf_counter() - t)
            cs.append(time.process_time() - c)
    return statistics.median(ts), statistics.median(cs), first


def _time_ops(fn: Callable[[], object], n: int) -> float:
    for _ in range(2):
        mx.eval(fn())
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


def profile_layer(B: int, T: int, n_q: int, n_kv: int, D: int, bits: int, group_size: int, n: int = 30) -> dict:
    """Microseconds per decode step of one attention layer's cache work, float vs 4-bit."""
    from mlx_lm.models import base

    qsdpa = base.quantized_scaled_dot_product_attention
    k = mx.random.normal((B, n_kv, T, D))
    v = mx.random.normal((B, n_kv, T, D))
    q = mx.random.normal((B, n_q, 1, D))
    nk, nv = mx.random.normal((B, n_kv, 1, D)), mx.random.normal((B, n_kv, 1, D))
    mx.eval(k, v, q, nk, nv)
    pads = [i * _ROW_STAGGER for i in range(B)]
    fc = BatchKVCache(pads)
    fc.update_and_fetch(k, v)
    qc = BatchQ4KVCache(pads, bits, group_size, float_copies=FloatCopies(decode_float_mb=0))  # never one
    qc.update_and_fetch(k, v)
    mc = BatchQ4KVCache(pads, bits, group_size, float_copies=FloatCopies(decode_float_mb=1 << 20))
    mc.update_and_fetch(k, v)  # with the float decode mirror (built by its first decode step, below)
    mx.eval(fc.keys, [x for x in qc.keys], [x for x in mc.keys])
    mc.update_and_fetch(nk, nv)  # a decode step: builds the mirror

    def upd(c):
        def f():
            c.trim(1)  # stay at T tokens: one slot rewritten per call
            return c.update_and_fetch(nk, nv)
        return f

    mask = fc.make_mask(1)  # before the update, as the model does
    fk, fv = fc.update_and_fetch(nk, nv)
    qk, qv = qc.update_and_fetch(nk, nv)
    mx.eval(fk, fv, qk, qv, mask)
    dk, dv = mx.dequantize(*qk, group_size=group_size, bits=bits), mx.dequantize(*qv, group_size=group_size, bits=bits)
    mx.eval(dk, dv)
    out = {
        "update float": _time_ops(upd(fc), n),
        "update q4": _time_ops(upd(qc), n),
        "update q4+mirror": _time_ops(upd(mc), n),
        "quantize new token (k+v)": _time_ops(lambda: (mx.quantize(nk, group_size, bits), mx.quantize(nv, group_size, bits)), n),
        "make_mask": _time_ops(lambda: create_causal_mask(1, offset=T, left_padding=fc.left_padding), n),
        "sdpa float": _time_ops(lambda: mx.fast.scaled_dot_product_attention(q, fk, fv, scale=0.125, mask=mask), n),
        "sdpa q4 (quantized_matmul)": _time_ops(lambda: qsdpa(q, qk, qv, scale=0.125, mask=mask, group_size=group_size, bits=bits), n),
        "dequantize k+v": _time_ops(lambda: (mx.dequantize(*qk, group_size=group_size, bits=bits),
                                             mx.dequantize(*qv, group_size=group_size, bits=bits)), n),
        "sdpa on dequantized": _time_ops(lambda: mx.fast.scaled_dot_product_attention(q, dk, dv, scale=0.125, mask=mask), n),
    }
    return {k: round(v) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_mlx_persist.tools.bench.decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="bench", help=f"model size preset ({', '.join(SIZES)})")
    p.add_argument("--arch", default="llama")
    p.add_argument("--batch", default="1,4,8", help="batch sizes")
    p.add_argument("--context", default="512,2048", help="tokens of context per sequence")
    p.add_argument("--steps", type=int, default=12, help="timed decode steps per rep")
    p.add_argument("--reps", type=int, default=5, help="interleaved reps per system")
    p.add_argument("--profile", action="store_true", help="also the per-op profile of one layer")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--mirror-mb", type=float, default=8192,
                   help="float decode mirror budget for the q4+mirror system (large: always on)")
    a = p.parse_args(argv)

    model, config = build_model(a.arch, a.size)
    install_attention_fix()
    n_layers = len(model.layers)
    s = SIZES[a.size]
    print(f"model {a.arch}/{a.size}: {n_layers} layers, {s.heads} q / {s.kv_heads} kv heads, head_dim {s.head_dim}")
    print("| B | context | float ms/step | q4 ms/step | q4+mirror ms/step | q4/float tok/s (wall) | "
          "q4+mirror/float (wall) | float CPU ms | q4 CPU ms | q4+mirror CPU ms | q4/float (CPU) | range | "
          "q4+mirror/float (CPU) | range | mirror build step CPU ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    systems = [("f", BatchKVCache), ("q", BatchQ4KVCache), ("m", BatchQ4KVCache)]
    # the q4 rows under a budget of 0 (no mirror) and the same rows under --mirror-mb
    budgets = {"q": FloatCopies(decode_float_mb=0), "m": FloatCopies(decode_float_mb=a.mirror_mb)}
    for T in [int(x) for x in a.context.split(",")]:
        full = _prefill(model, n_layers, T)
        for B in [int(x) for x in a.batch.split(",")]:
            rows = dict(zip(("f", "q"), _rows(full, B, T, a.bits, a.group_size)))
            rows.update({k: _under(rows["q"], copies) for k, copies in budgets.items()})
            got: dict[str, list] = {k: [] for k, _ in systems}
            for rep in range(a.reps):
                order = systems[rep % 3:] + systems[:rep % 3]  # rotate who goes first
                for name, cls in order:
                    got[name].append(_decode(model, _merge(rows[name], cls), B, a.steps))
            col = lambda k, i: [r[i] for r in got[k]]
            ratio = lambda k, i: [f / x for f, x in zip(col("f", i), col(k, i))]
            med = lambda xs: statistics.median(xs) * 1e3
            rng = lambda xs: f"{min(xs):.2f}-{max(xs):.2f}"
            print(f"| {B} | {T} | {med(col('f', 0)):.1f} | {med(col('q', 0)):.1f} | {med(col('m', 0)):.1f} | "
                  f"{statistics.median(ratio('q', 0)):.2f} | {statistics.median(ratio('m', 0)):.2f} | "
                  f"{med(col('f', 1)):.1f} | {med(col('q', 1)):.1f} | {med(col('m', 1)):.1f} | "
                  f"{statistics.median(ratio('q', 1)):.2f} | {rng(ratio('q', 1))} | "
                  f"{statistics.median(ratio('m', 1)):.2f} | {rng(ratio('m', 1))} | {med(col('m', 2)):.1f} |",
                  flush=True)
            if a.profile:
                prof = profile_layer(B, T, s.heads, s.kv_heads, s.head_dim, a.bits, a.group_size)
                print("    one layer, us: " + ", ".join(f"{k} {v}" for k, v in prof.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
