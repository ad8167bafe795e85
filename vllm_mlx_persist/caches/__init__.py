"""Per-layer-kind caches and the block codec the pool uses (see codec.py for the block layout)."""

from .codec import MAX_CHECKPOINTS, ModelCodec
from .recurrent import StateCache

__all__ = ["MAX_CHECKPOINTS", "ModelCodec", "StateCache"]
