"""Every pool operation at random, against a reference model (vllm_mlx_persist/tools/reliability/pool_machine.py):
turns, forks, branches, text matching, forget and amortize edits, anonymous requests, erasure, pins,
budgets, the TTL, restarts, crashes, kills at a write step, saves left queued, and with a redis-server a
second pool sharing the fleet tier. Here several short runs, each from its own seed (a run's first
examples are its most varied: several seeds find more than one long run for the same time);
`vllm-mlx-persist reliability --campaigns state_machine` runs it long. POOL_MACHINE_SEEDS,
POOL_MACHINE_FLEET_SEEDS and POOL_MACHINE_EXAMPLES (per seed) size the runs, POOL_MACHINE_SEED moves
the seeds on, POOL_MACHINE_SHRINK=0 reports a failure unshrunk (to time how fast one is found).

Sized for CI (2 cores, the whole suite under 10 minutes): 6 seeds of the pool machine and 3 of the
fleet one, 10 examples each (the fleet's 6), of up to 30 steps. This file, measured 2026-11-28 on 2
cores shared with other work: about 31 s of CPU; 66 s of wall time at a load average of 5, 110 s at 11. The defects
injected by hand that these runs catch, and how fast: docs/reliability.md, last section
(`python tests/mutants.py`)."""

from __future__ import annotations

import os
from typing import Callable, Optional

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as use_seed
from hypothesis.stateful import run_state_machine_as_test

from vllm_mlx_persist.tools.serving import RedisServer
from vllm_mlx_persist.tools.reliability.pool_machine import FleetMachine, PoolMachine

SEED = int(os.environ.get("POOL_MACHINE_SEED", "0"))
POOL_SEEDS = range(SEED, SEED + int(os.environ.get("POOL_MACHINE_SEEDS", "6")))
FLEET_SEEDS = range(SEED, SEED + int(os.environ.get("POOL_MACHINE_FLEET_SEEDS", "3")))
EXAMPLES = int(os.environ.get("POOL_MACHINE_EXAMPLES", "10"))
STEPS = 30


def run_seeded(machine: type, seed: int, examples: int) -> None:
    """`examples` examples of up to STEPS steps of `machine`, generated from `seed` (the same ones every
    run), shrunk when one fails."""
    phases = [Phase.generate] + ([Phase.shrink] if os.environ.get("POOL_MACHINE_SHRINK", "1") != "0" else [])
    run_state_machine_as_test(use_seed(seed)(type(f"{machine.__name__}Seed{seed}", (machine,), {})),
                              settings=settings(max_examples=examples, stateful_step_count=STEPS, deadline=None,
                                                database=None, phases=phases,
                                                suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.data_too_large]))


@pytest.mark.parametrize("seed", POOL_SEEDS)
def test_pool_machine(seed: int) -> None:
    run_seeded(PoolMachine, seed, EXAMPLES)


@pytest.mark.skipif(not RedisServer.available(), reason="no redis-server: the fleet rules need one")
@pytest.mark.parametrize("seed", FLEET_SEEDS)
def test_fleet_machine(seed: int) -> None:
    run_seeded(FleetMachine, seed, max(1, EXAMPLES * 2 // 3))


# ---- sequences the machine found, shrunk by Hypothesis, kept as explicit examples ----------------------


def replay(steps: list[tuple[str, dict]], check: Optional[Callable[[PoolMachine], None]] = None,
           machine: type = FleetMachine) -> None:
    """Run `steps` (rule name, arguments) on `machine` with the invariants after every step, as
    Hypothesis ran them; then `check(state)`."""
    state = machine()
    try:
        for rule, args in steps:
            getattr(state, rule)(**args)
            state.consistent()
            state.disk_within_budget_and_clean()
            state.held_histories()
            state.pins_as_set()
        if check is not None:
            check(state)
    finally:
        state.teardown()


@pytest.mark.skipif(not RedisServer.available(), reason="no redis-server")
def test_a_shorter_turn_after_a_restart_survives_the_next_fleet_sync():
    """After a restart the fleet tier no longer knew which value it had published, so a turn that
    diverged to a shorter history lost to the longer one in Redis ('kept other'), and the sync after
    the next restart fetched the older history back over the acknowledged turn."""
    state = FleetMachine()
    try:
        state.parallel(agent="b", pick=3, a=[38, 39], b=[23, 29])
        state.restart()
        state.parallel(agent="b", pick=26, a=[20, 8], b=[31, 8, 22, 33, 23, 26, 20, 35, 22, 24, 29, 33, 24, 32, 7, 21])
        state.restart()
        state.turn(agent="b", pick=68, cut=0.0, new=[24, 8, 37])
        state.consistent()
        state.restart()  # checks that every acknowledged turn is reused whole
    finally:
        state.teardown()


@pytest.mark.skipif(not RedisServer.available(), reason="no redis-server")
def test_branches_from_two_servers_are_merged_by_recency_and_no_acknowledged_turn_is_lost():
    """Server B held agent b with branches of 1, 4 and 9 tokens; A fetched them, served two parallel
    requests of b (its branches then of 7, 8 and 5 tokens, the 5 its last acknowledged turn) and
    published. B's sync skipped the fetch (its newest branch was longer than Redis's), B's turn was
    no successor of A's value but longer, so it replaced it ('the longer history wins'); A's next
    sync made the fetched branches the most recent and dropped its own beyond `branches`: the
    acknowledged turn, more recent than two of the three branches that replaced it, was gone."""
    steps = [
        ("fleet_turn", dict(agent="b", new=[31])),
        ("parallel", dict(a=[8], agent="c", b=[29, 35, 37, 8, 26, 33, 33], pick=66)),
        ("restart", {}),
        ("parallel", dict(a=[32, 8, 34, 21], agent="a", b=[7, 26], pick=15)),
        ("restart", {}),
        ("fleet_turn", dict(agent="b", new=[7, 30, 36, 32])),
        ("restart", {}),
        ("fleet_turn", dict(agent="b", new=[23, 28, 28, 8, 29, 22, 28, 27, 29])),
        ("parallel", dict(a=[26, 30, 31], agent="b", b=[36, 38, 32, 22, 33, 22], pick=73)),
        ("parallel", dict(a=[30, 32], agent="b", b=[21, 23, 26, 35], pick=93)),
        ("parallel", dict(a=[29, 30, 29, 35], agent="c", b=[31, 34, 20, 8, 7, 8, 20], pick=34)),
        ("disk_budget", dict(i=1)),
        ("parallel", dict(a=[28, 7, 7, 29, 31, 37, 37, 24, 20, 33, 21, 23, 8, 38, 32, 8], agent="d",
                          b=[34, 35, 20, 32, 8, 36, 39, 39, 30, 25, 22, 30, 7, 20, 30, 22], pick=98)),
        ("fleet_turn", dict(agent="d", new=[37])),
        ("fleet_turn", dict(agent="b", new=[27, 36, 8, 37, 8, 22, 28, 7, 31, 26, 26, 34, 37, 22, 27, 7, 26, 32,
                                            25, 8])),
        ("parallel", dict(a=[26, 28, 22, 21, 33, 27], agent="a",
                          b=[26, 30, 25, 30, 37, 38, 24, 8, 26, 20, 25, 20, 32, 30], pick=3)),
        ("restart", {}),  # checks that every acknowledged turn is reused whole
    ]
    replay(steps)


@pytest.mark.skipif(not RedisServer.available(), reason="no redis-server")
def test_an_erased_history_does_not_come_back_through_a_server_that_missed_the_tombstone():
    """B held agent a when A erased it (a tombstone); A then served a new turn of a, a new history on top
    of the tombstone, before B synced. B never saw the tombstone: its next sync merged its erased copy
    with the new history and served from it. Now the new history says which erasure it follows (its
    era), and B, whose copy follows none, erases it before it takes that history (docs/fleet.md, Erasure)."""
    replay([("turn", dict(agent="a", pick=0, cut=0.0, new=[20])),
            ("fleet_turn", dict(agent="a", new=[39])),
            ("erase", dict(agent="a")),
            ("turn", dict(agent="a", pick=0, cut=0.0, new=[20])),
            ("fleet_turn", dict(agent="a", new=[39, 20]))])


@pytest.mark.skipif(not RedisServer.available(), reason="no redis-server")
def test_a_turn_after_an_erasure_survives_a_restart_of_the_server_that_erased():
    """A erased agent a and served a new turn of it, a history of the erasure's era. After a restart A
    must still know that era (its local manifest carries it): else the history in Redis reads as a
    newer era than A's copy, and A erases its own copy (and fetches back what Redis holds of it)."""
    def check(state: FleetMachine) -> None:
        assert state.pool.fleet.counts["erased_from_fleet"] == 0  # A's copy was of the era in Redis
        # B held no copy: it still acts on the erasure once (so a fetch of an older era still running
        # cannot be saved), then takes the history
        assert state.other.fleet.counts["erased_from_fleet"] == 1

    replay([("turn", dict(agent="a", pick=0, cut=0.0, new=[20, 21])),
            ("erase", dict(agent="a")),
            ("turn", dict(agent="a", pick=0, cut=0.0, new=[22, 23, 24])),
            ("restart", {}),  # checks that every acknowledged turn is reused whole
            ("fleet_turn", dict(agent="a", new=[25])),
            ("turn", dict(agent="a", pick=0, cut=1.0, new=[26]))], check)


@pytest.mark.skipif(not RedisServer.available(), reason="no redis-server")
def test_a_fork_does_not_read_a_parent_erased_through_another_server():
    """b was erased through the other server; this one still held b's history when d forked from
    b. The lookup synced only the child, so d was served the first token of b's erased history
    (found by the state_machine campaign, seed 17): a fork's parent is synced too."""
    replay([("turn", dict(agent="b", pick=0, cut=1.0, new=[8, 35, 25, 37, 20, 21, 22, 23, 24])),
            ("fleet_erase", dict(agent="b")),
            ("fork", dict(child="d", parent="b", pick=0, cut=1.0, new=[8, 35, 25, 30, 7, 8]))])


def test_a_turn_saved_after_its_agents_erasure_is_durable():
    """A turn of agent a queued its save behind the writer; a was erased (its erasure queued after that
    save) and came back with a new turn, its save queued after the erasure. The erasure dropped every
    save of a still queued, the new turn's too: on a sound disk, that turn was never saved (found by the
    state machine's queued rule, then 'erase_x_turn'; shrunk to this one step). Now only the saves
    queued before the erasure go (tests/test_store.py has the persister's own test)."""
    replay([("queued", dict(x="a", y="a", new_x=[20], new_y=[20], then="erase_x_turn", i=0, fail=False)),
            ("restart", {})], machine=PoolMachine)


# ---- issue #44: partitions, kills of a removal, removals past their bound --------------------------------


@pytest.mark.skipif(not RedisServer.available(), reason="no redis-server")
def test_a_forget_holds_against_a_server_that_served_the_agent_while_cut_off():
    """B synced agent a; B is cut off; A forgets part of a's history; a's next turn lands on B (which
    serves a prefix of the old branch: a use); healed, B's next sync must drop the old branch."""
    replay([
        ("turn", dict(agent="a", pick=0, cut=1.0, new=[20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33])),
        ("fleet_turn", dict(agent="a", new=[34])),
        ("partition", dict(cut=True)),
        ("forget_edit", dict(agent="a", pick=0, cut=0.3, new=[35, 36], aborted=False)),
        ("fleet_turn", dict(agent="a", new=[37])),
        ("partition", dict(cut=False)),
        ("fleet_turn", dict(agent="a", new=[38])),  # its sync first: then it may hold nothing removed
    ])


@pytest.mark.skipif(not RedisServer.available(), reason="no redis-server")
def test_a_forget_made_while_cut_off_is_published_after_the_heal():
    replay([
        ("turn", dict(agent="b", pick=0, cut=1.0, new=[20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30])),
        ("fleet_turn", dict(agent="b", new=[31])),
        ("partition", dict(cut=True)),
        ("fleet_forget", dict(agent="b", pick=0, cut=0.4, new=[32, 33], aborted=False)),
        ("partition", dict(cut=False)),
        ("turn", dict(agent="b", pick=0, cut=1.0, new=[34])),
    ])


@pytest.mark.skipif(not RedisServer.available(), reason="no redis-server")
@pytest.mark.parametrize("stage", ["queued", "in_redis"])
def test_an_acknowledged_erasure_survives_a_kill_at_each_step(stage):
    replay([
        ("turn", dict(agent="c", pick=0, cut=1.0, new=[20, 21, 22, 23, 24, 25, 26, 27, 28])),
        ("turn", dict(agent="d", pick=0, cut=1.0, new=[29, 30])),
        ("fleet_turn", dict(agent="c", new=[31])),
        ("erase_then_killed", dict(agent="c", stage=stage)),
        ("fleet_turn", dict(agent="c", new=[32])),
        ("restart", {}),
    ])


@pytest.mark.skipif(not RedisServer.available(), reason="no redis-server")
def test_a_forget_killed_before_its_publish_is_published_after_the_restart():
    replay([
        ("turn", dict(agent="a", pick=0, cut=1.0, new=[20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31])),
        ("fleet_turn", dict(agent="a", new=[32])),
        ("forget_then_killed", dict(agent="a", pick=0, cut=0.3, new=[33, 34])),
        ("fleet_turn", dict(agent="a", new=[35])),
    ])


@pytest.mark.skipif(not RedisServer.available(), reason="no redis-server")
def test_removals_past_their_bound_hold_on_a_server_that_synced_before_them():
    replay([
        ("turn", dict(agent="d", pick=0, cut=1.0, new=[20, 21, 22, 23, 24, 25, 26, 27, 28, 29])),
        ("fleet_turn", dict(agent="d", new=[30])),
        ("forgets_past_bound", dict(agent="d", pick=0, new=[31, 32, 33])),
        ("fleet_turn", dict(agent="d", new=[34])),
    ])


@pytest.mark.skipif(not RedisServer.available(), reason="no redis-server")
def test_a_forget_made_while_cut_off_is_published_by_a_sync_that_merges():
    """Found by the machine's partition rule (seed 5, unshrunk): B, cut off, forgot part of agent c
    (its put given up) while A published a newer turn of c; healed, B's sync had something to fetch,
    merged and adopted, and saved the merge locally only: its removal never reached Redis, and A kept
    serving what B removed. Now a sync whose merge keeps local removals Redis lacks publishes them."""
    replay([
        ("fleet_turn", dict(agent="c", new=[31, 23, 27, 20, 7, 26, 34, 34, 33, 29, 7, 24, 7, 30, 34, 35, 33])),
        ("restart", {}),
        ("fleet_forget", dict(aborted=False, agent="a", cut=0.23758953444833397, new=[20, 20, 29], pick=35)),
        ("restart", {}),
        ("partition", dict(cut=True)),
        ("retokenized", dict(agent="c", new=[34, 38, 32, 31], pick=56)),
        ("disk_budget", dict(i=1)),
        ("fleet_forget", dict(aborted=True, agent="c", cut=0.8861259845042664, new=[7, 22, 30], pick=75)),
        ("fleet_forget", dict(aborted=False, agent="d", cut=0.0, new=[33, 25, 21, 25, 30, 25, 8, 22, 32, 36], pick=30)),
        ("disk_budget", dict(i=1)),
        ("disk_budget", dict(i=1)),
        ("queued", dict(fail=False, i=1, new_x=[20, 8, 21], new_y=[33, 29, 31, 37, 29], then="erase_x_turn", x="d",
                        y="a")),
        ("partition", dict(cut=False)),
        ("queued", dict(fail=True, i=1, new_x=[24, 7, 36, 25], new_y=[35, 30, 22, 31, 34], then="erase_x_turn", x="b",
                        y="c")),
    ])


@pytest.mark.skipif(not RedisServer.available(), reason="no redis-server")
def test_a_forget_holds_on_a_server_whose_disk_fails_during_the_sync():
    """Found by the fleet campaign (seed 1011, shrunk by hand): B forgot part of agent b and published
    the removal; A's next request of b synced, but the local save of the merge failed (the disk gave
    EIO), so the merge was never adopted and A served the removed block from its old record: reachable
    from Redis, it had read the removal. Now a sync whose merge cannot be saved still drops from memory
    the local branches the fetched removal records remove (FleetView.drop_removed)."""
    replay([
        ("turn", dict(agent="b", pick=0, cut=0.0, new=[33, 23, 38, 33])),
        ("fleet_forget", dict(agent="b", pick=0, cut=0.85, new=[20, 34], aborted=False)),
        ("crash", dict(agent="b", new=[33, 35, 33])),
    ])


@pytest.mark.skipif(not RedisServer.available(), reason="no redis-server")
def test_a_pin_that_meets_the_tombstone_erases_the_agent_before_the_next_step():
    """Found by the fleet campaign (seed 1001; not replayable: a race): B erased agent a while A held
    it; A's pin saved the record again, which published it, and that put met the tombstone, so A erased
    a on a fleet thread, memory first, then the disk, while the next step's invariants ran ("manifests
    on disk of agents it does not hold", or "block file(s) no manifest names"). The runtime is right; the
    pin rule now waits for that erasure, as fleet_erase does for a put queued at the erasure."""
    def erased_here(state: PoolMachine) -> None:
        assert state.pool.agent("a") is None, "A's put met the tombstone but A still holds the agent"

    replay([("turn", dict(agent="a", pick=0, cut=0.0, new=[20, 21, 22, 23, 24, 25])),
            ("fleet_turn", dict(agent="a", new=[26])),
            ("fleet_erase", dict(agent="a")),
            ("pin", dict(agent="a", pin=False))], erased_here)


@pytest.mark.skipif(not RedisServer.available(), reason="no redis-server")
def test_a_forget_on_a_server_without_spliced_branches_still_clears_the_fleets():
    """Found by the fleet campaign (seed 1011, its second failure, shrunk by hand): B, cut off, held
    only honest branches of agent c when it forgot part of it, so its record did not raise
    spliced_cleared; A meanwhile stored an amortize turn of c (a spliced copy, which may hold what B
    removed) and published it. At the heal B's sync merged that copy, written before the forget, and
    kept it. Now a forget always raises spliced_cleared (kv_edit/forget.py): every spliced copy written
    before it goes, wherever it is held."""
    replay([("turn", dict(agent="c", pick=0, cut=1.0, new=[20, 21, 22, 23, 24, 25, 26, 27, 28, 29])),
            ("fleet_turn", dict(agent="c", new=[30])),
            ("partition", dict(cut=True)),
            ("amortize", dict(agent="c", pick=0, cut=0.5, new=[31, 32, 33])),
            ("fleet_forget", dict(agent="c", pick=0, cut=0.3, new=[34, 35], aborted=False)),
            ("partition", dict(cut=False))])


@pytest.mark.skipif(not RedisServer.available(), reason="no redis-server")
def test_an_unpin_on_a_clock_stepped_back_wins_over_the_pin_before_it():
    """Issue #53, item 3 in the machine: A pins agent a, B syncs the pin (its turn), A's clock steps
    back 120 s and A unpins; B's next turn merges its pin with A's unpin and publishes, and A's next
    turn syncs. Stamped with the raw clock the unpin was older than the pin, which came back to A."""
    replay([("turn", dict(agent="a", pick=0, cut=0.0, new=[20, 21, 22, 23, 24, 25])),
            ("pin", dict(agent="a", pin=True)),
            ("fleet_turn", dict(agent="a", new=[26])),
            ("clock_step", dict(server="a", step=-120.0)),
            ("pin", dict(agent="a", pin=False)),
            ("fleet_turn", dict(agent="a", new=[27])),
            ("turn", dict(agent="a", pick=0, cut=1.0, new=[28]))])


@pytest.mark.skipif(not RedisServer.available(), reason="no redis-server")
@pytest.mark.parametrize("server", ["a", "b"])
def test_a_forget_on_a_clock_behind_the_writes_it_removes_holds(server):
    """Issue #53, item 2 in the machine: agent c's history is stored on A and synced by B; then
    `server`'s clock steps (A's back 120 s, or B's forward 120 s: B's next stamps ahead of A's) and A
    forgets part of it while B stores a turn of c first. Stamped with the raw clock the removal was
    older than the branches it removes, and B's sync kept what A forgot."""
    replay([("turn", dict(agent="c", pick=0, cut=1.0, new=[20, 21, 22, 23, 24, 25, 26, 27, 28, 29])),
            ("clock_step", dict(server=server, step=-120.0 if server == "a" else 120.0)),
            ("fleet_turn", dict(agent="c", new=[30])),
            ("forget_edit", dict(agent="c", pick=0, cut=0.3, new=[34, 35], aborted=False)),
            ("fleet_turn", dict(agent="c", new=[31]))])
