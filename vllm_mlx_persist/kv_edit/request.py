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
OPTION_DEFAULTS: dict[str, Any] = {"enabled": True, "max_rotations": 4, "min_run_tokens": 16, "max_stub_tokens": 4096,
                                   "boundaries": "lines", "recompute_tokens": 0}
BOUNDARIES = ("lines", "items", "messages")  # where a run may start, finest first (plan.Realign)
_WHERE = {"lines": "message, tool item or line start", "items": "message or tool item start",
          "messages": "message start"}


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
    """The backend option `kv_edit: {enabled, max_rotations, min_run_tokens, max_stub_tokens,
    boundaries, recompute_tokens}` merged over OPTION_DEFAULTS.
    `enabled: false` serves amortize requests as exact (reason "disabled"); forget always works.
    `boundaries`: where a stored run may start again after an edit (BOUNDARIES: `messages` splices
    at message starts only, `items` also at the template's tool-call and tool-result tags, `lines`
    also at line starts inside messages); `recompute_tokens`: tokens after each such point that are
    re-prefilled rather than moved."""
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
    if out["boundaries"] not in BOUNDARIES:
        raise ValueError(f"persist_q4 kv_edit.boundaries must be one of {', '.join(BOUNDARIES)}; "
                         f"got {out['boundaries']!r}")
    for key, top in (("max_rotations", 16), ("min_run_tokens", 1 << 20), ("max_stub_tokens", 1 << 20),
                     ("recompute_tokens", 1 << 10)):
        n = out[key]
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= top:
            raise ValueError(f"persist_q4 kv_edit.{key} must be an integer from 0 to {top}; got {n!r}")
    return out


def report(mode: str, applied: bool, exact_prefix: int, prompt_tokens: int, spliced: int = 0,
           fallback: Optional[str] = None, superseded_branches: int = 0, detail: Optional[str] = None,
           ) -> dict[str, Any]:
    """`usage.kv_edit`: what the edit did. recomputed = the prompt tokens prefilled (never spliced).
    With a fallback, `detail` says it in a sentence (`explain`)."""
    if fallback is not None and fallback not in FALLBACKS:
        raise ValueError(f"unknown kv_edit fallback {fallback!r}")
    out = {"mode": mode, "applied": applied, "exact_prefix_tokens": exact_prefix, "spliced_tokens": spliced,
           "recomputed_tokens": max(0, prompt_tokens - exact_prefix - spliced), "fallback": fallback,
           "superseded_branches": superseded_branches}
    if fallback is not None:
        out["detail"] = detail or explain(fallback)
    return out


def explain(reason: str, *, options: Optional[Mapping[str, Any]] = None, exact: Optional[int] = None,
            stored: Optional[int] = None, layer: Optional[str] = None, stub: Optional[int] = None) -> str:
    """Why an amortize request was served otherwise, and what the client or the operator can do
    about it (usage.kv_edit.detail). `exact`: the edit point (tokens shared with the stored
    history); `stored`: the stored history's length; `stub`: tokens before the first reusable run."""
    o = {**OPTION_DEFAULTS, **(options or {})}
    after = f" (token {exact})" if exact is not None else ""
    if reason == "no_realignment" and stored is not None and exact is not None \
            and stored - exact < max(1, o["min_run_tokens"]):
        return (f"the prompt parts from the stored history at token {exact}, {stored - exact} tokens before the "
                "stored history ends (typically in the model's previous reply, as the client sent it back): "
                "nothing stored after that point to reuse; the tokens from it on are prefilled")
    left = f"the {stored - exact} stored tokens after it" if stored is not None and exact is not None \
        else "the stored tokens after it"
    return {
        "disabled": "amortize is switched off on this server (kv_edit.enabled: false): served as an exact "
                    "request, re-prefilled from the first changed token",
        "no_history": "nothing is stored for this agent yet: its first request is prefilled in full and "
                      "stored; amortize applies to the edits of later requests",
        "no_edit": "the prompt continues the stored history unchanged: all of it is reused as it is, "
                   "there is nothing to splice",
        "recurrent_state": "this model has recurrent layers, whose state folds in every token, so nothing "
                           "stored after an edit can be moved: re-prefilled from the edit",
        "unsupported_positions": f"{layer or 'a layer'}: this model's keys cannot be moved to new positions "
                                 "by a rotation: re-prefilled from the edit",
        "unaligned": f"the tokenizer gives no {_WHERE[o['boundaries']]} to realign the stored history at "
                     "(no chat template"
                     + (", tool tags or newline tokens" if o["boundaries"] != "messages" else "") + ")"
                     + ("; kv_edit.boundaries: lines also realigns at line starts"
                        if o["boundaries"] != "lines" else "") + ": re-prefilled from the edit",
        "no_realignment": f"the prompt differs from the stored history at the edit{after}, and none of "
                          f"{left} reappear in the prompt at a {_WHERE[o['boundaries']]} for at least "
                          f"{o['min_run_tokens']} tokens in a row (kv_edit.min_run_tokens): to reuse them, "
                          "send the text after the edit unchanged (the same messages, rendered the same way)"
                          + (", or let the server realign inside messages (kv_edit.boundaries: lines)"
                             if o["boundaries"] != "lines" else "") + "; re-prefilled from the edit",
        "stub_too_long": f"{'the ' + str(stub) if stub is not None else 'the'} new tokens before the first "
                         f"reusable stored run exceed kv_edit.max_stub_tokens ({o['max_stub_tokens']}), "
                         "where a re-prefill costs about as much: re-prefilled from the edit",
        "rotation_budget": "every stored token that could be reused after the edit has already been moved "
                           f"kv_edit.max_rotations ({o['max_rotations']}) times, and more moves would add "
                           "4-bit error: re-prefilled from the edit (the re-prefilled tokens start again at "
                           "zero rotations)",
        "splice_not_built": "this model's cache kind cannot be spliced yet: re-prefilled from the edit",
        "unreadable": "a stored block of the run after the edit could not be read back (memory or disk): "
                      "re-prefilled from the edit",
        "window_not_held": "the sliding-window layers' window before the run is no longer held (no disk "
                           "tier, or a read failed): re-prefilled from the edit",
    }.get(reason, reason)
