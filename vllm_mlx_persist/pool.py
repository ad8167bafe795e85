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
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Optional, Sequence

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


class BlockState(enum.Enum):
    PENDING = "pending"  # hot, write not yet durable
    DURABLE = "durable"  # hot and on disk
    COLD = "cold"  # on disk only


@dataclass
class Block:
    block_id: str
    tokens: tuple[int, ...]
    layers: Optional[dict]  # name -> mx.array (see caches.codec); None while COLD
    state: BlockState = BlockState.PENDING
    nbytes: int = 0  # bytes in memory; fixed when the layers are set, so readers never sum arrays

    def set_layers(self, layers: Optional[dict]) -> int:
        """Set (or drop, with None) the in-memory arrays; returns the change in bytes."""
        before = self.nbytes
        self.layers = layers
        self.nbytes = 0 if layers is None else sum(a.nbytes for a in layers.values())
        return self.nbytes - before


@dataclass
class Agent:
    namespace: str
    block_ids: list[str] = field(default_factory=list)
    n_tokens: int = 0
    hot_bytes: int = 0
    pinned: bool = False
    last_used: float = field(default_factory=time.time)
    persistent: bool = True  # anonymous entries live in memory only


def chain_seed(fingerprint: str, namespace: str) -> str:
    """First link of an agent's block chain: blocks never match across agents or models."""
    return hashlib.sha256(f"{fingerprint}\n{namespace}".encode()).hexdigest()


def block_id(prev_id: str, tokens: Sequence[int]) -> str:
    h = hashlib.sha256(bytes.fromhex(prev_id))
    h.update(np.asarray(tokens, dtype=np.int32).tobytes())
    return h.hexdigest()


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if tuple(a[:n]) == tuple(b[:n]):
        return n
    i = 0
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
    ):
        self.fingerprint = fingerprint
        self.n_layers = n_layers
        # Default: every layer plain 4-bit attention (the pool's unit tests build it like that).
        self.codec = codec or ModelCodec([Q4] * n_layers, bits, group_size)
        self.bits = bits
        self.group_size = group_size
        self.block_size = block_size
        self.hot_budget = hot_bytes
        if persister is None and store is not None:
            persister = Persister(store, disk_budget=disk_budget)
        self.persister = persister
        self.store = persister.store if persister is not None else None
        if persister is not None:
            persister.on_erased = self._forget
        self.durable_writes = durable_writes
        self.write_timeout_s = write_timeout_s
        self.reader = (ThreadPoolExecutor(2, thread_name_prefix="vllm-mlx-persist-reader")
                       if persister is not None else None)
        # Reads started when a request arrives (HTTP thread), consumed by lookup (worker thread).
        self._prefetch: "OrderedDict[str, tuple[Future, float]]" = OrderedDict()
        self._lock = threading.RLock()
        self.blocks: dict[str, Block] = {}
        self.refs: dict[str, int] = {}
        self.agents: "OrderedDict[str, Agent]" = OrderedDict()  # LRU order: oldest first
        self.anonymous = AnonymousCache(max_anonymous)
        self.hot_bytes = 0
        self._hot_agents = 0  # agents (persistent) with any block in memory
        self._inflight: dict[str, list] = {}  # request id -> [namespace, erased while in flight]
        self.fleet = None  # fleet.Fleet when a remote tier is configured (set by the backend)
        self.stats = dict.fromkeys(
            ["hits_hot", "hits_disk", "misses", "tokens_reused", "tokens_stored", "blocks_loaded",
             "blocks_prefetched", "bytes_loaded", "evicted_agents", "write_errors", "bad_blocks",
             "unsaved_blocks_dropped", "store_refused", "read_timeouts"], 0)

    # ---- start-up -------------------------------------------------------------------------------

    def load_manifests(self) -> int:
        """Register every agent found on disk (cold: blocks are read on first use); returns count."""
        if self.persister is None:
            return 0
        with self._lock:
            for m in sorted(self.persister.load(), key=lambda m: m.updated_at, reverse=True):
                if m.namespace in self.agents:
                    continue
                agent = Agent(m.namespace, list(m.block_ids), m.n_tokens, pinned=m.pinned, last_used=m.updated_at)
                for bid in agent.block_ids:
                    self._ref(bid)
                    self.blocks.setdefault(bid, Block(bid, (), None, BlockState.COLD))
                self.agents[m.namespace] = agent
                self.agents.move_to_end(m.namespace, last=False)  # disk agents are the coldest
            return len(self.agents)

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
            agent = self.agents.get(namespace)
            self._expire_prefetch()
            if agent is None:
                return 0
            started, now = 0, time.monotonic()
            for bid in agent.block_ids:
                block = self.blocks.get(bid)
                if block is not None and block.layers is None and bid not in self._prefetch:
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
               request_id: Optional[str] = None) -> tuple[Optional[list], int, str]:
        """Longest reusable prefix of `prompt` for `namespace` (None: anonymous).

        Returns (per-layer cache list or None, tokens covered, tier). At least one prompt token is
        always left to prefill; recurrent models stop at their last state checkpoint. With `request_id`, the request counts as in flight until
        `finish(request_id)`: the disk budget never erases its agent meanwhile.
        """
        if self.fleet is not None and namespace is not None:
            self.fleet.wait(namespace)  # bounded; outside the lock, which a fetch from Redis needs
        with self._lock:
            if request_id is not None and namespace is not None:
                self._inflight[request_id] = [namespace, False]
                if self.persister is not None:
                    self.persister.begin_use(namespace)
            limit = len(prompt) - 1
            if namespace is None:
                agent = self.anonymous.find(prompt, self._first_block)
            else:
                agent = self.agents.get(namespace)
            if agent is None or limit <= 0:
                self.stats["misses"] += 1
                return None, 0, "miss"
            used, from_disk = self._match(agent, prompt, limit)
            for bid in agent.block_ids:  # read-ahead this lookup did not need
                entry = self._prefetch.pop(bid, None)
                if entry is not None:
                    entry[0].cancel()
            self._touch(agent)
            self._enforce_budget(keep=agent.namespace)
            cache, covered = self.codec.build([(b.layers, n) for b, n in used]) if used else (None, 0)
            if covered == 0:
                self.stats["misses"] += 1
                return None, 0, "miss"
            tier = "disk" if from_disk else "hot"
            self.stats["hits_disk" if from_disk else "hits_hot"] += 1
            self.stats["tokens_reused"] += covered
            return cache, covered, tier

    def _match(self, agent: Agent, prompt: Sequence[int], limit: int) -> tuple[list[tuple[Block, int]], bool]:
        """Walk the agent's chain against `prompt`: the blocks used and how many tokens of each."""
        covered, used, from_disk = 0, [], False
        prev = chain_seed(self.fingerprint, agent.namespace)
        for i, bid in enumerate(agent.block_ids):
            block = self.blocks.get(bid)
            if block is None:
                break
            if block.layers is None:
                if not self._load_block(agent, block):
                    self._cut_chain(agent, i)  # unreadable: re-cached from here on the next turn
                    break
                from_disk = True
            # The id chain is seeded with this model and agent: a block written for another model
            # or agent, or one whose tokens were altered, cannot match even if its file is sound.
            if block_id(prev, block.tokens) != bid:
                self._refuse_block(agent, i)
                break
            prev = bid
            n = min(_lcp(block.tokens, prompt[covered : covered + len(block.tokens)]), limit - covered)
            if n <= 0:
                break
            used.append((block, n))
            covered += n
            if n < len(block.tokens):
                break
        return used, from_disk

    def _refuse_block(self, agent: Agent, i: int) -> None:
        """Forget a sound block file whose tokens do not chain (forged, or another agent's), with the
        rest of `agent`'s chain after it, so the agent's next turn caches past it instead of being
        refused on every turn. Its file is quarantined unless another agent still names it."""
        self.stats["bad_blocks"] += 1
        bid = agent.block_ids[i]
        unshared = self.refs.get(bid) == 1
        self._cut_chain(agent, i)
        if unshared and self.persister is not None:  # on the writer: ordered before any rewrite of bid
            self.persister.quarantine_block(bid, "its tokens do not follow the agent's chain")

    def _first_block(self, agent: Agent) -> Block:
        return self.blocks[agent.block_ids[0]]

    def _load_block(self, agent: Agent, block: Block) -> bool:
        if self.store is None:
            return False
        entry = self._prefetch.pop(block.block_id, None)
        if entry is not None:
            self.stats["blocks_prefetched"] += 1
            future = entry[0]
        else:
            future = self.reader.submit(self.store.read_block, block.block_id)
        try:
            data = future.result(READ_TIMEOUT_S)
        except FutureTimeout:
            self.stats["read_timeouts"] += 1
            log.warning("reading block %s took over %.0f s; served as a miss", block.block_id[:16], READ_TIMEOUT_S)
            return False
        except Exception as e:  # CancelledError, a reader that died: a miss
            log.warning("reading block %s failed: %s", block.block_id[:16], e)
            return False
        if data is None or not self._valid(data):
            self.stats["bad_blocks"] += 1
            return False
        block.tokens = tuple(int(t) for t in data.tokens)
        self._add_hot(agent, block.set_layers(self.codec.from_numpy(data.arrays, data.dtypes)))
        block.state = BlockState.DURABLE
        self.stats["blocks_loaded"] += 1
        self.stats["bytes_loaded"] += block.nbytes
        return True

    def _valid(self, data: BlockData) -> bool:
        n = len(data.tokens)
        return 0 < n <= self.block_size and self.codec.valid(data.arrays, n)

    # ---- store ----------------------------------------------------------------------------------

    def commit(self, namespace: Optional[str], tokens: Sequence[int], cache: list,
               request_id: Optional[str] = None) -> int:
        """Make `namespace`'s cache cover `tokens` (prompt + output) from an extracted cache.

        The cache must cover `tokens`, or all but the last (generated, never fed back) token;
        anything else is refused (returns 0): a cache is never stored under tokens it does not
        cover. Blocks the agent already holds are kept; only new blocks are sliced, kept hot and
        written. Returns the number of tokens now cached.
        """
        offset = self.codec.length(cache)
        if not 0 <= len(tokens) - offset <= 1:
            with self._lock:
                self.stats["store_refused"] += 1
            log.warning("not caching agent %r: the cache covers %d tokens, the sequence has %d",
                        namespace, offset, len(tokens))
            return 0
        n_valid = offset
        tokens = [int(t) for t in tokens[:n_valid]]
        if n_valid == 0:
            return 0
        if self.persister is not None:
            # Wait for room in the write queue before taking the lock (the writer may need it).
            self.persister.wait_for_room(self.write_timeout_s)
        with self._lock:
            inflight = self._inflight.get(request_id) if request_id is not None else None
            if inflight is not None and inflight[1]:
                return 0  # the agent was erased while this request ran: its turn must not bring it back
            agent, future = self._commit_locked(namespace, tokens, cache)
        if future is not None and self.durable_writes:
            try:  # outside the lock: the writer may need it (an erasure's callback)
                if not future.result(self.write_timeout_s):
                    log.warning("agent %r kept in memory only for now: its write failed", agent.namespace)
            except FutureTimeout:
                log.warning("agent %r: write not durable after %.0f s; going on", agent.namespace,
                            self.write_timeout_s)
        return n_valid

    def _commit_locked(self, namespace: Optional[str], tokens: list[int], cache: list):
        n_valid = len(tokens)
        if namespace is None:
            agent, evicted = self.anonymous.slot(tokens, self._first_block, self.block_size)
            if evicted is not None:
                self._drop_anonymous(evicted)
        else:
            agent = self.agents.get(namespace) or Agent(namespace)
        checkpoints = self.codec.live_checkpoints(cache, n_valid) + self._old_checkpoints(agent, tokens)
        new_ids, new_blocks = [], []
        prev = chain_seed(self.fingerprint, agent.namespace)
        for start in range(0, n_valid, self.block_size):
            chunk = tuple(tokens[start : start + self.block_size])
            bid = block_id(prev, chunk)
            # A block that is missing or only on disk (possibly unreadable) is rebuilt from the
            # cache we hold anyway; the writer skips files that are already valid.
            block = self.blocks.get(bid)
            if block is None or block.layers is None:
                kv = self.codec.slice(cache, start, start + len(chunk), checkpoints)
                if block is None:
                    block = self.blocks[bid] = Block(bid, chunk, None)
                block.tokens = chunk
                block.state = BlockState.PENDING  # rewritten; the store skips a file already valid
                self._add_hot(agent, block.set_layers(kv))
                new_blocks.append(block)
            new_ids.append(bid)
            prev = bid
        if new_blocks:
            mx.eval([a for b in new_blocks for a in b.layers.values()])
        old_ids = agent.block_ids
        for bid in new_ids:
            self._ref(bid)
        agent.block_ids, agent.n_tokens = new_ids, n_valid
        dead = [bid for bid in old_ids if self._unref(bid)]
        for bid in dead:
            block = self.blocks.pop(bid, None)
            if block is not None and bid not in new_ids:
                self._add_hot(agent, -block.nbytes)
        if agent.persistent:
            self.agents[agent.namespace] = agent
        else:
            self.anonymous.entries[agent.namespace] = agent
        self._touch(agent)
        self.stats["tokens_stored"] += n_valid
        future = None
        if agent.persistent and self.persister is not None:
            future = self._save(agent, [self.blocks[b] for b in new_ids if self.blocks[b].state == BlockState.PENDING],
                                dead)
        self._enforce_budget(keep=agent.namespace)
        return agent, future

    def _old_checkpoints(self, agent: Agent, tokens: list[int]) -> list:
        """Recurrent-state checkpoints in the agent's hot blocks that still lie on `tokens`, so that
        rebuilding the block holding one (a grown tail) carries it over."""
        if not self.codec.has_state:
            return []
        out, start = [], 0
        for bid in agent.block_ids:
            block = self.blocks.get(bid)
            if block is None or block.layers is None:
                break
            n = len(block.tokens)
            ok = _lcp(block.tokens, tokens[start : start + n])
            out += [(p, s) for p, s in self.codec.block_checkpoints(block.layers, start) if p - start <= ok]
            if ok < n:
                break
            start += n
        return out

    def _save(self, agent: Agent, blocks: list[Block], dead: list[str]) -> Future:
        datas = [_to_numpy(b, self.codec) for b in blocks]  # MLX -> numpy here, on the worker thread
        manifest = Manifest(agent.namespace, list(agent.block_ids), agent.n_tokens, time.time(), agent.pinned)
        stats = self.stats

        def on_durable() -> None:  # writer thread: a state flag per block, and a queued upload
            for b in blocks:
                if b.state == BlockState.PENDING:
                    b.state = BlockState.DURABLE
            if self.fleet is not None:
                self.fleet.saved(manifest, datas)

        def count_failure(f: Future) -> None:
            if f.exception() is not None or not f.result():
                stats["write_errors"] += 1

        future = self.persister.save(manifest, datas, dead, on_durable)
        future.add_done_callback(count_failure)
        return future

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
            n_blocks = len(agent.block_ids)
            hot = sum(1 for b in agent.block_ids if b in self.blocks and self.blocks[b].layers is not None)
            info = {
                "id": agent.namespace,
                "tokens": agent.n_tokens,
                "blocks": n_blocks,
                "blocks_hot": hot,
                "bytes_hot": agent.hot_bytes,
                "tier": "hot" if hot == n_blocks else ("disk" if hot == 0 else "partial"),
                "pinned": agent.pinned,
                "last_used": agent.last_used,
            }
        if self.fleet is not None:
            info["remote"] = self.fleet.agent_info(namespace)
        info["bytes_disk"] = self.persister.agent_disk_bytes(namespace) if self.persister is not None else 0
        return info

    def list_agents(self) -> list[dict]:
        with self._lock:
            names = list(self.agents)
        return [i for i in map(self.agent_info, reversed(names)) if i is not None]

    def erase(self, namespace: str, timeout: Optional[float] = 60.0, fleet_wide: bool = True) -> bool:
        """Forget an agent in memory and on disk (durable when this returns); False if unknown.

        A request of the agent still running when this is called will not store its turn. With a
        fleet tier and `fleet_wide`, the agent is then erased from Redis too (queued).
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
            agent = self.agents.pop(namespace, None)
            if agent is None:
                return False
            if agent.hot_bytes:
                self._hot_agents -= 1
            for bid in agent.block_ids:
                if self._unref(bid):
                    block = self.blocks.pop(bid, None)
                    if block is not None:
                        self.hot_bytes -= block.nbytes
                    entry = self._prefetch.pop(bid, None)
                    if entry is not None:
                        entry[0].cancel()
            return True

    # ---- fleet: histories fetched from Redis (see fleet.py) ---------------------------------------

    def chain_state(self, namespace: str) -> Optional[tuple[tuple[str, ...], int]]:
        """(block ids, tokens) of an agent, or None if unknown; any thread."""
        with self._lock:
            agent = self.agents.get(namespace)
            return None if agent is None else (tuple(agent.block_ids), agent.n_tokens)

    def save_fetched(self, manifest: Manifest, blocks: list[BlockData], expect, on_done) -> Optional[Future]:
        """Save a history fetched from the fleet (its blocks the local disk lacks, then its manifest)
        and, once durable, make it the agent's chain with COLD blocks, provided the agent is still
        as `expect` (chain_state before the fetch). `on_done(manifest or None)` runs on the persister
        thread, in order with every other write. None when the agent changed meanwhile."""
        with self._lock:  # commits queue their saves under the lock too: the order is the pool's
            if self.persister is None or self.chain_state(manifest.namespace) != expect:
                return None

            def on_durable() -> None:  # persister thread; on_done must not raise
                try:
                    adopted = self._adopt(manifest, expect)
                except Exception:
                    log.exception("agent %r: registering its fetched history failed", manifest.namespace)
                    adopted = None
                on_done(adopted)

            return self.persister.save(manifest, blocks, [], on_durable)

    def _adopt(self, m: Manifest, expect) -> Optional[Manifest]:
        with self._lock:
            if self.chain_state(m.namespace) != expect:
                return None  # a turn, an erasure or a cut since: the pool's own state stands
            agent = self.agents.get(m.namespace)
            if agent is None:
                agent = self.agents[m.namespace] = Agent(m.namespace)
            old = agent.block_ids
            for bid in m.block_ids:
                self._ref(bid)
                self.blocks.setdefault(bid, Block(bid, (), None, BlockState.COLD))
            agent.block_ids, agent.n_tokens = list(m.block_ids), m.n_tokens
            for bid in old:
                if self._unref(bid):
                    block = self.blocks.pop(bid, None)
                    if block is not None:
                        self._add_hot(agent, -block.nbytes)
            self._touch(agent)
            return m

    # ---- memory ---------------------------------------------------------------------------------

    def _touch(self, agent: Agent) -> None:
        agent.last_used = time.time()
        if agent.persistent:
            self.agents.move_to_end(agent.namespace)
            if self.persister is not None:
                self.persister.touch(agent.namespace)
        elif agent.namespace in self.anonymous.entries:
            self.anonymous.entries.move_to_end(agent.namespace)

    def _add_hot(self, agent: Agent, delta: int) -> None:
        """Account `delta` bytes of `agent`'s blocks entering (or leaving) memory."""
        if not delta:
            return
        before = agent.hot_bytes
        agent.hot_bytes += delta
        self.hot_bytes += delta
        if agent.persistent:
            self._hot_agents += (agent.hot_bytes > 0) - (before > 0)

    def _ref(self, bid: str) -> None:
        self.refs[bid] = self.refs.get(bid, 0) + 1

    def _unref(self, bid: str) -> bool:
        """Drop one reference; True when the block is now unreferenced."""
        self.refs[bid] -= 1
        if self.refs[bid] == 0:
            del self.refs[bid]
            return True
        return False

    def _cut_chain(self, agent: Agent, i: int) -> None:
        """Drop the agent's blocks from position `i` on (unreadable, refused or unsaved): the
        agent is re-cached from there on its next turn instead of tripping over them forever."""
        for bid in agent.block_ids[i:]:
            if self._unref(bid):
                block = self.blocks.pop(bid, None)
                if block is not None:
                    self._add_hot(agent, -block.nbytes)
        agent.block_ids = agent.block_ids[:i]
        agent.n_tokens = min(agent.n_tokens, i * self.block_size)  # only the last block can be partial

    def _drop_anonymous(self, agent: Agent) -> None:
        self.anonymous.entries.pop(agent.namespace, None)
        for bid in agent.block_ids:
            if self._unref(bid):
                block = self.blocks.pop(bid, None)
                if block is not None:
                    self.hot_bytes -= block.nbytes
        self.stats["evicted_agents"] += 1

    def _evict(self, agent: Agent) -> None:
        """Take an agent out of memory: DURABLE blocks go COLD, PENDING ones (a write that has
        not succeeded) are dropped with the rest of the chain, so memory stays bounded on a
        failing disk."""
        self.stats["evicted_agents"] += 1
        if not agent.persistent:
            self._drop_anonymous(agent)
            return
        if self.persister is None:  # no disk tier: nothing to come back from
            self._forget(agent.namespace)
            return
        for i, bid in enumerate(agent.block_ids):
            block = self.blocks.get(bid)
            if block is None:
                continue
            if block.state == BlockState.PENDING:
                dropped = len(agent.block_ids) - i
                self.stats["unsaved_blocks_dropped"] += dropped
                log.warning("agent %r: %d unsaved block(s) left memory uncached", agent.namespace, dropped)
                self._cut_chain(agent, i)
                break
            if block.layers is not None:
                self._add_hot(agent, block.set_layers(None))
                block.state = BlockState.COLD

    def _enforce_budget(self, keep: Optional[str] = None) -> None:
        """Evict least recently used agents (anonymous entries and unpinned agents) until the hot
        tier fits `hot_budget`; `keep` (the agent being served) is spared."""
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
            for future, _ in self._prefetch.values():
                future.cancel()
            self._prefetch.clear()

    def flush(self, timeout: Optional[float] = None) -> None:
        if self.persister is not None:
            self.persister.flush(timeout)

    def close(self) -> None:
        with self._lock:
            for future, _ in self._prefetch.values():
                future.cancel()
            self._prefetch.clear()
        if self.persister is not None:
            self.persister.close()
            self.reader.shutdown(wait=False, cancel_futures=True)

    def snapshot(self) -> dict:
        """Counters for /v1/status, /health and /metrics: O(1), no disk access, any thread."""
        out = {
            **self.stats,
            "agents": len(self.agents),
            "agents_hot": self._hot_agents,
            "agents_in_flight": len(self._inflight),
            "anonymous_entries": len(self.anonymous.entries),
            "blocks": len(self.blocks),
            "hot_bytes": self.hot_bytes,
            "hot_budget_bytes": self.hot_budget,
            "prefetch_pending": len(self._prefetch),
        }
        if self.persister is not None:
            p = self.persister.stats()
            out.update(p)
            out["blocks_written"] = p["blocks_written"]
            out["bytes_written"] = p["bytes_written"]
        return out
