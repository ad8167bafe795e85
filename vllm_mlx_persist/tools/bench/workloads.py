"""The seeds' workloads in `vllm-mlx-persist bench` (issue #11): long contexts, two agents against one,
staggered arrivals, and other agents' decoding while one agent's long first turn is written.

- long: 16k and 32k-token histories on a smaller model (the 103M bench model would take hours of cold
  prefill): TTFT cold / hot / after a SIGKILL restart, and the server's peak RSS during the cold
  (chunked) prefill against its RSS before it.
- concurrency: per context, one agent alone against two at once (system and per-stream tok/s, TTFT,
  wall), and staggered arrivals (B sends `conc_stagger_s` after A), each with cold caches, hot
  caches, and after a SIGKILL restart.
- stall: `stall_agents` agents decode in a loop from warm caches while one agent sends a long first
  turn: their inter-token gaps before, during its prefill, and from its last token until
  `stall_after_s` after its response ended (persist_q4 writes its blocks then, vllm-mlx stores its
  prefix cache entry).
"""

from __future__ import annotations

import shutil
import signal
import statistics
import threading
import time
from typing import Any, Optional

from ..serving import RssSampler
from .kit import (FIXED_REPLY, Conversation, Ctx, Prompts, Session, _turn_record, at_once, cache_paths,
                  drop_page_cache, make_server, median, say, section_failed, seed_of, send)

MB = 2**20


def _restart_killed(s: Session, note: str) -> dict:
    """SIGKILL the server, drop what a crash loses (vllm-mlx's last SIGTERM snapshot) and the page
    cache of every cache file, start it again; returns the page-cache drop record."""
    s.stop(signal.SIGKILL, note)
    shutil.rmtree(s.server.home / ".cache" / "vllm-mlx" / "prefix_cache", ignore_errors=True)
    drop = drop_page_cache(cache_paths(s.server.home))
    s.start(f"after SIGKILL ({note})")
    return drop


def _client(s: Session) -> Any:
    import openai

    return openai.OpenAI(base_url=s.server.url + "/v1", api_key="bench", max_retries=0, timeout=7200)


def _tok_s(r: dict) -> Optional[float]:
    """Per-stream decode rate: (tokens - 1) / (first to last token)."""
    n = r.get("completion_tokens") or 0
    if n > 1 and r.get("t_first") and r.get("t_last") and r["t_last"] > r["t_first"]:
        return round((n - 1) / (r["t_last"] - r["t_first"]), 2)
    return None


# ---------------------------------------------------------------------------------------------
# Section: long contexts


def section_long(ctx: Ctx) -> dict:
    from ..models.build import SIZES, build_model_dir

    plan = ctx.plan
    model = build_model_dir(ctx.work / f"model-llama-{plan.long_size}", arch="llama", size=plan.long_size)
    prompts = Prompts(model)
    sz = SIZES[plan.long_size]
    result: dict = {"model": {"size": plan.long_size, "layers": sz.layers, "hidden": sz.hidden,
                              "kv_heads": sz.kv_heads, "head_dim": sz.head_dim},
                    "samples": [], "events": [], "drops": [], "errors": {}}
    histories = {L: prompts.history(seed_of("long", L), L) for L in plan.long_contexts}
    for system in plan.long_systems:
        say(f"long: {system}")
        s = Session(system, make_server(system, model, ctx.work / f"long-{system}", plan.ttft_cache_mb),
                    result["events"], "long")
        convs = [Conversation(f"long-{L}", [dict(m) for m in histories[L]], seed_of("long-u", L), plan.user_words,
                              context=L) for L in plan.long_contexts]

        def turn(conv: Conversation, state: str) -> None:
            sampler = RssSampler(0.05)
            sampler.start(s.server.pid)
            before = sampler.rss()
            r = send(s, conv.ask(), conv.agent, plan.ttft_max_tokens)
            peak = sampler.stop()
            conv.answer(r["text"])
            rec = _turn_record(r, system=system, context=conv.meta["context"], state=state,
                               rss_before_mb=round(before / MB, 1), rss_peak_mb=round(peak / MB, 1))
            result["samples"].append(rec)
            say(f"  {system} {conv.meta['context']:>6} {state:<16} ttft {r['ttft_s']:8.3f}s  prompt "
                f"{r['prompt_tokens']}  {r['tier']} {r['reused_tokens']}  rss {rec['rss_before_mb']} -> "
                f"{rec['rss_peak_mb']} MB")

        try:
            s.start("fresh")
            for conv in convs:
                turn(conv, "cold")
                turn(conv, "hot")
            result["drops"].append({"system": system, **_restart_killed(s, "long")})
            for conv in convs:
                turn(conv, "restart_sigkill")
        except Exception as e:
            section_failed(result["errors"], "long", system, s, e)
        finally:
            s.stop(signal.SIGTERM, "end")
    summary: dict = {}
    for system in plan.long_systems:
        for L in plan.long_contexts:
            row = {x["state"]: x for x in result["samples"] if x["system"] == system and x["context"] == L}
            if not row:
                continue
            cold, hot, kill = (row.get(k, {}).get("ttft_s") for k in ("cold", "hot", "restart_sigkill"))
            summary.setdefault(system, {})[str(L)] = {
                **{k: {f: v.get(f) for f in ("ttft_s", "prompt_tokens", "tier", "reused_tokens", "rss_before_mb",
                                             "rss_peak_mb")} for k, v in row.items()},
                "cold_over_hot": round(cold / hot, 2) if cold and hot else None,
                "kill_over_hot": round(kill / hot, 2) if kill and hot else None,
                "cold_over_kill": round(cold / kill, 2) if cold and kill else None,
                "prefill_rss_growth_mb": (round(row["cold"]["rss_peak_mb"] - row["cold"]["rss_before_mb"], 1)
                                          if "cold" in row else None),
            }
    result["summary"] = summary
    return result


def md_long(t: dict, plan: dict) -> list[str]:
    m = t.get("model", {})
    L = ["## Long contexts: 16k and 32k tokens", "",
         f"A smaller model here: llama-architecture `{m.get('size')}` ({m.get('layers')} layers, hidden "
         f"{m.get('hidden')}, {m.get('kv_heads')} KV heads, head_dim {m.get('head_dim')}, float32, random weights); "
         "the 103M bench model would need about an hour of cold prefill per 32k sample on this CPU. Per system one "
         f"conversation per context: a history of the nominal length plus a short user turn (cold), the next turn "
         "(hot), then SIGKILL, vllm-mlx's SIGTERM snapshot removed, page cache dropped, server started, one more "
         f"turn (KILL; no warm-up request). `max_tokens={plan['ttft_max_tokens']}`. RSS: the server's resident "
         "memory just before the turn and its peak during it (sampled every 50 ms): the cold row's growth is what "
         "the chunked prefill of that context costs in memory. Single samples.", "",
         "| system | context | prompt tok | cold s | hot s | after SIGKILL s (tier, reused) | cold/hot | KILL/hot | "
         "cold/KILL | RSS before cold MB | peak during cold prefill MB | growth MB |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for system, per in t.get("summary", {}).items():
        for c, row in per.items():
            cold, hot, kill = (row.get(k, {}) for k in ("cold", "hot", "restart_sigkill"))
            L.append(f"| {system} | {c} | {cold.get('prompt_tokens', '–')} | {cold.get('ttft_s', '–')} | "
                     f"{hot.get('ttft_s', '–')} | {kill.get('ttft_s', '–')} ({kill.get('tier', '–')}, "
                     f"{kill.get('reused_tokens', '–')}) | {row['cold_over_hot']} | {row['kill_over_hot']} | "
                     f"{row['cold_over_kill']} | {cold.get('rss_before_mb', '–')} | {cold.get('rss_peak_mb', '–')} | "
                     f"{row['prefill_rss_growth_mb']} |")
    return L + [""]


# ---------------------------------------------------------------------------------------------
# Section: two agents against one, and staggered arrivals


def section_concurrency(ctx: Ctx) -> dict:
    plan = ctx.plan
    result: dict = {"runs": [], "events": [], "errors": {}}
    roles = ("solo", "pair0", "pair1", "early", "late")
    for system in plan.conc_systems:
        say(f"concurrency: {system}")
        s = Session(system, make_server(system, ctx.model, ctx.work / f"conc-{system}", plan.ttft_cache_mb),
                    result["events"], "concurrency")
        convs = {(L, role): Conversation(f"conc-{L}-{role}", [dict(m) for m in
                                                             ctx.prompts.history(seed_of("conc", L, role), L)],
                                         seed_of("conc-u", L, role), plan.user_words)
                 for L in plan.conc_contexts for role in roles}

        def together(group: list[Conversation], delays: list[float]) -> list[dict]:
            clients = [_client(s) for _ in group]

            def one(i: int, msgs: list[dict]) -> dict:
                time.sleep(delays[i])
                r = send(s, msgs, group[i].agent, plan.conc_max_tokens, client=clients[i], classify_log=False)
                group[i].answer(FIXED_REPLY)
                return r

            return at_once(len(group), lambda i: group[i].ask(), one)[0]

        def run(L: int, state: str) -> None:
            for kind, group, delays in (("batch1", ["solo"], [0.0]), ("batch2", ["pair0", "pair1"], [0.0, 0.0]),
                                        ("staggered", ["early", "late"], [0.0, plan.conc_stagger_s])):
                res = together([convs[L, r] for r in group], delays)
                t0, t_end = min(r["t_send"] for r in res), max(r["t_last"] or r["t_end"] for r in res)
                toks = [r["completion_tokens"] or 0 for r in res]
                rec = {"system": system, "context": L, "state": state, "kind": kind,
                       "ttft_s": [r["ttft_s"] for r in res], "total_s": [r["total_s"] for r in res],
                       "completion_tokens": toks, "prompt_tokens": [r["prompt_tokens"] for r in res],
                       "cached_tokens": [r["usage_cached_tokens"] for r in res],
                       "wall_s": round(t_end - t0, 3), "system_tok_s": round(sum(toks) / (t_end - t0), 2),
                       "per_stream_tok_s": [_tok_s(r) for r in res]}
                result["runs"].append(rec)
                say(f"  {system} {L:>6} {state:<16} {kind:<9} ttft {rec['ttft_s']} wall {rec['wall_s']} s "
                    f"system {rec['system_tok_s']} tok/s cached {rec['cached_tokens']}")

        try:
            s.start("fresh")
            for L in plan.conc_contexts:
                run(L, "cold")
                run(L, "hot")
            _restart_killed(s, "concurrency")
            for L in plan.conc_contexts:
                run(L, "restart_sigkill")
        except Exception as e:
            section_failed(result["errors"], "concurrency", system, s, e)
        finally:
            s.stop(signal.SIGTERM, "end")
    result["summary"] = summarize_concurrency(result["runs"], plan.conc_stagger_s)
    return result


def summarize_concurrency(runs: list[dict], stagger_s: float) -> dict:
    """Per system, context and state: batch 2 against batch 1 (as the seeds' table), and staggered B's
    TTFT against the sequential estimate (B waits for A to end, then prefills alone, as batch 1)."""
    out: dict = {}
    for r1 in (r for r in runs if r["kind"] == "batch1"):
        key = (r1["system"], r1["context"], r1["state"])
        r2 = next((r for r in runs if (r["system"], r["context"], r["state"]) == key and r["kind"] == "batch2"), None)
        st = next((r for r in runs if (r["system"], r["context"], r["state"]) == key and r["kind"] == "staggered"), None)
        row: dict = {"batch1": {"ttft_s": r1["ttft_s"][0], "wall_s": r1["wall_s"], "system_tok_s": r1["system_tok_s"],
                                "per_stream_tok_s": r1["per_stream_tok_s"][0], "cached_tokens": r1["cached_tokens"][0]}}
        if r2:
            streams = [x for x in r2["per_stream_tok_s"] if x]
            row["batch2"] = {"ttft_s": round(median(r2["ttft_s"]), 4), "wall_s": r2["wall_s"], "system_tok_s": r2["system_tok_s"],
                             "per_stream_tok_s": round(statistics.mean(streams), 2) if streams else None,
                             "cached_tokens": r2["cached_tokens"]}
            row["system_tok_s_gain"] = round(r2["system_tok_s"] / r1["system_tok_s"], 2) if r1["system_tok_s"] else None
        if st:
            seq_b = max(0.0, r1["total_s"][0] - stagger_s) + r1["ttft_s"][0]
            row["staggered"] = {"a_ttft_s": st["ttft_s"][0], "b_ttft_s": st["ttft_s"][1],
                                "b_sequential_estimate_s": round(seq_b, 3),
                                "b_speedup": round(seq_b / st["ttft_s"][1], 2) if st["ttft_s"][1] else None,
                                "cached_tokens": st["cached_tokens"]}
        out.setdefault(r1["system"], {}).setdefault(str(r1["context"]), {})[r1["state"]] = row
    return out


def md_concurrency(c: dict, plan: dict) -> list[str]:
    L = ["## Two agents at once, and staggered arrivals", "",
         f"The ttft section's model. Per context, five agents with histories of that length: one alone (batch 1), two sent at "
         f"the same moment (batch 2), two staggered (B sent {plan['conc_stagger_s']} s after A). Each runs with cold "
         "caches (first turns), hot caches (their next turns) and after a SIGKILL restart (next turns again; "
         f"vllm-mlx's snapshot removed, page cache dropped, no warm-up request). `max_tokens={plan['conc_max_tokens']}`"
         ", assistant turns a fixed text (as in the batch section). System tok/s = all completion tokens / (first "
         "send to last token); per stream = (tokens - 1) / (its first to last token). Staggered, sequential = what B "
         "would wait without batching: A's batch-1 total time minus the stagger, plus B's own batch-1 TTFT. Single "
         "samples.", "",
         "| system | context | caches | batch 1 TTFT s | batch 2 TTFT s | batch 1 tok/s | batch 2 system tok/s | "
         "gain | batch 1 per-stream | batch 2 per-stream | staggered A TTFT s | staggered B TTFT s | B sequential s | "
         "B speed-up |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for system, per in c.get("summary", {}).items():
        for ctxlen, states in per.items():
            for state, row in states.items():
                b1, b2, st = row["batch1"], row.get("batch2", {}), row.get("staggered", {})
                L.append(f"| {system} | {ctxlen} | {state} | {b1['ttft_s']} | {b2.get('ttft_s', '–')} | "
                         f"{b1['system_tok_s']} | {b2.get('system_tok_s', '–')} | {row.get('system_tok_s_gain', '–')} | "
                         f"{b1['per_stream_tok_s']} | {b2.get('per_stream_tok_s', '–')} | {st.get('a_ttft_s', '–')} | "
                         f"{st.get('b_ttft_s', '–')} | {st.get('b_sequential_estimate_s', '–')} | "
                         f"{st.get('b_speedup', '–')} |")
    return L + [""]


# ---------------------------------------------------------------------------------------------
# Section: other agents' decoding while one agent's long first turn is prefilled and written


def _stream_times(client: Any, model: str, messages: list[dict], agent: str, max_tokens: int) -> dict:
    """One streamed turn; the arrival time of every content chunk (one token at --stream-interval 1)."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0.0,
                                            stream=True, extra_headers={"X-Agent-ID": agent})
    times = [time.perf_counter() for chunk in stream
             if chunk.choices and chunk.choices[0].delta is not None and chunk.choices[0].delta.content]
    return {"t_send": t0, "times": times, "t_end": time.perf_counter()}


def _gaps(turns: list[dict], lo: float, hi: float) -> list[float]:
    """Gaps between consecutive tokens of one request that end inside [lo, hi) (a new request's
    prefill is not a gap: it is counted as that request's TTFT)."""
    return [b - a for t in turns for a, b in zip(t["times"], t["times"][1:]) if lo <= b < hi]


def _gap_stats(gaps: list[float]) -> dict:
    if not gaps:
        return {"n": 0}
    gs = sorted(gaps)
    return {"n": len(gs), "median_ms": round(1000 * statistics.median(gs), 1),
            "p95_ms": round(1000 * gs[min(len(gs) - 1, int(0.95 * len(gs)))], 1), "max_ms": round(1000 * gs[-1], 1)}


def section_stall(ctx: Ctx) -> dict:
    plan = ctx.plan
    result: dict = {"systems": {}, "events": [], "errors": {}}
    long_history = ctx.prompts.history(seed_of("stall-long"), plan.stall_tokens)
    for system in plan.stall_systems:
        say(f"stall: {system}")
        s = Session(system, make_server(system, ctx.model, ctx.work / f"stall-{system}", plan.ttft_cache_mb),
                    result["events"], "stall")
        shorts = [Conversation(f"stall-short-{i}", [dict(m) for m in ctx.prompts.history(seed_of("stall", i),
                                                                                         plan.stall_history)],
                               seed_of("stall-u", i), plan.user_words) for i in range(plan.stall_agents)]
        turns: list[list[dict]] = [[] for _ in shorts]
        stop = threading.Event()
        errs: list[BaseException] = []

        def loop(i: int) -> None:
            client = _client(s)
            try:
                while not stop.is_set():
                    turns[i].append(_stream_times(client, s.server.model, shorts[i].ask(), shorts[i].agent,
                                                  plan.stall_max_tokens))
                    shorts[i].answer(FIXED_REPLY)
            except BaseException as e:  # noqa: BLE001 - surfaced below
                errs.append(e)

        try:
            s.start("fresh")
            for conv in shorts:  # warm every short agent's cache
                send(s, conv.ask(), conv.agent, 4, classify_log=False)
                conv.answer(FIXED_REPLY)
            threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(len(shorts))]
            [t.start() for t in threads]
            time.sleep(max(3.0, plan.stall_after_s))  # a baseline of steady decoding
            big = send(s, [dict(m) for m in long_history] + [{"role": "user", "content": "summarize"}],
                       "stall-long", 4, client=_client(s), classify_log=False)
            time.sleep(plan.stall_after_s)
            stop.set()
            [t.join(600) for t in threads]
            if errs:
                raise errs[0]
            all_turns = [t for ts in turns for t in ts]
            start = min(t["t_send"] for t in all_turns)
            last = big["t_last"] or big["t_end"]
            windows = {"before": (start, big["t_send"]), "prefill": (big["t_send"], big["t_first"] or big["t_end"]),
                       "write": (last, big["t_end"] + plan.stall_after_s)}
            result["systems"][system] = {
                "long": {k: big[k] for k in ("prompt_tokens", "ttft_s", "total_s")},
                "long_end_after_last_token_s": round(big["t_end"] - last, 3),
                "windows": {k: {**_gap_stats(_gaps(all_turns, lo, hi)), "seconds": round(hi - lo, 2)}
                            for k, (lo, hi) in windows.items()},
                "timeline": [{"agent": i, "t": [round(x - start, 4) for x in t["times"]]}
                             for i, ts in enumerate(turns) for t in ts],
                "long_marks": {"send": round(big["t_send"] - start, 3),
                               "first": round((big["t_first"] or big["t_end"]) - start, 3),
                               "end": round(big["t_end"] - start, 3)},
            }
            w = result["systems"][system]["windows"]
            say(f"  {system}: long turn {big['prompt_tokens']} tok, ttft {big['ttft_s']} s; gaps max ms before "
                f"{w['before'].get('max_ms')} prefill {w['prefill'].get('max_ms')} write {w['write'].get('max_ms')}")
        except Exception as e:
            stop.set()
            section_failed(result["errors"], "stall", system, s, e)
        finally:
            s.stop(signal.SIGTERM, "end")
    return result


def md_stall(st: dict, plan: dict) -> list[str]:
    L = ["## Other agents' tokens while one agent's long first turn is written", "",
         f"The ttft section's model. {plan['stall_agents']} agents with warm caches ({plan['stall_history']}-token histories) "
         f"decode in a loop (`max_tokens={plan['stall_max_tokens']}` per turn, next turn at once) while one new "
         f"agent sends a {plan['stall_tokens']}-token first turn (`max_tokens=4`). Gaps between consecutive tokens "
         "of the looping agents (within a request), in three windows: before the long turn arrives; during its "
         f"prefill (send to its first token); write: from its last token until {plan['stall_after_s']} s after its "
         "response ended (persist_q4 writes the new agent's blocks and holds the response until they are durable; "
         "vllm-mlx stores its prefix-cache entry). Single run.", "",
         "| system | long turn prompt tok | its TTFT s | response end after its last token s | gaps before: median / p95 / "
         "max ms | during prefill: median / p95 / max ms | write window: median / p95 / max ms |",
         "|---|---|---|---|---|---|---|"]
    for system, v in st.get("systems", {}).items():
        w = v["windows"]

        def cell(k: str) -> str:
            x = w.get(k, {})
            return f"{x.get('median_ms', '–')} / {x.get('p95_ms', '–')} / {x.get('max_ms', '–')} (n={x.get('n', 0)})"
        L.append(f"| {system} | {v['long']['prompt_tokens']} | {v['long']['ttft_s']} | "
                 f"{v['long_end_after_last_token_s']} | {cell('before')} | {cell('prefill')} | {cell('write')} |")
    return L + ["", "![Token timeline](stall.png)", ""]


def headline_workloads(results: dict) -> dict:
    h: dict = {}
    lg = results.get("long")
    if lg and lg.get("summary"):
        h["long"] = {s: {c: {k: row.get(k) for k in ("cold_over_hot", "kill_over_hot", "prefill_rss_growth_mb")}
                         for c, row in per.items()} for s, per in lg["summary"].items()}
    st = results.get("stall")
    if st and st.get("systems"):
        h["stall_max_gap_ms"] = {s: {k: w.get("max_ms") for k, w in v["windows"].items()}
                                 for s, v in st["systems"].items()}
    return h
