"""`recorder`: a small, real prefix-cache backend for testing the vllm-mlx patch series on its own.

tests/test_seam_series.py copies this module into a site-packages folder next to a copy of vllm_mlx
carrying only some patches of the series, registers it as a pluggy plugin (entry point group
`vllm_mlx.plugins`) implementing every hook the series defines (a hook the patches present do not
define is ignored), and serves a tiny model through it. The backend keeps finished sequences' mlx-lm KVCache in memory and
hands back their longest shared prefix; every call the seam makes is appended as a JSON line (the
call, its thread, the request id and namespace, a monotonic time) to $HOME/seam.jsonl (each test's
server has its own HOME).

Options (--cache-backend-options): ready_delay_s / durable_delay_s make `ready` / `store` return a
future done that much later (from a timer thread); ready_timeout_s / durable_timeout_s are the
seam's limits on waiting for them; refuse (a message) makes the factory refuse the model.
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Mapping, Optional

import pluggy

hookimpl = pluggy.HookimplMarker("vllm_mlx")
_LOCK = threading.Lock()


def log(event: str, **fields: Any) -> None:
    line = {"event": event, "t": time.monotonic(), "thread": threading.get_ident(),
            "thread_name": threading.current_thread().name, **fields}
    with _LOCK, open(os.path.join(os.environ["HOME"], "seam.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")


import vllm_mlx  # noqa: E402 - logged: which copy of vllm_mlx the server runs

log("imported", vllm_mlx=vllm_mlx.__file__)


def _later(seconds: float, event: str, **fields: Any) -> Future:
    """A future a timer thread completes `seconds` from now, logging `event` just before."""
    future: Future = Future()

    def done() -> None:
        log(event, **fields)
        future.set_result(True)

    timer = threading.Timer(seconds, done)
    timer.daemon = True
    timer.start()
    return future


class RecorderBackend:
    """An in-memory prefix cache over mlx-lm's KVCache that logs every seam call."""

    def __init__(self, *, model: Any, tokenizer: Any, config: Any, options: dict):
        if options.get("refuse"):
            raise ValueError(options["refuse"])
        self.model, self.options = model, options
        self.ready_timeout_s: Optional[float] = options.get("ready_timeout_s")
        self.durable_timeout_s: Optional[float] = options.get("durable_timeout_s")
        self.entries: list[tuple[list[int], list]] = []
        self.hits = self.misses = 0
        log("created", config_backend=config.cache_backend, options=options)

    def _ids(self, request: Any) -> dict:
        return {"rid": request.request_id, "ns": getattr(request, "cache_namespace", None)}

    def ready(self, request: Any) -> Optional[Future]:
        log("ready", **self._ids(request))
        delay = self.options.get("ready_delay_s")
        return _later(delay, "ready_done", rid=request.request_id) if delay else None

    def fetch(self, request: Any):
        from vllm_mlx.cache_backend import CacheLookup

        prompt = list(request.prompt_token_ids)
        best, best_n = None, 0
        for tokens, cache in self.entries:
            n = 0
            while n < min(len(tokens), len(prompt)) and tokens[n] == prompt[n]:
                n += 1
            n = min(n, cache[0].offset, len(prompt) - 1)
            if n > best_n:
                best, best_n = cache, n
        log("fetch", prompt=len(prompt), hit=best_n, **self._ids(request))
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        return CacheLookup(cache=[_prefix(layer, best_n) for layer in best], num_tokens=best_n)

    def make_prompt_cache(self, request: Any) -> list:
        from mlx_lm.models.cache import make_prompt_cache

        log("make_prompt_cache", **self._ids(request))
        return make_prompt_cache(self.model)

    def store(self, request: Any, token_ids: list[int], cache: list) -> Any:
        log("store", tokens=len(token_ids), prompt=len(request.prompt_token_ids), **self._ids(request))
        self.entries.append((list(token_ids), cache))
        delay = self.options.get("durable_delay_s")
        return _later(delay, "durable", rid=request.request_id) if delay else True

    def on_request_finished(self, request: Any, aborted: bool) -> None:
        log("finished", aborted=aborted, **self._ids(request))

    def get_stats(self) -> dict:
        return {"backend": "recorder", "entry_count": len(self.entries), "hits": self.hits,
                "misses": self.misses, "health": {"backend": "recorder", "entries": len(self.entries)}}

    def clear(self) -> None:
        log("clear")
        self.entries.clear()

    def load(self) -> int:
        log("load")
        return 0

    def save(self) -> bool:
        log("save")
        return True

    def close(self) -> None:
        log("close")


def _prefix(layer: Any, n: int) -> Any:
    """A new KVCache holding the first `n` positions of `layer`."""
    from mlx_lm.models.cache import KVCache

    keys, values = layer.state
    out = KVCache()
    out.state = (keys[..., :n, :], values[..., :n, :])
    return out


class _Incomplete:
    """A backend that forgot part of the protocol (no `ready`, no `durable_timeout_s`)."""

    ready_timeout_s = None

    def __init__(self, **kwargs: Any):
        pass

    fetch = make_prompt_cache = store = on_request_finished = get_stats = clear = load = save = close = (
        lambda self, *a, **k: None)


@hookimpl
def vllm_mlx_cache_backends() -> Mapping[str, Callable[..., Any]]:
    return {"recorder": RecorderBackend, "recorder_incomplete": _Incomplete}


@hookimpl
def vllm_mlx_cache_namespace(request: Any, headers: Mapping[str, str], endpoint: str) -> Optional[str]:
    """The namespace from an X-Test-Namespace header ("bad" is malformed, "secret" forbidden); None
    defers to the seam."""
    value = headers.get("x-test-namespace")
    if value == "bad":
        raise ValueError("the test resolver refuses the namespace 'bad'")
    if value == "secret":
        raise PermissionError("the test resolver forbids the namespace 'secret'")
    if value is not None:
        log("namespace", ns=value, endpoint=endpoint)
    return value


@hookimpl
def vllm_mlx_api_routers() -> Any:
    from fastapi import APIRouter

    r = APIRouter()

    @r.get("/v1/recorder")
    def status() -> dict:
        return {"backend": "recorder"}

    return r

