"""Smoke test of `vllm-mlx-persist bench --quick`: real servers, tiny models, structure only (no timings).

Every server section runs in one `bench --quick` invocation (a module fixture: one process, one
scratch directory, so each model is built once), and each test below reads its own section of it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_mlx_persist.tools.bench.fanout import worker_fetches
from vllm_mlx_persist.tools.bench.kit import FAMILY_TURNS, STATES, classify

QUICK_SECTIONS = ("ttft", "reload", "families", "fanout", "long", "concurrency", "stall", "capacity", "edits")


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[dict, Path, str]:
    """(bench.json, the results directory, stdout) of one quick run of every server section."""
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "results"
    # Smaller than `bench --quick` where the assertions below do not need more: two TTFT contexts, two
    # reload sizes, the edits' TTFT points at one history and no agent trace (which nothing here checks;
    # `./dev bench` runs it). Capacity keeps quick's 4096 tokens: at 2048 the grown deepseek agent's
    # last block is too large a share to hold within 1.1x of the analytical bytes. key_format q4: what
    # `auto` chose on every one of these models (tests/test_e2e_server.py says why it is pinned), so
    # the ten fresh cache roots skip their calibration. The micro model (tests/test_scenario.py says why)
    # everywhere: each section's checks are about the cache (reuse, tiers, bytes against the formulas
    # on the model's own shape), not the model's size.
    cmd = [sys.executable, "-m", "vllm_mlx_persist.cli", "bench", "--quick", "--sections", ",".join(QUICK_SECTIONS),
           "--systems", "persist_q4,vllm_default", "--families", "gemma3_text", "--long-contexts", "1024",
           "--contexts", "128,256", "--reload-sizes", "256,1024", "--edit-histories", "512",
           "--edit-sweep-history", "512", "--edit-grid-histories", "1024", "--edit-parts", "accounting,ttft,trace",
           "--persist-options", json.dumps({"key_format": "q4"}), "--model-size", "micro", "--long-size", "micro",
           "--edit-size", "micro", "--family-size", "micro", "--capacity-size", "micro",
           "--out", str(out), "--work", str(tmp / "work")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads((out / "bench.json").read_text()), out, p.stdout


def test_quick_bench_writes_results(quick):
    res, out, stdout = quick
    assert "vllm-mlx-persist bench --quick" in stdout and "Reproduce" in stdout
    assert {"command", "machine", "plan", "systems", "sections", "headline", "duration_s"} <= set(res)
    assert {"cpu", "cores", "ram_gib", "os", "python", "mlx", "blas"} <= set(res["machine"])
    assert set(res["sections"]) == set(QUICK_SECTIONS)

    ttft = res["sections"]["ttft"]
    assert ttft["errors"] == {}
    for system in ("persist_q4", "vllm_default"):
        for context in res["plan"]["contexts"]:
            row = ttft["summary"][system][str(context)]
            assert set(STATES) <= set(row), row
            assert row["cold"]["n"] >= 1 and row["cold"]["median_s"] > 0
            assert {"cold/hot", "cold/restart_sigterm", "cold/restart_sigkill"} <= set(row["ratios"])
    # persist_q4 serves the returning turns from its cache: memory when hot, disk after a restart
    tiers = {(x["state"], x["tier"]) for x in ttft["samples"] if x["system"] == "persist_q4"}
    assert {("cold", "cold"), ("hot", "memory"), ("restart_sigterm", "disk"), ("restart_sigkill", "disk")} <= tiers
    assert ttft["page_cache_drops"] and all(d["files"] > 0 for d in ttft["page_cache_drops"]
                                            if d["system"] == "persist_q4")

    rel = res["sections"]["reload"]
    assert rel["bandwidth"]["buffered_after_drop_mb_s"] > 0
    assert [r["tokens"] for r in rel["summary"]] == res["plan"]["reload_sizes"]
    assert all(r["reload_ms"] > 0 and r["file_mb"] > 0 for r in rel["summary"])
    assert "ttft_ratios" in res["headline"] and "reload" in res["headline"]

    md = (out / "bench.md").read_text()
    assert "Time to first token" in md and "Reload against the physical limit" in md and res["command"] in md


def test_classify_reads_both_servers_log_lines():
    persist = ("INFO:vllm_mlx_persist:[persist_q4] agent=a HIT disk cached=1225 prompt=1269\n"
               "INFO:vllm_mlx.scheduler:[cache_fetch] request=f08e5bf0-1e4 HOT prompt_tokens=1269 cached=1225\n")
    assert classify(persist, "a") == ("disk", 1225)
    assert classify("[persist_q4] agent=a MISS prompt=13\n", "a") == ("cold", 0)
    fork = "[persist_q4] agent=w1 HIT hot from parent coord cached=4096 prompt=4120\n"
    assert classify(fork, "w1") == ("memory", 4096)  # a fork's first turn, served from its parent's blocks
    hit = "[cache_fetch] request=708bf183-9ca HIT prompt_tokens=192 cached=153 remaining=39 time=0.000s\n"
    assert classify(hit, "x") == ("memory", 153)
    assert classify("[cache_fetch] request=1 MISS prompt_tokens=36 time=0.000s entries=0\n", "x") == ("cold", 0)
    ssd = "[ssd_promote] request=abc prefix promote: 900/1000 tokens from SSD in 0.1s\n"
    assert classify(hit.replace("HIT", "MISS") + ssd, "x") == ("disk", 900)


def test_worker_fetches_reads_each_servers_lookup_lines():
    """persist_q4's lookups by worker agent id (the seam logs no `[cache_fetch]` line for a backend,
    and the coordinator's own line is not a worker's); vllm-mlx's one `[cache_fetch]` line per request."""
    persist = ("INFO:vllm_mlx_persist:[persist_q4] agent=coord MISS prompt=509\n"
               "INFO:vllm_mlx_persist:[persist_q4] agent=w1 MISS prompt=580\n"
               "INFO:vllm_mlx_persist:[persist_q4] agent=w0 HIT hot from parent coord cached=517 prompt=576 in 0.6 ms\n")
    assert worker_fetches(persist, ["w0", "w1"], persist=True) == [(576, 517), (580, 0)]
    with pytest.raises(RuntimeError, match="1 .persist_q4. agent= lines for 2 workers"):
        worker_fetches(persist, ["w0", "w2"], persist=True)
    vllm = ("[cache_fetch] request=708bf183-9ca HIT prompt_tokens=578 cached=513 remaining=65 time=0.000s\n"
            "[cache_fetch] request=1 MISS prompt_tokens=36 time=0.000s entries=0\n")
    assert worker_fetches(vllm, ["w0", "w1"], persist=False) == [(578, 513), (36, 0)]
    with pytest.raises(RuntimeError, match="0 .cache_fetch. lines for 1 workers"):
        worker_fetches(persist, ["w0"], persist=False)


def test_quick_fanout_section(quick):
    """Forked workers on a real persist_q4 server: each worker's first turn reuses the coordinator's
    document (at least half its tokens) from its parent's blocks, and every level has one lookup per
    worker in both systems."""
    res, out, _ = quick
    f = res["sections"]["fanout"]
    assert f["errors"] == {}
    for system in ("persist_q4", "vllm_default"):
        levels = f["systems"][system]["levels"]
        assert [int(n) for n in levels] == res["plan"]["fanout_levels"]
        for n, x in levels.items():
            assert len(x["cached_tokens"]) == int(n) and x["prefill_tokens"] > 0
    for x in f["systems"]["persist_q4"]["levels"].values():
        assert all(k >= x["coordinator"]["prompt_tokens"] // 2 for k in x["cached_tokens"]), x
    assert "## Fan-out" in (out / "bench.md").read_text()


def test_families_table_from_samples():
    from vllm_mlx_persist.tools.bench.families import md_families, summarize_families
    from vllm_mlx_persist.tools.bench.kit import QUICK
    from vllm_mlx_persist.tools.bench.report import headline

    plan = dataclasses.replace(QUICK, family_archs=["gemma3_text"])
    samples = []
    for system, reused in (("persist_q4", [0, 280, 334, 389]), ("vllm_default", [0, 0, 0, 0])):
        for (state, turn), prompt, n, ttft in zip(FAMILY_TURNS, [280, 334, 389, 446], reused, [2.0, 0.5, 0.4, 1.0]):
            samples.append({"arch": "gemma3_text", "system": system, "state": state, "turn": turn, "ttft_s": ttft,
                            "tier": "cold" if not n else "memory", "prompt_tokens": prompt, "reused_tokens": n,
                            "completion_tokens": 4})
    summary = summarize_families(samples, plan)
    p = summary["gemma3_text"]["persist_q4"]
    assert p["turns"]["2"]["reuse_ratio"] == round(280 / 334, 3) and p["turns"]["4"]["reuse_ratio"] == round(389 / 446, 3)
    assert p["turns"]["3"]["reusable_ratio"] == round(338 / 389, 3) and p["turns"]["1"]["reusable_ratio"] == 0.0
    assert p["ttft_s"] == {"cold": 2.0, "hot": 0.45, "restart_sigkill": 1.0}
    assert p["ratios"] == {"cold/hot": 4.44, "cold/restart_sigkill": 2.0}
    assert summary["gemma3_text"]["vllm_default"]["turns"]["3"]["reuse_ratio"] == 0.0
    h = headline({"families": {"summary": summary}})["families"]["gemma3_text"]
    assert h["vllm_default"]["reuse_turn2"] == 0.0 and h["persist_q4"]["reuse_restart"] == round(389 / 446, 3)
    md = "\n".join(md_families({"summary": summary, "models": {}}, dataclasses.asdict(plan)))
    assert "| gemma3_text | persist_q4 | 84% (280/334) | 86% (334/389) | 87% (389/446) | 0.87 |" in md
    assert "| gemma3_text | vllm_default | 0% (0/334) | 0% (0/389) | 0% (0/446) |" in md


def test_quick_families_section_on_gemma3(quick):
    """The families section on one real family (sliding window): persist_q4 serves turns 2-3 from
    memory and the turn after a SIGKILL from disk, each reusing the whole previous prompt."""
    res, out, _ = quick
    assert res["sections"]["families"]["errors"] == {}
    s = res["sections"]["families"]["summary"]["gemma3_text"]
    assert set(s) == {"persist_q4", "vllm_default"}
    turns = s["persist_q4"]["turns"]
    assert [turns[t]["tier"] for t in "1234"] == ["cold", "memory", "memory", "disk"]
    for t in "234":  # at least the whole previous prompt (its reply too, where it re-tokenizes the same)
        assert turns[str(int(t) - 1)]["prompt_tokens"] <= turns[t]["reused_tokens"] < turns[t]["prompt_tokens"], turns
    assert all(v["ttft_s"][st] > 0 for v in s.values() for st in ("cold", "hot", "restart_sigkill"))
    assert "## Model families" in (out / "bench.md").read_text()


def test_quick_workload_sections(quick):
    """The seeds' workloads (long contexts, batch 2 vs 1 and staggered arrivals, other agents' tokens
    while a long first turn is written) run on real servers and report what they measured."""
    res, out, _ = quick
    secs = res["sections"]
    assert all(secs[s]["errors"] == {} for s in ("long", "concurrency", "stall"))

    long_ = secs["long"]["summary"]
    # after a SIGKILL restart persist_q4 reuses the history from disk; vllm-mlx's memory cache is gone
    assert long_["persist_q4"]["1024"]["restart_sigkill"]["tier"] == "disk"
    assert long_["persist_q4"]["1024"]["restart_sigkill"]["reused_tokens"] >= 1024
    assert long_["vllm_default"]["1024"]["restart_sigkill"]["tier"] == "cold"
    assert long_["persist_q4"]["1024"]["cold"]["rss_peak_mb"] >= long_["persist_q4"]["1024"]["cold"]["rss_before_mb"]

    conc = secs["concurrency"]["summary"]
    for system in ("persist_q4", "vllm_default"):
        for state in ("cold", "hot", "restart_sigkill"):
            row = conc[system]["256"][state]
            assert {"batch1", "batch2", "staggered"} <= set(row), row
            assert row["batch2"]["system_tok_s"] > 0 and row["staggered"]["b_ttft_s"] > 0
    # returning agents after the restart: every persist_q4 request reports cached tokens, vllm-mlx none
    kill = [r for r in secs["concurrency"]["runs"] if r["state"] == "restart_sigkill"]
    assert all(c and c > 0 for r in kill if r["system"] == "persist_q4" for c in r["cached_tokens"])
    assert all(not c for r in kill if r["system"] == "vllm_default" for c in r["cached_tokens"])

    for system, v in secs["stall"]["systems"].items():
        assert v["long"]["prompt_tokens"] >= 1024
        assert v["windows"]["before"]["n"] > 0 and v["windows"]["write"]["n"] > 0, (system, v["windows"])
    md = (out / "bench.md").read_text()
    assert "Long contexts" in md and "staggered" in md and "long first turn is written" in md
    assert (out / "stall.png").exists()


def test_goal_ratios_read_each_section():
    from vllm_mlx_persist.tools.bench.report import GOALS, goal_ratios, md_goals

    sections = {
        "ttft": {"summary": {"persist_q4": {"4096": {"hot": {"median_s": 1.0}, "restart_sigkill": {"median_s": 1.1},
                                                     "ratios": {}}},
                             "vllm_default": {"4096": {"hot": {"median_s": 0.8}, "ratios": {}}}}},
        "long": {"summary": {"persist_q4": {"16384": {"kill_over_hot": 1.5}}}},
        "reload": {"summary": [{"tokens": 1024, "reload_over_limit": 9.0}, {"tokens": 4096, "reload_over_limit": 1.2}]},
        "batch": {"systems": {"persist_q4": {"summary": {"1": {"system_tok_s": 5.0}, "4": {"system_tok_s": 19.0}}},
                              "vllm_default": {"summary": {"1": {"system_tok_s": 9.0}, "4": {"system_tok_s": 20.0}}}}},
    }
    got = {(GOALS.index(next(x for x in GOALS if x[0] == g)), where): x for g, where, x in goal_ratios(sections)}
    assert got == {(0, "4096 tokens"): 1.1, (1, "16384 tokens"): 1.5, (2, "4096 tokens"): 1.2, (3, "4 agents"): 0.95,
                   (4, "4096 tokens"): 1.25}
    md = "\n".join(md_goals(sections))
    # met: restart at 4k (1.1 <= 1.2), reload (1.2 <= 1.3), batch (0.95 >= 0.95); not: long restart, hot turn
    assert md.count("| yes |") == 3 and md.count("| no |") == 2


def test_capacity_formulas_on_published_shapes():
    """The analytical half of the capacity section: layer patterns read from the published configs,
    and per-agent bytes (design.md's Gemma-3-12B figures at 32k: persist_q4 ~0.72 GB, vllm-mlx ~2.4 GB)."""
    from vllm_mlx_persist.tools.bench.capacity import (PUBLISHED, agent_bytes, published_rows, shape_from_config,
                                                       window_tokens)

    gemma = shape_from_config(PUBLISHED["gemma3_text"]["config"])
    assert [(g.count, g.window) for g in gemma.layers] == [(40, 1024), (8, None)]
    assert [(g.count, g.kind) for g in shape_from_config(PUBLISHED["qwen3_next"]["config"]).layers] == \
        [(36, "state"), (12, "kv")]
    assert sum(g.count for g in shape_from_config(PUBLISHED["gpt_oss"]["config"]).layers if g.window) == 12
    assert round(agent_bytes(gemma, 32768, "persist_q4", rule="worst")["total"] / 1e9, 2) == 0.72  # window + a block
    assert round(agent_bytes(gemma, 32768, "persist_q4")["total"] / 1e9, 3) == 0.698  # 32k: the window's 4 blocks
    assert round(agent_bytes(gemma, 32768, "vllm_default")["total"] / 1e9, 1) == 2.5
    # 4-bit with bf16 scales and biases: 0.5625 bytes per element; vllm-mlx keeps 2
    llama = shape_from_config(PUBLISHED["llama"]["config"])
    assert agent_bytes(llama, 4096, "persist_q4")["total"] == 32 * 4096 * 2 * 8 * 128 * 0.5625
    assert agent_bytes(llama, 4096, "persist_q4")["total"] == agent_bytes(llama, 4096, "bound")["total"]
    # the sliding layers' blocks: from the one holding n - w; at worst the window + a block - 1
    assert window_tokens(4096, 1024, 256) == 1024 and window_tokens(4100, 1024, 256) == 1028
    assert window_tokens(4096, 1024, 256, "worst") == 1279 and window_tokens(4100, 1024, 256, "window") == 1024
    assert window_tokens(100, 1024, 256, "worst") == 100
    # recurrent hybrids: one state per branch, as the bound counts them (issue #33 item 3)
    qwen = shape_from_config(PUBLISHED["qwen3_next"]["config"])
    one, two = (agent_bytes(qwen, 4096, "persist_q4", branches=b)["state"] for b in (1, 2))
    assert two == 2 * one and agent_bytes(qwen, 4096, "bound", branches=2)["state"] == 2 * (one - 4)
    rows = published_rows([4096, 32768], [16], turns=8)
    assert {r["key"] for r in rows} == set(PUBLISHED)
    for r in rows:
        a = r["agents"]["16"]
        assert a["bound"] >= a["persist_q4"] >= a["persist_q4_turns"], r
    # sliding-window families against the bound, by hand: equal bytes per token and layer, so
    # (global x n + sliding x (window + 255)) / (global x n + sliding x window) at their worst
    # (Gemma-3-12B: 8 global, 40 sliding of 1024; gpt-oss-20b: 12 and 12 of 128), within 1.15x
    by_hand = {("gemma3_text", 4096): (8 * 4096 + 40 * 1279) / (8 * 4096 + 40 * 1024),
               ("gemma3_text", 32768): (8 * 32768 + 40 * 1279) / (8 * 32768 + 40 * 1024),
               ("gpt_oss", 4096): (4096 + 383) / (4096 + 128), ("gpt_oss", 32768): (32768 + 383) / (32768 + 128),
               ("qwen3_next", 4096): 1.0, ("qwen3_next", 32768): 1.0}  # one state, and its 4-byte position
    got = {(r["key"], r["context"]): r["persist_over_bound"] for r in rows if r["target"]}
    assert got.keys() == by_hand.keys()
    for k, want in by_hand.items():
        assert abs(got[k] - want) < 1e-3 and want <= 1.15, (k, got[k], want)


def test_quick_capacity_section(quick):
    """The capacity section in quick mode: per family real persist_q4 and vllm-mlx servers on a
    scaled-down model report per-agent bytes that agree with the formulas on the small shape."""
    res, out, _ = quick
    cap = res["sections"]["capacity"]
    assert cap["errors"] == {}
    assert set(cap["measured"]) == {"llama", "gemma3_text", "gpt_oss", "qwen3_next", "deepseek_v3"}
    for arch, m in cap["measured"].items():
        rows = m["compare"]["rows"]
        assert [r["context"] for r in rows] == res["plan"]["capacity_contexts"]
        for r in rows:
            for system in ("persist_q4", "vllm_default"):
                assert r[system]["bytes"] > 0 and r[system]["agrees"], (arch, system, r)
            assert r["persist_q4"]["bytes"] >= r["persist_q4"]["bound"] * 0.99, (arch, r)
            if arch in ("gemma3_text", "gpt_oss"):
                assert r["target_met"], r
        g = m["compare"]["grown"]["persist_q4"]
        assert g["turns"] == res["plan"]["capacity_turns"]
        # one recurrent state per branch, plus older branches' tail blocks
        assert g["bytes"] <= g["branches_analytical"] * 1.1, (arch, g)
    assert (out / "capacity.png").exists()
    md = (out / "bench.md").read_text()
    assert "## Capacity: agents per memory budget" in md and "Gemma-3-12B" in md and "target 1.15x" in md


def test_edit_accounting_follows_the_servers_cut():
    """The edits section's re-prefill accounting on hand-made token lists (anchor 7 starts every
    message): exact and forget re-prefill after the common prefix, vllm-mlx reuses nothing under 128
    tokens, and amortize prefills the stub and what the run leaves (the server always keeps the last
    prompt token to prefill, so a run reaching the end is cut by one)."""
    from vllm_mlx_persist.tools.bench.edits_accounting import VLLM_MIN_PREFIX, reprefill

    def msg(start: int, n: int) -> list[int]:
        return [7, *range(start, start + n - 1)]

    first, old, third = msg(100, 41), msg(200, 41), msg(300, 41)
    stub = [7, 900, 901]
    got = reprefill(first + old + third, first + stub + third, anchor=7)
    n = 41 + 3 + 41
    assert got["prompt"] == n and got["exact_prefix"] == 42  # the stub's anchor matches the old message's
    assert got["exact"] == got["forget"] == n - 42
    assert got["vllm_default"] == got["no_cache"] == n  # 42 < 128: a miss
    assert got["plan"] == [{"stub_tokens": 2, "run_tokens": 40, "delta": 44 - 82}] and got["fallback"] is None
    assert got["amortize"] == 2 + 1  # the stub after its anchor, and the prompt's last token

    long_first = msg(1000, VLLM_MIN_PREFIX + 10)
    got = reprefill(long_first + old + third, long_first + stub + third, anchor=7)
    assert got["vllm_default"] == got["exact"] == got["prompt"] - (VLLM_MIN_PREFIX + 11)
    # no message boundary reappears after the edit: amortize is exact
    got = reprefill(first + old + third, first + stub + msg(500, 41), anchor=7)
    assert got["fallback"] == "no_realignment" and got["amortize"] == got["exact"]
    # without a chat template's message-start token nothing is spliced
    assert reprefill(first + old + third, first + stub + third, anchor=None)["fallback"] == "unaligned"


def test_edit_conversations_and_truncation_policy(tiny_llama_dir):
    """The section's conversations, rendered with the tiny model's chat template: a grid point stubs
    whole tool outputs where it says, each edit is one splice moved by the tokens removed so far, and
    the truncation trace stubs exactly the outputs older than two turns, one more per turn."""
    from vllm_mlx_persist.tools.bench.edits_accounting import reprefill
    from vllm_mlx_persist.tools.bench.edits_chats import (Chat, EditPoint, edit_history, edit_position, edited_turn,
                                                          stub_msg, trace_requests)
    from vllm_mlx_persist.tools.bench.kit import Prompts

    chat = Chat(Prompts(tiny_llama_dir))
    assert chat.anchor is not None
    point = EditPoint(1024, 0.5, 64, 2)
    history, targets = edit_history(chat, 1, point)
    assert len(targets) == 2 and all(history[k]["content"].startswith("[tool output") for k in targets)
    assert all(history[k - 1]["role"] == "assistant" for k in targets) and history[-1]["role"] == "user"
    assert abs(len(chat.ids(history)) - point.history) < 64
    assert abs(edit_position(chat, history, targets) - point.history * point.position) < 64
    for k in targets:
        assert abs(chat.size(history[k]) - point.span) <= 4
    edited = edited_turn(history, targets, 2)
    assert [m for k, m in enumerate(history) if k not in targets] == [m for k, m in enumerate(edited[:-2])
                                                                      if k not in targets]
    got = reprefill(chat.ids(history), chat.ids(edited), chat.anchor)
    removed = [chat.size(history[k]) - chat.size(stub_msg(history[k])) for k in targets]
    assert [p["delta"] for p in got["plan"]] == [-removed[0], -removed[0] - removed[1]]
    assert got["amortize"] < got["exact"] and got["exact"] == got["prompt"] - got["exact_prefix"]

    reqs = trace_requests(chat, 3, 5, 48)
    for t, msgs in enumerate(reqs, start=1):
        tools = [m for m in msgs if m["content"].startswith("[tool output")]
        assert len(tools) == t
        assert [m["content"].endswith("truncated]") for m in tools] == [i <= t - 2 for i in range(1, t + 1)]
    for t in range(2, 5):  # turn t+1 stubs output t-1 and appends a call and an output
        got = reprefill(chat.ids(reqs[t - 1]), chat.ids(reqs[t]), chat.anchor)
        assert len(got["plan"]) == 1 and got["plan"][0]["delta"] < 0 and got["fallback"] is None
    assert reprefill(chat.ids(reqs[0]), chat.ids(reqs[1]), chat.anchor)["plan"] == []  # turn 2 edits nothing


def test_quick_edits_section(quick):
    """The edits section in quick mode on real servers: every timed request prefills what the planner
    predicted for its system (amortize: usage.kv_edit; the others: vllm-mlx's scheduler), amortize
    splices every TTFT point, and the truncation trace splices from turn 3 on."""
    res, out, _ = quick
    ed = res["sections"]["edits"]
    assert ed["errors"] == {}
    assert ed["summary"]["accounting_mismatches"] == [] and ed["summary"]["accounting_checked"] == len(ed["samples"])
    amortize = [x for x in ed["samples"] if x["system"] == "amortize"]
    assert amortize and all(x["kv_edit"]["applied"] and x["prefilled"] < x["prompt_tokens"] // 2 for x in amortize)
    trace = {x["turn"]: x for x in ed["trace"] if x["system"] == "amortize"}
    assert trace[1]["kv_edit"]["fallback"] == "no_history"
    assert all(trace[t]["kv_edit"]["applied"] for t in range(3, len(trace) + 1))
    assert {x["system"] for x in ed["samples"]} == {"amortize", "forget", "exact", "vllm_default", "no_cache"}
    assert (out / "edits.png").exists()
    md = (out / "bench.md").read_text()
    assert "## Span directives: the turn after an edit" in md and "### Multi-turn trace" in md
