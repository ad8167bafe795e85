"""Servers of one model's weights with different key formats on one Redis (issue #53 item 4): their
keyspaces differ (the fingerprint includes the key format), so they share no K/V; the mixed fleet is
detected and reported, and an erasure on either reaches the other's keyspace (fleet/family.py).
Pools hold synthetic 4-bit blocks (test_remote.chain) on one real redis-server."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest

pytest.importorskip("redis", reason='the fleet extra is not installed: pip install -e ".[fleet]"')

from fleet_pools import (SECRET, fleet_pool, fp, held, put_history, redis_server, tier_maker,  # noqa: E402,F401
                         wait_for)

from vllm_mlx_persist.fleet import FleetSettings, RemoteTier  # noqa: E402


@pytest.fixture
def servers(redis_server, fp, tmp_path):
    """make(name, key_format) -> a pool of the weights `fp` storing keys as `key_format` (q4: the
    keyspace of `fp` itself; another: of a fingerprint that includes it, as the backend's)."""
    made: list = []

    def make(name: str, key_format: str):
        own = fp if key_format == "q4" else hashlib.sha256(f"{fp}\n{key_format}".encode()).hexdigest()
        pool = fleet_pool(own, tmp_path / name, tier_maker(redis_server.url, own, secret=SECRET, read_timeout_s=2.0),
                          family=(fp, key_format))
        made.append(pool)
        assert pool.fleet.family.registered.wait(20)  # its keyspace claimed (a sync thread, at start)
        return pool, own

    yield make
    for p in made:
        p.close()


def publish(redis_server, fingerprint: str, agent: str, n: int = 2) -> set:
    """An agent's history written into the keyspace of `fingerprint` (as a server of it publishes one)."""
    t = RemoteTier(FleetSettings(redis_server.url, secret=SECRET), fingerprint)
    hist = put_history(t, fingerprint, agent, n)
    t.close(2)
    return {b.block_id for b in hist}


def test_a_mixed_fleet_is_detected_and_reported(servers, caplog):
    a, _ = servers("a", "q4")
    with caplog.at_level(logging.WARNING, logger="vllm_mlx_persist.fleet"):
        b, _ = servers("b", "k8v4")
        b.fleet.family.refresh(force=True)
        a.fleet.family.refresh(force=True)
    for pool in (a, b):
        stats = pool.fleet.stats()
        assert stats["mixed_key_formats"] and stats["key_formats"] == ["k8v4", "q4"], stats
        assert stats["keyspaces_of_weights"] == 2
    assert "MIXED FLEET" in caplog.text and "'k8v4'" in caplog.text


def test_one_key_format_is_no_mixed_fleet(servers):
    a, _ = servers("a", "q4")
    b, _ = servers("b", "q4")  # the same keyspace: sharing as ever
    for pool in (a, b):
        assert pool.fleet.family.refresh(force=True) == {}
        stats = pool.fleet.stats()
        assert stats["mixed_key_formats"] is False and stats["key_formats"] == ["q4"], stats


@pytest.mark.parametrize("eraser", ["q4", "k8v4"])
def test_an_erasure_on_one_key_format_reaches_the_others(servers, redis_server, eraser):
    """B (k8v4) serves agent X; A (q4) never did. DELETE on A is not a 404, and B's next sync of X
    acts on the tombstone A's erasure wrote into B's keyspace: B holds nothing of X any more. Either way round."""
    a, fp_a = servers("a", "q4")
    b, fp_b = servers("b", "k8v4")
    eraser_pool, holder, fp_holder = (a, b, fp_b) if eraser == "q4" else (b, a, fp_a)
    ids = publish(redis_server, fp_holder, "x")
    holder.fleet._sync_agent("x")
    assert held(holder, "x") == ids
    assert eraser_pool.agent("x") is None
    assert eraser_pool.erase("x")  # known: another keyspace of the weights held it
    assert eraser_pool.fleet.tier.flush(20)
    t = RemoteTier(FleetSettings(redis_server.url, secret=SECRET), fp_holder)
    m = t.get_manifest("x")
    t.close(2)
    assert m is not None and m.erased, m
    holder.fleet._sync_agent("x")
    assert not held(holder, "x")
    assert eraser_pool.fleet.stats()["family_erasures"] == 1
    # the erasure was acknowledged and let go only once written everywhere
    assert not list((Path(eraser_pool.fleet.outbox.dir)).glob("*.json"))


def test_an_erasure_sent_again_leaves_a_history_begun_on_its_tombstone_in_another_keyspace(servers, redis_server):
    """A (q4) erases X, which B (k8v4) holds: the tombstone reaches B's keyspace, where a new history of
    X begins on it. The erasure sent to that keyspace again (a restart's outbox, a drain's retry) is
    written already there: the newer history stays."""
    import dataclasses
    import secrets

    import redis
    from fleet_pools import chain, manifest
    from test_remote import plant

    a, _ = servers("a", "q4")
    b, fp_b = servers("b", "k8v4")
    publish(redis_server, fp_b, "x")
    b.fleet._sync_agent("x")
    assert a.erase("x") and a.fleet.tier.flush(20)
    t = RemoteTier(FleetSettings(redis_server.url, secret=SECRET), fp_b)
    try:
        tomb = t.get_manifest("x")
        assert tomb is not None and tomb.erased, tomb
        hist = chain(fp_b, "x", 2, seed=5)  # B's new history, as a put of B's writes it (its blocks aside)
        plant(redis.Redis.from_url(redis_server.url), t, "x", dataclasses.replace(manifest("x", hist), era=tomb.ident),
              version=tomb.version + 1, ident=secrets.token_hex(8))
        assert not t.get_manifest("x").erased
        a.fleet.family.erase("x", tomb.ident)  # sent again
        after = t.get_manifest("x")
        assert after is not None and not after.erased, "the erasure sent again ended a newer history"
    finally:
        t.close(2)


def test_an_unknown_agent_is_still_unknown_on_every_key_format(servers):
    a, _ = servers("a", "q4")
    servers("b", "k8v4")
    assert not a.erase("nobody")


def _erasure_missing_a_keyspace(servers, redis_server, agent: str):
    """Pools a (q4) and b (k8v4); a erases `agent`, whose tombstone cannot be written into b's keyspace
    (the key holds another type: Redis answers WRONGTYPE), seen failing. Returns (a, b, client, b's key)."""
    a, _ = servers("a", "q4")
    b, _ = servers("b", "k8v4")
    client = redis_server.client()
    key_b = b.fleet.tier.manifest_key(agent)
    client.set(key_b, b"not a manifest hash")
    a.erase(agent)
    assert a.fleet.tier.flush(20)
    wait_for(lambda: a.fleet.stats()["family_erasure_failures"] >= 1, "the failed erasure in B's keyspace seen")
    return a, b, client, key_b


def test_an_erasure_that_misses_another_keyspace_stays_pending_and_is_sent_after_a_restart(servers, redis_server):
    """The outbox lets an erasure go only once every keyspace of the weights has its tombstone: one
    that cannot be written there (here: the key holds another type, so Redis answers WRONGTYPE) stays
    pending, and the next start writes it."""
    a, b, client, key_b = _erasure_missing_a_keyspace(servers, redis_server, "y")
    outbox = Path(a.fleet.outbox.dir)
    assert len(list(outbox.glob("*.json"))) == 1  # still pending
    client.delete(key_b)
    a.close()
    a, _ = servers("a", "q4")  # the same disk: its outbox queues the erasure again
    assert a.fleet.tier.flush(20)
    wait_for(lambda: list(outbox.glob("*.json")) == [], "the erasure let go of after the restart")
    m = b.fleet.tier.get_manifest("y")
    assert m is not None and m.erased


def test_a_tombstone_written_here_is_not_written_again_while_another_keyspace_waits(servers, redis_server,
                                                                                   monkeypatch):
    """An erasure whose tombstone is in this keyspace but could not reach another key format's stays
    pending, and the drain retries only the other keyspace: writing this keyspace's tombstone again
    (as an erasure never written) could end a history begun since (an independent review's finding)."""
    a, b, client, key_b = _erasure_missing_a_keyspace(servers, redis_server, "z")
    rewritten: list = []
    real = a.fleet.tier.erase
    monkeypatch.setattr(a.fleet.tier, "erase", lambda *args, **kw: rewritten.append(args) or real(*args, **kw))
    for _ in range(3):  # an erasure not queued at two drains in a row is queued again
        a.fleet.drain()
    assert rewritten == [] and len(a.fleet.outbox) == 1
    client.delete(key_b)
    a.fleet.drain()
    assert rewritten == [] and len(a.fleet.outbox) == 0
    m = b.fleet.tier.get_manifest("z")
    assert m is not None and m.erased
