"""The start-up warm-up: the model run once through fresh 4-bit caches before any request.

Without it, the first request after a (re)start pays first-use costs: allocations, compiled
functions, the quantize / dequantized-prefill / batched-decode kernels. `warm_up` runs on the worker
thread (MLX work), from the backend's `load()`; it keeps nothing and has no state of its own.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from .caches.floats import DEQUANT_MIN_QUERIES

log = logging.getLogger("vllm_mlx_persist")

# One prefill chunk on the dequantized path (>= DEQUANT_MIN_QUERIES queries), then a few batched
# decode steps (on the float decode mirror when its budget allows, else the quantized path).
WARMUP_TOKENS = max(16, 2 * DEQUANT_MIN_QUERIES)
WARMUP_STEPS = 3


def warm_up(model: Any, make_cache: Callable[[], list], runs: int = 0) -> dict:
    """Run `model` once over a tiny prompt through fresh caches from `make_cache`: two sequences
    of WARMUP_TOKENS and one fewer are prefilled in one chunk each, merged the way BatchGenerator
    merges them, and decoded WARMUP_STEPS steps. Bounded (a few dozen tokens of KV), stored
    nowhere, never fatal. Returns what it did, for get_stats: {"runs", "s", "tokens"} (`runs`
    counted on from the given one), or {"runs", "error"}."""
    import mlx.core as mx
    from mlx_lm.generate import _merge_caches

    t0 = time.perf_counter()
    try:
        n = WARMUP_TOKENS
        prompts = [list(range(1, n + 1)), list(range(2, n + 1))]
        caches = []
        for p in prompts:
            cache = make_cache()
            mx.eval(model(mx.array([p]), cache=cache))
            caches.append(cache)
        batch = _merge_caches(caches)
        y = mx.array([[1], [2]])
        for _ in range(WARMUP_STEPS):
            y = mx.argmax(model(y, cache=batch)[:, -1:, :], axis=-1)
            mx.eval(y)
        del caches, batch
        mx.clear_cache()  # give the warm-up's buffers back: it keeps nothing
        done = {"runs": runs + 1, "s": round(time.perf_counter() - t0, 3),
                "tokens": sum(map(len, prompts)) + 2 * WARMUP_STEPS}
        log.info("persist_q4: warm-up ran the 4-bit prefill and batched decode paths in %.2f s", done["s"])
        return done
    except Exception as e:  # a model that cannot warm up will say so on its first request
        failed = {"runs": runs, "error": f"{type(e).__name__}: {e}"}
        log.warning("persist_q4: warm-up failed (%s); serving without it", failed["error"])
        return failed
