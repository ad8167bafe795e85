"""Every pool operation at random, against a reference model (vllm_mlx_persist/tools/pool_machine.py):
turns, forks, branches, text matching, anonymous requests, erasure, pins, budgets, the TTL, restarts,
crashes, and with a redis-server a second pool sharing the fleet tier. A bounded number of examples
here; `vllm-mlx-persist reliability --campaigns state_machine` runs it long."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from vllm_mlx_persist.tools.pool_machine import FleetMachine, PoolMachine, Redis

EXAMPLES = int(os.environ.get("POOL_MACHINE_EXAMPLES", "25"))
SETTINGS = settings(max_examples=EXAMPLES, stateful_step_count=30, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

TestPool = PoolMachine.TestCase
TestPool.settings = SETTINGS

TestFleet = FleetMachine.TestCase
TestFleet.settings = settings(SETTINGS, max_examples=max(1, EXAMPLES // 3))
if not Redis.available():
    TestFleet = pytest.mark.skip(reason="no redis-server: the fleet rules need one")(TestFleet)
