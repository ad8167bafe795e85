"""Span directives, amortize: where an edited prompt can be spliced onto an agent's stored history,
or why it cannot (issues #21, #32). Pure functions, no MLX (but `ModelSplicing.probe`); splice.py
executes a plan (prefill the stub, append the run with its keys moved by `rope_shift`).

A splice of the prompt P onto stored tokens T:

    P = T[:i] + stub + T[j:j+L] + rest        (i: the exact prefix, the longest common prefix)

where T[j:j+L] is a stored run that reappears at P[j':], verified token by token, and both j and j'
are *realignment points* (`Realign`): positions where the text is cut at a place the chat template
and the tokenizer both respect, so a run never starts inside a template tag or a special-token
sequence. Three kinds, from the coarsest (`kv_edit.boundaries`: `messages`, `items`, `lines`, the
default):

* `message`: the chat template's message-start token (ChatML's <|im_start|>, Llama 3's
  <|start_header_id|>): the boundary of issue #21;
* `item`: a special token the template opens a tool call or a tool result with inside a message
  (Qwen's <tool_response> / <tool_call> when they are added tokens, DeepSeek's tool-output begin
  markers), found by rendering one and two items with the tokenizer's own template (`item_openers`);
* `line`: the first token of a line, i.e. the token after one whose text ends a line (a newline,
  then only spaces or tabs), neither of them a special token: the "\n\n" vllm-mlx joins merged
  same-role messages with, a newline before a plain-text tag (`<tool_response>` spelled in BPE
  pieces), or a line inside a tool output. Byte-level BPE never merges a newline with the
  letters after it, and the planner compares tokens, not text: where the edit changes how the
  tokens around the cut merge, those tokens differ and become part of the stub (re-prefilled),
  never guessed.

The run's keys move by Δ = j' - j. With `kv_edit.recompute_tokens` k, the first k tokens after each
point are re-prefilled as well (they are the run's tokens that attended most to what the edit
removed; CacheBlend/EPIC's boundary recomputation). Fallback reasons, in the order they are checked
(`request.explain` says each one to the user):

* `no_history`: the agent has nothing stored; `no_edit`: the prompt extends the history (exact);
* `recurrent_state`: recurrent layers fold in every token (qwen3_next, lfm2): nothing can move;
* `unsupported_positions`: the start-up probe refused a layer (rope_shift.probe_model);
* `unaligned`: the tokenizer gives no realignment point of the kinds allowed;
* `no_realignment`: no stored run of at least `min_run` tokens reappears at a realignment point
  after the edit;
* `stub_too_long`: more than `max_stub` new tokens to prefill before the run (a plain re-prefill
  costs about as much).
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass, replace
from typing import Any, Iterator, Optional, Sequence, Union

from ..chain import lcp

MIN_RUN_TOKENS = 16
MAX_STUB_TOKENS = 4096
BOUNDARIES = ("lines", "items", "messages")  # kv_edit.boundaries, finest first
_LINE_END = re.compile(r"(\r?\n)[ \t]*\Z")


@dataclass(frozen=True)
class Splice:
    """One splice: reuse `exact` tokens as stored, prefill P[exact:at], then the stored run
    T[src:src+length] moved to P[at:at+length] (its keys rotated by `delta`). `boundary`: the kind
    of realignment point the run starts at (or starts recompute_tokens after)."""

    exact: int
    at: int
    src: int
    length: int
    boundary: str = "message"

    @property
    def delta(self) -> int:
        return self.at - self.src

    @property
    def stub(self) -> int:
        return self.at - self.exact


@dataclass(frozen=True)
class Realign:
    """Where a run may start (module docstring): the message-start token, the template's item
    openers, the tokens that end a line and the special tokens (never a line start), and the
    coarsest kind allowed (`level`, one of BOUNDARIES)."""

    anchor: Optional[int] = None
    openers: frozenset = frozenset()
    line_ends: frozenset = frozenset()
    special: frozenset = frozenset()
    level: str = "lines"

    @classmethod
    def messages(cls, anchor: Optional[int]) -> "Realign":
        """Message starts only (issue #21's planner)."""
        return cls(anchor=anchor, level="messages")

    def at_level(self, level: str) -> "Realign":
        if level not in BOUNDARIES:
            raise ValueError(f"kv_edit.boundaries must be one of {', '.join(BOUNDARIES)}; got {level!r}")
        return replace(self, level=level)

    @property
    def usable(self) -> bool:
        """Whether any point can be found at this level."""
        if self.level == "messages":
            return self.anchor is not None
        if self.level == "items":
            return self.anchor is not None or bool(self.openers)
        return self.anchor is not None or bool(self.openers) or bool(self.line_ends)

    def kind(self, tokens: Sequence[int], p: int) -> Optional[str]:
        """"message", "item" or "line" if position p of `tokens` is a realignment point, else None."""
        t = tokens[p]
        if t == self.anchor:
            return "message"
        if self.level == "messages":
            return None
        if t in self.openers:
            return "item"
        if self.level == "lines" and p > 0 and tokens[p - 1] in self.line_ends and t not in self.special:
            return "line"
        return None

    def points(self, tokens: Sequence[int], lo: int = 0, hi: Optional[int] = None) -> Iterator[int]:
        """The realignment points of `tokens` in [lo, hi), in order."""
        kind = self.kind
        for p in range(max(0, lo), len(tokens) if hi is None else min(hi, len(tokens))):
            if kind(tokens, p) is not None:
                yield p


Points = Union[Realign, int, None]  # an int: a message-start token (message starts only)


def _realign(points: Points) -> Optional[Realign]:
    return points if points is None or isinstance(points, Realign) else Realign.messages(points)


class _Runs:
    """The stored realignment points from `s_lo` on, indexed by their first `min_run` tokens (at
    least one), so each prompt point looks up its candidate sources instead of trying them all."""

    def __init__(self, stored: Sequence[int], prompt: Sequence[int], realign: Realign, s_lo: int, min_run: int):
        self.stored, self.prompt, self.realign, self.min_run = stored, prompt, realign, min_run
        self.key = max(1, min_run)
        self.sources: dict[tuple, list[int]] = {}
        for s in realign.points(stored, s_lo, len(stored) - self.key + 1):
            self.sources.setdefault(tuple(stored[s:s + self.key]), []).append(s)

    def next(self, p_from: int, s_from: int) -> Optional[Splice]:
        """The longest stored run from `s_from` on that reappears at the first realignment point of
        the prompt from `p_from` on where any does (at least `min_run` tokens), as a Splice whose
        stub starts at `p_from`; None if none does."""
        stored, prompt, k = self.stored, self.prompt, self.key
        for at in self.realign.points(prompt, p_from, len(prompt) - k + 1):
            cands = self.sources.get(tuple(prompt[at:at + k]))
            if not cands:
                continue
            best: Optional[Splice] = None
            for src in cands[bisect.bisect_left(cands, s_from):]:
                length = lcp(stored[src:], prompt[at:])
                if length >= self.min_run and (best is None or length > best.length):
                    best = Splice(p_from, at, src, length, self.realign.kind(prompt, at))
            if best is not None:
                return best
        return None


def find_splice(stored: Sequence[int], prompt: Sequence[int], exact: int, points: Points,
                min_run: int = MIN_RUN_TOKENS, max_stub: int = MAX_STUB_TOKENS) -> Union[Splice, str]:
    """The splice reusing the longest stored run after the edit, or the fallback reason (module
    docstring). `exact`: the tokens the prompt shares with `stored` from the start; `points`: where
    runs may start (a Realign, or a message-start token)."""
    got = find_splices(stored, prompt, exact, points, min_run, max_stub)
    return got if isinstance(got, str) else got[0]


def find_splices(stored: Sequence[int], prompt: Sequence[int], exact: int, points: Points,
                 min_run: int = MIN_RUN_TOKENS, max_stub: int = MAX_STUB_TOKENS) -> Union[list[Splice], str]:
    """Every edit of the prompt, left to right: the first splice (or the fallback reason), then,
    after each run ends, the next stored run (later in the stored tokens) that reappears at a
    realignment point, as long as the stubs together stay within `max_stub`."""
    if exact >= len(stored):
        return "no_edit"
    realign = _realign(points)
    if realign is None or not realign.usable:
        return "unaligned"
    runs = _Runs(stored, prompt, realign, exact, min_run)
    first = runs.next(exact, exact)
    if first is None:
        return "no_realignment"
    if first.stub > max_stub:
        return "stub_too_long"
    out, stubs = [first], first.stub
    while True:
        last = out[-1]
        p, s = last.at + last.length, last.src + last.length
        if p >= len(prompt) or s >= len(stored):
            return out
        nxt = runs.next(p, s)
        if nxt is None or stubs + nxt.stub > max_stub:
            return out
        out.append(nxt)
        stubs += nxt.stub


def recompute(plans: Sequence[Splice], k: int, min_run: int = MIN_RUN_TOKENS) -> list[Splice]:
    """The plans with the first k tokens of each run re-prefilled (moved into its stub); a run left
    shorter than `min_run` is dropped (prefilled with the next piece's stub)."""
    if k <= 0:
        return list(plans)
    out, end = [], None
    for p in plans:
        if p.length - k >= max(1, min_run):
            out.append(Splice(p.exact if end is None else end, p.at + k, p.src + k, p.length - k, p.boundary))
            end = p.at + p.length
    return out


def snap(points: Optional[Realign], prompt: Sequence[int], at: int, length: int, min_run: int = MIN_RUN_TOKENS,
         k: int = 0) -> Optional[tuple[int, int, str]]:
    """(start, length, kind) of the stretch prompt[at:at+length] of a verified run cut to start at
    its first realignment point (and k tokens after it: recompute_tokens), or None if what is left
    is shorter than `min_run`. For a run cut where its tokens reached the rotation budget: the
    prompt and the stored tokens agree over the run, so a point of one is a point of the other."""
    if points is None:
        return None
    for p in points.points(prompt, at, at + length):
        n = at + length - (p + k)
        if n < max(1, min_run):
            return None
        return p + k, n, points.kind(prompt, p)
    return None


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


def _special(tokenizer: Any) -> tuple[set, set]:
    """(special tokens, special and added tokens) of a tokenizer: the chat template's structure. Added
    tokens that are not special (Qwen's <tool_call>, Gemma's whitespace runs) are not special."""
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    added = dict(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    special |= {i for i, t in added.items() if getattr(t, "special", False)}
    return special, special | set(added)


_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "probe", "description": "a probe", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


def _call(i: int, as_text: bool) -> dict:
    args = {"q": f"zqc{i}"}
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": "probe", "arguments": json.dumps(args) if as_text else args}}


def item_openers(tokenizer: Any, added: set) -> set:
    """The special (or added) tokens the chat template opens a second tool call or tool result with
    inside one message (Qwen's <tool_call>, <tool_response>; DeepSeek's tool-output begin marker):
    the first such token where a rendering with two items parts from one with one item, before the
    second item's content. Templates that render neither are skipped (empty)."""
    out: set = set()
    for as_text in (False, True):
        calls = [_call(1, as_text), _call(2, as_text)]
        pairs = (  # (one item, two items, the second item's content)
            ([{"role": "user", "content": "zqu"}, {"role": "assistant", "content": "", "tool_calls": calls[:1]}],
             [{"role": "user", "content": "zqu"}, {"role": "assistant", "content": "", "tool_calls": calls}], "zqc2"),
            ([{"role": "user", "content": "zqu"}, {"role": "assistant", "content": "", "tool_calls": calls},
              {"role": "tool", "tool_call_id": "call_1", "content": "zqa first"}],
             [{"role": "user", "content": "zqu"}, {"role": "assistant", "content": "", "tool_calls": calls},
              {"role": "tool", "tool_call_id": "call_1", "content": "zqa first"},
              {"role": "tool", "tool_call_id": "call_2", "content": "zqb second"}], "zqb"))
        for one, two, marker in pairs:
            try:
                a_text = tokenizer.apply_chat_template(one, tools=_PROBE_TOOLS, tokenize=False)
                b_text = tokenizer.apply_chat_template(two, tools=_PROBE_TOOLS, tokenize=False)
                cut = b_text.rindex(marker)
                a = list(tokenizer.encode(a_text, add_special_tokens=False))
                b = list(tokenizer.encode(b_text[:cut], add_special_tokens=False))
            except Exception:
                continue
            lead = b[lcp(a, b):]  # the second item's lead-in (special tokens are atomic: exact here)
            first = next((t for t in lead if t in added), None)
            if first is not None:
                out.add(first)
        if out:
            break
    return out


def line_end_tokens(tokenizer: Any, special: set) -> set:
    """The tokens whose text ends a line: a newline, then only spaces or tabs (not special ones)."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:
        return set()
    marks = ("\n", "\u010a", "<0x0A>")  # the text, byte-level BPE's spelling of it, SentencePiece's byte
    out = set()
    for piece, i in vocab.items():
        if i in special or not any(m in piece for m in marks):
            continue
        try:
            text = tokenizer.decode([i])
        except Exception:
            continue
        if _LINE_END.search(text):
            out.add(i)
    return out


def realign_points(tokenizer: Any) -> Optional[Realign]:
    """Every realignment point a tokenizer gives (module docstring), at level `lines`; None if the
    tokenizer cannot be read."""
    try:
        special, added = _special(tokenizer)
    except Exception:
        return None
    anchor = message_anchor(tokenizer)
    return Realign(anchor=anchor, openers=frozenset(item_openers(tokenizer, added) - {anchor}),
                   line_ends=frozenset(line_end_tokens(tokenizer, special)), special=frozenset(special))


def decide(stored: Optional[Sequence[int]], prompt: Sequence[int], exact: int, points: Points, *,
           recurrent: bool, refused_layer: Optional[str], min_run: int = MIN_RUN_TOKENS,
           max_stub: int = MAX_STUB_TOKENS, recompute_tokens: int = 0) -> Union[list[Splice], str]:
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
    got = find_splices(stored, prompt, exact, points, min_run, max_stub)
    if isinstance(got, str) or not recompute_tokens:
        return got
    return recompute(got, recompute_tokens, min_run) or "no_realignment"


@dataclass(frozen=True)
class ModelSplicing:
    """What a model allows a splice, found once (on the MLX thread): where runs may start (a Realign;
    a message-start token is taken as message starts only), whether recurrent layers hold state, and
    the first layer the rotation probe refused (with its reason)."""

    realign: Points
    recurrent: bool
    refused_layer: Optional[str]
    verdicts: tuple = ()  # rope_shift.LayerShift per layer (empty for a recurrent model)

    def __post_init__(self):
        object.__setattr__(self, "realign", _realign(self.realign))

    @property
    def anchor(self) -> Optional[int]:
        return self.realign.anchor if self.realign is not None else None

    @classmethod
    def probe(cls, model: Any, tokenizer: Any, recurrent: bool) -> "ModelSplicing":
        from .rope_shift import probe_model  # MLX: only here

        refused, verdicts = None, ()
        if not recurrent:
            verdicts = tuple(probe_model(model))
            refused = next((f"layer {i}: {v.reason}" for i, v in enumerate(verdicts) if not v.ok), None)
        return cls(realign_points(tokenizer), recurrent, refused, verdicts)

    def summary(self) -> str:
        """One log line: the boundaries found and the layers' verdicts, counted (not every token id)."""
        r = self.realign
        where = ("no message-start token: amortize serves as exact" if r is None else
                 f"message start {r.anchor}, {len(r.openers)} item openers, {len(r.line_ends)} line-end tokens, "
                 f"{len(r.special)} special")
        kinds = sorted({"/".join(s.kind for s in v.slots) for v in self.verdicts})
        layers = (f"{len(self.verdicts)} layers ({', '.join(kinds)})" if self.verdicts else
                  "recurrent state: splices re-prefill" if self.recurrent else "no layers probed")
        return f"{where}; {layers}; refused: {self.refused_layer or 'none'}"

    def points(self, options: dict) -> Optional[Realign]:
        """Where runs may start under the kv_edit option's `boundaries`."""
        level = options.get("boundaries", "lines")
        return self.realign.at_level(level) if self.realign is not None else None

    def decide(self, stored: Optional[Sequence[int]], prompt: Sequence[int], options: dict,
               ) -> Union[list[Splice], str]:
        """`decide` for this model (`options`: the backend's kv_edit option)."""
        exact = lcp(stored or (), prompt)
        return decide(stored, prompt, exact, self.points(options), recurrent=self.recurrent,
                      refused_layer=self.refused_layer, min_run=options.get("min_run_tokens", MIN_RUN_TOKENS),
                      max_stub=options.get("max_stub_tokens", MAX_STUB_TOKENS),
                      recompute_tokens=options.get("recompute_tokens", 0))
