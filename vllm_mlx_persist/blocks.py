"""The block table: every block the pool knows, who names it, who pays for its memory.

Owns `BlockTable.blocks`, `refs`, `orphans` and `hot_bytes`, and each `Agent`'s `branches`, `ids`
and `hot_bytes` (agents.py owns which agents exist). Invariants, checked by `check()`:
- `refs[b]` is the number of agents naming block b, and a block is in `blocks` iff it is named;
- a hot block's bytes are counted once: by its `owner`, an agent that names it, or as an orphan
  (named only by agents that did not bring it into memory); the owners' `hot_bytes` plus the
  orphans' bytes equal `hot_bytes`, which equals the hot blocks' bytes.
Threads: any, with the pool's lock held (pool.py); nothing here does I/O or waits.

A block holds `block_size` consecutive tokens (the last block of a branch may be a partial tail)
for all layers, as one name -> array map whose layout per layer kind is `caches.ModelCodec`'s. It is
PENDING (in memory, its write not yet durable), DURABLE (in memory and on disk) or COLD (on disk only).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from .chain import Branch, Removal


class BlockState(enum.Enum):
    PENDING = "pending"  # hot, write not yet durable
    DURABLE = "durable"  # hot and on disk
    COLD = "cold"  # on disk only


@dataclass(eq=False)  # a block is itself: never compared by its arrays
class Block:
    block_id: str
    tokens: tuple[int, ...]  # () while COLD and never read since the start
    layers: Optional[dict] = None  # name -> mx.array (see caches.codec); None while COLD
    state: BlockState = BlockState.COLD
    nbytes: int = 0  # bytes it keeps in memory; fixed when set (and see Run), so readers never sum arrays
    owner: Optional["Agent"] = None  # the agent whose hot_bytes count it (None: cold, or an orphan)
    run: Optional[tuple["Run", int]] = None  # (the Run its layers are views of, its first token in it)


@dataclass(eq=False)
class Run:
    """Consecutive blocks whose token arrays are slices of one array each: the blocks a lookup read
    from disk together (one MLX import per array), or a committed turn's (its cache's arrays). Every
    member's layers are views of `arrays`, so a lookup that uses the run from its start takes them
    whole (codec.build's `whole`) instead of concatenating.
    The arrays live while any member is hot: a dropped member's bytes move to a surviving member,
    so the hot budget always counts all of them."""

    arrays: dict
    members: list[Block]  # the hot ones, in chain order
    # A committed turn's float copies of its 4-bit layers (caches.floats.CarriedFloats), for the next
    # lookup that takes the run whole; bounded by their own budget, never counted in hot_bytes;
    # dropped when the run's first block leaves it (a lookup then never takes it whole).
    floats: Any = None


@dataclass(eq=False)
class Agent:
    """One agent's record: everything it owns, so that erasure, pins, budgets, the TTL, listing, the
    offline tools and the fleet act on all of it. Its branches are its honest histories and its
    spliced ones (`Branch.generation`); forks are links in branches, never other agents."""

    namespace: str  # the agent id (anonymous entries: a key no agent id can be)
    branches: list[Branch] = field(default_factory=list)  # least recently used first
    ids: dict = field(default_factory=dict)  # every block id its branches name, newest branch first
    hot_bytes: int = 0  # bytes of the hot blocks it owns (Block.owner)
    pinned: bool = False
    last_used: float = field(default_factory=time.time)
    persistent: bool = True  # anonymous entries live in memory only
    listed: bool = False  # in the agent registry (agents.Agents); counted in BlockTable.hot_agents
    forkable: Optional[bool] = None  # may others fork it (None: the server's fork_policy decides)
    removals: tuple[Removal, ...] = ()  # content forget edits removed (chain.Removal), newest last
    spliced_cleared: float = 0.0  # spliced branches used at or before this were dropped by a forget
    settings_at: dict = field(default_factory=dict)  # setting -> when it was set (record_settings.py)
    removed_floor: float = 0.0  # removal records compacted away removed what was written before it
    era: str = ""  # the fleet erasure its history follows ('' none): kept here, the tier's memory is bounded

    @property
    def block_ids(self) -> list[str]:
        """The most recently used honest branch's block ids."""
        honest = self.honest
        return honest[-1].block_ids if honest else []

    @property
    def n_tokens(self) -> int:
        honest = self.honest
        return honest[-1].n_tokens if honest else 0

    @property
    def honest(self) -> list[Branch]:
        """The branches every token of which was prefilled (not spliced), least recently used first."""
        return [br for br in self.branches if not br.spliced]


class BlockTable:
    """Blocks, their references and the bytes they hold in memory (see the module docstring)."""

    def __init__(self) -> None:
        self.blocks: dict[str, Block] = {}
        self.refs: dict[str, int] = {}  # block id -> how many agents name it
        self.shared = 0  # blocks named by more than one agent (forks)
        self.orphans: dict[str, None] = {}  # hot blocks no owner counts, least recently orphaned first
        self.hot_bytes = 0
        self.hot_agents = 0  # listed agents owning any hot block

    # ---- names ----------------------------------------------------------------------------------

    def name(self, agent: Agent, branches: list[Branch]) -> list[str]:
        """Give `agent` these branches, moving references; returns the ids of blocks no agent names
        any more (dropped from memory and from the table; their files go once no manifest names them)."""
        ids = dict.fromkeys(b for br in reversed(branches) for b in br.block_ids)
        dead = []
        for bid in ids:
            if bid not in agent.ids:
                self.refs[bid] = n = self.refs.get(bid, 0) + 1
                self.shared += n == 2
                self.blocks.setdefault(bid, Block(bid, ()))
        for bid in agent.ids:
            if bid in ids:
                continue
            block = self.blocks.get(bid)
            n = self.refs[bid] - 1
            self.shared -= n == 1
            if n == 0:
                del self.refs[bid]
                dead.append(bid)
                if block is not None:
                    self.set_layers(block, None)
                    del self.blocks[bid]
            else:
                self.refs[bid] = n
                if block is not None and block.owner is agent:
                    self.orphan(block)
        agent.branches, agent.ids = branches, ids
        return dead

    # ---- memory ---------------------------------------------------------------------------------

    def set_layers(self, block: Block, layers: Optional[dict], owner: Optional[Agent] = None,
                   run: Optional[tuple[Run, int]] = None) -> None:
        """Bring a block's arrays into memory, counted by `owner` (an agent naming it; None: an
        orphan), or drop them (None)."""
        if owner is not None and block.block_id not in owner.ids:
            owner = None  # only an agent naming the block may count it (check() reports the caller)
        before, left = block.nbytes, block.run
        # what stays allocated when it leaves its run: its views of the run's arrays and what it
        # inherited (its own arrays, such as checkpoints or a sliding window's, are freed with it)
        viewed = before - sum(a.nbytes for n, a in block.layers.items() if n not in left[0].arrays) if left else 0
        if block.owner is not None:
            self._charge(block.owner, -before)
        elif block.layers is not None:
            self.orphans.pop(block.block_id, None)
        self.hot_bytes -= before
        block.layers, block.run = layers, run
        block.nbytes = 0 if layers is None else sum(a.nbytes for a in layers.values())
        self.hot_bytes += block.nbytes
        block.owner = owner if layers is not None else None
        if block.owner is not None:
            self._charge(block.owner, block.nbytes)
        elif layers is not None:
            self.orphans[block.block_id] = None
        if left is not None:  # its views no longer hold the run's arrays, the other members' still do
            left[0].members = [b for b in left[0].members if b is not block]
            if left[1] == 0:  # no lookup can take the run whole from its start again: its floats go now
                left[0].floats = None
            if left[0].members and viewed:
                heir = left[0].members[0]
                heir.nbytes += viewed
                self.hot_bytes += viewed
                if heir.owner is not None:
                    self._charge(heir.owner, viewed)

    def shed(self, block: Block, names: set[str], extra: Optional[dict] = None) -> None:
        """Drop some of a hot block's arrays from memory (`names`, never part of its Run) and add
        `extra` small ones: its bytes, its owner's and the table's shrink by what left."""
        gone = sum(a.nbytes for n, a in block.layers.items() if n in names)
        layers = {n: a for n, a in block.layers.items() if n not in names}
        layers.update(extra or {})
        delta = sum(a.nbytes for a in (extra or {}).values()) - gone
        block.layers, block.nbytes = layers, block.nbytes + delta
        self.hot_bytes += delta
        if block.owner is not None:
            self._charge(block.owner, delta)

    def drop(self, block: Block) -> None:
        """Out of memory: a DURABLE block goes COLD (callers handle PENDING ones first)."""
        self.set_layers(block, None)
        block.state = BlockState.COLD

    def orphan(self, block: Block) -> None:
        """The block's owner no longer names it (or leaves), but another agent does: still hot,
        counted by none."""
        if block.owner is not None:
            self._charge(block.owner, -block.nbytes)
        block.owner = None
        if block.layers is not None:
            self.orphans[block.block_id] = None

    def adopt(self, agent: Agent, block: Block) -> None:
        """An orphan used by `agent`, which names it, is counted by it from now on."""
        if block.layers is not None and block.owner is None and block.block_id in agent.ids:
            self.orphans.pop(block.block_id, None)
            block.owner = agent
            self._charge(agent, block.nbytes)

    def list(self, agent: Agent, listed: bool) -> None:
        """The agent enters (or leaves) the registry: `hot_agents` counts listed agents only."""
        if agent.listed != listed and agent.persistent:
            self.hot_agents += (1 if listed else -1) * (agent.hot_bytes > 0)
        agent.listed = listed

    def _charge(self, agent: Agent, delta: int) -> None:
        before = agent.hot_bytes
        agent.hot_bytes += delta
        if agent.listed and agent.persistent:
            self.hot_agents += (agent.hot_bytes > 0) - (before > 0)

    # ---- checks ---------------------------------------------------------------------------------

    def check(self, agents: list[Agent]) -> list[str]:
        """What breaks the invariants (the module docstring) for these agents (every agent that
        names blocks); [] when they hold. O(blocks): tests and the state machine only."""
        bad = []
        names: dict[str, int] = {}
        for a in agents:
            for bid in a.ids:
                names[bid] = names.get(bid, 0) + 1
        if names != self.refs:
            bad.append(f"refs {len(self.refs)} differ from the agents' names {len(names)}")
        if set(self.blocks) != set(names):
            bad.append(f"{len(set(self.blocks) ^ set(names))} blocks in the table but unnamed, or named but absent")
        hot = sum(b.nbytes for b in self.blocks.values())
        owned = sum(a.hot_bytes for a in agents)
        orphaned = sum(self.blocks[b].nbytes for b in self.orphans if b in self.blocks)
        if not hot == self.hot_bytes == owned + orphaned:
            bad.append(f"hot bytes: blocks {hot}, table {self.hot_bytes}, owners {owned} + orphans {orphaned}")
        for a in agents:
            mine = sum(b.nbytes for b in self.blocks.values() if b.owner is a)
            if mine != a.hot_bytes:
                bad.append(f"agent {a.namespace!r} counts {a.hot_bytes} hot bytes, owns {mine}")
        for b in self.blocks.values():
            if b.owner is not None and b.block_id not in b.owner.ids:
                bad.append(f"block {b.block_id[:12]} owned by {b.owner.namespace!r}, which does not name it")
            if b.layers is None and (b.nbytes or b.owner is not None or b.state != BlockState.COLD):
                bad.append(f"block {b.block_id[:12]} is out of memory but counted, owned or not COLD")
            if b.layers is not None and b.state == BlockState.COLD:
                bad.append(f"block {b.block_id[:12]} is COLD with layers in memory")
        return bad
