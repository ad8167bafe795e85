"""`vllm-mlx-persist scenario`: run a multi-agent, multi-phase scenario against a running server and
report, per phase and per agent, time to first token, prompt and cached tokens, against a comparison
run in which no cache is reused.

Requests go through the official `openai` client, streamed, so TTFT is what a user sees. The
comparison run replays exactly the same requests (same messages, same order and concurrency), either
on the same server with every request under a fresh throwaway agent id (`--no-cache-compare`, the
default) or against a second server (`--compare-url`, e.g. vllm-mlx with its default cache).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from .spec import Agent, Phase, Scenario, ScenarioError, Sees, load_scenario, render, shipped_scenarios

FORK_HEADER = "X-Agent-Fork-From"


@dataclass
class Record:
    """One request of a run and what the server reported for it."""

    phase: str
    step: int  # index of the step in the whole run; requests of one parallel step share it
    agent: str
    agent_id: str
    fork_from: Optional[str]
    parallel: bool
    messages: list[dict]
    max_tokens: int
    output: str = ""
    ttft_s: float = 0.0
    total_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: Optional[str] = None


@dataclass
class AgentState:
    """What one agent (one server-side id) has been shown and said."""

    agent_id: str
    history: list[dict] = field(default_factory=list)
    delivered: set[int] = field(default_factory=set)  # indices of posts already in `history`
    own: set[int] = field(default_factory=set)  # indices of its own posts
    fork_from: Optional[str] = None  # the parent's server-side id


@dataclass(frozen=True)
class Post:
    phase: str
    author: str
    text: str


def base_url(url: str) -> str:
    """The OpenAI base URL (…/v1) for a server URL given with or without /v1."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def make_client(url: str, timeout: float = 600):
    import openai

    return openai.OpenAI(base_url=base_url(url), api_key="scenario", max_retries=0, timeout=timeout)


def served_model(client) -> str:
    """The first model the server lists."""
    models = client.models.list().data
    if not models:
        raise RuntimeError("the server lists no models; pass --model")
    return models[0].id


def send(client, model: str, rec: Record, agent_id: Optional[str], fork_from: Optional[str]) -> None:
    """Stream one chat completion; fill `rec` with the output, TTFT and usage."""
    metadata: dict[str, str] = {}
    headers: dict[str, str] = {}
    if agent_id is not None:
        metadata["agent_id"] = agent_id
    if fork_from is not None:
        metadata["fork_from"] = fork_from
        headers[FORK_HEADER] = fork_from
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=rec.messages, max_tokens=rec.max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, metadata=metadata or None, extra_headers=headers or None)
    parts: list[str] = []
    ttft = None
    usage = None
    for chunk in stream:
        if chunk.choices:
            choice = chunk.choices[0]
            if choice.delta is not None and choice.delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(choice.delta.content)
            if choice.finish_reason:
                rec.finish_reason = choice.finish_reason
        if chunk.usage is not None:
            usage = chunk.usage
    total = time.perf_counter() - t0
    rec.output = "".join(parts)
    rec.ttft_s = ttft if ttft is not None else total  # no text at all: the first token was the end
    rec.total_s = total
    if usage is None:
        raise RuntimeError("the server's stream carried no usage (stream_options.include_usage)")
    rec.prompt_tokens = usage.prompt_tokens
    rec.completion_tokens = usage.completion_tokens or 0
    details = usage.prompt_tokens_details
    rec.cached_tokens = (details.cached_tokens if details else 0) or 0


class Runner:
    """Plays a scenario: builds each agent's prompt from what it may see, sends it, records it."""

    def __init__(self, scenario: Scenario, client, model: str, run_id: str):
        self.sc, self.client, self.model, self.run_id = scenario, client, model, run_id
        self.posts: list[Post] = []
        self.states: dict[str, AgentState] = {}  # by agent name (the current phase's id if ephemeral)
        self.records: list[Record] = []
        self._step = 0

    def agent_id(self, agent: Agent, phase: Phase) -> str:
        if agent.ephemeral:  # a fresh id per phase: nothing of an earlier phase is reused
            return f"{self.run_id}-{agent.name}-{phase.name}"
        return f"{self.run_id}-{agent.name}"

    def state(self, agent: Agent, phase: Phase) -> AgentState:
        aid = self.agent_id(agent, phase)
        st = self.states.get(agent.name)
        if st is not None and st.agent_id == aid:
            return st
        st = AgentState(aid)
        if agent.fork_from is not None:
            parent = self.states[agent.fork_from]  # validation guarantees the parent has spoken
            st.history = [dict(m) for m in parent.history]
            st.delivered = parent.delivered | parent.own
            st.fork_from = parent.agent_id
        else:
            system = render(agent.system, agent=agent.name, phase=phase.name, round=1, texts=self.sc.texts,
                            doc=agent.document)
            if system:
                st.history.append({"role": "system", "content": system})
        self.states[agent.name] = st
        return st

    def visible(self, agent: str, st: AgentState, sees: Sees) -> list[int]:
        if sees.nothing:
            return []
        return [i for i, p in enumerate(self.posts)
                if i not in st.delivered and p.author != agent
                and (sees.agents is None or p.author in sees.agents)
                and (sees.phases is None or p.phase in sees.phases)]

    def prepare(self, phase: Phase, step_prompt: str, agent: Agent, round_no: int) -> tuple[Record, AgentState, list[int]]:
        st = self.state(agent, phase)
        new = self.visible(agent.name, st, phase.sees[agent.name])
        parts = [f"[{self.posts[i].author}, {self.posts[i].phase}]: {self.posts[i].text}" for i in new]
        cue = render(step_prompt, agent=agent.name, phase=phase.name, round=round_no, texts=self.sc.texts,
                     doc=agent.document)
        if cue:
            parts.append(cue)
        user = "\n\n".join(parts) or f"{agent.name}, it is your turn."
        rec = Record(phase.name, self._step, agent.name, st.agent_id, st.fork_from, phase.parallel,
                     st.history + [{"role": "user", "content": user}], phase.max_tokens or self.sc.max_tokens)
        return rec, st, new

    def finish(self, rec: Record, st: AgentState, new: list[int]) -> None:
        st.history = rec.messages + [{"role": "assistant", "content": rec.output}]
        st.delivered.update(new)
        st.own.add(len(self.posts))
        self.posts.append(Post(rec.phase, rec.agent, rec.output))
        self.records.append(rec)

    def run(self, progress: Callable[[str], None] = lambda s: None) -> list[Record]:
        for phase in self.sc.phases:
            progress(f"phase {phase.name}")
            for round_no, step in enumerate(phase.steps, 1):
                agents = [self.sc.agents[a] for a in step.agents]
                if phase.parallel:  # everyone sees the transcript as it was when the step began
                    prepared = [self.prepare(phase, step.prompt_for(a.name), a, round_no) for a in agents]
                    with ThreadPoolExecutor(len(prepared)) as pool:
                        list(pool.map(lambda p: send(self.client, self.model, p[0], p[0].agent_id, p[0].fork_from),
                                      prepared))
                    for rec, st, new in prepared:
                        self.finish(rec, st, new)
                else:
                    for a in agents:
                        rec, st, new = self.prepare(phase, step.prompt_for(a.name), a, round_no)
                        send(self.client, self.model, rec, rec.agent_id, rec.fork_from)
                        self.finish(rec, st, new)
                self._step += 1
        return self.records


def replay(records: list[Record], client, model: str, id_for: Callable[[Record, int], Optional[str]],
           keep_fork: bool) -> list[Record]:
    """Send the same requests again, in the same order and concurrency, under `id_for`'s agent ids."""
    out: list[Record] = []
    steps: dict[int, list[Record]] = {}
    for r in records:
        steps.setdefault(r.step, []).append(r)
    n = 0
    for step in sorted(steps):
        recs = []
        for r in steps[step]:
            recs.append(Record(r.phase, r.step, r.agent, id_for(r, n) or "", r.fork_from if keep_fork else None,
                               r.parallel, r.messages, r.max_tokens))
            n += 1
        if recs[0].parallel:
            with ThreadPoolExecutor(len(recs)) as pool:
                list(pool.map(lambda r: send(client, model, r, r.agent_id or None, r.fork_from), recs))
        else:
            for r in recs:
                send(client, model, r, r.agent_id or None, r.fork_from)
        out += recs
    return out


def warm_up(client, model: str, run_id: str) -> None:
    """One short request under a throwaway id: first-request costs stay out of the figures."""
    rec = Record("warmup", -1, "warmup", f"{run_id}-warmup", None, False,
                 [{"role": "user", "content": "warm up"}], 2)
    send(client, model, rec, rec.agent_id, None)


# ---------------------------------------------------------------- summaries

def _totals(recs: list[Record]) -> dict[str, Any]:
    n = len(recs)
    prompt = sum(r.prompt_tokens for r in recs)
    cached = sum(r.cached_tokens for r in recs)
    return {
        "requests": n, "prompt_tokens": prompt, "cached_tokens": cached, "prefill_tokens": prompt - cached,
        "saved": cached / prompt if prompt else 0.0,
        "ttft_ms_mean": 1000 * sum(r.ttft_s for r in recs) / n if n else 0.0,
        "ttft_ms_total": 1000 * sum(r.ttft_s for r in recs),
    }


def summarize(records: list[Record], compare: Optional[list[Record]]) -> list[dict[str, Any]]:
    """Rows per (phase, agent), per phase and overall, each with the comparison side by side."""
    groups: dict[tuple[str, str], list[int]] = {}
    for i, r in enumerate(records):
        groups.setdefault((r.phase, r.agent), []).append(i)
    phases = list(dict.fromkeys(r.phase for r in records))
    for ph in phases:
        groups[(ph, "*")] = [i for i, r in enumerate(records) if r.phase == ph]
    groups[("*", "*")] = list(range(len(records)))
    order = [k for ph in phases for k in groups if k[0] == ph and k[1] != "*"]
    order += [(ph, "*") for ph in phases] + [("*", "*")]
    rows = []
    for key in order:
        idx = groups[key]
        row: dict[str, Any] = {"phase": key[0], "agent": key[1], **_totals([records[i] for i in idx])}
        if compare is not None:
            c = _totals([compare[i] for i in idx])
            row["compare"] = c
            row["ttft_ratio"] = c["ttft_ms_mean"] / row["ttft_ms_mean"] if row["ttft_ms_mean"] else None
            row["prefill_ratio"] = (c["prefill_tokens"] / row["prefill_tokens"]) if row["prefill_tokens"] else None
        rows.append(row)
    return rows


def format_table(rows: list[dict[str, Any]], compare_label: Optional[str]) -> str:
    head = ["phase", "agent", "req", "prompt", "cached", "saved", "TTFT ms"]
    if compare_label:
        head += ["| cmp cached", "cmp TTFT ms", "TTFT x", "prefill x"]
    lines = []
    for r in rows:
        cells = [r["phase"] if r["phase"] != "*" else "ALL", r["agent"] if r["agent"] != "*" else "(all)",
                 str(r["requests"]), str(r["prompt_tokens"]), str(r["cached_tokens"]), f"{100 * r['saved']:.0f}%",
                 f"{r['ttft_ms_mean']:.1f}"]
        if compare_label:
            c = r["compare"]
            cells += ["| " + str(c["cached_tokens"]), f"{c['ttft_ms_mean']:.1f}",
                      f"{r['ttft_ratio']:.2f}" if r["ttft_ratio"] else "-",
                      f"{r['prefill_ratio']:.2f}" if r["prefill_ratio"] else "-"]
        lines.append(cells)
    widths = [max(len(x) for x in col) for col in zip(head, *lines)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    out = [fmt(head), fmt(["-" * w for w in widths])]
    prev_phase = None
    for cells, r in zip(lines, rows):
        block = r["phase"] if r["agent"] != "*" else "totals"
        if prev_phase is not None and block != prev_phase:
            out.append("")
        prev_phase = block
        out.append(fmt(cells))
    if compare_label:
        out.append(f"\ncmp = {compare_label}. TTFT x = cmp TTFT / this TTFT (mean per request); "
                   "prefill x = cmp prefilled tokens / this run's.")
    return "\n".join(out)


# ---------------------------------------------------------------- entry points

def run_scenario(scenario: Scenario, url: str, *, model: Optional[str] = None, compare_url: Optional[str] = None,
                 compare: bool = True, run_id: Optional[str] = None, warmup: bool = True,
                 progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Run `scenario` against `url` (and its comparison); returns the report as a JSON-able dict."""
    client = make_client(url)
    model = model or served_model(client)
    run_id = run_id or f"{scenario.name}-{uuid.uuid4().hex[:8]}"
    if warmup:
        warm_up(client, model, run_id)
    t0 = time.perf_counter()
    records = Runner(scenario, client, model, run_id).run(progress)
    wall = time.perf_counter() - t0

    compared: Optional[list[Record]] = None
    mode = label = None
    cmp_wall = None
    if compare_url is not None:
        mode, label = "url", f"the same requests against {compare_url}"
        cclient = make_client(compare_url)
        cmodel = model if model in [m.id for m in cclient.models.list().data] else served_model(cclient)
        if warmup:
            warm_up(cclient, cmodel, run_id + "-cmp")
        progress(f"comparison run against {compare_url}")
        t0 = time.perf_counter()
        compared = replay(records, cclient, cmodel, lambda r, n: r.agent_id, keep_fork=True)
        cmp_wall = time.perf_counter() - t0
    elif compare:
        mode = "no-cache"
        label = "the same requests, each under a fresh throwaway agent id (no cache reused)"
        progress("comparison run: no cache reuse")
        t0 = time.perf_counter()
        compared = replay(records, client, model, lambda r, n: f"{run_id}-nocache-{n}", keep_fork=False)
        cmp_wall = time.perf_counter() - t0

    rows = summarize(records, compared)
    report: dict[str, Any] = {
        "scenario": scenario.name, "description": scenario.description, "url": url, "model": model,
        "run_id": run_id, "params": scenario.params, "max_tokens": scenario.max_tokens,
        "compare": {"mode": mode, "label": label, "url": compare_url} if mode else None,
        "wall_s": wall, "compare_wall_s": cmp_wall, "summary": rows,
        "requests": [asdict(r) for r in records],
        "compare_requests": [asdict(r) for r in compared] if compared is not None else None,
    }
    if compared is not None:
        report["outputs_identical"] = sum(a.output == b.output for a, b in zip(records, compared))
    return report



def parse_param(text: str) -> tuple[str, int]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=INTEGER, got {text!r}")
    try:
        return key, int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected KEY=INTEGER, got {text!r}") from None


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="vllm-mlx-persist scenario", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", nargs="?", help="a scenario YAML file, or the name of a shipped scenario")
    p.add_argument("--url", help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name to request (default: the first the server lists)")
    cmp = p.add_mutually_exclusive_group()
    cmp.add_argument("--compare-url", help="replay the same requests against this second server")
    cmp.add_argument("--no-cache-compare", action="store_true",
                     help="replay on the same server, each request under a throwaway agent id (the default)")
    cmp.add_argument("--no-compare", action="store_true", help="skip the comparison run")
    p.add_argument("--param", action="append", type=parse_param, default=[], metavar="KEY=N",
                   help="override one of the scenario's params (e.g. doc_words=40); repeatable")
    p.add_argument("--run-id", help="prefix of the agent ids (default: scenario name + random suffix)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the full report (every request) here")
    p.add_argument("--list", action="store_true", help="list the shipped scenarios and exit")
    p.add_argument("--check", action="store_true", help="only validate the file and print its shape")
    args = p.parse_args(argv)

    if args.list:
        for name, path in sorted(shipped_scenarios().items()):
            print(f"{name:14s} {path}")
        return 0
    if not args.file:
        p.error("a scenario file is required")
    try:
        scenario = load_scenario(args.file, dict(args.param))
    except ScenarioError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.check:
        print(describe(scenario))
        return 0
    if not args.url:
        p.error("--url is required")
    progress = lambda s: print(f"[scenario] {s}", file=sys.stderr, flush=True)
    report = run_scenario(scenario, args.url, model=args.model, compare_url=args.compare_url,
                          compare=not args.no_compare, run_id=args.run_id, progress=progress)
    print(f"scenario {scenario.name} on {args.url} (model {report['model']}), params {scenario.params}, "
          f"run id {report['run_id']}")
    print(format_table(report["summary"], report["compare"]["label"] if report["compare"] else None))
    if report["compare"]:
        print(f"wall: {report['wall_s']:.1f} s, comparison {report['compare_wall_s']:.1f} s; "
              f"outputs identical in {report['outputs_identical']}/{len(report['requests'])} requests")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"report: {args.json}")
    return 0


def describe(sc: Scenario) -> str:
    """A short outline of a scenario: agents, phases, steps."""
    lines = [f"{sc.name}: {sc.description.strip()}", f"params {sc.params}, max_tokens {sc.max_tokens}"]
    for a in sc.agents.values():
        extra = f", forks from {a.fork_from}" if a.fork_from else ""
        lines.append(f"  agent {a.name} ({a.lifecycle}{extra})")
    for ph in sc.phases:
        mode = "parallel" if ph.parallel else "in turn"
        lines.append(f"  phase {ph.name}: {len(ph.steps)} step(s), {mode}, agents {', '.join(ph.agents)}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
