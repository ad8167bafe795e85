"""Span directives' request side (vllm_mlx_persist/kv_edit/request.py): the declared mode, its 400s, how it
rides in the request's route next to a fork parent, and the kv_edit server option."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_mlx_persist import kv_edit
from vllm_mlx_persist.namespace import Route
from vllm_mlx_persist.options import parse_options
from vllm_mlx_persist.plugin import vllm_mlx_cache_namespace


def _req(**metadata):
    return SimpleNamespace(metadata=metadata or None, prompt_cache_key=None)


@pytest.mark.parametrize("headers, metadata, want", [
    ({}, {}, None),
    ({"x-kv-edit": "forget"}, {}, "forget"),
    ({"x-kv-edit": " Amortize "}, {}, "amortize"),
    ({}, {"kv_edit": "forget"}, "forget"),
    ({"x-kv-edit": "amortize"}, {"kv_edit": "forget"}, "amortize"),  # the header wins
    ({"x-kv-edit": "exact"}, {}, None),
])
def test_mode_comes_from_the_header_else_metadata(headers, metadata, want):
    assert kv_edit.resolve_mode(_req(**metadata), headers) == want


@pytest.mark.parametrize("headers, metadata", [
    ({"x-kv-edit": "splice"}, {}), ({}, {"kv_edit": 1}), ({}, {"kv_edit": ""}), ({"x-kv-edit": "forget;x"}, {}),
])
def test_a_bad_mode_is_refused_naming_the_modes(headers, metadata):
    with pytest.raises(ValueError, match="amortize, forget"):
        kv_edit.resolve_mode(_req(**metadata), headers)


def test_the_route_carries_agent_fork_and_mode(serving_backend):
    ns = vllm_mlx_cache_namespace(_req(agent_id="kid", fork_from="mom"), {"x-kv-edit": "forget"}, "/v1/chat/completions")
    assert ns == "kid\0fork:mom\0edit:forget"
    assert Route.parse(ns) == Route("kid", "mom", "forget")
    ns = vllm_mlx_cache_namespace(_req(agent_id="a"), {"x-kv-edit": "amortize"}, "/v1/messages")
    assert Route.parse(ns) == Route("a", None, "amortize")
    plain = vllm_mlx_cache_namespace(_req(agent_id="a"), {}, "/v1/messages")
    assert plain == "a" and Route.parse(plain) == Route("a")  # no fork, no mode: the agent id itself
    assert Route.parse(None) == Route() and Route().encode() is None  # anonymous
    for route in (Route("a", "b", "amortize"), Route("a", None, "forget"), Route("a", "b")):
        assert Route.parse(route.encode()) == route


def test_a_mode_without_an_agent_is_400(serving_backend):
    with pytest.raises(ValueError, match="needs an agent id"):
        vllm_mlx_cache_namespace(_req(), {"x-kv-edit": "forget"}, "/v1/chat/completions")


def test_the_server_option():
    assert parse_options({})["kv_edit"] == {"enabled": True, "max_rotations": 4, "min_run_tokens": 16,
                                           "max_stub_tokens": 4096, "boundaries": "lines", "recompute_tokens": 0}
    assert parse_options({"kv_edit": {"enabled": False}})["kv_edit"]["enabled"] is False
    assert parse_options({"kv_edit": {"boundaries": "messages"}})["kv_edit"]["boundaries"] == "messages"
    for bad in ({"enabled": "yes"}, {"max_rotations": -1}, {"max_rotations": 2.5}, {"rotations": 3}, "on",
                {"boundaries": "words"}, {"recompute_tokens": -2}):
        with pytest.raises(ValueError, match="kv_edit"):
            parse_options({"kv_edit": bad})


def test_the_report():
    r = kv_edit.report("forget", True, 40, 100, superseded_branches=1)
    assert r == {"mode": "forget", "applied": True, "exact_prefix_tokens": 40, "spliced_tokens": 0,
                 "recomputed_tokens": 60, "fallback": None, "superseded_branches": 1}
    with pytest.raises(ValueError):
        kv_edit.report("amortize", False, 0, 10, fallback="because")
    # a fallback comes with a sentence that says what to do about it
    r = kv_edit.report("amortize", False, 40, 100, fallback="no_realignment")
    assert r["fallback"] == "no_realignment" and "min_run_tokens" in r["detail"]
    for reason in kv_edit.FALLBACKS:
        assert kv_edit.request.explain(reason) != reason, reason
