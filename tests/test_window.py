"""Sliding-window layers that hold only their window (issue #24, item 1).

Tiny random float32 gemma3_text (sliding window + global layers) and gpt_oss (sliding window +
attention sinks + MoE) built with mlx-lm's own classes, window 16, prompts several windows long.
`ModelCodec.for_model(model, bounded=True)` gives their sliding layers `Q4KVCache(window=16)`; the
reference is the same model on today's linear caches (`bounded=False`), which keep every token and
apply the window through the mask.

* the storage of a sliding layer never exceeds window + max(slack, the chunk just written), at
  every step of a chunked prefill (chunks shorter and longer than the window) and a long decode,
  per sequence and batched in mlx-lm's BatchGenerator (the decode mirror's storage too);
* logits of the bounded cache equal the linear cache's within LOGIT_TOL of the logit std (the same
  keys, the others masked out there, so only the shorter reductions' rounding differs: measured
  bit-identical per sequence and 1.9e-6 batched on these models), and greedy tokens are the same;
* batched == per-sequence bit for bit is tests/test_batch_invariance.py (bounded variants);
* merge / extract / filter / extend / trim / prepare-finalize / state with rows of different
  lengths, left padding and dropped columns, against what each row was fed;
* a chunk longer than the window still sees the previous window;
* a cache built for reuse at p from arrays covering [p - window, p) continues exactly like the live
  one.
"""

from __future__ import annotations

import copy
import random

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator

from vllm_mlx_persist.caches import ModelCodec
from vllm_mlx_persist.caches.floats import FloatCopies
from vllm_mlx_persist.caches.codec import WIN_FROM
from vllm_mlx_persist.caches.attention import install_attention_fix
from vllm_mlx_persist.caches.q4 import BatchQ4KVCache, Q4KVCache
from vllm_mlx_persist.tools.models.build import SIZES, Size, build_model

WINDOW = 16
SLACK = min(Q4KVCache.step, WINDOW)  # what the caches allow beyond the window between two drops
SIZE = Size(**{**SIZES["tiny"].__dict__, "sliding_window": WINDOW, "vocab": 512})
ARCHS = ["gemma3_text", "gpt_oss"]
LOGIT_TOL = 1e-4  # of the logit std, bounded vs linear (measured 0 per sequence, 1.9e-6 batched)


@pytest.fixture(scope="module", params=ARCHS)
def family(request):
    model, _ = build_model(request.param, SIZE, seed=0)
    install_attention_fix()
    return request.param, model, ModelCodec.for_model(model), ModelCodec.for_model(model, bounded=True)


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, SIZE.vocab) for _ in range(n)]


def _check_bound(cache, S: int) -> None:
    """A window cache's storage (and mirror) after writing S tokens: at most window + max(slack, S)
    tokens, holding at least the window before its end."""
    w = cache.window
    assert cache.keys[0].shape[2] <= w + max(SLACK, S), (cache.keys[0].shape, S)
    if isinstance(cache, BatchQ4KVCache):
        held = cache._idx - cache.left_padding
        assert mx.all(held >= mx.minimum(cache.offset, w)).item()
        if cache._mirror is not None:
            assert cache._mirror[0].shape[2] == cache.keys[0].shape[2]
    else:
        assert cache.held >= min(cache.offset, w)


def test_codec_windows(family):
    arch, model, linear, bounded = family
    assert linear.windows == bounded.windows == {0: WINDOW}  # layer 0 slides, layer 1 is global
    assert linear.window(0) is None and bounded.window(0) == WINDOW and bounded.window(1) is None
    caches = bounded.make_cache()
    assert [c.window for c in caches] == [WINDOW, None]
    assert bounded.is_cache(caches) and not linear.is_cache(caches) and not bounded.is_cache(linear.make_cache())


def test_prefill_and_decode_bounded_and_equal(family):
    """Chunks of 7, 50 (> window), 3 and 37 tokens, then 60 decode steps: after every step the
    sliding layer holds at most window + max(slack, chunk) tokens and at least the window, the
    global layer every token, and the logits equal the linear cache's."""
    arch, model, linear, bounded = family
    toks = _tokens(160, 1)
    lin, bnd = linear.make_cache(), bounded.make_cache()
    cuts = [0, 7, 57, 60, 97] + list(range(98, 158))
    worst, greedy = 0.0, ([], [])
    for a, b in zip(cuts, cuts[1:]):
        x = mx.array([toks[a:b]])
        lf, lb = model(x, cache=lin)[0, -1], model(x, cache=bnd)[0, -1]
        mx.eval(lf, lb)
        worst = max(worst, (mx.abs(lf - lb).max() / lf.std()).item())
        greedy[0].append(mx.argmax(lf).item())
        greedy[1].append(mx.argmax(lb).item())
        _check_bound(bnd[0], b - a)
        assert bounded.spans(bnd)[1] == linear.spans(lin)[1] == (0, b)
        assert bounded.spans(bnd)[0][1] == b and bnd[0].offset == b
    print(arch, f"max |Δlogit| / std, bounded vs linear: {worst:.1e}")
    assert worst < LOGIT_TOL
    assert greedy[0] == greedy[1]
    assert bnd[0].start > 100  # the window did drop tokens
    # what the sliding layer holds is the linear cache's tail, byte for byte
    start, end = bounded.spans(bnd)[0]
    for a, b in zip(sum(bnd[0].to_arrays(), ()), sum(lin[0].to_arrays(), ())):
        assert mx.array_equal(a, b[..., start:end, :]).item()
    assert bnd[0].nbytes < lin[0].nbytes / 3


def test_chunk_longer_than_window_sees_the_previous_window(family):
    """A 40-token chunk after a 30-token history: its first queries attend to the history's last
    window, which the cache keeps until the chunk is done (then drops at the next step)."""
    arch, model, linear, bounded = family
    hist, chunk = _tokens(30, 2), _tokens(40, 3)
    bnd = bounded.make_cache()
    model(mx.array([hist]), cache=bnd)
    out = model(mx.array([chunk]), cache=bnd)[0]
    assert bnd[0].held == WINDOW + 40 and bnd[0].start == 30 - WINDOW
    ref = model(mx.array([hist + chunk]), cache=linear.make_cache())[0, 30:]
    # a chunk that lost the history's window (its first query alone) would differ by ~1 std
    cut = bounded.make_cache()
    model(mx.array([hist]), cache=cut)
    cut[0].start = cut[0].offset  # as if it had dropped the whole history
    out_cut = model(mx.array([chunk]), cache=cut)[0]
    std = ref.std().item()
    assert (mx.abs(out - ref).max() / std).item() < LOGIT_TOL
    assert (mx.abs(out_cut[0] - ref[0]).max() / std).item() > 0.1
    model(mx.array([[5]]), cache=bnd)
    assert bnd[0].held == WINDOW + 1 and bnd[0].keys[0].shape[2] == WINDOW + SLACK


def _spy_updates(monkeypatch) -> list:
    """Record every window batch cache after each update, with the chunk length."""
    seen = []
    original = BatchQ4KVCache.update_and_fetch

    def spy(self, keys, values):
        out = original(self, keys, values)
        if self.window is not None:
            _check_bound(self, keys.shape[2])
            seen.append((self.keys[0].shape[2], keys.shape[2], self._mirror is not None))
        return out

    monkeypatch.setattr(BatchQ4KVCache, "update_and_fetch", spy)
    return seen


def _generate(model, codec, prompts, max_tokens, step, schedule) -> dict:
    """Greedy through BatchGenerator; `schedule[i]`: the step at which prompt i is inserted.
    Returns {i: (tokens, extracted cache, logprobs)}."""
    gen = BatchGenerator(model, max_tokens=max(max_tokens), prefill_step_size=step)
    rows, toks, caches, n = {}, {i: [] for i in range(len(prompts))}, {}, 0
    lps = {i: [] for i in range(len(prompts))}
    while len(caches) < len(prompts):
        for i, at in enumerate(schedule):
            if at == n:
                (uid,) = gen.insert([prompts[i]], max_tokens=[max_tokens[i]], caches=[codec.make_cache()])
                rows[uid] = i
        for r in gen.next()[1]:
            toks[rows[r.uid]].append(r.token)
            lps[rows[r.uid]].append(r.logprobs)
            if r.finish_reason is not None:
                caches[rows[r.uid]] = r.prompt_cache
        n += 1
        assert n < 400
    return {i: (toks[i], caches[i], mx.stack(lps[i])) for i in caches}


def test_batched_storage_bounded(family, decode_mirror, monkeypatch, float_copies):
    """Through BatchGenerator (staggered inserts, right-padded chunks of 24 > window, left-padded
    decode, rows finishing first): every update of a window batch cache leaves it within bounds;
    the answers equal the linear caches' and the per-sequence loop's; each extracted cache holds
    its row's last tokens, byte for byte the linear run's, and says which."""
    arch, model, linear, bounded = family
    linear, bounded = linear.with_float_copies(float_copies), bounded.with_float_copies(float_copies)
    prompts = [_tokens(n, 10 + n) for n in (70, 41, 23, 90)]
    max_tokens = [40, 25, 50, 30]
    schedule = [0, 0, 3, 9]
    seen = _spy_updates(monkeypatch)
    got = _generate(model, bounded, prompts, max_tokens, 24, schedule)
    assert seen and max(c for c, _, _ in seen) < 90  # bounded, while rows reached 120 tokens
    assert any(m for _, _, m in seen) == decode_mirror
    ref = _generate(model, linear, prompts, max_tokens, 24, schedule)
    worst = max((mx.abs(got[i][2] - ref[i][2]).max() / got[i][2].std()).item() for i in got)
    print(arch, f"max |Δlogprob| / std, bounded vs linear, batched: {worst:.1e}")
    assert worst < LOGIT_TOL
    for i, p in enumerate(prompts):
        toks, cache, _ = got[i]
        assert toks == ref[i][0], (arch, i)
        per_seq = bounded.make_cache()
        model(mx.array([p[:-1]]), cache=per_seq)
        y, want = p[-1], []
        for _ in range(max_tokens[i]):
            y = mx.argmax(model(mx.array([[y]]), cache=per_seq)[0, -1]).item()
            want.append(y)
        assert toks == want, (arch, i)
        assert bounded.is_cache(cache) and bounded.length(cache) == len(p) + max_tokens[i]
        start, end = bounded.spans(cache)[0]
        assert end - start >= WINDOW and start > 0 and cache[0].keys[0].shape[2] == end - start
        # layer 0's K/V come from the embeddings alone: equal bytes whatever the attention did
        for a, b in zip(sum(cache[0].to_arrays(), ()), sum(ref[i][1][0].to_arrays(), ())):
            assert mx.array_equal(a, b[..., start:end, :]).item()


# ---- the batch cache contract on random K/V --------------------------------------------------------


class Rows:
    """Every token each row was fed (float K/V), to check what a cache holds against."""

    def __init__(self):
        self.k: dict[int, list] = {}
        self.v: dict[int, list] = {}

    def feed(self, row: int, k: mx.array, v: mx.array) -> None:
        self.k.setdefault(row, []).append(k)
        self.v.setdefault(row, []).append(v)

    def check(self, row: int, c: Q4KVCache) -> None:
        """`c` holds exactly quantize(row's tokens)[start:offset], and at least the window."""
        k, v = (mx.concatenate(x[row], axis=2) for x in (self.k, self.v))
        assert c.offset == k.shape[2] and c.held >= min(c.offset, c.window)
        got_k, got_v = c.to_arrays()
        for got, full in ((got_k, k), (got_v, v)):
            want = mx.quantize(full[..., c.start : c.offset, :], group_size=64, bits=4)
            assert all(mx.array_equal(a, b).item() for a, b in zip(got, want)), row


def _check_mirror(c: BatchQ4KVCache, on: bool) -> None:
    kv = c.float_kv()
    assert (kv is not None) == on
    if kv is not None:
        for f, q in zip(kv, (c.keys, c.values)):
            want = mx.dequantize(*(x[..., : c.size(), :] for x in q), group_size=64, bits=4)
            assert mx.array_equal(f, want).item()


def _contract(budget_mb: float) -> list:
    """merge (different lengths and starts) / decode across drops / extend (an empty side, a side
    with its own mirror, one without) / trim / filter / a right-padded chunk longer than the window
    in which one row ends early / deepcopy / state, each checked against what the rows were fed,
    on caches under a decode budget of `budget_mb`."""
    copies = FloatCopies(decode_float_mb=budget_mb)
    on = budget_mb > 0
    mx.random.seed(5)
    rows = Rows()
    kv = lambda B, n: (mx.random.normal((B, 2, n, 64)), mx.random.normal((B, 2, n, 64)))

    def single(row: int, chunks: list[int]) -> Q4KVCache:
        c = Q4KVCache(window=WINDOW, float_copies=copies)
        for n in chunks:
            k, v = kv(1, n)
            c.update_and_fetch(k, v)
            rows.feed(row, k, v)
        return c

    def step(batch: BatchQ4KVCache, ids: list[int], n: int = 1) -> None:
        k, v = kv(len(ids), n)
        batch.update_and_fetch(k, v)
        for i, r in enumerate(ids):
            rows.feed(r, k[i : i + 1], v[i : i + 1])
        _check_bound(batch, n)
        _check_mirror(batch, on)

    def check(batch: BatchQ4KVCache, ids: list[int]) -> None:
        for i, r in enumerate(ids):
            rows.check(r, batch.extract(i))
        assert batch.starts() == [batch.extract(i).start for i in range(len(ids))]

    singles = [single(0, [50, 3]), single(1, [9]), single(2, [20, 20])]
    assert [c.start for c in singles] == [50 - WINDOW, 0, 20 - WINDOW]  # chunks kept whole, then all but 16
    a = Q4KVCache.merge(singles)
    ids = [0, 1, 2]
    assert a.offset.tolist() == [53, 9, 40] and a.window == WINDOW
    check(a, ids)
    for _ in range(40):  # across several drops
        step(a, ids)
    check(a, ids)
    assert min(a.starts()) > 0
    b = Q4KVCache.merge([single(3, [25]), single(4, [70])])
    step(b, [3, 4])  # its own mirror
    a.extend(b)
    ids += [3, 4]
    _check_mirror(a, on)
    a.extend(Q4KVCache.merge([single(5, [33])]))  # no mirror: dequantized into a's
    ids += [5]
    _check_mirror(a, on)
    empty = Q4KVCache.merge([Q4KVCache(window=WINDOW, float_copies=copies)])
    a.extend(empty)
    ids += [6]
    for _ in range(3):
        step(a, ids)
    check(a, ids)
    assert a.extract(6).offset == 3 and a.extract(6).start == 0
    a.filter(ids[:6])
    ids = ids[:6]
    _check_mirror(a, on)
    # trim: only as far as every row that has dropped tokens keeps its window
    assert min(a.starts()) > 0
    limit = min(a._idx - a.left_padding).item() - WINDOW
    assert a.trim(100) == limit > 0
    for r in ids:  # the rows lose their last `limit` tokens
        for x in (rows.k, rows.v):
            full = mx.concatenate(x[r], axis=2)
            x[r] = [full[..., : full.shape[2] - limit, :]]
    check(a, ids)
    step(a, ids)
    check(a, ids)
    a.filter([0, 2, 3, 5])
    ids = [0, 2, 3, 5]
    check(a, ids)
    # a right-padded prompt call of two 20-token chunks (each > window): row 2 has 3 real tokens,
    # so the second chunk must not drop its last window
    real = [40, 3, 22, 40]
    a.prepare(lengths=real, right_padding=[40 - n for n in real])
    for c in range(2):
        k, v = kv(4, 20)
        a.update_and_fetch(k, v)
        for i, (r, n) in enumerate(zip(ids, real)):
            m = max(0, min(20, n - 20 * c))
            rows.feed(r, k[i : i + 1, :, :m], v[i : i + 1, :, :m])
        _check_bound(a, 20 * (c + 1))  # the call counts as one chunk until finalize
        _check_mirror(a, on)
    a.finalize()
    _check_bound(a, 40)
    _check_mirror(a, on)
    check(a, ids)
    for _ in range(20):
        step(a, ids)
    check(a, ids)
    d = copy.deepcopy(a)
    _check_mirror(d, on)
    g = BatchQ4KVCache([0], 4, 64)
    g.state, g.meta_state = a.state, a.meta_state
    assert g.window == WINDOW and g.starts() == a.starts()
    check(g, ids)
    r = Q4KVCache.from_state(a.extract(1).state, a.extract(1).meta_state)
    assert (r.window, r.start, r.offset) == (WINDOW, a.extract(1).start, a.extract(1).offset)
    rows.check(ids[1], r)
    out = [a.extract(i) for i in range(4)]
    a.filter([])
    return out


def test_batch_contract_with_window():
    """What every row holds after each batch operation is exactly its last tokens (quantized as
    fed) from `start` on, at least its window; the mirror follows bit for bit; what is extracted is
    bit-identical with and without the mirror."""
    with_mirror = _contract(256)
    without = _contract(0)
    for x, y in zip(with_mirror, without):
        assert (x.offset, x.start) == (y.offset, y.start)
        assert all(mx.array_equal(p, q).item() for p, q in zip(x.keys + x.values, y.keys + y.values))


def test_mixed_windows_refused():
    with pytest.raises(ValueError, match="window"):
        Q4KVCache.merge([Q4KVCache(window=WINDOW), Q4KVCache()])
    a, b = (Q4KVCache.merge([Q4KVCache(window=w)]) for w in (WINDOW, None))
    with pytest.raises(ValueError, match="window"):
        a.extend(b)
    with pytest.raises(ValueError, match="window"):
        Q4KVCache(window=WINDOW).make_mask(4, window_size=2 * WINDOW)


# ---- the interface for blocks ---------------------------------------------------------------------


def test_build_for_reuse_at_p(family):
    """A cache built for reuse at p from arrays covering [p - window, p) of the sliding layer (and
    [0, p) of the global one), by `Q4KVCache.from_arrays` or by `ModelCodec.build` from today's
    blocks, continues exactly like the live bounded cache: bit-identical logits."""
    arch, model, linear, bounded = family
    toks = _tokens(90, 4)
    p = 60
    live = bounded.make_cache()
    model(mx.array([toks[:p]]), cache=live)
    full = linear.make_cache()
    model(mx.array([toks[:p]]), cache=full)

    # layer 0 (sliding) from the linear cache, whose K/V there come from the embeddings alone
    # (the same bytes in both); layer 1 (global) from the live cache
    k, v = full[0].to_arrays()
    window = tuple(x[..., p - WINDOW : p, :] for x in k), tuple(x[..., p - WINDOW : p, :] for x in v)
    by_arrays = [Q4KVCache.from_arrays(*window, 4, 64, window=WINDOW, offset=p),
                 Q4KVCache.from_arrays(*live[1].to_arrays(), 4, 64)]
    assert (by_arrays[0].start, by_arrays[0].offset) == (p - WINDOW, p)
    blocks = linear.token_arrays(full)  # every token, as today's blocks hold them
    blocks.update({n: a for n, a in bounded.token_arrays(live).items() if n.startswith("1.")})
    by_codec, covered = bounded.build([(blocks, p)])
    assert covered == p and bounded.is_cache(by_codec) and bounded.spans(by_codec) == [(p - WINDOW, p), (0, p)]
    with pytest.raises(ValueError, match="cover"):
        Q4KVCache.from_arrays(*(tuple(x[..., 1:, :] for x in q) for q in window), 4, 64, window=WINDOW, offset=p)

    def cont(cache):
        outs = [model(mx.array([toks[p:80]]), cache=cache)[0]]
        for t in toks[80:]:
            outs.append(model(mx.array([[t]]), cache=cache)[0])
        return mx.concatenate(outs)

    want = cont(live)
    for cache in (by_arrays, by_codec):
        assert mx.array_equal(cont(cache), want).item()


def test_codec_slice_follows_spans(family):
    """`slice` of a bounded cache gives the positions asked for (shifted by each layer's start);
    for a block reaching before what a sliding layer still holds, its arrays from that point on,
    and `win.from` says where they begin."""
    arch, model, linear, bounded = family
    toks = _tokens(70, 5)
    lin, bnd = linear.make_cache(), bounded.make_cache()
    for c in (lin, bnd):
        model(mx.array([toks[:40]]), cache=c)
        model(mx.array([toks[40:]]), cache=c)
    start = bounded.spans(bnd)[0][0]
    assert start > 0
    got, want = bounded.slice(bnd, 64, 70), linear.slice(lin, 64, 70)
    assert set(got) == set(want)
    own = bounded.token_arrays(bnd)
    for n, a in got.items():  # layer 0's K/V are the embeddings': the same bytes in both caches
        ref = want[n] if n.startswith("0.") else own[n][..., 64:70, :]
        assert mx.array_equal(a, ref).item()
    part = bounded.slice(bnd, start - 1, 70)
    assert int(part[WIN_FROM][0].item()) == 1
    for n in bounded.window_names():
        assert part[n].shape[2] == 70 - start and mx.array_equal(part[n], own[n][..., :70 - start, :]).item()
    assert all(part[n].shape[2] == 71 - start for n in set(part) - bounded.window_names() - {WIN_FROM})


def test_window_bench_runs(capsys):
    """The benchmark tool (docs/performance.md) runs end to end on the tiny model."""
    from vllm_mlx_persist.tools.bench import window as window_bench

    assert window_bench.main(["--size", "tiny", "--context", "300", "--steps", "1", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert all(f"| 300 | {s} |" in out for s in window_bench.SYSTEMS)
