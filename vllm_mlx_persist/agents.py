"""Which agents exist, in what recency, and who leaves memory when the hot tier is over budget.

Owns the agent registry (`Agents.registry`, least recently used first), the anonymous namespace's
LRU (requests without an agent id: in memory only, reused by token prefix, never visible to agents)
and the hot-budget policy. Blocks and their bytes are the block table's (blocks.py).
Threads: any, with the pool's lock held; nothing here does I/O or waits (a PENDING block's unsaved
turn is simply not cached when it must leave memory).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from typing import Callable, Optional, Sequence

import numpy as np

from .blocks import Agent, BlockState, BlockTable
from .chain import cut_branch, lcp

log = logging.getLogger("vllm_mlx_persist.pool")

ANON_PREFIX = "\x00anon:"  # valid agent ids cannot start with NUL, so anonymous entries never collide


# The least a decision is stamped after the newest stamp its record holds: strictly later (a merge
# breaks a tie the other way: a removal takes what was written at its stamp, a tie of settings goes
# to the refusal); a microsecond is a distinct float at any wall-clock time (an ulp there: 2.4e-7 s).
STAMP_STEP_S = 1e-6


def after(t: float) -> float:
    """A stamp strictly later than `t` (0: none)."""
    return t + STAMP_STEP_S if t > 0 else 0.0


def removed_at(agent: Agent) -> float:
    """The newest removal the agent's record holds: its removal records, `spliced_cleared`, the floor."""
    return max([agent.spliced_cleared, agent.removed_floor] + [r.at for r in agent.removals])


def newest(agent: Agent) -> float:
    """The newest stamp the agent's record holds: its branches' uses and writes, its removals and
    its settings' times."""
    return max([removed_at(agent)] + [t for br in agent.branches for t in (br.last_used, br.written)]
               + list(agent.settings_at.values()))


class Agents:
    """The agent registry, the anonymous LRU, eviction and the hot budget."""

    def __init__(self, table: BlockTable, block_size: int, max_anonymous: int, stats: dict,
                 on_drop: Callable[[list[str]], None], clock: Callable[[], float] = time.time,
                 saving: Callable[[str], bool] = lambda bid: False):
        self.table = table
        self.clock = clock
        self.saving = saving  # whether a queued save that has not failed carries a block's data
        self.block_size = block_size
        self.max_anonymous = max_anonymous
        self.stats = stats
        self.on_drop = on_drop  # block ids whose pending reads are no longer wanted (reads.cancel)
        self.registry: "OrderedDict[str, Agent]" = OrderedDict()  # least recently used first
        self.anonymous: "OrderedDict[str, Agent]" = OrderedDict()  # least recently used first

    def get(self, namespace: str) -> Optional[Agent]:
        return self.registry.get(namespace)

    def all(self) -> list[Agent]:
        """Every agent naming blocks: registered and anonymous."""
        return list(self.registry.values()) + list(self.anonymous.values())

    def add(self, agent: Agent, coldest: bool = False) -> None:
        """Register (or re-register) `agent`; `coldest`: as the least recently used (start-up)."""
        if agent.persistent:
            self.registry[agent.namespace] = agent
            self.registry.move_to_end(agent.namespace, last=not coldest)
        else:
            self.anonymous[agent.namespace] = agent
        self.table.list(agent, True)

    def stamp(self, agent: Agent) -> float:
        """When a use of one of the agent's branches, or a commit of one, happens now: the clock, but
        never before the agent's most recent branch, and after every removal its record holds (a clock
        stepped back, or stamps of a server whose clock is ahead, cannot make its newest use count as
        older than its others, nor content sent again after a forget as written before it)."""
        return max([self.clock(), after(removed_at(agent))] + [br.last_used for br in agent.branches])

    def later(self, agent: Agent) -> float:
        """When a decision on the agent's record (a removal, a setting) is made now: the clock, but
        after every stamp the record holds, so no clock step or skew orders it before a write it
        removes or a setting it overrides that this server has seen (docs/fleet.md, "The merge rules")."""
        return max(self.clock(), after(newest(agent)))

    def touch(self, agent: Agent) -> None:
        agent.last_used = self.clock()
        entries = self.registry if agent.persistent else self.anonymous
        if entries.get(agent.namespace) is agent:
            entries.move_to_end(agent.namespace)

    # ---- the anonymous namespace ----------------------------------------------------------------

    def find_anonymous(self, prompt: Sequence[int]) -> Optional[Agent]:
        """The anonymous entry sharing the longest prefix with `prompt` in its first block."""
        best, best_n = None, 0
        for agent in self.anonymous.values():
            first = self._first_tokens(agent)
            if first:
                n = lcp(first, prompt[: len(first)])
                if n > best_n:
                    best, best_n = agent, n
        return best

    def anonymous_slot(self, tokens: Sequence[int]) -> Agent:
        """The anonymous entry this sequence extends, or a new one (the least recently used entry
        leaves when there are `max_anonymous`)."""
        for agent in self.anonymous.values():
            first = self._first_tokens(agent)
            if first and (tuple(tokens[: len(first)]) == first or first[: len(tokens)] == tuple(tokens)):
                return agent
        key = ANON_PREFIX + hashlib.sha256(np.asarray(tokens[: self.block_size], np.int32).tobytes()).hexdigest()
        taken = self.anonymous.get(key)
        if taken is not None:  # made for this first block, then taken over by another sequence: it takes this one
            return taken
        if len(self.anonymous) >= self.max_anonymous:
            self.stats["evicted_agents"] += 1
            self.drop(next(iter(self.anonymous.values())))
        return Agent(key, persistent=False)

    def _first_tokens(self, agent: Agent) -> tuple[int, ...]:
        block = self.table.blocks.get(agent.block_ids[0]) if agent.block_ids else None
        return block.tokens if block is not None else ()

    # ---- leaving ----------------------------------------------------------------------------------

    def drop(self, agent: Agent) -> list[str]:
        """Forget `agent` in memory: it leaves the registry and names nothing; returns the ids of
        blocks nobody names any more."""
        entries = self.registry if agent.persistent else self.anonymous
        if entries.get(agent.namespace) is agent:
            del entries[agent.namespace]
        ids = list(agent.ids)
        dead = self.table.name(agent, [])
        self.table.list(agent, False)
        self.on_drop(ids)
        return dead

    def cut(self, agent: Agent, bid: str) -> list[str]:
        """Cut the agent's branches naming `bid` at it (unreadable, refused or unsaved): they are
        re-cached from there on its next turn. Returns the ids nobody names any more."""
        branches = []
        for br in agent.branches:
            if bid in br.block_ids:
                br = cut_branch(br, br.block_ids.index(bid), self.block_size)
            if br.block_ids:
                branches.append(br)
        return self.table.name(agent, branches)

    def cut_everywhere(self, bid: str) -> list[str]:
        """`cut` for every agent naming `bid`."""
        dead = []
        for agent in [a for a in self.all() if bid in a.ids]:
            dead += self.cut(agent, bid)
        return dead

    def evict(self, agent: Agent, durable: bool) -> None:
        """Take an agent out of memory: the hot blocks it owns go COLD (`durable`: there is a disk
        tier to come back from; else the agent is forgotten). PENDING ones whose save is still
        queued stay until it is durable (the write queue's byte budget bounds them); those whose
        save failed are dropped with the rest of their branches, so memory stays bounded on a
        failing disk. Blocks it names but others own stay (counted by them)."""
        self.stats["evicted_agents"] += 1
        if not agent.persistent or not durable:
            self.drop(agent)
            return
        for bid in [b for b in agent.ids if self._owned_pending(agent, b) and not self.saving(b)]:
            if bid in agent.ids:
                before = len(agent.ids)
                self.cut(agent, bid)
                dropped = before - len(agent.ids)
                self.stats["unsaved_blocks_dropped"] += dropped
                log.warning("agent %r: %d unsaved block(s) left memory uncached", agent.namespace, dropped)
        for bid in agent.ids:
            block = self.table.blocks.get(bid)
            if block is not None and block.owner is agent and block.state != BlockState.PENDING:
                self.table.drop(block)

    def _owned_pending(self, agent: Agent, bid: str) -> bool:
        block = self.table.blocks.get(bid)
        return block is not None and block.owner is agent and block.state == BlockState.PENDING

    def drop_orphans(self, budget: int) -> None:
        """Drop hot blocks no agent counts (least recently orphaned first) while over `budget`;
        PENDING ones whose save is queued stay until it is durable."""
        table = self.table
        for bid in list(table.orphans):
            if table.hot_bytes <= budget:
                return
            block = table.blocks.get(bid)
            if block is None or block.layers is None:
                table.orphans.pop(bid, None)
                continue
            if block.state == BlockState.PENDING and self.saving(bid):
                continue
            if block.state == BlockState.PENDING:
                self.stats["unsaved_blocks_dropped"] += 1
                self.cut_everywhere(bid)  # nobody names it now: out of the table with its layers
                table.orphans.pop(bid, None)
                continue
            table.drop(block)

    def enforce(self, budget: int, keep: Sequence[str], durable: bool) -> None:
        """Evict least recently used agents (anonymous entries and unpinned agents, never those in
        `keep`: the request being served), then hot blocks nobody counts, until the hot tier fits
        `budget`. Every agent is evicted at most once per call, so this always ends."""
        table = self.table
        tried: set[int] = set()
        while table.hot_bytes > budget:
            victim = None
            for agent in self.anonymous.values():
                if agent.namespace not in keep and id(agent) not in tried:
                    victim = agent
                    break
            for agent in self.registry.values():
                if (agent.namespace not in keep and agent.hot_bytes and not agent.pinned
                        and id(agent) not in tried):
                    if victim is None or agent.last_used < victim.last_used:
                        victim = agent
                    break
            if victim is None:
                self.drop_orphans(budget)
                return
            tried.add(id(victim))
            self.evict(victim, durable)  # what a queued save still holds stays: each victim once
