"""Span directives, amortize: where an edited prompt can be spliced onto an agent's stored history,
or why it cannot (issue #21). Pure functions, no MLX (but `ModelSplicing.probe`); splice.py executes
a plan (prefill the stub, append the run with its keys moved by `rope_shift`).

A splice of the prompt P onto stored tokens T:

    P = T[:i] + stub + T[j:j+L] + rest        (i: the exact prefix, the longest common prefix)

where T[j:j+L] is a stored run that reappears at P[j':], both j and j' at a message boundary (the
chat template's message-start token), so the edit is widened to whole messages: splicing inside a
template breaks models (Leyline, Table 5) and a boundary also keeps BPE from merging across the
edit. The run's keys move by Δ = j' - j. Fallback reasons, in the order they are checked:

* `no_history`: the agent has nothing stored; `no_edit`: the prompt extends the history (exact);
* `recurrent_state`: recurrent layers fold in every token (qwen3_next, lfm2): nothing can move;
* `unsupported_positions`: the start-up probe refused a layer (rope_shift.probe_model);
* `unaligned`: no message-start token is known (no chat template), so no edit can be widened to
  whole messages;
* `no_realignment`: no stored run of at least `min_run` tokens reappears at a message boundary
  after the edit;
* `stub_too_long`: more than `max_stub` new tokens to prefill before the run (a plain re-prefill
  costs about as much).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from ..chain import lcp

MIN_RUN_TOKENS = 16
MAX_STUB_TOKENS = 4096


@dataclass(frozen=True)
class Splice:
    """One splice: reuse `exact` tokens as stored, prefill P[exact:at], then the stored run
    T[src:src+length] moved to P[at:at+length] (its keys rotated by `delta`)."""

    exact: int
    at: int
    src: int
    length: int

    @property
    def delta(self) -> int:
        return self.at - self.src

    @property
    def stub(self) -> int:
        return self.at - self.exact


def find_splice(stored: Sequence[int], prompt: Sequence[int], exact: int, anchor: Optional[int],
                min_run: int = MIN_RUN_TOKENS, max_stub: int = MAX_STUB_TOKENS) -> Union[Splice, str]:
    """The splice reusing the longest stored run after the edit, or the fallback reason (module
    docstring). `exact`: the tokens the prompt shares with `stored` from the start."""
    if exact >= len(stored):
        return "no_edit"
    if anchor is None:
        return "unaligned"
    best = _next_run(stored, prompt, exact, exact, anchor, min_run)
    if best is None:
        return "no_realignment"
    if best.stub > max_stub:
        return "stub_too_long"
    return best


def _next_run(stored: Sequence[int], prompt: Sequence[int], p_from: int, s_from: int, anchor: int,
              min_run: int) -> Optional[Splice]:
    """The longest stored run from `s_from` on that reappears at the first message boundary of the
    prompt from `p_from` on where any does (at least `min_run` tokens), as a Splice whose stub
    starts at `p_from`; None if none does."""
    targets = [p for p in range(p_from, len(prompt)) if prompt[p] == anchor]
    sources = [s for s in range(s_from, len(stored)) if stored[s] == anchor]
    for at in targets:
        best: Optional[Splice] = None
        for src in sources:
            length = lcp(stored[src:], prompt[at:])
            if length >= min_run and (best is None or length > best.length):
                best = Splice(p_from, at, src, length)
        if best is not None:
            return best
    return None


def find_splices(stored: Sequence[int], prompt: Sequence[int], exact: int, anchor: Optional[int],
                 min_run: int = MIN_RUN_TOKENS, max_stub: int = MAX_STUB_TOKENS) -> Union[list[Splice], str]:
    """Every edit of the prompt, left to right: the first as `find_splice` finds it (or its fallback
    reason), then, after each run ends, the next stored run (later in the stored tokens) that
    reappears at a message boundary, as long as the stubs together stay within `max_stub`."""
    first = find_splice(stored, prompt, exact, anchor, min_run, max_stub)
    if isinstance(first, str):
        return first
    out, stubs = [first], first.stub
    while True:
        last = out[-1]
        p, s = last.at + last.length, last.src + last.length
        if p >= len(prompt) or s >= len(stored):
            return out
        nxt = _next_run(stored, prompt, p, s, anchor, min_run)
        if nxt is None or stubs + nxt.stub > max_stub:
            return out
        out.append(nxt)
        stubs += nxt.stub


def message_anchor(tokenizer: Any) -> Optional[int]:
    """The token the chat template starts every message with (ChatML's <|im_start|>, Llama 3's
    <|start_header_id|>), if it is a special token; None without a chat template."""
    try:
        one = tokenizer.apply_chat_template([{"role": "user", "content": "a"}], tokenize=False)
        two = tokenizer.apply_chat_template([{"role": "user", "content": "a"},
                                             {"role": "assistant", "content": "b"}], tokenize=False)
        a = list(tokenizer.encode(one, add_special_tokens=False))
        b = list(tokenizer.encode(two, add_special_tokens=False))
        special = set(getattr(tokenizer, "all_special_ids", None) or [])
        special |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    except Exception:
        return None
    # The second message starts where the two renderings part (after the first message's end); its
    # first token, if special and starting the first message too, starts every message.
    k = lcp(a, b)
    start = b[k] if k < len(b) else None
    return start if start in special and start in a else None


def decide(stored: Optional[Sequence[int]], prompt: Sequence[int], exact: int, anchor: Optional[int], *,
           recurrent: bool, refused_layer: Optional[str], min_run: int = MIN_RUN_TOKENS,
           max_stub: int = MAX_STUB_TOKENS) -> Union[list[Splice], str]:
    """The splices for an amortize request (one per edit, left to right), or why not (checked in the
    module docstring's order)."""
    if not stored:
        return "no_history"
    if exact >= len(stored):
        return "no_edit"
    if recurrent:
        return "recurrent_state"
    if refused_layer:
        return "unsupported_positions"
    return find_splices(stored, prompt, exact, anchor, min_run, max_stub)


@dataclass(frozen=True)
class ModelSplicing:
    """What a model allows a splice, found once (on the MLX thread): the message-start token, whether
    recurrent layers hold state, and the first layer the rotation probe refused (with its reason)."""

    anchor: Optional[int]
    recurrent: bool
    refused_layer: Optional[str]
    verdicts: tuple = ()  # rope_shift.LayerShift per layer (empty for a recurrent model)

    @classmethod
    def probe(cls, model: Any, tokenizer: Any, recurrent: bool) -> "ModelSplicing":
        from .rope_shift import probe_model  # MLX: only here

        refused, verdicts = None, ()
        if not recurrent:
            verdicts = tuple(probe_model(model))
            refused = next((f"layer {i}: {v.reason}" for i, v in enumerate(verdicts) if not v.ok), None)
        return cls(message_anchor(tokenizer), recurrent, refused, verdicts)

    def decide(self, stored: Optional[Sequence[int]], prompt: Sequence[int], options: dict,
               ) -> Union[list[Splice], str]:
        """`decide` for this model (`options`: the backend's kv_edit option)."""
        exact = lcp(stored or (), prompt)
        return decide(stored, prompt, exact, self.anchor, recurrent=self.recurrent, refused_layer=self.refused_layer,
                      min_run=options.get("min_run_tokens", MIN_RUN_TOKENS),
                      max_stub=options.get("max_stub_tokens", MAX_STUB_TOKENS))
