"""What the interactions campaign (interactions.py, `vllm-mlx-persist reliability --campaigns
interactions`) knows: its budgets and mix of steps, each conversation and what the server acknowledged
of it, each request of a step and what its answer must show, and the server log's erasures and
exceptions.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

from .server_kit import MAX_TOKENS, OPTIONS, user_text


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


class ErasureLog:
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


class IConv:
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


class ISpec:
    """One request of a step (several run at once in a concurrent step) and what its answer must show."""

    def __init__(self, what: str, agent: Optional[str], messages: list[dict], ref_key: str,
                 conv: Optional[IConv] = None, fork_from: Optional[str] = None, k: int = 0):
        self.what, self.agent, self.messages, self.ref_key = what, agent, messages, ref_key
        self.conv, self.fork_from, self.k = conv, fork_from, k
        self.need, self.excuse = conv.need_at(k) if conv is not None and what not in ("probe", "revisit") else (0, None)
        self.ref: Optional[str] = None
        self.result: tuple[str, Any] = ("not-run", None)
        self.sent_seq = 0


_EXC_RE = re.compile(r"^(?:\w+\.)*\w+(?:Error|Exception): .*$", re.M)
_FRAME_RE = re.compile(r'File "[^"]*/(vllm_mlx_persist/[^"]+)", line (\d+), in (\w+)')


def exception_since(log: Path, pos: int) -> str:
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


def manifests_of(root: Path, agent: str) -> list[str]:
    """Manifests (any model under `root`) whose agent is `agent`."""
    out = []
    for p in root.glob("*/agents/*.json"):
        try:
            if json.loads(p.read_bytes()).get("namespace") == agent:
                out.append(str(p.relative_to(root)))
        except (OSError, ValueError):
            pass
    return out


class Abort(Exception):
    """The server under test cannot be started again: the campaign stops with what it has."""
