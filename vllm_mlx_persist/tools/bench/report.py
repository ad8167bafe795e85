"""`vllm-mlx-persist bench`'s report: the headline numbers, bench.md (each section's table from its
own module) with the speed goals of issue #11, and the summary printed at the end."""

from __future__ import annotations

from typing import Optional

from .agents import md_agents
from .batch import md_batch
from .capacity import headline_capacity, md_capacity
from .edits import headline_edits
from .edits_report import md_edits
from .families import md_families
from .fanout import md_fanout
from .fleet import md_fleet
from .kit import LABELS, fmt
from .reload import md_reload
from .ttft import md_ttft
from .workloads import headline_workloads, md_concurrency, md_long, md_stall


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
    L += md_goals(res["sections"])
    L += ["Systems (every server: `vllm-mlx serve MODEL --continuous-batching --stream-interval 1 --timeout 7200`, "
          "own HOME in a temp dir):", ""]
    for s, flags in res["systems"].items():
        L.append(f"- **{s}**: {LABELS[s]}: `{flags}`")
    L.append("")
    if "ttft" in res["sections"]:
        L += md_ttft(res["sections"]["ttft"], plan)
    if "agents" in res["sections"]:
        L += md_agents(res["sections"]["agents"], plan)
    if "batch" in res["sections"]:
        L += md_batch(res["sections"]["batch"], plan)
    if "reload" in res["sections"]:
        L += md_reload(res["sections"]["reload"], plan)
    if "families" in res["sections"]:
        L += md_families(res["sections"]["families"], plan)
    if "fanout" in res["sections"]:
        L += md_fanout(res["sections"]["fanout"], plan)
    if "fleet" in res["sections"]:
        L += md_fleet(res["sections"]["fleet"], plan)
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


def md_goals(sections: dict) -> list[str]:
    rows = goal_ratios(sections)
    if not rows:
        return []
    L = ["## Speed goals (issue #11), from the sections below", "",
         "| goal | where | measured | target | met |", "|---|---|---|---|---|"]
    for what, where, x in rows:
        target, op = next((t, o) for g, t, o in GOALS if g == what)
        met = "–" if x is None else ("yes" if (x <= target if op == "<=" else x >= target) else "no")
        L.append(f"| {what} | {where} | {fmt(x, 2)} | {op} {target} | {met} |")
    return L + [""]


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
                reuse = " / ".join(fmt(v[k], 2) for k in ("reuse_turn2", "reuse_turn3", "reuse_restart"))
                print(f"  {a:<13} {s:<13} reuse {reuse}  ttft {fmt(v['cold'])} / {fmt(v['hot'])} / "
                      f"{fmt(v['restart_sigkill'])}")
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
