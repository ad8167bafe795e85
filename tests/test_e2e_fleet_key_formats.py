"""End to end (issue #53 item 4): two real servers of one model's weights on one Redis, one storing keys
as q4 and one as k8v4 (a rolling change of key_format). They share no K/V (the key format is part of
the fingerprint naming the keyspace), but the mixed fleet is reported (/v1/status, /health) and
DELETE on the server that never served an agent is not a 404: the other one then serves nothing of
it. Pool level: tests/test_fleet_key_formats.py."""

from __future__ import annotations

import pytest

from test_e2e_fleet import Conversation, options, remote, running, wait_for
from test_e2e_lifecycle import call
from vllm_mlx_persist.tools.models.build import build_model_dir
from vllm_mlx_persist.tools.serving import Server

redis = pytest.importorskip("redis", reason='the fleet extra is not installed: pip install -e ".[fleet]"')
from test_remote import RedisServer  # noqa: E402


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mixed")
    model = build_model_dir(tmp / "model", arch="llama", size="micro", seed=0)
    rds = RedisServer(tmp)
    a = Server(model, tmp / "a", options=options(tmp / "a-cache", rds.url, "q4"))
    b = Server(model, tmp / "b", options=options(tmp / "b-cache", rds.url, "k8v4"))
    with running(rds, a, b) as started:
        yield started


def _health(server: Server) -> dict:
    status, body = call(server, "GET", "/health")
    assert status == 200, body
    return body


def test_mixed_key_formats_are_reported_and_an_erasure_reaches_both(mixed):
    rds, a, b = mixed
    conv = Conversation("split", "split")
    conv.turn(b)
    conv.turn(b)
    assert conv.cached[1] > 0  # B serves it
    wait_for(lambda: remote(b)["puts_published"] >= 2, "B's turns in Redis")
    # A never served the agent, and is asked to erase it: not a 404, and B then serves nothing of it
    assert call(a, "DELETE", "/v1/agents/split")[0] == 200
    wait_for(lambda: remote(a).get("family_erasures", 0) >= 1, "the tombstone in B's keyspace")
    _, cached, _ = Conversation("split", "split").chat.send(
        b, conv.chat.messages + [{"role": "user", "content": "again"}])
    assert cached == 0, b.log_tail()  # B dropped its copy before the lookup
    # Both report the mixed fleet (A read the family again at the erasure; B at its start)
    for server in (a, b):
        stats = remote(server)
        assert stats["mixed_key_formats"] and stats["key_formats"] == ["k8v4", "q4"], stats
        assert stats["keyspaces_of_weights"] == 2
        assert _health(server)["cache_backend"]["fleet_key_formats"] == ["k8v4", "q4"]
    assert "MIXED FLEET" in b.log_tail(400) and "MIXED FLEET" in a.log_tail(400)
