"""Removals and settings that hold in a fleet that partitions and crashes (issue #44): servers behind
a partition proxy (tools/reliability/partition.py) in front of one real redis-server, cut and healed by the tests.
Pools here hold synthetic 4-bit blocks (test_remote.chain) unless a test needs a model's turns."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("redis", reason='the fleet extra is not installed: pip install -e ".[fleet]"')

from fleet_pools import (SECRET, crash, fleet, fp, held, model, put_history, reaches_redis,  # noqa: E402,F401
                         redis_server, republish, settle, shared_history, wait_for)



def test_the_proxy_cuts_and_heals(fleet):
    proxy = fleet.proxy()
    import redis

    c = redis.Redis.from_url(proxy.url, socket_timeout=2, socket_connect_timeout=1)
    assert c.ping()
    proxy.cut()
    with pytest.raises(redis.exceptions.ConnectionError):
        c.ping()
    assert proxy.is_cut and proxy.refused >= 1
    proxy.heal()
    assert c.ping()  # redis-py reconnects on its next command
    c.close()


# ---- 2. a fork refusal travels --------------------------------------------------------------------------


def test_a_fork_refusal_travels_and_survives_another_servers_publish(fleet, fp):
    """Finding 2: A refuses forks of P (DELETE /v1/agents/P/forkable); B, which synced P before, syncs
    again and refuses too; B's next publish of P keeps the refusal in Redis, so a third server that
    never knew P refuses as well. A later grant on B wins over the earlier refusal (the latest setting
    wins; docs/fleet.md, "The merge rules")."""
    w = fleet.tier()
    hist = put_history(w, fp, "p")
    a, b = fleet.synced_servers("p", "a", "b")
    for pool in (a, b):
        assert held(pool, "p") == {x.block_id for x in hist}
        assert pool.may_fork("p")  # the policy's default ("open")

    assert a.set_forkable("p", False)
    settle(a)
    assert w.get_manifest("p") is not None
    b.fleet._sync_agent("p")
    assert not b.may_fork("p"), "B allows the fork A refused"

    # a later grant, on B, wins over the earlier refusal everywhere
    assert b.set_forkable("p", True)
    settle(b)
    a.fleet._sync_agent("p")
    assert a.may_fork("p") and b.may_fork("p")


def test_a_publish_of_another_server_keeps_the_refusal(fleet, fp):
    """Finding 2, the drop: B synced P before A's refusal and publishes P after it (B's record has no
    fork setting): Redis must keep A's refusal, and a third server refuses the fork."""
    w = fleet.tier()
    put_history(w, fp, "p")
    a, b = fleet.synced_servers("p", "a", "b")
    assert a.set_forkable("p", False)
    settle(a)
    b.fleet._sync_agent("p")
    republish(b, "p")  # B's next save of P's record publishes it
    rm = w.get_manifest("p")
    assert rm is not None and not rm.erased
    c, _ = fleet.server("c")
    c.fleet._sync_agent("p")
    assert held(c, "p")
    assert not c.may_fork("p"), "a third server allows the fork A refused"


# ---- 3. an acknowledged erasure survives kill -9 ---------------------------------------------------------


def test_an_acknowledged_erasure_survives_a_crash_before_it_reaches_redis(fleet, fp):
    """Finding 3: A erases P (DELETE returns: the local erasure is durable) while A cannot reach Redis,
    then A dies before the tombstone is written (its writer's queue is lost, as with kill -9). A,
    restarted, must not fetch P back, and the erasure must reach Redis once A reaches it again."""
    w = fleet.tier()
    put_history(w, fp, "p")
    a, proxy = fleet.server("a")
    a.fleet._sync_agent("p")
    assert held(a, "p")
    proxy.cut()
    assert a.erase("p", 30)  # acknowledged: known locally
    crash(a)  # kill -9: the tier's writer thread and queue vanish without a flush (no close())
    proxy.heal()

    again, _ = fleet.server("a", proxy)
    again.fleet._sync_agent("p")
    assert again.fleet_view.branch_state("p") is None, "the restarted server fetched the erased agent back"
    wait_for(lambda: (m := w.get_manifest("p")) is not None and m.erased, "the tombstone in Redis")
    wait_for(lambda: not again.fleet.outbox.pending(), "the outbox emptied once the tombstone is in Redis")
    assert not a.fleet.outbox.pending() or a.fleet.outbox.dir == again.fleet.outbox.dir
    b, _ = fleet.server("b")
    b.fleet._sync_agent("p")
    assert b.fleet_view.branch_state("p") is None


# ---- 1. a forget holds against a server that served the agent while cut off ---------------------------


def test_a_forget_holds_against_a_server_that_served_the_agent_while_cut_off(fleet, model):
    """Finding 1: A forgets a span while B cannot reach Redis; the client's next request (which never
    sends the span again) lands on B, whose lookup serves the old branch's prefix (a use). After the
    heal B's sync must drop the old branch (its content was made before the removal; serving a prefix
    of it is no new history), B's next publish must not carry it, and A must never hold it again."""
    from test_forget import _turn

    from vllm_mlx_persist.kv_edit import FORGET

    a, pa = fleet.model_server("a", model)
    b, pb = fleet.model_server("b", model)
    head, span, tail, old = shared_history(a, b, model)
    assert held(b, "x") == set(old)

    pb.cut()
    _turn(a, model, "x", head + tail, "r2", edit=FORGET)
    settle(a)
    (removal,) = a.agent("x").removals
    gone = set(old[removal.index:])
    assert not held(a, "x") & gone

    # the client's next turn obeys the forget, and lands on B, cut off: B serves the prefix
    m, _, _ = _turn(b, model, "x", head + tail + [7, 8, 9], "r3")
    assert m.num_tokens > 0
    b.flush(30)
    pb.heal()
    reaches_redis(b, "x")
    b.fleet._sync_agent("x")
    assert not held(b, "x") & gone, "B kept the forgotten branch after the heal"
    republish(b, "x")
    a.fleet._sync_agent("x")
    assert not held(a, "x") & gone, "A serves the forgotten span again"
    assert not set(fleet.tier().get_manifest("x").block_ids) & gone


def test_a_use_moves_last_used_only_and_survives_the_manifest():
    """Finding 1, the rule: a lookup's use (Branch.used) makes a branch more recently used, never its
    content newer (`written`), which is what a removal record compares; both survive disk and Redis."""
    from vllm_mlx_persist.chain import Branch, Removal, branches_of, manifest_of, surviving_removals
    from vllm_mlx_persist.disk_format import decode_manifest, encode_manifest

    br = Branch(["a" * 64, "b" * 64], 32, ((0, "x"),), 10.0)
    removal = Removal("b" * 64, 1, "a" * 64, (), 20.0)
    used = br.used(30.0)
    assert (used.last_used, used.written) == (30.0, 10.0)
    assert surviving_removals([used], [removal], 0.0, lambda b: None) == []
    again = Branch(["a" * 64, "b" * 64], 32, ((0, "x"),), 25.0)  # sent again after the forget: stays
    assert surviving_removals([again], [removal], 0.0, lambda b: None) == [again]
    (back,) = branches_of(decode_manifest(encode_manifest(manifest_of("x", [used], False, 30.0))))
    assert (back.last_used, back.written) == (30.0, 10.0)


def test_settings_merge_by_the_latest_setting_and_a_tie_refuses():
    """Finding 2, the rule (record_settings.py): per setting the copy that set it later wins; on equal
    times (unstamped: 0) the refusal wins over no decision over a grant, on either side."""
    from vllm_mlx_persist.record_settings import merge_settings

    def merged(a, a_at, b, b_at):
        return merge_settings({"forkable": a}, a_at, {"forkable": b}, b_at)[0]["forkable"]

    assert merged(True, {"forkable": 2.0}, False, {"forkable": 1.0}) is True  # a later grant
    assert merged(True, {"forkable": 1.0}, False, {"forkable": 2.0}) is False
    for a, b in ((None, False), (False, None), (True, False), (False, True)):
        assert merged(a, {}, b, {}) is False  # unstamped (a record from before the stamps): the refusal
    assert merged(None, {}, True, {}) is None and merged(None, {}, True, {"forkable": 1.0}) is True


# ---- 4. a forget whose publish never reached Redis is published after the heal -------------------------


def test_a_forget_whose_publish_never_reached_redis_is_republished(fleet, model):
    """Finding 4: A forgets a span while cut off (its put is given up), and restarts; after the heal
    A's sync finds its own record covering Redis's older copy. It must publish its removal (not
    adopt Redis's copy as unchanged and stop there), so B drops the span too."""
    from test_forget import _turn

    from vllm_mlx_persist.kv_edit import FORGET

    a, pa = fleet.model_server("a", model)
    b, _ = fleet.model_server("b", model)
    head, span, tail, old = shared_history(a, b, model)

    pa.cut()
    _turn(a, model, "x", head + tail, "r2", edit=FORGET)
    a.flush(30)
    assert a.fleet.tier.flush(30)  # given up: the put never reached Redis
    (removal,) = a.agent("x").removals
    gone = set(old[removal.index:])
    a.close()
    pa.heal()
    a, _ = fleet.model_server("a", model, pa)
    assert a.agent("x").removals == (removal,)
    reaches_redis(a, "x")
    a.fleet._sync_agent("x")
    settle(a)
    assert removal in fleet.tier().get_manifest("x").removals, "the removal never reached Redis"
    a.fleet._sync_agent("x")  # published once: Redis holds it now, nothing more to publish
    assert a.fleet.counts["syncs_republished"] == 1
    b.fleet._sync_agent("x")
    assert not held(b, "x") & gone, "B still serves the forgotten span"


# ---- 5. removals past the bound ------------------------------------------------------------------------


def test_removals_past_the_bound_still_hold_against_an_old_copy(fleet, model):
    """Finding 5: an agent forgets one tool output per turn, 33 times (one more than MAX_REMOVALS
    records); B synced it before the first forget. B's sync must not keep (and B's publish must not
    bring back) the first forgotten output: the bound compacts removal records into the record's floor
    (branches written before it that the record does not hold go), never forgets what they removed."""
    from test_forget import _turn
    from test_pool import tokens

    from vllm_mlx_persist.disk_format import MAX_REMOVALS
    from vllm_mlx_persist.kv_edit import FORGET

    a, _ = fleet.model_server("a", model)
    b, _ = fleet.model_server("b", model)
    head = tokens(40, seed=1)
    _turn(a, model, "x", head + tokens(30, seed=100), "r0", out=2)
    settle(a)
    b.fleet._sync_agent("x")
    first = list(a.agent("x").branches[-1].block_ids)
    for i in range(1, MAX_REMOVALS + 2):
        _turn(a, model, "x", head + tokens(30, seed=100 + i), f"r{i}", edit=FORGET, out=2)
    settle(a)
    assert len(a.agent("x").removals) <= MAX_REMOVALS
    gone = set(first[2:])  # the first output's blocks (head: blocks 0-1 and half of 2)
    assert not held(a, "x") & gone
    b.fleet._sync_agent("x")
    assert not held(b, "x") & gone, "B kept the first forgotten output"
    republish(b, "x")
    a.fleet._sync_agent("x")
    assert not held(a, "x") & gone, "A serves the first forgotten output again"


def test_bounded_removals_raise_a_floor_that_older_copies_cannot_cross():
    """Finding 5, the rule (chain.bound_removals, chain.merge_records): records past the bound go, the
    newest of them raising the floor; a branch of another copy written at or before the floor that
    the floor's copy does not hold goes, one written after it (sent again) stays."""
    from vllm_mlx_persist.chain import Branch, Copy, Removal, bound_removals, merge_records

    rs = [Removal(f"{i:064x}", 1, None, (), float(i)) for i in range(1, 6)]
    kept, floor = bound_removals(rs, 3, 0.0, 0.0)
    assert [r.at for r in kept] == [3.0, 4.0, 5.0] and floor == 2.0
    kept, floor = bound_removals(rs, 3, 4.0, 0.0)  # expired by age too
    assert [r.at for r in kept] == [4.0, 5.0] and floor == 3.0

    old = Branch(["a" * 64, f"{1:064x}"], 32, ((0, "x"),), 0.5)  # holds what the first removal removed
    mine = Branch(["a" * 64, "c" * 64], 32, ((0, "x"),), 4.5)
    again = Branch(["a" * 64, f"{1:064x}"], 32, ((0, "x"),), 6.0)
    compacted = Copy((mine,), kept, removed_floor=floor)
    for br, stays in ((old, False), (again, True)):
        got, _, _, f = merge_records([br, mine], compacted, Copy((br,)), 32, 0.0, lambda b: None)
        assert (br in got) is stays and mine in got and f == floor


# ---- 6. the era of an agent the tier's bounded memory forgot --------------------------------------------


def test_a_forgotten_era_does_not_erase_a_valid_copy(fleet, fp):
    """Finding 6: X was erased elsewhere and recreated; A acted on the erasure and holds the new
    history (its era). Once A's tier forgets X's state (its `max_agents` bound), neither A's sync nor
    A's next publish of X may treat A's own copy as from before the erasure and erase it."""
    w = fleet.tier()
    put_history(w, fp, "x")
    a, _ = fleet.server("a", settings={"secret": SECRET, "max_agents": 2})
    a.fleet._sync_agent("x")
    assert w.erase("x") and w.flush(10)
    new = put_history(w, fp, "x", seed=7)
    a.fleet._sync_agent("x")
    assert held(a, "x") == {b.block_id for b in new} and a.fleet.counts["erased_from_fleet"] == 1
    era = a.fleet.tier.era("x")
    assert era and a.store.read_manifest("x").era == era

    for other in ("y", "z", "v"):  # other agents' states push X's out of the tier's memory
        a.fleet.tier.get_manifest(other)
    a.fleet._sync_agent("x")
    assert a.fleet.counts["erased_from_fleet"] == 1, "A erased its valid copy (sync)"
    assert held(a, "x") == {b.block_id for b in new} and a.fleet.tier.era("x") == era

    for other in ("y", "z", "v"):
        a.fleet.tier.get_manifest(other)
    republish(a, "x")
    assert a.fleet.tier.stats()["puts_erased"] == 0, "A's publish met its own era as an erasure"
    assert a.fleet.counts["erased_from_fleet"] == 1 and held(a, "x") == {b.block_id for b in new}
    assert a.store.read_manifest("x").era == era


_ERASE_AND_HANG = """
import sys, time
from pathlib import Path
from fleet_pools import SECRET, fleet_pool, tier_maker
fp, root, url = sys.argv[1:4]
pool = fleet_pool(fp, Path(root), tier_maker(url, fp, secret=SECRET, breaker_failures=1, breaker_open_s=0.2))
print("acked", pool.erase("p", 30), flush=True)
time.sleep(600)
"""


def test_an_erasure_acknowledged_by_a_server_then_sigkilled_reaches_the_fleet(fleet, fp, tmp_path):
    """Finding 3 with a real kill -9: a server process answers the erasure of P while cut off from
    Redis and is SIGKILLed; restarted on its directory (healed), it does not fetch P back and the
    tombstone reaches Redis from its outbox."""
    import os
    import signal
    import subprocess
    import sys

    w = fleet.tier()
    put_history(w, fp, "p")
    a, proxy = fleet.server("a")
    a.fleet._sync_agent("p")
    assert held(a, "p")
    a.close()
    proxy.cut()
    tests = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(tests).parent), tests])}
    child = subprocess.Popen([sys.executable, "-c", _ERASE_AND_HANG, fp, str(tmp_path / "a"), proxy.url],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = child.stdout.readline()  # the erasure's answer: the event the kill waits for
        assert line.strip() == "acked True", line
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    assert w.get_manifest("p") is not None and not w.get_manifest("p").erased  # it never reached Redis
    proxy.heal()
    again, _ = fleet.server("a", proxy)
    reaches_redis(again, "p")
    again.fleet._sync_agent("p")
    assert again.fleet_view.branch_state("p") is None, "the restarted server fetched the erased agent back"
    wait_for(lambda: (m := w.get_manifest("p")) is not None and m.erased, "the tombstone in Redis")
    wait_for(lambda: not again.fleet.outbox.pending(), "the outbox emptied")


def test_a_fork_request_admitted_before_the_sync_is_refused_the_parents_history(fleet, model):
    """Finding 2 on the request path: a fork request's admission checks the parent's setting as the
    server holds it (before any sync); A refused forks of P since. The lookup syncs P first and must
    then serve nothing of P (a miss), its record as synced being what decides."""
    from test_forget import _turn
    from test_pool import tokens

    a, _ = fleet.model_server("a", model)
    b, _ = fleet.model_server("b", model)
    _, _, seq = _turn(a, model, "p", tokens(70, seed=4), "r1")
    settle(a)
    b.fleet._sync_agent("p")
    assert b.may_fork("p")  # what B's admission sees
    assert a.set_forkable("p", False)
    settle(a)
    m = b.match("child", seq + [9, 9], "r2", fork_from="p")
    b.finish("r2")
    assert m.num_tokens == 0, "B served the fork from a parent that refuses forks"
    assert not b.may_fork("p") and b.stats["forks_refused_at_lookup"] == 1


def test_a_pin_travels_and_the_latest_pin_setting_wins(fleet, fp):
    """Every per-agent setting replicates by the stated rule (record_settings.py): A pins P, B's sync
    pins it there too (its disk index included: the budget and the TTL spare it on B as well); B
    unpins it later, and A's sync unpins it. A pin from before pins were stamped stays local."""
    from vllm_mlx_persist.record_settings import merge_settings

    w = fleet.tier()
    put_history(w, fp, "p")
    a, b = fleet.synced_servers("p", "a", "b")
    assert a.set_pinned("p", True)
    settle(a)
    assert w.get_manifest("p").pinned
    b.fleet._sync_agent("p")
    b.flush(30)
    assert b.agent("p").pinned and b.persister.index.agents["p"].pinned and b.store.read_manifest("p").pinned
    assert b.set_pinned("p", False)
    settle(b)
    a.fleet._sync_agent("p")
    a.flush(30)
    assert not a.agent("p").pinned and not a.persister.index.agents["p"].pinned

    def pinned(mine, mine_at, theirs, theirs_at):
        return merge_settings({"forkable": None, "pinned": mine}, mine_at, {"forkable": None, "pinned": theirs},
                              theirs_at)[0]["pinned"]

    assert pinned(True, {}, False, {}) is True and pinned(False, {}, True, {}) is False  # unstamped: local
    assert pinned(True, {}, False, {"pinned": 1.0}) is False and pinned(False, {"pinned": 2.0}, True, {"pinned": 2.0})


def test_the_outbox_keeps_an_agents_latest_erasure_and_holds_no_lock_across_its_writes(tmp_path, monkeypatch):
    """One file per pending erasure: a later erasure of the agent supersedes the earlier one's file, a
    done removes only its own, a file of the old one-per-agent naming is read and renamed; concurrent
    erasures (one agent and many) leave each agent's newest last in the start-up order."""
    import hashlib
    import json
    import threading

    from vllm_mlx_persist.fleet.outbox import Outbox

    box = Outbox(tmp_path / "outbox")
    box.add("a", "e1")
    box.add("a", "e2")
    box.add("b", "e3")
    assert sorted(box.pending()) == [("a", "e2"), ("b", "e3")]
    box.done("a", "e1")  # the superseded one's tombstone reaching Redis late: the newer stays
    box.done("b", "e3")
    assert box.pending() == [("a", "e2")]
    legacy = box.dir / (hashlib.sha256(b"c").hexdigest()[:32] + ".json")
    legacy.write_text(json.dumps({"agent": "c", "era": "old"}))
    assert box.pending() == [("c", "old"), ("a", "e2")]  # without a time: first
    box.done("c", "old")
    assert box.pending() == [("a", "e2")] and not legacy.exists()

    def erase_many(k: int) -> None:  # at once: each thread its own agent, and one agent all share
        for i in range(30):
            box.add(f"x{k}", f"t{k}-{i}")
            if i % 3 == 0:
                box.add("shared", f"s{k}-{i}")

    threads = [threading.Thread(target=erase_many, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    order = box.pending()
    assert {agent: era for agent, era in order if agent.startswith("x")} == {f"x{k}": f"t{k}-29" for k in range(4)}
    again = Outbox(box.dir)  # a clock stepped back: the later erasure still supersedes the earlier
    monkeypatch.setattr(time, "time_ns", lambda: 1)
    again.add("y", "first")
    again.add("y", "second")
    assert [e for a, e in again.pending() if a == "y"] == ["second"]
    assert [a for a, _ in order].count("shared") >= 1 and len(order) <= 1 + 4 + 4


# ---- issue #53: a forget's publish and every pending removal are durable, drained and bounded -----------


def _removed_in_redis(w, agent: str, removal) -> bool:
    m = w.get_manifest(agent)
    return m is not None and not m.erased and removal in m.removals


def test_a_forget_acknowledged_before_a_crash_reaches_the_fleet_after_the_restart(fleet, model):
    """Issue #53, item 1: A, cut off from Redis, forgets a span (the turn is acknowledged: durable
    locally), and is killed before its put reaches Redis; Redis comes back and A restarts. Nothing
    asks A for the agent again, yet the removal must reach Redis from A's outbox, so B (which synced
    the agent before the forget) drops the forgotten span at its next sync."""
    from test_forget import _turn

    from vllm_mlx_persist.kv_edit import FORGET

    a, pa = fleet.model_server("a", model, outbox_retry_s=0.2)  # its outbox sent again every 0.2 s
    b, _ = fleet.model_server("b", model)
    head, span, tail, old = shared_history(a, b, model)
    pa.cut()
    _turn(a, model, "x", head + tail, "r2", edit=FORGET)  # acknowledged: pool.commit waited for the disk
    (removal,) = a.agent("x").removals
    gone = set(old[removal.index:])
    assert held(b, "x") & gone
    crash(a)
    pa.heal()
    a, _ = fleet.model_server("a", model, pa, outbox_retry_s=0.2)  # restarted; X is never asked for
    w = fleet.tier()
    wait_for(lambda: _removed_in_redis(w, "x", removal), "the forget's removal in Redis from the outbox")
    wait_for(lambda: not a.fleet.outbox.forgets(), "the outbox letting go of the forget's publish")
    b.fleet._sync_agent("x")
    assert not held(b, "x") & gone, "B still serves the span A forgot"


def test_a_forget_whose_put_was_given_up_reaches_redis_while_the_server_runs(fleet, model):
    """Issue #53, item 2 for a forget: A's put of its forget is given up while A is cut off; after the
    heal, with no request of the agent and no restart, the outbox sends it again."""
    from test_forget import _history, _turn

    from vllm_mlx_persist.kv_edit import FORGET

    a, pa = fleet.model_server("a", model, outbox_retry_s=0.2)  # its outbox sent again every 0.2 s
    head, span, tail = _history()
    _turn(a, model, "x", head + span + tail, "r1")
    settle(a)
    pa.cut()
    _turn(a, model, "x", head + tail, "r2", edit=FORGET)
    (removal,) = a.agent("x").removals
    pending = a.fleet.outbox.forgets()
    assert list(pending) == ["x"] and pending["x"] >= removal.at, "the forget was acknowledged with no pending publish"
    a.flush(30)
    assert a.fleet.tier.flush(30)  # its put given up: Redis unreachable
    assert not _removed_in_redis(fleet.tier(), "x", removal)
    syncs = a.fleet.counts["syncs"]  # the turns' own
    pa.heal()
    w = fleet.tier()
    wait_for(lambda: _removed_in_redis(w, "x", removal), "the forget's removal in Redis while A runs")
    wait_for(lambda: not a.fleet.outbox.forgets(), "the outbox letting go of the forget's publish")
    assert a.fleet.counts["forgets_sent_again"] >= 1 and a.fleet.counts["syncs"] == syncs, "a sync published it"


def test_an_erasure_in_the_outbox_reaches_redis_while_the_server_runs(fleet, fp):
    """Issue #53, item 5: an erasure pending in the outbox that no write carries (the writer refused
    it, or let it go) was read only at the next start. Now the running server sends it again."""
    w = fleet.tier()
    put_history(w, fp, "p")
    a, _ = fleet.server("a", settings={"secret": SECRET, "outbox_retry_s": 0.2})
    a.fleet.outbox.add("p", "e" * 16)  # pending, not queued
    wait_for(lambda: (m := w.get_manifest("p")) is not None and m.erased and m.ident == "e" * 16,
             "the pending erasure's tombstone in Redis while the server runs")
    wait_for(lambda: not a.fleet.outbox.pending(), "the outbox letting go of it")


def test_removals_past_the_bound_are_refused_with_503_not_acknowledged(fleet, fp, monkeypatch):
    """Issue #53, item 5: with `max_erasures` removals pending (A cut off from Redis), DELETE answered
    200, the writer refused to queue the erasure, and after the heal A fetched the agent back and
    served it. Now the next removal is refused (503, nothing removed: A still serves it), a forget
    too (503 at admission); after the heal the pending ones reach Redis while A runs, and a removal
    is taken again."""
    import asyncio
    import weakref

    from fastapi import HTTPException

    from vllm_mlx_persist import plugin
    from vllm_mlx_persist.admin import make_router

    w = fleet.tier()
    for agent in ("p1", "p2", "p3"):
        put_history(w, fp, agent)
    a, proxy = fleet.server("a", settings={"secret": SECRET, "breaker_failures": 1, "breaker_open_s": 0.2,
                                          "read_timeout_s": 1.0, "max_erasures": 2, "outbox_retry_s": 0.2})

    class Backend:  # what the admin routes and the namespace hook ask of the backend serving
        closed = False
        loaded_pool = a

        def removal_room(self) -> bool:
            return a.fleet.removal_room()

        def may_fork(self, parent: str) -> bool:
            return True

        def prefetch(self, route) -> None:
            pass

    backend = Backend()
    live = weakref.WeakSet()
    live.add(backend)
    monkeypatch.setattr(plugin, "_LIVE_BACKENDS", live)
    delete = next(r.endpoint for r in make_router(lambda: backend).routes
                  if r.path == "/v1/agents/{agent_id}" and "DELETE" in r.methods)

    def forget(agent: str):
        from types import SimpleNamespace

        return plugin.vllm_mlx_cache_namespace(request=SimpleNamespace(metadata=None, prompt_cache_key=None),
                                               headers={"x-agent-id": agent, "x-kv-edit": "forget"},
                                               endpoint="/v1/chat/completions")

    for agent in ("p1", "p2", "p3"):
        a.fleet._sync_agent(agent)
        assert held(a, agent)
    proxy.cut()
    for agent in ("p1", "p2"):
        assert asyncio.run(delete(agent_id=agent)) == {"id": agent, "deleted": True}
    refused = asyncio.run(delete(agent_id="p3"))
    assert getattr(refused, "status_code", 200) == 503, "an erasure past the bound was acknowledged"
    assert b"pending" in refused.body and refused.headers["retry-after"]
    assert held(a, "p3"), "a refused erasure removed the agent"
    with pytest.raises(HTTPException) as e:
        forget("p3")
    assert e.value.status_code == 503 and "pending" in e.value.detail
    assert a.fleet.counts["removals_refused"] == 2
    proxy.heal()
    for agent in ("p1", "p2"):
        wait_for(lambda: (m := w.get_manifest(agent)) is not None and m.erased, f"{agent}'s tombstone")
    wait_for(lambda: a.fleet.removal_room(), "room again once the pending erasures are in Redis")
    assert forget("p3") == "p3\0edit:forget"
    assert asyncio.run(delete(agent_id="p3")) == {"id": "p3", "deleted": True}
    wait_for(lambda: (m := w.get_manifest("p3")) is not None and m.erased, "p3's tombstone")
    for agent in ("p1", "p2", "p3"):
        a.fleet._sync_agent(agent)
        assert a.fleet_view.branch_state(agent) is None, f"A fetched the erased {agent} back"


# ---- issue #53: the outbox's own promises, each guarding a defect injected by hand ----------------------


def test_a_failed_erasure_record_keeps_the_agents_earlier_one(tmp_path, monkeypatch):
    """The outbox removes an agent's earlier erasure files only once its own is durable: a write that
    fails (here its fsync) leaves the earlier erasure pending."""
    from vllm_mlx_persist.fleet import outbox as ob

    box = ob.Outbox(tmp_path / "outbox")
    box.add("a", "e1")
    box.add_forget("a", 5.0)

    def failing(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(ob, "_fsync", failing)
    with pytest.raises(OSError):
        box.add("a", "e2")
    with pytest.raises(OSError):
        box.add_forget("a", 6.0)
    assert box.pending() == [("a", "e1")] and box.forgets() == {"a": 5.0}
    assert ob.Outbox(box.dir).pending() == [("a", "e1")]


def test_an_outbox_file_is_fsynced_before_its_rename_and_the_directory_after(tmp_path, monkeypatch):
    """Each entry: written to a temporary file, fsynced, renamed into place, then the directory
    fsynced (else a power loss can leave the name pointing at nothing)."""
    import os

    from vllm_mlx_persist.fleet import outbox as ob

    calls: list = []
    real_fsync, real_replace, real_dir = ob._fsync, ob._replace, ob._fsync_dir

    def fsync(fd: int) -> None:
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst) -> None:
        calls.append(("replace", str(src), str(dst)))
        real_replace(src, dst)

    def fsync_dir(path) -> None:
        calls.append(("fsync_dir", str(path)))
        real_dir(path)

    monkeypatch.setattr(ob, "_fsync", fsync)
    monkeypatch.setattr(ob, "_replace", replace)
    monkeypatch.setattr(ob, "_fsync_dir", fsync_dir)
    box = ob.Outbox(tmp_path / "outbox")
    for add in (lambda: box.add("a", "e1"), lambda: box.add_forget("b", 1.0)):
        calls.clear()
        add()
        (i, (_, tmp, final)), = [(i, c) for i, c in enumerate(calls) if c[0] == "replace"]
        assert ("fsync", tmp) in calls[:i], f"renamed without an fsync of its file: {calls}"
        assert ("fsync_dir", str(box.dir)) in calls[i + 1:], f"no directory fsync after the rename: {calls}"
        assert Path(final).exists() and not Path(tmp).exists()


def test_outbox_times_go_on_from_the_files_after_a_restart_whatever_the_clock(tmp_path, monkeypatch):
    """Restarted with its clock behind the newest pending entry's time, the outbox goes on from that
    time: a new erasure of the agent still supersedes the earlier one and sorts last."""
    from vllm_mlx_persist.fleet import outbox as ob

    box = ob.Outbox(tmp_path / "outbox")
    box.add("a", "e1")
    box.add("b", "e2")
    monkeypatch.setattr(ob, "_clock_ns", lambda: 1000)  # the clock stepped back, then the server restarted
    again = ob.Outbox(box.dir)
    again.add("a", "e3")
    assert again.pending() == [("b", "e2"), ("a", "e3")]


def test_the_outbox_records_an_erasure_before_its_tombstone_is_queued(fleet, fp):
    """The tombstone is queued only once the erasure is durable in the outbox (a writer that reached
    Redis first could let go of a file not written yet, which then stays and is sent again forever)."""
    a, _ = fleet.server("a")
    w = fleet.tier()
    put_history(w, fp, "p")
    a.fleet._sync_agent("p")
    queued_at_add = []
    real_add = a.fleet.outbox.add

    def add(namespace: str, era: str) -> None:
        queued_at_add.append(a.fleet.tier.stats()["erases"])
        real_add(namespace, era)

    a.fleet.outbox.add = add
    assert a.erase("p", 30)
    assert queued_at_add == [0], "the tombstone was queued before the erasure was in the outbox"
    wait_for(lambda: (m := w.get_manifest("p")) is not None and m.erased, "the tombstone")
    wait_for(lambda: not a.fleet.outbox.pending(), "the outbox letting go of it")


def test_the_writer_lets_an_erasure_go_only_once_its_tombstone_is_written(fleet, fp):
    """The outbox file of an erasure stays while its tombstone's write fails (here the compare-and-set
    itself), and goes once it is written."""
    import redis

    a, _ = fleet.server("a")
    w = fleet.tier()
    put_history(w, fp, "p")
    a.fleet._sync_agent("p")
    writer = a.fleet.tier.writer
    real_cas, failures, failing = writer._cas_script, [], [True]

    def cas(client, keys, args):
        if failing[0]:
            failures.append(keys)
            raise redis.exceptions.ConnectionError("the tombstone's write failed")
        return real_cas(client, keys, args)

    writer._cas_script = cas
    assert a.erase("p", 30)
    wait_for(lambda: len(failures) >= 2, "the tombstone's write to fail twice")
    assert a.fleet.outbox.pending(), "the writer let the erasure go before its tombstone was written"
    assert not w.get_manifest("p").erased
    failing[0] = False
    wait_for(lambda: (m := w.get_manifest("p")) is not None and m.erased, "the tombstone")
    wait_for(lambda: not a.fleet.outbox.pending(), "the outbox letting go of it")
