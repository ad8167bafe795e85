"""Model identity: a fingerprint of everything that determines the KV a model produces.

Computed from the loaded model, not its path: a model moved to another directory keeps its caches,
and a re-quantized or fine-tuned model never shares them (its weights' shapes, dtypes or bytes differ).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

# Hash every weight byte up to this total; above it, hash a fixed sample of each tensor (start, end
# and evenly strided chunks) plus all shapes and dtypes. Any fine-tune or re-quantization changes
# nearly every tensor, so the sample still tells models apart, and start-up stays fast for 8B+ models.
FULL_HASH_LIMIT = 512 * 2**20
_CHUNK = 4096
_CHUNKS_PER_TENSOR = 16


def _tensor_bytes(x: mx.array) -> mx.array:
    return x.reshape(-1).view(mx.uint8)


def _hash_tensor(h: "hashlib._Hash", x: mx.array, full: bool) -> None:
    raw = _tensor_bytes(x)
    n = raw.size
    if full or n <= (_CHUNKS_PER_TENSOR + 2) * _CHUNK:
        h.update(memoryview(raw))
        return
    stride = n // _CHUNKS_PER_TENSOR
    starts = [0, n - _CHUNK] + [i * stride for i in range(1, _CHUNKS_PER_TENSOR)]
    for s in starts:
        h.update(memoryview(raw[s : s + _CHUNK]))


def _model_args(model: Any) -> dict:
    args = getattr(model, "args", None)
    if args is None:
        return {}
    return {k: v for k, v in sorted(vars(args).items()) if not k.startswith("_")}


def _vocab_digest(tokenizer: Any) -> str:
    if tokenizer is None:
        return ""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without get_vocab still yields a stable (empty) digest
        return ""
    items = sorted(vocab.items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


def model_digest(model: Any, tokenizer: Any) -> str:
    """sha256 hex of the model itself (its type, config, tokenizer vocabulary and weights): the costly
    part of a fingerprint (every weight byte up to FULL_HASH_LIMIT), hashed once per process however
    many cache formats are fingerprinted (auto's q4 key, then the chosen format's directory)."""
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    total = sum(p.nbytes for _, p in params)
    full = total <= FULL_HASH_LIMIT
    h = hashlib.sha256()
    header = {
        "model_type": type(model).__module__,
        "args": _model_args(model),
        "vocab": _vocab_digest(tokenizer),
        "weights": [(k, list(p.shape), str(p.dtype)) for k, p in params],
        "full_weight_hash": full,
    }
    h.update(json.dumps(header, sort_keys=True, default=str).encode())
    for _, p in params:
        _hash_tensor(h, p, full)
    return h.hexdigest()


def model_fingerprint(model: Any, tokenizer: Any, cache_format: dict, digest: Optional[str] = None) -> str:
    """sha256 hex of (cache format, the model's digest): `digest` is `model_digest(model, tokenizer)`,
    computed here when not given."""
    digest = model_digest(model, tokenizer) if digest is None else digest
    blob = json.dumps({"format": cache_format, "model": digest}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()
