"""Span directives, amortize: where an edited prompt could be spliced onto the stored history, at
message boundaries, or which fallback applies (vllm_mlx_persist/kv_edit/plan.py)."""

from __future__ import annotations

import pytest

from vllm_mlx_persist.kv_edit.plan import ModelSplicing, Splice, decide, find_splice, find_splices, message_anchor
from vllm_mlx_persist.tools.models import build_model, build_model_dir

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
