"""MLA latents packed in 8 or 4 bits in blocks (`ModelCodec(latent_bits=...)`, caches/latent.py):
the quantizer's error bound and idempotence, and the pool's hot and disk round trip on a real
deepseek_v3 model, turn after turn, with the live cache staying float."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

from vllm_mlx_persist.caches import ModelCodec
from vllm_mlx_persist.caches.latent import dequantize_latent, latent_group, quantize_latent
from vllm_mlx_persist.pool import BlockPool
from vllm_mlx_persist.store import DiskStore
from vllm_mlx_persist.tools.models.build import SIZES, Size, build_model

from test_families import _logits, _prompt  # the same vocabulary (512)

BLOCK = 16
SIZE = Size(**{**SIZES["tiny"].__dict__, "vocab": 512})


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantizer_error_bound_and_idempotence(bits, dtype):
    x = (mx.random.normal((1, 1, 37, 96), key=mx.random.key(1)) * 3).astype(dtype)
    codes, scales, biases = quantize_latent(x, bits)
    g = latent_group(96)
    assert g == 32 and codes.dtype == mx.uint8 and scales.dtype == mx.float32
    assert codes.shape == (1, 1, 37, 96 * bits // 8) and scales.shape == biases.shape == (1, 1, 37, 96 // g)
    y = dequantize_latent(codes, scales, biases, bits, dtype)
    assert y.dtype == dtype and y.shape == x.shape
    err = mx.abs(y.astype(mx.float32) - x.astype(mx.float32)).reshape(1, 1, 37, 96 // g, g).max(axis=-1)
    # half a step, plus the rounding of the result to `dtype`
    slack = 0 if dtype == mx.float32 else 2 ** -8 * mx.abs(x.astype(mx.float32)).max().item()
    assert (err <= scales / 2 + 1e-5 + slack).all().item()
    # packing what it dequantized gives the same codes back (a commit packs reloaded tokens again)
    again = quantize_latent(y, bits)
    assert mx.array_equal(again[0], codes).item()
    assert mx.allclose(again[1], scales, rtol=1e-5).item() and mx.allclose(again[2], biases, rtol=1e-5).item()
    # a constant group is exact
    flat = mx.full((1, 1, 2, 64), 0.75, dtype=dtype)
    assert mx.array_equal(dequantize_latent(*quantize_latent(flat, bits), bits, dtype), flat).item()
    with pytest.raises(ValueError):
        quantize_latent(x, 3)


@pytest.fixture(scope="module")
def deepseek():
    model, _ = build_model("deepseek_v3", SIZE, seed=0)
    return model


def _pool(codec, root, fp="d" * 64):
    fmt = {"bits": 4, "group_size": 64, "block_size": BLOCK, "latent_bits": codec.latent_bits}
    store = DiskStore(root, fp, {"test": True}, fmt)
    pool = BlockPool(fingerprint=fp, n_layers=codec.n_layers, bits=4, group_size=64, block_size=BLOCK,
                     hot_bytes=1 << 30, store=store, codec=codec)
    pool.load_manifests()
    return pool


@pytest.mark.parametrize("bits", [8, 4])
def test_packed_latents_through_the_pool(deepseek, bits, tmp_path):
    model = deepseek
    codec = ModelCodec.for_model(model, latent_bits=bits)
    plain = ModelCodec.for_model(model)
    assert codec.latent_bits == bits and codec.latent_dtype == mx.float32
    live = codec.make_cache()
    assert all(type(c) is KVCache for c in live)  # the live cache stays float

    turn1 = _prompt(45, 7)
    _logits(model, live, turn1)
    arrays = codec.token_arrays(live)
    assert set(arrays) == codec.token_names() and all(n.split(".", 1)[1][0] in "kv" for n in arrays)
    assert {a.dtype for n, a in arrays.items() if n.endswith(".c")} == {mx.uint8}
    packed_bytes = sum(a.nbytes for a in arrays.values())
    float_bytes = sum(a.nbytes for a in plain.token_arrays(live).values())
    assert packed_bytes < float_bytes * (0.32 if bits == 8 else 0.2)  # float32 latents here

    pool = _pool(codec, tmp_path)
    assert pool.commit("a", turn1, live) == 45
    turn2 = turn1 + _prompt(12, 8)
    hot, n, tier = pool.lookup("a", turn2)
    assert (n, tier) == (45, "hot") and all(type(c) is KVCache for c in hot)
    pool.flush()
    pool2 = _pool(codec, tmp_path)
    cold, n2, tier2 = pool2.lookup("a", turn2)
    assert (n2, tier2) == (45, "disk")
    for a, b in zip(hot, cold):
        assert mx.array_equal(a.keys[..., :45, :], b.keys[..., :45, :]).item()
        assert mx.array_equal(a.values[..., :45, :], b.values[..., :45, :]).item()

    # the rebuilt cache holds the dequantized latents: close to the float run, not equal to it
    full = _logits(model, make_prompt_cache(model), turn2)
    got = _logits(model, cold, turn2[n:])
    err = mx.abs(got - full).max().item()
    assert 0 < err < (0.02 if bits == 8 else 0.3) * full.std().item(), err

    # a second turn commits the reloaded tokens again: their codes do not move (no drift)
    _logits(model, cold, [7])
    turn2 = turn2 + [7]
    again = codec.token_arrays(cold)
    for name, a in arrays.items():
        assert mx.array_equal(again[name][..., :45, :], a).item() if name.endswith(".c") else \
            mx.allclose(again[name][..., :45, :], a, rtol=1e-5).item(), name
    assert pool2.commit("a", turn2, cold) == len(turn2)
    third, n3, _ = pool2.lookup("a", turn2 + [9])
    assert n3 == len(turn2)
    for a, b in zip(cold, third):
        assert mx.array_equal(a.keys[..., :45, :], b.keys[..., :45, :]).item()


def test_block_layouts_do_not_mix(deepseek):
    """A block written with packed latents is not valid for a codec without them, nor the reverse:
    a store written under one setting is a miss under the other, never misread."""
    model = deepseek
    packed, plain = ModelCodec.for_model(model, latent_bits=8), ModelCodec.for_model(model)
    live = plain.make_cache()
    _logits(model, live, _prompt(20, 3))
    for writer, reader in ((packed, plain), (plain, packed)):
        block, _ = writer.to_numpy(writer.slice(live, 0, BLOCK))
        assert writer.valid(block, BLOCK) and not reader.valid(block, BLOCK)
    with pytest.raises(ValueError):
        ModelCodec.for_model(model, latent_bits=2)
    # attention layers of other models are untouched by the option
    llama, _ = build_model("llama", SIZE, seed=0)
    c = ModelCodec.for_model(llama, latent_bits=4)
    cache = c.make_cache()
    _logits(llama, cache, _prompt(20, 4))
    assert c.token_names() == ModelCodec.for_model(llama).token_names()
    np.testing.assert_array_equal(np.array(c.token_arrays(cache)["0.k.q"]),
                                  np.array(ModelCodec.for_model(llama).token_arrays(cache)["0.k.q"]))
