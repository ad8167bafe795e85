"""`vllm-mlx-persist bench --sections agents`: N agents round-robin in a memory budget too small for
all of them: per-turn TTFT, turns served from memory / disk / cold, prompt tokens prefilled, peak RSS
of the server."""

from __future__ import annotations

import signal
import time

from ..serving import RssSampler
from .kit import (MB, Conversation, Ctx, Session, _turn_record, fmt, make_server, median, say, section_failed,
                  seed_of, send)


def section_agents(ctx: "Ctx") -> dict:
    plan = ctx.plan
    histories = [ctx.prompts.history(seed_of("agents", i), plan.agent_tokens) for i in range(plan.agents)]
    result: dict = {"events": [], "systems": {}, "errors": {}}
    for system in plan.agent_systems:
        say(f"agents: {system} ({plan.agents} agents, budget {plan.agent_budget_mb} MB)")
        home = ctx.work / f"agents-{system}"
        s = Session(system, make_server(system, ctx.model, home, plan.agent_budget_mb), result["events"], "agents")
        convs = [Conversation(f"agent-{i}", [dict(m) for m in histories[i]], seed_of("agents-u", i), plan.user_words)
                 for i in range(plan.agents)]
        turns: list[dict] = []
        sampler = RssSampler(0.1)
        try:
            s.start("fresh")
            sampler.start(s.server.pid)
            time.sleep(0.3)
            baseline = sampler.rss()
            for rnd in range(plan.agent_rounds):
                for i, conv in enumerate(convs):
                    r = send(s, conv.ask(), conv.agent, plan.ttft_max_tokens)
                    conv.answer(r["text"])
                    rec = _turn_record(r, round=rnd, agent=i, rss_bytes=sampler.rss())
                    rec["prefilled_tokens"] = (r["prompt_tokens"] or 0) - (r["reused_tokens"] or 0)
                    turns.append(rec)
                    say(f"  {system} round {rnd} agent {i}: ttft {r['ttft_s']:7.3f}s {r['tier']:<6} "
                        f"reused {r['reused_tokens']}/{r['prompt_tokens']}")
            stats = s.server.get_json("/v1/cache/stats").get("engine_cache")
        except Exception as e:
            section_failed(result["errors"], "agents", system, s, e)
            stats, baseline = None, 0
        finally:
            peak = sampler.stop()
            s.stop(signal.SIGTERM, "end")
        ret = [t for t in turns if t["round"] > 0]
        result["systems"][system] = {
            "turns": turns,
            "cache_stats": stats,
            "baseline_rss_bytes": baseline,
            "peak_rss_bytes": peak,
            "rss_series": sampler.series,
            "summary": {
                "turns": len(turns),
                "returning_turns": len(ret),
                "returning": {t: sum(1 for x in ret if x["tier"] == t) for t in ("memory", "disk", "cold")},
                "all": {t: sum(1 for x in turns if x["tier"] == t) for t in ("memory", "disk", "cold")},
                "median_ttft_returning_s": median([x["ttft_s"] for x in ret]),
                "median_ttft_first_s": median([x["ttft_s"] for x in turns if x["round"] == 0]),
                "prompt_tokens": sum(x["prompt_tokens"] or 0 for x in turns),
                "prefilled_tokens": sum(x["prefilled_tokens"] for x in turns),
                "prefilled_tokens_returning": sum(x["prefilled_tokens"] for x in ret),
                "peak_rss_mb": round(peak / MB, 1),
                "baseline_rss_mb": round(baseline / MB, 1),
                "total_time_s": round(sum(x["total_s"] for x in turns), 2),
            },
        }
    return result


def md_agents(a: dict, plan: dict) -> list[str]:
    L = ["## Many agents in a fixed memory budget", "",
         f"{plan['agents']} agents, each with a history of about {plan['agent_tokens']} tokens, take "
         f"{plan['agent_rounds']} rounds of turns round-robin. Memory budget {plan['agent_budget_mb']} MB for the "
         "cache (`hot_mb` for persist_q4, `--cache-memory-mb` for vllm-mlx). Round 0 is every agent's first turn "
         "(necessarily cold); the counts below are the returning turns (rounds 1+). Tier from the server's own log "
         "line for each lookup. Peak memory: RSS of the server process, sampled every 0.1 s.", "",
         "| system | returning turns | from memory | from disk | cold | median TTFT returning s | median TTFT first s | "
         "prompt tokens | prefilled tokens | peak RSS MB | RSS after start MB |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s, v in a["systems"].items():
        x = v["summary"]
        r = x["returning"]
        L.append(f"| {s} | {x['returning_turns']} | {r['memory']} | {r['disk']} | {r['cold']} | "
                 f"{fmt(x['median_ttft_returning_s'])} | {fmt(x['median_ttft_first_s'])} | {x['prompt_tokens']} | "
                 f"{x['prefilled_tokens']} | {x['peak_rss_mb']} | {x['baseline_rss_mb']} |")
    L += ["", "![Per-turn TTFT and RSS](agents.png)", ""]
    return L
