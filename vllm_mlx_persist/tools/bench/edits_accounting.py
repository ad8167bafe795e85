"""`vllm-mlx-persist bench --sections edits`, part accounting: the prompt tokens each system re-prefills
after an edit, over the whole grid, with no model forward (amortize: the planner the server runs;
exact, forget and vllm-mlx's default cache: after the longest common prefix; no cache: the prompt)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Optional, Sequence

from ... import chain
from ...kv_edit import OPTION_DEFAULTS
from ...kv_edit.plan import ModelSplicing, Points, Splice
from .edits_chats import Chat, EditPoint, edit_history, edit_position, edited_turn
from .kit import seed_of

# vllm-mlx 0.6.0's MemoryAwarePrefixCache: an LCP (or prefix) hit shorter than min_prefix_tokens is a miss
VLLM_MIN_PREFIX = 128


def reprefill(stored: Sequence[int], prompt: Sequence[int], anchor: Points,
              options: Optional[dict] = None) -> dict:
    """Prompt tokens each system prefills when `prompt` follows a turn that stored `stored`.
    amortize: the server's plan (ModelSplicing.decide, at the realignment points `anchor`: a Realign,
    or a message-start token for message starts only) and its cut of each run (kv_edit.serve: a
    token is always left to prefill; a run cut under min_run_tokens ends the splices)."""
    opts = {**OPTION_DEFAULTS, **(options or {})}
    n, lcp = len(prompt), chain.lcp(stored, prompt)
    exact = min(lcp, n - 1)
    out: dict[str, Any] = {"prompt": n, "stored": len(stored), "exact_prefix": exact, "exact": n - exact,
                           "forget": n - exact, "vllm_default": n - lcp if lcp >= VLLM_MIN_PREFIX else n,
                           "no_cache": n, "plan": [], "fallback": None}
    plans = ModelSplicing(anchor, False, None).decide(stored, prompt, opts)
    used: list[tuple[Splice, int]] = []
    if isinstance(plans, str):
        out["fallback"] = plans
    else:
        for p in plans:
            k = min(p.length, n - 1 - p.at)
            if k < opts["min_run_tokens"]:
                break
            used.append((p, k))
        if not used:
            out["fallback"] = "no_realignment"
    out["amortize"] = n - exact - sum(k for _, k in used)
    out["plan"] = [{"stub_tokens": p.stub, "run_tokens": k, "delta": p.delta} for p, k in used]
    return out


def grid(plan: Any, histories: Optional[Sequence[int]] = None) -> list[EditPoint]:
    """The accounting grid: every history (default plan.edit_grid_histories) x position x span x
    edits that fits."""
    pts = [EditPoint(h, p, s, e) for h in histories or plan.edit_grid_histories for p in plan.edit_positions
           for s in plan.edit_spans for e in plan.edit_counts]
    return [p for p in pts if p.fits()]


def ttft_points(plan: Any) -> list[EditPoint]:
    """The TTFT subset: histories x positions at one span and one edit, then at the sweep history
    and position, every span (one edit) and every edit count (the one span)."""
    if plan.edit_full_grid:
        return grid(plan, plan.edit_histories)
    pts = [EditPoint(h, p, plan.edit_span, 1) for h in plan.edit_histories for p in plan.edit_positions]
    top, at = plan.edit_sweep_history, plan.edit_sweep_position
    pts += [EditPoint(top, at, s, 1) for s in plan.edit_spans]
    pts += [EditPoint(top, at, plan.edit_span, e) for e in plan.edit_counts]
    return [p for p in dict.fromkeys(pts) if p.fits()]


def account_point(chat: Chat, point: EditPoint) -> dict:
    """One grid point's accounting, on its conversation (seeded by the point)."""
    history, targets = edit_history(chat, seed_of("edits", point.key), point)
    stored = chat.ids(history)
    prompt = chat.ids(edited_turn(history, targets, seed_of("edits-new", point.key)))
    return {"point": point.key, **asdict(point), "edit_at": edit_position(chat, history, targets),
            **reprefill(stored, prompt, chat.realign)}
