"""Concurrent turns of one agent keep each other (issue #53 item 7), on real MLX.

Three requests of one agent run at once: a shared base and each its own tool result. Their commits
land in any order; then each branch's follow-up arrives, re-rendering the history: the reply comes
back as its text re-tokenizes, so the follow-up diverges from its branch inside the stored reply
(this model's replies even hold bytes that are not UTF-8, never matched by text) and is stored as a
new branch beside the one it was served from. With `branches` = 4 the fifth branch evicts one: it
must be a branch whose whole prompt another branch holds (its only own tokens are a reply as
generated, which the client re-rendered), never a sibling whose follow-up has not come yet.
End to end: tests/test_e2e_sharing.py (`test_concurrent_branches_under_the_default_bound`).
"""

from __future__ import annotations

import itertools

import pytest

from test_pool import make_pool, prefill, tokens
from test_sharing import check_accounting
from vllm_mlx_persist.tools.models.build import build_model


@pytest.fixture(scope="module")
def model():
    m, _ = build_model("llama", "tiny", seed=0)
    return m


def serve(pool, model, agent, prompt, out, rid):
    """One request: lookup (in flight as `rid`), prefill the rest and `out` (the reply as generated),
    commit prompt + reply. Returns (tokens reused, the finishing function)."""
    hit, n, _ = pool.lookup(agent, prompt, request_id=rid)
    seq = prompt + out
    cache, _ = prefill(model, seq[n:], hit) if n else prefill(model, seq)
    return n, (lambda: (pool.commit(agent, seq, cache, request_id=rid), pool.finish(rid)))


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))), ids=lambda o: "".join(map(str, o)))
def test_each_concurrent_branch_is_found_by_its_own_follow_up(model, tmp_path, order):
    pool = make_pool(model, tmp_path)
    assert pool.max_branches == 4  # the default bound
    base = tokens(40)
    prompts = [base + tokens(30, seed=10 + i) for i in range(3)]
    replies = [tokens(6, seed=20 + i) for i in range(3)]
    # Looked up before any of them commits (concurrent), then committed in `order`.
    pending = [serve(pool, model, "a", p, r, f"first-{i}")[1] for i, (p, r) in enumerate(zip(prompts, replies))]
    for i in order:
        pending[i]()
    assert len(pool.agent("a").branches) == 3
    for i in range(3):
        # The history re-rendered: the reply's first token as stored, then tokenized otherwise.
        follow = prompts[i] + replies[i][:1] + tokens(4, seed=30 + i) + tokens(8, seed=40 + i)
        n, done = serve(pool, model, "a", follow, tokens(6, seed=50 + i), f"follow-{i}")
        assert n >= len(prompts[i]), (order, i, n, len(prompts[i]))  # its own whole prompt
        done()
    check_accounting(pool)
    pool.close()


def test_a_branch_nothing_else_holds_still_goes_least_recently_used_first(model, tmp_path):
    """Branches no other holds the prompt of are evicted as before: the least recently used."""
    pool = make_pool(model, tmp_path)
    pool.max_branches = 2
    base = tokens(20)
    b = [base + tokens(20, seed=60 + i) for i in range(3)]
    for i in range(3):
        n, done = serve(pool, model, "a", b[i], tokens(4, seed=70 + i), f"r{i}")
        done()
    assert pool.stats["branches_evicted"] == 1
    assert pool.lookup("a", b[0] + [1])[1] == 20  # the oldest went
    assert pool.lookup("a", b[2] + [1])[1] == 40
    pool.close()
