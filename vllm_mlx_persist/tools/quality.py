"""`vllm-mlx-persist quality`: what 4-bit KV costs, measured on a model trained here.

Trains a small llama on CPython stdlib sources (`train.py`), then runs it on held-out files with
four KV caches: mlx-lm's full-precision `KVCache` and the project's `Q4KVCache` at 8 bits/group 64,
4 bits/group 64 and 4 bits/group 32 (`make_q4_prompt_cache`, the cache the persist_q4 backend
serves from). Measures held-out perplexity with chunked prefill (later chunks attend over the
quantized cache) and greedy-token agreement with full precision over long generations, free
running and teacher-forced, per sequence (`generate_step`) and batched (`BatchGenerator` merging
the caches into `BatchQ4KVCache`). Writes `quality.md` and `results/quality.json` under `--out`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .serving import cpu_name
from .train import EVAL_SOURCES, QUALITY_SIZE, QUICK_CONFIG, TrainConfig, corpus, load_tokenizer, train

OPENBLAS = f"/usr/lib/{platform.machine()}-linux-gnu/openblas-pthread/libblas.so.3"


@dataclass(frozen=True)
class KVFormat:
    name: str
    label: str
    bits: int | None = None  # None: mlx-lm's full-precision KVCache
    group_size: int | None = None

    def make_cache(self, model: Any) -> list:
        from mlx_lm.models.cache import make_prompt_cache

        from ..q4cache import make_q4_prompt_cache

        if self.bits is None:
            return make_prompt_cache(model)
        return make_q4_prompt_cache(model, bits=self.bits, group_size=self.group_size)


FULL = KVFormat("fp32", "float32 (mlx-lm KVCache)")
FORMATS = (
    FULL,
    KVFormat("q8g64", "8-bit, group 64", 8, 64),
    KVFormat("q4g64", "4-bit, group 64", 4, 64),
    KVFormat("q4g32", "4-bit, group 32", 4, 32),
)


@dataclass(frozen=True)
class MeasureConfig:
    eval_len: int = 1024  # tokens per held-out sequence (= the training context)
    chunk: int = 256  # prefill step
    eval_seqs: int = 32
    prompts: int = 8
    prompt_len: int = 256
    gen_len: int = 512
    batched: bool = True


QUICK_MEASURE = MeasureConfig(eval_len=128, chunk=32, eval_seqs=4, prompts=2, prompt_len=32, gen_len=48)


# ---- perplexity ----------------------------------------------------------------------------------


def _logprobs(model: Any, tokens: np.ndarray, cache: list, chunk: int) -> Any:
    """Log-probabilities (len(tokens), vocab) from a chunked prefill of `tokens` into `cache`."""
    import mlx.core as mx

    out = []
    for s in range(0, len(tokens), chunk):
        logits = model(mx.array(tokens[None, s : s + chunk]), cache=cache)[0]
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(lp)
        out.append(lp)
    return mx.concatenate(out)


def perplexity(model: Any, windows: np.ndarray, chunk: int, formats: Sequence[KVFormat] = FORMATS,
               log: Callable[[str], None] = print) -> dict[str, dict[str, Any]]:
    """Held-out perplexity of each format over `windows` (n, L), each prefilled `chunk` tokens at a
    time into a fresh cache, with KL(full || format) and argmax agreement with full precision."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    tree_leaves = lambda t: [x for _, x in tree_flatten(t)]
    n, L = windows.shape
    n_chunks = -(-(L - 1) // chunk)
    acc = {f.name: {"nll": [], "kl": 0.0, "top1": 0, "by_chunk": np.zeros(n_chunks), "kv_bytes": 0}
           for f in formats}
    for i, w in enumerate(windows):
        targets = mx.array(w[1:])[:, None]
        ref = None
        for f in formats:
            cache = f.make_cache(model)
            lp = _logprobs(model, w, cache, chunk)[:-1]  # position t predicts token t + 1
            nll = -mx.take_along_axis(lp, targets, axis=-1)[:, 0]
            if ref is None:
                ref = lp
            kl = (mx.exp(ref) * (ref - lp)).sum(axis=-1).sum()
            top1 = (mx.argmax(lp, axis=-1) == mx.argmax(ref, axis=-1)).sum()
            nll_np = np.array(nll, dtype=np.float64)
            a = acc[f.name]
            a["nll"].append(nll_np.mean())
            a["kl"] += kl.item()
            a["top1"] += top1.item()
            for c in range(n_chunks):
                a["by_chunk"][c] += nll_np[c * chunk : (c + 1) * chunk].sum()
            a["kv_bytes"] = sum(x.nbytes for x in tree_leaves([c.state for c in cache]))
        log(f"  perplexity: sequence {i + 1}/{n} " + "  ".join(
            f"{f.name} {math.exp(acc[f.name]['nll'][-1]):.3f}" for f in formats))

    count = n * (L - 1)
    base = np.array(acc[formats[0].name]["nll"])
    results = {}
    for f in formats:
        a = acc[f.name]
        per_seq = np.array(a["nll"])  # every window predicts L - 1 tokens: equal weights
        nll = per_seq.mean()
        d = per_seq - base
        chunk_counts = np.array([min(chunk, L - 1 - c * chunk) for c in range(n_chunks)]) * n
        results[f.name] = {
            "label": f.label,
            "bits": f.bits,
            "group_size": f.group_size,
            "nll": nll,
            "ppl": math.exp(nll),
            "delta_nll": d.mean(),
            "delta_nll_sem": d.std(ddof=1) / math.sqrt(n) if n > 1 else 0.0,
            "kl_from_full": a["kl"] / count,
            "argmax_agreement": a["top1"] / count,
            "ppl_by_chunk": [math.exp(s / c) for s, c in zip(a["by_chunk"], chunk_counts)],
            "kv_bytes_per_token": a["kv_bytes"] / L,
        }
    full = results[formats[0].name]["ppl"]
    for r in results.values():
        r["delta_ppl"] = r["ppl"] - full
        r["delta_ppl_pct"] = 100 * (r["ppl"] / full - 1)
    return results


# ---- greedy agreement ----------------------------------------------------------------------------


def greedy(model: Any, prompt: Sequence[int], n: int, cache: list, chunk: int) -> list[int]:
    """`n` greedy tokens after `prompt` through mlx-lm's `generate_step` on `cache`."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    sampler = lambda lp: mx.argmax(lp, axis=-1)
    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=sampler,
                          prompt_cache=cache, prefill_step_size=chunk)
    return [tok for tok, _ in steps]


def teacher_forced(model: Any, prompt: Sequence[int], reference: Sequence[int], cache: list,
                   chunk: int) -> tuple[list[int], list[float]]:
    """Decode `reference` one token at a time after a chunked prefill of `prompt` (as
    generate_step does) and return this cache's argmax at each position, and the top-2 logprob
    margin there."""
    import mlx.core as mx

    for s in range(0, len(prompt) - 1, chunk):
        model(mx.array([prompt[s : min(s + chunk, len(prompt) - 1)]]), cache=cache)
        mx.eval([c.state for c in cache])
    preds, margins = [], []
    for tok in [prompt[-1], *reference[:-1]]:
        logits = model(mx.array([[tok]]), cache=cache)[0, -1]
        top2 = mx.topk(logits, 2)
        pred = mx.argmax(logits)
        mx.eval(pred, top2)
        preds.append(pred.item())
        margins.append(abs(top2[0].item() - top2[1].item()))
    return preds, margins


def batched_greedy(model: Any, prompts: Sequence[Sequence[int]], n: int, fmt: KVFormat,
                   chunk: int) -> list[list[int]]:
    """Greedy tokens for all `prompts` at once through mlx-lm's `BatchGenerator`; quantized formats
    insert per-sequence `Q4KVCache`s, which it merges into one `BatchQ4KVCache`."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=n, prefill_step_size=chunk,
                         completion_batch_size=len(prompts), prefill_batch_size=len(prompts))
    caches = None if fmt.bits is None else [fmt.make_cache(model) for _ in prompts]
    uids = gen.insert([list(p) for p in prompts], max_tokens=[n] * len(prompts), caches=caches)
    out: dict[int, list[int]] = {u: [] for u in uids}
    done = 0
    try:
        while done < len(uids):
            for r in gen.next_generated():
                out[r.uid].append(r.token)
                done += r.finish_reason is not None
    finally:
        gen.close()
    return [out[u] for u in uids]


def _first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(model: Any, prompts: Sequence[Sequence[int]], cfg: MeasureConfig,
              formats: Sequence[KVFormat] = FORMATS,
              log: Callable[[str], None] = print) -> dict[str, dict[str, Any]]:
    """Greedy agreement of each format with full precision over `cfg.gen_len` tokens per prompt."""
    n = cfg.gen_len
    ref = [greedy(model, p, n, FULL.make_cache(model), cfg.chunk) for p in prompts]
    ref_margins = []
    results = {}
    for f in formats:
        free = ref if f is FULL else [greedy(model, p, n, f.make_cache(model), cfg.chunk) for p in prompts]
        div = [_first_divergence(a, b) for a, b in zip(free, ref)]
        matches, mismatch_margins = 0, []
        for i, (p, r) in enumerate(zip(prompts, ref)):
            preds, margins = teacher_forced(model, p, r, f.make_cache(model), cfg.chunk)
            if f is FULL:
                ref_margins.append(margins)
            ok = [a == b for a, b in zip(preds, r)]
            matches += sum(ok)
            mismatch_margins += [ref_margins[i][t] for t, good in enumerate(ok) if not good]
        res = {
            "label": f.label,
            "first_divergence": div,
            "prefix_match": float(np.mean(div)) / n,
            "identical_prompts": sum(d == n for d in div),
            "teacher_forced_agreement": matches / (n * len(prompts)),
            "mismatch_fp_margin_median": float(np.median(mismatch_margins)) if mismatch_margins else None,
        }
        if cfg.batched:
            batched = batched_greedy(model, prompts, n, f, cfg.chunk)
            bdiv = [_first_divergence(a, b) for a, b in zip(batched, free)]
            res["batched_vs_per_sequence_prefix_match"] = float(np.mean(bdiv)) / n
            res["batched_first_divergence_vs_full"] = [_first_divergence(a, b) for a, b in zip(batched, ref)]
        results[f.name] = res
        log(f"  greedy {f.name}: teacher-forced agreement {res['teacher_forced_agreement']:.4f}, "
            f"free-running prefix match {res['prefix_match']:.4f} (first divergence at {div})")
    all_margins = [m for ms in ref_margins for m in ms]
    results["_full_margin_median"] = float(np.median(all_margins)) if all_margins else None
    return results


# ---- report --------------------------------------------------------------------------------------


def _machine() -> dict[str, Any]:
    import mlx.core as mx
    import mlx_lm

    return {
        "system": f"{platform.system()} {platform.machine()}",
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "device": str(mx.default_device().type).removeprefix("DeviceType."),
        "openblas_preloaded": "openblas" in os.environ.get("LD_PRELOAD", ""),
    }


def _loss_curve(losses: Sequence[float], points: int = 16) -> list[tuple[int, float]]:
    """(step, mean loss of the steps since the previous point) at about `points` steps."""
    every = max(1, math.ceil(len(losses) / points))
    return [(min(s + every, len(losses)), float(np.mean(losses[s : s + every])))
            for s in range(0, len(losses), every)]


def render_markdown(r: dict[str, Any]) -> str:
    """docs/quality.md from the results dict."""
    t, m, mc = r["training"], r["machine"], r["measure_config"]
    tc = t["config"]
    size = tc["size"]
    ppl, agr = r["perplexity"], r["greedy"]
    lines = [
        "# Quality of 4-bit KV",
        "",
        "What keeping the KV cache in 4-bit form costs in model quality, measured on a small model",
        "trained here, through the project's own cache classes. Generated by",
        "`vllm-mlx-persist quality` (`vllm_mlx_persist/tools/quality.py`, training in",
        "`vllm_mlx_persist/tools/train.py`); the numbers below are in `docs/results/quality.json`.",
        "",
        "## Command",
        "",
        "```",
        r["command"],
        "```",
        "",
        f"Machine: {m['system']}, {m['cpu']}, {m['cores']} cores, Python {m['python']}, "
        f"mlx {m['mlx']} ({m['device']}), mlx-lm {m['mlx_lm']}, OpenBLAS preloaded: "
        f"{'yes' if m['openblas_preloaded'] else 'no'}. Training took {t['train_seconds']:.0f} s"
        + (" (in an earlier run of the same command; this run reused the saved model)" if t["reused"] else "")
        + f"; measuring took {r['seconds']['perplexity']:.0f} s (perplexity) and "
        f"{r['seconds']['greedy']:.0f} s (greedy); this run's wall time was {r['seconds']['total']:.0f} s.",
        "",
        "Run it from the repository root after `./dev test` (or any set-up that installed the",
        "package). On Linux preload OpenBLAS as above: the bundled BLAS is 15-35x slower. The trained",
        "model is saved under `.models/quality/` (not committed) and reused by later runs with the same",
        "training config; `--retrain` trains again. `--quick` runs a tiny version in seconds.",
        "",
        "## Results",
        "",
        f"Held-out perplexity over {mc['eval_seqs']} sequences of {mc['eval_len']} tokens "
        f"({mc['eval_seqs'] * (mc['eval_len'] - 1)} predicted tokens), each prefilled "
        f"{mc['chunk']} tokens at a time into a fresh cache:",
        "",
        "| KV cache | bytes/token | perplexity | Δ ppl | Δ ppl % | Δ NLL (nats/token) ± s.e. | "
        "KL(full ‖ q) | argmax = full |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, p in ppl.items():
        lines.append(
            f"| {p['label']} | {p['kv_bytes_per_token']:.0f} | {p['ppl']:.4f} | {p['delta_ppl']:+.4f} | "
            f"{p['delta_ppl_pct']:+.3f}% | {p['delta_nll']:+.5f} ± {p['delta_nll_sem']:.5f} | "
            f"{p['kl_from_full']:.5f} | {100 * p['argmax_agreement']:.2f}% |"
        )
    n, P = mc["gen_len"], mc["prompts"]
    lines += [
        "",
        f"Greedy agreement with full precision: {P} held-out prompts of {mc['prompt_len']} tokens, "
        f"{n} generated tokens each:",
        "",
        "| KV cache | teacher-forced agreement | free-running: matched prefix | prompts identical "
        "to the end | first divergence per prompt |"
        + (" batched = per-sequence |" if mc["batched"] else ""),
        "|---|---:|---:|---:|---|" + ("---:|" if mc["batched"] else ""),
    ]
    for name, g in agr.items():
        if name.startswith("_"):
            continue
        row = (f"| {g['label']} | {100 * g['teacher_forced_agreement']:.2f}% | "
               f"{100 * g['prefix_match']:.1f}% | {g['identical_prompts']}/{P} | "
               f"{', '.join(map(str, g['first_divergence']))} |")
        if mc["batched"]:
            row += f" {100 * g['batched_vs_per_sequence_prefix_match']:.1f}% |"
        lines.append(row)
    q4 = ppl.get("q4g64", {})
    q8 = ppl.get("q8g64", {})
    lines += [
        "",
        "- **Teacher-forced agreement**: at every position of the full-precision generation, the",
        "  quantized run is fed the full-precision prefix (decoding one token at a time on its own",
        "  cache) and its argmax is compared with the full-precision token. This is the fair",
        "  per-token metric: one early flip does not count every later token as wrong. The",
        "  full-precision row is a control (same loop, should be 100%).",
        "- **Matched prefix**: free-running greedy generation (mlx-lm `generate_step`); the share of",
        "  the generated tokens before the first token that differs from full precision, averaged",
        "  over prompts. After a divergence the two texts are different texts, so later positions",
        "  say nothing about the cache; this number is dominated by when the first near-tie flips.",
    ]
    margin = agr.get("_full_margin_median")
    mism = {k: g.get("mismatch_fp_margin_median") for k, g in agr.items() if not k.startswith("_")}
    if margin is not None and any(v is not None for v in mism.values()):
        lines.append(
            f"- Where teacher-forced tokens differ, full precision's own top-2 logit margin there has "
            f"median {', '.join(f'{v:.3f} ({k})' for k, v in mism.items() if v is not None)}, against "
            f"{margin:.3f} over all positions: the flips are near-ties.")
    if mc["batched"]:
        lines.append(
            "- **Batched = per-sequence**: the same prompts generated together through mlx-lm's "
            "`BatchGenerator` (quantized formats: per-sequence `Q4KVCache`s merged into one "
            "`BatchQ4KVCache`, the path the persist_q4 backend serves through); the share of tokens "
            "before the batched output first differs from the per-sequence output of the same cache.")
    lines += [
        "",
        f"Perplexity by position in the sequence (prefill chunk of {mc['chunk']} tokens; later "
        "chunks attend over more quantized cache):",
        "",
        "| KV cache | " + " | ".join(
            f"tokens {c * mc['chunk'] + 1}-{min((c + 1) * mc['chunk'], mc['eval_len'] - 1)}"
            for c in range(len(ppl["fp32"]["ppl_by_chunk"]))) + " |",
        "|---|" + "---:|" * len(ppl["fp32"]["ppl_by_chunk"]),
    ]
    for p in ppl.values():
        lines.append(f"| {p['label']} | " + " | ".join(f"{x:.3f}" for x in p["ppl_by_chunk"]) + " |")
    if q4 and q8:
        q4b = ppl["q4g32"]
        order = sorted((p for p in ppl.values() if p["bits"]), key=lambda p: p["kl_from_full"])
        lines += [
            "",
            "By KL divergence from full precision the formats rank "
            + " < ".join(f"{p['label']} ({p['kl_from_full']:.5f})" for p in order)
            + f". The two 4-bit perplexity deltas differ by {abs(q4['delta_nll'] - q4b['delta_nll']):.5f} "
            f"nats/token, against standard errors of {q4['delta_nll_sem']:.5f} and "
            f"{q4b['delta_nll_sem']:.5f}: perplexity alone does not separate group 32 from group 64 "
            "on this model; KL and argmax agreement are the finer measures.",
            "",
            f"In short: 8-bit KV changes held-out perplexity by {q8['delta_ppl_pct']:+.3f}% "
            f"({q8['delta_ppl']:+.4f}), 4-bit group 64 by {q4['delta_ppl_pct']:+.3f}% "
            f"({q4['delta_ppl']:+.4f}) and 4-bit group 32 by "
            f"{ppl['q4g32']['delta_ppl_pct']:+.3f}% ({ppl['q4g32']['delta_ppl']:+.4f}), against a "
            f"full-precision perplexity of {ppl['fp32']['ppl']:.3f}.",
        ]
    lines += [
        "",
        "## Method",
        "",
        "- **Model**: mlx-lm's `llama` model class, "
        f"{size['layers']} layers, hidden {size['hidden']}, {size['heads']} query heads over "
        f"{size['kv_heads']} KV heads (grouped-query attention) of dim {size['head_dim']}, MLP "
        f"{size['intermediate']}, vocabulary {size['vocab']}, untied embeddings, float32: "
        f"{t['params'] / 1e6:.2f}M parameters. Tokenizer: the project's byte-level BPE "
        "(`models.train_tokenizer`).",
        f"- **Text**: CPython {m['python']} standard library sources. Training: "
        f"{len(t['train_files'])} files ({t['train_tokens']} tokens; the list is "
        "`train.TRAIN_SOURCES`, which includes the tokenizer's files). Held out: "
        f"{len(t['eval_files'])} other files ({t['eval_tokens']} tokens): "
        f"{', '.join(t['eval_files'])}. Files are joined with the end-of-text token.",
        f"- **Training**: {tc['steps']} AdamW steps (betas 0.9/0.95, weight decay "
        f"{tc['weight_decay']}) of {tc['batch']} x {tc['seq_len']} tokens ({t['tokens_seen']} "
        f"tokens seen), learning rate {tc['lr']} after {tc['warmup']} warm-up steps, cosine decay to "
        f"{tc['lr'] * tc['min_lr_ratio']:.1e}, gradient clipping at {tc['grad_clip']}, "
        f"`nn.value_and_grad` and `mlx.optimizers.AdamW`. Deterministic: weights drawn from numpy's "
        f"PCG64 at seed {tc['seed']}, windows of the corpus in a seeded permuted order, "
        "`mx.random.seed`; two runs on one machine give byte-identical weights.",
        f"- **Training result**: {t['train_seconds']:.0f} s, final training loss "
        f"{t['final_train_loss']:.3f} nats (mean of the last 10 steps), held-out loss "
        f"{t['heldout_loss']:.3f} nats (perplexity {math.exp(t['heldout_loss']):.2f}; full "
        "sequences in one pass, no cache). Uniform guessing would be "
        f"{math.log(size['vocab']):.2f} nats and a bigram count model of the training tokens gets "
        f"{t['bigram_heldout_loss']:.3f}: the model uses its context. Loss curve (mean over each "
        "span of steps):",
        "",
        "  | step | " + " | ".join(str(s) for s, _ in t["loss_curve"]) + " |",
        "  |---|" + "---:|" * len(t["loss_curve"]),
        "  | loss | " + " | ".join(f"{l:.2f}" for _, l in t["loss_curve"]) + " |",
        "",
        "- **Caches**: full precision is mlx-lm's `KVCache` (float32, the model's dtype). The "
        "quantized rows are `make_q4_prompt_cache(model, bits, group_size)`: one `Q4KVCache` per "
        "layer, which quantizes every new key and value (per token, along the head dimension) and "
        "hands mlx-lm's quantized attention the packed cache, so attention runs on the quantized "
        "keys and values, the current chunk's included. Bytes/token is the cache's size over all "
        "layers divided by the sequence length; the quantized formats store a scale and a bias per group in "
        "the model's dtype (float32 here, so 4-bit group 64 is 5 bits per element; 4.5 on a 16-bit "
        "model).",
        "- **Perplexity**: exp of the mean negative log-likelihood of every predicted token. Each "
        f"held-out sequence of {mc['eval_len']} tokens (consecutive windows of the held-out text) "
        f"goes through the model in chunks of {mc['chunk']} tokens on a fresh cache, as prefill "
        "does, so later chunks attend over the cache built by earlier ones; the NLL of each token "
        "comes from the logits of the chunk that predicts it. Δ NLL ± s.e. is the mean per-sequence "
        "difference from full precision and its standard error over sequences (paired: same tokens). "
        "KL(full ‖ q) is the mean KL divergence of the quantized next-token distribution from the "
        "full-precision one; argmax = full the share of positions with the same top token.",
        f"- **Greedy agreement**: {P} prompts of {mc['prompt_len']} tokens taken at evenly spaced "
        f"points of the held-out text; {n} greedy tokens each (prompt plus generation "
        f"{mc['prompt_len'] + n} <= the training context {tc['seq_len']}). Free-running generation "
        "uses mlx-lm's `generate_step` with the cache as its prompt cache and prefill step "
        f"{mc['chunk']}; teacher-forced decoding prefills the prompt the same way and then feeds "
        "the full-precision tokens one at a time.",
        "",
        f"Caveats: a {t['params'] / 1e6:.1f}M-parameter model trained for minutes on Python source is "
        "not a production model; its distributions are flatter than a large model's. The numbers "
        "say how much the KV formats move a model that does clearly better than bigram statistics, at "
        "float32 with head_dim 64; production models on Apple Silicon run 16-bit, with head_dim "
        "64-128 and many more layers. The training text differs slightly between Python versions, "
        "so other versions train a slightly different model."
        + (" The size is what 2 CPU cores train best in about ten minutes: many small steps on a "
           "small model beat a larger one (while choosing this configuration, a 2.6M-parameter "
           "variant with hidden 256 reached a held-out loss of 2.84 in 10 minutes, against 2.66 "
           "for this one)." if size == asdict(QUALITY_SIZE) else ""),
        "",
    ]
    return "\n".join(lines)


# ---- command -------------------------------------------------------------------------------------


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="vllm-mlx-persist quality",
        description="Train a small model on stdlib sources and measure what 4-bit KV costs "
                    "(perplexity, greedy agreement) against full-precision and 8-bit KV.")
    p.add_argument("--quick", action="store_true",
                   help="tiny model and measurement (seconds): for development and smoke tests")
    p.add_argument("--steps", type=int, help=f"training steps (default {TrainConfig.steps}; --quick: {QUICK_CONFIG.steps})")
    p.add_argument("--out", help="where quality.md and results/quality.json go "
                                 "(default docs; --quick: .models/quality-quick/report)")
    p.add_argument("--model-dir", help="where the trained model is saved "
                                       "(default .models/quality; --quick: .models/quality-quick/model)")
    p.add_argument("--retrain", action="store_true", help="train even if --model-dir holds this model")
    p.add_argument("--no-batched", action="store_true", help="skip the BatchGenerator comparison")
    return p.parse_args(list(argv))


DEFAULT_CONFIG = TrainConfig()


def main(argv: Sequence[str]) -> int:
    """Train (or reuse) the model, measure, write the report; return the exit status."""
    args = _parse(argv)
    t_start = time.perf_counter()
    cfg = QUICK_CONFIG if args.quick else DEFAULT_CONFIG
    if args.steps is not None:
        cfg = replace(cfg, steps=args.steps)
    mcfg = QUICK_MEASURE if args.quick else MeasureConfig()
    if args.no_batched:
        mcfg = replace(mcfg, batched=False)
    out = Path(args.out or (".models/quality-quick/report" if args.quick else "docs"))
    model_dir = Path(args.model_dir or (".models/quality-quick/model" if args.quick else ".models/quality"))
    log = lambda s: print(s, flush=True)
    if sys.platform == "linux" and os.path.exists(OPENBLAS) and "openblas" not in os.environ.get("LD_PRELOAD", ""):
        log(f"warning: OpenBLAS is not preloaded; float32 runs 15-35x slower. Run with LD_PRELOAD={OPENBLAS}")

    from mlx_lm import load

    from ..q4cache import install_attention_fix

    install_attention_fix()  # what the persist_q4 backend installs: needed for batched GQA masks
    trained = train(cfg, model_dir, force=args.retrain, log=log)
    model, _ = load(str(trained.model_dir))  # the saved model, as vllm-mlx would load it
    tokenizer, _ = load_tokenizer(cfg.size.vocab)
    eval_tokens, _ = corpus(EVAL_SOURCES, tokenizer)

    L = mcfg.eval_len
    n_windows = min(mcfg.eval_seqs, len(eval_tokens) // L)
    windows = eval_tokens[: n_windows * L].reshape(n_windows, L)
    mcfg = replace(mcfg, eval_seqs=n_windows)
    log(f"perplexity: {n_windows} held-out sequences of {L} tokens, prefill chunks of {mcfg.chunk}")
    t0 = time.perf_counter()
    ppl = perplexity(model, windows, mcfg.chunk, log=log)
    t_ppl = time.perf_counter() - t0

    stride = (len(eval_tokens) - mcfg.prompt_len) // mcfg.prompts
    prompts = [eval_tokens[i * stride : i * stride + mcfg.prompt_len].tolist() for i in range(mcfg.prompts)]
    log(f"greedy: {len(prompts)} prompts of {mcfg.prompt_len} tokens, {mcfg.gen_len} tokens each")
    t0 = time.perf_counter()
    agr = agreement(model, prompts, mcfg, log=log)
    t_greedy = time.perf_counter() - t0

    tdict = trained.to_dict()
    tdict["final_train_loss"] = float(np.mean(trained.losses[-10:]))
    tdict["loss_curve"] = _loss_curve(trained.losses)
    command = "vllm-mlx-persist quality" + "".join(" " + shlex.quote(a) for a in argv)
    if sys.platform == "linux":
        command = f"LD_PRELOAD={OPENBLAS} {command}"
    results = {
        "command": command,
        "machine": _machine(),
        "training": tdict,
        "measure_config": asdict(mcfg),
        "perplexity": ppl,
        "greedy": agr,
        "seconds": {"perplexity": t_ppl, "greedy": t_greedy, "total": time.perf_counter() - t_start},
    }
    (out / "results").mkdir(parents=True, exist_ok=True)
    (out / "results" / "quality.json").write_text(json.dumps(results, indent=1, default=_json_default) + "\n")
    (out / "quality.md").write_text(render_markdown(json.loads(json.dumps(results, default=_json_default))))

    log("")
    log(f"{'KV cache':26s} {'ppl':>9s} {'Δ ppl':>9s} {'Δ %':>8s} {'teacher-forced':>15s} {'prefix':>7s}")
    for name, p in ppl.items():
        g = agr[name]
        log(f"{p['label']:26s} {p['ppl']:9.4f} {p['delta_ppl']:+9.4f} {p['delta_ppl_pct']:+7.3f}% "
            f"{100 * g['teacher_forced_agreement']:14.2f}% {100 * g['prefix_match']:6.1f}%")
    log(f"training: {trained.train_seconds:.0f} s, final loss {tdict['final_train_loss']:.3f}, "
        f"held-out loss {trained.heldout_loss:.3f}")
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
