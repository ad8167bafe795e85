"""`vllm-mlx-persist reliability --campaigns state_machine` (and `--campaigns fleet`): long seeded runs of
the pool's state machine (pool_machine.py), every fourth seed with the fleet rules; a failure is shrunk
by Hypothesis and recorded with its steps. tests/mutants.py's campaign-style hunt uses its sizes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..serving import RedisServer
from .pool_machine import FleetMachine, PoolMachine

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
        fleet = (fleet_only or (s - seed) % 4 == 1) and RedisServer.available()
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
