"""The fork answer is the fleet's, not one server's (issue #53, item 6): a fork request's admission
(the namespace hook: pool.may_fork) reads the parent's settings in Redis, within a bound, and merges
them with the local record by the settings' merge rule; a server that never served the parent answers
as the one that set it. Cut off from Redis, a server answers from what it knows (docs/fleet.md, "The
fork answer"). Pools on one real redis-server, each behind its own partition proxy."""

from __future__ import annotations

import pytest

pytest.importorskip("redis", reason='the fleet extra is not installed: pip install -e ".[fleet]"')

from fleet_pools import (SECRET, fleet, fleet_pool, fp, held, put_history, redis_server, settle,  # noqa: E402,F401
                         tier_maker, wait_for)


def refused_on_a(fleet, fp) -> tuple:
    """P's history in Redis (put by a server that is no pool here); server A synced P and refused its
    forks (published), server B never synced P: (A, B, B's proxy)."""
    put_history(fleet.tier(), fp, "p")
    a, _ = fleet.server("a")
    b, proxy = fleet.server("b")
    a.fleet._sync_agent("p")
    assert a.set_forkable("p", False)
    settle(a)
    return a, b, proxy


def test_a_server_that_never_served_the_parent_refuses_like_the_one_that_set_it(fleet, fp):
    """P set non-forkable on A; B never served P (nor synced it): a fork of P on B is refused, the
    answer A gives. Nothing of P is fetched by the answer itself."""
    a, b, _ = refused_on_a(fleet, fp)
    assert not a.may_fork("p")
    assert not b.may_fork("p"), "B allows a fork of P, which A refused (B never synced P)"
    assert not held(b, "p"), "the admission check fetched P's history"
    # a later grant on A: B follows without a sync either
    assert a.set_forkable("p", True)
    settle(a)
    assert b.may_fork("p")


def test_under_the_listed_policy_a_grant_travels_to_a_server_that_never_served_the_parent(fleet, fp):
    """fork_policy "listed": only agents set forkable may be forked. A grants P; B, which never
    served P, allows the fork too; an agent that no server knows is refused on both alike."""
    put_history(fleet.tier(), fp, "p")
    a, _ = fleet.server("a")
    b, _ = fleet.server("b")
    for pool in (a, b):
        pool.records.fork_policy = "listed"
    a.fleet._sync_agent("p")
    assert not a.may_fork("p") and not b.may_fork("p")
    assert a.set_forkable("p", True)
    settle(a)
    assert a.may_fork("p")
    assert b.may_fork("p"), "B refuses a fork of P, which A granted (B never synced P)"
    assert not a.may_fork("nobody") and not b.may_fork("nobody")


def test_a_refusal_in_redis_wins_over_an_older_local_grant(fleet, fp):
    """B synced P while it was forkable and holds its record; A refuses forks later. B's admission
    answers by the merge of its record with Redis's (the later setting wins), without a sync first."""
    put_history(fleet.tier(), fp, "p")
    a, b = fleet.synced_servers("p", "a", "b")
    assert a.set_forkable("p", True)
    settle(a)
    b.fleet._sync_agent("p")
    assert b.may_fork("p")
    assert a.set_forkable("p", False)
    settle(a)
    assert not b.may_fork("p"), "B's older grant won over A's later refusal at admission"


def test_an_erased_parent_is_answered_like_an_unknown_one(fleet, fp):
    """P refused forks, then was erased fleet-wide (a tombstone): a server that still holds P's old
    record answers like for any unknown agent (the policy), not by the erased record's setting."""
    put_history(fleet.tier(), fp, "p")
    a, b = fleet.synced_servers("p", "a", "b")
    assert a.set_forkable("p", False)
    settle(a)
    b.fleet._sync_agent("p")
    assert not b.may_fork("p")
    assert a.erase("p")
    wait_for(lambda: (m := fleet.tier().get_manifest("p")) is not None and m.erased, "the tombstone in Redis")
    assert b.may_fork("p") == b.may_fork("nobody") is True


def test_a_history_begun_after_an_erasure_answers_by_its_own_settings(fleet, fp):
    """B refused forks of P and holds that record; P is then erased elsewhere and a new history of P
    begun on its tombstone, with no fork setting. B has not synced since: its record is of the past
    the erasure ended and does not count; B answers by the new history's settings (the policy)."""
    w = fleet.tier()
    put_history(fleet.tier(), fp, "p")
    b, _ = fleet.server("b")
    b.fleet._sync_agent("p")
    assert b.set_forkable("p", False)
    settle(b)
    assert w.erase("p") and w.flush(10)
    put_history(w, fp, "p", 1, seed=5)
    m = w.get_manifest("p")
    assert not m.erased and m.era and m.forkable is None
    assert held(b, "p")  # B still holds its record of P's erased past
    assert b.may_fork("p"), "B answered by its record of P's erased past"


def test_cut_off_from_redis_a_server_answers_from_what_it_knows(fleet, fp):
    """B cannot reach Redis: its answer is its own record's (here: none, so the policy's), within the
    read's bound; once healed it answers as A does."""
    _, b, proxy = refused_on_a(fleet, fp)
    proxy.cut()
    assert b.may_fork("p"), "cut off, B must answer from its local knowledge (the open policy)"
    proxy.heal()
    wait_for(lambda: not b.may_fork("p"), "B's answer once it reaches Redis again")


def test_admission_checks_do_not_queue_behind_the_syncs_reads(fleet, fp):
    """Every reader of the syncs is taken (syncs stuck on a slow Redis): a fork's admission still reads
    the parent's settings, on the admission checks' own reader, and refuses as A does."""
    _, b, _ = refused_on_a(fleet, fp)
    slots = b.fleet.tier.reads._read_slots
    taken = 0
    while slots.acquire(blocking=False):
        taken += 1
    try:
        assert taken >= 1
        assert not b.may_fork("p"), "the admission check was skipped behind the syncs' readers"
    finally:
        for _ in range(taken):
            slots.release()


def test_the_answer_waits_at_most_the_fleets_bound_on_a_redis_that_never_answers(fp, tmp_path):
    """A Redis that takes the connection and never answers (hung): the admission waits min(wait_s,
    read timeout), here 0.3 s against a 60 s read timeout, then answers from the local record, without
    opening the breaker for the syncs. The assertion's margin is two orders of magnitude: it shows which
    bound applies, not a speed."""
    import socket
    import time

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)  # accepted by the kernel, never read
    url = f"redis://127.0.0.1:{hung.getsockname()[1]}/0"
    pool = fleet_pool(fp, tmp_path / "b", tier_maker(url, fp, secret=SECRET, read_timeout_s=60.0,
                                                     connect_timeout_s=60.0, wait_s=0.3, breaker_failures=1))
    try:
        t0 = time.monotonic()
        assert pool.may_fork("p")  # nothing known here: the open policy
        assert time.monotonic() - t0 < 30.0, "the admission waited for the read timeout, not the fleet's bound"
        stats = pool.fleet.tier.stats()
        assert stats["timeouts"] == 1  # it did wait for the read, and gave up
        assert stats["breaker_opens"] == 0  # its own shorter bound is no verdict on Redis (the syncs' reads judge)
        pool.records.fork_policy = "listed"
        assert not pool.may_fork("p")  # the next check is skipped at once: its reader is still held
    finally:
        pool.close()
        hung.close()


def test_the_admission_merge_is_the_settings_merge_rule():
    """RemoteSettings.merged_forkable, the rule the sync's merge applies (record_settings.py): the
    later setting wins, on a tie a refusal; a record of a past an erasure ended does not count."""
    from types import SimpleNamespace as Rec

    from vllm_mlx_persist.record_settings import RemoteSettings

    grant_then = lambda t: RemoteSettings(True, {"forkable": t})  # noqa: E731
    assert grant_then(1.0).merged_forkable(Rec(forkable=False, settings_at={"forkable": 2.0})) is False
    assert grant_then(3.0).merged_forkable(Rec(forkable=False, settings_at={"forkable": 2.0})) is True
    assert grant_then(2.0).merged_forkable(Rec(forkable=False, settings_at={"forkable": 2.0})) is False
    assert grant_then(1.0).merged_forkable(Rec(forkable=None, settings_at={})) is True
    assert grant_then(1.0).merged_forkable(None) is True
    assert RemoteSettings(None, {}).merged_forkable(Rec(forkable=False, settings_at={"forkable": 1.0})) is False
    assert RemoteSettings(replaces=True).merged_forkable(Rec(forkable=False, settings_at={"forkable": 9.0})) is None
