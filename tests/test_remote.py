"""Fleet tier (vllm_mlx_persist/fleet/) against a real redis-server: bytes, sharing, compare-and-set, refusal of bad
values, erasure across servers, and every fault (killed, hung, restarted Redis) without an exception
reaching the caller and within the stated time bound."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from vllm_mlx_persist.store import DiskStore

try:
    from vllm_mlx_persist.disk_format import BlockData, Manifest, encode_block
except ImportError:  # OLD_BUILD_SCRIPT imports this module against builds from before disk_format.py
    from vllm_mlx_persist.store import BlockData, Manifest, encode_block

redis = pytest.importorskip("redis", reason='the fleet extra is not installed: pip install -e ".[fleet]"')

try:
    from vllm_mlx_persist.fleet import FleetSettings, RemoteTier  # noqa: E402
except ImportError:  # OLD_BUILD_SCRIPT imports this module against builds from before the fleet package
    from vllm_mlx_persist.remote import RemoteTier  # noqa: E402

TOKENS_PER_BLOCK = 16
# Generous: a bound is a property we check, not a timing; CI machines are shared and slow.
SLACK_S = 1.5
HANG_S = 30.0  # `returns`' deadline: it only turns a hang into a failure


def returns(fn, *args):
    """fn(*args) on a thread, which must return (a call that waited on a hung Redis for good fails the
    test instead of hanging it); its result. Used where Redis is dead or hung: the call's bound is
    proven by it returning at all, and by the counters saying how it ended, not by a stopwatch."""
    out: list = []
    err: list = []

    def run() -> None:
        try:
            out.append(fn(*args))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            err.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG_S)
    assert not t.is_alive(), f"{getattr(fn, '__qualname__', fn)} did not return within {HANG_S} s (a hang)"
    if err:
        raise err[0]
    return out[0]


class RedisServer:
    """A real redis-server on a free local port, without persistence; can be killed, hung, restarted."""

    def __init__(self, tmp: Path, *args: str):
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.skip("redis-server is not installed (Debian: apt-get install redis-server; "
                        "./dev test installs it when run as root)")
        self.exe, self.dir, self.args = exe, tmp, list(args)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.dir), *self.args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        for _ in range(100):
            try:
                if client.ping():
                    client.close()
                    return
            except redis.exceptions.AuthenticationError:
                return  # up, and asking for a password
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def client(self) -> "redis.Redis":
        return redis.Redis(port=self.port, socket_timeout=5)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = RedisServer(tmp_path_factory.mktemp("redis"))
    yield srv
    srv.stop()


@pytest.fixture
def own_server(tmp_path):
    """A server of this test's own, for tests that kill or hang it."""
    srv = RedisServer(tmp_path)
    yield srv
    srv.stop()


@pytest.fixture
def fp(request) -> str:
    """A fingerprint per test, so tests sharing the module's Redis never see each other's keys."""
    return hashlib.sha256(request.node.nodeid.encode()).hexdigest()


# What a RemoteTier is given beside its settings (the fleet glue's callbacks, and what a merge keeps).
TIER_ARGS = ("block_source", "on_erased", "on_erase_done", "on_put_done", "branches", "keep_continued")


@pytest.fixture
def tiers():
    """make(url, fingerprint, **kw): a RemoteTier; `kw` are FleetSettings fields and TIER_ARGS."""
    made = []

    def make(url: str, fingerprint: str, **kw) -> RemoteTier:
        args = {k: kw.pop(k) for k in TIER_ARGS if k in kw}
        t = RemoteTier(FleetSettings(url, **kw), fingerprint, **args)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close(2)


def seed_of(fingerprint: str, agent: str, prev: str | None = None) -> str:
    """The chain link into `agent` (docs/disk-format.md): its seed, or `prev` re-seeded with it."""
    seed = hashlib.sha256(f"{fingerprint}\n{agent}".encode()).hexdigest()
    return seed if prev is None else hashlib.sha256(bytes.fromhex(prev) + bytes.fromhex(seed)).hexdigest()


def chain(fingerprint: str, agent: str, n_blocks: int, seed: int = 0, after: BlockData | None = None,
          ) -> list[BlockData]:
    """Blocks shaped as the pool makes them (2 layers, 2 KV heads, head_dim 32, 4-bit, bfloat16
    scales/biases as raw uint16), with chained ids like pool.block_id: seeded with the agent, or
    continuing from block `after` re-seeded with the agent (a fork's or a branch's own blocks)."""
    rng = np.random.default_rng(seed)
    prev = seed_of(fingerprint, agent, after.block_id if after is not None else None)
    out = []
    for i in range(n_blocks):
        tokens = np.arange(i * TOKENS_PER_BLOCK, (i + 1) * TOKENS_PER_BLOCK, dtype=np.int32) + seed * 1000
        h = hashlib.sha256(bytes.fromhex(prev))
        h.update(tokens.tobytes())
        bid = prev = h.hexdigest()
        arrays, dtypes = {}, {}
        for l in range(2):
            for kv in "kv":
                arrays[f"{l}.{kv}.q"] = rng.integers(0, 2**32, (1, 2, TOKENS_PER_BLOCK, 4), dtype=np.uint32)
                for part in "sb":
                    arrays[f"{l}.{kv}.{part}"] = rng.integers(0, 2**16, (1, 2, TOKENS_PER_BLOCK, 1), dtype=np.uint16)
                    dtypes[f"{l}.{kv}.{part}"] = "bfloat16"
        out.append(BlockData(bid, tokens, arrays, dtypes))
    return out


def wait_for(cond, what: str, timeout: float = 30.0) -> None:
    """Poll `cond` until true; the deadline only turns a hang into a failure."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.01)


def slow_source(blocks: dict[str, BlockData], delay_s: float):
    """A local store that takes `delay_s` per block read (a slow disk)."""
    def read(block_id: str):
        time.sleep(delay_s)
        return blocks.get(block_id)
    return read


def manifest(agent: str, blocks: list[BlockData]) -> Manifest:
    return Manifest(agent, [b.block_id for b in blocks], sum(len(b.tokens) for b in blocks), time.time())


def plant(client, tier: RemoteTier, agent: str, m: Manifest | None = None, *, key: str | None = None,
          version: int = 1, ident: str = "ab" * 8, body: bytes | None = None, tagger: RemoteTier | None = None) -> None:
    """Write an agent's manifest (None: a tombstone) straight into Redis, tagged as `tagger` (default
    `tier`) tags values: what any holder of its secret (or anyone, for an unauthenticated tier) can write."""
    from vllm_mlx_persist.fleet.manifests import digest

    key = key or tier.manifest_key(agent)
    tagger = tagger or tier
    if m is None:
        fields = tagger.manifests.fields(key, version, ident, True)
    else:
        body = tier.manifests.body(m) if body is None else body
        fields = tagger.manifests.fields(key, version, ident, False, m.n_tokens, digest(m), body)
    client.delete(key)
    client.hset(key, mapping=dict(zip(fields[::2], fields[1::2])))


def same_block(a: BlockData, b: BlockData) -> bool:
    return (a.block_id == b.block_id and np.array_equal(a.tokens, b.tokens) and a.dtypes == b.dtypes
            and a.arrays.keys() == b.arrays.keys()
            and all(a.arrays[k].dtype == b.arrays[k].dtype and np.array_equal(a.arrays[k], b.arrays[k])
                    for k in a.arrays))


# ---- bytes and sharing -----------------------------------------------------------------------------


def test_block_round_trip_is_the_disk_file(server, fp, tiers, tmp_path):
    blocks = chain(fp, "agent-1", 3)
    a = tiers(server.url, fp)
    assert a.put(manifest("agent-1", blocks), {b.block_id: b for b in blocks})
    assert a.flush(10)
    disk = DiskStore(tmp_path / "cache", fp, {}, {})
    raw = server.client()
    for b in blocks:
        disk.write_block(b)
        assert raw.get(a.block_key(b.block_id)) == disk.block_path(b.block_id).read_bytes()
    b_tier = tiers(server.url, fp)  # a second server
    m = b_tier.get_manifest("agent-1")
    assert m is not None and m.block_ids == [b.block_id for b in blocks] and m.n_tokens == 48 and m.version == 1
    for b in blocks:
        got = b_tier.get_block(b.block_id)
        assert got is not None and same_block(got, b) and encode_block(got) == encode_block(b)
    s = b_tier.stats()
    assert (s["hits"], s["misses"], s["refused"], s["connected"]) == (3, 0, 0, True)
    assert b_tier.get_block("ab" * 32) is None and b_tier.stats()["misses"] == 1
    assert b_tier.get_manifest("nobody") is None


def test_two_servers_store_a_block_once(server, fp, tiers):
    blocks = chain(fp, "shared", 4)
    a, b = tiers(server.url, fp), tiers(server.url, fp)
    assert a.put(manifest("shared", blocks), {x.block_id: x for x in blocks}) and a.flush(10)
    assert b.put(manifest("shared", blocks), {x.block_id: x for x in blocks}) and b.flush(10)
    sa, sb = a.stats(), b.stats()
    assert (sa["blocks_uploaded"], sb["blocks_uploaded"], sb["blocks_present"]) == (4, 0, 4)
    assert sb["puts_same"] == 1 and sb["puts_published"] == 0  # nothing new: no version churn
    keys = server.client().keys(a.block_key("00")[:-2] + "*")
    assert len(keys) == 4
    assert b.get_manifest("shared").version == 1


def test_missing_blocks_come_from_block_source_or_the_manifest_waits(server, fp, tiers, tmp_path):
    blocks = chain(fp, "src", 3)
    disk = DiskStore(tmp_path / "cache", fp, {}, {})
    for b in blocks[:2]:
        disk.write_block(b)
    a = tiers(server.url, fp, block_source=disk.read_block)
    # Block 3 is neither on disk nor in the put: the manifest must not name it yet.
    assert a.put(manifest("src", blocks)) and a.flush(10)
    assert a.stats()["puts_incomplete"] == 1 and a.get_manifest("src") is None
    disk.write_block(blocks[2])
    assert a.put(manifest("src", blocks)) and a.flush(10)
    m = a.get_manifest("src")
    assert m is not None and len(m.block_ids) == 3
    s = a.stats()
    assert s["puts_published"] == 1 and s["blocks_uploaded"] == 3  # 2 from the first try, 1 now
    # bytes from a source are verified before upload: a damaged local file is not sent
    raw_source = {blocks[0].block_id: b"\0" * 64}
    c = tiers(server.url, hashlib.sha256(b"other" + fp.encode()).hexdigest(), block_source=raw_source.get)
    assert c.put(manifest("src", blocks[:1])) and c.flush(10)
    assert c.stats()["puts_incomplete"] == 1 and c.stats()["blocks_uploaded"] == 0


# ---- manifests: compare-and-set ---------------------------------------------------------------------


def test_conflict_rule(server, fp, tiers):
    hist = chain(fp, "cas", 6)
    a, b = tiers(server.url, fp), tiers(server.url, fp)
    blocks = {x.block_id: x for x in hist}
    a.put(manifest("cas", hist[:4]), blocks); a.flush(10)  # v1, 4 blocks
    late = manifest("cas", hist[:3])
    late.updated_at -= 100  # B never saw v1: a late put of an older turn, which v1 holds -> kept
    b.put(late, blocks); b.flush(10)
    assert b.stats()["puts_kept_other"] == 1 and len(b.get_manifest("cas").block_ids) == 4
    b.put(manifest("cas", hist[:5]), blocks); b.flush(10)  # concurrent, continues v1: merged, v1 held by it
    m = b.get_manifest("cas")
    assert (m.version, m.block_ids, b.stats()["puts_merged"]) == (2, [x.block_id for x in hist[:5]], 1)
    assert b.seen_version("cas") == 2  # the merged value is all B's own: its next put succeeds it

    def turn(n: int, seed: int) -> Manifest:  # hist[:n] and one block of its own
        own = chain(fp, "cas", 1, seed=seed, after=hist[n - 1])
        blocks.update({x.block_id: x for x in own})
        return manifest("cas", hist[:n] + own)

    a.put(turn(4, 7), blocks); a.flush(10)  # A's base v1 is stale: its diverging turn is merged in
    m = a.get_manifest("cas")
    assert m.version == 3 and [br["block_ids"] for br in m.branches] == [
        [x.block_id for x in hist[:5]], turn(4, 7).block_ids]  # B's branch, then A's (the newest)
    assert m.n_tokens == 5 * TOKENS_PER_BLOCK and a.seen_version("cas") == 1  # A does not hold B's branch
    a.put(turn(2, 8), blocks); a.flush(10)  # still no successor: merged again, nothing lost
    m = a.get_manifest("cas")
    assert m.version == 4 and [br["block_ids"] for br in m.branches][-1] == turn(2, 8).block_ids
    assert len(m.branches) == 3
    b.adopt("cas", b.get_manifest("cas").version)  # B fetched v4 (a sync): a rewind is its successor, wins
    b.put(manifest("cas", hist[:2]), blocks); b.flush(10)
    m = a.get_manifest("cas")
    assert (m.version, len(m.block_ids), m.n_tokens, m.branches[0].get("last_used")) == (5, 2, 32, None)
    b.release("cas")  # B erased its copy here (its disk budget): its next put merges instead
    b.put(turn(1, 9), blocks); b.flush(10)
    m = a.get_manifest("cas")
    assert m.version == 6 and [br["block_ids"] for br in m.branches] == [
        [x.block_id for x in hist[:2]], turn(1, 9).block_ids]


def test_a_merge_keeps_the_most_recently_used_branches_of_both(server, fp, tiers):
    """Concurrent puts of branched histories: the union by last use, `branches` at most, whichever
    server wrote them; a branch another holds goes, its last use passing to the newest holder."""
    from vllm_mlx_persist.chain import Branch, manifest_of

    base = chain(fp, "m", 1)
    forks = [chain(fp, "m", 1, seed=i, after=base[0])[0] for i in range(5)]
    blocks = {x.block_id: x for x in base + forks}

    def br(i: int, t: float) -> Branch:  # the base block, then fork i's own
        return Branch([base[0].block_id, forks[i].block_id], 2 * TOKENS_PER_BLOCK, ((0, "m"), (1, "m")), t)

    a, b = tiers(server.url, fp, branches=3), tiers(server.url, fp, branches=3)
    a.put(manifest_of("m", [br(0, 10.0), br(2, 30.0), br(4, 50.0)], False, 50.0), blocks); a.flush(10)
    only_base = Branch([base[0].block_id], TOKENS_PER_BLOCK, ((0, "m"),), 60.0)
    b.put(manifest_of("m", [br(1, 20.0), br(3, 40.0), only_base], False, 60.0), blocks); b.flush(10)
    m = a.get_manifest("m")
    assert b.stats()["puts_merged"] == 1 and m.version == 2
    assert [(e["block_ids"][1], e["last_used"]) for e in m.branches] == [
        (forks[2].block_id, 30.0), (forks[3].block_id, 40.0), (forks[4].block_id, 60.0)]
    assert m.n_tokens == 2 * TOKENS_PER_BLOCK and b.seen_version("m") == -1  # B holds only one of them


def test_alternating_servers_lose_no_turn(server, fp, tiers):
    """A conversation whose turns land on either server, with both writers racing to Redis."""
    n_turns = 24
    hist = chain(fp, "busy", n_turns)
    # Each server holds the history it served on its local disk (block_source). A's disk is slow, so
    # its uploads lag and B publishes later turns before A publishes earlier ones.
    local = {x.block_id: x for x in hist}
    a = tiers(server.url, fp, block_source=slow_source(local, 0.01))
    b = tiers(server.url, fp, block_source=local.get)
    for k in range(1, n_turns + 1):
        (a if k % 2 else b).put(manifest("busy", hist[:k]))
    assert a.flush(20) and b.flush(20)
    m = a.get_manifest("busy")
    assert m.block_ids == [x.block_id for x in hist] and m.n_tokens == n_turns * TOKENS_PER_BLOCK
    sa, sb = a.stats(), b.stats()
    assert sa["dropped"] == sb["dropped"] == 0 and sa["errors"] == sb["errors"] == 0


def test_concurrent_threads_keep_the_longest_history(server, fp, tiers):
    n = 40
    hist = chain(fp, "race", n)
    blocks = {x.block_id: x for x in hist}
    tier_list = [tiers(server.url, fp, block_source=slow_source(blocks, 0.005)),
                 tiers(server.url, fp, block_source=blocks.get)]
    start = threading.Barrier(2)

    def worker(t: RemoteTier, offset: int) -> None:
        start.wait()
        for k in range(1 + offset, n + 1, 2):
            assert t.put(manifest("race", hist[:k]))
            time.sleep(0.001)

    threads = [threading.Thread(target=worker, args=(t, i)) for i, t in enumerate(tier_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(t.flush(30) for t in tier_list)
    m = tier_list[0].get_manifest("race")
    assert m.n_tokens == n * TOKENS_PER_BLOCK and m.block_ids == list(blocks)
    # every block the manifest names is in Redis
    raw = server.client()
    assert all(raw.exists(tier_list[0].block_key(b)) for b in m.block_ids)


# ---- refusal ----------------------------------------------------------------------------------------


def test_damaged_block_is_refused_deleted_and_healed(server, fp, tiers):
    blocks = chain(fp, "dmg", 2)
    by_id = {x.block_id: x for x in blocks}
    a = tiers(server.url, fp, block_source=by_id.get)
    a.put(manifest("dmg", blocks), by_id); a.flush(10)
    raw = server.client()
    key = a.block_key(blocks[1].block_id)
    value = raw.get(key)
    raw.setrange(key, len(value) - 3, bytes([value[-3] ^ 0x10]))  # one flipped bit in the data
    assert a.get_block(blocks[1].block_id) is None
    assert a.stats()["refused"] == 1 and raw.get(key) is None  # deleted: SET NX could not repair it
    assert a.get_block(blocks[0].block_id) is not None
    a.put(manifest("dmg", blocks)); a.flush(10)  # the next put re-uploads it from the local store
    got = a.get_block(blocks[1].block_id)
    assert got is not None and same_block(got, blocks[1])


def test_foreign_values_are_refused(server, fp, tiers):
    blocks = chain(fp, "mine", 2)
    a = tiers(server.url, fp)
    a.put(manifest("mine", blocks), {x.block_id: x for x in blocks}); a.flush(10)
    raw = server.client()
    # another block's bytes under this id
    raw.set(a.block_key(blocks[1].block_id), raw.get(a.block_key(blocks[0].block_id)))
    assert a.get_block(blocks[1].block_id) is None and a.stats()["refused"] == 1
    # another agent's manifest under this agent's key
    a.put(manifest("other", blocks[:1]), {}); a.flush(10)
    raw.hset(a.manifest_key("mine"), "body", raw.hget(a.manifest_key("other"), "body"))
    assert a.get_manifest("mine") is None and a.stats()["refused"] == 2
    # a damaged manifest
    body = raw.hget(a.manifest_key("other"), "body")
    raw.hset(a.manifest_key("other"), "body", body.replace(b'"n_tokens":16', b'"n_tokens":17'))
    assert a.get_manifest("other") is None and a.stats()["refused"] == 3
    # another model never sees this model's keys
    other_model = tiers(server.url, hashlib.sha256(fp.encode()).hexdigest())
    assert other_model.get_block(blocks[0].block_id) is None and other_model.get_manifest("other") is None
    # a fingerprint sharing the key prefix but not equal: the tier refuses to run, serves nothing
    clash = tiers(server.url, fp[:32] + "0" * 32)
    assert clash.get_block(blocks[0].block_id) is None
    assert not clash.put(manifest("mine", blocks), {})
    s = clash.stats()
    assert s["state"].startswith("refused") and not s["connected"] and s["hits"] == 0


# ---- branches and forks --------------------------------------------------------------------------


def forked(fp: str):
    """Agent "child" forked from "parent" after 2 blocks, with two branches diverging after block 2:
    (blocks by id, the child's manifest as the pool writes it, its branches least recent first)."""
    parent = chain(fp, "parent", 3)
    own = chain(fp, "child", 2, seed=1, after=parent[1])  # the child's blocks, re-seeded at block 2
    other = chain(fp, "child", 1, seed=2, after=own[0])  # an older branch diverging at block 3
    newest = parent[:2] + own
    older = parent[:2] + own[:1] + other
    branches = [
        {"block_ids": [b.block_id for b in older], "n_tokens": 4 * TOKENS_PER_BLOCK - 5,
         "links": [[0, "parent"], [2, "child"], [3, "child"]]},
        {"block_ids": [b.block_id for b in newest], "n_tokens": 4 * TOKENS_PER_BLOCK,
         "links": [[0, "parent"], [2, "child"]]},
    ]
    ids = list(dict.fromkeys([b.block_id for b in newest] + [b.block_id for b in older]))
    m = Manifest("child", ids, 4 * TOKENS_PER_BLOCK, time.time(), branches=branches)
    return {b.block_id: b for b in parent + own + other}, m, branches


def test_branched_and_forked_manifest_round_trips(server, fp, tiers):
    blocks, m, branches = forked(fp)
    a, b = tiers(server.url, fp), tiers(server.url, fp)
    assert a.put(m, blocks) and a.flush(10)
    assert a.stats()["puts_published"] == 1 and a.stats()["blocks_uploaded"] == 5  # every branch's blocks
    got = b.get_manifest("child")
    assert got is not None and (got.block_ids, got.n_tokens, got.branches) == (m.block_ids, m.n_tokens, branches)
    fetched = b.get_blocks(m.block_ids)
    assert [x.block_id for x in fetched] == m.block_ids and all(same_block(x, blocks[x.block_id]) for x in fetched)
    # a retried put of the same history is a no-op; another branch order is a new history
    assert a.put(m) and a.flush(10) and a.stats()["puts_same"] == 0 and a.get_manifest("child").version == 2
    assert b.put(m) and b.flush(10) and b.stats()["puts_same"] == 1
    swapped = Manifest("child", m.block_ids, branches[0]["n_tokens"], time.time(), branches=branches[::-1])
    assert a.put(swapped) and a.flush(10) and a.get_manifest("child").branches == branches[::-1]
    # a concurrent put is merged by last use: B's (stale base) names the same branches, used before
    # A's put (a branch without last_used counts as used when its manifest was written): kept out
    assert b.put(m) and b.flush(10) and b.stats()["puts_kept_other"] == 1
    assert b.get_manifest("child").branches == branches[::-1]
    with pytest.raises(ValueError):  # a branch naming a block the manifest does not list: misuse
        a.put(Manifest("child", m.block_ids[:2], 5, time.time(), branches=branches))


def test_damaged_branches_are_refused(server, fp, tiers):
    blocks, m, branches = forked(fp)
    a = tiers(server.url, fp)
    assert a.put(m, blocks) and a.flush(10)
    raw = server.client()
    key = a.manifest_key("child")
    good = raw.hget(key, "body")
    # one link's namespace changed, tag not: refused
    raw.hset(key, "body", good.replace(b'[2,"child"]', b'[2,"chilD"]', 1))
    assert a.get_manifest("child") is None and a.stats()["refused"] == 1 and a.stats()["refused_mac"] == 1
    # tagged, but not a valid manifest: a branch naming an unlisted block, a bad link, a newest
    # branch whose tokens are not the manifest's
    bad = [
        Manifest("child", m.block_ids[:-1], m.n_tokens, time.time(), branches=branches),
        Manifest("child", m.block_ids, m.n_tokens, time.time(),
                 branches=[branches[0], {**branches[1], "links": [[1, "parent"]]}]),
        Manifest("child", m.block_ids, m.n_tokens + 1, time.time(), branches=branches),
        Manifest("child", m.block_ids, m.n_tokens, time.time(), branches=[]),
    ]
    for i, x in enumerate(bad):
        plant(raw, a, "child", x)
        assert a.get_manifest("child") is None and a.stats()["refused"] == 2 + i
    assert a.stats()["refused_mac"] == 1
    plant(raw, a, "child", m)
    assert a.get_manifest("child").branches == branches


def test_manifest_without_branches_reads_as_one_chain(server, fp, tiers):
    """What every older server writes (and this one for an agent that never branched or forked)."""
    hist = chain(fp, "plain", 3)
    a = tiers(server.url, fp)
    assert a.put(manifest("plain", hist), {x.block_id: x for x in hist}) and a.flush(10)
    raw = server.client()
    body = json.loads(raw.hget(a.manifest_key("plain"), "body"))
    assert sorted(body) == ["block_ids", "checksum", "fingerprint", "format", "format_version", "n_tokens",
                            "namespace", "updated_at"]
    ids = [x.block_id for x in hist]
    assert raw.hget(a.manifest_key("plain"), "d") == hashlib.sha256("\n".join(ids).encode()).hexdigest().encode()
    m = tiers(server.url, fp).get_manifest("plain")
    assert m.branches == [{"block_ids": ids, "n_tokens": 48, "links": [[0, "plain"]]}]


def test_get_blocks_pipelines_in_bounded_round_trips_and_stops_at_the_first_bad_block(server, fp, tiers):
    hist = chain(fp, "many", 10)
    by_id = {x.block_id: x for x in hist}
    ids = list(by_id)
    one = len(encode_block(hist[0]))
    a = tiers(server.url, fp)
    assert a.put(manifest("many", hist), by_id) and a.flush(10)
    b = tiers(server.url, fp, fetch_blocks=4)  # knows no block size yet: one block, then 4 at a time
    assert [x.block_id for x in b.get_blocks(ids)] == ids
    assert b.stats()["fetch_round_trips"] == 1 + 3 and b.stats()["hits"] == 10
    c = tiers(server.url, fp, fetch_blocks=8, fetch_bytes=3 * one)  # the bytes bound: 3 blocks a trip
    assert all(same_block(x, by_id[x.block_id]) for x in c.get_blocks(ids))
    assert c.stats()["fetch_round_trips"] == 1 + 3
    # stops at the first block not served: missing, then damaged (refused and deleted)
    raw = server.client()
    raw.delete(a.block_key(ids[7]))
    assert [x.block_id for x in c.get_blocks(ids)] == ids[:7]
    value = bytearray(raw.get(a.block_key(ids[4])))
    value[-3] ^= 0x10
    raw.set(a.block_key(ids[4]), bytes(value))
    assert [x.block_id for x in c.get_blocks(ids)] == ids[:4]
    assert c.stats()["refused"] == 1 and raw.get(a.block_key(ids[4])) is None
    assert c.get_blocks([]) == []
    # the bytes held: it stops once max_bytes are in
    assert [x.block_id for x in c.get_blocks(ids[:4], max_bytes=2 * hist[0].nbytes + 1)] == ids[:3]
    assert c.get_blocks(ids[:4], max_bytes=0) == []


def test_a_sync_holds_at_most_max_fetch_bytes_and_keeps_the_prefix(server, fp, tiers, tmp_path):
    """An agent larger than the fetch budget is fetched up to it (the rest is prefilled later),
    counted, and saved locally as a usable prefix; memory per sync stays bounded."""
    from vllm_mlx_persist.fleet import Fleet
    from vllm_mlx_persist.pool import BlockPool

    hist = chain(fp, "big", 10)
    a = tiers(server.url, fp)
    assert a.put(manifest("big", hist), {x.block_id: x for x in hist}) and a.flush(10)
    fmt = {"bits": 4, "group_size": 64, "block_size": TOKENS_PER_BLOCK}
    pool = BlockPool(fingerprint=fp, n_layers=2, bits=4, group_size=64, block_size=TOKENS_PER_BLOCK,
                     hot_bytes=1 << 30, store=DiskStore(tmp_path / "b", fp, {"test": True}, fmt), disk_budget=1 << 30,
                     fleet=lambda p: Fleet(p, lambda **cb: tiers(server.url, fp, max_fetch_bytes=3 * hist[0].nbytes,
                                                                   **cb)))
    fleet, persister = pool.fleet, pool.persister
    try:
        fleet._sync_agent("big")
        assert fleet.counts["fetch_cut_at_budget"] == 1 and fleet.counts["fetch_incomplete"] == 1
        assert fleet.counts["blocks_fetched"] == 3
        ((ids, n_tokens, _, _, _),) = pool.fleet_view.branch_state("big")
        assert list(ids) == [x.block_id for x in hist[:3]] and n_tokens == 3 * TOKENS_PER_BLOCK
        assert all(persister.store.has_block(x.block_id) for x in hist[:3])
    finally:
        fleet.close()
        pool.close()


def test_a_sync_fetches_any_branch_it_lacks_and_nothing_it_holds(server, fp, tiers, tmp_path):
    """A sync fetches whenever Redis holds something this server lacks: here a branch shorter than
    the local newest one (before: skipped, the local history being 'at least as long'). A history
    already held costs the manifest read only: no block read, and the server adopts its version."""
    from vllm_mlx_persist.chain import Branch, manifest_of
    from vllm_mlx_persist.fleet import Fleet
    from vllm_mlx_persist.pool import BlockPool

    hist = chain(fp, "s", 3)
    side = chain(fp, "s", 1, seed=5, after=hist[0])  # a branch diverging after block 0
    blocks = {x.block_id: x for x in hist + side}
    long_ = Branch([x.block_id for x in hist], 3 * TOKENS_PER_BLOCK, ((0, "s"),), 10.0)
    short = Branch([hist[0].block_id, side[0].block_id], 2 * TOKENS_PER_BLOCK, ((0, "s"), (1, "s")), 20.0)
    a = tiers(server.url, fp)
    assert a.put(manifest_of("s", [long_], False, 10.0), blocks) and a.flush(10)
    fmt = {"bits": 4, "group_size": 64, "block_size": TOKENS_PER_BLOCK}
    pool = BlockPool(fingerprint=fp, n_layers=2, bits=4, group_size=64, block_size=TOKENS_PER_BLOCK,
                     hot_bytes=1 << 30, store=DiskStore(tmp_path / "b", fp, {"test": True}, fmt),
                     fleet=lambda p: Fleet(p, lambda **cb: tiers(server.url, fp, **cb)))
    fleet = pool.fleet
    try:
        fleet._sync_agent("s")
        assert [x[:2] for x in pool.fleet_view.branch_state("s")] == [(tuple(long_.block_ids), long_.n_tokens)]
        gets = fleet.tier.stats()["gets"]
        fleet._sync_agent("s")  # nothing new: no block read, the version adopted
        assert fleet.counts["syncs_unchanged"] == 1 and fleet.tier.stats()["gets"] == gets
        assert fleet.tier.seen_version("s") == 1
        assert a.put(manifest_of("s", [long_, short], False, 20.0), blocks) and a.flush(10)  # A's successor: v2
        fleet._sync_agent("s")  # its newest branch is shorter than the local one, and new here
        assert [x[:2] for x in pool.fleet_view.branch_state("s")] == [(tuple(long_.block_ids), long_.n_tokens),
                                                           (tuple(short.block_ids), short.n_tokens)]
        assert fleet.tier.stats()["gets"] == gets + 1 and fleet.tier.seen_version("s") == 2  # the one block it lacked
        fleet._sync_agent("s")
        assert fleet.counts["syncs_unchanged"] == 2 and fleet.tier.stats()["gets"] == gets + 1
    finally:
        pool.close()


# ---- erasure ----------------------------------------------------------------------------------------


def test_erase_is_seen_by_the_other_server_and_not_revived(server, fp, tiers):
    hist = chain(fp, "gone", 3)
    blocks = {x.block_id: x for x in hist}
    erased_seen = []
    a = tiers(server.url, fp)
    b = tiers(server.url, fp, on_erased=lambda agent, ident: erased_seen.append((agent, ident)))
    c = tiers(server.url, fp)
    b.put(manifest("gone", hist[:2]), blocks); b.flush(10)
    c.put(manifest("gone", hist[:2]), blocks); c.flush(10)
    assert a.get_manifest("gone").version == 1
    assert a.erase("gone") and a.flush(10)
    m = b.get_manifest("gone")
    assert m.erased and m.block_ids == [] and m.version == 2 and not m.seen
    assert a.get_manifest("gone").seen  # A erased it itself
    # C published before the erasure and never looked since: its next turn must not revive it
    c.put(manifest("gone", hist[:3]), blocks); c.flush(10)
    assert c.stats()["puts_erased"] == 1 and a.get_manifest("gone").erased
    # B saw the erasure and dropped its copy; a new conversation under the same id starts afresh
    assert b.erased_locally("gone", m.ident) and b.get_manifest("gone").seen
    new = chain(fp, "gone", 1, seed=7)
    b.put(manifest("gone", new), {x.block_id: x for x in new}); b.flush(10)
    m = a.get_manifest("gone")
    assert not m.erased and m.block_ids == [new[0].block_id] and m.version == 3
    assert erased_seen == []
    # a put queued before an erasure on the same server is discarded, or published then erased
    a.put(manifest("gone", hist), blocks)
    a.erase("gone")
    assert a.flush(10) and a.get_manifest("gone").erased
    # B learns of the erasure through its own refused put: the callback fires, naming the tombstone
    b.put(manifest("gone", new + hist[:1]), {**blocks, **{x.block_id: x for x in new}}); b.flush(10)
    m = a.get_manifest("gone")
    assert m.erased and erased_seen == [("gone", m.ident)]


# ---- versions: builds of different formats sharing one Redis -------------------------------------

# The last build before blocks carried crc32 (8b66dfa): it knows only sha256 checksums and deleted
# crc32 blocks from Redis as damaged when both shared one keyspace.
OLD_BUILD = "cb2a569"
# Run by that build in a subprocess. It imports this module for chain() and manifest(), so this
# module imports nothing from the fleet tier at its top but RemoteTier (and FleetSettings, where the
# build has them).
OLD_BUILD_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from test_remote import chain, manifest
from vllm_mlx_persist.remote import RemoteTier
url, fp, agent, *ids = sys.argv[2:]
t = RemoteTier(url, fp)
out = {"manifest": t.get_manifest(agent) is not None, "blocks": [t.get_block(b) is not None for b in ids]}
own = chain(fp, "old-agent", 2, seed=3)
t.put(manifest("old-agent", own), {b.block_id: b for b in own})
t.flush(10)
out["own_ids"] = [b.block_id for b in own]
out["own"] = [t.get_block(b) is not None for b in out["own_ids"]]
out["refused"] = t.stats()["refused"]
t.close(2)
print(json.dumps(out))
"""


def old_build(tmp_path: Path, commit: str = OLD_BUILD, what: str = "the build before crc32 blocks") -> Path:
    """The package as it was at `commit`, extracted under tmp_path (skips without git history)."""
    root = Path(__file__).resolve().parent.parent
    git = shutil.which("git")
    if git is None or subprocess.run([git, "cat-file", "-e", commit], cwd=root,
                                     capture_output=True).returncode != 0:
        pytest.skip(f"needs git and commit {commit} ({what})")
    archive = subprocess.run([git, "archive", commit, "vllm_mlx_persist"], cwd=root, capture_output=True,
                             check=True).stdout
    dest = tmp_path / f"build-{commit}"
    dest.mkdir()
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def test_an_older_build_sharing_the_redis_neither_sees_nor_deletes_this_builds_values(server, fp, tiers,
                                                                                        tmp_path):
    """The issue: a server not yet upgraded read crc32 blocks as damaged and deleted them. Now each
    remote format version has its own keyspace: the older build runs beside this one, on its own keys."""
    hist = chain(fp, "new-agent", 3)
    ids = [x.block_id for x in hist]
    a = tiers(server.url, fp)
    assert a.put(manifest("new-agent", hist), {x.block_id: x for x in hist}) and a.flush(10)
    old = old_build(tmp_path)
    done = subprocess.run([sys.executable, "-c", OLD_BUILD_SCRIPT, str(Path(__file__).parent), server.url, fp,
                           "new-agent", *ids], capture_output=True, text=True, timeout=120,
                          cwd=old, env={**os.environ, "PYTHONPATH": str(old)})  # cwd: not this checkout
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["manifest"] is False and seen["blocks"] == [False] * 3 and seen["refused"] == 0
    assert seen["own"] == [True, True]  # the older build works on its own keys
    # this build's values are intact, and it leaves the older build's keys alone
    b = tiers(server.url, fp)
    assert [x.block_id for x in b.get_blocks(ids)] == ids and b.get_manifest("new-agent").n_tokens == 48
    raw = server.client()
    old_keys = [f"vmp:{fp[:32]}:b:{i}" for i in seen["own_ids"]] + [
        f"vmp:{fp[:32]}:a:{hashlib.sha256(b'old-agent').hexdigest()}"]
    assert b.get_blocks(seen["own_ids"]) == [] and b.get_manifest("old-agent") is None
    assert all(raw.exists(k) for k in old_keys)
    assert b.stats()["refused"] == b.stats()["foreign"] == 0


def with_metadata(raw: bytes, **meta: str) -> bytes:
    """A block file's bytes with these __metadata__ entries changed (data section untouched)."""
    hlen = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + hlen])
    header["__metadata__"].update(meta)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(8 + len(head)) % 8)
    return len(head).to_bytes(8, "little") + head + raw[8 + hlen :]


def test_a_block_of_a_format_this_build_cannot_read_is_left_in_redis(server, fp, tiers):
    """Our own refusal path deletes only what it can judge: a value that says it is our block in a
    later format version or with a checksum kind unknown here is 'not mine', not 'damaged'."""
    hist = chain(fp, "newer", 3)
    by_id = {x.block_id: x for x in hist}
    a = tiers(server.url, fp)
    assert a.put(manifest("newer", hist), by_id) and a.flush(10)
    raw = server.client()
    good = [raw.get(a.block_key(x.block_id)) for x in hist]
    newer = {hist[0].block_id: with_metadata(good[0], checksum="xxh3:0123456789abcdef"),
             hist[1].block_id: with_metadata(good[1], format_version="2")}
    for bid, value in newer.items():
        raw.set(a.block_key(bid), value)
    for bid, value in newer.items():
        assert a.get_block(bid) is None
        assert raw.get(a.block_key(bid)) == value  # not deleted
    s = a.stats()
    assert (s["foreign"], s["refused"]) == (2, 0)
    # a damaged block of this format is still refused and deleted, so a put can store a good copy
    flipped = bytearray(good[2])
    flipped[-3] ^= 0x10
    raw.set(a.block_key(hist[2].block_id), bytes(flipped))
    assert a.get_block(hist[2].block_id) is None and raw.get(a.block_key(hist[2].block_id)) is None
    assert a.stats()["refused"] == 1
    # with a secret: a value whose MAC holds (a holder of the secret wrote it) in a later format too
    c = tiers(server.url, fp, secret=SECRET)
    key = c.block_key(hist[0].block_id)
    value = c.tagger.wrap_block(key, newer[hist[0].block_id])
    raw.set(key, value)
    assert c.get_block(hist[0].block_id) is None and raw.get(key) == value
    assert (c.stats()["foreign"], c.stats()["refused"]) == (1, 0)


def test_two_remote_format_versions_coexist(server, fp, tiers, monkeypatch):
    from vllm_mlx_persist.fleet import keyspace

    hist = chain(fp, "both", 3)
    by_id = {x.block_id: x for x in hist}
    a = tiers(server.url, fp)
    monkeypatch.setattr(keyspace, "REMOTE_FORMAT_VERSION", keyspace.REMOTE_FORMAT_VERSION + 1)
    b = tiers(server.url, fp)
    assert a.stats()["keyspace"] != b.stats()["keyspace"]
    assert a.put(manifest("both", hist[:2]), by_id) and b.put(manifest("both", hist), by_id)
    assert a.flush(10) and b.flush(10)
    assert (a.get_manifest("both").n_tokens, b.get_manifest("both").n_tokens) == (32, 48)
    assert a.get_manifest("both").version == b.get_manifest("both").version == 1  # no interplay
    raw = server.client()
    assert len(list(raw.scan_iter(match=f"vmp:{fp[:32]}:*"))) == 2 * (1 + 1) + 2 + 3  # model, manifest, blocks
    assert all(t.stats()["refused"] == t.stats()["foreign"] == 0 for t in (a, b))


def test_the_remote_version_pins_what_its_keyspace_holds():
    """A tripwire: keyspace r3 holds disk_format FORMAT_VERSION 1 blocks checked by crc32 or sha256 and
    agent records (spliced branches, removal records), and every r3 reader accepts exactly those. A
    build that writes anything else must bump REMOTE_FORMAT_VERSION (docs/fleet.md, Versions), or it
    deletes, or is deleted by, its peers."""
    from vllm_mlx_persist import disk_format
    from vllm_mlx_persist.fleet import keyspace

    raw = encode_block(chain("f" * 64, "t", 1)[0])
    meta = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])["__metadata__"]
    assert (disk_format.FORMAT_VERSION, keyspace.REMOTE_FORMAT_VERSION) == (1, 3), "bump REMOTE_FORMAT_VERSION"
    assert meta["checksum"].split(":")[0] in keyspace.BLOCK_CHECKSUM_KINDS == ("crc32", "sha256")


# ---- authentication: a shared secret ------------------------------------------------------------------

SECRET = b"correct horse battery staple 42!"
OTHER_SECRET = b"another secret, just as long ..."


def test_servers_with_one_secret_share_and_others_see_nothing_of_it(server, fp, tiers):
    hist = chain(fp, "sec", 3)
    by_id = {x.block_id: x for x in hist}
    ids = list(by_id)
    a, b = tiers(server.url, fp, secret=SECRET), tiers(server.url, fp, secret=SECRET)
    c, d = tiers(server.url, fp, secret=OTHER_SECRET), tiers(server.url, fp)
    assert a.put(manifest("sec", hist), by_id) and a.flush(10)
    m = b.get_manifest("sec")
    assert m is not None and m.block_ids == ids
    assert all(same_block(x, by_id[x.block_id]) for x in b.get_blocks(ids)) and len(b.get_blocks(ids)) == 3
    # in Redis: the block file then its MAC; the manifest's tag is an HMAC
    raw = server.client()
    value = raw.get(a.block_key(ids[0]))
    assert value[:-40] == encode_block(hist[0]) and value[-40:-32] == b"vmp-hmac"
    assert raw.hget(a.manifest_key("sec"), "m").startswith(b"hmac-sha256:")
    # another secret, or none: another keyspace. They see nothing, and their puts touch nothing of it.
    assert a.key_id == b.key_id != c.key_id and d.key_id is None and SECRET.hex() not in repr(a.stats())
    assert len({t.stats()["keyspace"] for t in (a, c, d)}) == 3
    for t in (c, d):
        assert t.get_manifest("sec") is None and t.get_blocks(ids) == []
        assert t.put(manifest("sec", hist[:1]), by_id) and t.flush(10)
        assert t.get_manifest("sec").n_tokens == 16
    m = a.get_manifest("sec")
    assert (m.n_tokens, m.version) == (48, 1) and [x.block_id for x in b.get_blocks(ids)] == ids
    assert all(t.stats()["refused"] == 0 for t in (a, b, c, d))


def test_values_planted_without_the_secret_are_refused(server, fp, tiers):
    hist, other = chain(fp, "victim", 2), chain(fp, "other", 2, seed=4)
    a = tiers(server.url, fp, secret=SECRET)
    for agent, h in (("victim", hist), ("other", other)):
        assert a.put(manifest(agent, h), {x.block_id: x for x in h})
    assert a.flush(10)
    raw = server.client()
    outsider = tiers(server.url, fp)  # knows every format, not the secret
    wrong = tiers(server.url, fp, secret=OTHER_SECRET)
    # a block under its correct id: the right tokens, forged K/V, a valid crc32; no MAC, or a wrong one
    forged = BlockData(hist[1].block_id, hist[1].tokens, {k: np.zeros_like(v) for k, v in hist[1].arrays.items()},
                       hist[1].dtypes)
    key = a.block_key(forged.block_id)
    for value in (encode_block(forged), wrong.tagger.wrap_block(key, encode_block(forged))):
        raw.set(key, value)
        assert a.get_block(forged.block_id) is None and raw.get(key) is None  # refused, deleted
    assert a.stats()["refused_mac"] == 2
    assert a.put(manifest("victim", hist), {hist[1].block_id: hist[1]}) and a.flush(10)  # a good copy again
    assert same_block(a.get_block(hist[1].block_id), hist[1])
    # a manifest linking another agent as the victim's parent (its one branch chains from "other")
    linked = Manifest("victim", [x.block_id for x in other], 32, time.time(),
                      branches=[{"block_ids": [x.block_id for x in other], "n_tokens": 32, "links": [[0, "other"]]}])
    for forger in (outsider, wrong):
        plant(raw, a, "victim", linked, version=7, tagger=forger)
        assert a.get_manifest("victim") is None
    # what the secret protects against: the same plant in an unauthenticated keyspace is served
    plant(raw, outsider, "victim", linked, version=7)
    assert outsider.get_manifest("victim").branches[0]["links"] == [[0, "other"]]
    # a forged tombstone erases nobody: refused when read; a put replaces it rather than meeting it
    met = []
    a.on_erased = lambda *x: met.append(x)
    plant(raw, a, "other", None, version=99, tagger=outsider)
    assert a.get_manifest("other") is None
    assert a.put(manifest("other", other)) and a.flush(10)
    m = a.get_manifest("other")
    assert m is not None and not m.erased and m.block_ids == [x.block_id for x in other] and met == []
    s = a.stats()
    assert s["refused_mac"] == 2 + 2 + 2 and s["puts_erased"] == 0 and s["foreign"] == 0


def test_a_value_moved_to_another_key_is_refused(server, fp, tiers):
    x, y = chain(fp, "x", 2), chain(fp, "y", 2, seed=1)
    a = tiers(server.url, fp, secret=SECRET)
    met = []
    b = tiers(server.url, fp, secret=SECRET, on_erased=lambda *e: met.append(e))
    for agent, h in (("x", x), ("y", y)):
        assert a.put(manifest(agent, h), {k.block_id: k for k in h})
    assert a.erase("x") and a.flush(10)
    raw = server.client()

    def copy(src: str, dst: str) -> None:
        fields = raw.hgetall(src)
        raw.delete(dst)
        raw.hset(dst, mapping=fields)

    # X's tombstone under Y's key: Y is not erased, neither when read nor when B puts Y
    copy(a.manifest_key("x"), a.manifest_key("y"))
    assert b.get_manifest("y") is None and b.stats()["refused_mac"] == 1
    assert b.put(manifest("y", y)) and b.flush(10) and met == [] and not a.get_manifest("y").erased
    assert b.stats()["refused_mac"] == 2  # the put replaced it (counted too)
    # Y's manifest under another agent's key, a block's value under another block's id
    copy(a.manifest_key("y"), a.manifest_key("z"))
    assert b.get_manifest("z") is None and b.stats()["refused_mac"] == 3
    raw.set(a.block_key(y[1].block_id), raw.get(a.block_key(y[0].block_id)))
    assert b.get_block(y[1].block_id) is None and b.stats()["refused_mac"] == 4


def test_a_forged_model_record_is_replaced_and_a_real_clash_still_refused(server, fp, tiers):
    hist = chain(fp, "m", 1)
    probe = tiers(server.url, fp, secret=SECRET)
    server.client().set(probe.keys.model, b'{"format": "anything", "fingerprint": "x"}')
    a = tiers(server.url, fp, secret=SECRET)
    assert a.put(manifest("m", hist), {hist[0].block_id: hist[0]}) and a.flush(10)
    s = a.stats()
    assert s["state"] == "ok" and s["refused_mac"] == 1 and a.get_manifest("m") is not None
    # another fingerprint with the same 32-character prefix and the same secret: a real other model
    clash = tiers(server.url, fp[:32] + "0" * 32, secret=SECRET)
    assert clash.get_block(hist[0].block_id) is None and clash.stats()["state"].startswith("refused")


def test_start_up_says_whether_the_tier_is_authenticated(server, fp, tiers, caplog):
    with caplog.at_level(logging.INFO, logger="vllm_mlx_persist.fleet"):
        tiers(server.url, fp)
        t = tiers(server.url, fp, secret=SECRET)
    text = caplog.text
    assert "UNAUTHENTICATED" in text and f"authenticated (HMAC-SHA256, key id {t.key_id}" in text
    assert SECRET.decode() not in text and SECRET.hex() not in text
    with pytest.raises(ValueError):
        RemoteTier(FleetSettings(server.url, secret=b"too short"), fp)


def test_the_secret_comes_from_a_file_or_the_environment(tmp_path, caplog):
    from vllm_mlx_persist.fleet import SECRET_ENV, load_secret

    f = tmp_path / "secret"
    f.write_bytes(SECRET + b"\n")
    f.chmod(0o600)
    assert load_secret(str(f), {}) == SECRET
    assert load_secret(None, {SECRET_ENV: " " + SECRET.decode() + "\n"}) == SECRET
    assert load_secret(None, {}) is None
    for args in ((str(f), {SECRET_ENV: "x" * 32}), (None, {SECRET_ENV: "short"}), (None, {SECRET_ENV: ""}),
                 (str(tmp_path / "absent"), {})):
        with pytest.raises(ValueError):
            load_secret(*args)
    f.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="vllm_mlx_persist.fleet"):
        assert load_secret(str(f), {}) == SECRET
    assert "open to other users" in caplog.text and SECRET.decode() not in caplog.text
    # the backend's options: a file path (a secret inline is refused, naming the ways to give one)
    from vllm_mlx_persist.options import parse_options

    assert parse_options({"remote_secret_file": "~/s"})["remote_secret_file"] == os.path.expanduser("~/s")
    with pytest.raises(ValueError, match="remote_secret_file.*VLLM_MLX_PERSIST_FLEET_SECRET"):
        parse_options({"remote_secret": SECRET.decode()})


# ---- tombstones: an erasure holds fleet-wide -------------------------------------------------------


def test_a_server_that_read_the_tombstone_cannot_put_its_old_history_back(server, fp, tiers):
    """B holds agent X locally and never published it; X is erased on A. B's sync reads the tombstone,
    and a save job of B's old history ends after that read (the tier has no way to tell it from a
    turn made after B erased its copy): its put must not bring X back. Nor may C's, which never
    synced X. Only once B has dropped its copy (erased_locally) does its put start a new history."""
    hist = chain(fp, "x", 3)
    blocks = {x.block_id: x for x in hist}
    met = []
    a = tiers(server.url, fp)
    b = tiers(server.url, fp, on_erased=lambda agent, ident: met.append((agent, ident)))
    c = tiers(server.url, fp)
    assert a.erase("x") and a.flush(10)
    tomb = b.get_manifest("x")
    assert tomb.erased
    assert b.put(manifest("x", hist), blocks) and b.flush(10)
    assert a.get_manifest("x").erased and b.stats()["puts_erased"] == 1
    assert c.put(manifest("x", hist), blocks) and c.flush(10)
    assert a.get_manifest("x").erased and c.stats()["puts_erased"] == 1
    assert not tomb.seen and met == [("x", tomb.ident)]
    assert not b.erased_locally("x", "not-that-one")
    assert b.erased_locally("x", tomb.ident) and b.get_manifest("x").seen
    new = chain(fp, "x", 1, seed=5)
    assert b.put(manifest("x", new), {new[0].block_id: new[0]}) and b.flush(10)
    m = a.get_manifest("x")
    assert not m.erased and m.block_ids == [new[0].block_id] and m.version == tomb.version + 1


def test_a_tombstone_written_after_the_manifest_expired_is_not_mistaken_for_one_seen(server, fp, tiers):
    """Versions start again once a key expires: B published X as version 1, the manifest expired (or
    was evicted), and A's erasure wrote a tombstone that is version 1 too. B has not seen it."""
    hist = chain(fp, "y", 3)
    blocks = {x.block_id: x for x in hist}
    a, b = tiers(server.url, fp), tiers(server.url, fp, on_erased=lambda *e: None)
    assert b.put(manifest("y", hist[:2]), blocks) and b.flush(10) and b.seen_version("y") == 1
    server.client().delete(b.manifest_key("y"))
    assert a.erase("y") and a.flush(10)
    tomb = b.get_manifest("y")
    assert tomb.erased and tomb.version == 1
    assert b.put(manifest("y", hist), blocks) and b.flush(10)
    assert a.get_manifest("y").erased and b.stats()["puts_erased"] == 1
    assert not tomb.seen  # the fleet erases B's copy on reading it


def test_tombstones_live_as_long_as_manifests(server, fp, tiers):
    a = tiers(server.url, fp)  # defaults: manifests 30 days
    assert a.erase("z") and a.flush(10)
    ttl = a.settings.manifest_ttl_s
    assert ttl - 60 <= server.client().ttl(a.manifest_key("z")) <= ttl
    b = tiers(server.url, fp, manifest_ttl_s=3600)
    assert b.erase("z2") and b.flush(10) and 3500 <= server.client().ttl(b.manifest_key("z2")) <= 3600
    for manifest_ttl, tombstone_ttl in ((3600, 60), (0, 60)):
        with pytest.raises(ValueError):
            RemoteTier(FleetSettings(server.url, manifest_ttl_s=manifest_ttl, tombstone_ttl_s=tombstone_ttl), fp)


def test_the_fleet_erases_its_copy_before_its_puts_start_afresh(server, fp, tiers, tmp_path):
    """Fleet glue: a put refused by a tombstone has the agent erased here, then acknowledged; a sync
    reading a tombstone does the same, once."""
    from vllm_mlx_persist.fleet import Fleet
    from vllm_mlx_persist.pool import BlockPool

    hist = chain(fp, "moved", 3)
    blocks = {x.block_id: x for x in hist}
    a = tiers(server.url, fp)
    assert a.put(manifest("moved", hist), blocks) and a.flush(10)
    fmt = {"bits": 4, "group_size": 64, "block_size": TOKENS_PER_BLOCK}
    pool = BlockPool(fingerprint=fp, n_layers=2, bits=4, group_size=64, block_size=TOKENS_PER_BLOCK,
                     hot_bytes=1 << 30, store=DiskStore(tmp_path / "b", fp, {"test": True}, fmt), disk_budget=1 << 30,
                     fleet=lambda p: Fleet(p, lambda **cb: tiers(server.url, fp, **cb)))
    fleet = pool.fleet
    b = fleet.tier
    try:
        fleet._sync_agent("moved")
        assert pool.fleet_view.branch_state("moved") is not None and b.seen_version("moved") == 1
        assert a.erase("moved") and a.flush(10)
        # a save job of B's ending after the erasure: refused; B then drops its copy, and says so
        assert b.put(manifest("moved", hist)) and b.flush(10)
        assert a.get_manifest("moved").erased and fleet.counts["erased_from_fleet"] == 1
        def seen() -> bool:  # a read that times out on a loaded machine answers None: not yet
            m = b.get_manifest("moved")
            return m is not None and m.seen

        deadline = time.monotonic() + 10
        while (pool.fleet_view.branch_state("moved") is not None or not seen()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.fleet_view.branch_state("moved") is None and seen()
        new = chain(fp, "moved", 1, seed=9)
        assert b.put(manifest("moved", new), {new[0].block_id: new[0]}) and b.flush(10)
        assert a.get_manifest("moved").block_ids == [new[0].block_id]
        # erased again: B's sync reads the tombstone, erases here and acknowledges it, once
        assert a.erase("moved") and a.flush(10)
        fleet._sync_agent("moved")
        assert fleet.counts["erased_from_fleet"] == 2 and b.get_manifest("moved").seen
        fleet._sync_agent("moved")
        assert fleet.counts["erased_from_fleet"] == 2
    finally:
        fleet.close()
        pool.close()


# The last build before eras (r2): manifests, in Redis and on disk, without `era`.
PRE_ERA_BUILD = "8f65fcc"
# The last build before the agent record (r2): spliced histories as agents of their own.
PRE_RECORD_BUILD = "0cf79ac"
OLD_READER_SCRIPT = """
import json, sys
from vllm_mlx_persist.remote import RemoteTier
from vllm_mlx_persist.store import DiskStore
url, fp, root, secret, block_size = sys.argv[1:6]
t = RemoteTier(url, fp, secret=secret.encode())
m = t.get_manifest("x")
local = DiskStore(root, fp, {"test": True}, {"bits": 4, "group_size": 64, "block_size": int(block_size)}
                  ).read_manifest("x")
print(json.dumps({"remote": m and [m.block_ids, m.n_tokens, m.erased], "refused": t.stats()["refused"],
                  "local": local and [local.block_ids, local.n_tokens]}))
t.close(2)
"""


def _old_reader(old: Path, server, fp, root: Path) -> dict:
    """What an older build (extracted at `old`) reads of agent x in Redis and under the cache `root`."""
    done = subprocess.run([sys.executable, "-c", OLD_READER_SCRIPT, server.url, fp, str(root),
                           SECRET.decode(), str(TOKENS_PER_BLOCK)], capture_output=True, text=True, timeout=120,
                          cwd=old, env={**os.environ, "PYTHONPATH": str(old)})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_build_from_before_eras_reads_manifests_that_carry_one(server, fp, tiers, tmp_path):
    """`era` is an optional field of a version-1 manifest on disk (docs/disk-format.md, Versioning):
    the build before it reads one carrying it as any other. In Redis the record (r3) is another
    keyspace (docs/fleet.md, Versions): an r2 build sees nothing of it and refuses nothing."""
    hist = chain(fp, "x", 2)
    a = tiers(server.url, fp, secret=SECRET)
    assert a.erase("x") and a.put(manifest("x", hist), {b.block_id: b for b in hist}) and a.flush(10)
    raw = server.client()
    assert json.loads(raw.hget(a.manifest_key("x"), "body"))["era"] == a.era("x")
    fmt = {"bits": 4, "group_size": 64, "block_size": TOKENS_PER_BLOCK}
    m = manifest("x", hist)
    m.era = a.era("x")
    DiskStore(tmp_path / "cache", fp, {"test": True}, fmt).write_manifest(m)
    on_disk = next((tmp_path / "cache").glob("*/agents/*.json")).read_text()
    assert json.loads(on_disk)["era"] == a.era("x") and json.loads(on_disk)["format_version"] == 1
    seen = _old_reader(old_build(tmp_path, PRE_ERA_BUILD, "the build before eras"), server, fp, tmp_path / "cache")
    ids = [b.block_id for b in hist]
    assert seen == {"remote": None, "refused": 0, "local": [ids, 2 * TOKENS_PER_BLOCK]}


def test_a_build_from_before_the_agent_record_refuses_a_record_with_spliced_branches(server, fp, tmp_path):
    """A manifest holding a spliced branch is version 2 on disk: the build before the agent record
    (which would take it for an honest history and serve it to exact requests) refuses it as a bad
    file, a cache loss and never spliced K/V served as prefilled. A plain one it still reads."""
    from vllm_mlx_persist.chain import Branch, manifest_of

    hist = chain(fp, "x", 2)
    ids = [b.block_id for b in hist]
    fmt = {"bits": 4, "group_size": 64, "block_size": TOKENS_PER_BLOCK}
    store = DiskStore(tmp_path / "cache", fp, {"test": True}, fmt)
    for b in hist:
        store.write_block(b)
    plain = Branch(ids, 2 * TOKENS_PER_BLOCK, ((0, "x"),), 1.0)
    store.write_manifest(manifest_of("x", [plain], False, 1.0))
    old = old_build(tmp_path, PRE_RECORD_BUILD, "the build before the agent record")
    assert _old_reader(old, server, fp, tmp_path / "cache")["local"] == [ids, 2 * TOKENS_PER_BLOCK]
    spliced = Branch(ids, 2 * TOKENS_PER_BLOCK, ((0, "x"), (1, "x\0amortized:1")), 2.0, (), 1)
    store.write_manifest(manifest_of("x", [plain, spliced], False, 2.0))
    assert json.loads(next((tmp_path / "cache").glob("*/agents/*.json")).read_text())["format_version"] == 2
    assert _old_reader(old, server, fp, tmp_path / "cache")["local"] is None


def fleet_pool(fp: str, root: Path, make_tier, family: tuple[str, str] | None = None, **kw):
    """A pool with its disk tier at `root` and a fleet tier from `make_tier`, its agents loaded from disk
    (`family`: (weights' fingerprint, key format), fleet.Fleet's; `kw`: more BlockPool options, e.g. its `clock`)."""
    from vllm_mlx_persist.fleet import Fleet
    from vllm_mlx_persist.pool import BlockPool

    fmt = {"bits": 4, "group_size": 64, "block_size": TOKENS_PER_BLOCK}
    pool = BlockPool(fingerprint=fp, n_layers=2, bits=4, group_size=64, block_size=TOKENS_PER_BLOCK,
                     hot_bytes=1 << 30, store=DiskStore(root, fp, {"test": True}, fmt), disk_budget=1 << 30,
                     fleet=lambda p: Fleet(p, make_tier, family), **kw)
    pool.load_manifests()
    return pool


def held(pool, agent: str) -> set:
    """The block ids of every branch the pool holds for the agent."""
    return {b for br in pool.fleet_view.branch_state(agent) or () for b in br[0]}


def test_an_erasure_holds_on_a_server_that_missed_its_tombstone(server, fp, tiers, tmp_path):
    """Server B holds agents X and Y; A erases both (tombstones) and serves a new turn of each, a new
    history on top of the tombstone, before B reads the tombstones. Each new history carries its
    tombstone's id (its era). B's sync of X erases its copy before it takes the new history; B's put
    of its old copy of Y is refused like a put onto the tombstone, and B erases that copy. The era
    survives B's restart (its local manifests carry it) and the MAC covers it; a history without one
    (from before the erasure) is neither taken by B nor kept by its next put."""
    old, new = chain(fp, "x", 3), chain(fp, "x", 2, seed=5)
    y_old, y_new = chain(fp, "y", 2, seed=1), chain(fp, "y", 1, seed=6)
    by_id = {b.block_id: b for b in old + new + y_old + y_new}
    ids = lambda hist: {b.block_id for b in hist}  # noqa: E731
    a = tiers(server.url, fp, secret=SECRET)

    def make(**cb):
        return tiers(server.url, fp, secret=SECRET, **cb)

    pool = fleet_pool(fp, tmp_path / "b", make)
    try:
        for agent, hist in (("x", old), ("y", y_old)):
            assert a.put(manifest(agent, hist), by_id) and a.flush(10)
            pool.fleet._sync_agent(agent)
            assert held(pool, agent) == ids(hist)
        for agent, hist in (("x", new), ("y", y_new)):
            assert a.erase(agent) and a.flush(10)
            assert a.get_manifest(agent).erased and a.era(agent) == a.get_manifest(agent).ident
            assert a.put(manifest(agent, hist), by_id) and a.flush(10)
            m = a.get_manifest(agent)
            assert not m.erased and m.era == a.era(agent) and not m.erasure and not m.outdated
        fleet, b = pool.fleet, pool.fleet.tier
        assert b.era("x") == "" and b.get_manifest("x").erasure == a.era("x")

        # the sync path: B's copy predates the erasure, so it goes before the new history is taken
        fleet._sync_agent("x")
        assert held(pool, "x") == ids(new) and fleet.counts["erased_from_fleet"] == 1
        assert b.era("x") == a.era("x") and pool.store.read_manifest("x").era == a.era("x")
        assert b.seen_version("x") == a.get_manifest("x").version  # adopted: its next put succeeds it

        # the put path: a save job of B's old copy of Y ends now; refused, and B erases that copy
        assert b.put(manifest("y", y_old)) and b.flush(10)
        assert b.stats()["puts_erased"] == 1 and set(a.get_manifest("y").block_ids) == ids(y_new)
        deadline = time.monotonic() + 10
        while (pool.fleet_view.branch_state("y") is not None or b.era("y") != a.era("y")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.fleet_view.branch_state("y") is None and b.era("y") == a.era("y")
        fleet._sync_agent("y")
        assert held(pool, "y") == ids(y_new) and fleet.counts["erased_from_fleet"] == 2

        # a restart: the eras come back from the local manifests; nothing to erase, nothing to fetch
        pool.close()
        pool = fleet_pool(fp, tmp_path / "b", make)
        fleet, b = pool.fleet, pool.fleet.tier
        assert (b.era("x"), b.era("y")) == (a.era("x"), a.era("y"))
        for agent in ("x", "y"):
            fleet._sync_agent(agent)
        assert fleet.counts["erased_from_fleet"] == 0 and fleet.counts["syncs_unchanged"] == 2
        assert held(pool, "x") == ids(new) and held(pool, "y") == ids(y_new)

        # the MAC covers the era: a body whose era was changed (its checksum recomputed) is refused
        raw = server.client()
        key = a.manifest_key("x")
        body = json.loads(raw.hget(key, "body"))
        del body["checksum"]
        body["era"] = "0" * 16
        body["checksum"] = "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"),
                                                                 ensure_ascii=True).encode()).hexdigest()
        good = raw.hget(key, "body")
        raw.hset(key, "body", json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
        before = b.stats()["refused_mac"]
        assert b.get_manifest("x") is None and b.stats()["refused_mac"] == before + 1
        raw.hset(key, "body", good)

        # a history without an era (a build from before eras, or one published again after Redis
        # lost the key) is from before B's erasure: B takes nothing from it, and its put replaces it
        plant(raw, a, "x", manifest("x", old), version=9, ident="cd" * 8)
        rm = b.get_manifest("x")
        assert rm.outdated and not rm.erasure and rm.era == ""
        fleet._sync_agent("x")
        assert fleet.counts["syncs_outdated"] == 1 and held(pool, "x") == ids(new)
        assert b.put(manifest("x", new)) and b.flush(10)
        m = a.get_manifest("x")
        assert set(m.block_ids) == ids(new) and m.era == a.era("x") and m.version == 10
        assert b.stats()["puts_outdated"] == 1
    finally:
        pool.close()


# ---- faults ------------------------------------------------------------------------------------------


def test_redis_killed_and_restarted(own_server, fp, tiers):
    hist = chain(fp, "k", 4)
    by_id = {x.block_id: x for x in hist}
    bound = 0.5
    t = tiers(own_server.url, fp, block_source=by_id.get, read_timeout_s=bound, connect_timeout_s=0.2,
              breaker_open_s=0.3, breaker_failures=2, max_attempts=2, backoff_s=0.05)
    assert t.put(manifest("k", hist[:2])) and t.flush(10) and t.get_block(hist[0].block_id) is not None

    own_server.kill()
    before = t.stats()
    for _ in range(5):  # no exception; each call fails fast (refused: an error, or skipped), never a time-out
        assert returns(t.get_block, hist[0].block_id) is None and returns(t.get_manifest, "k") is None
    s = t.stats()
    assert s["errors"] + s["skipped"] - before["errors"] - before["skipped"] == 10
    assert s["timeouts"] == before["timeouts"]
    assert t.put(manifest("k", hist[:3]))
    assert t.flush(30)
    s = t.stats()
    assert s["put_failures"] == 1 and s["errors"] >= 2 and s["breaker_opens"] >= 1 and not s["connected"]

    own_server.start()  # empty: no persistence
    wait_for(lambda: not t.stats()["breaker_open"], "the breaker's open time to end")
    assert t.put(manifest("k", hist)) and t.flush(10)  # missing blocks re-read from the source
    m = t.get_manifest("k")
    assert m is not None and m.block_ids == list(by_id)
    assert all(same_block(t.get_block(b), by_id[b]) for b in by_id)
    s = t.stats()
    assert s["connected"] and s["state"] == "ok" and s["puts_published"] == 2


def test_hung_redis_costs_a_bounded_wait_and_the_queue_holds(own_server, fp, tiers):
    hist = chain(fp, "h", 2)
    by_id = {x.block_id: x for x in hist}
    bound = 0.5
    # The breaker stays open far longer than the few calls below take (it only makes the end wait for it)
    t = tiers(own_server.url, fp, block_source=by_id.get, read_timeout_s=bound, connect_timeout_s=0.2,
              write_timeout_s=0.5, breaker_open_s=5.0, breaker_failures=1, max_attempts=2, backoff_s=0.05,
              queue_max=4)
    assert t.put(manifest("h", hist[:1])) and t.flush(10)

    own_server.proc.send_signal(signal.SIGSTOP)  # accepts connections, answers nothing
    try:
        assert returns(t.get_block, hist[0].block_id) is None  # ended by the read's time-out, Redis still hung
        assert t.stats()["timeouts"] == 1
        before = t.stats()
        assert before["breaker_open"]
        assert t.get_manifest("h") is None  # breaker open: skipped at once, Redis never asked
        after = t.stats()
        assert after["skipped"] == before["skipped"] + 1
        assert (after["timeouts"], after["errors"]) == (before["timeouts"], before["errors"])
        accepted = [t.put(manifest("h", hist[:2])) for _ in range(20)]
        s = t.stats()
        assert s["queue_depth"] <= 4 and s["dropped"] >= 15 and accepted.count(False) == s["dropped"]
        assert s["timeouts"] >= 1 and not s["connected"]
    finally:
        own_server.proc.send_signal(signal.SIGCONT)
    assert t.flush(30)
    wait_for(lambda: not t.stats()["breaker_open"], "the breaker's open time to end")
    assert t.put(manifest("h", hist)) and t.flush(10)
    m = t.get_manifest("h")
    assert m is not None and len(m.block_ids) == 2 and t.stats()["connected"]


def test_queue_bytes_bound_and_close_bound(own_server, fp, tiers):
    hist = chain(fp, "q", 3)
    one = len(encode_block(hist[0]))
    t = tiers(own_server.url, fp, write_timeout_s=0.5, connect_timeout_s=0.2, breaker_failures=1,
              breaker_open_s=5.0, queue_max_bytes=2 * one)
    own_server.proc.send_signal(signal.SIGSTOP)
    try:
        results = [t.put(manifest("q", hist[:k + 1]), {hist[k].block_id: hist[k]}) for k in range(3)]
        for _ in range(10):
            t.put(manifest("q", hist[:3]), {x.block_id: x for x in hist})
        s = t.stats()
        assert s["queue_bytes"] <= 2 * one + one and s["dropped"] >= 10 and results[0]
        t0 = time.monotonic()
        returns(t.close, 1.0)  # returns while Redis is hung (a hang fails the test rather than hanging it)
        assert time.monotonic() - t0 < 1.0 + 0.5 + SLACK_S  # flush bound + one write timeout
        s = t.stats()
        assert s["queue_depth"] == 0 and s["puts"] == s["dropped"] + s["put_failures"] + s["puts_published"]
        assert not t.put(manifest("q", hist[:1]))  # closed: dropped, no exception
    finally:
        own_server.proc.send_signal(signal.SIGCONT)


def test_missing_client_library_gives_a_clear_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_redis(name, *args, **kw):
        if name == "redis" or name.startswith("redis."):
            raise ImportError("No module named 'redis'")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_redis)
    with pytest.raises(ImportError, match=r"vllm-mlx-persist\[fleet\]"):
        RemoteTier(FleetSettings("redis://127.0.0.1:1/0"), "f" * 64)


def test_password_in_the_url_and_never_in_stats(tmp_path, fp, tiers):
    srv = RedisServer(tmp_path, "--requirepass", "s3cret")
    try:
        blocks = chain(fp, "pw", 1)
        good = tiers(srv.url.replace("://", "://:s3cret@"), fp)
        assert good.put(manifest("pw", blocks), {blocks[0].block_id: blocks[0]}) and good.flush(10)
        assert same_block(good.get_block(blocks[0].block_id), blocks[0])
        assert "s3cret" not in repr(good.stats()) and good.stats()["url"].startswith("redis://***@")
        bad = tiers(srv.url.replace("://", "://:wrong@"), fp)
        assert bad.get_block(blocks[0].block_id) is None and bad.get_manifest("pw") is None
        s = bad.stats()
        assert s["errors"] + s["skipped"] >= 2 and not s["connected"] and "wrong" not in repr(s)
    finally:
        srv.stop()
