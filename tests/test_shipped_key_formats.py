"""The key formats the package ships (issue #50, item 5): `vllm-mlx-persist calibrate --ship` writes a
model's calibrated choice into the package, a server with a fresh cache root and no shared folder then
reads it instead of calibrating, and the project's real checkpoints, as `make-model` imports them, find
theirs (so a first `./dev serve` does not calibrate for minutes on a CPU)."""

from __future__ import annotations

import pytest

from vllm_mlx_persist import backend as backend_mod
from vllm_mlx_persist import key_choice


def _backend(model, tok, root, key_format="auto"):
    return backend_mod.PersistQ4Backend(model=model, tokenizer=tok, options={
        "cache_dir": str(root), "warmup": False, "restore": False, "key_format": key_format})


def _counting(monkeypatch) -> list[str]:
    calls: list[str] = []
    real = backend_mod.resolve_keys

    def counting(option, *a, **k):
        calls.append(option)
        return real(option, *a, **k)

    monkeypatch.setattr(backend_mod, "resolve_keys", counting)
    return calls


def test_a_shipped_choice_is_read_instead_of_calibrating(tiny_llama_dir, tmp_path, monkeypatch):
    """calibrate --ship writes one file into the package folder; a server on a new root, its shared
    folder off, reads it (and copies it into its root) without running the calibration; a damaged
    shipped file is ignored and the model calibrated as before."""
    from mlx_lm import load

    from vllm_mlx_persist.tools.quality.calibrate import calibrate

    monkeypatch.setattr(key_choice, "SHIPPED_DIR", tmp_path / "shipped")
    monkeypatch.setenv(key_choice.SHARED_ENV, "off")
    report, written = calibrate(tiny_llama_dir, "auto", ship=True)
    assert written is not None and written.parent == tmp_path / "shipped" and "measured" in report
    assert [p.name for p in (tmp_path / "shipped").iterdir()] == [written.name]

    model, tok = load(str(tiny_llama_dir))
    calls = _counting(monkeypatch)
    digests = []
    real_digest = backend_mod.model_digest
    monkeypatch.setattr(backend_mod, "model_digest", lambda *a: digests.append(1) or real_digest(*a))
    b = _backend(model, tok, tmp_path / "root")
    b.load()
    assert calls == [] and b.key_report["remembered"] == str(written)
    # the weights are hashed once for both fingerprints (q4's, the choice's key; the chosen format's)
    assert len(digests) == 1 and b.fingerprint != b._q4_fingerprint()
    assert b.key_report["chosen"] == report["chosen"]
    b.close()
    assert (tmp_path / "root" / key_choice.CHOICES_DIR / written.name).exists()
    # the block size is no part of a choice: a server with other blocks reads it too
    b = backend_mod.PersistQ4Backend(model=model, tokenizer=tok, options={
        "cache_dir": str(tmp_path / "root-blocks"), "warmup": False, "restore": False, "block_size": 32})
    b.load()
    assert calls == [] and b.key_report["remembered"] == str(written)
    b.close()

    written.write_text("{")  # not ours: calibrated again
    b = _backend(model, tok, tmp_path / "root2")
    b.load()
    assert calls == ["auto"] and "remembered" not in b.key_report
    b.close()


REAL = {"smollm2_dir": "smollm2-135m-instruct", "gemma3_dir": "gemma3-270m"}  # ./dev's import folders


@pytest.mark.parametrize("fixture", sorted(REAL))
def test_the_real_models_ship_their_choice(fixture, request, tmp_path, monkeypatch):
    """SmolLM2 and Gemma 3 270M, imported as ./dev imports them (float32 on a CPU), start with auto's
    shipped choice, no calibration. When this fails after a change to the calibration, the importer or
    mlx: `vllm-mlx-persist calibrate .models/<folder> --ship` for each (it replaces the stale file)."""
    from mlx_lm import load

    model_dir = request.getfixturevalue(fixture)
    monkeypatch.setenv(key_choice.SHARED_ENV, "off")
    model, tok = load(str(model_dir))
    calls = _counting(monkeypatch)
    b = _backend(model, tok, tmp_path / "root")
    try:
        b._resolve_keys()
    finally:
        b.close()
    assert calls == [], f"{REAL[fixture]}'s shipped key format is stale: vllm-mlx-persist calibrate ... --ship"
    assert b.key_report["remembered"].startswith(str(key_choice.SHIPPED_DIR))
    assert b.key_report["shipped_for"] == REAL[fixture] and b.key_report["chosen"] != "q4"


def test_the_package_ships_one_choice_per_real_model():
    """No stale file rides along: one shipped choice per real checkpoint, each one of them."""
    from vllm_mlx_persist.tools.quality.calibrate import _shipped_for

    shipped = sorted(_shipped_for(p) or p.name for p in key_choice.SHIPPED_DIR.glob("*.json"))
    assert shipped == sorted(REAL.values())
