"""`vllm-mlx-persist quality`: the quick run end to end (tiny models of every family: trains,
measures, writes the report), and the pieces the measurement rests on, checked on real MLX models.

The quality numbers themselves are the full run's business (docs/quality.md); here only what must
hold whatever the model: controls, orderings that follow from the arithmetic, the simulation
matching the served cache, the outlier construction leaving the float model unchanged.

The quick run trains its models, so its numbers move with the machine's float kernels (the BLAS, its
kernel choice and its thread count change the trained weights, not only the last bits). Every margin
asserted on the quick run held on four kernels, one BLAS thread as `./dev test` runs them: OpenBLAS
0.3.21 as `./dev` preloads it (Zen: Haswell kernels), `OPENBLAS_CORETYPE=Sandybridge`,
`OPENBLAS_CORETYPE=Nehalem` and mlx-cpu's own BLAS (no preload), with the other families trained
`QUICK_FAMILY_STEPS` (20) steps. Measured there (min / max over the four; the issue that asked for
this saw 2.6 for the first on another machine) and asserted:
- outlier keys, 4-bit group 64 KL over Hadamard-rotated keys: 5.18 / 11.5, asserted > 1.5;
- over 8-bit keys with 4-bit values: 174 / 290, asserted > 10;
- plain llama, 4-bit over 8-bit KL: 112 / 486, asserted > 1;
- latents: 8-bit KL is float noise (-2.5e-8 to 3.9e-8), 4-bit 9.1e-7 to 2.8e-6: asserted 8-bit < 4-bit;
- key outlier sweep, max/median of the strongest over the plain model: 39 / 49.8, asserted > 10;
- the other families' held-out loss 5.22 / 5.45 (20 steps; 5.08 / 5.36 at 40) against log(512) = 6.24
  for a uniform guess.
The random-weight checks below (no training) gave the same figures on all four kernels.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from vllm_mlx_persist import cli
from vllm_mlx_persist.caches.key_formats import hadamard
from vllm_mlx_persist.tools.quality import families
from vllm_mlx_persist.tools.quality.families import FAMILIES, OUTLIER_SWEEP, add_cache_format, family_formats
from vllm_mlx_persist.tools.quality.kv_formats import FORMATS, FULL, KVFormat, QSpec, fake_quantize, sim_factory
from vllm_mlx_persist.tools.quality.mla_latents import _latent_cache_classes, latent_bytes, per_turn_latent_format
from vllm_mlx_persist.tools.quality.outlier_keys import Outliers, add_key_outliers, key_channel_stats, outlier_channels
from vllm_mlx_persist.tools.quality.train import family_overrides


def test_quick_quality(tmp_path, capsys):
    out, model_dir = tmp_path / "report", tmp_path / "model"
    out.mkdir()
    (out / "quality.md").write_text("# old\n\n## Command\n\nold\n\n## Written by hand\n\nkept.\n")
    assert cli.main(["quality", "--quick", "--out", str(out), "--model-dir", str(model_dir)]) == 0
    stdout = capsys.readouterr().out
    assert "command: " in stdout and "vllm-mlx-persist quality --quick" in stdout

    r = json.loads((out / "results" / "quality.json").read_text())
    md = (out / "quality.md").read_text()
    assert r["command"] in md and "## Summary: per family, against the seed paper" in md
    assert "## Written by hand\n\nkept." in md and "# old" not in md  # a full run keeps what it does not write
    assert list(r["families"]) == list(FAMILIES)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / name).is_file()
    for arch in ("gemma3_text", "qwen3_next", "deepseek_v3"):
        assert (tmp_path / f"model-{arch}" / "model.safetensors").is_file()
        assert json.loads((tmp_path / f"model-{arch}" / "config.json").read_text())["model_type"] == arch

    fams = r["families"]
    for name, f in fams.items():
        ppl, g = f["perplexity"], f["greedy"]
        assert list(ppl)[0] == "fp32" and ppl["fp32"]["delta_ppl"] == 0 and ppl["fp32"]["argmax_agreement"] == 1
        assert g["fp32"]["teacher_forced_agreement"] == 1  # the control: compared with itself
        for p in ppl.values():
            assert math.isfinite(p["ppl"]) and 1 < p["ppl"] < 512 and p["kl_from_full"] >= -1e-6
        assert f"### {f['title']}" in md
        if name in ("llama", "gemma3_text", "qwen3_next", "deepseek_v3"):
            t = f["training"]
            assert len(t["losses"]) == t["config"]["steps"] and t["losses"][-1] < t["losses"][0]
            assert t["heldout_loss"] < math.log(t["config"]["size"]["vocab"])  # better than uniform

    llama = fams["llama"]
    assert list(llama["perplexity"])[: len(FORMATS)] == [f.name for f in FORMATS]
    assert llama["perplexity"]["q8g64"]["kl_from_full"] < llama["perplexity"]["q4g64"]["kl_from_full"]
    b = [llama["perplexity"][n]["kv_bytes_per_token"] for n in ("fp32", "q8g64", "q4g64")]
    assert b[0] > b[1] > b[2]
    assert llama["greedy"]["fp32"]["prefix_match"] == 1
    assert "| 4-bit, group 32 |" in md

    # each family's full precision is mlx-lm's own cache of that family
    assert "RotatingKVCache" in fams["gemma3_text"]["perplexity"]["fp32"]["label"]
    assert "ArraysCache" in fams["qwen3_next"]["perplexity"]["fp32"]["label"]
    # hybrid: only the attention layers are quantized, the recurrent state is counted in full
    qn = fams["qwen3_next"]["perplexity"]
    assert qn["q4g64"]["kv_bytes_per_token"] > llama["perplexity"]["q4g64"]["kv_bytes_per_token"] / 2
    # latents: 8-bit moves the model less than 4-bit, in fewer bytes than float
    ds = fams["deepseek_v3"]["perplexity"]
    assert ds["lat8"]["kl_from_full"] < ds["lat4"]["kl_from_full"]
    assert ds["fp32"]["kv_bytes_per_token"] > ds["lat8"]["kv_bytes_per_token"] > ds["lat4"]["kv_bytes_per_token"]
    # the option packs earlier turns only (each chunk is a turn): the first turn is read exactly as in
    # full precision, the later ones see packed latents. (Its KL against packing every token varied
    # from 0.08x to 0.98x over the four kernels: too thin a margin to assert; the per-turn mechanism
    # itself is checked exactly by test_latent_caches_quantize_the_latent_only.)
    assert ds["lat4turn"]["ppl_by_chunk"][0] == pytest.approx(ds["fp32"]["ppl_by_chunk"][0], rel=1e-5)
    assert ds["lat4"]["ppl_by_chunk"][0] != pytest.approx(ds["fp32"]["ppl_by_chunk"][0], rel=1e-5)
    assert ds["lat4turn"]["kl_from_full"] > 0

    # outliers: the simulation reproduces the served cache; outlier keys hurt 4-bit group 64 and a
    # rotation or 8-bit keys take it back
    o = fams["llama_outliers"]["perplexity"]
    assert o["q4g64sim"]["ppl"] == pytest.approx(o["q4g64"]["ppl"], rel=1e-4)
    assert o["q4g64"]["kl_from_full"] > 1.5 * o["q4g64h"]["kl_from_full"]  # 5.18-11.5 measured (module docstring)
    assert o["q4g64"]["kl_from_full"] > 10 * o["k8v4"]["kl_from_full"]  # 174-290 measured
    # served key formats (issue #33): 8-bit keys and Hadamard-rotated keys served are their
    # simulations; served per-channel scales (calibrated at load) take most of the loss back too
    assert o["k8v4srv"]["ppl"] == pytest.approx(o["k8v4"]["ppl"], rel=1e-4)
    assert o["q4g64hsrv"]["ppl"] == pytest.approx(o["q4g64h"]["ppl"], rel=1e-4)
    assert o["q4g64ssrv"]["kl_from_full"] < o["q4g64"]["kl_from_full"]
    auto = fams["llama_outliers"]["key_format_auto"]
    assert auto["option"] == "auto" and auto["chosen"] in auto["measured"] or auto["chosen"] in ("mixed", "mixedr")
    sweep = r["outliers"]["sweep"]
    assert [s["scale"] for s in sweep] == [1.0, *OUTLIER_SWEEP]
    # same windows: the outlier model's float perplexity is the plain llama's
    assert o["fp32"]["ppl"] == pytest.approx(sweep[0]["ppl"]["fp32"]["ppl"], rel=1e-4)
    assert sweep[-1]["key_max_over_median"] > 10 * sweep[0]["key_max_over_median"]

    lat = r["latent"]
    assert {row["context"] for row in lat["speed"]["rows"]} == {128, 256}
    for row in lat["speed"]["rows"]:
        assert all(row[k] > 0 for k in ("float", "4-bit, dequantized every step", "8-bit: pack ms", "4-bit: build ms"))
    for row in lat["bytes"].values():
        assert row["float"] > row["8-bit"] > row["4-bit"]
    assert "## MLA latents in 8 or 4 bits" in md and "## Keys with outlier channels" in md


def test_quick_training_is_deterministic_and_reused(tmp_path):
    from dataclasses import replace

    from vllm_mlx_persist.tools.quality.train import QUICK_CONFIG, train

    cfg = replace(QUICK_CONFIG, steps=8, heldout_windows=2)  # both phases: 6 short steps, then 2 long
    logs: list[str] = []
    a = train(cfg, tmp_path / "a", log=logs.append)
    b = train(cfg, tmp_path / "b", log=logs.append)
    assert a.losses == b.losses
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    again = train(cfg, tmp_path / "a", log=logs.append)
    assert again.reused and again.losses == a.losses
    # another family is another model: not reused from a llama's directory
    other = replace(cfg, arch="gemma3_text", overrides=family_overrides("gemma3_text", 2, 32), steps=2)
    assert not train(other, tmp_path / "a", log=logs.append).reused


def test_llama_stamp_unchanged_by_family_fields():
    """A llama trained before TrainConfig had `arch`/`overrides` keeps its stamp (and is reused)."""
    from vllm_mlx_persist.tools.quality.train import TrainConfig

    d = TrainConfig().to_dict()
    assert "arch" not in d and "overrides" not in d
    assert TrainConfig(arch="qwen3_next").to_dict()["arch"] == "qwen3_next"


@pytest.fixture(scope="module")
def tiny_llama():
    from vllm_mlx_persist.tools.models.build import build_model

    model, _ = build_model("llama", "tiny", seed=3)
    return model


def _logits(model, tokens, cache):
    import mlx.core as mx

    out = model(mx.array([tokens]), cache=cache)
    mx.eval(out)
    return np.array(out)


def test_hadamard_and_fake_quantize():
    import mlx.core as mx

    h = hadamard(64)
    np.testing.assert_allclose(h @ h.T, np.eye(64), atol=1e-6)
    with pytest.raises(ValueError):
        hadamard(48)
    x = mx.random.normal((1, 2, 5, 64), key=mx.random.key(0))
    x = x * mx.array(np.where(np.arange(64) % 31 == 0, 30.0, 1.0).astype(np.float32))  # outlier channels
    plain = fake_quantize(x, QSpec(4, 64))
    rot = fake_quantize(x, QSpec(4, 64, "hadamard"))
    assert fake_quantize(x, None) is x
    # the rotated round trip is the rotation of a plain round trip of the rotated keys
    hx = x @ mx.array(h)
    want = fake_quantize(hx, QSpec(4, 64)) @ mx.array(h).T
    assert mx.abs(rot - want).max().item() < 1e-4
    # and spreading the outliers makes the round trip far more accurate
    err = lambda y: mx.abs(y - x).mean().item()
    assert err(rot) < err(plain) / 3


def test_simulated_4bit_matches_the_served_cache(tiny_llama):
    """A prefill through the simulation gives the served Q4KVCache's logits (on the CPU the served
    cache attends multi-token chunks on the same dequantized values)."""
    from vllm_mlx_persist.caches.attention import install_attention_fix

    install_attention_fix()
    tokens = list(range(5, 69))
    served = FORMATS[2].make_cache(tiny_llama)
    sim = sim_factory(QSpec(4, 64), QSpec(4, 64))(tiny_llama)
    assert type(sim[0]).__name__ == "SimQuantCache" and type(served[0]).__name__ == "Q4KVCache"
    a, b = _logits(tiny_llama, tokens, served), _logits(tiny_llama, tokens, sim)
    full = _logits(tiny_llama, tokens, FULL.make_cache(tiny_llama))
    assert np.abs(a - b).max() < 1e-4
    assert np.abs(a - full).max() > 1e-3  # and 4-bit is not a no-op
    assert sim[0].stored_nbytes == served[0].nbytes * sim[0].offset // served[0].keys[0].shape[2]


def test_outlier_construction_keeps_the_float_model():
    import mlx.core as mx

    from vllm_mlx_persist.tools.models.build import build_model

    model, _ = build_model("llama", "tiny", seed=3)
    tokens = list(range(5, 69))
    window = np.array([tokens])
    before = _logits(model, tokens, FULL.make_cache(model))
    q4_before = np.abs(_logits(model, tokens, FORMATS[2].make_cache(model)) - before).mean()
    ratio0 = np.median(key_channel_stats(model, window)["max_over_median"])
    add_key_outliers(model, Outliers(pairs=2, scale=16.0))
    after = _logits(model, tokens, FULL.make_cache(model))
    assert np.abs(after - before).max() < 1e-3 * np.abs(before).max()
    stats = key_channel_stats(model, window)
    assert np.median(stats["max_over_median"]) > 5 * ratio0
    # the outliers sit where outlier_channels says, in every head
    D = 64
    for scales in stats["scales"]:
        s = np.array(scales)[:, 0, :]
        top = set(np.argsort(-s, axis=1)[:, :4].ravel().tolist())
        assert top == set(outlier_channels(D, 2))
    # and hurt 4-bit group 64 keys far more than before; rotated or 8-bit keys take most of it back
    # (measured 4.1x, 1.96x and 1.21x on every kernel the module docstring names)
    err = lambda factory: np.abs(_logits(model, tokens, factory(model)) - after).mean()
    q4 = err(FORMATS[2].make_cache)
    assert q4 > 3 * q4_before
    assert err(sim_factory(QSpec(4, 64, "hadamard"), QSpec(4, 64))) < q4 / 1.5
    assert err(sim_factory(QSpec(8, 64), QSpec(4, 64))) < q4_before
    del mx


def test_cache_format_hook_adds_a_row(tiny_llama, monkeypatch):
    from mlx_lm.models.cache import make_prompt_cache

    monkeypatch.setattr(families, "EXTRA_FORMATS", {})
    made = []

    def factory(model):
        made.append(1)
        return make_prompt_cache(model)

    add_cache_format("gemma3_text", KVFormat("bounded", "bounded to the window", factory=factory))
    with pytest.raises(ValueError):
        add_cache_format("nope", KVFormat("x", "x", factory=factory))
    fmts = family_formats(FAMILIES["gemma3_text"], tiny_llama)
    assert fmts[-1].name == "bounded" and fmts[-1].make_cache(tiny_llama) and made
    assert all(f.name != "bounded" for f in family_formats(FAMILIES["qwen3_next"], tiny_llama))


def test_latent_caches_quantize_the_latent_only():
    """deepseek_v3: the sim factory replaces the latent layers only with `latent=True`; the caches of
    the speed measurement and the per-turn rows attend on the quantizer's values where they should."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    from vllm_mlx_persist.tools.models.build import Size, model_config
    from vllm_mlx_persist.tools.quality.train import init_weights

    size = Size(layers=2, hidden=128, heads=4, kv_heads=2, head_dim=64, intermediate=256, vocab=512)
    config = model_config("deepseek_v3", size)
    config.update(dict(family_overrides("deepseek_v3", 2, 32)))
    mc, ac = _get_classes(config)
    model = mc(ac.from_dict(config))
    init_weights(model, config, 0)
    tokens = list(range(5, 69))
    assert all(type(c).__name__ == "KVCache" for c in sim_factory(QSpec(4, 64), QSpec(4, 64))(model))
    sim = sim_factory(QSpec(8, 64), QSpec(8, 64), latent=True)(model)
    assert all(type(c).__name__ == "SimQuantCache" for c in sim)
    _logits(model, tokens, sim)
    assert sim[0].stored_nbytes == 64 * (128 + 64 + 2 * 3 * 4)  # 8-bit codes + float32 scale, bias per group
    PerTurn, EveryStep = _latent_cache_classes()
    every = sim_factory(QSpec(8, method="minmax"), QSpec(8, method="minmax"), latent=True)
    # one call: the dequantize-every-step cache attends on exactly the simulation's values
    a = _logits(model, tokens, [EveryStep(8) for _ in range(2)])
    assert np.abs(a - _logits(model, tokens, every(model))).max() < 1e-5
    # per turn: the first call is all float (nothing packed yet); the second call sees it packed
    fmt = per_turn_latent_format("t", "t", 4)
    turn, sim, full = fmt.make_cache(model), every(model), FULL.make_cache(model)
    assert np.abs(_logits(model, tokens, turn) - _logits(model, tokens, full)).max() < 1e-5
    nxt = list(range(70, 90))
    t2, f2 = _logits(model, nxt, turn), _logits(model, nxt, full)
    assert turn[0].packed_upto == len(tokens) and np.abs(t2 - f2).max() > 1e-4
    b4 = sim_factory(QSpec(4, method="minmax"), QSpec(4, method="minmax"), latent=True)(model)
    _logits(model, tokens, b4)
    assert np.abs(t2 - _logits(model, nxt, b4)).max() > 0  # the current turn stays float
    del sim
    b = latent_bytes(512, 64, 61, 2)
    assert b["float"] == 61 * 576 * 2 and b["4-bit"] == 61 * (576 / 2 + 2 * 9 * 4)
    del mx
