"""What the pool's parts share: its one lock, the block table, the agents, the writer, the counters,
and the few acts every part needs (an agent dropped from memory, a record's manifest queued, the hot
budget enforced).

`PoolCore` owns the requests in flight (`inflight`), the epoch, the erasure marks (`erased`) and the
hot budget; the parts (pool.BlockPool: lookups, commits, memory; records.Records: agents as units;
kv_edit/forget.Forgets: forget edits; fleet_view.FleetView: the pool as the fleet sees it) hold the
core and act on it under `lock`, held for bookkeeping only: never across I/O, a wait or MLX work.
Threads: any, with `lock` held where a method says so.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx

from .agents import Agents
from .blocks import Agent, Block, BlockState, BlockTable
from .caches import ModelCodec
from .caches.codec import WIN_FROM
from .chain import Branch, Chains, cut_branch, manifest_of
from .disk_format import BlockData, Manifest
from .persister import Persister
from .reads import Reads

log = logging.getLogger("vllm_mlx_persist.pool")

MAX_ERASED = 1 << 16  # erasures remembered for fleet syncs in flight (a sync takes seconds)

STATS = ("hits_hot", "hits_disk", "misses", "tokens_reused", "tokens_stored", "blocks_loaded", "bytes_loaded",
         "evicted_agents", "write_errors", "bad_blocks", "unsaved_blocks_dropped", "store_refused", "read_timeouts",
         "fork_hits", "tokens_from_parent", "branches_evicted", "text_matches", "tokens_matched_by_text",
         "commit_replans", "kv_edit_forgets", "kv_edit_amortizes", "kv_edit_splices", "branches_superseded",
         "forks_refused_at_lookup")


class PoolCore:
    """The pool's shared state and primitives (see the module docstring)."""

    def __init__(self, *, chains: Chains, codec: ModelCodec, table: BlockTable, agents: Agents,
                 persister: Optional[Persister], reads: Optional[Reads], stats: dict, hot_budget: int,
                 clock: Callable[[], float] = time.time):
        self.lock = threading.RLock()
        self.chains, self.codec, self.table, self.agents = chains, codec, table, agents
        self.persister, self.reads, self.stats, self.clock = persister, reads, stats, clock
        self.block_size = chains.block_size
        self.hot_budget = hot_budget
        # request id -> [agent, erased while in flight, tokens reused, epoch and clock at its lookup]
        self.inflight: dict[str, list] = {}
        # Bumped whenever another thread than the worker changes agents (erasure, fleet adoption): a
        # commit planned before it is planned again.
        self.epoch = 0
        # The epoch at each agent's last erasure (the most recent MAX_ERASED): a fleet sync that read
        # the agent before it is refused, even when the agent was unknown here (agent_version).
        self.erased: "OrderedDict[str, int]" = OrderedDict()
        self.fleet: Any = None  # fleet.Fleet, once the pool has built it

    # ---- an agent leaves memory -------------------------------------------------------------------

    def forget(self, namespace: str) -> bool:
        """(lock held) Drop an agent from memory; the epoch moves on even for an unknown one (a
        fleet sync of it that started before must not bring it back)."""
        self.epoch += 1
        self.erased[namespace] = self.epoch
        self.erased.move_to_end(namespace)
        if len(self.erased) > MAX_ERASED:
            self.erased.popitem(last=False)
        if self.fleet is not None:
            self.fleet.released(namespace)  # this server holds no history of it in Redis any more
        agent = self.agents.get(namespace)
        if agent is None:
            return False
        self.agents.drop(agent)
        return True

    def forgotten(self, namespace: str) -> None:
        """The persister erased an agent (disk budget, TTL, or an erasure): persister thread."""
        with self.lock:
            self.forget(namespace)

    # ---- a record saved ---------------------------------------------------------------------------

    def manifest(self, agent: Agent, branches: Optional[list[Branch]] = None, now: Optional[float] = None) -> Manifest:
        """(lock held) The agent's record as a manifest (chain.manifest_of): its branches (or
        `branches`), pin, fork setting and removal records, with the erasure its history follows."""
        m = manifest_of(agent.namespace, agent.branches if branches is None else branches, agent.pinned, now,
                        removals=agent.removals, spliced_cleared=agent.spliced_cleared, forkable=agent.forkable,
                        settings_at=agent.settings_at, removed_floor=agent.removed_floor)
        return self.stamped(m)

    def stamped(self, manifest: Manifest) -> Manifest:
        """(lock held) With a fleet tier: the manifest with the erasure its history follows (docs/fleet.md,
        Erasure). The agent's record keeps it too: the tier's memory of agents is bounded, and an era
        it forgot is told back from the record (else its own copy would read as from before it)."""
        if self.fleet is not None:
            agent = self.agents.get(manifest.namespace)
            era = self.fleet.era(manifest.namespace)
            if not era and agent is not None and agent.era:
                self.fleet.loaded_era(manifest.namespace, agent.era)
                era = agent.era
            manifest.era = era or None
            if agent is not None:
                agent.era = era or ""
        return manifest

    def save(self, agent: Agent, blocks: list[Block], datas: dict[str, BlockData], dead: list[str],
             before: list[Branch]) -> Future:
        """(lock held) Queue the agent's manifest after the blocks it names that are not durable yet
        (`blocks`, with their numpy copies in `datas`; `before`: its branches before the turn, what
        the fleet tier's put continues). The manifest is dated by the turn's branch's last use, which
        is what a plain manifest's branch reads back. A branch naming an unsaved block that neither
        `blocks` nor a queued save carries (an earlier turn's failed save) is cut before it in the
        manifest, which never names a block that may not reach the disk; memory keeps it, and the
        agent's next turn writes it."""
        carried = {b.block_id for b in blocks}

        def on_disk(bid: str) -> bool:
            block = self.table.blocks.get(bid)
            return (block is None or block.state != BlockState.PENDING or bid in carried
                    or self.persister.saving(bid))

        branches = [br for br in (_cut_at(br, on_disk, self.block_size) for br in agent.branches) if br.block_ids]
        manifest = self.manifest(agent, branches, agent.branches[-1].last_used if agent.branches else self.clock())
        base = manifest_of(agent.namespace, before, agent.pinned) if before else None
        data = [datas[b.block_id] for b in blocks]
        stats = self.stats

        def on_durable() -> None:  # persister thread
            with self.lock:
                for b in blocks:
                    if b.state == BlockState.PENDING and self.table.blocks.get(b.block_id) is b:
                        b.state = BlockState.DURABLE
            if self.fleet is not None:
                self.fleet.saved(manifest, data, base)

        def count_failure(f: Future) -> None:
            if f.cancelled() or f.exception() is not None or not f.result():
                stats["write_errors"] += 1

        future = self.persister.save(manifest, data, dead, on_durable)
        future.add_done_callback(count_failure)
        return future

    def drop_remote(self, dead: list[str], saved: Optional[Future]) -> None:
        """With a fleet tier: once the save that stops naming `dead` is durable (its put then queued),
        delete those blocks from Redis too."""
        if self.fleet is not None and dead and saved is not None:
            fleet = self.fleet
            saved.add_done_callback(
                lambda f: fleet.superseded(dead) if not f.cancelled() and f.exception() is None and f.result() else None)

    # ---- memory -----------------------------------------------------------------------------------

    def touch(self, agent: Agent) -> None:
        self.agents.touch(agent)
        if agent.persistent and self.persister is not None:
            self.persister.touch(agent.namespace)

    def enforce_budget(self, keep: Sequence[str] = ()) -> None:
        """(lock held) Restored-but-unused blocks go first, least recent first; then agents leave
        memory (agents.enforce) until the hot tier fits `hot_budget`. `keep`: the request's agents."""
        if self.reads is not None:
            over = self.table.hot_bytes + self.reads.restored_bytes - self.hot_budget
            if over > 0:
                self.reads.shrink_restored(over)
        self.agents.enforce(self.hot_budget, keep, durable=self.persister is not None)

    def trim_windows(self, owners: Sequence[Agent]) -> None:
        """(lock held) Bounded sliding-window layers: the hot blocks these agents count keep their
        sliding arrays only where the window before an agent's most recent branch end needs them
        (every agent's: forks share blocks), so memory holds about one window per agent; the disk
        keeps every turn's window, and a request resuming elsewhere reads it back (Lookup.fill_windows)."""
        names = self.codec.window_names()
        if not names:
            return
        w, bs = max(self.codec.windows.values()), self.block_size
        keep = set()
        for a in self.agents.all():
            if a.branches:
                br = a.branches[-1]
                keep.update(br.block_ids[max(0, br.n_tokens - w) // bs:])
        for agent in owners:
            for bid in agent.ids:
                block = self.table.blocks[bid]
                if (block.owner is agent and block.layers is not None and bid not in keep
                        and names & block.layers.keys()):
                    self.table.shed(block, names | {WIN_FROM},
                                    {WIN_FROM: mx.array([len(block.tokens)], dtype=mx.int32)})


def _cut_at(branch: Branch, keep: Callable[[str], bool], block_size: int) -> Branch:
    """`branch` up to its first block `keep` refuses."""
    for i, bid in enumerate(branch.block_ids):
        if not keep(bid):
            return cut_branch(branch, i, block_size)
    return branch
