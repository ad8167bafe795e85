"""`vllm-mlx-persist bench --sections fanout`: a coordinator reads one document, then N workers fork
from it (metadata.fork_from) and ask their own questions at once: total prefill and time to all
first tokens, persist_q4 against vllm-mlx's default prefix cache."""

from __future__ import annotations

import random
import re
import signal

from .kit import Ctx, Prompts, Session, at_once, fmt, make_server, say, section_failed, seed_of, send


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
_PERSIST_TOKENS_RE = re.compile(
    r"\[persist_q4\] agent=(\S+) (?:HIT \w+(?: from parent \S+)? cached=(\d+) prompt=(\d+)|MISS prompt=(\d+))")


def worker_fetches(log: str, agents: list[str], persist: bool) -> list[tuple[int, int]]:
    """(prompt tokens, cached tokens) of each worker's lookup, from the server log its requests wrote.
    persist_q4 (`persist`): its own `[persist_q4] agent=` lines, by agent id (the seam logs no
    `[cache_fetch]` line for a backend); vllm-mlx's caches: one `[cache_fetch]` line per request.
    Raises RuntimeError unless there is one lookup per worker."""
    if persist:
        found = {m[1]: (int(m[3] or m[4]), int(m[2] or 0)) for m in _PERSIST_TOKENS_RE.finditer(log)}
        fetched = [found[a] for a in agents if a in found]
        what = "[persist_q4] agent="
    else:
        fetched = [(int(p), int(k or 0)) for p, k in _FETCH_TOKENS_RE.findall(log)]
        what = "[cache_fetch]"
    if len(fetched) != len(agents):
        raise RuntimeError(f"{len(fetched)} {what} lines for {len(agents)} workers")
    return fetched


def section_fanout(ctx: "Ctx") -> dict:
    """Per level N, on a fresh document: the coordinator reads it (one turn), then N workers, each with
    the coordinator's history plus a question of its own and `metadata.fork_from` = the coordinator,
    are sent at once. Prefill = prompt - cached tokens summed over the workers, from the server's
    lookup lines (worker_fetches; vllm-mlx's own prefix cache reports its hits there but 0 in `usage`);
    time to all first tokens = first send to the last worker's first streamed token."""
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
                workers = [f"fanout-{n}-w{i}" for i in range(n)]

                def question(i: int) -> dict:
                    rng = random.Random(seed_of("fanout-q", n, i))
                    return {"role": "user", "content": f"Worker {i}: " + Prompts.words(rng, plan.fanout_question_words)}

                def ask(i: int, q: dict) -> dict:
                    return send(s, history + [q], workers[i], plan.fanout_max_tokens, client=clients[i],
                                classify_log=False, metadata={"fork_from": coord} if fork else None)

                res, seg = at_once(n, question, ask, s.server.log_path)
                fetched = worker_fetches(seg, workers, server_kind == "persist_q4")
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


def md_fanout(f: dict, plan: dict) -> list[str]:
    L = ["## Fan-out: one document, N forked workers", "",
         f"Per level N, a fresh document of about {plan['fanout_tokens']} tokens: a coordinator agent reads it "
         f"(one turn, `max_tokens={plan['fanout_max_tokens']}`), then N workers are sent at once, each with the "
         f"coordinator's history (its message and reply) plus a question of its own ({plan['fanout_question_words']} "
         "words), under its own agent id, with `metadata.fork_from` naming the coordinator (vllm-mlx's default "
         "cache ignores it and shares whatever its prefix cache finds; persist_q4_nofork: persist_q4 without "
         "`fork_from`, so each worker is an isolated agent). Prefill = prompt - cached tokens, summed over the "
         "workers, from the servers' lookup log lines (persist_q4's `[persist_q4] agent=` lines, vllm-mlx's "
         "`[cache_fetch]` lines: vllm-mlx's own prefix cache reports its hits there but 0 in "
         "`usage.prompt_tokens_details`). All first = first send to the last worker's first streamed "
         "token. Ratios: vllm_default / persist_q4 and persist_q4_nofork / persist_q4.", "",
         "| workers | " + " | ".join(f"{s} prefill tok | {s} all first s | {s} cached per worker"
                                     for s in f["systems"]) + " | prefill x vllm | all first x vllm | "
         "prefill x nofork | all first x nofork |",
         "|---|" + "---|---|---|" * len(f["systems"]) + "---|---|---|---|"]
    for n in plan["fanout_levels"]:
        cells = []
        for v in f["systems"].values():
            x = v["levels"].get(str(n))
            cells += ([str(x["prefill_tokens"]), fmt(x["all_first_s"], 2),
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
