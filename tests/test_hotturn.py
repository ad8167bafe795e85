"""A returning agent's hot turn: what it costs beyond vllm-mlx's own (issue #24 item 2). Real MLX
on the CPU, tiny random models.
"""

from __future__ import annotations

import copy
import gc
import random

import mlx.core as mx
import pytest

from vllm_mlx_persist import q4cache
from vllm_mlx_persist.q4cache import BatchQ4KVCache, install_attention_fix, make_q4_prompt_cache
from vllm_mlx_persist.tools.models import build_model


@pytest.fixture(scope="module")
def model():
    m, _ = build_model("llama", "tiny", seed=0)
    install_attention_fix()
    return m


@pytest.fixture(autouse=True)
def budgets():
    q4cache.set_decode_float_budget(256)
    yield
    q4cache.set_decode_float_budget("auto")


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 1000) for _ in range(n)]


def test_splitting_a_prompt_batch_copies_nothing(model):
    """mlx-lm moves a prompt batch to decode by deep-copying it, emptying the original and
    filtering the copy to all its rows: no byte of the packed storage or the mirror is copied (the
    mirror was copied twice per turn before: a float copy of the history per layer), and a write
    to either side afterwards leaves the other as it was."""
    cache = make_q4_prompt_cache(model)
    mx.eval(model(mx.array([_tokens(300, 15)]), cache=cache))
    batch = BatchQ4KVCache.merge([cache[0]])
    batch.update_and_fetch(mx.ones((1, 2, 5, 64)), mx.ones((1, 2, 5, 64)))  # builds the mirror
    mx.eval(batch.state, batch.float_kv())
    gc.collect()
    before = mx.get_active_memory()
    copied = copy.deepcopy(batch)
    copied.filter([0])
    mx.eval(copied.state, copied.float_kv())
    assert mx.get_active_memory() - before < 4096  # a few scalars, not 300 x 2 heads x 64 x 4 B x 2
    old = mx.array(batch.float_kv()[0])
    copied.update_and_fetch(mx.zeros((1, 2, 1, 64)), mx.zeros((1, 2, 1, 64)))
    mx.eval(copied.float_kv())
    assert mx.array_equal(batch.float_kv()[0], old).item()
    assert copied.size() == batch.size() + 1
    assert mx.array_equal(copied.float_kv()[0][..., : batch.size(), :], old).item()
