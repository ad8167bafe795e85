"""`python -m vllm_mlx_persist.tools.bench.key_formats`: prefill and batched decode speed of each served
key format (issue #33) against today's 4-bit (q4), in one process, interleaved rep by rep (a tool;
the server never imports it).

Per rep and format: a cold prefill of `--context` tokens in chunks of 512 on the format's
per-sequence caches (the server's codec caches, float decode budgets as on this machine), then
`--batch` such rows (left-padded: row i is 7 i tokens shorter) merged as BatchGenerator merges them
and `--steps` greedy decode steps of the real model. Reports median wall and CPU times (the
process's, all threads: what a shared machine disturbs least) and each format's speed ratio to q4
(q4's time over the format's, median over reps: > 1 is faster). "scaled" uses unit scales (the arithmetic is the same).
`float` is the baseline of vllm-mlx's own cache: mlx-lm's float KVCache per sequence, merged into its
BatchKVCache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx

from ...caches.attention import install_attention_fix
from ...caches.codec import ModelCodec
from ...caches.floats import FloatCopies
from ...caches.key_formats import LayerKeys
from ..models.build import build_model

FORMATS = ("q4", "k8v4", "scaled", "hadamard", "float")


def _formats(model, codec: ModelCodec) -> dict[str, list]:
    args = model.args
    ones = mx.ones((args.num_key_value_heads, 1, args.head_dim))
    return {"q4": [None] * codec.n_layers, "k8v4": [LayerKeys(8)] * codec.n_layers,
            "scaled": [LayerKeys(4, "scaled", ones)] * codec.n_layers,
            "hadamard": [LayerKeys(4, "hadamard")] * codec.n_layers}


def _tokens(n: int, seed: int) -> list[int]:
    return [(i * 31 + 7 * seed) % 4000 + 1 for i in range(n)]


def run(size: str = "bench", context: int = 1024, batch: int = 4, steps: int = 16, reps: int = 3,
        formats: tuple[str, ...] = FORMATS) -> dict:
    from mlx_lm.generate import _merge_caches
    from mlx_lm.models.cache import make_prompt_cache

    install_attention_fix()
    model, _ = build_model("llama", size, seed=0)
    base = ModelCodec.for_model(model, float_copies=FloatCopies())
    fmts = _formats(model, base)
    keys = ("prefill_s", "decode_step_s", "prefill_cpu_s", "decode_step_cpu_s")
    times: dict[str, dict[str, list[float]]] = {f: {k: [] for k in keys} for f in formats}
    for rep in range(reps):
        for name in formats:
            codec = base.with_key_formats(fmts[name]) if name != "float" else None
            rows = []
            for b in range(batch):
                toks = _tokens(context - 7 * b, b)
                cache = codec.make_cache() if codec is not None else make_prompt_cache(model)
                t0, c0 = time.perf_counter(), time.process_time()
                for s in range(0, len(toks), 512):
                    mx.eval(model(mx.array([toks[s : s + 512]]), cache=cache))
                if b == 0:
                    times[name]["prefill_s"].append(time.perf_counter() - t0)
                    times[name]["prefill_cpu_s"].append(time.process_time() - c0)
                rows.append(cache)
            merged = _merge_caches(rows)
            y = mx.array([[1]] * batch)
            mx.eval(model(y, cache=merged))  # first step: builds the float mirror (4-bit formats)
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                y = mx.argmax(model(y, cache=merged)[:, -1:, :], axis=-1)
                mx.eval(y)
            times[name]["decode_step_s"].append((time.perf_counter() - t0) / steps)
            times[name]["decode_step_cpu_s"].append((time.process_time() - c0) / steps)
            del rows, merged
            mx.clear_cache()
    out = {"size": size, "context": context, "batch": batch, "steps": steps, "reps": reps, "formats": {}}
    for name in formats:
        t = times[name]
        ratio = lambda key: statistics.median(q / x for q, x in zip(times["q4"][key], t[key]))  # noqa: E731
        out["formats"][name] = {
            "prefill_s": round(statistics.median(t["prefill_s"]), 4),
            "decode_tok_s": round(batch / statistics.median(t["decode_step_s"]), 1),
            "prefill_speed_vs_q4": round(ratio("prefill_s"), 3),
            "decode_speed_vs_q4": round(ratio("decode_step_s"), 3),
            # CPU time of this process (all its threads): less sensitive to a shared machine
            "prefill_cpu_s": round(statistics.median(t["prefill_cpu_s"]), 4),
            "decode_step_cpu_ms": round(1e3 * statistics.median(t["decode_step_cpu_s"]), 3),
            "prefill_cpu_vs_q4": round(ratio("prefill_cpu_s"), 3),
            "decode_cpu_vs_q4": round(ratio("decode_step_cpu_s"), 3),
        }
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="bench")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args(argv)
    print(json.dumps(run(a.size, a.context, a.batch, a.steps, a.reps), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
