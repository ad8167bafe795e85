"""Sharing in the block pool, on real MLX: forks share blocks by reference, agents keep several
branches, and matching goes on across a re-tokenization. End to end: tests/test_e2e_sharing.py.

Tolerances as in test_pool.py: reused vs cold prefill logits within COLD_HOT_TOL, same greedy token;
anything read back (hot, shared, reloaded) bit-identical.
"""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import pytest

from vllm_mlx_persist.tools.models import build_model
from vllm_mlx_persist.chain import Branch
from vllm_mlx_persist.pool import BlockPool
from vllm_mlx_persist.text_match import align as _align
from test_pool import COLD_HOT_TOL, assert_same_cache, make_pool, prefill, tokens


@pytest.fixture(scope="module")
def model():
    m, _ = build_model("llama", "tiny", seed=0)
    return m


def check_accounting(pool: BlockPool) -> None:
    """Every hot block counted once; references equal the agents naming each block; the disk
    index counts each block once per manifest naming it."""
    assert pool.check() == []  # the block table's invariants (blocks.BlockTable.check)
    names = Counter(b for a in pool.agents.all() for b in a.ids)
    assert pool.refs == dict(names)
    assert pool.snapshot()["shared_blocks"] == sum(1 for n in names.values() if n > 1)
    assert set(pool.blocks) == set(names)
    if pool.persister is not None:
        pool.flush()
        disk = Counter(b for a in pool.persister.agents.values() for b in a.block_ids)
        assert pool.persister.block_refs == dict(disk)


def commit(pool, model, agent, seq, fork_from=None):
    """Serve `seq` as a request of `agent` (reusing what lookup finds), then commit it."""
    hit, n, _ = pool.lookup(agent, seq, fork_from=fork_from)
    cache, _ = prefill(model, seq[n:], hit) if n else prefill(model, seq)
    assert pool.commit(agent, seq, cache, fork_from=fork_from) == len(seq)
    return n


def test_fork_shares_the_parents_blocks_by_reference(model, tmp_path):
    pool = make_pool(model, tmp_path)
    doc = tokens(70)  # 4 whole blocks of 16 and a tail
    cache_p, _ = prefill(model, doc)
    pool.commit("parent", doc, cache_p)
    parent_ids = list(pool.agent("parent").ids)

    # First turn of a child: the parent's whole prefix, bit-identical to what the parent stored.
    q1 = doc + tokens(20, seed=1)
    hit, n, _ = pool.lookup("w1", q1, fork_from="parent")
    assert n == 70 and pool.stats["fork_hits"] == 1
    assert_same_cache(hit, cache_p)
    cache1, hot_logits = prefill(model, q1[n:], hit)
    _, cold_logits = prefill(model, q1)
    assert mx.abs(hot_logits - cold_logits).max().item() < COLD_HOT_TOL
    pool.commit("w1", q1, cache1, fork_from="parent")
    check_accounting(pool)

    # Siblings share the parent's whole blocks, nothing else, even with the same continuation.
    assert commit(pool, model, "w2", q1, fork_from="parent") == 70
    w1, w2 = pool.agent("w1").ids, pool.agent("w2").ids
    assert set(w1) & set(w2) == set(parent_ids[:4])
    assert pool.agent_info("w1")["shared_blocks"] == 4 and pool.agent_info("w1")["forked_from"] == ["parent"]
    assert pool.agent("parent").ids.keys() == dict.fromkeys(parent_ids).keys()  # parent unaffected
    check_accounting(pool)

    # The child's later turns are its own: the parent and a sibling never reuse them.
    q2 = q1 + tokens(20, seed=2)
    assert commit(pool, model, "w1", q2) == 90
    assert pool.lookup("parent", q2)[1] == 70
    assert pool.lookup("w2", q2)[1] == 90  # its own identical turn, not w1's
    assert pool.lookup("w3", q2)[1] == 0  # no fork named: nothing

    # Erasing the parent: children keep working, in memory and after a restart.
    assert pool.erase("parent")
    check_accounting(pool)
    for agent in ("w1", "w2"):
        hit, n, _ = pool.lookup(agent, q2 + [7])
        assert n >= 90
    pool.close()
    pool = make_pool(model, tmp_path)
    assert pool.agent("parent") is None
    hit, n, tier = pool.lookup("w1", q2 + [7])
    assert (n, tier) == (len(q2), "disk")
    _, hot_logits = prefill(model, [7], hit)
    _, cold_logits = prefill(model, q2 + [7])
    assert mx.abs(hot_logits - cold_logits).max().item() < COLD_HOT_TOL
    check_accounting(pool)
    pool.close()


def test_child_with_a_shorter_own_match_takes_the_parents(model, tmp_path):
    pool = make_pool(model, tmp_path)
    doc = tokens(64)
    commit(pool, model, "child", doc[:20])  # its own short history on the same text
    commit(pool, model, "parent", doc)
    q = doc + tokens(10, seed=3)
    assert pool.lookup("child", q)[1] == 20
    assert pool.lookup("child", q, fork_from="parent")[1] == 64
    commit(pool, model, "child", q, fork_from="parent")
    assert pool.agent_info("child")["shared_blocks"] == 4
    check_accounting(pool)
    pool.close()


def test_three_concurrent_branches_each_keep_their_continuation(model, tmp_path):
    pool = make_pool(model, tmp_path)
    history = tokens(40)
    commit(pool, model, "a", history)
    # Three requests looked up before any of them commits (concurrent), each its own continuation.
    seqs = [history + tokens(30, seed=10 + i) for i in range(3)]
    caches = []
    for s in seqs:
        hit, n, _ = pool.lookup("a", s)
        assert n == 40
        caches.append(prefill(model, s[n:], hit)[0])
    for s, c in zip(seqs, caches):
        pool.commit("a", s, c)
    assert len(pool.agent("a").branches) == 3  # the history was replaced by its continuations
    check_accounting(pool)
    for s in seqs:  # each follow-up reuses its own whole branch
        assert pool.lookup("a", s + tokens(5, seed=99))[1] == 70
    # ... also after a restart
    pool.close()
    pool = make_pool(model, tmp_path)
    for s in seqs:
        assert pool.lookup("a", s + [3])[1] == 70
    check_accounting(pool)
    pool.close()


def test_least_recently_used_branch_goes_first(model, tmp_path):
    fmt_pool = make_pool(model, tmp_path)
    fmt_pool.max_branches = 2
    pool = fmt_pool
    history = tokens(20)
    b = [history + tokens(20, seed=20 + i) for i in range(3)]
    commit(pool, model, "a", b[0])
    commit(pool, model, "a", b[1])
    pool.lookup("a", b[0] + [1])  # b0 is now more recent than b1
    commit(pool, model, "a", b[2])  # over the limit: b1 goes
    assert pool.stats["branches_evicted"] == 1
    assert pool.lookup("a", b[0] + [1])[1] == 40
    assert pool.lookup("a", b[2] + [1])[1] == 40
    assert pool.lookup("a", b[1] + [1])[1] == 20  # only the common history
    check_accounting(pool)
    pool.flush()
    files = {p.stem for p in (tmp_path).glob("*/blocks/*/*.safetensors")}
    assert files == set(pool.agent("a").ids)  # the evicted branch's own blocks are deleted
    pool.close()


def test_hot_budget_counts_a_shared_block_once(model, tmp_path):
    pool = make_pool(model, tmp_path)
    doc = tokens(64)
    commit(pool, model, "parent", doc)
    one_agent = pool.hot_bytes
    for w in range(4):
        commit(pool, model, f"w{w}", doc + [5, 6], fork_from="parent")
    tail_bytes = pool.hot_bytes - one_agent
    assert tail_bytes < one_agent  # 4 children added 4 small tails, not 4 copies of the document
    check_accounting(pool)

    # Evict the parent: the shared blocks it owned go cold, the children reload them from disk.
    pool.agents.evict(pool.agent("parent"), durable=True)
    check_accounting(pool)
    hit, n, tier = pool.lookup("w0", doc + [5, 6, 7])
    assert n == 66 and tier == "disk"
    check_accounting(pool)

    # Erase the parent while a child holds its blocks hot: they become orphans, still counted once,
    # and a budget squeeze drops them too.
    assert pool.erase("parent")
    check_accounting(pool)
    pool.hot_budget = 0
    pool._enforce_budget()
    assert pool.hot_bytes == 0
    check_accounting(pool)
    assert pool.lookup("w3", doc + [5, 6, 7])[1] == 66
    pool.close()


# A toy detokenizer over the tiny model's vocabulary: ids 5..9 spell "a", "b", "ab", "c", "bc", every
# other id a distinct word. So [7] and [5, 6] are the same text, as are [5, 9] and [7, 8].
_TEXT = {5: "a", 6: "b", 7: "ab", 8: "c", 9: "bc"}


def toy_decode(ids):
    return "".join(_TEXT.get(int(i), f" w{int(i)}") for i in ids)


def test_align_finds_where_the_text_agrees_again():
    k = 3
    stored = [100, 101, 102, 7, 8, 200, 201]
    prompt = [100, 101, 102, 5, 9, 200, 201, 300]
    assert _align(stored, prompt, k, toy_decode) == (2, 2)  # "abc" both ways, then 200 == 200
    assert _align([100, 101, 102, 7], [100, 101, 102, 5, 6, 300], k, toy_decode) == (1, 2)
    assert _align([100, 101, 102, 8], [100, 101, 102, 5, 6, 300], k, toy_decode) is None


def test_retokenized_reply_is_reused_and_served_as_the_stored_tokens(model, tmp_path):
    pool = make_pool(model, tmp_path)
    pool.decode = toy_decode
    turn1 = tokens(30, seed=4) + [7, 8] + tokens(10, seed=5)  # a "reply" holding "ab" "c"
    commit(pool, model, "a", turn1)
    retok = turn1[:30] + [5, 9] + turn1[32:]  # the same text, tokenized as "a" "bc"
    prompt = retok + tokens(12, seed=6)
    m = pool.match("a", prompt)
    assert m.num_tokens == len(turn1) and m.prompt == turn1 + prompt[len(retok):]
    assert pool.stats["text_matches"] == 1
    # Served as the stored tokens: identical to a cold run on that token sequence.
    _, hot_logits = prefill(model, m.prompt[m.num_tokens:], m.cache)
    _, cold_logits = prefill(model, m.prompt)
    assert mx.abs(hot_logits - cold_logits).max().item() < COLD_HOT_TOL
    assert mx.argmax(hot_logits).item() == mx.argmax(cold_logits).item()
    # Without a decoder the match stops at the re-tokenization.
    pool.decode = None
    assert pool.match("a", prompt).num_tokens == 30
    pool.close()


def test_fetched_branches_are_chain_checked_and_merged_with_local_ones(model, tmp_path):
    """The pool's side of the fleet tier (fleet.py; Redis itself in test_remote.py and end to end in
    test_e2e_fleet.py): a fork with two branches computed by pool A is adopted by pool B, which
    holds the parent, an older copy of the fork and a branch of its own."""
    a, b = make_pool(model, tmp_path / "a"), make_pool(model, tmp_path / "b")
    doc = tokens(40)  # 2 whole blocks of 16 and a tail
    seqs = [doc + tokens(20, seed=1 + i) for i in range(2)]
    for pool in (a, b):
        commit(pool, model, "p", doc)
    for seq in seqs:
        commit(a, model, "c", seq, fork_from="p")
    commit(b, model, "c", doc, fork_from="p")  # a fork of its own, as far as the document
    commit(b, model, "c", tokens(30, seed=9))  # and a branch A never saw
    a.flush()
    fetched = [Branch(list(br.block_ids), br.n_tokens, br.links) for br in a.agent("c").branches]
    assert [l[1] for l in fetched[-1].links] == ["p", "c"]
    data = {bid: a.store.read_block(bid) for br in fetched for bid in br.block_ids}

    # Each branch's chain is checked with its links; the parent's blocks B holds are not fetched.
    held = b.store.has_block
    assert held(fetched[-1].block_ids[0]) and held(fetched[-1].block_ids[1])
    missing = {bid: d for bid, d in data.items() if not held(bid)}
    assert b.chains.prefix(fetched[-1], missing, held) == (4, False)
    assert b.chains.prefix(Branch(fetched[-1].block_ids, 60, ((0, "c"),)), data,
                          lambda _: False) == (0, True)  # seeded with the fork's own id: refused
    assert b.chains.prefix(Branch(fetched[-1].block_ids, 60, ((0, "p"), (3, "c"))), data,
                          lambda _: False) == (2, True)  # re-seeded at the wrong block
    assert b.chains.prefix(fetched[-1], {}, held) == (2, False)  # the fork's own blocks not at hand

    local = [br.block_ids for br in b.agent("c").branches]
    done = []
    fut = b.save_fetched("c", fetched, list(missing.values()), b.agent_version("c"), done.append)
    assert fut.result(30) and done and done[0] is not None
    # B's older copy of the fork (the same blocks but its partial tail) is continued by a fetched
    # branch and goes; its own branch stays, older than the fetched ones
    assert [br.block_ids for br in b.agent("c").branches] == [local[1]] + [br.block_ids for br in fetched]
    assert len(b.store.read_manifest("c").branches) == 3  # on disk as in memory
    check_accounting(b)
    for seq in seqs:
        want, n_a, _ = a.lookup("c", seq + [1])
        got, n_b, tier = b.lookup("c", seq + [1])
        assert n_a == n_b == len(seq) and tier == "disk"
        assert_same_cache(got, want)
    assert b.lookup("c", tokens(30, seed=9) + [1])[1] == 30
    # an agent changed since the fetch began keeps its own state
    assert b.save_fetched("c", fetched, [], (), done.append) is None
    a.close()
    b.close()


class Clock:
    """The pools' clock, set by the test."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_a_branch_records_its_last_use(model, tmp_path):
    """A commit stamps its branch, a lookup the branch it served from (with the pool's clock, never
    before the agent's newest stamp: a clock stepped back cannot reorder its branches), and the
    manifest keeps the stamps across a restart."""
    clock = Clock(100.0)
    pool = make_pool(model, tmp_path, clock=clock)
    history = tokens(20)
    b = [history + tokens(20, seed=30 + i) for i in range(2)]
    for t, seq in zip((100.0, 200.0), b):
        clock.t = t
        assert pool.commit("a", seq, prefill(model, seq)[0]) == 40
    clock.t = 300.0
    assert pool.lookup("a", b[0] + [1])[1] == 40
    assert [(x.n_tokens, x.last_used) for x in pool.agent("a").branches] == [(40, 200.0), (40, 300.0)]
    assert pool.agent("a").branches[-1].block_ids == pool.chains.ids(((0, "a"),), b[0])
    clock.t = 50.0  # stepped back
    assert pool.lookup("a", b[1] + [1])[1] == 40
    assert [x.last_used for x in pool.agent("a").branches] == [300.0, 300.0]
    assert pool.agent("a").branches[-1].block_ids == pool.chains.ids(((0, "a"),), b[1])
    seq = b[1] + tokens(5, seed=40)
    assert pool.commit("a", seq, prefill(model, seq)[0]) == 45  # the save writes the stamps
    pool.close()
    pool = make_pool(model, tmp_path, clock=clock)
    assert [(x.n_tokens, x.last_used) for x in pool.agent("a").branches] == [(40, 300.0), (45, 300.0)]
    pool.close()
