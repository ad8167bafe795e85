"""Every cache kind persist_q4 serves, per model family, on tiny random float32 models built with
mlx-lm's own classes (vllm_mlx_persist.tools.models.build): sliding window (gemma3_text), sliding window +
attention sinks + MoE (gpt_oss), gated-delta linear attention (qwen3_next) and short-convolution
(lfm2) hybrids, latent MLA (deepseek_v3).

Checks per family:
* batched 4-bit greedy (mlx-lm's BatchGenerator, staggered inserts, chunked prefill, one insert on
  a cache rebuilt from the pool) == the per-sequence loop on the same caches, token for token;
* hot and reloaded-from-disk caches are bit-identical;
* logits of cold, hot, reloaded and DIVERGE (trimmed) caches stay within LOGIT_TOL of mlx-lm's
  full-precision caches (its own RotatingKVCache / ArraysCache / KVCache) on the same prompt.

Tolerance, in units of the reference logits' std (lfm2's tied embeddings give std ~19, the
others ~1): measured max |Δlogit| / std with 4-bit K/V is 0.034 (gemma3_text), 0.19 (gpt_oss),
0.045 (qwen3_next), 0.06 (lfm2), and ~1e-6 for deepseek_v3 (its latent stays full precision).
REL_TOL = 0.4 leaves 2x margin and still fails on a misplaced window, sink, state or token (those
move logits by about one std or more).
"""

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from vllm_mlx_persist.caches import ModelCodec, StateCache
from vllm_mlx_persist.caches.floats import FloatCopies
from vllm_mlx_persist.caches.attention import install_attention_fix
from vllm_mlx_persist.caches.q4 import BatchQ4KVCache
from vllm_mlx_persist.pool import BlockPool
from vllm_mlx_persist.store import DiskStore
from vllm_mlx_persist.tools.models.build import SIZES, Size, build_model

REL_TOL = 0.4
BLOCK = 16
WINDOW = 16  # sliding window of gemma3_text / gpt_oss: prompts here are longer, so it matters
SIZE = Size(**{**SIZES["tiny"].__dict__, "sliding_window": WINDOW, "vocab": 512})
ARCHS = ["gemma3_text", "gpt_oss", "qwen3_next", "lfm2", "deepseek_v3", "deepseek_v32"]


# The sliding families also with their sliding layers bounded to the window (the server's codec): the
# live caches hold only the window, blocks the window before each turn's end.
BOUNDED = ["gemma3_text", "gpt_oss"]


@pytest.fixture(scope="module", params=[(a, False) for a in ARCHS] + [(a, True) for a in BOUNDED],
                ids=lambda p: p[0] + ("-bounded" if p[1] else ""))
def family(request):
    arch, bounded = request.param
    model, _ = build_model(arch, SIZE, seed=0)
    install_attention_fix()
    return arch, model, ModelCodec.for_model(model, bounded=bounded)


@pytest.fixture(scope="module")
def hybrid():
    """(model, codec): the recurrent hybrid qwen3_next alone, for the tests of its states."""
    model, _ = build_model("qwen3_next", SIZE, seed=0)
    install_attention_fix()
    return model, ModelCodec.for_model(model)


def _prompt(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(5, SIZE.vocab) for _ in range(n)]


def _logits(model, cache, tokens):
    out = model(mx.array([tokens]), cache=cache)[0, -1]
    mx.eval(out)
    return out


def _greedy(model, cache, prompt, n):
    """Per-sequence reference, prefilled like BatchGenerator: all but the last token, then decode."""
    if len(prompt) > 1:
        mx.eval(model(mx.array([prompt[:-1]]), cache=cache))
    out, y = [], prompt[-1]
    for _ in range(n):
        y = mx.argmax(model(mx.array([[y]]), cache=cache)[0, -1]).item()
        out.append(y)
    return out


def _pool(codec, root, fp="f" * 64):
    fmt = {"bits": 4, "group_size": 64, "block_size": BLOCK}
    store = DiskStore(root, fp, {"test": True}, fmt)
    pool = BlockPool(fingerprint=fp, n_layers=codec.n_layers, bits=4, group_size=64, block_size=BLOCK,
                     hot_bytes=1 << 30, store=store, codec=codec)
    pool.load_manifests()
    return pool


def _flat(cache):
    for c in cache:
        if isinstance(c, StateCache):
            yield from c.cache
        elif hasattr(c, "caches"):
            for s in c.caches:
                yield from (s.keys[..., : s.offset, :], s.values[..., : s.offset, :])
        elif isinstance(c.keys, tuple):
            yield from c.keys + c.values
        else:
            yield from (c.keys[..., : c.offset, :], c.values[..., : c.offset, :])


def _same(a, b):
    xs, ys = list(_flat(a)), list(_flat(b))
    return len(xs) == len(ys) and all(x.dtype == y.dtype and mx.array_equal(x, y).item() for x, y in zip(xs, ys))


def test_batched_equals_per_sequence(family, decode_mirror, float_copies):
    """Also with the float decode mirror on (the 4-bit layers' batch caches decode on it; MLA,
    recurrent and CacheList layers are untouched), against the same per-sequence 4-bit reference."""
    arch, model, codec = family
    codec = codec.with_float_copies(float_copies)
    prompts = [_prompt(n, s) for s, n in enumerate([40, 9, 27, 33])]
    max_tokens = [6, 9, 4, 7]
    # sequence 3 starts from a cache rebuilt by the pool (20 tokens of its prompt)
    pre = codec.make_cache()
    _logits(model, pre, prompts[3][:21])
    pool = BlockPool(fingerprint="e" * 64, n_layers=codec.n_layers, bits=4, group_size=64, block_size=BLOCK,
                     hot_bytes=1 << 30, store=None, codec=codec)
    pool.commit("a", prompts[3][:21], pre)
    hit, n, _ = pool.lookup("a", prompts[3])
    assert n > 0 or codec.has_state is False
    gen = BatchGenerator(model, max_tokens=8, prefill_step_size=8)
    caches = [codec.make_cache() for _ in range(3)] + [hit]
    refs = [_greedy(model, codec.make_cache(), p, m) for p, m in zip(prompts[:3], max_tokens)]
    hit_ref, _, _ = pool.lookup("a", prompts[3])
    refs.append(_greedy(model, hit_ref, prompts[3][n:], max_tokens[3]))
    uids = gen.insert([prompts[0], prompts[1]], max_tokens=max_tokens[:2], caches=caches[:2])
    out, step = {}, 0
    while len(out) < 4 or any(u not in out or out[u][1] is None for u in uids):
        if step == 2:
            uids += gen.insert([prompts[2], prompts[3][n:]], max_tokens=max_tokens[2:], caches=caches[2:])
        for r in gen.next()[1]:
            toks, _ = out.get(r.uid, ([], None))
            out[r.uid] = (toks + [r.token], r.prompt_cache if r.finish_reason else None)
        step += 1
        assert step < 200
    for i, u in enumerate(uids):
        assert out[u][0] == refs[i], (arch, i)
        extracted = out[u][1]
        assert codec.is_cache(extracted)
        assert codec.length(extracted) == len(prompts[i]) + max_tokens[i]
    assert len({tuple(out[u][0]) for u in uids}) > 1  # not degenerate


def test_hot_reloaded_and_full_precision(family, tmp_path):
    arch, model, codec = family
    turn1 = _prompt(45, 7)
    cache = codec.make_cache()
    _logits(model, cache, turn1[:-1])  # like BatchGenerator: the prefill snapshot sits here
    _logits(model, cache, turn1[-1:])
    pool = _pool(codec, tmp_path)
    assert pool.commit("a", turn1, cache) == 45

    turn2 = turn1 + _prompt(12, 8)
    hot, n, tier = pool.lookup("a", turn2)
    # recurrent models: the turn's one checkpoint, where its prompt ended (the prefill snapshot)
    want = 44 if codec.has_state else 45
    assert tier == "hot" and n == want
    pool.flush()
    pool2 = _pool(codec, tmp_path)
    cold, n2, tier2 = pool2.lookup("a", turn2)
    assert (n2, tier2) == (want, "disk") and _same(hot, cold)

    full = _logits(model, make_prompt_cache(model), turn2)
    q_cold = _logits(model, codec.make_cache(), turn2)
    q_hot = _logits(model, hot, turn2[n:])
    q_disk = _logits(model, cold, turn2[n:])
    assert mx.array_equal(q_hot, q_disk).item()
    errs = {k: mx.abs(v - full).max().item() for k, v in (("cold", q_cold), ("hot", q_hot))}

    # DIVERGE: a prompt that leaves turn1 at token 30 reuses what lies before (attention: 30
    # tokens trimmed from the blocks; recurrent: only up to a checkpoint at or before 30; bounded
    # sliding layers: only up to a point whose window the blocks hold, here 44 and 45)
    other = turn1[:30] + _prompt(10, 9)
    div, nd, _ = pool2.lookup("a", other)
    if codec.has_state or codec.window_names():
        assert div is None and nd == 0  # the only checkpoint (window) is past 30
    else:
        assert nd == 30
        errs["diverge"] = mx.abs(_logits(model, div, other[nd:]) - _logits(model, make_prompt_cache(model), other)).max().item()
    print(arch, "max |Δlogit| vs full precision", errs, "logit std", full.std().item())
    assert all(e < REL_TOL * full.std().item() for e in errs.values()), errs

    # EXACT-1: the same prompt again reuses up to its last token (recurrent: the prefill snapshot)
    _, ne, _ = pool2.lookup("a", turn1)
    assert ne == 44


@pytest.mark.parametrize("arch", ["qwen3_next"])
def test_a_continued_turn_drops_the_checkpoint_it_supersedes(arch, tmp_path):
    """A second turn's commit rebuilds the tail block; the first turn's checkpoint, no branch's
    resume point any more, is not carried into it (one state per branch): going back to turn 1's
    end prefills from the start, and the agent holds one checkpoint, in memory and on disk."""
    model, _ = build_model(arch, SIZE, seed=0)
    install_attention_fix()
    codec = ModelCodec.for_model(model)
    pool = _pool(codec, tmp_path)
    t1 = _prompt(20, 1)
    c = codec.make_cache()
    _logits(model, c, t1)
    pool.commit("a", t1, c)
    t2 = t1 + _prompt(5, 2)
    hit, n, _ = pool.lookup("a", t2)
    assert n == 20
    _logits(model, hit, t2[n:])
    pool.commit("a", t2, hit)
    back = t1 + _prompt(6, 3)
    _, n2, _ = pool.lookup("a", back)
    assert n2 == 0
    hit3, n3, _ = pool.lookup("a", t2 + _prompt(6, 3))
    assert n3 == 25  # turn 2's resume point (its cache had no prefill snapshot: its final state)
    want = _logits(model, codec.make_cache(), t2 + _prompt(6, 3))
    assert mx.abs(_logits(model, hit3, _prompt(6, 3)) - want).max().item() < 1e-3
    agent = pool.agent("a")
    held = [p for b in agent.ids for _, p in codec.checkpoint_slots(pool.blocks[b].layers)]
    assert len(held) == 1 and pool.check() == []
    pool.flush()
    on_disk = [p for b in agent.ids for _, p in codec.checkpoint_slots(pool.store.read_block(b).arrays)]
    assert len(on_disk) == 1


def test_unsupported_models_refused_with_reason():
    from mlx_lm.models import gemma2

    from vllm_mlx_persist.caches.kinds import UnsupportedModelError

    args = gemma2.ModelArgs(model_type="gemma2", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6,
                            vocab_size=64)
    with pytest.raises(UnsupportedModelError, match=r"'gemma2'.*computes the scores itself"):
        ModelCodec.for_model(gemma2.Model(args))


@pytest.mark.parametrize("n_q,L,B", [(4, 1, 1), (4, 1, 3), (4, 6, 2), (2, 3, 2)])
def test_quantized_attention_with_sinks(n_q, L, B):
    """The quantized path with sinks (decode) equals mx.fast SDPA with sinks on the dequantized K/V,
    with GQA and a batched left-padded mask; without the sink term it would not."""
    from mlx_lm.models.base import create_causal_mask

    from vllm_mlx_persist.caches.attention import _sdpa_with_sinks

    mx.random.seed(0)
    n_kv, T, D = 2, 12, 64
    q = mx.random.normal((B, n_q, L, D))
    qk = mx.quantize(mx.random.normal((B, n_kv, T, D)), group_size=64, bits=4)
    qv = mx.quantize(mx.random.normal((B, n_kv, T, D)), group_size=64, bits=4)
    sinks = mx.random.normal((n_q,)) * 2
    mask = create_causal_mask(L, offset=T - L, left_padding=mx.array([0, 3, 5][:B]))
    deq = lambda x: mx.dequantize(*x, group_size=64, bits=4)
    want = mx.fast.scaled_dot_product_attention(q, deq(qk), deq(qv), scale=D**-0.5, mask=mask, sinks=sinks)
    got = _sdpa_with_sinks(q, qk, qv, D**-0.5, mask, sinks, 64, 4)
    assert mx.abs(got - want).max().item() < 1e-4
    no_sink = mx.fast.scaled_dot_product_attention(q, deq(qk), deq(qv), scale=D**-0.5, mask=mask)
    assert mx.abs(no_sink - want).max().item() > 0.05


@pytest.mark.parametrize("arch", ["gemma3_text", "gpt_oss"])
def test_decode_mirror_with_window_and_sinks(arch):
    """The float decode mirror under a sliding-window mask (gemma3_text) and attention sinks
    (gpt_oss): teacher-forced batched decode of rows longer than the window, logits with the mirror
    on vs off (the 4-bit matmuls with our sinks/window handling) within 1e-4 of the logit std (same
    K/V values, float rounding order only; measured ~2e-6)."""
    from mlx_lm.generate import _merge_caches

    model, _ = build_model(arch, SIZE, seed=0)
    install_attention_fix()
    logits = {}
    for budget in (0, 256):
        codec = ModelCodec.for_model(model, float_copies=FloatCopies(decode_float_mb=budget))
        rows = []
        for i, n in enumerate([40, 25, 33]):
            c = codec.make_cache()
            _logits(model, c, _prompt(n, 20 + i))
            rows.append(c)
        batch = _merge_caches(rows)
        out = []
        for s in range(2 * WINDOW):
            y = mx.array([[(s * 7 + b) % SIZE.vocab] for b in range(3)])
            out.append(model(y, cache=batch)[:, -1])
            mx.eval(out[-1])
        q4 = [c for c in batch if isinstance(c, BatchQ4KVCache)]
        assert q4 and all((c.float_kv() is not None) == (budget > 0) for c in q4)
        logits[budget] = mx.stack(out)
    rel = (mx.abs(logits[256] - logits[0]).max() / logits[0].std()).item()
    print(arch, f"max |Δlogit| / std, mirror on vs off: {rel:.2e}")
    assert rel < 1e-4
