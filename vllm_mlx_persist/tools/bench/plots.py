"""PNG plots for `vllm-mlx-persist bench` (matplotlib, Agg backend: the `bench` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLORS = {"persist_q4": "tab:blue", "vllm_default": "tab:orange", "vllm_q4_ssd": "tab:green",
          "persist_q4_nofork": "tab:purple"}
EDIT_STYLE = {"amortize": ("tab:blue", "o"), "forget": ("tab:purple", "v"), "exact": ("tab:cyan", "s"),
              "vllm_default": ("tab:orange", "^"), "no_cache": ("black", "x")}
STATE_STYLE = {
    "cold": ("black", "-", "o", "cold"),
    "hot": ("tab:green", "-", "s", "hot (in memory)"),
    "restart_sigterm": ("tab:blue", "-", "^", "after restart (SIGTERM)"),
    "restart_sigkill": ("tab:red", "--", "v", "after restart (SIGKILL)"),
}
TIER_COLORS = {"memory": "tab:green", "disk": "tab:blue", "cold": "tab:red"}


MISSING = ('the bench plots need matplotlib, which is not installed: pip install "vllm-mlx-persist[bench]" '
           "(or pass --no-plots)")


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend. Nothing is installed at run time: without matplotlib,
    an ImportError names the extra that provides it."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(MISSING) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(res: dict, out: Path) -> list[str]:
    """Write every plot the results have data for; returns the file names."""
    plt = pyplot()
    secs = res["sections"]
    written = []
    for name, fn, file in (("ttft", plot_ttft, None), ("agents", plot_agents, None), ("batch", plot_batch, None),
                           ("reload", plot_reload, None), ("families", plot_families, None),
                           ("fanout", plot_fanout, None), ("stall", plot_stall, None),
                           ("capacity", plot_capacity, None), ("edits", plot_edits, None),
                           ("edits", plot_edits_agent, "edits_agent")):
        data = secs.get(name)
        if not data or ("summary" not in data and "systems" not in data):
            continue
        fig = fn(plt, data, res)
        if fig is None:
            continue
        path = out / f"{file or name}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(path.name)
    return written


def _title(res: dict) -> str:
    m = res["machine"]
    return f"{res['model']['size']} model (float32), {m['cpu']} x{m['cores']}, {'OpenBLAS' if 'OpenBLAS' in m['blas'] else 'BLAS: see bench.md'}"


def plot_ttft(plt: Any, t: dict, res: dict):
    systems = list(t["summary"])
    if not systems:
        return None
    fig, axes = plt.subplots(1, len(systems), figsize=(5.2 * len(systems), 4.6), sharey=True, squeeze=False)
    contexts = res["plan"]["contexts"]
    for ax, s in zip(axes[0], systems):
        for state, (color, ls, marker, label) in STATE_STYLE.items():
            xs, ys = [], []
            for c in contexts:
                v = t["summary"][s].get(str(c), {}).get(state)
                if v:
                    xs.append(c)
                    ys.append(v["median_s"])
            if not xs:
                continue
            ax.plot(xs, ys, ls=ls, marker=marker, color=color, label=label)
            pts = [(x["context"], x["ttft_s"]) for x in t["samples"] if x["system"] == s and x["state"] == state]
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=color, alpha=0.25, s=12)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(contexts)
        ax.set_xticklabels([f"{c // 1024}k" if c >= 1024 else str(c) for c in contexts])
        ax.set_title(s)
        ax.set_xlabel("tokens of history")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("time to first token (s, log)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"TTFT against context: medians (lines), samples (dots). {_title(res)}", fontsize=10)
    return fig


def plot_agents(plt: Any, a: dict, res: dict):
    systems = a.get("systems", {})
    if not systems:
        return None
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    n_agents = res["plan"]["agents"]
    for s, v in systems.items():
        turns = v["turns"]
        xs = list(range(1, len(turns) + 1))
        ax.plot(xs, [x["ttft_s"] for x in turns], color=COLORS.get(s), lw=1, label=s)
        for tier, c in TIER_COLORS.items():
            pts = [(i, x["ttft_s"]) for i, x in zip(xs, turns) if x["tier"] == tier]
            if pts:
                ax.scatter(*zip(*pts), color=c, s=22, zorder=3, edgecolor=COLORS.get(s), linewidth=1)
        series = v.get("rss_series") or []
        if series:
            ax2.plot([p[0] for p in series], [p[1] / 2**20 for p in series], color=COLORS.get(s),
                     label=f"{s} (peak {v['summary']['peak_rss_mb']:.0f} MB)")
    for r in range(1, res["plan"]["agent_rounds"]):
        ax.axvline(r * n_agents + 0.5, color="grey", lw=0.8, ls=":")
    for tier, c in TIER_COLORS.items():
        ax.scatter([], [], color=c, s=22, label=f"served {'from ' if tier != 'cold' else ''}{tier}")
    ax.set_yscale("log")
    ax.set_xlabel(f"turn ({n_agents} agents round-robin; dotted lines separate rounds)")
    ax.set_ylabel("time to first token (s, log)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"Per-turn TTFT, cache budget {res['plan']['agent_budget_mb']} MB")
    ax2.set_xlabel("seconds since the server finished starting")
    ax2.set_ylabel("server RSS (MB)")
    ax2.grid(True, alpha=0.3)
    ax2.legend(fontsize=8)
    ax2.set_title("Server memory (RSS, sampled every 0.1 s)")
    fig.suptitle(_title(res), fontsize=10)
    return fig


def plot_batch(plt: Any, b: dict, res: dict):
    systems = b.get("systems", {})
    if not systems:
        return None
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.3))
    for s, v in systems.items():
        levels = sorted(int(k) for k in v["summary"])
        if not levels:
            continue
        ax.plot(levels, [v["summary"][str(k)]["system_tok_s"] for k in levels], marker="o", color=COLORS.get(s), label=s)
        ax2.plot(levels, [v["summary"][str(k)]["per_agent_tok_s"] for k in levels], marker="o", color=COLORS.get(s),
                 label=s)
    for a, t in ((ax, "system tokens/s"), (ax2, "per-agent decode tokens/s")):
        a.set_xscale("log", base=2)
        a.set_xticks(res["plan"]["batch_levels"])
        a.set_xticklabels([str(x) for x in res["plan"]["batch_levels"]])
        a.set_xlabel("agents generating at once")
        a.set_ylabel(t)
        a.set_ylim(bottom=0)
        a.grid(True, alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(f"Batched decoding from warm caches ({res['plan']['batch_tokens']} tokens of history each). "
                 f"{_title(res)}", fontsize=10)
    return fig


def plot_reload(plt: Any, r: dict, res: dict):
    rows = r.get("summary")
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    mb = [x["file_mb"] for x in rows]
    ax.plot(mb, [x["reload_ms"] for x in rows], marker="o", color="tab:blue", label="reload from disk (page cache dropped)")
    ax.plot(mb, [x["store_read_ms"] for x in rows], marker="s", color="tab:purple", ls="--",
            label="read + verify only (no MLX)")
    ax.plot(mb, [x["reload_page_cache_ms"] for x in rows], marker="^", color="tab:green",
            label="reload, files in page cache")
    bw = r["bandwidth"]
    lo, hi = min(mb), max(mb)
    for key, ls, label in (("buffered_after_drop_mb_s", "-", "disk limit: size / sequential read"),
                           ("o_direct_mb_s", ":", "disk limit with O_DIRECT")):
        if bw.get(key):
            ax.plot([lo, hi], [lo / bw[key] * 1e3, hi / bw[key] * 1e3], color="black", ls=ls,
                    label=f"{label} ({bw[key]:.0f} MB/s)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("agent cache on disk (MB, 4-bit)")
    ax.set_ylabel("time (ms, log)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    toks = [x["tokens"] for x in rows]
    ax.set_title(f"Reload against the physical limit ({toks[0]}..{toks[-1]} tokens)", fontsize=10)
    return fig


def plot_families(plt: Any, f: dict, res: dict):
    summary = f.get("summary") or {}
    archs = [a for a in summary if summary[a]]
    if not archs:
        return None
    systems = list(dict.fromkeys(s for a in archs for s in summary[a]))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.6))
    width = 0.8 / len(systems)
    turn_style = (("2", 1.0, "turn 2"), ("3", 0.7, "turn 3"), ("4", 0.4, "after SIGKILL"))
    for j, s in enumerate(systems):
        for k, (turn, alpha, label) in enumerate(turn_style):
            xs = [i + (j - (len(systems) - 1) / 2) * width + (k - 1) * width / 3 for i in range(len(archs))]
            ys = [(summary[a].get(s, {}).get("turns", {}).get(turn) or {}).get("reuse_ratio") or 0 for a in archs]
            ax.bar(xs, ys, width / 3, color=COLORS.get(s), alpha=alpha, label=f"{s}, {label}")
            for x, y in zip(xs, ys):
                if not y:  # a bar of height 0 is invisible: say it
                    ax.text(x, 0.01, "0", ha="center", va="bottom", fontsize=7, color=COLORS.get(s))
        for k, (state, marker) in enumerate((("cold", "o"), ("hot", "s"), ("restart_sigkill", "v"))):
            xs = [i + (j - (len(systems) - 1) / 2) * width for i in range(len(archs))]
            ys = [summary[a].get(s, {}).get("ttft_s", {}).get(state) for a in archs]
            pts = [(x, y) for x, y in zip(xs, ys) if y]
            if pts:
                ax2.scatter(*zip(*pts), marker=marker, color=COLORS.get(s), s=40,
                            label=f"{s}, {STATE_STYLE[state][3]}")
    for a, ylabel in ((ax, "cached tokens / prompt tokens"), (ax2, "time to first token (s, log)")):
        a.set_xticks(range(len(archs)))
        a.set_xticklabels(archs, fontsize=8, rotation=15)
        a.set_ylabel(ylabel)
        a.grid(True, axis="y", alpha=0.3)
    ax.set_ylim(0, 1.05)
    ax.set_title("Reuse of the previous turns")
    ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    ax2.set_yscale("log")
    ax2.set_title("TTFT cold / hot / after SIGKILL restart")
    ax2.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    size = res["plan"].get("family_size")
    fig.suptitle(f"Model families, {size} random-weight float32 models, about {res['plan'].get('family_tokens')} "
                 f"tokens of history. {res['machine']['cpu']} x{res['machine']['cores']}", fontsize=10)
    return fig


def plot_fanout(plt: Any, f: dict, res: dict):
    systems = {s: v["levels"] for s, v in f.get("systems", {}).items() if v.get("levels")}
    if not systems:
        return None
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.3))
    for s, lv in systems.items():
        ns = sorted(int(k) for k in lv)
        ax.plot(ns, [lv[str(n)]["prefill_tokens"] for n in ns], marker="o", color=COLORS.get(s), label=s)
        ax2.plot(ns, [lv[str(n)]["all_first_s"] for n in ns], marker="o", color=COLORS.get(s), label=s)
    for a, t in ((ax, "tokens prefilled by the workers (sum)"), (ax2, "time to all first tokens (s)")):
        a.set_xticks(res["plan"]["fanout_levels"])
        a.set_xlabel("workers forked from the coordinator, sent at once")
        a.set_ylabel(t)
        a.set_ylim(bottom=0)
        a.grid(True, alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(f"Fan-out over a {res['plan']['fanout_tokens']}-token document. {_title(res)}", fontsize=10)
    return fig


def plot_stall(plt: Any, st: dict, res: dict):
    systems = list(st.get("systems", {}))
    if not systems:
        return None
    fig, axes = plt.subplots(len(systems), 1, figsize=(10, 2.6 * len(systems)), sharex=True, squeeze=False)
    for ax, system in zip(axes[:, 0], systems):
        v = st["systems"][system]
        for row in v["timeline"]:
            ax.plot(row["t"], [row["agent"]] * len(row["t"]), "|", markersize=6, color=f"C{row['agent']}")
        m = v["long_marks"]
        ax.axvspan(m["send"], m["first"], color="tab:orange", alpha=0.15, label="long turn: prefill")
        ax.axvline(m["end"], color="tab:red", linestyle="--", label="long turn: response end")
        ax.set_yticks(sorted({row["agent"] for row in v["timeline"]}))
        ax.set_ylabel("agent")
        ax.set_title(system)
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds (each tick: one token of a looping agent)")
    fig.suptitle("Other agents' tokens while one agent's long first turn is prefilled and written")
    return fig


def plot_capacity(plt: Any, cap: dict, res: dict):
    """Agents per budget against context, one panel per published shape: persist_q4, vllm-mlx's
    default cache and the bound (analytical), and persist_q4 after the grown agent's turns where it
    differs; persist_q4's measured / analytical ratio on the scaled-down model is in the title."""
    rows = cap.get("published") or []
    keys = list(dict.fromkeys(r["key"] for r in rows))
    if not keys:
        return None
    budget = str(res["plan"].get("capacity_budgets_gib", [16])[0])
    turns = res["plan"].get("capacity_turns")
    cols = 3
    fig, axes = plt.subplots((len(keys) + cols - 1) // cols, cols, figsize=(4.3 * cols, 3.6 * ((len(keys) + 2) // 3)),
                             squeeze=False)
    measured = cap.get("summary", {}).get("measured", {})
    for ax, key in zip(axes.flat, keys):
        rs = sorted((r for r in rows if r["key"] == key), key=lambda r: r["context"])
        xs = [r["context"] for r in rs]
        for name, color, ls, label in (("bound", "black", "--", "bound (4-bit, window only)"),
                                       ("persist_q4", COLORS["persist_q4"], "-", "persist_q4"),
                                       ("vllm_default", COLORS["vllm_default"], "-", "vllm-mlx default")):
            ax.plot(xs, [r["agents"][budget][name] for r in rs], ls=ls, marker="o", color=color, label=label)
        grown = [r["agents"][budget]["persist_q4_turns"] for r in rs]
        if grown != [r["agents"][budget]["persist_q4"] for r in rs]:
            ax.plot(xs, grown, ls=":", marker="v", color=COLORS["persist_q4"], label=f"persist_q4 after {turns} turns")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{x // 1024}k" for x in xs])
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        m = measured.get(rs[0]["family"]) if key == rs[0]["family"] else None
        note = ""
        if m:
            ratios = [v["over_bound"] for v in m.values() if v.get("over_bound")]
            note = (f"\nmeasured, float32 at 1/{res['plan'].get('capacity_scale')} scale: "
                    f"{min(ratios):.2f}-{max(ratios):.2f}x bound")
        ax.set_title(f"{rs[0]['model']} ({rs[0]['family']}){note}", fontsize=9)
        ax.set_xlabel("tokens per agent")
        ax.set_ylabel(f"agents in {budget} GiB")
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.suptitle(f"Agents per {budget} GiB of cache memory, published shapes (bfloat16), persist_q4 vs vllm-mlx's "
                 "default cache vs the bound", fontsize=10)
    fig.tight_layout()
    return fig


def plot_edits_agent(plt: Any, ed: dict, res: dict):
    """The agent trace (issue #32): per API, prompt tokens prefilled and TTFT per turn, per system."""
    agent = (ed.get("summary") or {}).get("agent") or {}
    if not agent:
        return None
    apis = list(agent)
    fig, axes = plt.subplots(len(apis), 2, figsize=(12, 3.8 * len(apis)), squeeze=False)
    labels = {"amortize": "persist_q4, X-KV-Edit: amortize", "exact": "persist_q4 exact",
              "vllm_default": "vllm-mlx default cache"}
    for row, api in zip(axes, apis):
        turns = sorted(agent[api], key=int)
        for s in ("amortize", "exact", "vllm_default"):
            pts = [(int(t), agent[api][t][s]) for t in turns if s in agent[api][t]]
            if not pts:
                continue
            color, marker = EDIT_STYLE[s]
            row[0].plot([t for t, _ in pts], [max(1, v["prefilled"] or 0) for _, v in pts], marker=marker,
                        color=color, label=labels[s])
            row[1].plot([t for t, _ in pts], [v["ttft_s"] for _, v in pts], marker=marker, color=color, label=labels[s])
        prompt = [agent[api][t][next(iter(agent[api][t]))]["prompt"] for t in turns]
        row[0].plot([int(t) for t in turns], prompt, ls=":", color="gray", label="prompt")
        for ax, what in ((row[0], "prompt tokens prefilled"), (row[1], "TTFT, s")):
            ax.set_yscale("log")
            ax.set_xticks([int(t) for t in turns])
            ax.set_xlabel("turn (from 3: outputs older than two turns cut to a head/tail stub)")
            ax.set_ylabel(what)
            ax.set_title(f"{api} client: {what} per turn", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    m = ed.get("model", {})
    fig.suptitle(f"Agent trace with tool calls, {m.get('size')} model ({m.get('layers')} layers, hidden "
                 f"{m.get('hidden')}, float32), {res['machine']['cpu']} x{res['machine']['cores']}", fontsize=10)
    fig.tight_layout()
    return fig


def plot_edits(plt: Any, ed: dict, res: dict):
    """Span directives: re-prefilled tokens against history (accounting), TTFT after an edit against
    history (real servers), and TTFT per turn of the truncation trace."""
    acc, sm = ed.get("accounting") or [], ed.get("summary") or {}
    if not (acc or sm.get("ttft") or sm.get("trace")):
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    systems = [s for s in EDIT_STYLE if s in ed.get("systems", {})]
    if acc:
        ax = axes[0]
        span = 256 if any(a["span"] == 256 for a in acc) else min(a["span"] for a in acc)
        for pos, ls in zip(sorted({a["position"] for a in acc})[:2], ("-", "--")):
            rs = sorted((a for a in acc if a["span"] == span and a["edits"] == 1 and a["position"] == pos),
                        key=lambda a: a["history"])
            for s in systems:
                if s == "forget":  # the same as exact
                    continue
                color, marker = EDIT_STYLE[s]
                ax.plot([a["history"] for a in rs], [max(1, a[s]) for a in rs], ls=ls, marker=marker, color=color,
                        label=f"{'exact / forget' if s == 'exact' else s}, edit at {round(pos * 100)}%")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("history tokens")
        ax.set_ylabel("prompt tokens re-prefilled")
        ax.set_title(f"Re-prefilled tokens per edit (planner; span {span}, one edit)", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    rows = list((sm.get("ttft") or {}).values())
    if rows:
        ax = axes[1]
        pos = min(r["point"]["position"] for r in rows)
        spans = [r["point"]["span"] for r in rows if r["point"]["position"] == pos and r["point"]["edits"] == 1]
        span = max(set(spans), key=spans.count)  # the span the histories x positions points share
        rs = sorted((r for r in rows if r["point"]["position"] == pos and r["point"]["edits"] == 1
                     and r["point"]["span"] == span), key=lambda r: r["point"]["history"])
        for s in systems:
            pts = [(r["point"]["history"], r["systems"][s]["ttft_s"]) for r in rs if s in r["systems"]]
            if pts:
                color, marker = EDIT_STYLE[s]
                ax.plot(*zip(*pts), marker=marker, color=color, label=s)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([r["point"]["history"] for r in rs])
        ax.set_xticklabels([f"{r['point']['history'] // 1024}k" if r["point"]["history"] >= 1024 else
                            str(r["point"]["history"]) for r in rs])
        ax.set_xlabel("history tokens")
        ax.set_ylabel("TTFT after the edit, s")
        ax.set_title(f"TTFT after an edit at {round(pos * 100)}% (span {span}), real servers", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    trace = sm.get("trace") or {}
    if trace:
        ax = axes[2]
        turns = sorted(trace, key=int)
        for s in systems:
            pts = [(int(t), trace[t][s]["ttft_s"]) for t in turns if s in trace[t]]
            if pts:
                color, marker = EDIT_STYLE[s]
                ax.plot(*zip(*pts), marker=marker, color=color, label=s)
        ax.set_yscale("log")
        ax.set_xlabel("turn (from turn 3: one more output stubbed + one appended)")
        ax.set_ylabel("TTFT, s")
        ax.set_title("Multi-turn trace, outputs older than two turns stubbed", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    m = ed.get("model", {})
    fig.suptitle(f"Span directives, {m.get('size')} model ({m.get('layers')} layers, hidden {m.get('hidden')}, "
                 f"float32), {res['machine']['cpu']} x{res['machine']['cores']}", fontsize=10)
    fig.tight_layout()
    return fig
