"""`vllm-mlx-persist bench --sections edits`: span directives (issue #21) against re-prefilling.

An agent's harness edits its context (a stale tool output replaced by a stub) and sends the edited
conversation. Three parts, each on agent conversations rendered with the bench model's own chat
template (a task, then assistant tool calls each answered by a user-role tool output):

- Accounting: prompt tokens each system re-prefills after the edit, over the whole grid (histories,
  edit positions, spans, edits per turn), with no model forward: amortize by the planner the server
  runs (`kv_edit.plan.ModelSplicing.decide` with the template's message-start token, then the server's
  cut of each run: a token is always left to prefill); persist_q4 exact and forget re-prefill after
  the longest common prefix; vllm-mlx's default cache the same but reuses nothing under
  `VLLM_MIN_PREFIX` tokens (its memory-aware cache: token-level LCP, no blocks); no cache the prompt.
- TTFT on real `vllm-mlx serve` subprocesses over a subset of the grid: each agent's previous turn sent
  the unedited history (the server stored it), then the edited request is timed (streamed, first
  token). Every timed request also checks the accounting: the tokens the server says it prefilled
  against what the planner predicted for the same prompts.
- A multi-turn trace: a tool call per turn, and the harness's truncation policy (tool outputs older
  than two turns replaced by a stub), so from turn 3 on every turn is an edit plus an append.
- An agent trace through the official openai and anthropic clients (issue #32): each turn the
  assistant calls several tools at once (OpenAI `tool_calls` answered by `tool` messages; Anthropic
  `tool_use` blocks answered by one user message of `tool_result` blocks), and a Leyline-like policy
  cuts every tool output older than two turns to a 200-character head/tail stub, so every turn from
  the third edits inside a message (vllm-mlx merges the tool results into one user message, and
  the stub keeps the output's tail). Per turn: TTFT and the prompt tokens each system re-prefilled
  (amortize, exact, vllm-mlx's default cache).

`--edit-parts` picks the parts (accounting, ttft, trace, agent). This module runs the section; edits_chats.py
builds the conversations, edits_accounting.py, edits_agent.py and edits_servers.py hold the parts and
their servers, edits_report.py the section's tables.
"""

from __future__ import annotations

import shutil
import signal
from dataclasses import asdict
from typing import Any, Optional, Sequence

from .edits_accounting import account_point, grid, reprefill, ttft_points
from .edits_agent import AGENT_SYSTEMS, run_agent_trace
from .edits_chats import Chat, EditPoint, edit_history, edit_position, edited_turn, trace_requests
from .edits_servers import EDIT_SYSTEMS, edit_servers, kv_edit_headers, scheduled_tokens
from .kit import Ctx, Prompts, Session, make_server, say, section_failed, seed_of, send, server_flags

EDIT_PARTS = ("accounting", "ttft", "trace", "agent")


def _turn(s: Session, messages: list[dict], agent: str, max_tokens: int, system: str) -> dict:
    """One streamed turn, with `scheduled`: the tokens vllm-mlx's scheduler prefilled (scheduled_tokens)."""
    pos = s.server.log_path.stat().st_size
    r = send(s, messages, agent, max_tokens, headers=kv_edit_headers(system))
    r["scheduled"] = scheduled_tokens(s.server, pos)
    return r


def _measured(r: dict) -> Optional[int]:
    """Prompt tokens the server prefilled: usage.kv_edit's recomputed_tokens (amortize's stub is
    prefilled inside the lookup, so the scheduler never sees it), else the scheduler's count."""
    if r.get("kv_edit"):
        return r["kv_edit"]["recomputed_tokens"]
    return r.get("scheduled")


def _record(r: dict, **kw: Any) -> dict:
    keep = ("ttft_s", "prompt_tokens", "usage_cached_tokens", "scheduled", "tier", "reused_tokens", "kv_edit")
    return {**kw, **{k: r.get(k) for k in keep}, "prefilled": _measured(r)}


def section_edits(ctx: Ctx) -> dict:
    from ..models.build import SIZES, build_model_dir

    plan = ctx.plan
    model = build_model_dir(ctx.work / f"model-llama-{plan.edit_size}", arch="llama", size=plan.edit_size)
    chat = Chat(Prompts(model))
    sz = SIZES[plan.edit_size]
    systems = [s for s in EDIT_SYSTEMS if s in plan.edit_systems]
    result: dict = {"model": {"size": plan.edit_size, "layers": sz.layers, "hidden": sz.hidden, "heads": sz.heads,
                              "kv_heads": sz.kv_heads, "head_dim": sz.head_dim, "dtype": "float32"},
                    "anchor": chat.anchor,
                    "systems": {s: server_flags(s if s in ("vllm_default", "no_cache") else "persist_q4",
                                                plan.ttft_cache_mb, quote=False) for s in systems},
                    "samples": [], "trace": [], "events": [], "errors": {}}
    parts = [x for x in EDIT_PARTS if x in plan.edit_parts]
    result["parts"] = parts
    result["accounting"] = []
    if "accounting" in parts:
        say(f"edits: accounting over {len(grid(plan))} grid points")
        result["accounting"] = [account_point(chat, p) for p in grid(plan)]

    points = ttft_points(plan) if "ttft" in parts else []
    convs = {}
    for p in points:
        history, targets = edit_history(chat, seed_of("edits", p.key), p)
        edited = edited_turn(history, targets, seed_of("edits-new", p.key))
        convs[p.key] = (history, edited, reprefill(chat.ids(history), chat.ids(edited), chat.realign),
                        edit_position(chat, history, targets))
    trace = trace_requests(chat, seed_of("edits-trace"), plan.edit_trace_turns, plan.edit_trace_tool_tokens) \
        if "trace" in parts else []
    trace_ids = [chat.ids(m) for m in trace]
    trace_expected = [None] + [reprefill(a, b, chat.realign) for a, b in zip(trace_ids, trace_ids[1:])]
    if "agent" in parts:
        result["agent"] = []
        if not (points or trace):  # the agent trace alone: its systems only
            systems = [s for s in systems if s in AGENT_SYSTEMS]
            result["systems"] = {s: v for s, v in result["systems"].items() if s in systems}
    say(f"edits: TTFT at {len(points)} points, trace of {len(trace)} turns, systems {', '.join(systems)}")
    # Every server runs for the whole section and the systems take turns at each point (and each
    # trace turn), so load from other jobs on a shared machine falls on all of them alike.
    sessions: dict[str, Session] = {}
    started: list[Session] = []
    try:
        for server, modes in edit_servers(systems):
            home = ctx.work / f"edits-{server}"
            shutil.rmtree(home, ignore_errors=True)  # vllm-mlx reloads the prefix cache a previous run saved
            s = Session(server, make_server(server, model, home, plan.ttft_cache_mb), result["events"], "edits")
            started.append(s)
            try:
                s.start("fresh")
                sessions.update({m: s for m in modes})
            except Exception as e:
                section_failed(result["errors"], "edits", server, s, e)
        first = set()
        for p in points:
            history, edited, expected, at = convs[p.key]
            for system, s in sessions.items():
                if system in result["errors"]:
                    continue
                try:
                    agent = f"edit-{p.slug}-{system}"
                    if system != "no_cache":  # the agent's previous turn: the server stores the unedited history
                        send(s, history, agent, plan.edit_max_tokens, headers=kv_edit_headers(system))
                    r = _turn(s, edited, agent, plan.edit_max_tokens, system)
                except Exception as e:
                    section_failed(result["errors"], "edits", system, s, e)
                    continue
                rec = _record(r, system=system, point=p.key, **asdict(p), edit_at=at, expected=expected[system],
                              first_on_server=s.system not in first)
                first.add(s.system)
                result["samples"].append(rec)
                say(f"  {system:<12} {p.key:<18} ttft {r['ttft_s']:7.3f}s prompt {r['prompt_tokens']} "
                    f"prefilled {rec['prefilled']} (planned {expected[system]})"
                    + (f" fallback {r['kv_edit']['fallback']}" if r.get("kv_edit") and r["kv_edit"]["fallback"] else ""))
        for t, msgs in enumerate(trace, start=1):
            exp = trace_expected[t - 1]
            for system, s in sessions.items():
                if system in result["errors"]:
                    continue
                try:
                    r = _turn(s, msgs, f"edit-trace-{system}", plan.edit_max_tokens, system)
                except Exception as e:
                    section_failed(result["errors"], "edits", system, s, e)
                    continue
                rec = _record(r, system=system, turn=t, expected=exp[system] if exp else len(trace_ids[0]))
                result["trace"].append(rec)
                say(f"  trace {system:<12} turn {t} ttft {r['ttft_s']:7.3f}s prompt {r['prompt_tokens']} "
                    f"prefilled {rec['prefilled']} (planned {rec['expected']})"
                    + (f" {r['kv_edit']}" if r.get("kv_edit") and system == "amortize" else ""))
        if "agent" in parts:
            run_agent_trace(plan, chat.tok, sessions, result)
    finally:
        for s in started:
            s.stop(signal.SIGTERM, "end")
    result["summary"] = summarize(result, points)
    return result


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return round(a / b, 3) if a is not None and b else None


def summarize(result: dict, points: Sequence[EditPoint]) -> dict:
    """Per TTFT point and system: time, ratios to exact and to vllm-mlx default, prefilled tokens and
    whether they are what the planner predicted; per trace turn the same."""
    by = {(x["point"], x["system"]): x for x in result["samples"]}
    ttft: dict = {}
    for p in points:
        row = {}
        for (key, system), x in by.items():
            if key != p.key:
                continue
            ex, vd = by.get((key, "exact")), by.get((key, "vllm_default"))
            row[system] = {"ttft_s": x["ttft_s"], "prefilled": x["prefilled"], "planned": x["expected"],
                           "over_exact": _ratio(x["ttft_s"], ex and ex["ttft_s"]),
                           "over_vllm_default": _ratio(x["ttft_s"], vd and vd["ttft_s"]),
                           "fallback": (x.get("kv_edit") or {}).get("fallback")}
        if row:
            ttft[p.key] = {"point": asdict(p), "edit_at": next(x["edit_at"] for (k, _), x in by.items() if k == p.key),
                           "prompt": next(x["prompt_tokens"] for (k, _), x in by.items() if k == p.key), "systems": row}
    trace: dict = {}
    for x in result["trace"]:
        trace.setdefault(str(x["turn"]), {})[x["system"]] = {
            "ttft_s": x["ttft_s"], "prompt": x["prompt_tokens"], "prefilled": x["prefilled"], "planned": x["expected"],
            "kv_edit": x.get("kv_edit")}
    mismatches = [f"{x['point']} {x['system']}: prefilled {x['prefilled']}, planned {x['expected']}"
                  for x in result["samples"] if x["prefilled"] != x["expected"]]
    agent: dict = {}
    for x in result.get("agent", []):
        kv = x.get("kv_edit") or {}
        agent.setdefault(x["api"], {}).setdefault(str(x["turn"]), {})[x["system"]] = {
            "ttft_s": x["ttft_s"], "prompt": x["prompt_tokens"], "cached": x["cached_tokens"],
            "prefilled": x["prefilled"], "applied": kv.get("applied"), "fallback": kv.get("fallback"),
            "boundaries": [p.get("boundary") for p in kv.get("plan", [])]}
    return {"ttft": ttft, "trace": trace, "agent": agent, "accounting_checked": len(result["samples"]),
            "accounting_mismatches": mismatches}


def headline_edits(results: dict) -> dict:
    ed = results.get("edits")
    if not ed or not ed.get("summary", {}).get("ttft"):
        return {}
    rows = ed["summary"]["ttft"]
    first = [r for r in rows.values() if r["point"]["edits"] == 1 and r["point"]["position"] == min(
        x["point"]["position"] for x in rows.values())]
    top = max(first, key=lambda r: (r["point"]["history"], r["point"]["span"] == 256, -r["point"]["span"]))
    am = top["systems"].get("amortize", {})
    return {"edits_at": f"{top['point']['history']} tokens, edit at {round(top['point']['position'] * 100)}%, "
                        f"span {top['point']['span']}",
            "edits": {s: {"ttft_s": v["ttft_s"], "prefilled": v["prefilled"]} for s, v in top["systems"].items()},
            "edits_amortize_over_exact": am.get("over_exact"),
            "edits_amortize_over_vllm_default": am.get("over_vllm_default")}
