"""The servers the benchmarks compare, by name: persist_q4, vllm-mlx's default prefix cache, its
4-bit + SSD tier, and no cache at all. `vllm-mlx-persist bench` (every section) and
`python -m vllm_mlx_persist.tools.bench.hotturn --servers` start theirs here."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Optional

from .server import Server

SERVER_SYSTEMS = ("persist_q4", "vllm_default", "vllm_q4_ssd", "no_cache")
COMMON_ARGS = ("--stream-interval", "1", "--timeout", "7200")


def system_server(system: str, model: Path, home: Path, cache_mb: float, options: Optional[dict] = None) -> Server:
    """A (not yet started) server of `system` with a cache of `cache_mb` (persist_q4: `hot_mb`, then
    `options`; vllm-mlx: `--cache-memory-mb`)."""
    if system == "persist_q4":
        return Server(model, home, backend="persist_q4", options={"hot_mb": cache_mb, **(options or {})},
                      extra_args=COMMON_ARGS)
    if system == "no_cache":
        return Server(model, home, backend=None, extra_args=COMMON_ARGS + ("--disable-prefix-cache",))
    args = COMMON_ARGS + ("--cache-memory-mb", str(max(1, int(cache_mb))))
    if system == "vllm_q4_ssd":
        args += ("--kv-cache-quantization", "--kv-cache-quantization-bits", "4", "--ssd-cache-dir", str(home / "ssd"))
    elif system != "vllm_default":
        raise ValueError(f"unknown system {system!r}; choose from {', '.join(SERVER_SYSTEMS)}")
    return Server(model, home, backend=None, extra_args=args)


def system_flags(system: str, cache_mb: float, options: Optional[dict] = None, quote: bool = True) -> str:
    """`system`'s `vllm-mlx serve` command line from the model on (MODEL, HOME /tmp/HOME), without host
    and port: what a report shows."""
    server = system_server(system, Path("MODEL"), Path("/tmp/HOME"), cache_mb, options)
    args = [a for a in server.command()[2:] if a not in ("--port", "0", "--host", "127.0.0.1")]
    return " ".join(shlex.quote(a) for a in args) if quote else " ".join(args)
