"""End to end: matching by text never feeds the model text the client did not send.

A real `vllm-mlx serve --cache-backend persist_q4` subprocess (match_text on, the default) serves a
model whose tokenizer config sets clean_up_tokenization_spaces (as every Llama 3.x config does), driven
by the official openai client. After every request the test reads the agent's stored tokens from the
cache directory: their first `usage.prompt_tokens` are the prompt the model was fed (a turn is durable
before its response completes), and they must give the model the client's rendered conversation byte
for byte, with the same control tokens (`fed`, tests/test_text_match.py), wherever the client edited
it: inside the last user message, an earlier message, a previous reply; and when replies (streamed
or not) are replayed as they were received.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import openai
import pytest

from test_text_match import CLEAN, FILL, SPACED, fed
from vllm_mlx_persist.disk_format import decode_block
from vllm_mlx_persist.tools.models.build import build_model_dir
from vllm_mlx_persist.tools.serving import Server

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("models") / "llama-cleanup", arch="llama", size="tiny",
                           seed=0, clean_up_spaces=True)


@pytest.fixture(scope="module")
def tok(model_dir):
    from mlx_lm.tokenizer_utils import load

    return load(model_dir)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    options = {"block_size": 32, "hot_mb": 64, "cache_dir": str(home / "kv"), "key_format": "q4"}  # auto's choice here
    with Server(model_dir, home, options=options) as s:
        s.cache_dir = home / "kv"
        yield s


def stored_tokens(cache_dir: Path, agent: str) -> list[int]:
    """The agent's most recently used branch, read from its durable manifest and block files."""
    (model_dir,) = [p for p in cache_dir.iterdir() if (p / "model.json").is_file()]
    manifest = json.loads((model_dir / "agents" / (hashlib.sha256(agent.encode()).hexdigest() + ".json")).read_text())
    ids = manifest["branches"][-1]["block_ids"] if manifest.get("branches") else manifest["block_ids"]
    out: list[int] = []
    for bid in ids:
        (path,) = (model_dir / "blocks" / bid[:2]).glob(bid + ".*")
        out += decode_block(path.read_bytes(), bid).tokens.tolist()
    return out


class Conversation:
    """One agent's chat; every request is checked: the model was fed exactly the client's text."""

    def __init__(self, server, tok, agent: str, stream: bool = False):
        self.server, self.tok, self.agent, self.stream = server, tok, agent, stream
        self.client = openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0, timeout=300)
        self.cached: list[int] = []

    def send(self, messages: list[dict]) -> str:
        kw = dict(model=self.server.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0,
                  metadata={"agent_id": self.agent})
        if self.stream:
            text, usage = "", None
            for chunk in self.client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                usage = chunk.usage or usage
        else:
            r = self.client.chat.completions.create(**kw)
            text, usage = r.choices[0].message.content, r.usage
        details = usage.prompt_tokens_details
        self.cached.append((details.cached_tokens if details else 0) or 0)
        rendered = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        served = stored_tokens(self.server.cache_dir, self.agent)[: usage.prompt_tokens]
        assert fed(self.tok, served) == fed(self.tok, self.tok.encode(rendered)), (
            f"the model was fed\n{self.tok.decode(served, clean_up_tokenization_spaces=False)!r}\n"
            f"the client sent\n{rendered!r}\n{self.server.log_tail(5)}")
        return text

    def edit_point(self, before: list[dict], after: list[dict]) -> int:
        """Tokens the two conversations' prompts share."""
        a, b = (self.tok.apply_chat_template(m, add_generation_prompt=True) for m in (before, after))
        return next(i for i in range(min(len(a), len(b))) if a[i] != b[i])


def test_an_edit_inside_the_last_user_message(server, tok):
    """The client resends its turn with the spaces before '!' removed: the model reads it so."""
    c = Conversation(server, tok, "edit-last")
    first = [{"role": "user", "content": FILL + SPACED + " " + FILL}]
    c.send(first)
    edited = [{"role": "user", "content": FILL + CLEAN + " " + FILL}]
    c.send(edited)
    assert c.cached[1] >= c.edit_point(first, edited) - 1  # what precedes the edit is reused


def test_an_edit_inside_an_earlier_message(server, tok):
    c = Conversation(server, tok, "edit-earlier")
    first = [{"role": "system", "content": FILL + SPACED}, {"role": "user", "content": FILL}]
    reply = c.send(first)
    second = [{"role": "system", "content": FILL + CLEAN}, {"role": "user", "content": FILL},
              {"role": "assistant", "content": reply}, {"role": "user", "content": "next " + FILL}]
    c.send(second)
    assert c.cached[1] >= c.edit_point(first, second) - 1


def test_an_edit_inside_a_previous_reply(server, tok):
    """An assistant message in the history (a few-shot example the client wrote) edited later."""
    c = Conversation(server, tok, "edit-reply")
    history = [{"role": "user", "content": FILL}, {"role": "assistant", "content": FILL + SPACED},
               {"role": "user", "content": "again " + FILL}]
    c.send(history)
    edited = history[:1] + [{"role": "assistant", "content": FILL + CLEAN}] + history[2:]
    c.send(edited)
    assert c.cached[1] >= c.edit_point(history, edited) - 1


@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
def test_replies_replayed_as_received(server, tok, stream):
    """Replies come back as the client received them: cleaned of spaces before punctuation,
    stripped of whitespace (non-streamed), U+FFFD for bytes that are not UTF-8 (frequent with this
    random-weight model). Each later turn must still feed the client's text."""
    c = Conversation(server, tok, f"replay-{'s' if stream else 'n'}", stream=stream)
    messages: list[dict] = []
    for turn in range(4):
        messages.append({"role": "user", "content": f"turn {turn} ! " + FILL + SPACED})
        messages.append({"role": "assistant", "content": c.send(messages)})
    assert all(n > 0 for n in c.cached[1:]), c.cached  # earlier turns are still reused
