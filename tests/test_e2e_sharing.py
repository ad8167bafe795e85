"""End to end on one real server: forks (metadata and header), sibling/parent isolation, erasing a
parent, a SIGKILL restart, three concurrent branches of one agent, and a reply that re-tokenizes
differently, whose output must equal a cold greedy run on the tokens the cache holds.

Tolerance: greedy decoding; a reused 4-bit prefix gives the same greedy tokens as a cold prefill on
these models (tests/test_pool.py bounds the logits), and we assert identical text.
"""

from __future__ import annotations

import signal
import threading

import mlx.core as mx
import openai
import pytest

from test_e2e_lifecycle import call
from test_e2e_server import MAX_TOKENS, Chat, user_text
from test_e2e_text_match import stored_tokens
from test_text_match import fed
from vllm_mlx_persist.tools.models.build import build_model_dir
from vllm_mlx_persist.tools.serving import Server

# Room for 8 branches: this model's replies hold bytes that are not UTF-8, which the client gets as
# U+FFFD and which are never matched by text (tests/test_text_match.py), so a replayed reply starts a
# new branch beside the one it replays; three concurrent branches and their follow-ups are 6.
# key_format q4: auto's choice here, without calibrating (tests/test_e2e_server.py says why).
OPTIONS = {"block_size": 32, "hot_mb": 64, "branches": 8, "key_format": "q4"}
DOC = "shared document: " + user_text("doc", 9) + " " + user_text("doc", 10)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("models") / "llama", arch="llama", size="tiny", seed=0)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with Server(model_dir, tmp_path_factory.mktemp("home"), options=OPTIONS) as s:
        yield s


class Worker(Chat):
    """A Chat whose requests also name a fork parent (metadata or header)."""

    def __init__(self, agent: str, parent: str | None, via: str = "metadata"):
        super().__init__(agent, id_via="metadata" if via == "metadata" else "header")
        self.parent, self.via = parent, via

    def send(self, server, messages):
        if self.parent is None:
            return super().send(server, messages)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0, timeout=300)
        kw: dict = {}
        if self.via == "metadata":
            kw["metadata"] = {"agent_id": self.agent, "fork_from": self.parent}
        else:
            kw["extra_headers"] = {"X-Agent-ID": self.agent, "X-Agent-Fork-From": self.parent}
        r = client.chat.completions.create(model=server.model, messages=messages, max_tokens=MAX_TOKENS,
                                           temperature=0.0, **kw)
        details = r.usage.prompt_tokens_details
        return r.choices[0].message.content, (details.cached_tokens if details else 0) or 0, r.usage.prompt_tokens


def doc_messages(task: str) -> list[dict]:
    return [{"role": "system", "content": DOC}, {"role": "user", "content": task}]


def test_fork_fan_out_isolation_erasure_and_restart(server):
    coord = Chat("coord")
    _, _, doc_tokens = coord.send(server, doc_messages("summarize"))
    workers = [Worker("w-meta", "coord", "metadata"), Worker("w-head", "coord", "header")]
    first = []
    for w in workers:
        text, cached, prompt = w.send(server, doc_messages(f"task for {w.agent}"))
        first.append(text)
        # First turn reuses the parent's prefix (the document; the task differs)
        assert 0 < cached < prompt and cached >= doc_tokens - 40, (w.agent, cached, doc_tokens, server.log_tail())
    # Same answer as a cold agent on the same prompt.
    for w, text in zip(workers, first):
        cold, cached, _ = Chat(f"cold-{w.agent}").send(server, doc_messages(f"task for {w.agent}"))
        assert cached == 0 and cold == text

    # Each worker's second turn reuses its own first turn; siblings never see each other's turns.
    convs = {}
    for w, text in zip(workers, first):
        msgs = doc_messages(f"task for {w.agent}") + [{"role": "assistant", "content": text},
                                                       {"role": "user", "content": "go on"}]
        convs[w.agent] = msgs
        _, cached, prompt = w.send(server, msgs)
        assert cached > doc_tokens
    other = workers[1]
    _, cached, _ = Chat(other.agent).send(server, convs[workers[0].agent])  # w-head on w-meta's turns
    assert cached < doc_tokens + 20
    _, cached, _ = Chat("coord").send(server, convs[workers[0].agent])  # the parent on a child's turns
    assert cached < doc_tokens + 20

    info = server.get_json("/v1/agents/w-meta")
    assert info["shared_blocks"] > 0 and info["forked_from"] == ["coord"], info
    stats = server.get_json("/v1/cache/stats")
    assert "shared_blocks" in str(stats) and "fork_hits" in str(stats)

    # Erasing the parent leaves the children working, also after a SIGKILL restart.
    assert call(server, "DELETE", "/v1/agents/coord", key=None)[0] == 200
    for w in workers:
        _, cached, _ = w.send(server, convs[w.agent])
        assert cached > doc_tokens
    server.restart(signal.SIGKILL)
    for w in workers:
        text, cached, _ = Chat(w.agent).send(server, convs[w.agent])
        assert cached > doc_tokens, server.log_tail()
    status, _ = call(server, "GET", "/v1/agents/coord", key=None)
    assert status == 404


@pytest.mark.parametrize("how", ["metadata", "header"])
def test_bad_fork_source_is_400(server, how):
    for bad in ("bad id!", "w-self"):
        w = Worker("w-self", bad, how)
        with pytest.raises(openai.BadRequestError):
            w.send(server, doc_messages("x"))
    assert Chat("after-bad").send(server, doc_messages("x"))[0] is not None


def test_a_fork_its_parent_does_not_allow_is_403_on_every_api(server):
    """The parent's own setting (admin API) closes it to forks: OpenAI and Anthropic clients get 403 and
    learn nothing of its history; reopened, the same fork reuses its prefix."""
    import anthropic

    _, _, doc_tokens = Chat("guarded").send(server, doc_messages("keep this"))
    assert call(server, "DELETE", "/v1/agents/guarded/forkable", key=None)[0] == 200
    assert call(server, "GET", "/v1/agents/guarded", key=None)[1]["forkable"] is False
    with pytest.raises(openai.PermissionDeniedError, match="may not fork"):
        Worker("peek", "guarded", "header").send(server, doc_messages("guess"))
    claude = anthropic.Anthropic(base_url=server.url, api_key="test", max_retries=0, timeout=120)
    with pytest.raises(anthropic.PermissionDeniedError, match="may not fork"):
        claude.messages.create(model=server.model, messages=[{"role": "user", "content": DOC}], max_tokens=4,
                               extra_headers={"X-Agent-ID": "peek", "X-Agent-Fork-From": "guarded"})
    assert call(server, "PUT", "/v1/agents/guarded/forkable", key=None)[0] == 200
    _, cached, _ = Worker("peek", "guarded", "header").send(server, doc_messages("guess"))
    assert cached >= doc_tokens - 40, server.log_tail()


def test_three_concurrent_branches_each_reuse_their_own(server):
    base = Chat("brancher")
    base.turn(server, 0)
    history = list(base.messages)
    branches = [history + [{"role": "user", "content": user_text(f"branch{i}", 1)}] for i in range(3)]
    outs: list = [None] * 3

    def run(i):
        outs[i] = base.send(server, branches[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    for i in range(3):
        text, cached, prompt = outs[i]
        follow = branches[i] + [{"role": "assistant", "content": text}, {"role": "user", "content": "and?"}]
        _, cached2, _ = base.send(server, follow)
        assert cached2 >= prompt - 2, (i, cached2, prompt)  # its own whole branch, not just the history
    info = server.get_json("/v1/agents/brancher")
    assert len(info["branches"]) >= 3, info


def _greedy(model, tokens, n, eos):
    from vllm_mlx_persist.caches.q4 import make_q4_prompt_cache

    cache = make_q4_prompt_cache(model, 4, 64)
    logits = model(mx.array(tokens)[None], cache=cache)
    out = []
    for _ in range(n):
        t = int(mx.argmax(logits[0, -1]).item())
        out.append(t)
        if t in eos:
            break
        logits = model(mx.array([[t]]), cache=cache)
    return out


def test_reply_that_retokenizes_differently_is_still_reused(server, model_dir):
    from mlx_lm import load

    from vllm_mlx_persist.caches.attention import install_attention_fix

    install_attention_fix()
    model, tok = load(str(model_dir))
    eos = set(tok.eos_token_ids)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0, timeout=300)

    def complete(prompt, agent):
        r = client.completions.create(model=server.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                      extra_body={"prompt_cache_key": agent})
        complete.prompt_tokens = r.usage.prompt_tokens
        return r.choices[0].text, (r.usage.prompt_tokens_details.cached_tokens or 0)

    for attempt in range(6):  # find a reply whose tokens are not how its text tokenizes
        # (" answer" then a reply starting with a letter: its first word merges differently)
        t1 = user_text(f"retok{attempt}", attempt) + " answer"
        p1 = tok.encode(t1)
        g = _greedy(model, p1, MAX_TOKENS, eos)
        reply, _ = complete(t1, f"retok-{attempt}")
        assert tok.decode(g) == reply  # the in-process reference decodes as the server does
        t2 = t1 + reply + " next question: " + user_text("more", 1)
        p2 = tok.encode(t2)
        # Not a reply with bytes that are not UTF-8: its U+FFFD is not the client's, never matched.
        if p2[: len(p1) + len(g) - 1] != p1 + g[:-1] and "\ufffd" not in reply:
            break
    else:
        pytest.skip("no reply re-tokenized differently")
    stored = (p1 + g)[: len(p1) + len(g) - 1]  # the cache covers all but the last generated token
    k = next(i for i in range(len(p2)) if stored[i] != p2[i])
    text2, cached = complete(t2, f"retok-{attempt}")
    assert cached > k, (cached, k)  # reuse went on past where the tokens differ
    # The served prompt, as the turn stored it (durable before the response completed).
    served = stored_tokens(server.home / ".cache" / "vllm-mlx-persist", f"retok-{attempt}")[: complete.prompt_tokens]
    assert served[:k] == stored[:k] and served != p2
    assert fed(tok, served) == fed(tok, p2)  # byte for byte the client's text
    assert tok.decode(_greedy(model, served, MAX_TOKENS, eos)) == text2
