"""Forget edits in the pool: what a forget request removes from its agent's record, and when.

A forget's lookup notes the first block of each of the agent's branches the prompt no longer holds
(supersede.py) with the removal records the fleet's merges apply (chain.Removal); the branches naming
them, and every spliced branch (a spliced copy may hold what is removed), leave the record when the
turn commits (`record`, through the commit's filter) or, when it never does (an aborted request), when
the request finishes (`finished`). The removal records stay with the record, bounded (MAX_REMOVALS,
`removal_ttl_s`), so no older copy of the removed content comes back from another server.

Owns the forgets in flight (request id -> agent and removals), under the pool's lock; any thread
with it held (the worker's lookups and commits, the finish of a request).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from ..blocks import Agent
from ..chain import Branch, Removal, bound_removals, removal_of
from ..disk_format import MAX_REMOVALS
from ..pool_core import PoolCore
from .supersede import edit_point, superseded_block, surviving


class Forgets:
    """Forget edits of the pool's agents (see the module docstring)."""

    def __init__(self, core: PoolCore, removal_ttl_s: float = 30 * 86400.0):
        self.core = core
        self.removal_ttl_s = removal_ttl_s
        self._pending: dict[str, tuple[str, dict[str, Removal]]] = {}  # request id -> (agent, removals)

    def supersede(self, agent: Agent, found: Optional[Any], prompt: list[int], request_id: str) -> int:
        """(lock held) A forget's lookup: note the first block of the agent's own best branch that
        holds content the prompt no longer has (and of the branches tied with it); returns how many of
        its branches name one."""
        if found is None or found.src is not agent:
            return 0
        served = found.prompt if found.prompt is not None else prompt
        bs = self.core.block_size
        removals: dict[str, Removal] = {}
        now = self.core.clock()  # provisional: `record` stamps it after every write its record holds then
        for f in [found] + [t for t in found.ties if t.src is agent]:
            point = edit_point([got.tokens for got, _ in f.used], served)
            bid = superseded_block(f.branch, point, bs)
            if bid is not None:
                i = point // bs
                tokens = f.used[i][0].tokens if i < len(f.used) else self.core.table.blocks[bid].tokens
                removals[bid] = removal_of(f.branch, i, tokens, bs, now)
        if not removals:
            return 0
        self._pending[request_id] = (agent.namespace, removals)
        return len(agent.branches) - len(surviving(agent.branches, removals))

    def pending(self, request_id: Optional[str]) -> Optional[dict[str, Removal]]:
        """(lock held) The removals of a forget request whose turn has not committed yet, or None."""
        entry = self._pending.get(request_id) if request_id is not None else None
        return entry[1] if entry is not None else None

    def committed(self, request_id: str) -> None:
        """(lock held) The forget's turn committed, its removals with it."""
        self._pending.pop(request_id, None)

    def record(self, agent: Agent, branches: list[Branch], removals: dict[str, Removal]) -> list[Branch]:
        """(lock held) A forget's removals entered in the agent's record: of `branches` (the
        agent's), those naming a superseded block and every spliced one go (returns those kept), and
        the removal records stay with the record, bounded, for the fleet's merges. Each is stamped
        now, after every stamp the record holds (whatever the clock says: one stepped back, or stamps
        of a server whose clock is ahead), so every write it removes here counts as older than the
        removal in every merge, a turn committed since the forget's lookup included."""
        now = self.core.agents.later(agent)
        kept = surviving(branches, removals)
        # spliced copies may hold what is removed: every one written before now goes, this record's and
        # those another server holds (its copy merged later), even when this record holds none
        agent.spliced_cleared = max(agent.spliced_cleared, now)
        kept = [br for br in kept if not br.spliced]
        stamped = [replace(r, at=max(r.at, now)) for r in removals.values()]
        agent.removals, agent.removed_floor = bound_removals([*agent.removals, *stamped], MAX_REMOVALS,
                                                             self.core.clock() - self.removal_ttl_s,
                                                             agent.removed_floor)
        self.core.stats["branches_superseded"] += len(branches) - len(kept)
        return kept

    def finished(self, request_id: str) -> None:
        """(lock held) The request is done: a forget whose turn was not stored drops the superseded
        branches now, and keeps the removal in the record, saved and published like a turn."""
        entry = self._pending.pop(request_id, None)
        if entry is None:
            return
        core = self.core
        namespace, removals = entry
        agent = core.agents.get(namespace)
        if agent is None:
            return
        before = list(agent.branches)
        kept = self.record(agent, before, removals)
        core.epoch += 1  # commits planned on those blocks plan again
        if not kept and core.fleet is None:  # nothing left, nothing to tell: the agent goes, locally
            core.forget(namespace)
            if core.persister is not None:
                core.persister.erase(namespace)
            return
        dead = core.table.name(agent, kept)
        if agent.persistent and core.persister is not None:
            core.drop_remote(dead, core.save(agent, [], {}, dead, before))
