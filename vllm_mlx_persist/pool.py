"""Per-agent pool of 4-bit KV blocks: the public face of the pool's parts, and their one lock.

The parts, each owning its state (see their docstrings):
    chain.py    block ids, branches, manifests <-> branches          pure
    blocks.py   the block table: blocks, references, hot bytes       under the lock
    agents.py   the agent registry, the anonymous LRU, hot budget    under the lock
    reads.py    reads ahead of the worker, the hot-set restore       its own lock
    lookup.py   a prompt's longest reusable prefix                    worker
    commit.py   a finished turn becomes the agent's newest branch    worker
This module owns the lock, the requests in flight, the counters and the epoch, and composes the
persister (the disk tier's one writer) and, when configured, the fleet tier.

The lock is held for in-memory bookkeeping only: never across I/O, a wait or MLX work (lookups and
commits release it for those). Who calls what:
- vllm-mlx's worker thread (MLX): match/lookup, commit, load_manifests, clear;
- the event loop: prefetch, pending_reads (short, never behind a disk);
- admin API threads: agent_info, list_agents, erase, set_pinned (erase and pin wait for the disk
  with the lock released);
- the persister thread: erasures by the disk budget and TTL, saves becoming durable, fetched
  histories adopted;
- fleet threads: what fleet.FleetPool lists (agent_version, holds, save_fetched, erase, prefetch,
  the disk's blocks, the chain check).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx

from .agents import ANON_PREFIX, Agents
from .blocks import Agent, Block, BlockState, BlockTable
from .caches import ModelCodec
from .caches.codec import WIN_FROM
from .caches.kinds import Q4
from .chain import (Branch, Chains, Copy, Removal, branches_of, cut_branch, limit_branches, manifest_of,
                    merge_branches, merge_removals, removal_of, removals_of, same_branches, surviving_removals)
from .commit import Commit
from .disk_format import MAX_REMOVALS, BlockData, Manifest
from .kv_edit import AMORTIZE, FORGET
from .kv_edit.rotations import Segments
from .kv_edit.supersede import edit_point, superseded_block, surviving
from .lookup import Found, Lookup, Match, whole_run
from .namespace import legacy_spliced, spliced_seed
from .persister import Persister
from .reads import Reads
from .store import DiskStore

log = logging.getLogger("vllm_mlx_persist.pool")

READ_TIMEOUT_S = 30.0  # a block read slower than this (a hung disk) is a miss, not a hung worker
COMMIT_ATTEMPTS = 3  # a commit planned again when another thread changed what its plan relied on
MIN_READ_AHEAD_BYTES = 64 << 20
MAX_ERASED = 1 << 16  # erasures remembered for fleet syncs in flight (a sync takes seconds)

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
        fleet: Optional[Callable[["BlockPool"], Any]] = None,
        clock: Callable[[], float] = time.time,
        removal_ttl_s: float = 30 * 86400.0,
        fork_policy: str = "open",
    ):
        """`store`: the disk tier (None: memory only), written by a Persister built here with
        `disk_budget` and `persister_options`. `fleet`: builds the fleet tier's glue for this pool
        (fleet.Fleet, which sees the pool as a fleet.FleetPool), or None. `read_ahead_bytes`: read
        results waiting for their lookup, at most (default: a quarter of the hot budget, at least 64
        MB). `clock`: wall-clock time of manifests, last uses and the TTL (a test may move it on).
        `removal_ttl_s`: how long an agent's record
        keeps a forget's removal records (chain.Removal; at most MAX_REMOVALS of them). `fork_policy`:
        which agents may be forked ("open": any but those set not forkable; "listed": only those set
        forkable; "none"); see `may_fork`."""
        self.clock = clock
        self.removal_ttl_s = removal_ttl_s
        self.fork_policy = fork_policy
        self.fingerprint = fingerprint
        self.n_layers = n_layers
        # Default: every layer plain 4-bit attention (the pool's unit tests build it like that).
        self.codec = codec or ModelCodec([Q4] * n_layers, bits, group_size)
        self.bits, self.group_size, self.block_size = bits, group_size, block_size
        self.hot_budget = hot_bytes
        self.durable_writes = durable_writes
        self.write_timeout_s = write_timeout_s
        self.stats = dict.fromkeys(
            ["hits_hot", "hits_disk", "misses", "tokens_reused", "tokens_stored", "blocks_loaded",
             "bytes_loaded", "evicted_agents", "write_errors", "bad_blocks", "unsaved_blocks_dropped",
             "store_refused", "read_timeouts", "fork_hits", "tokens_from_parent", "branches_evicted",
             "text_matches", "tokens_matched_by_text", "commit_replans", "kv_edit_forgets",
             "kv_edit_amortizes", "kv_edit_splices", "branches_superseded"], 0)
        self._lock = threading.RLock()
        # request id -> [namespace, erased while in flight, tokens reused, epoch and clock at its lookup]
        self._inflight: dict[str, list] = {}
        # request id -> (namespace, first superseded blocks) of a forget edit, until its turn commits
        self._superseding: dict[str, tuple[str, dict[str, Removal]]] = {}
        # Bumped whenever another thread than the worker changes agents (erasure, fleet adoption): a
        # commit planned before it is planned again.
        self.epoch = 0
        # The epoch at each agent's last erasure (the most recent MAX_ERASED): a fleet sync that read
        # the agent before it is refused, even when the agent was unknown here (agent_version).
        self._erased: "OrderedDict[str, int]" = OrderedDict()
        self.fleet: Any = None  # built last (below); the persister may erase before that
        self.persister = (Persister(store, disk_budget=disk_budget, on_erased=self._forgotten, clock=clock,
                                    **(persister_options or {})) if store is not None else None)
        self.store = store
        self.chains = Chains(fingerprint, block_size)
        self.table = BlockTable()
        self.reads = (Reads(store, read_ahead_bytes if read_ahead_bytes is not None
                            else max(MIN_READ_AHEAD_BYTES, hot_bytes // 4), self._block_bytes, self.stats)
                      if store is not None else None)
        self.agents = Agents(self.table, block_size, max_anonymous, self.stats,
                             on_drop=self.reads.cancel if self.reads is not None else (lambda ids: None),
                             clock=clock, saving=self.persister.saving if self.persister is not None else (lambda b: False))
        self.lookup_ = Lookup(self._lock, self.chains, self.table, self.agents, self.reads, self.codec,
                              self.stats, READ_TIMEOUT_S, decode, self._quarantine)
        self.committer = Commit(self.chains, self.table, self.agents, self.codec, self.persister, self.stats,
                                max(1, int(branches)), self._save)
        self.fleet = fleet(self) if fleet is not None else None

    # ---- views for tests, tools and the fleet -----------------------------------------------------

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
        with self._lock:
            return self.table.check(self.agents.all())

    # ---- start-up -------------------------------------------------------------------------------

    def load_manifests(self) -> int:
        """Register every agent found on disk (cold: blocks are read on first use); returns count."""
        if self.persister is None:
            return 0
        manifests = sorted(self.persister.load(), key=lambda m: m.updated_at, reverse=True)
        legacy: dict[str, list[tuple[Manifest, int]]] = {}  # agent -> its spliced histories' old manifests
        with self._lock:
            for m in manifests:
                old = legacy_spliced(m.namespace)
                if old is not None:
                    legacy.setdefault(old[0], []).append((m, old[1]))
                    continue
                if self.agents.get(m.namespace) is not None:
                    continue
                if self.fleet is not None:
                    self.fleet.loaded(m)  # the erasure its history follows survives the restart
                agent = Agent(m.namespace, pinned=m.pinned, last_used=m.updated_at, forkable=m.forkable,
                              removals=removals_of(m), spliced_cleared=m.spliced_cleared or 0.0)
                self.table.name(agent, branches_of(m))
                self.agents.add(agent, coldest=True)  # disk agents are the coldest
            for name, old in legacy.items():
                self._adopt_legacy(name, old)
            return len(self.agents.registry)

    def _adopt_legacy(self, name: str, old: list[tuple[Manifest, int]]) -> None:
        """(lock held, start-up) Spliced histories stored before the agent record, each as an agent of
        its own (`name\0amortized:g`): they become the agent's branches of generation g (their ids
        unchanged: their links name the same seeds), the record is saved with them, and then the old
        manifests are erased (their blocks stay: the record's manifest names them)."""
        agent = self.agents.get(name)
        if agent is None:
            agent = Agent(name, last_used=max(m.updated_at for m, _ in old))
            self.agents.add(agent, coldest=True)
        spliced = [replace(br, generation=g) for m, g in old for br in branches_of(m)]
        spliced.sort(key=lambda br: br.last_used)
        branches = limit_branches(agent.branches + spliced, self.max_branches)
        self.table.name(agent, sorted(branches, key=lambda br: br.last_used))
        if self.persister is not None:
            self._save(agent, [], {}, [], [])
            for m, _ in old:
                self.persister.erase(m.namespace)
        log.info("agent %r: %d spliced histories of the earlier layout moved into its record", name, len(old))

    def restore_hot_set(self) -> Optional[Future]:
        """After a restart, read the most recently used agents' blocks, in the order they were last
        used, up to `hot_budget` bytes, on the restore thread (numpy only): their first turns then
        find them in memory instead of on disk. Returns at once (the restore's future, for tests)."""
        if self.reads is None or self.hot_budget <= 0:
            return None
        with self._lock:
            plan = [bid for a in reversed(self.agents.registry.values()) for bid in a.ids
                    if bid in self.table.blocks and self.table.blocks[bid].layers is None]
        return self.reads.restore(list(dict.fromkeys(plan)),
                                  room=lambda: self.hot_budget - self.table.hot_bytes - self.reads.restored_bytes,
                                  idle=lambda: not self._inflight, wanted=self._cold)

    def _cold(self, bid: str) -> bool:
        """Whether a block is named and out of memory; any thread, no lock (one dict read)."""
        block = self.table.blocks.get(bid)
        return block is not None and block.layers is None

    # ---- lookup ---------------------------------------------------------------------------------

    def prefetch(self, namespace: str) -> int:
        """Start reading `namespace`'s cold blocks on the reader threads (at most the read-ahead
        budget's bytes); returns how many. Called from the event loop as a request arrives, so the
        disk read overlaps the decode steps the worker runs before it gets to this request's lookup."""
        if self.reads is None:
            return 0
        with self._lock:
            agent = self.agents.get(namespace)
            cold = [bid for bid in agent.ids if self.table.blocks[bid].layers is None] if agent is not None else []
            return self.reads.start(cold, arrival=True)  # the most recently used branch's first

    def pending_reads(self, namespaces: Sequence[str]) -> list[Future]:
        """The reads still running for these agents' blocks (read-ahead and hot-set restore); any thread."""
        if self.reads is None:
            return []
        with self._lock:
            ids = [bid for ns in namespaces for bid in (self.agents.get(ns).ids if self.agents.get(ns) else ())]
        return self.reads.pending(ids)

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
        with self._lock:
            if request_id is not None and namespace is not None:
                self._inflight[request_id] = [namespace, False, 0, self.epoch, self.clock()]
                if self.persister is not None:
                    self.persister.begin_use(namespace)
            agent = self.agents.find_anonymous(prompt) if namespace is None else self.agents.get(namespace)
            parent = self.agents.get(fork_from) if fork_from and namespace and fork_from != namespace else None
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
        with self._lock:
            if edit == FORGET and request_id is not None:
                self.stats["kv_edit_forgets"] += 1
                superseded = self._supersede(agent, found, prompt, request_id)
            if found is not None and found.n and found.src is agent:
                at = next((i for i, b in enumerate(agent.branches) if b is found.branch), None)
                if at is not None:  # now the most recently used
                    used = replace(found.branch, last_used=self.agents.stamp(agent))
                    del agent.branches[at]
                    agent.branches.append(used)
            if self.reads is not None:  # read-ahead this lookup did not need (spliced histories' too)
                read = {id(a): a for a, _ in candidates if a is not None}
                self.reads.cancel([b for a in read.values() for b in a.ids], restored=False)
            if agent.listed:
                self._touch(agent)
            # The blocks this lookup uses are held by it (Got.layers): evicting them or shedding their
            # sliding arrays only moves their bytes out of the budget's count until the cache is built.
            self._trim_windows([agent] + ([found.src] if found is not None and found.src is not agent else []))
            self._enforce_budget(keep=(agent.namespace, found.src.namespace if found is not None else agent.namespace))
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
        with self._lock:
            if request_id is not None and request_id in self._inflight:
                self._inflight[request_id][2] = covered
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

    def _supersede(self, agent: Agent, found: Optional[Any], prompt: list[int], request_id: str) -> int:
        """(lock held) A forget edit: note the first block of the agent's own best branch that holds
        content the prompt no longer has (and of the branches tied with it), with the removal records
        the fleet's merges apply (chain.Removal); returns how many of its branches name one. The
        branches go, with the agent's spliced histories (they may copy what is removed), when the
        turn commits or the request finishes without committing."""
        if found is None or found.src is not agent:
            return 0
        served = found.prompt if found.prompt is not None else prompt
        bids: dict[str, Removal] = {}
        now = self.clock()
        for f in [found] + [t for t in found.ties if t.src is agent]:
            point = edit_point([got.tokens for got, _ in f.used], served)
            bid = superseded_block(f.branch, point, self.block_size)
            if bid is not None:
                i = point // self.block_size
                tokens = f.used[i][0].tokens if i < len(f.used) else self.table.blocks[bid].tokens
                bids[bid] = removal_of(f.branch, i, tokens, self.block_size, now)
        if not bids:
            return 0
        self._superseding[request_id] = (agent.namespace, bids)
        return len(agent.branches) - len(surviving(agent.branches, bids))

    def forget_record(self, agent: Agent, branches: list[Branch], removals: dict[str, Removal]) -> list[Branch]:
        """(lock held) A forget edit's removals entered in the agent's record: of `branches` (the
        agent's), those naming a superseded block and every spliced one go (returns those kept), and
        the removal records stay with the record, bounded (MAX_REMOVALS, `removal_ttl_s`), for the
        fleet's merges."""
        now = self.clock()
        kept = surviving(branches, removals)
        if any(br.spliced for br in kept):  # spliced copies may hold what is removed
            agent.spliced_cleared = max(agent.spliced_cleared, now)
            kept = [br for br in kept if not br.spliced]
        agent.removals = merge_removals(agent.removals, list(removals.values()), MAX_REMOVALS, now - self.removal_ttl_s)
        self.stats["branches_superseded"] += len(branches) - len(kept)
        return kept

    def _drop_superseded(self, namespace: str, removals: dict[str, Removal]) -> None:
        """(lock held) A forget edit whose turn did not commit: drop the superseded branches now, and
        keep the removal in the record, saved and published like a turn."""
        agent = self.agents.get(namespace)
        if agent is None:
            return
        before = list(agent.branches)
        kept = self.forget_record(agent, before, removals)
        self.epoch += 1  # commits planned on those blocks plan again
        if not kept and self.fleet is None:  # nothing left, nothing to tell: the agent goes, locally
            self._forget(namespace)
            if self.persister is not None:
                self.persister.erase(namespace)
            return
        dead = self.table.name(agent, kept)
        if agent.persistent and self.persister is not None:
            self._drop_remote(dead, self._save(agent, [], {}, dead, before))

    def _drop_remote(self, dead: list[str], saved: Optional[Future]) -> None:
        """With a fleet tier: once the save that stops naming `dead` is durable (its put then queued),
        delete those blocks from Redis too."""
        if self.fleet is not None and dead and saved is not None:
            fleet = self.fleet
            saved.add_done_callback(
                lambda f: fleet.superseded(dead) if not f.cancelled() and f.exception() is None and f.result() else None)

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
        with self._lock:  # a forget edit's superseded branches go with this turn (else at finish())
            removals = self._superseding.get(request_id, (None, None))[1] if request_id is not None else None
        for _ in range(COMMIT_ATTEMPTS):
            with self._lock:
                inflight = self._inflight.get(request_id) if request_id is not None else None
                if inflight is not None and inflight[1]:
                    return 0, None  # erased while this request ran: its turn must not bring it back
                if namespace is None:
                    agent = self.agents.anonymous_slot(tokens)
                else:
                    agent = self.agents.get(namespace) or Agent(namespace)
                if generation and inflight is not None and (agent.spliced_cleared >= inflight[4]
                                                            or self._erased.get(namespace, -1) > inflight[3]):
                    return 0, None  # a forget dropped the agent's spliced histories (or all of it) since the lookup
                # A spliced cache holds no stored block bit for bit (its lookup was another agent's).
                reused = inflight[2] if inflight and not generation else 0
                plan = self.committer.plan(agent, tokens, fork_from, reused, self.epoch, rotations, generation)
            built = self.committer.build(plan, cache)  # MLX, no lock
            with self._lock:
                if inflight is not None and inflight[1]:
                    return 0, None
                if self.committer.stale(plan, self.epoch):
                    self.stats["commit_replans"] += 1
                    continue
                forget = None if removals is None else (lambda kept: self.forget_record(agent, kept, removals))
                dead, future = self.committer.install(plan, built, forget)
                if removals is not None:
                    self._superseding.pop(request_id, None)
                    self.epoch += 1  # other commits planned on the superseded blocks plan again
                    self._drop_remote(dead, future)
                self._trim_windows([agent])
                self._enforce_budget(keep=(agent.namespace,))
            return n_valid, future
        log.warning("agent %r: turn not cached, its history kept changing under the commit", namespace)
        return 0, None

    def _save(self, agent: Agent, blocks: list[Block], datas: dict[str, BlockData], dead: list[str],
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
        manifest = self._stamped(self._manifest(agent, branches,
                                                agent.branches[-1].last_used if agent.branches else self.clock()))
        base = manifest_of(agent.namespace, before, agent.pinned) if before else None
        data = [datas[b.block_id] for b in blocks]
        stats = self.stats

        def on_durable() -> None:  # persister thread
            with self._lock:
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

    def _manifest(self, agent: Agent, branches: Optional[list[Branch]] = None, now: Optional[float] = None) -> Manifest:
        """(lock held) The agent's record as a manifest (chain.manifest_of): its branches (or
        `branches`), pin, fork permission and removal records."""
        return manifest_of(agent.namespace, agent.branches if branches is None else branches, agent.pinned, now,
                           removals=agent.removals, spliced_cleared=agent.spliced_cleared, forkable=agent.forkable)

    def _stamped(self, manifest: Manifest) -> Manifest:
        """(lock held) With a fleet tier: the manifest with the erasure its history follows (docs/fleet.md, Erasure)."""
        if self.fleet is not None:
            manifest.era = self.fleet.era(manifest.namespace)
        return manifest

    def finish(self, request_id: str) -> None:
        """The request is done (completed or aborted): its agent is no longer in use by it."""
        with self._lock:
            entry = self._inflight.pop(request_id, None)
            if entry is not None and self.persister is not None:
                self.persister.end_use(entry[0])
            pending = self._superseding.pop(request_id, None)
            if pending is not None:  # a forget edit whose turn was not stored
                self._drop_superseded(*pending)

    # ---- agents: admin API ----------------------------------------------------------------------

    def agent_info(self, namespace: str) -> Optional[dict]:
        """What the pool knows of an agent, or None if it has none."""
        with self._lock:
            agent = self.agents.get(namespace)
            if agent is None:
                return None
            n_blocks = len(agent.ids)
            hot = sum(1 for b in agent.ids if self.table.blocks[b].layers is not None)
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
                "shared_blocks": sum(1 for b in agent.ids if self.table.refs.get(b, 0) > 1),
                "forked_from": sorted({ns for br in agent.honest for _, ns in br.links} - {namespace}),
                "forkable": self._may_fork_locked(agent),
                "removals": len(agent.removals),
            }
        if self.fleet is not None:
            info["remote"] = self.fleet.agent_info(namespace)
        info["bytes_disk"] = self.persister.agent_disk_bytes(namespace) if self.persister is not None else 0
        return info

    def list_agents(self, limit: int, after: Optional[str] = None) -> tuple[list[dict], bool]:
        """One page of agents ordered by id: up to `limit` whose ids sort after `after`, and whether
        more follow. Id order keeps pages stable while agents are used (recency would reshuffle them)."""
        with self._lock:
            names = sorted(n for n in self.agents.registry if after is None or n > after)
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
        with self._lock:
            known = self._forget(namespace)
            for entry in self._inflight.values():
                if entry[0] == namespace:
                    entry[1] = True
            # queued under the lock, so it is ordered after every save already committed
            future = self.persister.erase(namespace) if self.persister is not None else None
        if future is not None:
            known = bool(future.result(timeout)) or known
        if fleet_wide and self.fleet is not None:  # after the local save jobs: their uploads are queued
            known = self.fleet.erase(namespace) or known
        return known

    def may_fork(self, parent: str) -> bool:
        """Whether a request may fork `parent` (`fork_policy`, and the parent's own setting). An
        unknown parent is answered like a known one under the policy, so the answer tells nothing
        of which agents exist. Any thread, no I/O."""
        with self._lock:
            return self._may_fork_locked(self.agents.get(parent))

    def _may_fork_locked(self, agent: Optional[Agent]) -> bool:
        if self.fork_policy == "none":
            return False
        if agent is None or agent.forkable is None:
            return self.fork_policy == "open"
        return agent.forkable

    def set_forkable(self, namespace: str, forkable: Optional[bool], timeout: Optional[float] = 60.0) -> bool:
        """Let other agents fork this one (True), forbid it (False) or leave it to `fork_policy`
        (None); saved with the record (its manifest). False if the agent is unknown."""
        with self._lock:
            agent = self.agents.get(namespace)
            if agent is None:
                return False
            agent.forkable = forkable
            future = self._save(agent, [], {}, [], list(agent.branches)) if self.persister is not None else None
        if future is not None:
            future.result(timeout)
        return True

    def set_pinned(self, namespace: str, pinned: bool, timeout: Optional[float] = 60.0) -> bool:
        """Pin (exempt from hot eviction, the disk budget and the TTL) or unpin; False if unknown."""
        with self._lock:
            agent = self.agents.get(namespace)
            if agent is None:
                return False
            agent.pinned = pinned
            if not pinned:
                self._enforce_budget()  # what the pin held over the budget leaves memory now
            future = self.persister.set_pinned(namespace, pinned) if self.persister is not None else None
        if future is not None:
            future.result(timeout)
        return True

    def _forget(self, namespace: str) -> bool:
        """(lock held) Drop an agent from memory; the epoch moves on even for an unknown one (a
        fleet sync of it that started before must not bring it back)."""
        self.epoch += 1
        self._erased[namespace] = self.epoch
        self._erased.move_to_end(namespace)
        if len(self._erased) > MAX_ERASED:
            self._erased.popitem(last=False)
        if self.fleet is not None:
            self.fleet.released(namespace)  # this server holds no history of it in Redis any more
        agent = self.agents.get(namespace)
        if agent is None:
            return False
        self.agents.drop(agent)
        return True

    def _forgotten(self, namespace: str) -> None:
        """The persister erased an agent (disk budget, TTL, or an erasure): persister thread."""
        with self._lock:
            self._forget(namespace)

    def _quarantine(self, bid: str, why: str) -> None:
        if self.persister is not None:
            self.persister.quarantine_block(bid, why)

    # ---- fleet: what the fleet asks of the pool (fleet.FleetPool; fleet/sync.py) ------------------

    @property
    def bounded_windows(self) -> bool:
        """Whether the model has bounded sliding-window layers."""
        return bool(self.codec.window_names())

    @property
    def disk_queue_bytes(self) -> Optional[int]:
        """The disk tier's write queue, in bytes; None without a disk tier."""
        return self.persister.queue_bytes if self.persister is not None else None

    def has_disk_block(self, block_id: str) -> bool:
        """Whether the disk holds the block's file (not verified: a read does that)."""
        return self.store.has_block(block_id)

    def read_disk_block(self, block_id: str) -> Optional[BlockData]:
        """The block read from disk, verified; None when absent or bad."""
        return self.store.read_block(block_id)

    def chain_prefix(self, branch: Branch, fetched: dict[str, BlockData]) -> tuple[int, bool]:
        """`Chains.prefix` of a branch fetched from the fleet, the disk's blocks held."""
        return self.chains.prefix(branch, fetched, self.store.has_block)

    def branch_state(self, namespace: str) -> Optional[tuple]:
        """The agent's branches as ((block ids), tokens, links, last used), least recently used first
        (the last is the most recent; () when every branch was cut), or None if unknown; any thread."""
        with self._lock:
            agent = self.agents.get(namespace)
            return None if agent is None else tuple((tuple(br.block_ids), br.n_tokens, br.links, br.last_used,
                                                     br.generation) for br in agent.branches)

    def agent_version(self, namespace: str) -> tuple:
        """What `save_fetched` compares: when the agent was last erased, its branches (their last
        uses included: a lookup since changes it) and its removal records."""
        with self._lock:
            agent = self.agents.get(namespace)
            removals = (agent.removals, agent.spliced_cleared) if agent is not None else None
            return self._erased.get(namespace, 0), self.branch_state(namespace), removals

    def holds(self, namespace: str, expect: tuple, remote: Copy, then: Callable[[], None],
              tokens: Optional[dict] = None) -> bool:
        """Whether the agent is still as `expect` and merging `remote` (a copy of its record in the
        fleet tier) would change nothing: it holds every branch of it as recently used, and every
        removal record. If so, `then()` runs under the lock (so no erasure comes between; it must
        not wait). `tokens`: block id -> tokens read ahead for removal records (`removal_blocks`).
        No I/O."""
        if not isinstance(remote, Copy):
            remote = Copy(tuple(remote))
        with self._lock:
            agent = self.agents.get(namespace)
            if agent is None or self.agent_version(namespace) != expect:
                return False
            branches, removals, cleared = self._merge_fetched(agent, remote, {}, tokens or {})
            if (not same_branches(branches, agent.branches) or set(removals) != set(agent.removals)
                    or cleared != agent.spliced_cleared):
                return False
            then()
            return True

    def removal_blocks(self, namespace: str, remote: Copy) -> list[str]:
        """The blocks whose tokens the merge with `remote` needs to tell whether a branch grew a
        removed partial tail (chain.Removal.tail), that no fetched block nor memory holds: the fleet
        reads them from the local disk before it merges. Any thread, no I/O."""
        with self._lock:
            agent = self.agents.get(namespace)
            removals = [r for r in (*(agent.removals if agent else ()), *remote.removals) if r.tail]
            if not removals:
                return []
            wanted = set()
            for br in [*(agent.branches if agent else ()), *remote.branches]:
                for r in removals:
                    i = r.index
                    if len(br.block_ids) > i and (br.block_ids[i - 1] if i else None) == r.prev:
                        block = self.table.blocks.get(br.block_ids[i])
                        if block is None or not block.tokens:
                            wanted.add(br.block_ids[i])
            return sorted(wanted)

    def save_fetched(self, namespace: str, fetched: Copy, blocks: list[BlockData], expect: tuple,
                     on_done: Callable, tokens: Optional[dict] = None) -> Optional[Future]:
        """Save a copy of the agent's record fetched from the fleet (`fetched`: its branches, least
        recently used first, and removal records; `blocks`: those the local disk lacks) merged with
        the agent's local record (see `_merge_fetched`), and once durable make it the agent's
        record with COLD blocks, provided the agent is still as `expect` (`agent_version` before
        the fetch: an erasure since, even of an agent unknown here, refuses it). `on_done(manifest
        or None)` runs on the persister thread, in order with every other write. None when the
        agent changed."""
        if not isinstance(fetched, Copy):  # a plain list of branches: a copy without removal records
            fetched = Copy(tuple(fetched))
        with self._lock:  # commits queue their saves under the lock too: the order is the pool's
            if self.persister is None or self.agent_version(namespace) != expect:
                return None
            agent = self.agents.get(namespace)
            data = {d.block_id: d for d in blocks}
            record = Agent(namespace) if agent is None else agent
            merged = self._merge_fetched(record, fetched, data, tokens or {})
            branches, removals, cleared = merged
            manifest = self._stamped(manifest_of(namespace, branches, record.pinned, self.clock(), removals=removals,
                                                 spliced_cleared=cleared, forkable=record.forkable))
            named = set(manifest.block_ids)
            blocks = [d for d in blocks if d.block_id in named]  # not those of branches merged away

            def on_durable() -> None:  # persister thread; on_done must not raise
                try:
                    adopted = self._adopt_fetched(namespace, merged, expect)
                except Exception:
                    log.exception("agent %r: registering its fetched history failed", namespace)
                    adopted = False
                on_done(manifest if adopted else None)

            return self.persister.save(manifest, blocks, [], on_durable)

    def _merge_fetched(self, agent: Agent, fetched: Copy, data: dict[str, BlockData], tokens: dict,
                       ) -> tuple[list[Branch], tuple[Removal, ...], float]:
        """(lock held) The agent's record merged with a fetched copy: branches by recency
        (chain.merge_branches: a branch another holds goes, the `branches` most recently used stay,
        from either side, honest and spliced apart), then every branch either side's removal records
        remove (chain.surviving_removals: removals win over every older copy). A partial tail
        another branch grew is recognised by the tokens at hand (`data`: fetched blocks; blocks in
        memory; `tokens`: read ahead from disk), never by a read."""
        def tokens_of(bid: str) -> Optional[Sequence[int]]:
            got = data.get(bid)
            if got is not None:
                return got.tokens
            block = self.table.blocks.get(bid)
            return block.tokens if block is not None and block.tokens else tokens.get(bid)

        removals = merge_removals(agent.removals, fetched.removals, MAX_REMOVALS, self.clock() - self.removal_ttl_s)
        cleared = max(agent.spliced_cleared, fetched.spliced_cleared)
        branches = merge_branches(agent.branches, list(fetched.branches), self.max_branches,
                                  lambda c, b: self.chains.grew(c, b, tokens_of),
                                  continued=not self.codec.window_names())
        return surviving_removals(branches, removals, cleared, tokens_of), removals, cleared

    def _adopt_fetched(self, namespace: str, merged: tuple, expect: tuple) -> bool:
        """Give the agent its merged record, with COLD blocks (blocks still hot stay hot)."""
        branches, removals, cleared = merged
        with self._lock:
            if self.agent_version(namespace) != expect:
                return False  # a turn, an erasure or a cut since: the pool's own state stands
            agent = self.agents.get(namespace)
            if agent is None:
                agent = Agent(namespace)
                self.agents.add(agent)
            agent.removals, agent.spliced_cleared = removals, cleared
            self.table.name(agent, branches)
            self._touch(agent)
            self.epoch += 1
            return True

    # ---- memory ---------------------------------------------------------------------------------

    def set_hot_budget(self, nbytes: int) -> None:
        """A new hot budget, enforced now (agents leave memory until it fits)."""
        with self._lock:
            self.hot_budget = nbytes
            self._enforce_budget()

    def _touch(self, agent: Agent) -> None:
        self.agents.touch(agent)
        if agent.persistent and self.persister is not None:
            self.persister.touch(agent.namespace)

    def _enforce_budget(self, keep: Sequence[str] = ()) -> None:
        """(lock held) Restored-but-unused blocks go first, least recent first; then agents leave
        memory (agents.enforce) until the hot tier fits `hot_budget`. `keep`: the request's agents."""
        if self.reads is not None:
            over = self.table.hot_bytes + self.reads.restored_bytes - self.hot_budget
            if over > 0:
                self.reads.shrink_restored(over)
        self.agents.enforce(self.hot_budget, keep, durable=self.persister is not None)

    def _trim_windows(self, owners: Sequence[Agent]) -> None:
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

    def _block_bytes(self, bid: str) -> int:
        """A block file's size from the disk index (no I/O: called under locks), else a typical size."""
        return self.persister.block_size_of(bid) if self.persister is not None else 0

    def clear(self) -> None:
        """Drop everything from memory; durable agents stay on disk and come back on demand."""
        self.flush()
        with self._lock:
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
            "agents_in_flight": len(self._inflight),
            "anonymous_entries": len(self.agents.anonymous),
            "blocks": len(self.table.blocks),
            "shared_blocks": self.table.shared,
            "hot_bytes": self.table.hot_bytes,
            "hot_budget_bytes": self.hot_budget,
        }
        if self.reads is not None:
            out.update(self.reads.snapshot())
        if self.persister is not None:
            out.update(self.persister.stats())
        return out


def _cut_at(branch: Branch, keep: Callable[[str], bool], block_size: int) -> Branch:
    """`branch` up to its first block `keep` refuses."""
    for i, bid in enumerate(branch.block_ids):
        if not keep(bid):
            return cut_branch(branch, i, block_size)
    return branch
