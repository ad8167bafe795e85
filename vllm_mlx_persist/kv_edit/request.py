"""Span directives' request side (issue #21): the edit mode a client declares, the server option, and
the `usage.kv_edit` report. No MLX: plugin.py imports it (through the package, `kv_edit`).

A client sends its edited messages as usual (the prompt stays the source of truth) and declares how
the server may treat the stored history they no longer match:

* `forget`: re-prefill from the first differing token (a cold run's output), and the history the edit
  superseded really goes: its branch and the blocks only it named leave memory, disk and Redis.
* `amortize`: splice (keep the K/V after the edited span, keys rotated by the position shift); where
  it cannot, served as exact with `applied: false` and the reason (`FALLBACKS`).
* none: today's exact behaviour.

The mode comes from the `X-KV-Edit` header, else `metadata.kv_edit`; it needs an agent id. It is part
of the request's route (namespace.Route); spliced histories are branches of the agent's record with
their rotation generation (chain.Branch.generation).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

HEADER = "x-kv-edit"
AMORTIZE, FORGET = "amortize", "forget"
MODES = (AMORTIZE, FORGET)
# Why an amortize request was served otherwise (usage.kv_edit.fallback).
FALLBACKS = ("disabled", "no_history", "no_edit", "recurrent_state", "unsupported_positions", "no_realignment",
             "unaligned", "stub_too_long", "rotation_budget", "splice_not_built", "unreadable", "window_not_held")
OPTION_DEFAULTS: dict[str, Any] = {"enabled": True, "max_rotations": 4, "min_run_tokens": 16, "max_stub_tokens": 4096}


def resolve_mode(request: Any, headers: Optional[Mapping[str, str]]) -> Optional[str]:
    """The edit mode a request declares (None: exact), from X-KV-Edit, else metadata.kv_edit.
    ValueError for anything but the modes (or an explicit "exact", which is no mode)."""
    value, source = (headers.get(HEADER) if headers is not None else None), "the X-KV-Edit header"
    if value is None:
        metadata = getattr(request, "metadata", None)
        if isinstance(metadata, Mapping) and metadata.get("kv_edit") is not None:
            value, source = metadata["kv_edit"], "metadata.kv_edit"
    if value is None:
        return None
    if not isinstance(value, str) or value.strip().lower() not in MODES + ("exact",):
        shown = value[:40] if isinstance(value, str) else type(value).__name__
        raise ValueError(f"{source} must be one of {', '.join(MODES)} (or exact); got {shown!r}")
    mode = value.strip().lower()
    return None if mode == "exact" else mode


def parse_option(value: Any) -> dict[str, Any]:
    """The backend option `kv_edit: {enabled, max_rotations, min_run_tokens, max_stub_tokens}` merged
    over OPTION_DEFAULTS.
    `enabled: false` serves amortize requests as exact (reason "disabled"); forget always works."""
    if value is None:
        return dict(OPTION_DEFAULTS)
    if not isinstance(value, Mapping):
        raise ValueError("persist_q4 kv_edit must be an object like {\"enabled\": true, \"max_rotations\": 4}")
    unknown = sorted(set(value) - set(OPTION_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown persist_q4 kv_edit key(s) {unknown}; known: {sorted(OPTION_DEFAULTS)}")
    out = {**OPTION_DEFAULTS, **value}
    if not isinstance(out["enabled"], bool):
        raise ValueError("persist_q4 kv_edit.enabled must be true or false")
    # max_rotations bounds an agent's spliced namespaces, each synced and erased by name (pool.py).
    for key, top in (("max_rotations", 16), ("min_run_tokens", 1 << 20), ("max_stub_tokens", 1 << 20)):
        n = out[key]
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= top:
            raise ValueError(f"persist_q4 kv_edit.{key} must be an integer from 0 to {top}; got {n!r}")
    return out


def report(mode: str, applied: bool, exact_prefix: int, prompt_tokens: int, spliced: int = 0,
           fallback: Optional[str] = None, superseded_branches: int = 0) -> dict[str, Any]:
    """`usage.kv_edit`: what the edit did. recomputed = the prompt tokens prefilled (never spliced)."""
    if fallback is not None and fallback not in FALLBACKS:
        raise ValueError(f"unknown kv_edit fallback {fallback!r}")
    return {"mode": mode, "applied": applied, "exact_prefix_tokens": exact_prefix, "spliced_tokens": spliced,
            "recomputed_tokens": max(0, prompt_tokens - exact_prefix - spliced), "fallback": fallback,
            "superseded_branches": superseded_branches}
