"""`vllm-mlx-persist bench --sections batch`: 1..8 agents decoding at once from warm caches: system
and per-agent tokens/s, and the tokens each request had to prefill."""

from __future__ import annotations

import re
import signal
import statistics

from .kit import (FIXED_REPLY, Conversation, Ctx, Session, at_once, classify, fmt, make_server, median, say,
                  section_failed, seed_of, send)


def section_batch(ctx: "Ctx") -> dict:
    import openai

    plan = ctx.plan
    n_agents = max(plan.batch_levels)
    histories = [ctx.prompts.history(seed_of("batch", i), plan.batch_tokens) for i in range(n_agents)]
    result: dict = {"events": [], "systems": {}, "errors": {}}
    for system in plan.batch_systems:
        say(f"batch: {system}")
        home = ctx.work / f"batch-{system}"
        s = Session(system, make_server(system, ctx.model, home, plan.ttft_cache_mb), result["events"], "batch")
        convs = [Conversation(f"batch-{i}", [dict(m) for m in histories[i]], seed_of("batch-u", i), plan.user_words)
                 for i in range(n_agents)]
        runs: list[dict] = []
        try:
            s.start("fresh")
            for conv in convs:  # warm every agent's cache
                send(s, conv.ask(), conv.agent, 4)
                conv.answer(FIXED_REPLY)
            clients = [openai.OpenAI(base_url=s.server.url + "/v1", api_key="bench", max_retries=0, timeout=7200)
                       for _ in range(n_agents)]
            for level in plan.batch_levels:
                for rep in range(plan.batch_reps):
                    group = convs[:level]

                    def one(i: int, msgs: list[dict]) -> dict:
                        r = send(s, msgs, group[i].agent, plan.batch_max_tokens, client=clients[i], classify_log=False)
                        group[i].answer(FIXED_REPLY)
                        return r

                    res, seg = at_once(level, lambda i: group[i].ask(), one, s.server.log_path)
                    t0 = min(r["t_send"] for r in res)
                    t_end = max(r["t_last"] or r["t_end"] for r in res)
                    toks = [r["completion_tokens"] or 0 for r in res]
                    per_agent = [(n - 1) / (r["t_last"] - r["t_first"]) for n, r in zip(toks, res)
                                 if n > 1 and r["t_last"] and r["t_first"] and r["t_last"] > r["t_first"]]
                    hits = [classify(seg, c.agent) for c in group] if system == "persist_q4" else []
                    # tokens each request had to prefill, from the server's own lookup lines
                    if system == "persist_q4":
                        prefilled = [r["prompt_tokens"] - n for r, (_, n) in zip(res, hits)]
                    else:
                        prefilled = [int(x) for x in re.findall(r"\[cache_fetch\] request=\S+ (?:HIT|MISS) prompt_tokens=\d+"
                                                                  r"(?: cached=\d+ remaining=(\d+))?", seg) if x]
                    run = {
                        "level": level, "rep": rep,
                        "completion_tokens": toks,
                        "prompt_tokens": [r["prompt_tokens"] for r in res],
                        "prefilled_tokens": prefilled,
                        "ttft_s": [r["ttft_s"] for r in res],
                        "wall_s": round(t_end - t0, 4),
                        "system_tok_s": round(sum(toks) / (t_end - t0), 2),
                        "per_agent_tok_s": [round(x, 2) for x in per_agent],
                        "per_agent_tok_s_mean": round(statistics.mean(per_agent), 2) if per_agent else None,
                        "cache_hits": (sum(1 for t, _ in hits if t != "cold") if hits
                                       else len(re.findall(r"\[cache_fetch\] request=\S+ HIT", seg))),
                    }
                    runs.append(run)
                    say(f"  {system} x{level} rep {rep}: {run['system_tok_s']} tok/s system, "
                        f"{run['per_agent_tok_s_mean']} tok/s per agent, tokens {toks}, hits {run['cache_hits']}")
        except Exception as e:
            section_failed(result["errors"], "batch", system, s, e)
        finally:
            s.stop(signal.SIGTERM, "end")
        summary = {}
        for level in plan.batch_levels:
            rs = [r for r in runs if r["level"] == level]
            if rs:
                summary[str(level)] = {
                    "system_tok_s": round(median([r["system_tok_s"] for r in rs]), 2),
                    "per_agent_tok_s": round(median([r["per_agent_tok_s_mean"] or 0 for r in rs]), 2),
                    "median_ttft_s": median([x for r in rs for x in r["ttft_s"]]),
                    "tokens_per_agent": median([x for r in rs for x in r["completion_tokens"]]),
                    "cache_hits": sum(r["cache_hits"] for r in rs),
                    "median_prompt_tokens": median([x for r in rs for x in r.get("prompt_tokens", [])]),
                    "median_prefilled_tokens": median([x for r in rs for x in r.get("prefilled_tokens", [])]),
                    "requests": sum(r["level"] for r in rs),
                }
        result["systems"][system] = {"runs": runs, "summary": summary}
    return result


def md_batch(b: dict, plan: dict) -> list[str]:
    L = ["## Batched decoding from warm caches", "",
         f"Agents with about {plan['batch_tokens']} tokens of history each, caches warmed by one turn; then k of them "
         f"send a new turn at the same moment, `max_tokens={plan['batch_max_tokens']}`, {plan['batch_reps']} "
         "repetitions; every turn extends each agent's history, and each request hits its agent's cache and prefills "
         "only the new tokens (median prompt / prefilled tokens below, from the servers' lookup lines). The "
         f"assistant turns in these histories are a fixed text (\"{FIXED_REPLY}\"): the random model's replies do "
         "not survive detokenize + retokenize, and vllm-mlx then prefers an older entry that is an exact prefix over "
         "the newest (longest) one and re-prefills hundreds of tokens per turn. System tok/s = all completion tokens "
         "/ (first send to last token), so it includes the concurrent prefills. Per-agent tok/s = (tokens - 1) / "
         "(first to last token of that agent), mean over agents.", "",
         "| agents | " + " | ".join(f"{s} system tok/s | {s} per-agent tok/s | {s} TTFT s" for s in b["systems"]) + " |",
         "|---|" + "---|---|---|" * len(b["systems"])]
    for lv in plan["batch_levels"]:
        cells = []
        for s, v in b["systems"].items():
            x = v["summary"].get(str(lv))
            cells += [fmt(x and x["system_tok_s"], 1), fmt(x and x["per_agent_tok_s"], 1), fmt(x and x["median_ttft_s"])] \
                if x else ["–"] * 3
        L.append(f"| {lv} | " + " | ".join(cells) + " |")
    L += ["", "| agents | " + " | ".join(f"{s} prompt / prefilled tok" for s in b["systems"]) + " |",
          "|---|" + "---|" * len(b["systems"])]
    for lv in plan["batch_levels"]:
        cells = []
        for v in b["systems"].values():
            x = v["summary"].get(str(lv)) or {}
            cells.append(f"{fmt(x.get('median_prompt_tokens'), 0)} / {fmt(x.get('median_prefilled_tokens'), 0)}")
        L.append(f"| {lv} | " + " | ".join(cells) + " |")
    L += ["", "![Batched decoding](batch.png)", ""]
    return L
