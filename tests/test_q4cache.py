"""Batched generation on 4-bit KV caches through mlx-lm's unmodified BatchGenerator.

Real MLX on CPU with tiny random float32 models built in-process. The reference is a plain
one-sequence-at-a-time greedy loop over the model with a single `Q4KVCache` per layer; batched vs
the same sequence alone through the BatchGenerator is compared bit for bit, with the model's
projections one row at a time (conftest's `row_by_row`), so on every BLAS kernel.

mlx-lm's extract contract (measured here): a finished sequence's extracted cache covers the prompt
(including any cached prefix) and *every* generated token, the last one included:
`offset == len(prefix) + len(prompt) + max_tokens`. `GenerationBatch._step` feeds the token it is
about to return through the model in the same step (the token sampled after it is discarded).
"""

import copy
import gc
import hashlib
import importlib.util
import inspect
import random
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import base as mlx_base
from mlx_lm.models import gemma3_text, llama, qwen2, qwen3
from mlx_lm.models.cache import KVCache

from vllm_mlx_persist.caches import ModelCodec, attention, dequant, floats
from vllm_mlx_persist.caches.attention import install_attention_fix
from vllm_mlx_persist.caches.floats import FloatCopies
from vllm_mlx_persist.caches.kinds import Q4, UnsupportedModelError, check_model_supported
from vllm_mlx_persist.caches.q4 import BatchQ4KVCache, Q4KVCache, make_q4_prompt_cache

VOCAB = 512
PATCHES = Path(__file__).resolve().parent.parent / "patches"
_ORIGINAL_QSDPA = getattr(
    mlx_base.quantized_scaled_dot_product_attention,
    "_vllm_mlx_persist_original",
    mlx_base.quantized_scaled_dot_product_attention,
)


def _reinit(model, std: float, seed: int):
    """Redraw every weight from N(0, std) (norm weights stay 1); float32."""
    mx.random.seed(seed)
    params = [
        (k, mx.ones(v.shape) if "norm" in k else mx.random.normal(v.shape) * std)
        for k, v in tree_flatten(model.parameters())
    ]
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


def _llama(n_kv_heads: int = 2, head_dim: int = 64, std: float = 0.1, seed: int = 0, layers: int = 2):
    # std 0.1 (not 0.02) so greedy outputs vary across prompts and steps instead of repeating.
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=128,
        num_hidden_layers=layers,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=n_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
    )
    return _reinit(llama.Model(args), std, seed)


@pytest.fixture(scope="module")
def model():
    install_attention_fix()
    return _llama()


@pytest.fixture(params=["quantized", "dequantized"])
def attention_mode(request, float_copies):
    """Run a test with prefill chunks on mlx's quantized matmuls, then on transient dequantized K/V
    (the CPU default): the mode of the test's `float_copies`. Decode steps use the quantized matmuls
    either way."""
    float_copies.set_prefill_attention(request.param)
    return request.param


def _prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _prefill(model, cache, tokens):
    if tokens:
        mx.eval(model(mx.array([tokens]), cache=cache))


def _reference(model, prompt, n, bits=4, group_size=64, cache=None, float_copies=None):
    """Per-sequence greedy decode on one Q4KVCache per layer, prefilled like BatchGenerator does
    (all but the last prompt token, then one token at a time). Returns (tokens, logprobs, cache)."""
    cache = cache if cache is not None else make_q4_prompt_cache(model, bits, group_size, float_copies=float_copies)
    _prefill(model, cache, prompt[:-1])
    tokens, logprobs, y = [], [], prompt[-1]
    for _ in range(n):
        logits = model(mx.array([[y]]), cache=cache)[0, -1]
        lp = logits - mx.logsumexp(logits)
        y = mx.argmax(lp).item()
        tokens.append(y)
        logprobs.append(lp)
    return tokens, logprobs, cache


def _run(gen, schedule):
    """Drive `gen`; `schedule[step]` is a list of (prompt, max_tokens, caches) inserted at that
    step. Returns {uid: (tokens, logprobs, extracted cache, all_tokens)} and the uids in order."""
    out, order, step = {}, [], 0
    pending = dict(schedule)
    done = set()
    while pending or len(done) < len(order):
        for prompt, max_tokens, caches in pending.pop(step, []):
            order += gen.insert([prompt], max_tokens=[max_tokens], caches=[caches])
        for r in gen.next()[1]:
            toks, lps, _, _ = out.setdefault(r.uid, ([], [], None, None))
            toks.append(r.token)
            lps.append(r.logprobs)
            if r.finish_reason is not None:
                out[r.uid] = (toks, lps, r.prompt_cache, r.all_tokens)
                done.add(r.uid)
        step += 1
        assert step < 500
    return out, order


def _batch_gen(model, prefill_step_size=2048):
    return BatchGenerator(model, max_tokens=8, prefill_step_size=prefill_step_size)


@pytest.fixture
def extend_sides(monkeypatch):
    """Record (self empty?, other empty?) for each BatchQ4KVCache.extend call (real calls)."""
    seen = []
    original = BatchQ4KVCache.extend

    def spy(self, other):
        seen.append((self.keys is None, other.keys is None))
        return original(self, other)

    monkeypatch.setattr(BatchQ4KVCache, "extend", spy)
    return seen


@pytest.fixture
def mirror_used(monkeypatch):
    """Record, per attention call on a BatchQ4KVCache, whether it ran on the float decode mirror."""
    seen = []
    original = BatchQ4KVCache.float_kv

    def spy(self):
        out = original(self)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(BatchQ4KVCache, "float_kv", spy)
    return seen


def test_batched_matches_per_sequence(model, extend_sides, attention_mode, decode_mirror, mirror_used,
                                      float_copies, row_by_row):
    """Staggered inserts, prompt lengths 3..29 (right padding), chunked prefill, a prefix-cached
    insert and per-sequence max_tokens, with decode on the 4-bit matmuls and on the float decode
    mirror: each sequence batched gets the tokens, logprobs and stored K/V it gets alone through the
    same BatchGenerator, bit for bit, on every BLAS kernel (the model's projections one row at a time,
    conftest's `row_by_row`: what is compared is the cache's part), and the tokens of the plain
    per-sequence 4-bit loop (`_reference`: one prefill call, the 4-bit kernel, never a mirror) with
    logprobs within 1e-4 (measured up to 6e-6: the same values through other attention kernels)."""
    fresh = lambda: make_q4_prompt_cache(model, float_copies=float_copies)  # noqa: E731
    prompts = _prompts(6, 3, 30, seed=1)
    max_tokens = [5, 9, 3, 12, 7, 6]
    prefix_len = 7
    prefix_cache = fresh()
    _prefill(model, prefix_cache, prompts[4][:prefix_len])
    prefix_ref_cache = copy.deepcopy(prefix_cache)
    prefix_alone_cache = copy.deepcopy(prefix_cache)
    prefix_snapshot = [mx.array(x) for c in prefix_cache for x in c.state[0] + c.state[1]]

    inserts = [
        (p, m, prefix_cache if i == 4 else fresh())
        for i, (p, m) in enumerate(zip(prompts, max_tokens))
    ]
    inserts[4] = (prompts[4][prefix_len:], max_tokens[4], prefix_cache)
    # Small prefill steps keep long prompts mid-prefill when fresh sequences join.
    schedule = {0: inserts[:2], 1: inserts[2:3], 3: inserts[3:5], 6: inserts[5:]}
    out, uids = _run(_batch_gen(model, prefill_step_size=8), schedule)

    for i, uid in enumerate(uids):
        if i == 4:
            suffix = prompts[4][prefix_len:]
            ref, ref_lps, _ = _reference(model, suffix, max_tokens[4], cache=prefix_ref_cache)
            one = (suffix, max_tokens[4], prefix_alone_cache)
        else:
            ref, ref_lps, _ = _reference(model, prompts[i], max_tokens[i], float_copies=float_copies)
            one = (prompts[i], max_tokens[i], fresh())
        (a_tokens, a_lps, a_cache, _), = _run(_batch_gen(model, prefill_step_size=8), {0: [one]})[0].values()
        tokens, lps, cache, all_tokens = out[uid]
        assert tokens == a_tokens, f"sequence {i}: batched vs alone"
        same = [mx.array_equal(a, b).item() for a, b in zip(lps, a_lps)]
        assert all(same), (i, same, max(mx.abs(a - b).max().item() for a, b in zip(lps, a_lps)))
        assert all(mx.array_equal(a, b).item() for c, d in zip(cache, a_cache)
                   for a, b in zip(c.state[0] + c.state[1], d.state[0] + d.state[1])), f"sequence {i}: stored K/V"
        assert tokens == ref, f"sequence {i}"
        err = max(mx.abs(a - b).max().item() for a, b in zip(lps, ref_lps))
        assert err < 1e-4, f"sequence {i}: max |Δlogprob| {err}"
        n_prompt = len(prompts[i])  # includes the cached prefix for sequence 4
        for c in cache:
            assert isinstance(c, Q4KVCache) and (c.bits, c.group_size) == (4, 64)
            assert c.keys[0].dtype == mx.uint32 and c.values[0].dtype == mx.uint32
            assert c.offset == c.size() == n_prompt + max_tokens[i]
            assert c.keys[0].shape[2] == c.offset  # extract is a contiguous exact-size copy
        # all_tokens are the tokens the BatchGenerator put into the cache itself (not the prefix).
        assert all_tokens == (prompts[i][prefix_len:] if i == 4 else prompts[i]) + tokens
    assert len(set(tuple(out[u][0]) for u in uids)) == len(uids)  # outputs are not degenerate
    assert any(mirror_used) == decode_mirror
    assert (False, True) in extend_sides  # fresh (empty) caches joined a batch mid-prefill
    # merge copies: the inserted prefix cache (e.g. one built from the persistent store) is intact
    after = [x for c in prefix_cache for x in c.state[0] + c.state[1]]
    assert all(c.offset == prefix_len for c in prefix_cache)
    assert all(mx.array_equal(a, b).item() for a, b in zip(prefix_snapshot, after))


def test_extracted_cache_continues_like_reference(model, decode_mirror, float_copies):
    """A second turn inserted on the cache extracted after the first equals the reference that
    keeps decoding on its own per-sequence cache."""
    p1, p2 = _prompts(2, 5, 15, seed=2)
    gen = _batch_gen(model)
    fresh = lambda: make_q4_prompt_cache(model, float_copies=float_copies)
    out, uids = _run(gen, {0: [(p1, 6, fresh()), (p2, 4, fresh())]})
    toks1, _, cache1, _ = out[uids[0]]

    turn2 = [7, 8, 9, 10]
    out2, uids2 = _run(gen, {0: [(turn2, 5, cache1), (p2, 3, fresh())]})

    ref1, _, ref_cache = _reference(model, p1, 6, float_copies=float_copies)
    assert toks1 == ref1
    # The reference cache holds p1 + all but the last generated token; feed that one too.
    ref2, _, _ = _reference(model, [ref1[-1]] + turn2, 5, cache=ref_cache)
    assert out2[uids2[0]][0] == ref2


def test_gqa_batch_equals_kv_heads(model, monkeypatch, attention_mode, float_copies):
    """B == n_kv_heads == 2 with left padding matches the per-sequence reference. The batch cache
    attends one row at a time (batch invariance), so a (B, 1, L, T) mask never reaches the quantized
    SDPA and even mlx-lm 0.31's unpatched function, which mis-broadcasts it (silently wrong at
    B == n_kv_heads, `test_attention_fix_function_level`), gives the right answer here. (Decode on
    the quantized matmuls: the float decode mirror would bypass them.)"""
    float_copies.set_decode_float_budget(0)
    prompts = [[5, 17, 300, 42, 8, 99, 100, 1, 2, 3, 4], [77, 3, 250]]

    def first_logprobs():
        gen = _batch_gen(model)
        out, uids = _run(gen, {0: [(p, 3, make_q4_prompt_cache(model, float_copies=float_copies)) for p in prompts]})
        return [out[u] for u in uids]

    refs = [_reference(model, p, 3, float_copies=float_copies) for p in prompts]
    fixed = first_logprobs()
    for (toks, lps, _, _), (rt, rlps, _) in zip(fixed, refs):
        assert toks == rt
        assert mx.abs(lps[0] - rlps[0]).max().item() < 1e-4

    original = mlx_base.quantized_scaled_dot_product_attention._vllm_mlx_persist_original
    monkeypatch.setattr(mlx_base, "quantized_scaled_dot_product_attention", original)
    unpatched = first_logprobs()
    for (toks, lps, _, _), (rt, rlps, _) in zip(unpatched, refs):
        assert toks == rt
        assert mx.abs(lps[0] - rlps[0]).max().item() < 1e-4  # batched: 3-4 nats off (before per-row)


def _check_attention(fixed, original):
    """`fixed` matches full-precision attention on the dequantized K/V for batched GQA masks;
    `original` (mlx-lm 0.31.3) raises for B != n_kv_heads and is wrong for B == n_kv_heads."""
    mx.random.seed(3)
    n_q, n_kv, L, T, D = 4, 2, 3, 10, 64
    for B in (2, 3):
        q = mx.random.normal((B, n_q, L, D))
        qk = mx.quantize(mx.random.normal((B, n_kv, T, D)), group_size=64, bits=4)
        qv = mx.quantize(mx.random.normal((B, n_kv, T, D)), group_size=64, bits=4)
        left = mx.array([0, 4, 7][:B])
        mask = mlx_base.create_causal_mask(L, offset=T - L, left_padding=left)  # (B, 1, L, T)
        deq = lambda x: mx.repeat(mx.dequantize(*x, group_size=64, bits=4), n_q // n_kv, axis=1)
        k, v = deq(qk), deq(qv)
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=mask)

        def run(fn, m):  # mlx-lm scales `queries` in place (`queries *= scale`): pass a copy
            return fn(mx.array(q), qk, qv, scale=D**-0.5, mask=m, group_size=64, bits=4)

        assert mx.abs(run(fixed, mask) - want).max().item() < 1e-4
        # A per-head (B, n_q, L, T) mask is handled too.
        head_mask = mx.broadcast_to(mask, (B, n_q, L, T))
        assert mx.abs(run(fixed, head_mask) - want).max().item() < 1e-4
        if not attention.mask_needs_fix(original):  # mlx-lm >= 0.32: fixed upstream
            assert mx.abs(run(original, mask) - want).max().item() < 1e-4
        elif B == n_kv:  # silently wrong: measured max error 2.0
            assert mx.abs(run(original, mask) - want).max().item() > 0.5
        else:
            with pytest.raises(ValueError, match="broadcast"):
                mx.eval(run(original, mask))


def test_attention_fix_function_level():
    install_attention_fix()
    install_attention_fix()  # idempotent
    fixed = mlx_base.quantized_scaled_dot_product_attention
    original = fixed._vllm_mlx_persist_original
    assert not hasattr(original, "_vllm_mlx_persist_original")
    _check_attention(fixed, original)


def test_prefill_attention_modes_agree(model):
    """Dequantizing K/V for a multi-token chunk computes the same attention as the quantized
    matmuls (float rounding only), on a 200-token prefill over a 300-token cached prefix; "auto"
    dequantizes on the CPU and only for chunks of >= DEQUANT_MIN_QUERIES queries."""
    prefix, chunk = _prompts(2, 200, 301, seed=5)
    logits = {}
    for mode in ("quantized", "dequantized", "auto"):
        cache = make_q4_prompt_cache(model, float_copies=FloatCopies(prefill_attention=mode))
        _prefill(model, cache, prefix)
        logits[mode] = model(mx.array([chunk]), cache=cache)
    assert mx.abs(logits["quantized"] - logits["dequantized"]).max().item() < 1e-4
    assert mx.array_equal(logits["auto"], logits["dequantized"]).item()  # tests run on the CPU
    assert floats.DEQUANT_MIN_QUERIES > 1
    assert not FloatCopies(prefill_attention="dequantized").dequantize_for(1)  # decode stays on the quantized matmuls
    with pytest.raises(ValueError, match="prefill_attention"):
        FloatCopies().set_prefill_attention("fp16")
    with pytest.raises(ValueError, match="prefill_attention"):
        FloatCopies(prefill_attention="fp16")


def test_attention_fix_patch_file(tmp_path):
    """The upstream patch applies to the installed base.py and fixes the same cases."""
    patch = PATCHES / "mlx-lm-0.31.3-quantized-sdpa-gqa-mask.patch"
    pristine = Path(inspect.getsourcefile(_ORIGINAL_QSDPA))
    manifest = patch.with_suffix(".sha256").read_text().split("\n")[1].split()
    if hashlib.sha256(pristine.read_bytes()).hexdigest() != manifest[1]:
        pytest.skip("installed mlx_lm/models/base.py is not the one the patch targets")
    if shutil.which("git") is None:
        pytest.skip("git not available to apply the patch")
    target = tmp_path / "mlx_lm" / "models" / "base.py"
    target.parent.mkdir(parents=True)
    shutil.copy(pristine, target)
    subprocess.run(["git", "apply", str(patch)], cwd=tmp_path, check=True)
    assert hashlib.sha256(target.read_bytes()).hexdigest() == manifest[2]
    spec = importlib.util.spec_from_file_location("_patched_mlx_lm_base", target)
    patched = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(patched)
    _check_attention(patched.quantized_scaled_dot_product_attention, _ORIGINAL_QSDPA)


@pytest.mark.parametrize("bits,group_size", [(8, 32), (6, 64), (2, 128)])
def test_other_formats(bits, group_size, attention_mode, decode_mirror, float_copies):
    """Other bit widths and group sizes batch exactly like their per-sequence reference."""
    install_attention_fix()
    model = _llama(head_dim=128, seed=1)
    prompts = _prompts(3, 4, 20, seed=bits)
    gen = _batch_gen(model, prefill_step_size=16)
    out, uids = _run(
        gen, {0: [(p, 4, make_q4_prompt_cache(model, bits, group_size, float_copies=float_copies)) for p in prompts]}
    )
    for p, uid in zip(prompts, uids):
        ref, _, _ = _reference(model, p, 4, bits, group_size, float_copies=float_copies)
        assert out[uid][0] == ref
        assert all((c.bits, c.group_size) == (bits, group_size) for c in out[uid][2])


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_dequantize_is_mx_dequantize_bit_for_bit(dtype):
    """`dequant.dequantize` (byte unpacking on the CPU for 2 to 8 bits, mx.dequantize elsewhere) gives
    mx.dequantize's values bit for bit: every format, one group per row and several, one token (a
    decode step) and many, values spread over every level."""
    raw = mx.uint32 if dtype == mx.float32 else mx.uint16
    for bits in (2, 3, 4, 5, 6, 8):
        for group_size in (32, 64, 128):
            for D, T in ((64, 1), (128, 33), (256, 2)):
                if D % group_size:
                    continue
                x = (mx.random.normal((2, 3, T, D), key=mx.random.key(bits * D + T)) * 3).astype(dtype)
                q = mx.quantize(x, group_size=group_size, bits=bits)
                want = mx.dequantize(*q, group_size=group_size, bits=bits)
                got = dequant.dequantize(q, group_size, bits)
                assert got.dtype == want.dtype and got.shape == want.shape
                assert mx.array_equal(got.view(raw), want.view(raw)).item(), (bits, group_size, D, T)
    assert all(dequant._exact.values())  # the byte path was taken (and checked) for every format here


def test_logits_close_to_full_precision():
    """Quantized attention vs a full-precision KVCache, same 64-token prompts, group size 64.

    On the N(0, 0.02) two-layer model (logit std ≈ 0.23), measured over 4 prompts:
      4-bit: max |Δlogit| 0.072-0.089, mean |Δlogit| 0.012-0.017, max per-position KL 3.2e-4 nats
      8-bit: max |Δlogit| 0.004-0.006, mean 0.0007-0.0012, KL < 1e-5
    Bounds asserted below have >2x margin. (The noisier N(0, 0.1) model used for the batching
    tests amplifies the 4-bit error to max |Δlogit| ≈ 1.3 with logit std 1.1, max KL ≈ 0.1;
    random weights say little about a trained model's sensitivity.)
    """
    model = _llama(std=0.02)
    for prompt in _prompts(2, 64, 65, seed=0):
        x = mx.array([prompt])
        full = model(x, cache=[KVCache() for _ in model.layers])[0]
        lp_full = full - mx.logsumexp(full, axis=-1, keepdims=True)
        stats = {}
        for bits in (4, 8):
            q = model(x, cache=make_q4_prompt_cache(model, bits, 64))[0]
            lp = q - mx.logsumexp(q, axis=-1, keepdims=True)
            d = mx.abs(q - full)
            kl = (mx.exp(lp_full) * (lp_full - lp)).sum(-1).max()
            stats[bits] = (d.max().item(), d.mean().item(), kl.item())
        print(f"logit std {full.std().item():.3f}  (max, mean, KL) {stats}")
        assert stats[4][0] < 0.2 and stats[4][1] < 0.04 and stats[4][2] < 1e-3
        assert stats[8][0] < 0.015 and stats[8][1] < 0.003 and stats[8][2] < 2e-5


def test_from_arrays_to_arrays_round_trip(model):
    cache = make_q4_prompt_cache(model)
    _prefill(model, cache, list(range(1, 20)))
    for c in cache:
        keys, values = c.to_arrays()
        assert all(x.shape[2] == 19 for x in keys + values)
        c2 = Q4KVCache.from_arrays(keys, values, bits=4, group_size=64)
        assert (c2.offset, c2.size(), c2.bits, c2.group_size) == (19, 19, 4, 64)
        k2, v2 = c2.to_arrays()
        for a, b in zip(keys + values, k2 + v2):
            assert a.dtype == b.dtype and mx.array_equal(a, b).item()
        assert c2.nbytes == sum(x.nbytes for x in keys + values)
        # trim is O(1) and later writes never reach the arrays it was built from
        snapshot = [mx.array(x) for x in keys]
        c2.trim(3)
        assert c2.offset == 16 and c2.to_arrays()[0][0].shape[2] == 16
        c2.update_and_fetch(mx.ones((1, 2, 2, 64)), mx.ones((1, 2, 2, 64)))
        assert c2.offset == 18
        assert all(mx.array_equal(a, b).item() for a, b in zip(keys, snapshot))
        d = copy.deepcopy(c2)
        assert d.offset == 18 and mx.array_equal(d.keys[0], c2.keys[0]).item()
        # mlx-lm's state/meta_state (what save_prompt_cache writes) round-trip too
        r = Q4KVCache.from_state(c2.state, c2.meta_state)
        assert (r.offset, r.bits, r.group_size) == (18, 4, 64)
        assert all(mx.array_equal(a, b).item() for a, b in zip(r.to_arrays()[0], c2.to_arrays()[0]))


def test_batch_cache_contract_unit(model):
    """merge / extend with an empty side / filter / extract / trim / state on BatchQ4KVCache."""
    lens = [5, 9]
    singles = []
    for n in lens:
        c = Q4KVCache(group_size=64, bits=4)
        c.update_and_fetch(mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64)))
        singles.append(c)
    b = Q4KVCache.merge(singles)
    assert isinstance(b, BatchQ4KVCache) and b.size() == 9
    assert b.offset.tolist() == [5, 9] and b.left_padding.tolist() == [4, 0]

    def same(c, ref):
        flat = lambda x: x.to_arrays()[0] + x.to_arrays()[1]
        return c.offset == ref.offset and all(
            mx.array_equal(a, b).item() for a, b in zip(flat(c), flat(ref))
        )

    assert all(same(b.extract(i), s) for i, s in enumerate(singles))

    empty = Q4KVCache.merge([Q4KVCache(), Q4KVCache()])
    assert empty.empty() and empty.nbytes == 0 and empty.size() == 0
    for left_empty in (True, False):
        a = copy.deepcopy(empty) if left_empty else copy.deepcopy(b)
        a.extend(copy.deepcopy(b) if left_empty else copy.deepcopy(empty))
        assert a.offset.shape == (4,) and a.keys[0].shape[0] == 4
        full_rows = [2, 3] if left_empty else [0, 1]
        assert all(same(a.extract(r), s) for r, s in zip(full_rows, singles))
        a.filter(full_rows)
        assert a.size() == 9 and all(same(a.extract(i), s) for i, s in enumerate(singles))
    both = copy.deepcopy(empty)
    both.extend(copy.deepcopy(empty))
    assert both.empty() and both.offset.shape == (4,)

    # filter drops the common left padding; trim is O(1); state round-trips
    f = copy.deepcopy(b)
    f.filter([0])
    assert f.size() == 5 and f.left_padding.tolist() == [0] and same(f.extract(0), singles[0])
    assert f.trim(2) == 2 and f.offset.tolist() == [3] and f.extract(0).offset == 3
    g = BatchQ4KVCache([0], 4, 64)
    g.state = b.state
    assert g.size() == 9 and same(g.extract(1), singles[1])

    # one sequence: merged without a copy, and nothing written to the batch reaches the single
    one = Q4KVCache.merge([singles[1]])
    kept = [mx.array(x) for x in singles[1].to_arrays()[0]]
    assert same(one.extract(0), singles[1])
    one.trim(3)
    one.update_and_fetch(mx.random.normal((1, 2, 2, 64)), mx.random.normal((1, 2, 2, 64)))  # in place
    assert one.size() == 8 and singles[1].offset == 9
    assert all(mx.array_equal(a, b).item() for a, b in zip(singles[1].to_arrays()[0], kept))

    with pytest.raises(ValueError):
        Q4KVCache.merge([singles[0], Q4KVCache(group_size=32, bits=4)])


def test_check_model_supported():
    def small(mod, **kw):
        base = dict(
            hidden_size=128, num_hidden_layers=2, intermediate_size=256,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
        )
        base.update(kw)
        return mod.Model(mod.ModelArgs(**base))

    for m in (
        small(llama, model_type="llama", head_dim=64),
        small(qwen2, model_type="qwen2"),  # head_dim = 128 // 4 = 32
        small(qwen3, model_type="qwen3", head_dim=64, max_position_embeddings=512,
              rope_theta=1e6, tie_word_embeddings=True),
    ):
        check_model_supported(m, 32)
        assert len(make_q4_prompt_cache(m, 4, 32)) == 2

    with pytest.raises(UnsupportedModelError, match=r"qwen2.*head_dim 32.*group size 64"):
        check_model_supported(small(qwen2, model_type="qwen2"), 64)

    gemma = small(
        gemma3_text, model_type="gemma3_text", head_dim=64, sliding_window=16,
        sliding_window_pattern=2, num_hidden_layers=2,
    )
    # sliding-window layers are 4-bit linear caches; the window comes from the mask
    check_model_supported(gemma, 64)
    assert all(isinstance(c, Q4KVCache) for c in make_q4_prompt_cache(gemma))
    with pytest.raises(ValueError):
        make_q4_prompt_cache(small(llama, model_type="llama", head_dim=64), bits=7)


def test_mask_fix_detected_not_assumed():
    """The GQA mask fix is applied only where the installed mlx-lm needs it (0.31.3 does; 0.32.x
    fixed it upstream, and wrapping again there breaks batched decode)."""
    assert attention.mask_needs_fix(_ORIGINAL_QSDPA) == (tuple(map(int, mlx_lm_version().split(".")[:2])) < (0, 32))
    fixed = attention._make_fixed(_ORIGINAL_QSDPA)
    assert not attention.mask_needs_fix(fixed)


def mlx_lm_version() -> str:
    from importlib.metadata import version

    return version("mlx-lm")


# ---- float decode mirror -------------------------------------------------------------------------


def _deq(q, end):
    return mx.dequantize(*(x[..., :end, :] for x in q), group_size=64, bits=4)


def _check_mirror(c: BatchQ4KVCache, want: bool = True):
    """The mirror holds exactly dequantize(packed) up to the write index (bit for bit)."""
    kv = c.float_kv()
    assert (kv is not None) == want
    if kv is not None:
        assert kv[0].shape == (c.offset.shape[0], 2, c.size(), 64)
        assert mx.array_equal(kv[0], _deq(c.keys, c.size())).item()
        assert mx.array_equal(kv[1], _deq(c.values, c.size())).item()


def _mirror_ops(copies: FloatCopies, budget_mb):
    """Every batch-cache operation BatchGenerator uses, on random K/V (the same with any budget):
    merge, decode updates across a buffer growth, extend (with a mirrored, an unmirrored and an
    empty side), trim, filter, a right-padded chunk with prepare/finalize, deepcopy, state. Returns
    every row's extracted cache and the mirror bytes seen after each step (all under `copies`)."""
    copies.set_decode_float_budget(budget_mb)
    mx.random.seed(11)
    kv = lambda B, n: (mx.random.normal((B, 2, n, 64)), mx.random.normal((B, 2, n, 64)))
    on = budget_mb > 0

    def merged(lens):
        rows = []
        for n in lens:
            c = Q4KVCache(float_copies=copies)
            c.update_and_fetch(*kv(1, n))
            rows.append(c)
        return Q4KVCache.merge(rows)

    seen = []
    a = merged([250, 241, 200])
    _check_mirror(a, False)  # merge builds none: only decode does
    # 250 -> 510 tokens: the packed buffer (merged at exactly 250) grows to 506 on the first step,
    # which builds the mirror, and to 762 at token 507, which grows the mirror the same way
    for i in range(260):
        a.update_and_fetch(*kv(3, 1))
        if i in (0, 255, 256, 259):
            _check_mirror(a, on)
            seen.append(copies.decode_float_bytes())
    b = merged([30, 12])
    b.update_and_fetch(*kv(2, 1))  # b has its own mirror
    a.extend(b)
    _check_mirror(a, on)
    assert b.float_kv() is None  # moved into a
    a.extend(merged([60]))  # a side without a mirror is dequantized into a's
    _check_mirror(a, on)
    empty = Q4KVCache.merge([Q4KVCache(float_copies=copies)])
    a.extend(empty)
    _check_mirror(a, on)
    a.update_and_fetch(*kv(7, 1))
    _check_mirror(a, on)
    assert a.trim(2) == 2
    a.update_and_fetch(*kv(7, 1))
    _check_mirror(a, on)
    a.filter([0, 3, 5, 6])
    _check_mirror(a, on)
    a.prepare(lengths=[5, 3, 4, 5], right_padding=[0, 2, 1, 0])  # a right-padded prompt chunk
    a.update_and_fetch(*kv(4, 5))
    a.finalize()
    _check_mirror(a, on)
    a.update_and_fetch(*kv(4, 1))
    _check_mirror(a, on)
    seen.append(copies.decode_float_bytes())
    d = copy.deepcopy(a)
    _check_mirror(d, on)  # shares a's mirror: a deep copy of an array is the same data
    d.update_and_fetch(*kv(4, 1))
    _check_mirror(d, on)
    _check_mirror(a, on)  # the copies are independent (MLX copies a shared buffer on write)
    if on:
        copies.set_decode_float_budget(copies.decode_float_bytes() / 2**20)  # full
        _check_mirror(copy.deepcopy(a), True)  # a deep copy allocates nothing: shared whatever the budget
        rows = [a.extract(i) for i in range(4)]
        for r in rows:
            r.floats = None  # else the merge would start the mirror from them (test_carried_floats_*)
        refused = copies.mirror_counts["refused"]
        d2 = Q4KVCache.merge(rows)
        d2.update_and_fetch(*kv(4, 1))
        d2.update_and_fetch(*kv(4, 1))
        _check_mirror(d2, False)  # no room: none built at its decode steps
        assert copies.mirror_counts["refused"] == refused + 1  # one cache refused, not one per step
        packed = lambda c: sum(x.nbytes for x in c.keys + c.values)  # noqa: E731
        assert a.nbytes == packed(a) + a.mirror_nbytes > packed(a)  # nbytes counts the mirror
        assert d2.nbytes == packed(d2)
        copies.set_decode_float_budget(budget_mb)
        d2.update_and_fetch(*kv(4, 1))
        _check_mirror(d2, True)  # room again: built
        d2.filter([])
    out = [a.extract(i) for i in range(4)] + [d.extract(i) for i in range(4)]
    assert all(type(c) is Q4KVCache and c.keys[0].dtype == mx.uint32 for c in out)
    g = BatchQ4KVCache([0], 4, 64, float_copies=copies)
    g.update_and_fetch(*kv(1, 1))
    g.state = b.state
    _check_mirror(g, False)  # new storage: the old mirror is dropped
    a.filter([])
    d.filter([2])
    return out, seen


def test_mirror_follows_every_op_and_storage_is_unchanged():
    """The mirror equals dequantize(packed) bit for bit after each op, and what is stored and
    extracted is bit-identical with and without it (the mirror never feeds the storage)."""
    copies = FloatCopies()
    gc.collect()
    base = copies.decode_float_bytes()
    with_mirror, seen = _mirror_ops(copies, 256)
    without, seen_off = _mirror_ops(copies, 0)
    assert all(n > base for n in seen) and all(n == base for n in seen_off)
    assert seen[0] == seen[1] < seen[2] == seen[3]  # the growth was accounted
    for x, y in zip(with_mirror, without):
        assert x.offset == y.offset
        assert all(mx.array_equal(p, q).item() for p, q in zip(x.keys + x.values, y.keys + y.values))
    gc.collect()
    assert copies.decode_float_bytes() == base  # filtered to nothing / freed: nothing held


def _teacher_forced(model, lens, steps, copies: FloatCopies, seed=0):
    """Batched decode of fixed tokens (the same inputs whatever the logits) on merged 4-bit rows
    under `copies` (its decode budget); returns the logits per step, the peak mirror bytes and the
    batch caches."""
    rows = []
    rng = random.Random(seed)
    for n in lens:
        c = make_q4_prompt_cache(model, float_copies=copies)
        _prefill(model, c, [rng.randrange(VOCAB) for _ in range(n)])
        rows.append(c)
    batch = [BatchQ4KVCache.merge([r[l] for r in rows]) for l in range(len(model.layers))]
    logits, peak = [], 0
    for s in range(steps):
        y = mx.array([[(s * 7 + b) % VOCAB] for b in range(len(lens))])
        logits.append(model(y, cache=batch)[:, -1])
        mx.eval(logits[-1])
        peak = max(peak, copies.decode_float_bytes())
    return mx.stack(logits), peak, batch


def test_mirror_logits_match_quantized_decode(model):
    """Logits with the mirror on vs off (4-bit matmuls), same inputs, 3 left-padded rows, 20 decode
    steps across the 256-token buffer growth. Same K/V values, so the only difference is float32
    rounding order (the fused float kernel vs quantized_matmul's on-the-fly dequantization, each
    ~1e-7 relative), carried through 2 layers: measured 4e-6 of the logit std; asserted 1e-4."""
    off, peak_off, _ = _teacher_forced(model, [245, 230, 180], 20, FloatCopies(decode_float_mb=0))
    on, peak_on, batch = _teacher_forced(model, [245, 230, 180], 20, FloatCopies(decode_float_mb=256))
    assert all(c.float_kv() is not None for c in batch)
    rel = (mx.abs(on - off).max() / off.std()).item()
    print(f"max |Δlogit| / std, mirror on vs off: {rel:.2e}")
    assert rel < 1e-4
    # 2 layers x 3 rows x (245 + 256) capacity x 2 heads x 64 x 4 bytes x (K, V)
    assert peak_off == 0 and peak_on == 2 * 3 * 501 * 2 * 64 * 4 * 2
    # greedy on the mirrored batch == per-sequence greedy on 4-bit (no mirror) is
    # test_batched_matches_per_sequence[...mirror_on]


def test_a_returning_turn_dequantizes_once(model):
    """A returning agent's turn: its 4-bit cache merged alone, a prefill chunk of new tokens, then
    decode steps. The chunk dequantizes the K/V once, into the mirror (one build per layer), which
    the chunk's attention reads and the decode steps keep. Before, the chunk dequantized into a
    transient copy and the first decode step dequantized again into the mirror (reproduced here
    with no budget during the chunk): the same values, so the logits are bit-identical."""
    rng = random.Random(9)
    history = [rng.randrange(VOCAB) for _ in range(300)]
    new = [rng.randrange(VOCAB) for _ in range(12)]

    def turn(chunk_budget_mb: float):
        copies = FloatCopies()
        cache = make_q4_prompt_cache(model, float_copies=copies)
        _prefill(model, cache, history)
        batch = [BatchQ4KVCache.merge([c]) for c in cache]
        builds = copies.mirror_counts["builds"]
        copies.set_decode_float_budget(chunk_budget_mb)
        logits = [model(mx.array([new]), cache=batch)[:, -1]]
        in_chunk = copies.mirror_counts["builds"] - builds
        copies.set_decode_float_budget(256)
        for y in (3, 5, 7):
            logits.append(model(mx.array([[y]]), cache=batch)[:, -1])
        mx.eval(logits)
        assert all(c.float_kv() is not None for c in batch)
        return logits, in_chunk, copies.mirror_counts["builds"] - builds

    logits, in_chunk, total = turn(256)
    ref, ref_in_chunk, ref_total = turn(0)
    n = len(model.layers)
    assert (in_chunk, total) == (n, n)  # built by the chunk, kept by the decode steps
    assert (ref_in_chunk, ref_total) == (0, n)  # built again by the first decode step
    assert all(mx.array_equal(a, b).item() for a, b in zip(logits, ref))
    # A full-size chunk of a long prompt attends on a transient copy: no mirror held through a
    # cold prefill (the chunks after it would keep a float copy of the whole history).
    batch = [BatchQ4KVCache.merge([c]) for c in make_q4_prompt_cache(model, float_copies=FloatCopies())]
    model(mx.array([[1] * floats.MIRROR_PREFILL_MAX_QUERIES]), cache=batch)
    assert all(c.float_kv() is None for c in batch)


def test_mirror_budget_bounds_and_drops(model):
    """A budget too small for any mirror: none is built, decode is on the 4-bit matmuls and still
    equals the per-sequence reference. A budget that fits the first mirror but not its growth: the
    mirror is dropped at the growth (the batch goes on on 4-bit), and the bytes never exceed it."""
    copies = FloatCopies()
    gc.collect()
    base = copies.decode_float_bytes()
    copies.set_decode_float_budget(0.01)  # 10 KB
    prompts = _prompts(3, 5, 20, seed=4)
    gen = _batch_gen(model)
    out, uids = _run(gen, {0: [(p, 6, make_q4_prompt_cache(model, float_copies=copies)) for p in prompts]})
    assert copies.decode_float_bytes() == base
    for p, u in zip(prompts, uids):
        assert out[u][0] == _reference(model, p, 6, float_copies=copies)[0]

    # 3 rows at capacity 245 + 256 = 501 tokens: 1.47 MB per layer; growing to 757 needs 2.22 MB.
    # 3.5 MB fits both layers' mirrors, not layer 0's growth (3.69 MB): layer 0 drops its mirror,
    # which leaves room for layer 1's growth (2.22 MB).
    copies.set_decode_float_budget(3.5)
    _, peak, batch = _teacher_forced(model, [245, 230, 180], 4, copies)
    assert all(c.float_kv() is not None for c in batch) and peak <= 3.5 * 2**20
    y = mx.zeros((3, 1), dtype=mx.int32)
    for _ in range(260):
        mx.eval(model(y, cache=batch))
        assert copies.decode_float_bytes() - base <= 3.5 * 2**20
    assert batch[0].float_kv() is None and batch[1].float_kv() is not None
    _check_mirror(batch[1])
    assert batch[0].size() == 245 + 4 + 260
    with pytest.raises(ValueError, match="decode_float_mb"):
        copies.set_decode_float_budget(-1)
    with pytest.raises(ValueError, match="decode_float_mb"):
        copies.set_decode_float_budget("fast")
    with pytest.raises(ValueError, match="decode_float_mb"):
        FloatCopies(decode_float_mb=-1)
    assert FloatCopies().decode_float_budget_bytes() == floats.DECODE_FLOAT_AUTO_MB * 2**20  # CPU default
    assert floats.DEFAULT.decode_float_budget_bytes() == floats.DECODE_FLOAT_AUTO_MB * 2**20
    del batch
    gc.collect()
    assert copies.decode_float_bytes() == base


def test_mirror_accounting_returns_to_zero(model):
    """Through mlx-lm's BatchGenerator (extract of each finished row, filter, and the batch list
    cleared when the last one finishes): the mirror bytes go back to where they started."""
    copies = FloatCopies(decode_float_mb=256)
    fresh = lambda: make_q4_prompt_cache(model, float_copies=copies)  # noqa: E731
    gc.collect()
    base = copies.decode_float_bytes()
    gen = _batch_gen(model)
    peak = []
    orig_next = gen.next

    def next_():
        r = orig_next()
        peak.append(copies.decode_float_bytes() - base)
        return r

    gen.next = next_
    prompts = _prompts(4, 5, 40, seed=6)
    out, uids = _run(gen, {0: [(p, m, fresh()) for p, m in zip(prompts[:2], (4, 9))],
                           2: [(p, m, fresh()) for p, m in zip(prompts[2:], (3, 5))]})
    assert max(peak) > 0
    assert all(isinstance(c, Q4KVCache) for u in uids for c in out[u][2])
    gc.collect()
    assert copies.decode_float_bytes() == base


def test_two_float_copies_are_independent():
    """Caches under two `FloatCopies` share no budget, registry or counter: one's decode budget
    full does not refuse the other's mirror, one's carried copies do not evict the other's. A batch
    keeps its rows' object through extend, extract and deepcopy; caches under different ones do not
    batch; a codec hands its own to every cache; `floats.DEFAULT`'s settings cannot be changed."""
    mx.random.seed(2)
    kv = lambda B, n: (mx.random.normal((B, 2, n, 64)), mx.random.normal((B, 2, n, 64)))  # noqa: E731

    def decoding(copies: FloatCopies) -> BatchQ4KVCache:
        rows = []
        for n in (100, 60):
            c = Q4KVCache(float_copies=copies)
            c.update_and_fetch(*kv(1, n))
            rows.append(c)
        batch = Q4KVCache.merge(rows)
        batch.update_and_fetch(*kv(2, 1))  # a decode step: builds the mirror if it fits
        return batch

    one, other = FloatCopies(decode_float_mb=256), FloatCopies(decode_float_mb=256)
    a = decoding(one)
    _check_mirror(a)
    one.set_decode_float_budget(one.decode_float_bytes() / 2**20)  # full
    _check_mirror(decoding(one), False)
    b = decoding(other)
    _check_mirror(b)  # the other's budget is its own
    assert one.decode_float_bytes() == a.mirror_nbytes and other.decode_float_bytes() == b.mirror_nbytes
    assert one.mirror_counts == {"builds": 1, "carried": 0, "refused": 1}
    assert other.mirror_counts == {"builds": 1, "carried": 0, "refused": 0}

    assert a.float_copies is one and a.extract(0).float_copies is one
    assert copy.deepcopy(a).float_copies is one and copy.deepcopy(Q4KVCache(float_copies=one)).float_copies is one
    with pytest.raises(ValueError, match="FloatCopies"):
        Q4KVCache.merge([Q4KVCache(float_copies=one), Q4KVCache(float_copies=other)])
    with pytest.raises(ValueError, match="FloatCopies"):
        a.extend(b)

    mib = lambda: {0: (mx.zeros((1, 2, 1024, 64)), mx.zeros((1, 2, 1024, 64)))}  # noqa: E731 - 1 MiB
    one.set_carry_float_budget(1)
    other.set_carry_float_budget(1)
    x, y = one.carry_floats(mib(), 1024), other.carry_floats(mib(), 1024)
    assert x.layers is not None and y.layers is not None  # each within its own 1 MiB
    assert one.carry_float_bytes() == other.carry_float_bytes() == 1 << 20
    z = one.carry_floats(mib(), 1024)
    assert x.layers is None and y.layers is not None and z.layers is not None  # `one` evicted its own
    assert (one.carry_counts["evicted"], other.carry_counts["evicted"]) == (1, 0)

    codec = ModelCodec([Q4, Q4], float_copies=other)
    assert all(c.float_copies is other for c in codec.make_cache())
    own = ModelCodec([Q4, Q4])
    assert own.float_copies not in (one, other, floats.DEFAULT)
    assert all(c.float_copies is own.float_copies for c in own.make_cache())
    assert all(c.float_copies is one for c in own.with_float_copies(one).make_cache())
    assert Q4KVCache().float_copies is floats.DEFAULT and BatchQ4KVCache([0]).float_copies is floats.DEFAULT
    with pytest.raises(RuntimeError, match="DEFAULT"):
        floats.DEFAULT.set_decode_float_budget(0)
    with pytest.raises(RuntimeError, match="DEFAULT"):
        floats.DEFAULT.set_prefill_attention("quantized")
