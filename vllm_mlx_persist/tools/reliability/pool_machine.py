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

K/V are synthetic but go through the real 4-bit code (machine_kit.py's SyntheticKV): a prefix served
from another agent's or another branch's history, or a spliced branch served to an exact lookup, has
other bytes.

Here: the rules of one pool and the invariants. The reference model and the checked pool operations
the rules are made of: pool_model.py; the fleet's rules: fleet_rules.py; what the machine drives the
pool with: machine_kit.py. Used by tests/test_state_machine.py (short seeded runs in CI, and the shrunk
sequences of failures found as explicit examples) and by `vllm-mlx-persist reliability --campaigns
state_machine` (long runs, machine_campaign.py). Never imported by the runtime.
"""

from __future__ import annotations

import shutil
from concurrent.futures import Future
from typing import Optional

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ... import faults, store as store_mod
from ...kv_edit import AMORTIZE
from ...kv_edit.rotations import clip, normalize, peak
from .fleet_rules import FleetRules
from .machine_kit import (ADMIN, AGENTS, CLOCK_SPAN, CLOCK_STEPS, DISK_BUDGETS, HOT_BUDGETS, OP_TIMEOUT_S, RETOKENIZE,
                          TTL_S, WORDS, Gate, KillAt, names, wait_until, watchdog, words)

QUEUED_THEN = ("erase_x", "erase_y", "erase_x_in_flight", "erase_x_turn", "budget", "sweep", "fleet_erase_y")


class PoolMachine(FleetRules, RuleBasedStateMachine):
    """The pool against a reference model (pool_model.py; the rules and invariants: the module docstring)."""

    steps_run = 0  # steps taken by every machine in this process (the campaign's count)

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
                erasing = ADMIN.submit(self.pool.erase, target, 30.0)
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

    # ---- invariants ----------------------------------------------------------------------------------


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
