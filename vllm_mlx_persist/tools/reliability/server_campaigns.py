"""Reliability campaigns against a real `vllm-mlx serve --cache-backend persist_q4` (tiny local model).

server_crash  SIGKILL the server at random moments (mid-request, right after a response, at a chosen
              write step through the store's fault hook) with several agents in flight; one server
              lifetime per kill. Every completed turn must be covered by the agent's next turn's
              cached_tokens, no request may fail while the server is up, and every reply must equal a
              never-killed reference server's reply to the same conversation.
disk          a small tmpfs filled up (injected ENOSPC where no tmpfs can be mounted), then injected EIO
              on fsync and on reads: requests keep succeeding with the reference's replies, memory stays
              within hot_mb + model + overhead, counters say what was not cached, and the cache works
              again (across a SIGKILL) once the fault is gone.
soak          16 agents round-robin with growing histories: RSS and disk sampled, both within budget,
              latency percentiles per tier (hot / disk / miss) over time.
storm         32 concurrent clients: agents, the same agent in parallel, aborted and disconnected
              streams, invalid bodies and ids; the server stays up, nothing hangs, and afterwards every
              agent answers exactly as a fresh server given the same history cold.
interactions  every feature at once on one server under tight hot and disk budgets and a short TTL:
              turns, concurrent agents, forks, concurrent branches, erasures and reused erased ids, pins,
              isolation probes, anonymous requests, SIGKILLs (between steps, mid-request, at a write
              step). Every answer equals a never-killed reference server's; every acknowledged turn (and
              a fork parent's) is reused unless the server's log records an erasure of the agent; erased
              agents never come back; /health answers within 1 s; memory and disk within their bounds.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from ...faults import ENV as FAULT_ENV
from ..serving import RssSampler, Server

# Matching by text off, as in tests/test_e2e_server.py: the campaigns compare replies with a reference
# given the same re-rendered messages, i.e. the same prompt tokens; with it on, an agent whose turn
# was not cached (a failing disk) is served as re-tokenized text, not as the tokens it generated.
OPTIONS = {"block_size": 32, "hot_mb": 64, "match_text": False}
MAX_TOKENS = 8
TIMEOUT_S = 120.0  # no request may take longer: past it, it counts as a hang
# Replies are compared with a reference server's token for token, but both servers batch whichever
# requests are in flight, and multi-threaded OpenBLAS splits a product differently by its row count:
# the last bits of the logits then depend on the batch partners, and a random-weight model's near-tied
# greedy choice can flip (1 reply in 148 did in one full run). One BLAS thread per server makes every
# row's result independent of the batch, so a different reply means a different cache.
BATCH_INVARIANT_ENV = {"OPENBLAS_NUM_THREADS": "1"}
# Soak memory: RSS may not grow (the lowest sample of the last third of the run within GROWTH_MB +
# hot_mb of the first third's lowest: what stays resident between requests), and may not pass the
# post-warm-up RSS + hot_mb + OVERHEAD_MB at any time. The overhead covers MLX's transient buffers of concurrent prefills (attention scores of a
# 2k-token chunk are tens of MB per layer and sequence), HTTP and threads: the one-hour run peaked at
# 600 MB over its post-warm-up RSS (4 clients prefilling up to ~2k-token histories at once), and went
# back to it between peaks. Growth is judged only on runs of GROWTH_MIN_S or more: in the first
# minutes the allocator's pools are still filling (a 40 s quick soak's minimum rose 92 MB), so a short
# run cannot tell growth from warm-up; it still reports the figure and checks the bound.
OVERHEAD_MB = 1024
GROWTH_MB = 64
GROWTH_MIN_S = 600
TURN_SLACK = 1 << 20  # disk may pass disk_mb by the save in progress (the budget is enforced after it)
# 4-bit K+V of the tiny llama: 2 layers x 2 x 2 KV heads x 64 dims x 0.5625 bytes (docs/operations.md)
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 9 // 16
WORDS = ("the cache keeps what the agent has read so that a returning agent only "
         "prefills what is new while every other agent keeps its own memory ").split()



def _run_for(threads: list[threading.Thread], seconds: float, stop: threading.Event) -> int:
    """Start `threads`, let them run `seconds`, set `stop`, join each for at most a request's time-out
    (plus slack); returns how many are still running (hung)."""
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(TIMEOUT_S + 10)
    return sum(t.is_alive() for t in threads)

def user_text(agent: str, turn: int, words: int = 40) -> str:
    body = " ".join(WORDS[(turn * 7 + len(agent) + i) % len(WORDS)] for i in range(words + 6 * turn))
    return f"{agent} turn {turn}: {body}"


class HttpError(Exception):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


def request(url: str, path: str, body: Any, *, headers: Optional[dict] = None, timeout: float = TIMEOUT_S,
            method: str = "POST") -> tuple[int, bytes]:
    host, port = url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def chat(url: str, model: str, messages: list[dict], agent: Optional[str], *,
         max_tokens: int = MAX_TOKENS, timeout: float = TIMEOUT_S, fork_from: Optional[str] = None,
         ) -> tuple[str, int, int]:
    """(reply, cached_tokens, prompt_tokens) of one greedy chat completion; HttpError if not 200."""
    body: dict = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
    if agent is not None:
        body["metadata"] = {"agent_id": agent, **({"fork_from": fork_from} if fork_from else {})}
    status, raw = request(url, "/v1/chat/completions", body, timeout=timeout)
    if status != 200:
        raise HttpError(status, raw.decode(errors="replace"))
    r = json.loads(raw)
    usage = r.get("usage") or {}
    cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    return r["choices"][0]["message"]["content"] or "", cached, usage.get("prompt_tokens", 0)


def status(srv: Server) -> dict:
    return srv.get_json("/v1/status").get("cache") or {}


class Shared:
    """What the campaigns of one run share: the tiny model and a never-killed reference server."""

    def __init__(self, work: Path):
        self.work = work
        self.model = work / "model"
        if not (self.model / "config.json").exists():  # in a subprocess: the campaign process stays MLX-free
            subprocess.run([sys.executable, "-m", "vllm_mlx_persist.cli", "make-model", str(self.model),
                            "--size", "tiny"], check=True, capture_output=True, timeout=600)
        self._ref: Optional[Server] = None
        self._memo: dict[str, str] = {}
        self._lock = threading.Lock()

    @property
    def ref(self) -> Server:
        with self._lock:
            if self._ref is None:
                self._ref = Server(self.model, self.work / "reference", options=OPTIONS,
                                   env=BATCH_INVARIANT_ENV).start()
            return self._ref

    def reply(self, agent: str, messages: list[dict]) -> str:
        """The reference server's reply to this conversation under this agent (memoized)."""
        key = agent + "\0" + json.dumps(messages)
        if key not in self._memo:
            self._memo[key] = chat(self.ref.url, str(self.model), messages, "ref-" + agent)[0]
        return self._memo[key]

    def cold(self, messages: list[dict]) -> str:
        """The reference server's reply to `messages` under an agent it has never seen."""
        return chat(self.ref.url, str(self.model), messages, f"cold-{time.time_ns()}")[0]

    def close(self) -> None:
        if self._ref is not None:
            self._ref.stop()


_SHARED: dict[Path, Shared] = {}


def shared(work: Path) -> Shared:
    if work not in _SHARED:
        _SHARED[work] = Shared(work)
    return _SHARED[work]


def close_shared() -> None:
    for s in _SHARED.values():
        s.close()
    _SHARED.clear()


class Conv:
    """One agent's conversation; sessions (fresh ids) keep histories bounded."""

    def __init__(self, name: str, session_turns: int = 5, words: int = 40):
        self.name, self.session, self.turn = name, 0, 0
        self.session_turns, self.words = session_turns, words
        self.messages: list[dict] = []
        self.last_prompt = 0  # prompt tokens of the last completed turn of this session
        self.lock = threading.Lock()

    @property
    def agent(self) -> str:
        return f"{self.name}-s{self.session}"

    def next_messages(self) -> list[dict]:
        return self.messages + [{"role": "user", "content": user_text(self.agent, self.turn, self.words)}]

    def complete(self, messages: list[dict], reply: str, prompt_tokens: int) -> None:
        self.messages = messages + [{"role": "assistant", "content": reply}]
        self.turn += 1
        self.last_prompt = prompt_tokens
        if self.turn >= self.session_turns:
            self.session, self.turn, self.messages, self.last_prompt = self.session + 1, 0, [], 0


# ---------------------------------------------------------------------------------------------
# server_crash


def rss_growth(samples: list[dict]) -> Optional[dict]:
    """How much the lowest and the highest RSS sample of the last third of a run exceed the first
    third's, MB (None with fewer than 6 samples)."""
    if len(samples) < 6:
        return None
    k = len(samples) // 3
    first, last = [s["rss_mb"] for s in samples[:k]], [s["rss_mb"] for s in samples[-k:]]
    return {"low": round(min(last) - min(first), 1), "high": round(max(last) - max(first), 1)}


def server_crash_campaign(trials: int, seed: int, work: Path, n_agents: int = 4) -> dict:
    sh = shared(work)
    model = str(sh.model)
    rng = random.Random(seed)
    srv = Server(sh.model, work / "server-crash", options=OPTIONS)
    convs = [Conv(f"crash{k}") for k in range(n_agents)]
    failures: list[dict] = []
    st: dict[str, Any] = {"completed_turns": 0, "turns_checked_across_a_kill": 0, "requests_killed_in_flight": 0,
                          "modes": {}, "write_point_kills": 0, "replies_compared": 0}
    modes = ["mid-request", "after-response", "write-point"]
    for trial in range(trials + 1):  # the last lifetime only checks every agent's next turn
        final = trial == trials
        mode = "final-check" if final else modes[trial % 3]
        point = rng.randint(1, 60) if mode == "write-point" else None
        srv.extra_env = {**BATCH_INVARIANT_ENV, **({FAULT_ENV: f"kill@{point}"} if point else {})}
        try:
            srv.start()
        except RuntimeError as e:
            failures.append({"trial": trial, "seed": seed, "mode": mode, "problem": f"restart failed: {str(e)[-300:]}"})
            break
        proc = srv.proc
        killed, stop = threading.Event(), threading.Event()
        responses, in_flight = [0], [0]
        crossed = {c.name: True for c in convs}  # the next turn of each agent spans a kill
        lock = threading.Lock()

        def run(c: Conv) -> None:
            while not stop.is_set():
                msgs = c.next_messages()
                try:
                    ref = sh.reply(c.agent, msgs)
                except Exception as e:  # the reference must not fail either
                    failures.append({"trial": trial, "seed": seed, "problem": f"reference server: {e}"})
                    return
                if stop.is_set():
                    return
                with lock:
                    in_flight[0] += 1
                try:
                    text, cached, prompt = chat(srv_url, model, msgs, c.agent)
                except Exception as e:
                    dead = killed.is_set()
                    if not dead and not isinstance(e, HttpError):
                        try:
                            proc.wait(3)
                            dead = True
                        except subprocess.TimeoutExpired:
                            pass
                    if dead:
                        with lock:
                            st["requests_killed_in_flight"] += 1
                    else:
                        failures.append({"trial": trial, "seed": seed, "mode": mode, "agent": c.agent,
                                         "turn": c.turn, "problem": f"request failed with the server up: {e}"[:400]})
                    return
                finally:
                    with lock:
                        in_flight[0] -= 1
                st["replies_compared"] += 1
                if text != ref:
                    failures.append({"trial": trial, "seed": seed, "mode": mode, "agent": c.agent, "turn": c.turn,
                                     "problem": f"reply {text!r} differs from the never-killed server's {ref!r}"})
                if c.turn > 0 and cached < c.last_prompt:
                    failures.append({"trial": trial, "seed": seed, "mode": mode, "agent": c.agent, "turn": c.turn,
                                     "problem": f"completed turn lost: cached {cached} < {c.last_prompt} tokens of "
                                                f"the turn before" + (" (across a kill)" if crossed[c.name] else "")})
                if c.turn > 0 and crossed[c.name]:
                    st["turns_checked_across_a_kill"] += 1
                crossed[c.name] = False
                c.complete(msgs, ref, prompt)
                with lock:
                    st["completed_turns"] += 1
                    responses[0] += 1
                    if mode == "after-response" and responses[0] >= target and not killed.is_set():
                        killed.set()
                        proc.send_signal(signal.SIGKILL)
                if final:
                    return

        srv_url = srv.url
        target = rng.randint(1, n_agents)
        threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in convs]
        for t in threads:
            t.start()
        deadline = time.time() + 90
        if mode == "mid-request":
            while in_flight[0] == 0 and time.time() < deadline and proc.poll() is None:
                time.sleep(0.005)
            time.sleep(rng.uniform(0, 1.0))
            killed.set()
            proc.send_signal(signal.SIGKILL)
        elif mode == "write-point":
            try:
                proc.wait(60)
                st["write_point_kills"] += 1
            except subprocess.TimeoutExpired:
                killed.set()
        elif mode == "after-response":
            while not killed.is_set() and time.time() < deadline and proc.poll() is None:
                time.sleep(0.005)
        if final:
            for t in threads:
                t.join(TIMEOUT_S + 10)
        stop.set()
        srv.stop(signal.SIGKILL)
        for t in threads:
            t.join(TIMEOUT_S + 10)
            if t.is_alive():
                failures.append({"trial": trial, "seed": seed, "mode": mode, "problem": "a client hung past its time-out"})
        st["modes"][mode] = st["modes"].get(mode, 0) + 1
    if st["turns_checked_across_a_kill"] == 0:
        failures.append({"seed": seed, "problem": "no turn was checked across a kill: the campaign checked nothing"})
    return {"trials": trials, "failures": len(failures), "failure_cases": failures[:20], **st}


# ---------------------------------------------------------------------------------------------
# disk


def _mount_tmpfs(path: Path, size_mb: float) -> Optional[str]:
    """Mount a tmpfs of size_mb at path; None on success, else why not."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size_mb * 1024)}k,mode=0700", "tmpfs", str(path)],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    return None if r.returncode == 0 else (r.stderr.strip() or f"mount exited {r.returncode}")


def _fill(path: Path) -> int:
    """Write path until the file system is full; returns bytes written."""
    n = 0
    with open(path, "wb", buffering=0) as f:
        chunk = b"\0" * 65536
        while True:
            try:
                n += f.write(chunk)
            except OSError:
                break
        while True:
            try:
                n += f.write(b"\0" * 512)
            except OSError:
                return n


def disk_campaign(trials: int, seed: int, work: Path, n_agents: int = 6) -> dict:
    """trials: rounds of every agent's turn per phase."""
    sh = shared(work)
    model = str(sh.model)
    mnt = work / "tmpfs"
    why_no_tmpfs = _mount_tmpfs(mnt, 8)
    sw = {k: work / f"switch-{k}" for k in ("eio-read", "eio-fsync", "enospc")}
    spec = f"EIO:read@{sw['eio-read']};EIO:fsync@{sw['eio-fsync']};ENOSPC:write,fsync@{sw['enospc']}"
    hot_mb = 0.25
    # disk_mb below the 8 MB file system and above the working set (6 agents, ~2.2 MB), as an operator
    # would set it: once the filler is gone, the budget (not ENOSPC) bounds the root, so space returns.
    opts = {**OPTIONS, "hot_mb": hot_mb, "disk_mb": 6, "write_timeout_s": 5, "cache_dir": str(mnt / "root")}
    srv = Server(sh.model, work / "disk-home", options=opts, env={FAULT_ENV: spec})
    convs = [Conv(f"disk{k}", session_turns=10**9, words=30) for k in range(n_agents)]
    failures: list[dict] = []
    phases: dict[str, dict] = {}
    rss = RssSampler(interval=0.1)
    peak_hot = [0, 0, 0]  # hot_bytes, hot_budget_bytes, most prompt tokens of one turn

    def rounds(phase: str, n: int, check_cached: bool = True, fresh: bool = False) -> None:
        if fresh:  # new agent ids: histories stay short however many rounds the campaign runs
            for c in convs:
                c.session, c.turn, c.messages, c.last_prompt = c.session + 1, 0, [], 0
        before = status(srv)
        ok = 0
        for _ in range(n):
            for c in convs:
                msgs = c.next_messages()
                ref = sh.reply(c.agent, msgs)
                try:
                    text, cached, prompt = chat(srv.url, model, msgs, c.agent)
                except Exception as e:
                    failures.append({"seed": seed, "phase": phase, "agent": c.agent, "problem": f"request failed: {e}"[:400]})
                    continue
                ok += 1
                if text != ref:
                    failures.append({"seed": seed, "phase": phase, "agent": c.agent, "turn": c.turn,
                                     "problem": f"reply {text!r} differs from the reference's {ref!r}"})
                if check_cached and c.turn > 0 and cached < c.last_prompt:
                    failures.append({"seed": seed, "phase": phase, "agent": c.agent, "turn": c.turn,
                                     "problem": f"cache did not recover: cached {cached} < {c.last_prompt}"})
                c.complete(msgs, ref, prompt)
                peak_hot[2] = max(peak_hot[2], prompt + MAX_TOKENS)
                s = status(srv)
                peak_hot[0], peak_hot[1] = max(peak_hot[0], s.get("hot_bytes", 0)), s.get("hot_budget_bytes", 0)
        after = status(srv)
        keys = ("write_errors", "save_failures", "saves_dropped", "unsaved_blocks_dropped", "read_errors",
                "quarantined", "hits_hot", "hits_disk", "misses", "retries")
        phases[phase] = {"requests_ok": ok, **{k: after.get(k, 0) - before.get(k, 0) for k in keys}}

    restarts = 0
    try:
        srv.start()
        rss.start(srv.pid)
        rounds("space", max(1, trials))
        baseline = rss.rss()
        if why_no_tmpfs is None:
            _fill(mnt / "filler")
        else:
            sw["enospc"].touch()
        rounds("full", trials, check_cached=False, fresh=True)
        (mnt / "filler").unlink(missing_ok=True)
        sw["enospc"].unlink(missing_ok=True)
        rounds("space-returned", trials, check_cached=False)
        # Found here: a retry of an older failed save, run after a newer turn was saved, put the older
        # manifest back (fixed in persister.py). Still open (pool.py, reported): the newer manifest may
        # name blocks of the failed turn that only its pending retry writes, so a SIGKILL before the retry
        # (1, 5, 30 s) cuts the chain there. The check below runs once the retries have settled.
        deadline = time.time() + 45
        while status(srv).get("saves_retrying", 0) and time.time() < deadline:
            time.sleep(0.5)
        srv.stop(signal.SIGKILL)
        srv.start()
        restarts += 1
        rss.watch(srv.pid)
        rounds("after-sigkill", 1)  # turns made after the disk recovered survived the kill
        sw["eio-fsync"].touch()
        rounds("eio-fsync", trials, check_cached=False, fresh=True)
        sw["eio-fsync"].unlink()
        rounds("fsync-recovered", 1, check_cached=False)
        srv.stop(signal.SIGTERM)
        srv.start()  # everything cold: the next turns read from disk
        restarts += 1
        rss.watch(srv.pid)
        sw["eio-read"].touch()
        rounds("eio-read", trials, check_cached=False)
        sw["eio-read"].unlink()
        srv.stop(signal.SIGKILL)
        srv.start()
        restarts += 1
        rss.watch(srv.pid)
        rounds("read-recovered", 1)
        peak = rss.stop()
        alive = srv.proc is not None and srv.proc.poll() is None
    finally:
        srv.stop()
        if why_no_tmpfs is None:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)
    full = phases["full"]
    if not (full["write_errors"] or full["save_failures"] or full["saves_dropped"] or full["unsaved_blocks_dropped"]):
        failures.append({"seed": seed, "phase": "full", "problem": f"no counter says what was not cached: {full}"})
    if phases["eio-read"]["read_errors"] == 0:
        failures.append({"seed": seed, "phase": "eio-read", "problem": "read_errors did not count the injected EIO"})
    if phases["eio-read"]["quarantined"]:
        failures.append({"seed": seed, "phase": "eio-read", "problem": "a sound file was quarantined on EIO"})
    bound = baseline + int((hot_mb + OVERHEAD_MB) * 2**20)
    if peak > bound:
        failures.append({"seed": seed, "problem": f"RSS peak {peak >> 20} MB over {bound >> 20} MB "
                                                   f"(post-warm-up {baseline >> 20} + hot_mb + {OVERHEAD_MB})"})
    turn_bytes = peak_hot[2] * TINY_KV_BYTES_PER_TOKEN + (64 << 10)  # the turn being committed, all unsaved
    if peak_hot[0] > peak_hot[1] + turn_bytes:
        failures.append({"seed": seed, "problem": f"hot_bytes {peak_hot[0]} over hot_mb {peak_hot[1]} + "
                                                   f"one turn ({turn_bytes})"})
    if not alive:
        failures.append({"seed": seed, "problem": "the server died"})
    n_req = sum(p["requests_ok"] for p in phases.values())
    return {"trials": n_req, "failures": len(failures), "failure_cases": failures[:20], "phases": phases,
            "tmpfs": "8 MB tmpfs (disk_mb 6) filled with a file" if why_no_tmpfs is None else
            f"no tmpfs ({why_no_tmpfs}): ENOSPC injected on write and fsync",
            "rss_baseline_mb": round(baseline / 2**20, 1), "rss_peak_mb": round(peak / 2**20, 1),
            "rss_bound_mb": round(bound / 2**20, 1), "hot_bytes_peak": peak_hot[0], "hot_budget_bytes": peak_hot[1],
            "hot_bound_bytes": peak_hot[1] + turn_bytes,
            "restarts": restarts}


# ---------------------------------------------------------------------------------------------
# soak


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


def _tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


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
                            "disk_walk_bytes": _tree_bytes(root), "budget_erasures": s.get("budget_erasures", 0)})
            if not warm[0] and time.time() - t0 > min(30.0, seconds / 4):
                warm[0] = rss.rss()

    threads = [threading.Thread(target=client, args=(convs[k::clients],), daemon=True) for k in range(clients)]
    _run_for(threads + [threading.Thread(target=sampler, daemon=True)], seconds, stop)
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


# ---------------------------------------------------------------------------------------------
# storm


BAD_IDS = ["", "../etc/passwd", "a" * 300, "bad\x00id", "sp ace", "x/y", "-lead", 12345, ["list"], {"d": 1}]
BAD_HEADER_IDS = ["../etc/passwd", "a" * 300, "sp ace", "x/y", "-lead", "%00"]
BAD_BODIES = [b"{not json", b"", b"[]", b'{"messages": "nope"}', b'{"model": 1, "messages": [{"role": 5}]}',
              b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}', b"\xff\xfe" * 50,
              b"[" * 10000]


def _abort_stream(url: str, model: str, messages: list, agent: str, rng: random.Random) -> None:
    host, port = url.split("//")[1].split(":")
    body = json.dumps({"model": model, "messages": messages, "max_tokens": 32, "temperature": 0.0, "stream": True,
                       "metadata": {"agent_id": agent}}).encode()
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        if rng.random() < 0.5:
            s.recv(rng.randint(1, 4096))  # some of the stream, then hang up
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST


def storm_campaign(seconds: int, seed: int, work: Path, clients: int = 32, n_agents: int = 8) -> dict:
    sh = shared(work)
    model = str(sh.model)
    srv = Server(sh.model, work / "storm-home", options=OPTIONS)
    srv.start()
    failures: list[dict] = []
    counts: dict[str, dict[str, int]] = {}
    histories: dict[str, list[list[dict]]] = {f"storm{k}": [] for k in range(n_agents)}  # completed conversations
    lock = threading.Lock()
    stop = threading.Event()
    slowest = [0.0]

    def count(kind: str, outcome: str) -> None:
        with lock:
            counts.setdefault(kind, {}).setdefault(outcome, 0)
            counts[kind][outcome] += 1

    def client(j: int) -> None:
        rng = random.Random(seed * 1000 + j)
        mine: dict[str, list[dict]] = {}
        while not stop.is_set():
            kind = rng.choices(["turn", "abort", "disconnect", "bad_body", "bad_id"], [6, 1, 1, 1, 1])[0]
            agent = f"storm{rng.randrange(n_agents)}"
            hist = mine.setdefault(agent, [])
            msgs = hist + [{"role": "user", "content": user_text(agent, len(hist) // 2, 20)}]
            t = time.perf_counter()
            try:
                if kind == "turn":
                    text, _, _ = chat(srv.url, model, msgs, agent)
                    mine[agent] = msgs + [{"role": "assistant", "content": text}] if len(hist) < 8 else []
                    with lock:
                        histories[agent].append(msgs + [{"role": "assistant", "content": text}])
                    count(kind, "200")
                elif kind == "abort":
                    _abort_stream(srv.url, model, msgs, agent, rng)
                    count(kind, "hung up")
                elif kind == "disconnect":
                    try:
                        chat(srv.url, model, msgs, agent, timeout=rng.uniform(0.01, 0.3))
                        count(kind, "finished first")
                    except (socket.timeout, TimeoutError):
                        count(kind, "hung up")
                elif kind == "bad_body":
                    code, _ = request(srv.url, "/v1/chat/completions", rng.choice(BAD_BODIES))
                    count(kind, str(code))
                    if code >= 500:
                        failures.append({"seed": seed, "client": j, "problem": f"invalid body answered {code}"})
                else:
                    if rng.random() < 0.5:
                        bad = rng.choice(BAD_IDS)
                        body = {"model": model, "messages": msgs, "max_tokens": 4, "metadata": {"agent_id": bad}}
                        code, _ = request(srv.url, "/v1/chat/completions", body)
                    else:
                        bad = rng.choice(BAD_HEADER_IDS)
                        code, _ = request(srv.url, "/v1/chat/completions", {"model": model, "messages": msgs,
                                          "max_tokens": 4}, headers={"X-Agent-ID": bad})
                    count(kind, str(code))
                    if code != 400:
                        failures.append({"seed": seed, "client": j, "problem": f"bad agent id {bad!r} answered {code}"})
            except (socket.timeout, TimeoutError) as e:
                failures.append({"seed": seed, "client": j, "kind": kind, "problem": f"hung past {TIMEOUT_S}s: {e}"})
            except Exception as e:
                count(kind, type(e).__name__)
                if kind == "turn":
                    failures.append({"seed": seed, "client": j, "problem": f"turn failed: {e}"[:300]})
            with lock:
                slowest[0] = max(slowest[0], time.perf_counter() - t)

    threads = [threading.Thread(target=client, args=(j,), daemon=True) for j in range(clients)]
    for _ in range(_run_for(threads, seconds, stop)):
        failures.append({"seed": seed, "problem": "a client thread hung"})
    alive = srv.proc is not None and srv.proc.poll() is None
    verified = 0
    try:
        if not alive or srv.get_json("/health").get("status") != "healthy":
            failures.append({"seed": seed, "problem": "the server is down after the storm"})
        else:
            # Every agent's cache is one it really computed: its next turn after each of a few of its
            # real conversations answers exactly as a fresh server given that history cold.
            rng = random.Random(seed)
            for agent, convs in histories.items():
                for h in rng.sample(convs, min(3, len(convs))) + convs[-1:]:
                    msgs = h + [{"role": "user", "content": f"{agent} after the storm"}]
                    got, cached, _ = chat(srv.url, model, msgs, agent)
                    want = sh.cold(msgs)
                    verified += 1
                    if got != want:
                        failures.append({"seed": seed, "agent": agent, "problem": f"after the storm: {got!r} "
                                         f"(cached {cached}) differs from a cold server's {want!r}"})
    finally:
        srv.stop()
    return {"trials": sum(sum(v.values()) for v in counts.values()), "failures": len(failures),
            "failure_cases": failures[:20], "clients": clients, "seconds_run": seconds, "requests": counts,
            "slowest_request_s": round(slowest[0], 2), "agents_verified_after": verified}


# ---------------------------------------------------------------------------------------------
# interactions


I_HOT_MB = 0.25  # ~900 tokens of the tiny llama in memory: two or three agents' histories
I_DISK_MB = 4.0  # ~12k tokens on disk: the last dozen or so agents; the budget erases older ones (tighter,
# it erased nearly every agent before its next turn, and no fork found its parent)
I_TTL_HOURS = 0.01  # 36 s: agents left alone that long go at the next sweep (every start, every minute);
# at 72 s the disk budget, erasing the least recently used first, always got to them before
I_OPTIONS = {**OPTIONS, "hot_mb": I_HOT_MB, "disk_mb": I_DISK_MB, "ttl_hours": I_TTL_HOURS, "durable_writes": True}
I_PROGRESS_STEPS = 250  # a long run's figures so far go to `progress` this often
I_TIMEOUT_S = 15.0  # a tiny-model turn answers in well under a second: past this the request hung
HEALTH_LIMIT_S = 1.0
I_WORDS = 30  # words of a user turn (~100 tokens)
I_MAX_TURNS = 7  # turns of a history, a fork's inherited ones included: an agent stops taking turns there
# and is no fork's parent (histories stay under ~1k tokens; counting own turns only, fork chains grew them to
# ~75 turns by step 10,000, and a step's cost with them: 34 turns sent per step instead of 5)
I_ACTIVE = (3, 8)  # conversations taking turns: a new one is started below 3, none above 8
DISK_BYTES_PER_TOKEN = 340  # measured: 29 blocks of 32 tokens took 308 kB on disk (headers, token ids)
I_DOCS = ["shared document A: " + user_text("docA", 9, 60), "shared document B: " + user_text("docB", 4, 60)]
# (op, weight): what a step does
I_OPS = (("turn", 30), ("concurrent", 14), ("fork", 12), ("branch", 8), ("rewind", 6), ("erase", 5), ("revisit", 4),
         ("pin", 4), ("unpin", 3), ("probe", 4), ("anonymous", 3), ("kill", 5), ("kill-mid", 3),
         ("write-point", 2))
# Kinds of step a run of any length makes (the quick run in tests/test_reliability.py: 30 steps):
# where a run's last steps are too few for the ones not drawn yet, they are made in this order
# (erase before revisit, which needs an erased agent).
I_COVER = ("concurrent", "fork", "branch", "erase", "revisit", "pin", "kill", "kill-mid")
_ERASED_RE = re.compile(r"erased agent '([^']+)' \(([^)]+)\)")
_UNCACHED_RE = re.compile(r"agent '([^']+)': (\d+) unsaved block\(s\) left memory uncached")


class _ErasureLog:
    """Follows the server log (one file across restarts): every erasure the persister logs, in order,
    as (agent, why) with why "request" (DELETE), "disk budget" or "ttl"; and, for diagnosis, the turns
    the hot budget dropped from memory before they were saved (agent, erasure position then)."""

    def __init__(self, path: Path):
        self.path, self.pos = path, 0
        self.events: list[tuple[str, str]] = []
        self.uncached: list[tuple[str, int]] = []

    def refresh(self) -> int:
        """Read what was logged since; returns how many erasures are known (a position to compare with)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except OSError:
            return len(self.events)
        cut = data.rfind(b"\n") + 1
        self.pos += cut
        for line in data[:cut].decode(errors="replace").splitlines():
            m = _ERASED_RE.search(line)
            if m:
                self.events.append((m.group(1), m.group(2)))
            m = _UNCACHED_RE.search(line)
            if m:
                self.uncached.append((m.group(1), len(self.events)))
        return len(self.events)

    def since(self, agent: str, seq: int) -> list[str]:
        """Why `agent` was erased after position `seq` (empty if it was not)."""
        return [why for a, why in self.events[seq:] if a == agent]


class _IConv:
    """One agent's conversation as the campaign knows it: its messages, and for each of its own turns
    along the current line what was acknowledged (prompt tokens, erasure-log position when sent)."""

    def __init__(self, agent: str, messages: list[dict], ref_key: str, parent: Optional[str] = None):
        self.agent, self.messages, self.ref_key, self.parent = agent, messages, ref_key, parent
        self.base = len(messages)  # messages before its own first turn (a document, or the parent's)
        self.acks: list[tuple[int, int]] = []  # (prompt tokens, erasure-log position when sent); 0: gone
        # What its requests' shared start must reuse, from the parent's acknowledged turn at the fork:
        # (tokens, parent, parent's position). Its own first turn then holds them too.
        self.from_parent: Optional[tuple[int, str, int]] = None
        self.seqs: list[int] = []  # tokens of its recent sequences (prompt + reply), for the memory bounds

    @property
    def turns(self) -> int:
        return len(self.acks)

    @property
    def history_turns(self) -> int:
        """Turns its history holds: the ones it started from (a fork's parent's, a probe's source's) and its own."""
        return (self.base - 1) // 2 + self.turns

    @property
    def last_prompt(self) -> int:
        return self.acks[-1][0] if self.acks else 0

    def messages_at(self, k: int, tag: str = "") -> list[dict]:
        """The conversation after its first `k` own turns, then a new user message."""
        user = {"role": "user", "content": user_text(self.agent + tag, k, I_WORDS)}
        return self.messages[: self.base + 2 * k] + [user]

    def need_at(self, k: int) -> tuple[int, Optional[tuple[str, int]]]:
        """What a request continuing its first `k` turns must reuse, and whose erasure since when
        excuses a shortfall: its own turn k-1, or (k = 0) the parent's turn it forked from."""
        if k > 0:
            prompt, seq = self.acks[k - 1]
            return prompt, (self.agent, seq)
        if self.from_parent is None:
            return 0, None
        tokens, parent, pseq = self.from_parent
        if self.acks and self.acks[0][0]:  # its own first turn holds them as well
            return tokens, (self.agent, self.acks[0][1])
        return tokens, (parent, pseq)

    def forget(self) -> None:
        """Erased as a whole (the log says so): nothing acknowledged is owed any more."""
        self.acks = [(0, seq) for _, seq in self.acks]
        self.from_parent = None

    def footprint(self) -> int:
        """Tokens it may hold at once: its last `branches` (4) sequences, shared prefixes counted again."""
        return sum(self.seqs[-4:])

    def complete(self, k: int, messages: list[dict], reply: str, prompt: int, sent_seq: int) -> None:
        """Its turn k (after k own turns) was acknowledged: the conversation goes on from there."""
        self.messages = messages + [{"role": "assistant", "content": reply}]
        self.acks = self.acks[:k] + [(prompt, sent_seq)]
        self.seqs.append(prompt + MAX_TOKENS)


class _ISpec:
    """One request of a step (several run at once in a concurrent step) and what its answer must show."""

    def __init__(self, what: str, agent: Optional[str], messages: list[dict], ref_key: str,
                 conv: Optional[_IConv] = None, fork_from: Optional[str] = None, k: int = 0):
        self.what, self.agent, self.messages, self.ref_key = what, agent, messages, ref_key
        self.conv, self.fork_from, self.k = conv, fork_from, k
        self.need, self.excuse = conv.need_at(k) if conv is not None and what not in ("probe", "revisit") else (0, None)
        self.ref: Optional[str] = None
        self.result: tuple[str, Any] = ("not-run", None)
        self.sent_seq = 0


_EXC_RE = re.compile(r"^(?:\w+\.)*\w+(?:Error|Exception): .*$", re.M)
_FRAME_RE = re.compile(r'File "[^"]*/(vllm_mlx_persist/[^"]+)", line (\d+), in (\w+)')


def _exception_since(log: Path, pos: int) -> str:
    """'; server: <the last exception logged after byte `pos`> at <its two deepest frames in this
    package>', or '' (what a 500 hides from the client)."""
    try:
        with open(log, "rb") as f:
            f.seek(pos)
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    excs = _EXC_RE.findall(text)
    if not excs:
        return ""
    tb = text[: text.rfind(excs[-1])]
    frames = _FRAME_RE.findall(tb[tb.rfind("Traceback"):])
    where = " at " + " > ".join(f"{f}:{n} ({fn})" for f, n, fn in frames[-2:]) if frames else ""
    return f"; server: {excs[-1][:200]}{where}"


def _manifests_of(root: Path, agent: str) -> list[str]:
    """Manifests (any model under `root`) whose agent is `agent`."""
    out = []
    for p in root.glob("*/agents/*.json"):
        try:
            if json.loads(p.read_bytes()).get("namespace") == agent:
                out.append(str(p.relative_to(root)))
        except (OSError, ValueError):
            pass
    return out


class _Abort(Exception):
    """The server under test cannot be started again: the campaign stops with what it has."""


class _Interactions:
    """The interactions campaign's state: one server under test SIGKILLed at random moments, the
    conversations it acknowledged, the agents erased and pinned, and the watchers (health, memory, disk)."""

    def __init__(self, seed: int, work: Path):
        self.sh = shared(work)
        self.model = str(self.sh.model)
        self.seed, self.rng = seed, random.Random(seed)
        self.root = work / "interactions-root"
        self.srv = Server(self.sh.model, work / "interactions-home", options={**I_OPTIONS, "cache_dir": str(self.root)},
                          env=BATCH_INVARIANT_ENV)
        self.elog = _ErasureLog(self.srv.log_path)
        self.convs: dict[str, _IConv] = {}
        self.erased: dict[str, list[dict]] = {}  # agents we erased and have not used since: their history
        self.pinned: set[str] = set()
        self.failures: list[dict] = []
        self.steps: list[str] = []
        self.step = 0
        self.next_id = 0
        self.fault_kill = False  # this lifetime was started with kill@N (it may die by itself)
        self.killing = False  # the campaign is killing the server now
        self.inflight_tokens = 0  # tokens of the turns the current step has in flight
        self.max_footprint = 0
        self.max_seq = 1024  # tokens of the longest sequence (prompt + reply) seen, at least a full turn
        self.seen_events = 0
        self.rss = RssSampler(interval=0.5)
        self.rss_baseline = 0
        self.st: dict[str, Any] = {
            "ops": {}, "lifetimes": {}, "answers": 0, "replies_compared": 0, "turns_checked": 0,
            "turns_checked_across_a_restart": 0, "losses_excused_by_erasure": 0, "fork_first_checked": 0,
            "erasures_requested": 0, "erased_revisited": 0, "probes": 0, "pins": 0, "unpins": 0,
            "requests_killed_in_flight": 0, "write_point_kills": 0, "killed_during_start": 0, "longest_history_turns": 0,
            "cold_replies_equal_to_cold_reference": 0,
            "health_polls": 0, "health_worst_s": 0.0, "health_late": 0,
            "hot_bytes_peak": 0, "hot_bound_at_peak": 0, "hot_over": 0,
            "disk_peak_bytes": 0, "disk_bound_at_peak": 0, "disk_over": 0}
        self.restarted: set[str] = set()  # agents whose next turn is the first since a restart
        self.pending_restart: Optional[str] = None
        self.op = ""  # the step's op as chosen (the step list gets what it did, once done)
        self.ended = ""  # how the last lifetime ended
        self._pause = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()

    # ---- bookkeeping --------------------------------------------------------------------------

    def fail(self, kind: str, problem: str, **extra: Any) -> None:
        self.failures.append({"kind": kind, "seed": self.seed, "step": self.step, "op": self.op,
                              "problem": problem[:600], **extra, "steps": self.steps[-10:]})

    def count(self, key: str, sub: Optional[str] = None) -> None:
        if sub is None:
            self.st[key] += 1
        else:
            self.st[key][sub] = self.st[key].get(sub, 0) + 1

    def refresh_log(self) -> int:
        """Read new erasures; a pinned agent erased by the budget or the TTL is a failure."""
        n = self.elog.refresh()
        for agent, why in self.elog.events[self.seen_events:]:
            if why != "request" and agent in self.pinned:
                self.fail("pinned-erased", f"pinned agent {agent} erased ({why})", agent=agent)
                self.pinned.discard(agent)
        self.seen_events = n
        return n

    def pinned_tokens(self) -> int:
        """(any thread) Tokens the pinned agents may hold; list() copies under the GIL, so the main
        thread's changes cannot break the iteration."""
        return sum(c.footprint() for c in map(self.convs.get, list(self.pinned)) if c is not None)

    # ---- the server ---------------------------------------------------------------------------

    def start(self, kill_at: Optional[int] = None) -> bool:
        """Start a lifetime (with kill@N: the server SIGKILLs itself before its Nth write step)."""
        self.srv.extra_env = {**BATCH_INVARIANT_ENV, **({FAULT_ENV: f"kill@{kill_at}"} if kill_at else {})}
        try:
            self.srv.start()
        except RuntimeError as e:
            if not kill_at:
                self.fail("start-failed", f"the server did not start: {str(e)[-400:]}")
                raise _Abort() from None
            self.count("killed_during_start")  # it reached its kill point while starting: start plain
            return self.start(None)
        self.fault_kill = bool(kill_at)
        self.killing = False
        if self.rss.pid is None:
            self.rss.start(self.srv.pid)
        else:
            self.rss.watch(self.srv.pid)
        self._pause.clear()
        self.after_start()
        return True

    def restart(self, mode: str, kill_at: Optional[int] = None) -> bool:
        self._pause.set()
        self.killing = True
        if self.srv.proc is not None and self.srv.proc.poll() is None:
            self.srv.stop(signal.SIGKILL)
        else:
            self.srv.stop()
        self.count("lifetimes", mode)
        self.restarted = set(self.convs)
        self.ended = mode
        return self.start(kill_at)

    def alive(self) -> bool:
        return self.srv.proc is not None and self.srv.proc.poll() is None

    def listed(self) -> Optional[set[str]]:
        ids: set[str] = set()
        after = ""
        while True:
            code, raw = request(self.srv.url, "/v1/agents?limit=1000" + (f"&after={after}" if after else ""), b"",
                                method="GET", timeout=I_TIMEOUT_S)
            if code != 200:
                self.fail("admin", f"GET /v1/agents answered {code}")
                return None
            page = json.loads(raw)
            ids |= {a["id"] for a in page["data"]}
            if not page["has_more"]:
                return ids
            after = page["last_id"]

    def after_start(self) -> None:
        """Right after a start: erased agents are not back; every acknowledged agent is there or an
        erasure the log records removed it."""
        try:
            on_disk = self.listed()
        except (OSError, ValueError) as e:
            self.fail("admin", f"GET /v1/agents after a start: {e!r}")
            return
        self.refresh_log()
        if on_disk is None:
            return
        for agent in self.erased:
            if agent in on_disk:
                self.fail("came-back", f"erased agent {agent} is listed again after a restart", agent=agent)
        for c in self.convs.values():
            if c.last_prompt and c.agent not in on_disk:
                if not self.elog.since(c.agent, c.acks[-1][1]):
                    # After a hang the persister may have deleted the agent and then waited forever for
                    # the pool's lock (its erasure callback) before logging it: named apart.
                    self.fail("vanished" + (":after-a-hang" if self.ended == "after-hung" else ""),
                              f"{c.agent} (acknowledged turn of {c.last_prompt} tokens) is not listed after the "
                              f"restart (the last lifetime ended: {self.ended}) and no erasure of it was logged",
                              agent=c.agent)
                c.forget()

    # ---- watchers -----------------------------------------------------------------------------

    def watch(self) -> None:
        """(thread) /health every 0.2 s within HEALTH_LIMIT_S; the pool's hot bytes and the root's
        disk bytes every second against their bounds. Paused while the campaign restarts the server."""
        try:
            self._watch()
        except Exception as e:  # the watcher must not stop silently: its silence would read as health
            with self._lock:
                self._late.append((self.step, f"the health watcher failed: {e!r}"[:200]))

    def _watch(self) -> None:
        i = 0
        while not self._stop.wait(0.2):
            if self._pause.is_set() or not self.alive():
                continue
            url, step, proc = self.srv.url, self.step, self.srv.proc
            t = time.monotonic()
            try:
                code, _ = request(url, "/health", b"", method="GET", timeout=HEALTH_LIMIT_S)
                problem = None if code == 200 else f"answered {code}"
            except Exception as e:
                problem = repr(e)[:100]
            dt = time.monotonic() - t

            def ended() -> bool:  # the lifetime polled is over (a kill; the next one may be up already)
                return self.srv.proc is not proc or proc.poll() is not None

            if problem is not None and not self._pause.is_set():
                # a reset while a kill takes it down is not a health failure: give its death up to 2 s
                # to show (a loaded machine, a fork server reporting the exit)
                for _ in range(10):
                    if ended():
                        break
                    time.sleep(0.2)
            if self._pause.is_set() or ended():
                continue
            with self._lock:
                self.st["health_polls"] += 1
                self.st["health_worst_s"] = round(max(self.st["health_worst_s"], dt), 3)
                if problem is None and dt > HEALTH_LIMIT_S:
                    problem = f"answered in {dt:.2f} s"
                if problem is not None:
                    self.st["health_late"] += 1
                    self._late.append((step, problem))
            i += 1
            if i % 4 == 0:
                self.sample_bounds(url, step)

    def sample_bounds(self, url: str, step: int) -> None:
        try:
            code, raw = request(url, "/v1/status", b"", method="GET", timeout=2.0)
            cache = json.loads(raw).get("cache") or {} if code == 200 else {}
        except Exception:
            cache = {}
        with self._lock:
            pinned = self.pinned_tokens()
            if cache.get("hot_budget_bytes") is not None:
                hot = cache.get("hot_bytes", 0)
                # the largest agent's last sequences: before any turn is acknowledged, the one in flight
                footprint = max(self.max_footprint, self.max_seq)
                bound = cache["hot_budget_bytes"] + (footprint + pinned) * TINY_KV_BYTES_PER_TOKEN + (64 << 10)
                if hot > self.st["hot_bytes_peak"]:
                    self.st["hot_bytes_peak"], self.st["hot_bound_at_peak"] = hot, bound
                if hot > bound:
                    self.st["hot_over"] += 1
                    self._over.append((step, f"hot_bytes {hot} over hot_mb + one agent + pinned = {bound}"))
            # a save's budget check runs before its turn is acknowledged, so the disk passes disk_mb by
            # the turns being written; pinned agents are never erased; model.json, the lock, manifests'
            # estimate: 64 kB
            disk = _tree_bytes(self.root)
            bound = int(I_DISK_MB * 2**20) + (self.inflight_tokens + pinned) * DISK_BYTES_PER_TOKEN + (64 << 10)
            if disk > self.st["disk_peak_bytes"]:
                self.st["disk_peak_bytes"], self.st["disk_bound_at_peak"] = disk, bound
            if disk > bound:
                self.st["disk_over"] += 1
                self._over.append((step, f"disk {disk} bytes over disk_mb + agents in flight + pinned = {bound}"))

    def drain_watch(self) -> None:
        """Turn what the watcher saw during the step into failures (one per kind and step)."""
        with self._lock:
            late, over = self._late, self._over
            self._late, self._over = [], []
        if late:
            self.fail("health", f"/health missed {HEALTH_LIMIT_S} s {len(late)} time(s) during step {late[0][0]}: "
                                f"{[p for _, p in late[:3]]}")
        for kind in ("hot_bytes", "disk"):
            mine = [p for _, p in over if p.startswith(kind)]
            if mine:
                self.fail("hot-over" if kind == "hot_bytes" else "disk-over", f"{mine[0]} ({len(mine)} sample(s))")

    # ---- requests -----------------------------------------------------------------------------

    def ask(self, spec: _ISpec) -> None:
        """(any thread) Send one request; spec.result = ("ok", (text, cached, prompt)) or
        ("dead" | "hung" | "error", why)."""
        url, proc = self.srv.url, self.srv.proc
        try:
            spec.result = ("ok", chat(url, self.model, spec.messages, spec.agent, timeout=I_TIMEOUT_S,
                                      fork_from=spec.fork_from))
        except HttpError as e:  # it answered: alive
            spec.result = ("error", str(e))
        except (socket.timeout, TimeoutError) as e:
            dead = proc.poll() is not None
            spec.result = ("dead" if dead else "hung", f"no answer in {I_TIMEOUT_S} s ({e!r})")
        except (OSError, http.client.HTTPException) as e:  # refused, reset or cut short: dead, or dying
            try:
                proc.wait(2)
                spec.result = ("dead", repr(e))
            except subprocess.TimeoutExpired:
                spec.result = ("error", repr(e))
        except Exception as e:  # anything else is the request's failure, never the campaign's crash
            spec.result = ("error", repr(e))

    def run_specs(self, specs: list[_ISpec], kill_after: Optional[float] = None) -> None:
        """Run the step's requests at once (SIGKILL the server `kill_after` s in), then check each; a
        restart they call for is left in `pending_restart` (after the step's turns are recorded)."""
        for sp in specs:
            try:
                sp.ref = self.sh.reply(sp.ref_key, sp.messages)
            except Exception as e:
                self.fail("reference", f"the reference server failed: {e}"[:400])
                return
        with self._lock:  # one turn per request in flight (at most the longest sequence seen)
            self.inflight_tokens = self.max_seq * len(specs)
        seq = self.refresh_log()
        log_pos = self.elog.pos
        for sp in specs:
            sp.sent_seq = seq
        threads = [threading.Thread(target=self.ask, args=(sp,), daemon=True) for sp in specs]
        for t in threads:
            t.start()
        killed = False
        if kill_after is not None:
            time.sleep(kill_after)
            self._pause.set()
            self.killing = killed = True
            self.srv.proc.send_signal(signal.SIGKILL)
        for t in threads:
            t.join(I_TIMEOUT_S + 10)
        self.refresh_log()
        recover = None
        for sp in specs:
            kind, what = sp.result
            if kind == "ok":
                self.check(sp, *what)
            elif kind == "dead":
                if killed or self.fault_kill:
                    self.count("requests_killed_in_flight")
                    recover = recover or ("write-point" if not killed else None)
                else:
                    self.fail("died", f"the server died under {sp.what} of {sp.agent}: {what}; "
                                      f"{self.srv.log_tail(8)[-600:]}", agent=sp.agent)
                    recover = "died"
            elif kind == "hung":
                self.fail("hung", f"{sp.what} of {sp.agent} (fork_from {sp.fork_from}) hung: {what}", agent=sp.agent)
                recover = "hung"
            else:
                code = re.match(r"HTTP (\d+)", what)
                server = _exception_since(self.srv.log_path, log_pos)
                if not server and code:  # the traceback may be logged just after the response
                    time.sleep(0.3)
                    server = _exception_since(self.srv.log_path, log_pos)
                self.fail(f"http-{code.group(1)}" if code else "request-error",
                          f"{sp.what} of {sp.agent} (fork_from {sp.fork_from}) failed: {what}{server}", agent=sp.agent)
        with self._lock:
            self.inflight_tokens = 0
        if killed:
            self.pending_restart = "kill-mid"
        elif recover == "write-point":
            self.count("write_point_kills")
            self.pending_restart = "write-point"
        elif recover is not None:
            self.pending_restart = f"after-{recover}"

    def check(self, sp: _ISpec, text: str, cached: int, prompt: int) -> None:
        """One answer: the reference's reply, and the reuse its agent's acknowledged state promises."""
        self.st["answers"] += 1
        self.st["replies_compared"] += 1
        who = f"{sp.what} of {sp.agent}" + (f" (fork_from {sp.fork_from})" if sp.fork_from else "")
        if text != sp.ref:
            # A prefill without a cache and one over a cached prefix agree to float rounding, not bit
            # for bit (docs/design.md), and a random model's near-tied greedy choice can flip between
            # them: an answer computed without a cache must equal the reference's without one.
            cold = self.sh.cold(sp.messages) if cached == 0 else None
            if cold is not None and text == cold:
                self.st["cold_replies_equal_to_cold_reference"] += 1
            else:
                self.fail("reply-differs", f"{who}: reply {text!r} differs from the reference's {sp.ref!r} "
                                           f"(cached {cached} of {prompt})"
                          + (f" and from its reply without a cache {cold!r}" if cold is not None else ""),
                          agent=sp.agent)
        if cached >= prompt > 0:
            self.fail("cached-all", f"{who}: cached {cached} of a {prompt}-token prompt", agent=sp.agent)
        if sp.what in ("probe", "revisit"):
            if cached:
                kind = "isolation" if sp.what == "probe" else "came-back"
                self.fail(kind, f"{who}: a new or erased id was served {cached} cached tokens", agent=sp.agent)
            return
        if not sp.need:
            return
        self.st["turns_checked" if sp.k else "fork_first_checked"] += 1
        if sp.k and sp.agent in self.restarted:
            self.st["turns_checked_across_a_restart"] += 1
        if cached >= sp.need:
            return
        owner, seq = sp.excuse
        if self.elog.since(owner, seq):
            self.st["losses_excused_by_erasure"] += 1
            if owner == sp.agent and sp.conv is not None:
                sp.conv.forget()
            return
        stats = {}
        try:
            s = status(self.srv)
            stats = {k: s.get(k) for k in ("budget_erasures", "ttl_erasures", "unsaved_blocks_dropped",
                                           "evicted_agents", "bad_blocks", "saves_dropped")}
        except Exception:
            pass
        what = (f"its acknowledged turn {sp.k - 1}" if sp.k else f"the turn of {owner} it forked from")
        # The log says when the hot budget dropped a turn whose save was still queued (the same turn the
        # response then acknowledged as durable): named apart, it is a failure all the same.
        dropped = any(a == owner and at >= seq for a, at in self.elog.uncached)
        self.fail(("lost-turn" if sp.k else "fork-lost") + (":evicted-while-saving" if dropped else ""),
                  f"{who}: cached {cached} < {sp.need} tokens of {what}"
                  + (" (its first turn since a restart)" if sp.agent in self.restarted else "")
                  + f"; no erasure of {owner} logged; stats {stats}", agent=sp.agent)

    # ---- steps --------------------------------------------------------------------------------

    def new_conv(self, parent: Optional[_IConv] = None) -> _IConv:
        agent = f"i{self.next_id}"
        self.next_id += 1
        if parent is None:
            c = _IConv(agent, [{"role": "system", "content": self.rng.choice(I_DOCS)}], agent)
        else:
            c = _IConv(agent, list(parent.messages), parent.ref_key, parent.agent)
            if parent.last_prompt:
                c.from_parent = (parent.last_prompt, parent.agent, parent.acks[-1][1])
        self.convs[agent] = c
        return c

    def active(self) -> list[_IConv]:
        return [c for c in self.convs.values() if c.history_turns < I_MAX_TURNS]

    def pick(self, with_history: bool = False, room: bool = False) -> Optional[_IConv]:
        """A conversation at random: one with a turn of its own (`with_history`), or one that may take
        another turn (`room`, or neither)."""
        pool = [c for c in self.convs.values() if c.turns > 0] if with_history else self.active()
        if room:
            pool = [c for c in pool if c.history_turns < I_MAX_TURNS]
        return self.rng.choice(pool) if pool else None

    def pick_or_new(self) -> _IConv:
        active = self.active()
        if len(active) < I_ACTIVE[0] or (len(active) < I_ACTIVE[1] and self.rng.random() < 0.15):
            return self.new_conv()
        return self.rng.choice(active)

    def turn_spec(self, c: _IConv, what: str = "turn", k: Optional[int] = None, tag: str = "") -> _ISpec:
        """A request of `c` after its first `k` turns (default: all of them: its next turn)."""
        k = c.turns if k is None else k
        return _ISpec(what, c.agent, c.messages_at(k, tag), c.ref_key, c, c.parent, k)

    def finish_turns(self, specs: list[_ISpec]) -> None:
        """Acknowledged turns move their conversations on (one per conversation)."""
        done: set[str] = set()
        for sp in specs:
            if sp.result[0] == "ok" and sp.conv is not None and sp.conv.agent not in done \
                    and self.convs.get(sp.conv.agent) is sp.conv:
                done.add(sp.conv.agent)
                sp.conv.complete(sp.k, sp.messages, sp.ref, sp.result[1][2], sp.sent_seq)
                self.restarted.discard(sp.conv.agent)
                self.st["longest_history_turns"] = max(self.st["longest_history_turns"], sp.conv.history_turns)
                with self._lock:
                    self.max_footprint = max(self.max_footprint, sp.conv.footprint())
                    self.max_seq = max(self.max_seq, sp.conv.seqs[-1])

    def do_step(self, op: str) -> str:
        """Run one step; returns its description for the step list."""
        rng = self.rng
        if op == "turn":
            c = self.pick_or_new()
            specs = [self.turn_spec(c)]
            self.run_specs(specs)
            self.finish_turns(specs)
            return f"turn {c.agent}" + (f"<-{c.parent}" if c.parent else "") + f" t{c.turns}"
        if op in ("concurrent", "kill-mid"):
            convs = list({id(c): c for c in (self.pick_or_new() for _ in range(rng.randint(2, 3)))}.values())
            specs = [self.turn_spec(c) for c in convs]
            kill_after = rng.uniform(0.0, 0.6) if op == "kill-mid" else None
            self.run_specs(specs, kill_after)
            self.finish_turns(specs)
            return f"{op} " + ",".join(sp.agent for sp in specs) + (f" kill@{kill_after:.2f}s" if kill_after else "")
        if op == "fork":
            parent = self.pick(with_history=True, room=True)  # the child's turns count its parent's
            if parent is None:
                return self.do_step("turn")
            child = self.new_conv(parent)
            specs = [self.turn_spec(child, "fork")]
            self.run_specs(specs)
            self.finish_turns(specs)
            return f"fork {child.agent}<-{parent.agent}"
        if op == "branch":
            c = self.pick(with_history=True)
            if c is None or c.history_turns >= I_MAX_TURNS:
                return self.do_step("turn")
            specs = [self.turn_spec(c, "branch", tag=f"-b{i}") for i in range(rng.randint(2, 3))]
            self.run_specs(specs)
            self.finish_turns(specs)  # the conversation goes on along the first branch answered
            return f"branch {c.agent} x{len(specs)}"
        if op == "rewind":  # an earlier message edited: a new branch from an earlier turn (a fork's own
            c = self.pick(with_history=True)  # first message: a branch that ties with its parent's)
            if c is None:
                return self.do_step("turn")
            k = 0 if c.parent and rng.random() < 0.5 else rng.randrange(c.turns)
            specs = [self.turn_spec(c, "rewind", k, tag=f"-r{self.step}")]
            self.run_specs(specs)
            self.finish_turns(specs)
            return f"rewind {c.agent} to turn {k}"
        if op == "erase":
            c = self.pick(with_history=True)
            if c is None:
                return self.do_step("turn")
            self.erase(c)
            return f"erase {c.agent}"
        if op == "revisit":
            if not self.erased:
                return self.do_step("fork")
            agent = rng.choice(sorted(self.erased))
            old = self.erased.pop(agent)[: 1 + 2 * (I_MAX_TURNS - 1)]  # its start, if long: the bound holds
            c = _IConv(agent, old, f"revisit-{agent}")  # a new conversation of the same id
            self.convs[agent] = c
            specs = [self.turn_spec(c, "revisit")]
            self.run_specs(specs)
            self.finish_turns(specs)
            self.st["erased_revisited"] += 1
            return f"revisit {agent}"
        if op in ("pin", "unpin"):
            c = self.pick(with_history=True) if op == "pin" else \
                (self.convs.get(rng.choice(sorted(self.pinned))) if self.pinned else None)
            if c is None:
                return self.do_step("turn")
            self.pin(c, op == "pin")
            return f"{op} {c.agent}"
        if op == "probe":
            src = self.pick(with_history=True, room=True)  # the probe's turn counts the source's
            if src is None:
                return self.do_step("turn")
            probe = self.new_conv()
            probe.messages, probe.ref_key = list(src.messages), src.ref_key
            probe.base = len(probe.messages)
            specs = [self.turn_spec(probe, "probe")]
            self.run_specs(specs)
            self.finish_turns(specs)
            self.st["probes"] += 1
            return f"probe {probe.agent} on {src.agent}'s history"
        if op == "anonymous":
            src = self.pick(with_history=True)
            if src is None:
                return self.do_step("turn")
            self.run_specs([_ISpec("anonymous", None, src.messages_at(src.turns, "-anon"), src.ref_key)])
            return f"anonymous on {src.agent}'s history"
        if op == "kill":
            self.restart("kill")
            return "kill"
        if op == "write-point":
            point = rng.randint(1, 60)
            self.restart("kill", kill_at=point)
            return f"write-point kill@{point} (restarted)"
        raise ValueError(op)

    def erase(self, c: _IConv) -> None:
        self.refresh_log()
        try:
            code, raw = request(self.srv.url, f"/v1/agents/{c.agent}", b"", method="DELETE", timeout=I_TIMEOUT_S)
        except (socket.timeout, TimeoutError):
            self.fail("hung", f"DELETE /v1/agents/{c.agent} did not answer in {I_TIMEOUT_S} s", agent=c.agent)
            self.pending_restart = "after-hung"
            return
        except OSError as e:
            self.fail("admin", f"DELETE /v1/agents/{c.agent}: {e!r}", agent=c.agent)
            return
        self.refresh_log()
        if code == 404 and c.last_prompt and not self.elog.since(c.agent, c.acks[-1][1]):
            self.fail("admin", f"DELETE /v1/agents/{c.agent} answered 404 for an agent with an acknowledged turn "
                               "and no erasure logged", agent=c.agent)
        elif code not in (200, 404):
            self.fail("admin", f"DELETE /v1/agents/{c.agent} answered {code}: {raw[:200]!r}", agent=c.agent)
        if code == 200:
            self.st["erasures_requested"] += 1
            if request(self.srv.url, f"/v1/agents/{c.agent}", b"", method="GET", timeout=I_TIMEOUT_S)[0] != 404:
                self.fail("came-back", f"GET /v1/agents/{c.agent} right after its DELETE is not 404", agent=c.agent)
            left = _manifests_of(self.root, c.agent)
            if left:
                self.fail("came-back", f"a manifest of {c.agent} is on disk after its DELETE: {left}", agent=c.agent)
        self.gone(c)

    def gone(self, c: _IConv) -> None:
        """`c` was erased (or its DELETE found nothing): its history waits for a revisit."""
        del self.convs[c.agent]
        self.pinned.discard(c.agent)
        self.erased[c.agent] = c.messages

    def pin(self, c: _IConv, on: bool) -> None:
        self.refresh_log()
        try:
            code, _ = request(self.srv.url, f"/v1/agents/{c.agent}/pin", b"", method="PUT" if on else "DELETE",
                              timeout=I_TIMEOUT_S)
        except (socket.timeout, TimeoutError):
            self.fail("hung", f"pin {c.agent} did not answer in {I_TIMEOUT_S} s", agent=c.agent)
            self.pending_restart = "after-hung"
            return
        except OSError as e:
            self.fail("admin", f"pin {c.agent}: {e!r}", agent=c.agent)
            return
        if code == 200:
            (self.pinned.add if on else self.pinned.discard)(c.agent)
            self.count("pins" if on else "unpins")
        elif not (code == 404 and (not c.last_prompt or self.elog.since(c.agent, c.acks[-1][1]))):
            self.fail("admin", f"{'PUT' if on else 'DELETE'} /v1/agents/{c.agent}/pin answered {code}", agent=c.agent)

    def run(self, n_steps: int, progress: Optional[Callable[[dict], None]] = None,
            every: int = I_PROGRESS_STEPS) -> dict:
        """`n_steps` steps, then the final check; `progress` gets the figures so far every `every` steps
        (a partial result: no final check). Stopped by KeyboardInterrupt (SIGINT, or SIGTERM as
        `reliability` turns it into one), it returns the figures of the steps done, marked stopped."""
        self._late: list[tuple[int, str]] = []
        self._over: list[tuple[int, str]] = []
        watcher = threading.Thread(target=self.watch, name="interactions-watch", daemon=True)
        ops, weights = zip(*I_OPS)
        try:
            self.sh.ref  # the reference first: its start-up is not part of any lifetime
            self.start()
            watcher.start()
            for self.step in range(n_steps):
                if not self.alive():  # it killed itself at a write point between steps, or crashed
                    if self.fault_kill:
                        self.count("write_point_kills")
                        self.restart("write-point")
                    else:
                        self.fail("died", f"the server died between steps: {self.srv.log_tail(8)[-600:]}")
                        self.restart("after-died")
                missing = [k for k in I_COVER if k not in self.st["ops"]]
                if missing and n_steps - self.step <= len(missing):
                    self.op = op = missing[0]
                else:
                    self.op = op = self.rng.choices(ops, weights)[0]
                desc = self.do_step(op)
                self.count("ops", desc.split()[0])  # what it did (an op with nothing to act on falls back)
                self.steps.append(f"{self.step} {desc}")
                if self.pending_restart:
                    mode, self.pending_restart = self.pending_restart, None
                    self.restart(mode)
                self.refresh_log()
                self.drain_watch()
                if self.step == 4:
                    self.rss_baseline = self.rss.rss()
                if progress is not None and (self.step + 1) % every == 0 and self.step + 1 < n_steps:
                    progress(self.result(self.step + 1, stopped=True))
            # The last lifetime: a restart, then every conversation's next turn is checked.
            self.op = "final-check"
            self.restart("final-check")
            live = [c for c in self.convs.values() if c.last_prompt]
            for k in range(0, len(live), 3):
                specs = [self.turn_spec(c) for c in live[k:k + 3]]
                self.run_specs(specs)
                self.finish_turns(specs)
                if self.pending_restart:
                    mode, self.pending_restart = self.pending_restart, None
                    self.restart(mode)
            self.steps.append(f"{n_steps} final-check of {len(live)} agents")
            self.count("lifetimes", "end")
            self.refresh_log()
            self.drain_watch()
        except _Abort:
            n_steps = self.step
        except KeyboardInterrupt:  # the steps done so far (a step cut short is not counted)
            return self.result(min(len(self.steps), n_steps), stopped=True)
        finally:
            self._stop.set()
            self.srv.stop(signal.SIGKILL)
            if self.rss.pid is not None:
                self.rss.stop()
        return self.result(n_steps)

    def result(self, n_steps: int, stopped: bool = False) -> dict:
        """The figures of the first `n_steps` steps; `stopped`: the run ends (or is looked at) before its
        final check, which is then not part of them (nothing is added to the failures themselves)."""
        failures = list(self.failures)
        bound = (self.rss_baseline or self.rss.peak) + int((I_HOT_MB + OVERHEAD_MB) * 2**20)
        if self.rss.peak > bound:
            failures.append({"kind": "rss-over", "seed": self.seed, "step": n_steps, "op": "", "steps": [],
                             "problem": f"RSS peak {self.rss.peak >> 20} MB over {bound >> 20} MB (post-warm-up "
                                        f"{self.rss_baseline >> 20} + hot_mb + {OVERHEAD_MB})"})
        if n_steps and not stopped and self.st["turns_checked_across_a_restart"] == 0:
            failures.append({"kind": "checked-nothing", "seed": self.seed, "step": n_steps, "op": "", "steps": [],
                             "problem": "no acknowledged turn was checked across a restart"})
        kinds: dict[str, dict] = {}
        for f in failures:
            k = kinds.setdefault(f["kind"], {"count": 0, "first_step": f["step"], "first": f})
            k["count"] += 1
        # the first failure of each kind first, so the report shows every kind
        firsts = [k["first"] for k in kinds.values()]
        cases = firsts + [f for f in failures if f not in firsts]
        budget = sum(1 for _, why in self.elog.events if why == "disk budget")
        ttl = sum(1 for _, why in self.elog.events if why == "ttl")
        return {"trials": n_steps, "failures": len(failures), "failure_cases": cases[:20], "seed": self.seed,
                "stopped_before_final_check": stopped,
                "failure_kinds": {k: {"count": v["count"], "first_step": v["first_step"]} for k, v in kinds.items()},
                **self.st, "budget_erasures_logged": budget, "ttl_erasures_logged": ttl,
                "agents": self.next_id, "hot_mb": I_HOT_MB, "disk_mb": I_DISK_MB, "ttl_hours": I_TTL_HOURS,
                "block_size": OPTIONS["block_size"], "rss_after_warmup_mb": round(self.rss_baseline / 2**20, 1),
                "rss_peak_mb": round(self.rss.peak / 2**20, 1), "rss_bound_mb": round(bound / 2**20, 1),
                "steps": self.steps[:3000]}


def interactions_campaign(trials: int, seed: int, work: Path, progress: Optional[Callable[[dict], None]] = None,
                          every: int = I_PROGRESS_STEPS) -> dict:
    """`trials` random steps mixing turns, forks, concurrent branches, erasures, pins, probes and SIGKILL
    restarts on one server under tight hot and disk budgets, every answer compared with a never-killed
    reference server; then one more restart and every conversation's next turn checked. `progress`
    gets the figures so far every `every` steps (a long run stopped keeps them)."""
    return _Interactions(seed, work).run(trials, progress, every)
