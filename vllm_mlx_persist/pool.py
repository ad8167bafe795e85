"""Per-agent pool of 4-bit KV blocks: chained block ids, agents, the hot LRU and the disk tier.

Runs on vllm-mlx's worker thread (it does MLX work); the admin API (list, erase, pin) calls it from
HTTP threads, so every public method takes the pool's lock. Disk writes go to the `Persister`, reads
to a small reader pool (numpy only).

A block holds `block_size` consecutive tokens (the last block of an agent may be a partial tail)
for all layers, as one name -> array map whose layout per layer kind (4-bit K/V, full-precision
latent, recurrent-state checkpoints) is `caches.ModelCodec`'s. 4-bit packing runs along the head
dimension, so slicing and concatenating along the token axis is exact.

A block is in one of three states: PENDING (in memory, its write not yet durable), DURABLE (in
memory and on disk) and COLD (on disk only). Leaving the hot tier makes a DURABLE block COLD and
drops a PENDING one, with the rest of its agent's chain (that turn is then simply not cached).
"""

from __future__ import annotations

import enum
import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import mlx.core as mx
import numpy as np

from .caches import ModelCodec
from .persister import Persister
from .q4cache import Q4
from .store import BlockData, Manifest

log = logging.getLogger("vllm_mlx_persist.pool")

ANON_PREFIX = "\x00anon:"  # valid agent ids cannot start with NUL, so anonymous entries never collide
READ_TIMEOUT_S = 30.0  # a block read slower than this (a hung disk) is a miss, not a hung worker
PREFETCH_MAX_BLOCKS = 1024  # read-ahead results waiting for their lookup, at most
PREFETCH_TTL_S = 60.0  # read-ahead results nobody looked up (a rejected request) expire
RESTORE_IDLE_S = 0.2  # the hot-set restore reads only when no request is served and none came this recently
# Block reads (open, read, sha256: all release the GIL) run in parallel on this many threads.
READER_THREADS = max(2, min(4, os.cpu_count() or 2))


class BlockState(enum.Enum):
    PENDING = "pending"  # hot, write not yet durable
    DURABLE = "durable"  # hot and on disk
    COLD = "cold"  # on disk only


@dataclass(eq=False)  # a block is itself: never compared by its arrays
class Block:
    block_id: str
    tokens: tuple[int, ...]
    layers: Optional[dict]  # name -> mx.array (see caches.codec); None while COLD
    state: BlockState = BlockState.PENDING
    nbytes: int = 0  # bytes it keeps in memory; fixed when set (and see Run), so readers never sum arrays
    # The agent whose hot_bytes count this block's bytes (the one that brought it into memory);
    # None while COLD, or while hot but named only by agents that did not (an "orphan", see
    # BlockPool._orphans). So a block shared by several agents is counted once.
    owner: Optional["Agent"] = None
    run: Optional[tuple["Run", int]] = None  # (the Run its layers are views of, its first token in it)

    def set_layers(self, layers: Optional[dict], run: Optional[tuple["Run", int]] = None) -> int:
        """Set (or drop, with None) the in-memory arrays; returns the change in bytes."""
        before = self.nbytes
        self.layers, self.run = layers, run
        self.nbytes = 0 if layers is None else sum(a.nbytes for a in layers.values())
        return self.nbytes - before


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


Links = tuple[tuple[int, str], ...]


@dataclass
class Branch:
    """One continuation of an agent's history: a chain of block ids.

    `links` says how the chain is seeded: ((0, ns),) is an agent's own chain, seeded with its
    namespace. A fork is ((0, parent), (k, child)): blocks 0..k-1 are the parent's (the same ids,
    shared by reference) and block k's link is re-seeded with the child's namespace, so what the
    child adds can never collide with what the parent or a sibling adds after the same prefix.
    """

    block_ids: list[str]
    n_tokens: int
    links: Links
    last_used: float = field(default_factory=time.time)


@dataclass
class Agent:
    namespace: str
    branches: list[Branch] = field(default_factory=list)  # least recently used first
    ids: dict = field(default_factory=dict)  # every block id its branches name (an ordered set)
    hot_bytes: int = 0  # bytes of the hot blocks it owns (Block.owner)
    pinned: bool = False
    last_used: float = field(default_factory=time.time)
    persistent: bool = True  # anonymous entries live in memory only

    @property
    def block_ids(self) -> list[str]:
        """The most recently used branch's block ids."""
        return self.branches[-1].block_ids if self.branches else []

    @property
    def n_tokens(self) -> int:
        return self.branches[-1].n_tokens if self.branches else 0


@dataclass
class Match:
    """What a lookup found: the cache, the tokens it covers, where from, and (when the prompt was
    matched by text across a re-tokenization) the prompt as the tokens the cache holds."""

    cache: Optional[list]
    num_tokens: int
    tier: str
    prompt: Optional[list[int]] = None  # replacement prompt tokens, or None when unchanged
    forked: bool = False  # the prefix came from the fork parent


def chain_seed(fingerprint: str, namespace: str) -> str:
    """First link of an agent's block chain: blocks never match across agents or models."""
    return hashlib.sha256(f"{fingerprint}\n{namespace}".encode()).hexdigest()


def link_id(prev: Optional[str], fingerprint: str, namespace: str) -> str:
    """The chain's link into `namespace`: its seed at the start, else the previous id re-seeded."""
    seed = chain_seed(fingerprint, namespace)
    if prev is None:
        return seed
    return hashlib.sha256(bytes.fromhex(prev) + bytes.fromhex(seed)).hexdigest()


def block_id(prev_id: str, tokens: Sequence[int]) -> str:
    h = hashlib.sha256(bytes.fromhex(prev_id))
    h.update(np.asarray(tokens, dtype=np.int32).tobytes())
    return h.hexdigest()


def chain_prev(prev: Optional[str], i: int, at: dict, fingerprint: str) -> Optional[str]:
    """The id block i of a branch chains from: block i-1's id (`prev`), re-seeded where one of the
    branch's links (`at`: dict(links)) begins."""
    return link_id(prev, fingerprint, at[i]) if i in at else prev


def cut_branch(branch: Branch, i: int, block_size: int) -> Branch:
    """`branch` without block i and the blocks after it."""
    return Branch(branch.block_ids[:i], min(branch.n_tokens, i * block_size),
                  tuple(l for l in branch.links if l[0] < i) or branch.links[:1], branch.last_used)


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if tuple(a[:n]) == tuple(b[:n]):
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _common(a: Sequence[str], b: Sequence[str]) -> int:
    i, n = 0, min(len(a), len(b))
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _to_numpy(block: Block, codec: ModelCodec) -> BlockData:
    arrays, dtypes = codec.to_numpy(block.layers)
    return BlockData(block.block_id, np.asarray(block.tokens, dtype=np.int32), arrays, dtypes)


class AnonymousCache:
    """Requests without an agent id: an in-memory LRU of up to `max_entries` prefix entries,
    reused by token prefix, never written to disk and never visible to agents."""

    def __init__(self, max_entries: int = 32):
        self.max_entries = max_entries
        self.entries: "OrderedDict[str, Agent]" = OrderedDict()  # least recently used first

    def find(self, prompt: Sequence[int], first_block) -> Optional[Agent]:
        """The entry sharing the longest prefix with `prompt` in its first block."""
        best, best_n = None, 0
        for agent in self.entries.values():
            if agent.block_ids:
                first = first_block(agent)
                n = _lcp(first.tokens, prompt[: len(first.tokens)])
                if n > best_n:
                    best, best_n = agent, n
        return best

    def slot(self, tokens: list[int], first_block, block_size: int) -> tuple[Agent, Optional[Agent]]:
        """(the entry this sequence extends or a new one, the entry evicted to make room or None)."""
        for agent in self.entries.values():
            if agent.block_ids:
                first = first_block(agent).tokens
                if tuple(tokens[: len(first)]) == first or first[: len(tokens)] == tuple(tokens):
                    return agent, None
        evicted = None
        if len(self.entries) >= self.max_entries:
            evicted = next(iter(self.entries.values()))
        key = ANON_PREFIX + hashlib.sha256(np.asarray(tokens[:block_size], np.int32).tobytes()).hexdigest()
        return Agent(key, persistent=False), evicted


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
        persister: Optional[Persister] = None,
        durable_writes: bool = True,
        write_timeout_s: float = 30.0,
        max_anonymous: int = 32,
        store=None,
        disk_budget: int = 1 << 62,
        codec: Optional[ModelCodec] = None,
        branches: int = 4,
        decode: Optional[Callable[[list[int]], str]] = None,
    ):
        self.fingerprint = fingerprint
        self.n_layers = n_layers
        # Default: every layer plain 4-bit attention (the pool's unit tests build it like that).
        self.codec = codec or ModelCodec([Q4] * n_layers, bits, group_size)
        self.bits = bits
        self.group_size = group_size
        self.block_size = block_size
        self.hot_budget = hot_bytes
        self.max_branches = max(1, int(branches))
        self.decode = decode  # token ids -> text; enables matching across re-tokenization
        if persister is None and store is not None:
            persister = Persister(store, disk_budget=disk_budget)
        self.persister = persister
        self.store = persister.store if persister is not None else None
        if persister is not None:
            persister.on_erased = self._forget
        self.durable_writes = durable_writes
        self.write_timeout_s = write_timeout_s
        self.reader = (ThreadPoolExecutor(READER_THREADS, thread_name_prefix="vllm-mlx-persist-reader")
                       if persister is not None else None)
        # The hot-set restore reads on a thread of its own, one block at a time and only while no
        # request is served: a request's own reads and its prefill never share the CPU or the disk
        # with it, and never queue behind it on the readers.
        self.restorer = (ThreadPoolExecutor(1, thread_name_prefix="vllm-mlx-persist-restore")
                         if persister is not None else None)
        self._restore_stop = threading.Event()
        self._last_arrival = 0.0  # monotonic time of the last prefetch (a request's arrival)
        # Reads started when a request arrives (HTTP thread), consumed by lookup (worker thread).
        self._prefetch: "OrderedDict[str, tuple[Future, float]]" = OrderedDict()
        # Blocks of the most recently used agents read at start-up (restore_hot_set), most recent
        # first, with their file sizes: they count against hot_budget until used or dropped.
        self._restored: "OrderedDict[str, tuple[Future, int]]" = OrderedDict()
        self._restored_bytes = 0
        self._lock = threading.RLock()
        self.blocks: dict[str, Block] = {}
        self.refs: dict[str, int] = {}  # block id -> how many agents name it
        self._shared = 0  # blocks named by more than one agent (forks)
        self._orphans: dict[str, None] = {}  # hot blocks no owner counts (their owner let go)
        self.agents: "OrderedDict[str, Agent]" = OrderedDict()  # LRU order: oldest first
        self.anonymous = AnonymousCache(max_anonymous)
        self.hot_bytes = 0
        self._hot_agents = 0  # agents (persistent) with any block in memory
        self._inflight: dict[str, list] = {}  # request id -> [namespace, erased while in flight]
        self.fleet = None  # fleet.Fleet when a remote tier is configured (set by the backend)
        self.stats = dict.fromkeys(
            ["hits_hot", "hits_disk", "misses", "tokens_reused", "tokens_stored", "blocks_loaded",
             "blocks_prefetched", "blocks_restored", "bytes_loaded", "evicted_agents", "write_errors", "bad_blocks",
             "unsaved_blocks_dropped", "store_refused", "read_timeouts", "fork_hits", "tokens_from_parent",
             "branches_evicted", "text_matches", "tokens_matched_by_text"], 0)

    # ---- chains ---------------------------------------------------------------------------------

    def chain_ids(self, links: Links, tokens: Sequence[int]) -> list[str]:
        """The block ids `tokens` get on a chain seeded by `links` (see Branch)."""
        out: list[str] = []
        at = dict(links)
        prev: Optional[str] = None
        for i, start in enumerate(range(0, len(tokens), self.block_size)):
            prev = chain_prev(prev, i, at, self.fingerprint)
            bid = block_id(prev, tokens[start : start + self.block_size])
            out.append(bid)
            prev = bid
        return out

    def follows(self, prev: Optional[str], bid: str, tokens: Sequence[int]) -> bool:
        """Whether a block holding `tokens` is block `bid` of a chain continuing from `prev`: a block
        written for another model or agent, or one whose tokens were altered, never is, even when
        its file (or Redis value) is sound."""
        return prev is not None and 0 < len(tokens) <= self.block_size and block_id(prev, tokens) == bid

    def chain_prefix(self, branch: Branch, fetched: dict, held: Callable[[str], bool]) -> tuple[int, bool]:
        """How many leading blocks of `branch` (e.g. one fetched from the fleet) can be used, and
        whether the first that cannot was refused (its tokens do not follow the chain) rather than
        missing. `fetched`: block id -> BlockData, checked here; `held(bid)`: blocks already on the
        local disk, checked when read (`_walk`), as every disk block is."""
        at = dict(branch.links)
        prev: Optional[str] = None
        for i, bid in enumerate(branch.block_ids):
            prev = chain_prev(prev, i, at, self.fingerprint)
            data = fetched.get(bid)
            if data is not None:
                if not self.follows(prev, bid, data.tokens):
                    return i, True
            elif not held(bid):
                return i, False
            prev = bid
        return len(branch.block_ids), False

    def _is_prefix(self, branch: Branch, tokens: Sequence[int]) -> bool:
        """Whether `tokens` continue `branch` (the branch then adds nothing to them)."""
        return (branch.n_tokens <= len(tokens)
                and self.chain_ids(branch.links, tokens[: branch.n_tokens]) == branch.block_ids)

    # ---- start-up -------------------------------------------------------------------------------

    def load_manifests(self) -> int:
        """Register every agent found on disk (cold: blocks are read on first use); returns count."""
        if self.persister is None:
            return 0
        with self._lock:
            for m in sorted(self.persister.load(), key=lambda m: m.updated_at, reverse=True):
                if m.namespace in self.agents:
                    continue
                agent = Agent(m.namespace, pinned=m.pinned, last_used=m.updated_at)
                branches = [Branch(list(b["block_ids"]), b["n_tokens"],
                                   tuple((int(i), ns) for i, ns in b.get("links") or [(0, m.namespace)]),
                                   m.updated_at)
                            for b in (m.branches or [{"block_ids": m.block_ids, "n_tokens": m.n_tokens}])]
                for bid in dict.fromkeys(b for br in branches for b in br.block_ids):
                    self.blocks.setdefault(bid, Block(bid, (), None, BlockState.COLD))
                self._set_branches(agent, branches)
                self.agents[m.namespace] = agent
                self.agents.move_to_end(m.namespace, last=False)  # disk agents are the coldest
            return len(self.agents)

    def restore_hot_set(self) -> Optional[Future]:
        """After a restart, read the most recently used agents' blocks, in the order they were last
        used, up to `hot_budget` bytes, on the restore thread (numpy only): their first turns then
        find them in memory instead of on disk. Returns at once (the restore's future, for tests)."""
        if self.persister is None or self.hot_budget <= 0:
            return None
        with self._lock:
            plan = [bid for a in reversed(self.agents.values()) for bid in a.ids
                    if bid in self.blocks and self.blocks[bid].layers is None]
            self._restore_stop.set()  # a restore still running (a second call) stops
            self._restore_stop = stop = threading.Event()
        try:
            return self.restorer.submit(self._restore, list(dict.fromkeys(plan)), stop)
        except RuntimeError:  # closing
            return None

    def _restore(self, plan: list[str], stop: threading.Event) -> None:
        """(restore thread) Read `plan`'s blocks one by one while their sizes fit the budget, each
        once the server is idle (`_idle`), until `stop` is set (clear, close)."""
        for bid in plan:
            size = self.store.block_file_size(bid)
            while not self._idle():
                if stop.wait(RESTORE_IDLE_S / 4):
                    return
            with self._lock:
                if stop.is_set():
                    return
                if size == 0 or bid in self._restored or bid not in self.blocks or self.blocks[bid].layers is not None:
                    continue
                if self.hot_bytes + self._restored_bytes + size > self.hot_budget:
                    return
                future: Future = Future()
                future.set_running_or_notify_cancel()  # started: a lookup now waits for it, never repeats it
                self._restored[bid] = (future, size)
                self._restored_bytes += size
            try:
                future.set_result(self.store.read_block(bid))
            except BaseException as e:  # read_block returns None for a bad file; this is a bug or a dying thread
                future.set_exception(e)

    def _idle(self) -> bool:
        """No request in flight, and none arrived in the last RESTORE_IDLE_S (one may be on its way
        from arrival to its lookup)."""
        return not self._inflight and time.monotonic() - self._last_arrival >= RESTORE_IDLE_S

    def _drop_restored(self, bid: str) -> Optional[Future]:
        entry = self._restored.pop(bid, None)
        if entry is None:
            return None
        self._restored_bytes -= entry[1]
        return entry[0]

    # ---- lookup ---------------------------------------------------------------------------------

    def prefetch(self, namespace: str) -> int:
        """Start reading `namespace`'s cold blocks on the reader threads; returns how many.

        Called from the HTTP thread as a request arrives, so the disk read overlaps the decode steps
        the worker runs before it gets to this request's lookup. No MLX here. Results wait at most
        PREFETCH_TTL_S for their lookup, and at most PREFETCH_MAX_BLOCKS of them.
        """
        if self.reader is None:
            return 0
        with self._lock:
            self._last_arrival = time.monotonic()
            agent = self.agents.get(namespace)
            self._expire_prefetch()
            if agent is None:
                return 0
            return self._read_ahead(agent.ids)  # the most recently used branch's first

    def pending_reads(self, namespaces: Sequence[str]) -> list[Future]:
        """The reads still running for these agents' blocks (read-ahead and hot-set restore); any thread."""
        out = []
        with self._lock:
            for ns in namespaces:
                agent = self.agents.get(ns)
                for bid in agent.ids if agent is not None else ():
                    entry = self._prefetch.get(bid) or self._restored.get(bid)
                    if entry is not None and not entry[0].done():
                        out.append(entry[0])
        return out

    def _read_ahead(self, block_ids: Sequence[str]) -> int:
        """Start reading the cold blocks among `block_ids` (lock held), within PREFETCH_MAX_BLOCKS."""
        started, now = 0, time.monotonic()
        for bid in block_ids:
            block = self.blocks.get(bid)
            if (block is not None and block.layers is None and bid not in self._prefetch
                    and bid not in self._restored):  # else read (or being read) by the hot-set restore
                if len(self._prefetch) >= PREFETCH_MAX_BLOCKS:
                    break
                try:
                    self._prefetch[bid] = (self.reader.submit(self.store.read_block, bid), now)
                except RuntimeError:  # shutting down
                    break
                started += 1
        return started

    def _expire_prefetch(self) -> None:
        cutoff = time.monotonic() - PREFETCH_TTL_S
        while self._prefetch:
            bid, (future, t) = next(iter(self._prefetch.items()))
            if t > cutoff:
                break
            future.cancel()
            del self._prefetch[bid]

    def lookup(self, namespace: Optional[str], prompt: Sequence[int],
               request_id: Optional[str] = None, fork_from: Optional[str] = None) -> tuple[Optional[list], int, str]:
        """(per-layer cache list or None, tokens covered, tier): `match` without the details."""
        m = self.match(namespace, prompt, request_id, fork_from)
        return m.cache, m.num_tokens, m.tier

    def match(self, namespace: Optional[str], prompt: Sequence[int], request_id: Optional[str] = None,
              fork_from: Optional[str] = None, wait_fleet: bool = True) -> Match:
        """Longest reusable prefix of `prompt` for `namespace` (None: anonymous).

        Every branch of the agent is a candidate, and with `fork_from` every branch of that agent
        too (the child then starts from the parent's prefix, by reference). With a `decode`
        function, a match that stops where the stored tokens and the prompt differ but decode to
        the same text goes on past it; `Match.prompt` is then the prompt as the stored tokens.
        At least one prompt token is always left to prefill; recurrent models stop at their last
        state checkpoint. With `request_id`, the request counts as in flight until
        `finish(request_id)`: the disk budget never erases its agent meanwhile.
        """
        if self.fleet is not None and namespace is not None:
            self.fleet.wait(namespace, wait_fleet)  # bounded; outside the lock, which a fetch from Redis needs
        prompt = [int(t) for t in prompt]
        with self._lock:
            if request_id is not None and namespace is not None:
                self._inflight[request_id] = [namespace, False, 0]  # + tokens its lookup reused
                if self.persister is not None:
                    self.persister.begin_use(namespace)
            if namespace is None:
                agent = self.anonymous.find(prompt, self._first_block)
            else:
                agent = self.agents.get(namespace)
            parent = self.agents.get(fork_from) if fork_from and namespace and fork_from != namespace else None
            if (agent is None and parent is None) or len(prompt) <= 1:
                self.stats["misses"] += 1
                return Match(None, 0, "miss")
            if agent is None:  # a new child: what it reads is charged to its parent until it commits
                agent = Agent(namespace)
            candidates = [(agent, br) for br in reversed(agent.branches)]
            if parent is not None:
                candidates += [(parent, br) for br in reversed(parent.branches)]
            registered = agent.namespace in self.agents or not agent.persistent
            charged = agent if registered else parent
            best, best_n = None, -1
            # Branches tied on tokens may differ after a re-tokenized stretch: each tied one is
            # matched by text too, and the longest wins (own branches first, most recent first).
            for src, branch, used, from_disk in self._best(charged, candidates, prompt):
                replaced = None
                if self.decode is not None:
                    replaced, used, disk2 = self._match_text(charged, branch, prompt, used)
                    from_disk = from_disk or disk2
                n = sum(c for _, c in used)
                if n > best_n:
                    best, best_n = (src, branch, used, from_disk, replaced), n
            if best is None:
                self.stats["misses"] += 1
                return Match(None, 0, "miss")
            src, branch, used, from_disk, replaced = best
            covered_tokens = sum(n for _, n in used)
            if covered_tokens:
                branch.last_used = time.time()
                if src is agent and any(b is branch for b in agent.branches):  # now the most recent
                    agent.branches.remove(branch)
                    agent.branches.append(branch)
            for bid in list(agent.ids) + (list(parent.ids) if parent is not None else []):
                entry = self._prefetch.pop(bid, None)  # read-ahead this lookup did not need
                if entry is not None:
                    entry[0].cancel()
            if registered:
                self._touch(agent)
            self._enforce_budget(keep=agent.namespace)
            cache, covered = (self.codec.build([(b.layers, n) for b, n in used], _whole(used))
                              if used else (None, 0))
            if covered == 0:
                self.stats["misses"] += 1
                return Match(None, 0, "miss")
            if request_id is not None and request_id in self._inflight:
                self._inflight[request_id][2] = covered
            tier = "disk" if from_disk else "hot"
            self.stats["hits_disk" if from_disk else "hits_hot"] += 1
            self.stats["tokens_reused"] += covered
            forked = src is not agent
            if forked:
                self.stats["fork_hits"] += 1
                self.stats["tokens_from_parent"] += covered
            return Match(cache, covered, tier, replaced, forked)

    def _best(self, agent: Agent, candidates: list, prompt: list[int]) -> list:
        """[(source agent, branch, blocks used, read from disk)] of the longest token matches.

        Candidates are ranked by how many whole blocks match by id (hashing the prompt, no reads);
        only the best-ranked ones are walked (and read, if cold), the partial block deciding.
        """
        if not candidates:
            return []
        ids_by_links: dict = {}
        ranked = []
        for src, br in candidates:
            if br.links not in ids_by_links:
                ids_by_links[br.links] = self.chain_ids(br.links, prompt)
            ranked.append((_common(ids_by_links[br.links], br.block_ids), src, br))
        top = max(k for k, _, _ in ranked)
        walked = []
        for k, src, br in ranked:
            if k == top:
                used, from_disk = self._walk(agent, br, prompt, len(prompt) - 1)
                walked.append((sum(c for _, c in used), src, br, used, from_disk))
        most = max(w[0] for w in walked)
        return [w[1:] for w in walked if w[0] == most]  # in candidate order

    def _walk(self, agent: Agent, branch: Branch, prompt: Sequence[int], limit: int,
              ) -> tuple[list[tuple[Block, int]], bool]:
        """Walk `branch` against `prompt`: the blocks used and how many tokens of each. Blocks read
        from disk are charged to `agent` (the one being served)."""
        covered, used, from_disk = 0, [], False
        at = dict(branch.links)
        prev: Optional[str] = None
        run: list[tuple[Block, BlockData]] = []  # consecutive blocks read here, converted together
        for i, bid in enumerate(list(branch.block_ids)):
            prev = chain_prev(prev, i, at, self.fingerprint)
            block = self.blocks.get(bid)
            if block is None:
                break
            data = None
            if block.layers is None:
                if not from_disk and self.reader is not None:
                    # the blocks this prompt can still use are read in parallel while this thread
                    # checks the first ones (no request's prefetch started them)
                    self._expire_prefetch()
                    self._read_ahead(branch.block_ids[i : i + -(-(limit - covered) // self.block_size)])
                data = self._read_block(block)
                if data is None:
                    self._cut_block(bid)  # unreadable: re-cached from here on the next turn
                    break
                from_disk = True
            elif run:  # a hot block between read ones ends the run
                self._convert(agent, run)
                run = []
            # The id chain is seeded with this model and agent: a block written for another model
            # or agent, or one whose tokens were altered, cannot match even if its file is sound.
            if not self.follows(prev, bid, block.tokens):
                self.stats["bad_blocks"] += 1
                self._cut_agent(agent, bid)  # only this agent's: the block may be another's, and sound
                if bid not in self.refs and self.persister is not None:
                    # nobody names it now: moved aside, on the writer so before any rewrite of it
                    self.persister.quarantine_block(bid, "its tokens do not follow the agent's chain")
                break
            if data is not None:
                run.append((block, data))
            elif block.owner is None:
                self._adopt(agent, block)
            prev = bid
            n = min(_lcp(block.tokens, prompt[covered : covered + len(block.tokens)]), limit - covered)
            if n <= 0:
                break
            used.append((block, n))
            covered += n
            if n < len(block.tokens):
                break
        if run:
            self._convert(agent, run)
        return used, from_disk

    # ---- matching across re-tokenization --------------------------------------------------------

    def _match_text(self, agent: Agent, branch: Branch, prompt: list[int], used: list):
        """Go on past token mismatches that decode to the same text (a reply re-tokenized).

        Returns (replacement prompt or None, blocks used, read from disk). The replacement is the
        branch's stored tokens up to the realigned point followed by the rest of the prompt, so the
        request is then served, exactly, as a prompt of the tokens the cache holds.
        """
        replaced, from_disk = None, False
        for _ in range(TEXT_MATCH_MAX_REALIGN):
            k = sum(n for _, n in used)
            if k >= len(prompt) - 1 or k >= branch.n_tokens:
                break  # the prompt is used up to its last token, or the branch is
            stored, disk = self._branch_tokens(agent, branch, k + TEXT_MATCH_WINDOW)
            from_disk = from_disk or disk
            if len(stored) <= k or prompt[k] == stored[k]:
                break  # the walk stopped for another reason (the limit, a checkpoint)
            pair = _align(stored, prompt, k, self.decode)
            if pair is None:
                break
            i, j = pair
            new_prompt = stored[: k + i] + prompt[k + j :]
            new_used, disk = self._walk(agent, branch, new_prompt, len(new_prompt) - 1)
            from_disk = from_disk or disk
            if sum(n for _, n in new_used) <= k:
                break
            self.stats["text_matches"] += 1
            self.stats["tokens_matched_by_text"] += i
            prompt, used, replaced = new_prompt, new_used, new_prompt
        return replaced, used, from_disk

    def _branch_tokens(self, agent: Agent, branch: Branch, upto: int) -> tuple[list[int], bool]:
        """The branch's stored tokens up to about `upto` (blocks read as needed)."""
        out: list[int] = []
        from_disk = False
        for bid in branch.block_ids:
            if len(out) >= upto:
                break
            block = self.blocks.get(bid)
            if block is None:
                break
            if block.layers is None:
                data = self._read_block(block)
                if data is None:
                    break
                self._convert(agent, [(block, data)])
                from_disk = True
            out.extend(block.tokens)
        return out, from_disk

    def _first_block(self, agent: Agent) -> Block:
        return self.blocks[agent.block_ids[0]]

    def _read_block(self, block: Block) -> Optional[BlockData]:
        """The block's data from disk (a read-ahead's or the restore's read, else one started now),
        checked, its tokens set; None when it cannot be used."""
        if self.store is None:
            return None
        entry = self._prefetch.pop(block.block_id, None)
        restored = self._drop_restored(block.block_id)
        if entry is not None:
            self.stats["blocks_prefetched"] += 1
            future = entry[0]
        elif restored is not None:
            self.stats["blocks_restored"] += 1
            future = restored
        else:
            future = self.reader.submit(self.store.read_block, block.block_id)
        try:
            data = future.result(READ_TIMEOUT_S)
        except FutureTimeout:
            self.stats["read_timeouts"] += 1
            log.warning("reading block %s took over %.0f s; served as a miss", block.block_id[:16], READ_TIMEOUT_S)
            return None
        except Exception as e:  # CancelledError, a reader that died: a miss
            log.warning("reading block %s failed: %s", block.block_id[:16], e)
            return None
        if data is None or not self._valid(data):
            self.stats["bad_blocks"] += 1
            return None
        block.tokens = tuple(int(t) for t in data.tokens)
        return data

    def _convert(self, agent: Agent, run: list[tuple[Block, BlockData]]) -> None:
        """Bring consecutive blocks read from disk into memory, charged to `agent`: one MLX import
        per token array for the whole run (codec.from_numpy_run), each block holding views of it."""
        layers, whole = self.codec.from_numpy_run([(d.arrays, d.dtypes) for _, d in run])
        together, start = Run(whole, [b for b, _ in run]), 0
        for (block, _), arrays in zip(run, layers):
            self._set_layers(block, arrays, agent, (together, start))
            start += len(block.tokens)
            block.state = BlockState.DURABLE
            self.stats["blocks_loaded"] += 1
            self.stats["bytes_loaded"] += block.nbytes

    def _valid(self, data: BlockData) -> bool:
        n = len(data.tokens)
        return 0 < n <= self.block_size and self.codec.valid(data.arrays, n)

    # ---- store ----------------------------------------------------------------------------------

    def commit(self, namespace: Optional[str], tokens: Sequence[int], cache: list,
               request_id: Optional[str] = None, fork_from: Optional[str] = None) -> int:
        """`commit_async`, then (with durable writes) wait up to `write_timeout_s` for the disk.
        Returns the number of tokens now cached."""
        n, future = self.commit_async(namespace, tokens, cache, request_id, fork_from)
        if future is not None and self.durable_writes:
            try:
                if not future.result(self.write_timeout_s):
                    log.warning("agent %r kept in memory only for now: its write failed", namespace)
            except FutureTimeout:
                log.warning("agent %r: write not durable after %.0f s; going on", namespace, self.write_timeout_s)
        return n

    def commit_async(self, namespace: Optional[str], tokens: Sequence[int], cache: list,
                     request_id: Optional[str] = None, fork_from: Optional[str] = None,
                     ) -> tuple[int, Optional[Future]]:
        """Make `namespace`'s cache cover `tokens` (prompt + output) from an extracted cache.

        The cache must cover `tokens`, or all but the last (generated, never fed back) token;
        anything else is refused (0 tokens): a cache is never stored under tokens it does not
        cover. The sequence becomes the agent's most recently used branch; branches it continues
        are replaced by it, and beyond `branches` the least recently used one goes. Blocks the
        agent already holds (or, with `fork_from`, the parent's whole blocks the sequence starts
        with) are kept by reference; only new blocks are sliced, kept hot and handed to the
        persister. Returns (tokens now cached, the save's future: True once the turn is durable,
        False if it failed; None when nothing is written).
        """
        offset = self.codec.length(cache)
        if not 0 <= len(tokens) - offset <= 1:
            with self._lock:
                self.stats["store_refused"] += 1
            log.warning("not caching agent %r: the cache covers %d tokens, the sequence has %d",
                        namespace, offset, len(tokens))
            return 0, None
        n_valid = offset
        tokens = [int(t) for t in tokens[:n_valid]]
        if n_valid == 0:
            return 0, None
        if self.persister is not None:
            # Back-pressure: wait for room in the write queue before taking the lock (the writer
            # may need the lock for an erasure's callback).
            self.persister.wait_for_room(self.write_timeout_s)
        with self._lock:
            inflight = self._inflight.get(request_id) if request_id is not None else None
            if inflight is not None and inflight[1]:
                return 0, None  # the agent was erased while this request ran: its turn must not bring it back
            _, future = self._commit_locked(namespace, tokens, cache, fork_from, inflight[2] if inflight else 0)
        return n_valid, future

    def _links_for(self, agent: Agent, tokens: list[int], fork_from: Optional[str]) -> Links:
        """How the chain of `tokens` is seeded: along the agent's branch sharing the most blocks
        with it, or the fork parent's if that shares more whole blocks; re-seeded with the agent's
        namespace where its own blocks begin."""
        best: Links = ()
        d = 0
        for br in agent.branches:
            k = _common(self.chain_ids(br.links, tokens), br.block_ids)
            if k > d:
                best, d = br.links, k
        parent = self.agents.get(fork_from) if fork_from and fork_from != agent.namespace else None
        if parent is not None and agent.persistent:
            full = len(tokens) // self.block_size
            for br in parent.branches:
                k = min(_common(self.chain_ids(br.links, tokens), br.block_ids),
                        full, br.n_tokens // self.block_size)  # whole blocks only
                if k > d:
                    best, d = br.links, k
        links = tuple((i, ns) for i, ns in best if i < d)
        if not links or links[-1][1] != agent.namespace:
            links += ((d, agent.namespace),)
        return links

    def _commit_locked(self, namespace: Optional[str], tokens: list[int], cache: list,
                       fork_from: Optional[str] = None, reused: int = 0):
        """`reused`: the tokens the request's lookup took from this agent's blocks; the cache holds
        them bit for bit, so the blocks holding only those become views of it too."""
        n_valid = len(tokens)
        if namespace is None:
            agent, evicted = self.anonymous.slot(tokens, self._first_block, self.block_size)
            if evicted is not None:
                self._drop_anonymous(evicted)
        else:
            agent = self.agents.get(namespace)
            if agent is None:  # registered first, so the blocks charged to it count it as hot
                agent = self.agents[namespace] = Agent(namespace)
        checkpoints = self.codec.live_checkpoints(cache, n_valid) + self._old_checkpoints(agent, tokens)
        links = self._links_for(agent, tokens, fork_from)
        new_ids = self.chain_ids(links, tokens)
        new_blocks = []
        # A block that is missing or only on disk (possibly unreadable) is rebuilt from the cache we
        # hold anyway; the writer skips files that are already valid. A block another agent names is
        # never rebuilt: shared blocks are never modified. A hot block holding only tokens the lookup
        # reused holds the cache's own bytes (the lookup copied them from it).
        plan = []
        for i, bid in enumerate(new_ids):
            start = i * self.block_size
            chunk = tuple(tokens[start : start + self.block_size])
            block = self.blocks.get(bid)
            others = self.refs.get(bid, 0) - (bid in agent.ids)
            if block is None or (block.layers is None and others <= 0):
                plan.append((start, chunk, bid, block, "new"))
            elif block.layers is not None and others <= 0 and start + len(chunk) <= reused:
                plan.append((start, chunk, bid, block, "same"))
            else:
                plan.append((start, chunk, bid, block, "keep"))
        # When every block can, the turn's blocks are views of the cache's arrays (one Run), so the
        # next lookup takes them whole instead of concatenating; the Run's bytes are then exactly
        # its members'. Otherwise (a fork's shared prefix) new blocks are copies, as they were.
        run = None
        if all(what != "keep" for *_, what in plan):
            arrays = self.codec.token_arrays(cache)
            run = Run({n: mx.contiguous(a[..., :n_valid, :]) for n, a in arrays.items()}, [])
        for start, chunk, bid, block, what in plan:
            if what == "new":
                kv = self.codec.slice(cache, start, start + len(chunk), checkpoints, run.arrays if run else None)
                if block is None:
                    block = self.blocks[bid] = Block(bid, chunk, None)
                block.tokens = chunk
                block.state = BlockState.PENDING  # rewritten; the store skips a file already valid
                new_blocks.append(block)
            elif what == "same" and run is not None:
                kv = {**{n: a for n, a in block.layers.items() if n not in run.arrays},
                      **{n: a[..., start : start + len(chunk), :] for n, a in run.arrays.items()}}
            else:
                continue
            self._set_layers(block, kv, agent, (run, start) if run is not None else None)
            if run is not None:
                run.members.append(block)
        if new_blocks:
            mx.eval([a for b in new_blocks for a in b.layers.values()])
        limit = self.max_branches if agent.persistent else 1
        kept = [br for br in agent.branches if not self._is_prefix(br, tokens)]
        kept.append(Branch(new_ids, n_valid, links))
        if len(kept) > limit:
            self.stats["branches_evicted"] += len(kept) - limit
            kept = kept[-limit:]
        dead = self._set_branches(agent, kept)
        if agent.persistent:
            self.agents[agent.namespace] = agent
        else:
            self.anonymous.entries[agent.namespace] = agent
        self._touch(agent)
        self.stats["tokens_stored"] += n_valid
        future = None
        if agent.persistent and self.persister is not None:
            # Every unsaved block the manifest will name, in any branch (a failed earlier turn's blocks
            # too): the manifest is written only after all of them are durable.
            pending = [self.blocks[b] for b in agent.ids if b in self.blocks
                       and self.blocks[b].state == BlockState.PENDING and self.blocks[b].layers is not None]
            future = self._save(agent, pending, dead)
        self._enforce_budget(keep=agent.namespace)
        return agent, future

    def _old_checkpoints(self, agent: Agent, tokens: list[int]) -> list:
        """Recurrent-state checkpoints in the agent's hot blocks that still lie on `tokens`, so that
        rebuilding the block holding one (a grown tail) carries it over."""
        if not self.codec.has_state:
            return []
        out = []
        for br in agent.branches:
            start = 0
            for bid in br.block_ids:
                block = self.blocks.get(bid)
                if block is None or block.layers is None:
                    break
                n = len(block.tokens)
                ok = _lcp(block.tokens, tokens[start : start + n])
                out += [(p, s) for p, s in self.codec.block_checkpoints(block.layers, start) if p - start <= ok]
                if ok < n:
                    break
                start += n
        return list({p: (p, s) for p, s in out}.values())

    def _save(self, agent: Agent, blocks: list[Block], dead: list[str]) -> Future:
        datas = [_to_numpy(b, self.codec) for b in blocks]  # MLX -> numpy here, on the worker thread
        manifest = self._manifest(agent)
        stats = self.stats

        def on_durable() -> None:  # writer thread: a state flag per block, and a queued upload
            for b in blocks:
                if b.state == BlockState.PENDING:
                    b.state = BlockState.DURABLE
            if self.fleet is not None:
                self.fleet.saved(manifest, datas)

        def count_failure(f: Future) -> None:
            if f.cancelled() or f.exception() is not None or not f.result():
                stats["write_errors"] += 1

        future = self.persister.save(manifest, datas, dead, on_durable)
        future.add_done_callback(count_failure)
        return future

    def _manifest(self, agent: Agent) -> Manifest:
        return self._manifest_of(agent.namespace, agent.branches, agent.pinned)

    @staticmethod
    def _manifest_of(namespace: str, branches: list[Branch], pinned: bool) -> Manifest:
        """An agent's manifest: every block it names (newest branch first), and its branches when
        they are more than one plain chain (so manifests of agents that never fork or branch read
        as before)."""
        ids = list(dict.fromkeys(b for br in reversed(branches) for b in br.block_ids))
        plain = len(branches) == 1 and branches[0].links == ((0, namespace),)
        listed = None if plain else [
            {"block_ids": list(br.block_ids), "n_tokens": br.n_tokens, "links": [list(l) for l in br.links]}
            for br in branches]
        return Manifest(namespace, ids, branches[-1].n_tokens if branches else 0, time.time(), pinned,
                        branches=listed)

    # ---- agents: admin API ----------------------------------------------------------------------

    def finish(self, request_id: str) -> None:
        """The request is done (completed or aborted): its agent is no longer in use by it."""
        with self._lock:
            entry = self._inflight.pop(request_id, None)
            if entry is not None and self.persister is not None:
                self.persister.end_use(entry[0])

    def agent_info(self, namespace: str) -> Optional[dict]:
        """What the pool knows of an agent, or None if it has none."""
        with self._lock:
            agent = self.agents.get(namespace)
            if agent is None:
                return None
            n_blocks = len(agent.ids)
            hot = sum(1 for b in agent.ids if b in self.blocks and self.blocks[b].layers is not None)
            info = {
                "id": agent.namespace,
                "tokens": agent.n_tokens,
                "blocks": n_blocks,
                "blocks_hot": hot,
                "bytes_hot": agent.hot_bytes,
                "tier": "hot" if hot == n_blocks else ("disk" if hot == 0 else "partial"),
                "pinned": agent.pinned,
                "last_used": agent.last_used,
                "branches": [br.n_tokens for br in reversed(agent.branches)],  # most recent first
                "shared_blocks": sum(1 for b in agent.ids if self.refs.get(b, 0) > 1),
                "forked_from": sorted({ns for br in agent.branches for _, ns in br.links} - {namespace}),
            }
        if self.fleet is not None:
            info["remote"] = self.fleet.agent_info(namespace)
        info["bytes_disk"] = self.persister.agent_disk_bytes(namespace) if self.persister is not None else 0
        return info

    def list_agents(self, limit: int, after: Optional[str] = None) -> tuple[list[dict], bool]:
        """One page of agents ordered by id: up to `limit` whose ids sort after `after`, and whether
        more follow. Id order keeps pages stable while agents are used (recency would reshuffle them)."""
        with self._lock:
            names = sorted(n for n in self.agents if after is None or n > after)
        page = [i for i in map(self.agent_info, names[:limit]) if i is not None]
        return page, len(names) > limit

    def erase(self, namespace: str, timeout: Optional[float] = 60.0, fleet_wide: bool = True) -> bool:
        """Forget an agent in memory and on disk (durable when this returns); False if unknown.

        A request of the agent still running when this is called will not store its turn. Blocks
        its forks share stay, in memory and on disk, as long as a fork names them. With a fleet
        tier and `fleet_wide`, the agent is then erased from Redis too (queued).
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

    def set_pinned(self, namespace: str, pinned: bool, timeout: Optional[float] = 60.0) -> bool:
        """Pin (exempt from hot eviction, the disk budget and the TTL) or unpin; False if unknown."""
        with self._lock:
            agent = self.agents.get(namespace)
            if agent is None:
                return False
            agent.pinned = pinned
            future = self.persister.set_pinned(namespace, pinned) if self.persister is not None else None
        if future is not None:
            future.result(timeout)
        return True

    def _forget(self, namespace: str) -> bool:
        """Drop an agent from memory (any thread; also the persister's erasure callback)."""
        with self._lock:
            agent = self.agents.get(namespace)
            if agent is None:
                return False
            for bid in self._set_branches(agent, []):  # every block it owned is dropped or orphaned
                entry = self._prefetch.pop(bid, None)
                if entry is not None:
                    entry[0].cancel()
                restored = self._drop_restored(bid)
                if restored is not None:
                    restored.cancel()
            del self.agents[namespace]
            return True

    # ---- fleet: histories fetched from Redis (see fleet.py) ---------------------------------------

    def branch_state(self, namespace: str) -> Optional[tuple]:
        """The agent's branches as ((block ids), tokens, links), least recently used first (the last
        is the most recent; () when every branch was cut), or None if unknown; any thread."""
        with self._lock:
            agent = self.agents.get(namespace)
            return None if agent is None else tuple((tuple(br.block_ids), br.n_tokens, br.links)
                                                    for br in agent.branches)

    def save_fetched(self, namespace: str, fetched: list[Branch], blocks: list[BlockData], expect,
                     on_done) -> Optional[Future]:
        """Save a history fetched from the fleet (`fetched`: its branches, least recently used
        first; `blocks`: those the local disk lacks) merged with the agent's local branches (see
        `_merge_fetched`), and once durable make it the agent's branches with COLD blocks, provided
        the agent is still as `expect` (branch_state before the fetch). `on_done(manifest or None)`
        runs on the persister thread, in order with every other write. None when the agent changed."""
        with self._lock:  # commits queue their saves under the lock too: the order is the pool's
            if self.persister is None or self.branch_state(namespace) != expect:
                return None
            agent = self.agents.get(namespace)
            branches = self._merge_fetched(agent.branches if agent is not None else [], fetched)
            manifest = self._manifest_of(namespace, branches, agent is not None and agent.pinned)

            def on_durable() -> None:  # persister thread; on_done must not raise
                try:
                    adopted = self._adopt_fetched(namespace, branches, expect)
                except Exception:
                    log.exception("agent %r: registering its fetched history failed", namespace)
                    adopted = False
                on_done(manifest if adopted else None)

            return self.persister.save(manifest, blocks, [], on_durable)

    def _merge_fetched(self, local: list[Branch], fetched: list[Branch]) -> list[Branch]:
        """The agent's branches once a longer history is fetched: the fetched branches become the
        most recent (the conversation went on there), after the local branches none of them
        continues; the `branches` most recent are kept. A fetched branch continues a local one when
        it names all of its blocks but a partial tail (a tail the other server grew)."""
        def continued(br: Branch) -> bool:
            whole = br.n_tokens == len(br.block_ids) * self.block_size
            head = br.block_ids if whole else br.block_ids[:-1]
            return any(f.n_tokens >= br.n_tokens and f.block_ids[: len(head)] == head for f in fetched)

        return ([br for br in local if not continued(br)] + list(fetched))[-self.max_branches:]

    def _adopt_fetched(self, namespace: str, branches: list[Branch], expect) -> bool:
        """Give the agent its merged branches with COLD blocks (blocks still hot stay hot)."""
        with self._lock:
            if self.branch_state(namespace) != expect:
                return False  # a turn, an erasure or a cut since: the pool's own state stands
            agent = self.agents.get(namespace)
            if agent is None:
                agent = self.agents[namespace] = Agent(namespace)
            for br in branches:
                for bid in br.block_ids:
                    self.blocks.setdefault(bid, Block(bid, (), None, BlockState.COLD))
            self._set_branches(agent, branches)
            self._touch(agent)
            return True

    # ---- references and memory ------------------------------------------------------------------

    def _set_branches(self, agent: Agent, branches: list[Branch]) -> list[str]:
        """Give `agent` these branches, moving references; returns the ids of blocks no agent
        names any more (dropped from memory; their files go once no manifest names them)."""
        ids = dict.fromkeys(b for br in reversed(branches) for b in br.block_ids)  # newest first
        dead = []
        for bid in ids:
            if bid not in agent.ids:
                self._ref(bid)
        for bid in agent.ids:
            if bid in ids:
                continue
            block = self.blocks.get(bid)
            if self._unref(bid):
                dead.append(bid)
                if block is not None:
                    self._set_layers(block, None)
                    self.blocks.pop(bid, None)
            elif block is not None and block.owner is agent:
                self._orphan(block)
        agent.branches, agent.ids = branches, ids
        return dead

    def _ref(self, bid: str) -> None:
        n = self.refs.get(bid, 0) + 1
        self.refs[bid] = n
        self._shared += n == 2

    def _unref(self, bid: str) -> bool:
        """Drop one reference; True when the block is now unreferenced."""
        n = self.refs[bid] - 1
        self._shared -= n == 1
        if n == 0:
            del self.refs[bid]
            return True
        self.refs[bid] = n
        return False

    def _charge(self, agent: Agent, delta: int) -> None:
        before = agent.hot_bytes
        agent.hot_bytes += delta
        if agent.persistent and self.agents.get(agent.namespace) is agent:
            self._hot_agents += (agent.hot_bytes > 0) - (before > 0)

    def _set_layers(self, block: Block, layers: Optional[dict], agent: Optional[Agent] = None,
                    run: Optional[tuple[Run, int]] = None) -> None:
        """Bring a block's arrays into memory (charged to `agent`) or drop them (None)."""
        before, left = block.nbytes, block.run
        if block.owner is not None:
            self._charge(block.owner, -before)
        elif block.layers is not None:
            self._orphans.pop(block.block_id, None)
        delta = block.set_layers(layers, run)
        self.hot_bytes += delta
        block.owner = agent if layers is not None else None
        if block.owner is not None:
            self._charge(block.owner, block.nbytes)
        elif layers is not None:
            self._orphans[block.block_id] = None
        if left is not None:  # its views no longer hold the run's arrays, the other members' still do
            left[0].members = [b for b in left[0].members if b is not block]
            if left[0].members and before:
                heir = left[0].members[0]
                heir.nbytes += before
                self.hot_bytes += before
                if heir.owner is not None:
                    self._charge(heir.owner, before)

    def _orphan(self, block: Block) -> None:
        """The block's owner no longer names it, but another agent does: still hot, counted by none."""
        if block.owner is not None:
            self._charge(block.owner, -block.nbytes)
        block.owner = None
        if block.layers is not None:
            self._orphans[block.block_id] = None

    def _adopt(self, agent: Agent, block: Block) -> None:
        if block.layers is not None and block.owner is None:
            self._orphans.pop(block.block_id, None)
            block.owner = agent
            self._charge(agent, block.nbytes)

    def _touch(self, agent: Agent) -> None:
        agent.last_used = time.time()
        if agent.persistent:
            self.agents.move_to_end(agent.namespace)
            if self.persister is not None:
                self.persister.touch(agent.namespace)
        elif agent.namespace in self.anonymous.entries:
            self.anonymous.entries.move_to_end(agent.namespace)

    def _cut_block(self, bid: str) -> None:
        """Cut every branch naming `bid` (unreadable, refused or unsaved) at it, for every agent:
        they are re-cached from there on their next turn instead of tripping over it forever."""
        for agent in [a for a in list(self.agents.values()) + list(self.anonymous.entries.values())
                      if bid in a.ids]:
            self._cut_agent(agent, bid)

    def _cut_agent(self, agent: Agent, bid: str) -> None:
        branches = []
        for br in agent.branches:
            if bid in br.block_ids:
                br = cut_branch(br, br.block_ids.index(bid), self.block_size)
            if br.block_ids:
                branches.append(br)
        self._set_branches(agent, branches)

    def _drop_anonymous(self, agent: Agent) -> None:
        self.anonymous.entries.pop(agent.namespace, None)
        self._set_branches(agent, [])
        self.stats["evicted_agents"] += 1

    def _evict(self, agent: Agent) -> None:
        """Take an agent out of memory: DURABLE blocks it owns go COLD, PENDING ones (a write that
        has not succeeded) are dropped with the rest of their branches, so memory stays bounded on
        a failing disk. Blocks other agents own stay (counted by them)."""
        self.stats["evicted_agents"] += 1
        if not agent.persistent:
            self._drop_anonymous(agent)
            return
        if self.persister is None:  # no disk tier: nothing to come back from
            self._forget(agent.namespace)
            return
        pending = [b for b in agent.ids if b in self.blocks and self.blocks[b].owner is agent
                   and self.blocks[b].state == BlockState.PENDING]
        for bid in pending:
            if bid in agent.ids:
                before = len(agent.ids)
                self._cut_agent(agent, bid)
                dropped = before - len(agent.ids)
                self.stats["unsaved_blocks_dropped"] += dropped
                log.warning("agent %r: %d unsaved block(s) left memory uncached", agent.namespace, dropped)
        for bid in agent.ids:
            block = self.blocks.get(bid)
            if block is not None and block.owner is agent:
                self._set_layers(block, None)
                block.state = BlockState.COLD

    def _evict_orphans(self) -> bool:
        """Drop hot blocks no agent counts (least recently orphaned first); False if none."""
        if not self._orphans:
            return False
        while self._orphans and self.hot_bytes > self.hot_budget:
            bid = next(iter(self._orphans))
            block = self.blocks.get(bid)
            if block is None:
                self._orphans.pop(bid, None)
                continue
            if block.state == BlockState.PENDING:
                self.stats["unsaved_blocks_dropped"] += 1
                self._cut_block(bid)
                block = self.blocks.get(bid)
            if block is not None:
                self._set_layers(block, None)
                block.state = BlockState.COLD
            self._orphans.pop(bid, None)
        return True

    def _enforce_budget(self, keep: Optional[str] = None) -> None:
        """Evict least recently used agents (anonymous entries and unpinned agents), then hot
        blocks nobody counts, until the hot tier fits `hot_budget`; `keep` (the agent being
        served) is spared. Restored-but-unused blocks count too and go first, least recent first."""
        while self._restored and self.hot_bytes + self._restored_bytes > self.hot_budget:
            self._drop_restored(next(reversed(self._restored))).cancel()
        while self.hot_bytes > self.hot_budget:
            victim = None
            for agent in self.anonymous.entries.values():
                if agent.namespace != keep:
                    victim = agent
                    break
            for agent in self.agents.values():
                if agent.namespace != keep and agent.hot_bytes and not agent.pinned:
                    if victim is None or agent.last_used < victim.last_used:
                        victim = agent
                    break
            if victim is None:
                self._evict_orphans()
                return
            self._evict(victim)

    def clear(self) -> None:
        """Drop everything from memory; durable agents stay on disk and come back on demand."""
        self.flush()
        with self._lock:
            for agent in list(self.anonymous.entries.values()):
                self._drop_anonymous(agent)
            for agent in list(self.agents.values()):
                self._evict(agent)
            for bid in list(self._orphans):
                block = self.blocks.get(bid)
                if block is not None and block.state != BlockState.PENDING:
                    self._set_layers(block, None)
                    block.state = BlockState.COLD
            for future, _ in self._prefetch.values():
                future.cancel()
            self._prefetch.clear()
            self._restore_stop.set()
            for bid in list(self._restored):
                self._drop_restored(bid).cancel()

    def flush(self, timeout: Optional[float] = None) -> None:
        if self.persister is not None:
            self.persister.flush(timeout)

    def close(self) -> None:
        with self._lock:
            for future, _ in self._prefetch.values():
                future.cancel()
            self._prefetch.clear()
            self._restore_stop.set()
            for bid in list(self._restored):
                self._drop_restored(bid).cancel()
        if self.persister is not None:
            self.persister.close()
            self.reader.shutdown(wait=False, cancel_futures=True)
            self.restorer.shutdown(wait=False, cancel_futures=True)

    def snapshot(self) -> dict:
        """Counters for /v1/status, /health and /metrics: O(1), no disk access, any thread."""
        out = {
            **self.stats,
            "agents": len(self.agents),
            "agents_hot": self._hot_agents,
            "agents_in_flight": len(self._inflight),
            "anonymous_entries": len(self.anonymous.entries),
            "blocks": len(self.blocks),
            "shared_blocks": self._shared,
            "hot_bytes": self.hot_bytes,
            "hot_budget_bytes": self.hot_budget,
            "prefetch_pending": len(self._prefetch),
            "restored_pending": len(self._restored),
            "restored_bytes": self._restored_bytes,
        }
        if self.persister is not None:
            p = self.persister.stats()
            out.update(p)
            out["blocks_written"] = p["blocks_written"]
            out["bytes_written"] = p["bytes_written"]
        return out


TEXT_MATCH_WINDOW = 256  # tokens past a mismatch searched for the same text
TEXT_MATCH_MAX_REALIGN = 4  # mismatches matched by text per lookup, at most
TEXT_MATCH_CONTEXT = 8  # tokens decoded before the mismatch, so both sides decode in the same context


def _whole(used: list[tuple[Block, int]]) -> Optional[dict]:
    """The run's token arrays when the used blocks are, in order, the start of one run read
    together (Block.run), else None."""
    first = used[0][0].run
    if first is None or first[1] != 0:
        return None
    start = 0
    for block, _ in used:
        if block.run is None or block.run[0] is not first[0] or block.run[1] != start:
            return None
        start += len(block.tokens)
    return first[0].arrays


def _align(stored: list[int], prompt: list[int], k: int,
           decode: Callable[[list[int]], str]) -> Optional[tuple[int, int]]:
    """Where `stored` and `prompt` (equal before `k`, different at `k`) decode to the same text
    again: (i, j) with decode(stored[:k+i]) == decode(prompt[:k+j]), or None.

    Preferred: the first such point where the tokens agree again (the walk then goes on); else the
    furthest one into `stored` (the stored run is used up to there). Both texts are grown token by
    token, the shorter first, and the search stops as soon as one is no longer a prefix of the
    other, so a real difference costs a couple of decodes. Decoding starts a few tokens before `k`,
    so both sides see the same left context (leading-space rules); a text ending in an incomplete
    character (U+FFFD) never counts as equal.
    """
    c = max(0, k - TEXT_MATCH_CONTEXT)
    max_i = min(TEXT_MATCH_WINDOW, len(stored) - k)
    max_j = min(TEXT_MATCH_WINDOW, len(prompt) - k - 1)  # the prompt's last token is never matched
    i = j = 1
    if max_i < 1 or max_j < 1:
        return None
    ts, tp = decode(stored[c : k + i]), decode(prompt[c : k + j])
    furthest = None
    while True:
        if ts == tp and not ts.endswith("\ufffd"):
            if k + i < len(stored) and stored[k + i] == prompt[k + j]:
                return i, j
            furthest = (i, j)
            if i == max_i or j == max_j:
                return furthest
            i, j = i + 1, j + 1
            ts, tp = decode(stored[c : k + i]), decode(prompt[c : k + j])
            continue
        short, long_ = (ts, tp) if len(ts) <= len(tp) else (tp, ts)
        if not long_.startswith(short.rstrip("\ufffd")):
            return furthest  # the texts differ for good
        if len(ts) <= len(tp) and i < max_i:
            i += 1
            ts = decode(stored[c : k + i])
        elif len(tp) < len(ts) and j < max_j:
            j += 1
            tp = decode(prompt[c : k + j])
        else:
            return furthest
