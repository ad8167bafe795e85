"""The pool state machine's reference model: what every agent may be served and must still hold (its
honest and spliced histories, what an erasure or a forget removed, what the other server of the fleet
may still hold until it syncs, the last acknowledged turns, the pins, the hot tier's recency), and the
checked pool operations the rules are made of: a lookup whose served prefix, text and K/V are checked
against the model (and who left memory around it), a commit, the acknowledgement of its save, a
restart's survivors.

The rules are in pool_machine.py (PoolMachine) and fleet_rules.py; tests/test_state_machine.py and
`vllm-mlx-persist reliability --campaigns state_machine` (or `fleet`) run them. Never imported by the
runtime.
"""

from __future__ import annotations

import shutil
import tempfile
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from ... import store as store_mod
from ...chain import Branch, Chains, lcp
from ...kv_edit import AMORTIZE, FORGET
from ...pool import BlockPool
from .machine_kit import (AGENTS, BLOCK, BRANCHES, DISK_BUDGETS, FINGERPRINT, GONE_KEPT, HOT_BUDGETS, OP_TIMEOUT_S,
                          WORDS, Clock, ServerClock, SyntheticKV, decode, open_pool, same_cache, spliced_mask,
                          wait_until, watchdog)
from ..serving import RedisServer
from .partition import PartitionProxy


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



class PoolModel:
    """The reference model and the checked pool operations of PoolMachine (see the module docstring)."""

    fleet = False  # FleetMachine turns the second pool and its rules on (needs a redis-server)

    def __init__(self) -> None:
        super().__init__()
        self.work = Path(tempfile.mkdtemp(prefix="pool-machine-"))
        self.kv = SyntheticKV()
        self.chains = Chains(FINGERPRINT, BLOCK)
        self._ids_memo: dict[tuple, list[str]] = {}
        self.clock = Clock()
        self.clocks = {n: ServerClock(self.clock) for n in "ab"}  # each server's, stepped by `clock_step`
        self.hot, self.disk = HOT_BUDGETS[0], DISK_BUDGETS[0]
        self.redis = RedisServer(self.work) if self.fleet else None
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

    # ---- restarts and what must survive them ------------------------------------------------------------

    def _reopen(self) -> None:
        self._base_erasures = self._erasures_now()  # the closed pool's, every one before the restart included
        self.pool = self._open(self.work / "a")
        self.recency.restart([a for a in AGENTS if self.pool.agent(a) is not None])
        self.keep, self.saving_now = set(), set()

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
