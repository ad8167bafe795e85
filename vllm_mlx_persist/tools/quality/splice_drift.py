"""`vllm-mlx-persist splice-drift`: what amortize's splice does to a model's predictions (issue #21, item 6).

On the trained quality llama (`quality.py`) and held-out stdlib text T, an edit replaces the span
T[i:j] by a stub r; the run T[j:j+L] after it is spliced (`splice.apply`: its cached K/V reused, keys
moved by Δ = |r| - (j - i) with `rope_shift`), and the next `eval_len` tokens are teacher-forced.
Paths on the edited prompt P = T[:i] + r + T[j:]:

* `cold`: a float prefill of P (what forget serves, at full precision; the reference);
* `cold_q4`: a 4-bit prefill of P (the 4-bit baseline: what forget serves);
* `splice`: the splice on float K/V; `splice_q4`: the server's, on its 4-bit cache;
* `splice_q4_unmoved`: the 4-bit run appended without moving its keys (what the rotation buys);
* `unedited`: a float prefill of T itself (what the edit changes).

Measured over the eval region: mean KL(ref || path), the NLL of the true tokens and top-1 agreement
with the ref, for refs `cold`, `splice` and `unedited`; chained splices (the stub edited again g
times, the run's keys re-rotated and, at 4 bits, requantized each time); and a recall probe in the
spirit of the Leyline paper's §4.1 (a fact at the end of the removed span, asked for after the run:
`KEY = VALUE` lines and copied held-out tokens).
Writes splice_drift.{json,md,png}. Tools only: the server never imports this.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .machine import OPENBLAS, machine_info
from .train import EVAL_SOURCES, QUICK_CONFIG, TrainConfig, corpus, load_tokenizer, train

PATHS = ("cold", "cold_q4", "splice", "splice_q4", "splice_q4_unmoved", "unedited")
REFS = ("cold", "splice", "unedited")
CONDITIONS = ("unedited", "amortize", "amortize_float", "forget", "control")
STUB_TEXT = "# [truncated]\n"  # the recall probe's stub, as a harness would write it
BRIEF_RATIO = 1.5  # design brief: KL(splice || splice_q4) within 1.5x KL(cold || cold_q4)


@dataclass(frozen=True)
class DriftConfig:
    seqs: int = 32  # held-out windows
    prefix: int = 256  # i: tokens before the edit
    run: int = 256  # L: the spliced run
    eval_len: int = 128  # teacher-forced tokens after the run
    edits: tuple[tuple[int, int], ...] = ((64, 8), (256, 8), (128, 120), (16, 48))  # (span, stub): Δ < 0, Δ > 0
    chain_span: int = 64
    # one stub per generation; consecutive lengths differ, so every generation moves the run
    chain_stubs: tuple[int, ...] = (8, 40, 16, 56, 4, 32, 12, 48)
    facts: int = 64  # recall trials per run length
    fact_span: int = 64  # held-out tokens of the removed span before the fact
    fact_runs: tuple[int, ...] = (16, 128)
    bits: int = 4
    group_size: int = 64
    seed: int = 0
    # where the run starts (issue #32): KINDS, each at `kind_seqs` held-out points per run length
    kind_seqs: int = 48
    kind_span: int = 64  # tokens removed before the point (replaced by STUB_TEXT's first line)
    kind_runs: tuple[int, ...] = (16, 64, 256)
    kind_eval: int = 64
    recompute: tuple[int, ...] = (0, 1, 2, 4, 8, 16)  # the run's first k tokens re-prefilled
    chat: bool = False  # the kinds part on the held-out text as a ChatML conversation (CHAT_KINDS)


QUICK = DriftConfig(seqs=3, prefix=32, run=32, eval_len=16, edits=((16, 4), (8, 12)), chain_span=16,
                    chain_stubs=(4, 10, 2), facts=4, fact_span=16, fact_runs=(8,), kind_seqs=3, kind_span=8,
                    kind_runs=(20,), kind_eval=8, recompute=(0, 2))
# Where a splice's run starts, in this model's own text (Python source): `block`, a statement at column
# 0 after a blank line (a new top-level definition: the analog of a message start, where the text
# before matters least); `line`, a line start inside a block (the planner's line point: the token
# before it ends a line, indentation included); `mid`, inside a line (no point: what the planner
# never splices at). The trained model never saw a chat template, so message starts themselves
# cannot be measured on it.
KINDS = ("block", "line", "mid")
# `--chat` (a chat model, issue #42): the held-out text cut at line ends into messages of at least
# CHAT_MESSAGE_TOKENS tokens, rendered in ChatML with alternating user and assistant roles; a
# `message` point is a message-start token (<|im_start|>), where amortize's planner splices first.
CHAT_KINDS = ("message", "line", "mid")
CHAT_MESSAGE_TOKENS = 160
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


# ---- paths ---------------------------------------------------------------------------------------


def codecs(model: Any, bits: int = 4, group_size: int = 64) -> tuple[Any, Any]:
    """(float, 4-bit) codecs of `model`: the float one holds every layer as mlx-lm's KVCache, so
    `splice.apply` runs the same move on float K/V (keys rotated in float32, values untouched)."""
    from ...caches import ModelCodec
    from ...caches.kinds import FULL

    q4 = ModelCodec.for_model(model, bits, group_size, bounded=True)
    return ModelCodec([FULL] * q4.n_layers), q4


def prefill(model: Any, codec: Any, tokens: Sequence[int]) -> list:
    """A fresh cache of `codec` holding `tokens`, prefilled in one step."""
    import mlx.core as mx

    cache = codec.make_cache()
    mx.eval(model(mx.array([list(tokens)]), cache=cache))
    return cache


def fork(codec: Any, cache: list, n: int) -> list:
    """A new cache holding the first n tokens of `cache`, built as the pool builds one from blocks."""
    return codec.build([(codec.token_arrays(cache), n)])[0] if n else codec.make_cache()


def spliced(model: Any, codec: Any, verdicts: Sequence[Any], source: list, prompt: Sequence[int], exact: int,
            at: int, src: int, length: int, move: bool = True) -> list:
    """The cache of prompt[:at + length] by `splice.apply`: prompt[:exact] from `source` (which holds
    the same tokens there), prompt[exact:at] prefilled, then source's positions [src, src + length)
    with their keys moved by at - src (`move=False`: left where they were)."""
    from ...kv_edit import splice
    from ...kv_edit.plan import Splice

    run = {n: a[..., src:src + length, :] for n, a in codec.token_arrays(source).items()}
    plan = Splice(exact, at, src if move else at, length)
    return splice.apply(model, codec, verdicts, fork(codec, source, exact), exact, prompt, plan, run)[0]


def logprobs(model: Any, cache: list, tokens: Sequence[int]) -> Any:
    """Log-probabilities (len(tokens), vocab), float32, of `tokens` fed after `cache` (which grows)."""
    import mlx.core as mx

    logits = model(mx.array([list(tokens)]), cache=cache)[0].astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(lp)
    return lp


def compare(ref: Any, lp: Any, targets: Sequence[int]) -> dict[str, float]:
    """Over the rows (positions) of two log-prob arrays: mean KL(ref || lp), mean NLL of `targets`
    (one per row) under lp, and the fraction of rows where lp's argmax is ref's."""
    import mlx.core as mx

    kl = (mx.exp(ref) * (ref - lp)).sum(axis=-1).mean()
    nll = -mx.take_along_axis(lp, mx.array(list(targets))[:, None], axis=-1).mean()
    top1 = (mx.argmax(lp, axis=-1) == mx.argmax(ref, axis=-1)).astype(mx.float32).mean()
    return {"kl": max(0.0, kl.item()), "nll": nll.item(), "top1": top1.item()}


def key_error(codec: Any, cache: list, ref: list, lo: int, hi: int, layer: int = 0) -> float:
    """Relative L2 error of `cache`'s keys at positions [lo, hi) of `layer` (dequantized if 4-bit)
    against the float cache `ref`'s. Layer 0's keys depend only on token and position, so against a
    cold float prefill this is the move's and the quantization's error alone."""
    import mlx.core as mx

    got = codec.token_arrays(cache)
    if f"{layer}.k.q" in got:
        q, scales, biases = (got[f"{layer}.k.{p}"] for p in "qsb")
        k = mx.dequantize(q, scales.astype(mx.float32), biases.astype(mx.float32), codec.group_size, codec.bits)
    else:
        k = got[f"{layer}.k"]
    want = ref[layer].keys[..., lo:hi, :].astype(mx.float32)
    k = k[..., lo:hi, :].astype(mx.float32)
    return (mx.linalg.norm((k - want).reshape(-1)) / mx.linalg.norm(want.reshape(-1))).item()


# ---- experiments ---------------------------------------------------------------------------------


@dataclass
class Setup:
    model: Any
    fl: Any  # float codec
    q4: Any  # 4-bit codec (the server's)
    verdicts: list


def make_setup(model: Any, bits: int = 4, group_size: int = 64) -> Setup:
    """The codecs and `rope_shift.probe_model`'s per-layer verdicts (the server's start-up probe)."""
    from ...kv_edit.rope_shift import probe_model

    fl, q4 = codecs(model, bits, group_size)
    verdicts = probe_model(model)
    if not all(v.ok for v in verdicts):
        raise ValueError(f"the model's layers cannot be moved: {[v.reason for v in verdicts]}")
    return Setup(model, fl, q4, verdicts)


def edit_paths(s: Setup, T: Sequence[int], i: int, span: int, stub: Sequence[int], L: int,
               E: int) -> dict[str, Any]:
    """Log-probs of each of PATHS over the eval region T[j+L : j+L+E+1] (row t predicts token t+1)."""
    T, stub = list(T), list(stub)
    j, at = i + span, i + len(stub)
    P = T[:i] + stub + T[j:]
    ev = T[j + L:j + L + E + 1]
    src_f, src_q = prefill(s.model, s.fl, T[:j + L]), prefill(s.model, s.q4, T[:j + L])
    caches = {
        "cold": prefill(s.model, s.fl, P[:at + L]),
        "cold_q4": prefill(s.model, s.q4, P[:at + L]),
        "splice": spliced(s.model, s.fl, s.verdicts, src_f, P, i, at, j, L),
        "splice_q4": spliced(s.model, s.q4, s.verdicts, src_q, P, i, at, j, L),
        "splice_q4_unmoved": spliced(s.model, s.q4, s.verdicts, src_q, P, i, at, j, L, move=False),
        "unedited": fork(s.fl, src_f, j + L),
    }
    return {k: logprobs(s.model, c, ev) for k, c in caches.items()}


def chain_paths(s: Setup, T: Sequence[int], i: int, span: int, stubs: Sequence[Sequence[int]], L: int,
                E: int) -> list[dict[str, Any]]:
    """Generation g = 1..len(stubs): the prompt T[:i] + stubs[g-1] + T[j:], its run spliced from
    generation g-1's cache (generation 0: a prefill of T), so the run's keys have been moved g times
    (at 4 bits: dequantized, rotated, requantized g times). Per generation: log-probs of `cold`,
    `cold_q4`, `splice`, `splice_q4` over the eval region, and layer 0's key error (`key_error`)
    of `cold_q4`, `splice` and `splice_q4` against `cold` over the run."""
    T = list(T)
    j = i + span
    ev = T[j + L:j + L + E + 1]
    prev = {"splice": prefill(s.model, s.fl, T[:j + L]), "splice_q4": prefill(s.model, s.q4, T[:j + L])}
    codec = {"splice": s.fl, "splice_q4": s.q4, "cold": s.fl, "cold_q4": s.q4}
    src, out = j, []
    for stub in stubs:
        at = i + len(stub)
        P = T[:i] + list(stub) + T[j:]
        cur = {k: spliced(s.model, codec[k], s.verdicts, c, P, i, at, src, L) for k, c in prev.items()}
        cold = {k: prefill(s.model, codec[k], P[:at + L]) for k in ("cold", "cold_q4")}
        row = {"delta": at - src,
               "key_error": {k: key_error(codec[k], c, cold["cold"], at, at + L)
                             for k, c in {**cold, **cur}.items() if k != "cold"}}
        row["lp"] = {k: logprobs(s.model, fork(codec[k], c, at + L), ev) for k, c in {**cold, **cur}.items()}
        out.append(row)
        prev, src = cur, at
    return out


@dataclass(frozen=True)
class Fact:
    """What the removed span ends with (`tokens`), what the prompt asks after the run (`probe`) and
    the answer scored (`targets`, teacher-forced after the probe)."""

    tokens: tuple[int, ...]
    probe: tuple[int, ...]
    targets: tuple[int, ...]


def kv_fact(rng: np.random.Generator, keys: Sequence[int], values: Sequence[int], eq: Sequence[int],
            nl: Sequence[int]) -> Fact:
    """`KEY = VALUE` on a line of its own (KEY: two random identifier pieces), asked as `KEY =`."""
    key = [int(k) for k in rng.choice(keys, 2)]
    value = int(rng.choice(values))
    return Fact((*nl, *key, *eq, value, *nl), (*nl, *key, *eq), (value,))


def copy_fact(rng: np.random.Generator, tokens: np.ndarray, n: int = 8, k: int = 4) -> Fact:
    """n + k held-out tokens from elsewhere; asked with their first n, the next k scored (the model
    has only to copy them from context)."""
    a = int(rng.integers(0, len(tokens) - n - k))
    line = tuple(int(t) for t in tokens[a:a + n + k])
    return Fact(line, line[:n], line[n:])


def fact_vocab(tokenizer: Any) -> tuple[list[int], list[int]]:
    """(key pieces, values): identifier-like tokens of 3+ characters without and with a leading space."""
    text = {i: tokenizer.decode([i]) for i in range(tokenizer.get_vocab_size())}
    keys = [i for i, t in text.items() if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{2,}", t)]
    values = [i for i, t in text.items() if re.fullmatch(r" [A-Za-z_][A-Za-z0-9_]{2,}", t)]
    return keys, values


def recall(s: Setup, A: Sequence[int], F: Sequence[int], B: Sequence[int], fact: Fact,
           stub: Sequence[int]) -> dict[str, tuple[float, int]]:
    """(mean log P of `fact.targets`, rank of the first among the vocab) after `fact.probe`, per
    CONDITIONS: the history is
    A + F + fact + B (the fact ends the removed span F + fact, B is the run); the edit replaces the
    span by `stub`. unedited: a 4-bit prefill of the history; amortize: the server's splice of B
    (4-bit; `amortize_float` on float K/V); forget: a 4-bit prefill of the edited prompt; control:
    a 4-bit prefill of A + F + B (the fact never there)."""
    import mlx.core as mx

    A, F, B, stub = list(A), list(F), list(B), list(stub)
    T = A + F + list(fact.tokens) + B
    P = A + stub + B
    i, j, at = len(A), len(A) + len(F) + len(fact.tokens), len(A) + len(stub)
    caches = {
        "unedited": prefill(s.model, s.q4, T),
        "amortize": spliced(s.model, s.q4, s.verdicts, prefill(s.model, s.q4, T), P, i, at, j, len(B)),
        "amortize_float": spliced(s.model, s.fl, s.verdicts, prefill(s.model, s.fl, T), P, i, at, j, len(B)),
        "forget": prefill(s.model, s.q4, P),
        "control": prefill(s.model, s.q4, A + F + B),
    }
    out = {}
    for k, c in caches.items():
        lp = logprobs(s.model, c, [*fact.probe, *fact.targets[:-1]])[len(fact.probe) - 1:]
        got = mx.take_along_axis(lp, mx.array(fact.targets)[:, None], axis=-1)
        out[k] = (got.mean().item(), 1 + int(mx.sum(lp[0] > got[0]).item()))
    return out


def chat_corpus(tokens: np.ndarray, tokenizer: Any, size: int = CHAT_MESSAGE_TOKENS) -> np.ndarray:
    """The held-out `tokens` as one ChatML conversation: cut after a line's end (and its indentation)
    once a message holds `size` tokens, each piece decoded and rendered as a user or an assistant
    message in turn (the template's own tags, encoded by the tokenizer as its special tokens)."""
    text = lambda ids: tokenizer.decode([int(t) for t in ids])  # noqa: E731
    parts, start, roles = [], 0, ("user", "assistant")
    for j in range(len(tokens)):
        if j + 1 - start >= size and re.search(r"\n[ \t]*\Z", text(tokens[j:j + 1])):
            parts.append(f"{IM_START}{roles[len(parts) % 2]}\n{text(tokens[start:j + 1])}{IM_END}\n")
            start = j + 1
    ids = tokenizer.encode("".join(parts), add_special_tokens=False).ids
    return np.array(ids, dtype=np.int64)


def point_kinds(tokens: Sequence[int], text: Callable[[int], str], lo: int, hi: int,
                tags: Optional[tuple[int, int]] = None) -> dict[str, list[int]]:
    """The positions j in [lo, hi) of `tokens` by KINDS (module docstring of DriftConfig's KINDS); with
    `tags` (the ids of ChatML's message start and end) by CHAT_KINDS: `message` at a start token,
    `line` and `mid` as before, never at or just after a tag (the role line after a start)."""
    out: dict[str, list[int]] = {k: [] for k in (KINDS if tags is None else CHAT_KINDS)}
    for j in range(max(2, lo), hi):
        if tags is not None:
            if tokens[j] == tags[0]:
                out["message"].append(j)
                continue
            if any(t in tags for t in tokens[max(0, j - 4):j + 1]):
                continue
        before, here = text(tokens[j - 1]), text(tokens[j])
        if re.search(r"\n[ \t]*\Z", before) and "\n" not in here:
            # a chat text has no blocks: its message starts are points of their own
            top = tags is None and re.search(r"\n[ \t]*\n\Z", text(tokens[j - 2]) + before) is not None \
                and not here[:1].isspace()
            out["block" if top else "line"].append(j)
        elif "\n" not in before and "\n" not in here:
            out["mid"].append(j)
    return out


def recomputed_run(L: int, k: int) -> bool:
    """Whether a run of L tokens still splices with its first k re-prefilled: the planner's
    `recompute` keeps a run only while at least `min_run_tokens` of it are left to move."""
    from ...kv_edit.plan import MIN_RUN_TOKENS

    return k == 0 or L - k >= MIN_RUN_TOKENS


def kind_paths(s: Setup, T: Sequence[int], j: int, span: int, stub: Sequence[int], L: int, E: int,
               ks: Sequence[int], keep: int = 1) -> dict[str, Any]:
    """An edit that removes the `span` tokens before T[j-keep] (the `keep` tokens before the point are
    kept: the token that makes it a point, and a message's end tag with it) and puts `stub` there; the
    run T[j:j+L] spliced from the point (`splice_k`/`splice_q4_k`: its first k tokens re-prefilled;
    only k that leave `recomputed_run(L, k)`, as the server's planner would).
    Log-probs over T[j+L : j+L+E+1] of cold, cold_q4 and each splice."""
    T, stub = list(T), list(stub)
    i = j - keep - span
    P = T[:i] + stub + T[j - keep:]
    at = i + len(stub) + keep
    ev = T[j + L:j + L + E + 1]
    src_f, src_q = prefill(s.model, s.fl, T[:j + L]), prefill(s.model, s.q4, T[:j + L])
    caches = {"cold": prefill(s.model, s.fl, P[:at + L]), "cold_q4": prefill(s.model, s.q4, P[:at + L])}
    for k in (k for k in ks if recomputed_run(L, k)):
        caches[f"splice_{k}"] = spliced(s.model, s.fl, s.verdicts, src_f, P, i, at + k, j + k, L - k)
        caches[f"splice_q4_{k}"] = spliced(s.model, s.q4, s.verdicts, src_q, P, i, at + k, j + k, L - k)
    return {k: logprobs(s.model, c, ev) for k, c in caches.items()}


def opening_ids(tokenizer: Any) -> list[int]:
    """The ids `tokenizer` puts before any text (its BOS where its post-processor adds one)."""
    return list(tokenizer.encode("").ids)


def kinds_run(s: Setup, tokens: np.ndarray, tokenizer: Any, cfg: DriftConfig,
              log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Drift by where the run starts (KINDS) and by recomputed tokens k, per run length: `kind_seqs`
    points of each kind drawn from the held-out text, each in its own window."""
    rng = np.random.default_rng(cfg.seed + 1)
    vocab = {}
    text = lambda t: vocab.setdefault(t, tokenizer.decode([int(t)]))  # noqa: E731
    stub = tokenizer.encode(STUB_TEXT.strip(), add_special_tokens=False).ids
    tags = (tokenizer.token_to_id(IM_START), tokenizer.token_to_id(IM_END)) if cfg.chat else None
    # what the tokenizer opens every sequence with (Gemma 3's BOS; none for SmolLM2 or ours): each window
    # is a sequence of its own, and Gemma without its BOS reads text far worse than with it
    lead = opening_ids(tokenizer)
    rows = []
    toks = [int(t) for t in tokens]
    for L in cfg.kind_runs:
        after = L + cfg.kind_eval + 1
        found = point_kinds(toks, text, cfg.prefix + cfg.kind_span + (2 if tags else 1), len(toks) - after, tags)
        for kind in found:
            pts = sorted(rng.choice(found[kind], size=min(cfg.kind_seqs, len(found[kind])), replace=False).tolist())
            trials = []
            # a message point keeps the previous message's end tag and the newline after it
            keep = 2 if kind == "message" else 1
            before = cfg.prefix + cfg.kind_span + keep
            for j in pts:  # a window of `prefix` tokens before the edit, the point at `before` (after `lead`)
                T = lead + toks[j - before:j + after]
                at = len(lead) + before
                lps = kind_paths(s, T, at, cfg.kind_span, stub, L, cfg.kind_eval, cfg.recompute, keep)
                targets = T[at + L + 1:][:cfg.kind_eval]
                m = {p: compare(lps["cold"][:-1], lps[p][:-1], targets) for p in lps if p != "cold"}
                trials.append(m)
            row = {"run": L, "kind": kind, "points": len(pts), "candidates": len(found[kind]), **_summarise(trials)}
            rows.append(row)
            kl = lambda p: 1e3 * row[p]["kl"]["mean"]  # noqa: E731
            ks = [k for k in cfg.recompute if f"splice_{k}" in row]
            log(f"kind {kind:5s} run {L:3d} ({len(pts)} of {len(found[kind])} points): KL 1e-3 vs cold: "
                f"cold_q4 {kl('cold_q4'):.3f}; float splice " + " ".join(
                    f"k={k}:{kl(f'splice_{k}'):.4f}" for k in ks) + "; 4-bit splice " + " ".join(
                    f"k={k}:{kl(f'splice_q4_{k}'):.3f}" for k in ks))
    return rows


# ---- the run -------------------------------------------------------------------------------------


def windows(tokens: np.ndarray, length: int, n: int) -> list[list[int]]:
    """n windows of `length` tokens spread evenly over `tokens` (every held-out file gets some)."""
    starts = np.linspace(0, len(tokens) - length, n).astype(int)
    return [tokens[a:a + length].tolist() for a in starts]


def _mean_sem(xs: Sequence[float]) -> dict[str, float]:
    a = np.asarray(xs, dtype=np.float64)
    return {"mean": float(a.mean()), "sem": float(a.std(ddof=1) / math.sqrt(len(a))) if len(a) > 1 else 0.0,
            "min": float(a.min()), "max": float(a.max())}


def _summarise(trials: Sequence[dict[str, dict[str, float]]]) -> dict[str, dict[str, dict[str, float]]]:
    """{path: {metric: mean/sem/min/max}} over trials of {path: {metric: value}}."""
    return {p: {m: _mean_sem([t[p][m] for t in trials]) for m in trials[0][p]} for p in trials[0]}


PARTS = ("edits", "chain", "recall", "kinds")


def run(s: Setup, tokens: np.ndarray, tokenizer: Any, cfg: DriftConfig,
        log: Callable[[str], None] = print, parts: Sequence[str] = PARTS) -> dict[str, Any]:
    """The measurements of the module docstring (`parts` of PARTS); returns the results as plain data."""
    rng = np.random.default_rng(cfg.seed)
    need = cfg.prefix + max([sp for sp, _ in cfg.edits] + [cfg.chain_span]) + cfg.run + cfg.eval_len + 1
    wins = windows(tokens, need, cfg.seqs)
    stub_of = lambda n: tokens[(a := int(rng.integers(0, len(tokens) - n))):a + n].tolist()  # noqa: E731
    res: dict[str, Any] = {"config": asdict(cfg), "seconds": {}}
    if "kinds" in parts:
        t0 = time.perf_counter()
        res["kinds"] = kinds_run(s, tokens, tokenizer, cfg, log)
        res["kind_lead"] = opening_ids(tokenizer)
        res["seconds"]["kinds"] = time.perf_counter() - t0
    if "edits" not in parts:
        return res

    t0 = time.perf_counter()
    edits = []
    for span, n_stub in cfg.edits:
        per_ref: dict[str, list] = {r: [] for r in REFS}
        for T in wins:
            lps = edit_paths(s, T, cfg.prefix, span, stub_of(n_stub), cfg.run, cfg.eval_len)
            targets = T[cfg.prefix + span + cfg.run + 1:][:cfg.eval_len]
            for r in REFS:
                per_ref[r].append({p: compare(lps[r][:-1], lps[p][:-1], targets) for p in PATHS})
        row = {"span": span, "stub": n_stub, "delta": n_stub - span,
               "vs": {r: _summarise(t) for r, t in per_ref.items()}}
        kl = lambda r, p: row["vs"][r][p]["kl"]["mean"]  # noqa: E731
        row["brief_ratio"] = kl("splice", "splice_q4") / kl("cold", "cold_q4")
        edits.append(row)
        log(f"edit span {span:4d} stub {n_stub:4d} (Δ {n_stub - span:+d}): KL vs cold: splice_q4 "
            f"{kl('cold', 'splice_q4'):.4f} splice {kl('cold', 'splice'):.4f} cold_q4 {kl('cold', 'cold_q4'):.4f} "
            f"unmoved {kl('cold', 'splice_q4_unmoved'):.4f} unedited {kl('cold', 'unedited'):.4f}; "
            f"KL(splice||splice_q4) / KL(cold||cold_q4) = {row['brief_ratio']:.2f}")
    res["edits"] = edits
    res["seconds"]["edits"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    gens: list[list[dict]] = [[] for _ in cfg.chain_stubs]
    for T in wins:
        stubs = [stub_of(n) for n in cfg.chain_stubs]
        targets = T[cfg.prefix + cfg.chain_span + cfg.run + 1:][:cfg.eval_len]
        for g, row in enumerate(chain_paths(s, T, cfg.prefix, cfg.chain_span, stubs, cfg.run, cfg.eval_len)):
            lp = {k: v[:-1] for k, v in row["lp"].items()}
            m = {f"{p}_vs_cold": compare(lp["cold"], lp[p], targets) for p in ("cold_q4", "splice", "splice_q4")}
            m["splice_q4_vs_splice"] = compare(lp["splice"], lp["splice_q4"], targets)
            m["key_error"] = row["key_error"]
            gens[g].append(m)
    res["chain"] = [{"generation": g + 1, "stub": cfg.chain_stubs[g],
                     "delta": cfg.chain_stubs[g] - (cfg.chain_stubs[g - 1] if g else cfg.chain_span),
                     **_summarise(t)} for g, t in enumerate(gens)]
    for c in res["chain"]:
        log(f"chain g={c['generation']}: KL vs cold: splice_q4 {c['splice_q4_vs_cold']['kl']['mean']:.4f} "
            f"splice {c['splice_vs_cold']['kl']['mean']:.4f} cold_q4 {c['cold_q4_vs_cold']['kl']['mean']:.4f}; "
            f"KL(splice||splice_q4) {c['splice_q4_vs_splice']['kl']['mean']:.4f}; layer-0 key error "
            f"{c['key_error']['splice_q4']['mean']:.4f} (cold 4-bit {c['key_error']['cold_q4']['mean']:.4f})")
    res["seconds"]["chain"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    keys, values = fact_vocab(tokenizer)
    eq = tuple(tokenizer.encode(" =", add_special_tokens=False).ids)
    nl = tuple(tokenizer.encode("\n", add_special_tokens=False).ids)
    stub = tokenizer.encode(STUB_TEXT, add_special_tokens=False).ids
    res["recall"] = []
    for kind in ("kv", "copy"):
        for L in cfg.fact_runs:
            trials = []
            for f in range(cfg.facts):
                T = wins[f % len(wins)]
                fact = kv_fact(rng, keys, values, eq, nl) if kind == "kv" else copy_fact(rng, tokens)
                A, F = T[:cfg.prefix], T[cfg.prefix:cfg.prefix + cfg.fact_span]
                B = T[cfg.prefix + cfg.fact_span:cfg.prefix + cfg.fact_span + L]
                trials.append(recall(s, A, F, B, fact, stub))
            row = {"fact": kind, "run": L, "facts": cfg.facts, "conditions": {}}
            for c in CONDITIONS:
                lp = [t[c][0] for t in trials]
                rank = np.array([t[c][1] for t in trials])
                row["conditions"][c] = {"logp": _mean_sem(lp), "median_rank": float(np.median(rank)),
                                        "top1": float(np.mean(rank == 1)), "top10": float(np.mean(rank <= 10)),
                                        # paired, fact by fact: what this condition gains over forget
                                        "vs_forget": _mean_sem([t[c][0] - t["forget"][0] for t in trials])}
            res["recall"].append(row)
            log(f"recall, {kind}, run {L}: " + ", ".join(
                f"{c} logP {v['logp']['mean']:.2f} top1 {100 * v['top1']:.0f}%" for c, v in row["conditions"].items()))
    res["recall_candidates"] = len(values)
    res["recall_chance_logp"] = -math.log(tokenizer.get_vocab_size())
    res["seconds"]["recall"] = time.perf_counter() - t0
    return res


# ---- report --------------------------------------------------------------------------------------

LABELS = {"cold": "cold float prefill of the edited prompt", "cold_q4": "cold 4-bit prefill (forget, as served)",
          "splice": "float splice", "splice_q4": "4-bit splice (amortize, as served)",
          "splice_q4_unmoved": "4-bit splice, keys not moved", "unedited": "float prefill of the unedited prompt"}


def _pm(d: dict[str, float], fmt: str = ".3f", scale: float = 1.0) -> str:
    return f"{scale * d['mean']:{fmt}} ± {scale * d['sem']:{fmt.lstrip('+')}}"


def _kl(d: dict[str, float]) -> str:
    """KL in 10^-3 nats per token."""
    return _pm(d, ".3f", 1e3)


def render_kinds(r: dict[str, Any]) -> list[str]:
    """The section on where the run starts (issue #32) and what recomputing its first k tokens buys."""
    cfg = r["config"]
    ks = cfg["recompute"]
    lines = ["## Where the run starts: block, line, mid-line; recomputed tokens (issue #32)", "",
             f"An edit removes the {cfg['kind_span']} tokens before the token that precedes a point j (that token "
             f"is kept, so the point stays one) and puts `{STUB_TEXT.strip()}` there; the run from j is spliced "
             f"and the next {cfg['kind_eval']} tokens are teacher-forced. Points drawn from the held-out text "
             + ((f"rendered as one ChatML conversation (cut at line ends into messages of at least "
                 f"{CHAT_MESSAGE_TOKENS} tokens, user and assistant in turn) by kind: **message** = a message "
                 "start (`<|im_start|>`; the edit is the end of the message before it, whose end tag and "
                 "newline are kept); **line** = a line start inside a message (the planner's line point); "
                 "**mid** = inside a line (never a splice point). ") if cfg.get("chat") else
                ("by kind: **block** = a statement at column 0 after a blank line (a new top-level definition, "
                 "this model's analog of a message start); **line** = a line start inside a block (the planner's "
                 "line point); **mid** = inside a line (never a splice point). ")) + "KL in 10⁻³ nats per token against "
             "the cold float prefill of the edited prompt (mean ± s.e. over the points); k = the run's first "
             "k tokens re-prefilled with the stub (boundary recomputation)."
             + (f" Each window opens with the tokenizer's opening ids {r['kind_lead']} (its BOS), as a served "
                "prompt does." if r.get("kind_lead") else ""), "",
             "| run | kind | points | cold 4-bit | " + " | ".join(f"float splice k={k}" for k in ks) + " | "
             + " | ".join(f"4-bit splice k={k}" for k in ks) + " |",
             "|---:|---|---:|---:|" + "---:|" * (2 * len(ks))]
    cell = lambda row, p, fmt: _pm(row[p]["kl"], fmt, 1e3) if p in row else "–"  # noqa: E731
    for row in r["kinds"]:
        lines.append(f"| {row['run']} | {row['kind']} | {row['points']} | {_kl(row['cold_q4']['kl'])} | "
                     + " | ".join(cell(row, f"splice_{k}", ".4f") for k in ks) + " | "
                     + " | ".join(cell(row, f"splice_q4_{k}", ".3f") for k in ks) + " |")
    lines += ["", "Top-1 agreement with the cold float prefill (k = 0): " + "; ".join(
        f"run {row['run']} {row['kind']}: float splice {100 * row['splice_0']['top1']['mean']:.1f}%, 4-bit splice "
        f"{100 * row['splice_q4_0']['top1']['mean']:.1f}%, cold 4-bit {100 * row['cold_q4']['top1']['mean']:.1f}%"
        for row in r["kinds"]) + ".", ""]
    return lines


def render_markdown(r: dict[str, Any], doc: str = "../span-directives.md") -> str:
    """The report; `doc`: the link to docs/span-directives.md from where the report is written."""
    cfg, m = r["config"], r["machine"]
    if "edits" not in r:  # a run of the kinds part only
        return "\n".join([
            "# Splice drift by where the run starts (amortize, issue #32)", "",
            f"Generated by `{r['command']}` in {r['seconds']['total'] / 60:.1f} min on {m.get('cpu', '?')} "
            f"({m.get('cores', '?')} cores, shared with other jobs), model `{r['model_dir']}` ({r['model']}); "
            f"4-bit paths in key_format {r.get('key_format', 'q4')}. Method and reading: [span-directives.md]({doc}#drift-at-sub-message-points).", "",
            *render_kinds(r)])
    lines = [
        "# Splice drift and recall (amortize, issue #21 item 6)", "",
        f"Generated by `{r['command']}` in {r['seconds']['total'] / 60:.1f} min on {m.get('cpu', '?')} "
        f"({m.get('cores', '?')} cores, shared with other jobs), model `{r['model_dir']}` ({r['model']}). "
        f"Method and reading: [span-directives.md]({doc}#measured-drift-and-recall). "
        f"Values are means ± standard error over {cfg['seqs']} held-out windows; "
        "KL in 10⁻³ nats per token (mean over tokens), "
        f"over {cfg['eval_len']} teacher-forced tokens after a {cfg['run']}-token run; the edit is at token "
        f"{cfg['prefix']}.", "",
        "## One splice", "",
        "Against the cold float prefill of the edited prompt:", "",
        "| span → stub (Δ) | path | KL | NLL | top-1 agreement |", "|---|---|---:|---:|---:|"]
    for e in r["edits"]:
        for p in PATHS:
            v = e["vs"]["cold"][p]
            lines.append(f"| {e['span']} → {e['stub']} ({e['delta']:+d}) | {LABELS[p]} | {_kl(v['kl'])} | "
                         f"{_pm(v['nll'])} | {_pm(v['top1'], '.1f', 100)}% |")
    lines += ["", "Against the float splice and the unedited prompt; the brief's check is "
              f"KL(float splice ‖ 4-bit splice) within {BRIEF_RATIO}x KL(cold float ‖ cold 4-bit):", "",
              "| span → stub (Δ) | KL(splice ‖ splice_q4) | KL(cold ‖ cold_q4) | ratio | top-1 vs splice | "
              "KL(unedited ‖ splice_q4) | KL(unedited ‖ splice) | KL(unedited ‖ cold) |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for e in r["edits"]:
        vs = e["vs"]
        lines.append(f"| {e['span']} → {e['stub']} ({e['delta']:+d}) | {_kl(vs['splice']['splice_q4']['kl'])} | "
                     f"{_kl(vs['cold']['cold_q4']['kl'])} | "
                     f"{e['brief_ratio']:.2f} ({'within' if e['brief_ratio'] <= BRIEF_RATIO else 'over'}) | "
                     f"{_pm(vs['splice']['splice_q4']['top1'], '.1f', 100)}% | "
                     f"{_kl(vs['unedited']['splice_q4']['kl'])} | {_kl(vs['unedited']['splice']['kl'])} | "
                     f"{_kl(vs['unedited']['cold']['kl'])} |")
    lines += ["", f"## Chained splices (span {cfg['chain_span']}, the stub edited again each generation)", "",
              "| g | stub (Δ) | KL(cold ‖ splice_q4) | KL(cold ‖ splice) | KL(cold ‖ cold_q4) | "
              "KL(splice ‖ splice_q4) | top-1 splice_q4 vs cold | layer-0 key error: splice_q4 | cold_q4 |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in r["chain"]:
        lines.append(f"| {c['generation']} | {c['stub']} ({c['delta']:+d}) | {_kl(c['splice_q4_vs_cold']['kl'])} | "
                     f"{_kl(c['splice_vs_cold']['kl'])} | {_kl(c['cold_q4_vs_cold']['kl'])} | "
                     f"{_kl(c['splice_q4_vs_splice']['kl'])} | {_pm(c['splice_q4_vs_cold']['top1'], '.1f', 100)}% | "
                     f"{_pm(c['key_error']['splice_q4'], '.4f')} | {_pm(c['key_error']['cold_q4'], '.4f')} |")
    lines += ["", "## Recall probe", "",
              f"A fact ends the removed {cfg['fact_span']}-token span, the edit replaces the span by "
              f"`{STUB_TEXT.strip()}`, and after the run the prompt asks for it. `kv`: a line `KEY = VALUE` "
              f"(KEY two random identifier pieces, VALUE one of {r['recall_candidates']} space-led identifier "
              "tokens), asked as `KEY =`, VALUE scored. `copy`: 12 held-out tokens from elsewhere, asked with "
              "their first 8, the next 4 scored (mean log P; rank and top-k of the first). "
              f"{cfg['facts']} random facts per row. Uniform over the vocabulary: log P = "
              f"{r['recall_chance_logp']:.2f}.", "",
              "| fact | run | condition | log P(answer) | − forget's, fact by fact | median rank | top-1 | top-10 |",
              "|---|---:|---|---:|---:|---:|---:|---:|"]
    for row in r["recall"]:
        for c, v in row["conditions"].items():
            lines.append(f"| {row['fact']} | {row['run']} | {c} | {_pm(v['logp'], '.2f')} | "
                         f"{_pm(v['vs_forget'], '+.3f')} | {v['median_rank']:.0f} | "
                         f"{100 * v['top1']:.0f}% | {100 * v['top10']:.0f}% |")
    lines += ["", "Conditions: unedited = the 4-bit history with the fact; amortize = the server's 4-bit splice "
              "(amortize_float: the same on float K/V); forget = a 4-bit prefill of the edited prompt; "
              "control = the history without the fact.", "", "![splice drift](splice_drift.png)", ""]
    if "kinds" in r:
        lines += render_kinds(r)
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    from ..bench.plots import pyplot

    plt = pyplot()
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2))
    g = [x["generation"] for x in r["chain"]]
    for key, label in (("splice_q4_vs_cold", "4-bit splice vs cold float"),
                       ("splice_vs_cold", "float splice vs cold float"),
                       ("cold_q4_vs_cold", "cold 4-bit vs cold float"),
                       ("splice_q4_vs_splice", "4-bit splice vs float splice")):
        a.errorbar(g, [x[key]["kl"]["mean"] for x in r["chain"]], [x[key]["kl"]["sem"] for x in r["chain"]],
                   marker="o", capsize=3, label=label)
    a.set(xlabel="splices of the same run (g)", ylabel="KL (nats/token)", yscale="log", title="chained splices: KL")
    a.legend(fontsize=8)
    a.set_xticks(g)
    for key, label in (("splice_q4", "4-bit splice"), ("cold_q4", "cold 4-bit"), ("splice", "float splice")):
        err = [x["key_error"][key] for x in r["chain"]]
        b.errorbar(g, [e["mean"] for e in err], [e["sem"] for e in err], marker="o", capsize=3, label=label)
    b.set(xlabel="splices of the same run (g)", ylabel="relative L2 error", title="layer-0 keys of the run vs cold float",
          ylim=(0, None))
    b.legend(fontsize=8)
    b.set_xticks(g)
    shown = [cnd for cnd in CONDITIONS if cnd != "forget"]
    width = 0.8 / max(1, len(r["recall"]))
    for k, row in enumerate(r["recall"]):
        xs = np.arange(len(shown)) + k * width
        v = [row["conditions"][cnd]["vs_forget"] for cnd in shown]
        c.bar(xs, [x["mean"] for x in v], width, yerr=[x["sem"] for x in v], capsize=3,
              label=f"{row['fact']}, run {row['run']}")
    c.axhline(0, color="gray", lw=1)
    c.set_xticks(np.arange(len(shown)) + width * (len(r["recall"]) - 1) / 2, shown, fontsize=8)
    c.set(ylabel="log P(answer) − forget's (paired)", title="recall probe (a fact in the removed span)")
    c.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(res: dict[str, Any], out: Path, plots: bool = True) -> None:
    """splice_drift.json, .md and (with `plots`) .png under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "splice_drift.json").write_text(json.dumps(res, indent=1) + "\n")
    doc = Path(__file__).resolve().parents[3] / "docs" / "span-directives.md"
    (out / "splice_drift.md").write_text(render_markdown(res, os.path.relpath(doc, out.resolve())))
    if plots and "edits" in res:
        plot(res, out / "splice_drift.png")


# ---- command -------------------------------------------------------------------------------------


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vllm-mlx-persist splice-drift",
                                description="Drift (KL, NLL, agreement) and recall of amortize's splice on the "
                                            "trained quality llama (issue #21, item 6).")
    p.add_argument("--quick", action="store_true", help="a tiny model and a few trials (seconds): smoke test")
    p.add_argument("--model-dir", help="a trained quality llama (default .models/quality, trained there by the "
                                       "quality tool's config if absent; --quick: .models/quality-quick/model)")
    p.add_argument("--out", help="where splice_drift.{json,md,png} go (default docs/results; --kinds-only: "
                                 "docs/results/splice-drift-kinds; --quick: .models/splice-drift-quick)")
    p.add_argument("--seqs", type=int, help="held-out windows")
    p.add_argument("--facts", type=int, help="recall trials per run length")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--kinds-only", action="store_true",
                   help="only the drift by where the run starts (block, line, mid-line) and recomputed tokens")
    p.add_argument("--kind-seqs", type=int, help="points per kind and run length of the kinds part (default 48)")
    p.add_argument("--kind-runs", help="run lengths of the kinds part, e.g. 16,64,256 (the default)")
    p.add_argument("--recompute", help="recomputed tokens k of the kinds part, e.g. 0,1,2,4,8,16 (the default)")
    p.add_argument("--key-format", default="q4",
                   help="the 4-bit paths' key_format, as the server resolves it (e.g. k6v4c: calibrated on the "
                        "server's calibration text first); default q4")
    p.add_argument("--chat", action="store_true",
                   help="the kinds part on the held-out text rendered as a ChatML conversation (a chat model's "
                        "template): points at message starts, line starts and mid-line")
    p.add_argument("--render", metavar="JSON", help="only write the report (md, png) of an earlier run's JSON")
    return p.parse_args(list(argv))


def main(argv: Sequence[str]) -> int:
    """Load (or train) the model, measure, write the report; return the exit status."""
    args = _parse(argv)
    if args.render:
        res = json.loads(Path(args.render).read_text())
        write_report(res, Path(args.out or Path(args.render).parent), plots=not args.no_plot)
        return 0
    t_start = time.perf_counter()
    log = lambda s: print(s, flush=True)  # noqa: E731
    if sys.platform == "linux" and os.path.exists(OPENBLAS) and "openblas" not in os.environ.get("LD_PRELOAD", ""):
        log(f"warning: OpenBLAS is not preloaded; float32 runs 15-35x slower. Run with LD_PRELOAD={OPENBLAS}")
    cfg = QUICK if args.quick else DriftConfig()
    ints = lambda v: None if v is None else tuple(int(x) for x in v.split(","))  # noqa: E731
    cfg = replace(cfg, chat=args.chat, **{k: v for k, v in (("seqs", args.seqs), ("facts", args.facts), ("kind_seqs", args.kind_seqs),
                                             ("kind_runs", ints(args.kind_runs)), ("recompute", ints(args.recompute)))
                          if v is not None})
    model_dir = Path(args.model_dir or (".models/quality-quick/model" if args.quick else ".models/quality"))
    out = Path(args.out or (".models/splice-drift-quick" if args.quick else
                            "docs/results/splice-drift-kinds" if args.kinds_only else "docs/results"))
    if not (model_dir / "config.json").exists():  # never retrain a model that is there
        train(QUICK_CONFIG if args.quick else TrainConfig(), model_dir, log=log)

    from mlx_lm import load

    from ...caches.attention import install_attention_fix

    model, _ = load(str(model_dir))
    install_attention_fix()  # what the persist_q4 backend installs
    if (model_dir / "tokenizer.json").is_file():  # the model's own (a real checkpoint; trained ones save ours)
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    else:
        tokenizer, _ = load_tokenizer(model.args.vocab_size)
    tokens, files = corpus(EVAL_SOURCES, tokenizer)
    if cfg.chat:
        if tokenizer.token_to_id(IM_START) is None:
            raise SystemExit(f"--chat needs a ChatML model ({IM_START} is not a token of {model_dir})")
        tokens = chat_corpus(tokens, tokenizer)
    s = make_setup(model, cfg.bits, cfg.group_size)
    if args.key_format != "q4":  # the 4-bit paths in the server's format for this model (calibrated as at load)
        from ...key_calibration import resolve

        formats, chosen = resolve(args.key_format, model, tokenizer, s.q4)
        s.q4 = s.q4.with_key_formats(formats)
        log(f"4-bit paths: key_format {args.key_format} ({chosen.get('chosen')})")
    log(f"model {model_dir}: {model.args.num_hidden_layers} layers; {len(tokens)} held-out tokens of {len(files)} files")
    res = run(s, tokens, tokenizer, cfg, log=log, parts=("kinds",) if args.kinds_only else PARTS)

    from mlx.utils import tree_flatten

    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    command = "vllm-mlx-persist splice-drift" + "".join(" " + shlex.quote(a) for a in argv)
    if sys.platform == "linux":
        command = f"LD_PRELOAD={OPENBLAS} {command}"
    res = {"command": command, "machine": machine_info(), "model_dir": str(model_dir), "key_format": args.key_format,
           "model": f"{model.args.model_type}, {model.args.num_hidden_layers} layers, {params / 1e6:.2f}M parameters, "
                    f"{next(v.dtype for _, v in tree_flatten(model.parameters()))}".replace("mlx.core.", ""),
           "heldout_files": files, **res}
    res["seconds"]["total"] = time.perf_counter() - t_start
    write_report(res, out, plots=not args.no_plot)
    log(f"wrote {out / 'splice_drift.md'} ({res['seconds']['total']:.0f} s)")
    return 0
