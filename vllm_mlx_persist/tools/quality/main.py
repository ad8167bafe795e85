"""`vllm-mlx-persist quality`: what 4-bit KV costs, measured on a model trained here.

Trains a small llama on CPython stdlib sources (`train.py`), then runs it on held-out files with
four KV caches: mlx-lm's full-precision `KVCache` and the project's `Q4KVCache` at 8 bits/group 64,
4 bits/group 64 and 4 bits/group 32 (`make_q4_prompt_cache`, the cache the persist_q4 backend
serves from). Measures held-out perplexity with chunked prefill (later chunks attend over the
quantized cache) and greedy-token agreement with full precision over long generations, free
running and teacher-forced, per sequence (`generate_step`) and batched (`BatchGenerator` merging
the caches into `BatchQ4KVCache`). Writes `quality.md` and `results/quality.json` under `--out`.

The other families (`families.py`) and the options that fix what misses are measured the same way:
the formats in `kv_formats.py`, the measurement in `measure.py`, outlier keys in `outlier_keys.py`,
MLA latents in `mla_latents.py`, the report in `report.py`; this module is the command.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .families import (DEFAULT_CONFIG, FAMILIES, FAMILY_MEASURE, FAMILY_STEPS, GOAL_PCT, OUTLIER_SWEEP, PAPER,
                       QUICK_FAMILY_MEASURE, QUICK_FAMILY_STEPS, SWEEP_MEASURE, Family, family_formats,
                       family_train_config, measure_family, outlier_sweep)
from .kv_formats import SERVED_KEY_CHOICES
from .machine import OPENBLAS, machine_info
from .measure import QUICK_MEASURE, MeasureConfig, token_windows
from .mla_latents import latent_bytes, latent_speed
from .outlier_keys import add_key_outliers, key_channel_stats, outlier_channels
from .real import main as measure_model
from .report import plots, write_markdown
from .train import EVAL_SOURCES, QUICK_CONFIG, TRAIN_SOURCES, TrainConfig, corpus, load_tokenizer, train


def _loss_curve(losses: Sequence[float], points: int = 16) -> list[tuple[int, float]]:
    """(step, mean loss of the steps since the previous point) at about `points` steps."""
    every = max(1, math.ceil(len(losses) / points))
    return [(min(s + every, len(losses)), float(np.mean(losses[s : s + every])))
            for s in range(0, len(losses), every)]


# ---- command -------------------------------------------------------------------------------------


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="vllm-mlx-persist quality",
        description="Train small models of each family on stdlib sources and measure what 4-bit KV costs "
                    "(perplexity, greedy agreement) against full-precision and 8-bit KV, with the options "
                    "that fix what misses (outlier keys, MLA latents).")
    p.add_argument("--render", action="store_true", help="only write <out>/quality.md again from "
                   "<out>/results/quality.json and the real-checkpoint reports in <out>/results/real "
                   "(with their Pareto tables and plots): no measuring")
    p.add_argument("--model", metavar="DIR", help="measure this model directory (a real checkpoint) instead of "
                   "training: see `quality --model DIR --help`")
    p.add_argument("--quick", action="store_true",
                   help="tiny models and measurements (about a minute): for development and smoke tests")
    p.add_argument("--families", help=f"comma-separated, from {', '.join(FAMILIES)} (default: all)")
    p.add_argument("--steps", type=int, help=f"training steps (default {TrainConfig.steps} for llama, "
                                             f"{FAMILY_STEPS} for the others; --quick: {QUICK_CONFIG.steps} and {QUICK_FAMILY_STEPS})")
    p.add_argument("--out", help="where quality.md and results/quality*.{json,png} go "
                                 "(default docs; --quick: .models/quality-quick/report)")
    p.add_argument("--model-dir", help="where the trained llama is saved, the other families beside it "
                                       "as <dir>-<arch> (default .models/quality; --quick: "
                                       ".models/quality-quick/model)")
    p.add_argument("--retrain", action="store_true", help="train even if the model dirs hold these models")
    p.add_argument("--no-batched", action="store_true", help="skip the BatchGenerator comparison")
    p.add_argument("--no-sweep", action="store_true", help="skip the outlier-magnitude sweep")
    p.add_argument("--no-speed", action="store_true", help="skip the MLA latent decode-speed measurement")
    p.add_argument("--eval-seqs", type=int, help="held-out sequences per family (default: the family's measure config)")
    a = p.parse_args(list(argv))
    a.families = [f.strip() for f in a.families.split(",")] if a.families else list(FAMILIES)
    for f in a.families:
        if f not in FAMILIES:
            p.error(f"unknown family {f!r}; choose from {', '.join(FAMILIES)}")
    return a


def _train_dict(trained: Any) -> dict[str, Any]:
    t = trained.to_dict()
    t["final_train_loss"] = float(np.mean(trained.losses[-10:]))
    t["loss_curve"] = _loss_curve(trained.losses)
    return t


def _outlier_conclusion(fr: dict[str, Any], plain: dict[str, Any] | None) -> str:
    p = fr["perplexity"]
    g = lambda k: p[k]["delta_ppl_pct"] if k in p else float("nan")
    b = lambda k: p[k]["kv_bytes_per_token"] if k in p else float("nan")
    text = (f"Measured: at this outlier scale, 4-bit group 64 moves perplexity by {g('q4g64'):+.2f}% "
            + (f"(the plain llama: {plain['perplexity']['q4g64']['delta_ppl_pct']:+.2f}%) " if plain else "")
            + f"and group 32 (served today, {b('q4g32'):.0f} against {b('q4g64'):.0f} bytes/token) by "
            f"{g('q4g32'):+.2f}%. 8-bit keys with 4-bit values: {g('k8v4'):+.2f}% at {b('k8v4'):.0f} bytes/token; "
            f"a Hadamard rotation of the keys: {g('q4g64h'):+.2f}% at group 64 and {g('q4g32h'):+.2f}% at group 32, "
            "no extra bytes")
    if "q4g64s" in p:
        text += f"; calibrated per-channel key scales: {g('q4g64s'):+.2f}% (best case, see above)"
    text += f". The simulated 4-bit group 64 row ({g('q4g64sim'):+.3f}%) checks the simulation against the served cache ({g('q4g64'):+.3f}%)."
    return text


def _latent_conclusion(fr: dict[str, Any] | None, lat: dict[str, Any]) -> str:
    parts = []
    if fr:
        p, g = fr["perplexity"], fr["greedy"]
        d = lambda k: f"{p[k]['delta_ppl_pct']:+.3f}%"
        parts.append(
            f"Fidelity: every token packed, 8-bit latents move perplexity by {d('lat8')} and 4-bit by {d('lat4')} "
            f"(an 8-bit rope key {d('lat4r8')}, Hadamard-rotated {d('lat4h')}, mx.quantize's quantizer "
            f"{d('lat4mlx')}); per turn, as the `latent_bits` option serves them, {d('lat8turn')} and "
            f"{d('lat4turn')}; teacher-forced agreement {100 * g['lat8turn']['teacher_forced_agreement']:.2f}% "
            f"(8-bit) and {100 * g['lat4turn']['teacher_forced_agreement']:.2f}% (4-bit), per turn.")
    big = list(lat["bytes"].values())[-1]
    parts.append(f"Capacity: on a DeepSeek-V3-sized cache the latent goes from {big['float'] / 1024:.1f} KB to "
                 f"{big['8-bit'] / 1024:.2f} KB (8-bit) or {big['4-bit'] / 1024:.2f} KB (4-bit) per token in the "
                 "hot tier and on disk, so the hot tier holds that many times more agents; while an agent runs, "
                 "its live float mirror costs what today's cache costs.")
    sp = lat.get("speed")
    if sp:
        last = sp["rows"][-1]
        parts.append(f"Speed at {last['context']} tokens: decode stays at the float cache's "
                     f"{last['float']:.2f} ms/token (dequantizing every step instead: "
                     f"{last['8-bit, dequantized every step']:.2f} ms at 8-bit, "
                     f"{last['4-bit, dequantized every step']:.2f} ms at 4-bit); the option adds, once per turn, "
                     f"{last['8-bit: build ms']:.1f} / {last['4-bit: build ms']:.1f} ms to build the mirror and "
                     f"{last['8-bit: pack ms']:.1f} / {last['4-bit: pack ms']:.1f} ms to pack at commit (8 / 4-bit).")
    return " ".join(parts)


def main(argv: Sequence[str]) -> int:
    """Train (or reuse) the models, measure, write the report; return the exit status. With
    `--model DIR`: measure a given (real) model instead (real.py)."""
    if any(a == "--model" or a.startswith("--model=") for a in argv):
        return measure_model(argv)
    args = _parse(argv)
    if args.render:
        out = Path(args.out or "docs")
        results = json.loads((out / "results" / "quality.json").read_text())
        write_markdown(results, out)
        print(f"wrote {out / 'quality.md'} from {out / 'results' / 'quality.json'} and {out / 'results' / 'real'}")
        return 0
    t_start = time.perf_counter()
    quick = args.quick
    out = Path(args.out or (".models/quality-quick/report" if quick else "docs"))
    model_dir = Path(args.model_dir or (".models/quality-quick/model" if quick else ".models/quality"))
    log = lambda s: print(s, flush=True)
    if sys.platform == "linux" and os.path.exists(OPENBLAS) and "openblas" not in os.environ.get("LD_PRELOAD", ""):
        log(f"warning: OpenBLAS is not preloaded; float32 runs 15-35x slower. Run with LD_PRELOAD={OPENBLAS}")

    from mlx_lm import load

    from ...caches.attention import install_attention_fix

    install_attention_fix()  # what the persist_q4 backend installs: needed for batched GQA masks
    tokenizer, _ = load_tokenizer((QUICK_CONFIG if quick else DEFAULT_CONFIG).size.vocab)
    eval_tokens, _ = corpus(EVAL_SOURCES, tokenizer)
    train_tokens, _ = corpus(TRAIN_SOURCES, tokenizer)
    calib = token_windows(train_tokens[len(train_tokens) // 2 :], 128 if quick else 1024, 2 if quick else 4)
    seconds: dict[str, float] = {}
    fams: dict[str, dict[str, Any]] = {}
    trained_dirs: dict[str, Path] = {}

    def trained(fam: Family) -> tuple[Any, Path]:
        cfg = family_train_config(fam, quick, args.steps)
        d = model_dir if fam.arch == "llama" else Path(f"{model_dir}-{fam.arch}")
        result = train(cfg, d, force=args.retrain and fam.name not in trained_dirs, log=log)
        trained_dirs[fam.name] = d
        return result, d

    for name in args.families:
        fam = FAMILIES[name]
        src = FAMILIES[fam.derived_from] if fam.derived_from else fam
        result, d = trained(src) if src.name not in trained_dirs else (None, trained_dirs[src.name])
        model, _ = load(str(d))  # the saved model, as vllm-mlx would load it
        entry: dict[str, Any] = {}
        if fam.outliers is not None:
            plain = key_channel_stats(model, calib)
            add_key_outliers(model, fam.outliers)
            stats = key_channel_stats(model, calib)
            D = model.args.head_dim or model.args.hidden_size // model.args.num_attention_heads
            med = lambda st: float(np.median([x for layer in st["max_over_median"] for x in layer]))
            fams_o = {"spec": asdict(fam.outliers), "channels": outlier_channels(D, fam.outliers.pairs),
                      "head_dim": D, "plain_ratio": med(plain), "outlier_ratio": med(stats),
                      "max_over_median": stats["max_over_median"]}
            entry["derived"] = (f"Derived from the {src.name} model (no training): outlier channels put into "
                                "its keys, see below.")
        mcfg = QUICK_MEASURE if quick else (MeasureConfig() if name == "llama" else FAMILY_MEASURE)
        if quick and name != "llama":
            mcfg = QUICK_FAMILY_MEASURE
        if args.no_batched:
            mcfg = replace(mcfg, batched=False)
        if args.eval_seqs:
            mcfg = replace(mcfg, eval_seqs=args.eval_seqs)
        formats = family_formats(fam, model, calib, tokenizer)
        fr = measure_family(fam, model, eval_tokens, mcfg, formats, log=log)
        fr.update(entry)
        if fam.arch == "gemma3_text":
            fr["sliding_window"] = model.args.sliding_window
        if result is not None and src is fam:
            fr["training"] = _train_dict(result)
        fams[name] = fr
        seconds[name] = fr["seconds"]["perplexity"] + fr["seconds"]["greedy"]
        if fam.outliers is not None and SERVED_KEY_CHOICES:
            fr["key_format_auto"] = SERVED_KEY_CHOICES[-1].get("auto", (None, None))[1]
        if fam.outliers is not None:
            fams_o["conclusion"] = _outlier_conclusion(fr, fams.get("llama"))
            fr["outliers"] = fams_o

    results: dict[str, Any] = {"machine": machine_info(), "families": fams, "paper": PAPER, "goal_pct": GOAL_PCT}
    if "llama_outliers" in fams:
        results["outliers"] = fams["llama_outliers"].pop("outliers")
        if not args.no_sweep:
            t0 = time.perf_counter()
            mcfg = QUICK_FAMILY_MEASURE if quick else SWEEP_MEASURE
            sweep = outlier_sweep(trained_dirs["llama"], eval_tokens, calib, mcfg, (1.0, *OUTLIER_SWEEP), log=log)
            for row in sweep:
                row["seqs"] = min(mcfg.eval_seqs, len(eval_tokens) // mcfg.eval_len)
            results["outliers"]["sweep"] = sweep
            seconds["sweep"] = time.perf_counter() - t0
    if "deepseek_v3" in fams:
        margs = load(str(trained_dirs["deepseek_v3"]))[0].args
        lat: dict[str, Any] = {
            "model": {"kv_lora_rank": margs.kv_lora_rank, "qk_rope_head_dim": margs.qk_rope_head_dim},
            "bytes": {
                f"this model ({margs.num_hidden_layers} layers, float32)":
                    latent_bytes(margs.kv_lora_rank, margs.qk_rope_head_dim, margs.num_hidden_layers, 4),
                "DeepSeek-V3 (61 layers, latent 512 + rope 64, bfloat16)": latent_bytes(512, 64, 61, 2),
            }}
        if not args.no_speed:
            t0 = time.perf_counter()
            lat["speed"] = latent_speed((128, 256) if quick else (1024, 4096), steps=3 if quick else 8,
                                        quick=quick, log=log)
            seconds["latent_speed"] = time.perf_counter() - t0
        lat["conclusion"] = _latent_conclusion(fams["deepseek_v3"], lat)
        results["latent"] = lat

    command = "vllm-mlx-persist quality" + "".join(" " + shlex.quote(a) for a in argv)
    if sys.platform == "linux":
        command = f"LD_PRELOAD={OPENBLAS} {command}"
    results = {"command": command, **results}
    seconds["total"] = time.perf_counter() - t_start
    results["seconds"] = seconds
    (out / "results").mkdir(parents=True, exist_ok=True)
    results = json.loads(json.dumps(results, default=_json_default))
    results["plots"] = plots(results, out / "results")
    (out / "results" / "quality.json").write_text(json.dumps(results, indent=1) + "\n")
    write_markdown(results, out)

    log("")
    log(f"{'family':15s} {'KV cache':44s} {'ppl':>9s} {'Δ %':>8s} {'teacher-forced':>15s}")
    for fname, fr in fams.items():
        for name, p in fr["perplexity"].items():
            g = fr["greedy"][name]
            log(f"{fname:15s} {p['label'][:44]:44s} {p['ppl']:9.4f} {p['delta_ppl_pct']:+7.3f}% "
                f"{100 * g['teacher_forced_agreement']:14.2f}%")
    log(f"wrote {out / 'quality.md'} and {out / 'results' / 'quality.json'}")
    log(f"command: {command}")
    return 0


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(type(o).__name__)
