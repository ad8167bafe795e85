"""End to end, the fleet tier: two real `vllm-mlx serve --cache-backend persist_q4` servers with their
own cache roots and one real redis-server. An agent moves between servers with zero re-prefill and
the same answers as on one server; concurrent turns on both servers lose nothing; Redis killed and
restarted fails no request; an erasure on one server is seen by the other; a damaged value in Redis
is never served; a fork and an agent's branches move with it. The servers share a secret (A reads it
from a file, remote_secret_file; B from the environment): every value carries its HMAC. Servers
without one are tested end to end by test_remote_cluster.py.

Tolerance: greedy decoding; a cache fetched from Redis holds the same bits as the one the other
server computed, so outputs must be identical to a one-server conversation (which itself matches
cold prefill on these models, see test_e2e_server.py)."""

from __future__ import annotations

import hashlib
import json
import signal
import threading
import time
from contextlib import contextmanager

import pytest

from test_e2e_lifecycle import call
from test_e2e_server import Chat, user_text
from test_e2e_sharing import Worker, doc_messages
from vllm_mlx_persist.fleet import SECRET_ENV
from vllm_mlx_persist.disk_format import decode_block
from vllm_mlx_persist.tools.models.build import build_model_dir
from vllm_mlx_persist.tools.serving import Server

redis = pytest.importorskip("redis", reason='the fleet extra is not installed: pip install -e ".[fleet]"')
from test_remote import RedisServer  # noqa: E402

BLOCK = 32
KEY = "test"
SECRET = "e2e fleet secret, 32 bytes long!"


def options(root, url: str, key_format: str = "q4") -> dict:
    # Matching by text off: these tests compare a served turn with another server's (or a cold) turn
    # on the same re-rendered messages, i.e. the same prompt tokens (see tests/test_e2e_server.py).
    return {"block_size": BLOCK, "hot_mb": 64, "cache_dir": str(root), "remote_url": url,
            "remote_wait_s": 10.0,  # generous: a bound checked elsewhere, not a timing
            "match_text": False, "key_format": key_format}  # q4: what auto chooses here, without calibrating


@contextmanager
def running(rds: RedisServer, *servers: Server):
    """(rds, *servers) with the servers started; at exit every server stopped, then Redis."""
    try:
        for server in servers:
            server.start()
        yield (rds, *servers)
    finally:
        for server in servers:
            server.stop()
        rds.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """(redis, server A, server B): started once for the module."""
    tmp = tmp_path_factory.mktemp("fleet")
    model = build_model_dir(tmp / "model", arch="llama", size="micro", seed=0)
    rds = RedisServer(tmp)
    secret_file = tmp / "fleet.secret"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o600)
    a = Server(model, tmp / "a", options={**options(tmp / "a-cache", rds.url), "remote_secret_file": str(secret_file)},
               extra_args=("--api-key", KEY))
    b = Server(model, tmp / "b", options=options(tmp / "b-cache", rds.url), extra_args=("--api-key", KEY),
               env={SECRET_ENV: SECRET})
    with running(rds, a, b) as started:
        yield started


class Conversation:
    """One agent's conversation with a text of its own `label`, each turn sent to a chosen server."""

    def __init__(self, agent: str, label: str):
        self.chat = Chat(agent)
        self.label = label
        self.outputs: list[str] = []
        self.cached: list[int] = []
        self.prompts: list[int] = []

    def turn(self, server: Server) -> str:
        msgs = self.chat.messages + [{"role": "user", "content": user_text(self.label, len(self.outputs))}]
        text, cached, prompt = self.chat.send(server, msgs)
        self.chat.messages = msgs + [{"role": "assistant", "content": text}]
        self.outputs.append(text)
        self.cached.append(cached)
        self.prompts.append(prompt)
        return text


def remote(server: Server) -> dict:
    status, body = call(server, "GET", "/v1/status")
    assert status == 200, body
    return body["cache"]["remote"]


def wait_for(cond, what: str, timeout: float = 30.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def manifest(rds: RedisServer, agent: str) -> dict:
    """The agent's manifest hash in Redis (any model prefix), decoded; {} if absent."""
    client = rds.client()
    keys = list(client.scan_iter(match="vmp:*:a:" + hashlib.sha256(agent.encode()).hexdigest()))
    if not keys:
        return {}
    h = {k.decode(): v for k, v in client.hgetall(keys[0]).items()}
    if "body" in h:
        h["body"] = json.loads(h["body"])
    return h


def published(rds: RedisServer, agent: str, n_tokens: int) -> bool:
    m = manifest(rds, agent)
    return "body" in m and m["body"]["n_tokens"] >= n_tokens


def test_agent_moves_to_another_server_with_zero_reprefill(fleet):
    rds, a, b = fleet
    ref = Conversation("ref-move", "move")
    for _ in range(3):
        ref.turn(a)
    moved = Conversation("moved", "move")
    moved.turn(a)
    moved.turn(a)
    wait_for(lambda: published(rds, "moved", moved.prompts[1]), "A's turn 2 in Redis")
    moved.turn(b)
    assert moved.outputs == ref.outputs
    assert moved.cached == ref.cached  # B reused exactly what A would have
    assert moved.cached[2] >= moved.prompts[1], moved.cached
    stats = remote(b)
    assert stats["agents_fetched"] >= 1 and stats["blocks_fetched"] >= moved.prompts[1] // BLOCK, stats
    assert stats["refused"] == 0 and stats["authenticated"] and stats["key_id"] == remote(a)["key_id"]
    assert stats["keyspace"].endswith(f":r3:k{stats['key_id']}:") and SECRET not in json.dumps(stats)
    value = rds.client().get(stats["keyspace"] + "b:" + manifest(rds, "moved")["body"]["block_ids"][0])
    assert value[-40:-32] == b"vmp-hmac"  # the block file, then its MAC
    # B's turn 3 reached Redis too; back on A, turn 4 reuses it (A fetches only B's new blocks)
    wait_for(lambda: published(rds, "moved", moved.prompts[2]), "B's turn 3 in Redis")
    ref.turn(a)
    moved.turn(a)
    assert moved.outputs == ref.outputs and moved.cached[3] == ref.cached[3], (moved.cached, ref.cached)
    info = call(b, "GET", "/v1/agents/moved")[1]
    assert info["remote"]["version"] is not None


def test_same_agent_on_both_servers_at_once_loses_no_turn(fleet):
    rds, a, b = fleet
    ref = Conversation("ref-both", "both")
    conv = {s.url: Conversation("both", "both") for s in (a, b)}
    for turn in range(3):
        ref.turn(a)
        threads = [threading.Thread(target=conv[s.url].turn, args=(s,)) for s in (a, b)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        for c in conv.values():
            assert c.outputs == ref.outputs, (c.outputs, ref.outputs)
    # Redis ends on the last turn (the longest history), whichever server published last
    wait_for(lambda: published(rds, "both", ref.prompts[2]), "the last turn in Redis")
    for s in (a, b):
        wait_for(lambda: remote(s)["queue_depth"] == 0, "uploads done")
    # and either server continues from it
    for s in (a, b):
        c = conv[s.url]
        c.turn(s)
        assert c.cached[3] >= c.prompts[2], c.cached


def test_fork_moves_to_another_server_with_its_parents_prefix(fleet):
    rds, a, b = fleet
    _, _, doc_tokens = Chat("fork-parent").send(a, doc_messages("summarize"))
    # the fork and a reference fork (another agent taking the same turns), both on A
    first = doc_messages("task for the fork")
    (text, cached, prompt), (ref_text, ref_cached, _) = [
        Worker(agent, "fork-parent").send(a, first) for agent in ("fork-child", "fork-ref")]
    assert text == ref_text and cached == ref_cached and 0 < cached < prompt and cached >= doc_tokens - 40
    wait_for(lambda: published(rds, "fork-child", prompt), "the fork's turn in Redis")
    # the fork's chain starts in its parent's namespace: Redis must carry its links
    branches = manifest(rds, "fork-child")["body"]["branches"]
    assert branches[-1]["links"][0] == [0, "fork-parent"] and branches[-1]["links"][-1][1] == "fork-child"
    before = remote(b)
    # its next turn on B (no fork named any more: the agent's own history) reuses the parent's prefix
    # and the fork's own blocks, and answers as A does
    msgs = first + [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
    got = Chat("fork-child").send(b, msgs)
    want = Chat("fork-ref").send(a, msgs)
    assert got == want and got[1] >= prompt, (got, want)
    after = remote(b)
    assert after["chain_refused"] == before["chain_refused"] and after["fetch_incomplete"] == before["fetch_incomplete"]
    assert after["blocks_fetched"] > before["blocks_fetched"]
    info = call(b, "GET", "/v1/agents/fork-child")[1]
    assert info["forked_from"] == ["fork-parent"] and info["remote"]["version"] is not None, info


def test_branches_move_with_the_agent(fleet):
    rds, a, b = fleet
    agents = ("branched", "ref-branched")
    turn0 = [{"role": "user", "content": user_text("branched", 0)}]
    text0 = [Chat(x).send(a, turn0)[0] for x in agents]
    assert text0[0] == text0[1]
    # two continuations of turn 0 on A: the agent (and the reference) hold two branches
    conts = [turn0 + [{"role": "assistant", "content": text0[0]},
                      {"role": "user", "content": user_text(f"branch{i}", 1)}] for i in range(2)]
    sent = {(x, i): Chat(x).send(a, conts[i]) for i in range(2) for x in agents}
    # (turn 0 stays a branch of its own too: its stored tokens end with the reply as generated,
    # which the re-rendered history does not repeat token for token)
    n_branches = len(call(a, "GET", "/v1/agents/branched")[1]["branches"])
    assert n_branches >= 2
    wait_for(lambda: len(manifest(rds, "branched").get("body", {}).get("branches") or []) == n_branches
             and published(rds, "branched", sent["branched", 1][2]), "every branch in Redis")
    before = remote(b)
    # on B, each branch's next turn (the older branch first) reuses that branch and answers as on A
    for i in range(2):
        msgs = conts[i] + [{"role": "assistant", "content": sent["branched", i][0]},
                           {"role": "user", "content": "go on"}]
        got = Chat("branched").send(b, msgs)
        want = Chat("ref-branched").send(a, msgs)
        assert got == want and got[1] >= sent["branched", i][2], (i, got, want)
    after = remote(b)
    assert after["agents_fetched"] == before["agents_fetched"] + 1 and after["fetch_incomplete"] == before["fetch_incomplete"]
    assert (call(b, "GET", "/v1/agents/branched")[1]["branches"]
            == call(a, "GET", "/v1/agents/ref-branched")[1]["branches"])


def test_erasure_on_one_server_is_seen_by_the_other(fleet):
    rds, a, b = fleet
    conv = Conversation("erased", "erased")
    conv.turn(a)
    wait_for(lambda: published(rds, "erased", conv.prompts[0]), "A's turn in Redis")
    conv.turn(b)  # B now holds the agent too, on its own disk
    assert conv.cached[1] >= conv.prompts[0]
    wait_for(lambda: published(rds, "erased", conv.prompts[1]), "B's turn in Redis")

    assert call(a, "DELETE", "/v1/agents/erased") == (200, {"id": "erased", "deleted": True})
    wait_for(lambda: manifest(rds, "erased").get("e") == b"1", "the tombstone in Redis")
    # B's next turn for the agent reuses nothing, and B erased its own copy
    _, cached, _ = Chat("erased").send(b, conv.chat.messages + [{"role": "user", "content": "again"}])
    assert cached == 0  # B dropped its own copy (memory and disk) before the lookup
    assert remote(b)["erased_from_fleet"] >= 1
    # an agent B never knew locally can still be erased fleet-wide from B
    other = Conversation("erased-2", "erased-2")
    other.turn(a)
    wait_for(lambda: published(rds, "erased-2", other.prompts[0]), "A's turn in Redis")
    assert call(b, "DELETE", "/v1/agents/erased-2")[0] == 200
    wait_for(lambda: manifest(rds, "erased-2").get("e") == b"1", "the tombstone in Redis")
    _, cached, _ = Chat("erased-2").send(a, other.chat.messages + [{"role": "user", "content": "again"}])
    assert cached == 0


def test_damaged_value_in_redis_is_refused(fleet):
    rds, a, b = fleet
    ref = Conversation("ref-damaged", "damaged")
    conv = Conversation("damaged", "damaged")
    for c in (ref, conv):
        c.turn(a)
        c.turn(a)
    wait_for(lambda: published(rds, "damaged", conv.prompts[1]), "A's turn 2 in Redis")
    ids = manifest(rds, "damaged")["body"]["block_ids"]
    assert len(ids) >= 3
    client = rds.client()
    key = next(iter(client.scan_iter(match="vmp:*:b:" + ids[1])))
    value = bytearray(client.get(key))
    value[-45] ^= 0x40  # one bit in the K/V data (before the 40-byte MAC trailer): the MAC catches it
    client.set(key, bytes(value))
    refused = remote(b)["refused"]
    ref.turn(a)
    conv.turn(b)
    assert conv.outputs == ref.outputs  # correct output: the damaged block was never served
    assert conv.cached[2] == BLOCK  # the block before the damaged one is still reused
    assert remote(b)["refused"] == refused + 1 and remote(b)["refused_mac"] >= 1
    # deleted, so B's put (or the next one) stores a sound copy (B's own KV for those tokens: equal to A's
    # up to float rounding, since B prefilled them in other chunks)
    now = client.get(key)
    assert now != bytes(value)
    if now is not None:
        decode_block(now[:-40], ids[1])


def test_redis_killed_and_restarted_fails_no_request(fleet):
    rds, a, b = fleet
    ref = Conversation("ref-outage", "outage")
    conv = Conversation("outage", "outage")
    ref.turn(a)
    conv.turn(a)
    rds.proc.send_signal(signal.SIGSTOP)  # hung: accepts connections, never answers
    try:
        hung = Conversation("outage-hung", "outage")
        hung.turn(b)  # served cold after at most remote_timeout_s of waiting for Redis
        assert hung.outputs == ref.outputs[:1] and hung.cached == [0]
        r = remote(b)  # B noticed: a read timed out, or its breaker skipped Redis outright
        assert r["timeouts"] + r["skipped"] + r["errors"] >= 1, r
    finally:
        rds.proc.send_signal(signal.SIGCONT)
    rds.kill()
    ref.turn(a)
    conv.turn(a)  # Redis down: served from memory and disk, no error
    ref.turn(a)
    conv.turn(b)  # B cannot reach Redis: cold, but correct
    assert conv.outputs == ref.outputs and conv.cached[2] == 0
    rds.start()  # back, empty (no persistence)
    ref.turn(a)
    conv.turn(a)  # A's put re-uploads the agent's blocks from its disk once Redis answers again
    assert conv.outputs == ref.outputs
    wait_for(lambda: published(rds, "outage", conv.prompts[3]), "the tier to recover", timeout=60)
    ref.turn(a)
    conv.turn(b)
    assert conv.outputs == ref.outputs
    assert conv.cached[4] >= conv.prompts[3], conv.cached
    stats = remote(a)
    assert stats["connected"] and stats["errors"] + stats["timeouts"] + stats["skipped"] > 0, stats


def test_a_bad_secret_refuses_start_up_in_one_line(fleet, tmp_path):
    rds, a, _ = fleet
    short = "not 16 bytes"
    srv = Server(a.model, tmp_path / "home", options=options(tmp_path / "cache", rds.url),
                 env={SECRET_ENV: short})
    with pytest.raises(RuntimeError, match="exited with 3"):
        srv.start(timeout=120)
    log = srv.log_tail(400)
    assert "Traceback" not in log, log
    (line,) = [l for l in log.splitlines() if "persist_q4: " in l and "ERROR" in l]
    assert SECRET_ENV in line and "at least 16" in line and short not in log, line


def _edit(server: Server, agent: str, messages: list[dict], mode: str, max_tokens: int = 4) -> dict:
    """An edited conversation sent with X-KV-Edit; returns its usage."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    r = client.chat.completions.create(model=server.model, messages=messages, max_tokens=max_tokens, temperature=0.0,
                                       metadata={"agent_id": agent}, extra_headers={"X-KV-Edit": mode})
    return r.usage.model_dump()


def _spliced_on(server: Server, rds: RedisServer, agent: str) -> tuple[list[dict], dict]:
    """Three turns of `agent` on `server`, then an amortize edit (its first user message replaced)
    published to Redis: (the edited messages, the edit's usage.kv_edit)."""
    conv = Conversation(agent, agent)
    for _ in range(3):
        conv.turn(server)
    msgs = conv.chat.messages
    edited = msgs[:1] + [{"role": "user", "content": "(removed)"}] + msgs[3:] + [{"role": "user", "content": "go"}]
    report = _edit(server, agent, edited, "amortize")["kv_edit"]
    assert report["applied"] and report["plan"], report
    wait_for(lambda: any(br.get("generation") for br in manifest(rds, agent).get("body", {}).get("branches", [])),
             "the spliced history in the agent's record in Redis")
    return edited, report


def test_a_spliced_history_moves_to_another_server(fleet):
    """A splices an edited conversation (amortize); B's amortize request for it reads A's spliced
    history back from Redis instead of splicing again; B's exact request never sees it."""
    rds, a, b = fleet
    edited, first = _spliced_on(a, rds, "spl")
    again = _edit(b, "spl", edited, "amortize")
    report, cached = again["kv_edit"], again["prompt_tokens_details"]["cached_tokens"]
    assert report["applied"] and "plan" not in report, report  # read back, not spliced again
    assert cached == again["prompt_tokens"] - 1  # all but the last token: A's spliced turn, stub included
    assert cached == report["exact_prefix_tokens"] + report["spliced_tokens"]
    _, cached, _ = Chat("spl").send(b, edited)  # exact: the honest prefix only
    assert cached <= first["exact_prefix_tokens"] + 1


def test_erasing_an_agent_erases_its_spliced_histories_fleet_wide(fleet):
    """Erasing the agent on B, which never saw its spliced history, removes that history from Redis
    and from A, where it was made: it is part of the agent's record, which the tombstone replaces."""
    rds, a, b = fleet
    edited, _ = _spliced_on(a, rds, "spl-e")
    assert call(b, "DELETE", "/v1/agents/spl-e")[0] == 200
    wait_for(lambda: manifest(rds, "spl-e").get("e") == b"1", "the agent's tombstone")
    wait_for(lambda: _edit(a, "spl-e", edited, "amortize")["kv_edit"]["fallback"] == "no_history",
             "A dropping the agent and its spliced history")


def _stream_and_drop(server: Server, agent: str, messages: list[dict], mode: str) -> None:
    """A streamed request with X-KV-Edit that the client drops after its first token (the lookup, and
    with it the forget's supersede, has happened then)."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    stream = client.chat.completions.create(model=server.model, messages=messages, max_tokens=2048, temperature=0.0,
                                            metadata={"agent_id": agent}, extra_headers={"X-KV-Edit": mode},
                                            stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    stream.close()


def _removals(rds: RedisServer, agent: str) -> list:
    return manifest(rds, agent).get("body", {}).get("removals", [])


def test_a_forget_on_one_server_wins_on_every_other(fleet):
    """Issue #30: A's forget was undone by B, which had synced the agent: B still served the forgotten
    branch, and B's next put brought it back to Redis and to A. Now the forget's removal record
    travels with the agent's record and wins in every merge: B, which holds the old history, serves
    nothing past the edit; B's next turn (of the edited conversation) does not bring it back; and
    neither server reuses the forgotten history afterwards."""
    rds, a, b = fleet
    conv = Conversation("fgt", "fgt")
    conv.turn(a)
    conv.turn(a)
    conv.turn(b)  # B holds the whole history: synced from Redis, then its own turn on it
    wait_for(lambda: published(rds, "fgt", conv.prompts[2]), "B's turn in Redis")
    old = conv.chat.messages
    edited = old[:1] + [{"role": "assistant", "content": "(forgotten)"}] + old[2:] + [
        {"role": "user", "content": "go on"}]
    forget = _edit(a, "fgt", edited, "forget")["kv_edit"]
    assert forget["applied"] and forget["superseded_branches"] >= 1, forget
    prefix = forget["exact_prefix_tokens"]
    assert 0 < prefix < conv.prompts[1]
    wait_for(lambda: _removals(rds, "fgt"), "the forget's removal record in Redis")
    # B's next turn continues the edited conversation: its put merges with A's record, and the
    # forgotten branch B still held does not come back
    _, cached, _ = Chat("fgt").send(b, edited + [{"role": "assistant", "content": "ok"},
                                                 {"role": "user", "content": "and then"}])
    assert cached >= prefix
    removed = {r["block"] for r in _removals(rds, "fgt")}
    wait_for(lambda: remote(b)["puts_merged"] + remote(b)["puts_published"] > 0 and not any(
        removed & set(br["block_ids"]) for br in manifest(rds, "fgt")["body"].get("branches", [])),
        "B's put, without the forgotten branch")
    # B, which held the old history, serves nothing past the edit point of the old conversation (the
    # request re-sends the old content: from then on that is a new history of it, which stays)
    _, cached, _ = Chat("fgt").send(b, old + [{"role": "user", "content": "remember?"}])
    assert cached <= prefix + 1, (cached, prefix)


def test_an_aborted_forget_still_wins_fleet_wide(fleet):
    """Issue #30: a forget superseding every branch (the first message edited) on a request the client
    dropped: the agent was dropped locally with no tombstone and no new manifest, and the next request
    of the old conversation reused it from Redis. Now the record keeps the removal (with no branch
    left), is published, and neither server serves the forgotten history."""
    rds, a, b = fleet
    conv = Conversation("fgt-abort", "fgt-abort")
    conv.turn(a)
    conv.turn(a)
    conv.turn(b)
    wait_for(lambda: published(rds, "fgt-abort", conv.prompts[2]), "B's turn in Redis")
    old = conv.chat.messages
    edited = [{"role": "user", "content": "a different first message"}] + old[1:] + [
        {"role": "user", "content": "go on"}]
    _stream_and_drop(a, "fgt-abort", edited, "forget")
    wait_for(lambda: _removals(rds, "fgt-abort"), "the aborted forget's removal record in Redis", timeout=60)
    body = manifest(rds, "fgt-abort")["body"]
    removed = {r["block"] for r in body["removals"]}
    # nothing of the old history left (the edited request's own turn, if it finished before the
    # client's drop reached the server, is the only history there may be)
    assert not removed & set(body["block_ids"]), body
    # B held the old history: it serves none of it (the template's first tokens at most)
    _, cached, _ = Chat("fgt-abort").send(b, old + [{"role": "user", "content": "remember?"}])
    assert cached <= 8, cached


def test_a_forget_queues_no_erasure(fleet):
    """Issue #30: every forget queued erasures for every spliced generation even when the agent never
    used amortize (3 forgets cost 12 directory fsyncs, 12 queued tier erasures and 4 Redis
    tombstones). Now a forget changes the agent's record only: each is one turn's save, no agent is
    erased and no tombstone written. (Each of these forgets removes only the previous reply's tokens,
    which the client's re-rendered reply does not repeat exactly.)"""
    rds, a, _ = fleet
    conv = Conversation("fgt-none", "fgt-none")
    conv.turn(a)
    before_remote, before = remote(a), call(a, "GET", "/v1/status")[1]["cache"]
    for k in range(3):
        msgs = conv.chat.messages + [{"role": "user", "content": f"more {k}"}]
        report = _edit(a, "fgt-none", msgs, "forget")["kv_edit"]
        assert report["applied"] and report["exact_prefix_tokens"] >= conv.prompts[0], report
        conv.chat.messages = msgs + [{"role": "assistant", "content": "ok"}]
    after_remote, after = remote(a), call(a, "GET", "/v1/status")[1]["cache"]
    assert after_remote["erases"] == before_remote["erases"]
    assert after["agents_erased"] == before["agents_erased"]
    assert after["saves"] - before["saves"] <= 3  # each turn's own save, nothing else
    assert manifest(rds, "fgt-none").get("e") != b"1"


def test_a_fork_refusal_on_one_server_holds_on_every_other(fleet):
    """Issue #44 (finding 2): `DELETE /v1/agents/P/forkable` on A was written to Redis, but no server
    read it back: B, which held P, allowed forks, and B's next publish of P dropped the refusal from
    Redis. Now the setting travels with P's record and merges by the latest set: B's admission reads
    it (issue #53, item 6), so a fork request on B is refused (403) although B's own copy of P still
    allows it, and B's publish of P keeps the refusal. (A request admitted just before the refusal
    reached Redis is served nothing of P: test_fleet_partitions.py, the pool level.)"""
    import openai

    rds, a, b = fleet
    conv = Conversation("guarded-f", "guarded-f")
    conv.turn(a)
    conv.turn(b)  # B holds P, synced from Redis, and its own turn on it
    wait_for(lambda: published(rds, "guarded-f", conv.prompts[1]), "B's turn in Redis")
    assert call(a, "DELETE", "/v1/agents/guarded-f/forkable")[0] == 200
    wait_for(lambda: manifest(rds, "guarded-f").get("body", {}).get("forkable") is False,
             "the refusal in Redis")
    probe = conv.chat.messages + [{"role": "user", "content": "tell me what it said"}]
    for peek in ("peek-f", "peek-g"):  # the first one on B's own copy, not synced since the refusal
        with pytest.raises(openai.PermissionDeniedError, match="may not fork"):
            Worker(peek, "guarded-f", "header").send(b, probe)
    before = remote(b)
    conv.turn(b)  # B publishes P's record
    wait_for(lambda: remote(b)["puts_published"] + remote(b)["puts_merged"]
             > before["puts_published"] + before["puts_merged"], "B's put of P")
    assert manifest(rds, "guarded-f")["body"].get("forkable") is False
    assert call(a, "GET", "/v1/agents/guarded-f")[1]["forkable"] is False


def test_a_forget_acknowledged_before_a_crash_holds_fleet_wide(fleet, tmp_path):
    """Issue #53 (item 1): server C, cut off from Redis (a partition proxy), forgets a reply of agent Y
    (acknowledged), is SIGKILLed; Redis comes back, C restarts. B, which synced Y before the forget,
    then serves Y's old conversation: it must reuse nothing past the edit point. The forget's publish
    was pending in C's outbox before C answered, and the restarted C sends it without any request."""
    from vllm_mlx_persist.tools.reliability.partition import PartitionProxy

    rds, a, b = fleet
    proxy = PartitionProxy("127.0.0.1", rds.port)
    c = Server(a.model, tmp_path / "c", options=options(tmp_path / "c-cache", proxy.url),
               extra_args=("--api-key", KEY), env={SECRET_ENV: SECRET})
    try:
        c.start()
        conv = Conversation("crash-fgt", "crash-fgt")
        conv.turn(c)
        conv.turn(c)
        wait_for(lambda: published(rds, "crash-fgt", conv.prompts[1]), "C's turn in Redis")
        conv.turn(b)  # B holds Y: synced from Redis, and its own turn on it
        wait_for(lambda: published(rds, "crash-fgt", conv.prompts[2]), "B's turn in Redis")
        old = conv.chat.messages
        edited = old[:1] + [{"role": "assistant", "content": "(forgotten)"}] + old[2:] + [
            {"role": "user", "content": "go on"}]
        proxy.cut()
        forget = _edit(c, "crash-fgt", edited, "forget")["kv_edit"]  # the acknowledgement
        assert forget["applied"] and forget["superseded_branches"] >= 1, forget
        prefix = forget["exact_prefix_tokens"]
        c.stop(signal.SIGKILL)
        assert not _removals(rds, "crash-fgt")  # it never reached Redis before the kill
        proxy.heal()
        c.start()
        wait_for(lambda: _removals(rds, "crash-fgt"), "the forget's removal in Redis from C's outbox", timeout=60)
        _, cached, _ = Chat("crash-fgt").send(b, old + [{"role": "user", "content": "remember?"}])
        assert cached <= prefix + 1, (cached, prefix)
    finally:
        c.stop()
        proxy.close()


def test_a_fork_is_answered_alike_on_a_server_that_never_served_the_parent(fleet):
    """Issue #53, item 6: P set non-forkable on A; B never served P nor synced it. A fork of P is
    refused (403) on B exactly as on A: B's admission reads P's settings in Redis, not only its own
    (empty) knowledge of P. A grant on A is then a fork on B, served from P's history; an agent no
    server knows is answered like a forkable one under the open policy (no existence leak)."""
    import openai

    rds, a, b = fleet
    conv = Conversation("private-p", "private-p")
    conv.turn(a)
    assert call(a, "DELETE", "/v1/agents/private-p/forkable")[0] == 200
    wait_for(lambda: manifest(rds, "private-p").get("body", {}).get("forkable") is False, "the refusal in Redis")
    assert call(b, "GET", "/v1/agents/private-p")[0] == 404  # B never served P
    probe = conv.chat.messages + [{"role": "user", "content": "what did it say?"}]
    for server, child in ((a, "pry-a"), (b, "pry-b")):
        with pytest.raises(openai.PermissionDeniedError, match="may not fork"):
            Worker(child, "private-p", "header").send(server, probe)
    assert call(b, "GET", "/v1/agents/pry-b")[0] == 404  # nothing of the refused request was stored
    _, cached, _ = Worker("pry-none", "nobody-knows-this-agent", "header").send(b, probe)
    assert cached == 0
    # a grant travels the same way
    assert call(a, "PUT", "/v1/agents/private-p/forkable")[0] == 200
    wait_for(lambda: manifest(rds, "private-p").get("body", {}).get("forkable") is True, "the grant in Redis")
    _, cached, _ = Worker("granted-b", "private-p", "header").send(b, probe)
    assert cached >= conv.prompts[0] // BLOCK * BLOCK > 0, cached
