"""Span directives, amortize: a splice executed at pool level on real MLX (vllm_mlx_persist/splice.py):
the exact prefix and the run's values byte-identical to what was stored, the run's keys moved to their
new positions (layer 0, whose K depends only on token and position, matches a cold prefill to 4-bit
precision; unmoved it does not), and the model decodes on the result."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from vllm_mlx_persist.amortize import Splice, find_splice
from vllm_mlx_persist.caches import ModelCodec
from vllm_mlx_persist.chain import lcp
from vllm_mlx_persist.kv_edit import AMORTIZE
from vllm_mlx_persist.rope_shift import probe_model
from vllm_mlx_persist import splice
from test_pool import GROUP, make_pool, prefill

A = 2  # the message-start token of these synthetic conversations


def msg(n, seed):
    return [A] + np.random.default_rng(seed).integers(5, 500, size=n - 1).tolist()


@pytest.fixture(scope="module")
def model():
    from vllm_mlx_persist.tools.models import build_model

    m, _ = build_model("llama", "tiny", seed=0)
    return m


def deq(arrays, layer, x):
    return mx.dequantize(*(arrays[f"{layer}.{x}.{p}"] for p in "qsb"), GROUP, 4)


def cache_arrays(cache, codec, lo, hi):
    return {n: a[..., lo:hi, :] for n, a in codec.token_arrays(cache).items()}


@pytest.mark.parametrize("stub_len", [3, 45])  # Δ < 0 (a long span replaced by a short stub) and Δ > 0
def test_a_splice_moves_the_run_and_keeps_everything_else(model, tmp_path, stub_len):
    pool = make_pool(model, tmp_path)
    codec = ModelCodec.for_model(model)
    head, span, tail = msg(40, 1), msg(30, 2), msg(40, 3)
    stored = head + span + tail
    cache, _ = prefill(model, stored)
    assert pool.commit("a", stored, cache) == len(stored)
    prompt = head + msg(stub_len, 4) + tail + msg(6, 5)

    m = pool.match("a", prompt, "r", edit=AMORTIZE)
    assert m.stored == stored and m.num_tokens == 41  # the span's start token matched too
    plan = find_splice(m.stored, prompt, lcp(m.stored, prompt), A)
    assert isinstance(plan, Splice) and plan.src == 70 and plan.at == 40 + stub_len and plan.length == 40
    assert plan.delta == stub_len - 30
    run = pool.run_arrays(m.source, plan.src, plan.src + plan.length)
    verdicts = probe_model(model)
    spliced, n = splice.apply(model, codec, verdicts, m.cache, m.num_tokens, prompt, plan, run)
    pool.finish("r")
    assert n == plan.at + plan.length and all(c.offset == n for c in spliced)

    got = cache_arrays(spliced, codec, 0, n)
    old = codec.token_arrays(cache)
    for name in old:  # the exact prefix: byte for byte what was stored
        assert mx.array_equal(got[name][..., :m.num_tokens, :], old[name][..., :m.num_tokens, :]).item(), name
    moved = {k: a[..., plan.at:, :] for k, a in got.items()}
    for name in (x for x in run if ".v." in x):  # the run's values: untouched
        assert mx.array_equal(moved[name], run[name]).item(), name
    # Layer 0's keys depend only on token and position: moved, they are a cold prefill's to 4-bit
    # precision; left where they were stored, they are far off.
    cold, _ = prefill(model, prompt[:n])
    ref = cache_arrays(cold, codec, plan.at, n)
    step = mx.abs(ref["0.k.s"].astype(mx.float32)).max().item()
    assert mx.abs(deq(moved, 0, "k") - deq(ref, 0, "k")).max().item() <= 2 * step
    assert mx.abs(deq(run, 0, "k") - deq(ref, 0, "k")).max().item() > 4 * step
    assert mx.array_equal(moved["0.v.q"], ref["0.v.q"]).item()  # layer-0 values: the same tokens' values

    # The model decodes on the spliced cache.
    _, logits = prefill(model, prompt[n:], spliced)
    assert mx.all(mx.isfinite(logits)).item()
    pool.close()


def test_only_linear_q4_models_are_spliced_here():
    from vllm_mlx_persist.tools.models import build_model

    assert splice.supported(ModelCodec.for_model(build_model("llama", "tiny")[0]))
    assert not splice.supported(ModelCodec.for_model(build_model("gemma3_text", "tiny")[0], bounded=True))
    assert not splice.supported(ModelCodec.for_model(build_model("deepseek_v3", "tiny")[0]))
