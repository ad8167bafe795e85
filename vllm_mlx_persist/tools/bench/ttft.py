"""`vllm-mlx-persist bench --sections ttft`: time to first token against context length, cold / hot /
after a restart (SIGTERM, and SIGKILL), for persist_q4, vllm-mlx's default prefix cache and vllm-mlx's
4-bit + SSD tier, on real servers."""

from __future__ import annotations

import shutil
import signal

from .kit import (STATES, Conversation, Ctx, Plan, Session, _turn_record, cache_paths, drop_page_cache, fmt,
                  make_server, median, say, section_failed, seed_of, send)


def section_ttft(ctx: "Ctx") -> dict:
    plan = ctx.plan
    samples: list[dict] = []
    events: list[dict] = []
    drops: list[dict] = []
    errors: dict[str, str] = {}
    histories = {(L, rep): ctx.prompts.history(seed_of("ttft", L, rep), L)
                 for L in plan.contexts for rep in range(plan.reps_for(L))}
    for system in plan.ttft_systems:
        say(f"ttft: {system}")
        home = ctx.work / f"ttft-{system}"
        s = Session(system, make_server(system, ctx.model, home, plan.ttft_cache_mb), events, "ttft")
        convs = [Conversation(f"ttft-{L}-{rep}", [dict(m) for m in histories[L, rep]], seed_of("ttft-u", L, rep),
                              plan.user_words, context=L, rep=rep)
                 for rep in range(plan.reps) for L in plan.contexts if rep < plan.reps_for(L)]

        def turn(conv: Conversation, state: str, cycle: int = 0) -> None:
            r = send(s, conv.ask(), conv.agent, plan.ttft_max_tokens)
            conv.answer(r["text"])
            samples.append(_turn_record(r, system=system, context=conv.meta["context"], rep=conv.meta["rep"],
                                        state=state, cycle=cycle))
            say(f"  {system} {conv.meta['context']:>6} rep {conv.meta['rep']} {state:<16} "
                f"ttft {r['ttft_s']:8.3f}s  prompt {r['prompt_tokens']}  {r['tier']} {r['reused_tokens']}")

        try:
            s.start("fresh")
            for conv in convs:
                turn(conv, "cold")
                for h in range(plan.hot_turns):
                    turn(conv, "hot", h)
            for cycle in range(plan.restart_cycles):
                s.stop(signal.SIGTERM, f"restart {cycle}")
                drops.append({"system": system, "before": f"restart_sigterm {cycle}", **drop_page_cache(cache_paths(home))})
                s.start(f"after SIGTERM {cycle}")
                for conv in convs:
                    turn(conv, "restart_sigterm", cycle)
            firsts = [c for c in convs if c.meta["rep"] == 0]
            for cycle in range(plan.kill_cycles):
                s.stop(signal.SIGKILL, f"kill {cycle}")
                # The snapshot vllm-mlx wrote at the last SIGTERM holds these conversations only because
                # this benchmark stopped it gracefully a minute ago; a crash loses what was not in it.
                shutil.rmtree(home / ".cache" / "vllm-mlx" / "prefix_cache", ignore_errors=True)
                drops.append({"system": system, "before": f"restart_sigkill {cycle}", **drop_page_cache(cache_paths(home))})
                s.start(f"after SIGKILL {cycle}")
                for conv in firsts:
                    turn(conv, "restart_sigkill", cycle)
        except Exception as e:
            section_failed(errors, "ttft", system, s, e)
        finally:
            s.stop(signal.SIGTERM, "end")
    return {"samples": samples, "events": events, "page_cache_drops": drops, "errors": errors,
            "summary": summarize_ttft(samples, plan)}


def summarize_ttft(samples: list[dict], plan: Plan) -> dict:
    out: dict = {}
    for system in plan.ttft_systems:
        per: dict = {}
        for L in plan.contexts:
            row: dict = {}
            for state in STATES:
                xs = [x["ttft_s"] for x in samples if x["system"] == system and x["context"] == L and x["state"] == state]
                if xs:
                    these = [x for x in samples if x["system"] == system and x["context"] == L and x["state"] == state]
                    row[state] = {"median_s": round(median(xs), 4), "min_s": min(xs), "max_s": max(xs), "n": len(xs),
                                  "tiers": sorted({x["tier"] for x in these}),
                                  "prompt_tokens": median([x["prompt_tokens"] for x in these if x["prompt_tokens"]]),
                                  "reused_tokens": median([x["reused_tokens"] or 0 for x in these])}
            cold = row.get("cold", {}).get("median_s")
            row["ratios"] = {f"cold/{st}": round(cold / row[st]["median_s"], 2)
                             for st in STATES[1:] if cold and st in row and row[st]["median_s"] > 0}
            hot = row.get("hot", {}).get("median_s")
            row["ratios"].update({f"{st}/hot": round(row[st]["median_s"] / hot, 2)
                                  for st in STATES[2:] if hot and st in row})
            prompts = [x["prompt_tokens"] for x in samples if x["system"] == system and x["context"] == L
                       and x["state"] == "cold" and x["prompt_tokens"]]
            row["cold_prompt_tokens"] = median(prompts)
            per[str(L)] = row
        out[system] = per
    return out


def md_ttft(t: dict, plan: dict) -> list[str]:
    L = ["## Time to first token against context length", "",
         f"Each conversation: a history of the nominal length plus a short new user turn ({plan['user_words']} "
         f"words), `max_tokens={plan['ttft_max_tokens']}`, streamed; TTFT = send to first content chunk. Cold: the "
         f"first turn of a new agent. Hot: the next turn ({plan['hot_turns']} per conversation), cache in memory. "
         f"Restart (SIGTERM): server stopped gracefully and started again between turns "
         f"({plan['restart_cycles']} cycles). Restart (SIGKILL): killed, then started ({plan.get('kill_cycles', 1)} "
         "cycles; each gives one turn of the first conversation of each context, in context order). Before every "
         "restart the cache files are fsync'd and dropped from the page cache (posix_fadvise DONTNEED); vllm-mlx's SIGTERM snapshot is removed before a SIGKILL restart (a crash keeps "
         "only what an earlier graceful stop saved, and none of these conversations predate one). No request is "
         "served between a start and the measured turn (no warm-up request: the turn pays what a user's first request "
         "after a restart pays; persist_q4 runs its own warm-up at start-up). Medians; n = samples. "
         "Conversations per context: " + ", ".join(f"{c}: {plan['reps_by_context'].get(str(c), plan['reps_by_context'].get(c, plan['reps']))}"
                                                   for c in plan["contexts"]) + ".", "",
         "Cells: median TTFT (samples, where the server says the prefix came from, median prompt tokens). "
         "Every turn adds a short user turn and a short reply, so later states have slightly longer prompts: "
         "a restart that falls back to a cold prefill is slower than the first cold turn.", "",
         "| system | context | prompt tok | cold s | hot s | restart TERM s | restart KILL s | cold/hot | cold/TERM | cold/KILL | "
         "KILL/hot |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s, per in t["summary"].items():
        for c, row in per.items():
            def cell(st: str) -> str:
                v = row.get(st)
                return (f"{v['median_s']:.3f} (n={v['n']}, {'/'.join(v['tiers'])}, {v['prompt_tokens']:.0f} tok)"
                        if v else "–")
            r = row["ratios"]
            L.append(f"| {s} | {c} | {fmt(row['cold_prompt_tokens'], 0)} | {cell('cold')} | {cell('hot')} | "
                     f"{cell('restart_sigterm')} | {cell('restart_sigkill')} | {r.get('cold/hot', '–')} | "
                     f"{r.get('cold/restart_sigterm', '–')} | {r.get('cold/restart_sigkill', '–')} | "
                     f"{r.get('restart_sigkill/hot', '–')} |")
    L += ["", "Server stop and start times (start = until /health answers; includes loading vllm-mlx's snapshot):", "",
          "| system | event | seconds |", "|---|---|---|"]
    for e in t["events"]:
        if e["event"] != "warmup" and e["note"] != "end":
            L.append(f"| {e['system']} | {e['event']} ({e['note']}) | {e['seconds']:.2f} |")
    L += ["", "![TTFT against context](ttft.png)", ""]
    return L
