"""`vllm-mlx-persist bench --sections edits`, part agent (issue #32): an agent trace through the official
openai and anthropic clients, each turn several tool calls at once, and a policy that cuts every tool
output older than two turns to a head/tail stub; per turn TTFT and the tokens each system re-prefilled."""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from typing import Any, Sequence

from .edits_servers import kv_edit_headers, scheduled_tokens
from .kit import Prompts, Session, say, section_failed, seed_of

AGENT_SYSTEMS = ("amortize", "exact", "vllm_default")
AGENT_APIS = ("openai", "anthropic")
AGENT_SYSTEM_PROMPT = "You are a coding agent. Call tools to read, search and test the repository."
TOOLS = ("read_file", "grep", "run_tests", "list_dir")


def tool_output(rng: random.Random, tok: Any, tool: str, n_tokens: int) -> str:
    """A tool's output of about `n_tokens` tokens: lines as the tool would print them."""
    lines: list[str] = []
    while len(tok.encode("\n".join(lines), add_special_tokens=False)) < n_tokens:
        k = len(lines)
        if tool == "grep":
            lines.append(f"src/pkg/mod{rng.randrange(40)}.py:{rng.randrange(1, 900)}: " + Prompts.words(rng, 8))
        elif tool == "run_tests":
            lines.append(f"tests/test_{rng.randrange(30)}.py::test_{Prompts.words(rng, 2).replace(' ', '_')} "
                         + rng.choice(("PASSED", "PASSED", "FAILED", "SKIPPED")))
        elif tool == "list_dir":
            lines.append(f"{rng.choice(('-rw-r--r--', 'drwxr-xr-x'))} {rng.randrange(100, 99999):>6} "
                         f"{Prompts.words(rng, 1)}_{k}.py")
        else:
            lines.append(("    " * rng.randrange(0, 3)) + Prompts.words(rng, 9))
    return "\n".join(lines)


def head_tail(text: str, chars: int) -> str:
    """The policy's stub: the first and last chars/2 characters of a tool output, the cut marked."""
    if len(text) <= chars + 40:
        return text
    h = chars // 2
    return f"{text[:h]}\n[... {len(text) - chars} characters truncated ...]\n{text[-h:]}"


@dataclass(frozen=True)
class AgentTurn:
    """One turn of the agent: its tool calls (name, arguments, output)."""

    calls: tuple[tuple[str, dict, str], ...]


def agent_turns(tok: Any, seed: int, turns: int, calls: int, tool_tokens: int) -> tuple[str, list[AgentTurn]]:
    """(the task, the turns): each turn `calls` tool calls with outputs of about `tool_tokens` tokens."""
    rng = random.Random(seed)
    task = f"task {seed:016x}: " + Prompts.words(rng, 40)
    out = []
    for t in range(turns):
        cs = []
        for c in range(calls):
            name = TOOLS[(t * calls + c) % len(TOOLS)]
            args = {"path": f"src/pkg/mod{rng.randrange(40)}.py"} if name in ("read_file", "list_dir") else \
                {"query": Prompts.words(rng, 2)}
            cs.append((name, args, tool_output(rng, tok, name, tool_tokens)))
        out.append(AgentTurn(tuple(cs)))
    return task, out


def _policy(turns: Sequence[AgentTurn], t: int, stub_chars: int) -> list[list[str]]:
    """The outputs turn t (1-based) sends: those of turns older than two (i <= t - 2) cut to stubs."""
    return [[head_tail(o, stub_chars) if i <= t - 2 else o for _, _, o in turn.calls]
            for i, turn in enumerate(turns[:t], start=1)]


def openai_messages(task: str, turns: Sequence[AgentTurn], t: int, stub_chars: int) -> list[dict]:
    """Turn t's request as the openai client sends it: assistant tool_calls, then one tool message each."""
    msgs: list[dict] = [{"role": "system", "content": AGENT_SYSTEM_PROMPT}, {"role": "user", "content": task}]
    for i, (turn, outs) in enumerate(zip(turns, _policy(turns, t, stub_chars)), start=1):
        ids = [f"call_{i}_{c}" for c in range(len(turn.calls))]
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            for cid, (name, args, _) in zip(ids, turn.calls)]})
        msgs += [{"role": "tool", "tool_call_id": cid, "content": o} for cid, o in zip(ids, outs)]
    return msgs


def anthropic_messages(task: str, turns: Sequence[AgentTurn], t: int, stub_chars: int) -> list[dict]:
    """Turn t's request as the anthropic client sends it: tool_use blocks, then one user message of
    tool_result blocks."""
    msgs: list[dict] = [{"role": "user", "content": task}]
    for i, (turn, outs) in enumerate(zip(turns, _policy(turns, t, stub_chars)), start=1):
        ids = [f"toolu_{i}_{c}" for c in range(len(turn.calls))]
        msgs.append({"role": "assistant", "content": [{"type": "tool_use", "id": cid, "name": name, "input": args}
                                                      for cid, (name, args, _) in zip(ids, turn.calls)]})
        msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": cid, "content": o}
                                                 for cid, o in zip(ids, outs)]})
    return msgs


def agent_turn(s: Session, api: str, messages: list[dict], agent: str, max_tokens: int, system: str) -> dict:
    """One streamed request through the official client of `api`: TTFT (send to first text), prompt
    and cached tokens, usage.kv_edit, and the tokens prefilled (amortize: usage.kv_edit; else the
    scheduler's count)."""
    srv = s.server
    pos = srv.log_path.stat().st_size
    headers = {"X-Agent-ID": agent, **(kv_edit_headers(system) or {})}
    t0 = time.perf_counter()
    first, usage = None, {}
    if api == "openai":
        stream = s.client.chat.completions.create(
            model=srv.model, messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_headers=headers)
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta and chunk.choices[0].delta.content:
                first = time.perf_counter()
            if getattr(chunk, "usage", None):
                usage = chunk.usage.model_dump()
        prompt = usage.get("prompt_tokens")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    else:
        import anthropic

        client = anthropic.Anthropic(base_url=srv.url, api_key="bench", max_retries=0, timeout=7200)
        start: dict = {}
        for ev in client.messages.create(model=srv.model, messages=messages, system=AGENT_SYSTEM_PROMPT,
                                         max_tokens=max_tokens, stream=True, extra_headers=headers,
                                         extra_body={"temperature": 0.0}):
            if ev.type == "message_start":
                start = ev.message.usage.model_dump()
            elif ev.type == "content_block_delta" and first is None and getattr(ev.delta, "text", None):
                first = time.perf_counter()
            elif ev.type == "message_delta" and ev.usage is not None:
                usage = {**start, **{k: v for k, v in ev.usage.model_dump().items() if v is not None}}
        cached = usage.get("cache_read_input_tokens") or 0
        prompt = (usage.get("input_tokens") or 0) + cached
    end = time.perf_counter()
    kv = usage.get("kv_edit")
    return {"ttft_s": round((first or end) - t0, 4), "prompt_tokens": prompt, "cached_tokens": cached,
            "kv_edit": kv, "prefilled": kv["recomputed_tokens"] if kv else scheduled_tokens(srv, pos)}


def run_agent_trace(plan: Any, tok: Any, sessions: dict, result: dict) -> None:
    """The agent trace over every API and system (the systems take turns at each turn); fills
    result["agent"] with one record per (api, system, turn)."""
    apis = [a for a in AGENT_APIS if a in plan.edit_agent_apis]
    systems = [x for x in AGENT_SYSTEMS if x in sessions]
    task, turns = agent_turns(tok, seed_of("edits-agent"), plan.edit_agent_turns, plan.edit_agent_calls,
                              plan.edit_agent_tool_tokens)
    build = {"openai": openai_messages, "anthropic": anthropic_messages}
    say(f"edits: agent trace, {len(turns)} turns x {plan.edit_agent_calls} tool calls of ~"
        f"{plan.edit_agent_tool_tokens} tokens, APIs {', '.join(apis)}, systems {', '.join(systems)}")
    for api in apis:
        for t in range(1, len(turns) + 1):
            msgs = build[api](task, turns, t, plan.edit_agent_stub_chars)
            for system in systems:
                s = sessions[system]
                if system in result["errors"]:
                    continue
                try:
                    r = agent_turn(s, api, msgs, f"edit-agent-{api}-{system}", plan.edit_max_tokens, system)
                except Exception as e:
                    section_failed(result["errors"], "edits", system, s, e)
                    continue
                result["agent"].append({"api": api, "system": system, "turn": t, **r})
                kv = r["kv_edit"] or {}
                say(f"  agent {api:<9} {system:<12} turn {t:2d} ttft {r['ttft_s']:7.3f}s prompt {r['prompt_tokens']} "
                    f"cached {r['cached_tokens']} prefilled {r['prefilled']}"
                    + (f" applied {kv.get('applied')} fallback {kv.get('fallback')} "
                       f"{[p.get('boundary') for p in kv.get('plan', [])]}" if kv else ""))


def agent_totals(agent: dict) -> dict:
    """Per API and system over the turns from 3 on (every one an edit): prefilled tokens and TTFT
    summed, and the amortize turns that spliced."""
    out: dict = {}
    for api, turns in agent.items():
        rows = [v for t, v in turns.items() if int(t) >= 3]
        out[api] = {s: {"prefilled": sum(r[s]["prefilled"] or 0 for r in rows if s in r),
                        "ttft_s": round(sum(r[s]["ttft_s"] for r in rows if s in r), 3),
                        "turns": sum(1 for r in rows if s in r),
                        "applied": sum(1 for r in rows if s in r and r[s].get("applied"))}
                    for s in AGENT_SYSTEMS if any(s in r for r in rows)}
    return out
