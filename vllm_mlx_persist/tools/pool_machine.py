"""Every pool operation at random against a reference model: a Hypothesis state machine.

A reference model of what every agent should hold is driven against the real pool, persister and
store on disk (and, with a redis-server at hand, a second pool sharing it as the fleet tier). Rules:
turns (growing or diverging histories), forks, two requests of one agent at once (branches), turns
whose history is re-tokenized (matched by text), forget edits (span directives), anonymous requests, erasure, pin and unpin, hot and
disk budget changes, the TTL with a clock moved on, restart (close and reopen), crash (the disk fails
with writes queued, then close), and on the second pool: turns synced from the fleet and erasures.
Invariants after every step:
- a served prefix covers only tokens of the request, comes from a history of that agent (or of the
  parent it explicitly forked from), and its K/V equal, bit for bit, what that history stored;
- the text of a prompt served as stored tokens (matching by text) is the client's text;
- every operation returns within OP_TIMEOUT_S (a watchdog fails the run, never hangs it);
- the block table's invariants hold (references, owners, hot bytes: BlockTable.check);
- hot bytes within the hot budget plus the agents of the last request and the pinned ones; disk
  within its budget plus the agent saved last and the pinned ones;
- after a flush, every block file is named by a manifest and every named block has its file;
- an acknowledged (durable) turn survives every restart and crash, unless an erasure that the stats
  record removed its agent (the disk budget or the TTL) or the API erased it, or (the fleet merging
  both servers' branches by recency) `branches` branches used after it on the other server may have
  pushed it out; pinned agents are never erased by the budget or the TTL; an erased agent never
  returns, locally or from the fleet.

K/V are synthetic but go through the real 4-bit code: token t's K and V are drawn from a seed that
hashes the whole history up to t (as a real model's depend on everything before), quantized by
`Q4KVCache`. So a prefix served from another agent's or another branch's history has other bytes.

Used by tests/test_state_machine.py (a bounded run in CI, and the shrunk sequences of failures found
as explicit examples) and by `vllm-mlx-persist reliability --campaigns state_machine` (long runs).
Never imported by the runtime.
"""

from __future__ import annotations

import hashlib
import shutil
import socket
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Callable, Optional

import mlx.core as mx
import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from .. import faults, store as store_mod
from ..caches.q4 import Q4KVCache
from ..kv_edit import FORGET
from ..pool import BlockPool
from ..store import DiskStore

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


def decode(ids: list[int]) -> str:
    return "".join(TEXT.get(int(i), f" w{int(i)}") for i in ids)


class SyntheticKV:
    """K/V of a token history: per token, drawn from a seed hashing every token up to it."""

    def __init__(self) -> None:
        self._memo: dict[bytes, np.ndarray] = {}

    def arrays(self, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(K, V), each (LAYERS, 1, HEADS, len(tokens), DIM) float32."""
        h = hashlib.sha256(b"synthetic-kv")
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
        kv = np.stack(rows, axis=3) if rows else np.zeros((2, LAYERS, HEADS, 0, DIM), np.float32)
        return kv[0][:, None], kv[1][:, None]

    def cache(self, tokens: list[int]) -> list[Q4KVCache]:
        """A per-sequence 4-bit cache holding `tokens`, as a prefill would store it."""
        k, v = self.arrays(tokens)
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


_WORKER = ThreadPoolExecutor(1, thread_name_prefix="machine-worker")  # vllm-mlx's worker: the one MLX thread


def watchdog(fn: Callable, *args: Any, timeout: float = OP_TIMEOUT_S, **kw: Any) -> Any:
    """fn(*args) on the machine's worker thread (MLX streams are per thread, and the pool's MLX work
    runs on one thread, as in the server); AssertionError if it does not return within `timeout`."""
    future = _WORKER.submit(fn, *args, **kw)
    try:
        return future.result(timeout)
    except FutureTimeout:
        raise AssertionError(f"{getattr(fn, '__qualname__', fn)} did not return within {timeout} s (a hang)") from None


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


def open_pool(root: Path, *, hot: int, disk: int, clock: Clock, redis_url: Optional[str] = None,
              retry_delays: tuple = (0.05,)) -> BlockPool:
    fmt = {"bits": BITS, "group_size": GROUP, "block_size": BLOCK}
    fleet = None
    if redis_url is not None:
        from ..fleet import Fleet, FleetSettings, RemoteTier

        def fleet(pool: BlockPool) -> Fleet:
            return Fleet(pool, lambda **cb: RemoteTier(FleetSettings(redis_url, wait_s=10.0), FINGERPRINT, **cb))
    pool = BlockPool(fingerprint=FINGERPRINT, n_layers=LAYERS, bits=BITS, group_size=GROUP, block_size=BLOCK,
                     hot_bytes=hot, store=DiskStore(root, FINGERPRINT, {"machine": True}, fmt), disk_budget=disk,
                     persister_options={"ttl_s": TTL_S, "retry_delays": retry_delays},
                     branches=BRANCHES, decode=decode, fleet=fleet, clock=clock)
    pool.load_manifests()
    pool.flush()  # the start-up scan (sizes, garbage collection, the first budget and TTL check) is done
    return pool


HOT_BUDGETS = (1 << 30, 40 * TOKEN_BYTES, 120 * TOKEN_BYTES)
DISK_BUDGETS = (1 << 40, 200 * TOKEN_BYTES, 600 * TOKEN_BYTES)

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
        self.clock = Clock()
        self.hot, self.disk = HOT_BUDGETS[0], DISK_BUDGETS[0]
        self.redis = Redis(self.work) if self.fleet else None
        self.pool = self._open(self.work / "a")
        self.other = self._open(self.work / "b") if self.fleet else None
        self.hist: dict[str, list[list[int]]] = {a: [] for a in AGENTS}  # since the agent's last erasure
        # Histories the budget or the TTL erased here: local space decisions, so with the fleet tier
        # they may come back from Redis (only an API erasure is fleet-wide).
        self.published: dict[str, list[list[int]]] = {a: [] for a in AGENTS}
        self.anon: list[list[int]] = []
        self.acked: dict[str, Optional[list[int]]] = dict.fromkeys(AGENTS)  # last durable turn
        self.acked_at: dict[str, int] = dict.fromkeys(AGENTS, 0)  # erasures counted when it was acked
        # Branches of the agent the other server may have used since its acknowledged turn here: each
        # fleet turn uses at most two (the one it is served from, the one it makes). With `branches`
        # of them, the fleet's merge by recency may rightly push that turn out.
        self.elsewhere: dict[str, int] = dict.fromkeys(AGENTS, 0)
        self.pinned: set[str] = set()
        self.erasures = 0  # budget and TTL erasures over every pool lifetime (the stats'); API ones apart
        self.keep: set[str] = set()  # agents of the last request: the hot budget spares them
        self.saved_last: Optional[str] = None
        self.rid = 0

    def _open(self, root: Path) -> BlockPool:
        return watchdog(open_pool, root, hot=self.hot, disk=self.disk, clock=self.clock,
                        redis_url=self.redis.url if self.redis else None)

    def teardown(self) -> None:
        for pool in (self.pool, self.other):
            if pool is not None:
                try:
                    pool.close()
                except Exception:
                    pass
        store_mod._FAULT = None
        if self.redis is not None:
            self.redis.stop()
        shutil.rmtree(self.work, ignore_errors=True)

    # ---- helpers -----------------------------------------------------------------------------------

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

    def _serve(self, pool: BlockPool, agent: Optional[str], prompt: list[int], fork_from: Optional[str] = None,
               durable: bool = True, edit: Optional[str] = None) -> tuple[int, list[int]]:
        """One request through `pool`: look up, check what was served, commit the whole prompt (the
        stored tokens when matched by text). Returns (tokens reused, the tokens committed)."""
        self.rid += 1
        rid = f"r{self.rid}"
        m = watchdog(pool.match, agent, prompt, rid, fork_from, edit=edit)
        served = m.prompt if m.prompt is not None else prompt
        assert decode(served) == decode(prompt), f"served {served} for {prompt}: not the client's text"
        n = m.num_tokens
        assert 0 <= n <= len(served) - 1
        if n:
            allowed = (self.hist[agent] + self.published[agent] if agent is not None else self.anon) + (
                self.hist[fork_from] + self.published[fork_from] if fork_from else [])
            assert any(s[:n] == served[:n] for s in allowed), (
                f"{agent!r} was served {n} tokens that none of its histories{' or its parent' if fork_from else ''} holds")
            assert watchdog(self._same, m.cache, served[:n]), f"{agent!r}: served K/V differ from the stored"
        n_stored, future = watchdog(self._commit, pool, agent, served, rid, fork_from)
        ok = bool(future.result(OP_TIMEOUT_S)) if future is not None else False
        watchdog(pool.finish, rid)
        assert n_stored in (0, len(served))
        if agent is None:
            self.anon.append(served)
        elif n_stored:
            self.hist[agent].append(served)
            self.saved_last = agent
            if ok and durable and pool is self.pool:
                self.acked[agent], self.acked_at[agent], self.elsewhere[agent] = served, self._erasures_now(), 0
        if pool is self.pool:  # a request of the other server leaves this pool's budget as it was
            self.keep = {x for x in (agent, fork_from) if x is not None}
        return n, served

    def _same(self, cache: list, tokens: list[int]) -> bool:
        return same_cache(cache, self.kv.cache(tokens))

    def _commit(self, pool: BlockPool, agent: Optional[str], tokens: list[int], rid: str,
                fork_from: Optional[str] = None) -> tuple:
        return pool.commit_async(agent, tokens, self.kv.cache(tokens), rid, fork_from)

    def _forget(self, agent: str, fleet_wide: bool = True) -> None:
        """The agent was erased: by the API (`fleet_wide`), or here only (the budget, the TTL)."""
        if fleet_wide:
            self.published[agent] = []
        elif self.fleet:
            self.published[agent] += self.hist[agent]
        self.hist[agent] = []
        self.acked[agent] = None
        self.pinned.discard(agent)

    # ---- rules ---------------------------------------------------------------------------------------

    @rule(agent=names, pick=st.integers(0, 99), cut=st.floats(0.0, 1.0), new=words)
    def turn(self, agent: str, pick: int, cut: float, new: list[int]) -> None:
        """A turn: one of the agent's histories cut somewhere (all of it: the conversation goes on),
        then new tokens."""
        self._serve(self.pool, agent, self._history(agent, pick, cut) + new)

    @rule(agent=names, pick=st.integers(0, 99), cut=st.floats(0.0, 0.9), new=words)
    def forget_edit(self, agent: str, pick: int, cut: float, new: list[int]) -> None:
        """A span directive `forget`: one of the agent's histories cut and continued otherwise; the
        branches holding what it drops leave the agent, memory and disk (kv_edit/supersede.py). The edit may
        supersede the acknowledged turn, so only its own turn is owed afterwards."""
        self.acked[agent] = None
        self._serve(self.pool, agent, self._history(agent, pick, cut) + new, edit=FORGET)

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
        rids = []
        for p in (p1, p2):
            self.rid += 1
            rids.append(f"r{self.rid}")
            m = watchdog(self.pool.match, agent, p, rids[-1])
            if m.num_tokens:
                assert any(s[: m.num_tokens] == (m.prompt or p)[: m.num_tokens]
                           for s in self.hist[agent] + self.published[agent])
                assert watchdog(self._same, m.cache, (m.prompt or p)[: m.num_tokens])
        for p, rid in reversed(list(zip((p1, p2), rids))):
            n, future = watchdog(self._commit, self.pool, agent, p, rid)
            ok = bool(future.result(OP_TIMEOUT_S)) if future is not None else False
            watchdog(self.pool.finish, rid)
            if n:
                self.hist[agent].append(p)
                self.saved_last = agent
                if ok:
                    self.acked[agent], self.acked_at[agent], self.elsewhere[agent] = p, self._erasures_now(), 0
        self.keep = {agent}

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

    @rule(pick=st.integers(0, 99), cut=st.floats(0.0, 1.0), new=words)
    def anonymous(self, pick: int, cut: float, new: list[int]) -> None:
        self._serve(self.pool, None, self._history(None, pick, cut) + new)

    @rule(agent=names)
    def erase(self, agent: str) -> None:
        watchdog(self.pool.erase, agent, 30.0)
        self._forget(agent)
        if self.other is not None:
            self.pool.fleet.tier.flush(10)  # the tombstone is in Redis before the next step

    @rule(agent=names, pin=st.booleans())
    def pin(self, agent: str, pin: bool) -> None:
        if watchdog(self.pool.set_pinned, agent, pin, 30.0):
            (self.pinned.add if pin else self.pinned.discard)(agent)

    @rule(i=st.integers(0, len(HOT_BUDGETS) - 1))
    def hot_budget(self, i: int) -> None:
        self.hot = HOT_BUDGETS[i]
        watchdog(self.pool.set_hot_budget, self.hot)
        self.keep = set()

    @rule(i=st.integers(0, len(DISK_BUDGETS) - 1))
    def disk_budget(self, i: int) -> None:
        self.disk = self.pool.persister.budget.disk_budget = DISK_BUDGETS[i]
        watchdog(self.pool.persister.sweep().result, OP_TIMEOUT_S)
        self.saved_last = None

    @rule()
    def ttl(self) -> None:
        """The clock moves past the TTL: every agent but the pinned ones is erased (no request is in
        flight between steps)."""
        self.clock.offset += TTL_S + 1
        watchdog(self.pool.persister.sweep().result, OP_TIMEOUT_S)
        for a in AGENTS:
            if a not in self.pinned:
                self._forget(a, fleet_wide=False)
        self.saved_last = None

    @rule()
    def restart(self) -> None:
        self._base_erasures = self._erasures_now()
        watchdog(self.pool.close)
        self.pool = self._open(self.work / "a")
        self._check_survivors()

    @rule(agent=names, new=words)
    def crash(self, agent: str, new: list[int]) -> None:
        """The disk fails with a turn queued, then the process stops: that turn is not acknowledged and
        may be lost; every acknowledged one survives."""
        self._base_erasures = self._erasures_now()
        store_mod._FAULT = faults.parse(f"EIO:open,write,fsync,rename,dirsync@{self.work}")
        try:
            self._serve(self.pool, agent, self._history(agent, 0, 1.0) + new, durable=False)
            watchdog(self.pool.close)
        finally:
            store_mod._FAULT = None
        self.pool = self._open(self.work / "a")
        self._check_survivors()

    # ---- the fleet (a second pool sharing Redis) ------------------------------------------------------

    @precondition(lambda self: self.other is not None)
    @rule(agent=names, new=words)
    def fleet_turn(self, agent: str, new: list[int]) -> None:
        """A turn of the agent on the other server: it syncs the agent from Redis first (its lookup
        waits for the sync), so it may reuse any history the first server published."""
        self.pool.fleet.tier.flush(10)
        n, _ = self._serve(self.other, agent, self._history(agent, 0, 1.0) + new)
        self.other.fleet.tier.flush(10)
        self.elsewhere[agent] += 2

    @precondition(lambda self: self.other is not None)
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
            deadline = time.monotonic() + OP_TIMEOUT_S
            while self.pool.agent(agent) is not None and time.monotonic() < deadline:
                time.sleep(0.01)
        self._forget(agent)

    # ---- invariants ----------------------------------------------------------------------------------

    def _check_survivors(self) -> None:
        """After a restart or crash: every acknowledged turn is reused whole, unless its agent was
        erased by the budget or the TTL since (the stats say so); pinned agents never are."""
        self._sync_erased()
        for a, seq in self.acked.items():
            if seq is None:
                continue
            probe = seq + [WORDS[1]]
            n = watchdog(self.pool.lookup, a, probe)[1]
            if n < len(seq) and self.elsewhere[a] >= BRANCHES:
                self.acked[a] = None  # `branches` more recently used ones on the other server kept instead
                continue
            assert n == len(seq), f"agent {a!r}: acknowledged turn of {len(seq)} tokens, {n} reused after a restart"

    def _sync_erased(self) -> None:
        """Agents the pool no longer knows were erased by the disk budget or the TTL: the stats must
        say so, and none was pinned. The model forgets them (so they must never come back)."""
        for a in AGENTS:
            if (self.hist[a] or self.acked[a]) and self.pool.agent(a) is None:
                if self.acked[a] is not None:
                    assert a not in self.pinned, f"pinned agent {a!r} was erased"
                    assert self._erasures_now() > self.acked_at[a], (
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
    def disk_within_budget_and_clean(self) -> None:
        if not hasattr(self, "pool"):
            return
        pool = self.pool
        watchdog(pool.flush, OP_TIMEOUT_S)
        s = pool.snapshot()
        extra = sum(pool.persister.agent_disk_bytes(a) + 2048 for a in self.pinned | {self.saved_last} if a)
        assert s["disk_bytes"] <= self.disk + extra, f"disk bytes {s['disk_bytes']} over {self.disk} + {extra}"
        named = set(pool.persister.index.block_refs)
        files = set(pool.store.iter_block_ids())
        assert named <= files, f"{len(named - files)} block(s) named by a manifest have no file"
        assert files <= named, f"{len(files - named)} block file(s) no manifest names"


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


def campaign(trials: int, seed: int, work: Path, steps: int = STEPS) -> dict:
    """`vllm-mlx-persist reliability --campaigns state_machine`: `trials` examples of up to `steps`
    steps, EXAMPLES_PER_SEED per seed from `seed` on, every fourth seed with the fleet rules (when a
    redis-server is at hand). A failure is shrunk by Hypothesis and recorded with its steps."""
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
        fleet = (s - seed) % 4 == 1 and Redis.available()
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
