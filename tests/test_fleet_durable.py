"""The fleet's outbox keeps every acknowledged removal and setting, and only those, within its bound
(fleet/outbox.py, fleet/sync.py): settings durable like forgets, a file that cannot be removed still
counted, a restart that records nothing Redis already has, and an erasure sent again after its
tombstone that leaves a history begun on that tombstone alone. Real Redis, real pools, crashes as
fleet_pools.crash makes them."""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path

import pytest

pytest.importorskip("redis", reason='the fleet extra is not installed: pip install -e ".[fleet]"')

from fleet_pools import (PARTITIONED, chain, crash, fleet, fp, held, manifest, model,  # noqa: E402,F401
                         put_history, redis_server, settle, wait_for)


def test_settings_acknowledged_before_a_crash_reach_the_fleet_after_the_restart(fleet, fp):
    """A, cut off from Redis, refuses forks of P and pins it (both acknowledged: durable locally), and
    is killed before its put reaches Redis; Redis comes back and A restarts. Nothing asks A for P
    again, yet both settings must reach Redis from A's outbox."""
    w = fleet.tier()
    put_history(w, fp, "p")
    settings = {**PARTITIONED, "outbox_retry_s": 0.2}
    a, proxy = fleet.server("a", settings=settings)
    a.fleet._sync_agent("p")
    assert held(a, "p")
    proxy.cut()
    assert a.set_forkable("p", False) and a.set_pinned("p", True)
    crash(a)
    proxy.heal()
    rm = w.get_manifest("p")
    assert rm.forkable is None and not rm.pinned  # neither reached Redis before the kill
    again, _ = fleet.server("a", proxy, settings=settings)  # restarted; P is never asked for
    wait_for(lambda: (m := w.get_manifest("p")) is not None and m.forkable is False and m.pinned,
             "the settings in Redis from the outbox", timeout=15)
    wait_for(lambda: not again.fleet.outbox.forgets(), "the outbox letting go of the settings' publish")


def test_an_outbox_file_that_cannot_be_removed_stays_counted(tmp_path, monkeypatch):
    """An entry whose file's unlink fails (EACCES) is still pending: it counts toward the bound, and
    the next done removes it."""
    from vllm_mlx_persist.fleet import outbox as ob

    box = ob.Outbox(tmp_path / "outbox", bound=2)
    box.add("a", "e1")
    box.add("b", "e2")
    real = Path.unlink

    def refuse(self, *args, **kw):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "unlink", refuse)
    with contextlib.suppress(OSError):  # the writer's callback logs what it raises, and goes on
        box.done("a", "e1")
    files = list(box.dir.glob("*.json"))
    assert len(box) == len(files) == 2 and box.full(), "the count disagrees with the files"
    monkeypatch.setattr(Path, "unlink", real)
    box.done("a", "e1")
    assert len(box) == len(list(box.dir.glob("*.json"))) == 1 and not box.full()



def test_an_older_erasure_left_on_disk_is_never_sent_again(tmp_path, monkeypatch):
    """P erased (e1), written again, erased again (e2) while e1's file cannot be removed: only e2 is
    ever pending to send, running or after a restart (sent again, e1 would end what was written after
    e2); e2's done keeps e2 until e1's file is gone, so e1 never becomes P's newest."""
    from vllm_mlx_persist.fleet import outbox as ob

    box = ob.Outbox(tmp_path / "outbox", bound=10)
    box.add("p", "e1")
    real = Path.unlink

    def refuse(self, *args, **kw):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "unlink", refuse)
    box.add("p", "e2")  # e1's file stays
    assert len(box) == 2 and box.erasures() == [("p", "e2")]
    box.done("p", "e2")  # in Redis; e1's file still cannot go, so e2's stays too
    assert box.erasures() == [("p", "e2")]
    assert ob.Outbox(tmp_path / "outbox", bound=10).pending() == [("p", "e2")]  # a restart sends e2 only
    monkeypatch.setattr(Path, "unlink", real)
    box.done("p", "e2")
    assert len(box) == 0 and box.erasures() == [] and not list(box.dir.glob("*.json"))

def test_a_publish_past_the_bound_is_refused_unless_it_supersedes_one(tmp_path):
    """At the bound the outbox is full (admission answers 503), yet a save admitted before it filled
    still lands (its removal was acknowledged); add_forget refuses a new agent's entry at twice the
    bound (nothing grows the outbox past it); a later publish of an agent already pending replaces its
    entry and is taken."""
    from vllm_mlx_persist.fleet import outbox as ob

    box = ob.Outbox(tmp_path / "outbox", bound=2)
    box.add("a", "e1")
    box.add_forget("b", 1.0)
    assert box.full()
    box.add_forget("c", 1.0)
    box.add_forget("d", 1.0)
    with pytest.raises(ob.OutboxFull):
        box.add_forget("e", 1.0)
    box.add_forget("b", 2.0)
    assert len(box) == len(list(box.dir.glob("*.json"))) == 4
    assert box.forgets() == {"b": 2.0, "c": 1.0, "d": 1.0}


def _forget_published(server, model) -> list[int]:
    """X's history on `server`, a span of it forgotten, and the forget's publish in Redis (let go of by
    the outbox); X's tokens after the forget."""
    from test_forget import _history, _turn

    from vllm_mlx_persist.kv_edit import FORGET

    head, span, tail = _history()
    _turn(server, model, "x", head + span + tail, "r1")
    _, _, seq = _turn(server, model, "x", head + tail, "r2", edit=FORGET)
    settle(server)
    wait_for(lambda: not server.fleet.outbox.forgets(), "the forget's publish let go of once in Redis")
    return seq


def _cut_off_turn_records_nothing(server, proxy, model, seq: list[int], why: str) -> None:
    """X's next plain turn on `server`, saved while it is cut off from Redis: its record's removal is
    in Redis already, so nothing enters the outbox (bound: one) and the next removal is taken."""
    from test_forget import _turn
    from test_pool import tokens

    proxy.cut()
    _turn(server, model, "x", seq + tokens(20, seed=9), "r3")
    server.flush(30)
    assert len(server.fleet.outbox) == 0 and server.fleet.counts["forgets_recorded"] == 0, why
    assert server.fleet.removal_room()


def test_a_restart_records_no_publish_of_what_redis_already_has(fleet, model):
    """A forgets a span and its publish reaches Redis; A restarts (bound: one pending removal) and the
    agent's next plain turn is saved while A is cut off. Its record still holds the old removal, which
    Redis has: nothing enters the outbox, and the next removal is taken, not refused."""
    a, pa = fleet.model_server("a", model, max_erasures=1)
    seq = _forget_published(a, model)
    a.close()
    a, _ = fleet.model_server("a", model, pa, max_erasures=1)  # restarted on the same disk
    _cut_off_turn_records_nothing(a, pa, model, seq, "the restart recorded again a publish Redis already had")


def test_an_adopted_record_records_no_publish_of_what_redis_already_has(fleet, model):
    """B forgets a span of X and its publish reaches Redis; A adopts X from Redis, and X's next plain
    turn on A is saved while A is cut off. The record holds B's removal, which Redis has: nothing
    enters A's outbox (bound: one pending removal), and the next removal is taken, not refused."""
    b, _ = fleet.model_server("b", model)
    seq = _forget_published(b, model)
    a, pa = fleet.model_server("a", model, max_erasures=1)
    a.fleet._sync_agent("x")
    wait_for(lambda: held(a, "x"), "A adopting X from Redis")
    _cut_off_turn_records_nothing(a, pa, model, seq,
                                  "an adopted record's removal, which Redis has, was recorded as a pending publish")


def test_an_erasure_sent_again_after_its_tombstone_leaves_a_newer_history_alone(fleet, fp):
    """A erases P; its tombstone is written, and A is killed before its outbox lets the erasure go.
    Another server reads the tombstone and starts a new history of P on it. A restarts and sends the
    erasure again: it is in Redis already (the history follows it), so the new history stays."""
    w = fleet.tier()
    put_history(w, fp, "p")
    a, proxy = fleet.server("a")
    a.fleet._sync_agent("p")
    assert held(a, "p")
    a.fleet.outbox.done = lambda namespace, era: None  # killed before the outbox let it go
    assert a.erase("p", 30)
    settle(a)
    tomb = w.get_manifest("p")
    assert tomb.erased and a.fleet.outbox.pending() == [("p", tomb.ident)]
    crash(a)

    b = fleet.tier()  # another server: it erased its copy for the tombstone, then serves a new turn
    assert b.get_manifest("p").erasure == tomb.ident and b.erased_locally("p", tomb.ident)
    new = chain(fp, "p", 2, seed=7)
    assert b.put(manifest("p", new), {x.block_id: x for x in new}) and b.flush(10)
    m = w.get_manifest("p")
    assert not m.erased and m.era == tomb.ident

    again, _ = fleet.server("a", proxy)
    wait_for(lambda: not again.fleet.outbox.pending(), "the erasure let go of after the restart")
    m = w.get_manifest("p")
    assert m is not None and not m.erased, "the erasure sent again ended the history begun on its tombstone"
    assert set(m.block_ids) == {x.block_id for x in new}
    again.fleet._sync_agent("p")
    assert held(again, "p") == {x.block_id for x in new}
