"""`python -m vllm_mlx_persist.tools.bench.hotturn`: a hot turn of a long agent, persist_q4 against
vllm-mlx's default prefix cache, in one process, interleaved (a tool; the server never imports it).

Each system holds one agent whose history of T tokens is random K/V at the model's shapes (a hot turn
does not depend on the values; a cold prefill of 32k tokens would take hours on the CPU). A turn is
what vllm-mlx's scheduler does with a prefix hit, with the same objects:

* `vllm-default`: vllm-mlx's `MemoryAwarePrefixCache.fetch` (its stored float `KVCache`s), mlx-lm's
  `BatchGenerator.insert(remaining tokens, caches=...)` and `next()` until the request finishes, then
  `store(prompt + output, extracted cache)`;
* `persist-q4`: the pool's `match` (lookup and build from hot blocks), the same `BatchGenerator`
  calls on the 4-bit caches, then `commit_async` and the wait until the turn is durable on disk
  (a temporary directory).

The next turn's prompt is the previous prompt, its output and a new suffix of `--suffix` tokens, so
the agent grows a little every rep, as a conversation does. Reported per system and context: TTFT
(lookup included), the lookup, the whole turn, and the store/commit after it, wall and process CPU
time, the persist-q4 / vllm-default TTFT ratio per rep (median, range), and the ratio of the two
systems' fastest TTFTs (best of the reps: on a machine shared with other work, the least disturbed
turn of each), and the median per-rep ratio of their process CPU times to the first token (with
`OPENBLAS_NUM_THREADS=1`, the work done, which other jobs on the machine disturb least). The load
average is printed before and after. `decode ms/token`: the rest of the turn after the first token,
per token (with more `--max-tokens`, what a long answer costs per token), its per-rep ratio, and the
median per-rep ratio of the process CPU time per token.

`--servers` instead runs the same comparison through real servers: a persist_q4 server and a
vllm-mlx server with its default prefix cache (the bench's own flags, kit.make_server), side
by side, on a chat history of about T tokens (the model's template); one cold turn each, then
`--reps` hot turns alternating between them, one request at a time, TTFT as a streaming client sees
it. Each reply is recorded as a fixed text (kit.FIXED_REPLY, as the bench's batch section does)
so that both re-prefill the same few tokens. No warm-up request: the cold turn is the agent's first.

`--profile` also splits a turn into stages, run one after the other with an `mx.eval` between them
(so nothing overlaps, unlike the turn above): lookup, merge, prefill of the suffix, the split of the
prompt batch into a generation batch (mlx-lm deep-copies it), the first two decode steps, extract,
commit; and times one attention layer's share of the prefill at the same shapes (float copies,
4-bit regrowth, dequantization, the float SDPA), the cache work alone over every layer (merge,
the new text's chunk, one decode step) and the model's decode step on each system.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator, _merge_caches
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache

from vllm_mlx_persist.caches import ModelCodec
from vllm_mlx_persist.caches.floats import FloatCopies
from vllm_mlx_persist.caches.attention import install_attention_fix
from vllm_mlx_persist.caches.key_formats import LayerKeys
from vllm_mlx_persist.caches.dequant import dequantize, widened
from vllm_mlx_persist.caches.q4 import Q4KVCache
from vllm_mlx_persist.pool import BlockPool
from vllm_mlx_persist.store import DiskStore
from vllm_mlx_persist.tools.models.build import SIZES, build_model

# "persist-q4-nocarry": persist_q4 with no float copies carried between turns (carry_float_mb 0).
SYSTEMS = ("vllm-default", "persist-q4")
Q4_SYSTEMS = ("persist-q4", "persist-q4-nocarry")
STAGES = ("lookup", "merge", "prefill", "split", "decode1", "decode2", "extract", "commit", "durable",
          "to first token")
FP = "b" * 64  # the pool's fingerprint: any fixed id will do here


def _head_dim(model) -> int:
    a = model.args
    return getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads


def _stored(k: mx.array, v: mx.array, bits: int, group_size: int, key_format: Optional[LayerKeys] = None):
    """K/V (1, H, T, D) as a 4-bit cache in `key_format` stores them (encoded, in its key bits and
    scales' dtype): (keys, values) packed tuples and their exact float values (a carried copy)."""
    c = Q4KVCache(group_size, bits, key_format=key_format)
    c.update_and_fetch(k, v)
    qk, qv = c.to_arrays()
    return qk, qv, (dequantize(widened(qk, qv), group_size, c.key_bits), dequantize(qv, group_size, bits))


def _history(model, T: int, bits: int, group_size: int, seed: int = 0,
             key_format: Optional[LayerKeys] = None, quantized: bool = True) -> list:
    """Per layer, T tokens of random K/V (the same values for a seed): as `Q4KVCache`s (keys stored per
    `key_format`, e.g. 8-bit), or as float `KVCache`s (`quantized` False)."""
    mx.random.seed(seed)
    a = model.args
    out = []
    for _ in model.layers:
        k = mx.random.normal((1, a.num_key_value_heads, T, _head_dim(model)))
        v = mx.random.normal((1, a.num_key_value_heads, T, _head_dim(model)))
        if quantized:
            c = Q4KVCache.from_arrays(*_stored(k, v, bits, group_size, key_format)[:2], bits, group_size,
                                      key_format=key_format)
            mx.eval(*c.keys, *c.values)
        else:
            c = KVCache()
            c.update_and_fetch(k, v)
            mx.eval(c.keys, c.values)
        out.append(c)
    return out


def _drive(model, cache: list, tokens: list[int], max_tokens: int, t0: float, c0: float) -> dict:
    """One request through mlx-lm's BatchGenerator as vllm-mlx drives it; times from (t0, c0)."""
    bg = BatchGenerator(model, max_tokens=max_tokens, prefill_batch_size=8, completion_batch_size=32,
                        prefill_step_size=2048)
    bg.insert([tokens], max_tokens=[max_tokens], caches=[cache])
    del cache
    out: dict = {"output": []}
    while True:
        _, gen = bg.next()
        for r in gen:
            if not out["output"]:
                out["ttft"], out["ttft_cpu"] = time.perf_counter() - t0, time.process_time() - c0
            out["output"].append(r.token)
            if r.finish_reason is not None:
                out["cache"] = r.prompt_cache
                out["turn"], out["turn_cpu"] = time.perf_counter() - t0, time.process_time() - c0
                bg.close()
                return out


class DefaultSystem:
    """vllm-mlx's default prefix cache, as its scheduler uses it."""

    name = "vllm-default"

    def __init__(self, model, history: list[int], caches: list):
        from vllm_mlx.memory_cache import MemoryAwarePrefixCache, MemoryCacheConfig

        self.model = model
        self.cache = MemoryAwarePrefixCache(model, MemoryCacheConfig(max_memory_mb=16384))
        if not self.cache.store(list(history), caches):
            raise RuntimeError("vllm-mlx's cache refused the history")

    def turn(self, prompt: list[int], max_tokens: int) -> dict:
        t0, c0 = time.perf_counter(), time.process_time()
        cache, remaining = self.cache.fetch(prompt)
        if not cache or not remaining:
            raise RuntimeError("no prefix hit")
        lookup = time.perf_counter() - t0
        r = _drive(self.model, cache, remaining, max_tokens, t0, c0)
        t1, c1 = time.perf_counter(), time.process_time()
        self.cache.store(prompt + r["output"], r.pop("cache"))
        r.update(lookup=lookup, store=time.perf_counter() - t1, store_cpu=time.process_time() - c1, hit=len(prompt) - len(remaining))
        return r


class Q4System:
    """persist_q4's pool (hot tier in memory, disk tier in a temporary directory) and 4-bit caches,
    under budgets of its own (`float_copies`: `mirror_mb` and `carry_mb`, the backend's
    decode_float_mb and carry_float_mb), as a server's backend owns them."""

    def __init__(self, model, history: list[int], caches: list, bits: int, group_size: int, root: Path,
                 carry_mb: Any = "auto", mirror_mb: Any = "auto", key_format: Optional[LayerKeys] = None):
        self.model = model
        self.float_copies = FloatCopies(decode_float_mb=mirror_mb, carry_float_mb=carry_mb)
        fmt = {"bits": bits, "group_size": group_size, "block_size": 256}
        codec = ModelCodec.for_model(model, bits, group_size, float_copies=self.float_copies)
        if key_format is not None:
            codec = codec.with_key_formats([key_format] * codec.n_layers)
        self.pool = BlockPool(fingerprint=FP, n_layers=codec.n_layers, bits=bits, group_size=group_size,
                              block_size=256, hot_bytes=8 << 30, store=DiskStore(root, FP, {"bench": "hotturn"}, fmt),
                              codec=codec)
        self.pool.load_manifests()
        n, durable = self.pool.commit_async("agent", list(history), caches)
        if n != len(history) or not durable.result(600):
            raise RuntimeError("the pool did not take the history")
        self.turns = 0

    def turn(self, prompt: list[int], max_tokens: int) -> dict:
        self.turns += 1
        rid = f"r{self.turns}"
        t0, c0 = time.perf_counter(), time.process_time()
        m = self.pool.match("agent", prompt, rid)
        if m.cache is None or m.tier != "hot":
            raise RuntimeError(f"no hot hit ({m.tier})")
        lookup = time.perf_counter() - t0
        r = _drive(self.model, m.cache, prompt[m.num_tokens:], max_tokens, t0, c0)
        del m
        t1, c1 = time.perf_counter(), time.process_time()
        _, durable = self.pool.commit_async("agent", prompt + r["output"], r.pop("cache"), rid)
        store, store_cpu = time.perf_counter() - t1, time.process_time() - c1
        ok = durable.result(600) if durable is not None else None
        r.update(lookup=lookup, store=store, store_cpu=store_cpu, durable=time.perf_counter() - t1, saved=ok)
        self.pool.finish(rid)
        return r

    def close(self) -> None:
        self.pool.close()


# ---- stage profile --------------------------------------------------------------------------------


def _ev(caches: list) -> list:
    """Evaluate the caches, a persist_q4 batch cache's float decode mirror included."""
    mx.eval([c.state for c in caches], [c.float_kv() for c in caches if hasattr(c, "float_kv")])
    return caches


def _timed(out: dict, name: str, fn: Callable[[], Any]) -> Any:
    t = time.perf_counter()
    r = fn()
    out[name] = (time.perf_counter() - t) * 1e3
    return r


def profile_turn(system, prompt: list[int], max_tokens: int) -> tuple[dict, list[int]]:
    """The stages of one turn, serialized (ms). Returns them and the output tokens."""
    out: dict = {}
    model = system.model
    if isinstance(system, Q4System):
        m = _timed(out, "lookup", lambda: system.pool.match("agent", prompt, "profile"))
        cache, rest = m.cache, prompt[m.num_tokens:]
    else:
        cache, rest = _timed(out, "lookup", lambda: system.cache.fetch(prompt))
    batch = _timed(out, "merge", lambda: _ev(_merge_caches([cache])))
    del cache
    x = mx.array([rest[:-1]])
    _timed(out, "prefill", lambda: (model(x, cache=batch), _ev(batch), mx.clear_cache()))
    def split() -> list:
        """PromptProcessingBatch.split, every row going to decode: a deep copy, the original
        emptied, the copy filtered to all its rows."""
        gen = copy.deepcopy(batch)
        batch.clear()
        for c in gen:
            c.filter([0])
        return _ev(gen)

    gen = _timed(out, "split", split)
    del batch
    y = mx.array([rest[-1:]])
    tokens = []

    def step():
        nonlocal y
        y = mx.argmax(model(y, cache=gen)[:, -1:, :], axis=-1)
        mx.eval(y)
        tokens.append(y.item())

    _timed(out, "decode1", step)
    _timed(out, "decode2", step)
    for _ in range(max_tokens - 2):
        step()
    ex = _timed(out, "extract", lambda: _ev([c.extract(0) for c in gen]))
    del gen
    output = tokens
    if isinstance(system, Q4System):
        def commit():
            _, f = system.pool.commit_async("agent", prompt + output, ex, "profile")
            return f
        f = _timed(out, "commit", commit)
        _timed(out, "durable", lambda: f.result(600))
        system.pool.finish("profile")
    else:
        _timed(out, "commit", lambda: system.cache.store(prompt + output, ex))
    out["to first token"] = sum(out[k] for k in ("lookup", "merge", "prefill", "split", "decode1"))
    return out, output


def layer_ops(model, T: int, S: int, bits: int, group_size: int, reps: int = 7) -> dict[str, float]:
    """Median ms of one attention layer's prefill work for S new queries after T cached tokens."""
    a = model.args
    H, D, Q = a.num_key_value_heads, _head_dim(model), a.num_attention_heads
    mx.random.seed(1)
    k = mx.random.normal((1, H, T, D))
    qk = mx.quantize(k, group_size, bits)
    q = mx.random.normal((1, Q, S, D))
    fk = mx.random.normal((1, H, T + S, D))
    mask = create_causal_mask(S, offset=T)
    mx.eval(k, qk, q, fk, mask)
    ops = {
        "float copy (merge)": lambda: mx.array(k),
        "float concat (growth)": lambda: mx.concatenate([k, mx.zeros((1, H, 256, D))], axis=2),
        "4-bit regrow": lambda: [mx.concatenate([x, mx.zeros((1, H, 256, x.shape[3]), x.dtype)], axis=2) for x in qk],
        "dequantize": lambda: mx.dequantize(*qk, group_size=group_size, bits=bits),
        "SDPA (float)": lambda: mx.fast.scaled_dot_product_attention(q, fk, fk, scale=D ** -0.5, mask=mask),
    }
    got = {}
    for name, fn in ops.items():
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            mx.eval(fn())
            ts.append(time.perf_counter() - t)
        # K and V: two of each (the SDPA reads both at once)
        got[name] = statistics.median(ts) * 1e3 * (1 if name.startswith("SDPA") else 2)
    return got


BENCH_KEY_FORMATS = ("q4", "k8v4", "k8v4r", "k6v4c")


def bench_key_format(name: str, model: Any) -> Optional[LayerKeys]:
    """The format every layer's keys are timed in. k6v4c's center and scales are calibrated per
    model; any values cost the same ops, so the bench uses zeros and ones of their shape."""
    if name == "k8v4":
        return LayerKeys(8)
    if name == "k8v4r":
        return LayerKeys(8, values="hadamard")
    if name == "k6v4c":
        import mlx.core as mx

        args = model.args
        shape = (args.num_key_value_heads, 1, getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads)
        return LayerKeys(6, "centred", mx.ones(shape), values="hadamard", center=mx.zeros(shape), scales16=True)
    return None


def cache_ops(model, T: int, S: int, bits: int, group_size: int, key_format: Optional[LayerKeys] = None,
              reps: int = 15, steps: int = 4) -> dict[str, dict[str, float]]:
    """Median ms of the cache work alone (no model) of a turn over every layer, per system: the merge
    of a T-token history, the update with a chunk of S new tokens, then one decode step's update,
    each with what attention reads (the float K/V: the float cache's, the 4-bit cache's mirror)
    evaluated; the 4-bit caches start from carried floats, as a hot turn does. `python`: the part
    spent building the graph. Process CPU time, the systems interleaved."""
    a = model.args
    H, D, n = a.num_key_value_heads, _head_dim(model), len(model.layers)
    copies = FloatCopies()
    mx.random.seed(2)
    hist = []
    for _ in range(n):
        k, v = mx.random.normal((1, H, T, D)), mx.random.normal((1, H, T, D))
        qk, qv, f = _stored(k, v, bits, group_size, key_format)
        mx.eval(k, v, qk, qv, f)
        hist.append((k, v, qk, qv, f))
    new = [(mx.random.normal((1, H, S, D)), mx.random.normal((1, H, S, D))) for _ in range(n)]
    one = [(mx.random.normal((1, H, 1, D)), mx.random.normal((1, H, 1, D))) for _ in range(n)]
    mx.eval(new, one)

    def fl() -> list:
        out = []
        for k, v, *_ in hist:
            c = KVCache()
            c.keys, c.values, c.offset = k, v, T
            out.append(_merge_caches([[c]])[0])
        return out

    def q4() -> list:
        out = []
        for _, _, qk, qv, f in hist:
            c = Q4KVCache.from_arrays(qk, qv, bits, group_size, float_copies=copies, key_format=key_format)
            c.floats = f
            out.append(_merge_caches([[c]])[0])
        return out

    def run(make: Callable[[], list]) -> dict[str, float]:
        r, c0 = {}, time.process_time()
        batch = make()
        mx.eval([c.state for c in batch])
        r["merge"], c0 = (time.process_time() - c0) * 1e3, time.process_time()
        for name, x in (("prefill chunk", new), *(("decode step", one),) * steps):
            out = [c.update_and_fetch(*x[l]) for l, c in enumerate(batch)]
            out = [c.float_kv() if hasattr(c, "float_kv") else o for c, o in zip(batch, out)]
            py = (time.process_time() - c0) * 1e3
            mx.eval(out)
            t = (time.process_time() - c0) * 1e3
            if name not in r or t < r[name]:  # the steps: the least disturbed
                r[name], r[name + " (python)"] = t, py
            c0 = time.process_time()
        return r

    got: dict[str, list] = {"vllm-default": [], "persist-q4": []}
    for i in range(reps):
        for name, make in (("vllm-default", fl), ("persist-q4", q4))[:: 1 if i % 2 else -1]:
            got[name].append(run(make))
    return {s: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for s, rs in got.items()}


def decode_steps(model, T: int, S: int, bits: int, group_size: int,
                 key_formats: Optional[dict[str, Optional[LayerKeys]]] = None,
                 rounds: int = 6, steps: int = 12) -> dict[str, list[float]]:
    """Per round and system, the median process-CPU ms of one decode step of the model (the forward
    pass of one token and its argmax, evaluated), after a history of T tokens (as `cache_ops` builds
    it: float caches, or 4-bit caches starting from carried floats) and a chunk of S new tokens; the
    systems alternate round by round. `key_formats`: the 4-bit systems, by name (default: one,
    "persist-q4", plain)."""
    a = model.args
    H, D = a.num_key_value_heads, _head_dim(model)
    key_formats = key_formats or {"persist-q4": None}
    copies = FloatCopies()
    mx.random.seed(3)
    hist = []
    for _ in model.layers:
        k, v = mx.random.normal((1, H, T, D)), mx.random.normal((1, H, T, D))
        stored = {n: _stored(k, v, bits, group_size, f) for n, f in key_formats.items()}
        mx.eval(k, v, stored)
        hist.append((k, v, stored))

    def fl() -> list:
        out = []
        for k, v, _ in hist:
            c = KVCache()
            c.keys, c.values, c.offset = k, v, T
            out.append(c)
        return _merge_caches([out])

    def q4(name: str) -> list:
        out = []
        for _, _, stored in hist:
            qk, qv, f = stored[name]
            c = Q4KVCache.from_arrays(qk, qv, bits, group_size, float_copies=copies, key_format=key_formats[name])
            c.floats = f
            out.append(c)
        return _merge_caches([out])

    makers = {"vllm-default": fl, **{n: (lambda n=n: q4(n)) for n in key_formats}}
    x = mx.array([[(7 * i) % (a.vocab_size - 10) + 5 for i in range(S)]])
    got: dict[str, list[float]] = {n: [] for n in makers}
    for i in range(rounds):
        for name in list(makers)[:: 1 if i % 2 == 0 else -1]:
            cache = makers[name]()
            model(x, cache=cache)
            mx.eval([c.state for c in cache])
            y, ts = mx.array([[5]]), []
            for _ in range(steps):
                c0 = time.process_time()
                y = mx.argmax(model(y, cache=cache)[:, -1:, :], axis=-1)
                mx.eval(y)
                ts.append((time.process_time() - c0) * 1e3)
            got[name].append(statistics.median(ts))
            del cache
    return got


# ---- through real servers ---------------------------------------------------------------------------


def _find(d: Any, keys: tuple[str, ...], out: dict) -> dict:
    """The stats fields whose names contain one of `keys`, wherever they are nested."""
    if isinstance(d, dict):
        for k, v in d.items():
            if any(x in str(k) for x in keys) and not isinstance(v, dict):
                out[k] = v
            _find(v, keys, out)
    return out


def servers_main(a: argparse.Namespace) -> int:
    from .kit import FIXED_REPLY, Conversation, Prompts, Session, make_server, seed_of, send
    from ..models.build import build_model_dir

    systems = ["vllm_default", "persist_q4"]
    with tempfile.TemporaryDirectory(prefix="hotturn-servers-") as root:
        work = Path(root)
        model = Path(a.model_dir).resolve() if a.model_dir else build_model_dir(work / "model", arch="llama", size=a.size)
        prompts = Prompts(model)
        print(f"model {model.name if a.model_dir else 'llama/' + a.size} through servers; {a.max_tokens} output tokens; load average "
              "%.2f %.2f %.2f" % os.getloadavg(), flush=True)
        print("| context | cold s: vllm-mlx / persist_q4 | hot TTFT s median: vllm-mlx / persist_q4 | per-pair ratio "
              "median (range) | best vs best | carried |")
        print("|---|---|---|---|---|---|")
        for T in [int(x) for x in a.context.split(",")]:
            hist = prompts.history(seed_of("hotturn", T), T)
            sess = {s: Session(s, make_server(s, model, work / f"{s}-{T}", 4096), [], "hotturn") for s in systems}
            convs = {s: Conversation(f"agent-{T}", [dict(m) for m in hist], seed_of("hotturn-u", T), 30)
                     for s in systems}
            cold: dict[str, float] = {}
            got: dict[str, list[float]] = {s: [] for s in systems}
            carried: dict = {}
            try:
                for s in systems:
                    sess[s].start()
                for s in systems:
                    cold[s] = send(sess[s], convs[s].ask(), convs[s].agent, a.max_tokens)["ttft_s"]
                    convs[s].answer(FIXED_REPLY)
                for i in range(a.reps):
                    for s in systems if i % 2 == 0 else systems[::-1]:
                        r = send(sess[s], convs[s].ask(), convs[s].agent, a.max_tokens)
                        convs[s].answer(FIXED_REPLY)
                        if r["tier"] != "memory":
                            raise RuntimeError(f"{s}: a hot turn was served from {r['tier']}")
                        got[s].append(r["ttft_s"])
                carried = _find(sess["persist_q4"].server.get_json("/v1/cache/stats"),
                                ("carry_float_used", "decode_float_from_carry"), {})
            finally:
                for s in systems:
                    sess[s].stop()
            f, q = got["vllm_default"], got["persist_q4"]
            ratios = [y / x for x, y in zip(f, q)]
            print(f"| {T} | {cold['vllm_default']:.1f} / {cold['persist_q4']:.1f} | {statistics.median(f):.3f} / "
                  f"{statistics.median(q):.3f} | {statistics.median(ratios):.3f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f}) | "
                  f"{min(q) / min(f):.3f} | {carried} |", flush=True)
        print("load average %.2f %.2f %.2f" % os.getloadavg())
    return 0


# ---- main -------------------------------------------------------------------------------------------


def _suffix(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(5, vocab - 5, size=n).tolist()


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_mlx_persist.tools.bench.hotturn", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="small", help=f"llama model size preset ({', '.join(SIZES)})")
    p.add_argument("--model-dir", default=None,
                   help="an mlx-lm model directory to load instead of a preset (e.g. .models/smollm2-135m-instruct)")
    p.add_argument("--key-format", default="q4",
                   help=f"how persist_q4 stores keys ({', '.join(BENCH_KEY_FORMATS)}); a comma-separated list "
                        "runs one 4-bit system per format, interleaved, and compares each with the first")
    p.add_argument("--context", default="4096,16384,32768", help="tokens of history")
    p.add_argument("--suffix", type=int, default=100, help="new tokens per turn")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--reps", type=int, default=5, help="turns per system, interleaved")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--mirror-mb", default="auto", help="persist_q4's decode_float_mb")
    p.add_argument("--carry-mb", default="auto", help="persist_q4's carry_float_mb (persist-q4-nocarry: 0)")
    p.add_argument("--profile", action="store_true", help="also the serialized stages and one layer's ops")
    p.add_argument("--servers", action="store_true",
                   help="through real servers instead (persist_q4 and vllm-mlx's default cache; --reps hot turns)")
    p.add_argument("--decode-rounds", type=int, default=6, help="--profile: rounds of the model's decode steps")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    a = p.parse_args(argv)
    a.carry_mb = a.carry_mb if a.carry_mb == "auto" else float(a.carry_mb)
    if a.servers:
        return servers_main(a)
    logging.getLogger("vllm_mlx").setLevel(logging.WARNING)
    systems = a.systems.split(",")
    if a.model_dir:
        from mlx_lm import load

        model, _ = load(a.model_dir)
        name = Path(a.model_dir).name
    else:
        model, _ = build_model("llama", a.size)
        name = f"llama/{a.size}"
    formats = a.key_format.split(",")
    if any(f not in BENCH_KEY_FORMATS for f in formats):
        p.error(f"--key-format: each of {', '.join(BENCH_KEY_FORMATS)}")
    key_formats = {f: bench_key_format(f, model) for f in formats}
    # the 4-bit systems in the first format keep their names; each other format adds "<system>@<format>"
    q4_systems = {s if i == 0 else f"{s}@{f}": (s, f) for s in Q4_SYSTEMS if s in systems
                  for i, f in enumerate(formats)}
    systems = [s for s in systems if s not in Q4_SYSTEMS] + list(q4_systems)
    install_attention_fix()
    mirror_mb = a.mirror_mb if a.mirror_mb == "auto" else float(a.mirror_mb)
    counts: list[str] = []  # per context and 4-bit system: its mirrors' and carried floats' counters
    vocab = model.args.vocab_size
    print(f"model {name}: {len(model.layers)} layers, {model.args.num_key_value_heads} KV heads; "
          f"suffix {a.suffix} tokens, {a.max_tokens} output tokens, mirror budget {a.mirror_mb}, "
          f"keys {a.key_format}")
    print("load average %.2f %.2f %.2f" % os.getloadavg())
    print("| context | system | TTFT ms | TTFT CPU ms | vs vllm-default (range) | best vs best | CPU vs CPU | "
          "lookup ms | "
          "turn ms | decode ms/token | decode vs vllm-default (range) | decode CPU vs CPU | store/commit ms | "
          "durable ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    profiles: list[str] = []
    between: list[str] = []  # each other format's 4-bit system against the first format's
    for T in [int(x) for x in a.context.split(",")]:
        rng = np.random.default_rng(T)
        history = _suffix(rng, T, vocab)
        with tempfile.TemporaryDirectory(prefix="hotturn-") as root:
            made: dict[str, Any] = {}
            if "vllm-default" in systems:
                made["vllm-default"] = DefaultSystem(model, history,
                                                     _history(model, T, a.bits, a.group_size, quantized=False))
            for s, (base, f) in q4_systems.items():
                q4 = _history(model, T, a.bits, a.group_size, key_format=key_formats[f])
                made[s] = Q4System(model, history, q4, a.bits, a.group_size, Path(root) / s.replace("@", "-"),
                                   0 if base.endswith("nocarry") else a.carry_mb, mirror_mb, key_formats[f])
                del q4
            prompts = {s: list(history) for s in systems}
            got: dict[str, list] = {s: [] for s in systems}
            for rep in range(a.reps + 1):  # the first rep warms up both and is not counted
                for s in systems[rep % len(systems):] + systems[: rep % len(systems)]:
                    prompt = prompts[s] + _suffix(rng, a.suffix, vocab)
                    r = made[s].turn(prompt, a.max_tokens)
                    prompts[s] = prompt + r["output"]
                    if rep:
                        got[s].append(r)
            if a.profile:
                for s in systems:
                    prompt = prompts[s] + _suffix(rng, a.suffix, vocab)
                    stages, output = profile_turn(made[s], prompt, a.max_tokens)
                    prompts[s] = prompt + output
                    profiles.append(f"| {T} | {s} | " + " | ".join(
                        f"{stages[k]:.1f}" if k in stages else "" for k in STAGES) + " |")
            for r in (r for s in systems for r in got[s]):  # the steps after the first token, per token
                r["decode"] = (r["turn"] - r["ttft"]) / max(1, len(r["output"]) - 1)
                r["decode_cpu"] = (r["turn_cpu"] - r["ttft_cpu"]) / max(1, len(r["output"]) - 1)
            for s in systems:
                med = lambda k: statistics.median(r[k] for r in got[s]) * 1e3  # noqa: E731
                line = f"| {T} | {s} | {med('ttft'):.0f} | {med('ttft_cpu'):.0f} | "
                if "vllm-default" in got:
                    ratios = [x["ttft"] / f["ttft"] for f, x in zip(got["vllm-default"], got[s])]
                    line += f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
                    best = min(x["ttft"] for x in got[s]) / min(f["ttft"] for f in got["vllm-default"])
                    cpu = [x["ttft_cpu"] / f["ttft_cpu"] for f, x in zip(got["vllm-default"], got[s])]
                    line += f"{best:.3f} | {statistics.median(cpu):.3f} | "
                else:
                    line += "| | | "
                line += f"{med('lookup'):.1f} | {med('turn'):.0f} | {med('decode'):.1f} | "
                if "vllm-default" in got:
                    dr = [x["decode"] / f["decode"] for f, x in zip(got["vllm-default"], got[s])]
                    dc = [x["decode_cpu"] / f["decode_cpu"] for f, x in zip(got["vllm-default"], got[s])]
                    line += f"{statistics.median(dr):.3f} ({min(dr):.2f}-{max(dr):.2f}) | {statistics.median(dc):.3f} | "
                else:
                    line += "| | "
                line += f"{med('store'):.1f} | "
                line += f"{med('durable'):.1f} |" if "durable" in got[s][0] else "|"
                print(line, flush=True)
            for s, (base, f) in q4_systems.items():
                if s != base:
                    ratio = lambda k: [x[k] / y[k] for x, y in zip(got[s], got[base])]  # noqa: E731
                    t, d, dc = ratio("ttft"), ratio("decode"), ratio("decode_cpu")
                    between.append(f"| {T} | {s} / {base} | {statistics.median(t):.3f} ({min(t):.2f}-{max(t):.2f}) | "
                                   f"{statistics.median(d):.3f} ({min(d):.2f}-{max(d):.2f}) | {statistics.median(dc):.3f} |")
            for name, s in made.items():
                if isinstance(s, Q4System):
                    counts.append(f"{T} {name}: mirrors {s.float_copies.mirror_counts}, "
                                  f"carried {s.float_copies.carry_counts}")
                if hasattr(s, "close"):
                    s.close()
            del made
            mx.clear_cache()
    print("load average %.2f %.2f %.2f" % os.getloadavg())
    if between:
        print("\nEach key format's 4-bit system against the first format's, per rep (same turns, interleaved):\n")
        print("| context | systems | TTFT ratio (range) | decode ms/token ratio (range) | decode CPU ratio |")
        print("|---|---|---|---|---|")
        print("\n".join(between))
    print("\n" + "\n".join(counts))
    if a.profile:
        print("\nStages of one turn, serialized (ms):\n")
        print("| context | system | " + " | ".join(STAGES) + " |")
        print("|---|---|" + "---|" * len(STAGES))
        print("\n".join(profiles))
        print("\nOne attention layer's prefill work (ms; K and V both, SDPA over the history):\n")
        print("| context | " + " | ".join(layer_ops(model, 16, 4, a.bits, a.group_size, 1)) + " |")
        print("|---|" + "---|" * 5)
        for T in [int(x) for x in a.context.split(",")]:
            ops = layer_ops(model, T, a.suffix, a.bits, a.group_size)
            print(f"| {T} | " + " | ".join(f"{v:.1f}" for v in ops.values()) + " |", flush=True)
        print(f"\nThe cache work alone over the {len(model.layers)} layers (ms of process CPU, median of 15, "
              "the systems interleaved; (python): building the graph):\n")
        names = None
        for T in [int(x) for x in a.context.split(",")]:
            ops = {}
            for i, (f, fmt) in enumerate(key_formats.items()):
                got_ops = cache_ops(model, T, a.suffix, a.bits, a.group_size, fmt)
                ops.update(got_ops if i == 0 else {f"persist-q4@{f}": got_ops["persist-q4"]})
            if names is None:
                names = list(ops["vllm-default"])
                print("| context | system | " + " | ".join(names) + " |")
                print("|---|---|" + "---|" * len(names))
            for sname, r in ops.items():
                print(f"| {T} | {sname} | " + " | ".join(f"{r[k]:.2f}" for k in names) + " |", flush=True)
        print("\nA decode step of the model (process CPU ms, the median of 12 steps per round; rounds alternate "
              "the systems):\n")
        print("| context | system | per round | ratio per round (against) | median ratio |")
        print("|---|---|---|---|---|")
        names = {"persist-q4" if i == 0 else f"persist-q4@{f}": fmt for i, (f, fmt) in enumerate(key_formats.items())}
        for T in [int(x) for x in a.context.split(",")]:
            d = decode_steps(model, T, a.suffix, a.bits, a.group_size, names, rounds=a.decode_rounds)
            for s, r in d.items():
                against = "vllm-default" if s == "persist-q4" else "persist-q4" if s != "vllm-default" else None
                ratios = [y / x for x, y in zip(d[against], r)] if against else []
                print(f"| {T} | {s} | {' '.join(f'{x:.0f}' for x in r)} | "
                      f"{' '.join(f'{x:.3f}' for x in ratios)}{f' ({against})' if against else ''} | "
                      f"{f'{statistics.median(ratios):.3f}' if ratios else ''} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
