"""The agent admin API that persist_q4 adds to vllm-mlx (through the `vllm_mlx_api_routers` hook).

    GET    /v1/agents              agents by id, a page at a time (?limit=1..1000, default 100; ?after=ID, the
                                   last id of the previous page; has_more, last_id): id, tokens, bytes hot
                                   and on disk, tier, pinned, last used, branches (tokens of each, newest
                                   first), shared_blocks, forked_from
    GET    /v1/agents/{id}         one agent (404 if unknown)
    DELETE /v1/agents/{id}         erase it from memory and disk, durably, before the reply (404 if unknown;
                                   503 with a fleet tier whose pending removals are at their bound)
    PUT    /v1/agents/{id}/pin     pin: exempt from hot-tier eviction, the disk budget and the TTL (a setting;
                                   with a fleet tier, 503 like DELETE at the bound: settings are in its outbox too)
    DELETE /v1/agents/{id}/pin     unpin
    PUT    /v1/agents/{id}/forkable     other agents may fork it (whatever the fork_policy, but "none")
    DELETE /v1/agents/{id}/forkable     no other agent may fork it (requests naming it as parent get 403)

vllm-mlx mounts the router behind `--api-key`. Handlers run the pool's calls in a thread: they take the
pool's lock and wait for the disk, which must never block the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Optional

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse

from .namespace import validate_agent_id

PAGE_DEFAULT, PAGE_MAX = 100, 1000  # agents per GET /v1/agents reply: every response has a bound


def _error(status: int, message: str, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "code": status}},
                        headers=headers)


def removals_full_message(fleet: Any) -> str:
    """What a removal refused at the outbox's bound is told (HTTP 503)."""
    return (f"this server has {fleet.settings.max_erasures} removals and settings pending for the "
            "fleet tier, which cannot reach Redis: nothing was removed or set; retry once Redis is reachable")


def make_router(get_backend: Callable[[], Optional[Any]]) -> APIRouter:
    """Routes over the backend `get_backend()` returns."""
    router = APIRouter()

    def outbox_full(pool) -> Optional[JSONResponse]:
        """A 503 when the pool's fleet tier has no room for a new removal or setting (refused, not
        acknowledged and left undone), else None."""
        fleet = getattr(pool, "fleet", None)
        if fleet is not None and not fleet.removal_room():
            return _error(503, removals_full_message(fleet),
                          {"Retry-After": str(max(1, round(fleet.settings.outbox_retry_s)))})
        return None

    def pool_or_error():
        backend = get_backend()
        pool = backend.loaded_pool if backend is not None else None
        if pool is None:  # never built here: building hashes the weights, MLX work for the worker
            return None, _error(503, "the persist_q4 cache backend is not running")
        return pool, None

    def agent_and_pool(agent_id: str):
        """(pool, error response): a 400 for a malformed id, a 503 without a running backend."""
        try:
            validate_agent_id(agent_id, "the URL path")
        except ValueError as e:
            return None, _error(400, str(e))
        return pool_or_error()

    @router.get("/v1/agents")
    async def list_agents(limit: int = Query(PAGE_DEFAULT, ge=1, le=PAGE_MAX), after: Optional[str] = None):
        pool, err = pool_or_error()
        if err:
            return err
        if after is not None:
            try:
                validate_agent_id(after, "`after`")
            except ValueError as e:
                return _error(400, str(e))
        agents, more = await asyncio.to_thread(pool.list_agents, limit, after)
        return {"object": "list", "data": agents, "has_more": more,
                "first_id": agents[0]["id"] if agents else None, "last_id": agents[-1]["id"] if agents else None}

    @router.get("/v1/agents/{agent_id}")
    async def show_agent(agent_id: str):
        pool, err = agent_and_pool(agent_id)
        if err:
            return err
        info = await asyncio.to_thread(pool.agent_info, agent_id)
        return info if info is not None else _error(404, f"no agent {agent_id!r}")

    @router.delete("/v1/agents/{agent_id}")
    async def erase_agent(agent_id: str):
        pool, err = agent_and_pool(agent_id)
        if err:
            return err
        full = outbox_full(pool)
        if full is not None:
            return full
        if not await asyncio.to_thread(pool.erase, agent_id):
            return _error(404, f"no agent {agent_id!r}")
        return {"id": agent_id, "deleted": True}

    async def setting(agent_id: str, name: str, value: bool):
        """Set one of the agent's settings (`pinned`: pool.set_pinned; `forkable`: pool.set_forkable)."""
        pool, err = agent_and_pool(agent_id)
        if err:
            return err
        full = outbox_full(pool)
        if full is not None:
            return full
        setter = pool.set_pinned if name == "pinned" else pool.set_forkable
        if not await asyncio.to_thread(setter, agent_id, value):
            return _error(404, f"no agent {agent_id!r}")
        return {"id": agent_id, name: value}

    @router.put("/v1/agents/{agent_id}/pin")
    async def pin_agent(agent_id: str):
        return await setting(agent_id, "pinned", True)

    @router.delete("/v1/agents/{agent_id}/pin")
    async def unpin_agent(agent_id: str):
        return await setting(agent_id, "pinned", False)

    @router.put("/v1/agents/{agent_id}/forkable")
    async def allow_forks(agent_id: str):
        return await setting(agent_id, "forkable", True)

    @router.delete("/v1/agents/{agent_id}/forkable")
    async def refuse_forks(agent_id: str):
        return await setting(agent_id, "forkable", False)

    return router
