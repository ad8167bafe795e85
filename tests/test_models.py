"""Locally built models: deterministic, loadable by mlx-lm, context-sensitive, rebuilt only when asked."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from vllm_mlx_persist.tools.models import build as models
from vllm_mlx_persist.cli import main as cli_main

PARTS = [{"type": "text", "text": "Hello there, "}, {"type": "text", "text": "how is the cache?"}]
TEXT = "Hello there, how is the cache?"


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def greedy(model, ids: list[int], n: int) -> list[int]:
    return [int(t) for (t, _), _ in zip(generate_step(mx.array(ids), model, max_tokens=n), range(n))]


def test_sizes_are_gqa_with_head_dim_a_multiple_of_64():
    assert {"tiny", "small", "bench"} <= set(models.SIZES)
    for name, s in models.SIZES.items():
        assert s.head_dim % 64 == 0 and s.hidden == s.heads * s.head_dim, name
        assert s.kv_heads < s.heads and s.heads % s.kv_heads == 0, name
        for arch in models.ARCHS:
            models.model_config(arch, name)
    b = models.SIZES["bench"]
    attn = b.hidden * b.head_dim * (2 * b.heads + 2 * b.kv_heads)
    params = b.layers * (attn + 3 * b.hidden * b.intermediate) + 2 * b.vocab * b.hidden
    assert 90e6 < params < 110e6
    with pytest.raises(ValueError):
        models.model_config("mamba", "tiny")


def test_build_is_deterministic(tmp_path):
    a = models.build_model_dir(tmp_path / "a", size="tiny", seed=3)
    b = models.build_model_dir(tmp_path / "b", size="tiny", seed=3)
    c = models.build_model_dir(tmp_path / "c", size="tiny", seed=4)
    for f in models.MODEL_FILES:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    assert sha(a / "model.safetensors") != sha(c / "model.safetensors")
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_tokenizer_training_is_deterministic_across_processes():
    code = ("import hashlib; from vllm_mlx_persist.tools.models import build as models; "
            "print(hashlib.sha256(models.train_tokenizer(1024).encode()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == hashlib.sha256(models.train_tokenizer(1024).encode()).hexdigest()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_arch_loads_and_generates_from_chat_template(model_dir, arch):
    path = model_dir(arch, "tiny")
    model, tok = mlx_lm.load(str(path))
    cfg = json.loads((path / "config.json").read_text())
    attn = model.layers[0].self_attn
    assert cfg["model_type"] == arch and attn.n_kv_heads < attn.n_heads
    assert model.layers[0].self_attn.k_proj.weight.shape[0] == attn.n_kv_heads * 64
    assert model.layers[0].self_attn.k_proj.weight.dtype == mx.float32
    assert all(type(c) is KVCache for c in make_prompt_cache(model))  # no sliding-window layers
    assert tok.eos_token_ids == set(models.EOS_IDS)

    def ids(content):
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
        return tok.apply_chat_template(msgs, add_generation_prompt=True)

    msgs = [{"role": "user", "content": TEXT}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == f"<|bos|><|im_start|>user\n{TEXT}<|im_end|>\n<|im_start|>assistant\n"
    assert ids(TEXT) == ids(PARTS)
    prompt = ids(PARTS)
    assert prompt[:2] == [models.BOS_ID, models.IM_START_ID] and prompt.count(models.IM_START_ID) == 3

    out = greedy(model, prompt, 8)
    assert len(out) == 8 and out == greedy(model, prompt, 8)  # deterministic, no early EOS
    assert not set(out) & set(range(len(models.SPECIAL_TOKENS)))
    assert len(set(out)) >= 4  # not a degenerate repeat-one-token model
    assert isinstance(mlx_lm.generate(model, tok, prompt=prompt, max_tokens=4), str)


def test_output_depends_on_context(tiny_llama_dir):
    """Replacing the first tokens changes later greedy picks: a wrong or corrupted KV cache shows.

    (Weights of N(0, 0.02) everywhere fail this: such a model echoes its last input token.)"""
    model, tok = mlx_lm.load(str(tiny_llama_dir))
    prompt = tok.encode(models._stdlib_text()[20000:24000])[:96]
    other = tok.encode("An entirely different beginning of the context. ")[:16] + prompt[16:]
    a = model(mx.array([prompt]))[0, 48:].argmax(-1)
    b = model(mx.array([other]))[0, 48:].argmax(-1)
    assert (a != b).mean().item() > 0.2  # measured 0.35-0.46 over seeds 0-2 (small: 0.67-0.73)


def test_gemma3_text_has_sliding_window_layers(model_dir):
    model, _ = mlx_lm.load(str(model_dir("gemma3_text", "tiny")))
    caches = model.make_cache()
    assert any(isinstance(c, RotatingKVCache) for c in caches)
    assert any(type(c) is KVCache for c in caches)
    assert len(greedy(model, [1, 2, 100, 200, 300], 3)) == 3


def test_stamp_prevents_rebuild_unless_forced(tmp_path):
    path = models.build_model_dir(tmp_path / "m", size="tiny", seed=0)
    weights = path / "model.safetensors"
    ino = weights.stat().st_ino
    assert models.build_model_dir(tmp_path / "m", size="tiny", seed=0) == path
    assert weights.stat().st_ino == ino
    assert models.read_stamp(path)["seed"] == 0

    models.build_model_dir(path, size="tiny", seed=0, force=True)
    assert weights.stat().st_ino != ino
    ino = weights.stat().st_ino
    models.build_model_dir(path, size="tiny", seed=1)  # other parameters: rebuilt in place
    assert weights.stat().st_ino != ino and models.read_stamp(path)["seed"] == 1
    assert not [p for p in tmp_path.iterdir() if p.name != "m"]  # no temp dirs left behind


def test_refuses_to_replace_a_directory_it_did_not_build(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        models.build_model_dir(tmp_path / "mine", size="tiny", force=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    # an incomplete build (no stamp) is never taken for a model
    models.build_model_dir(tmp_path / "m", size="tiny")
    (tmp_path / "m" / models.STAMP_FILE).unlink()
    with pytest.raises(FileExistsError):
        models.build_model_dir(tmp_path / "m", size="tiny")


def test_tokenizer_round_trips_text(tiny_llama_dir):
    _, tok = mlx_lm.load(str(tiny_llama_dir))
    assert len(tok.get_vocab()) == models.SIZES["tiny"].vocab
    for text in ["Hello, world!", "  leading and trailing  \n\n\ttabs", "naïve café – 東京 🙂",
                 "def f(x):\n    return {'a': [1, 2]}\n", ""]:
        assert tok.decode(tok.encode(text)) == text
    for i, special in enumerate(models.SPECIAL_TOKENS):
        assert tok.encode(special) == [i]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[0] == models.IM_START_ID


def test_cli_make_model(tmp_path, capsys):
    argv = ["make-model", str(tmp_path / "m"), "--arch", "qwen3", "--size", "tiny", "--seed", "2"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out.strip()
    assert out == str(tmp_path / "m") and models.read_stamp(out)["arch"] == "qwen3"
