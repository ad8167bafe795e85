"""The pool as the fleet sees it (fleet.FleetPool): what a sync compares, merges and adopts, and the
local disk's blocks a put or a fetch needs.

A sync reads an agent's record in Redis (a copy: its branches and removal records), and the pool
merges it with the local record (branches by recency, then every removal record of either side
applied: removals win) and adopts the merge once it is durable on the local disk. Owns nothing: it
acts on the pool's core (pool_core.PoolCore) under its lock, which it never holds across I/O. Threads:
the fleet's sync threads, the tier's writer thread, the persister thread (adoptions).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Callable, Optional, Sequence

from .blocks import Agent
from .chain import (Branch, Copy, Removal, manifest_of, merge_branches, merge_records, same_branches,
                    surviving_removals)
from .disk_format import MAX_REMOVALS, BlockData, Manifest
from .pool_core import PoolCore
from .record_settings import differ, merge_records_settings, values_of
from .store import DiskStore

log = logging.getLogger("vllm_mlx_persist.pool")


def record_ahead(agent: Agent, remote: Copy) -> bool:
    """Whether the agent's record holds a removal or a setting that `remote` lacks (a removal of a
    block `remote` removed at the same time or later counts as held)."""
    at = {r.block: r.at for r in remote.removals}
    if any(at.get(r.block, -1.0) < r.at and r.at > remote.removed_floor for r in agent.removals):
        return True
    if agent.spliced_cleared > remote.spliced_cleared or agent.removed_floor > remote.removed_floor:
        return True
    return differ(*merge_records_settings(agent, remote), remote)


class FleetView:
    """fleet.FleetPool over one pool (see the module docstring)."""

    def __init__(self, core: PoolCore, store: DiskStore, max_branches: Callable[[], int],
                 prefetch: Callable[[str], int], erase: Callable[..., bool], removal_ttl_s: float):
        self.core, self.store = core, store
        self._max_branches = max_branches
        self.prefetch = prefetch  # the pool's read-ahead of an agent's cold blocks
        self.erase = erase  # records.Records.erase
        self.removal_ttl_s = removal_ttl_s

    # ---- what the pool is -----------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.core.block_size

    @property
    def max_branches(self) -> int:
        return self._max_branches()

    @property
    def bounded_windows(self) -> bool:
        """Whether the model has bounded sliding-window layers."""
        return bool(self.core.codec.window_names())

    @property
    def fleet_dir(self):
        """The model's directory on the local disk (the fleet keeps its pending removals there)."""
        return self.store.dir

    @property
    def disk_queue_bytes(self) -> Optional[int]:
        """The disk tier's write queue, in bytes; None without a disk tier."""
        return self.core.persister.queue_bytes if self.core.persister is not None else None

    # ---- the local disk -------------------------------------------------------------------------

    def has_disk_block(self, block_id: str) -> bool:
        """Whether the disk holds the block's file (not verified: a read does that)."""
        return self.store.has_block(block_id)

    def read_disk_block(self, block_id: str) -> Optional[BlockData]:
        """The block read from disk, verified; None when absent or bad."""
        return self.store.read_block(block_id)

    def read_record(self, namespace: str) -> Optional[Manifest]:
        """The agent's record as its manifest on the local disk, verified; None when absent or bad."""
        return self.store.read_manifest(namespace)

    def chain_prefix(self, branch: Branch, fetched: dict[str, BlockData]) -> tuple[int, bool]:
        """`Chains.prefix` of a branch fetched from the fleet, the disk's blocks held."""
        return self.core.chains.prefix(branch, fetched, self.store.has_block)

    # ---- an agent's record: compared, merged, adopted -------------------------------------------

    def branch_state(self, namespace: str) -> Optional[tuple]:
        """The agent's branches as ((block ids), tokens, links, last used, generation), least recently
        used first (() when every branch was cut), or None if unknown; any thread."""
        with self.core.lock:
            agent = self.core.agents.get(namespace)
            return None if agent is None else tuple((tuple(br.block_ids), br.n_tokens, br.links, br.last_used,
                                                     br.generation) for br in agent.branches)

    def agent_version(self, namespace: str) -> tuple:
        """What `save_fetched` compares: when the agent was last erased, its branches (their last
        uses included: a lookup since changes it) and its removal records."""
        core = self.core
        with core.lock:
            agent = core.agents.get(namespace)
            removals = ((agent.removals, agent.spliced_cleared, agent.removed_floor, agent.forkable, agent.pinned,
                         tuple(sorted(agent.settings_at.items()))) if agent is not None else None)
            return core.erased.get(namespace, 0), self.branch_state(namespace), removals

    def holds(self, namespace: str, expect: tuple, remote: Copy, then: Callable[[], None],
              tokens: Optional[dict] = None) -> bool:
        """Whether the agent is still as `expect` and merging `remote` (a copy of its record in the
        fleet tier) would change nothing: it holds every branch of it as recently used, and every
        removal record. If so, `then()` runs under the lock (so no erasure comes between; it must
        not wait). `tokens`: block id -> tokens read ahead for removal records (`removal_blocks`).
        No I/O."""
        if not isinstance(remote, Copy):
            remote = Copy(tuple(remote))
        with self.core.lock:
            agent = self.core.agents.get(namespace)
            if agent is None or self.agent_version(namespace) != expect:
                return False
            branches, removals, cleared, settings = self._merge(agent, remote, {}, tokens or {})
            if (not same_branches(branches, agent.branches) or set(removals) != set(agent.removals)
                    or cleared != (agent.spliced_cleared, agent.removed_floor)
                    or settings != (values_of(agent), agent.settings_at)):
                return False
            then()
            return True

    def era_of(self, namespace: str) -> Optional[str]:
        """The erasure the agent's record follows (None: none, or unknown agent). No I/O."""
        with self.core.lock:
            agent = self.core.agents.get(namespace)
            return (agent.era or None) if agent is not None else None

    def republish(self, namespace: str, remote: Copy) -> bool:
        """Whether the agent's record holds removals or settings that `remote` (its copy in Redis,
        which the record holds: `holds`) lacks, a put of it that never reached Redis (a partition, a
        restart); if so its record is saved again, which publishes it. No I/O (the save is queued)."""
        core = self.core
        with core.lock:
            agent = core.agents.get(namespace)
            if agent is None or core.persister is None or not agent.branches and not agent.removals:
                return False
            if not record_ahead(agent, remote):
                return False
            core.save(agent, [], {}, [], list(agent.branches))
            return True

    def removal_blocks(self, namespace: str, remote: Copy) -> list[str]:
        """The blocks whose tokens the merge with `remote` needs to tell whether a branch grew a
        removed partial tail (chain.Removal.tail), that no fetched block nor memory holds: the fleet
        reads them from the local disk before it merges. Any thread, no I/O."""
        core = self.core
        with core.lock:
            agent = core.agents.get(namespace)
            removals = [r for r in (*(agent.removals if agent else ()), *remote.removals) if r.tail]
            if not removals:
                return []
            wanted = set()
            for br in [*(agent.branches if agent else ()), *remote.branches]:
                for r in removals:
                    i = r.index
                    if len(br.block_ids) > i and (br.block_ids[i - 1] if i else None) == r.prev:
                        block = core.table.blocks.get(br.block_ids[i])
                        if block is None or not block.tokens:
                            wanted.add(br.block_ids[i])
            return sorted(wanted)

    def save_fetched(self, namespace: str, fetched: Copy, blocks: list[BlockData], expect: tuple,
                     on_done: Callable, tokens: Optional[dict] = None) -> Optional[Future]:
        """Save a copy of the agent's record fetched from the fleet (`fetched`: its branches, least
        recently used first, and removal records; `blocks`: those the local disk lacks) merged with
        the agent's local record (see `_merge`), and once durable make it the agent's record with
        COLD blocks, provided the agent is still as `expect` (`agent_version` before the fetch: an
        erasure since, even of an agent unknown here, refuses it). `on_done(manifest or None)` runs
        on the persister thread, in order with every other write. None when the agent changed."""
        if not isinstance(fetched, Copy):  # a plain list of branches: a copy without removal records
            fetched = Copy(tuple(fetched))
        core = self.core
        with core.lock:  # commits queue their saves under the lock too: the order is the pool's
            if core.persister is None or self.agent_version(namespace) != expect:
                return None
            agent = core.agents.get(namespace)
            data = {d.block_id: d for d in blocks}
            record = Agent(namespace) if agent is None else agent
            merged = self._merge(record, fetched, data, tokens or {})
            branches, removals, (cleared, floor), (values, settings_at) = merged
            manifest = core.stamped(manifest_of(namespace, branches, values["pinned"], core.clock(),
                                                removals=removals, spliced_cleared=cleared, forkable=values["forkable"],
                                                settings_at=settings_at, removed_floor=floor))
            named = set(manifest.block_ids)
            blocks = [d for d in blocks if d.block_id in named]  # not those of branches merged away

            def on_durable() -> None:  # persister thread; on_done must not raise
                try:
                    adopted = self._adopt(namespace, merged, expect, manifest.era or "")
                except Exception:
                    log.exception("agent %r: registering its fetched history failed", namespace)
                    adopted = False
                on_done(manifest if adopted else None)

            return core.persister.save(manifest, blocks, [], on_durable)

    def drop_removed(self, namespace: str, remote: Copy, tokens: Optional[dict] = None) -> bool:
        """The merge with `remote` (the agent's record in Redis) could not be saved (the local disk
        failed): its removal records hold all the same. The local branches they remove (and spliced
        ones used before its `spliced_cleared`) leave memory now, as a local forget edit's do before
        its save, so that nothing removed is served; the disk keeps its record until the agent's next
        save, and the next sync applies them again. Whether any left. No I/O."""
        core = self.core
        with core.lock:
            agent = core.agents.get(namespace)
            if agent is None:
                return False

            def tokens_of(bid: str) -> Optional[Sequence[int]]:
                block = core.table.blocks.get(bid)
                return block.tokens if block is not None and block.tokens else (tokens or {}).get(bid)

            keep = surviving_removals(agent.branches, remote.removals, remote.spliced_cleared, tokens_of)
            if len(keep) == len(agent.branches):
                return False
            core.table.name(agent, keep)
            core.epoch += 1
            return True

    def _merge(self, agent: Agent, fetched: Copy, data: dict[str, BlockData], tokens: dict,
               ) -> tuple[list[Branch], tuple[Removal, ...], tuple[float, float], tuple[dict, dict]]:
        """(lock held) The agent's record merged with a fetched copy: branches by recency
        (chain.merge_branches: a branch another holds goes, the `branches` most recently used stay,
        from either side, honest and spliced apart), then every branch either side's removal records
        remove (chain.surviving_removals: removals win over every older copy). A partial tail
        another branch grew is recognised by the tokens at hand (`data`: fetched blocks; blocks in
        memory; `tokens`: read ahead from disk), never by a read. Settings: the latest set wins, a
        tie the more restrictive (record_settings.py)."""
        core = self.core

        def tokens_of(bid: str) -> Optional[Sequence[int]]:
            got = data.get(bid)
            if got is not None:
                return got.tokens
            block = core.table.blocks.get(bid)
            return block.tokens if block is not None and block.tokens else tokens.get(bid)

        branches = merge_branches(agent.branches, list(fetched.branches), self.max_branches,
                                  lambda c, b: core.chains.grew(c, b, tokens_of),
                                  continued=not self.bounded_windows)
        mine = Copy(tuple(agent.branches), agent.removals, agent.spliced_cleared, removed_floor=agent.removed_floor)
        branches, removals, cleared, floor = merge_records(branches, mine, fetched, MAX_REMOVALS,
                                                           core.clock() - self.removal_ttl_s, tokens_of)
        return branches, removals, (cleared, floor), merge_records_settings(agent, fetched)

    def _adopt(self, namespace: str, merged: tuple, expect: tuple, era: str) -> bool:
        """Give the agent its merged record, with COLD blocks (blocks still hot stay hot)."""
        branches, removals, (cleared, floor), (values, settings_at) = merged
        core = self.core
        with core.lock:
            if self.agent_version(namespace) != expect:
                return False  # a turn, an erasure or a cut since: the pool's own state stands
            agent = core.agents.get(namespace)
            if agent is None:
                agent = Agent(namespace)
                core.agents.add(agent)
            agent.removals, agent.spliced_cleared, agent.removed_floor = removals, cleared, floor
            agent.era = era
            agent.forkable, agent.settings_at = values["forkable"], dict(settings_at)
            if agent.pinned != values["pinned"]:  # the pin set on another server: the disk's index too
                agent.pinned = values["pinned"]
                if core.persister is not None:
                    core.persister.set_pinned(namespace, agent.pinned)
            core.table.name(agent, branches)
            core.touch(agent)
            core.epoch += 1
            return True
