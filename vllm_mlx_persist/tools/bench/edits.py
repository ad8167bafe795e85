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

`--edit-parts` picks the parts (accounting, ttft, trace, agent).
"""

from __future__ import annotations

import json
import random
import re
import shutil
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from ... import chain
from ...kv_edit.plan import ModelSplicing, Points, Splice, message_anchor, realign_points
from ...kv_edit import OPTION_DEFAULTS
from .kit import (COMMON_ARGS, FIXED_REPLY, Ctx, Prompts, Session, make_server, say, section_failed,
                        seed_of, send)
from ..serving import Server

EDIT_SYSTEMS = ("amortize", "forget", "exact", "vllm_default", "no_cache")
EDIT_LABELS = {"amortize": "persist_q4, X-KV-Edit: amortize", "forget": "persist_q4, X-KV-Edit: forget",
               "exact": "persist_q4, no header (exact)", "vllm_default": "vllm-mlx default prefix cache",
               "no_cache": "vllm-mlx --disable-prefix-cache"}
PERSIST_MODES = ("amortize", "forget", "exact")
# vllm-mlx 0.6.0's MemoryAwarePrefixCache: an LCP (or prefix) hit shorter than min_prefix_tokens is a miss
VLLM_MIN_PREFIX = 128
CALL_WORDS = 14  # an assistant tool call: ~30 tokens, a run longer than kv_edit.min_run_tokens
NEW_TOOL_WORDS = 24  # the tool output the edited turn appends
FILLER_TOKENS = (60, 200)  # other tool outputs
TAIL_TOKENS = 64  # room a grid point keeps after its edited messages
EDIT_PARTS = ("accounting", "ttft", "trace", "agent")
AGENT_SYSTEMS = ("amortize", "exact", "vllm_default")
AGENT_APIS = ("openai", "anthropic")
AGENT_SYSTEM_PROMPT = "You are a coding agent. Call tools to read, search and test the repository."


# ---------------------------------------------------------------------------------------------
# Conversations


class Chat:
    """Token ids of messages rendered with the model's chat template."""

    def __init__(self, prompts: Prompts):
        self.tok = prompts.tok
        self.anchor = message_anchor(self.tok)
        self.realign = realign_points(self.tok)  # where the server's planner realigns (kv_edit.plan)
        self._one = len(self.ids([{"role": "user", "content": "a"}], gen=False))

    def ids(self, messages: list[dict], gen: bool = True) -> list[int]:
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5: a BatchEncoding

    def size(self, message: dict) -> int:
        """Tokens one message adds to a rendering (the template's tokens around it included)."""
        return len(self.ids([{"role": "user", "content": "a"}, message], gen=False)) - self._one

    def sized(self, role: str, head: str, rng: random.Random, n_tokens: int) -> dict:
        """A message of `head` + words, as close to `n_tokens` (template included) as fits under it."""
        words = Prompts.words(rng, max(1, n_tokens)).split(" ")
        lo, hi = 0, len(words)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.size({"role": role, "content": " ".join([head, *words[:mid]])}) <= n_tokens:
                lo = mid
            else:
                hi = mid - 1
        return {"role": role, "content": " ".join([head, *words[:lo]])}


def call_msg(i: int, rng: random.Random) -> dict:
    return {"role": "assistant", "content": f"call {i}: " + Prompts.words(rng, CALL_WORDS)}


def tool_head(i: int) -> str:
    return f"[tool output {i}]"


def stub_msg(message: dict) -> dict:
    """The harness's stub for a tool output: '[tool output i truncated]'."""
    head = message["content"].split("]", 1)[0]
    return {"role": message["role"], "content": f"{head} truncated]"}


@dataclass(frozen=True)
class EditPoint:
    """A grid point: a history of about `history` tokens whose `edits` tool outputs of `span` tokens
    (each after an assistant call), the first starting at `position` of the history, are stubbed."""

    history: int
    position: float
    span: int
    edits: int

    @property
    def key(self) -> str:
        return f"{self.history}/{round(self.position * 100)}%/{self.span}x{self.edits}"

    @property
    def slug(self) -> str:
        """The key as an agent id allows it."""
        return f"{self.history}-{round(self.position * 100)}-{self.span}x{self.edits}"

    def fits(self) -> bool:
        return self.position * self.history + self.edits * (self.span + 40) + TAIL_TOKENS <= self.history


def _fill(chat: Chat, msgs: list[dict], n: int, until: int, i: int, rng: random.Random, keep: int) -> tuple[int, int]:
    """Append (call, tool output) pairs while the rendering stays `keep` tokens short of `until`; the
    last output is sized to land there. Returns (tokens, next tool number)."""
    while True:
        call = call_msg(i, rng)
        room = until - keep - n - chat.size(call)
        if room < 24:
            return n, i
        want = room if room <= FILLER_TOKENS[1] + 30 else rng.randint(*FILLER_TOKENS)
        out = chat.sized("user", tool_head(i), rng, want)
        msgs += [call, out]
        n += chat.size(call) + chat.size(out)
        i += 1


def edit_history(chat: Chat, seed: int, point: EditPoint) -> tuple[list[dict], list[int]]:
    """The unedited history (ending in a tool output) and the indices of the messages the edit stubs."""
    rng = random.Random(seed)
    msgs = [{"role": "user", "content": f"task {seed:016x}: " + Prompts.words(rng, 40)}]
    n = len(chat.ids(msgs, gen=False))
    probe = chat.size(call_msg(0, random.Random(0)))
    n, i = _fill(chat, msgs, n, round(point.position * point.history), 1, rng, keep=probe)
    targets = []
    for _ in range(point.edits):
        call = call_msg(i, rng)
        out = chat.sized("user", tool_head(i), rng, point.span)
        msgs += [call, out]
        targets.append(len(msgs) - 1)
        n += chat.size(call) + chat.size(out)
        i += 1
    _fill(chat, msgs, n, point.history, i, rng, keep=0)
    return msgs, targets


def edited_turn(history: list[dict], targets: Sequence[int], seed: int) -> list[dict]:
    """The next request: the history with its targets stubbed, the model's tool call and its output."""
    rng = random.Random(seed)
    i = sum(1 for m in history if m["role"] == "assistant") + 1
    edited = [stub_msg(m) if k in set(targets) else m for k, m in enumerate(history)]
    return edited + [{"role": "assistant", "content": f"call {i}: {FIXED_REPLY}"},
                     {"role": "user", "content": f"{tool_head(i)} " + Prompts.words(rng, NEW_TOOL_WORDS)}]


def trace_requests(chat: Chat, seed: int, turns: int, tool_tokens: int) -> list[list[dict]]:
    """The requests of a `turns`-turn agent: turn t sends the task and t (call, tool output) pairs,
    outputs older than two turns (i <= t - 2) replaced by a stub: the harness's truncation policy."""
    rng = random.Random(seed)
    task = {"role": "user", "content": f"task {seed:016x}: " + Prompts.words(rng, 40)}
    pairs = []
    for i in range(1, turns + 1):
        pairs.append((call_msg(i, rng), chat.sized("user", tool_head(i), rng, tool_tokens)))
    out = []
    for t in range(1, turns + 1):
        msgs = [task]
        for i, (call, tool) in enumerate(pairs[:t], start=1):
            msgs += [call, stub_msg(tool) if i <= t - 2 else tool]
        out.append(msgs)
    return out


# ---------------------------------------------------------------------------------------------
# The agent trace (issue #32): tool calls and results as the APIs carry them


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


def _scheduled(server: Server, pos: int) -> Optional[int]:
    """The tokens vllm-mlx's scheduler prefilled for the request whose log starts at `pos`."""
    for _ in range(20):  # the line is written before the first token; let it reach the file
        with open(server.log_path, errors="replace") as f:
            f.seek(pos)
            found = _SCHEDULE_RE.findall(f.read())
        if found:
            return int(found[-1][1])
        time.sleep(0.05)
    return None


def agent_turn(s: Session, api: str, messages: list[dict], agent: str, max_tokens: int, system: str) -> dict:
    """One streamed request through the official client of `api`: TTFT (send to first text), prompt
    and cached tokens, usage.kv_edit, and the tokens prefilled (amortize: usage.kv_edit; else the
    scheduler's count)."""
    srv = s.server
    pos = srv.log_path.stat().st_size
    headers = {"X-Agent-ID": agent, **(_headers(system) or {})}
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
            "kv_edit": kv, "prefilled": kv["recomputed_tokens"] if kv else _scheduled(srv, pos)}


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


# ---------------------------------------------------------------------------------------------
# Accounting


def reprefill(stored: Sequence[int], prompt: Sequence[int], anchor: Points,
              options: Optional[dict] = None) -> dict:
    """Prompt tokens each system prefills when `prompt` follows a turn that stored `stored`.
    amortize: the server's plan (ModelSplicing.decide, at the realignment points `anchor`: a Realign,
    or a message-start token for message starts only) and its cut of each run (kv_edit.serve: a
    token is always left to prefill; a run cut under min_run_tokens ends the splices)."""
    opts = {**OPTION_DEFAULTS, **(options or {})}
    n, lcp = len(prompt), chain.lcp(stored, prompt)
    exact = min(lcp, n - 1)
    out: dict[str, Any] = {"prompt": n, "stored": len(stored), "exact_prefix": exact, "exact": n - exact,
                           "forget": n - exact, "vllm_default": n - lcp if lcp >= VLLM_MIN_PREFIX else n,
                           "no_cache": n, "plan": [], "fallback": None}
    plans = ModelSplicing(anchor, False, None).decide(stored, prompt, opts)
    used: list[tuple[Splice, int]] = []
    if isinstance(plans, str):
        out["fallback"] = plans
    else:
        for p in plans:
            k = min(p.length, n - 1 - p.at)
            if k < opts["min_run_tokens"]:
                break
            used.append((p, k))
        if not used:
            out["fallback"] = "no_realignment"
    out["amortize"] = n - exact - sum(k for _, k in used)
    out["plan"] = [{"stub_tokens": p.stub, "run_tokens": k, "delta": p.delta} for p, k in used]
    return out


def grid(plan: Any, histories: Optional[Sequence[int]] = None) -> list[EditPoint]:
    """The accounting grid: every history (default plan.edit_grid_histories) x position x span x
    edits that fits."""
    pts = [EditPoint(h, p, s, e) for h in histories or plan.edit_grid_histories for p in plan.edit_positions
           for s in plan.edit_spans for e in plan.edit_counts]
    return [p for p in pts if p.fits()]


def ttft_points(plan: Any) -> list[EditPoint]:
    """The TTFT subset: histories x positions at one span and one edit, then at the sweep history
    and position, every span (one edit) and every edit count (the one span)."""
    if plan.edit_full_grid:
        return grid(plan, plan.edit_histories)
    pts = [EditPoint(h, p, plan.edit_span, 1) for h in plan.edit_histories for p in plan.edit_positions]
    top, at = plan.edit_sweep_history, plan.edit_sweep_position
    pts += [EditPoint(top, at, s, 1) for s in plan.edit_spans]
    pts += [EditPoint(top, at, plan.edit_span, e) for e in plan.edit_counts]
    return [p for p in dict.fromkeys(pts) if p.fits()]


def edit_position(chat: Chat, history: list[dict], targets: Sequence[int]) -> int:
    """The token the first stubbed message starts at."""
    return len(chat.ids(history[:targets[0]], gen=False))


def account_point(chat: Chat, point: EditPoint) -> dict:
    """One grid point's accounting, on its conversation (seeded by the point)."""
    history, targets = edit_history(chat, seed_of("edits", point.key), point)
    stored = chat.ids(history)
    prompt = chat.ids(edited_turn(history, targets, seed_of("edits-new", point.key)))
    return {"point": point.key, **asdict(point), "edit_at": edit_position(chat, history, targets),
            **reprefill(stored, prompt, chat.realign)}


# ---------------------------------------------------------------------------------------------
# Servers


def _server(name: str, model: Path, home: Path, cache_mb: float) -> Server:
    if name == "no_cache":
        return Server(model, home, backend=None, extra_args=COMMON_ARGS + ("--disable-prefix-cache",))
    return make_server(name, model, home, cache_mb)


def _flags(name: str, cache_mb: float) -> str:
    s = _server(name, Path("MODEL"), Path("/tmp/HOME"), cache_mb)
    return " ".join(a for a in s.command()[2:] if a not in ("--port", "0", "--host", "127.0.0.1"))


def _servers(systems: Sequence[str]) -> list[tuple[str, list[str]]]:
    """(server, the systems it serves): persist_q4's three modes share one server."""
    out = []
    modes = [m for m in PERSIST_MODES if m in systems]
    if modes:
        out.append(("persist_q4", modes))
    out += [(s, [s]) for s in ("vllm_default", "no_cache") if s in systems]
    return out


def _headers(system: str) -> Optional[dict]:
    return {"X-KV-Edit": system} if system in ("amortize", "forget") else None


_SCHEDULE_RE = re.compile(r"\[schedule\] request=\S+ uid=\d+ prompt_tokens=(\d+) tokens_to_prefill=(\d+)")


def _turn(s: Session, messages: list[dict], agent: str, max_tokens: int, system: str) -> dict:
    """One streamed turn, with `scheduled`: the tokens vllm-mlx's scheduler prefilled after the cache
    lookup (its `[schedule]` log line; an exact hit, which vllm-mlx discards, counts the whole prompt)."""
    pos = s.server.log_path.stat().st_size
    r = send(s, messages, agent, max_tokens, headers=_headers(system))
    r["scheduled"] = None
    for _ in range(20):  # the line is written before the first token; let it reach the file
        with open(s.server.log_path, errors="replace") as f:
            f.seek(pos)
            found = _SCHEDULE_RE.findall(f.read())
        if found:
            r["scheduled"] = int(found[-1][1])
            break
        time.sleep(0.05)
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


# ---------------------------------------------------------------------------------------------
# The section


def section_edits(ctx: Ctx) -> dict:
    from ..models.build import SIZES, build_model_dir

    plan = ctx.plan
    model = build_model_dir(ctx.work / f"model-llama-{plan.edit_size}", arch="llama", size=plan.edit_size)
    chat = Chat(Prompts(model))
    sz = SIZES[plan.edit_size]
    systems = [s for s in EDIT_SYSTEMS if s in plan.edit_systems]
    result: dict = {"model": {"size": plan.edit_size, "layers": sz.layers, "hidden": sz.hidden, "heads": sz.heads,
                              "kv_heads": sz.kv_heads, "head_dim": sz.head_dim, "dtype": "float32"},
                    "anchor": chat.anchor, "systems": {s: _flags(s if s in ("vllm_default", "no_cache") else
                                                               "persist_q4", plan.ttft_cache_mb) for s in systems},
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
        for server, modes in _servers(systems):
            home = ctx.work / f"edits-{server}"
            shutil.rmtree(home, ignore_errors=True)  # vllm-mlx reloads the prefix cache a previous run saved
            s = Session(server, _server(server, model, home, plan.ttft_cache_mb), result["events"], "edits")
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
                        send(s, history, agent, plan.edit_max_tokens, headers=_headers(system))
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


# ---------------------------------------------------------------------------------------------
# Headline, markdown


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


def _t(x: Optional[float]) -> str:
    return "–" if x is None else f"{x:.2f}"


def md_edits(ed: dict, plan: dict) -> list[str]:
    systems = [s for s in EDIT_SYSTEMS if s in ed.get("systems", {})]
    m = ed.get("model", {})
    L = ["## Span directives: the turn after an edit (issue #21)", "",
         f"Model: llama-architecture `{m.get('size')}` ({m.get('layers')} layers, hidden {m.get('hidden')}, "
         f"{m.get('kv_heads')} KV heads x {m.get('head_dim')}), float32, random weights. Conversations: a task, "
         "then assistant tool calls (~30 tokens) each answered by a user-role tool output, rendered with the "
         "model's chat template (ChatML; message-start token id "
         f"{ed.get('anchor')}). An edit replaces whole tool outputs by a stub (`[tool output i truncated]`, "
         f"8 tokens); the edited request also appends the model's next call and its ~40-token output. "
         f"`max_tokens={plan.get('edit_max_tokens')}`, temperature 0.", "",
         "Systems: " + "; ".join(f"**{s}**: {EDIT_LABELS[s]} (`{ed['systems'][s]}`)" for s in systems) + ".", ""]
    acc = ed.get("accounting", [])
    if acc:
        spans = sorted({a["span"] for a in acc})
        span = 256 if 256 in spans else spans[0]
        L += ["### Re-prefilled tokens per edit (accounting, the whole grid)", "",
              f"{len(acc)} grid points (histories {', '.join(str(h) for h in sorted({a['history'] for a in acc}))}; "
              f"edits at {', '.join(f'{round(p * 100)}%' for p in sorted({a['position'] for a in acc}))}; spans "
              f"{', '.join(map(str, spans))}; {', '.join(map(str, sorted({a['edits'] for a in acc})))} edits per turn; "
              "where they fit); all of them in bench.json. amortize: the server's own planner on the rendered "
              "tokens; the others: prompt minus the reusable common prefix (vllm-mlx: none under "
              f"{VLLM_MIN_PREFIX} tokens). Span {span}, one edit:", "",
              "| history | edit at | prompt | amortize | exact / forget | vllm-mlx default | no cache | "
              "exact / amortize |", "|---|---|---|---|---|---|---|---|"]
        for a in acc:
            if a["span"] == span and a["edits"] == 1:
                L.append(f"| {a['history']} | {round(a['position'] * 100)}% ({a['edit_at']}) | {a['prompt']} | "
                         f"**{a['amortize']}**{' (' + a['fallback'] + ')' if a['fallback'] else ''} | {a['exact']} | "
                         f"{a['vllm_default']} | {a['no_cache']} | {_t(a['exact'] / max(1, a['amortize']))} |")
        top = max(a["history"] for a in acc)
        pos = min(a["position"] for a in acc)
        L += ["", f"At {top} tokens, edits from {round(pos * 100)}%: amortize's re-prefilled tokens (exact's) "
              "by span and edits per turn:", "",
              "| span | " + " | ".join(f"{e} edit{'s' if e > 1 else ''}" for e in sorted({a['edits'] for a in acc}))
              + " |", "|---|" + "---|" * len({a["edits"] for a in acc})]
        for s in spans:
            cells = []
            for e in sorted({a["edits"] for a in acc}):
                a = next((a for a in acc if (a["history"], a["position"], a["span"], a["edits"]) == (top, pos, s, e)), None)
                cells.append("–" if a is None else f"{a['amortize']} ({a['exact']})")
            L.append(f"| {s} | " + " | ".join(cells) + " |")
        L.append("")
    sm = ed.get("summary", {})
    if sm.get("ttft"):
        L += ["### Time to first token after an edit (real servers)", "",
              "All servers run at once and the systems take turns at each point and trace turn (so load from "
              "other jobs falls on all alike). Per point and system one agent: its previous turn sent the "
              "unedited history (stored as in real "
              "use; no cache: not sent), then the edited request is timed (send to first streamed token). "
              "Time in s, with the ratio to persist_q4 exact and to vllm-mlx default; prefilled: the prompt "
              "tokens the server prefilled (amortize: usage.kv_edit.recomputed_tokens, the stub included; the "
              "others: vllm-mlx's scheduler's `tokens_to_prefill`, which counts an exact hit vllm-mlx discards as "
              "a full prefill). "
              f"Every timed request is also an accounting check: {sm['accounting_checked']} checked, "
              f"{len(sm['accounting_mismatches'])} differ from the planner's prediction"
              + (": " + "; ".join(sm["accounting_mismatches"][:8]) if sm["accounting_mismatches"] else "") + ".", "",
              "| history / edit at / span x edits | prompt | " + " | ".join(systems) + " |",
              "|---|---|" + "---|" * len(systems)]
        for key, row in sm["ttft"].items():
            cells = []
            for s in systems:
                v = row["systems"].get(s)
                if not v:
                    cells.append("–")
                    continue
                ratios = [f"x{_t(v[k])} {name}" for k, name, own in (("over_exact", "exact", "exact"),
                                                                     ("over_vllm_default", "vllm", "vllm_default"))
                          if s != own]
                extra = f" ({', '.join(ratios)})"
                fb = f", {v['fallback']}" if v.get("fallback") else ""
                cells.append(f"{v['ttft_s']:.2f} s{extra}; {v['prefilled']} tok{fb}")
            L.append(f"| {key} (at {row['edit_at']}) | {row['prompt']} | " + " | ".join(cells) + " |")
        L.append("")
    if sm.get("trace"):
        tsys = [s for s in systems if any(s in v for v in sm["trace"].values())]
        L += ["### Multi-turn trace with a truncation policy", "",
              f"One agent per system, {plan.get('edit_trace_turns')} turns; turn t sends the task and t (call, "
              f"~{plan.get('edit_trace_tool_tokens')}-token tool output) pairs, outputs older than two turns "
              "replaced by a stub, so from turn 3 on each turn stubs one more output and appends one. Per turn: "
              "TTFT in s and prompt tokens prefilled (planned: the planner's prediction from the previous turn's "
              "prompt, ignoring rotation limits); amortize's usage.kv_edit fallback where it did not splice.", "",
              "| turn | prompt | " + " | ".join(tsys) + " |", "|---|---|" + "---|" * len(tsys)]
        for t, row in sm["trace"].items():
            prompt = next(v["prompt"] for v in row.values())
            cells = []
            for s in tsys:
                v = row.get(s)
                if not v:
                    cells.append("–")
                    continue
                fb = (v.get("kv_edit") or {}).get("fallback")
                cells.append(f"{v['ttft_s']:.2f} s; {v['prefilled']} tok (planned {v['planned']})"
                             + (f", {fb}" if fb else ""))
            L.append(f"| {t} | {prompt} | " + " | ".join(cells) + " |")
        L.append("")
    if sm.get("agent"):
        L += md_agent(ed, plan)
    if ed.get("accounting") or sm.get("ttft") or sm.get("trace"):
        L += ["![Span directives](edits.png)", ""]
    return L


def md_agent(ed: dict, plan: dict) -> list[str]:
    sm = ed["summary"]
    systems = [s for s in AGENT_SYSTEMS if s in ed.get("systems", {})]
    L = ["### Agent trace through the openai and anthropic clients (issue #32)", "",
         f"One agent per API and system, {plan.get('edit_agent_turns')} turns. Each turn the assistant calls "
         f"{plan.get('edit_agent_calls')} tools at once (OpenAI: `tool_calls` answered by `tool` messages; "
         "Anthropic: `tool_use` blocks answered by one user message of `tool_result` blocks), outputs of "
         f"~{plan.get('edit_agent_tool_tokens')} tokens (grep hits, test runs, listings, file text); a "
         "Leyline-like policy cuts every output older than two turns to a "
         f"{plan.get('edit_agent_stub_chars')}-character head/tail stub, so from turn 3 on each turn edits "
         "inside a message (vllm-mlx renders tool results as user messages and merges consecutive ones) "
         "and appends a turn. The harness sends its own scripted tool calls (the random model's replies "
         "are not tool calls). Per turn: TTFT in s, prompt tokens prefilled (amortize: "
         "usage.kv_edit.recomputed_tokens; the others: vllm-mlx's scheduler), and for amortize the "
         "realignment points its splices used (l = line, m = message, i = item) or its fallback.", ""]
    for api, turns in sm["agent"].items():
        L += [f"**{api}**:", "", "| turn | prompt | " + " | ".join(systems) + " |", "|---|---|" + "---|" * len(systems)]
        for t, row in sorted(turns.items(), key=lambda kv: int(kv[0])):
            prompt = next(v["prompt"] for v in row.values())
            cells = []
            for s in systems:
                v = row.get(s)
                if not v:
                    cells.append("–")
                    continue
                extra = ""
                if s == "amortize":
                    extra = (" " + "".join(b[0] for b in v["boundaries"])) if v["boundaries"] else \
                        (f", {v['fallback']}" if v["fallback"] else "")
                cells.append(f"{v['ttft_s']:.2f} s; {v['prefilled']} tok{extra}")
            L.append(f"| {t} | {prompt} | " + " | ".join(cells) + " |")
        L.append("")
    tot = agent_totals(sm["agent"])
    if tot:
        L += ["Turns 3 on, summed (prefilled tokens; TTFT s; amortize turns that spliced): " + "; ".join(
            f"{api}: " + ", ".join(f"{s} {v['prefilled']} tok / {v['ttft_s']:.2f} s"
                                   + (f" ({v['applied']}/{v['turns']} spliced)" if s == "amortize" else "")
                                   for s, v in per.items()) for api, per in tot.items()) + ".", ""]
    L += ["![Agent trace](edits_agent.png)", ""]
    return L
