"""`vllm-mlx-persist bench --sections families`: per model family (sliding window, sinks, linear-attention
/ convolution hybrids, MLA), one conversation per system: reuse ratio (tokens the cache served / prompt
tokens) on turns 2-3 and after a SIGKILL restart, and TTFT cold / hot / after the restart."""

from __future__ import annotations

import shutil
import signal
import traceback

from .kit import (FAMILY_TURNS, Conversation, Ctx, Plan, Prompts, Session, _turn_record, cache_paths, drop_page_cache,
                  fmt, make_server, median, say, seed_of, send)


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


def md_families(fm: dict, plan: dict) -> list[str]:
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
                     f"{fmt(t.get('3', {}).get('reusable_ratio'), 2)} | {fmt(tt['cold'])} | {fmt(tt['hot'])} | "
                     f"{fmt(tt['restart_sigkill'])} | {r.get('cold/hot', '–')} | {r.get('cold/restart_sigkill', '–')} |")
    L += ["", "![Model families](families.png)", ""]
    return L
