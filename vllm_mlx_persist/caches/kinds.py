"""Which cache each layer of a model gets: the table of supported model kinds.

Owns the decision, made once per model from mlx-lm's own `make_prompt_cache`, of what persist_q4
gives each layer: Q4 (plain or sliding-window attention, `caches.q4`), FULL (a latent MLA layer's
full-precision `KVCache`), STATE (an `ArraysCache`: SSM or linear attention, `caches.recurrent`) or
(LIST, [kinds]) for a `CacheList`; and the refusal, naming the model type and the reason, of the
models that cannot run on it (`UnsupportedModelError`). Pure functions of the model and constant
tables: no state, any thread (building a model's prompt cache is MLX work: the worker, or start-up).
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache, make_prompt_cache

# Models (mlx-lm 0.31.3) whose attention reads what `update_and_fetch` returns with something other
# than the shared `base.scaled_dot_product_attention` dispatcher, so (packed, scales, biases)
# tuples would crash them or be misread.
_OWN_ATTENTION = "its attention computes the scores itself instead of using the shared SDPA"
_BYPASS_DISPATCHER = {
    "gemma2": _OWN_ATTENTION,
    "olmo": _OWN_ATTENTION,
    "plamo2": "its attention calls mx.fast.scaled_dot_product_attention directly",
    "gemma3n": "its layers share K/V across layers through the cache objects",
    "recurrent_gemma": "its attention reads the rotating cache's ring layout",
}
# Multi-head latent attention (MLA): the model multiplies the cached latent and rope key directly
# (`q_pe @ k_pe.T`, `q_nope @ kv_latent.T`), so no quantized op reads them: those layers keep
# mlx-lm's own full-precision KVCache (model dtype), persisted as is.
MLA_MODEL_TYPES = {"deepseek_v3", "deepseek_v32", "glm4_moe_lite", "kimi_linear", "longcat_flash"}

# Layer kinds (see vllm_mlx_persist/caches): what the cache of one layer is and how blocks hold it.
Q4, FULL, STATE, LIST = "q4", "full", "state", "list"


class UnsupportedModelError(ValueError):
    """The model cannot run on a batched quantized KV cache."""


def model_type_of(model: nn.Module) -> str:
    args = getattr(model, "args", None)
    model_type = getattr(model, "model_type", None) or getattr(args, "model_type", None)
    return str(model_type or type(model).__module__)


def _head_dims(model: nn.Module) -> dict[str, int]:
    """Key/value head dimensions from the model args (what the cache quantizes along)."""
    args = getattr(model, "args", None)
    if args is None:
        return {}
    nope, rope = getattr(args, "qk_nope_head_dim", None), getattr(args, "qk_rope_head_dim", None)
    if nope is not None and rope is not None:
        dims = {"key head_dim": nope + rope}
        v = getattr(args, "v_head_dim", None)
        if v is not None:
            dims["value head_dim"] = v
        return dims
    head_dim = getattr(args, "head_dim", None)
    model_type = getattr(args, "model_type", "")
    if head_dim is None or model_type == "qwen2":  # qwen2 ignores args.head_dim
        hidden = getattr(args, "hidden_size", None)
        heads = getattr(args, "num_attention_heads", None)
        if not hidden or not heads:
            return {}
        head_dim = hidden // heads
    return {"head_dim": head_dim}


def layer_kinds(model: nn.Module, group_size: int) -> list:
    """Per layer, the cache kind persist_q4 gives it; raise `UnsupportedModelError` for a model
    that cannot run on it, with the model type and the reason.

    Q4: plain attention (`KVCache`) and sliding-window attention (`RotatingKVCache`, keep 0; every
    such model asks for its mask with `window_size`, `layer_windows` gives the window). FULL: MLA
    layers' `KVCache`. STATE: `ArraysCache` (SSM / linear attention). (LIST, [kinds]): a `CacheList`.
    """
    model_type = model_type_of(model)

    def refuse(reason: str):
        raise UnsupportedModelError(
            f"model type {model_type!r} cannot use the persist_q4 cache: {reason}"
        )

    if model_type in _BYPASS_DISPATCHER:
        refuse(_BYPASS_DISPATCHER[model_type])
    try:
        caches = make_prompt_cache(model)
    except Exception as e:  # a model whose make_cache fails is not one we can serve either
        refuse(f"could not build its prompt cache ({type(e).__name__}: {e})")
    mla = model_type in MLA_MODEL_TYPES

    def kind(i: int, c) -> Any:
        if type(c) is KVCache:
            return FULL if mla else Q4
        if type(c) is RotatingKVCache and not mla:
            if c.keep:
                refuse(f"layer {i} uses a RotatingKVCache that keeps {c.keep} tokens")
            return Q4
        if type(c) is ArraysCache:
            return STATE
        if type(c) is CacheList:
            sub = [kind(i, s) for s in c.caches]
            if any(k != FULL for k in sub):
                refuse(f"layer {i} uses a CacheList of {[type(s).__name__ for s in c.caches]}")
            return (LIST, sub)
        refuse(f"layer {i} uses a {type(c).__name__}, which persist_q4 does not batch")

    kinds = [kind(i, c) for i, c in enumerate(caches)]
    if Q4 in kinds:
        for name, dim in _head_dims(model).items():
            if dim % group_size != 0:
                refuse(f"{name} {dim} is not a multiple of the quantization group size {group_size}")
    return kinds


def layer_windows(model: nn.Module) -> dict[int, int]:
    """Layer -> window of each sliding-window layer (its mlx-lm cache is a `RotatingKVCache`)."""
    return {l: c.max_size for l, c in enumerate(make_prompt_cache(model)) if type(c) is RotatingKVCache}


def check_model_supported(model: nn.Module, group_size: int) -> None:
    """Raise `UnsupportedModelError` unless persist_q4 can serve the model (see `layer_kinds`)."""
    layer_kinds(model, group_size)
