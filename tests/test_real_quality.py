"""`quality --model DIR` (tools/quality/real.py): the simulated levers must reproduce what the served
caches do where they claim to (else their rows say nothing about a served format), and keep exact
floats exactly where they say they do."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from vllm_mlx_persist.tools.quality.real import Lever, lever_view, main


def _kv(T: int = 100, seed: int = 0):
    rng = np.random.default_rng(seed)
    k = mx.array(rng.standard_normal((1, 2, T, 64)).astype(np.float32) * 3)
    v = mx.array(rng.standard_normal((1, 2, T, 64)).astype(np.float32))
    return k, v


def test_plain_lever_is_the_served_round_trip():
    k, v = _kv()
    kq, vq = lever_view(k, v, Lever())
    rt = lambda x: mx.dequantize(*mx.quantize(x, group_size=64, bits=4), group_size=64, bits=4)
    assert mx.array_equal(kq, rt(k)).item() and mx.array_equal(vq, rt(v)).item()


def test_float_positions_are_exact_and_only_those():
    k, v = _kv()
    kq, vq = lever_view(k, v, Lever(sinks=4, recent=10))
    exact = mx.all(kq == k, axis=(0, 1, 3))
    assert np.array(exact).tolist() == [True] * 4 + [False] * 86 + [True] * 10
    # per channel over 64 tokens: the first 64 tokens quantized, the open group (36) kept in float
    kc, _ = lever_view(k, v, Lever(key_axis="channel"))
    assert np.array(mx.all(kc == k, axis=(0, 1, 3))).tolist() == [False] * 64 + [True] * 36
    # rotations are undone: the error is a quantization error, not a rotated tensor
    kh, vh = lever_view(k, v, Lever(key_rotate=True, value_rotate=True))
    assert mx.abs(kh - k).max().item() < 0.5 * mx.abs(k).max().item()
    assert mx.abs(vh - v).max().item() < 0.5 * mx.abs(v).max().item()


def test_simulated_q4_reproduces_the_served_row(model_dir, tmp_path):
    out = tmp_path / "report"
    assert main(["--model", str(model_dir("llama", "micro")), "--windows", "1", "--window", "96", "--chunk", "32",
                 "--levers", "sim-q4,k8v4", "--out", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert rows["sim-q4"]["ppl"] == pytest.approx(rows["q4g64"]["ppl"], rel=1e-4)
    assert rows["sim-q4"]["bytes_per_token"] == pytest.approx(rows["q4g64"]["bytes_per_token"], rel=0.02)
    assert rows["fp32"]["delta_ppl_pct"] == 0 and rows["q4g64"]["kl"] > rows["q8g64"]["kl"] > 0
    assert "| keys 8-bit, values 4-bit |" in out.with_suffix(".md").read_text()


# auto's predictions against the perplexity change measured on held-out text (stated in docs/quality.md):
# within this many points, or this share of the measured change where that is larger.
MARGIN_POINTS, MARGIN_SHARE = 0.75, 0.25


def test_auto_predictions_agree_with_held_out_text_on_smollm2(smollm2_auto):
    """On the real SmolLM2-135M-Instruct, what auto predicts for a format on its measuring text
    (exp(KL) - 1) agrees with the perplexity change the served cache measures on 1,024 held-out
    tokens (CPython's language reference, which calibration never reads), within the stated margin;
    and the predictions sort the formats as the held-out text does."""
    from vllm_mlx_persist.tools.quality.kv_formats import FULL, KVFormat
    from vllm_mlx_persist.tools.quality.measure import perplexity
    from vllm_mlx_persist.tools.quality.real import heldout_text

    auto = smollm2_auto  # the model, its codec, the candidates and their predictions (tests/conftest.py)
    candidates = {n: auto.formats[n] for n in ("q4", "k5v4r", "k6v4c", "k8v4r")}
    predicted = auto.predicted(candidates)
    held_out = np.array(auto.tok.encode(heldout_text())[:1024], dtype=np.int64).reshape(1, 1024)
    rows = [FULL] + [KVFormat(n, n, 4, 64, factory=lambda m, f=f: auto.codec.with_key_formats(f).make_cache())
                     for n, f in candidates.items()]
    measured = {n: r["delta_ppl_pct"] for n, r in perplexity(auto.model, held_out, 256, rows, log=lambda s: None).items()}
    for n in candidates:
        assert abs(predicted[n] - measured[n]) <= max(MARGIN_POINTS, MARGIN_SHARE * measured[n]), \
            (n, predicted, measured)
    assert sorted(candidates, key=predicted.get)[2:] == sorted(candidates, key=measured.get)[2:] == ["k5v4r", "q4"]


def test_chat_mode_compares_greedy_replies_with_the_float_cache(model_dir, tmp_path):
    """`quality --model DIR --chat`: per served format, how many replies to CHAT_PROMPTS start and
    stay as the float cache's, and which prompts' first token changed."""
    from vllm_mlx_persist.tools.quality.real import CHAT_PROMPTS

    out = tmp_path / "chat"
    assert main(["--model", str(model_dir("llama", "micro")), "--chat", "--served", "q8g64,q4g64",
                 "--out", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads(out.with_suffix(".json").read_text())["chat"]}
    assert set(rows) == {"q8g64", "q4g64"}
    n = len(CHAT_PROMPTS)
    for r in rows.values():
        assert 0 <= r["identical"] <= r["first"] <= n and len(r["changed_first"]) == n - r["first"]
    assert "| 8-bit K and V, group 64 |" in out.with_suffix(".md").read_text()
