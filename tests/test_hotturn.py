"""A returning agent's hot turn starts its float mirror from the floats its last turn ended with
(`floats.CarriedFloats`, kept by the pool beside the turn's 4-bit blocks) instead of dequantizing
its history: the same values, so the same logits, bit for bit, as a turn that dequantizes (a reload
from disk, or no carry budget). Real MLX on the CPU, tiny random models, mlx-lm's BatchGenerator.
"""

from __future__ import annotations

import copy
import gc
import random

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator

from vllm_mlx_persist.caches import ModelCodec
from vllm_mlx_persist.caches.floats import FloatCopies
from vllm_mlx_persist.identity import model_fingerprint
from vllm_mlx_persist.pool import BlockPool
from vllm_mlx_persist.caches.attention import install_attention_fix
from vllm_mlx_persist.caches.q4 import BatchQ4KVCache, Q4KVCache, make_q4_prompt_cache
from vllm_mlx_persist.store import DiskStore
from vllm_mlx_persist.tools.models.build import build_model

BLOCK = 16


@pytest.fixture(scope="module")
def model():
    m, _ = build_model("llama", "tiny", seed=0)
    install_attention_fix()
    return m


@pytest.fixture(autouse=True)
def budgets(float_copies):
    """The test's own budgets (`float_copies`, conftest): 256 MB for the mirrors and the carried floats."""
    float_copies.set_decode_float_budget(256)
    float_copies.set_carry_float_budget(256)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 1000) for _ in range(n)]


def _history(model, n: int, seed: int, carried: bool, copies: FloatCopies) -> list[Q4KVCache]:
    """A per-sequence 4-bit cache after n tokens, under `copies`, with the floats a turn would carry, or none."""
    cache = make_q4_prompt_cache(model, float_copies=copies)
    mx.eval(model(mx.array([_tokens(n, seed)]), cache=cache))
    if carried:
        for c in cache:
            k, v = c.to_arrays()
            c.floats = tuple(mx.dequantize(*q, group_size=64, bits=4) for q in (k, v))
    return cache


def _turn(model, rows: list[list], new: list[list[int]], steps: int = 3):
    """Merge the rows as BatchGenerator does, one prefill chunk of their new tokens (right-padded
    when their lengths differ), then decode steps. Returns the logits and the mirror builds."""
    counts = rows[0][0].float_copies.mirror_counts
    builds = counts["builds"]
    batch = [BatchQ4KVCache.merge([r[l] for r in rows]) for l in range(len(model.layers))]
    started = [c.float_kv() is not None for c in batch]
    for c in batch:
        if c.float_kv() is not None:
            for got, packed in zip(c.float_kv(), (c.keys, c.values)):
                want = mx.dequantize(*(x[..., : c.size(), :] for x in packed), group_size=64, bits=4)
                assert mx.array_equal(got, want).item()
    n = max(map(len, new))
    if len(rows) > 1 and min(map(len, new)) != n:
        for c in batch:
            c.prepare(lengths=[len(t) for t in new], right_padding=[n - len(t) for t in new])
    x = mx.array([t + [0] * (n - len(t)) for t in new])
    logits = [model(x, cache=batch)[:, -1]]
    for c in batch:
        c.finalize()
    for s in range(steps):
        logits.append(model(mx.array([[7 + s + b] for b in range(len(rows))]), cache=batch)[:, -1])
    mx.eval(logits)
    return logits, all(started), counts["builds"] - builds


@pytest.mark.parametrize("chunk", [12, 600], ids=["short-chunk", "long-chunk"])
def test_one_row_starts_from_its_carried_floats_and_changes_no_logit(model, chunk, float_copies):
    """One returning agent: with its carried floats the merge starts the mirror (nothing is
    dequantized: no mirror build), and every logit equals the turn that dequantizes its history
    (a chunk under 512 tokens builds the mirror, a longer one attends on a transient copy)."""
    new = [_tokens(chunk, 5)]
    ref, started_ref, builds_ref = _turn(model, [_history(model, 300, 1, False, float_copies)], new)
    got, started, builds = _turn(model, [_history(model, 300, 1, True, float_copies)], new)
    assert (started_ref, started, builds) == (False, True, 0)
    assert builds_ref == len(model.layers)  # the chunk (short) or the first decode step (long)
    assert all(mx.array_equal(a, b).item() for a, b in zip(ref, got))


def test_rows_with_and_without_carried_floats_batch_bit_identically(model, float_copies):
    """Three rows of different lengths, one carrying floats, one not, one empty (a new agent):
    the merged mirror holds the carried values and the dequantized ones, and every row's logits
    equal the same batch with nothing carried."""
    new = [_tokens(9, 6), _tokens(14, 7), _tokens(30, 8)]

    def rows(carry: bool) -> list:
        return [_history(model, 280, 2, carry, float_copies), _history(model, 150, 3, False, float_copies),
                make_q4_prompt_cache(model, float_copies=float_copies)]

    ref, started_ref, _ = _turn(model, rows(False), new)
    got, started, builds = _turn(model, rows(True), new)
    assert (started_ref, started, builds) == (False, True, 0)
    assert all(mx.array_equal(a, b).item() for a, b in zip(ref, got))


def test_a_write_or_trim_drops_the_carried_floats(model, float_copies):
    """A cache used on its own (not merged) stops carrying floats once its K/V change."""
    cache = _history(model, 40, 4, True, float_copies)
    cache[0].update_and_fetch(mx.zeros((1, 2, 1, 64)), mx.zeros((1, 2, 1, 64)))
    cache[1].trim(3)
    assert cache[0].floats is None and cache[1].floats is None


def test_carry_budget_keeps_the_most_recently_used():
    """Copies are kept within the budget, least recently used dropped first, one larger than the
    budget never kept; the bytes go when their holders do."""
    mib = lambda: {0: (mx.zeros((1, 2, 1024, 64)), mx.zeros((1, 2, 1024, 64)))}  # noqa: E731 - 1 MiB
    copies = FloatCopies(carry_float_mb=3)
    a, b, c = (copies.carry_floats(mib(), 1024) for _ in range(3))
    assert copies.carry_float_bytes() == 3 << 20
    assert a.take(1000)[0][0].shape == (1, 2, 1000, 64)  # a is now the most recently used
    d = copies.carry_floats(mib(), 1024)
    assert b.layers is None and b.take(10) is None  # b went, not a
    assert all(x.layers is not None for x in (a, c, d))
    assert copies.carry_floats({0: (mx.zeros((1, 2, 8192, 64)),) * 2}, 8192) is None  # 8 MiB: never
    assert a.take(1025) is None  # beyond what it holds
    del a, b, c, d
    gc.collect()
    assert copies.carry_float_bytes() == 0


# ---- through the pool and mlx-lm's BatchGenerator -----------------------------------------------


def _pool(model, root, copies: FloatCopies) -> BlockPool:
    """A pool whose codec makes its caches under `copies` (as the backend's does under its own)."""
    fmt = {"bits": 4, "group_size": 64, "block_size": BLOCK}
    fp = model_fingerprint(model, None, fmt)
    codec = ModelCodec.for_model(model, float_copies=copies)
    pool = BlockPool(fingerprint=fp, n_layers=codec.n_layers, bits=4, group_size=64, block_size=BLOCK,
                     hot_bytes=1 << 30, store=DiskStore(root, fp, {"test": True}, fmt), codec=codec)
    pool.load_manifests()
    return pool


def _serve(model, pool: BlockPool, prompt: list[int], max_tokens: int = 6):
    """One request as vllm-mlx's scheduler serves it with the backend: lookup, BatchGenerator from
    the hit (or a fresh cache), commit of the extracted cache. Returns tokens, logprobs, tier and
    the mirror builds during the request."""
    counts = pool.codec.float_copies.mirror_counts
    builds = counts["builds"]
    m = pool.match("a", prompt, "r")
    cache, rest = (m.cache, prompt[m.num_tokens:]) if m.cache is not None else (pool.codec.make_cache(), prompt)
    gen = BatchGenerator(model, max_tokens=max_tokens, prefill_step_size=2048)
    gen.insert([rest], max_tokens=[max_tokens], caches=[cache])
    del cache, m.cache
    tokens, logprobs = [], []
    while True:
        for r in gen.next()[1]:
            tokens.append(r.token)
            logprobs.append(r.logprobs)
            if r.finish_reason is not None:
                pool.commit("a", prompt + tokens, r.prompt_cache, "r")
                pool.finish("r")
                return tokens, logprobs, m.tier, counts["builds"] - builds


def test_a_hot_turn_runs_on_the_carried_floats_like_a_reloaded_one(model, tmp_path, float_copies):
    """Turn 1 is cold; turn 2 is hot: the committed run carries turn 1's floats and the turn
    dequantizes nothing. The same turn 2 reloaded from disk (a new pool) dequantizes its history
    and gives the same tokens and logprobs, bit for bit; so does a hot turn with no carry budget."""
    first = _tokens(300, 11)
    pool = _pool(model, tmp_path / "a", float_copies)
    out1, _, tier, _ = _serve(model, pool, first)
    assert tier == "miss"
    run = pool.blocks[pool.agent("a").block_ids[0]].run[0]
    assert run.floats is not None and run.floats.n == len(first) + len(out1)
    second = first + out1 + _tokens(20, 12)
    used = float_copies.carry_counts["used"]
    hot = _serve(model, pool, second)
    assert (hot[2], hot[3], float_copies.carry_counts["used"]) == ("hot", 0, used + 1)
    pool.close()

    pool = _pool(model, tmp_path / "a", float_copies)  # a restart: the blocks come from disk, no floats with them
    reloaded = _serve(model, pool, second)
    assert (reloaded[2], reloaded[3]) == ("disk", len(model.layers))
    pool.close()

    pool = _pool(model, tmp_path / "b", FloatCopies(decode_float_mb=256, carry_float_mb=0))
    _serve(model, pool, first)
    assert pool.blocks[pool.agent("a").block_ids[0]].run[0].floats is None
    uncarried = _serve(model, pool, second)
    assert (uncarried[2], uncarried[3]) == ("hot", len(model.layers))
    pool.close()
    for other in (reloaded, uncarried):
        assert hot[0] == other[0]
        assert all(mx.array_equal(a, b).item() for a, b in zip(hot[1], other[1]))


def test_carried_floats_go_with_their_run(model, tmp_path, float_copies):
    """The floats live as long as the run of hot blocks that holds them: cleared with the pool's
    hot tier, and replaced, not accumulated, turn after turn."""
    gc.collect()
    base = float_copies.carry_float_bytes()
    pool = _pool(model, tmp_path, float_copies)
    prompt = _tokens(200, 13)
    for i in range(3):
        out, *_ = _serve(model, pool, prompt)
        prompt = prompt + out + _tokens(10, 14 + i)
        gc.collect()
        # an int, not the run: an object named in an assert stays alive in pytest's rewritten frame
        kept = pool.blocks[pool.agent("a").block_ids[0]].run[0].floats.nbytes
        assert float_copies.carry_float_bytes() - base == kept
    pool.clear()
    gc.collect()
    assert float_copies.carry_float_bytes() == base
    pool.close()


def test_carried_floats_go_when_the_run_loses_its_first_block(model, tmp_path, float_copies):
    """Once the run's first block leaves memory no lookup can take the run whole, so its floats are
    released at once, while the other blocks (and the run's 4-bit arrays) stay hot."""
    gc.collect()
    base = float_copies.carry_float_bytes()
    pool = _pool(model, tmp_path, float_copies)
    prompt = _tokens(200, 21)
    _serve(model, pool, prompt)
    first, second = (pool.blocks[b] for b in pool.agent("a").block_ids[:2])
    run = first.run[0]
    assert run.floats is not None and float_copies.carry_float_bytes() > base
    pool.flush()  # the blocks on disk first: they leave memory as an eviction would make them
    pool.table.drop(second)  # a later block leaving keeps them: a shorter prefix still uses them
    assert run.floats is not None
    pool.table.drop(first)
    assert run.floats is None and run.members
    del run
    gc.collect()
    assert float_copies.carry_float_bytes() == base
    pool.close()


def test_splitting_a_prompt_batch_copies_nothing(model, float_copies):
    """mlx-lm moves a prompt batch to decode by deep-copying it, emptying the original and
    filtering the copy to all its rows: no byte of the packed storage or the mirror is copied (the
    mirror was copied twice per turn before: a float copy of the history per layer), and a write
    to either side afterwards leaves the other as it was."""
    batch = BatchQ4KVCache.merge([_history(model, 300, 15, True, float_copies)[0]])
    batch.update_and_fetch(mx.ones((1, 2, 5, 64)), mx.ones((1, 2, 5, 64)))
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
