"""Every pool operation at random against a reference model: a Hypothesis state machine.

A reference model of what every agent should hold is driven against the real pool, persister and
store on disk (and, with a redis-server at hand, a second pool sharing it as the fleet tier). Rules:
turns (growing or diverging histories), forks, two requests of one agent at once (branches), turns
whose history is re-tokenized (matched by text), forget edits (span directives; their turn stored or
the request aborted), amortize turns (spliced branches), histories sent again after an erasure or a
forget, anonymous requests, erasure, pin and unpin, hot and disk budget changes, the TTL with a clock
moved on, each server's clock stepped back and forward (CLOCK_STEPS), restart (close and reopen), crash (the disk fails with writes queued, then close), a kill
before the Nth write step (in process: the store directory as it was at that step is what the restart
finds), turns whose saves stay queued (the writer held) while an erasure (then, maybe, a new turn of
the erased agent), a disk budget (none at all included), a sweep or a fleet erasure runs, and on the
second pool: turns synced from the fleet, erasures and forget edits; partitions (each pool reaches Redis
through a proxy, tools/reliability/partition.py: the second pool cut off and healed, serving from its local copy
meanwhile), a kill -9 at each step of an erasure (acknowledged then killed before its tombstone reached
Redis, or after it but before the outbox let go of it) and of a forget's publish (killed before its put
reached Redis), and forget edits past the removal records' bound (MAX_REMOVALS + 1 in a row).

Invariants, checked after every step (and the memory ones after every pool operation):
- a served prefix covers only tokens of the request and comes from a history that agent may still be
  served (or of the parent it explicitly forked from): never one an erasure removed, nor content a
  forget edit superseded unless a later turn stored it again; its K/V equal, bit for bit, what that
  history stored: a prefill's for an exact lookup (never a spliced branch's), a prefill's or a
  splice's, token by token, for an amortize lookup, and a splice's only where the agent holds a
  spliced history of those tokens;
- the text of a prompt served as stored tokens (matching by text) is the client's text;
- an agent is pinned on this server exactly when its last pin or unpin here pinned it (no merge
  brings an earlier one back, whatever the servers' clocks);
- every operation returns within OP_TIMEOUT_S (a watchdog fails the run, never hangs it);
- every branch a pool holds is (a prefix of) a history the model says that agent may hold: honest
  ones of its honest histories, spliced ones of its spliced histories; a pool that has not synced an
  agent since the other server erased it or ran a forget edit on it may still hold what that removed;
- the block table's invariants hold (references, owners, hot bytes: BlockTable.check);
- recency (agents.Agents.enforce): an operation evicts an unpinned agent (its hot bytes drop while its
  branches stay) only when no unpinned agent used less recently still holds hot bytes, apart from the
  operation's own agents (the request's, and its fork parent, read for it without being used) and
  agents whose save is still queued (their unsaved blocks stay until durable);
- pinned agents are never evicted: a pinned agent's hot bytes never drop while its branches stay;
- hot bytes within the hot budget plus the agents of the last request (and of the saves it left
  queued), the pinned ones and anonymous entries; disk within its budget plus the agents saved last
  and the pinned ones;
- after a flush, every block file is named by a manifest and every named block has its file, and
  every manifest on disk is of an agent the pool holds (an erased agent's never comes back);
- after a kill, every manifest on disk names only blocks that are on disk and sound;
- a save of this server's on a sound disk (no write failing, no erasure of its agent meeting it)
  becomes durable: the budget and the TTL never erase an agent whose save is queued, and an erasure
  keeps the saves of a new turn of its agent queued after it;
- an acknowledged (durable) turn, honest or spliced, survives every restart, crash and kill, unless an
  erasure that the stats record removed its agent (the disk budget or the TTL) or the API erased it, or
  (the fleet merging both servers' branches by recency) `branches` branches used after it on the other
  server may have pushed it out; pinned agents are never erased by the budget or the TTL.

K/V are synthetic but go through the real 4-bit code: token t's K and V are drawn from a seed that
hashes the whole history up to t (as a real model's depend on everything before), quantized by
`Q4KVCache`. So a prefix served from another agent's or another branch's history has other bytes. A
splice's K/V are drawn from another seed from the splice point on (its moved keys are rotated, and
what follows is prefilled on them), so a spliced branch served to an exact lookup has other bytes too.

Used by tests/test_state_machine.py (short seeded runs in CI, and the shrunk sequences of failures
found as explicit examples) and by `vllm-mlx-persist reliability --campaigns state_machine` (long
runs). Never imported by the runtime.
"""

from __future__ import annotations

import errno
import hashlib
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import mlx.core as mx
import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ... import faults, store as store_mod
from ...caches.q4 import Q4KVCache
from ...chain import Branch, Chains, lcp
from ...disk_format import MAX_REMOVALS
from ...kv_edit import AMORTIZE, FORGET
from ...kv_edit.rotations import clip, normalize, peak
from ...pool import BlockPool
from ...store import DiskStore
from .partition import PartitionProxy

OP_TIMEOUT_S = 60.0  # any pool operation slower than this is a hang
BITS, GROUP, BLOCK, HEADS, DIM, LAYERS = 4, 64, 8, 2, 64, 2
TOKEN_BYTES = LAYERS * 2 * HEADS * (DIM * BITS // 8 + 2 * 4 * DIM // GROUP)  # 4-bit K+V per token
FINGERPRINT = "machine" + "0" * 57
AGENTS = ("a", "b", "c", "d")
WORDS = tuple(range(20, 40))  # ordinary tokens: a distinct word each
# Tokens 5..9 spell "a", "b", "ab", "c", "bc": [7] and [5, 6] are the same text, as are [5, 9] and [7, 8].
TEXT = {5: "a", 6: "b", 7: "ab", 8: "c", 9: "bc"}
RETOKENIZE = {(7,): (5, 6), (7, 8): (5, 9)}
TTL_S = 3600.0
BRANCHES = 3  # the pools' `branches`
GONE_KEPT = 4  # histories an erasure or a forget removed, kept per agent to be sent again


def decode(ids: list[int]) -> str:
    return "".join(TEXT.get(int(i), f" w{int(i)}") for i in ids)


class SyntheticKV:
    """K/V of a token history: per token, drawn from a seed hashing every token up to it; a splice's
    from another seed (`spliced`: per token, whether its K/V are a splice's)."""

    def __init__(self) -> None:
        self._memo: dict[bytes, np.ndarray] = {}

    def _rows(self, tokens: Sequence[int], salt: bytes) -> list[np.ndarray]:
        h = hashlib.sha256(salt)
        rows = []
        for t in tokens:
            h.update(int(t).to_bytes(4, "little"))
            key = h.digest()
            row = self._memo.get(key)
            if row is None:
                rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
                row = rng.standard_normal((2, LAYERS, HEADS, DIM), dtype=np.float32)
                if len(self._memo) > 200_000:
                    self._memo.clear()
                self._memo[key] = row
            rows.append(row)
        return rows

    def arrays(self, tokens: Sequence[int], spliced: Optional[Sequence[bool]] = None) -> tuple[np.ndarray, np.ndarray]:
        """(K, V), each (LAYERS, 1, HEADS, len(tokens), DIM) float32."""
        rows = self._rows(tokens, b"synthetic-kv")
        if spliced is not None and any(spliced):
            other = self._rows(tokens, b"spliced-kv")
            rows = [o if s else r for r, o, s in zip(rows, other, spliced)]
        kv = np.stack(rows, axis=3) if rows else np.zeros((2, LAYERS, HEADS, 0, DIM), np.float32)
        return kv[0][:, None], kv[1][:, None]

    def cache(self, tokens: Sequence[int], spliced: Optional[Sequence[bool]] = None) -> list[Q4KVCache]:
        """A per-sequence 4-bit cache holding `tokens`, as a prefill (or a splice) would store it."""
        k, v = self.arrays(tokens, spliced)
        out = []
        for layer in range(LAYERS):
            c = Q4KVCache(group_size=GROUP, bits=BITS)
            c.update_and_fetch(mx.array(k[layer]), mx.array(v[layer]))
            out.append(c)
        mx.eval([a for c in out for part in c.to_arrays() for a in part])
        return out


def same_cache(a: list, b: list) -> bool:
    for x, y in zip(a, b):
        for px, py in zip(x.to_arrays(), y.to_arrays()):
            for ax, ay in zip(px, py):
                if ax.shape != ay.shape or not mx.array_equal(ax, ay).item():
                    return False
    return len(a) == len(b)


def spliced_mask(cache: list, kv: SyntheticKV, tokens: Sequence[int]) -> Optional[list[bool]]:
    """Per token of a served cache: False where its K/V are a prefill's, True where a splice's; None
    when some token's are neither. mlx quantizes each token on its own, so tokens compare apart."""
    honest, spliced = kv.cache(tokens), kv.cache(tokens, [True] * len(tokens))
    if len(cache) != len(honest):
        return None
    eq_h = eq_s = mx.ones((len(tokens),), dtype=mx.bool_)
    for c, h, s in zip(cache, honest, spliced):
        for pc, ph, ps in zip(c.to_arrays(), h.to_arrays(), s.to_arrays()):
            for ac, ah, as_ in zip(pc, ph, ps):
                if ac.shape != ah.shape:
                    return None
                eq_h = eq_h & mx.all(ac == ah, axis=(0, 1, 3))
                eq_s = eq_s & mx.all(ac == as_, axis=(0, 1, 3))
    h, s = np.array(eq_h), np.array(eq_s)
    if not (h | s).all():
        return None
    return [not bool(x) for x in h]


_WORKER = ThreadPoolExecutor(1, thread_name_prefix="machine-worker")  # vllm-mlx's worker: the one MLX thread
_ADMIN = ThreadPoolExecutor(1, thread_name_prefix="machine-admin")  # an admin API call that waits for the disk


def watchdog(fn: Callable, *args: Any, timeout: float = OP_TIMEOUT_S, **kw: Any) -> Any:
    """fn(*args) on the machine's worker thread (MLX streams are per thread, and the pool's MLX work
    runs on one thread, as in the server); AssertionError if it does not return within `timeout`."""
    future = _WORKER.submit(fn, *args, **kw)
    try:
        return future.result(timeout)
    except FutureTimeout:
        raise AssertionError(f"{getattr(fn, '__qualname__', fn)} did not return within {timeout} s (a hang)") from None


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class Redis:
    """A throwaway redis-server on a free loopback port (no persistence)."""

    def __init__(self, work: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--save", "", "--appendonly", "no",
                                      "--dir", str(work)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    @staticmethod
    def available() -> bool:
        return shutil.which("redis-server") is not None


class Clock:
    """Wall-clock time that a rule can move on (the TTL's)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


# A server's clock is the machine's wall clock stepped by one of these (seconds): a rule steps each
# server's clock back and forward, so the servers disagree by up to CLOCK_SPAN.
CLOCK_STEPS = (-120.0, -60.0, 0.0, 60.0, 120.0)
CLOCK_SPAN = max(CLOCK_STEPS) - min(CLOCK_STEPS)


class ServerClock:
    """One server's clock: the wall clock (`Clock`) stepped by `step` seconds."""

    def __init__(self, wall: Clock) -> None:
        self.wall, self.step = wall, 0.0

    def __call__(self) -> float:
        return self.wall() + self.step


class Gate:
    """A store fault hook (store._FAULT, faults.py's seam) that holds the first thread to reach a write
    step after it is installed (the persister, inside the save it is writing: every job queued after
    stays queued) until `open()`; `fail`: that step then fails (EIO), so the save is retried later.
    Every other thread passes."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._lock = threading.Lock()
        self.held = threading.Event()
        self.thread: Optional[threading.Thread] = None
        self.fail = False

    def __call__(self, step: str) -> None:
        if step not in faults.WRITE_STEPS or self._open.is_set():
            return
        with self._lock:
            if self.thread is None:
                self.thread = threading.current_thread()
            if self.thread is not threading.current_thread():
                return
        self.held.set()
        self._open.wait(OP_TIMEOUT_S)
        if self.fail:
            self.fail = False
            raise OSError(errno.EIO, f"held at {step}, then failed (injected)")

    def open(self) -> None:
        self._open.set()


class KillAt:
    """A store fault hook: the process is killed just before its `n`th write step. In process: the store
    directory is copied as it is then (all the disk's writers are the persister thread, which is here),
    which is what a SIGKILL there would leave for the restart; that step and every later write fail."""

    def __init__(self, n: int, root: Path, copy: Path):
        self.n, self.root, self.copy = n, root, copy
        self.count = 0
        self.killed: Optional[str] = None  # the step it was killed before
        self._lock = threading.Lock()

    def __call__(self, step: str) -> None:
        if step not in faults.WRITE_STEPS:
            return
        with self._lock:
            self.count += 1
            if self.count == self.n:
                shutil.copytree(self.root, self.copy, symlinks=True)
                self.killed = step
            if self.killed is not None:
                raise OSError(errno.EIO, f"killed before write step {self.n} ({self.killed})")


# The machine's tiers give up on an unreachable Redis fast: a partition (a cut proxy) costs a step
# a fraction of a second, and a healed one is reached again within FLEET_BREAKER_S.
FLEET_BREAKER_S = 0.1
FLEET_SETTINGS = {"wait_s": 10.0, "breaker_open_s": FLEET_BREAKER_S, "backoff_s": 0.02, "backoff_max_s": 0.1,
                  "max_attempts": 2, "read_timeout_s": 2.0}


def open_pool(root: Path, *, hot: int, disk: int, clock: Callable[[], float], redis_url: Optional[str] = None,
              retry_delays: tuple = (0.05,)) -> BlockPool:
    fmt = {"bits": BITS, "group_size": GROUP, "block_size": BLOCK}
    fleet = None
    if redis_url is not None:
        from ...fleet import Fleet, FleetSettings, RemoteTier

        def fleet(pool: BlockPool) -> Fleet:
            return Fleet(pool, lambda **cb: RemoteTier(FleetSettings(redis_url, **FLEET_SETTINGS), FINGERPRINT, **cb))
    pool = BlockPool(fingerprint=FINGERPRINT, n_layers=LAYERS, bits=BITS, group_size=GROUP, block_size=BLOCK,
                     hot_bytes=hot, store=DiskStore(root, FINGERPRINT, {"machine": True}, fmt), disk_budget=disk,
                     persister_options={"ttl_s": TTL_S, "retry_delays": retry_delays},
                     branches=BRANCHES, decode=decode, fleet=fleet, clock=clock)
    pool.load_manifests()
    pool.flush()  # the start-up scan (sizes, garbage collection, the first budget and TTL check) is done
    return pool


class Recency:
    """The reference order of the agents' last uses (the hot tier's LRU: agents.Agents.enforce evicts
    the least recently used unpinned agent first). A lookup of a known agent and a stored turn are uses.
    `order`: least recently used first. `unordered`: agents loaded at the last restart and not used
    since, all less recent than `order`, among themselves in an order the model does not track.
    `unknown`: agents a fleet sync may have used (adopted) or not, out of the check until their next use."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.unordered: set[str] = set()
        self.unknown: set[str] = set()

    def _drop(self, agent: str) -> None:
        if agent in self.order:
            self.order.remove(agent)
        self.unordered.discard(agent)
        self.unknown.discard(agent)

    def use(self, agent: str) -> None:
        self._drop(agent)
        self.order.append(agent)

    def forget(self, agent: str) -> None:
        self._drop(agent)

    def doubt(self, agent: str) -> None:
        self._drop(agent)
        self.unknown.add(agent)

    def restart(self, agents: Sequence[str]) -> None:
        self.order, self.unordered, self.unknown = [], set(agents), set()

    def older(self, x: str, y: str) -> bool:
        """Whether x was certainly used less recently than y."""
        if y not in self.order:
            return False
        return x in self.unordered or (x in self.order and self.order.index(x) < self.order.index(y))


HOT_BUDGETS = (1 << 30, 40 * TOKEN_BYTES, 120 * TOKEN_BYTES)
DISK_BUDGETS = (1 << 40, 200 * TOKEN_BYTES, 600 * TOKEN_BYTES)
QUEUED_THEN = ("erase_x", "erase_y", "erase_x_in_flight", "erase_x_turn", "budget", "sweep", "fleet_erase_y")

names = st.sampled_from(AGENTS)
words = st.lists(st.sampled_from(WORDS + (7, 8, 7, 8)), min_size=1, max_size=24)


class PoolMachine(RuleBasedStateMachine):
    """The pool against a reference model (see the module docstring)."""

    fleet = False  # a subclass turns the second pool and its rules on (needs a redis-server)
    steps_run = 0  # steps taken by every machine in this process (the campaign's count)

    def __init__(self) -> None:
        super().__init__()
        self.work = Path(tempfile.mkdtemp(prefix="pool-machine-"))
        self.kv = SyntheticKV()
        self.chains = Chains(FINGERPRINT, BLOCK)
        self._ids_memo: dict[tuple, list[str]] = {}
        self.clock = Clock()
        self.clocks = {n: ServerClock(self.clock) for n in "ab"}  # each server's, stepped by `clock_step`
        self.hot, self.disk = HOT_BUDGETS[0], DISK_BUDGETS[0]
        self.redis = Redis(self.work) if self.fleet else None
        # Each pool reaches Redis through its own partition proxy (tools/reliability/partition.py): a rule cuts one
        # pool off and heals it. `cut`: the pools ("a", "b") cut off now.
        self.proxies = ({n: PartitionProxy("127.0.0.1", self.redis.port) for n in "ab"}
                        if self.redis is not None else {})
        self.cut: set[str] = set()
        # Agents whose forget edit on a cut-off pool never reached Redis: the other pool may hold what
        # it removed until the cut-off one syncs the agent after the heal (which publishes it again).
        self.unpublished: dict[str, set[str]] = {"a": set(), "b": set()}
        self.forget_runs = 0  # runs of removals past the bound (one per example: a long step)
        self.pool = self._open(self.work / "a")
        self.other = self._open(self.work / "b") if self.fleet else None
        # The honest histories each agent may be served, since its last erasure (a forget edit cuts
        # those holding what it superseded at the edit point).
        self.hist: dict[str, list[list[int]]] = {a: [] for a in AGENTS}
        self.spliced: dict[str, list[list[int]]] = {a: [] for a in AGENTS}  # its spliced ones (amortize turns)
        # Histories the budget or the TTL erased here: local space decisions, so with the fleet tier
        # they may come back from Redis (only an API erasure is fleet-wide).
        self.published: dict[str, list[list[int]]] = {a: [] for a in AGENTS}
        self.published_spliced: dict[str, list[list[int]]] = {a: [] for a in AGENTS}
        # What a pool ("a": this one, "b": the other) may still hold of an agent until its next sync of
        # it: what the other server erased or a forget edit there removed.
        self.stale: dict[str, dict[str, list[list[int]]]] = {"a": {}, "b": {}}
        self.gone: dict[str, list[list[int]]] = {a: [] for a in AGENTS}  # removed histories, to send again
        self.anon: list[list[int]] = []
        self.acked: dict[str, Optional[list[int]]] = dict.fromkeys(AGENTS)  # last durable turn
        self.acked_at: dict[str, int] = dict.fromkeys(AGENTS, 0)  # erasures counted when it was acked
        self.acked_spliced: dict[str, Optional[list[int]]] = dict.fromkeys(AGENTS)  # last durable amortize turn
        self.acked_spliced_at: dict[str, int] = dict.fromkeys(AGENTS, 0)
        # Branches of the agent the other server may have used since its acknowledged turn here: each
        # fleet turn uses at most two (the one it is served from, the one it makes). With `branches`
        # of them, the fleet's merge by recency may rightly push that turn out.
        self.elsewhere: dict[str, int] = dict.fromkeys(AGENTS, 0)
        self.pinned: set[str] = set()
        self.erasures = 0  # budget and TTL erasures over every pool lifetime (the stats'); API ones apart
        self.keep: set[str] = set()  # agents of the last request (and its queued saves): the hot budget spares them
        self.saving_now: set[str] = set()  # agents whose saves a rule leaves queued (their unsaved blocks stay hot)
        # While writes fail (crash, kill): a sync's merge is adopted only once saved, so it may not be.
        self.unsure_syncs = False
        self.saved_last: set[str] = set()  # agents whose saves ran last: the disk budget may stay over by them
        self.recency = Recency()
        self.rid = 0

    def _open(self, root: Path) -> BlockPool:
        proxy = self.proxies.get(root.name)
        return watchdog(open_pool, root, hot=self.hot, disk=self.disk, clock=self.clocks[root.name],
                        redis_url=proxy.url if proxy is not None else None)

    def teardown(self) -> None:
        for pool in (self.pool, self.other):
            if pool is not None:
                try:
                    pool.close()
                except Exception:
                    pass
        store_mod._FAULT = None
        for proxy in self.proxies.values():
            proxy.close()
        if self.redis is not None:
            self.redis.stop()
        shutil.rmtree(self.work, ignore_errors=True)

    # ---- the reference model -------------------------------------------------------------------------

    def _erasures_now(self) -> int:
        s = self.pool.snapshot()
        return self._base_erasures + s.get("budget_erasures", 0) + s.get("ttl_erasures", 0)

    _base_erasures = 0

    def _history(self, agent: Optional[str], pick: int, cut: float) -> list[int]:
        seqs = self.hist[agent] if agent is not None else self.anon
        if not seqs:
            return []
        seq = seqs[pick % len(seqs)]
        return seq[: int(len(seq) * cut)]

    def _name(self, pool: BlockPool) -> str:
        return "a" if pool is self.pool else "b"

    def _allowed(self, agent: str) -> list[list[int]]:
        """The honest histories `agent` may be served."""
        return self.hist[agent] + self.published[agent]

    def _allowed_spliced(self, agent: str) -> list[list[int]]:
        """The spliced histories `agent` may be served (by its amortize lookups only)."""
        return self.spliced[agent] + self.published_spliced[agent]

    def _ids(self, links: tuple, tokens: list[int]) -> list[str]:
        key = (links, tuple(tokens))
        ids = self._ids_memo.get(key)
        if ids is None:
            if len(self._ids_memo) > 50_000:
                self._ids_memo.clear()
            ids = self._ids_memo[key] = self.chains.ids(links, tokens)
        return ids

    def _resolve(self, br: Branch, seqs: Sequence[list[int]]) -> Optional[list[int]]:
        """The tokens of a pool's branch: the first of `seqs` whose leading tokens have its block ids on
        its chain (block ids hash every token before them), or None."""
        for seq in seqs:
            if len(seq) >= br.n_tokens and self._ids(br.links, seq[: br.n_tokens]) == br.block_ids:
                return seq[: br.n_tokens]
        return None

    def _known(self, agent: str) -> list[list[int]]:
        """Every token history the model has seen for `agent` (to name a pool's branches)."""
        return (self.hist[agent] + self.published[agent] + self.gone[agent]
                + [s for stale in self.stale.values() for s in stale.get(agent, [])])

    def _forget(self, agent: str, fleet_wide: bool = True, here: Optional[str] = "a") -> None:
        """The agent was erased: by the API through pool `here` (`fleet_wide`), or here only (the
        budget, the TTL). With the fleet, the other pool holds what it held until it syncs the agent."""
        every = self._allowed(agent) + self._allowed_spliced(agent)
        if fleet_wide:
            if self.fleet:
                other = "b" if here == "a" else "a"
                self.stale[other].setdefault(agent, []).extend(every)
            self.published[agent], self.published_spliced[agent] = [], []
        elif self.fleet:
            self.published[agent] += self.hist[agent]
            self.published_spliced[agent] += self.spliced[agent]
        self.gone[agent] = (self.gone[agent] + [s for s in self.hist[agent] if s])[-GONE_KEPT:]
        self.hist[agent] = []
        self.spliced[agent] = []
        self.acked[agent] = self.acked_spliced[agent] = None
        self.pinned.discard(agent)
        self.recency.forget(agent)

    def _superseded(self, pool: BlockPool, agent: str, before: list[list[int]], served: list[int]) -> None:
        """A forget edit on `pool` served as `served`, the agent's honest branches before it being
        `before` (their tokens): the branches the prompt matches as far as the best one (its lookup
        cannot tell which the client edited; kv_edit/supersede.py) lose what they hold from where the
        prompt leaves them (their edit point e) on, and every spliced history goes. Without the fleet
        that is every copy of those tokens past e; with it, what the removal records name (chain.Removal:
        the block holding e, so a copy elsewhere that differs later in that block stays), and the other
        pool may hold it until it syncs the agent."""
        if len(served) <= 1 or not before:
            return
        reach = [min(lcp(b, served), len(served) - 1) for b in before]
        top = max(reach)
        removed = [b for b, r in zip(before, reach) if r == top and lcp(b, served) < len(b)]
        if not removed:
            return
        cut_off: list[list[int]] = self._allowed_spliced(agent)
        for b in removed:
            e = lcp(b, served)
            end = min(len(b), (e // BLOCK + 1) * BLOCK) if self.fleet else e + 1
            for seqs in (self.hist, self.published):
                kept = []
                for s in seqs[agent]:
                    if s[:end] == b[:end]:
                        cut_off.append(s)
                        s = s[:e]
                    if s:
                        kept.append(s)
                seqs[agent] = kept
            self.gone[agent] = (self.gone[agent] + [b])[-GONE_KEPT:]
        self.spliced[agent], self.published_spliced[agent] = [], []
        self.acked_spliced[agent] = None
        if self.fleet:
            other = "b" if pool is self.pool else "a"
            self.stale[other].setdefault(agent, []).extend(cut_off)

    # ---- requests ------------------------------------------------------------------------------------

    def _hot_state(self, pool: BlockPool) -> dict[str, tuple[int, frozenset, bool]]:
        out = {}
        for a in AGENTS:
            rec = pool.agent(a)
            if rec is not None:
                out[a] = (rec.hot_bytes, frozenset(rec.ids), rec.pinned)
        return out

    @contextmanager
    def _watching(self, pool: BlockPool, keep: set) -> Iterator[None]:
        """Around one operation on this server's pool (the one whose hot budget moves): who left memory.
        An agent evicted (its hot bytes dropped while its branches stayed) must not be pinned, and no
        unpinned agent used less recently may still hold hot bytes, but for `keep` (the operation's
        agents: enforce spares them) and agents with a save still queued. The caller records the
        operation's uses (`self.recency`) inside the block."""
        if pool is not self.pool:
            yield
            return
        before = self._hot_state(pool)
        yield
        after = self._hot_state(pool)
        for y, (hot0, ids0, pin0) in before.items():
            now = after.get(y)
            if now is None or y in keep or now[1] != ids0:
                continue
            hot1, _, pin1 = now
            if pin0 and pin1:
                assert hot1 >= hot0, f"pinned agent {y!r} left memory ({hot0} -> {hot1} hot bytes)"
            elif hot1 < hot0 and not pin1:
                older = [x for x, (h, _, p) in after.items() if x != y and h and not p and x not in keep
                         and x not in self.saving_now and self.recency.older(x, y)]
                assert not older, (f"agent {y!r} left memory ({hot0} -> {hot1} hot bytes) while {older}, "
                                   f"used less recently, stayed (recency {self.recency.order})")

    def _looked_up(self, pool: BlockPool, agent: Optional[str], prompt: list[int], fork_from: Optional[str]) -> None:
        """What a lookup used (Recency) and synced (`stale`)."""
        if agent is None:
            return
        name = self._name(pool)
        if self.fleet and not self.unsure_syncs and name not in self.cut:
            other = "b" if name == "a" else "a"
            for ns in {agent, fork_from} - {None} - self.unpublished[other]:
                self.stale[name].pop(ns, None)  # it synced them first
        if pool is not self.pool:
            return
        if pool.agent(agent) is not None:
            if len(prompt) > 1:
                self.recency.use(agent)
            elif self.fleet:
                self.recency.doubt(agent)  # only its sync ran, which may have adopted it (a use)
        if self.fleet and fork_from and fork_from != agent and pool.agent(fork_from) is not None:
            self.recency.doubt(fork_from)

    def _lookup(self, pool: BlockPool, agent: Optional[str], prompt: list[int], rid: Optional[str],
                fork_from: Optional[str] = None, edit: Optional[str] = None) -> tuple[Any, list[int], int, list[bool]]:
        """One lookup through `pool`, checked: what it served comes from a history the agent may be
        served, with that history's K/V. Returns (the match, the prompt as served, tokens served, per
        token whether a splice's K/V were served)."""
        with self._watching(pool, {x for x in (agent, fork_from) if x is not None}):
            m = watchdog(pool.match, agent, prompt, rid, fork_from, edit=edit)
            self._looked_up(pool, agent, prompt, fork_from)
        if pool is self.pool:  # its hot budget spares them (when the lookup enforced it at all)
            self.keep |= {x for x in (agent, fork_from) if x is not None}
        served = m.prompt if m.prompt is not None else prompt
        assert decode(served) == decode(prompt), f"served {served} for {prompt}: not the client's text"
        n = m.num_tokens
        assert 0 <= n <= len(served) - 1
        mask = [False] * n
        if n:
            if agent is None:
                allowed = self.anon
            else:
                allowed = self._allowed(agent) + (self._allowed(fork_from) if fork_from else [])
                if self.fleet and self._name(pool) in self.cut:  # it could not sync: its stale copy serves
                    stale = self.stale[self._name(pool)]
                    allowed = allowed + stale.get(agent, []) + (stale.get(fork_from, []) if fork_from else [])
                if edit == AMORTIZE:
                    allowed = allowed + self._allowed_spliced(agent)
            assert any(s[:n] == served[:n] for s in allowed), (
                f"{agent!r} was served {n} tokens that none of its histories{' or its parent' if fork_from else ''} "
                f"may serve")
            if edit == AMORTIZE:
                got = watchdog(spliced_mask, m.cache, self.kv, served[:n])
                assert got is not None, f"{agent!r}: served K/V neither a prefill's nor a splice's"
                mask = got
                if any(mask):
                    assert any(s[:n] == served[:n] for s in self._allowed_spliced(agent)), (
                        f"{agent!r}: an amortize lookup served a splice's K/V the agent holds no spliced history of")
            else:
                assert watchdog(self._same, m.cache, served[:n]), (
                    f"{agent!r}: served K/V differ from the stored (a prefill's)")
        return m, served, n, mask

    def _same(self, cache: list, tokens: list[int]) -> bool:
        return same_cache(cache, self.kv.cache(tokens))

    def _store(self, pool: BlockPool, agent: Optional[str], tokens: list[int], rid: Optional[str],
               fork_from: Optional[str] = None, spliced: Optional[list[bool]] = None, generation: int = 0,
               rotations: tuple = ()) -> tuple[int, Optional[Future]]:
        """Commit `tokens` (their K/V a prefill's, or per token a splice's) without waiting for the disk."""
        def commit() -> tuple:
            return pool.commit_async(agent, tokens, self.kv.cache(tokens, spliced), rid, fork_from, generation,
                                     rotations)

        with self._watching(pool, {agent} if agent is not None else set()):
            n, future = watchdog(commit)
            if n and pool is self.pool:
                self.keep = {agent} - {None}  # the budget is enforced sparing the turn's agent only
                if agent is not None and pool.agent(agent) is not None:
                    self.recency.use(agent)
        assert n in (0, len(tokens))
        return n, future

    def _finish(self, pool: BlockPool, rid: str, agent: Optional[str]) -> None:
        with self._watching(pool, {agent} if agent is not None else set()):
            watchdog(pool.finish, rid)

    def _ack(self, future: Optional[Future]) -> Callable[[], tuple[bool, int]]:
        """(durable, the budget and TTL erasures counted when its save settled), once it has: counted
        then, not later, so that a later erasure of the agent is told from one before its turn."""
        box: list = []
        if future is not None:
            future.add_done_callback(lambda f: box.append(
                (not f.cancelled() and f.exception() is None and bool(f.result()), self._erasures_now())))

        def settled() -> tuple[bool, int]:
            if future is None:
                return False, 0
            try:
                future.result(OP_TIMEOUT_S)
            except Exception:
                pass
            assert wait_until(lambda: bool(box), OP_TIMEOUT_S), "a save's future settled without its callback"
            return box[0]
        return settled

    def _stored(self, pool: BlockPool, agent: Optional[str], tokens: list[int], n: int,
                settled: Callable[[], tuple[bool, int]], durable: bool = True, spliced: bool = False,
                may_lose: bool = False) -> None:
        """The model's side of a stored turn, once its save settled. On a sound disk (`durable`, and
        not `may_lose`: no write fails and no erasure of the agent meets its save) this server's save
        must become durable: the budget and the TTL never erase an agent whose save is queued."""
        if agent is None:
            self.anon.append(tokens)
            return
        if not n:
            return
        (self.spliced if spliced else self.hist)[agent].append(tokens)
        if pool is self.pool:
            self.saved_last.add(agent)
        ok, at = settled()
        if durable and not may_lose and pool is self.pool:
            assert ok, f"agent {agent!r}: a turn's save was lost on a sound disk"
        if ok and durable and pool is self.pool:
            if spliced:
                self.acked_spliced[agent], self.acked_spliced_at[agent] = tokens, at
            else:
                self.acked[agent], self.acked_at[agent] = tokens, at
            self.elsewhere[agent] = 0

    def _serve(self, pool: BlockPool, agent: Optional[str], prompt: list[int], fork_from: Optional[str] = None,
               durable: bool = True, edit: Optional[str] = None, aborted: bool = False) -> tuple[int, list[int]]:
        """One request through `pool`: look up, check what was served, commit the whole prompt (the
        stored tokens when matched by text; nothing when `aborted`), wait for its save. Returns (tokens
        reused, the tokens as served)."""
        self.rid += 1
        rid = f"r{self.rid}"
        if pool is self.pool:  # its sync may save a fetched history of the agent (and of the fork parent)
            self.saved_last = {x for x in (agent, fork_from) if x is not None}
        _, served, n, _ = self._lookup(pool, agent, prompt, rid, fork_from, edit)
        if not aborted:
            n_stored, future = self._store(pool, agent, served, rid, fork_from)
            self._stored(pool, agent, served, n_stored, self._ack(future), durable)
        self._finish(pool, rid, agent)
        return n, served

    def _honest_branches(self, pool: BlockPool, agent: str) -> list[list[int]]:
        """The tokens of the agent's honest branches in `pool` (those the model can name)."""
        rec = pool.agent(agent)
        if rec is None:
            return []
        known = self._known(agent)
        return [t for t in (self._resolve(br, known) for br in list(rec.honest)) if t is not None]

    def _forget_edit(self, pool: BlockPool, agent: str, prompt: list[int], aborted: bool) -> None:
        if self.fleet:  # its sync first (a one-token lookup does nothing else), so `before` is what it edits
            with self._watching(pool, {agent}):
                watchdog(pool.match, agent, [WORDS[0]])
                self._looked_up(pool, agent, [WORDS[0]], None)
        before = self._honest_branches(pool, agent)
        self.acked[agent] = None  # the edit may supersede the acknowledged turn: only its own is owed after it
        _, served = self._serve(pool, agent, prompt, edit=FORGET, aborted=aborted)
        self._superseded(pool, agent, before, served)

    # ---- rules ---------------------------------------------------------------------------------------

    @rule(agent=names, pick=st.integers(0, 99), cut=st.floats(0.0, 1.0), new=words)
    def turn(self, agent: str, pick: int, cut: float, new: list[int]) -> None:
        """A turn: one of the agent's histories cut somewhere (all of it: the conversation goes on),
        then new tokens."""
        self._serve(self.pool, agent, self._history(agent, pick, cut) + new)

    @rule(agent=names, pick=st.integers(0, 99), cut=st.floats(0.0, 0.9), new=words, aborted=st.booleans())
    def forget_edit(self, agent: str, pick: int, cut: float, new: list[int], aborted: bool = False) -> None:
        """A span directive `forget`: one of the agent's histories cut and continued otherwise; the
        branches holding what it drops leave the agent, memory and disk (kv_edit/supersede.py), with
        every spliced branch, when its turn is stored or (`aborted`) when the request ends without it."""
        self._forget_edit(self.pool, agent, self._history(agent, pick, cut) + new, aborted)
        if self.other is not None:
            self.pool.fleet.tier.flush(10)  # published before the next step

    @rule(agent=names, pick=st.integers(0, 99), cut=st.floats(0.0, 1.0), new=words)
    def amortize(self, agent: str, pick: int, cut: float, new: list[int]) -> None:
        """A span directive `amortize`: its lookup may reuse the agent's spliced histories; the cache is
        spliced from where the lookup stopped (K/V a splice's from there on: rotated keys, then what is
        prefilled on them) and stored as a spliced branch (generation >= 1, rotation counts), never
        served to an exact lookup. Reusing a spliced history continues it; with nothing to splice after
        an honest prefix the turn is stored as an honest one."""
        seqs = self.hist[agent] + self.spliced[agent]
        base = seqs[pick % len(seqs)] if seqs else []
        prompt = base[: int(len(base) * cut)] + new
        self.rid += 1
        rid = f"r{self.rid}"
        self.saved_last = set()
        m, served, n, mask = self._lookup(self.pool, agent, prompt, rid, edit=AMORTIZE)
        source = m.source[1] if m.source is not None and n else None
        room = len(served) - 1 - n  # a token is always left to prefill
        if (source is not None and source.spliced) or room >= 1:
            counts = clip(source.rotations, n) if source is not None and source.spliced else ()
            rotations = normalize(counts + (((n, len(served) - 1, 1),) if room >= 1 else ()))
            kv = mask + [True] * (len(served) - n)
            n_stored, future = self._store(self.pool, agent, served, rid, spliced=kv,
                                           generation=max(1, peak(rotations)), rotations=rotations)
            self._stored(self.pool, agent, served, n_stored, self._ack(future), spliced=True)
        else:
            n_stored, future = self._store(self.pool, agent, served, rid)
            self._stored(self.pool, agent, served, n_stored, self._ack(future))
        self._finish(self.pool, rid, agent)

    @rule(child=names, parent=names, pick=st.integers(0, 99), cut=st.floats(0.3, 1.0), new=words)
    def fork(self, child: str, parent: str, pick: int, cut: float, new: list[int]) -> None:
        if child == parent:
            return
        self._serve(self.pool, child, self._history(parent, pick, cut) + new, fork_from=parent)

    @rule(agent=names, pick=st.integers(0, 99), a=words, b=words)
    def parallel(self, agent: str, pick: int, a: list[int], b: list[int]) -> None:
        """Two requests of one agent at once, diverging: both looked up, then committed in the other
        order (concurrent branches)."""
        base = self._history(agent, pick, 1.0)
        p1, p2 = base + a, base + b + [WORDS[0]]
        self.saved_last = set()
        rids = []
        for p in (p1, p2):
            self.rid += 1
            rids.append(f"r{self.rid}")
            self._lookup(self.pool, agent, p, rids[-1])
        for p, rid in reversed(list(zip((p1, p2), rids))):
            n, future = self._store(self.pool, agent, p, rid)
            self._stored(self.pool, agent, p, n, self._ack(future))
            self._finish(self.pool, rid, agent)

    @rule(agent=names, pick=st.integers(0, 99), new=words)
    def retokenized(self, agent: str, pick: int, new: list[int]) -> None:
        """A turn whose history comes back tokenized otherwise (the same text): matched by text."""
        base = self._history(agent, pick, 1.0)
        for i in range(len(base)):
            for old, same in RETOKENIZE.items():
                if tuple(base[i : i + len(old)]) == old:
                    self._serve(self.pool, agent, base[:i] + list(same) + base[i + len(old):] + new)
                    return
        self._serve(self.pool, agent, base + new)

    @rule(agent=names, pick=st.integers(0, 99), new=words, elsewhere=st.booleans())
    def resend(self, agent: str, pick: int, new: list[int], elsewhere: bool) -> None:
        """A client sends again a history an erasure or a forget edit removed (`elsewhere`: to the other
        server): its lookup must not serve what was removed; its turn stores it anew."""
        gone = self.gone[agent]
        prompt = (gone[pick % len(gone)] if gone else self._history(agent, pick, 1.0)) + new
        if elsewhere and self.other is not None:
            self.pool.fleet.tier.flush(10)
            self._serve(self.other, agent, prompt)
            self.other.fleet.tier.flush(10)
            self.elsewhere[agent] += 2
        else:
            self._serve(self.pool, agent, prompt)

    @rule(pick=st.integers(0, 99), cut=st.floats(0.0, 1.0), new=words)
    def anonymous(self, pick: int, cut: float, new: list[int]) -> None:
        self._serve(self.pool, None, self._history(None, pick, cut) + new)

    @rule(agent=names)
    def erase(self, agent: str) -> None:
        with self._watching(self.pool, {agent}):
            watchdog(self.pool.erase, agent, 30.0)
        self._forget(agent)
        if self.other is not None:
            self.pool.fleet.tier.flush(10)  # the tombstone is in Redis before the next step

    @rule(agent=names, pin=st.booleans())
    def pin(self, agent: str, pin: bool) -> None:
        """Pin or unpin. With the fleet the record is saved again, which publishes it without a sync
        first: when the other server erased the agent meanwhile, that put meets its tombstone and
        erases the agent here, on a fleet thread; the step waits for that (the invariants would race
        it: memory forgets first, then the disk)."""
        erased = self.pool.fleet.tier.stats()["puts_erased"] if self.other is not None else 0
        with self._watching(self.pool, set()):
            done = watchdog(self.pool.set_pinned, agent, pin, 30.0)
        if done:
            (self.pinned.add if pin else self.pinned.discard)(agent)
        if self.other is not None:
            self.pool.fleet.tier.flush(10)
            if self.pool.fleet.tier.stats()["puts_erased"] > erased:
                wait_until(lambda: self.pool.agent(agent) is None, OP_TIMEOUT_S)
                self.pinned.discard(agent)

    @rule(i=st.integers(0, len(HOT_BUDGETS) - 1))
    def hot_budget(self, i: int) -> None:
        self.hot = HOT_BUDGETS[i]
        with self._watching(self.pool, set()):
            watchdog(self.pool.set_hot_budget, self.hot)
        self.keep = set()

    @rule(i=st.integers(0, len(DISK_BUDGETS) - 1))
    def disk_budget(self, i: int) -> None:
        self.disk = self.pool.persister.budget.disk_budget = DISK_BUDGETS[i]
        watchdog(self.pool.persister.sweep().result, OP_TIMEOUT_S)
        self.saved_last = set()

    @rule()
    def ttl(self) -> None:
        """The clock moves past the TTL: every agent but the pinned ones is erased (no request is in
        flight between steps; past it whatever the server's clock was stepped to since)."""
        self.clock.offset += TTL_S + 1 + CLOCK_SPAN
        watchdog(self.pool.persister.sweep().result, OP_TIMEOUT_S)
        for a in AGENTS:
            if a not in self.pinned:
                self._forget(a, fleet_wide=False)
        self.saved_last = set()

    @rule(server=st.sampled_from("ab"), step=st.sampled_from(CLOCK_STEPS))
    def clock_step(self, server: str, step: float) -> None:
        """A server's clock steps (back or forward; the two servers' then disagree): its stamps of
        uses, commits, removals and settings (the merge rules order by them) must still order each
        after what its record has seen (docs/fleet.md, "The merge rules"), so no invariant changes."""
        self.clocks[server].step = step

    def _reopen(self) -> None:
        self._base_erasures = self._erasures_now()  # the closed pool's, every one before the restart included
        self.pool = self._open(self.work / "a")
        self.recency.restart([a for a in AGENTS if self.pool.agent(a) is not None])
        self.keep, self.saving_now = set(), set()

    @rule()
    def restart(self) -> None:
        watchdog(self.pool.close)
        self._reopen()
        self._check_survivors()

    @rule(agent=names, new=words)
    def crash(self, agent: str, new: list[int]) -> None:
        """The disk fails with a turn queued, then the process stops: that turn is not acknowledged and
        may be lost; every acknowledged one survives."""
        store_mod._FAULT = faults.parse(f"EIO:open,write,fsync,rename,dirsync@{self.work}")
        self.unsure_syncs = True
        try:
            self._serve(self.pool, agent, self._history(agent, 0, 1.0) + new, durable=False)
            watchdog(self.pool.close)
        finally:
            store_mod._FAULT = None
            self.unsure_syncs = False
        self._reopen()
        self._check_survivors()

    @rule(agents=st.lists(names, min_size=1, max_size=3, unique=True), new=words, at=st.integers(1, 60))
    def kill(self, agents: list[str], new: list[int], at: int) -> None:
        """Turns of several agents, their saves queued together, and the process killed just before its
        `at`th write step: the restart finds the store directory as it was then. Every manifest on disk
        then names only blocks on disk and sound, and every turn acknowledged before the kill survives."""
        root, copy = self.work / "a", self.work / "killed"
        hook = KillAt(at, root, copy)
        store_mod._FAULT = hook
        self.saving_now = set(agents)
        self.unsure_syncs = True  # the disk the restart finds may be from before a sync's save
        try:
            self.saved_last = set(agents)
            done = []
            for agent in agents:
                self.rid += 1
                rid = f"r{self.rid}"
                _, served, _, _ = self._lookup(self.pool, agent, self._history(agent, 0, 1.0) + new, rid)
                n, future = self._store(self.pool, agent, served, rid)
                self._finish(self.pool, rid, agent)
                done.append((agent, served, n, self._ack(future)))
            for agent, served, n, settled in done:
                self._stored(self.pool, agent, served, n, settled, may_lose=True)
            watchdog(self.pool.close)
        finally:
            store_mod._FAULT = None
            self.saving_now = set()
            self.unsure_syncs = False
        if hook.killed is not None:
            shutil.rmtree(root)
            copy.rename(root)
        self._reopen()
        for m in self.pool.store.list_manifests():
            for bid in m.block_ids:
                assert self.pool.store.read_block(bid) is not None, (
                    f"killed before write step {at} ({hook.killed}): agent {m.namespace!r}'s manifest names "
                    f"block {bid[:12]}, missing or unsound on disk")
        self._check_survivors()

    @rule(x=names, y=names, new_x=words, new_y=words, then=st.sampled_from(QUEUED_THEN),
          i=st.integers(0, len(DISK_BUDGETS) - 1), fail=st.booleans())
    def queued(self, x: str, y: str, new_x: list[int], new_y: list[int], then: str, i: int, fail: bool) -> None:
        """Turns of x and y whose saves are still queued (the writer held inside x's save; `fail`: that
        attempt then fails and is retried after) while `then` runs: an erasure of x or y (of x while its
        request is in flight: its turn must not be stored), a disk budget `i` met by the saves (i == 0: a
        budget of none, for this step only), a sweep, or (with the fleet) an erasure of y through the
        other server. A queued save must neither bring back an erased agent nor be lost to the budget
        (the budget and the TTL never erase an agent whose save is queued)."""
        if then == "fleet_erase_y" and (self.other is None or "b" in self.cut):  # (b's erasure waits for the heal)
            then = "erase_y"
        if then == "erase_x_turn" and self.other is not None:  # (a sync racing the erasure: not modelled)
            then = "erase_x"
        self.saved_last = set()
        rids = []
        prompts = {}
        for agent, new in ((x, new_x), (y, new_y)):
            self.rid += 1
            rids.append(f"r{self.rid}")
            _, prompts[rids[-1]], _, _ = self._lookup(self.pool, agent, self._history(agent, 0, 1.0) + new, rids[-1])
        if then == "erase_x_in_flight":
            with self._watching(self.pool, {x}):
                watchdog(self.pool.erase, x, 30.0)
            self._forget(x)
        gate = Gate()
        store_mod._FAULT = gate
        self.saving_now = {x, y}
        erasing: Optional[Future] = None
        again: Optional[tuple] = None  # erase_x_turn's turn
        held: Optional[str] = None  # the agent whose save the gate holds (and fails when `fail`)
        try:
            done = []
            for agent, rid in zip((x, y), rids):
                n, future = self._store(self.pool, agent, prompts[rid], rid)
                if then == "erase_x_in_flight" and agent == x:
                    assert n == 0, f"agent {x!r} erased while its request ran, and its turn was stored"
                self._finish(self.pool, rid, agent)
                done.append((agent, prompts[rid], n, self._ack(future)))
                if held is None and future is not None:
                    held = agent
                if agent == x and future is not None:
                    gate.held.wait(5.0)  # the writer is inside x's save: y's stays queued
            if then in ("erase_x", "erase_y", "erase_x_turn"):
                target = y if then == "erase_y" else x
                erasing = _ADMIN.submit(self.pool.erase, target, 30.0)
                wait_until(lambda: self.pool.agent(target) is None)  # queued under the pool's lock with it
            if then == "erase_x_turn":  # x comes back: a turn whose save is queued after the erasure
                self._forget(x)
                self.rid += 1
                rid = f"r{self.rid}"
                _, served, _, _ = self._lookup(self.pool, x, new_x + [WORDS[2]], rid)
                n, future = self._store(self.pool, x, served, rid)
                self._finish(self.pool, rid, x)
                again = (x, served, n, self._ack(future))
            elif then == "budget":  # i == 0: none, so every agent goes but those a queued save holds (and pinned ones)
                self.disk = self.pool.persister.budget.disk_budget = ((0,) + DISK_BUDGETS[1:])[i]
            elif then == "sweep":
                erasing = self.pool.persister.sweep()
            elif then == "fleet_erase_y":
                erased = self.pool.fleet.tier.stats()["puts_erased"]
                watchdog(self.other.erase, y, 30.0)
                self.other.fleet.tier.flush(10)
            gate.fail = fail
        finally:
            gate.open()
            store_mod._FAULT = None
        self.saving_now = set()
        for agent, tokens, n, settled in done:  # an erasure of its agent, or x's failed attempt, may lose a save
            if then == "erase_x_turn" and agent == x:
                continue  # erased: the model forgot it before x's next turn
            lost = ((agent == held and fail) or (agent == x and then == "erase_x")
                    or (agent == y and then in ("erase_y", "fleet_erase_y")))
            self._stored(self.pool, agent, tokens, n, settled, may_lose=lost)
        if again is not None:  # saved after the erasure: it must become durable
            self._stored(self.pool, *again)
        if erasing is not None:
            erasing.result(OP_TIMEOUT_S)
        assert wait_until(lambda: self.pool.snapshot()["saves_retrying"] == 0, OP_TIMEOUT_S), "a retry never settled"
        watchdog(self.pool.flush, OP_TIMEOUT_S)
        if then in ("erase_x", "erase_y"):
            self._forget(x if then == "erase_x" else y)
            if self.other is not None:
                self.pool.fleet.tier.flush(10)
        elif then == "fleet_erase_y":
            self.pool.fleet.tier.flush(10)
            if self.pool.fleet.tier.stats()["puts_erased"] > erased:
                wait_until(lambda: self.pool.agent(y) is None, OP_TIMEOUT_S)
            self._forget(y, here="b")
        self.keep, self.saved_last = {x, y}, {x, y}
        if self.disk == 0:  # the budget of none was for this step only
            self.disk = self.pool.persister.budget.disk_budget = DISK_BUDGETS[0]

    # ---- the fleet (a second pool sharing Redis) ------------------------------------------------------

    @precondition(lambda self: self.other is not None)
    @rule(agent=names, new=words)
    def fleet_turn(self, agent: str, new: list[int]) -> None:
        """A turn of the agent on the other server: it syncs the agent from Redis first (its lookup
        waits for the sync), so it may reuse any history the first server published."""
        self.pool.fleet.tier.flush(10)
        self._serve(self.other, agent, self._history(agent, 0, 1.0) + new)
        self.other.fleet.tier.flush(10)
        self.elsewhere[agent] += 2

    @precondition(lambda self: self.other is not None)
    @rule(agent=names, pick=st.integers(0, 99), cut=st.floats(0.0, 0.9), new=words, aborted=st.booleans())
    def fleet_forget(self, agent: str, pick: int, cut: float, new: list[int], aborted: bool) -> None:
        """A forget edit on the other server, its turn stored or the request aborted: its removal records
        win in every merge, so once it is published this server's next sync of the agent drops what it
        removed (docs/fleet.md, Removals win)."""
        self.pool.fleet.tier.flush(10)
        if "b" in self.cut:  # its put is given up: published by its first sync of the agent after the heal
            self.unpublished["b"].add(agent)
        self._forget_edit(self.other, agent, self._history(agent, pick, cut) + new, aborted)
        watchdog(self.other.flush, OP_TIMEOUT_S)  # an aborted edit's record is saved at its end, then put
        self.other.fleet.tier.flush(10)
        self.elsewhere[agent] += 2

    @precondition(lambda self: self.other is not None and "b" not in self.cut)
    @rule(agent=names)
    def fleet_erase(self, agent: str) -> None:
        """The agent is erased through the other server: fleet-wide. A put of this server's still
        queued then meets the tombstone and erases the agent here, on a fleet thread: the step waits
        for that (the invariants would race it)."""
        erased = self.pool.fleet.tier.stats()["puts_erased"]
        watchdog(self.other.erase, agent, 30.0)
        self.other.fleet.tier.flush(10)
        self.pool.fleet.tier.flush(10)
        if self.pool.fleet.tier.stats()["puts_erased"] > erased:
            wait_until(lambda: self.pool.agent(agent) is None, OP_TIMEOUT_S)
        self._forget(agent, here="b")

    # ---- partitions and kills of the fleet's removals --------------------------------------------------

    def _reach(self, pool: BlockPool) -> None:
        """Wait until the pool's tier reaches Redis again (a healed proxy; its breaker closed)."""
        tier = pool.fleet.tier
        assert wait_until(lambda: (tier.get_manifest(AGENTS[0]), tier.stats()["connected"])[1], OP_TIMEOUT_S), (
            "a healed server did not reach Redis again")

    def _removals_in_redis(self, pool: BlockPool, agent: str) -> bool:
        """Whether Redis's copy of the agent holds the newest removal of the pool's record (its removal
        records, spliced_cleared and floor), or is a tombstone; read with the pool's tier."""
        with pool.core.lock:
            rec = pool.agent(agent)
            mine = 0.0 if rec is None else max([r.at for r in rec.removals] + [rec.spliced_cleared,
                                                                               rec.removed_floor])
        if mine <= 0.0:
            return True
        rm = pool.fleet.tier.get_manifest(agent)
        if rm is None:
            return False
        return rm.erased or max([r.at for r in rm.removals] + [rm.spliced_cleared, rm.removed_floor]) >= mine

    def _die(self, pool: BlockPool) -> None:
        """kill -9 of the server, as far as the fleet goes: its writer's queue (puts, erasures) is lost
        unsent; the disk's own writes are done (what was acknowledged is durable before its answer)."""
        fleet = pool.fleet
        fleet.stop()
        writer = fleet.tier.writer
        with writer._cond:
            writer._q.clear()
            writer._state.stop = True
            writer._cond.notify_all()
        watchdog(pool.close)

    @precondition(lambda self: self.other is not None)
    @rule(cut=st.booleans())
    def partition(self, cut: bool) -> None:
        """The other server (b) is cut off from Redis (its proxy closes every connection) or healed. Cut
        off, it serves from its local copy (its syncs fail at once, its puts are given up), which may
        hold what this server's forgets and erasures removed meanwhile; healed, it reaches Redis again,
        and its first sync of an agent whose forget it made while cut off publishes that forget
        (docs/fleet.md, The merge rules)."""
        if cut:
            self.proxies["b"].cut()
            self.cut.add("b")
            return
        if "b" not in self.cut:
            return
        self.proxies["b"].heal()
        self.cut.discard("b")
        self._reach(self.other)
        for agent in sorted(self.unpublished["b"]):
            watchdog(self.other.fleet._sync_agent, agent)
            watchdog(self.other.flush, OP_TIMEOUT_S)
            self.other.fleet.tier.flush(10)
        self.unpublished["b"].clear()

    @precondition(lambda self: self.other is not None and "b" not in self.cut)
    @rule(agent=names, stage=st.sampled_from(["queued", "in_redis"]))
    def erase_then_killed(self, agent: str, stage: str) -> None:
        """DELETE on this server, acknowledged (its local erasure durable, the erasure in the fleet's
        outbox), then the process killed: `queued`, cut off from Redis before the tombstone was
        written; `in_redis`, after it was written but before the outbox let go of it. Restarted (and
        healed), the server must not fetch the agent back, the erasure must reach Redis (queued again
        from the outbox, with the same tombstone id) and the outbox must empty."""
        if stage == "queued":
            self.proxies["a"].cut()
            self.cut.add("a")
        try:
            watchdog(self.pool.erase, agent, 30.0)
            if stage == "in_redis":
                assert self.pool.fleet.tier.flush(OP_TIMEOUT_S)
                self.pool.fleet.outbox.add(agent, self.pool.fleet.tier.era(agent))  # not let go yet
            self._die(self.pool)
        finally:
            self.proxies["a"].heal()
            self.cut.discard("a")
        self._forget(agent, here="a")
        self._reopen()
        self._reach(self.pool)
        assert self.pool.fleet.tier.flush(OP_TIMEOUT_S)
        assert not self.pool.fleet.outbox.pending(), "an erasure in Redis is still in the outbox"
        m = self.pool.fleet.tier.get_manifest(agent)
        assert m is not None and m.erased, f"agent {agent!r}: the acknowledged erasure never reached Redis"
        self._check_survivors()

    @precondition(lambda self: self.other is not None and "b" not in self.cut)
    @rule(agent=names, pick=st.integers(0, 99), cut=st.floats(0.0, 0.9), new=words)
    def forget_then_killed(self, agent: str, pick: int, cut: float, new: list[int]) -> None:
        """A forget edit on this server while it is cut off from Redis (its turn acknowledged: durable
        locally; its put given up), then the process killed, restarted and healed: its outbox publishes
        the forget at start-up, with no request or sync of the agent (issue #53; the other server holds
        what it removed until then). Only of an
        agent this server holds: then its record keeps the erasure its history follows (an agent it
        erased and restarted since has no record left saying so, and a turn of it made while cut off
        meets its own old tombstone as an erasure at the heal: a known limit, docs/fleet.md)."""
        if self.pool.agent(agent) is None or self.stale["a"].get(agent):
            return  # (a copy from before another server's erasure: its turns go at the sync, by the era rules)
        self.proxies["a"].cut()
        self.cut.add("a")
        self.unpublished["a"].add(agent)
        try:
            self._forget_edit(self.pool, agent, self._history(agent, pick, cut) + new, False)
            self._die(self.pool)
        finally:
            self.proxies["a"].heal()
            self.cut.discard("a")
        self._reopen()
        self._reach(self.pool)
        assert wait_until(lambda: self._removals_in_redis(self.pool, agent), OP_TIMEOUT_S), (
            "a forget acknowledged before a kill was not published from the outbox after the restart")
        watchdog(self.pool.flush, OP_TIMEOUT_S)
        assert self.pool.fleet.tier.flush(OP_TIMEOUT_S)
        self.unpublished["a"].discard(agent)
        self._check_survivors()

    @precondition(lambda self: self.other is not None and self.forget_runs == 0 and "b" not in self.cut)
    @rule(agent=names, pick=st.integers(0, 99), new=words)
    def forgets_past_bound(self, agent: str, pick: int, new: list[int]) -> None:
        """The other server stores a turn (a history and a tool output after it); then this server
        forgets the tool output of each turn, MAX_REMOVALS + 1 times in a row, each turn replacing the
        last output (once per example: a long step). The removal records pass their bound (the first,
        the only one naming the other server's copy, is compacted away), and the other server must
        still drop that copy at its next sync (docs/fleet.md, The merge rules: the floor)."""
        self.forget_runs += 1
        base = self._history(agent, pick, 1.0) + new

        def output(i: int) -> list[int]:
            n = len(WORDS)  # distinct for every i < n * n: no output is sent again
            return [WORDS[i % n], WORDS[i // n % n]] + [WORDS[(i * 3 + j) % n] for j in range(BLOCK)]

        self.pool.fleet.tier.flush(10)
        self._serve(self.other, agent, base + output(0))
        self.other.fleet.tier.flush(10)
        self.elsewhere[agent] += 2
        for i in range(1, MAX_REMOVALS + 2):
            self._forget_edit(self.pool, agent, base + output(i), False)
        self.pool.fleet.tier.flush(10)

    # ---- invariants ----------------------------------------------------------------------------------

    def _check_survivors(self) -> None:
        """After a restart, crash or kill: every acknowledged turn is reused whole (a spliced one by an
        amortize lookup), unless its agent was erased by the budget or the TTL since (the stats say so);
        pinned agents never are."""
        self._sync_erased()
        for a in AGENTS:
            for seq, edit in ((self.acked[a], None), (self.acked_spliced[a], AMORTIZE)):
                if seq is None:
                    continue
                probe = seq + [WORDS[1]]
                with self._watching(self.pool, {a}):
                    n = watchdog(self.pool.match, a, probe, None, edit=edit).num_tokens
                    self._looked_up(self.pool, a, probe, None)
                self.keep.add(a)  # the hot budget spares the last lookup's agent
                if n < len(seq) and self.elsewhere[a] >= BRANCHES:
                    # `branches` more recently used ones on the other server kept instead
                    if edit is None:
                        self.acked[a] = None
                    else:
                        self.acked_spliced[a] = None
                    continue
                assert n == len(seq), (f"agent {a!r}: acknowledged {'amortize ' if edit else ''}turn of {len(seq)} "
                                       f"tokens, {n} reused after a restart")

    def _sync_erased(self) -> None:
        """Agents the pool no longer knows were erased by the disk budget or the TTL: the stats must
        say so, and none was pinned. The model forgets them (so they must never come back)."""
        for a in AGENTS:
            acked = [(s, at) for s, at in ((self.acked[a], self.acked_at[a]),
                                           (self.acked_spliced[a], self.acked_spliced_at[a])) if s is not None]
            if (self.hist[a] or self.spliced[a] or acked) and self.pool.agent(a) is None:
                for _, at in acked:
                    assert a not in self.pinned, f"pinned agent {a!r} was erased"
                    assert self._erasures_now() > at, (
                        f"agent {a!r} disappeared but no budget or TTL erasure was recorded since its last turn")
                self._forget(a, fleet_wide=False)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "pool"):
            return
        PoolMachine.steps_run += 1
        self._sync_erased()
        assert self.pool.check() == []
        agents = {a: self.pool.agent(a) for a in AGENTS}
        slack = sum(x.hot_bytes for a, x in agents.items() if x is not None and (x.pinned or a in self.keep))
        slack += sum(x.hot_bytes for x in self.pool.agents.anonymous.values())
        assert self.pool.hot_bytes <= self.hot + slack, (
            f"hot bytes {self.pool.hot_bytes} over the budget {self.hot} + {slack}")

    @invariant()
    def pins_as_set(self) -> None:
        """This server's pins are the ones it set last (the other server sets none; its merges carry
        them): an earlier pin or unpin never comes back through a merge, whatever the clocks did. An
        agent the other server erased is as it was here until this server syncs it."""
        if not hasattr(self, "pool"):
            return
        for a in AGENTS:
            rec = self.pool.agent(a)
            if rec is not None and a not in self.stale["a"]:
                assert rec.pinned == (a in self.pinned), (
                    f"agent {a!r} is {'' if rec.pinned else 'un'}pinned here; it was last "
                    f"{'' if a in self.pinned else 'un'}pinned")

    @invariant()
    def held_histories(self) -> None:
        """Every branch a pool holds is a history (or a prefix of one) that the agent may hold there."""
        if not hasattr(self, "pool"):
            return
        for pool in (self.pool, self.other):
            if pool is None:
                continue
            name = self._name(pool)
            for a in AGENTS:
                rec = pool.agent(a)
                if rec is None:
                    continue
                stale = self.stale[name].get(a, [])
                for br in list(rec.branches):
                    seqs = (self._allowed_spliced(a) if br.spliced else self._allowed(a)) + stale
                    assert self._resolve(br, seqs) is not None, (
                        f"pool {name}: agent {a!r} holds a{' spliced' if br.spliced else 'n honest'} branch of "
                        f"{br.n_tokens} tokens that is none of the histories it may hold")

    @invariant()
    def disk_within_budget_and_clean(self) -> None:
        if not hasattr(self, "pool"):
            return
        pool = self.pool
        watchdog(pool.flush, OP_TIMEOUT_S)
        s = pool.snapshot()
        extra = sum(pool.persister.agent_disk_bytes(a) + 2048 for a in self.pinned | self.saved_last)
        assert s["disk_bytes"] <= self.disk + extra, f"disk bytes {s['disk_bytes']} over {self.disk} + {extra}"
        named = set(pool.persister.index.block_refs)
        files = set(pool.store.iter_block_ids())
        assert named <= files, f"{len(named - files)} block(s) named by a manifest have no file"
        assert files <= named, f"{len(files - named)} block file(s) no manifest names"
        for p in (pool, self.other):
            if p is None:
                continue
            if p is not pool:
                watchdog(p.flush, OP_TIMEOUT_S)
            on_disk = {m.namespace for m in p.store.list_manifests()}
            unknown = sorted(ns for ns in on_disk if p.agent(ns) is None)
            assert not unknown, f"pool {self._name(p)}: manifests on disk of agents it does not hold: {unknown}"


class FleetMachine(PoolMachine):
    """PoolMachine with a second pool sharing a real redis-server (the fleet rules on)."""

    fleet = True


STEPS = 50  # steps per example in the campaign (the suite's runs take 30)
EXAMPLES_PER_SEED = 10


def _falsifying(e: BaseException) -> str:
    """The falsifying steps Hypothesis attaches to a failure as notes (PEP 678), of each failure
    when it found several (an ExceptionGroup)."""
    parts = [f"{type(e).__name__}: {e}"[:300] + "\n" + "\n".join(getattr(e, "__notes__", []))]
    for sub in getattr(e, "exceptions", ()):
        parts.append(_falsifying(sub))
    return "\n\n".join(p for p in parts if p.strip())


def campaign(trials: int, seed: int, work: Path, steps: int = STEPS, fleet_only: bool = False) -> dict:
    """`vllm-mlx-persist reliability --campaigns state_machine`: `trials` examples of up to `steps`
    steps, EXAMPLES_PER_SEED per seed from `seed` on, every fourth seed with the fleet rules (when a
    redis-server is at hand; `fleet_only`: every seed, the `fleet` campaign: partitions, kills of
    removals, removals past their bound). A failure is shrunk by Hypothesis and recorded with its steps."""
    import io
    import logging

    from hypothesis import HealthCheck, Phase, settings
    from hypothesis import seed as use_seed
    from hypothesis.reporting import with_reporter
    from hypothesis.stateful import run_state_machine_as_test

    logging.getLogger("vllm_mlx_persist").setLevel(logging.ERROR)  # the crash rule's failing writes, by the hundred
    out: dict[str, Any] = {"trials": 0, "failures": 0, "failure_cases": [], "steps": 0, "fleet_steps": 0,
                           "steps_per_example": steps, "seeds": []}
    left, s = trials, seed
    while left > 0:
        n = min(EXAMPLES_PER_SEED, left)
        fleet = (fleet_only or (s - seed) % 4 == 1) and Redis.available()
        if fleet_only and not fleet:
            raise RuntimeError("the fleet campaign needs a redis-server")
        machine = use_seed(s)(type(f"Seeded{s}", (FleetMachine if fleet else PoolMachine,), {}))
        before = PoolMachine.steps_run
        report = io.StringIO()
        try:
            with with_reporter(lambda text: report.write(f"{text}\n")):
                run_state_machine_as_test(machine, settings=settings(
                    max_examples=n, stateful_step_count=steps, deadline=None, database=None,
                    phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck)))
        except BaseException as e:  # a failed invariant, after shrinking: the steps are in the report
            out["failures"] += 1
            out["failure_cases"].append({"seed": s, "fleet": fleet, "problem": f"{type(e).__name__}: {e}"[:600],
                                         "steps": (_falsifying(e) or report.getvalue())[-4000:]})
        ran = PoolMachine.steps_run - before
        out["fleet_steps" if fleet else "steps"] += ran
        out["seeds"].append({"seed": s, "examples": n, "fleet": fleet, "steps": ran})
        out["trials"] += n
        left -= n
        s += 1
    return out
