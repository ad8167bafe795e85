"""Span directives, amortize: a splice executed at pool level on real MLX (vllm_mlx_persist/kv_edit/splice.py):
the exact prefix and the run's values byte-identical to what was stored, the run's keys moved to their
new positions (layer 0, whose K depends only on token and position, matches a cold prefill to 4-bit
precision; unmoved it does not), and the model decodes on the result."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from vllm_mlx_persist.kv_edit.plan import Splice, find_splice
from vllm_mlx_persist.caches import ModelCodec
from vllm_mlx_persist.chain import lcp
from vllm_mlx_persist.kv_edit import AMORTIZE
from vllm_mlx_persist.kv_edit.rope_shift import probe_model
from vllm_mlx_persist.kv_edit import splice
from test_pool import GROUP, make_pool, prefill

A = 2  # the message-start token of these synthetic conversations


def msg(n, seed):
    return [A] + np.random.default_rng(seed).integers(5, 500, size=n - 1).tolist()


@pytest.fixture(scope="module")
def model():
    from vllm_mlx_persist.tools.models.build import build_model

    m, _ = build_model("llama", "tiny", seed=0)
    return m


def _runner(model, codec):
    """run(tokens, cache=None): the model over `tokens` into `cache` (a fresh one of the codec's)."""
    def run(tokens, cache=None):
        cache = cache if cache is not None else codec.make_cache()
        mx.eval(model(mx.array([tokens]), cache=cache))
        return cache
    return run


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


def test_which_models_are_spliced_here():
    from vllm_mlx_persist.tools.models.build import build_model

    assert splice.supported(ModelCodec.for_model(build_model("llama", "tiny")[0]))
    assert splice.supported(ModelCodec.for_model(build_model("deepseek_v3", "tiny")[0]))
    assert splice.supported(ModelCodec.for_model(build_model("gemma3_text", "tiny")[0], bounded=True))
    assert splice.supported(ModelCodec.for_model(build_model("deepseek_v3", "tiny")[0], latent_bits=8))
    assert not splice.supported(ModelCodec.for_model(build_model("qwen3_next", "tiny")[0]))


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v32"])
def test_mla_layers_splice_their_rotary_slot_only(tmp_path, arch):
    """MLA keeps full-precision latents: the rotary slot (deepseek_v3's k_pe in the cache's values;
    deepseek_v32's also the indexer's keys) moves, the latent stays; layer 0 then equals a cold
    prefill's within float rounding."""
    from vllm_mlx_persist.kv_edit.rope_shift import slot_names
    from vllm_mlx_persist.tools.models.build import build_model

    model, _ = build_model(arch, "tiny")
    codec = ModelCodec.for_model(model)
    assert splice.supported(codec)
    from vllm_mlx_persist.identity import model_fingerprint
    from vllm_mlx_persist.pool import BlockPool
    from vllm_mlx_persist.store import DiskStore

    fmt = {"bits": 4, "group_size": GROUP, "block_size": 16}
    fp = model_fingerprint(model, None, fmt)
    pool = BlockPool(fingerprint=fp, n_layers=codec.n_layers, bits=4, group_size=GROUP, block_size=16,
                     hot_bytes=1 << 30, store=DiskStore(tmp_path, fp, {"test": True}, fmt), codec=codec)

    run_model = _runner(model, codec)

    head, span, tail = msg(40, 1), msg(30, 2), msg(40, 3)
    stored = head + span + tail
    assert pool.commit("a", stored, run_model(stored)) == len(stored)
    prompt = head + msg(3, 4) + tail + msg(6, 5)
    m = pool.match("a", prompt, "r", edit=AMORTIZE)
    plan = find_splice(m.stored, prompt, lcp(m.stored, prompt), A)
    run = pool.run_arrays(m.source, plan.src, plan.src + plan.length)
    verdicts = probe_model(model)
    spliced, n = splice.apply(model, codec, verdicts, m.cache, m.num_tokens, prompt, plan, run)
    pool.finish("r")
    got = codec.token_arrays(spliced)
    ref = codec.token_arrays(run_model(prompt[:n]))
    rotated = 0
    for slot, (name,) in zip(verdicts[0].slots, slot_names(codec.kinds[0], 0)):
        mine, cold, was = got[name][..., plan.at:n, :], ref[name][..., plan.at:n, :], run[name]
        if mine.size == 0:
            continue
        rel = (mx.linalg.norm((mine - cold).reshape(-1)) / mx.linalg.norm(cold.reshape(-1))).item()
        assert rel <= 1e-4, (name, slot.kind, rel)
        if slot.kind == "rotate":
            rotated += 1
            assert not mx.allclose(was, cold, atol=1e-3).item()  # unmoved it would be far off
        else:
            assert mx.array_equal(mine, was).item()  # the latent: the stored bytes
    assert rotated == (1 if arch == "deepseek_v3" else 2)
    _ = run_model(prompt[n:], spliced)  # the model decodes on it
    pool.close()


def test_spliced_histories_are_kept_apart_and_go_with_their_agent(model, tmp_path):
    """A spliced turn is a branch of the agent's own record, of its generation: only amortize lookups
    of the agent see it (not its exact requests, not a fork that did not opt in), it survives a
    restart, and a forget edit or erasing the agent removes it with the rest of the record."""
    from vllm_mlx_persist.kv_edit import FORGET

    pool = make_pool(model, tmp_path)
    codec = ModelCodec.for_model(model)
    head, span, tail = msg(40, 1), msg(30, 2), msg(40, 3)
    stored = head + span + tail
    cache, _ = prefill(model, stored)
    pool.commit("a", stored, cache)
    prompt = head + msg(3, 4) + tail + msg(6, 5)
    m = pool.match("a", prompt, "r", edit=AMORTIZE)
    plan = find_splice(m.stored, prompt, lcp(m.stored, prompt), A)
    run = pool.run_arrays(m.source, plan.src, plan.src + plan.length)
    spliced, n = splice.apply(model, codec, probe_model(model), m.cache, m.num_tokens, prompt, plan, run)
    spliced, _ = prefill(model, prompt[n:], spliced)
    assert pool.commit("a", prompt, spliced, "r", generation=1) == len(prompt)
    pool.finish("r")
    assert [br.generation for br in pool.agent("a").branches] == [0, 1]
    later = prompt + msg(5, 6)
    assert pool.match("a", later).num_tokens == m.num_tokens  # exact: the honest prefix only
    assert pool.match("b", later, fork_from="a").num_tokens <= m.num_tokens  # a fork that did not opt in
    hit = pool.match("a", later, "r2", edit=AMORTIZE)
    assert hit.num_tokens == len(prompt) and hit.source[1].generation == 1
    pool.finish("r2")
    assert [i["id"] for i in pool.list_agents(10)[0]] == ["a"]
    info = pool.agent_info("a")
    assert info["spliced_branches"] == [{"tokens": len(prompt), "generation": 1}] and info["tokens"] == len(stored)
    pool.flush()
    pool.close()

    again = make_pool(model, tmp_path)  # a restart: the spliced history reads back bit for bit
    hit2 = again.match("a", later, "r3", edit=AMORTIZE)
    assert hit2.num_tokens == len(prompt)
    for x, y in zip(codec.token_arrays(hit.cache).values(), codec.token_arrays(hit2.cache).values()):
        assert mx.array_equal(x, y).item()
    again.finish("r3")
    forgot = head + msg(9, 7)
    again.match("a", forgot, "r4", edit=FORGET)  # a forget edit drops spliced copies
    again.commit("a", forgot, prefill(model, forgot)[0], "r4")
    again.finish("r4")
    assert not any(br.spliced for br in again.agent("a").branches)
    again.flush()
    again.close()
    third = make_pool(model, tmp_path)
    assert not any(br.spliced for br in third.agent("a").branches) and third.agent("a").spliced_cleared > 0
    third.match("a", later, "r5", edit=AMORTIZE)
    assert third.commit("a", prompt, spliced, "r5", generation=1) == len(prompt)
    third.finish("r5")
    assert third.erase("a") and third.agent("a") is None  # erasing the agent erases all of it
    third.close()
    assert not list((tmp_path / "cache").rglob("agents/*.json"))


def test_a_splice_in_flight_during_a_forget_is_not_stored(model, tmp_path):
    """A forget edit drops the agent's spliced histories; an amortize request that looked up before
    it and finishes after it must not store its spliced turn (it may hold the forgotten content)."""
    from vllm_mlx_persist.kv_edit import FORGET

    pool = make_pool(model, tmp_path)
    head, span, tail = msg(40, 1), msg(30, 2), msg(40, 3)
    stored = head + span + tail
    pool.commit("a", stored, prefill(model, stored)[0])
    prompt = head + msg(3, 4) + tail + msg(6, 5)
    cache = prefill(model, prompt)[0]
    pool.commit("a", prompt, cache, generation=1)  # an earlier splice, stored
    pool.match("a", prompt + msg(4, 8), "slow", edit=AMORTIZE)  # a splice request in flight
    pool.match("a", head + msg(9, 7), "forget", edit=FORGET)  # meanwhile a forget drops spliced copies
    pool.finish("forget")  # its turn was not stored: every branch it superseded goes, here all of them
    assert pool.agent("a") is None
    assert pool.commit("a", prompt, cache, "slow", generation=1) == 0
    assert pool.agent("a") is None
    pool.finish("slow")
    pool.commit("a", stored, prefill(model, stored)[0])
    pool.commit("a", prompt, cache, generation=1)
    pool.match("a", prompt + msg(4, 8), "slow2", edit=AMORTIZE)
    pool.match("a", stored + msg(2, 9), "forget2", edit=FORGET)  # removes nothing of the honest history...
    pool.commit("a", stored + msg(2, 9), prefill(model, stored + msg(2, 9))[0], "forget2")
    pool.finish("forget2")
    assert any(br.spliced for br in pool.agent("a").branches)  # ...so the spliced one stays, and may grow
    assert pool.commit("a", prompt + msg(4, 8), prefill(model, prompt + msg(4, 8))[0], "slow2", generation=1) > 0
    pool.finish("slow2")
    pool.match("a", head + msg(9, 7), "forget3", edit=FORGET)
    pool.commit("a", head + msg(9, 7), prefill(model, head + msg(9, 7))[0], "forget3")
    pool.finish("forget3")
    assert not any(br.spliced for br in pool.agent("a").branches)
    pool.match("a", prompt, "later", edit=AMORTIZE)  # a request after the forget may splice again
    assert pool.commit("a", prompt, cache, "later", generation=1) == len(prompt)


def test_two_edits_in_one_request(model, tmp_path):
    """Two spans replaced by stubs of other lengths: both later runs move, each by its own Δ; layer 0
    of both equals a cold prefill's to 4-bit precision, and the values are the stored bytes."""
    from vllm_mlx_persist.kv_edit.plan import find_splices

    pool = make_pool(model, tmp_path)
    codec = ModelCodec.for_model(model)
    m1, span1, m2, span2, m3 = msg(30, 1), msg(25, 2), msg(30, 3), msg(20, 4), msg(30, 5)
    stored = m1 + span1 + m2 + span2 + m3
    pool.commit("a", stored, prefill(model, stored)[0])
    prompt = m1 + msg(4, 6) + m2 + msg(30, 7) + m3 + msg(5, 8)
    m = pool.match("a", prompt, "r", edit=AMORTIZE)
    plans = find_splices(m.stored, prompt, lcp(m.stored, prompt), A)
    assert len(plans) == 2 and plans[0].delta == -21 and plans[1].delta == -21 + 10  # shifts add up
    runs = [(p, pool.run_arrays(m.source, p.src, p.src + p.length)) for p in plans]
    spliced, n = splice.apply_all(model, codec, probe_model(model), m.cache, m.num_tokens, prompt, runs)
    pool.finish("r")
    assert n == plans[1].at + plans[1].length
    got = codec.token_arrays(spliced)
    cold = codec.token_arrays(prefill(model, prompt[:n])[0])
    step = mx.abs(cold["0.k.s"].astype(mx.float32)).max().item()
    for p, run in runs:
        moved = {k: a[..., p.at:p.at + p.length, :] for k, a in got.items()}
        ref = {k: a[..., p.at:p.at + p.length, :] for k, a in cold.items()}
        assert mx.abs(deq(moved, 0, "k") - deq(ref, 0, "k")).max().item() <= 2 * step
        assert all(mx.array_equal(moved[x], run[x]).item() for x in run if ".v." in x)
    pool.close()


def _window_model(arch):
    """A 16-token window (blocks of 16): gemma3_text with layer 0 sliding (its own RoPE base), gpt_oss
    with layer 0 global and layer 1 sliding, so layer 0 checks each kind against a cold prefill."""
    from vllm_mlx_persist.caches.attention import install_attention_fix
    from vllm_mlx_persist.tools.models.build import SIZES, Size, build_model

    size = Size(**{**SIZES["tiny"].__dict__, "sliding_window": 16, "vocab": 512})
    over = {"layer_types": ["full_attention", "sliding_attention"]} if arch == "gpt_oss" else None
    model, _ = build_model(arch, size, seed=0, overrides=over)
    install_attention_fix()
    return model, ModelCodec.for_model(model, bounded=True)


def _codec_pool(codec, root):
    from vllm_mlx_persist.pool import BlockPool
    from vllm_mlx_persist.store import DiskStore

    fp, fmt = "s" * 64, {"bits": 4, "group_size": GROUP, "block_size": 16}
    store = DiskStore(root, fp, {"test": True}, fmt) if root is not None else None
    pool = BlockPool(fingerprint=fp, n_layers=codec.n_layers, bits=4, group_size=GROUP, block_size=16,
                     hot_bytes=1 << 30, store=store, codec=codec)
    pool.load_manifests()
    return pool


def _four_turns(model, codec, pool, history, third):
    """Commit `history` as four turns ending at 40, 70, `third` and its end; the last live cache."""
    cache = None
    for upto in (40, 70, third, len(history)):
        cache = cache if cache is not None else codec.make_cache()
        mx.eval(model(mx.array([history[codec.length(cache):upto]]), cache=cache))
        assert pool.commit("a", history[:upto], cache) == upto
    pool.flush()
    return cache


def test_a_run_whose_window_memory_shed_and_no_disk_holds_is_not_spliced():
    """Without a disk tier, memory keeps sliding arrays only for the window before the branch end: a
    run ending further back cannot give its window (the backend falls back with window_not_held)."""
    model, codec = _window_model("gemma3_text")
    pool = _codec_pool(codec, None)
    head, span, tail = msg(40, 1), msg(30, 2), msg(40, 3)
    _four_turns(model, codec, pool, head + span + tail + msg(40, 6), 110)
    prompt = head + msg(3, 4) + tail + msg(6, 5)
    m = pool.match("a", prompt, "r", edit=AMORTIZE)
    plan = find_splice(m.stored, prompt, lcp(m.stored, prompt), A)
    assert codec.run_length(pool.run_arrays(m.source, plan.src, plan.src + plan.length)) == 0
    assert codec.run_length(pool.run_arrays(m.source, 120, 150)) == 30  # ending at the branch end: held
    pool.finish("r")
    pool.close()


@pytest.mark.parametrize("arch,tail_len,stub_len",
                         [("gemma3_text", 40, 3), ("gpt_oss", 40, 45), ("gemma3_text", 16, 45)])
def test_sliding_window_layers_splice_their_last_window(tmp_path, arch, tail_len, stub_len):
    """Bounded sliding layers: after the splice each holds the window before the new end, which the
    run gives (a run longer than the window alone; a shorter one after the stub's window), its keys
    moved with the layer's own RoPE; global layers hold the prefix as stored and the whole run moved.
    Layer 0 (sliding in gemma3_text, global in gpt_oss here) equals a cold prefill to 4-bit
    precision; every layer's run values are the stored bytes. The history goes on after the run, so
    memory has shed the run's sliding arrays and its window is read back from disk."""
    model, codec = _window_model(arch)
    pool = _codec_pool(codec, tmp_path)

    run_model = _runner(model, codec)

    head, span, tail = msg(40, 1), msg(30, 2), msg(tail_len, 3)
    cache = _four_turns(model, codec, pool, head + span + tail + msg(40, 6), 70 + tail_len)
    prompt = head + msg(stub_len, 4) + tail + msg(6, 5)  # `more` is not in it: the run ends before it
    m = pool.match("a", prompt, "r", edit=AMORTIZE)
    plan = find_splice(m.stored, prompt, lcp(m.stored, prompt), A)
    assert plan.length == tail_len + 1 and plan.delta == stub_len - 30  # the next message's start too
    assert m.num_tokens >= 32  # a bounded model reuses up to where its window is held
    # Memory keeps sliding arrays for the window before the branch end only: not the run's.
    bids = [bid for _, bid, _ in pool.chains.walk(m.source[1])]
    last = (plan.src + plan.length - 1) // 16
    assert codec.window_from(pool.table.blocks[bids[last]].layers) == 16
    run = pool.run_arrays(m.source, plan.src, plan.src + plan.length)
    assert codec.run_length(run) == plan.length
    verdicts = probe_model(model)
    spliced, n = splice.apply(model, codec, verdicts, m.cache, m.num_tokens, prompt, plan, run)
    pool.finish("r")
    assert n == plan.at + plan.length and codec.is_cache(spliced) and codec.length(spliced) == n
    (sliding,) = codec.windows
    assert codec.spans(spliced)[sliding][0] == max(0, n - 16)
    got = codec.token_arrays(spliced)
    cold = run_model(prompt[:n])
    ref = codec.token_arrays(cold)
    for layer in range(codec.n_layers):
        lo = codec.spans(spliced)[layer][0]
        if layer != sliding:  # the exact prefix: byte for byte what was stored
            for name in (f"{layer}.{x}.{p}" for x in "kv" for p in "qsb"):
                want = codec.token_arrays(cache)[name][..., :m.num_tokens, :]
                assert mx.array_equal(got[name][..., :m.num_tokens, :], want).item(), name
        for p in "qsb":  # the run's values (as far as the layer holds them): untouched
            held = got[f"{layer}.v.{p}"][..., max(0, plan.at - lo):, :]
            assert mx.array_equal(held, run[f"{layer}.v.{p}"][..., -held.shape[2]:, :]).item()
    # Layer 0's keys depend only on token and position: moved (with its own RoPE), a cold prefill's.
    lo = codec.spans(spliced)[0][0]
    mine = {k: a[..., max(plan.at, lo) - lo:, :] for k, a in got.items() if k.startswith("0.")}
    cold0 = {k: a[..., max(plan.at, lo):n, :] for k, a in ref.items() if k.startswith("0.")}
    step = mx.abs(cold0["0.k.s"].astype(mx.float32)).max().item()
    assert mx.abs(deq(mine, 0, "k") - deq(cold0, 0, "k")).max().item() <= 2 * step
    unmoved = {k: a[..., -mine["0.k.q"].shape[2]:, :] for k, a in run.items() if k.startswith("0.")}
    assert mx.abs(deq(unmoved, 0, "k") - deq(cold0, 0, "k")).max().item() > 4 * step
    # The model decodes on it as on the cold cache (layer 0's window is equal; layer 1 differs by
    # the approximation itself, so only finiteness is asserted).
    logits = model(mx.array([prompt[n:]]), cache=spliced)
    assert mx.all(mx.isfinite(logits)).item()
    pool.close()


def test_a_run_is_cut_to_where_its_sliding_window_is_held():
    """`ModelCodec.splice_run` on blocks whose sliding arrays were trimmed: the run ends at the furthest
    block end whose window (16) the blocks hold, positions before the run counting as held."""
    from vllm_mlx_persist.caches.codec import WIN_FROM

    codec = ModelCodec([splice.Q4, splice.Q4], windows={0: 16}, bounded=True)

    def block(n, f=0):
        """n tokens whose sliding layer (0) holds the last n - f; each array holds its positions."""
        a = {}
        for layer, lo in ((0, f), (1, 0)):
            for name in (f"{layer}.{x}.{p}" for x in "kv" for p in "qsb"):
                if lo < n:
                    a[name] = mx.broadcast_to(mx.arange(lo, n)[:, None], (n - lo, 8))[None, None]
        if f:
            a[WIN_FROM] = mx.array([f], dtype=mx.int32)
        return a

    full = block(16)
    assert codec.run_length(codec.splice_run([(full, 16), (full, 16), (full, 10)], 4)) == 38
    # The last block holds only its last 8: the end there needs 16 held; the block before ends a window.
    trimmed = [(block(16, 16), 16), (block(16), 16), (block(16, 8), 16)]
    run = codec.splice_run(trimmed, 4)
    assert codec.run_length(run) == 28 and codec.window_from(run) == 12
    assert run["0.k.q"][0, 0, :, 0].tolist() == list(range(0, 16))  # positions 16..32 of the blocks, as stored
    assert run["1.k.q"].shape[2] == 28
    # Nothing held at a block end with a full window: no run.
    assert codec.splice_run([(block(16, 16), 16), (block(16, 8), 16)], 4) == {}
    # A run starting inside the held part needs nothing before it.
    assert codec.run_length(codec.splice_run([(block(16, 16), 16), (block(16, 4), 16)], 20)) == 12


@pytest.mark.parametrize("bits", [8, 4])
def test_latent_packed_mla_moves_k_pe_only(tmp_path, bits):
    """deepseek_v3 with `latent_bits`: the run's packed latent is the stored bytes after the splice
    (the live float cache re-packs to the same codes), only k_pe moves; layer 0's k_pe then equals a
    cold prefill's to the packing's precision, and the exact prefix is stored bytes too."""
    from vllm_mlx_persist.caches.latent import dequantize_latent
    from vllm_mlx_persist.tools.models.build import build_model

    model, _ = build_model("deepseek_v3", "tiny")
    codec = ModelCodec.for_model(model, latent_bits=bits)
    assert splice.supported(codec)
    pool = _codec_pool(codec, tmp_path)

    run_model = _runner(model, codec)

    head, span, tail = msg(40, 1), msg(30, 2), msg(40, 3)
    stored = head + span + tail
    assert pool.commit("a", stored, run_model(stored)) == len(stored)
    packed = codec.token_arrays(pool.match("a", stored + [A], "p").cache)  # the stored bytes
    pool.finish("p")
    prompt = head + msg(3, 4) + tail + msg(6, 5)
    m = pool.match("a", prompt, "r", edit=AMORTIZE)
    plan = find_splice(m.stored, prompt, lcp(m.stored, prompt), A)
    run = pool.run_arrays(m.source, plan.src, plan.src + plan.length)
    assert set(run) == codec.token_names() and "0.v.c" in run
    spliced, n = splice.apply(model, codec, probe_model(model), m.cache, m.num_tokens, prompt, plan, run)
    pool.finish("r")
    got = codec.token_arrays(spliced)
    for name in codec.token_names():
        assert mx.array_equal(got[name][..., :m.num_tokens, :], packed[name][..., :m.num_tokens, :]).item(), name
        if ".k." in name:  # the latent: the stored bytes
            assert mx.array_equal(got[name][..., plan.at:n, :], run[name]).item(), name
    kpe = lambda arrays, lo, hi: dequantize_latent(*(arrays[f"0.v.{p}"][..., lo:hi, :] for p in "csb"), bits)
    cold = codec.token_arrays(run_model(prompt[:n]))
    want = kpe(cold, plan.at, n)
    step = mx.abs(cold["0.v.s"][..., plan.at:n, :]).max().item()
    assert mx.abs(kpe(got, plan.at, n) - want).max().item() <= 2 * step
    assert mx.abs(kpe(run, 0, n - plan.at) - want).max().item() > 4 * step  # unmoved: far off
    _ = run_model(prompt[n:], spliced)  # the model decodes on it
    pool.close()
