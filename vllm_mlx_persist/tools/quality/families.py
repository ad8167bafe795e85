"""The model families `vllm-mlx-persist quality` trains and measures, and the rows of each one's tables.

`FAMILIES`: llama, gemma3_text, qwen3_next, deepseek_v3 (each trained here, `family_train_config`)
and llama_outliers (llama with outlier key channels). `family_formats` gives a family's KV formats
(served and simulated), `measure_family` its perplexity and greedy agreement, `outlier_sweep` the
perplexity change as the outlier channels grow.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .kv_formats import FORMATS, FULL, KVFormat, QSpec, served_key_formats, sim_format
from .measure import QUICK_MEASURE, MeasureConfig, agreement, perplexity, token_prompts, token_windows
from .mla_latents import per_turn_latent_format
from .outlier_keys import Outliers, add_key_outliers, key_channel_stats
from .train import QUICK_CONFIG, TrainConfig, family_overrides

DEFAULT_CONFIG = TrainConfig()


@dataclass(frozen=True)
class Family:
    """A model family measured by `quality`: trained here (`arch`), or `derived_from` another
    family's trained model (`outliers` put into its keys)."""

    name: str
    title: str
    arch: str
    quantized: str  # which layers the persist_q4 backend keeps in 4-bit, in words
    derived_from: str | None = None
    outliers: Outliers | None = None


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", "Llama (plain attention, grouped-query)", "llama",
           "every layer's K and V"),
    Family("gemma3_text", "Gemma 3 (sliding-window and global attention)", "gemma3_text",
           "K and V of every layer, sliding ones included (sliding ones hold only their window, as the server keeps them)"),
    Family("qwen3_next", "Qwen3-Next (hybrid: gated-delta linear attention and attention)", "qwen3_next",
           "K and V of the attention layers; the linear-attention layers' recurrent state stays in the model's dtype"),
    Family("deepseek_v3", "DeepSeek-V3 (multi-head latent attention)", "deepseek_v3",
           "nothing: the MLA latent and rope key stay in the model's dtype (item 5 measures quantizing them)"),
    Family("llama_outliers", "Llama with outlier key channels (Qwen2-like keys)", "llama",
           "every layer's K and V", derived_from="llama", outliers=Outliers()),
)}

# Issue #24 / the seed paper's Table 9: perplexity with mlx-lm's QuantizedKVCache, 4-bit group 64,
# against FP16 (7,935 WikiText-2 tokens, 512-token windows, stride 256). The paper's DeepSeek is
# DeepSeek-V2-Lite, whose mlx-lm class expands the latent into per-head K/V and quantizes those.
PAPER = {
    "gemma3_text": {"model": "Gemma 3 12B", "fp": 14.40, "q4": 14.30, "delta_pct": -0.7},
    "llama": {"model": "Llama 3.1 8B", "fp": 4.28, "q4": 4.40, "delta_pct": 2.8},
    "deepseek_v3": {"model": "DeepSeek-V2-Lite 16B (expanded K/V)", "fp": 6.26, "q4": 6.45, "delta_pct": 3.0},
}
GOAL_PCT = 1.0  # issue #24: within +1% perplexity at 4-bit on every family

FAMILY_STEPS = 800  # training steps of the families other than llama (llama keeps its 2000): keeps the full run near 35 minutes on 2 cores
SLIDING_WINDOW = 128  # gemma3_text's window: held-out sequences are 8 windows long
QUICK_SLIDING_WINDOW = 32
# --quick's other families train this many steps (llama keeps QUICK_CONFIG's 150: the outlier
# assertions rest on its trained keys). Theirs only need a model that has learnt something (held-out
# loss 5.2-5.5 at 20 steps against 6.24 for a uniform guess, on four BLAS kernels): 20 steps are an
# eighth of llama's training time, the thing the quick run spends most on without OpenBLAS.
QUICK_FAMILY_STEPS = 20
OUTLIER_SWEEP = (4.0, 16.0, 64.0)  # outlier scales of the sweep (1.0 is plain llama)
FAMILY_MEASURE = MeasureConfig(eval_seqs=16, prompts=4, gen_len=256, batched=False, free_running=False)
SWEEP_MEASURE = replace(FAMILY_MEASURE, eval_seqs=8)
QUICK_FAMILY_MEASURE = replace(QUICK_MEASURE, eval_seqs=2, prompts=1, gen_len=24, batched=False,
                               free_running=False)


def family_train_config(family: Family, quick: bool, steps: int | None = None) -> TrainConfig:
    """What `family` trains (llama: the original quality model; others: the same size, the
    family's config keys, FAMILY_STEPS steps; --quick: QUICK_FAMILY_STEPS)."""
    base = QUICK_CONFIG if quick else DEFAULT_CONFIG
    if family.arch != "llama":
        window = QUICK_SLIDING_WINDOW if quick else SLIDING_WINDOW
        base = replace(base, arch=family.arch, steps=QUICK_FAMILY_STEPS if quick else FAMILY_STEPS,
                       overrides=family_overrides(family.arch, base.size.layers, window))
    return replace(base, steps=steps) if steps is not None else base


def _fp_label(model: Any) -> str:
    from mlx_lm.models.cache import make_prompt_cache

    kinds = sorted({type(c).__name__ for c in make_prompt_cache(model)}, key=lambda n: n != "KVCache")
    return f"float32 (mlx-lm {' + '.join(kinds)})"


# The hook for caches that are not written yet (the bounded 4-bit cache of sliding layers, issue
# #24): `add_cache_format("gemma3_text", KVFormat("q4g64-bounded", "4-bit, group 64, sliding
# layers bounded to the window", factory=lambda model: <one fresh cache per layer>))` adds a row to
# that family's tables in the next run (from a plugin or a wrapper script calling `main`).
EXTRA_FORMATS: dict[str, list[KVFormat]] = {}


def add_cache_format(family: str, fmt: KVFormat) -> None:
    """Add `fmt` (built by its `factory(model)`: a fresh per-sequence cache, one entry per layer)
    to the measured formats of `family` (a name of FAMILIES)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    EXTRA_FORMATS.setdefault(family, []).append(fmt)


def family_formats(family: Family, model: Any, calib: np.ndarray | None = None,
                   tokenizer: Any = None) -> list[KVFormat]:
    """The rows of `family`'s tables: full precision first, the served formats, then the options
    measured for it (simulated), the served key formats (outlier keys, given a `tokenizer`), then
    any `add_cache_format` rows."""
    fp = replace(FULL, label=_fp_label(model))
    served = [fp, *FORMATS[1:]]
    q4, q8 = QSpec(4, 64), QSpec(8, 64)
    if family.name == "deepseek_v3":
        l4, l8 = QSpec(4, method="minmax"), QSpec(8, method="minmax")
        fmts = [fp,
                sim_format("lat8", "latent 8-bit, every token packed", l8, l8, latent=True),
                sim_format("lat4", "latent 4-bit, every token packed", l4, l4, latent=True),
                per_turn_latent_format("lat8turn", "latent 8-bit, per turn (the latent_bits option)", 8),
                per_turn_latent_format("lat4turn", "latent 4-bit, per turn (the latent_bits option)", 4),
                sim_format("lat4r8", "latent 4-bit, rope key 8-bit, every token", l4, l8, latent=True),
                sim_format("lat4h", "latent 4-bit, Hadamard-rotated, every token",
                           replace(l4, transform="hadamard"), replace(l4, transform="hadamard"), latent=True),
                sim_format("lat4mlx", "latent 4-bit, mx.quantize group 64, every token", q4, q4, latent=True)]
    elif family.outliers is not None:
        scales = key_channel_stats(model, calib)["scales"] if calib is not None else None
        fmts = served + [
            sim_format("q4g64sim", "4-bit, group 64 (simulated: check)", q4, q4),
            sim_format("k8v4", "keys 8-bit, values 4-bit", q8, q4),
            sim_format("q4g64h", "4-bit, group 64, Hadamard-rotated keys", QSpec(4, 64, "hadamard"), q4),
            sim_format("q4g32h", "4-bit, group 32, Hadamard-rotated keys", QSpec(4, 32, "hadamard"), QSpec(4, 32)),
        ]
        if scales is not None:
            fmts.append(sim_format("q4g64s", "4-bit, group 64, per-channel key scales", QSpec(4, 64, "scaled"),
                                   q4, key_scales=scales))
        if tokenizer is not None:
            fmts += served_key_formats(tokenizer)
    elif family.name == "llama":
        fmts = served + [sim_format("k8v4", "keys 8-bit, values 4-bit", q8, q4),
                         sim_format("q4g64h", "4-bit, group 64, Hadamard-rotated keys",
                                    QSpec(4, 64, "hadamard"), q4)]
    else:
        fmts = served
    return fmts + EXTRA_FORMATS.get(family.name, [])


def measure_family(family: Family, model: Any, eval_tokens: np.ndarray, mcfg: MeasureConfig,
                   formats: Sequence[KVFormat], log: Callable[[str], None] = print) -> dict[str, Any]:
    """Perplexity and greedy agreement of `formats` on `model` (see `perplexity`, `agreement`)."""
    windows = token_windows(eval_tokens, mcfg.eval_len, mcfg.eval_seqs)
    mcfg = replace(mcfg, eval_seqs=len(windows))
    log(f"[{family.name}] perplexity: {len(windows)} held-out sequences of {mcfg.eval_len} tokens, "
        f"{len(formats)} formats")
    t0 = time.perf_counter()
    ppl = perplexity(model, windows, mcfg.chunk, formats, log=log)
    t_ppl = time.perf_counter() - t0
    t0 = time.perf_counter()
    prompts = token_prompts(eval_tokens, mcfg)
    log(f"[{family.name}] greedy: {len(prompts)} prompts of {mcfg.prompt_len} tokens, {mcfg.gen_len} tokens each")
    agr = agreement(model, prompts, mcfg, formats, log=log)
    return {"title": family.title, "arch": family.arch, "quantized": family.quantized,
            "measure_config": asdict(mcfg), "perplexity": ppl, "greedy": agr,
            "seconds": {"perplexity": t_ppl, "greedy": time.perf_counter() - t0}}


def outlier_sweep(model_dir: Path, eval_tokens: np.ndarray, calib: np.ndarray, mcfg: MeasureConfig,
                  scales: Sequence[float], log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Perplexity change of the 4-bit formats and their fixes as the outlier channels grow:
    the llama at `model_dir` with `Outliers(scale=s)` for each s (1: no outliers)."""
    from mlx_lm import load

    windows = token_windows(eval_tokens, mcfg.eval_len, mcfg.eval_seqs)
    out = []
    for s in scales:
        model, _ = load(str(model_dir))
        if s != 1:
            add_key_outliers(model, replace(Outliers(), scale=s))
        stats = key_channel_stats(model, calib)
        q4, q8 = QSpec(4, 64), QSpec(8, 64)
        fmts = [replace(FULL, label="float32"), FORMATS[1], FORMATS[2],
                sim_format("k8v4", "keys 8-bit, values 4-bit", q8, q4),
                sim_format("q4g64h", "4-bit, group 64, Hadamard-rotated keys", QSpec(4, 64, "hadamard"), q4),
                sim_format("q4g64s", "4-bit, group 64, per-channel key scales", QSpec(4, 64, "scaled"), q4,
                           key_scales=stats["scales"])]
        log(f"[outlier sweep] scale {s:g}")
        ppl = perplexity(model, windows, mcfg.chunk, fmts, log=lambda _: None)
        ratio = float(np.median([r for layer in stats["max_over_median"] for r in layer]))
        out.append({"scale": s, "key_max_over_median": ratio,
                    "ppl": {k: {"delta_ppl_pct": v["delta_ppl_pct"], "ppl": v["ppl"], "label": v["label"],
                                "delta_nll_sem": v["delta_nll_sem"]} for k, v in ppl.items()}})
        log("  " + "  ".join(f"{k} {v['delta_ppl_pct']:+.2f}%" for k, v in ppl.items()))
    return out
