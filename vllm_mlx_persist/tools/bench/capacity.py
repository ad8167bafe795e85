"""`vllm-mlx-persist bench --sections capacity`: how many agents fit in a memory budget, per family.

Two halves, reported side by side:

- Analytical, from published model shapes (PUBLISHED: the config.json keys that size a cache, with
  their source). Bytes one agent holds in memory, for persist_q4's hot tier, for vllm-mlx's default
  prefix cache (one entry holding the agent's context, as mlx-lm keeps it in the model dtype) and
  for the bound, and the agents that fit in each budget.
- Measured, on scaled-down random-weight models with the same layer pattern (models.py, config
  overrides): bytes_hot of each agent from real `vllm-mlx serve --cache-backend persist_q4` servers
  (`GET /v1/agents/ID`) and vllm-mlx's own accounting of its cache (`/v1/cache/stats`), against the
  same formulas on the small shapes. Windows, block size and contexts are all divided by `scale`, so
  tokens/window, window/block and tokens/block are those of the published shapes.

The bound (issue #24): the least a 4-bit cache must hold to resume the agent at its end: each
attention layer's K/V (an MLA layer's latent + rope key) for the tokens it can still attend to, all
of them on global layers and the window on sliding ones, at 4 bits with scales and biases per group
of 64 in the model dtype, plus one recurrent state per linear-attention layer in its own dtype
(nobody quantizes it).
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Optional

from ..serving import Server
from .kit import MB, Conversation, Ctx, Prompts, Session, make_server, say, seed_of, send

GIB = 2**30
BITS, GROUP = 4, 64
CAPACITY_FAMILIES = ("llama", "gemma3_text", "gpt_oss", "qwen3_next", "deepseek_v3")
SLIDING = ("gemma3_text", "gpt_oss")  # the families issue #24's 1.15x target is about
TARGETED = SLIDING + ("qwen3_next",)  # and issue #33 item 3's (hybrids at their bound)
TARGET = 1.15
# Measured against analytical on the small shapes: persist_q4 between its sliding layers' least and
# most (window_tokens; equal on other families), +-1% (the 4-byte `win.from` of trimmed blocks);
# vllm-mlx within 3% (its memory is reported in MiB with 2 decimals).
PERSIST_TOL, VLLM_TOL = 0.01, 0.03
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# The published shapes: the config.json keys that size a cache, copied from each model's config.json
# (Hugging Face, `main` branch). Keys absent there take mlx-lm's defaults (noted).
PUBLISHED: dict[str, dict[str, Any]] = {
    "llama": {
        "name": "Llama-3.1-8B",
        "source": "https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json",
        "config": {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "torch_dtype": "bfloat16"},  # head_dim = 4096 / 32
    },
    "gemma3_text": {
        "name": "Gemma-3-12B",
        "source": "https://huggingface.co/google/gemma-3-12b-it/blob/main/config.json (text_config)",
        "config": {"model_type": "gemma3_text", "num_hidden_layers": 48, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 256, "sliding_window": 1024, "sliding_window_pattern": 6,
                   "torch_dtype": "bfloat16"},
    },
    "gpt_oss": {
        "name": "gpt-oss-20b",
        "source": "https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json",
        "config": {"model_type": "gpt_oss", "num_hidden_layers": 24, "num_attention_heads": 64,
                   "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
                   "layer_types": ["sliding_attention", "full_attention"] * 12,
                   "torch_dtype": "bfloat16"},  # attention in bf16 (the experts are mxfp4)
    },
    "qwen3_next": {
        "name": "Qwen3-Next-80B-A3B",
        "source": "https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json",
        "config": {"model_type": "qwen3_next", "num_hidden_layers": 48, "num_attention_heads": 16,
                   "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4,
                   "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                   "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "torch_dtype": "bfloat16"},
    },
    "deepseek_v3": {
        "name": "DeepSeek-V2-Lite (MLA latent)",
        "source": "https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json",
        # Its MLA shapes, cached as mlx-lm's deepseek_v3 class caches them (latent + rope key per
        # token); the checkpoint itself says deepseek_v2: see "deepseek_v2" below.
        "config": {"model_type": "deepseek_v3", "num_hidden_layers": 27, "num_attention_heads": 16,
                   "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
                   "torch_dtype": "bfloat16"},
    },
    "deepseek_v2": {
        "name": "DeepSeek-V2-Lite (as served)",
        "source": "https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json",
        # mlx-lm 0.31.3's deepseek_v2 class caches expanded per-head K (nope + rope) and V: what
        # serving this checkpoint as published costs, in either system.
        "config": {"model_type": "deepseek_v2", "num_hidden_layers": 27, "num_attention_heads": 16,
                   "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
                   "torch_dtype": "bfloat16"},
    },
}
PUBLISHED_ORDER = ("llama", "gemma3_text", "gpt_oss", "qwen3_next", "deepseek_v3", "deepseek_v2")


# ---------------------------------------------------------------------------------------------
# Shapes and the formulas


@dataclass(frozen=True)
class Layers:
    """`count` layers whose cache is of one kind: `kv` (attention K/V; `window` for sliding layers),
    `latent` (MLA: `width` values per token) or `state` (recurrent: `state_bytes` per state)."""

    count: int
    kind: str
    kv_heads: int = 0
    k_dim: int = 0
    v_dim: int = 0
    window: Optional[int] = None
    width: int = 0
    state_bytes: int = 0


@dataclass(frozen=True)
class Shape:
    name: str
    arch: str
    dtype_bytes: int  # K/V, latents, scales and biases, conv states: the model's dtype
    layers: tuple[Layers, ...]

    def describe(self) -> str:
        parts = []
        for g in self.layers:
            if g.kind == "kv":
                dims = f"{g.k_dim}" if g.k_dim == g.v_dim else f"K {g.k_dim} / V {g.v_dim}"
                parts.append(f"{g.count} {'sliding (window ' + str(g.window) + ')' if g.window else 'global'} "
                             f"x {g.kv_heads} KV heads x {dims}")
            elif g.kind == "latent":
                parts.append(f"{g.count} MLA x latent+rope {g.width}")
            else:
                parts.append(f"{g.count} linear-attention, state {g.state_bytes / MB:.3g} MiB")
        return "; ".join(parts) + f"; {8 * self.dtype_bytes}-bit floats"


def shape_from_config(cfg: dict, name: str = "") -> Shape:
    """The cache shape of a model from its config.json, as mlx-lm 0.31.3 lays out its cache."""
    mt = cfg["model_type"]
    L = cfg["num_hidden_layers"]
    dt = _DTYPE_BYTES[cfg.get("torch_dtype", "bfloat16")]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or (cfg["hidden_size"] // heads if "hidden_size" in cfg else 0)  # MLA: unused
    if mt in ("llama", "qwen2", "qwen3"):
        layers = (Layers(L, "kv", kv, hd, hd),)
    elif mt == "gemma3_text":
        p = cfg.get("sliding_window_pattern", 6)  # layer i is global iff i % p == p - 1 (make_cache)
        g = sum(1 for i in range(L) if i % p == p - 1)
        layers = (Layers(L - g, "kv", kv, hd, hd, window=cfg["sliding_window"]), Layers(g, "kv", kv, hd, hd))
    elif mt == "gpt_oss":
        g = sum(1 for t in cfg["layer_types"] if t == "full_attention")
        layers = (Layers(L - g, "kv", kv, hd, hd, window=cfg["sliding_window"]), Layers(g, "kv", kv, hd, hd))
    elif mt == "qwen3_next":
        k = cfg["full_attention_interval"]
        full = sum(1 for i in range(L) if (i + 1) % k == 0)
        hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        conv = (cfg["linear_conv_kernel_dim"] - 1) * (2 * hk * dk + hv * dv) * dt  # ArraysCache[0], model dtype
        rec = hv * dv * dk * 4  # ArraysCache[1]: mlx-lm's gated delta keeps it in float32
        layers = (Layers(L - full, "state", state_bytes=conv + rec), Layers(full, "kv", kv, hd, hd))
    elif mt in ("deepseek_v3", "deepseek_v32"):
        layers = (Layers(L, "latent", width=cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]),)
    elif mt == "deepseek_v2":  # expanded: K = nope + rope per head (rope repeated), V per head
        layers = (Layers(L, "kv", heads, cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["v_head_dim"]),)
    else:
        raise ValueError(f"no cache shape for model type {mt!r}")
    return Shape(name or mt, mt, dt, layers)


def q4_element_bytes(dtype_bytes: int) -> float:
    """Bytes per K/V element at 4 bits: the packed value plus a scale and a bias per group."""
    return BITS / 8 + 2 * dtype_bytes / GROUP


def window_tokens(n: int, w: int, block: int, rule: str = "blocks") -> int:
    """Tokens of a sliding layer that persist_q4's hot blocks keep for an agent of n tokens.
    "blocks": the blocks from the one holding position n - w to the end (pool._trim_windows), at
    most; "worst": that for the worst n, one that ends just past a block boundary (w + block - 1);
    "window": the least, the window itself (a block keeps only what the live cache still held, the
    window plus the tokens decoded since its last drop)."""
    if n <= w:
        return n
    if rule == "window":
        return w
    return min(n, w + block - 1) if rule == "worst" else n - block * ((n - w) // block)


def agent_bytes(shape: Shape, n: int, system: str, block: int = 256, branches: int = 1,
                rule: str = "blocks") -> dict[str, float]:
    """Bytes one agent of n tokens holds in memory, by part, for `system`: persist_q4 (its hot
    blocks; `rule`: its sliding layers' tokens, see window_tokens; one recurrent-state checkpoint,
    with its int32 position, per branch, however many turns it took), vllm_default (one prefix-cache
    entry: what mlx-lm keeps, trimmed to the tokens) or bound (one state per branch: what a lookup
    needs to resume each branch the agent can return to)."""
    q4 = q4_element_bytes(shape.dtype_bytes)
    out = {"kv": 0.0, "window": 0.0, "latent": 0.0, "state": 0.0}
    for g in shape.layers:
        if g.kind == "kv":
            if g.window is None:
                held = n
            elif system == "persist_q4":
                held = window_tokens(n, g.window, block, rule)
            else:  # the bound, and mlx-lm's RotatingKVCache: the window
                held = min(n, g.window)
            per = g.kv_heads * (g.k_dim + g.v_dim) * (shape.dtype_bytes if system == "vllm_default" else q4)
            out["window" if g.window else "kv"] += g.count * held * per
        elif g.kind == "latent":  # persist_q4 keeps latents as mlx-lm does, in the model dtype
            out["latent"] += g.count * n * g.width * (q4 if system == "bound" else shape.dtype_bytes)
        else:
            copies = 1 if system == "vllm_default" else branches
            out["state"] += g.count * g.state_bytes * copies + (4 * copies if system == "persist_q4" else 0)
    out["total"] = sum(out.values())
    return out


def published_rows(contexts: list[int], budgets_gib: list[int], turns: int, block: int = 256) -> list[dict]:
    """Per published shape and context: MB per agent and agents per budget, per system. An agent that
    took `turns` turns on one branch holds what a one-turn agent of its tokens does (one recurrent
    state per branch): "persist_q4_turns" says so."""
    rows = []
    for key in PUBLISHED_ORDER:
        p = PUBLISHED[key]
        shape = shape_from_config(p["config"], p["name"])
        for c in contexts:
            per = {"bound": agent_bytes(shape, c, "bound")["total"],
                   "persist_q4": agent_bytes(shape, c, "persist_q4", block, rule="worst")["total"],
                   "vllm_default": agent_bytes(shape, c, "vllm_default")["total"],
                   "persist_q4_turns": agent_bytes(shape, c, "persist_q4", block, branches=1, rule="worst")["total"]}
            rows.append({
                "key": key, "family": shape.arch, "model": p["name"], "context": c,
                "mb": {s: round(b / MB, 2) for s, b in per.items()},
                "agents": {str(g): {s: int(g * GIB // b) for s, b in per.items()} for g in budgets_gib},
                "persist_over_bound": round(per["persist_q4"] / per["bound"], 3),
                "persist_over_vllm": round(per["persist_q4"] / per["vllm_default"], 3),
                "target": TARGET if key in TARGETED else None,
            })
    return rows


# ---------------------------------------------------------------------------------------------
# Measured: scaled-down models on real servers


def scaled_overrides(arch: str, scale: int) -> dict:
    """config.json overrides of the `tiny` preset giving the published shape's layer pattern, with
    its window divided by `scale`: gemma3_text 5 sliding + 1 global, gpt_oss 1 + 1 (tiny's 2
    layers alternate), qwen3_next 3 linear + 1 full, llama and deepseek_v3 all alike (tiny's 2)."""
    pub = PUBLISHED[arch]["config"]
    if arch == "gemma3_text":
        p = pub["sliding_window_pattern"]
        return {"num_hidden_layers": p, "sliding_window_pattern": p, "sliding_window": pub["sliding_window"] // scale}
    if arch == "gpt_oss":
        return {"sliding_window": pub["sliding_window"] // scale}
    if arch == "qwen3_next":
        k = pub["full_attention_interval"]
        return {"num_hidden_layers": k, "full_attention_interval": k}
    return {}


_STORE_RE = re.compile(r"\[cache_store(?:_prompt)?\] request=\S+ (?:key_)?tokens=(\d+)")


def _vllm_memory(server: Server) -> tuple[float, int]:
    """(MiB, entries) of vllm-mlx's prefix cache as it accounts them (MiB with 2 decimals)."""
    st = server.get_json("/v1/cache/stats").get("engine_cache") or {}
    return float(st.get("current_memory_mb", 0.0)), int(st.get("entry_count", 0))


def _turn(s: Session, conv: Conversation, max_tokens: int, system: str) -> dict:
    """One turn; then what the server holds for the agent: persist_q4's agent info, or vllm-mlx's
    cache memory (polled until the turn's entry shows) and the tokens its log says it stored."""
    srv = s.server
    before = _vllm_memory(srv) if system != "persist_q4" else None
    pos = srv.log_path.stat().st_size
    r = send(s, conv.ask(), conv.agent, max_tokens)
    conv.answer(r["text"])
    rec = {"prompt_tokens": r["prompt_tokens"], "completion_tokens": r["completion_tokens"], "tier": r["tier"],
           "reused_tokens": r["reused_tokens"]}
    if system == "persist_q4":
        info = srv.get_json(f"/v1/agents/{conv.agent}")
        rec.update(tokens=info["tokens"], bytes=info["bytes_hot"], blocks=info["blocks"],
                   blocks_hot=info["blocks_hot"], bytes_disk=info["bytes_disk"], branches=info["branches"])
        return rec
    after = before
    for _ in range(20):  # its store runs as the request finishes; a turn it does not cache changes nothing
        after = _vllm_memory(srv)
        if after != before:
            break
        time.sleep(0.05)
    with open(srv.log_path, "rb") as f:
        f.seek(pos)
        log = f.read().decode(errors="replace")
    stored = [int(x) for x in _STORE_RE.findall(log)]
    rec.update(tokens=stored[-1] if stored else (r["prompt_tokens"] or 0) + (r["completion_tokens"] or 0),
               bytes=round((after[0] - before[0]) * MB), memory_mib=after[0], entries=after[1],
               entries_before=before[1], stored_tokens=stored)
    return rec


def _grown_words(prompts: Prompts, tokens: int) -> int:
    """Words of kit's vocabulary that make a user turn of about `tokens` tokens."""
    import random

    sample = Prompts.words(random.Random(0), 400)
    per = (prompts.count([{"role": "user", "content": sample}]) - prompts.count([{"role": "user", "content": ""}])) / 400
    return max(1, int(tokens / per))


def measure_family(ctx: Ctx, arch: str) -> dict:
    """Per system one server on the scaled-down model: one agent per context (one turn: a history
    of context / scale tokens and a short user turn), then one agent grown to the largest context
    over `capacity_turns` turns, each a user turn of about context / scale / turns tokens."""
    from ..models.build import build_model_dir

    plan = ctx.plan
    scale, block = plan.capacity_scale, 256 // plan.capacity_scale
    overrides = scaled_overrides(arch, scale)
    model = build_model_dir(ctx.work / f"model-{arch}-{plan.capacity_size}-x{scale}", arch=arch,
                            size=plan.capacity_size, overrides=overrides)
    cfg = json.loads((model / "config.json").read_text())
    shape = shape_from_config(cfg, f"{arch} {plan.capacity_size} (scaled 1/{scale})")
    prompts = Prompts(model)
    big = max(plan.capacity_contexts)
    words = _grown_words(prompts, big // scale // plan.capacity_turns)
    out: dict = {"shape": asdict(shape), "describe": shape.describe(), "overrides": overrides, "block_size": block,
                 "params_m": round((model / "model.safetensors").stat().st_size / 4 / 1e6, 2),
                 "agents": {}, "grown": {}, "errors": {}, "events": []}
    for system in plan.capacity_systems:
        home = ctx.work / f"capacity-{arch}-{system}"
        shutil.rmtree(home, ignore_errors=True)
        s = Session(system, make_server(system, model, home, plan.ttft_cache_mb, {"block_size": block}),
                    out["events"], f"capacity-{arch}")
        agents, grown = [], []
        try:
            s.start("fresh")
            for c in plan.capacity_contexts:
                conv = Conversation(f"cap-{arch}-{c}", prompts.history(seed_of("capacity", arch, c), c // scale),
                                    seed_of("capacity-u", arch, c), plan.user_words)
                rec = {"context": c, "scaled_context": c // scale, **_turn(s, conv, plan.capacity_max_tokens, system)}
                agents.append(rec)
                say(f"  capacity {arch} {system} {c // scale:>6} tok (~{c}): {rec['tokens']} tokens, "
                    f"{rec['bytes']} bytes")
            conv = Conversation(f"cap-{arch}-grown", [], seed_of("capacity-grown", arch), words)
            for t in range(plan.capacity_turns):
                rec = {"turn": t + 1, **_turn(s, conv, plan.capacity_max_tokens, system)}
                grown.append(rec)
            say(f"  capacity {arch} {system} grown over {plan.capacity_turns} turns: {grown[-1]['tokens']} tokens, "
                f"{grown[-1]['bytes'] if system == 'persist_q4' else sum(g['bytes'] for g in grown)} bytes")
        except Exception as e:
            out["errors"][system] = f"{type(e).__name__}: {e}\n{srv.log_tail(30)}"
            say(f"capacity: {arch} on {system} FAILED: {e}")
            traceback.print_exc()
        finally:
            s.stop(signal.SIGTERM, "end")
        out["agents"][system] = agents
        out["grown"][system] = grown
    out["compare"] = compare(shape, out, plan.capacity_turns, block)
    return out


def compare(shape: Shape, m: dict, turns: int, block: int) -> dict:
    """Measured against the formulas on the small shape: per context, persist_q4's and vllm-mlx's
    bytes over their analytical value and over the bound; the grown agent against one branch and
    against the branches it holds (one recurrent state each, and the bound's too)."""
    rows = []
    by_ctx: dict[int, dict] = {}
    for system, recs in m["agents"].items():
        for r in recs:
            by_ctx.setdefault(r["context"], {})[system] = r
    for c, per in sorted(by_ctx.items()):
        row: dict = {"context": c}
        for system, r in per.items():
            n = r["tokens"]
            ana = agent_bytes(shape, n, system, block)["total"]
            low = agent_bytes(shape, n, system, block, rule="window")["total"]
            bound = agent_bytes(shape, n, "bound")["total"]
            x = r["bytes"] / ana if ana else None
            if system == "persist_q4":
                agrees = low * (1 - PERSIST_TOL) <= r["bytes"] <= ana * (1 + PERSIST_TOL)
            else:
                agrees = x is not None and abs(x - 1) <= VLLM_TOL
            row[system] = {"tokens": n, "bytes": r["bytes"], "analytical": round(ana), "bound": round(bound),
                           "analytical_low": round(low), "over_analytical": round(x, 3) if x else None,
                           "over_bound": round(r["bytes"] / bound, 3) if bound else None, "agrees": agrees}
        p, v = row.get("persist_q4"), row.get("vllm_default")
        if p and v and v["bytes"]:
            row["persist_over_vllm"] = round(p["bytes"] / v["bytes"], 3)
        if p and shape.arch in TARGETED:
            row["target_met"] = p["over_bound"] is not None and p["over_bound"] <= TARGET
        rows.append(row)
    grown: dict = {}
    for system, recs in m["grown"].items():
        if not recs:
            continue
        last = recs[-1]
        n = last["tokens"]
        held = last["bytes"] if system == "persist_q4" else sum(r["bytes"] for r in recs)
        entries = last["entries"] - recs[0]["entries_before"] if "entries" in last else None
        k = max(1, len(last.get("branches") or [])) if system == "persist_q4" else 1
        grown[system] = {"turns": len(recs), "tokens": n, "bytes": held, "entries": entries,
                         "branches": last.get("branches"),
                         "one_turn_analytical": round(agent_bytes(shape, n, system, block)["total"]),
                         "branches_analytical": round(agent_bytes(shape, n, system, block, branches=k)["total"]),
                         "bound": round(agent_bytes(shape, n, "bound", branches=k)["total"])}
        g = grown[system]
        g["over_one_turn"] = round(held / g["one_turn_analytical"], 3)
        g["over_bound"] = round(held / g["bound"], 3)
    return {"rows": rows, "grown": grown}


def section_capacity(ctx: Ctx) -> dict:
    plan = ctx.plan
    result: dict = {
        "published": published_rows(plan.capacity_contexts, plan.capacity_budgets_gib, plan.capacity_turns),
        "shapes": {k: {"name": PUBLISHED[k]["name"], "source": PUBLISHED[k]["source"],
                       "config": PUBLISHED[k]["config"],
                       "describe": shape_from_config(PUBLISHED[k]["config"], PUBLISHED[k]["name"]).describe()}
                   for k in PUBLISHED_ORDER},
        "measured": {}, "errors": {}, "events": [],
    }
    for arch in plan.capacity_archs:
        say(f"capacity: {arch} (scaled 1/{plan.capacity_scale})")
        try:
            m = measure_family(ctx, arch)
        except Exception as e:  # a model that does not build: the other families still run
            result["errors"][arch] = f"{type(e).__name__}: {e}"
            say(f"capacity: {arch} FAILED: {e}")
            traceback.print_exc()
            continue
        result["events"] += m.pop("events")
        result["errors"].update({f"{arch}/{s}": e for s, e in m.pop("errors").items()})
        result["measured"][arch] = m
    result["summary"] = summarize(result, plan)
    return result


def summarize(result: dict, plan: Any) -> dict:
    """The target per sliding family and context, published and measured, and the largest context's
    agents per budget."""
    out: dict = {"target": TARGET, "published": {}, "measured": {}}
    for r in result["published"]:
        if r["target"]:
            out["published"].setdefault(r["key"], {})[str(r["context"])] = r["persist_over_bound"]
    for arch, m in result["measured"].items():
        for row in m["compare"]["rows"]:
            p = row.get("persist_q4")
            if p:
                out["measured"].setdefault(arch, {})[str(row["context"])] = {
                    "over_bound": p["over_bound"], "over_analytical": p["over_analytical"],
                    "vllm_over_analytical": (row.get("vllm_default") or {}).get("over_analytical"),
                    "agrees": p["agrees"] and (row.get("vllm_default") or {}).get("agrees", True),
                    "target_met": row.get("target_met")}
    return out


def headline_capacity(results: dict) -> dict:
    cap = results.get("capacity")
    if not cap or not cap.get("published"):
        return {}
    big = max(r["context"] for r in cap["published"])
    g = next(iter(cap["published"][0]["agents"]))
    return {"capacity_at": big, "capacity_budget_gib": int(g),
            "capacity": {r["key"]: {"model": r["model"], **r["agents"][g]} for r in cap["published"]
                         if r["context"] == big},
            "capacity_target": cap.get("summary", {})}


# ---------------------------------------------------------------------------------------------
# Report


def _mb(x: float) -> str:
    return f"{x:,.1f}" if x >= 10 else f"{x:.2f}"


def _n(x: Any) -> str:
    return f"{x:,}" if isinstance(x, (int, float)) else "–"


def _range(r: dict) -> str:
    lo, hi = r.get("analytical_low"), r.get("analytical")
    return _n(hi) if lo is None or lo == hi else f"{_n(lo)}-{_n(hi)}"


def _agree(r: dict) -> str:
    x = r.get("over_analytical")
    return "–" if x is None else f"{x} ({'agrees' if r.get('agrees') else 'DIFFERS'})"


def md_capacity(cap: dict, plan: dict) -> list[str]:
    scale, turns = plan.get("capacity_scale", 8), plan.get("capacity_turns", 8)
    budgets = [str(b) for b in plan.get("capacity_budgets_gib", [16, 64])]
    L = ["## Capacity: agents per memory budget", "",
         "Bytes one agent's cache holds in memory, and how many agents fit in a budget, per model family. "
         "**persist_q4**: the agent's hot blocks (`bytes_hot` of `GET /v1/agents/ID`): 4-bit K/V with a scale "
         "and a bias per group of 64 in the model dtype; sliding-window layers only the blocks from the one "
         "holding the window's first token (`pool._trim_windows`), so at most the window + 255 tokens; one "
         "recurrent-state checkpoint per branch, in full precision (its resume point: the state where its last "
         "prompt ended; design.md, \"Recurrent state\"), however many turns the agent took; MLA latents as mlx-lm keeps them, in the model dtype. **vllm-mlx default**: one "
         "prefix-cache entry holding the agent's context, as mlx-lm keeps it (`KVCache` trimmed to the tokens, "
         "`RotatingKVCache` the window, `ArraysCache` one state, MLA latents), in the model dtype. **Bound** "
         "(the issue's): the least a 4-bit cache must hold to resume the agent at its end: global layers x "
         "tokens + sliding layers x window at 4 bits (the same scales and biases), MLA latents at 4 bits, one "
         "recurrent state in its own dtype per branch (what a lookup needs to resume each branch the agent can "
         "return to; one branch in the tables but the grown agents'). Budgets are `hot_mb` (persist_q4) and `--cache-memory-mb` (vllm-mlx) "
         "in GiB; weights, activations and the float decode mirror (`decode_float_mb`) come on top.", "",
         "### Published shapes (analytical)", "",
         f"Agents of exactly the context's tokens. persist_q4's sliding layers are counted at their worst (an "
         f"agent ending just past a block boundary: window + 255 tokens); \"after {turns} turns\": an agent grown "
         f"over {turns} turns on one branch (see the measured grown agents below; until issue #33 item 3 it held "
         "two recurrent states per turn). Targets: persist_q4 within 1.15x of the bound on sliding-window "
         "families (issue #24) and on Qwen3-Next (issue #33 item 3).", "",
         "| family | model | context | bound MB | persist_q4 MB | vllm-mlx MB | persist_q4 / bound | persist_q4 / "
         "vllm-mlx | " + " | ".join(f"agents in {b} GiB: bound / persist_q4 / vllm-mlx" for b in budgets)
         + f" | persist_q4 after {turns} turns MB (agents in {budgets[0]} GiB) | target |",
         "|---|---|---|---|---|---|---|---|" + "---|" * len(budgets) + "---|---|"]
    for r in cap.get("published", []):
        mb, ag = r["mb"], r["agents"]
        tgt = ("–" if not r["target"] else
               f"{'met' if r['persist_over_bound'] <= r['target'] else 'NOT met'} (<= {r['target']})")
        L.append(f"| {r['family']} | {r['model']} | {r['context'] // 1024}k | {_mb(mb['bound'])} | "
                 f"{_mb(mb['persist_q4'])} | {_mb(mb['vllm_default'])} | {r['persist_over_bound']:.2f} | "
                 f"{r['persist_over_vllm']:.2f} | "
                 + " | ".join(f"{ag[b]['bound']:,} / **{ag[b]['persist_q4']:,}** / {ag[b]['vllm_default']:,}"
                              for b in budgets)
                 + (" | same" if mb["persist_q4_turns"] == mb["persist_q4"] else
                    f" | {_mb(mb['persist_q4_turns'])} ({ag[budgets[0]]['persist_q4_turns']:,})") + f" | {tgt} |")
    L += ["", "![Agents per budget](capacity.png)", "", "Shapes (the config.json keys that size a cache; dtype "
          "bfloat16 as published, the recurrent state float32 as mlx-lm's gated delta keeps it):", ""]
    for k, sh in cap.get("shapes", {}).items():
        L.append(f"- **{sh['name']}** ({k}): {sh['describe']}. Source: {sh['source']}.")
    L += ["", "- DeepSeek-V2-Lite's checkpoint is `model_type: deepseek_v2`, which mlx-lm 0.31.3 caches as "
          "expanded per-head K (nope + rope, 192) and V (128) in both systems: 2.5x the latent in bfloat16. "
          "The deepseek_v3 row is the same model's latent, as mlx-lm's deepseek_v3 class (and "
          "deepseek_v3-architecture checkpoints) cache it.", ""]
    meas = cap.get("measured", {})
    if meas:
        L += ["### Measured on scaled-down models", "",
              f"Random-weight float32 models built by models.py (`{plan.get('capacity_size')}` preset with the "
              f"published layer pattern; scale 1/{scale}: windows, persist_q4's `block_size` "
              f"({256 // scale}) and contexts divided by {scale}, so tokens/window, window/block and tokens/block "
              "are the published ones). Per family and system one real server (`vllm-mlx serve` with "
              f"`--cache-backend persist_q4 --cache-backend-options '{{\"block_size\": {256 // scale}, \"hot_mb\": "
              f"{plan.get('ttft_cache_mb')}}}'`, or vllm-mlx's default cache with `--cache-memory-mb "
              f"{plan.get('ttft_cache_mb')}`) and one agent per context: a history of context / {scale} tokens "
              f"plus a short user turn, `max_tokens={plan.get('capacity_max_tokens')}`. persist_q4: `bytes_hot` "
              "and `tokens` from `GET /v1/agents/ID`; vllm-mlx: the growth of `current_memory_mb` in "
              "`/v1/cache/stats` (its own accounting, MiB with 2 decimals: +-5 KiB) and the tokens its "
              "`[cache_store]` log line stored. Analytical = the formulas above on the small shape at the "
              "measured tokens. persist_q4's sliding layers keep at most the blocks of the block rule at "
              "those tokens and at least the window: a block keeps only what the live cache still held, the window "
              "plus the tokens decoded since its last drop. Float32 scales and biases: 0.625 bytes per 4-bit element.", "",
              "Shapes: " + "; ".join(f"{a}: {m['describe']} ({m['params_m']}M parameters)" for a, m in meas.items())
              + ".", "",
              f"Agreement: persist_q4 within {PERSIST_TOL:.0%} of the analytical range (on sliding families from the "
              "window alone to the block rule; one value on the others), vllm-mlx within "
              f"{VLLM_TOL:.0%} of its analytical value; measured / analytical is against the range's top.", "",
              "| family | context (scaled) | persist_q4 tokens | bytes_hot | analytical | measured / analytical | "
              "bound | persist_q4 / bound | target 1.15x | vllm-mlx bytes | analytical | measured / analytical | "
              "persist_q4 / vllm-mlx |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for arch, m in meas.items():
            for row in m["compare"]["rows"]:
                p, v = row.get("persist_q4") or {}, row.get("vllm_default") or {}
                tgt = "–" if "target_met" not in row else ("met" if row["target_met"] else "NOT met")
                L.append(f"| {arch} | {row['context'] // 1024}k ({row['context'] // scale}) | {p.get('tokens', '–')} | "
                         f"{_n(p.get('bytes'))} | {_range(p)} | {_agree(p)} | "
                         f"{_n(p.get('bound'))} | {p.get('over_bound', '–')} | {tgt} | {_n(v.get('bytes'))} | "
                         f"{_n(v.get('analytical'))} | {_agree(v)} | {row.get('persist_over_vllm', '–')} |")
        L += ["", f"An agent grown over {turns} turns to about the largest context (each turn a user message of "
              f"about {max(plan.get('capacity_contexts', [0])) // scale // max(1, turns)} tokens and the model's "
              "streamed reply, sent back as a client does). persist_q4: `bytes_hot` after the last turn. It also "
              "keeps the last block of up to 3 older branches (`branches`: resume points) when a reply does not "
              "re-tokenize to the generated tokens, as these random models' replies often do not, and on "
              "recurrent families one state per branch (the bound counts them too). vllm-mlx: what "
              "its cache grew by over the agent's turns: on sliding-window and recurrent families it stores the "
              "first turn's prompt only (later turns are not cached: the families section), on the others an entry "
              "per turn that stays until its LRU evicts it (none extends the previous one exactly with these "
              "replies).", "",
              "| family | turns | tokens | branches | persist_q4 bytes_hot | analytical, 1 branch | analytical, its "
              "branches | / 1 branch | bound (its branches) | / bound | vllm-mlx bytes (entries) | vllm-mlx analytical, "
              "1 entry |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for arch, m in meas.items():
            g = m["compare"]["grown"]
            p, v = g.get("persist_q4"), g.get("vllm_default")
            if not p:
                continue
            k = len(p.get("branches") or []) or 1
            L.append(f"| {arch} | {p['turns']} | {p['tokens']} | {k} | {p['bytes']:,} | {p['one_turn_analytical']:,} | "
                     f"{p['branches_analytical']:,} | {p['over_one_turn']} | {p['bound']:,} | {p['over_bound']} | "
                     + (f"{v['bytes']:,} ({v['entries']}) | {v['one_turn_analytical']:,} |" if v else "– | – |"))
    L.append("")
    return L
