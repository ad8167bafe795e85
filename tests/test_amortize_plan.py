"""Span directives, amortize: where an edited prompt could be spliced onto the stored history, at
message boundaries and inside messages (tool items, lines), never inside a template tag, or which
fallback applies (vllm_mlx_persist/kv_edit/plan.py); on synthetic tokens and on the ChatML and Qwen
templates' renderings of the shapes agents send."""

from __future__ import annotations

import copy

import pytest

from vllm_mlx_persist.chain import lcp
from vllm_mlx_persist.kv_edit.plan import (ModelSplicing, Realign, Splice, decide, find_splice, find_splices,
                                           message_anchor, realign_points, recompute, snap)
from vllm_mlx_persist.tools.models.build import build_model, build_model_dir

A = 1  # the message-start token in these synthetic conversations


def msg(*body: int) -> list[int]:
    return [A, *body]


def test_a_removed_message_realigns_at_the_next_boundary():
    head, span, tail = msg(*range(10, 30)), msg(*range(100, 140)), msg(*range(200, 230))
    stored = head + span + tail
    prompt = head + msg(7, 7) + tail + msg(300, 301)  # the span replaced by a 2-token stub, then a new message
    plan = find_splice(stored, prompt, len(head) + 1, A)
    assert isinstance(plan, Splice)
    assert plan.exact == len(head) + 1 and plan.at == len(head) + 3 and plan.src == len(head) + len(span)
    assert plan.length == len(tail)  # the whole stored tail
    assert plan.delta == 3 - len(span) and plan.stub == 2
    assert prompt[plan.at:plan.at + plan.length] == stored[plan.src:plan.src + plan.length]


def test_two_edits_are_two_splices_left_to_right():
    m1, span1, m2, span2, m3 = (msg(*range(b, b + 20)) for b in (10, 100, 200, 300, 400))
    stored = m1 + span1 + m2 + span2 + m3
    prompt = m1 + msg(7) + m2 + msg(8, 8, 8) + m3 + msg(9)
    plans = find_splices(stored, prompt, len(m1) + 1, A)
    assert len(plans) == 2
    first, second = plans
    assert (first.at, first.src) == (len(m1) + 2, 2 * len(m1))  # m2, moved back by span1 - stub
    assert second.exact == first.at + first.length and second.src == 4 * len(m1)  # m3
    for p in plans:
        assert prompt[p.at:p.at + p.length] == stored[p.src:p.src + p.length]
    assert second.delta == (len(prompt) - len(m3) - 2) - 4 * len(m1)
    # a budget of stub tokens that only fits the first edit's stub keeps one splice
    assert len(find_splices(stored, prompt, len(m1) + 1, A, max_stub=2)) == 1


def test_an_inserted_message_moves_the_rest_forward():
    head, tail = msg(*range(10, 30)), msg(*range(200, 230))
    plan = find_splice(head + tail, head + msg(5, 6, 7) + tail, len(head), A)
    assert isinstance(plan, Splice) and plan.delta == 4 and plan.src == len(head)


@pytest.mark.parametrize("stored, prompt, anchor, want", [
    (msg(*range(10, 40)), msg(*range(10, 40)) + msg(9), A, "no_edit"),  # the prompt extends the history
    (msg(*range(10, 40)) + msg(*range(50, 90)), msg(*range(10, 40)) + msg(8), None, "unaligned"),
    (msg(*range(10, 40)) + msg(*range(50, 90)), msg(*range(10, 40)) + msg(8) + msg(*range(50, 60)), A,
     "no_realignment"),  # 10 tokens realign: under min_run
    (msg(*range(10, 40)) + msg(*range(50, 90)), msg(*range(10, 35)) + [3] * 5000 + msg(*range(50, 90)), A,
     "stub_too_long"),
])
def test_fallbacks(stored, prompt, anchor, want):
    exact = next(i for i, (a, b) in enumerate(zip(stored + [None], prompt)) if a != b)
    assert find_splice(stored, prompt, exact, anchor) == want


def test_model_wide_fallbacks_come_first():
    stored = msg(*range(10, 30)) + msg(*range(100, 140)) + msg(*range(200, 230))
    prompt = msg(*range(10, 30)) + msg(7) + msg(*range(200, 230))
    kw = dict(recurrent=False, refused_layer=None)
    assert [type(x) for x in decide(stored, prompt, 22, A, **kw)] == [Splice]
    assert decide(None, prompt, 0, A, **kw) == "no_history"
    assert decide(stored, prompt, 22, A, recurrent=True, refused_layer=None) == "recurrent_state"
    assert decide(stored, prompt, 22, A, recurrent=False, refused_layer="layer 3: unsupported_positions") \
        == "unsupported_positions"


def test_the_message_anchor_is_the_templates_message_start(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(build_model_dir(tmp_path / "m", arch="llama", size="tiny", seed=0)))
    anchor = message_anchor(tok)
    assert anchor is not None and tok.convert_ids_to_tokens(anchor) == "<|im_start|>"

    class NoTemplate:
        def apply_chat_template(self, *a, **k):
            raise ValueError("no chat template")

    assert message_anchor(NoTemplate()) is None


def test_the_model_probe_feeds_the_decision(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(build_model_dir(tmp_path / "m", arch="llama", size="tiny", seed=0)))
    llama, _ = build_model("llama", "tiny")
    s = ModelSplicing.probe(llama, tok, recurrent=False)
    assert s.refused_layer is None and s.anchor == message_anchor(tok)
    hybrid, _ = build_model("qwen3_next", "tiny")
    s = ModelSplicing.probe(hybrid, tok, recurrent=True)
    stored = [s.anchor] + list(range(10, 60)) + [s.anchor] + list(range(70, 100))
    prompt = [s.anchor] + list(range(10, 20)) + [s.anchor] + list(range(70, 100))
    assert s.decide(stored, prompt, {}) == "recurrent_state"


# ---- realignment inside messages (issue #32) -----------------------------------------------------

N, E = 3, 4  # a newline token and a message-end token of the synthetic conversations below
R = Realign(anchor=A, line_ends=frozenset({N}), special=frozenset({A, E}))


def test_a_merged_message_realigns_at_the_line_after_the_edit():
    """Two user messages merged into one (vllm-mlx joins them with a blank line): a stub for the first
    realigns at the line the second starts, inside the message; at message starts only it cannot."""
    head = msg(*range(10, 30), E, N)
    merged = msg(*range(100, 140), N, N, *range(200, 230), E, N)  # long output, "\n\n", the next message
    tail = msg(*range(300, 320), E, N)
    stored = head + merged + tail
    prompt = head + msg(7, 7, N, N, *range(200, 230), E, N) + tail + msg(9, 9)
    exact = len(head) + 1
    plan = find_splice(stored, prompt, exact, R)
    assert isinstance(plan, Splice) and plan.boundary == "line"
    # the blank line is a line: the run starts at its newline, the stub is "7 7 \n"
    assert prompt[plan.at:plan.at + 2] == [N, 200] and plan.stub == 3
    assert plan.length == 1 + 30 + 2 + len(tail) and plan.src == len(head) + 1 + 40 + 1
    assert find_splice(stored, prompt, exact, R.at_level("messages")).length == len(tail)  # issue #21's
    assert find_splice(stored, prompt[:-2 - len(tail)] + msg(8), exact, R.at_level("messages")) == "no_realignment"


def test_no_run_starts_inside_a_header_or_at_a_special_token():
    """A line start needs the token before it to end a line and is never a special token; the tokens
    after a message-start token (the role header) are no point either."""
    tokens = msg(50, 51, N, 60, 61, N, E, N) + msg(70, N, 71)
    kinds = {p: R.kind(tokens, p) for p in range(len(tokens))}
    assert [p for p, k in kinds.items() if k] == [0, 4, 9, 12]
    assert kinds[0] == kinds[9] == "message" and kinds[4] == kinds[12] == "line"
    assert kinds[1] is None and kinds[10] is None  # after the anchor: inside the role header
    assert kinds[7] is None and kinds[8] is None  # the message end after a newline, the newline after it
    assert list(R.at_level("messages").points(tokens)) == [0, 9]
    opener = Realign(anchor=A, openers=frozenset({5}), line_ends=frozenset({N}), special=frozenset({A, E}))
    assert opener.at_level("items").kind([A, 9, 5, 9], 2) == "item" and opener.at_level("items").kind([N, 9], 1) is None


def test_the_levels_and_fallbacks_say_which_points_exist():
    assert not Realign().usable and Realign(line_ends=frozenset({N})).usable
    assert not Realign(line_ends=frozenset({N}), level="items").usable
    stored, prompt = [10] * 5 + [N] + list(range(20, 60)), [10] * 4 + [11, N] + list(range(20, 60))
    assert find_splice(stored, prompt, 4, Realign()) == "unaligned"
    got = find_splice(stored, prompt, 4, Realign(line_ends=frozenset({N})))
    assert isinstance(got, Splice) and (got.at, got.src, got.length) == (6, 6, 40)  # Δ = 0: the same length


def test_recomputed_tokens_move_into_the_stub():
    plans = [Splice(10, 14, 40, 30, "line"), Splice(44, 50, 90, 18, "message")]
    got = recompute(plans, 4)
    assert got[0] == Splice(10, 18, 44, 26, "line")  # the run's first 4 tokens are prefilled
    assert len(got) == 1  # the second run, 14 tokens after them, is under min_run: prefilled
    assert recompute(plans, 0) == plans
    got = decide(msg(*range(10, 30)) + msg(*range(100, 140)) + msg(*range(200, 230)),
                 msg(*range(10, 30)) + msg(7) + msg(*range(200, 230)), 22, A, recurrent=False, refused_layer=None,
                 recompute_tokens=3)
    assert [(p.at, p.length) for p in got] == [(23 + 3, 31 - 3)]


def test_a_stretch_cut_by_the_rotation_budget_starts_at_a_point():
    tokens = msg(50, 51, N, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76)
    assert snap(R, tokens, 1, len(tokens) - 1, min_run=4) == (4, len(tokens) - 4, "line")
    assert snap(R, tokens, 1, len(tokens) - 1, min_run=4, k=2) == (6, len(tokens) - 6, "line")
    assert snap(R, tokens, 5, len(tokens) - 5, min_run=4) is None  # no point left in the stretch
    assert snap(R, tokens, 1, len(tokens) - 1, min_run=20) is None  # too short after the point


class _CountedTokens(list):
    """A token list counting the tokens read from it (an index, or a slice's length)."""
    reads = 0

    def __getitem__(self, i):
        got = super().__getitem__(i)
        _CountedTokens.reads += len(got) if isinstance(i, slice) else 1
        return got


def test_planning_a_long_history_is_linear():
    """A 32k-token history of short lines (a point every 8 tokens): the index keeps the planning
    linear, counted in tokens read (2.75 per token of the two lists; trying every stored point at
    every prompt point would read millions), not timed."""
    import random

    rng = random.Random(0)
    lines = [[rng.randrange(10, 1000) for _ in range(7)] + [N] for _ in range(4000)]
    stored = _CountedTokens([A] + [t for line in lines for t in line])
    prompt = _CountedTokens([A] + [t for line in lines[:400] for t in line] + [5, N]
                            + [t for line in lines[900:] for t in line])
    exact = lcp(list(stored), list(prompt))
    _CountedTokens.reads = 0
    plans = find_splices(stored, prompt, exact, R)
    assert _CountedTokens.reads <= 4 * (len(stored) + len(prompt)), _CountedTokens.reads
    assert len(plans) == 1 and plans[0].src == 1 + 900 * 8 and plans[0].length == len(stored) - plans[0].src


# ---- with the tokenizers' own templates ----------------------------------------------------------


def _ids(tok, messages, **kw):
    x = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
    return list(x["input_ids"] if hasattr(x, "keys") else x)


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    """(ChatML tokenizer, Qwen-template tokenizer with its tool tags as added tokens)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("tok")
    return tuple(AutoTokenizer.from_pretrained(str(build_model_dir(root / t, arch="llama", size="tiny", seed=0,
                                                                   template=t))) for t in ("chatml", "qwen"))


LONG = "\n".join(f"line {i}: x{i * 7919 % 10007} = {i * 31 % 97}" for i in range(30))


def _call(i, path):
    return {"id": f"call_{i}", "type": "function", "function": {"name": "read_file", "arguments": {"path": path}}}


def _check(plans, stored, prompt, realign):
    """Every run is the stored tokens, starts at a point of both sequences, and no point is inside a
    header or at a special token (the text before a line start ends a line)."""
    assert isinstance(plans, list) and plans, plans
    for p in plans:
        assert prompt[p.at:p.at + p.length] == stored[p.src:p.src + p.length]
        assert realign.kind(prompt, p.at) == realign.kind(stored, p.src) == p.boundary


def test_the_probe_finds_each_kind_of_point(toks):
    chatml, qwen = toks
    r = realign_points(chatml)
    assert chatml.convert_ids_to_tokens(r.anchor) == "<|im_start|>" and not r.openers
    assert {chatml.decode([i]) for i in r.line_ends} >= {"\n"} and r.anchor in r.special
    r = realign_points(qwen)
    assert {qwen.convert_ids_to_tokens(i) for i in r.openers} == {"<tool_call>", "<tool_response>"}
    assert r.anchor == realign_points(chatml).anchor


def test_merged_user_messages_splice_inside_the_message(toks):
    """The shape of the issue: a tool output in a user message merged with the next user message
    (vllm-mlx's `_normalize_messages` joins them with a blank line), the output replaced by a stub."""
    tok = toks[0]
    r = realign_points(tok)
    merged = lambda out: [{"role": "user", "content": "task: fix the parser"},  # noqa: E731
                          {"role": "assistant", "content": "[Calling tool: read_file({\"path\": \"a.py\"})]"},
                          {"role": "user", "content": f"[Tool Result (call_1)]: {out}\n\nand now please look at "
                                                      "the tests in the other file as well"},
                          {"role": "assistant", "content": "reading the tests"}, {"role": "user", "content": "go"}]
    stored, prompt = _ids(tok, merged(LONG)), _ids(tok, merged("(truncated)"))
    exact = lcp(stored, prompt)
    plans = find_splices(stored, prompt, exact, r)
    _check(plans, stored, prompt, r)
    assert plans[0].boundary == "line" and tok.decode(prompt[plans[0].at:]).startswith("\nand now please look")
    assert plans[0].at + plans[0].length == len(prompt)  # all the rest
    got = find_splices(stored, prompt, exact, r.at_level("messages"))
    assert got[0].at > plans[0].at  # at message starts only: from the next message on


def test_bpe_merges_across_the_edit_are_prefilled_not_guessed(toks):
    """A stub ending in spaces merges them with the newline after it (the tokens there differ from
    the stored ones although the text after the edit is the same): the run starts at the first point
    where the tokens agree, and what differs is part of the stub."""
    tok = toks[0]
    r = realign_points(tok)
    body = lambda out: [{"role": "user", "content": f"{out}\n\nnext: the rest of this message stays as it was, "  # noqa: E731
                                                    "word for word, and should be reused"}]
    stored, prompt = _ids(tok, body(LONG + ".")), _ids(tok, body("[cut]   "))
    plans = find_splices(stored, prompt, lcp(stored, prompt), r)
    _check(plans, stored, prompt, r)
    stub = tok.decode(prompt[plans[0].exact:plans[0].at])
    assert stub.startswith("[cut]") and stub.endswith("   \n")  # the spaces merged into the first newline
    assert tok.decode(prompt[plans[0].at:]).startswith("\nnext:")  # the second: the blank line, then on


@pytest.mark.parametrize("tags", ["added", "bpe"])
def test_tool_responses_in_one_user_turn(toks, tags):
    """Qwen's template renders consecutive tool results in one user turn: editing the first realigns
    at the second's <tool_response> (an added token: an item point) or the line it starts (spelled
    in BPE pieces); never inside the tag."""
    from vllm_mlx_persist.tools.models.build import QWEN_TEMPLATE

    tok = toks[1]
    if tags == "bpe":
        tok = copy.deepcopy(toks[0])
        tok.chat_template = QWEN_TEMPLATE
    r = realign_points(tok)
    conv = lambda out: [{"role": "user", "content": "fix it"},  # noqa: E731
                        {"role": "assistant", "content": "", "tool_calls": [_call(1, "a.py"), _call(2, "b.py")]},
                        {"role": "tool", "tool_call_id": "call_1", "content": out},
                        {"role": "tool", "tool_call_id": "call_2", "content": "def test_b():\n    assert b() == 2\n"},
                        {"role": "assistant", "content": "the test of b fails since b returns three instead"},
                        {"role": "user", "content": "go on"}]
    stored, prompt = _ids(tok, conv(LONG)), _ids(tok, conv("[truncated]"))
    plans = find_splices(stored, prompt, lcp(stored, prompt), r)
    _check(plans, stored, prompt, r)
    assert tok.decode(prompt[plans[0].at:]).startswith("</tool_response>\n<tool_response>\ndef test_b")
    items = find_splices(stored, prompt, lcp(stored, prompt), r.at_level("items"))
    if tags == "added":
        assert items[0].boundary == "item" and tok.decode(prompt[items[0].at:]).startswith("<tool_response>\ndef")
    else:  # no tag token: at item starts only, the next message
        assert items[0].boundary == "message"


def test_an_edited_tool_call_argument_realigns_after_it(toks):
    """An assistant message with tool calls whose long argument (a file written) is cut: the stored
    second call and everything after it are reused."""
    tok = toks[1]
    r = realign_points(tok)
    write = lambda text: {"id": "call_1", "type": "function",  # noqa: E731
                          "function": {"name": "write_file", "arguments": {"path": "a.py", "text": text}}}
    conv = lambda text: [{"role": "user", "content": "write a.py then run it"},  # noqa: E731
                         {"role": "assistant", "content": "", "tool_calls": [write(text), _call(2, "a.py")]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "written"},
                         {"role": "tool", "tool_call_id": "call_2", "content": "the file a.py reads back as written"},
                         {"role": "user", "content": "now run the tests for it"}]
    stored, prompt = _ids(tok, conv(LONG)), _ids(tok, conv("..."))
    plans = find_splices(stored, prompt, lcp(stored, prompt), r)
    _check(plans, stored, prompt, r)
    assert tok.decode(prompt[plans[0].at:]).startswith("</tool_call>\n<tool_call>")


def test_several_edits_in_one_message_are_several_splices(toks):
    tok = toks[1]
    r = realign_points(tok)
    conv = lambda a, b: [{"role": "user", "content": "fix it"},  # noqa: E731
                         {"role": "assistant", "content": "", "tool_calls": [_call(i, f"{i}.py") for i in (1, 2, 3)]},
                         {"role": "tool", "tool_call_id": "call_1", "content": a},
                         {"role": "tool", "tool_call_id": "call_2", "content": "the second output is kept as it is"},
                         {"role": "tool", "tool_call_id": "call_3", "content": b},
                         {"role": "user", "content": "which of them fails and why does it fail"}]
    stored, prompt = _ids(tok, conv(LONG, LONG.upper())), _ids(tok, conv("[cut]", "[cut]"))
    plans = find_splices(stored, prompt, lcp(stored, prompt), r)
    _check(plans, stored, prompt, r)
    assert len(plans) == 2 and plans[1].delta < plans[0].delta < 0
