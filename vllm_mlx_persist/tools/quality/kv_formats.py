"""The KV formats `vllm-mlx-persist quality` measures, and what each stores per token.

`KVFormat` is one row of the tables: the server's own caches (float, 8-bit, 4-bit group 64 and 32,
and the `key_format` option's served formats, `served_key_formats`), or a simulated option
(`sim_format`: a float cache holding each key and value after a quantization round trip, `QSpec`)
whose `stored_nbytes` is what the quantized cache would take (`spec_bytes`). Used by `quality`
(main.py, families.py) and `quality --model DIR` (real.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ...caches.key_formats import hadamard


@dataclass(frozen=True)
class KVFormat:
    """One row of the tables: how to build a fresh per-sequence cache (a list, one per layer).

    Without `factory`: `bits` None is mlx-lm's own `make_prompt_cache` (the model's dtype: a
    `KVCache` per plain layer, `RotatingKVCache` per sliding layer, `ArraysCache` per recurrent
    layer); otherwise the cache the persist_q4 backend serves from, `caches.ModelCodec(bits,
    group_size, bounded=True).make_cache()` (`Q4KVCache` on plain attention layers, bounded to the
    window on sliding ones, the model's dtype on MLA latents and recurrent states). `factory(model)` builds anything else: the simulated
    options (`sim_factory`) and, later, caches not written yet (`add_cache_format`)."""

    name: str
    label: str
    bits: int | None = None  # None: mlx-lm's full-precision caches
    group_size: int | None = None
    factory: Callable[[Any], list] | None = field(default=None, compare=False)
    served: bool = True  # False: an option measured here that the runtime does not offer

    def make_cache(self, model: Any) -> list:
        from mlx_lm.models.cache import make_prompt_cache

        from ...caches import ModelCodec

        if self.factory is not None:
            return self.factory(model)
        if self.bits is None:
            return make_prompt_cache(model)
        return ModelCodec.for_model(model, bits=self.bits, group_size=self.group_size, bounded=True,
                                    float_copies=float_copies()).make_cache()


_FLOAT_COPIES: list = []


def float_copies() -> Any:
    """The one `FloatCopies` every served cache of this process attends under (a server's codec
    has one; caches under different ones refuse to batch, so `batched_greedy` needs them shared)."""
    if not _FLOAT_COPIES:
        from ...caches.floats import FloatCopies

        _FLOAT_COPIES.append(FloatCopies())
    return _FLOAT_COPIES[0]


FULL = KVFormat("fp32", "float32 (mlx-lm KVCache)")
FORMATS = (
    FULL,
    KVFormat("q8g64", "8-bit, group 64", 8, 64),
    KVFormat("q4g64", "4-bit, group 64", 4, 64),
    KVFormat("q4g32", "4-bit, group 32", 4, 32),
)


def served_key_formats(tokenizer: Any) -> list[KVFormat]:
    """The `key_format` option's served formats (issue #33) as rows: the server's own caches
    (`ModelCodec` with the per-layer key formats `key_calibration.resolve` gives, calibrated on its
    calibration text through `tokenizer`, as at load), and what `auto` chooses."""
    from ...caches import ModelCodec
    from ...key_calibration import resolve

    chosen: dict[str, Any] = {}

    def factory(option: str) -> Callable[[Any], list]:
        def make(model: Any) -> list:
            codec = ModelCodec.for_model(model, bits=4, group_size=64, bounded=True, float_copies=float_copies())
            if option not in chosen:
                chosen[option] = resolve(option, model, tokenizer, codec)
            return codec.with_key_formats(chosen[option][0]).make_cache()
        return make

    rows = [("k8v4srv", "keys 8-bit, values 4-bit (served: key_format k8v4)", "k8v4"),
            ("k8v4rsrv", "keys 8-bit, values Hadamard-rotated 4-bit (served: key_format k8v4r)", "k8v4r"),
            ("k5v4rsrv", "keys 5-bit and values 4-bit, both Hadamard-rotated (served: key_format k5v4r)", "k5v4r"),
            ("k4v4rsrv", "keys and values 4-bit, both Hadamard-rotated (served: key_format k4v4r)", "k4v4r"),
            ("k5v4csrv", "keys 5-bit centred, balanced and rotated, values rotated 4-bit (served: key_format k5v4c)",
             "k5v4c"),
            ("k6v4csrv", "keys 6-bit centred, balanced and rotated, values rotated 4-bit (served: key_format k6v4c)",
             "k6v4c"),
            ("k56v4csrv", "k5v4c with 6-bit keys on the layers that lose most, within 1.15x q4's bytes "
             "(served: key_format k56v4c)", "k56v4c"),
            ("q4g64ssrv", "4-bit, per-channel key scales (served: key_format scaled)", "scaled"),
            ("q4g64hsrv", "4-bit, Hadamard-rotated keys (served: key_format hadamard)", "hadamard"),
            ("auto", "key_format auto (served: chosen at load)", "auto")]
    out = [KVFormat(name, label, 4, 64, factory=factory(option)) for name, label, option in rows]
    SERVED_KEY_CHOICES.append(chosen)
    return out


# What `served_key_formats` resolved, per call: option -> (formats, report) (for the report).
SERVED_KEY_CHOICES: list[dict[str, Any]] = []


# ---- simulated options ---------------------------------------------------------------------------
#
# Formats the runtime does not offer (8-bit keys with 4-bit values, rotated or rescaled keys, MLA
# latents in 4 or 8 bits) are measured with a float cache whose every new key and value is first
# sent through mx.quantize and mx.dequantize: attention then sees exactly the values a quantized
# cache would hold. On the CPU the served `Q4KVCache` attends multi-token chunks on the same
# dequantized values (`FloatCopies.dequantize_for`, prefill mode "auto"), so the simulated "4-bit,
# group 64" row reproduces the served one's perplexity (checked in the report); one-token decode
# steps differ only in float rounding (the served cache multiplies by the packed values directly).


@dataclass(frozen=True)
class QSpec:
    """Quantization of one tensor: bits, group size along the last axis, and an optional transform
    applied before quantizing and undone after (`hadamard`: an orthonormal Hadamard rotation of
    the head dimension; `scaled`: division by calibrated per-channel scales)."""

    bits: int
    group_size: int = 64
    transform: str | None = None  # None, "hadamard" or "scaled"
    method: str = "mlx"  # "mlx": mx.quantize (the served caches'); "minmax": caches.latent's (group from the dim)

    @property
    def tag(self) -> str:
        return f"{self.bits}b g{self.group_size}" + (f" {self.transform}" if self.transform else "")


def fake_quantize(x: Any, spec: QSpec | None, scales: Any = None) -> Any:
    """`x` after a round trip through `spec`'s quantization (unchanged when `spec` is None).
    `scales` (broadcastable to x, e.g. (n_kv_heads, 1, head_dim)) for the "scaled" transform."""
    import mlx.core as mx

    if spec is None:
        return x
    if spec.transform == "hadamard":
        h = mx.array(hadamard(x.shape[-1]), dtype=x.dtype)
        y = x @ h
    elif spec.transform == "scaled":
        y = x / scales
    else:
        y = x
    if spec.method == "minmax":
        from ...caches.latent import dequantize_latent, quantize_latent

        y = dequantize_latent(*quantize_latent(y, spec.bits), spec.bits, x.dtype)
    else:
        y = mx.dequantize(*mx.quantize(y, group_size=spec.group_size, bits=spec.bits),
                          group_size=spec.group_size, bits=spec.bits).astype(x.dtype)
    if spec.transform == "hadamard":
        return y @ h.T  # h is symmetric and orthonormal: the same as rotating the queries by h
    if spec.transform == "scaled":
        return y * scales
    return y


def spec_bytes(spec: QSpec | None, dim: int, float_bytes: int) -> float:
    """Bytes per token and head of one tensor stored per `spec` (scale and bias per group in the
    model's dtype), or in the model's dtype when `spec` is None."""
    if spec is None:
        return dim * float_bytes
    if spec.method == "minmax":
        from ...caches.latent import latent_nbytes_per_element

        return dim * latent_nbytes_per_element(spec.bits, dim)
    return dim * spec.bits / 8 + 2 * (dim // spec.group_size) * float_bytes


def _sim_cache_class():
    from mlx_lm.models.cache import KVCache

    class SimQuantCache(KVCache):
        """A float `KVCache` holding keys and values after a quantization round trip per `QSpec`
        (None: kept as is). `stored_nbytes`: what the quantized cache would take."""

        def __init__(self, key: QSpec | None, value: QSpec | None, key_scales: Any = None):
            super().__init__()
            self.key_spec, self.value_spec, self.key_scales = key, value, key_scales

        def update_and_fetch(self, keys: Any, values: Any) -> Any:
            return super().update_and_fetch(fake_quantize(keys, self.key_spec, self.key_scales),
                                            fake_quantize(values, self.value_spec))

        @property
        def stored_nbytes(self) -> int:
            if self.keys is None:
                return 0
            B, H, _, Dk = self.keys.shape
            Dv, fb = self.values.shape[-1], self.keys.dtype.size
            return int(B * H * self.offset * (spec_bytes(self.key_spec, Dk, fb) + spec_bytes(self.value_spec, Dv, fb)))

    return SimQuantCache


def sim_factory(key: QSpec | None, value: QSpec | None, latent: bool = False,
                key_scales: Sequence[Any] | None = None) -> Callable[[Any], list]:
    """A cache factory: mlx-lm's own cache for every layer, except a `SimQuantCache(key, value)`
    for every layer the persist_q4 backend quantizes (plain and sliding attention), or with
    `latent`, for every MLA latent layer instead (keys = the latent, values = the rope key).
    `key_scales[l]`: layer l's per-channel key scales for the "scaled" transform."""
    from ...caches.kinds import FULL, Q4, layer_kinds

    cls = _sim_cache_class()

    def make(model: Any) -> list:
        from mlx_lm.models.cache import make_prompt_cache

        kinds = layer_kinds(model, key.group_size if key else 64)
        want = FULL if latent else Q4
        base = make_prompt_cache(model)
        return [cls(key, value, key_scales[l] if key_scales is not None else None) if k == want else c
                for l, (k, c) in enumerate(zip(kinds, base))]

    return make


def sim_format(name: str, label: str, key: QSpec | None, value: QSpec | None, **kw: Any) -> KVFormat:
    return KVFormat(name, label, factory=sim_factory(key, value, **kw), served=False)
