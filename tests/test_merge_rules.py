"""The merge rules and bounds that six defects once slipped past the whole suite (issue #44): each test
here fails with its defect injected (tests/mutants.py lists them) and passes without it.

- removal_older_wins:        two removal records of one block merged, the older one winning
- sync_ignores_cleared:      a fetched copy's spliced_cleared ignored by the sync's merge
- put_own_removals_only:     a put's merge applying its own removal records and not Redis's
- disk_touch_not_recency:    the disk index's recency not refreshed by a use (the budget erases in save order)
- budget_newest_dir_first:   the budget removing the newest of other models' directories first
- scaled_identity_by_shape:  a scaled key format's identity depending on its scales' shape, not their values

And five defects of the floor and the settings merge (issue #53), listed with their tests below.
"""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import numpy as np

from test_remote import TOKENS_PER_BLOCK, chain, manifest

from vllm_mlx_persist.chain import Branch, Copy, Removal, manifest_of, merge_records, merge_removals
from vllm_mlx_persist.disk_format import BlockData
from vllm_mlx_persist.store import DiskStore

FP = "cd" * 32
FMT = {"bits": 4, "group_size": 64, "block_size": TOKENS_PER_BLOCK}


def _id(i: int) -> str:
    return f"{i:064x}"


# ---- removal records of one block: the newer decides --------------------------------------------------


def test_two_removal_records_of_one_block_keep_the_newer():
    """removal_older_wins: of two records of one block the newer stays (in either order), and so a
    branch written between them (older than the newer removal) goes in a merge of the two copies."""
    old, new = Removal(_id(2), 1, _id(1), (), 10.0), Removal(_id(2), 1, _id(1), (), 20.0)
    assert merge_removals([old], [new], 32, 0.0) == (new,)
    assert merge_removals([new], [old], 32, 0.0) == (new,)
    between = Branch([_id(1), _id(2)], 2 * TOKENS_PER_BLOCK, ((0, "x"),), 15.0)
    kept = Branch([_id(1), _id(3)], 2 * TOKENS_PER_BLOCK, ((0, "x"),), 25.0)
    for a, b in ((Copy((kept,), (new,)), Copy((between,), (old,))), (Copy((between,), (old,)), Copy((kept,), (new,)))):
        got, removals, _, _ = merge_records([between, kept], a, b, 32, 0.0, lambda bid: None)
        assert got == [kept] and removals == (new,)


# ---- a put's merge in Redis applies Redis's removal records too -----------------------------------------


def test_a_puts_merge_applies_the_removal_records_redis_holds():
    """put_own_removals_only: Redis holds a record that removed block b; a put from a server that
    never saw the removal (its old branch names b, written before it) merges with it: b goes."""
    from vllm_mlx_persist.fleet.manifests import merged

    hist = chain(FP, "x", 3)
    ids = [b.block_id for b in hist]
    old = Branch(ids, 3 * TOKENS_PER_BLOCK, ((0, "x"),), 10.0)
    clean = Branch(ids[:2], 2 * TOKENS_PER_BLOCK, ((0, "x"),), 30.0)
    removal = Removal(ids[2], 2, ids[1], (), 20.0)
    theirs = manifest_of("x", [clean], False, 30.0, removals=[removal])
    put = manifest_of("x", [old], False, 10.0)
    m = merged(put, theirs, 4, False)
    assert m is None or ids[2] not in m.block_ids
    # ... and a put that carries the removal itself merges the same way (its own records apply too)
    m = merged(manifest_of("x", [clean], False, 30.0, removals=[removal]), manifest_of("x", [old], False, 10.0),
               4, False)
    assert m is not None and ids[2] not in m.block_ids


# ---- the sync's merge applies the fetched copy's spliced_cleared ----------------------------------------


def _pool(root: Path, **kw):
    from vllm_mlx_persist.pool import BlockPool

    pool = BlockPool(fingerprint=FP, n_layers=2, bits=4, group_size=64, block_size=TOKENS_PER_BLOCK,
                     hot_bytes=1 << 30, store=DiskStore(root, FP, {"test": True}, FMT), disk_budget=1 << 30, **kw)
    pool.load_manifests()
    return pool


def _save_fetched(pool, agent: str, copy: Copy, blocks: list[BlockData]) -> None:
    done = []
    fut = pool.fleet_view.save_fetched(agent, copy, blocks, pool.fleet_view.agent_version(agent), done.append)
    assert fut is not None and fut.result(30) and done and done[0] is not None


def test_the_sync_merge_applies_a_fetched_copys_spliced_cleared(tmp_path):
    """sync_ignores_cleared: the agent here holds a spliced branch; the fleet's copy of its record says
    a forget cleared spliced branches since (spliced_cleared): the merge drops the spliced branch."""
    hist = chain(FP, "x", 2)
    spliced_blocks = chain(FP, "x\0amortized:1", 1, seed=3, after=hist[0])
    ids = [b.block_id for b in hist]
    honest = Branch(ids, 2 * TOKENS_PER_BLOCK, ((0, "x"),), 10.0)
    spliced = Branch([ids[0], spliced_blocks[0].block_id], 2 * TOKENS_PER_BLOCK,
                     ((0, "x"), (1, "x\0amortized:1")), 11.0, (), 1)
    pool = _pool(tmp_path)
    try:
        _save_fetched(pool, "x", Copy((honest, spliced)), hist + spliced_blocks)
        assert [br.generation for br in pool.agent("x").branches] == [0, 1]
        later = Branch(ids, 2 * TOKENS_PER_BLOCK, ((0, "x"),), 13.0)
        copy = Copy((later,), (), 12.0)  # another server's forget cleared spliced histories at 12
        assert not pool.fleet_view.holds("x", pool.fleet_view.agent_version("x"), copy, lambda: None)
        _save_fetched(pool, "x", copy, [])
        assert [br.generation for br in pool.agent("x").branches] == [0]
        assert pool.agent("x").spliced_cleared == 12.0
    finally:
        pool.close()


# ---- the disk budget: recency of use, and other models' directories oldest first -----------------------


def _persister(root: Path, fp: str = FP, budget: int = 1 << 40, clock=None):
    from vllm_mlx_persist.persister import Persister

    kw = {"clock": clock} if clock is not None else {}
    p = Persister(DiskStore(root, fp, {"test": True}, FMT), disk_budget=budget, **kw)
    p.load()
    p.flush(30)
    return p


def test_a_use_refreshes_an_agents_disk_recency(tmp_path):
    """disk_touch_not_recency: agents a, b, c saved in that order, then a used: over budget, b (the
    least recently used) goes, not a (the first saved)."""
    now = [1000.0]
    p = _persister(tmp_path, clock=lambda: now[0])
    try:
        for i, agent in enumerate("abc"):
            now[0] += 1
            blocks = chain(FP, agent, 1, seed=i)
            assert p.save(manifest(agent, blocks), blocks, [], lambda: None).result(30)
        now[0] += 1
        p.touch("a")
        p.flush(30)
        p.budget.disk_budget = p.index.disk_bytes(0)  # full: one more agent is over
        now[0] += 1
        d = chain(FP, "d", 1, seed=9)
        assert p.save(manifest("d", d), d, [], lambda: None).result(30)
        assert p.store.read_manifest("b") is None, "the budget did not erase the least recently used agent"
        assert p.store.read_manifest("a") is not None
    finally:
        p.close()


def test_the_budget_removes_the_oldest_of_other_models_directories_first(tmp_path):
    """budget_newest_dir_first: two other models' directories under the root, one last written long
    ago: over budget by less than one directory, the old one goes and the recent one stays."""
    dirs = {}
    for fp, when in (("11" * 32, 1_000_000.0), ("22" * 32, 2_000_000.0)):
        store = DiskStore(tmp_path, fp, {"test": True}, FMT)
        blocks = chain(fp, "y", 2)
        for b in blocks:
            store.write_block(b)
        store.write_manifest(manifest("y", blocks))
        for path, _, files in os.walk(store.dir):
            for f in files:
                os.utime(os.path.join(path, f), (when, when))
        dirs[when] = store.dir
    size = sum(f.stat().st_size for f in dirs[1_000_000.0].rglob("*") if f.is_file())
    p = _persister(tmp_path)
    total = p.index.disk_bytes(0)
    p.close()
    p = _persister(tmp_path, budget=total - size // 2)
    try:
        assert p.counts["other_dirs_removed"] == 1
        assert not dirs[1_000_000.0].exists(), "the budget removed another directory than the oldest"
        assert dirs[2_000_000.0].exists()
    finally:
        p.close()


# ---- a scaled key format's identity is its scales' values -----------------------------------------------


def test_a_scaled_key_formats_identity_is_its_scales_values():
    """scaled_identity_by_shape: two scaled formats with scales of one shape but other values are
    different formats (blocks written under one must never be read under the other)."""
    from vllm_mlx_persist.caches.key_formats import LayerKeys
    from vllm_mlx_persist.key_calibration import identity

    rng = np.random.default_rng(0)
    a = mx.array(rng.uniform(0.5, 2.0, (2, 1, 64)).astype(np.float32))
    b = mx.array(rng.uniform(0.5, 2.0, (2, 1, 64)).astype(np.float32))
    fa, fb, fa2 = LayerKeys(4, "scaled", a), LayerKeys(4, "scaled", b), LayerKeys(4, "scaled", mx.array(a))
    assert fa.digest() != fb.digest() and fa.digest() == fa2.digest()
    assert identity([None, fa]) != identity([None, fb]) and identity([None, fa]) == identity([None, fa2])


# ---- issue #53: the floor, the settings merge and their stamps -------------------------------------------
#
# - sync_ignores_local_floor:  a sync's merge ignoring the local record's removed_floor
# - put_takes_put_pin:         a put's merge taking the put's pin instead of the merged one
# - differ_values_only:        record_settings.differ comparing values and not their stamps
# - load_drops_settings_at:    Records.load dropping settings_at
# - floor_by_last_used:        chain.above_floor comparing last_used instead of written


def test_the_sync_merge_applies_the_local_records_floor(tmp_path):
    """sync_ignores_local_floor: the record here compacted removal records into a floor (20); the
    fleet's copy, from a server that never saw them, holds a branch written before the floor that
    this record does not hold: the sync's merge drops it and keeps the floor."""
    hist = chain(FP, "x", 3)
    alt = chain(FP, "x", 1, seed=3, after=hist[0])
    ids = [b.block_id for b in hist]
    mine = Branch([ids[0], alt[0].block_id], 2 * TOKENS_PER_BLOCK, ((0, "x"),), 30.0)
    old = Branch(ids, 3 * TOKENS_PER_BLOCK, ((0, "x"),), 10.0)
    pool = _pool(tmp_path)
    try:
        _save_fetched(pool, "x", Copy((mine,), removed_floor=20.0), [hist[0], alt[0]])
        assert pool.agent("x").removed_floor == 20.0
        _save_fetched(pool, "x", Copy((old,)), hist)
        rec = pool.agent("x")
        assert [br.block_ids for br in rec.branches] == [mine.block_ids], "the sync kept a branch below the floor"
        assert rec.removed_floor == 20.0
    finally:
        pool.close()


def test_a_puts_merge_keeps_the_merged_pin():
    """put_takes_put_pin: Redis's record was pinned at 20; a put whose record was unpinned earlier (10)
    merges with it: the merged record is pinned, its pin's time 20 (the latest setting wins)."""
    from vllm_mlx_persist.fleet.manifests import merged

    hist = chain(FP, "x", 3)
    ids = [b.block_id for b in hist]
    theirs = manifest_of("x", [Branch(ids[:2], 2 * TOKENS_PER_BLOCK, ((0, "x"),), 30.0)], True, 30.0,
                         settings_at={"pinned": 20.0})
    put = manifest_of("x", [Branch(ids, 3 * TOKENS_PER_BLOCK, ((0, "x"),), 40.0)], False, 40.0,
                      settings_at={"pinned": 10.0})
    m = merged(put, theirs, 4, False)
    assert m is not None and m.pinned is True and m.settings_at["pinned"] == 20.0, "the put's older unpin won"
    # the other way round: the put's later unpin wins over Redis's earlier pin
    m = merged(manifest_of("x", [Branch(ids, 3 * TOKENS_PER_BLOCK, ((0, "x"),), 40.0)], False, 40.0,
                           settings_at={"pinned": 25.0}), theirs, 4, False)
    assert m is not None and m.pinned is False and m.settings_at["pinned"] == 25.0


def test_a_setting_set_again_to_its_value_is_published_with_its_new_time():
    """differ_values_only: Redis holds a refusal set at 10; a server refuses again at 20 (the same value,
    a later decision) and puts the same branches: the merge must publish it (a grant made at 15 on a
    third server must lose to it), not find the put 'the same' because the values agree."""
    from vllm_mlx_persist.fleet.manifests import merged
    from vllm_mlx_persist.record_settings import differ, merge_records_settings, merge_settings

    ids = [b.block_id for b in chain(FP, "x", 2)]
    br = Branch(ids, 2 * TOKENS_PER_BLOCK, ((0, "x"),), 30.0)
    theirs = manifest_of("x", [br], False, 30.0, forkable=False, settings_at={"forkable": 10.0})
    put = manifest_of("x", [br], False, 30.0, forkable=False, settings_at={"forkable": 20.0})
    assert differ(*merge_records_settings(put, theirs), theirs)
    m = merged(put, theirs, 4, False)
    assert m is not None and m.settings_at["forkable"] == 20.0, "the later refusal was not published"
    values, _ = merge_settings({"forkable": False}, m.settings_at, {"forkable": True}, {"forkable": 15.0})
    assert values["forkable"] is False


def test_an_agents_setting_times_survive_a_restart(tmp_path):
    """load_drops_settings_at: a refusal set here (stamped) is read back from disk with its time, so a
    grant stamped before it on another server still loses to it after a restart."""
    from vllm_mlx_persist.record_settings import merge_records_settings

    hist = chain(FP, "x", 2)
    br = Branch([b.block_id for b in hist], 2 * TOKENS_PER_BLOCK, ((0, "x"),), 10.0)
    pool = _pool(tmp_path, clock=lambda: 100.0)
    try:
        _save_fetched(pool, "x", Copy((br,)), hist)
        assert pool.set_forkable("x", False)
        at = dict(pool.agent("x").settings_at)
        assert at["forkable"] >= 100.0
    finally:
        pool.close()
    pool = _pool(tmp_path, clock=lambda: 100.0)
    try:
        rec = pool.agent("x")
        assert rec.settings_at == at, "the setting's time was lost across the restart"
        grant = Copy((br,), forkable=True, settings_at={"forkable": 50.0})
        values, _ = merge_records_settings(rec, grant)
        assert values["forkable"] is False
    finally:
        pool.close()


def test_the_floor_compares_when_content_was_written_not_used():
    """floor_by_last_used: a branch written before the floor (10 < 20) and served since (used at 30)
    still holds what the compacted records removed: the floor removes it; one written after it stays."""
    from vllm_mlx_persist.chain import above_floor

    ids = [b.block_id for b in chain(FP, "x", 3)]
    old = Branch(ids, 3 * TOKENS_PER_BLOCK, ((0, "x"),), 10.0).used(30.0)
    again = Branch(ids, 3 * TOKENS_PER_BLOCK, ((0, "x"),), 25.0)
    assert above_floor([old], 20.0, []) == []
    assert above_floor([again], 20.0, []) == [again]
    got, _, _, floor = merge_records([old], Copy(()), Copy((), removed_floor=20.0), 32, 0.0, lambda b: None)
    assert got == [] and floor == 20.0


def test_settings_are_stamped_after_the_records_stamps(tmp_path):
    """A decision made on a clock stepped back is still the later one: a grant after a refusal (the
    clock stepped from 100 back to 50) is stamped after the refusal and wins a merge with a copy that
    holds the refusal; and so is an unpin after a pin."""
    from vllm_mlx_persist.record_settings import merge_records_settings

    now = [100.0]
    hist = chain(FP, "x", 2)
    br = Branch([b.block_id for b in hist], 2 * TOKENS_PER_BLOCK, ((0, "x"),), 90.0)
    pool = _pool(tmp_path, clock=lambda: now[0])
    try:
        _save_fetched(pool, "x", Copy((br,)), hist)
        assert pool.set_forkable("x", False) and pool.set_pinned("x", True)
        refusal = Copy((br,), forkable=False, pinned=True, settings_at=dict(pool.agent("x").settings_at))
        now[0] = 50.0
        assert pool.set_forkable("x", True) and pool.set_pinned("x", False)
        rec = pool.agent("x")
        assert all(rec.settings_at[k] > refusal.settings_at[k] for k in ("forkable", "pinned"))
        values, _ = merge_records_settings(rec, refusal)
        assert values == {"forkable": True, "pinned": False}
    finally:
        pool.close()
