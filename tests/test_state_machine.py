"""Every pool operation at random, against a reference model (vllm_mlx_persist/tools/pool_machine.py):
turns, forks, branches, text matching, anonymous requests, erasure, pins, budgets, the TTL, restarts,
crashes, and with a redis-server a second pool sharing the fleet tier. A bounded number of examples
here; `vllm-mlx-persist reliability --campaigns state_machine` runs it long."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from vllm_mlx_persist.tools.pool_machine import FleetMachine, PoolMachine, Redis

EXAMPLES = int(os.environ.get("POOL_MACHINE_EXAMPLES", "100"))
SETTINGS = settings(max_examples=EXAMPLES, stateful_step_count=30, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

TestPool = PoolMachine.TestCase
TestPool.settings = SETTINGS

TestFleet = FleetMachine.TestCase
TestFleet.settings = settings(SETTINGS, max_examples=max(1, EXAMPLES // 4))
if not Redis.available():
    TestFleet = pytest.mark.skip(reason="no redis-server: the fleet rules need one")(TestFleet)


# ---- sequences the machine found, shrunk by Hypothesis, kept as explicit examples ----------------------


@pytest.mark.skipif(not Redis.available(), reason="no redis-server")
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
