"""Sharing in the block pool, on real MLX: forks share blocks by reference, agents keep several
branches, and matching goes on across a re-tokenization. End to end: tests/test_e2e_sharing.py.

Tolerances as in test_pool.py: reused vs cold prefill logits within COLD_HOT_TOL, same greedy token;
anything read back (hot, shared, reloaded) bit-identical.
"""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import pytest

from vllm_mlx_persist.tools.models.build import build_model
from vllm_mlx_persist.chain import Branch, merge_branches
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
        disk = Counter(b for a in pool.persister.index.agents.values() for b in a.block_ids)
        assert pool.persister.index.block_refs == dict(disk)


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
    pool.set_hot_budget(0)
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
    """The pool's side of the fleet tier (fleet/sync.py; Redis itself in test_remote.py and end to end in
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
    fetched = [Branch(list(br.block_ids), br.n_tokens, br.links, br.last_used) for br in a.agent("c").branches]
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
    fut = b.fleet_view.save_fetched("c", fetched, list(missing.values()), b.fleet_view.agent_version("c"), done.append)
    assert fut.result(30) and done and done[0] is not None
    # B's older copy of the fork (the same blocks but its partial tail, which the fetched branches'
    # tokens show they grew) is held by the fetched branches and goes; its own branch stays, the
    # most recently used (B committed it after A's turns)
    assert [br.block_ids for br in b.agent("c").branches] == [br.block_ids for br in fetched] + [local[1]]
    assert len(b.store.read_manifest("c").branches) == 3  # on disk as in memory
    check_accounting(b)
    for seq in seqs:
        want, n_a, _ = a.lookup("c", seq + [1])
        got, n_b, tier = b.lookup("c", seq + [1])
        assert n_a == n_b == len(seq) and tier == "disk"
        assert_same_cache(got, want)
    assert b.lookup("c", tokens(30, seed=9) + [1])[1] == 30
    # an agent changed since the fetch began keeps its own state
    assert b.fleet_view.save_fetched("c", fetched, [], (), done.append) is None
    a.close()
    b.close()


# ---- two servers' branches of one agent, merged by recency (the fleet tier's syncs) -----------------


def br(ids: str, n: int, t: float) -> Branch:
    """A branch over blocks named by letters (an agent's own chain), used at `t`."""
    return Branch(list(ids), n, ((0, "x"),), t)


def test_merge_branches_keeps_the_most_recently_used_of_both_sides():
    mine = [br("a", 16, 1.0), br("bc", 32, 3.0), br("d", 16, 5.0)]
    theirs = [br("e", 16, 2.0), br("f", 16, 4.0), br("g", 16, 6.0)]
    got = merge_branches(mine, theirs, 3)
    assert [b.block_ids for b in got] == [["f"], ["d"], ["g"]]  # least recently used first, from either side
    assert [b.block_ids for b in merge_branches(mine, [br("h", 16, 5.0)], 1)] == [["h"]]  # a tie: theirs newer
    assert mine[1].last_used == 3.0 and len(mine) == 3  # pure


def test_merge_branches_drops_a_branch_another_holds():
    # "b" (a prefix, used last) is held by "bc": it goes and "bc" counts as used when it was
    got = merge_branches([br("a", 16, 1.0), br("bc", 32, 2.0)], [br("b", 16, 3.0)], 4)
    assert [(b.block_ids, b.last_used) for b in got] == [(["a"], 1.0), (["b", "c"], 3.0)]
    # the same branch on both sides: once, with the later use
    got = merge_branches([br("bc", 32, 5.0)], [br("bc", 32, 2.0), br("a", 16, 3.0)], 4)
    assert [(b.block_ids, b.last_used) for b in got] == [(["a"], 3.0), (["b", "c"], 5.0)]
    # a prefix of several: only the most recently used of them takes its use
    got = merge_branches([br("ab", 32, 1.0), br("ac", 32, 2.0)], [br("a", 16, 9.0)], 4)
    assert [(b.block_ids, b.last_used) for b in got] == [(["a", "b"], 1.0), (["a", "c"], 9.0)]
    # a partial tail ("b": 20 tokens, 4 in block b) is held only when the tokens show it was grown
    mine, theirs = [br("ab", 20, 1.0)], [br("ac", 40, 2.0)]
    assert len(merge_branches(mine, theirs, 4)) == 2
    assert len(merge_branches(mine, theirs, 4, grew=lambda c, b: True)) == 1
    # fewer tokens never hold: a branch shorter than one block is not 'continued' by a longer one
    assert len(merge_branches([br("a", 5, 3.0)], [br("e", 30, 1.0)], 4)) == 2


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


def test_a_fetched_history_merges_with_the_local_one_by_recency(model, tmp_path):
    """The defect the fleet state machine found, at the pool: A fetched B's three branches, served two
    parallel turns (the last one acknowledged), then fetched B's newer history, in which B had served
    a turn A never saw. A keeps the three most recently used of both servers' branches, its own two
    among them; before, the fetched ones became the most recent whatever their age, and A's went."""
    ca, cb = Clock(0.0), Clock(0.0)
    a, b = make_pool(model, tmp_path / "a", clock=ca), make_pool(model, tmp_path / "b", clock=cb)
    a.max_branches = b.max_branches = 3

    def turn(pool, clock, t, seq):  # a committed turn at time t (no lookup: nothing else is used)
        clock.t = t
        assert pool.commit("x", seq, prefill(model, seq)[0]) == len(seq)

    def sync(src, dst):  # what the fleet's sync hands the pool: the branches, and the blocks dst lacks
        src.flush()
        fetched = [Branch(list(x.block_ids), x.n_tokens, x.links, x.last_used) for x in src.agent("x").branches]
        blocks = [src.store.read_block(bid) for bid in src.agent("x").ids if not dst.store.has_block(bid)]
        done = []
        assert dst.fleet_view.save_fetched("x", fetched, blocks, dst.fleet_view.agent_version("x"), done.append).result(30) and done[0]
        return fetched

    doc = tokens(20)  # one whole block of 16 and a partial one
    olds = [doc + tokens(6, seed=i) for i in range(3)]
    for t, seq in zip((100.0, 200.0, 300.0), olds):
        turn(b, cb, t, seq)
    sync(b, a)
    p1, p2 = doc + tokens(8, seed=10), doc + tokens(3, seed=11)  # p2: 23 tokens, acknowledged last
    turn(a, ca, 400.0, p1)
    turn(a, ca, 500.0, p2)
    q = olds[0] + tokens(30, seed=12)  # B's turn continuing its oldest branch (A never saw it)
    turn(b, cb, 600.0, q)
    assert [x.n_tokens for x in b.agent("x").branches] == [26, 26, 56]
    ca.t = 700.0
    sync(b, a)
    assert [(x.n_tokens, x.last_used) for x in a.agent("x").branches] == [(28, 400.0), (23, 500.0), (56, 600.0)]
    for seq in (p1, p2, q):
        assert a.lookup("x", seq + [1])[1] == len(seq)
    assert a.lookup("x", olds[1] + [1])[1] == 20  # the least recently used went: the document only
    check_accounting(a)
    # on disk as in memory, last uses included; after a restart, the same order
    assert [x["last_used"] for x in a.store.read_manifest("x").branches] == [400.0, 500.0, 600.0]
    a.close()
    a = make_pool(model, tmp_path / "a", clock=ca)
    assert [(x.n_tokens, x.last_used) for x in a.agent("x").branches] == [(28, 400.0), (23, 500.0), (56, 600.0)]
    a.close()
    b.close()


def test_merge_branches_keeps_continued_branches_for_sliding_windows():
    """With bounded sliding windows a continued branch is a place to resume: only an equal one goes."""
    got = merge_branches([br("a", 16, 1.0), br("ab", 32, 2.0)], [br("ab", 32, 3.0)], 4, continued=False)
    assert [(b.block_ids, b.last_used) for b in got] == [(["a"], 1.0), (["a", "b"], 3.0)]
