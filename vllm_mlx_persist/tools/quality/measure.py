"""How far a KV format moves a model, measured through the cache itself (`vllm-mlx-persist quality`).

`perplexity`: held-out perplexity of each format, prefilled in chunks into a fresh cache (later
chunks attend over the quantized cache), with KL(full || format) and argmax agreement per token.
`agreement`: greedy-token agreement with full precision over long generations, free running and
teacher-forced, per sequence (`generate_step`) and batched (`BatchGenerator`). `quality --model DIR`
(real.py) measures real checkpoints with the same `perplexity`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .kv_formats import FORMATS, KVFormat


@dataclass(frozen=True)
class MeasureConfig:
    eval_len: int = 1024  # tokens per held-out sequence (= the training context)
    chunk: int = 256  # prefill step
    eval_seqs: int = 32
    prompts: int = 8
    prompt_len: int = 256
    gen_len: int = 512
    batched: bool = True  # also generate through BatchGenerator (served formats only)
    free_running: bool = True  # also generate free-running (else teacher-forced only)


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
            a["kv_bytes"] = sum(getattr(c, "stored_nbytes", None) or
                                sum(x.nbytes for x in tree_leaves(c.state)) for c in cache)
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
            "served": f.served,
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
    caches = None if fmt.bits is None and fmt.factory is None else [fmt.make_cache(model) for _ in prompts]
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
    """Greedy agreement of each format with the first (full precision) over `cfg.gen_len` tokens
    per prompt."""
    n = cfg.gen_len
    ref_fmt = formats[0]
    ref = [greedy(model, p, n, ref_fmt.make_cache(model), cfg.chunk) for p in prompts]
    ref_margins = []
    results = {}
    for f in formats:
        if cfg.free_running:
            free = ref if f is ref_fmt else [greedy(model, p, n, f.make_cache(model), cfg.chunk) for p in prompts]
            div = [_first_divergence(a, b) for a, b in zip(free, ref)]
        matches, mismatch_margins = 0, []
        for i, (p, r) in enumerate(zip(prompts, ref)):
            preds, margins = teacher_forced(model, p, r, f.make_cache(model), cfg.chunk)
            if f is ref_fmt:
                ref_margins.append(margins)
            ok = [a == b for a, b in zip(preds, r)]
            matches += sum(ok)
            mismatch_margins += [ref_margins[i][t] for t, good in enumerate(ok) if not good]
        res: dict[str, Any] = {
            "label": f.label,
            "teacher_forced_agreement": matches / (n * len(prompts)),
            "mismatch_fp_margin_median": float(np.median(mismatch_margins)) if mismatch_margins else None,
        }
        if cfg.free_running:
            res.update(first_divergence=div, prefix_match=float(np.mean(div)) / n,
                       identical_prompts=sum(d == n for d in div))
        if cfg.batched and cfg.free_running and f.served:
            batched = batched_greedy(model, prompts, n, f, cfg.chunk)
            bdiv = [_first_divergence(a, b) for a, b in zip(batched, free)]
            res["batched_vs_per_sequence_prefix_match"] = float(np.mean(bdiv)) / n
            res["batched_first_divergence_vs_full"] = [_first_divergence(a, b) for a, b in zip(batched, ref)]
        results[f.name] = res
        log(f"  greedy {f.name}: teacher-forced agreement {res['teacher_forced_agreement']:.4f}"
            + (f", free-running prefix match {res['prefix_match']:.4f} (first divergence at {div})"
               if cfg.free_running else ""))
    all_margins = [m for ms in ref_margins for m in ms]
    results["_full_margin_median"] = float(np.median(all_margins)) if all_margins else None
    return results


def token_windows(tokens: np.ndarray, L: int, n: int) -> np.ndarray:
    """The first `n` (at most as many as fit) consecutive windows of `L` tokens, as (n, L)."""
    n = min(n, len(tokens) // L)
    return tokens[: n * L].reshape(n, L)


def token_prompts(tokens: np.ndarray, mcfg: MeasureConfig) -> list[list[int]]:
    """`mcfg.prompts` prompts of `mcfg.prompt_len` tokens, evenly spaced through `tokens`."""
    stride = (len(tokens) - mcfg.prompt_len) // mcfg.prompts
    return [tokens[i * stride : i * stride + mcfg.prompt_len].tolist() for i in range(mcfg.prompts)]
