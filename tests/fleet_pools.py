"""Pools with a fleet tier on one real redis-server, for the fleet tests (test_fleet_*.py): the module's
Redis, servers behind partition proxies (tools/reliability/partition.py) that a test cuts and heals,
plain tiers that write into Redis as a server with no pool here would, and the waits and flushes those
tests share. A test module imports the fixtures it uses by name (pytest finds them there); the building
blocks of test_remote.py (synthetic 4-bit blocks, fleet_pool, held) come through here too."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from test_remote import (SECRET, RedisServer, chain, fleet_pool, fp, held, manifest,  # noqa: F401 (re-exported)
                         wait_for)

from vllm_mlx_persist.disk_format import BlockData
from vllm_mlx_persist.fleet import FleetSettings, RemoteTier
from vllm_mlx_persist.tools.reliability.partition import PartitionProxy

# A server behind a proxy gives up fast once cut off: its breaker opens at the first failure and
# closes again soon after the heal (FleetSettings fields).
PARTITIONED = {"secret": SECRET, "breaker_failures": 1, "breaker_open_s": 0.2, "backoff_s": 0.05,
               "backoff_max_s": 0.2, "read_timeout_s": 1.0}


def tier_maker(url: str, fingerprint: str, **settings) -> Callable[..., RemoteTier]:
    """A pool's make_tier (fleet.Fleet): a RemoteTier on `url` with these FleetSettings fields."""
    return lambda **cb: RemoteTier(FleetSettings(url, **settings), fingerprint, **cb)


def put_history(tier: RemoteTier, fingerprint: str, agent: str, n: int = 2, seed: int = 0) -> list[BlockData]:
    """`agent`'s history of `n` synthetic blocks put into Redis by `tier` and flushed; its blocks."""
    hist = chain(fingerprint, agent, n, seed=seed)
    assert tier.put(manifest(agent, hist), {b.block_id: b for b in hist}) and tier.flush(10)
    return hist


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    srv = RedisServer(tmp_path_factory.mktemp("redis"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def model():
    """A tiny llama of random weights, for pools whose turns run on real MLX (FleetPools.model_server)."""
    from vllm_mlx_persist.tools.models.build import build_model

    m, _ = build_model("llama", "tiny", seed=0)
    return m


class FleetPools:
    """Servers of the weights `fp` on one Redis, each a pool with its own disk under `root`/name and its
    own proxy to the Redis (cut one: that server alone is partitioned); what it made goes at close()."""

    def __init__(self, redis: RedisServer, fp: str, root: Path):
        self.redis, self.fp, self.root = redis, fp, root
        self.made: list = []
        self.proxies: list[PartitionProxy] = []

    def proxy(self) -> PartitionProxy:
        p = PartitionProxy("127.0.0.1", self.redis.port)
        self.proxies.append(p)
        return p

    def server(self, name: str, proxy: PartitionProxy | None = None, clock=None, settings: dict = PARTITIONED):
        """(pool of synthetic blocks, its proxy): a new proxy unless given one (a restart keeps it);
        `settings`: the FleetSettings fields of its tier; `clock`: the pool's, default time.time."""
        proxy = proxy or self.proxy()
        pool = fleet_pool(self.fp, self.root / name, tier_maker(proxy.url, self.fp, **settings),
                          **({"clock": clock} if clock else {}))
        self.made.append(pool)
        return pool, proxy

    def synced_servers(self, agent: str, *names: str) -> list:
        """server(name)'s pool for each of `names`, then each syncs `agent` (held in Redis) in turn."""
        pools = [self.server(name)[0] for name in names]
        for pool in pools:
            pool.fleet._sync_agent(agent)
        return pools

    def model_server(self, name: str, model, proxy: PartitionProxy | None = None, clock=None, **settings):
        """server() for a pool of `model` (its turns made on real MLX, test_forget._turn), whose tier gives
        a put up after two attempts; `settings`: more FleetSettings fields."""
        from test_pool import make_pool

        from vllm_mlx_persist.fleet import Fleet

        proxy = proxy or self.proxy()
        make_tier = tier_maker(proxy.url, self.fp, **{**PARTITIONED, "max_attempts": 2, **settings})
        pool = make_pool(model, self.root / name, fingerprint=self.fp, fleet=lambda p: Fleet(p, make_tier),
                         **({"clock": clock} if clock else {}))
        self.made.append(pool)
        return pool, proxy

    def tier(self) -> RemoteTier:
        """A plain tier straight to the Redis (no proxy): another server, or a look at what Redis holds."""
        t = RemoteTier(FleetSettings(self.redis.url, secret=SECRET), self.fp)
        self.made.append(t)
        return t

    def close(self) -> None:
        for p in self.proxies:
            p.heal()
        for x in self.made:
            try:
                x.close() if hasattr(x, "load_manifests") else x.close(2)
            except Exception:
                pass
        for p in self.proxies:
            p.close()


@pytest.fixture
def fleet(redis_server, fp, tmp_path):
    """FleetPools on the module's Redis, its servers' disks under tmp_path."""
    f = FleetPools(redis_server, fp, tmp_path)
    yield f
    f.close()


def settle(pool) -> None:
    """The pool's queued disk writes and the fleet's queued puts done."""
    pool.flush(30)
    assert pool.fleet.tier.flush(30)


def reaches_redis(pool, agent: str) -> None:
    """Wait until the pool's tier reads the agent's manifest again (after a heal: its breaker closed)."""
    wait_for(lambda: pool.fleet.tier.get_manifest(agent) is not None, "the healed server to reach Redis")


def republish(pool, agent: str) -> None:
    """What the agent's next turn's save does to its record: saved locally, then published."""
    with pool.core.lock:
        rec = pool.agent(agent)
        pool.core.save(rec, [], {}, [], list(rec.branches))
    settle(pool)


def crash(pool) -> None:
    """kill -9, as far as the fleet can tell: its threads stop, the writer's queue vanishes unsent (no
    close(), no flush), and the disk is left as it is."""
    pool.fleet.stop()
    writer = pool.fleet.tier.writer
    with writer._cond:
        writer._state.stop = True
        writer._q.clear()
        writer._cond.notify_all()
    pool.persister.close()


def shared_history(writer, reader, model, agent: str = "x") -> tuple[list, list, list, list[str]]:
    """`agent`'s turn of head + span + tail (test_forget._history) made on `writer` and published, then
    synced by `reader`: (head, span, tail, the block ids of the branch it wrote)."""
    from test_forget import _history, _turn

    head, span, tail = _history()
    _turn(writer, model, agent, head + span + tail, "r1")
    settle(writer)
    reader.fleet._sync_agent(agent)
    return head, span, tail, list(writer.agent(agent).branches[-1].block_ids)
