"""The conversations of `vllm-mlx-persist bench --sections edits`: agent histories rendered with the bench
model's chat template (a task, then assistant tool calls each answered by a user-role tool output),
the grid point an edit stubs, the edited next turn, and the truncation-policy trace."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from ...kv_edit.plan import message_anchor, realign_points
from .kit import FIXED_REPLY, Prompts

CALL_WORDS = 14  # an assistant tool call: ~30 tokens, a run longer than kv_edit.min_run_tokens
NEW_TOOL_WORDS = 24  # the tool output the edited turn appends
FILLER_TOKENS = (60, 200)  # other tool outputs
TAIL_TOKENS = 64  # room a grid point keeps after its edited messages


class Chat:
    """Token ids of messages rendered with the model's chat template."""

    def __init__(self, prompts: Prompts):
        self.tok = prompts.tok
        self.anchor = message_anchor(self.tok)
        self.realign = realign_points(self.tok)  # where the server's planner realigns (kv_edit.plan)
        self._one = len(self.ids([{"role": "user", "content": "a"}], gen=False))

    def ids(self, messages: list[dict], gen: bool = True) -> list[int]:
        ids = self.tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5: a BatchEncoding

    def size(self, message: dict) -> int:
        """Tokens one message adds to a rendering (the template's tokens around it included)."""
        return len(self.ids([{"role": "user", "content": "a"}, message], gen=False)) - self._one

    def sized(self, role: str, head: str, rng: random.Random, n_tokens: int) -> dict:
        """A message of `head` + words, as close to `n_tokens` (template included) as fits under it."""
        words = Prompts.words(rng, max(1, n_tokens)).split(" ")
        lo, hi = 0, len(words)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.size({"role": role, "content": " ".join([head, *words[:mid]])}) <= n_tokens:
                lo = mid
            else:
                hi = mid - 1
        return {"role": role, "content": " ".join([head, *words[:lo]])}


def call_msg(i: int, rng: random.Random) -> dict:
    return {"role": "assistant", "content": f"call {i}: " + Prompts.words(rng, CALL_WORDS)}


def tool_head(i: int) -> str:
    return f"[tool output {i}]"


def stub_msg(message: dict) -> dict:
    """The harness's stub for a tool output: '[tool output i truncated]'."""
    head = message["content"].split("]", 1)[0]
    return {"role": message["role"], "content": f"{head} truncated]"}


@dataclass(frozen=True)
class EditPoint:
    """A grid point: a history of about `history` tokens whose `edits` tool outputs of `span` tokens
    (each after an assistant call), the first starting at `position` of the history, are stubbed."""

    history: int
    position: float
    span: int
    edits: int

    @property
    def key(self) -> str:
        return f"{self.history}/{round(self.position * 100)}%/{self.span}x{self.edits}"

    @property
    def slug(self) -> str:
        """The key as an agent id allows it."""
        return f"{self.history}-{round(self.position * 100)}-{self.span}x{self.edits}"

    def fits(self) -> bool:
        return self.position * self.history + self.edits * (self.span + 40) + TAIL_TOKENS <= self.history


def _fill(chat: Chat, msgs: list[dict], n: int, until: int, i: int, rng: random.Random, keep: int) -> tuple[int, int]:
    """Append (call, tool output) pairs while the rendering stays `keep` tokens short of `until`; the
    last output is sized to land there. Returns (tokens, next tool number)."""
    while True:
        call = call_msg(i, rng)
        room = until - keep - n - chat.size(call)
        if room < 24:
            return n, i
        want = room if room <= FILLER_TOKENS[1] + 30 else rng.randint(*FILLER_TOKENS)
        out = chat.sized("user", tool_head(i), rng, want)
        msgs += [call, out]
        n += chat.size(call) + chat.size(out)
        i += 1


def edit_history(chat: Chat, seed: int, point: EditPoint) -> tuple[list[dict], list[int]]:
    """The unedited history (ending in a tool output) and the indices of the messages the edit stubs."""
    rng = random.Random(seed)
    msgs = [{"role": "user", "content": f"task {seed:016x}: " + Prompts.words(rng, 40)}]
    n = len(chat.ids(msgs, gen=False))
    probe = chat.size(call_msg(0, random.Random(0)))
    n, i = _fill(chat, msgs, n, round(point.position * point.history), 1, rng, keep=probe)
    targets = []
    for _ in range(point.edits):
        call = call_msg(i, rng)
        out = chat.sized("user", tool_head(i), rng, point.span)
        msgs += [call, out]
        targets.append(len(msgs) - 1)
        n += chat.size(call) + chat.size(out)
        i += 1
    _fill(chat, msgs, n, point.history, i, rng, keep=0)
    return msgs, targets


def edited_turn(history: list[dict], targets: Sequence[int], seed: int) -> list[dict]:
    """The next request: the history with its targets stubbed, the model's tool call and its output."""
    rng = random.Random(seed)
    i = sum(1 for m in history if m["role"] == "assistant") + 1
    edited = [stub_msg(m) if k in set(targets) else m for k, m in enumerate(history)]
    return edited + [{"role": "assistant", "content": f"call {i}: {FIXED_REPLY}"},
                     {"role": "user", "content": f"{tool_head(i)} " + Prompts.words(rng, NEW_TOOL_WORDS)}]


def trace_requests(chat: Chat, seed: int, turns: int, tool_tokens: int) -> list[list[dict]]:
    """The requests of a `turns`-turn agent: turn t sends the task and t (call, tool output) pairs,
    outputs older than two turns (i <= t - 2) replaced by a stub: the harness's truncation policy."""
    rng = random.Random(seed)
    task = {"role": "user", "content": f"task {seed:016x}: " + Prompts.words(rng, 40)}
    pairs = []
    for i in range(1, turns + 1):
        pairs.append((call_msg(i, rng), chat.sized("user", tool_head(i), rng, tool_tokens)))
    out = []
    for t in range(1, turns + 1):
        msgs = [task]
        for i, (call, tool) in enumerate(pairs[:t], start=1):
            msgs += [call, stub_msg(tool) if i <= t - 2 else tool]
        out.append(msgs)
    return out


def edit_position(chat: Chat, history: list[dict], targets: Sequence[int]) -> int:
    """The token the first stubbed message starts at."""
    return len(chat.ids(history[:targets[0]], gen=False))
