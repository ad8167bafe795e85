"""The servers of `vllm-mlx-persist bench --sections edits`: which system runs on which server
(persist_q4's three modes share one), the X-KV-Edit header of each, and the tokens vllm-mlx's
scheduler says it prefilled for a request."""

from __future__ import annotations

import re
import time
from typing import Optional, Sequence

from ..serving import Server

EDIT_SYSTEMS = ("amortize", "forget", "exact", "vllm_default", "no_cache")
EDIT_LABELS = {"amortize": "persist_q4, X-KV-Edit: amortize", "forget": "persist_q4, X-KV-Edit: forget",
               "exact": "persist_q4, no header (exact)", "vllm_default": "vllm-mlx default prefix cache",
               "no_cache": "vllm-mlx --disable-prefix-cache"}
PERSIST_MODES = ("amortize", "forget", "exact")


def edit_servers(systems: Sequence[str]) -> list[tuple[str, list[str]]]:
    """(server, the systems it serves): persist_q4's three modes share one server."""
    out = []
    modes = [m for m in PERSIST_MODES if m in systems]
    if modes:
        out.append(("persist_q4", modes))
    out += [(s, [s]) for s in ("vllm_default", "no_cache") if s in systems]
    return out


def kv_edit_headers(system: str) -> Optional[dict]:
    """The request headers of an edit system: X-KV-Edit for amortize and forget, none otherwise."""
    return {"X-KV-Edit": system} if system in ("amortize", "forget") else None


_SCHEDULE_RE = re.compile(r"\[schedule\] request=\S+ uid=\d+ prompt_tokens=(\d+) tokens_to_prefill=(\d+)")


def scheduled_tokens(server: Server, pos: int) -> Optional[int]:
    """The tokens vllm-mlx's scheduler prefilled after the cache lookup for the request whose log
    starts at `pos` (its `[schedule]` line; an exact hit, which vllm-mlx discards, counts the whole
    prompt)."""
    for _ in range(20):  # the line is written before the first token; let it reach the file
        with open(server.log_path, errors="replace") as f:
            f.seek(pos)
            found = _SCHEDULE_RE.findall(f.read())
        if found:
            return int(found[-1][1])
        time.sleep(0.05)
    return None
