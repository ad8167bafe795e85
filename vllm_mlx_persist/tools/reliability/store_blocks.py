"""What both store campaigns (store_crash.py: `vllm-mlx-persist reliability --campaigns crash`;
store_fuzz.py: `--campaigns fuzz`) write: the store's identity, and block content anyone can regenerate
from its id and compare.
"""

from __future__ import annotations

import numpy as np

from ...disk_format import BlockData


FP = "c0" * 32
INFO = ({"tool": "reliability"}, {"bits": 4})


def block_for(bid: str, n_tokens: int = 16, kib: int = 64) -> BlockData:
    """Deterministic content for an id: anyone can regenerate and compare it."""
    rng = np.random.default_rng(int(bid[:16], 16))
    words = kib * 256 // 2
    arrays = {f"{l}.{p}": rng.integers(0, 2**32, size=(1, 2, n_tokens, max(1, words // (2 * n_tokens))),
                                       dtype=np.uint32) for l in range(2) for p in ("k.q", "v.q")}
    return BlockData(bid, rng.integers(0, 50_000, size=n_tokens, dtype=np.int32), arrays)


def same_block(a: BlockData, b: BlockData) -> bool:
    return (a.block_id == b.block_id and np.array_equal(a.tokens, b.tokens) and a.arrays.keys() == b.arrays.keys()
            and all(a.arrays[k].tobytes() == b.arrays[k].tobytes() for k in a.arrays))
