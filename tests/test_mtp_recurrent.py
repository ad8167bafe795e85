"""vllm-mlx's MTP (multi-token prediction) on a recurrent hybrid: the checkpoints StateCache gives are
the states at the positions they are labelled with.

vllm-mlx 0.6.0's `_install_mtp` (scheduler.py) verifies [primary, draft] in one two-token step and,
when the draft is rejected on a hybrid model, trims the attention caches by 2, assigns each
recurrent cache the state it copied before the verify, and feeds the primary again. On mlx-lm
0.31.3 vllm-mlx does not install it (its BatchGenerator has no `_step` hook) and a tiny model has no
MTP head, so `mtp_decode` drives that same sequence of cache calls in-process on a real tiny
qwen3_next, with this project's batch caches (BatchQ4KVCache, StateCache), drafts accepted and
rejected. Each checkpoint of every row is compared with the state a cold prefill of the row's tokens
reaches at the checkpoint's position, and a lookup through the pool must give a cold prefill's logits.

Tolerance: the live state went through 4-bit attention in other chunks than the cold prefill, a
float-rounding difference: states within 2.2e-6 of the cold ones, logits within 1e-6, measured. Served
from the checkpoint the previous code stored after a rejected draft, the logits were 0.025 off.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest

from test_families import SIZE, _pool, hybrid  # noqa: F401 (a fixture)
from vllm_mlx_persist.caches import ModelCodec, StateCache
from vllm_mlx_persist.caches.recurrent import LOST
from vllm_mlx_persist.caches.kinds import STATE

STATE_TOL = 1e-4
LOGIT_TOL = 1e-3


def prompts(n: int, length: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % (SIZE.vocab - 10) + 5 for j in range(length)] for i in range(n)]


def cold_state(model, codec: ModelCodec, tokens: list[int]) -> tuple[list, mx.array]:
    """STATE layers' arrays and the last logits after a cold prefill of `tokens`."""
    cache = codec.make_cache()
    logits = model(mx.array([tokens]), cache=cache)[0, -1]
    states = [list(c.cache) for c, k in zip(cache, codec.kinds) if k == STATE]
    mx.eval(logits, states)
    return states, logits


def next_token(model, codec: ModelCodec, tokens: list[int]) -> int:
    return int(mx.argmax(cold_state(model, codec, tokens)[1]).item())


def mtp_decode(model, codec: ModelCodec, rows: list[list[int]], steps: int, drafts,
               plain: int = 0) -> tuple[list, list, dict]:
    """Prefill `rows` (equal lengths) as BatchGenerator does, then `steps` MTP steps as vllm-mlx's
    `_mtp_step` (verified mode) calls the caches, then `plain` one-token steps (vllm-mlx takes
    those when MTP is bypassed or its draft fails). `drafts(step, row, tokens so far + primary)`
    is the draft token. Returns (batch cache, the tokens each row's cache consumed, counts of
    accepts and rejects)."""
    per_seq = [codec.make_cache() for _ in rows]
    cache = [type(per_seq[0][l]).merge([c[l] for c in per_seq]) for l in range(codec.n_layers)]
    x = mx.array([r[:-1] for r in rows])
    for start in range(0, x.shape[1], 32):  # prefill in chunks, all but the last prompt token
        model(x[:, start : start + 32], cache=cache)
    tokens = [list(r) for r in rows]
    counts = {"accepted": 0, "rejected": 0}
    skip = None
    for step in range(steps):
        if skip is None:  # no logits kept from the last verify: a one-token step
            logits = model(mx.array([[t[-1]] for t in tokens]), cache=cache)[:, -1]
        else:
            logits, skip = skip, None
        primary = mx.argmax(logits, axis=-1)
        draft = mx.array([drafts(step, i, tokens[i] + [int(primary[i].item())]) for i in range(len(rows))])
        # vllm-mlx copies the state of every cache that cannot be trimmed (s.copy(); mx arrays copy
        # with mx.array), then verifies [primary, draft] in one step.
        snaps = {i: [mx.array(s) if s is not None else None for s in c.state]
                 for i, c in enumerate(cache) if not c.is_trimmable()}
        verify = model(mx.concatenate([primary[:, None], draft[:, None]], axis=1), cache=cache)
        pred = mx.argmax(verify[:, 0], axis=-1)
        if pred.tolist() == draft.tolist():
            counts["accepted"] += 1
            for i, t in enumerate(tokens):
                t += [int(primary[i].item()), int(draft[i].item())]
            skip = verify[:, 1]
        else:
            counts["rejected"] += 1
            for c in cache:
                if c.is_trimmable():
                    c.trim(2)
            for i, s in snaps.items():
                cache[i].state = s
            skip = model(primary[:, None], cache=cache)[:, -1]
            for i, t in enumerate(tokens):
                t.append(int(primary[i].item()))
    if plain:
        pending = mx.argmax(skip, axis=-1) if skip is not None else mx.array([t.pop() for t in tokens])
        for _ in range(plain):
            logits = model(pending[:, None], cache=cache)[:, -1]
            for i, t in enumerate(tokens):
                t.append(int(pending[i].item()))
            pending = mx.argmax(logits, axis=-1)
    elif skip is None:
        for t in tokens:  # the last prompt token was never fed
            t.pop()
    mx.eval([c.state for c in cache])
    return cache, tokens, counts


def check_rows(model, codec: ModelCodec, cache: list, tokens: list[list[int]], prompt_len: int,
               want_final: bool = True) -> None:
    for i, toks in enumerate(tokens):
        row = [c.extract(i) for c in cache]
        assert codec.length(row) == len(toks)
        ckpts = codec.live_checkpoints(row, len(toks))
        positions = [p for p, _ in ckpts]
        assert positions == ([prompt_len - 1, len(toks)] if want_final else [prompt_len - 1]), positions
        for pos, states in ckpts:
            want, _ = cold_state(model, codec, toks[:pos])
            err = max(mx.abs(a - b).max().item() for s, w in zip(states, want) for a, b in zip(s, w))
            assert err < STATE_TOL, (i, pos, err)


@pytest.mark.parametrize("plain", [0, 4], ids=["mtp-only", "then-plain-steps"])
@pytest.mark.parametrize("pattern", ["reject", "accept", "mixed"])
def test_mtp_verify_and_reject_keep_checkpoints_exact(hybrid, pattern, plain):
    """Regression: the verify's two-token step was taken as the prefill-end snapshot (a state that
    consumed the draft, labelled past it), and a reject restored the state but not the position,
    so the final state was labelled two tokens too far per rejected draft."""
    model, codec = hybrid
    rows = prompts(2, 40)

    def drafts(step: int, row: int, seq: list[int]) -> int:
        good = next_token(model, codec, seq)
        accept = pattern == "accept" or (pattern == "mixed" and step % 2 == 0)
        return good if accept else (good + 1) % SIZE.vocab

    cache, tokens, counts = mtp_decode(model, codec, rows, 6, drafts, plain=plain)
    if pattern != "accept":
        assert counts["rejected"] >= 3
    if pattern != "reject":
        assert counts["accepted"] >= 2
    check_rows(model, codec, cache, tokens, len(rows[0]))


def test_a_pool_lookup_after_mtp_gives_cold_logits(hybrid, tmp_path):
    """What the wrong labels broke: a rejected verify left a snapshot of a state that consumed the
    draft, labelled two tokens on; once later steps made the sequence that long, the pool stored
    it and a later turn was served from it."""
    model, codec = hybrid
    rows = prompts(1, 40)
    drafts = lambda step, row, seq: (next_token(model, codec, seq) + 1) % SIZE.vocab  # rejected
    cache, tokens, counts = mtp_decode(model, codec, rows, 1, drafts, plain=6)
    assert counts["rejected"] == 1
    pool = _pool(codec, tmp_path)
    row = [c.extract(0) for c in cache]
    assert pool.commit("a", tokens[0], row) == len(tokens[0])
    follow = tokens[0] + prompts(1, 12)[0]
    hit, n, _ = pool.lookup("a", follow)
    hot = model(mx.array([follow[n:]]), cache=hit)[0, -1]
    _, cold = cold_state(model, codec, follow)
    assert mx.abs(hot - cold).max().item() < LOGIT_TOL, (n, mx.abs(hot - cold).max().item())
    assert n == len(rows[0]) - 1  # the turn's resume point: its prefill snapshot
    pool.close()


def test_a_state_replaced_otherwise_is_not_kept(hybrid, caplog):
    """An assignment that is not the undo of the last verify leaves the position unknown: only the
    prefill-end snapshot is given, never the replaced state under a guessed label."""
    model, codec = hybrid
    rows = prompts(1, 40)
    cache, tokens, _ = mtp_decode(model, codec, rows, 2, lambda s, r, seq: next_token(model, codec, seq))
    layer = next(c for c in cache if isinstance(c, StateCache))
    with caplog.at_level(logging.WARNING, logger="vllm_mlx_persist"):
        layer.state = [mx.zeros_like(s) for s in layer.state]
    assert layer.pos == [LOST] and "position is unknown" in caplog.text
    row = [c.extract(0) for c in cache]
    ckpts = codec.live_checkpoints(row, len(tokens[0]))
    assert [p for p, _ in ckpts] == [len(rows[0]) - 1]


def test_prefill_chunks_still_snapshot_and_one_token_steps_do_not(hybrid):
    """Without MTP nothing changes: the snapshot is the prefill's end, the final state the last step."""
    model, codec = hybrid
    rows = prompts(2, 40)
    cache, tokens, _ = mtp_decode(model, codec, rows, 0, None, plain=4)
    check_rows(model, codec, cache, tokens, len(rows[0]))


def test_batch_generator_checkpoints_are_exact(hybrid):
    """mlx-lm's own BatchGenerator (no MTP): staggered inserts, prefill chunks of 8 with one-token
    chunks among them (a prompt batch step of one token is not a decode step for the rows that
    join later), every extracted cache's checkpoints equal cold states at their labels."""
    from mlx_lm.generate import BatchGenerator

    model, codec = hybrid
    rows = [p[:n] for p, n in zip(prompts(5, 40), [10, 40, 2, 17, 26])]
    gen = BatchGenerator(model, max_tokens=8, prefill_step_size=8)
    uids = gen.insert(rows[:2], max_tokens=[5, 6], caches=[codec.make_cache() for _ in range(2)])
    out, step = {}, 0
    while len([u for u in out if out[u][1] is not None]) < len(rows):
        if step in (6, 7):  # once the first two are decoding: a two-token prompt alone (its prefill
            new = rows[2:3] if step == 6 else rows[3:]  # is one token), then two more join it
            uids += gen.insert(new, max_tokens=[4] * len(new), caches=[codec.make_cache() for _ in new])
        for r in gen.next()[1]:
            toks, _ = out.get(r.uid, ([], None))
            out[r.uid] = (toks + [r.token], r.prompt_cache if r.finish_reason else None)
        step += 1
        assert step < 200
    for u, prompt in zip(uids, rows):
        toks, cache = out[u]
        seq = prompt + toks
        n = codec.length(cache)
        ckpts = codec.live_checkpoints(cache, n)
        assert ckpts and ckpts[-1][0] == n, [p for p, _ in ckpts]
        assert len(ckpts) == 2 or len(prompt) <= 2  # the prefill's end, then the final state
        for pos, states in ckpts:
            want, _ = cold_state(model, codec, seq[:pos])
            err = max(mx.abs(a - b).max().item() for s, w in zip(states, want) for a, b in zip(s, w))
            assert err < STATE_TOL, (len(prompt), pos, err)
