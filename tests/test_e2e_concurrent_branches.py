"""End to end on one real server (issue #53 item 7): three concurrent requests of one agent, a shared
~500-token base and each its own ~600-token tool result, then each branch's follow-up; with the
default bound (`branches` 4) each follow-up reuses its own branch's whole prompt (usage.cached_tokens).

The ChatML template re-renders the history: the reply comes back as its text, which for this model
holds bytes that are not UTF-8 (the client gets U+FFFD, never matched by text), so each follow-up
diverges inside its branch's stored reply and is stored beside it: five branches for a bound of
four. The one that goes must be one whose prompt another holds, never a sibling whose follow-up has
not come yet. Pool level, every commit order: tests/test_concurrent_branches.py.
"""

from __future__ import annotations

import threading

import pytest

from test_e2e_server import Chat, user_text
from vllm_mlx_persist.tools.models.build import build_model_dir
from vllm_mlx_persist.tools.serving import Server

# The defaults (blocks of 256, branches 4, match_text on), key_format q4: auto's choice here, without
# calibrating (tests/test_e2e_server.py says why).
OPTIONS = {"key_format": "q4"}
BASE = "base: " + " ".join(user_text("doc", k) for k in (9, 10))[:1300]


def tool_result(i: int) -> str:
    return f"tool result {i}: " + " ".join(user_text(f"tool{i}", k) for k in (12, 13))[:1500]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_model_dir(tmp_path_factory.mktemp("models") / "llama", arch="llama", size="tiny", seed=0)
    with Server(model_dir, tmp_path_factory.mktemp("home"), options=OPTIONS) as s:
        yield s


def test_three_concurrent_branches_each_reuse_their_whole_prompt_with_the_default_bound(server):
    chat = Chat("brancher")
    asks = [[{"role": "system", "content": BASE}, {"role": "user", "content": tool_result(i)}] for i in range(3)]
    outs: list = [None] * 3

    def run(i: int) -> None:
        outs[i] = chat.send(server, asks[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    reuse = []
    for i in range(3):
        text, _, prompt = outs[i]
        assert 900 < prompt < 1400, prompt  # ~500 base + ~600 tool result, in this tokenizer
        follow = asks[i] + [{"role": "assistant", "content": text}, {"role": "user", "content": "and?"}]
        _, cached, _ = chat.send(server, follow)
        reuse.append(cached / prompt)
    assert min(reuse) >= 1.0, (reuse, server.log_tail())
    info = server.get_json("/v1/agents/brancher")
    assert len(info["branches"]) <= 4, info
