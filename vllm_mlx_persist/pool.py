"""Per-agent pool of 4-bit KV blocks: chained block ids, agents, the hot LRU and the disk tier.

Runs on vllm-mlx's worker thread (it does MLX work); disk I/O is handed to `store.Writer`.

A block holds `block_size` consecutive tokens (the last block of an agent may be a partial tail)
for all layers: per layer the six arrays (keys packed/scales/biases, values packed/scales/biases),
each shaped (1, n_kv_heads, n_tokens, .). 4-bit packing runs along the head dimension, so slicing
and concatenating along the token axis is exact.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from .q4cache import Q4KVCache
from .store import BlockData, DiskStore, Manifest, StoreWriteError, Writer

log = logging.getLogger("vllm_mlx_persist.pool")

LayerKV = tuple  # (kq, ks, kb, vq, vs, vb)
_PARTS = ("k.q", "k.s", "k.b", "v.q", "v.s", "v.b")
# numpy has no bfloat16: such arrays travel to and from disk as raw 16-bit views.
_RAW16 = {mx.bfloat16: "bfloat16"}
ANON_PREFIX = "\x00anon:"  # valid agent ids cannot start with NUL, so anonymous entries never collide


@dataclass
class Block:
    block_id: str
    tokens: tuple[int, ...]
    layers: Optional[list[LayerKV]]  # None while the block lives only on disk
    durable: bool = False

    @property
    def nbytes(self) -> int:
        if self.layers is None:
            return 0
        return sum(a.nbytes for layer in self.layers for a in layer)


@dataclass
class Agent:
    namespace: str
    block_ids: list[str] = field(default_factory=list)
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


def _to_numpy(block: Block) -> BlockData:
    arrays, dtypes = {}, {}
    for l, layer in enumerate(block.layers):
        for part, a in zip(_PARTS, layer):
            name = f"{l}.{part}"
            if a.dtype in _RAW16:
                dtypes[name] = _RAW16[a.dtype]
                a = a.view(mx.uint16)
            arrays[name] = np.array(a)
    return BlockData(block.block_id, np.asarray(block.tokens, dtype=np.int32), arrays, dtypes)


def _from_numpy(data: BlockData, n_layers: int) -> list[LayerKV]:
    layers = []
    for l in range(n_layers):
        parts = []
        for part in _PARTS:
            name = f"{l}.{part}"
            a = mx.array(data.arrays[name])
            if data.dtypes.get(name) == "bfloat16":
                a = a.view(mx.bfloat16)
            parts.append(a)
        layers.append(tuple(parts))
    return layers


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
        store: Optional[DiskStore],
        durable_writes: bool = True,
        max_anonymous: int = 32,
    ):
        self.fingerprint = fingerprint
        self.n_layers = n_layers
        self.bits = bits
        self.group_size = group_size
        self.block_size = block_size
        self.hot_budget = hot_bytes
        self.store = store
        self.durable_writes = durable_writes
        self.max_anonymous = max_anonymous
        self.writer = Writer() if store is not None else None
        # Reads started when a request arrives (HTTP thread), consumed by lookup (worker thread).
        self.reader = Writer("vllm-mlx-persist-reader") if store is not None else None
        self._prefetch: dict[str, Future] = {}
        self.blocks: dict[str, Block] = {}
        self.refs: dict[str, int] = {}
        self.agents: "OrderedDict[str, Agent]" = OrderedDict()  # LRU order: oldest first
        self.hot_bytes = 0
        self.stats = dict.fromkeys(
            ["hits_hot", "hits_disk", "misses", "tokens_reused", "tokens_stored", "blocks_written",
             "bytes_written", "blocks_loaded", "blocks_prefetched", "bytes_loaded", "evicted_agents", "write_errors",
             "bad_blocks"], 0)

    # ---- start-up -------------------------------------------------------------------------------

    def load_manifests(self) -> int:
        """Register every agent found on disk (cold: blocks are read on first use); returns count."""
        if self.store is None:
            return 0
        for m in self.store.list_manifests():
            if m.namespace in self.agents:
                continue
            agent = Agent(m.namespace, list(m.block_ids))
            for bid in agent.block_ids:
                self._ref(bid)
                self.blocks.setdefault(bid, Block(bid, (), None, durable=True))
            self.agents[m.namespace] = agent
            self.agents.move_to_end(m.namespace, last=False)  # disk agents are the coldest
        removed = self.store.gc(set(self.blocks))
        if removed:
            log.info("removed %d unreferenced block files", removed)
        return len(self.agents)

    # ---- lookup ---------------------------------------------------------------------------------

    def prefetch(self, namespace: str) -> int:
        """Start reading `namespace`'s cold blocks on the reader thread; returns how many.

        Called from the HTTP thread as a request arrives, so the disk read overlaps the decode steps
        the worker runs before it gets to this request's lookup. Only dict lookups and file reads
        happen here: no MLX. Racing a concurrent commit at worst reads a block nobody uses.
        """
        agent = self.agents.get(namespace)
        if agent is None or self.reader is None:
            return 0
        started = 0
        for bid in list(agent.block_ids):
            block = self.blocks.get(bid)
            if block is not None and block.layers is None and bid not in self._prefetch:
                self._prefetch[bid] = self.reader.submit(self.store.read_block, bid)
                started += 1
        return started

    def lookup(self, namespace: Optional[str], prompt: Sequence[int]) -> tuple[Optional[list], int, str]:
        """Longest reusable prefix of `prompt` for `namespace` (None: anonymous).

        Returns (per-layer Q4KVCache list or None, tokens covered, tier). At least one prompt
        token is always left to prefill.
        """
        limit = len(prompt) - 1
        agent = self._find_anonymous(prompt) if namespace is None else self.agents.get(namespace)
        if agent is None or limit <= 0:
            self.stats["misses"] += 1
            return None, 0, "miss"
        covered, used, from_disk = 0, [], False
        prev = chain_seed(self.fingerprint, agent.namespace)
        for bid in agent.block_ids:
            block = self.blocks.get(bid)
            if block is None:
                break
            if block.layers is None:
                if not self._load_block(block):
                    break
                from_disk = True
            # The id chain is seeded with this model and agent: a block written for another model
            # or agent, or one whose tokens were altered, cannot match even if its file is sound.
            if block_id(prev, block.tokens) != bid:
                self._refuse_block(agent, bid)
                break
            prev = bid
            n = _lcp(block.tokens, prompt[covered : covered + len(block.tokens)])
            n = min(n, limit - covered)
            if n <= 0:
                break
            used.append((block, n))
            covered += n
            if n < len(block.tokens):
                break
        for bid in agent.block_ids:  # reads this lookup did not need
            self._prefetch.pop(bid, None)
        self.agents.move_to_end(agent.namespace)
        self._enforce_budget(keep=agent.namespace)
        if covered == 0:
            self.stats["misses"] += 1
            return None, 0, "miss"
        tier = "disk" if from_disk else "hot"
        self.stats["hits_disk" if from_disk else "hits_hot"] += 1
        self.stats["tokens_reused"] += covered
        return self._build_cache(used), covered, tier

    def _refuse_block(self, agent: Agent, bid: str) -> None:
        """Forget a sound block file whose tokens do not chain (forged, or another agent's), with the
        rest of `agent`'s chain after it, so the agent's next turn caches past it instead of being
        refused on every turn. Its file is quarantined unless another agent still names it."""
        self.stats["bad_blocks"] += 1
        i = agent.block_ids.index(bid)
        dropped, agent.block_ids = agent.block_ids[i:], agent.block_ids[:i]
        dead = [b for b in dropped if self._unref(b)]
        for b in dropped:
            self._prefetch.pop(b, None)
        self._drop_blocks(dead, delete_files=False)
        if bid in dead and self.writer is not None:  # on the writer: ordered before any rewrite of bid
            self.writer.submit(self.store.quarantine_block, bid, "its tokens do not follow the agent's chain")

    def _find_anonymous(self, prompt: Sequence[int]) -> Optional[Agent]:
        best, best_n = None, 0
        for agent in self.agents.values():
            if agent.persistent or not agent.block_ids:
                continue
            first = self.blocks[agent.block_ids[0]]
            n = _lcp(first.tokens, prompt[: len(first.tokens)])
            if n > best_n:
                best, best_n = agent, n
        return best

    def _build_cache(self, used: list[tuple[Block, int]]) -> list[Q4KVCache]:
        caches = []
        for l in range(self.n_layers):
            parts = []
            for p in range(len(_PARTS)):
                pieces = [b.layers[l][p][..., :n, :] for b, n in used]
                parts.append(mx.concatenate(pieces, axis=2) if len(pieces) > 1 else mx.contiguous(pieces[0]))
            caches.append(Q4KVCache.from_arrays(tuple(parts[:3]), tuple(parts[3:]), self.bits, self.group_size))
        mx.eval([c.keys for c in caches], [c.values for c in caches])
        return caches

    def _load_block(self, block: Block) -> bool:
        if self.store is None:
            return False
        future = self._prefetch.pop(block.block_id, None)
        if future is not None:
            self.stats["blocks_prefetched"] += 1
            data = future.result()
        else:
            data = self.store.read_block(block.block_id)
        if data is None or not self._valid(data):
            self.stats["bad_blocks"] += 1
            return False
        block.tokens = tuple(int(t) for t in data.tokens)
        block.layers = _from_numpy(data, self.n_layers)
        self.hot_bytes += block.nbytes
        self.stats["blocks_loaded"] += 1
        self.stats["bytes_loaded"] += block.nbytes
        return True

    def _valid(self, data: BlockData) -> bool:
        n = len(data.tokens)
        if not 0 < n <= self.block_size:
            return False
        for l in range(self.n_layers):
            for part in _PARTS:
                a = data.arrays.get(f"{l}.{part}")
                if a is None or a.ndim != 4 or a.shape[0] != 1 or a.shape[2] != n:
                    return False
        return len(data.arrays) == self.n_layers * len(_PARTS)

    # ---- store ----------------------------------------------------------------------------------

    def commit(self, namespace: Optional[str], tokens: Sequence[int], cache: list) -> int:
        """Make `namespace`'s cache cover `tokens` (prompt + output) from an extracted cache.

        Blocks the agent already holds are kept; only new blocks are sliced, kept hot and written.
        Returns the number of tokens now cached.
        """
        layers = [c.to_arrays() for c in cache]
        n_valid = min(len(tokens), int(cache[0].offset))
        tokens = [int(t) for t in tokens[:n_valid]]
        if n_valid == 0:
            return 0
        if namespace is None:
            agent = self._anonymous_slot(tokens)
        else:
            agent = self.agents.get(namespace) or Agent(namespace)
        new_ids, new_blocks = [], []
        prev = chain_seed(self.fingerprint, agent.namespace)
        for start in range(0, n_valid, self.block_size):
            chunk = tuple(tokens[start : start + self.block_size])
            bid = block_id(prev, chunk)
            # A block that is missing or only on disk (possibly unreadable) is rebuilt from the
            # cache we hold anyway; the writer skips files that are already valid.
            if bid not in self.blocks or self.blocks[bid].layers is None:
                kv = [tuple(mx.contiguous(a[..., start : start + len(chunk), :]) for a in k + v) for k, v in layers]
                block = Block(bid, chunk, kv)
                self.blocks[bid] = block
                self.hot_bytes += block.nbytes
                new_blocks.append(block)
            new_ids.append(bid)
            prev = bid
        if new_blocks:
            mx.eval([a for b in new_blocks for layer in b.layers for a in layer])
        old_ids = agent.block_ids
        for bid in new_ids:
            self._ref(bid)
        agent.block_ids = new_ids
        self.agents[agent.namespace] = agent
        self.agents.move_to_end(agent.namespace)
        dead = [bid for bid in old_ids if self._unref(bid)]
        self.stats["tokens_stored"] += n_valid
        if agent.persistent and self.writer is not None:
            # blocks from an earlier failed write (full disk) are retried with the new ones
            pending = [self.blocks[bid] for bid in new_ids if not self.blocks[bid].durable]
            self._write(agent, pending, n_valid, dead)
        else:
            self._drop_blocks(dead, delete_files=False)
        self._enforce_budget(keep=agent.namespace)
        return n_valid

    def _anonymous_slot(self, tokens: list[int]) -> Agent:
        """The anonymous entry this sequence extends, or a new one (evicting the oldest past the cap)."""
        for agent in self.agents.values():
            if agent.persistent or not agent.block_ids:
                continue
            first = self.blocks[agent.block_ids[0]]
            if tuple(tokens[: len(first.tokens)]) == first.tokens or first.tokens[: len(tokens)] == tuple(tokens):
                return agent
        anon = [a for a in self.agents.values() if not a.persistent]
        if len(anon) >= self.max_anonymous:
            self._evict(anon[0])
        slot = ANON_PREFIX + hashlib.sha256(np.asarray(tokens[: self.block_size], np.int32).tobytes()).hexdigest()
        return Agent(slot, persistent=False)

    def _write(self, agent: Agent, blocks: list[Block], n_tokens: int, dead: list[str]) -> None:
        datas = [_to_numpy(b) for b in blocks]  # MLX -> numpy here, on the worker thread
        manifest = Manifest(agent.namespace, list(agent.block_ids), n_tokens, time.time())
        store, stats = self.store, self.stats

        def job() -> None:  # writer thread: files and flags only, no MLX
            try:
                sizes = [store.write_block(d) for d in datas]
                store.write_manifest(manifest)  # only after every block it names is durable
            except Exception:
                stats["write_errors"] += 1
                raise
            for b in blocks:
                b.durable = True
            stats["blocks_written"] += sum(1 for n in sizes if n)
            stats["bytes_written"] += sum(sizes)
            for bid in dead:
                store.delete_block(bid)

        future = self.writer.submit(job)
        for bid in dead:
            block = self.blocks.pop(bid, None)
            if block is not None:
                self.hot_bytes -= block.nbytes
        if self.durable_writes:
            try:
                future.result()
            except OSError as e:
                log.warning("agent %r kept in memory only, not on disk: %s", agent.namespace, e)

    # ---- memory ---------------------------------------------------------------------------------

    def _ref(self, bid: str) -> None:
        self.refs[bid] = self.refs.get(bid, 0) + 1

    def _unref(self, bid: str) -> bool:
        """Drop one reference; True when the block is now unreferenced."""
        self.refs[bid] -= 1
        if self.refs[bid] == 0:
            del self.refs[bid]
            return True
        return False

    def _drop_blocks(self, bids: list[str], delete_files: bool) -> None:
        for bid in bids:
            block = self.blocks.pop(bid, None)
            if block is not None:
                self.hot_bytes -= block.nbytes
            if delete_files and self.writer is not None:
                self.writer.submit(self.store.delete_block, bid)

    def _evict(self, agent: Agent) -> None:
        """Take an agent out of memory: persistent agents keep their durable blocks on disk."""
        self.stats["evicted_agents"] += 1
        if not agent.persistent or self.store is None:  # nothing on disk to come back from
            del self.agents[agent.namespace]
            self._drop_blocks([bid for bid in agent.block_ids if self._unref(bid)], delete_files=False)
            return
        for bid in agent.block_ids:
            block = self.blocks.get(bid)
            if block is not None and block.layers is not None and block.durable:
                self.hot_bytes -= block.nbytes
                block.layers = None

    def _enforce_budget(self, keep: Optional[str] = None) -> None:
        if self.hot_bytes <= self.hot_budget:
            return
        for agent in list(self.agents.values()):
            if self.hot_bytes <= self.hot_budget:
                break
            if agent.namespace != keep and self._agent_hot_bytes(agent):
                self._evict(agent)

    def _agent_hot_bytes(self, agent: Agent) -> int:
        return sum(b.nbytes for b in map(self.blocks.get, agent.block_ids) if b is not None)

    def clear(self) -> None:
        """Drop everything from memory; durable agents stay on disk and come back on demand."""
        self.flush()
        for agent in list(self.agents.values()):
            self._evict(agent)

    def flush(self, timeout: Optional[float] = None) -> None:
        if self.writer is not None:
            self.writer.flush(timeout)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader.close()

    def snapshot(self) -> dict:
        """Counters for /v1/status and /metrics; read from the HTTP thread, so it only copies."""
        agents = [a for a in list(self.agents.values()) if a.persistent]
        hot = sum(1 for a in agents if self._agent_hot_bytes(a))
        return {
            **self.stats,
            "agents": len(agents),
            "agents_hot": hot,
            "anonymous_entries": len(self.agents) - len(agents),
            "blocks": len(self.blocks),
            "hot_bytes": self.hot_bytes,
            "hot_budget_bytes": self.hot_budget,
            "disk_bytes": self.store.disk_bytes() if self.store is not None else 0,
        }
