"""MLA latents in 8 and 4 bits (`vllm-mlx-persist quality`, family deepseek_v3): bytes and decode speed.

`latent_bytes`: what a latent cache takes per token in the model's dtype and packed;
`per_turn_latent_format`: the `latent_bits` option's cache as a row of the tables (tokens of earlier
turns packed, the current turn float); `latent_speed`: decode time per token on the float cache
against packed latents dequantized every step, and the option's per-turn pack and build costs.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np

from .kv_formats import KVFormat, QSpec, spec_bytes


def latent_bytes(kv_lora_rank: int, rope_dim: int, layers: int, float_bytes: int) -> dict[str, float]:
    """Bytes per token of an MLA latent cache (latent + rope key, all layers) stored in the
    model's dtype, and as the `latent_bits` option stores it in 8 and 4 bits (float32 scale and bias
    per group of 64)."""
    return {name: layers * (spec_bytes(spec, kv_lora_rank, float_bytes) + spec_bytes(spec, rope_dim, float_bytes))
            for name, spec in (("float", None), ("8-bit", QSpec(8, method="minmax")),
                               ("4-bit", QSpec(4, method="minmax")))}


def _latent_cache_classes() -> tuple[type, type]:
    """(PerTurnLatentCache, PackedEveryStepCache): float caches standing for the two ways of
    running MLA on packed latents (the quantizer of `caches.latent`, the `latent_bits` option's)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from ...caches.latent import dequantize_latent, quantize_latent

    def round_trip(x: Any, bits: int) -> Any:
        return dequantize_latent(*quantize_latent(x, bits), bits, x.dtype)

    class PerTurnLatentCache(KVCache):
        """What the `latent_bits` option serves: a float cache whose tokens before each
        multi-token call (standing for a turn: a request's prefill) are packed and dequantized
        (committed to blocks and reloaded as the per-turn mirror), the current turn's are float."""

        def __init__(self, bits: int):
            super().__init__()
            self.latent_bits, self.packed_upto = bits, 0  # not `bits`: that means a packed cache to mlx-lm

        def update_and_fetch(self, keys: Any, values: Any) -> Any:
            if keys.shape[2] > 1 and self.offset > self.packed_upto:
                a, b = self.packed_upto, self.offset
                self.keys[..., a:b, :] = round_trip(self.keys[..., a:b, :], self.latent_bits)
                self.values[..., a:b, :] = round_trip(self.values[..., a:b, :], self.latent_bits)
                self.packed_upto = b
            return super().update_and_fetch(keys, values)

        @property
        def stored_nbytes(self) -> int:
            """What the blocks hold: every token packed (the live mirror is float, as today)."""
            from ...caches.latent import latent_nbytes_per_element

            if self.keys is None:
                return 0
            per = sum(x.shape[-1] * latent_nbytes_per_element(self.latent_bits, x.shape[-1])
                      for x in (self.keys, self.values))
            return int(self.keys.shape[0] * self.keys.shape[1] * self.offset * per)

    class PackedEveryStepCache(KVCache):
        """The alternative to a mirror: only the packed latents are kept, and every step dequantizes
        all of them for the model's matmuls."""

        def __init__(self, bits: int):
            super().__init__()
            self.latent_bits, self.parts = bits, []

        def update_and_fetch(self, keys: Any, values: Any) -> Any:
            self.parts.append((quantize_latent(keys, self.latent_bits), quantize_latent(values, self.latent_bits)))
            self.offset += keys.shape[2]
            deq = lambda i: mx.concatenate([dequantize_latent(*p[i], self.latent_bits, keys.dtype)
                                            for p in self.parts], axis=2)
            return deq(0), deq(1)

    return PerTurnLatentCache, PackedEveryStepCache


def per_turn_latent_format(name: str, label: str, bits: int) -> KVFormat:
    """A deepseek_v3 row: `PerTurnLatentCache(bits)` on every latent layer."""
    from ...caches.kinds import FULL as FULL_KIND, layer_kinds

    PerTurn, _ = _latent_cache_classes()

    def make(model: Any) -> list:
        from mlx_lm.models.cache import make_prompt_cache

        return [PerTurn(bits) if k == FULL_KIND else c
                for k, c in zip(layer_kinds(model, 64), make_prompt_cache(model))]

    return KVFormat(name, label, factory=make, served=False)


def latent_speed(contexts: Sequence[int], steps: int = 8, quick: bool = False,
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """Decode time per token of a DeepSeek-V3-shaped attention stack (random weights: speed does
    not depend on them) at each context length: on the float cache (today, and the `latent_bits`
    option's per-turn mirror), and on packed latents dequantized at every step; and the option's
    per-turn costs, measured on `ModelCodec` itself: packing the cache into blocks at commit
    (`token_arrays`) and building the float mirror from them when a turn starts (`build`)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache
    from mlx_lm.utils import _get_classes

    from ...caches import ModelCodec
    from ..models.build import Size, model_config

    size = Size(layers=2, hidden=128, heads=4, kv_heads=4, head_dim=64, intermediate=256, vocab=512) if quick \
        else Size(layers=4, hidden=1024, heads=16, kv_heads=16, head_dim=128, intermediate=2048, vocab=1024)
    config = model_config("deepseek_v3", size)
    config.update(first_k_dense_replace=size.layers, q_lora_rank=None,
                  kv_lora_rank=128 if quick else 512, qk_rope_head_dim=64,
                  qk_nope_head_dim=64 if quick else 128, v_head_dim=64 if quick else 128)
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    model.eval()
    mx.eval(model.parameters())
    _, EveryStep = _latent_cache_classes()

    def timed(fn: Callable[[], Any], n: int) -> float:
        times = []
        for i in range(n + 2):
            t0 = time.perf_counter()
            mx.eval(fn())
            if i >= 2:  # warm-up
                times.append(time.perf_counter() - t0)
        return 1000 * float(np.median(times))

    rows = []
    for T in contexts:
        mx.random.seed(1)
        latent = mx.random.normal((1, 1, T, config["kv_lora_rank"]))
        rope = mx.random.normal((1, 1, T, config["qk_rope_head_dim"]))
        row: dict[str, Any] = {"context": T}
        tok = mx.array([[5]])
        for name, make in (("float", KVCache), ("8-bit, dequantized every step", lambda: EveryStep(8)),
                           ("4-bit, dequantized every step", lambda: EveryStep(4))):
            cache = [make() for _ in range(size.layers)]
            for c in cache:
                c.update_and_fetch(latent, rope)
            mx.eval([c.keys for c in cache if c.keys is not None] + [p for c in cache for p in getattr(c, "parts", [])])
            row[name] = timed(lambda: model(tok, cache=cache), steps)
        cache = [KVCache() for _ in range(size.layers)]
        for c in cache:
            c.update_and_fetch(latent, rope)
        for bits in (8, 4):
            codec = ModelCodec.for_model(model, latent_bits=bits)
            row[f"{bits}-bit: pack ms"] = timed(lambda: list(codec.token_arrays(cache).values()), 3)
            arrays = codec.token_arrays(cache)
            mx.eval(list(arrays.values()))
            row[f"{bits}-bit: build ms"] = timed(lambda: [a for c in codec.build([(arrays, T)])[0]
                                                          for a in (c.keys, c.values)], 3)
        rows.append(row)
        log(f"[latent speed] context {T}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in row.items() if k != "context"))
    return {"config": {k: config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                               "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                               "v_head_dim")},
            "steps": steps, "rows": rows}
