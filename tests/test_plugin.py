"""The plugin's namespace hook answers for persist_q4 only. vllm-mlx calls every installed plugin's
hooks, whichever backend `--cache-backend` selected, so without a persist_q4 backend serving in this
process the hook abstains (None) and refuses nothing; with one, it resolves and validates agent ids."""

from __future__ import annotations

import weakref
from types import SimpleNamespace
from typing import Any, Optional

import pytest

from vllm_mlx_persist import plugin


def resolve(headers: dict[str, str], metadata: Optional[dict[str, Any]] = None, key: Optional[str] = None):
    request = SimpleNamespace(metadata=metadata, prompt_cache_key=key)
    return plugin.vllm_mlx_cache_namespace(request=request, headers=headers, endpoint="/v1/chat/completions")


@pytest.fixture
def other_backend(monkeypatch):
    """Another plugin's backend serves: persist_q4 built none in this process."""
    monkeypatch.setattr(plugin, "_LIVE_BACKENDS", weakref.WeakSet())


MALFORMED = [
    ({"x-agent-id": "bad id!"}, None, "may only contain"),
    ({}, {"agent_id": 7}, "must be a string"),
    ({"x-agent-fork-from": "mom"}, None, "needs an agent id of its own"),
    ({"x-agent-id": "a", "x-agent-fork-from": "a"}, None, "cannot fork from itself"),
    ({"x-kv-edit": "forget"}, None, "needs an agent id"),
    ({"x-agent-id": "a", "x-kv-edit": "splice"}, None, "amortize, forget"),
]
WELL_FORMED = [
    ({"x-agent-id": "alice"}, {"agent_id": "bob"}, "carol", "alice"),  # the header wins
    ({}, {"agent_id": "bob"}, "carol", "bob"),
    ({}, None, "carol", "carol"),
    ({"x-agent-id": "kid", "x-agent-fork-from": "mom"}, None, None, "kid\0fork:mom"),
    ({}, None, None, None),
]


@pytest.mark.parametrize("headers, metadata, match", MALFORMED)
def test_serving_refuses_a_malformed_request(serving_backend, headers, metadata, match):
    with pytest.raises(ValueError, match=match):
        resolve(headers, metadata)


@pytest.mark.parametrize("headers, metadata, key, want", WELL_FORMED)
def test_serving_resolves_the_agent(serving_backend, headers, metadata, key, want):
    assert resolve(headers, metadata, key) == want


def test_another_backend_serving_gets_no_answer_and_no_refusal(other_backend):
    for headers, metadata, _ in MALFORMED:
        assert resolve(headers, metadata) is None
    for headers, metadata, key, _ in WELL_FORMED:
        assert resolve(headers, metadata, key) is None


def test_a_closed_backend_no_longer_answers(serving_backend):
    assert resolve({"x-agent-id": "alice"}) == "alice"
    serving_backend.close()  # engine teardown (Scheduler.close_cache_backend)
    assert plugin.live_backend() is None
    assert resolve({"x-agent-id": "alice"}) is None
    assert resolve({"x-agent-id": "bad id!"}) is None
