"""Features used together, in the pool and its persister on real MLX (a tiny llama): each test is a
defect found when forks, budgets, restarts, erasure, the fleet and slow disks met, kept as a
regression. End to end, through real servers: tests/test_e2e_interactions.py; every operation at
random: tests/test_state_machine.py.

Tolerances: reused K/V is compared bit for bit with what was stored (assert_same_cache). Nothing here
depends on the machine's speed: a slow disk is a gate that holds the store's I/O until the test opens
it, so "does not wait for the disk" is proven by the call returning while the I/O is held (a call that
waited would wait forever: `within`'s generous deadline only turns that hang into a failure).
"""

from __future__ import annotations

import dataclasses
import threading

import pytest

from vllm_mlx_persist import faults, lookup as lookup_mod, store as store_mod
from vllm_mlx_persist.disk_format import manifest_name
from vllm_mlx_persist.identity import model_fingerprint
from vllm_mlx_persist.pool import BlockPool
from vllm_mlx_persist.store import DiskStore
from vllm_mlx_persist.tools.models.build import build_model
from test_pool import BITS, BLOCK, GROUP, assert_same_cache, prefill, tokens


@pytest.fixture(scope="module")
def model():
    m, _ = build_model("llama", "tiny", seed=0)
    return m


def make(model, root, *, hot_bytes=1 << 30, disk_budget=1 << 40, fingerprint=None, **kw) -> BlockPool:
    fmt = {"bits": BITS, "group_size": GROUP, "block_size": BLOCK}
    fp = fingerprint or model_fingerprint(model, None, fmt)
    pool = BlockPool(fingerprint=fp, n_layers=len(model.layers), bits=BITS, group_size=GROUP, block_size=BLOCK,
                     hot_bytes=hot_bytes, store=DiskStore(root, fp, {"test": True}, fmt), disk_budget=disk_budget, **kw)
    pool.load_manifests()
    return pool


def serve(pool, model, agent, seq, fork_from=None, request_id=None):
    """One request: lookup, prefill what is new, commit (durably); returns the tokens reused."""
    hit, n, _ = pool.lookup(agent, seq, request_id=request_id, fork_from=fork_from)
    cache, _ = prefill(model, seq[n:], hit) if n else prefill(model, seq)
    assert pool.commit(agent, seq, cache, request_id=request_id, fork_from=fork_from) == len(seq)
    if request_id is not None:
        pool.finish(request_id)
    return n


def within(seconds: float, fn, *args):
    """fn(*args) on a thread, which must return within `seconds` (a hang fails the test, never hangs it)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} did not return within {seconds} s"
    return out[0] if out else None


HANG_S = 30.0  # a deadline that only turns a hang into a failure: a call under test returns in milliseconds


class DiskGate:
    """A store fault hook (store._FAULT): every thread that reaches one of `steps` waits there until
    `open()`. `held` is set when the first one arrives; `arrived` counts them."""

    def __init__(self, steps: str):
        self.steps = frozenset(steps.split(","))
        assert self.steps <= set(faults.STEPS), steps
        self.held = threading.Event()
        self.arrived = 0
        self._open = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, step: str) -> None:
        if step not in self.steps or self._open.is_set():
            return
        with self._lock:
            self.arrived += 1
        self.held.set()
        self._open.wait(HANG_S)

    def open(self) -> None:
        self._open.set()


@pytest.fixture
def disk_gate(monkeypatch):
    """disk_gate("write"): install a DiskGate on those steps; opened at the test's end whatever happens."""
    gates: list[DiskGate] = []

    def install(steps: str) -> DiskGate:
        gates.append(DiskGate(steps))
        monkeypatch.setattr(store_mod, "_FAULT", gates[-1])
        return gates[-1]
    yield install
    for g in gates:
        g.open()


def test_a_fork_after_a_restart_under_a_hot_budget_neither_hangs_nor_fails(model, tmp_path):
    """A child with a history of its own asks again naming its parent after a restart: the parent's
    blocks it reads (its partial tail, which the child's own branch lacks) are counted by the parent,
    which names them, so evicting the child empties it and the budget loop ends (before: the child
    kept bytes it did not name, was picked forever with the pool's lock held: the server hung).
    The child's first request after the restart under a full hot tier gets the parent's prefix (before:
    `'NoneType' object is not subscriptable` once the budget evicted the parent's blocks in use)."""
    doc = tokens(70)  # 4 whole blocks and a partial tail
    pool = make(model, tmp_path)
    serve(pool, model, "parent", doc)
    child_own = doc[:64] + tokens(40, seed=1)  # shares the whole blocks, not the tail
    serve(pool, model, "child", child_own, fork_from="parent")
    serve(pool, model, "other", tokens(60, seed=2))
    stored = pool.lookup("parent", doc + [1])[0]
    pool.close()

    one_block = sum(a.nbytes for c in prefill(model, doc[:BLOCK])[0] for part in c.to_arrays() for a in part)
    pool = make(model, tmp_path, hot_bytes=2 * one_block)  # far less than one agent
    hit, n, tier = within(20, pool.lookup, "child", doc + tokens(5, seed=3), None, "parent")
    assert (n, tier) == (70, "disk")  # the parent's tail too: longer than the child's own 64
    assert_same_cache(hit, stored)
    assert pool.check() == []
    within(20, serve, pool, model, "other", tokens(60, seed=2) + [7, 8])  # evicts the child: must end
    within(20, serve, pool, model, "child", doc + tokens(9, seed=4), "parent")
    assert pool.check() == []
    pool.close()


def test_a_disk_budget_erasure_spares_blocks_a_queued_save_names(model, tmp_path, disk_gate):
    """The parent is the least recently used agent when another agent's save pushes the disk over
    budget, while its fork child's save (naming the parent's blocks) is still queued: the parent goes,
    its blocks stay for the child's manifest (before: deleted, and the child's acknowledged turn
    reused nothing after a restart)."""
    doc = tokens(64)
    probe = make(model, tmp_path / "probe")
    serve(probe, model, "x", doc)
    probe.flush()
    one = probe.snapshot()["disk_bytes"]
    probe.close()

    pool = make(model, tmp_path / "root", disk_budget=int(one * 1.5))
    serve(pool, model, "parent", doc)
    pool.flush()
    gate = disk_gate("write")
    big = tokens(64, seed=5)
    _, f_big = pool.commit_async("big", big, prefill(model, big)[0])
    assert gate.held.wait(HANG_S)  # the writer is inside big's save: the child's queues behind it
    child = doc + tokens(20, seed=6)
    hit, n, _ = pool.lookup("child", child, fork_from="parent")
    assert n == 64
    cache, _ = prefill(model, child[n:], hit)
    n_child, f_child = pool.commit_async("child", child, cache, fork_from="parent")
    assert not f_child.done()
    gate.open()
    assert f_big.result(30) and f_child.result(30)
    pool.flush()
    s = pool.snapshot()
    assert s["budget_erasures"] >= 1 and pool.agent("parent") is None  # the budget did erase the parent
    pool.close()

    restarted = make(model, tmp_path / "root", disk_budget=int(one * 1.5))
    assert restarted.lookup("child", child + [1])[1] == len(child)  # every block of its manifest is there
    restarted.close()


def test_pinned_agents_are_never_erased_by_the_disk_budget(model, tmp_path):
    pool = make(model, tmp_path, disk_budget=1)  # nothing fits
    serve(pool, model, "keep", tokens(40))
    assert pool.set_pinned("keep", True)
    for i in range(3):
        serve(pool, model, f"a{i}", tokens(40, seed=i + 1))
    pool.flush()
    s = pool.snapshot()
    assert pool.agent("keep") is not None and pool.persister.disk_agent("keep") is not None
    assert s["budget_blocked"] >= 1 and s["disk_bytes"] > s["disk_budget_bytes"]  # over budget, said so
    pool.close()
    restarted = make(model, tmp_path, disk_budget=1)
    assert restarted.lookup("keep", tokens(40) + [1])[1] == 40
    restarted.close()


def test_quarantined_files_count_in_the_disk_budget_and_go_first(model, tmp_path):
    pool = make(model, tmp_path)
    serve(pool, model, "a", tokens(40))
    pool.flush()
    before = pool.snapshot()["disk_bytes"]
    junk = dataclasses.replace(pool.store.read_block(pool.agent("a").block_ids[0]), block_id="ab" * 32)
    size = pool.store.write_block(junk)
    pool.store.quarantine_block(junk.block_id, "test")
    assert pool.snapshot()["disk_bytes"] == before + size  # moved aside, still counted
    pool.persister.budget.disk_budget = before  # the next turn's blocks put it over
    serve(pool, model, "a", tokens(40) + tokens(20, seed=1))
    pool.flush()
    s = pool.snapshot()
    assert s["quarantine_removed"] == 1 and pool.store.quarantine.bytes == 0  # reclaimed first
    assert s["budget_erasures"] == 0 and pool.agent("a") is not None  # the agent in use is never erased
    pool.close()


def test_erasure_reaches_every_model_directory_under_the_root(model, tmp_path):
    """An agent used with two models (or two cache formats) under one root: erasing it through the
    server of one removes its manifest and the blocks only it names under the other too."""
    other = make(model, tmp_path, fingerprint="f" * 64)
    serve(other, model, "a", tokens(40))
    serve(other, model, "b", tokens(40, seed=1))
    other.flush()
    other_dir = other.store.dir
    a_blocks = set(other.agent("a").ids)
    other.close()

    pool = make(model, tmp_path)
    serve(pool, model, "a", tokens(40))
    assert pool.erase("a")
    assert not (other_dir / "agents" / manifest_name("a")).exists()
    assert not any((other_dir / "blocks" / b[:2] / f"{b}.safetensors").exists() for b in a_blocks)
    assert pool.snapshot()["erased_elsewhere"] == 1
    pool.close()
    again = make(model, tmp_path, fingerprint="f" * 64)
    assert again.lookup("a", tokens(40) + [1])[1] == 0 and again.lookup("b", tokens(40, seed=1) + [1])[1] == 40
    again.close()


def test_a_fleet_sync_that_read_an_agent_before_its_erasure_is_refused(model, tmp_path):
    """An erasure racing a fleet sync of the agent (unknown here: the state check compared None with
    None and the fetched history came back after the 200)."""
    pool = make(model, tmp_path)
    expect = pool.fleet_view.agent_version("x")
    assert pool.erase("x") is False
    assert pool.fleet_view.save_fetched("x", [], [], expect, lambda m: None) is None
    pool.close()


def test_nothing_waits_for_a_slow_disk_behind_the_pools_lock(model, tmp_path, disk_gate, monkeypatch):
    """A lookup reading an agent's blocks from a slow disk holds no lock meanwhile: the event loop's
    calls (read-ahead, readiness), the admin API's and the stats answer at once (before: behind the
    read, up to 30 s). The disk here never answers until every call has: one that waited behind the
    read would never return."""
    pool = make(model, tmp_path)
    seq = tokens(70)
    serve(pool, model, "a", seq)
    serve(pool, model, "b", tokens(40, seed=1))
    pool.close()
    pool = make(model, tmp_path)
    gate = disk_gate("read")
    waiting = threading.Event()  # the lookup has started waiting for a block read
    read_result = lookup_mod.read_result

    def observed_read_result(future, timeout):
        waiting.set()
        return read_result(future, timeout)

    monkeypatch.setattr(lookup_mod, "read_result", observed_read_result)
    found: list = []
    worker = threading.Thread(target=lambda: found.append(pool.lookup("a", seq + [1])), daemon=True)
    worker.start()
    assert waiting.wait(HANG_S) and gate.held.wait(HANG_S)  # the lookup waits for a read the disk holds
    for call, args in ((pool.prefetch, ("b",)), (pool.pending_reads, (["a"],)), (pool.agent_info, ("b",)),
                       (pool.list_agents, (10,)), (pool.snapshot, ()), (pool.fleet_view.agent_version, ("a",))):
        within(HANG_S, call, *args)
    assert worker.is_alive() and not found  # it was still reading throughout
    gate.open()
    worker.join(HANG_S)
    assert found and found[0][1] == len(seq)  # and then got its whole history
    pool.close()


def test_a_full_write_queue_never_makes_the_worker_wait(model, tmp_path, disk_gate):
    """Back-pressure is off the worker: a turn that finds the write queue full is dropped from it at
    once (counted), its blocks stay unsaved in memory, and the agent's next save writes them."""
    pool = make(model, tmp_path, persister_options={"queue_bytes": 1})
    gate = disk_gate("write")
    first = tokens(40)
    _, f1 = pool.commit_async("a", first, prefill(model, first)[0])
    assert gate.held.wait(HANG_S)  # the writer is inside a's save, and stays there: the queue is full
    other = tokens(40, seed=1)
    cache_b = prefill(model, other)[0]
    _, f2 = within(HANG_S, pool.commit_async, "b", other, cache_b)  # returns while the disk is held
    assert f2.result(0) is False  # not waited for: dropped
    gate.open()
    assert f1.result(30)
    hit, n, _ = pool.lookup("b", other + [2])
    assert n == 40  # still in memory
    grown = other + [2, 3]
    cache, _ = prefill(model, grown[n:], hit)
    assert pool.commit("b", grown, cache) == len(grown)
    pool.flush()
    pool.close()
    restarted = make(model, tmp_path)
    assert restarted.lookup("b", grown + [4])[1] == len(grown)  # the dropped turn's blocks were written
    restarted.close()


def test_read_ahead_holds_at_most_its_byte_budget(model, tmp_path):
    pool = make(model, tmp_path)
    seq = tokens(16 * BLOCK)
    serve(pool, model, "a", seq)
    pool.flush()
    one = pool.persister.block_size_of(pool.agent("a").block_ids[0])
    pool.close()
    pool = make(model, tmp_path, read_ahead_bytes=3 * one)
    pool.flush()  # the disk index knows the block sizes
    assert pool.prefetch("a") == 3
    s = pool.snapshot()
    assert s["prefetch_bytes"] <= 3 * one and s["read_ahead_over_budget"] == 1
    hit, n, _ = pool.lookup("a", seq + [1])
    assert n == len(seq)  # the lookup reads the rest itself, a budget at a time
    assert pool.check() == []
    pool.close()


def test_commit_plans_again_when_an_erasure_lands_between_plan_and_install(model, tmp_path):
    """The commit's MLX work runs without the lock; an erasure of the fork parent meanwhile (the
    admin API's thread) removes blocks the plan kept by reference: the commit plans again and slices
    them from its own cache, so the child's history is whole after a restart."""
    pool = make(model, tmp_path)
    doc = tokens(64)
    serve(pool, model, "parent", doc)
    child = doc + tokens(20, seed=1)
    hit, n, _ = pool.lookup("child", child, fork_from="parent")
    cache, _ = prefill(model, child[n:], hit)
    build = pool.committer.build

    def erase_then_build(plan, c):
        if not getattr(erase_then_build, "done", False):
            erase_then_build.done = True
            eraser = threading.Thread(target=pool.erase, args=("parent",))  # the admin API's thread
            eraser.start()
            eraser.join(HANG_S)  # the erasure has landed, in memory and on disk
            assert not eraser.is_alive()
        return build(plan, c)

    pool.committer.build = erase_then_build
    assert pool.commit("child", child, cache, fork_from="parent") == len(child)
    assert pool.stats["commit_replans"] == 1 and pool.check() == []
    pool.flush()
    pool.close()
    restarted = make(model, tmp_path)
    got, n, _ = restarted.lookup("child", child + [1])
    assert n == len(child)
    assert_same_cache(got, cache)
    restarted.close()


def test_a_turn_whose_save_is_queued_survives_its_agents_eviction(model, tmp_path, disk_gate):
    """Another agent's request evicts an agent whose turn is still being written: its unsaved blocks
    stay in memory until the save is durable (before: cut from its branches, so the acknowledged turn
    was not reused until a restart read its manifest). Found by the interactions campaign."""
    seq = tokens(70)
    one = sum(a.nbytes for c in prefill(model, seq)[0] for part in c.to_arrays() for a in part)
    pool = make(model, tmp_path, hot_bytes=one // 2)
    gate = disk_gate("fsync")
    _, saved = pool.commit_async("a", seq, prefill(model, seq)[0])
    assert gate.held.wait(HANG_S)  # a's save is being written
    other = tokens(40, seed=1)
    pool.commit_async("b", other, prefill(model, other)[0])  # over budget: "a" is evicted, its save queued
    assert not saved.done()
    gate.open()
    assert saved.result(30)
    assert pool.lookup("a", seq + [1])[1] == len(seq)  # no restart needed
    assert pool.check() == []
    pool.close()


def test_unpinning_an_agent_brings_the_hot_tier_back_within_its_budget(model, tmp_path):
    """A pin holds an agent in memory past hot_mb; unpinning it enforces the budget at once, not
    at some later request (found by the state_machine campaign, seed 30)."""
    probe = make(model, tmp_path / "probe")
    serve(probe, model, "x", tokens(4 * BLOCK, 0))
    one = probe.hot_bytes
    probe.close()
    pool = make(model, tmp_path / "cache", hot_bytes=int(1.5 * one))
    try:
        serve(pool, model, "a", tokens(4 * BLOCK, 1))
        assert pool.set_pinned("a", True)
        serve(pool, model, "b", tokens(4 * BLOCK, 2))
        assert pool.hot_bytes > pool.hot_budget  # the pin keeps a; b is the request's own agent
        assert pool.set_pinned("a", False)
        assert pool.hot_bytes <= pool.hot_budget
        assert pool.check() == []
    finally:
        pool.close()
