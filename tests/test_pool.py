"""The block pool on real MLX with a small local model: every cache path against the reference.

Tolerances: cold (full 4-bit prefill) vs hot (reused 4-bit prefix + suffix prefill) logits differ
only by float rounding of chunked vs whole attention: max abs diff < COLD_HOT_TOL (logits here are
within +-4; single-threaded BLAS gives 0.0, multi-threaded OpenBLAS 4.1e-3 on the 2-core CI machine,
since its kernels split a 30-row and an 80-row product differently). Hot vs reloaded
from disk, and reloaded after eviction, must be bit-identical (same arrays, same logits).
"""

from __future__ import annotations

import os
import resource
import signal

import mlx.core as mx
import numpy as np
import pytest

from vllm_mlx_persist.caches.q4 import make_q4_prompt_cache
from vllm_mlx_persist.disk_format import Manifest
from vllm_mlx_persist.identity import model_fingerprint
from vllm_mlx_persist.pool import BlockPool
from vllm_mlx_persist.store import DiskStore
from vllm_mlx_persist.tools.models.build import build_model

BITS, GROUP, BLOCK = 4, 64, 16
COLD_HOT_TOL = 1e-2


@pytest.fixture(scope="module")
def model():
    m, _ = build_model("llama", "tiny", seed=0)
    return m


def prefill(model, tokens, cache=None):
    """Run `tokens` through the model on a 4-bit cache; returns (cache, last logits)."""
    cache = cache if cache is not None else make_q4_prompt_cache(model, BITS, GROUP)
    logits = model(mx.array(tokens)[None], cache=cache)
    mx.eval(logits)
    return cache, logits[0, -1]


def make_pool(model, root, hot_bytes=1 << 30, fingerprint=None, **kw) -> BlockPool:
    fmt = {"bits": BITS, "group_size": GROUP, "block_size": BLOCK}
    fp = fingerprint or model_fingerprint(model, None, fmt)
    store = DiskStore(root, fp, {"test": True}, fmt)
    pool = BlockPool(fingerprint=fp, n_layers=len(model.layers), bits=BITS, group_size=GROUP,
                     block_size=BLOCK, hot_bytes=hot_bytes, store=store, **kw)
    pool.load_manifests()
    return pool


def tokens(n, seed=0):
    return np.random.default_rng(seed).integers(5, 500, size=n).tolist()


def arrays(cache):
    return [a for c in cache for part in c.to_arrays() for a in part]


def assert_same_cache(a, b):
    assert len(a) == len(b)
    for x, y in zip(arrays(a), arrays(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert mx.array_equal(x, y).item()


def test_hot_prefix_reuse_matches_cold_prefill(model, tmp_path):
    pool = make_pool(model, tmp_path)
    turn1 = tokens(50)
    cache, _ = prefill(model, turn1)
    assert pool.commit("a", turn1, cache) == 50
    turn2 = turn1 + tokens(30, seed=1)
    hit, n, tier = pool.lookup("a", turn2)
    assert (n, tier) == (50, "hot")
    assert_same_cache(hit, cache)  # the reused prefix is exactly what was stored
    _, hot_logits = prefill(model, turn2[n:], hit)
    _, cold_logits = prefill(model, turn2)
    assert mx.abs(hot_logits - cold_logits).max().item() < COLD_HOT_TOL
    assert mx.argmax(hot_logits).item() == mx.argmax(cold_logits).item()


def test_identical_prompt_reuses_all_but_last_token_and_divergent_prompt_trims(model, tmp_path):
    pool = make_pool(model, tmp_path)
    seq = tokens(40)
    pool.commit("a", seq, prefill(model, seq)[0])
    assert pool.lookup("a", seq)[1] == 39
    diverged = seq[:21] + [7, 8, 9]  # diverges inside the second block
    hit, n, _ = pool.lookup("a", diverged)
    assert n == 21 and hit[0].offset == 21
    _, logits = prefill(model, diverged[n:], hit)
    _, cold = prefill(model, diverged)
    assert mx.abs(logits - cold).max().item() < COLD_HOT_TOL


def test_reloaded_from_disk_is_bit_identical_to_hot(model, tmp_path):
    seq = tokens(70)
    pool = make_pool(model, tmp_path)
    pool.commit("a", seq, prefill(model, seq)[0])
    query = seq + tokens(5, seed=3)
    hot, n_hot, _ = pool.lookup("a", query)
    pool.close()

    restarted = make_pool(model, tmp_path)  # a new process: manifests from disk, blocks on demand
    cold_start, n_disk, tier = restarted.lookup("a", query)
    assert (n_disk, tier) == (n_hot, "disk")
    assert_same_cache(hot, cold_start)
    _, a = prefill(model, query[n_hot:], hot)
    _, b = prefill(model, query[n_disk:], cold_start)
    assert mx.array_equal(a, b).item()


def test_a_reloaded_run_stays_counted_until_its_last_block_goes(model, tmp_path):
    """Blocks read from disk together are views of one import per array (no per-block copy, no
    concatenation when the lookup takes them from the start); a block that leaves the run frees
    nothing while the others hold the arrays, so the hot tier keeps counting all of it."""
    seq = tokens(70)  # blocks of 16: four full and one of 6 tokens
    pool = make_pool(model, tmp_path)
    pool.commit("a", seq, prefill(model, seq)[0])
    query = seq + tokens(5, seed=3)
    hot = pool.lookup("a", query)[0]
    pool.close()

    pool = make_pool(model, tmp_path)
    cache, n, tier = pool.lookup("a", query)
    assert (n, tier) == (70, "disk")
    assert_same_cache(hot, cache)
    blocks = [pool.blocks[b] for b in pool.agent("a").block_ids]
    run = blocks[0].run[0]
    assert [b.run for b in blocks] == [(run, 16 * i) for i in range(5)] and run.members == blocks
    whole = sum(a.nbytes for a in run.arrays.values())
    assert pool.hot_bytes == whole == sum(b.nbytes for b in blocks)

    # The next turn replaces the 6-token block with a longer one: it leaves the run, its bytes stay.
    cache, _ = prefill(model, query[n:], cache)
    pool.commit("a", query, cache)
    assert blocks[4].layers is None and run.members == blocks[:4]
    new = [pool.blocks[b] for b in pool.agent("a").block_ids if pool.blocks[b].run is None]
    assert len(new) == 1 and pool.hot_bytes == whole + new[0].nbytes
    again, m, tier = pool.lookup("a", query + [7])
    assert (m, tier) == (75, "hot")
    assert_same_cache(again, cache)
    pool.clear()
    assert pool.hot_bytes == 0 and run.members == []


def test_each_turn_is_one_run_that_the_next_lookup_takes_whole(model, tmp_path):
    """A turn's blocks are views of its cache (one Run), and the blocks its lookup reused are
    re-pointed to the same bytes of the new cache, so an agent's blocks stay one run and a hot
    lookup takes it whole: bit-identical to a reload, the hot bytes exactly the run's. A fork's
    blocks after a shared prefix stay copies (a run over the prefix would hold it uncounted)."""
    seq = tokens(40)  # blocks of 16: two full and one of 8 tokens
    pool = make_pool(model, tmp_path)
    pool.commit("a", seq, prefill(model, seq)[0])
    first = [pool.blocks[b] for b in pool.agent("a").block_ids]
    old = first[0].run[0]
    assert [b.run for b in first] == [(old, 0), (old, 16), (old, 32)]

    query = seq + tokens(12, seed=5)
    cache, n, tier = pool.lookup("a", query, request_id="r1")
    assert (n, tier) == (40, "hot")
    cache, _ = prefill(model, query[n:], cache)
    pool.commit("a", query, cache, request_id="r1")
    pool.finish("r1")
    blocks = [pool.blocks[b] for b in pool.agent("a").block_ids]
    run = blocks[0].run[0]
    assert run is not old and old.members == [] and blocks[:2] == first[:2]  # re-pointed, not rebuilt
    assert [b.run for b in blocks] == [(run, 0), (run, 16), (run, 32), (run, 48)]
    assert pool.hot_bytes == sum(a.nbytes for a in run.arrays.values())

    hot, m, tier = pool.lookup("a", query + [3])
    assert (m, tier) == (52, "hot")
    pool.flush()
    assert_same_cache(hot, make_pool(model, tmp_path).lookup("a", query + [3])[0])

    child = query + tokens(20, seed=6)
    c, k, _ = pool.lookup("b", child, fork_from="a")
    pool.commit("b", child, prefill(model, child[k:], c)[0], fork_from="a")
    own = [pool.blocks[b] for b in pool.agent("b").block_ids if pool.refs[b] == 1]
    assert own and all(b.run is None for b in own)


def test_lru_spills_to_disk_and_reloads_identically(model, tmp_path):
    seqs = {name: tokens(48, seed=i) for i, name in enumerate("abc")}
    caches = {name: prefill(model, s)[0] for name, s in seqs.items()}
    one_agent = sum(a.nbytes for a in arrays(caches["a"]))
    pool = make_pool(model, tmp_path, hot_bytes=int(one_agent * 1.5))
    for name in "abc":
        pool.commit(name, seqs[name], caches[name])
    assert pool.hot_bytes <= int(one_agent * 1.5)
    assert pool.stats["evicted_agents"] >= 2
    hit, n, tier = pool.lookup("a", seqs["a"] + [1])
    assert (n, tier) == (48, "disk")
    assert_same_cache(hit, make_pool(model, tmp_path).lookup("a", seqs["a"] + [1])[0])


def test_agents_and_models_are_isolated(model, tmp_path):
    seq = tokens(40)
    pool = make_pool(model, tmp_path)
    pool.commit("a", seq, prefill(model, seq)[0])
    assert pool.lookup("b", seq)[1] == 0
    assert pool.lookup(None, seq)[1] == 0  # anonymous never sees agents
    pool.commit(None, seq, prefill(model, seq)[0])
    assert pool.lookup(None, seq + [3])[1] == 40  # anonymous reuses by prefix among its own
    pool.close()
    # Same directory, another model's fingerprint: the store puts it elsewhere, nothing matches.
    other = make_pool(model, tmp_path, fingerprint="f" * 64)
    assert other.lookup("a", seq)[1] == 0


def test_an_anonymous_entry_whose_history_changed_is_reused_not_shadowed(model, tmp_path):
    """Regression (found by the state machine): an anonymous entry is named after its first block when
    made, and a sequence that begins with its first block's tokens, or that they begin, takes the entry
    over: its history is then that sequence. After a short one and then another continuation of it, a
    sequence beginning with the entry's original first block matched no entry, and the entry made for
    it had the existing entry's name: it was never registered (the name was taken), so the blocks it
    named stayed in memory for good, counted by no registered entry (BlockTable.check broke; hot bytes
    no budget could free). Now the entry of that name takes the sequence."""
    pool = make_pool(model, tmp_path)
    first = tokens(24, seed=7)  # a block and a tail
    pool.commit(None, first, prefill(model, first)[0])
    pool.commit(None, first[:3], prefill(model, first[:3])[0])  # takes the entry over...
    other = first[:3] + tokens(21, seed=8)
    pool.commit(None, other, prefill(model, other)[0])  # ...and so does another continuation of it
    assert pool.snapshot()["anonymous_entries"] == 1
    again = first + [3]
    pool.commit(None, again, prefill(model, again)[0])
    assert pool.check() == []
    assert pool.snapshot()["anonymous_entries"] == 1
    assert pool.lookup(None, again + [4])[1] == len(again)
    pool.set_hot_budget(0)  # every entry leaves memory, and with it every block
    assert pool.check() == [] and pool.hot_bytes == 0
    pool.close()


def test_saving_a_turn_writes_only_new_blocks(model, tmp_path):
    pool = make_pool(model, tmp_path)
    turn1 = tokens(40)  # 2 full blocks + a tail of 8
    pool.commit("a", turn1, prefill(model, turn1)[0])
    assert pool.snapshot()["blocks_written"] == 3
    turn2 = turn1 + tokens(10, seed=5)  # 3 full blocks + tail of 2: the old tail is replaced
    hit, n, _ = pool.lookup("a", turn2 + [1])
    cache, _ = prefill(model, turn2[n:], hit)
    pool.commit("a", turn2, cache)
    assert pool.snapshot()["blocks_written"] == 3 + 2
    pool.flush()
    files = list(tmp_path.glob("*/blocks/*/*.safetensors"))
    assert len(files) == 4  # the replaced tail's file is gone


def test_full_disk_keeps_the_agent_hot_and_serving(model, tmp_path):
    pool = make_pool(model, tmp_path)
    seq = tokens(40)
    cache, _ = prefill(model, seq)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # any larger write fails with EFBIG
    try:
        pool.commit("a", seq, cache)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert pool.stats["write_errors"] == 1
    assert pool.lookup("a", seq + [1])[1] == 40  # still served from memory
    assert not list(tmp_path.glob("*/agents/*.json"))  # and nothing half-written on disk


def test_prefetched_blocks_are_the_blocks_read_on_demand(model, tmp_path):
    seq = tokens(70)
    pool = make_pool(model, tmp_path)
    pool.commit("a", seq, prefill(model, seq)[0])
    pool.close()
    on_demand = make_pool(model, tmp_path).lookup("a", seq + [1])[0]
    ahead = make_pool(model, tmp_path)
    assert ahead.prefetch("a") == 5  # 4 full blocks of 16 and a tail of 6, all cold
    assert ahead.prefetch("nobody") == 0
    hit, n, tier = ahead.lookup("a", seq + [1])
    assert (n, tier) == (70, "disk") and ahead.stats["blocks_prefetched"] == 5
    assert_same_cache(hit, on_demand)
    assert ahead.prefetch("a") == 0 and not ahead.reads.snapshot()["prefetch_pending"]  # now hot: nothing to read


def test_refused_block_is_dropped_quarantined_and_recached(model, tmp_path):
    """A block file with a valid checksum whose tokens do not chain (forged) is refused once: it
    leaves the agent's chain and goes to quarantine, and the agent's next turn caches past it."""
    seq = tokens(70)  # blocks of 16: 4 full + a tail of 6
    cache, _ = prefill(model, seq)
    pool = make_pool(model, tmp_path)
    pool.commit("a", seq, cache)
    forged_id = pool.agent("a").block_ids[2]
    pool.close()
    store = pool.store
    data = store.read_block(forged_id)
    data.tokens = (data.tokens + 1).astype(np.int32)
    assert store.write_block(data) > 0  # the store recomputes the checksum: the file itself is sound

    restarted = make_pool(model, tmp_path)
    hit, n, _ = restarted.lookup("a", seq + [1])
    assert n == 32 and restarted.stats["bad_blocks"] == 1
    assert restarted.agent("a").block_ids == pool.agent("a").block_ids[:2]
    restarted.flush()
    assert any(q.startswith(forged_id) for q in os.listdir(store.quarantine_dir))
    # The next turn rebuilds the refused block and those after it; nothing is refused again.
    restarted.commit("a", seq, cache)
    assert restarted.lookup("a", seq + [1])[1] == 70 and restarted.stats["bad_blocks"] == 1
    restarted.close()
    again = make_pool(model, tmp_path)
    hit2, n2, tier = again.lookup("a", seq + [1])
    assert (n2, tier) == (70, "disk") and again.stats["bad_blocks"] == 0
    assert_same_cache(hit2, cache)


def test_manifest_naming_another_agents_blocks_leaves_them_alone(model, tmp_path):
    """Agent b's manifest pointing at a's blocks: b is refused, a's files stay and a still hits."""
    seq = tokens(40)
    pool = make_pool(model, tmp_path)
    pool.commit("a", seq, prefill(model, seq)[0])
    pool.close()
    store = pool.store
    store.write_manifest(Manifest("b", list(pool.agent("a").block_ids), 40, 1.0))
    restarted = make_pool(model, tmp_path)
    assert restarted.lookup("b", seq + [1])[1] == 0 and restarted.stats["bad_blocks"] == 1
    assert restarted.agent("b").block_ids == []
    restarted.flush()
    assert os.listdir(store.quarantine_dir) == []
    assert restarted.lookup("a", seq + [1])[1] == 40


def test_memory_only_pool_stays_within_its_budget(model):
    """Without a disk tier (store=None) evicting an agent must free its blocks."""
    seqs = {name: tokens(48, seed=i) for i, name in enumerate("abc")}
    caches = {name: prefill(model, s)[0] for name, s in seqs.items()}
    one_agent = sum(a.nbytes for a in arrays(caches["a"]))
    pool = BlockPool(fingerprint="f" * 64, n_layers=len(model.layers), bits=BITS, group_size=GROUP,
                     block_size=BLOCK, hot_bytes=int(one_agent * 1.5), store=None)
    for name in "abc":
        pool.commit(name, seqs[name], caches[name])
        assert pool.hot_bytes <= int(one_agent * 1.5)
    assert pool.lookup("c", seqs["c"] + [1])[1] == 48
    assert pool.lookup("a", seqs["a"] + [1])[1] == 0  # evicted: gone, not pinned
