"""pluggy hook implementations that vllm-mlx loads from the `vllm_mlx.plugins` entry point (hookspecs:
vllm_mlx/plugins.py, added by the patch series in patches/vllm-mlx-0.6.0): the `persist_q4` factory
(`vllm_mlx_cache_backends`), the agent id of a request (`vllm_mlx_cache_namespace`) and the agent admin
API (`vllm_mlx_api_routers`). This module imports neither vllm-mlx nor MLX, and it must import without
the series applied (it only needs pluggy), so the marker is created here rather than imported from
`vllm_mlx.plugins`. What an agent id may be and how a fork rides in the namespace: `namespace.py`.
State: the registry of live backends (a WeakSet; the factory adds on the engine's thread, the hooks
read on the HTTP event loop).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Mapping, Optional

import pluggy

from .kv_edit import FORGET, resolve_mode
from .namespace import Route, validate_agent_id
from .refusal import refuse

hookimpl = pluggy.HookimplMarker("vllm_mlx")

BACKEND_NAME = "persist_q4"
AGENT_ID_HEADER = "x-agent-id"
FORK_HEADER = "x-agent-fork-from"
# Backends this plugin created in this process: the namespace hook starts their disk reads as a
# request arrives, and the admin routes find them here (backend.py never imports this module).
_LIVE_BACKENDS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def resolve_agent_id(request: Any, headers: Mapping[str, str]) -> Optional[str]:
    """Agent id of a request, by precedence: X-Agent-ID header, metadata.agent_id, prompt_cache_key."""
    header = headers.get(AGENT_ID_HEADER) if headers is not None else None
    if header is not None:
        return validate_agent_id(header, "the X-Agent-ID header")
    metadata = getattr(request, "metadata", None)
    if isinstance(metadata, Mapping) and metadata.get("agent_id") is not None:
        return validate_agent_id(metadata["agent_id"], "metadata.agent_id")
    key = getattr(request, "prompt_cache_key", None)
    if key is not None:
        return validate_agent_id(key, "prompt_cache_key")
    return None


def resolve_fork_from(request: Any, headers: Mapping[str, str]) -> Optional[str]:
    """The agent a request forks from, by precedence: X-Agent-Fork-From header, metadata.fork_from."""
    header = headers.get(FORK_HEADER) if headers is not None else None
    if header is not None:
        return validate_agent_id(header, "the X-Agent-Fork-From header")
    metadata = getattr(request, "metadata", None)
    if isinstance(metadata, Mapping) and metadata.get("fork_from") is not None:
        return validate_agent_id(metadata["fork_from"], "metadata.fork_from")
    return None


# vllm-mlx options of the built-in prefix caches, which persist_q4 replaces: accepted, they would
# be silently ignored. (--max-kv-size: its rotating cache bounds a sequence; 4-bit caches do not.)
_REPLACED_OPTIONS = (
    ("--use-paged-cache", "use_paged_cache", True),
    ("--disable-prefix-cache", "enable_prefix_cache", False),
    ("--no-memory-aware-cache", "use_memory_aware_cache", False),
    ("--kv-cache-quantization", "kv_cache_quantization", True),
    ("--ssd-cache-dir", "ssd_cache_dir", True),
    ("--max-kv-size", "max_kv_size", True),
)


def check_scheduler_config(config: Any) -> None:
    """Raise ValueError naming the options of vllm-mlx's SchedulerConfig that persist_q4 replaces."""
    given = [flag for flag, field, when_set in _REPLACED_OPTIONS
             if hasattr(config, field) and bool(getattr(config, field)) == when_set]
    if given:
        raise ValueError(f"--cache-backend {BACKEND_NAME} cannot be combined with {', '.join(given)}: "
                         "it replaces the built-in prefix cache those options configure")


def create_backend(**kwargs: Any) -> Any:
    """The `persist_q4` factory vllm-mlx calls: refuses the built-in cache options it replaces."""
    from .backend import PersistQ4Backend

    try:
        check_scheduler_config(kwargs.get("config"))
    except ValueError as e:
        raise refuse(e) from None
    backend = PersistQ4Backend(**kwargs)
    _LIVE_BACKENDS.add(backend)
    return backend


def live_backend() -> Optional[Any]:
    """The backend serving in this process, if any (the newest one)."""
    backends = [b for b in list(_LIVE_BACKENDS) if not getattr(b, "closed", False)]
    return backends[-1] if backends else None


@hookimpl
def vllm_mlx_cache_backends() -> Mapping[str, Callable[..., Any]]:
    return {BACKEND_NAME: create_backend}


@hookimpl
def vllm_mlx_api_routers() -> Any:
    """The agent admin API (mounted behind --api-key)."""
    from .admin import make_router

    return make_router(live_backend)


class ForkRefused(PermissionError):
    """A fork the server's fork_policy (or the parent's own setting) does not allow: HTTP 403."""


def removals_refused(backend: Any) -> Exception:
    """HTTP 503 for a forget refused at the fleet's bound of pending removals: refused before its lookup,
    rather than acknowledged and never published (the API's own handler answers a FastAPI
    HTTPException with its status)."""
    from fastapi import HTTPException

    from .admin import removals_full_message

    fleet = backend.loaded_pool.fleet
    return HTTPException(503, removals_full_message(fleet),
                         headers={"Retry-After": str(max(1, round(fleet.settings.outbox_retry_s)))})


@hookimpl
def vllm_mlx_cache_namespace(request: Any, headers: Mapping[str, str], endpoint: str) -> Optional[str]:
    """A request's route (agent id, fork parent, edit mode) as the one string vllm-mlx carries;
    ValueError (HTTP 400) for a malformed one, PermissionError (HTTP 403) for a fork not allowed, an
    HTTPException 503 for a forget past the fleet's bound of pending removals. None,
    without reading the request, unless persist_q4 is the backend serving in this process: vllm-mlx
    calls every plugin's hook, whichever backend --cache-backend selected."""
    backends = [b for b in list(_LIVE_BACKENDS) if not getattr(b, "closed", False)]
    if not backends:
        return None
    agent_id = resolve_agent_id(request, headers)
    parent = resolve_fork_from(request, headers)
    if parent is not None and agent_id is None:
        raise ValueError("a fork (X-Agent-Fork-From or metadata.fork_from) needs an agent id of its own "
                         "(X-Agent-ID, metadata.agent_id or prompt_cache_key)")
    if parent is not None and parent == agent_id:
        raise ValueError(f"agent {agent_id!r} cannot fork from itself")
    mode = resolve_mode(request, headers)
    if mode is not None and agent_id is None:
        raise ValueError(f"a span directive (X-KV-Edit or metadata.kv_edit: {mode}) needs an agent id "
                         "(X-Agent-ID, metadata.agent_id or prompt_cache_key): it edits that agent's history")
    if agent_id is None:
        return None
    if parent is not None and any(not b.may_fork(parent) for b in backends):
        # Refused before any lookup, the same way for an unknown parent: nothing about the parent's
        # history (or existence) reaches the client, through cached_tokens or otherwise. With a fleet
        # tier this reads the parent's settings in Redis: the event loop waits at most the fleet's
        # bound for it (docs/fleet.md, "The fork answer"); the hook is synchronous.
        raise ForkRefused(f"agent {agent_id!r} may not fork from {parent!r} on this server (fork_policy)")
    if mode == FORGET:
        full = [b for b in backends if not b.removal_room()]
        if full:
            raise removals_refused(full[0])
    route = Route(agent_id, parent, mode)
    # The earliest moment we know the agent: start reading its blocks (and its parent's) from disk
    # now, so the worker thread's fetch, which stalls every running sequence while it waits, finds
    # them read.
    for backend in backends:
        backend.prefetch(route)
    # One string reaches the backend (the seam carries it opaquely); it parses it back once.
    return route.encode()
