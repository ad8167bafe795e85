"""Batch invariance: a sequence's answer does not depend on which other sequences it is batched with.

Per family (micro random float32 models built with mlx-lm's own classes, sliding window 16), four
prompts longer than the window and of different lengths go through mlx-lm's BatchGenerator as
vllm-mlx drives it: each alone, then all four inserted together (right-padded chunked prefill,
left-padded decode, companions finishing first) and staggered (rows joining a running batch), one
of them a returning agent whose cache already holds most of its prompt (its last two prompt tokens
are prefilled in the same step as the others' 16-token chunks). With the float decode mirror off
and on, and prefill attention on the 4-bit matmuls and on dequantized K/V.

* `test_attention_rows_bit_identical`: the cache and attention alone, no model: each row of a
  left-padded batch (decode) and of a right-padded prefill chunk attends exactly as it does alone,
  also on caches that hold only their window (`Q4KVCache(window=16)`).
* `test_logits_bit_identical`: every step's logprobs alone == batched, bit for bit, on every
  family whose layers persist_q4 runs (4-bit attention, sliding windows, sinks, recurrent state).
  The model's own projections (Linear, MoE experts, short convolutions) are evaluated one token row
  at a time here: OpenBLAS (preloaded into tests and servers) rounds a matrix product's rows
  differently with the number of rows in it, which changes logits by ~1e-6 with any cache, mlx-lm's
  own included (docs/design.md, "Batch invariance"; qwen3_next's depthwise convolution, a product
  over the chunk's positions, does so on OpenBLAS's Nehalem kernels); row by row takes that out, so
  what is compared is everything else, the cache and attention first. Fails on the code before
  per-row attention (the float SDPA over a padded batch: mirror decode, dequantized prefill). The
  sliding-window families also run with bounded sliding layers (`ModelCodec.for_model(model,
  bounded=True)`), whose rows drop their oldest columns at times that depend on the batch.
* `test_greedy_invariant`: the model as served (one prompt per prefill call, as persist_q4 sets
  vllm-mlx's scheduler; the projections as the BLAS gives them), every family: greedy tokens alone ==
  batched, the first token's logprobs bit for bit (computed from the prompt alone), and every later
  step's within REL_TOL of its largest |logprob|. Decode steps' projections are one product over the
  rows decoding, which a BLAS may round with the number of rows (OpenBLAS's SkylakeX and SSE kernels
  from 2 rows, its Haswell and Zen kernels from 4, mlx's own never): ~1e-7, which 4-bit quantization
  can turn into a level of a generated token's K/V (3.0e-4, under REL_TOL; the defects above cost
  3.1e-3 and more). MLA layers keep mlx-lm's own cache and attention arithmetic, and
  deepseek_v32's indexer switches to sparse attention on the batch's padded length, so those two
  families are not bit-identical even row by row. With prompts prefilled together (batch_prefill:
  true) a prompt's own K/V round with its companions too, which is why persist_q4 does not serve
  that way by default.

Each test passes on every BLAS kernel (`./dev test-kernels`, docs/operations.md).
"""

from __future__ import annotations

import copy
import random

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import base as mlx_base

from vllm_mlx_persist.caches import ModelCodec
from vllm_mlx_persist.caches.attention import install_attention_fix
from vllm_mlx_persist.caches.floats import FloatCopies
from vllm_mlx_persist.caches.q4 import Q4KVCache
from vllm_mlx_persist.tools.models.build import SIZES, Size, build_model

WINDOW = 16
SIZE = Size(**{**SIZES["micro"].__dict__, "sliding_window": WINDOW, "vocab": 512})
STEP = 16  # prefill chunk: prompts span several chunks, rows end mid-chunk
LENGTHS = [50, 35, 23, 61]  # all > WINDOW; 35 and 50 end their prefill with a 2- and 1-token chunk
MAX_TOKENS = [9, 5, 12, 7]
RETURNING = 3  # this row's cache holds all but the last 3 tokens of its prompt
# Of a step's largest |logprob| (lfm2's tied embeddings: ~170; others ~10), alone vs batched as served.
# Decode steps' projections round with the number of rows: 2e-7 to 6.4e-7 (OpenBLAS's SkylakeX,
# Cooperlake kernels; Haswell and Zen: 0 but deepseek_v32's 2e-7), and 4-bit quantization can turn
# that into a level on a generated token's K/V: 3.0e-4 (llama, its Prescott and Atom kernels). A row
# attending with another row's mask or its keys one column early: 3.1e-3 (lfm2) to 0.5.
REL_TOL = 1e-3
# What persist_q4 serves with (backend.py: vllm-mlx's prefill_batch_size set to 1, option
# batch_prefill false): one prompt per prefill call, so its K/V do not depend on its companions.
SERVED_PREFILL_BATCH = 1
BIT_ARCHS = ["llama", "gemma3_text", "gpt_oss", "qwen3_next", "lfm2"]
WINDOW_ARCHS = ["gemma3_text", "gpt_oss"]  # also run with sliding layers that hold only their window
ALL_ARCHS = BIT_ARCHS + ["deepseek_v3", "deepseek_v32"]


@pytest.fixture(params=["quantized", "dequantized"])
def prefill_mode(request, float_copies):
    """The prefill attention mode of the test's `float_copies` (conftest)."""
    float_copies.set_prefill_attention(request.param)
    return request.param


_MODELS: dict = {}


def _family(arch: str, bounded: bool, copies: FloatCopies):
    """The family's model (built once) and a codec making its caches under the test's `copies`."""
    if arch not in _MODELS:
        model, _ = build_model(arch, SIZE, seed=0)
        _MODELS[arch] = (model, ModelCodec.for_model(model), ModelCodec.for_model(model, bounded=True))
    install_attention_fix()
    model, linear, window = _MODELS[arch]
    return model, (window if bounded else linear).with_float_copies(copies)


def _arch_params(archs: list) -> list:
    return [pytest.param(a, False, id=a) for a in archs] + [
        pytest.param(a, True, id=f"{a}-bounded") for a in archs if a in WINDOW_ARCHS]


def _prompts() -> list[list[int]]:
    return [[random.Random(i).randrange(5, SIZE.vocab) for _ in range(n)] for i, n in enumerate(LENGTHS)]


def _run(model, codec, rows: list[int], schedule: dict[int, list[int]], prefix, prefill_batch: int) -> dict[int, tuple]:
    """Drive one BatchGenerator prefilling up to `prefill_batch` prompts per model call:
    `schedule[step]` lists the rows inserted before that step. Returns {row: (tokens, [logprobs per step])}."""
    prompts = _prompts()
    gen = BatchGenerator(model, max_tokens=max(MAX_TOKENS), prefill_step_size=STEP, prefill_batch_size=prefill_batch)
    uid_row, out, step = {}, {r: ([], []) for r in rows}, 0
    while step <= max(schedule) or any(len(out[r][0]) < MAX_TOKENS[r] for r in rows):
        now = schedule.get(step, [])
        if now:
            caches, seqs = [], []
            for r in now:
                if r == RETURNING:
                    caches.append(copy.deepcopy(prefix))
                    seqs.append(prompts[r][-3:])
                else:
                    caches.append(codec.make_cache())
                    seqs.append(prompts[r])
            uid_row.update(zip(gen.insert(seqs, max_tokens=[MAX_TOKENS[r] for r in now], caches=caches), now))
        for resp in gen.next()[1]:
            toks, lps = out[uid_row[resp.uid]]
            toks.append(resp.token)
            lps.append(resp.logprobs)
        step += 1
        assert step < 300
    return out


def _alone_and_batched(model, codec, carried: bool = False, prefill_batch: int = 8) -> tuple[dict, list[dict]]:
    prefix = codec.make_cache()
    mx.eval(model(mx.array([_prompts()[RETURNING][:-3]]), cache=prefix))
    if carried:  # the floats a hot turn carries from the agent's last turn (floats.CarriedFloats)
        for c in prefix:
            if isinstance(c, Q4KVCache) and c.window is None:
                c.floats = tuple(mx.dequantize(*q, group_size=c.group_size, bits=c.bits) for q in c.to_arrays())
    rows = list(range(len(LENGTHS)))
    alone = {r: _run(model, codec, [r], {0: [r]}, prefix, prefill_batch)[r] for r in rows}
    together = _run(model, codec, rows, {0: rows}, prefix, prefill_batch)
    staggered = _run(model, codec, rows, {0: [0, 2], 2: [3], 5: [1]}, prefix, prefill_batch)
    return alone, [together, staggered]


def _max_diff(a: list, b: list) -> float:
    return max(mx.abs(x - y).max().item() for x, y in zip(a, b))


def _max_rel_diff(a: list, b: list) -> float:
    return max((mx.abs(x - y).max() / mx.abs(x).max()).item() for x, y in zip(a, b))


@pytest.mark.parametrize("arch,bounded", _arch_params(BIT_ARCHS))
def test_logits_bit_identical(arch, bounded, decode_mirror, prefill_mode, row_by_row, float_copies):
    model, codec = _family(arch, bounded, float_copies)
    alone, batched = _alone_and_batched(model, codec)
    for name, run in zip(("together", "staggered"), batched):
        for r, (toks, lps) in alone.items():
            assert run[r][0] == toks, (arch, name, r)
            same = [mx.array_equal(x, y).item() for x, y in zip(lps, run[r][1])]
            assert all(same), (arch, name, r, same, _max_diff(lps, run[r][1]))
    assert len({tuple(t) for t, _ in alone.values()}) > 1  # not degenerate


@pytest.mark.parametrize("arch,bounded", _arch_params(["llama", "gemma3_text", "qwen3_next"]))
def test_logits_bit_identical_with_carried_floats(arch, bounded, row_by_row):
    """The returning agent carries its last turn's floats, which start the batch's mirror at the
    merge (the other rows' K/V dequantized into it): every row's logprobs alone == batched, and
    == the same runs with nothing carried (the mirror then built by dequantizing), bit for bit."""
    copies = FloatCopies(decode_float_mb=256)
    model, codec = _family(arch, bounded, copies)
    started = copies.mirror_counts["carried"]
    alone, batched = _alone_and_batched(model, codec, carried=True)
    assert copies.mirror_counts["carried"] > started
    plain, _ = _alone_and_batched(model, codec)
    for name, run in zip(("together", "staggered", "nothing carried"), batched + [plain]):
        for r, (toks, lps) in alone.items():
            assert run[r][0] == toks, (arch, name, r)
            assert all(mx.array_equal(x, y).item() for x, y in zip(lps, run[r][1])), (arch, name, r)


@pytest.mark.parametrize("arch,bounded", _arch_params(ALL_ARCHS))
def test_greedy_invariant(arch, bounded, decode_mirror, float_copies):
    model, codec = _family(arch, bounded, float_copies)
    alone, batched = _alone_and_batched(model, codec, prefill_batch=SERVED_PREFILL_BATCH)
    worst = max(_max_rel_diff(lps, run[r][1]) for run in batched for r, (_, lps) in alone.items())
    print(arch, f"max |Δlogprob| / max |logprob|, alone vs batched: {worst:.1e}")
    for name, run in zip(("together", "staggered"), batched):
        for r, (toks, lps) in alone.items():
            assert run[r][0] == toks, (arch, name, r)
            # The first token comes from the prompt alone: the same bits on every BLAS.
            assert mx.array_equal(lps[0], run[r][1][0]).item(), (arch, name, r, _max_diff(lps[:1], run[r][1][:1]))
            assert _max_rel_diff(lps, run[r][1]) < REL_TOL, (arch, name, r)


@pytest.mark.parametrize("window,sinks,bounded", [
    (None, False, False), (16, False, False), (16, True, False), (16, False, True), (16, True, True)])
def test_attention_rows_bit_identical(decode_mirror, prefill_mode, window, sinks, bounded, float_copies):
    """Through the installed dispatcher, rows of 40, 23 and 57 cached tokens batched (left padding)
    attend bit for bit as each alone: a decode step, then a 16-token prefill chunk in which the rows
    have 5, 2 and 16 real tokens (right padding), with a sliding-window mask and attention sinks,
    and on caches that hold only the window (the batch drops 42 columns in the chunk, each row alone
    a different number)."""
    install_attention_fix()
    mx.random.seed(0)
    n_q, n_kv, D, lengths = 4, 2, 64, [40, 23, 57]
    rows = []
    for n in lengths:
        c = Q4KVCache(window=window if bounded else None, float_copies=float_copies)
        c.update_and_fetch(mx.random.normal((1, n_kv, n, D)), mx.random.normal((1, n_kv, n, D)))
        rows.append(c)
    sink = mx.random.normal((n_q,)) if sinks else None
    batch, alone = Q4KVCache.merge(rows), [Q4KVCache.merge([c]) for c in rows]

    def attend(cache, q, k, v, real=None):
        if real is not None:
            cache.prepare(lengths=real, right_padding=[q.shape[2] - r for r in real])
        mask = cache.make_mask(q.shape[2], window_size=window)
        keys, values = cache.update_and_fetch(k, v)
        out = mlx_base.scaled_dot_product_attention(q, keys, values, cache=cache, scale=D**-0.5, mask=mask, sinks=sink)
        mx.eval(out)
        return out

    for L, real in ((1, None), (16, [5, 2, 16])):
        q = mx.random.normal((3, n_q, L, D))
        k, v = mx.random.normal((3, n_kv, L, D)), mx.random.normal((3, n_kv, L, D))
        got = attend(batch, q, k, v, real)
        for b, c in enumerate(alone):
            n = L if real is None else real[b]
            want = attend(c, q[b : b + 1, :, :n], k[b : b + 1, :, :n], v[b : b + 1, :, :n])
            mine = got[b : b + 1, :, :n]
            assert mx.array_equal(mine, want).item(), (L, b, mx.abs(mine - want).max().item())
        if real is not None:
            batch.finalize()
    if bounded:
        assert min(batch.starts()) > 0 and batch.keys[0].shape[2] <= 16 + 16
