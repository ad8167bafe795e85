"""`python -m vllm_mlx_persist.tools.bench.window`: decode of one long agent on a sliding-window
model, mlx-lm's own caches against persist_q4's, in one process, interleaved (a tool; the server
never imports it).

For each context length it fills every layer's cache with the same random K/V (decode speed does
not depend on the values) and times greedy decode steps of the real model forward, B = 1, merged
the way BatchGenerator merges them:

* `mlx-lm`: vllm-mlx's default caches, `make_prompt_cache(model)`: float `KVCache` on global layers,
  `RotatingKVCache(window)` on sliding ones (`BatchKVCache` / `BatchRotatingKVCache` when merged);
* `q4-linear`: persist_q4 before issue #24, sliding layers keep every token (`Q4KVCache`);
* `q4-window`: sliding layers hold only their window (`Q4KVCache(window=w)`, what
  `ModelCodec.for_model(model, bounded=True)` makes).

Both 4-bit systems run with the float decode mirror budget the server uses (`--mirror-mb`, default
"auto": 1024 MB on a CPU). Run as a file (`python path/to/window.py --systems mlx-lm,q4-linear`)
with PYTHONPATH pointing at another checkout to time that checkout's caches (`q4-window` needs this one).
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.generate import _merge_caches
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from vllm_mlx_persist.caches.floats import FloatCopies
from vllm_mlx_persist.caches.attention import install_attention_fix
from vllm_mlx_persist.caches.q4 import Q4KVCache
from vllm_mlx_persist.tools.models.build import SIZES, build_model

SYSTEMS = ("mlx-lm", "q4-linear", "q4-window")


def _fill(model, T: int, systems: list[str], bits: int, group_size: int, copies: FloatCopies,
          seed: int = 0) -> dict[str, list]:
    """One per-sequence cache per system, every layer holding what it would after T tokens (the
    4-bit ones under `copies`' decode budget)."""
    mx.random.seed(seed)
    a = model.args
    kinds = make_prompt_cache(model)
    out: dict[str, list] = {s: [] for s in systems}
    for c in kinds:
        k = mx.random.normal((1, a.num_key_value_heads, T, a.head_dim))
        v = mx.random.normal((1, a.num_key_value_heads, T, a.head_dim))
        w = c.max_size if isinstance(c, RotatingKVCache) else None
        lo = 0 if w is None else max(0, T - w)
        if "mlx-lm" in systems:
            if w is None:
                f = KVCache()
                f.update_and_fetch(k, v)
            else:  # a full window in temporal order, as after T tokens of decode
                f = RotatingKVCache(max_size=w)
                f.keys, f.values = mx.array(k[..., lo:, :]), mx.array(v[..., lo:, :])
                f.offset, f._idx = T, T - lo
            out["mlx-lm"].append(f)
        qk, qv = mx.quantize(k, group_size, bits), mx.quantize(v, group_size, bits)
        if "q4-linear" in systems:
            out["q4-linear"].append(Q4KVCache.from_arrays(qk, qv, bits, group_size, float_copies=copies))
        if "q4-window" in systems:
            if w is None:
                out["q4-window"].append(Q4KVCache.from_arrays(qk, qv, bits, group_size, float_copies=copies))
            else:
                cut = lambda q: tuple(mx.array(x[..., lo:, :]) for x in q)
                out["q4-window"].append(Q4KVCache.from_arrays(cut(qk), cut(qv), bits, group_size, window=w, offset=T,
                                                              float_copies=copies))
        mx.eval([x for caches in out.values() for x in _arrays(caches[-1])])
    return out


def _arrays(c) -> list:
    if isinstance(c.keys, tuple):
        return list(c.keys + c.values)
    return [c.keys, c.values]


def _nbytes(batch: list) -> tuple[int, int]:
    """Bytes of the batch caches, and of those the float decode mirrors."""
    return sum(c.nbytes for c in batch), sum(getattr(c, "mirror_nbytes", 0) for c in batch)


def _decode(model, batch: list, steps: int, warm: int = 2) -> tuple[float, float]:
    """Median wall and process-CPU seconds per greedy decode step (model forward + argmax)."""
    y = mx.array([[1]])
    ts, cs = [], []
    for i in range(warm + steps):
        t, c = time.perf_counter(), time.process_time()
        y = mx.argmax(model(y, cache=batch)[:, -1:, :], axis=-1)
        mx.eval(y)
        if i >= warm:
            ts.append(time.perf_counter() - t)
            cs.append(time.process_time() - c)
    return statistics.median(ts), statistics.median(cs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_mlx_persist.tools.bench.window", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="gemma3_text")
    p.add_argument("--size", default="bench", help=f"model size preset ({', '.join(SIZES)})")
    p.add_argument("--context", default="4096,16384,32768", help="tokens of context")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"any of {', '.join(SYSTEMS)}")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per rep")
    p.add_argument("--reps", type=int, default=3, help="interleaved reps per system")
    p.add_argument("--mirror-mb", default="auto", help="float decode mirror budget of the 4-bit systems")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    a = p.parse_args(argv)
    systems = a.systems.split(",")
    mirror = a.mirror_mb if a.mirror_mb == "auto" else float(a.mirror_mb)
    copies = FloatCopies(decode_float_mb=mirror)  # the 4-bit systems' (mlx-lm's caches have no mirror)

    model, _ = build_model(a.arch, a.size)
    install_attention_fix()
    windows = {l: c.max_size for l, c in enumerate(make_prompt_cache(model)) if isinstance(c, RotatingKVCache)}
    print(f"model {a.arch}/{a.size}: {len(model.layers)} layers, sliding {sorted(windows)} "
          f"(window {set(windows.values())}), mirror budget {mirror}")
    print("| context | system | ms/step (wall) | CPU ms/step | tok/s (CPU) | vs mlx-lm (CPU) | range | KV MB after | of which mirror |")
    print("|---|---|---|---|---|---|---|---|---|")
    for T in [int(x) for x in a.context.split(",")]:
        rows = _fill(model, T, systems, a.bits, a.group_size, copies)
        got: dict[str, list] = {s: [] for s in systems}
        size: dict[str, tuple] = {}
        for rep in range(a.reps):
            for s in systems[rep % len(systems):] + systems[: rep % len(systems)]:  # rotate who goes first
                batch = _merge_caches([rows[s]])
                got[s].append(_decode(model, batch, a.steps))
                size[s] = _nbytes(batch)
                del batch
        med = lambda s, i: statistics.median(r[i] for r in got[s])
        for s in systems:
            line = f"| {T} | {s} | {med(s, 0) * 1e3:.1f} | {med(s, 1) * 1e3:.1f} | {1 / med(s, 1):.2f} | "
            if "mlx-lm" in got:
                ratios = [f[1] / x[1] for f, x in zip(got["mlx-lm"], got[s])]
                line += f"{statistics.median(ratios):.2f} | {min(ratios):.2f}-{max(ratios):.2f} | "
            else:
                line += "| | "
            print(line + f"{size[s][0] / 2**20:.0f} | {size[s][1] / 2**20:.0f} |", flush=True)
        del rows
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
