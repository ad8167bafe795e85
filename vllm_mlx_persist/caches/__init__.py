"""Per-layer-kind caches and the block codec the pool uses, one job a module:

`kinds` (which cache each layer gets), `q4` (the 4-bit per-sequence and batched caches), `packed`
(their packed storage and its writes), `dequant` (its float values), `mirror` (the batch cache's float
decode mirror), `floats` (when attention runs on float copies of their K/V, and the budgets of those
copies), `attention` (the dispatch fix installed into mlx-lm), `recurrent` (state layers with
checkpoints), `latent` (MLA latents packed in blocks) and `codec` (a model's caches to blocks and
back; see its block layout).
"""

from .codec import MAX_CHECKPOINTS, ModelCodec
from .recurrent import StateCache

__all__ = ["MAX_CHECKPOINTS", "ModelCodec", "StateCache"]
