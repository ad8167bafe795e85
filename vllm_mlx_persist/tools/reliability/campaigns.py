"""The campaigns `vllm-mlx-persist reliability` runs (main.py), by name, with their full and quick
trials; each campaign's module is imported only when it runs.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Callable

from .store_crash import crash_campaign
from .store_fuzz import fuzz_campaign


def _server(name: str, module: str = "") -> Callable:
    """A campaign against a real server (`name`_campaign in its module, named `name` unless given), imported
    only when run."""
    def run(trials: int, seed: int, work: Path, **kw: Any) -> dict:
        campaign = getattr(importlib.import_module(f".{module or name}", __package__), f"{name}_campaign")
        return campaign(trials, seed, work, **kw)
    return run


def _state_machine(trials: int, seed: int, work: Path) -> dict:
    """Every pool operation at random against a reference model (pool_machine.py), imported only when run."""
    from .machine_campaign import campaign

    return campaign(trials, seed, work)


def _fleet_machine(trials: int, seed: int, work: Path) -> dict:
    """The state machine with the fleet rules on every seed (partitions through tools/reliability/partition.py)."""
    from .machine_campaign import campaign

    return campaign(trials, seed, work, fleet_only=True)


# name: (function, full trials, quick trials); soak and storm count seconds, interactions steps,
# state_machine and fleet examples
CAMPAIGNS = {"crash": (crash_campaign, 1000, 60), "fuzz": (fuzz_campaign, 1000, 60),
             "state_machine": (_state_machine, 400, 20), "fleet": (_fleet_machine, 200, 10),
             "server_crash": (_server("server_crash"), 100, 4), "disk": (_server("disk", "disk_faults"), 4, 1),
             "storm": (_server("storm"), 300, 15), "soak": (_server("soak"), 3600, 40),
             "interactions": (_server("interactions"), 700, 100)}
# Campaigns that report their figures so far while they run (`progress`), and return them when stopped.
PROGRESS = {"interactions"}
