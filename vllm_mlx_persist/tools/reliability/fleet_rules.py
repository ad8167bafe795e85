"""The pool state machine's fleet rules: turns, forget edits and erasures on a second pool sharing a
real redis-server with the first, partitions (each pool reaches Redis through partition.py's proxy: the
second is cut off and healed), a kill -9 at each step of an erasure and of a forget's publish, and forget
edits past the removal records' bound.

A base of PoolMachine (pool_machine.py): each rule's precondition leaves it off until FleetMachine's
second pool is there. Both machines keep one list of rules, so a seed draws the same steps whichever
module a rule is written in. Run by tests/test_state_machine.py (test_fleet_machine) and
`vllm-mlx-persist reliability --campaigns fleet` (every fourth seed of `state_machine`). Never imported by
the runtime.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from ...disk_format import MAX_REMOVALS
from ...pool import BlockPool
from .machine_kit import AGENTS, BLOCK, OP_TIMEOUT_S, WORDS, names, wait_until, watchdog, words
from .pool_model import PoolModel


class FleetRules(PoolModel):
    """The rules of the second pool, the partitions and the kills of the fleet's removals."""

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
