"""`quality --model DIR --text prose|code|chat` (tools/quality/heldout.py, issue #50 item 3): held-out texts of
three kinds from files CPython ships, never what calibration reads, the same on every run; and on the
real SmolLM2, auto's predictions agree with what those texts measure within the stated margin."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from vllm_mlx_persist import key_calibration as kc
from vllm_mlx_persist.tools.quality import heldout
from vllm_mlx_persist.tools.quality.real import MARGIN_POINTS, MARGIN_SHARE, main, within_margin


@pytest.mark.parametrize("kind", ["prose", "code", "chat"])
def test_held_out_texts_share_nothing_with_calibration(kind):
    """No run of 8 words in common with the texts auto calibrates and measures on, and long enough
    for the documented budgets (8 windows of 1,024 tokens at ~4 characters a token)."""
    text = heldout.raw_text(kind)
    assert heldout.overlap(text, [kc.CALIBRATION_TEXT, kc.MEASURE_TEXT]) == []
    assert len(text) > 30_000
    # the check itself sees a shared run
    assert heldout.overlap(text + " " + kc.MEASURE_TEXT[:200], [kc.MEASURE_TEXT])


def test_prose_is_idle_help_else_the_license_else_a_clear_error(tmp_path):
    text, sources, notes = heldout.prose_text()
    if sources == ["idlelib/help.html"]:
        assert "Integrated Development and Learning Environment" in text and "<" not in text[:2000]
        assert "¶" not in text and "Previous topic" not in text and "Sphinx" not in text  # the page chrome, header links
    (tmp_path / "LICENSE.txt").write_text("A. HISTORY OF THE SOFTWARE\n\nPython was created...\n")
    text, sources, notes = heldout.prose_text(tmp_path)
    assert sources == ["LICENSE.txt"] and text.startswith("A. HISTORY") and "idlelib/help.html not found" in notes[0]
    (tmp_path / "LICENSE.txt").unlink()
    with pytest.raises(heldout.HeldOutError, match="no prose file"):
        heldout.prose_text(tmp_path)


def test_code_skips_a_missing_file_and_names_it(tmp_path):
    (tmp_path / "shlex.py").write_text("import os\n")
    (tmp_path / "queue.py").write_text("import threading\n")
    text, sources, notes = heldout.code_text(tmp_path)
    assert sources == ["shlex.py", "queue.py"] and text == "import os\n\n\nimport threading\n"
    assert len(notes) == len(heldout.CODE_FILES) - 2 and "textwrap.py not found" in notes[0]


class _NoTemplate:
    """A tokenizer without a chat template (a base model's), around one that has it."""

    def __init__(self, tok):
        self._tok = tok
        self.bos_token_id = tok.bos_token_id
        self.chat_template = None

    def encode(self, text):
        return self._tok.encode(text)


def test_chat_is_the_template_else_a_plain_transcript(model_dir):
    from mlx_lm import load

    _, tok = load(str(model_dir("llama", "micro")))
    msgs = heldout.chat_messages()
    assert len(msgs) > 60 and [m["role"] for m in msgs[:2]] == ["user", "assistant"]
    chat = heldout.load("chat", tok)
    assert chat.ids == list(tok.apply_chat_template(msgs, tokenize=True))
    plain = heldout.load("chat", _NoTemplate(tok))
    assert plain.ids == list(tok.encode(heldout.plain_transcript(msgs)))
    assert "no chat template" in plain.notes[0] and "User:/Assistant:" in plain.description
    # the same text every time, and a different one per kind
    assert heldout.load("chat", tok).sha256 == chat.sha256 != heldout.load("code", tok).sha256


def test_every_window_starts_with_bos_where_sequences_need_it(tmp_path):
    ids = list(range(10, 40))
    w = heldout.windows(ids, 3, 8, skip=2, bos=1)
    assert w.tolist() == [[1, *range(12, 19)], [1, *range(19, 26)], [1, *range(26, 33)]]
    assert heldout.windows(ids, 9, 8).tolist() == [list(range(10, 18)), list(range(18, 26)), list(range(26, 34))]
    with pytest.raises(heldout.HeldOutError, match="too few"):
        heldout.windows(ids, 1, 64)

    class Tok:  # a tokenizer that does not apply the BOS its config asks for (Gemma 3, mlx-lm)
        bos_token_id = 2

        def encode(self, text):
            return [7, 8]

    assert heldout.bos_id(Tok()) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
    assert heldout.bos_id(Tok(), tmp_path) == 2


def test_text_kinds_report_auto_against_each_text(model_dir, tmp_path):
    """`--text prose,code,chat`: one report, per text auto's choice and prediction beside the
    measured change with the margin's verdict, and the served formats' Pareto front."""
    out = tmp_path / "kinds"
    assert main(["--model", str(model_dir("llama", "micro")), "--windows", "2", "--window", "64", "--chunk", "32",
                 "--text", "prose,code,chat", "--served", "q8g64,q4g64,auto", "--out", str(out)]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert [t["text_kind"] for t in report["texts"]] == ["prose", "code", "chat"]
    for t in report["texts"]:
        c, rows = t["check"], {r["name"]: r for r in t["rows"]}
        assert c["measured_pct"] == rows["auto"]["delta_ppl_pct"] and c["chosen"] == t["auto"]["auto"]["chosen"]
        assert c["predicted_pct"] == t["auto"]["auto"]["measured"][c["chosen"]]["predicted_pct"]
        assert c["sem_pct"] == rows["auto"]["sem_pct"] > 0
        assert c["within"] == (abs(c["predicted_pct"] - c["measured_pct"])
                               <= max(MARGIN_POINTS, MARGIN_SHARE * abs(c["measured_pct"])) + 2 * c["sem_pct"])
        assert t["front"][0] == "q4g64" and set(t["front"]) <= {"q4g64", "q8g64"}
        assert t["held_out"]["tokens"] >= 2 * 64 and len(t["held_out"]["sha256"]) == 64
    md = out.with_suffix(".md").read_text()
    assert "| prose: IDLE's user guide" in md or "| prose: CPython's LICENSE.txt" in md
    assert "Margin: 0.75 points or 25% of the measured change, whichever is larger, plus twice" in md
    with pytest.raises(SystemExit):
        main(["--model", str(model_dir("llama", "micro")), "--text", "poetry"])


def test_served_front_keeps_only_formats_no_cheaper_one_beats():
    from vllm_mlx_persist.tools.quality.real import served_front

    row = lambda name, b, d, served=True: {"name": name, "bytes_per_token": b, "delta_ppl_pct": d, "served": served}
    rows = [row("fp32", 900, 0.0), row("q8g64", 180, 0.1), row("q4g64", 100, 17.0), row("scaled", 100, 12.0),
            row("k5v4c", 105, 1.6), row("k5v4r", 110, 1.8), row("k6v4c", 115, 0.7), row("k8v4", 140, 1.1),
            row("auto", 115, 0.7), row("sim", 101, 0.01, served=False)]
    assert served_front(rows) == ["scaled", "k5v4c", "k6v4c", "q8g64"]


HELD_OUT_TOKENS = 384  # two windows per text: the test's budget


def test_auto_predictions_hold_on_code_and_chat_on_smollm2(smollm2_auto, smollm2_dir):
    """On the real SmolLM2-135M-Instruct, what auto predicts for its candidates on its measuring text
    (exp(KL) - 1; plain 4-bit and the centred 5- and 6-bit keys) agrees with the perplexity change
    each served cache measures on 2 x 384 tokens of held-out code and of a chat transcript: for the
    candidate auto's rule picks (the cheapest predicted within LIMIT_PCT: k6v4c, as auto serves),
    the perplexity change within the stated margin (real_quality.within_margin, + twice the s.e. over
    the windows); for every candidate, exp(KL) - 1 on those texts within the margin alone."""
    from vllm_mlx_persist.tools.quality.kv_formats import FULL, KVFormat
    from vllm_mlx_persist.tools.quality.measure import perplexity

    auto = smollm2_auto  # the model, its codec, the candidates and their predictions (tests/conftest.py)
    model, tok, codec = auto.model, auto.tok, auto.codec
    candidates = {n: auto.formats[n] for n in ("q4", *kc.CENTRED)}
    predicted = auto.predicted(candidates)
    n_kv, D = kc._kv_shape(auto.keys)
    ranked = sorted(candidates, key=lambda n: (kc.bytes_per_token(codec, candidates[n], n_kv, D), kc.ORDER.index(n)))
    assert next((n for n in ranked if predicted[n] <= kc.LIMIT_PCT), None) == "k6v4c", predicted
    rows = [FULL] + [KVFormat(n, n, 4, 64, factory=lambda m, f=f: codec.with_key_formats(f).make_cache())
                     for n, f in candidates.items()]
    for kind in ("code", "chat"):
        held = heldout.load(kind, tok, smollm2_dir)
        w = heldout.windows(held.ids, 2, HELD_OUT_TOKENS, bos=heldout.bos_id(tok, smollm2_dir))
        res = perplexity(model, w, 256, rows, log=lambda s: None)
        # auto's choice: its perplexity change, within the margin and twice its s.e. over the windows
        change, sem = res["k6v4c"]["delta_ppl_pct"], 100 * res["k6v4c"]["delta_nll_sem"]
        assert within_margin(predicted["k6v4c"], change, sem), (kind, predicted, change, sem)
        # every candidate: what the prediction estimates, exp(KL) - 1 on this text, within the margin
        # alone (the perplexity change of 768 tokens swings by more than that: q4 +11.5% on chat)
        for n in candidates:
            kl_pct = 100 * math.expm1(res[n]["kl_from_full"])
            assert within_margin(predicted[n], kl_pct), (kind, n, predicted, kl_pct)
