"""Per-token rotation counts (issue #21): the pure bookkeeping (kv_edit/rotations.py), its manifest form, and
the backend in process on a real model: a run whose tokens reached `max_rotations` is re-prefilled
while the rest of it is still spliced, the counts persist across a restart, and no stored token is
ever rotated more than the cap; and the kv_edit options `boundaries` and `recompute_tokens` reach the
served plan."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import mlx.core as mx
import pytest

from vllm_mlx_persist.kv_edit import rotations as rot
from vllm_mlx_persist.chain import Branch, branches_of, manifest_of
from vllm_mlx_persist.disk_format import check_branches
from vllm_mlx_persist.namespace import spliced_seed
from test_e2e_kv_edit import _text, _tool_output
from vllm_mlx_persist.tools.models.build import build_model_dir


def test_counts_pieces_and_moves():
    segs = rot.normalize([(10, 20, 1), (20, 30, 1), (40, 50, 2), (5, 5, 3), (60, 70, 0)])
    assert segs == ((10, 30, 1), (40, 50, 2))
    assert rot.counts(segs, 8, 12) == [0, 0, 1, 1]
    assert rot.peak(segs) == 2 and rot.peak(()) == 0
    assert rot.clip(segs, 45) == ((10, 30, 1), (40, 45, 2)) and rot.clip(segs, 10) == ()
    # cap 2: tokens 40-49 (count 2) stay out; stretches shorter than min_run too.
    assert rot.pieces(segs, 0, 60, cap=2, min_run=4) == [(0, 40), (50, 10)]
    assert rot.pieces(segs, 0, 60, cap=1, min_run=4) == [(0, 10), (30, 10), (50, 10)]
    assert rot.pieces(segs, 0, 60, cap=0, min_run=1) == []
    assert rot.pieces(segs, 28, 14, cap=1, min_run=4) == [(2, 10)]
    assert rot.split_run(segs, 0, 60, 2, 4) == ([(0, 40), (50, 10)], 10)
    # Moving [10, 45) to 100: one more each; Δ = 0 requantizes nothing, so no more.
    assert rot.moved(segs, 10, 35, 100, delta=90) == ((100, 120, 2), (120, 130, 1), (130, 135, 3))
    assert rot.moved(segs, 10, 35, 10, delta=0) == ((10, 30, 1), (40, 45, 2))
    assert rot.legacy(3, 64, 100) == ((64, 100, 3),) and rot.legacy(0, 64, 100) == () == rot.legacy(2, None, 9)
    assert rot.decode(rot.encode(segs)) == segs


def test_rotations_travel_in_the_manifest_and_bad_ones_are_refused():
    br = Branch(["b" * 64, "c" * 64], 60, ((0, "a"), (1, spliced_seed("a", 2))), 5.0, ((32, 40, 1), (40, 60, 2)), 2)
    m = manifest_of("a", [br], pinned=False, now=7.0)
    check_branches(m.branches, set(m.block_ids))
    assert branches_of(m) == [br]
    # A branch without rotations on its own chain is a plain manifest, as before.
    assert manifest_of("a", [Branch(["b" * 64], 30, ((0, "a"),))], False).branches is None
    for bad in ([[40, 32, 1]], [[0, 61, 1]], [[0, 10, 0]], [[0, 10, 1], [5, 20, 1]], [[0, 10]], "x", [[0.0, 1, 1]]):
        entry = dict(m.branches[0], rotations=bad)
        with pytest.raises(ValueError, match="rotations"):
            check_branches([entry], set(m.block_ids))


# ---- the backend, in process -------------------------------------------------------------------

STUB = {"role": "user", "content": "tool output: (truncated)"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("models") / "llama", arch="llama", size="tiny", seed=0)


class Agent:
    """One agent's turns through an in-process backend: fetch, prefill what the cache lacks, store."""

    def __init__(self, model_dir: Path, cache_dir: Path, max_rotations: int, kv_edit: Optional[dict] = None,
                 **options):
        from mlx_lm import load

        from vllm_mlx_persist.backend import PersistQ4Backend

        self.model, self.tok = load(str(model_dir))
        self.backend = PersistQ4Backend(model=self.model, tokenizer=self.tok, options={
            "block_size": 16, "hot_mb": 64, "match_text": False, "cache_dir": str(cache_dir), "warmup": False,
            "key_format": "q4",  # auto's choice on this model, without calibrating (tests below set others)
            "kv_edit": {"enabled": True, "max_rotations": max_rotations, "min_run_tokens": 8, **(kv_edit or {})},
            **options})
        self.backend.load()
        self.n = 0

    def turn(self, messages: list[dict], mode: str | None) -> dict:
        ids = list(self.tok.encode(self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                                   add_special_tokens=False))
        self.n += 1
        ns = "ag" + ("" if mode is None else f"\0edit:{mode}")
        req = SimpleNamespace(prompt_token_ids=ids, cache_namespace=ns, request_id=f"r{self.n}")
        hit = self.backend.fetch(req)
        cache = hit.cache if hit is not None else self.backend.make_prompt_cache()
        done = hit.num_tokens if hit is not None else 0
        mx.eval(self.model(mx.array([ids[done:]]), cache=cache))
        self.last = (ids, cache)
        durable = self.backend.store(req, ids, cache)
        if hasattr(durable, "result"):
            assert durable.result(60)
        self.backend.on_request_finished(req, False)
        return getattr(req, "cache_usage", {}).get("kv_edit", {})

    def layer0_keys_off_cold(self) -> float:
        """How far the last turn's layer-0 keys (which depend only on token and position) lie from a
        cold 4-bit prefill's, in quantization steps of the cold one (<= 2: equal to 4-bit precision)."""
        ids, cache = self.last
        cold = self.backend.make_prompt_cache()
        mx.eval(self.model(mx.array([ids]), cache=cold))
        codec = self.backend.codec
        got, ref = codec.token_arrays(cache), codec.token_arrays(cold)
        bits = codec.key_format(0).bits if codec.key_format(0) is not None else codec.bits  # keys as stored
        deq = lambda a: mx.dequantize(*(a[f"0.k.{p}"] for p in "qsb"), codec.group_size, bits)  # noqa: E731
        step = mx.abs(ref["0.k.s"].astype(mx.float32)).max().item()
        return mx.abs(deq(got) - deq(ref)).max().item() / step

    def spliced(self) -> dict[int, list[Branch]]:
        """The agent's spliced branches by generation (its record's)."""
        out: dict[int, list[Branch]] = {}
        for br in self.backend.loaded_pool.agent("ag").branches:
            if br.spliced:
                out.setdefault(br.generation, []).append(br)
        return out

    def close(self) -> None:
        self.backend.close()


def test_a_run_past_the_cap_is_re_prefilled_and_the_rest_still_spliced(model_dir, tmp_path):
    """max_rotations 1. Splice 1 moves m2..m4 (count 1). The spliced history then grows by m5, m6
    (count 0). Removing m3 makes a run m4 (count 1: over the cap) + m5, m6 (count 0): m4 is
    re-prefilled, m5 onwards spliced, and the new history (peak 1) goes into the same generation.
    Under per-generation counting this request would have been served exact (rotation_budget)."""
    a = Agent(model_dir, tmp_path / "cache", max_rotations=1)
    try:
        msgs = [{"role": "user", "content": _text("task", 20, 1)}, {"role": "assistant", "content": _tool_output(2)},
                {"role": "user", "content": _text("then", 24, 3)}, {"role": "assistant", "content": _tool_output(4)},
                {"role": "user", "content": _text("more", 24, 5)}]
        assert a.turn(msgs, None) == {}
        first = a.turn([msgs[0], STUB] + msgs[2:], "amortize")
        assert first["applied"] and first["over_budget_tokens"] == 0 and len(first["plan"]) == 1, first
        grown = [msgs[0], STUB] + msgs[2:] + [{"role": "assistant", "content": _text("ok", 20, 6)},
                                             {"role": "user", "content": _text("next", 24, 7)}]
        cont = a.turn(grown, "amortize")
        assert cont["applied"] and cont["fallback"] is None and "plan" not in cont, cont  # read back, no new splice
        [(g, [br])] = a.spliced().items()
        assert g == 1 and rot.peak(br.rotations) == 1
        moved = br.rotations

        edited = grown[:3] + [STUB] + grown[4:]  # m3 (a tool output) goes: m4 has count 1, m5 and m6 count 0
        second = a.turn(edited, "amortize")
        assert second["applied"] is True and second["fallback"] is None, second
        # Prefilled before the first piece: the stub (as long as splice 1's) and m4, over the cap.
        over = second["over_budget_tokens"]
        assert 0 < over < sum(e - s for s, e, _ in moved), second
        assert second["plan"][0]["stub_tokens"] == first["plan"][0]["stub_tokens"] + over
        assert second["recomputed_tokens"] == second["plan"][0]["stub_tokens"] + 1  # + the token always left
        assert a.layer0_keys_off_cold() <= 2  # the re-prefilled stretch and the moved piece both in place
        spliced = a.spliced()
        assert list(spliced) == [1], spliced  # peak 1: the same generation, a new branch of it
        for branches in spliced.values():
            for br in branches:
                assert rot.peak(br.rotations) <= 1 and br.rotations[-1][1] <= br.n_tokens
        newest = max(spliced[1], key=lambda b: b.last_used)
        assert newest.rotations != moved and rot.peak(newest.rotations) == 1
        before = {g: [(b.block_ids, b.rotations) for b in brs] for g, brs in spliced.items()}
    finally:
        a.close()
    b = Agent(model_dir, tmp_path / "cache", max_rotations=1)  # a restart reads the counts back
    try:
        assert {g: [(br.block_ids, br.rotations) for br in brs] for g, brs in b.spliced().items()} == before
    finally:
        b.close()


def test_every_token_at_the_cap_is_served_exact_with_the_reason(model_dir, tmp_path):
    a = Agent(model_dir, tmp_path / "cache", max_rotations=1)
    try:
        msgs = [{"role": "user", "content": _text("task", 20, 1)}, {"role": "assistant", "content": _tool_output(2)},
                {"role": "user", "content": _text("then", 24, 3)}, {"role": "assistant", "content": _tool_output(4)},
                {"role": "user", "content": _text("more", 24, 5)}]
        a.turn(msgs, None)
        assert a.turn([msgs[0], STUB] + msgs[2:], "amortize")["applied"]
        # Removing m3 too: the run (m4) was moved once already and nothing after it is stored.
        again = a.turn([msgs[0], STUB, msgs[2], STUB, msgs[4]], "amortize")
        assert again["fallback"] == "rotation_budget" and again["over_budget_tokens"] > 0, again
        assert again["spliced_tokens"] > 0  # the spliced history's prefix was read back, nothing moved
        for brs in a.spliced().values():
            assert all(rot.peak(br.rotations) <= 1 for br in brs)
    finally:
        a.close()


@pytest.mark.parametrize("key_format", ["k8v4", "scaled", "hadamard"])
def test_a_splice_puts_keys_stored_in_a_key_format_in_place(model_dir, tmp_path, key_format):
    """Issue #33: under each served key format an amortize splice moves the stored keys (undoing the
    scales or the rotation around RoPE) to where a cold prefill puts them, within 4-bit precision."""
    a = Agent(model_dir, tmp_path / "cache", max_rotations=4, key_format=key_format)
    try:
        assert a.backend.get_stats()["key_format"]["chosen"] == key_format
        msgs = [{"role": "user", "content": _text("task", 20, 1)}, {"role": "assistant", "content": _tool_output(2)},
                {"role": "user", "content": _text("then", 24, 3)}]
        a.turn(msgs, None)
        first = a.turn([msgs[0], STUB] + msgs[2:], "amortize")
        assert first["applied"] and first["fallback"] is None and len(first["plan"]) == 1, first
        assert a.layer0_keys_off_cold() <= 2
    finally:
        a.close()


def test_the_boundaries_and_recompute_tokens_options_reach_the_served_plan(model_dir, tmp_path):
    """An edit inside the last message (a tool output before a note, one user message as vllm-mlx
    merges them): spliced at the note's line start by default; with recompute_tokens 4 the run's
    first 4 tokens are prefilled with the stub instead (keys still in place); with boundaries:
    messages nothing after the edit starts a message, so it is served exact with the reason."""
    msgs = lambda out: [{"role": "user", "content": _text("task", 20, 1)},  # noqa: E731
                        {"role": "assistant", "content": _text("ok", 12, 2)},
                        {"role": "user", "content": out + "\n\n" + _text("note", 30, 3)}]
    got = {}
    for name, opts in (("lines", {}), ("k4", {"recompute_tokens": 4}), ("messages", {"boundaries": "messages"})):
        a = Agent(model_dir, tmp_path / name, max_rotations=4, kv_edit=opts)
        try:
            a.turn(msgs(_tool_output(4)), None)
            got[name] = a.turn(msgs("tool output: (truncated)"), "amortize")
            if got[name]["applied"]:
                assert a.layer0_keys_off_cold() <= 2
        finally:
            a.close()
    lines, k4, messages = got["lines"], got["k4"], got["messages"]
    assert lines["applied"] and [p["boundary"] for p in lines["plan"]] == ["line"], lines
    assert k4["applied"] and k4["plan"][0]["run_tokens"] == lines["plan"][0]["run_tokens"] - 4, k4
    assert k4["plan"][0]["stub_tokens"] == lines["plan"][0]["stub_tokens"] + 4
    assert k4["recomputed_tokens"] == lines["recomputed_tokens"] + 4
    assert messages["applied"] is False and messages["fallback"] == "no_realignment", messages
    assert "kv_edit.boundaries: lines" in messages["detail"]
