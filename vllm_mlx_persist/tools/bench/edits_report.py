"""The `edits` section's part of `vllm-mlx-persist bench`'s bench.md: re-prefilled tokens over the grid,
TTFT after an edit, the truncation trace and the agent trace."""

from __future__ import annotations

from .edits_accounting import VLLM_MIN_PREFIX
from .edits_agent import AGENT_SYSTEMS, agent_totals
from .edits_servers import EDIT_LABELS, EDIT_SYSTEMS
from .kit import fmt


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
                         f"{a['vllm_default']} | {a['no_cache']} | {fmt(a['exact'] / max(1, a['amortize']), 2)} |")
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
                ratios = [f"x{fmt(v[k], 2)} {name}" for k, name, own in (("over_exact", "exact", "exact"),
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
