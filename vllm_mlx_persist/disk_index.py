"""The persister's index of the disk: what it holds (agents, block sizes, how many manifests name each
block, other models' directories) and what holds it (queued saves, requests in flight), counted as
files come and go, so disk usage and stats are counters, never a directory walk. No I/O; not
thread-safe by itself: the persister's lock guards it (methods are called with it held)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from .disk_format import BlockData, Manifest, encode_manifest


@dataclass
class DiskAgent:
    """What the disk holds for one agent: enough to pick budget victims without reading files."""

    block_ids: list[str]
    last_used: float
    pinned: bool = False
    n_tokens: int = 0
    manifest_bytes: int = 0  # its manifest file's size (a few hundred bytes plus ~65 per block id)


class DiskIndex:
    def __init__(self) -> None:
        self.agents: "OrderedDict[str, DiskAgent]" = OrderedDict()  # least recently used first
        self.block_sizes: dict[str, int] = {}
        self.block_bytes = 0  # sum of block_sizes, kept as it changes
        self.block_refs: dict[str, int] = {}  # how many manifests on disk name each block
        self.saved_order: dict[str, int] = {}  # per agent: submission order of its manifest on disk
        self.manifest_bytes = 0  # sum of the agents' manifest sizes (a fixed 1 kB each undercounted a
        # branching agent's ~10 kB: a disk of small blocks then passed its budget)
        self.other_dirs: list = []  # other models' directories under the root, oldest first
        self.other_bytes = 0
        self.live: dict[str, int] = {}  # agents with requests in flight: never erased by the budget
        # What queued (or retrying) saves will name once written: never erased meanwhile.
        self.queued_agents: dict[str, int] = {}
        self.queued_refs: dict[str, int] = {}
        self.fresh: dict[str, int] = {}  # blocks whose data a save not yet failed carries (see `saving`)

    # ---- what the disk holds ----------------------------------------------------------------------

    def index(self, m: Manifest, nbytes: Optional[int] = None) -> list[str]:
        """Record `m` as the agent's manifest on disk, `nbytes` long (default: its encoding's length);
        returns the block ids it replaced."""
        nbytes = len(encode_manifest(m)) if nbytes is None else nbytes
        old = self.agents.pop(m.namespace, None)
        for b in m.block_ids:
            self.block_refs[b] = self.block_refs.get(b, 0) + 1
        self.manifest_bytes += nbytes - (old.manifest_bytes if old else 0)
        for b in old.block_ids if old else ():
            self.unref(b)
        last_used = max(m.updated_at, old.last_used if old else 0.0)
        self.agents[m.namespace] = DiskAgent(list(m.block_ids), last_used, m.pinned, m.n_tokens, nbytes)
        return old.block_ids if old else []

    def resize_manifest(self, namespace: str, nbytes: int) -> None:
        """The agent's manifest was rewritten in place (a pin), now `nbytes` long."""
        agent = self.agents.get(namespace)
        if agent is not None:
            self.manifest_bytes += nbytes - agent.manifest_bytes
            agent.manifest_bytes = nbytes

    def forget(self, namespace: str) -> tuple[Optional[DiskAgent], list[str]]:
        """The agent leaves the index: (what it was, None if unknown; its blocks no manifest or
        queued save names any more, whose sizes leave it too)."""
        agent = self.agents.pop(namespace, None)
        self.saved_order.pop(namespace, None)
        ids = agent.block_ids if agent is not None else []
        for b in ids:
            self.unref(b)
        gone = [b for b in ids if not self.named(b)]  # another agent's queued save may name it
        for b in gone:
            self.drop_size(b)
        if agent is not None:
            self.manifest_bytes -= agent.manifest_bytes
        return agent, gone

    def unref(self, bid: str) -> None:
        n = self.block_refs.get(bid, 0) - 1
        if n > 0:
            self.block_refs[bid] = n
        else:
            self.block_refs.pop(bid, None)

    def set_size(self, bid: str, n: int) -> None:
        self.block_bytes += n - self.block_sizes.get(bid, 0)
        self.block_sizes[bid] = n

    def drop_size(self, bid: str) -> None:
        self.block_bytes -= self.block_sizes.pop(bid, 0)

    def disk_bytes(self, quarantine_bytes: int) -> int:
        return self.block_bytes + self.manifest_bytes + self.other_bytes + quarantine_bytes

    def block_size_of(self, bid: str) -> int:
        """A block file's size from the index; for one not indexed (yet), the mean indexed size
        (64 KiB when none is)."""
        n = self.block_sizes.get(bid)
        if n is not None:
            return n
        return self.block_bytes // len(self.block_sizes) if self.block_sizes else 64 << 10

    def agent_disk_bytes(self, namespace: str) -> int:
        a = self.agents.get(namespace)
        return 0 if a is None else sum(self.block_sizes.get(b, 0) for b in a.block_ids)

    def touch(self, namespace: str, now: float) -> None:
        agent = self.agents.get(namespace)
        if agent is not None:
            agent.last_used = now
            self.agents.move_to_end(namespace)

    # ---- what holds it ------------------------------------------------------------------------------

    def hold(self, manifest: Manifest, delta: int) -> None:
        """Count (or release) a queued save's agent and the blocks its manifest names."""
        for d, key in ((self.queued_agents, manifest.namespace), *((self.queued_refs, b) for b in manifest.block_ids)):
            n = d.get(key, 0) + delta
            if n > 0:
                d[key] = n
            else:
                d.pop(key, None)

    def freshen(self, blocks: list[BlockData], delta: int) -> None:
        """Count (or release) the blocks a save carries while it has not failed."""
        for b in blocks:
            n = self.fresh.get(b.block_id, 0) + delta
            if n > 0:
                self.fresh[b.block_id] = n
            else:
                self.fresh.pop(b.block_id, None)

    def named(self, bid: str) -> bool:
        """Whether a manifest on disk or a queued save names the block."""
        return bid in self.block_refs or bid in self.queued_refs

    def begin_use(self, namespace: str) -> None:
        self.live[namespace] = self.live.get(namespace, 0) + 1

    def end_use(self, namespace: str) -> None:
        n = self.live.get(namespace, 0) - 1
        if n > 0:
            self.live[namespace] = n
        else:
            self.live.pop(namespace, None)

    # ---- which agents may go ------------------------------------------------------------------------

    def budget_victim(self) -> Optional[str]:
        """The least recently used agent the budget may erase: not pinned, no request in flight, no
        save queued; None when none is left."""
        busy = self.live.keys() | self.queued_agents.keys()
        return next((ns for ns, a in self.agents.items() if ns not in busy and not a.pinned), None)

    def expired(self, cutoff: float) -> list[str]:
        """Agents last used before `cutoff` that the TTL may erase (the same exemptions)."""
        return [ns for ns, a in self.agents.items() if a.last_used < cutoff and not a.pinned
                and ns not in self.live and ns not in self.queued_agents]
