"""A server that runs for months, at pool level on real MLX: disk budget, TTL, pinning, erasure,
bounded memory on a failing disk, refusal of caches that do not cover their tokens, O(1) stats."""

from __future__ import annotations

import errno
import threading
import time

import mlx.core as mx
import pytest

from test_pool import BITS, BLOCK, GROUP, assert_same_cache, prefill, tokens
from vllm_mlx_persist.identity import model_fingerprint
from vllm_mlx_persist.tools.models.build import build_model
from vllm_mlx_persist.pool import BlockPool, BlockState
from vllm_mlx_persist.disk_format import Manifest
from vllm_mlx_persist.store import DiskStore, StoreWriteError


@pytest.fixture(scope="module")
def model():
    m, _ = build_model("llama", "tiny", seed=0)
    return m


def budget_pool(model, root, *, disk_budget=1 << 40, hot_bytes=1 << 30, ttl_s=None, retry_delays=(0.2, 0.2)):
    fmt = {"bits": BITS, "group_size": GROUP, "block_size": BLOCK}
    fp = model_fingerprint(model, None, fmt)
    store = DiskStore(root, fp, {"test": True}, fmt)
    pool = BlockPool(fingerprint=fp, n_layers=len(model.layers), bits=BITS, group_size=GROUP,
                     block_size=BLOCK, hot_bytes=hot_bytes, store=store, disk_budget=disk_budget,
                     persister_options={"ttl_s": ttl_s, "retry_delays": retry_delays})
    pool.load_manifests()
    return pool


def files_naming(root, agent_id: str) -> list:
    """Every file under root holding `agent_id` as a JSON string (ids are stored in manifests only)."""
    needle = f'"{agent_id}"'.encode()
    return [p for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


def wait_until(cond, what: str, timeout: float = 30.0) -> None:
    """Poll `cond` until true; the deadline only turns a hang into a failure (it is met in milliseconds)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.01)


def agent_bytes_on_disk(model, tmp_path) -> int:
    pool = budget_pool(model, tmp_path / "probe")
    seq = tokens(40)
    pool.commit("probe", seq, prefill(model, seq)[0])
    pool.flush()
    n = pool.snapshot()["disk_bytes"]
    pool.close()
    return n


def test_disk_bytes_count_every_manifest_at_its_size(model, tmp_path):
    """The budget's disk_bytes is the files' bytes: a branching agent's manifest (every branch's block
    ids) is ~10 kB on the tiny model; counted at a fixed 1 kB, a disk of small blocks passed its
    budget (the interactions campaign's disk-over). Through saves, a pin's rewrite, an erasure, a restart."""
    root = tmp_path / "root"

    def files() -> int:
        return sum(f.stat().st_size for d in ("agents", "blocks") for f in root.glob(f"*/{d}/**/*") if f.is_file())

    pool = budget_pool(model, root)
    for name, n_branches in (("wide", 6), ("narrow", 1), ("other", 3)):
        base = tokens(64, seed=len(name))
        for i in range(n_branches):  # branches share the first 48 tokens
            seq = base[:48] + tokens(40, seed=100 + i)
            pool.commit(name, seq, prefill(model, seq)[0])
    pool.flush()
    assert pool.snapshot()["disk_bytes"] == files()
    assert pool.set_pinned("wide", True)
    pool.flush()
    assert pool.snapshot()["disk_bytes"] == files()
    assert pool.erase("other")
    pool.flush()
    assert pool.snapshot()["disk_bytes"] == files()
    pool.close()
    restarted = budget_pool(model, root)
    restarted.flush()
    assert restarted.snapshot()["disk_bytes"] == files()
    restarted.close()


def test_start_up_counts_manifests_as_read_not_encoded_again(model, tmp_path, monkeypatch):
    """A restart indexes each manifest at the size of the file it read: encoding every manifest again
    (a JSON dump and a sha256 per agent) cost ~1 s per 10,000 agents of start-up."""
    from vllm_mlx_persist import disk_index

    root = tmp_path / "root"
    pool = budget_pool(model, root)
    for i in range(3):
        seq = tokens(40, seed=i)
        pool.commit(f"a{i}", seq, prefill(model, seq)[0])
    pool.flush()
    before = pool.snapshot()["disk_bytes"]
    pool.close()

    def no_encoding(m):
        raise AssertionError(f"start-up encoded {m.namespace}'s manifest again")

    monkeypatch.setattr(disk_index, "encode_manifest", no_encoding)
    restarted = budget_pool(model, root)
    restarted.flush()
    assert restarted.snapshot()["disk_bytes"] == before
    restarted.close()


def test_disk_budget_holds_across_many_agents_and_keeps_the_recent_ones(model, tmp_path):
    one = agent_bytes_on_disk(model, tmp_path)
    budget = one * 8 + one // 2  # room for 8 agents
    root = tmp_path / "root"
    pool = budget_pool(model, root, disk_budget=budget, hot_bytes=one)
    seqs = {f"agent-{i}": tokens(40, seed=i) for i in range(32)}
    for name, seq in seqs.items():
        pool.commit(name, seq, prefill(model, seq)[0])
        pool.flush()
        assert pool.snapshot()["disk_bytes"] <= budget
    stats = pool.snapshot()
    assert stats["budget_erasures"] >= 24 and stats["disk_agents"] <= 8
    on_disk = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    assert on_disk <= budget + 4096  # counters agree with the disk (model.json and .lock aside)
    assert not files_naming(root, "agent-0") and not files_naming(root, "agent-3")
    pool.close()

    restarted = budget_pool(model, root, disk_budget=budget, hot_bytes=one)  # as after a crash: disk only
    for name in ("agent-31", "agent-30", "agent-25"):
        hit, n, tier = restarted.lookup(name, seqs[name] + [1])
        assert (n, tier) == (40, "disk")
    assert restarted.lookup("agent-0", seqs["agent-0"] + [1])[1] == 0
    restarted.close()


def test_pinned_agents_are_erased_last_and_never_evicted_from_memory(model, tmp_path):
    one = agent_bytes_on_disk(model, tmp_path)
    pool = budget_pool(model, tmp_path / "root", disk_budget=one * 3 + one // 2, hot_bytes=one)
    seqs = {f"a{i}": tokens(40, seed=i) for i in range(6)}
    pool.commit("a0", seqs["a0"], prefill(model, seqs["a0"])[0])
    assert pool.set_pinned("a0", True) and not pool.set_pinned("nobody", True)
    for name in list(seqs)[1:]:
        pool.commit(name, seqs[name], prefill(model, seqs[name])[0])
        pool.flush()
    assert pool.agent_info("a0")["pinned"] and pool.agent_info("a0")["tier"] == "hot"
    assert pool.lookup("a0", seqs["a0"] + [1])[2] == "hot"  # the oldest, yet neither evicted nor erased
    assert pool.agent_info("a1") is None  # the oldest unpinned agent went instead
    pool.close()
    again = budget_pool(model, tmp_path / "root")
    assert again.agent_info("a0")["pinned"]  # the pin is in the manifest: it survives a restart
    again.close()


def test_ttl_erases_unused_agents(model, tmp_path):
    pool = budget_pool(model, tmp_path, ttl_s=3600)
    for name in ("old", "new"):
        seq = tokens(20, seed=len(name))
        pool.commit(name, seq, prefill(model, seq)[0])
    pool.flush()
    with pool.persister._cv:  # as if "old" was last used two hours ago
        pool.persister.index.agents["old"].last_used -= 7200
    pool.persister.budget.sweep()
    assert pool.agent_info("old") is None and pool.agent_info("new") is not None
    assert not files_naming(tmp_path, "old") and pool.snapshot()["ttl_erasures"] == 1
    pool.close()


def test_erase_leaves_no_file_naming_the_agent_and_spares_the_others(model, tmp_path):
    pool = budget_pool(model, tmp_path)
    a, b = tokens(40, seed=1), tokens(40, seed=2)
    pool.commit("secret-agent", a, prefill(model, a)[0])
    pool.commit("other", b, prefill(model, b)[0])
    pool.flush()
    blocks_before = set(tmp_path.rglob("*.safetensors"))
    assert files_naming(tmp_path, "secret-agent")
    assert pool.erase("secret-agent") and not pool.erase("secret-agent")
    assert not files_naming(tmp_path, "secret-agent")
    assert len(set(tmp_path.rglob("*.safetensors"))) == len(blocks_before) - 3  # its 3 blocks, nothing else
    assert pool.lookup("secret-agent", a + [1])[1] == 0
    assert pool.lookup("other", b + [1])[1] == 40
    pool.close()
    assert budget_pool(model, tmp_path).lookup("secret-agent", a + [1])[1] == 0


def test_erasure_during_a_request_is_not_undone_by_its_store(model, tmp_path):
    pool = budget_pool(model, tmp_path)
    seq = tokens(30)
    pool.commit("a", seq, prefill(model, seq)[0])
    hit, n, _ = pool.lookup("a", seq + [5, 6], request_id="r1")  # a request in flight
    cache, _ = prefill(model, [5, 6], hit)
    assert pool.erase("a")
    assert pool.commit("a", seq + [5, 6], cache, request_id="r1") == 0
    pool.finish("r1")
    pool.flush()
    assert pool.agent_info("a") is None and not files_naming(tmp_path, "a")
    pool.close()


def test_a_cache_is_never_stored_under_tokens_it_does_not_cover(model, tmp_path):
    pool = budget_pool(model, tmp_path)
    seq = tokens(30)
    cache, _ = prefill(model, seq)
    # vllm-mlx's recovery re-runs a request from its prompt but keeps its old output ids: the
    # cache then covers fewer tokens than it is stored under.
    assert pool.commit("a", seq + tokens(5, seed=9), cache) == 0
    assert pool.snapshot()["store_refused"] == 1 and pool.agent_info("a") is None
    assert pool.commit("a", seq + [7], cache) == 30  # one more: the last generated token, never fed
    pool.close()


class FailingWrites:
    """Injects ENOSPC into the store's block writes while `failing` is set."""

    def __init__(self, store):
        self.failing, self.calls, self._write = True, 0, store.write_block
        store.write_block = self

    def __call__(self, block):
        self.calls += 1
        if self.failing:
            raise StoreWriteError(errno.ENOSPC, "No space left on device (injected)")
        return self._write(block)


def test_full_disk_keeps_memory_within_the_hot_budget_and_recovers(model, tmp_path):
    seq0 = tokens(40)
    one = sum(a.nbytes for c in prefill(model, seq0)[0] for part in c.to_arrays() for a in part)
    budget = int(one * 3.5)
    pool = budget_pool(model, tmp_path, hot_bytes=budget, retry_delays=(30.0,))
    writes = FailingWrites(pool.store)
    for i in range(20):
        seq = tokens(40, seed=i)
        pool.commit(f"a{i}", seq, prefill(model, seq)[0])
        assert pool.hot_bytes <= budget + one  # plus at most the turn in flight
    stats = pool.snapshot()
    assert stats["write_errors"] == 20 and stats["unsaved_blocks_dropped"] > 0
    assert stats["write_queue_bytes"] <= pool.persister.queue_bytes
    assert not list(tmp_path.glob("*/agents/*.json"))
    writes.failing = False  # space is back: new turns are cached and durable again
    seq = tokens(40, seed=99)
    pool.commit("back", seq, prefill(model, seq)[0])
    assert all(pool.blocks[b].state == BlockState.DURABLE for b in pool.agent("back").block_ids)
    pool.close()
    assert budget_pool(model, tmp_path).lookup("back", seq + [1])[1] == 40


def test_failed_writes_are_retried_without_waiting_for_the_agent(model, tmp_path):
    pool = budget_pool(model, tmp_path, retry_delays=(0.3, 0.3))
    writes = FailingWrites(pool.store)
    seq = tokens(40)
    pool.commit("a", seq, prefill(model, seq)[0])
    assert pool.snapshot()["write_errors"] == 1
    writes.failing = False
    deadline = time.time() + 10
    while time.time() < deadline and pool.snapshot()["saves"] == 0:
        time.sleep(0.05)
    assert all(pool.blocks[b].state == BlockState.DURABLE for b in pool.agent("a").block_ids)
    pool.close()
    assert budget_pool(model, tmp_path).lookup("a", seq + [1])[1] == 40


def test_erased_agent_is_not_resurrected_by_a_pending_retry(model, tmp_path):
    """The retry of "a"'s failed save, pending when "a" is erased, never writes it back. Witness: "b"'s
    save failed after a's, so its retry is due after a's (the writer runs them in that order): once
    b's retry has written b, a's would have run. Retries go on while the disk fails (as many as the
    test could need), so neither is given up before the disk is back."""
    pool = budget_pool(model, tmp_path, retry_delays=(0.1,) * 300)
    writes = FailingWrites(pool.store)
    seq, other = tokens(40), tokens(40, seed=1)
    pool.commit("a", seq, prefill(model, seq)[0])
    pool.commit("b", other, prefill(model, other)[0])
    assert pool.snapshot()["saves_retrying"] == 2  # both wait for a retry, a's first
    assert pool.erase("a") is True
    writes.failing = False
    wait_until(lambda: files_naming(tmp_path, "b"), "b's retry")
    pool.flush()
    assert not files_naming(tmp_path, "a") and pool.snapshot()["saves_retrying"] == 0
    pool.close()


def test_read_ahead_of_a_request_that_never_comes_expires(model, tmp_path, monkeypatch):
    import vllm_mlx_persist.reads as reads_module

    seq = tokens(70)
    pool = budget_pool(model, tmp_path)
    pool.commit("a", seq, prefill(model, seq)[0])
    pool.close()
    pool = budget_pool(model, tmp_path)
    assert pool.prefetch("a") == 5
    monkeypatch.setattr(reads_module, "PREFETCH_TTL_S", 0.0)
    assert pool.prefetch("nobody") == 0 and not pool.reads.snapshot()["prefetch_pending"]  # expired on the next call
    pool.close()
    assert pool.prefetch("a") == 0  # closed: no read is started, nothing raises


def test_stats_take_constant_time_with_a_hundred_thousand_blocks(model, tmp_path):
    fmt = {"bits": BITS, "group_size": GROUP, "block_size": BLOCK}
    fp = model_fingerprint(model, None, fmt)
    store = DiskStore(tmp_path, fp, {"test": True}, fmt)
    for a in range(100):  # manifests only: 100 agents x 1000 blocks, registered cold
        ids = [f"{a:04x}{b:060x}" for b in range(1000)]
        store.write_manifest(Manifest(f"agent-{a}", ids, 1000 * BLOCK, time.time()))
    pool = budget_pool(model, tmp_path)
    pool.flush()
    with pool.persister._cv:
        for bid in pool.blocks:
            pool.persister.index.set_size(bid, 4096)
    assert len(pool.blocks) == 100_000
    timings = []
    for _ in range(50):
        t = time.perf_counter()
        s = pool.snapshot()
        timings.append(time.perf_counter() - t)
    assert s["blocks"] == 100_000 and s["disk_bytes"] >= 100_000 * 4096
    assert sorted(timings)[25] < 1e-3
    pool.close()


def test_hot_and_reloaded_stay_bit_identical_through_the_persister(model, tmp_path):
    seq = tokens(50)
    pool = budget_pool(model, tmp_path)
    pool.commit("a", seq, prefill(model, seq)[0])
    hot = pool.lookup("a", seq + [1])[0]
    pool.close()
    cold = budget_pool(model, tmp_path).lookup("a", seq + [1])[0]
    assert_same_cache(hot, cold)
    _, x = prefill(model, [1], hot)
    _, y = prefill(model, [1], cold)
    assert mx.array_equal(x, y).item()


def test_recovery_rerun_is_refused_not_stored_under_wrong_tokens(tmp_path, tiny_llama_dir):
    """Drive vllm-mlx's own recovery (what `Scheduler.step` does on a cache-corruption error): the
    request re-runs from its prompt while keeping the output ids it had, so its final cache covers
    prompt + new output but is stored under prompt + old + new output. That store must be refused."""
    from mlx_lm import load
    from vllm_mlx.request import Request, SamplingParams
    from vllm_mlx.scheduler import Scheduler, SchedulerConfig

    model, tokenizer = load(str(tiny_llama_dir))
    config = SchedulerConfig(cache_backend="persist_q4",
                             cache_backend_options={"cache_dir": str(tmp_path), "block_size": 16})
    sched = Scheduler(model, tokenizer, config)
    backend = sched.cache_backend
    backend.load()
    prompt = tokens(40)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    sched.add_request(Request("r1", prompt, params, prompt_token_ids=prompt, cache_namespace="agent"))
    for _ in range(6):
        sched.step()
    assert 0 < len(sched.requests["r1"].output_token_ids) < 12
    sched._recover_from_cache_error()
    sched._reschedule_running_requests()
    for _ in range(60):
        if not sched.has_requests():
            break
        sched.step()
    assert not sched.has_requests()
    stats = backend.get_stats()
    assert stats["store_refused"] == 1 and stats["agents"] == 0, stats
    backend.save()
    assert not list(tmp_path.glob("*/agents/*.json"))

    sched.add_request(Request("r2", prompt, params, prompt_token_ids=prompt, cache_namespace="agent"))
    while sched.has_requests():
        sched.step()
    assert backend.get_stats()["agents"] == 1  # an ordinary run is stored as usual
    sched.close_cache_backend()


def test_offline_agents_command_lists_shows_erases_and_refuses_a_held_root(model, tmp_path):
    import subprocess
    import sys

    from vllm_mlx_persist.cache_root import CacheDirLock

    pool = budget_pool(model, tmp_path)
    for name in ("keep", "drop"):
        seq = tokens(40, seed=len(name))
        pool.commit(name, seq, prefill(model, seq)[0])
    pool.close()

    def agents(*args):
        return subprocess.run([sys.executable, "-m", "vllm_mlx_persist.cli", "agents", *args,
                               "--cache-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)

    listed = agents("list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert {r["id"] for r in json_rows(listed.stdout)} == {"keep", "drop"}
    shown = agents("show", "drop", "--json")
    assert shown.returncode == 0 and json_rows(shown.stdout)[0]["tokens"] == 40
    assert agents("show", "nobody").returncode == 1
    assert agents("rm", "drop").returncode == 0
    assert not files_naming(tmp_path, "drop") and files_naming(tmp_path, "keep")
    assert agents("rm", "drop").returncode == 1
    assert agents("gc").returncode == 0

    lock = CacheDirLock(tmp_path)  # a server holding the root
    try:
        refused = agents("list")
    finally:
        lock.release()
    assert refused.returncode == 2 and "in use by another server" in refused.stderr
    assert f"pid {__import__('os').getpid()}" in refused.stderr and "/v1/agents" in refused.stderr


def json_rows(text: str) -> list:
    import json

    return json.loads(text)


def test_restart_restores_the_most_recent_agents_within_hot_mb(model, tmp_path):
    seqs = {f"a{i}": tokens(40, seed=i) for i in range(5)}
    pool = budget_pool(model, tmp_path)
    for name, seq in seqs.items():  # a4 is the most recently used
        pool.commit(name, seq, prefill(model, seq)[0])
    one = pool.persister.agent_disk_bytes("a0")
    on_demand = pool.lookup("a4", seqs["a4"] + [1])[0]
    pool.close()

    restarted = budget_pool(model, tmp_path, hot_bytes=int(one * 2.2))
    restarted.restore_hot_set().result(20)
    restored_agents = {name for name in seqs
                       if any(b in restarted.reads.restored_ids() for b in restarted.agent(name).ids)}
    assert restored_agents == {"a4", "a3"}  # the most recent ones, within the budget (a2 would not fit)
    assert restarted.snapshot()["restored_bytes"] <= int(one * 2.2)
    hit, n, tier = restarted.lookup("a4", seqs["a4"] + [1])
    assert n == 40 and restarted.stats["blocks_restored"] == 3
    assert_same_cache(hit, on_demand)  # bit-identical to a block read on demand
    restarted.close()


def test_the_hot_set_restore_gives_way_to_requests(model, tmp_path, monkeypatch):
    """The restore reads on its own thread, one block at a time, and only while no request is
    served: a returning agent's blocks are read at once on the readers (not behind the restore),
    and its turn does not share the CPU or the disk with other agents' reads (slow disk: the
    store's fault hook). Once the server is idle again, the restore goes on."""
    from vllm_mlx_persist import store as store_mod
    from vllm_mlx_persist.reads import RESTORE_IDLE_S

    seqs = {f"a{i}": tokens(3 * BLOCK, seed=i) for i in range(5)}
    pool = budget_pool(model, tmp_path)
    for name, seq in seqs.items():  # a4 is the most recently used, a0 the least: last in the restore
        pool.commit(name, seq, prefill(model, seq)[0])
    on_demand = pool.lookup("a0", seqs["a0"] + [1])[0]
    pool.close()

    held, go = threading.Event(), threading.Event()

    def restore_disk(step: str) -> None:  # the restore thread's reads wait for `go`; the readers' pass
        if step == "read" and threading.current_thread().name.startswith("vllm-mlx-persist-restore"):
            held.set()
            go.wait(30)

    monkeypatch.setattr(store_mod, "_FAULT", restore_disk)
    restarted = budget_pool(model, tmp_path)
    refused = threading.Semaphore(0)  # the restore asked idle() after the arrival's quiet time: "no"
    restore = restarted.reads.restore

    def observed_restore(plan, room, idle, wanted):
        def observed_idle():
            answer = idle()
            if not answer and time.monotonic() - restarted.reads.last_arrival >= RESTORE_IDLE_S:
                refused.release()
            return answer
        return restore(plan, room, observed_idle, wanted)

    monkeypatch.setattr(restarted.reads, "restore", observed_restore)
    try:
        job = restarted.restore_hot_set()
        assert held.wait(30)  # the restore is reading a4's first block, and stays there
        assert restarted.prefetch("a0") == 3  # a0 arrives: its blocks are read on the readers at once
        hit, n, tier = restarted.lookup("a0", seqs["a0"] + [1], request_id="r0")  # not behind the restore
        assert n == 3 * BLOCK and tier == "disk" and restarted.stats["blocks_prefetched"] == 3
        assert_same_cache(hit, on_demand)  # bit-identical to a block read on demand
        assert len(restarted.reads.restored_ids()) == 1
    finally:
        go.set()
    # r0 is in flight: past the arrival's quiet time the restore asks twice whether it may read its
    # next block and is refused (the second ask proves the first refusal read nothing)
    assert refused.acquire(timeout=30) and refused.acquire(timeout=30)
    assert len(restarted.reads.restored_ids()) == 1 and not job.done()
    restarted.finish("r0")
    job.result(20)
    restored = {name for name in seqs if any(b in restarted.reads.restored_ids() for b in restarted.agent(name).ids)}
    assert restored == {"a1", "a2", "a3", "a4"}  # a0 is in memory already
    restarted.close()


def test_a_manifest_never_names_a_block_that_is_not_on_disk(model, tmp_path):
    """A failed turn's blocks stay in another branch when the next turn diverges inside them: the
    next save must write them too before its manifest names them (found by the disk campaign)."""
    pool = budget_pool(model, tmp_path, retry_delays=(60.0,))
    writes = FailingWrites(pool.store)
    first = tokens(40)
    pool.commit("a", first, prefill(model, first)[0])  # fails: its blocks stay PENDING, retry far off
    writes.failing = False
    second = first[:36] + tokens(20, seed=7)  # diverges inside the first turn's tail: two branches
    hit, n, _ = pool.lookup("a", second)
    cache, _ = prefill(model, second[n:], hit)
    pool.commit("a", second, cache)
    (m,) = pool.store.list_manifests()
    assert len(pool.agent("a").branches) == 2
    assert all(pool.store.block_path(b).is_file() for b in m.block_ids)
    pool.close()
