"""Span directives, forget mode, at pool level on real MLX (issue #21): a forget edit is served as
a cold run of the edited prompt from the first differing token, and the history it superseded
(its branch and the blocks only that branch named) leaves memory and disk, across a restart."""

from __future__ import annotations

import mlx.core as mx
import pytest

from vllm_mlx_persist.kv_edit import FORGET
from vllm_mlx_persist.kv_edit.supersede import edit_point, superseded_block
from vllm_mlx_persist.chain import Branch
from test_pool import BLOCK, COLD_HOT_TOL, make_pool, prefill, tokens


@pytest.fixture(scope="module")
def model():
    from vllm_mlx_persist.tools.models.build import build_model

    m, _ = build_model("llama", "tiny", seed=0)
    return m


def _history():
    """Head (40 tokens: blocks 0-1 and half of 2), a span of 30 the edit removes, a tail of 30."""
    head, span, tail = tokens(40, seed=1), tokens(30, seed=2), tokens(30, seed=3)
    return head, span, tail


def _holds(seq, run):
    run = list(run)
    return any(list(seq[i:i + len(run)]) == run for i in range(len(seq) - len(run) + 1))


def _disk_tokens(pool):
    store = pool.persister.store if hasattr(pool.persister, "store") else pool.store
    return [store.read_block(b).tokens.tolist() for b in store.iter_block_ids()]


def _turn(pool, model, agent, prompt, rid, edit=None, out=5):
    """One request: lookup, prefill the rest, commit prompt + `out` generated tokens, finish."""
    m = pool.match(agent, prompt, rid, edit=edit)
    cache, logits = prefill(model, prompt[m.num_tokens:], m.cache) if m.cache is not None else prefill(model, prompt)
    seq = prompt + tokens(out, seed=len(prompt))
    _, _ = prefill(model, seq[len(prompt):], cache)
    pool.commit(agent, seq, cache, rid)
    pool.finish(rid)
    return m, logits, seq


def test_edit_point_and_superseded_block():
    assert edit_point([[1, 2, 3, 4], [5, 6, 7, 8]], [1, 2, 3, 4, 5, 9]) == 5
    assert edit_point([[1, 2, 3, 4]], [1, 2]) == 2  # a truncation ends inside the stored run
    assert edit_point([[1, 2, 3, 4]], [1, 2, 3, 4, 5]) == 4
    br = Branch(("a", "b", "c"), 10, ((0, "x"),))
    assert superseded_block(br, 5, 4) == "b" and superseded_block(br, 8, 4) == "c"
    assert superseded_block(br, 10, 4) is None  # the prompt extends the branch: nothing removed


def test_forget_serves_a_cold_run_and_the_superseded_history_leaves_memory_and_disk(model, tmp_path):
    pool = make_pool(model, tmp_path)
    head, span, tail = _history()
    _, _, stored = _turn(pool, model, "a", head + span + tail, "r1")
    old_ids = list(pool.agent("a").branches[-1].block_ids)
    pool.flush()
    assert any(_holds(t, span[:4]) for t in _disk_tokens(pool))  # the span is on disk before the edit

    edited = head + tail + tokens(7, seed=9)  # the span removed; the client's next message appended
    m, logits, seq = _turn(pool, model, "a", edited, "r2", edit=FORGET)
    assert m.num_tokens == 40 and m.superseded == 1  # re-prefilled from the first differing token
    _, cold = prefill(model, edited)
    assert mx.abs(logits - cold).max().item() < COLD_HOT_TOL

    pool.flush()
    agent = pool.agent("a")
    assert len(agent.branches) == 1 and agent.branches[0].n_tokens == len(seq)
    kept = set(agent.branches[0].block_ids)
    assert kept & set(old_ids) == set(old_ids[:40 // BLOCK])  # blocks before the edit keep their ids
    gone = set(old_ids) - kept
    assert gone and not (gone & set(pool.blocks)), "superseded blocks still in memory"
    for t in _disk_tokens(pool):
        assert not _holds(t, span[:4]), "a block file still holds the removed span's tokens"
    assert pool.snapshot()["branches_superseded"] == 1

    # After a restart (a new pool on the same disk) the unedited prompt reuses nothing past the edit.
    pool.close()
    again = make_pool(model, tmp_path)
    m2 = again.match("a", stored + [7], "r3")
    assert m2.num_tokens <= 40
    again.finish("r3")
    again.close()


def test_exact_mode_keeps_the_old_history(model, tmp_path):
    """The control: the same edit without the mode leaves the old branch where it was."""
    pool = make_pool(model, tmp_path)
    head, span, tail = _history()
    _, _, stored = _turn(pool, model, "a", head + span + tail, "r1")
    m, _, _ = _turn(pool, model, "a", head + tail, "r2")
    assert m.superseded == 0 and len(pool.agent("a").branches) == 2
    assert pool.match("a", stored + [7]).num_tokens == len(stored)
    pool.flush()
    assert any(_holds(t, span[:4]) for t in _disk_tokens(pool))
    pool.close()


def test_truncation_and_extension(model, tmp_path):
    pool = make_pool(model, tmp_path)
    head, span, tail = _history()
    _, _, stored = _turn(pool, model, "a", head + span + tail, "r1")
    m, _, _ = _turn(pool, model, "a", stored + tokens(5, seed=4), "r2", edit=FORGET)
    assert m.superseded == 0 and m.num_tokens == len(stored)  # an extension supersedes nothing
    n_before = len(pool.agent("a").branches)
    m, _, _ = _turn(pool, model, "a", head, "r3", edit=FORGET)  # everything after the head removed
    assert m.superseded == n_before and len(pool.agent("a").branches) == 1
    pool.flush()
    for t in _disk_tokens(pool):
        assert not _holds(t, span[:4])
    pool.close()


def test_a_forget_whose_turn_is_not_stored_still_drops_the_history(model, tmp_path):
    pool = make_pool(model, tmp_path)
    head, span, tail = _history()
    _turn(pool, model, "a", head + span + tail, "r1")
    other = head[:20] + tokens(20, seed=6)
    _turn(pool, model, "a", other, "r1b")  # a second branch, diverging before the edit point
    m = pool.match("a", head + tail, "r2", edit=FORGET)
    assert m.superseded == 1 and m.num_tokens == 40
    pool.finish("r2")  # aborted: never committed
    pool.flush()
    branches = pool.agent("a").branches
    assert len(branches) == 1 and branches[0].n_tokens == 20 + 20 + 5
    for t in _disk_tokens(pool):
        assert not _holds(t, span[:4])
    pool.close()


def test_branches_tied_with_the_best_match_are_superseded_too(model, tmp_path):
    """Two histories the edited prompt matches equally far: the lookup cannot tell which one the
    client edited, so neither keeps content the prompt does not have."""
    pool = make_pool(model, tmp_path)
    head, span, tail = _history()
    _turn(pool, model, "a", head + span + tail, "r1")
    _turn(pool, model, "a", head + tokens(20, seed=6), "r1b")
    m, _, seq = _turn(pool, model, "a", head + tail, "r2", edit=FORGET)
    assert m.superseded == 2
    assert [b.n_tokens for b in pool.agent("a").branches] == [len(seq)]
    pool.close()


def test_a_childs_forget_leaves_its_fork_parent_alone(model, tmp_path):
    pool = make_pool(model, tmp_path)
    head, span, tail = _history()
    _, _, stored = _turn(pool, model, "parent", head + span + tail, "r1")
    m = pool.match("child", head + tail, "r2", fork_from="parent", edit=FORGET)
    assert m.superseded == 0  # the edited history is the parent's, not the child's to drop
    pool.finish("r2")
    assert pool.match("parent", stored + [3]).num_tokens == len(stored)
    pool.close()


def test_forget_deletes_the_superseded_blocks_from_the_fleet_tier(model, tmp_path):
    """With Redis behind the disk: the put continues the old manifest, so Redis's manifest loses the
    branch, and the blocks only it named are deleted rather than left for their 7-day TTL."""
    pytest.importorskip("redis")
    from test_remote import RedisServer

    from vllm_mlx_persist.fleet import Fleet, FleetSettings, RemoteTier

    (tmp_path / "redis").mkdir()
    redis_srv = RedisServer(tmp_path / "redis")
    pool = None
    try:
        fp = "f" * 64
        pool = make_pool(model, tmp_path / "disk", fingerprint=fp,
                         fleet=lambda p: Fleet(p, lambda **cb: RemoteTier(FleetSettings(redis_srv.url), fp, **cb)))
        tier, client = pool.fleet.tier, redis_srv.client()
        head, span, tail = _history()
        _turn(pool, model, "a", head + span + tail, "r1")
        pool.flush()
        assert tier.flush(10)
        old = list(pool.agent("a").branches[-1].block_ids)
        assert all(client.exists(tier.block_key(b)) for b in old)

        _turn(pool, model, "a", head + tail, "r2", edit=FORGET)
        pool.flush()
        assert tier.flush(10)
        kept = set(pool.agent("a").branches[-1].block_ids)
        gone = [b for b in old if b not in kept]
        assert gone and not any(client.exists(tier.block_key(b)) for b in gone)
        assert all(client.exists(tier.block_key(b)) for b in kept)  # the new turn's and the prefix
        rm = tier.get_manifest("a")
        assert len(rm.branches) == 1 and not set(rm.block_ids) & set(gone)
        assert tier.stats()["blocks_deleted"] == len(gone)
    finally:
        if pool is not None:
            pool.close()
        redis_srv.stop()


def test_a_forget_leaves_its_removal_in_the_record_and_only_what_it_removed(model, tmp_path):
    """A forget that removes content keeps a removal record in the agent's record (what a merge with
    another server's older copy applies: chain.Removal), on disk across a restart; an older copy of
    the superseded branch is refused by it, a newer one (a client that sent the content again) is
    not. A forget that removes nothing (the prompt extends the history) changes nothing: no removal
    record and no write."""
    from vllm_mlx_persist.chain import surviving_removals

    pool = make_pool(model, tmp_path)
    head, span, tail = _history()
    _turn(pool, model, "a", head + span + tail, "r1")
    old = pool.agent("a").branches[-1]
    saves = pool.persister.counts["saves"]
    _turn(pool, model, "a", old_tokens(pool, old) + tokens(5, seed=9), "r0", edit=FORGET)  # extends: nothing removed
    assert pool.agent("a").removals == () and pool.stats["branches_superseded"] == 0
    assert pool.persister.counts["saves"] == saves + 1  # the turn's own save only
    old = pool.agent("a").branches[-1]
    _turn(pool, model, "a", head + tail, "r2", edit=FORGET)
    (removal,) = pool.agent("a").removals
    assert removal.block in old.block_ids and removal.removes(old, lambda b: None)
    assert surviving_removals([old], [removal], 0.0, lambda b: None) == []
    from dataclasses import replace
    newer = replace(old, last_used=removal.at + 1)  # sent again after the forget: stays
    assert surviving_removals([newer], [removal], 0.0, lambda b: None) == [newer]
    pool.flush()
    pool.close()
    again = make_pool(model, tmp_path)
    assert again.agent("a").removals == (removal,)
    again.close()


def old_tokens(pool, branch):
    """The tokens a branch holds (its blocks', read back)."""
    return [t for b in branch.block_ids for t in pool.store.read_block(b).tokens.tolist()]
