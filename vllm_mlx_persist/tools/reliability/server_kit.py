"""What the campaigns against a real `vllm-mlx serve --cache-backend persist_q4` (tiny local model) share:
the HTTP client, the tiny model and a never-killed reference server, an agent's conversation in
sessions, their bounds and time-outs. Used by server_crash.py, disk_faults.py, soak.py, storm.py and
interactions.py (`vllm-mlx-persist reliability --campaigns server_crash,disk,soak,storm,interactions`),
and by tests/test_e2e_interactions.py.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from ..serving import Server


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
# Memory: RSS may not pass the post-warm-up RSS + hot_mb + OVERHEAD_MB at any time (soak, disk,
# interactions). The overhead covers MLX's transient buffers of concurrent prefills (attention scores of a
# 2k-token chunk are tens of MB per layer and sequence), HTTP and threads: the one-hour soak peaked at
# 600 MB over its post-warm-up RSS (4 clients prefilling up to ~2k-token histories at once), and went
# back to it between peaks.
OVERHEAD_MB = 1024
# 4-bit K+V of the tiny llama: 2 layers x 2 x 2 KV heads x 64 dims x 0.5625 bytes (docs/operations.md)
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 9 // 16
WORDS = ("the cache keeps what the agent has read so that a returning agent only "
         "prefills what is new while every other agent keeps its own memory ").split()



def run_for(threads: list[threading.Thread], seconds: float, stop: threading.Event) -> int:
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



def tree_bytes(path: Path) -> int:
    """Bytes of every file under `path` (links counted as links, not followed)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total
