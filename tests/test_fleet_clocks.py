"""Removals and settings that hold when servers' clocks disagree or step (issue #53, items 2 and 3):
two or three pools on one real redis-server, one of them with a clock ahead of the others, or a clock
stepped back between two of its own decisions. A removal or a setting is ordered after every stamp
its record had seen (docs/fleet.md, "The merge rules"), so no skew or step makes an older write win
over a newer removal, nor an older grant over a newer refusal."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("redis", reason='the fleet extra is not installed: pip install -e ".[fleet]"')

from fleet_pools import (fleet, fp, held, model, put_history, redis_server, republish, settle,  # noqa: E402,F401
                         shared_history)

SKEW_S = 60.0


class Clock:
    """A server's wall clock: the real one moved by `offset` seconds (a test steps it)."""

    def __init__(self, offset: float = 0.0) -> None:
        self.offset = offset

    def __call__(self) -> float:
        return time.time() + self.offset


@pytest.mark.parametrize("how", ["skew", "step_back"])
def test_a_forget_holds_when_the_forgetting_servers_clock_is_behind(fleet, model, how):
    """Item 2: `skew`: B's clock is 60 s ahead; B stores the history, A syncs it and forgets a span
    with its own clock (behind B's stamps). `step_back`: A stores the history, then A's clock steps
    back 60 s and A forgets. Either way B syncs the forget and publishes its record again, and A
    syncs: neither may hold the forgotten span (a removal is ordered after every write its record had
    seen, whatever the clock said)."""
    from test_forget import _turn

    from vllm_mlx_persist.kv_edit import FORGET

    ca, cb = Clock(), Clock(SKEW_S if how == "skew" else 0.0)
    a, _ = fleet.model_server("a", model, clock=ca)
    b, _ = fleet.model_server("b", model, clock=cb)
    writer, other = (b, a) if how == "skew" else (a, b)
    head, span, tail, old = shared_history(writer, other, model)
    assert held(other, "x") == set(old)

    if how == "step_back":
        ca.offset = -SKEW_S
    _turn(a, model, "x", head + tail, "r2", edit=FORGET)
    settle(a)
    (removal,) = a.agent("x").removals
    gone = set(old[removal.index:])
    assert not held(a, "x") & gone

    b.fleet._sync_agent("x")
    assert not held(b, "x") & gone, "B kept the forgotten span"
    republish(b, "x")
    a.fleet._sync_agent("x")
    assert not held(a, "x") & gone, "A serves the span it forgot again"
    assert not set(fleet.tier().get_manifest("x").block_ids) & gone
    # the client's next turn on A (a clock behind the removal's stamp) sends the span again: a new
    # history, which stays (a removal spares what is written after it, on this server too)
    _turn(a, model, "x", head + span + tail + [7, 8], "r3")
    again = set(a.agent("x").branches[-1].block_ids)
    assert again & gone
    settle(a)
    for pool in (b, a):
        pool.fleet._sync_agent("x")
        assert held(pool, "x") >= again, "the history sent again after the forget was dropped"


@pytest.mark.parametrize("setting", ["forkable", "pinned"])
@pytest.mark.parametrize("how", ["skew", "step_back"])
def test_a_later_refusal_wins_over_an_earlier_grant_whatever_the_clocks(fleet, fp, how, setting):
    """Item 3: `skew`: G (clock 60 s ahead) grants (allows forks of P; pins P), then R (true clock),
    having synced the grant, refuses (forbids forks; unpins). `step_back`: G grants, its clock steps
    back 60 s, G refuses. After G's and R's syncs and publishes, every server (a third one too) holds
    the refusal: the later decision wins, whatever its server's clock said."""
    put_history(fleet.tier(), fp, "p")
    cg = Clock(SKEW_S if how == "skew" else 0.0)
    g, _ = fleet.server("g", clock=cg)
    r, _ = fleet.server("r")
    for pool in (g, r):
        pool.fleet._sync_agent("p")

    def grant(pool) -> None:
        assert pool.set_forkable("p", True) if setting == "forkable" else pool.set_pinned("p", True)

    def refuse(pool) -> None:
        assert pool.set_forkable("p", False) if setting == "forkable" else pool.set_pinned("p", False)

    def refused(pool) -> bool:
        return not pool.may_fork("p") if setting == "forkable" else not pool.agent("p").pinned

    grant(g)
    settle(g)
    r.fleet._sync_agent("p")
    assert not refused(r)
    if how == "skew":
        refuse(r)
        settle(r)
    else:
        cg.offset = -SKEW_S
        refuse(g)
        settle(g)
    for pool in (g, r, g):  # each syncs (and publishes what its record holds that Redis lacks)
        pool.fleet._sync_agent("p")
        settle(pool)
    c, _ = fleet.server("c")
    c.fleet._sync_agent("p")
    for name, pool in (("G", g), ("R", r), ("a third server", c)):
        assert refused(pool), f"{name} holds the earlier grant over the later refusal"
