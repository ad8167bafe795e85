"""Moving cached keys by Δ positions in closed form (vllm_mlx_persist/kv_edit/rope_shift.py, issue #21):
every RoPE variant mlx-lm 0.31.3 ships, each model family's layers through its own attention, the
start-up probe's refusals, and 4-bit keys (dequantize, rotate in float32, requantize)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.deepseek_v2 import DeepseekV2YarnRotaryEmbedding
from mlx_lm.models.internlm2 import DynamicNTKScalingRoPE
from mlx_lm.models.rope_utils import initialize_rope

from vllm_mlx_persist.caches.kinds import layer_kinds
from vllm_mlx_persist.kv_edit.rope_shift import (
    RopeParams,
    identity_error,
    probe_attention,
    probe_model,
    probe_rope,
    rotate,
    rotate_q4,
    shift_arrays,
)
from vllm_mlx_persist.tools.models.build import build_model

W = 128
# Every rope class mlx-lm 0.31.3 builds through initialize_rope, plus the models' own classes.
VARIANTS = {
    "default": lambda: initialize_rope(W, 10000, False),
    "traditional": lambda: initialize_rope(W, 10000, True),
    "linear": lambda: initialize_rope(W, 10000, False, {"type": "linear", "factor": 4.0}),
    "llama3": lambda: initialize_rope(W, 500000, False, {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}, 131072),
    "yarn": lambda: initialize_rope(W, 10000, False, {
        "type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.0}, 163840),
    "longrope": lambda: initialize_rope(W, 10000, False, {
        "type": "longrope", "original_max_position_embeddings": 4096, "short_factor": [1.0] * (W // 2),
        "long_factor": [1.0 + i / 32 for i in range(W // 2)]}, 131072),
    "proportional": lambda: initialize_rope(W, 10000, False, {
        "rope_type": "proportional", "partial_rotary_factor": 0.25, "factor": 1.0}),
    "partial": lambda: nn.RoPE(32, traditional=False, base=10000),  # phixtral-style rotary_dim < head_dim
    "deepseek_v2_yarn": lambda: DeepseekV2YarnRotaryEmbedding(W, 163840, 10000, 40.0, 4096, 32, 1, 1.0, 0.0),
}
# Positions a test context reaches; float32 angles at p ~ 20k round to ~2e-4 relative (both sides).
POSITIONS = (0, 1, 100, 1000, 4000)
SHIFTS = (1, -1, 57, -57, 1500)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_rotation_equals_a_fresh_rope_at_the_new_position(name):
    rope = VARIANTS[name]()
    params = probe_rope(rope, W)
    assert params is not None, f"{name}: the probe found no reading of the module's parameters"
    x = mx.random.normal((1, 4, 3, W), key=mx.random.key(1))
    worst = 0.0
    for p in POSITIONS:
        for d in SHIFTS + (-p,):
            if p + d < 0:
                continue
            worst = max(worst, identity_error(rope(x, p), rope(x, p + d), d, params))
    assert worst <= 1e-4, f"{name}: rotation vs fresh RoPE, relative error {worst:.2e}"


def test_scaled_variants_must_not_be_rotated_by_the_module_itself():
    """YaRN and LongRoPE scale what they rotate: the module applied again scales twice."""
    for name in ("yarn", "longrope"):
        rope = VARIANTS[name]()
        x = mx.random.normal((1, 2, 1, W), key=mx.random.key(2))
        twice = rope(rope(x, 10), 5)  # what "rotate with the module" would give
        assert identity_error(rope(x, 10), rope(x, 15), 5, probe_rope(rope, W)) < 1e-5
        err = (mx.linalg.norm((twice - rope(x, 15)).reshape(-1)) / mx.linalg.norm(rope(x, 15).reshape(-1))).item()
        assert err > 0.1, name


def test_the_wrong_pairing_convention_is_far_off_and_never_picked():
    for name, right in (("default", False), ("traditional", True)):
        rope = VARIANTS[name]()
        params = probe_rope(rope, W)
        assert params.traditional is right
        wrong = RopeParams(W, not right, base=10000.0)
        x = mx.random.normal((1, 2, 1, W), key=mx.random.key(3))
        assert identity_error(rope(x, 10), rope(x, 310), 300, wrong) > 0.5


def test_dynamic_positions_are_refused():
    """internlm2's dynamic NTK RoPE has no fixed frequencies to rotate with."""
    assert probe_rope(DynamicNTKScalingRoPE(W, base=10000, scale=2.0), W) is None


class _Attention(nn.Module):
    """A minimal attention that writes K/V to its cache, optionally normalising K after RoPE
    (afm7-style) or without RoPE at all (NoPE)."""

    def __init__(self, hidden: int, head_dim: int, rope: bool = True, norm_after_rope: bool = False):
        super().__init__()
        self.k_proj = nn.Linear(hidden, head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, head_dim, bias=False)
        self.rope = nn.RoPE(head_dim, base=10000) if rope else None
        self.k_norm = nn.RMSNorm(head_dim) if norm_after_rope else None

    def __call__(self, x, mask=None, cache=None):
        k = self.k_proj(x)[:, None]
        v = self.v_proj(x)[:, None]
        if self.rope is not None:
            k = self.rope(k, offset=cache.offset)
        if self.k_norm is not None:
            k = self.k_norm(k * 3.0 + 1.0)
        cache.update_and_fetch(k, v)
        return x


def test_the_probe_reads_what_a_layer_caches():
    ok = probe_attention(_Attention(32, 64), 32)
    assert ok.ok and [s.kind for s in ok.slots] == ["rotate", "static"]
    nope = probe_attention(_Attention(32, 64, rope=False), 32)  # position-free: nothing to move
    assert nope.ok and [s.kind for s in nope.slots] == ["static", "static"]
    normed = probe_attention(_Attention(32, 64, norm_after_rope=True), 32)
    assert not normed.ok and normed.reason == "unsupported_positions"


# Layers the splice moves, per family, and the slot (probe order) holding each layer's rotary part.
FAMILIES = {
    "llama": "q4", "qwen3": "q4", "gemma3_text": "q4", "gpt_oss": "q4",
    "deepseek_v3": "mla", "deepseek_v32": "list",
}


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_each_layer_moves_with_its_own_parameters(arch):
    """Per layer, through the model's own attention: rotating what it cached at p by Δ equals what
    it caches at p+Δ, within 1e-4; values and MLA latents do not move."""
    model, _ = build_model(arch, "tiny")
    verdicts = probe_model(model)
    assert len(verdicts) == len(model.layers) and all(v.ok for v in verdicts), [v.reason for v in verdicts]
    hidden = model.args.hidden_size
    x = mx.random.normal((1, 3, hidden), key=mx.random.key(4)) * 0.5
    from vllm_mlx_persist.kv_edit.rope_shift import _attention_of, _Recorder

    for layer, verdict in zip(model.layers, verdicts):
        kinds = [s.kind for s in verdict.slots]
        if FAMILIES[arch] == "q4":
            assert kinds == ["rotate", "static"]
        elif FAMILIES[arch] == "mla":  # the cache's "values" slot holds k_pe; the latent stays
            assert kinds == ["static", "rotate"]
        else:  # latent + k_pe, then the indexer's keys (rotated) and its empty values
            assert kinds == ["static", "rotate", "rotate", "static"]
        attn = _attention_of(layer)
        for p, d in ((0, 40), (700, -650), (3000, 1)):
            a, b = _Recorder(p), _Recorder(p + d)
            attn(x, mask=None, cache=a)
            attn(x, mask=None, cache=b)
            for slot, before, after in zip(verdict.slots, a.slots(), b.slots()):
                if slot.kind == "rotate":
                    assert identity_error(before, after, d, slot.params) <= 1e-4
                else:
                    assert mx.array_equal(before, after)


def test_recurrent_layers_are_refused():
    for arch in ("qwen3_next", "lfm2"):
        model, _ = build_model(arch, "tiny")
        verdicts = probe_model(model)
        kinds = layer_kinds(model, 64)
        refused = [v.reason for v, k in zip(verdicts, kinds) if k == "state"]
        assert refused and all(r == "recurrent_state" for r in refused), (arch, refused)
        assert all(v.ok for v, k in zip(verdicts, kinds) if k != "state")


def _keys_with_outliers(seed: int, n: int = 40, heads: int = 2, dim: int = W) -> mx.array:
    k = mx.random.normal((1, heads, n, dim), key=mx.random.key(seed))
    return k * mx.where(mx.arange(dim) % 17 == 3, 8.0, 1.0)  # a few outlier channels, as real K has


@pytest.mark.parametrize("delta", [1, -3, 250, -1000])
def test_4bit_keys_land_within_half_a_step_of_the_rotated_keys(delta):
    params = probe_rope(VARIANTS["default"](), W)
    rope = VARIANTS["default"]()
    keys = rope(_keys_with_outliers(5), 1200)  # cached K at positions 1200..: rotated already
    q, s, b = mx.quantize(keys, 64, 4)
    s, b = s.astype(mx.float16), b.astype(mx.float16)  # as a float16 model stores them
    q2, s2, b2 = rotate_q4(q, s, b, delta, params)
    assert q2.dtype == q.dtype and s2.dtype == mx.float16 and q2.shape == q.shape and s2.shape == s.shape
    want = rotate(mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), 64, 4), delta, params)
    got = mx.dequantize(q2, s2.astype(mx.float32), b2.astype(mx.float32), 64, 4)
    # Per group of 64, against that group's new step. mlx's quantizer pins the group's larger-magnitude
    # edge exactly and so errs by up to one step on ~0.3% of elements, on a cold prefill just as here:
    # the bound is half a step for all but those, one step for every element.
    err = mx.abs(got - want).reshape(*got.shape[:-1], -1, 64)
    half = (mx.abs(s2.astype(mx.float32)) / 2)[..., None]
    assert mx.all(err <= 2 * half * 1.01 + 1e-3).item(), (err / half).max().item()
    assert mx.mean(err > half * 1.01 + 1e-3).item() < 0.01
    cold = mx.abs(mx.dequantize(*mx.quantize(want, 64, 4), 64, 4) - want).reshape(err.shape)
    assert mx.mean(err > half * 1.01 + 1e-3).item() <= 2 * mx.mean(cold > half * 1.01 + 1e-3).item() + 1e-3
    # and not the same as the unrotated keys: the test could fail
    assert not mx.array_equal(q2, q)


def test_a_zero_shift_requantizes_nothing():
    q, s, b = mx.quantize(_keys_with_outliers(6), 64, 4)
    params = probe_rope(VARIANTS["default"](), W)
    assert all(x is y for x, y in zip(rotate_q4(q, s, b, 0, params), (q, s, b)))
    arrays = {"0.k.q": q, "0.k.s": s, "0.k.b": b}
    assert shift_arrays(arrays, 0, [], []) is arrays


def test_shifting_a_block_moves_keys_and_leaves_values_byte_identical():
    model, _ = build_model("llama", "tiny")
    verdicts = probe_model(model)
    kinds = layer_kinds(model, 64)
    from vllm_mlx_persist.caches import ModelCodec

    codec = ModelCodec.for_model(model)
    cache = codec.make_cache()
    tokens = mx.array([[(i * 37) % 500 + 3 for i in range(48)]])
    mx.eval(model(tokens, cache=cache))
    arrays = codec.slice(cache, 16, 48)
    moved = shift_arrays(arrays, -16, kinds, verdicts)
    for name, a in arrays.items():
        if ".v." in name:
            assert moved[name] is a
        else:
            assert moved[name].shape == a.shape and moved[name].dtype == a.dtype
            assert not mx.array_equal(moved[name], a)
    # the moved keys are those a fresh run caches at positions 0..32, to 4-bit precision
    fresh = codec.make_cache()
    # same tokens at positions 0.. give layer 0 the same K up to the shift (layer 0 is exact)
    mx.eval(model(tokens[:, 16:], cache=fresh))
    ref = codec.slice(fresh, 0, 32)
    deq = lambda a, l: mx.dequantize(a[f"{l}.k.q"], a[f"{l}.k.s"], a[f"{l}.k.b"], 64, 4)  # noqa: E731
    step = mx.abs(ref["0.k.s"].astype(mx.float32)).max().item()
    assert mx.abs(deq(moved, 0) - deq(ref, 0)).max().item() <= 1.5 * step
    assert mx.abs(deq(arrays, 0) - deq(ref, 0)).max().item() > 1.5 * step  # unmoved: far off


def test_a_dead_leading_rotary_pair_is_still_rotated_from_channel_0():
    """Gemma 3 270M's layer 12 has a K-norm weight of 0 on channels 0 and 128 (the first RoPE pair):
    its keys never move there, so the first moving channel is 1. The probe once read that as a
    rotary slice starting at 1 (an odd width no RoPE has) and refused the layer, which cost the
    model its splices and its centred key formats (issue #50). A gemma3_text of that shape (head
    dim 256, one KV head) with that pair zeroed on one layer: every layer rotates, from channel 0."""
    from vllm_mlx_persist.kv_edit.rope_shift import _attention_of, _Recorder
    from vllm_mlx_persist.tools.models.build import Size

    size = Size(layers=2, hidden=256, heads=4, kv_heads=1, head_dim=256, intermediate=512, vocab=1024)
    model, _ = build_model("gemma3_text", size)
    norm = model.layers[1].self_attn.k_norm
    dead = mx.zeros((256,)).at[mx.array([0, 128])].add(1.0)
    norm.weight = norm.weight * (1 - dead) - dead  # mlx-lm's Gemma norm scales by (1 + w): 0 there
    verdicts = probe_model(model)
    assert all(v.ok for v in verdicts), [v.reason for v in verdicts]
    params = verdicts[1].slots[0].params
    assert (params.start, params.dims) == (0, 256)
    x = mx.random.normal((1, 3, 256), key=mx.random.key(4)) * 0.5
    a, b = _Recorder(5), _Recorder(905)
    attn = _attention_of(model.layers[1])
    attn(x, mask=None, cache=a)
    attn(x, mask=None, cache=b)
    assert float(mx.abs(a.slots()[0][..., 0]).max()) == 0.0  # the pair is dead
    assert identity_error(a.slots()[0], b.slots()[0], 900, params) <= 1e-4
