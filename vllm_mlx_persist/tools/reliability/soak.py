"""`vllm-mlx-persist reliability --campaigns soak`: 16 agents round-robin with growing histories
against a real server: RSS and disk sampled, both within budget, latency percentiles per tier (hot /
disk / miss) over time.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Optional

from ..serving import RssSampler, Server
from .server_kit import OPTIONS, OVERHEAD_MB, Conv, chat, run_for, shared, status, tree_bytes


# Soak memory: besides the bound (server_kit.OVERHEAD_MB), RSS may not grow: the lowest sample of the
# last third of the run within GROWTH_MB + hot_mb of the first third's lowest (what stays resident between
# requests). Growth is judged only on runs of GROWTH_MIN_S or more: in the first minutes the allocator's
# pools are still filling (a 40 s quick soak's minimum rose 92 MB), so a short run cannot tell growth from
# warm-up; it still reports the figure and checks the bound.
GROWTH_MB = 64
GROWTH_MIN_S = 600
TURN_SLACK = 1 << 20  # disk may pass disk_mb by the save in progress (the budget is enforced after it)
_TIER_RE = re.compile(r"\[persist_q4\] agent=(\S+) (HIT (hot|disk)|MISS)")


class LogTiers:
    """Follows the server log: each agent's fetches in order, as 'hot', 'disk' or 'miss'."""

    def __init__(self, path: Path):
        self.path, self.pos = path, path.stat().st_size if path.exists() else 0
        self.tiers: dict[str, list[str]] = {}
        self.lock = threading.Lock()

    def next(self, agent: str, timeout: float = 5.0) -> str:
        deadline = time.time() + timeout
        while True:
            with self.lock:
                self._read()
                q = self.tiers.get(agent)
                if q:
                    return q.pop(0)
            if time.time() > deadline:
                return "unknown"
            time.sleep(0.05)

    def _read(self) -> None:
        with open(self.path, "rb") as f:
            f.seek(self.pos)
            data = f.read()
        cut = data.rfind(b"\n") + 1
        self.pos += cut
        for m in _TIER_RE.finditer(data[:cut].decode(errors="replace")):
            self.tiers.setdefault(m.group(1), []).append(m.group(3) or "miss")


def _pct(xs: list[float]) -> dict:
    if not xs:
        return {}
    xs = sorted(xs)
    q = lambda p: round(xs[min(len(xs) - 1, int(p * len(xs)))] * 1000, 1)  # noqa: E731
    return {"n": len(xs), "p50_ms": q(0.5), "p90_ms": q(0.9), "p99_ms": q(0.99)}



def rss_growth(samples: list[dict]) -> Optional[dict]:
    """How much the lowest and the highest RSS sample of the last third of a run exceed the first
    third's, MB (None with fewer than 6 samples)."""
    if len(samples) < 6:
        return None
    k = len(samples) // 3
    first, last = [s["rss_mb"] for s in samples[:k]], [s["rss_mb"] for s in samples[-k:]]
    return {"low": round(min(last) - min(first), 1), "high": round(max(last) - max(first), 1)}



def soak_campaign(seconds: int, seed: int, work: Path, n_agents: int = 16, clients: int = 4) -> dict:
    sh = shared(work)
    model = str(sh.model)
    hot_mb, disk_mb = 1.0, 4.0  # tiny model, 288 B/token: all three tiers occur
    root = work / "soak-root"
    srv = Server(sh.model, work / "soak-home", options={**OPTIONS, "hot_mb": hot_mb, "disk_mb": disk_mb,
                                                         "cache_dir": str(root)})
    convs = [Conv(f"soak{k}", session_turns=12, words=40) for k in range(n_agents)]
    failures: list[dict] = []
    lat: list[tuple[float, str, float]] = []  # (t, tier, seconds)
    samples: list[dict] = []
    srv.start()
    tiers = LogTiers(srv.log_path)
    rss = RssSampler(interval=0.2).start(srv.pid)
    t0, stop = time.time(), threading.Event()
    warm = [0]

    def client(mine: list[Conv]) -> None:
        i = 0
        while not stop.is_set():
            c = mine[i % len(mine)]
            i += 1
            msgs = c.next_messages()
            t = time.perf_counter()
            try:
                text, cached, prompt = chat(srv.url, model, msgs, c.agent)
            except Exception as e:
                failures.append({"seed": seed, "t_s": round(time.time() - t0), "agent": c.agent,
                                 "problem": f"request failed: {e}"[:300]})
                continue
            dt = time.perf_counter() - t
            lat.append((time.time() - t0, tiers.next(c.agent), dt))
            c.complete(msgs, text, prompt)

    def sampler() -> None:
        while not stop.wait(2.0):
            try:
                s = status(srv)
            except Exception:
                continue
            samples.append({"t_s": round(time.time() - t0, 1), "rss_mb": round(rss.rss() / 2**20, 1),
                            "hot_bytes": s.get("hot_bytes", 0), "disk_bytes": s.get("disk_bytes", 0),
                            "disk_walk_bytes": tree_bytes(root), "budget_erasures": s.get("budget_erasures", 0)})
            if not warm[0] and time.time() - t0 > min(30.0, seconds / 4):
                warm[0] = rss.rss()

    threads = [threading.Thread(target=client, args=(convs[k::clients],), daemon=True) for k in range(clients)]
    run_for(threads + [threading.Thread(target=sampler, daemon=True)], seconds, stop)
    peak_after_warm = max((s["rss_mb"] for s in samples if warm[0] and s["t_s"] > min(30.0, seconds / 4)), default=0)
    final = status(srv)
    srv.stop()
    baseline = warm[0] or rss.peak
    bound_mb = baseline / 2**20 + hot_mb + OVERHEAD_MB
    if peak_after_warm > bound_mb:
        failures.append({"seed": seed, "problem": f"RSS {peak_after_warm} MB over {bound_mb:.0f} MB"})
    growth = rss_growth([s for s in samples if s["t_s"] > min(30.0, seconds / 4)])
    if growth is not None and seconds >= GROWTH_MIN_S and growth["low"] > GROWTH_MB + hot_mb:
        failures.append({"seed": seed, "problem": f"resident memory grew over the run: {growth} MB (last third "
                                                  "against the first; low: lowest samples, high: highest)"})
    disk_peak = max((s["disk_walk_bytes"] for s in samples), default=0)
    if disk_peak > disk_mb * 2**20 + TURN_SLACK:
        failures.append({"seed": seed, "problem": f"disk {disk_peak} bytes over disk_mb {disk_mb} MB + one turn"})
    windows = max(1, min(6, seconds // 10))
    per_window = []
    for w in range(windows):
        lo, hi = seconds * w / windows, seconds * (w + 1) / windows
        per_window.append({"from_s": round(lo), "to_s": round(hi), **{
            tier: _pct([d for t, k, d in lat if lo <= t < hi and k == tier]) for tier in ("hot", "disk", "miss")}})
    return {"trials": len(lat), "failures": len(failures), "failure_cases": failures[:20], "seconds_run": seconds,
            "agents": n_agents, "clients": clients, "hot_mb": hot_mb, "disk_mb": disk_mb,
            "rss_after_warmup_mb": round(baseline / 2**20, 1), "rss_peak_after_warmup_mb": peak_after_warm,
            "rss_bound_mb": round(bound_mb, 1), "rss_growth_mb": growth, "rss_growth_limit_mb": GROWTH_MB + hot_mb,
            "rss_growth_min_s": GROWTH_MIN_S, "disk_peak_bytes": disk_peak,
            "tiers": {k: sum(1 for _, t, _ in lat if t == k) for k in ("hot", "disk", "miss", "unknown")},
            "latency": per_window, "budget_erasures": final.get("budget_erasures", 0),
            "evicted_agents": final.get("evicted_agents", 0), "samples": samples[:: max(1, len(samples) // 60)]}
