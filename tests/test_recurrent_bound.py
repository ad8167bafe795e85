"""Hybrids at their bound (issue #33 item 3): a recurrent hybrid agent holds one recurrent-state
checkpoint per branch, its resume point (the state where the branch's last prompt ended), so its
bytes are its tokens' 4-bit attention blocks plus one state per branch, in memory and on disk,
however many turns it took; and every point it can return to still resumes.

Real MLX on a tiny random-weight qwen3_next (2 linear-attention + 2 full-attention layers). Turns are
served as BatchGenerator serves them: the prompt prefilled but its last token, then greedy decoding;
the committed tokens are prompt + reply (the last reply token never fed). Resumed states are compared
bit for bit with the live snapshot the turn committed, and logits with a cold 4-bit prefill within
LOGIT_TOL (test_mtp_recurrent.py's tolerance).
"""

from __future__ import annotations

import random

import mlx.core as mx

from test_families import BLOCK, SIZE, _logits, _pool, hybrid  # noqa: F401 (a fixture)
from vllm_mlx_persist.caches import ModelCodec
from vllm_mlx_persist.caches.kinds import STATE

LOGIT_TOL = 1e-3


def words(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, SIZE.vocab) for _ in range(n)]


class Agentic:
    """Turns of one model against one pool, with request ids as the server gives them."""

    def __init__(self, model, codec: ModelCodec, pool):
        self.model, self.codec, self.pool, self.rid = model, codec, pool, 0

    def turn(self, agent: str, prompt: list[int], reply: int, fork_from=None) -> tuple[list[int], int, list]:
        """(tokens committed, tokens reused, the states at len(prompt) - 1 the turn's cache held)."""
        self.rid += 1
        rid = f"r{self.rid}"
        m = self.pool.match(agent, prompt, rid, fork_from)
        cache = m.cache if m.cache is not None else self.codec.make_cache()
        rest = prompt[m.num_tokens:]
        if len(rest) > 1:
            _logits(self.model, cache, rest[:-1])
        snap = [list(c.snap) for c, k in zip(cache, self.codec.kinds) if k == STATE]
        y, out = rest[-1], []
        for _ in range(reply):
            y = int(mx.argmax(_logits(self.model, cache, [y])).item())
            out.append(y)
        tokens = prompt + out
        assert self.pool.commit(agent, tokens, cache, rid, fork_from) == len(tokens) - 1
        self.pool.finish(rid)
        assert self.pool.check() == []
        return tokens, m.num_tokens, snap

    def resume(self, agent: str, prompt: list[int], fork_from=None) -> tuple[int, list, mx.array]:
        """(tokens reused, the resumed states, logits after the prompt) of a lookup, checked against
        a cold 4-bit prefill."""
        cache, n, _ = self.pool.lookup(agent, prompt, fork_from=fork_from)
        if cache is None:
            return 0, [], None
        states = [list(c.cache) for c, k in zip(cache, self.codec.kinds) if k == STATE]
        got = _logits(self.model, cache, prompt[n:])
        want = _logits(self.model, self.codec.make_cache(), prompt)
        assert mx.abs(got - want).max().item() < LOGIT_TOL
        return n, states, got


def held(codec: ModelCodec, pool, agent: str) -> list[int]:
    """Absolute positions of the checkpoints the agent's hot blocks hold (a block once)."""
    out = []
    for br in pool.agent(agent).branches:
        for i, bid in enumerate(br.block_ids):
            out += [(bid, i * BLOCK + p) for _, p in codec.checkpoint_slots(pool.blocks[bid].layers)]
    return sorted({p for _, p in set(out)})


def bound(codec: ModelCodec, pool, agent: str, state_bytes: int) -> int:
    """The agent's bound: the 4-bit attention arrays of the tokens its blocks hold (each block once)
    plus one recurrent state (and its int32 position) per branch."""
    a = pool.agent(agent)
    names = codec.token_names()
    kv = sum(x.nbytes for bid in a.ids for n, x in pool.blocks[bid].layers.items() if n in names)
    return kv + len(a.branches) * state_bytes


def ckpt_bytes(codec: ModelCodec, pool, agent: str) -> int:
    """Bytes of the checkpoints the agent's hot blocks hold."""
    names = codec.token_names()
    return sum(x.nbytes for bid in pool.agent(agent).ids for n, x in pool.blocks[bid].layers.items() if n not in names)


def per_token(codec: ModelCodec, pool, agent: str) -> int:
    layers = pool.blocks[pool.agent(agent).ids and next(iter(pool.agent(agent).ids))].layers
    return sum(x.nbytes // x.shape[2] for n, x in layers.items() if n in codec.token_names())


def state_bytes(snap: list) -> int:
    return sum(x.nbytes for layer in snap for x in layer) + 4


def same_states(a: list, b: list) -> bool:
    return all(mx.array_equal(x, y).item() for la, lb in zip(a, b) for x, y in zip(la, lb))


def test_an_eight_turn_agent_holds_one_state_in_memory_and_on_disk(hybrid, tmp_path):
    """Before: two states per turn (an 8-turn agent at 2.0x its one-turn size). Now after every turn
    exactly one, at the newest prompt's end, and the agent's hot bytes are its bound (plus, until
    its run goes, the K/V of a replaced tail block that the turn's cache arrays still hold); the
    blocks that held a superseded checkpoint are rewritten without it, so the disk holds exactly the
    bound's arrays (and the disk budget counts the rewritten files). Every turn resumed where the previous prompt ended, and after a restart the last one
    resumes from disk with the state the turn's cache held, bit for bit."""
    model, codec = hybrid
    pool = _pool(codec, tmp_path)
    run = Agentic(model, codec, pool)
    prompt, snaps, sizes = words(40, 0), [], []
    for t in range(8):
        tokens, reused, snap = run.turn("a", prompt, reply=10 + t)
        assert reused == (len(snaps[-1][0]) - 1 if t else 0)
        snaps.append((prompt, snap))
        assert held(codec, pool, "a") == [len(prompt) - 1]
        b, hot = bound(codec, pool, "a", state_bytes(snap)), pool.agent("a").hot_bytes
        assert ckpt_bytes(codec, pool, "a") == state_bytes(snap)
        assert b <= hot <= b + BLOCK * per_token(codec, pool, "a"), (t, hot, b)
        sizes.append((hot, b))
        prompt = tokens + words(12, t + 1)
    assert len(pool.agent("a").branches) == 1 and pool.stats["tokens_stored"] > 8 * 40
    pool.flush()
    arrays = [pool.store.read_block(bid).arrays for bid in pool.agent("a").ids]
    assert sum(len(codec.checkpoint_slots(a)) for a in arrays) == 1
    assert sum(x.nbytes for a in arrays for x in a.values()) == bound(codec, pool, "a", state_bytes(snaps[-1][1]))
    files = sum(pool.store.block_file_size(b) for b in pool.agent("a").ids)
    assert pool.persister.agent_disk_bytes("a") == files  # the disk budget counts the rewritten sizes
    print("agent (hot bytes, bound) per turn:", sizes, "disk files:", files)
    pool.close()

    again = Agentic(model, codec, _pool(codec, tmp_path))
    last, snap = snaps[-1]
    n, states, _ = again.resume("a", prompt)
    assert n == len(last) - 1 and same_states(states, snap)
    again.pool.close()


def test_each_branch_and_a_resent_prompt_resume_where_their_prompt_ended(hybrid, tmp_path):
    """A turn whose history diverges inside the previous reply (a reply that does not come back
    token for token) resumes at the previous prompt's end and becomes a second branch: the agent
    holds two states, one per branch. A resent (regenerated) turn of either branch resumes at its
    prompt's end with the committed state, bit for bit, hot and after a restart."""
    model, codec = hybrid
    pool = _pool(codec, tmp_path)
    run = Agentic(model, codec, pool)
    p1 = words(40, 10)
    t1, _, _ = run.turn("a", p1, reply=10)
    p2 = t1 + words(12, 11)
    t2, reused, s2 = run.turn("a", p2, reply=12)
    assert reused == len(p1) - 1
    p3 = p2 + words(5, 12) + words(12, 13)  # the reply re-rendered differently, then a user turn
    t3, reused, s3 = run.turn("a", p3, reply=8)
    assert reused == len(p2) - 1
    assert len(pool.agent("a").branches) == 2 and held(codec, pool, "a") == [len(p2) - 1, len(p3) - 1]
    assert ckpt_bytes(codec, pool, "a") == 2 * state_bytes(s3)
    for p, s in ((p2, s2), (p3, s3)):
        n, states, _ = run.resume("a", p)
        assert n == len(p) - 1 and same_states(states, s)
    pool.close()
    again = Agentic(model, codec, _pool(codec, tmp_path))
    for p, s in ((p2, s2), (p3, s3)):
        n, states, _ = again.resume("a", p + words(3, 14))
        assert n == len(p) - 1 and same_states(states, s)
    again.pool.close()


def test_a_checkpoint_a_fork_shares_stays(hybrid, tmp_path):
    """A fork child names its parent's whole blocks, checkpoint included. When the parent moves on,
    that checkpoint is no longer the parent's resume point but stays in the shared block, so the
    fork point still resumes (for the child, and for a new fork from the parent's old turn); the
    parent's and the child's own turns resume at their prompts' ends."""
    model, codec = hybrid
    pool = _pool(codec, tmp_path)
    run = Agentic(model, codec, pool)
    p1 = words(40, 20)
    t1, _, s1 = run.turn("p", p1, reply=10)  # prompt end 39 in block [32, 48), which fills
    c1 = t1 + words(8, 21)
    tc, reused, sc = run.turn("c", c1, reply=6, fork_from="p")
    assert reused == len(p1) - 1
    shared = pool.agent("p").branches[-1].block_ids[2]
    assert shared in pool.agent("c").ids and pool.refs[shared] == 2
    p2 = t1 + words(12, 22)
    t2, reused, s2 = run.turn("p", p2, reply=9)
    assert reused == len(p1) - 1
    assert [p for _, p in codec.checkpoint_slots(pool.blocks[shared].layers)] == [len(p1) - 1 - 2 * BLOCK]
    n, states, _ = run.resume("c", c1)
    assert n == len(c1) - 1 and same_states(states, sc)
    n, states, _ = run.resume("d", t1 + words(7, 23), fork_from="p")
    assert n == len(p1) - 1 and same_states(states, s1)
    n, states, _ = run.resume("d", t2 + words(7, 24), fork_from="p")
    assert n == len(p2) - 1 and same_states(states, s2)
    pool.close()
