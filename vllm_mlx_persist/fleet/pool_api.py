"""What the fleet needs of the pool, and all it may touch: `FleetPool`, implemented by
pool.BlockPool. The fleet never reaches into the pool's parts (its chains, disk store, persister or
codec); what it needs of them is asked here. Every member may be called from any thread (the
fleet's sync threads, the tier's writer thread, the persister thread); none waits on I/O while it
holds the pool's lock."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Callable, Optional, Protocol

from ..chain import Branch, Copy
from ..disk_format import BlockData, Manifest


class FleetPool(Protocol):
    # ---- what the pool is -----------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        """Tokens per block (where a fetched branch is cut)."""

    @property
    def max_branches(self) -> int:
        """Branches kept per agent (a merge keeps as many; a sync fetches at most as many)."""

    @property
    def bounded_windows(self) -> bool:
        """Whether the model has bounded sliding-window layers (then a merge keeps continued branches:
        chain.merge_branches)."""

    @property
    def fleet_dir(self) -> Path:
        """The model's directory on the local disk: the fleet's pending removals live under it (outbox.py)."""

    @property
    def disk_queue_bytes(self) -> Optional[int]:
        """The local disk tier's write queue, in bytes (a sync's default fetch budget); None: no disk tier."""

    # ---- the local disk: blocks a put lacks, blocks a sync need not fetch -------------------------------

    def has_disk_block(self, block_id: str) -> bool:
        """Whether the local disk holds the block's file (not verified: a read does that)."""

    def read_record(self, namespace: str) -> Optional[Manifest]:
        """The agent's manifest on the local disk (its durable record: what a forget's pending publish
        sends), verified; None when absent or bad."""

    def read_disk_block(self, block_id: str) -> Optional[BlockData]:
        """The block from the local disk, verified; None when absent or bad."""

    def chain_prefix(self, branch: Branch, fetched: dict[str, BlockData]) -> tuple[int, bool]:
        """How many leading blocks of a fetched `branch` follow its id chain (`fetched` checked here,
        the local disk's as every disk block is), and whether the first that does not was refused
        rather than missing (chain.Chains.prefix)."""

    # ---- an agent's history: compared, adopted, erased ---------------------------------------------------

    def agent_version(self, namespace: str) -> tuple:
        """What save_fetched compares: the agent's last erasure here, its branches (last uses
        included) and its removal records."""

    def era_of(self, namespace: str) -> Optional[str]:
        """The erasure the agent's record follows (None: none, or unknown agent). No I/O."""

    def removal_blocks(self, namespace: str, remote: Copy) -> list[str]:
        """The local blocks whose tokens a merge with `remote` needs and memory does not hold (to
        tell a grown partial tail a removal record names): the fleet reads them from the local disk
        before it asks `holds` or `save_fetched`."""

    def holds(self, namespace: str, expect: tuple, remote: Copy, then: Callable[[], None],
              tokens: Optional[dict] = None) -> bool:
        """Whether the agent is still as `expect` and merging `remote` (its record in Redis) would
        change nothing; if so `then()` runs under the pool's lock. `tokens`: read ahead
        (removal_blocks)."""

    def republish(self, namespace: str, remote: Copy) -> bool:
        """If the agent's record holds removals or settings its copy in Redis (`remote`) lacks, save it
        again (which publishes it); whether it did. No I/O."""

    def save_fetched(self, namespace: str, fetched: Copy, blocks: list[BlockData], expect: tuple,
                     on_done: Callable[[Optional[Manifest]], None], tokens: Optional[dict] = None,
                     ) -> Optional[Future]:
        """Save a fetched record merged with the local one (removals win: chain.surviving_removals);
        once durable the agent's record (`on_done(manifest or None)` on the persister thread). None
        when the agent changed."""

    def drop_removed(self, namespace: str, remote: Copy, tokens: Optional[dict] = None) -> bool:
        """The merge with `remote` could not be saved: the local branches its removal records remove
        leave memory all the same (nothing removed is served); whether any left. No I/O."""

    def erase(self, namespace: str, timeout: Optional[float] = 60.0, fleet_wide: bool = True) -> bool:
        """Erase the agent here (memory and disk; `fleet_wide=False`: not in Redis again)."""

    def prefetch(self, namespace: str) -> int:
        """Start reading the agent's cold blocks from the local disk."""
