"""tools/quality/splice_drift.py's measurement functions on a tiny llama (real MLX, float32): the comparisons,
the float splice built through `splice.apply` with a float codec, and the recall probe's wiring."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vllm_mlx_persist.tools.quality import splice_drift as sd


@pytest.fixture(scope="module")
def setup():
    from vllm_mlx_persist.tools.models.build import build_model

    model, _ = build_model("llama", "tiny", seed=0)
    return sd.make_setup(model)


def tokens(n, seed):
    return np.random.default_rng(seed).integers(5, 1000, size=n).tolist()


def test_compare_of_a_path_with_itself_and_with_another(setup):
    T = tokens(80, 1)
    a = sd.logprobs(setup.model, sd.prefill(setup.model, setup.fl, T[:60]), T[60:])
    b = sd.logprobs(setup.model, sd.prefill(setup.model, setup.fl, T[10:60]), T[60:])
    same = sd.compare(a, a, T[61:] + [T[0]])
    assert same["kl"] == pytest.approx(0, abs=1e-7) and same["top1"] == 1.0
    other = sd.compare(a, b, T[61:] + [T[0]])
    assert other["kl"] > 1e-4 and other["nll"] != pytest.approx(same["nll"])


def test_float_splice_without_an_edit_is_the_cold_prefill(setup):
    T = tokens(100, 2)
    cold = sd.prefill(setup.model, setup.fl, T[:80])
    src = sd.prefill(setup.model, setup.fl, T[:80])
    # the "stub" is the span itself, so the prompt is T and the run does not move
    got = sd.spliced(setup.model, setup.fl, setup.verdicts, src, T, 30, 50, 50, 30)
    ref, lp = sd.logprobs(setup.model, cold, T[80:]), sd.logprobs(setup.model, got, T[80:])
    assert sd.compare(ref, lp, T[81:] + [0])["kl"] < 1e-6


@pytest.mark.parametrize("stub", [4, 40])  # Δ < 0 and Δ > 0
def test_the_float_splice_moves_keys_exactly_and_the_4bit_one_within_quantization(setup, stub):
    T, r = tokens(140, 3), tokens(stub, 4)
    i, span, L = 40, 20, 48
    P = T[:i] + r + T[i + span:]
    at = i + stub
    cold = sd.prefill(setup.model, setup.fl, P[:at + L])
    cold_q4 = sd.prefill(setup.model, setup.q4, P[:at + L])
    src_f = sd.prefill(setup.model, setup.fl, T[:i + span + L])
    src_q = sd.prefill(setup.model, setup.q4, T[:i + span + L])
    moved = sd.spliced(setup.model, setup.fl, setup.verdicts, src_f, P, i, at, i + span, L)
    unmoved = sd.spliced(setup.model, setup.fl, setup.verdicts, src_f, P, i, at, i + span, L, move=False)
    q4 = sd.spliced(setup.model, setup.q4, setup.verdicts, src_q, P, i, at, i + span, L)
    # layer 0's keys depend only on token and position: moved, they are the cold prefill's
    assert sd.key_error(setup.fl, moved, cold, at, at + L) < 1e-5
    assert sd.key_error(setup.fl, unmoved, cold, at, at + L) > 0.1
    base = sd.key_error(setup.q4, cold_q4, cold, at, at + L)
    assert 0.01 < base < sd.key_error(setup.q4, q4, cold, at, at + L) < 2 * base

    lps = sd.edit_paths(setup, T, i, span, r, L, 16)
    targets = T[i + span + L + 1:][:16]
    kl = lambda ref, p: sd.compare(lps[ref][:-1], lps[p][:-1], targets)["kl"]  # noqa: E731
    assert kl("splice", "splice_q4") < kl("splice", "splice_q4_unmoved") / 4
    assert 0 < kl("splice", "splice_q4") < 3 * kl("cold", "cold_q4")


def test_chained_splices_compound_4bit_key_error_but_not_float(setup):
    T = tokens(120, 5)
    rows = sd.chain_paths(setup, T, 30, 16, [tokens(n, 6 + n) for n in (4, 12, 2)], 40, 8)
    assert [r["delta"] for r in rows] == [-12, 8, -10]
    errs = [r["key_error"] for r in rows]
    assert all(e["splice"] < 1e-5 for e in errs)
    assert errs[0]["splice_q4"] < errs[2]["splice_q4"] and errs[2]["splice_q4"] > 1.2 * errs[2]["cold_q4"]


def test_recall_probe_wiring(setup):
    from vllm_mlx_persist.tools.quality.train import load_tokenizer

    tok, _ = load_tokenizer(512)
    keys, values = sd.fact_vocab(tok)
    assert keys and values and all(tok.decode([v]).startswith(" ") for v in values)
    T = tokens(90, 7)
    A, F, B = T[:30], T[30:50], T[50:90]
    rng = np.random.default_rng(0)
    fact = sd.kv_fact(rng, keys, values, (277,), (202,))
    assert fact.tokens[-3:] == (277, *fact.targets, 202) and fact.probe == fact.tokens[:-2]
    copy = sd.copy_fact(rng, np.arange(100, 200))
    assert copy.probe + copy.targets == copy.tokens and len(copy.targets) == 4
    got = sd.recall(setup, A, F, B, fact, F + list(fact.tokens))  # the "stub" is the span: nothing removed
    assert set(got) == set(sd.CONDITIONS)
    assert all(lp <= 0 and 1 <= rank <= 1024 for lp, rank in got.values())
    assert got["amortize"][0] == pytest.approx(got["unedited"][0], abs=1e-3)
    assert got["forget"][0] == pytest.approx(got["unedited"][0], abs=1e-3)
    assert not math.isclose(got["control"][0], got["unedited"][0], abs_tol=1e-3)
    got = sd.recall(setup, A, F, B, copy, F + list(copy.tokens))
    assert got["amortize"][0] == pytest.approx(got["unedited"][0], abs=1e-3)


def test_point_kinds_and_the_kind_paths(setup):
    """Points by where the run starts (issue #32): a column-0 statement after a blank line (block), a
    line start (line), inside a line (mid); an edit that removes nothing splices to the cold prefill
    whatever the point and the recomputed tokens."""
    text = {10: "def", 11: " f", 12: "():", 13: "\n", 14: "\n    ", 15: "return", 16: " x"}.get
    toks = [10, 11, 12, 13, 13, 10, 11, 12, 14, 15, 16, 13]
    got = sd.point_kinds(toks, text, 0, len(toks))
    assert got["block"] == [5] and got["line"] == [9] and got["mid"] == [2, 6, 7, 10]
    T = tokens(120, 8)
    j, span, L = 60, 10, 24
    lps = sd.kind_paths(setup, T, j, span, T[j - 1 - span:j - 1], L, 8, (0, 3, 16))
    assert "splice_16" not in lps  # 8 tokens left to move: the planner would re-prefill the run
    ev = T[j + L + 1:][:8]
    for k in (0, 3):
        assert sd.compare(lps["cold"][:-1], lps[f"splice_{k}"][:-1], ev)["kl"] < 1e-6
        assert sd.compare(lps["cold"][:-1], lps[f"splice_q4_{k}"][:-1], ev)["kl"] > 0  # 4-bit: quantized


def test_chat_points_and_a_message_points_edit_keeps_the_end_tag(setup):
    """--chat (issue #42): message starts are points, never a line or mid point at or just after a tag;
    a message point's edit keeps the two tokens before it (end tag, newline), so an edit that
    removes nothing splices to the cold prefill."""
    S, E, NL = 1, 2, 13  # <|im_start|>, <|im_end|>, "\n"
    text = {S: "", E: "", NL: "\n", 20: "user", 10: "def", 11: " f", 12: "():"}.get
    toks = [S, 20, NL, 10, 11, 12, NL, 10, 11, 12, E, NL, S, 20, NL, 10, 11, 12, NL, 10, 11, E, NL]
    got = sd.point_kinds(toks, text, 0, len(toks), (S, E))
    assert got["message"] == [12]
    assert got["line"] == [7, 19] and got["mid"] == [5, 8, 9, 17, 20]  # none within 4 tokens after a tag
    T = tokens(120, 9)
    j, span, L = 60, 10, 24
    lps = sd.kind_paths(setup, T, j, span, T[j - 2 - span:j - 2], L, 8, (0,), keep=2)
    assert sd.compare(lps["cold"][:-1], lps["splice_0"][:-1], T[j + L + 1:][:8])["kl"] < 1e-6
