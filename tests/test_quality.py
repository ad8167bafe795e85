"""Smoke test of `vllm-mlx-persist quality --quick`: trains a tiny model, measures, writes the report.

Only sanity is asserted (finite numbers, the report's shape, deterministic training, the control
rows); the quality numbers themselves are the full run's business (docs/quality.md).
"""

from __future__ import annotations

import json
import math

from vllm_mlx_persist import cli
from vllm_mlx_persist.tools.quality import FORMATS


def test_quick_quality(tmp_path, capsys):
    out, model_dir = tmp_path / "report", tmp_path / "model"
    assert cli.main(["quality", "--quick", "--out", str(out), "--model-dir", str(model_dir)]) == 0
    stdout = capsys.readouterr().out
    assert "command: " in stdout and "vllm-mlx-persist quality --quick" in stdout

    r = json.loads((out / "results" / "quality.json").read_text())
    md = (out / "quality.md").read_text()
    assert "| 4-bit, group 32 |" in md and r["command"] in md

    t = r["training"]
    assert len(t["losses"]) == t["config"]["steps"] and all(map(math.isfinite, t["losses"]))
    assert t["losses"][-1] < t["losses"][0]  # it learned something
    assert t["heldout_loss"] < math.log(t["config"]["size"]["vocab"])  # better than uniform
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / name).is_file()

    ppl = r["perplexity"]
    assert list(ppl) == [f.name for f in FORMATS]
    for p in ppl.values():
        assert math.isfinite(p["ppl"]) and 1 < p["ppl"] < t["config"]["size"]["vocab"]
        assert p["kl_from_full"] >= -1e-6
    assert ppl["fp32"]["delta_ppl"] == 0 and ppl["fp32"]["argmax_agreement"] == 1
    # close to the no-cache held-out loss (same model; different windows and chunking)
    assert abs(math.log(ppl["fp32"]["ppl"]) - t["heldout_loss"]) < 1.0
    # 4-bit moves the distributions more than 8-bit does
    assert ppl["q8g64"]["kl_from_full"] < ppl["q4g64"]["kl_from_full"]
    # fewer bytes per token for fewer bits (scales and biases included)
    b = [ppl[n]["kv_bytes_per_token"] for n in ("fp32", "q8g64", "q4g64")]
    assert b[0] > b[1] > b[2]

    g = r["greedy"]
    for f in FORMATS:
        assert 0 <= g[f.name]["teacher_forced_agreement"] <= 1
        assert 0 <= g[f.name]["prefix_match"] <= 1
    assert g["fp32"]["prefix_match"] == 1  # compared with itself


def test_quick_training_is_deterministic_and_reused(tmp_path):
    from dataclasses import replace

    from vllm_mlx_persist.tools.train import QUICK_CONFIG, train

    cfg = replace(QUICK_CONFIG, steps=40, heldout_windows=2)  # both phases, short and long
    logs: list[str] = []
    a = train(cfg, tmp_path / "a", log=logs.append)
    b = train(cfg, tmp_path / "b", log=logs.append)
    assert a.losses == b.losses
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    again = train(cfg, tmp_path / "a", log=logs.append)
    assert again.reused and again.losses == a.losses
