"""`vllm-mlx-persist bench --sections fleet`: two persist_q4 servers sharing a real redis-server
(`remote_url`): TTFT of an agent's first turn on the second server against cold and against a
local-disk hit, and Redis bytes per token."""

from __future__ import annotations

import signal
import time
import traceback

from ..serving import RedisServer
from .kit import (Conversation, Ctx, Session, _turn_record, cache_paths, drop_page_cache, make_server, median, say,
                  seed_of, send)


def section_fleet(ctx: "Ctx") -> dict:
    """Each conversation: a history's first turn on server A (cold), its next turn on server B, which
    has never seen the agent (fleet: fetched from Redis); then B restarts with its page cache dropped
    and serves one more turn from its own disk (disk). Redis memory and traffic per token stored."""
    plan = ctx.plan
    result: dict = {"samples": [], "events": [], "errors": {}, "redis": {}}
    import redis

    # LRU over keys with a TTL, as docs/fleet.md asks of a fleet's Redis
    server = RedisServer(ctx.work / "fleet-redis", ("--maxmemory", "4gb", "--maxmemory-policy", "volatile-lru"))
    url, rc = server.url, redis.Redis(port=server.port, socket_timeout=10)
    sessions = {name: Session("persist_q4", make_server("persist_q4", ctx.model, ctx.work / f"fleet-{name}",
                                                        plan.ttft_cache_mb, {"remote_url": url}),
                              result["events"], f"fleet-{name}")
                for name in ("A", "B")}
    a, b = sessions["A"], sessions["B"]
    convs = [Conversation(f"fleet-{L}-{rep}", [dict(m) for m in ctx.prompts.history(seed_of("fleet", L, rep), L)],
                          seed_of("fleet-u", L, rep), plan.user_words, context=L, rep=rep)
             for L in plan.fleet_contexts for rep in range(plan.fleet_reps)]

    def turn(s: Session, conv: Conversation, state: str) -> dict:
        r = send(s, conv.ask(), conv.agent, plan.ttft_max_tokens)
        conv.answer(r["text"])
        rec = _turn_record(r, context=conv.meta["context"], rep=conv.meta["rep"], state=state, server=s.phase)
        result["samples"].append(rec)
        say(f"  fleet {conv.meta['context']:>6} rep {conv.meta['rep']} {state:<6} on {s.phase}: ttft "
            f"{r['ttft_s']:8.3f}s  prompt {r['prompt_tokens']}  cached {r['usage_cached_tokens']}")
        return rec

    def remote(s: Session) -> dict:
        return s.server.get_json("/v1/status")["cache"]["remote"]

    def published(s: Session, n: int) -> None:
        deadline = time.time() + 300
        while time.time() < deadline:
            r = remote(s)
            done = r["puts_published"] + r.get("puts_merged", 0) + r["puts_same"] + r["puts_kept_other"]
            if r["queue_depth"] == 0 and done >= n:
                return
            time.sleep(0.05)
        raise RuntimeError("uploads to Redis did not finish")

    try:
        mem0 = rc.info("memory")["used_memory"]
        a.start("fresh")
        b.start("fresh")
        for conv in convs:
            turn(a, conv, "cold")
        published(a, len(convs))
        up = remote(a)
        mem1 = rc.info("memory")["used_memory"]
        tokens = sum(x["prompt_tokens"] + (x["completion_tokens"] or 0) - 1 for x in result["samples"])
        result["redis"] = {"tokens_stored": tokens, "used_memory_bytes": mem1 - mem0, "bytes_up": up["bytes_up"],
                           "blocks_uploaded": up["blocks_uploaded"],
                           "used_memory_per_token": round((mem1 - mem0) / max(1, tokens), 1),
                           "bytes_up_per_token": round(up["bytes_up"] / max(1, tokens), 1)}
        for conv in convs:
            turn(b, conv, "fleet")
        down = remote(b)
        result["redis"].update(bytes_down=down["bytes_down"], blocks_fetched=down["blocks_fetched"],
                               fetch_round_trips=down.get("fetch_round_trips"),
                               agents_fetched=down["agents_fetched"], lookup_wait_s_max=down["lookup_wait_s_max"])
        b.stop(signal.SIGTERM, "restart")
        result["page_cache_drop"] = drop_page_cache(cache_paths(b.server.home))
        b.start("after SIGTERM")
        for conv in convs:
            turn(b, conv, "disk")
    except Exception as e:
        result["errors"]["fleet"] = f"{type(e).__name__}: {e}\n{b.server.log_tail(30)}"
        say(f"fleet FAILED: {e}")
        traceback.print_exc()
    finally:
        a.stop(signal.SIGTERM, "end")
        b.stop(signal.SIGTERM, "end")
        server.stop()
    summary: dict = {}
    for L in plan.fleet_contexts:
        row: dict = {}
        for state in ("cold", "fleet", "disk"):
            xs = [x for x in result["samples"] if x["context"] == L and x["state"] == state]
            if xs:
                row[state] = {"median_s": round(median([x["ttft_s"] for x in xs]), 4), "n": len(xs),
                              "prompt_tokens": median([x["prompt_tokens"] for x in xs]),
                              "cached_tokens": median([x["usage_cached_tokens"] or 0 for x in xs])}
        cold = row.get("cold", {}).get("median_s")
        row["ratios"] = {f"cold/{st}": round(cold / row[st]["median_s"], 2)
                         for st in ("fleet", "disk") if cold and st in row and row[st]["median_s"] > 0}
        summary[str(L)] = row
    result["summary"] = summary
    return result


def md_fleet(f: dict, plan: dict) -> list[str]:
    r = f.get("redis", {})
    L = ["## Fleet tier: an agent's first turn on a second server", "",
         "Two persist_q4 servers (own cache roots) share one local `redis-server` (`remote_url`, no persistence, "
         "`volatile-lru`). Cold: an agent's first turn, on server A. Fleet: its next turn (a short new user turn) on "
         "server B, which has never seen it: B reads the agent's manifest from Redis, fetches and verifies its blocks, "
         "saves them to its disk, then serves the turn from them. Disk: one more turn on B after B was restarted "
         "(SIGTERM) with its page cache dropped: a local-disk hit (B still reads the manifest from Redis first). "
         f"Conversations per context: {plan['fleet_reps']}; medians; cached = usage.prompt_tokens_details.cached_tokens.",
         "", "| context | cold s (prompt tok) | fleet s (cached tok) | disk s (cached tok) | cold/fleet | cold/disk |",
         "|---|---|---|---|---|---|"]
    for c, row in f.get("summary", {}).items():
        def cell(st: str, key: str) -> str:
            v = row.get(st)
            return f"{v['median_s']:.3f} ({v[key]:.0f})" if v else "–"
        L.append(f"| {c} | {cell('cold', 'prompt_tokens')} | {cell('fleet', 'cached_tokens')} | "
                 f"{cell('disk', 'cached_tokens')} | {row['ratios'].get('cold/fleet', '–')} | "
                 f"{row['ratios'].get('cold/disk', '–')} |")
    if r:
        L += ["", f"Redis: {r.get('tokens_stored')} tokens stored by A's first turns took "
              f"{r.get('used_memory_per_token')} bytes of Redis `used_memory` per token "
              f"({r.get('bytes_up_per_token')} bytes uploaded per token, {r.get('blocks_uploaded')} blocks); B "
              f"downloaded {r.get('bytes_down')} bytes in {r.get('blocks_fetched')} blocks "
              f"({r.get('fetch_round_trips')} pipelined round trips) for "
              f"{r.get('agents_fetched')} agents; longest wait of a lookup for Redis "
              f"{r.get('lookup_wait_s_max')} s."]
    return L + [""]
