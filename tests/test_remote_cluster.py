"""Fleet tier (vllm_mlx_persist/fleet/, `cluster=True`) against a real 3-master Redis Cluster: blocks spread over
the nodes, pipelined fetches across slots, the compare-and-set rules, erasure, refusal of a damaged
value, and one node killed (its keys are misses within the bound, the other nodes still serve);
then two real servers with `remote_cluster: true` moving an agent between them.

The cluster's nodes run with `cluster-require-full-coverage no`, the setting under which the other
masters keep serving their slots once a master without a replica is marked failed (docs/fleet.md)."""

from __future__ import annotations

import hashlib
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

redis = pytest.importorskip("redis", reason='the fleet extra is not installed: pip install -e ".[fleet]"')
import redis.cluster  # noqa: E402

from test_remote import SECRET, SLACK_S, chain, fp, manifest, same_block, tiers  # noqa: E402,F401 (fixtures)
from vllm_mlx_persist.fleet import FleetSettings, RemoteTier  # noqa: E402
from vllm_mlx_persist.fleet.keyspace import REMOTE_FORMAT_VERSION  # noqa: E402
from vllm_mlx_persist.disk_format import Manifest, encode_block  # noqa: E402

NODE_TIMEOUT_MS = 2000


def free_ports(n: int) -> list[int]:
    """`n` free local ports P whose cluster bus port P + 10000 is free too (so P < 55536)."""
    found: list[int] = []
    rng = random.Random()
    while len(found) < n:
        p = rng.randrange(20000, 55000)
        if p in found:
            continue
        try:
            for port in (p, p + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        found.append(p)
    return found


class RedisClusterServers:
    """Three real redis-server masters on free local ports joined by `redis-cli --cluster create`
    (no replicas, no persistence); a node can be killed."""

    def __init__(self, tmp: Path):
        server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if server is None or cli is None:
            pytest.skip("redis-server and redis-cli are needed for a Redis Cluster "
                        "(Debian: apt-get install redis-server redis-tools)")
        self.ports = free_ports(3)
        self.procs: dict[int, subprocess.Popen] = {}
        try:
            for p in self.ports:
                self.procs[p] = subprocess.Popen(
                    [server, "--port", str(p), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                     "--cluster-config-file", f"nodes-{p}.conf", "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                     "--cluster-require-full-coverage", "no", "--appendonly", "no", "--save", "",
                     "--dir", str(tmp)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for p in self.ports:
                self._wait(lambda: self.node(p).ping(), f"node {p} up")
            subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                            "--cluster-replicas", "0", "--cluster-yes"],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
            for p in self.ports:
                self._wait(lambda: self.node(p).execute_command("CLUSTER INFO")["cluster_state"] == "ok",
                           f"cluster_state:ok on {p}")
        except BaseException:
            self.stop()
            raise
        self.url = f"redis://127.0.0.1:{self.ports[0]}/0"

    @staticmethod
    def _wait(cond, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if cond():
                    return
            except redis.exceptions.RedisError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"Redis Cluster: timed out waiting for {what}")

    def node(self, port: int) -> "redis.Redis":
        """A plain client of one node (DBSIZE, CLUSTER KEYSLOT, SCRIPT FLUSH: that node only)."""
        return redis.Redis(port=port, socket_timeout=5, socket_connect_timeout=1)

    def client(self) -> "redis.cluster.RedisCluster":
        """A cluster client for raw reads and writes of any key (routed to its node)."""
        return redis.cluster.RedisCluster(host="127.0.0.1", port=self.ports[0], socket_timeout=5)

    def port_of(self, key: str) -> int:
        """The port of the node serving `key`'s slot (CLUSTER KEYSLOT, CLUSTER SLOTS)."""
        return self.port_of_slot(self.node(self.alive()[0]).execute_command("CLUSTER KEYSLOT", key))

    def port_of_slot(self, slot: int) -> int:
        n = self.node(self.alive()[0])
        for start, end, master, *_ in n.execute_command("CLUSTER SLOTS"):
            if start <= slot <= end:
                return int(master[1])
        raise AssertionError(f"slot {slot} not served")

    def alive(self) -> list[int]:
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    def kill(self, port: int) -> None:
        self.procs[port].kill()
        self.procs[port].wait()

    def wait_marked_failed(self, port: int) -> None:
        """Until the surviving masters flag the killed one as failed (after the node timeout)."""
        for p in self.alive():
            self._wait(lambda: "fail" in self.node(p).execute_command("CLUSTER NODES")[f"127.0.0.1:{port}"]["flags"]
                       .split(","), f"node {port} marked failed on {p}")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = RedisClusterServers(tmp_path_factory.mktemp("redis-cluster"))
    yield c
    c.stop()


def ctier(tiers, c: RedisClusterServers, fingerprint: str, **kw) -> RemoteTier:
    return tiers(c.url, fingerprint, cluster=True, **kw)


# ---- blocks: spread over the nodes, read back pipelined across slots -----------------------------


def test_blocks_spread_over_the_nodes_and_are_fetched_across_slots(cluster, fp, tiers):
    hist = chain(fp, "spread", 12)
    by_id = {x.block_id: x for x in hist}
    ids = list(by_id)
    a = ctier(tiers, cluster, fp)
    assert a.put(manifest("spread", hist), by_id) and a.flush(20)
    s = a.stats()
    assert (s["puts_published"], s["blocks_uploaded"], s["errors"], s["state"]) == (1, 12, 0, "ok"), s
    # where the keys landed: by slot, and by each node's own key count
    ports = {k: cluster.port_of(a.block_key(k)) for k in ids}
    assert len(set(ports.values())) >= 2, ports
    for p in cluster.ports:  # each node holds exactly the blocks of its slots
        node = cluster.node(p)
        held = {k.decode() for k in node.scan_iter(match=a.block_key("0" * 64)[:-64] + "*")}
        assert held == {a.block_key(k) for k, v in ports.items() if v == p}
        assert node.dbsize() >= len(held)
    assert sum(1 for p in cluster.ports if cluster.node(p).dbsize() > 0) >= 2

    b = ctier(tiers, cluster, fp, fetch_blocks=5)  # a second server: one block, then 5 a round trip
    m = b.get_manifest("spread")
    assert m is not None and m.block_ids == ids and m.n_tokens == 12 * 16 and m.version == 1
    got = b.get_blocks(ids)
    assert [x.block_id for x in got] == ids and all(same_block(x, by_id[x.block_id]) for x in got)
    s = b.stats()
    assert (s["fetch_round_trips"], s["hits"], s["misses"], s["refused"]) == (1 + 3, 12, 0, 0), s
    # GETEX refreshed the TTL on every node
    assert all(0 < cluster.client().ttl(a.block_key(k)) <= a.settings.block_ttl_s for k in ids)
    # a second server storing the same history stores nothing again
    assert b.put(manifest("spread", hist), by_id) and b.flush(20)
    s = b.stats()
    assert (s["blocks_uploaded"], s["blocks_present"], s["puts_same"]) == (0, 12, 1), s
    # a missing block in the middle: the prefix before it
    cluster.client().delete(a.block_key(ids[7]))
    assert [x.block_id for x in b.get_blocks(ids)] == ids[:7]


# ---- manifests: compare-and-set, erasure ---------------------------------------------------------


def test_conflict_rule_on_a_cluster(cluster, fp, tiers):
    hist = chain(fp, "cas", 6)
    blocks = {x.block_id: x for x in hist}
    a, b = ctier(tiers, cluster, fp), ctier(tiers, cluster, fp)
    assert a.put(manifest("cas", hist[:4]), blocks) and a.flush(10)  # v1

    def late(m: Manifest) -> Manifest:  # a put of a turn made before v1 was
        m.updated_at -= 100
        return m

    assert b.put(late(manifest("cas", hist[:3])), blocks) and b.flush(10)  # stale base, held by v1: kept out
    assert b.stats()["puts_kept_other"] == 1 and len(b.get_manifest("cas").block_ids) == 4
    assert b.put(manifest("cas", hist[:5]), blocks) and b.flush(10)  # stale base, continues v1: merged
    assert b.get_manifest("cas").version == 2 and b.stats()["puts_merged"] == 1
    assert b.put(manifest("cas", hist[:2]), blocks) and b.flush(10)  # sequential successor: a rewind wins
    m = a.get_manifest("cas")
    assert (m.version, len(m.block_ids), m.n_tokens) == (3, 2, 32)
    assert a.put(late(manifest("cas", hist[:1])), blocks) and a.flush(10)  # stale base (v1), held: kept out
    assert a.stats()["puts_kept_other"] == 1 and a.get_manifest("cas").version == 3
    x = chain(fp, "cas", 1, seed=7, after=hist[0])
    assert a.put(manifest("cas", hist[:1] + x), {**blocks, x[0].block_id: x[0]}) and a.flush(10)
    m = a.get_manifest("cas")  # stale base, diverging: merged in beside the rewind, nothing lost
    assert m.version == 4 and [br["n_tokens"] for br in m.branches] == [32, 32] and a.stats()["puts_merged"] == 1


def test_erasure_on_a_cluster(cluster, fp, tiers):
    hist = chain(fp, "gone", 3)
    blocks = {x.block_id: x for x in hist}
    erased_seen = []
    a = ctier(tiers, cluster, fp)
    b = ctier(tiers, cluster, fp, on_erased=lambda agent, ident: erased_seen.append((agent, ident)))
    assert b.put(manifest("gone", hist[:2]), blocks) and b.flush(10)
    assert a.get_manifest("gone").version == 1
    assert a.erase("gone") and a.flush(10)
    m = a.get_manifest("gone")
    assert m.erased and m.block_ids == [] and m.version == 2
    assert 0 < cluster.client().ttl(a.manifest_key("gone")) <= a.settings.tombstone_ttl_s
    # B published before the erasure: its next put is refused and tells it so
    assert b.put(manifest("gone", hist), blocks) and b.flush(10)
    assert b.stats()["puts_erased"] == 1 and erased_seen == [("gone", m.ident)] and a.get_manifest("gone").erased
    # having erased its copy because of it, B starts a new history under the same id
    assert b.erased_locally("gone", m.ident)
    new = chain(fp, "gone", 1, seed=7)
    assert b.put(manifest("gone", new), {x.block_id: x for x in new}) and b.flush(10)
    m = a.get_manifest("gone")
    assert not m.erased and m.block_ids == [new[0].block_id] and m.version == 3


def test_damaged_block_is_refused_and_deleted_on_its_node(cluster, fp, tiers):
    hist = chain(fp, "dmg", 3)
    by_id = {x.block_id: x for x in hist}
    a = ctier(tiers, cluster, fp, block_source=by_id.get)
    assert a.put(manifest("dmg", hist), by_id) and a.flush(10)
    key = a.block_key(hist[1].block_id)
    node = cluster.node(cluster.port_of(key))
    value = node.get(key)
    node.setrange(key, len(value) - 3, bytes([value[-3] ^ 0x10]))  # one flipped bit, on the key's node
    assert [x.block_id for x in a.get_blocks(list(by_id))] == [hist[0].block_id]
    assert a.stats()["refused"] == 1 and node.get(key) is None  # deleted by the script on that node
    assert a.put(manifest("dmg", hist)) and a.flush(10)  # healed from the local store
    assert same_block(a.get_block(hist[1].block_id), hist[1])


def test_authenticated_tiers_on_a_cluster(cluster, fp, tiers):
    hist = chain(fp, "auth", 4)
    by_id = {x.block_id: x for x in hist}
    a = ctier(tiers, cluster, fp, secret=SECRET, block_source=by_id.get)
    b = ctier(tiers, cluster, fp, secret=SECRET)
    assert a.put(manifest("auth", hist), by_id) and a.flush(10)
    assert [x.block_id for x in b.get_blocks(list(by_id))] == list(by_id) and b.get_manifest("auth") is not None
    assert ctier(tiers, cluster, fp).get_manifest("auth") is None  # no secret: another keyspace
    # a block planted under its id without the MAC: refused and deleted on its node, healed by a put
    key = a.block_key(hist[2].block_id)
    node = cluster.node(cluster.port_of(key))
    node.set(key, encode_block(hist[2]))
    assert len(b.get_blocks(list(by_id))) == 2 and node.get(key) is None and b.stats()["refused_mac"] == 1
    assert a.put(manifest("auth", hist)) and a.flush(10)
    assert same_block(b.get_block(hist[2].block_id), hist[2])


# ---- faults --------------------------------------------------------------------------------------


def test_unreachable_cluster_at_start_is_a_miss_then_connects(tmp_path, fp, tiers):
    port = free_ports(1)[0]
    t = tiers(f"redis://127.0.0.1:{port}/0", fp, cluster=True, read_timeout_s=0.5, connect_timeout_s=0.2,
              breaker_failures=100, max_attempts=1)
    t0 = time.monotonic()
    assert t.get_manifest("x") is None and t.get_block("ab" * 32) is None
    assert time.monotonic() - t0 < 2 * 0.5 + SLACK_S
    assert t.put(manifest("x", chain(fp, "x", 1))) and t.flush(10)
    s = t.stats()
    assert s["errors"] >= 2 and s["put_failures"] == 1 and s["state"] == "unreachable", s
    with pytest.raises(ValueError, match="database 0"):
        RemoteTier(FleetSettings(f"redis://127.0.0.1:{port}/3", cluster=True), fp)
    with pytest.raises(ValueError, match="unix"):
        RemoteTier(FleetSettings("unix:///tmp/redis.sock", cluster=True), fp)


def test_one_node_killed_its_keys_are_misses_the_others_still_serve(tmp_path, fp, tiers):
    c = RedisClusterServers(tmp_path)
    try:
        _one_node_killed(c, fp, tiers)
    finally:
        c.stop()


def _one_node_killed(c: RedisClusterServers, fp: str, tiers) -> None:
    bound = 0.5
    kw = dict(read_timeout_s=bound, connect_timeout_s=0.2, write_timeout_s=1.0, max_attempts=1)
    # The node to kill: the one the tier's URL names, and the client's first "default node" (slot 0's
    # master); not the one holding the model key (a server's first command checks it, docs/fleet.md).
    victim = c.port_of_slot(0)
    fp = next(f for f in (hashlib.sha256(f"{fp}{i}".encode()).hexdigest() for i in range(100))
              if c.port_of(f"vmp:{f[:32]}:r{REMOTE_FORMAT_VERSION}:model") != victim)
    a = tiers(f"redis://127.0.0.1:{victim}/0", fp, cluster=True, **kw)
    model_port = c.port_of(a.keys.model)
    assert model_port != victim
    agents = {f"agent-{i}": chain(fp, f"agent-{i}", 2, seed=i) for i in range(12)}
    for name, hist in agents.items():
        assert a.put(manifest(name, hist), {x.block_id: x for x in hist})
    assert a.flush(30) and a.stats()["puts_published"] == 12
    # Only the writer's client exists yet; the reader's is made after the kill, from the nodes the
    # writer's discovered (the URL's node is dead by then).
    c.kill(victim)
    block_ids = [x.block_id for hist in agents.values() for x in hist]
    dead = [b for b in block_ids if c.port_of(a.block_key(b)) == victim]
    live = [b for b in block_ids if c.port_of(a.block_key(b)) != victim]
    assert dead and live
    live_agents = [n for n in agents if c.port_of(a.manifest_key(n)) != victim]
    dead_agents = [n for n in agents if c.port_of(a.manifest_key(n)) == victim]
    assert live_agents

    def check_reads(tier: RemoteTier) -> None:
        # Interleaved: the tier's breaker counts consecutive failures (docs/fleet.md, Cluster)
        for d, l in zip(dead, live):
            t0 = time.monotonic()
            assert tier.get_block(d) is None  # no exception, within the bound
            assert time.monotonic() - t0 < bound + SLACK_S
            got = tier.get_block(l)
            assert got is not None and got.block_id == l, tier.stats()
        for n in live_agents[:3]:
            m = tier.get_manifest(n)
            assert m is not None and m.block_ids == [x.block_id for x in agents[n]]
        for n in dead_agents[:1]:
            t0 = time.monotonic()
            assert tier.get_manifest(n) is None
            assert time.monotonic() - t0 < bound + SLACK_S

    check_reads(a)  # at once
    c.wait_marked_failed(victim)
    check_reads(a)  # and once the other masters have marked it failed
    s = a.stats()
    assert s["hits"] >= 2 * min(len(dead), len(live)) and s["errors"] + s["timeouts"] >= 1, s

    # A server started now (its client discovers the nodes from a live one) reads and publishes on
    # the live nodes, even with the scripts flushed there: a script never needs the dead node.
    for p in c.alive():
        c.node(p).script_flush()
    b = tiers(f"redis://127.0.0.1:{model_port}/0", fp, cluster=True, **kw)
    check_reads(b)
    n = next(n for n in live_agents
             if all(c.port_of(a.block_key(x.block_id)) != victim for x in agents[n]))
    longer = agents[n] + chain(fp, n, 1, seed=99, after=agents[n][-1])
    while c.port_of(a.block_key(longer[-1].block_id)) == victim:  # its new block on a live node too
        longer = agents[n] + chain(fp, n, 1, seed=int(time.monotonic_ns() % 10**6), after=agents[n][-1])
    assert b.put(manifest(n, longer), {x.block_id: x for x in longer}) and b.flush(10)
    assert b.stats()["puts_merged"] == 1, b.stats()  # no successor (B never saw it): merged, and it holds A's
    assert a.get_manifest(n).block_ids == [x.block_id for x in longer]


# ---- end to end: two real servers on the cluster ---------------------------------------------------


def published(c: RedisClusterServers, agent: str, n_tokens: int) -> bool:
    """Whether the agent's manifest (any model prefix, on whichever node) names at least n_tokens."""
    client = c.client()
    for key in client.scan_iter(match="vmp:*:a:" + hashlib.sha256(agent.encode()).hexdigest()):
        return int(client.hget(key, "n") or -1) >= n_tokens
    return False


def test_agent_moves_between_two_servers_over_a_cluster(cluster, tmp_path):
    """Turns 1-2 on server A, turn 3 on server B (`remote_cluster: true`, each given another node's
    URL): B reuses everything A computed, and answers as a one-server conversation does."""
    from test_e2e_fleet import BLOCK, KEY, Conversation, options, remote, wait_for
    from vllm_mlx_persist.tools.models.build import build_model_dir
    from vllm_mlx_persist.tools.serving import Server

    model = build_model_dir(tmp_path / "model", arch="llama", size="tiny", seed=0)
    servers = []
    for name, port in (("a", cluster.ports[0]), ("b", cluster.ports[1])):
        opts = {**options(tmp_path / f"{name}-cache", f"redis://127.0.0.1:{port}/0"), "remote_cluster": True}
        servers.append(Server(model, tmp_path / name, options=opts, extra_args=("--api-key", KEY)))
    a, b = servers
    try:
        a.start()
        b.start()
        ref = Conversation("ref-cluster", "cluster")
        moved = Conversation("moved-cluster", "cluster")
        for _ in range(3):
            ref.turn(a)
        moved.turn(a)
        moved.turn(a)
        wait_for(lambda: published(cluster, "moved-cluster", moved.prompts[1]), "A's turn 2 in the cluster")
        moved.turn(b)
        assert moved.outputs == ref.outputs and moved.cached == ref.cached, (moved.cached, ref.cached)
        assert moved.cached[2] >= moved.prompts[1], moved.cached
        s = remote(b)
        assert s["agents_fetched"] >= 1 and s["blocks_fetched"] >= moved.prompts[1] // BLOCK, s
        assert (s["refused"], s["errors"], s["state"]) == (0, 0, "ok"), s
        # the blocks landed on more than one node of the cluster
        assert sum(1 for p in cluster.ports if cluster.node(p).dbsize() > 0) >= 2
    finally:
        a.stop()
        b.stop()
