"""Per-agent pool of 4-bit KV blocks: the public face of the pool's parts.

The parts, each owning its state (see their docstrings):
    chain.py        block ids, branches, manifests <-> branches, removal records   pure
    blocks.py       the block table: blocks, references, hot bytes; the agent record   under the lock
    agents.py       the agent registry, the anonymous LRU, hot budget               under the lock
    pool_core.py    the lock, requests in flight, epoch, erasure marks; saves        under the lock
    reads.py        reads ahead of the worker, the hot-set restore                  its own lock
    lookup.py       a prompt's longest reusable prefix                               worker
    commit.py       a finished turn becomes the agent's newest branch               worker
    records.py      agents as units: load, erase, pin, forks, the admin views      admin threads
    kv_edit/forget.py   forget edits: what they remove from a record, and when       under the lock
    fleet_view.py   the pool as the fleet sees it (fleet.FleetPool)                  fleet threads
This module composes them with the persister (the disk tier's one writer) and, when configured, the
fleet tier, and does lookups, commits and the hot tier's memory.

The lock is held for in-memory bookkeeping only: never across I/O, a wait or MLX work (lookups and
commits release it for those). Who calls what:
- vllm-mlx's worker thread (MLX): match/lookup, commit, load_manifests, clear;
- the event loop: prefetch, pending_reads (short, never behind a disk);
- admin API threads: agent_info, list_agents, erase, set_pinned, set_forkable (records.py: erase,
  pin and fork settings wait for the disk with the lock released); the namespace hook: may_fork
  (with a fleet tier, a bounded read of the parent's settings in Redis, the lock released);
- the persister thread: erasures by the disk budget and TTL, saves becoming durable, fetched
  histories adopted;
- fleet threads: what fleet.FleetPool lists (`fleet_view`).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Optional, Sequence

from .agents import ANON_PREFIX, Agents
from .blocks import Agent, Block, BlockState, BlockTable
from .caches import ModelCodec
from .caches.kinds import Q4
from .chain import Branch, Chains
from .commit import Commit
from .fleet_view import FleetView
from .kv_edit import AMORTIZE, FORGET
from .kv_edit.forget import Forgets
from .kv_edit.rotations import Segments
from .lookup import Found, Lookup, Match, whole_run
from .persister import Persister
from .pool_core import STATS, PoolCore
from .reads import Reads
from .records import Records
from .store import DiskStore

log = logging.getLogger("vllm_mlx_persist.pool")

READ_TIMEOUT_S = 30.0  # a block read slower than this (a hung disk) is a miss, not a hung worker
COMMIT_ATTEMPTS = 3  # a commit planned again when another thread changed what its plan relied on
MIN_READ_AHEAD_BYTES = 64 << 20

__all__ = ["ANON_PREFIX", "READ_TIMEOUT_S", "Agent", "Block", "BlockPool", "BlockState", "Branch", "Match"]


class BlockPool:
    """Blocks and agents, with an LRU hot tier bounded in bytes and an optional disk tier."""

    def __init__(
        self,
        *,
        fingerprint: str,
        n_layers: int,
        bits: int,
        group_size: int,
        block_size: int,
        hot_bytes: int,
        store: Optional[DiskStore] = None,
        disk_budget: int = 1 << 62,
        persister_options: Optional[dict] = None,
        durable_writes: bool = True,
        write_timeout_s: float = 30.0,
        max_anonymous: int = 32,
        codec: Optional[ModelCodec] = None,
        branches: int = 4,
        decode: Optional[Callable[[list[int]], str]] = None,
        read_ahead_bytes: Optional[int] = None,
        fleet: Optional[Callable[[FleetView], Any]] = None,
        clock: Callable[[], float] = time.time,
        removal_ttl_s: float = 30 * 86400.0,
        fork_policy: str = "open",
    ):
        """`store`: the disk tier (None: memory only), written by a Persister built here with
        `disk_budget` and `persister_options`. `fleet`: builds the fleet tier's glue (fleet.Fleet)
        over the pool as the fleet sees it (`fleet_view`), or None. `read_ahead_bytes`: read results
        waiting for their lookup, at most (default: a quarter of the hot budget, at least 64 MB).
        `clock`: wall-clock time of manifests, last uses and the TTL (a test may move it on).
        `removal_ttl_s`: how long a record keeps a forget's removal records (kv_edit/forget.py).
        `fork_policy`: which agents may be forked (records.Records)."""
        self.clock = clock
        self.fingerprint = fingerprint
        self.n_layers = n_layers
        # Default: every layer plain 4-bit attention (the pool's unit tests build it like that).
        self.codec = codec or ModelCodec([Q4] * n_layers, bits, group_size)
        self.bits, self.group_size, self.block_size = bits, group_size, block_size
        self.durable_writes = durable_writes
        self.write_timeout_s = write_timeout_s
        self.stats = dict.fromkeys(STATS, 0)
        self.store = store
        self.chains = Chains(fingerprint, block_size)
        self.table = BlockTable()
        self.persister = (Persister(store, disk_budget=disk_budget, on_erased=lambda ns: self.core.forgotten(ns),
                                    clock=clock, **(persister_options or {})) if store is not None else None)
        self.reads = (Reads(store, read_ahead_bytes if read_ahead_bytes is not None
                            else max(MIN_READ_AHEAD_BYTES, hot_bytes // 4), self._block_bytes, self.stats)
                      if store is not None else None)
        self.agents = Agents(self.table, block_size, max_anonymous, self.stats,
                             on_drop=self.reads.cancel if self.reads is not None else (lambda ids: None),
                             clock=clock, saving=self.persister.saving if self.persister is not None else (lambda b: False))
        self.core = PoolCore(chains=self.chains, codec=self.codec, table=self.table, agents=self.agents,
                             persister=self.persister, reads=self.reads, stats=self.stats, hot_budget=hot_bytes,
                             clock=clock)
        self.lookup_ = Lookup(self.core.lock, self.chains, self.table, self.agents, self.reads, self.codec,
                              self.stats, READ_TIMEOUT_S, decode, self._quarantine)
        self.committer = Commit(self.chains, self.table, self.agents, self.codec, self.persister, self.stats,
                                max(1, int(branches)), self.core.save)
        self.records = Records(self.core, lambda: self.max_branches, fork_policy)
        self.forgets = Forgets(self.core, removal_ttl_s)
        self.fleet_view = (FleetView(self.core, store, lambda: self.max_branches, self.prefetch, self.records.erase,
                                     removal_ttl_s) if store is not None else None)
        self.fleet = self.core.fleet = fleet(self.fleet_view) if fleet is not None and store is not None else None

    # ---- views for tests, tools and the admin API ---------------------------------------------------

    @property
    def max_branches(self) -> int:
        """Diverging continuations kept per agent (the commit's)."""
        return self.committer.max_branches

    @max_branches.setter
    def max_branches(self, n: int) -> None:
        self.committer.max_branches = max(1, int(n))

    @property
    def decode(self) -> Optional[Callable[[list[int]], str]]:
        """Token ids -> text (the lookup's): enables matching across re-tokenization."""
        return self.lookup_.decode

    @decode.setter
    def decode(self, fn: Optional[Callable[[list[int]], str]]) -> None:
        self.lookup_.decode = fn

    @property
    def hot_budget(self) -> int:
        return self.core.hot_budget

    @property
    def blocks(self) -> dict[str, Block]:
        return self.table.blocks

    @property
    def refs(self) -> dict[str, int]:
        return self.table.refs

    @property
    def hot_bytes(self) -> int:
        return self.table.hot_bytes

    def agent(self, namespace: str) -> Optional[Agent]:
        return self.agents.get(namespace)

    def check(self) -> list[str]:
        """What breaks the block table's invariants (blocks.BlockTable.check); [] when they hold.
        Tests and the state machine: O(blocks)."""
        with self.core.lock:
            return self.table.check(self.agents.all())

    # The agent as a unit (records.py), here for the admin API, the backend and the tests.
    def load_manifests(self) -> int:
        """Register every agent found on disk (records.Records.load); returns how many."""
        return self.records.load()

    def agent_info(self, namespace: str) -> Optional[dict]:
        return self.records.agent_info(namespace)

    def list_agents(self, limit: int, after: Optional[str] = None) -> tuple[list[dict], bool]:
        return self.records.list_agents(limit, after)

    def erase(self, namespace: str, timeout: Optional[float] = 60.0, fleet_wide: bool = True) -> bool:
        return self.records.erase(namespace, timeout, fleet_wide)

    def set_pinned(self, namespace: str, pinned: bool, timeout: Optional[float] = 60.0) -> bool:
        return self.records.set_pinned(namespace, pinned, timeout)

    def may_fork(self, parent: str) -> bool:
        """Whether a request may fork `parent` (records.Records.may_fork). With a fleet tier, the
        parent's settings in Redis count too: read here, within the fleet's bound, with the lock
        released (Fleet.settings_of); Redis not answering, the local record answers alone."""
        remote = None
        if self.fleet is not None and self.records.fork_policy != "none":
            remote = self.fleet.settings_of(parent)
        return self.records.may_fork(parent, remote)

    def set_forkable(self, namespace: str, forkable: Optional[bool], timeout: Optional[float] = 60.0) -> bool:
        return self.records.set_forkable(namespace, forkable, timeout)

    # ---- start-up -------------------------------------------------------------------------------

    def restore_hot_set(self) -> Optional[Future]:
        """After a restart, read the most recently used agents' blocks, in the order they were last
        used, up to `hot_budget` bytes, on the restore thread (numpy only): their first turns then
        find them in memory instead of on disk. Returns at once (the restore's future, for tests)."""
        if self.reads is None or self.core.hot_budget <= 0:
            return None
        with self.core.lock:
            plan = [bid for a in reversed(self.agents.registry.values()) for bid in a.ids
                    if bid in self.table.blocks and self.table.blocks[bid].layers is None]
        return self.reads.restore(list(dict.fromkeys(plan)),
                                  room=lambda: self.core.hot_budget - self.table.hot_bytes - self.reads.restored_bytes,
                                  idle=lambda: not self.core.inflight, wanted=self._cold)

    def _cold(self, bid: str) -> bool:
        """Whether a block is named and out of memory; any thread, no lock (one dict read)."""
        block = self.table.blocks.get(bid)
        return block is not None and block.layers is None

    def prefetch(self, namespace: str) -> int:
        """Start reading `namespace`'s cold blocks on the reader threads (at most the read-ahead
        budget's bytes); returns how many. Called from the event loop as a request arrives, so the
        disk read overlaps the decode steps the worker runs before it gets to this request's lookup."""
        if self.reads is None:
            return 0
        with self.core.lock:
            agent = self.agents.get(namespace)
            cold = [bid for bid in agent.ids if self.table.blocks[bid].layers is None] if agent is not None else []
            return self.reads.start(cold, arrival=True)  # the most recently used branch's first

    def pending_reads(self, namespaces: Sequence[str]) -> list[Future]:
        """The reads still running for these agents' blocks (read-ahead and hot-set restore); any thread."""
        if self.reads is None:
            return []
        with self.core.lock:
            ids = [bid for ns in namespaces for bid in (self.agents.get(ns).ids if self.agents.get(ns) else ())]
        return self.reads.pending(ids)

    # ---- lookup ---------------------------------------------------------------------------------

    def lookup(self, namespace: Optional[str], prompt: Sequence[int],
               request_id: Optional[str] = None, fork_from: Optional[str] = None) -> tuple[Optional[list], int, str]:
        """(per-layer cache list or None, tokens covered, tier): `match` without the details."""
        m = self.match(namespace, prompt, request_id, fork_from)
        return m.cache, m.num_tokens, m.tier

    def match(self, namespace: Optional[str], prompt: Sequence[int], request_id: Optional[str] = None,
              fork_from: Optional[str] = None, wait_fleet: bool = True, edit: Optional[str] = None) -> Match:
        """Longest reusable prefix of `prompt` for `namespace` (None: anonymous).

        Every branch of the agent is a candidate, and with `fork_from` every branch of that agent
        too (the child then starts from the parent's prefix, by reference). With a `decode`
        function, a match that stops where the stored tokens and the prompt differ but decode to
        the same text goes on past it; `Match.prompt` is then the prompt as the stored tokens.
        At least one prompt token is always left to prefill; recurrent models stop at their last
        state checkpoint. With `request_id`, the request counts as in flight until
        `finish(request_id)`: the disk budget never erases its agent meanwhile. With `edit="forget"`
        (and a request id), the agent's branches holding what the prompt no longer has (kv_edit/supersede.py)
        are dropped when the turn commits, or when the request finishes without committing.
        """
        if self.fleet is not None and namespace is not None:
            # bounded, and before the lock; a fork's parent too (its copy may be of an erased
            # history), both syncs running at once
            names = [namespace] + ([fork_from] if fork_from and fork_from != namespace else [])
            for ns in names[1:]:
                self.fleet.prefetch(ns)
            for ns in names:
                self.fleet.wait(ns, wait_fleet)
        prompt = [int(t) for t in prompt]
        with self.core.lock:
            if request_id is not None and namespace is not None:
                # [agent, erased meanwhile, tokens reused, epoch, when, tokens of the prompt served]
                self.core.inflight[request_id] = [namespace, False, 0, self.core.epoch, self.clock(), len(prompt)]
                if self.persister is not None:
                    self.persister.begin_use(namespace)
            agent = self.agents.find_anonymous(prompt) if namespace is None else self.agents.get(namespace)
            parent = self.agents.get(fork_from) if fork_from and namespace and fork_from != namespace else None
            if parent is not None and not self.records.allows_fork(parent):
                # The request was admitted on the record as it was (the namespace hook's check, before
                # any sync); the parent's record as synced just now refuses: nothing of it is served.
                self.stats["forks_refused_at_lookup"] += 1
                parent = None
            if (agent is None and parent is None) or len(prompt) <= 1:
                self.stats["misses"] += 1
                return Match(None, 0, "miss")
            if agent is None:  # a new child: what it reads is counted by its parent until it commits
                agent = Agent(namespace)
            candidates = [(agent, br) for br in reversed(agent.honest)]
            if parent is not None:  # a fork never sees its parent's spliced histories
                candidates += [(parent, br) for br in reversed(parent.honest)]
            if edit == AMORTIZE:  # only the agent's own amortize requests see its spliced histories
                candidates += [(agent, br) for br in reversed(agent.branches) if br.spliced]
        found = self.lookup_.best(candidates, prompt)  # the lock is taken and released inside
        superseded = 0
        with self.core.lock:
            if edit == FORGET and request_id is not None:
                self.stats["kv_edit_forgets"] += 1
                superseded = self.forgets.supersede(agent, found, prompt, request_id)
            if found is not None and found.n and found.src is agent:
                at = next((i for i, b in enumerate(agent.branches) if b is found.branch), None)
                if at is not None:  # now the most recently used
                    used = found.branch.used(self.agents.stamp(agent))  # its content no newer
                    del agent.branches[at]
                    agent.branches.append(used)
            if self.reads is not None:  # read-ahead this lookup did not need (spliced histories' too)
                read = {id(a): a for a, _ in candidates if a is not None}
                self.reads.cancel([b for a in read.values() for b in a.ids], restored=False)
            if agent.listed:
                self.core.touch(agent)
            # The blocks this lookup uses are held by it (Got.layers): evicting them or shedding their
            # sliding arrays only moves their bytes out of the budget's count until the cache is built.
            self.core.trim_windows([agent] + ([found.src] if found is not None and found.src is not agent else []))
            self.core.enforce_budget(keep=(agent.namespace, found.src.namespace if found is not None else agent.namespace))
        stored = source = None
        if edit == AMORTIZE and found is not None and found.src is not parent:  # what a splice could reuse
            self.stats["kv_edit_amortizes"] += 1
            stored, _ = self.lookup_.stored_tokens(found.src, found.branch, found.branch.n_tokens)
            source = (found.src, found.branch)
        if found is None or not found.used:
            self.stats["misses"] += 1
            return Match(None, 0, "miss", superseded=superseded, stored=stored, source=source)
        run = whole_run(found.used)
        cache, covered = self.codec.build([(got.layers, n) for got, n in found.used],
                                          run.arrays if run is not None else None,
                                          run.floats if run is not None else None)
        if covered == 0:
            self.stats["misses"] += 1
            return Match(None, 0, "miss", superseded=superseded, stored=stored, source=source)
        with self.core.lock:
            if request_id is not None and request_id in self.core.inflight:
                self.core.inflight[request_id][2] = covered
                if found.prompt is not None:  # served as the stored tokens (matched by text)
                    self.core.inflight[request_id][5] = len(found.prompt)
            self.stats["hits_disk" if found.from_disk else "hits_hot"] += 1
            self.stats["tokens_reused"] += covered
            forked = parent is not None and found.src is parent
            if forked:
                self.stats["fork_hits"] += 1
                self.stats["tokens_from_parent"] += covered
        return Match(cache, covered, "disk" if found.from_disk else "hot", found.prompt, forked, superseded, stored, source)

    def run_arrays(self, source: tuple, start: int, end: int) -> Optional[dict]:
        """The token arrays of stored positions [start, end) of a branch (`Match.source`), read as
        needed (worker: MLX); None if a block cannot be had. Bounded sliding layers: the window
        before the end only, read back from disk where memory shed it, and the run cut to where
        that window is held (`ModelCodec.splice_run`, `run_length`)."""
        agent, branch = source
        bs = self.block_size
        first = start // bs
        steps = list(self.chains.walk(branch))[first: -(-end // bs)]
        got, ended = self.lookup_.fetch(agent, steps)
        if len(got) < len(steps):
            return None
        used = [(g, min(len(g.tokens), end - (first + i) * bs)) for i, g in enumerate(got)]
        found = Found(agent, branch, used, False)
        self.lookup_.fill_windows(found)
        return self.codec.splice_run([(g.layers, n) for g, n in found.used], start - first * bs)

    # ---- commit ---------------------------------------------------------------------------------

    def commit(self, namespace: Optional[str], tokens: Sequence[int], cache: list,
               request_id: Optional[str] = None, fork_from: Optional[str] = None, generation: int = 0,
               rotations: Segments = ()) -> int:
        """`commit_async`, then (with durable writes) wait up to `write_timeout_s` for the disk.
        Returns the number of tokens now cached."""
        n, future = self.commit_async(namespace, tokens, cache, request_id, fork_from, generation, rotations)
        if future is not None and self.durable_writes:
            try:
                if not future.result(self.write_timeout_s):
                    log.warning("agent %r kept in memory only for now: its write failed", namespace)
            except FutureTimeout:
                log.warning("agent %r: write not durable after %.0f s; going on", namespace, self.write_timeout_s)
        return n

    def commit_async(self, namespace: Optional[str], tokens: Sequence[int], cache: list,
                     request_id: Optional[str] = None, fork_from: Optional[str] = None, generation: int = 0,
                     rotations: Segments = ()) -> tuple[int, Optional[Future]]:
        """Make `namespace`'s cache cover `tokens` (prompt + output) from an extracted cache.

        The cache must cover `tokens`, or all but the last (generated, never fed back) token;
        anything else is refused (0 tokens): a cache is never stored under tokens it does not
        cover. The sequence becomes the agent's most recently used branch; branches it continues
        are replaced by it, and beyond `branches` the least recently used one goes. Blocks the
        agent already holds (or, with `fork_from`, the parent's whole blocks the sequence starts
        with) are kept by reference; only new blocks are sliced, kept hot and handed to the
        persister, which never makes this thread wait (a full write queue drops the save, counted;
        the blocks stay unsaved in memory and the agent's next save writes them). Returns (tokens
        now cached, the save's future: True once the turn is durable, False if it failed; None
        when nothing is written). `generation`, `rotations`: a spliced history's turn (kv_edit): the
        agent's branch of that generation (chain.Branch), never seen by its exact requests.
        """
        n_valid = self.codec.length(cache)
        if not 0 <= len(tokens) - n_valid <= 1:
            self.stats["store_refused"] += 1
            log.warning("not caching agent %r: the cache covers %d tokens, the sequence has %d",
                        namespace, n_valid, len(tokens))
            return 0, None
        tokens = [int(t) for t in tokens[:n_valid]]
        if n_valid == 0:
            return 0, None
        with self.core.lock:  # a forget edit's superseded branches go with this turn (else at finish())
            removals = self.forgets.pending(request_id)
        for _ in range(COMMIT_ATTEMPTS):
            with self.core.lock:
                inflight = self.core.inflight.get(request_id) if request_id is not None else None
                if inflight is not None and inflight[1]:
                    return 0, None  # erased while this request ran: its turn must not bring it back
                if namespace is None:
                    agent = self.agents.anonymous_slot(tokens)
                else:
                    agent = self.agents.get(namespace) or Agent(namespace)
                if generation and inflight is not None and (agent.spliced_cleared >= inflight[4]
                                                            or self.core.erased.get(namespace, -1) > inflight[3]):
                    return 0, None  # a forget dropped the agent's spliced histories (or all of it) since the lookup
                # A spliced cache holds no stored block bit for bit (its lookup was another agent's).
                reused = inflight[2] if inflight and not generation else 0
                # the request's prompt, so a later turn holding all of it may take this branch's place
                asked = inflight[5] if inflight and not generation and inflight[5] <= len(tokens) else None
                plan = self.committer.plan(agent, tokens, fork_from, reused, self.core.epoch, rotations, generation,
                                           asked)
            built = self.committer.build(plan, cache)  # MLX, no lock
            with self.core.lock:
                if inflight is not None and inflight[1]:
                    return 0, None
                if self.committer.stale(plan, self.core.epoch):
                    self.stats["commit_replans"] += 1
                    continue
                forget = None if removals is None else (lambda kept: self.forgets.record(agent, kept, removals))
                dead, future = self.committer.install(plan, built, forget)
                if removals is not None:
                    self.forgets.committed(request_id)
                    self.core.epoch += 1  # other commits planned on the superseded blocks plan again
                    self.core.drop_remote(dead, future)
                self.core.trim_windows([agent])
                self.core.enforce_budget(keep=(agent.namespace,))
            return n_valid, future
        log.warning("agent %r: turn not cached, its history kept changing under the commit", namespace)
        return 0, None

    def finish(self, request_id: str) -> None:
        """The request is done (completed or aborted): its agent is no longer in use by it."""
        with self.core.lock:
            entry = self.core.inflight.pop(request_id, None)
            if entry is not None and self.persister is not None:
                self.persister.end_use(entry[0])
            self.forgets.finished(request_id)  # a forget edit whose turn was not stored

    # ---- memory ---------------------------------------------------------------------------------

    def set_hot_budget(self, nbytes: int) -> None:
        """A new hot budget, enforced now (agents leave memory until it fits)."""
        with self.core.lock:
            self.core.hot_budget = nbytes
            self.core.enforce_budget()

    def _block_bytes(self, bid: str) -> int:
        """A block file's size from the disk index (no I/O: called under locks), else a typical size."""
        return self.persister.block_size_of(bid) if self.persister is not None else 0

    def _quarantine(self, bid: str, why: str) -> None:
        if self.persister is not None:
            self.persister.quarantine_block(bid, why)

    def clear(self) -> None:
        """Drop everything from memory; durable agents stay on disk and come back on demand."""
        self.flush()
        with self.core.lock:
            for agent in list(self.agents.anonymous.values()):
                self.agents.drop(agent)
            for agent in list(self.agents.registry.values()):
                self.agents.evict(agent, durable=self.persister is not None)
            for bid in list(self.table.orphans):
                block = self.table.blocks.get(bid)
                if block is not None and block.state != BlockState.PENDING:
                    self.table.drop(block)
            if self.reads is not None:
                self.reads.clear()

    def flush(self, timeout: Optional[float] = None) -> None:
        if self.persister is not None:
            self.persister.flush(timeout)

    def close(self) -> None:
        """Stop reading, write what is queued, then send the fleet tier's queued uploads (bounded)."""
        if self.fleet is not None:
            self.fleet.stop()  # no new syncs, no erasures from refused puts: the persister is closing
        if self.reads is not None:
            self.reads.close()
        if self.persister is not None:
            self.persister.close()
        if self.fleet is not None:
            self.fleet.close()

    def snapshot(self) -> dict:
        """Counters for /v1/status, /health and /metrics: O(1), no disk access, any thread."""
        out = {
            **self.stats,
            "agents": len(self.agents.registry),
            "agents_hot": self.table.hot_agents,
            "agents_in_flight": len(self.core.inflight),
            "anonymous_entries": len(self.agents.anonymous),
            "blocks": len(self.table.blocks),
            "shared_blocks": self.table.shared,
            "hot_bytes": self.table.hot_bytes,
            "hot_budget_bytes": self.core.hot_budget,
        }
        if self.reads is not None:
            out.update(self.reads.snapshot())
        if self.persister is not None:
            out.update(self.persister.stats())
        return out

