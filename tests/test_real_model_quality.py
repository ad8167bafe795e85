"""The 4-bit cache in served formats on each real model, against mlx-lm's float cache, on 512 tokens
of text the calibration never reads (CPython's language reference, `real_quality.heldout_text`).

Each model's float perplexity has a bound too: an import that maps a weight wrongly or loses the BOS
moves it far (Gemma 3 270M without BOS: 71.2 against 21.6). The KL and top-1 bounds sit between
what the code measures and what a known defect measures: centred keys balanced by
rms(k - c) / rms(q) instead of its square root (`caches.key_formats.balance_scales`) leaves k6v4c
within a few percent but moves k5v4c's KL by +57%.

Measured (float32 on a 2-core x86 CPU, OpenBLAS; the test's own numbers are in its assertion
messages):

| model | format | float ppl | KL (nats/token) | top-1 | with the defect |
|---|---|---:|---:|---:|---|
| SmolLM2-135M-Instruct | k6v4c (auto's choice) | 17.54 | 0.00764 | 97.3% | KL 0.00922, 96.7% |
| SmolLM2-135M-Instruct | k5v4c | | 0.0144 | 95.1% | KL 0.0227, 93.5% |
| Gemma 3 270M | k6v4c (auto's choice) | 21.59 | 0.00770 | 94.7% | KL 0.0162, 93.7% |
| Gemma 3 270M | (k8v4r / k8v4 / q4, for scale) | | 0.00825 / 0.0114 / 0.278 | 95.5% / 93.0% / 72.6% | |

The same measurement checks auto's shipped choice (issue #50): the prediction shipped for the served
format against what its cache measures here, and the best-predicted cheaper candidate measuring no
better (the last tests). Each model is measured once for all its tests.
"""

from __future__ import annotations

import functools
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest

from vllm_mlx_persist import key_calibration as kc
from vllm_mlx_persist.key_choice import SHIPPED_DIR
from vllm_mlx_persist.tools.quality.real import margin, within_margin

TOKENS, CHUNK = 512, 256


@functools.cache
def _measure(model_dir: Path, options: tuple[str, ...]) -> dict[str, dict]:
    """Float and each `key_format` option's served cache (as the backend builds it: bits 4, group 64,
    the option resolved by key_calibration on its built-in text) over the first TOKENS tokens of the
    held-out text, encoded as the server encodes a completion prompt (BOS where the model asks).
    Measured once per run for each (model, options): the tests below share it."""
    t0 = time.perf_counter()
    from mlx_lm import load

    from vllm_mlx_persist.caches import ModelCodec
    from vllm_mlx_persist.caches.attention import install_attention_fix
    from vllm_mlx_persist.tools.quality.kv_formats import FULL, KVFormat, float_copies
    from vllm_mlx_persist.tools.quality.measure import perplexity
    from vllm_mlx_persist.tools.quality.real import heldout_text

    install_attention_fix()
    model, tok = load(str(model_dir))
    codec = ModelCodec.for_model(model, bits=4, group_size=64, bounded=True, float_copies=float_copies())
    rows = [FULL]
    for option in options:
        formats, _ = kc.resolve(option, model, tok, codec)
        rows.append(KVFormat(option, option, 4, 64, factory=lambda m, f=formats: codec.with_key_formats(f).make_cache()))
    ids = np.array(tok.encode(heldout_text())[:TOKENS], dtype=np.int64).reshape(1, TOKENS)
    out = perplexity(model, ids, CHUNK, rows, log=lambda s: None)
    out["fp32"]["first_ids"] = ids[0, :2].tolist()
    out["fp32"]["seconds"] = time.perf_counter() - t0
    return out


def _summary(r: dict) -> str:
    return "; ".join(f"{n}: ppl {v['ppl']:.3f} ({v['delta_ppl_pct']:+.2f}%) KL {v['kl_from_full']:.5f} "
                     f"top-1 {v['argmax_agreement']:.4f}" for n, v in r.items())


def test_smollm2_centred_formats_against_the_float_cache(smollm2_dir):
    """SmolLM2-135M-Instruct: k6v4c (what auto serves) and k5v4c within their bounds; the defect
    above fails k5v4c's KL bound (0.0227 against 0.018)."""
    r = _measure(smollm2_dir, ("k5v4c", "k6v4c"))
    msg = f"{_summary(r)} ({r['fp32']['seconds']:.0f} s)"
    assert r["fp32"]["first_ids"][0] != 1, msg  # its GGUF says add_bos_token false: no BOS (id 1) added
    assert r["fp32"]["ppl"] < 20.0, msg  # 17.54
    assert r["k6v4c"]["kl_from_full"] <= 0.0095 and r["k6v4c"]["argmax_agreement"] >= 0.955, msg
    assert r["k5v4c"]["kl_from_full"] <= 0.018 and r["k5v4c"]["argmax_agreement"] >= 0.93, msg


def test_gemma3_served_format_against_the_float_cache(gemma3_dir):
    """Gemma 3 270M (base): every prompt starts with BOS (id 2) and the float model reads the text as
    Gemma does (perplexity ~21.6; without BOS 71.2); k6v4c (what auto serves on it, shipped: predicted
    +0.82%) within its bounds; the balance defect above doubles its KL (0.0162 against 0.011)."""
    r = _measure(gemma3_dir, ("k5v4c", "k6v4c"))
    msg = f"{_summary(r)} ({r['fp32']['seconds']:.0f} s)"
    assert r["fp32"]["first_ids"][0] == 2 and r["fp32"]["first_ids"][1] != 2, msg
    assert r["fp32"]["ppl"] < 25.0, msg  # 21.59
    assert r["k6v4c"]["kl_from_full"] <= 0.011 and r["k6v4c"]["argmax_agreement"] >= 0.93, msg


# auto's shipped choices (vllm_mlx_persist/shipped_key_formats, `vllm-mlx-persist calibrate DIR --ship`)
# against what the served caches measure on the held-out text above, which calibration never reads
# (issue #50: "auto's predictions and choices are tested against measurements on both" real models).


def _shipped(model_dir: Path) -> dict:
    """auto's report shipped for this real checkpoint (found by its import folder's name)."""
    reports = [r for r in (json.loads(p.read_text())["report"] for p in sorted(SHIPPED_DIR.glob("*.json")))
               if r.get("shipped_for") == model_dir.name]
    assert len(reports) == 1, f"{len(reports)} shipped choices for {model_dir.name}"
    return reports[0]


def _rival(report: dict) -> str:
    """The candidate auto did not serve that its calibration predicts best among those of at most the
    served format's bytes: the one most likely to show auto paid for nothing."""
    served = report["measured"][report["chosen"]]
    others = {n: m["predicted_pct"] for n, m in report["measured"].items()
              if n != report["chosen"] and m["bytes_per_token"] <= served["bytes_per_token"] + 1e-6}
    return min(others, key=others.get)


@pytest.mark.parametrize("path", sorted(SHIPPED_DIR.glob("*.json")), ids=lambda p: p.stem[:8])
def test_a_shipped_choice_is_what_autos_rule_picks_from_its_predictions(path):
    """Each shipped choice is what `key_calibration.choose` picks from the predictions shipped beside
    it, within the limit, and no candidate of equal or fewer bytes is predicted better (auto never
    prefers a format its calibration shows worse at equal bytes). No model is run."""
    report = json.loads(path.read_text())["report"]
    measured, chosen = report["measured"], report["chosen"]
    assert kc.choose([(n, m["bytes_per_token"], m["predicted_pct"]) for n, m in measured.items()],
                     report["limit_pct"]) == (chosen, report["within_limit"]), report
    served = measured[chosen]
    assert report["within_limit"] and served["predicted_pct"] <= report["limit_pct"], report
    better = [n for n, m in measured.items() if n != chosen and m["bytes_per_token"] <= served["bytes_per_token"]
              and m["predicted_pct"] < served["predicted_pct"]]
    assert better == [], (chosen, better, measured)


def _check_shipped_against_held_out(model_dir: Path) -> None:
    """The shipped prediction for the served format is within the stated margin (tools/quality/real.py
    `margin`: 0.75 points, or 25% of the measured change where larger) of the perplexity change, and of
    exp(KL) - 1, that its served cache measures on TOKENS held-out tokens; and the best-predicted
    candidate of at most its bytes (`_rival`) measures no better there (exp(KL) - 1: the quantity auto
    predicts, steadier than a few hundred tokens' perplexity)."""
    report = _shipped(model_dir)
    chosen, rival = report["chosen"], _rival(report)
    r = _measure(model_dir, tuple(sorted((chosen, rival))))
    predicted = report["measured"][chosen]["predicted_pct"]
    change = r[chosen]["delta_ppl_pct"]
    kl_pct = {n: 100 * math.expm1(r[n]["kl_from_full"]) for n in (chosen, rival)}
    msg = (f"{model_dir.name}: auto serves {chosen}, predicted {predicted:+.2f}%; held out: change "
           f"{change:+.2f}% (margin {margin(change):.2f}), exp(KL) - 1 {kl_pct[chosen]:+.2f}%; rival {rival} "
           f"({report['measured'][rival]['bytes_per_token']:.0f} against "
           f"{report['measured'][chosen]['bytes_per_token']:.0f} B/token) exp(KL) - 1 {kl_pct[rival]:+.2f}%; "
           f"{_summary(r)}")
    assert within_margin(predicted, change), msg
    assert within_margin(predicted, kl_pct[chosen]), msg
    assert kl_pct[chosen] <= kl_pct[rival], msg


def test_smollm2_shipped_prediction_and_choice_hold_on_held_out_text(smollm2_dir):
    """SmolLM2-135M-Instruct: k6v4c predicted +0.73%, measured +0.24% (exp(KL) - 1 +0.77%); its rival
    k5v4c (1.05x) +1.06% (+1.45%). With the shipped prediction 2.5% the margin check fails."""
    _check_shipped_against_held_out(smollm2_dir)


def test_gemma3_shipped_prediction_and_choice_hold_on_held_out_text(gemma3_dir):
    """Gemma 3 270M: k6v4c predicted +0.82%, exp(KL) - 1 measured +0.77%; its rival k5v4c (1.05x)
    +1.79% (+1.09%). With the choice swapped to k5v4r (1.10x) the rival check fails (+4.48%)."""
    _check_shipped_against_held_out(gemma3_dir)
