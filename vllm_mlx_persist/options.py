"""persist_q4's options (`--cache-backend-options` JSON): their defaults, parsing and validation.

Owns DEFAULTS, the one list of options (docs/operations.md documents each), and `parse_options`,
which the backend factory calls once at start-up (the event-loop thread) and which raises
ValueError naming the option for anything unknown or out of range. Pure: no state, no I/O.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit

from .caches.floats import PREFILL_ATTENTION_MODES
from .caches.key_formats import KEY_FORMATS
from .kv_edit import parse_option as parse_kv_edit

FORK_POLICIES = ("open", "listed", "none")

DEFAULTS: dict[str, Any] = {
    "cache_dir": None,  # default: $XDG_CACHE_HOME/vllm-mlx-persist, else ~/.cache/vllm-mlx-persist
    "hot_mb": 2048.0,  # hot-tier budget: bytes of 4-bit blocks kept in memory
    "bits": 4,
    "group_size": 64,
    # How 4-bit layers store keys (issue #33, caches/key_formats.py): "q4" (like the values), "k8v4"
    # (8-bit keys), "k8v4r" (8-bit keys, Hadamard-rotated values), "k4v4r" / "k5v4r" (Hadamard-rotated
    # 4- or 5-bit keys and 4-bit values: 1x or 1.1x q4's bytes), "k5v4c" / "k6v4c" (5- or 6-bit keys centred, balanced
    # against the queries and rotated, calibrated at load; rotated 4-bit values), "scaled" (per-channel scales
    # calibrated at load), "hadamard" (rotated keys), or "auto": measured at load on a calibration
    # text, the cheapest within +1% (key_calibration.py).
    "key_format": "auto",
    "latent_bits": None,  # MLA latents in blocks: None (the model's dtype), 8 or 4 bits (caches/latent.py)
    "block_size": 256,
    "durable_writes": True,  # a turn's blocks are on disk before its response completes
    "disk_mb": 16384.0,  # disk-tier budget for the whole cache root (see docs/operations.md)
    "ttl_hours": None,  # erase agents unused for this long (None: never)
    "write_timeout_s": 30.0,  # longest a turn waits for its write (a hung disk); then it goes on uncached
    "prefill_attention": "auto",  # see caches.floats.FloatCopies.set_prefill_attention
    "decode_float_mb": "auto",  # float decode mirror budget, MB (auto: 1024 on a CPU, 0 on a GPU)
    "carry_float_mb": "auto",  # float copies carried to agents' next turns, MB (auto: 1024 on a CPU, 0 on a GPU)
    "batch_prefill": False,  # prefill several prompts in one model call (vllm-mlx's default; see backend.py)
    "branches": 4,  # diverging continuations kept per agent (least recently used goes first)
    # Which agents a request may fork (read through X-Agent-Fork-From / metadata.fork_from): "open"
    # (any agent, but those set not forkable through the admin API), "listed" (only those set
    # forkable), "none". A refused fork is answered 403 (docs/operations.md, Forks).
    "fork_policy": "open",
    "match_text": True,  # reuse past tokens that differ but decode to the same text (re-tokenized replies)
    "warmup": True,  # run the model once at start-up (PersistQ4Backend.warm_up)
    "restore": True,  # at start-up, read the most recently used agents' blocks up to hot_mb (in the background)
    # The fleet tier (docs/fleet.md): Redis shared by several servers; None: off.
    "remote_url": None,  # redis://[user:password@]host:6379/0, rediss://... (TLS), unix:///path.sock
    "remote_cluster": False,  # remote_url is a node of a Redis Cluster (its client discovers the rest)
    "remote_timeout_s": 2.0,  # longest one Redis read may take
    "remote_wait_s": 3.0,  # longest a request waits for its agent's fetch from Redis; then it goes on
    "remote_queue_mb": 1024.0,  # block data waiting for upload, at most (then uploads are dropped)
    "remote_fetch_mb": 16.0,  # block data asked for in one pipelined Redis round trip, about
    "remote_block_ttl_hours": 168.0,  # blocks expire in Redis unless used (refreshed on every use)
    "remote_manifest_ttl_hours": 720.0,  # also how long an erasure's tombstone holds (docs/fleet.md)
    # A file holding the fleet's shared secret (or env VLLM_MLX_PERSIST_FLEET_SECRET; never inline,
    # where it would show in the command line): every value in Redis then carries an HMAC.
    "remote_secret_file": None,
    "kv_edit": None,  # span directives: {"enabled": true, "max_rotations": 4} (kv_edit.parse_option)
}


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vllm-mlx-persist"


def parse_options(options: Optional[dict]) -> dict[str, Any]:
    """Merge user options over DEFAULTS; unknown keys and bad values raise ValueError."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(DEFAULTS))
    if "remote_secret" in unknown:
        raise ValueError("persist_q4 remote_secret is not taken inline (the command line is visible to every "
                         "user of the machine): put it in a file named by remote_secret_file, or in the "
                         "environment variable VLLM_MLX_PERSIST_FLEET_SECRET")
    if unknown:
        raise ValueError(f"unknown persist_q4 option(s) {unknown}; known: {sorted(DEFAULTS)}")
    opts = {**DEFAULTS, **options}
    try:
        for key in ("hot_mb", "disk_mb", "write_timeout_s", "remote_timeout_s", "remote_wait_s",
                    "remote_queue_mb", "remote_fetch_mb", "remote_block_ttl_hours", "remote_manifest_ttl_hours"):
            opts[key] = float(opts[key])
        for key in ("bits", "group_size", "block_size", "branches"):
            opts[key] = int(opts[key])
        if opts["ttl_hours"] is not None:
            opts["ttl_hours"] = float(opts["ttl_hours"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"bad persist_q4 option value: {e}") from None
    for key in ("decode_float_mb", "carry_float_mb"):
        mb = opts[key]
        if mb == "auto":
            continue
        try:
            mb = float(mb) if not isinstance(mb, bool) else -1.0
        except (TypeError, ValueError):
            mb = -1.0
        if not 0 <= mb < float("inf"):
            raise ValueError(f"persist_q4 {key} must be \"auto\" or a number of MB >= 0; got {opts[key]!r}")
        opts[key] = mb
    if opts["disk_mb"] <= 0 or opts["write_timeout_s"] <= 0 or (opts["ttl_hours"] is not None and opts["ttl_hours"] <= 0):
        raise ValueError("persist_q4 disk_mb, write_timeout_s and ttl_hours must be > 0")
    if opts["bits"] not in (2, 3, 4, 5, 6, 8):
        raise ValueError(f"persist_q4 bits must be one of 2, 3, 4, 5, 6, 8; got {opts['bits']}")
    if opts["group_size"] not in (32, 64, 128):
        raise ValueError(f"persist_q4 group_size must be 32, 64 or 128; got {opts['group_size']}")
    if opts["block_size"] < 16 or opts["hot_mb"] < 0:
        raise ValueError("persist_q4 block_size must be >= 16 and hot_mb >= 0")
    if opts["latent_bits"] not in (None, 4, 8) or isinstance(opts["latent_bits"], bool):
        raise ValueError(f"persist_q4 latent_bits must be null, 4 or 8; got {opts['latent_bits']!r}")
    if opts["key_format"] not in KEY_FORMATS:
        raise ValueError(f"persist_q4 key_format must be one of {', '.join(KEY_FORMATS)}; got {opts['key_format']!r}")
    if opts["key_format"] == "auto" and opts["bits"] == 8:
        opts["key_format"] = "q4"  # keys are 8-bit already: nothing to choose
    if opts["key_format"].startswith("k") and opts["bits"] != 4:
        raise ValueError(f"persist_q4 key_format {opts['key_format']} stores 4-bit values, but bits is {opts['bits']}: "
                         "use key_format q4 (keys and values in `bits`) or auto")
    if opts["prefill_attention"] not in PREFILL_ATTENTION_MODES:
        raise ValueError(
            f"persist_q4 prefill_attention must be one of {PREFILL_ATTENTION_MODES}; "
            f"got {opts['prefill_attention']!r}"
        )
    for key in ("durable_writes", "match_text", "warmup", "restore", "remote_cluster", "batch_prefill"):
        if not isinstance(opts[key], bool):
            raise ValueError(f"persist_q4 {key} must be true or false")
    if opts["fork_policy"] not in FORK_POLICIES:
        raise ValueError(f"persist_q4 fork_policy must be one of {', '.join(FORK_POLICIES)}; got {opts['fork_policy']!r}")
    if not 1 <= opts["branches"] <= 64:
        raise ValueError(f"persist_q4 branches must be 1 to 64; got {opts['branches']}")
    url = opts["remote_url"]
    if url is not None and (not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://"))):
        raise ValueError("persist_q4 remote_url must be a redis://, rediss:// or unix:// URL")
    if opts["remote_cluster"] and url is not None and (
            url.startswith("unix://") or urlsplit(url).path.strip("/") not in ("", "0")):
        raise ValueError("persist_q4 remote_cluster needs a redis:// or rediss:// URL of any node, database 0 "
                         "(a Redis Cluster has no unix sockets and no other databases)")
    if min(opts["remote_timeout_s"], opts["remote_wait_s"], opts["remote_queue_mb"], opts["remote_fetch_mb"],
           opts["remote_block_ttl_hours"], opts["remote_manifest_ttl_hours"]) <= 0:
        raise ValueError("persist_q4 remote_* time-outs, sizes and TTLs must be > 0")
    secret_file = opts["remote_secret_file"]
    if secret_file is not None:
        if not isinstance(secret_file, str) or not secret_file:
            raise ValueError("persist_q4 remote_secret_file must be the path of a file holding the fleet secret")
        opts["remote_secret_file"] = os.path.expanduser(secret_file)
    opts["cache_dir"] = Path(os.path.expanduser(opts["cache_dir"])) if opts["cache_dir"] else default_cache_dir()
    opts["kv_edit"] = parse_kv_edit(opts["kv_edit"])
    return opts
