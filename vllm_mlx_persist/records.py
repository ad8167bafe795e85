"""Agents as units: what is done to an agent's record as a whole, not to one of its turns.

An agent's record (blocks.Agent) holds its honest and spliced branches, its pin, its fork setting
and its removal records; everything here acts on all of it: loading the records from disk (and the
layout before the record), the admin views (`agent_info`, `list_agents`), erasure, the pin and the
fork permission. Owns nothing of its own: it acts on the pool's core (pool_core.PoolCore) under its
lock, held for bookkeeping only; `erase`, `set_pinned` and `set_forkable` wait for the disk with the
lock released. Threads: the admin API's (HTTP threads), the worker at start-up (`load`).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable, Optional

from .blocks import Agent
from .chain import branches_of, limit_branches, removals_of
from .disk_format import Manifest
from .namespace import legacy_spliced
from .pool_core import PoolCore
from .record_settings import RemoteSettings

log = logging.getLogger("vllm_mlx_persist.pool")


class Records:
    """The agents' records (see the module docstring). `fork_policy`: which agents may be forked
    (options.FORK_POLICIES: "open": any but those set not forkable; "listed": only those set
    forkable; "none")."""

    def __init__(self, core: PoolCore, max_branches: Callable[[], int], fork_policy: str = "open"):
        self.core = core
        self.max_branches = max_branches
        self.fork_policy = fork_policy

    # ---- start-up -------------------------------------------------------------------------------

    def load(self) -> int:
        """Register every agent found on disk (cold: blocks are read on first use); returns count."""
        core = self.core
        if core.persister is None:
            return 0
        manifests = sorted(core.persister.load(), key=lambda m: m.updated_at, reverse=True)
        legacy: dict[str, list[tuple[Manifest, int]]] = {}  # agent -> its spliced histories' old manifests
        with core.lock:
            for m in manifests:
                old = legacy_spliced(m.namespace)
                if old is not None:
                    legacy.setdefault(old[0], []).append((m, old[1]))
                    continue
                if core.agents.get(m.namespace) is not None:
                    continue
                if core.fleet is not None:
                    core.fleet.loaded(m)  # the erasure its history follows survives the restart
                agent = Agent(m.namespace, pinned=m.pinned, last_used=m.updated_at, forkable=m.forkable,
                              removals=removals_of(m), spliced_cleared=m.spliced_cleared or 0.0,
                              settings_at=dict(m.settings_at or {}), removed_floor=m.removed_floor or 0.0,
                              era=m.era or "")
                core.table.name(agent, branches_of(m))
                core.agents.add(agent, coldest=True)  # disk agents are the coldest
            for name, old in legacy.items():
                self._adopt_legacy(name, old)
            return len(core.agents.registry)

    def _adopt_legacy(self, name: str, old: list[tuple[Manifest, int]]) -> None:
        """(lock held, start-up) Spliced histories stored before the agent record, each as an agent of
        its own (`name\\0amortized:g`): they become the agent's branches of generation g (their ids
        unchanged: their links name the same seeds), the record is saved with them, and then the old
        manifests are erased (their blocks stay: the record's manifest names them)."""
        core = self.core
        agent = core.agents.get(name)
        if agent is None:
            agent = Agent(name, last_used=max(m.updated_at for m, _ in old))
            core.agents.add(agent, coldest=True)
        spliced = [replace(br, generation=g) for m, g in old for br in branches_of(m)]
        branches = limit_branches(sorted(agent.branches + spliced, key=lambda br: br.last_used), self.max_branches())
        core.table.name(agent, branches)
        core.save(agent, [], {}, [], [])
        for m, _ in old:
            core.persister.erase(m.namespace)
        log.info("agent %r: %d spliced histories of the earlier layout moved into its record", name, len(old))

    # ---- the admin API --------------------------------------------------------------------------

    def agent_info(self, namespace: str) -> Optional[dict]:
        """What the pool knows of an agent, or None if it has none."""
        core = self.core
        with core.lock:
            agent = core.agents.get(namespace)
            if agent is None:
                return None
            n_blocks = len(agent.ids)
            hot = sum(1 for b in agent.ids if core.table.blocks[b].layers is not None)
            info = {
                "id": agent.namespace,
                "tokens": agent.n_tokens,
                "blocks": n_blocks,
                "blocks_hot": hot,
                "bytes_hot": agent.hot_bytes,
                "tier": "hot" if hot == n_blocks else ("disk" if hot == 0 else "partial"),
                "pinned": agent.pinned,
                "last_used": agent.last_used,
                "branches": [br.n_tokens for br in reversed(agent.honest)],  # most recent first
                "spliced_branches": [{"tokens": br.n_tokens, "generation": br.generation}
                                     for br in reversed(agent.branches) if br.spliced],
                "shared_blocks": sum(1 for b in agent.ids if core.table.refs.get(b, 0) > 1),
                "forked_from": sorted({ns for br in agent.honest for _, ns in br.links} - {namespace}),
                "forkable": self._may_fork(agent),
                "removals": len(agent.removals),
            }
        if core.fleet is not None:
            info["remote"] = core.fleet.agent_info(namespace)
        info["bytes_disk"] = core.persister.agent_disk_bytes(namespace) if core.persister is not None else 0
        return info

    def list_agents(self, limit: int, after: Optional[str] = None) -> tuple[list[dict], bool]:
        """One page of agents ordered by id: up to `limit` whose ids sort after `after`, and whether
        more follow. Id order keeps pages stable while agents are used (recency would reshuffle them)."""
        with self.core.lock:
            names = sorted(n for n in self.core.agents.registry if after is None or n > after)
        page = [i for i in map(self.agent_info, names[:limit]) if i is not None]
        return page, len(names) > limit

    def erase(self, namespace: str, timeout: Optional[float] = 60.0, fleet_wide: bool = True) -> bool:
        """Forget an agent in memory and on disk (durable when this returns), under every model
        directory of the cache root; False if unknown.

        The whole record goes: every branch, honest and spliced, its pin and its removal records. A
        request of the agent still running when this is called will not store its turn. Blocks its
        forks share stay, in memory and on disk, as long as a fork names them. With a fleet tier and
        `fleet_wide`, the agent is then erased from Redis too (queued).
        """
        core = self.core
        with core.lock:
            known = core.forget(namespace)
            for entry in core.inflight.values():
                if entry[0] == namespace:
                    entry[1] = True
            # queued under the lock, so it is ordered after every save already committed
            future = core.persister.erase(namespace) if core.persister is not None else None
        if future is not None:
            known = bool(future.result(timeout)) or known
        if fleet_wide and core.fleet is not None:  # after the local save jobs: their uploads are queued
            known = core.fleet.erase(namespace) or known
        return known

    def set_pinned(self, namespace: str, pinned: bool, timeout: Optional[float] = 60.0) -> bool:
        """Pin (exempt from hot eviction, the disk budget and the TTL) or unpin; False if unknown."""
        core = self.core
        with core.lock:
            agent = core.agents.get(namespace)
            if agent is None:
                return False
            agent.pinned = pinned
            # the latest setting wins: stamped after every stamp the record holds (a clock behind cannot lose it)
            agent.settings_at = {**agent.settings_at, "pinned": core.agents.later(agent)}
            if not pinned:
                core.enforce_budget()  # what the pin held over the budget leaves memory now
            future = core.persister.set_pinned(namespace, pinned) if core.persister is not None else None
            if future is not None and core.fleet is not None and agent.branches:  # the fleet's copies too
                future = core.save(agent, [], {}, [], list(agent.branches))
        if future is not None:
            future.result(timeout)
        return True

    # ---- forks ----------------------------------------------------------------------------------

    def may_fork(self, parent: str, remote: Optional[RemoteSettings] = None) -> bool:
        """Whether a request may fork `parent` (`fork_policy`, and the parent's own setting). An
        unknown parent is answered like a known one under the policy, so the answer tells nothing
        of which agents exist. `remote`: the parent's settings in Redis, merged with the local
        record's by the merge rule (the fleet's answer, whichever server asks). Any thread, no I/O."""
        with self.core.lock:
            agent = self.core.agents.get(parent)
            if remote is None:
                return self._may_fork(agent)
            return self._decide(remote.merged_forkable(agent))

    def allows_fork(self, agent: Optional[Agent]) -> bool:
        """(lock held) `may_fork` for an agent's record at hand: the lookup's own check, after the
        parent's sync with the fleet (a refusal made on another server since the request's admission)."""
        return self._may_fork(agent)

    def _may_fork(self, agent: Optional[Agent]) -> bool:
        return self._decide(None if agent is None else agent.forkable)

    def _decide(self, forkable: Optional[bool]) -> bool:
        if self.fork_policy == "none":
            return False
        if forkable is None:
            return self.fork_policy == "open"
        return forkable

    def set_forkable(self, namespace: str, forkable: Optional[bool], timeout: Optional[float] = 60.0) -> bool:
        """Let other agents fork this one (True), forbid it (False) or leave it to `fork_policy`
        (None); saved with the record (its manifest). False if the agent is unknown."""
        core = self.core
        with core.lock:
            agent = core.agents.get(namespace)
            if agent is None:
                return False
            agent.forkable = forkable
            # the latest setting wins: stamped after every stamp the record holds (a clock behind cannot lose it)
            agent.settings_at = {**agent.settings_at, "forkable": core.agents.later(agent)}
            future = core.save(agent, [], {}, [], list(agent.branches)) if core.persister is not None else None
        if future is not None:
            future.result(timeout)
        return True
