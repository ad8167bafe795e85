"""End to end, a long-running server: the agent admin API over HTTP (behind --api-key), erasure that
leaves no file naming the agent, pinning, and a disk budget held across many agents and a SIGKILL
restart, on real `vllm-mlx serve --cache-backend persist_q4` processes."""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from test_e2e_server import Chat
from vllm_mlx_persist.tools.models.build import build_model_dir
from vllm_mlx_persist.tools.serving import Server

KEY = "test"  # Chat's clients send this key; the server is started with --api-key test
# key_format q4: auto's choice here, without calibrating (tests/test_e2e_server.py says why).
OPTIONS = {"block_size": 32, "hot_mb": 64, "key_format": "q4"}


def call(server: Server, method: str, path: str, key: str | None = KEY) -> tuple[int, dict]:
    req = urllib.request.Request(server.url + path, method=method)
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def files_naming(root: Path, agent_id: str) -> list[Path]:
    needle = f'"{agent_id}"'.encode()
    return [p for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("models") / "llama", arch="llama", size="tiny", seed=0)


def test_agent_api_lists_shows_pins_and_erases(model, tmp_path):
    root = tmp_path / "cache"
    with Server(model, tmp_path / "home", options={**OPTIONS, "cache_dir": str(root)},
                extra_args=("--api-key", KEY)) as server:
        alpha, beta = Chat("alpha"), Chat("beta")
        alpha.turn(server, 0)
        alpha.turn(server, 1)
        beta.turn(server, 0)

        assert call(server, "GET", "/v1/agents", key=None)[0] == 401
        assert call(server, "DELETE", "/v1/agents/alpha", key="wrong")[0] == 401
        status, listing = call(server, "GET", "/v1/agents")
        assert status == 200
        by_id = {a["id"]: a for a in listing["data"]}
        assert set(by_id) == {"alpha", "beta"}
        assert by_id["alpha"]["tokens"] > by_id["beta"]["tokens"] > 0
        assert by_id["alpha"]["bytes_disk"] > 0 and by_id["alpha"]["tier"] == "hot"
        assert listing["has_more"] is False and listing["last_id"] == "beta"
        first = call(server, "GET", "/v1/agents?limit=1")[1]  # pages by id
        assert [a["id"] for a in first["data"]] == ["alpha"] and first["has_more"] is True
        rest = call(server, "GET", f"/v1/agents?limit=1&after={first['last_id']}")[1]
        assert [a["id"] for a in rest["data"]] == ["beta"] and rest["has_more"] is False
        assert call(server, "GET", "/v1/agents?after=beta")[1]["data"] == []
        assert call(server, "GET", "/v1/agents?limit=0")[0] in (400, 422)
        assert call(server, "GET", "/v1/agents?limit=1001")[0] in (400, 422)
        assert call(server, "GET", "/v1/agents?after=bad%20id")[0] == 400
        assert call(server, "GET", "/v1/agents/beta")[1]["id"] == "beta"
        assert call(server, "GET", "/v1/agents/nobody")[0] == 404
        assert call(server, "GET", "/v1/agents/bad%20id")[0] == 400
        assert call(server, "DELETE", "/v1/agents/nobody")[0] == 404

        assert call(server, "PUT", "/v1/agents/beta/pin") == (200, {"id": "beta", "pinned": True})
        assert call(server, "GET", "/v1/agents/beta")[1]["pinned"] is True
        assert call(server, "PUT", "/v1/agents/nobody/pin")[0] == 404

        assert files_naming(root, "alpha")
        assert call(server, "DELETE", "/v1/agents/alpha") == (200, {"id": "alpha", "deleted": True})
        assert not files_naming(root, "alpha")  # durable before the reply
        assert call(server, "GET", "/v1/agents/alpha")[0] == 404
        assert call(server, "DELETE", "/v1/agents/alpha")[0] == 404

        _, cached, _ = Chat("alpha").send(server, alpha.messages[:-1])
        assert cached == 0  # gone from memory too
        beta.turn(server, 1)
        assert beta.cached[1] > 0  # the other agent is untouched
        assert call(server, "DELETE", "/v1/agents/beta/pin")[1] == {"id": "beta", "pinned": False}


def test_disk_budget_holds_across_many_agents_and_a_sigkill(model, tmp_path):
    with Server(model, tmp_path / "probe", options=OPTIONS) as probe:
        Chat("probe").turn(probe, 0)
        one = probe.get_json("/v1/agents")["data"][0]["bytes_disk"]
    root = tmp_path / "cache"
    budget_mb = one * 6.5 / 2**20  # room for about six agents of one turn
    server = Server(model, tmp_path / "home", options={**OPTIONS, "cache_dir": str(root), "disk_mb": budget_mb})
    chats = [Chat(f"agent-{i}") for i in range(32)]
    with server:
        for chat in chats:
            chat.turn(server, 0)
        stats = server.get_json("/v1/status")
        used = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
        assert used <= budget_mb * 2**20 + 8192, (used, stats)  # model.json and the lock file aside
        server.stop(signal.SIGKILL)
        assert not files_naming(root, "agent-0") and files_naming(root, "agent-31")
        server.start()
        for chat in chats[-3:]:  # the most recent agents survived the budget and the crash
            chat.turn(server, 1)
            assert chat.cached[1] >= chat.prompt_tokens[0] - 1, chat.cached
        _, cached, _ = chats[0].send(server, chats[0].messages + [{"role": "user", "content": "again"}])
        assert cached == 0  # the oldest was erased to make room
