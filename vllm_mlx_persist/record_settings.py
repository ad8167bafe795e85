"""An agent's replicated settings and how two copies of them merge (docs/fleet.md, "The merge rules").

A setting is a value of the agent's record that an admin sets (today `forkable`: may other agents fork
it; None leaves it to the server's fork_policy). Each copy of the record carries, beside the values,
when each was last set (`settings_at`: name -> the setter's clock, seconds). Two copies merge per
setting: the one set later wins; on equal times (a setting never stamped counts as set at 0) the more
restrictive value wins (`RESTRICTIVE`: a refusal over no decision over a grant), so a refusal is never
lost to a copy that merely did not know of it. Pure; any thread.

The pin is not one of them: it exempts the agent from *this* server's hot eviction, disk budget and
TTL, which are per-server space decisions (as the budget and the TTL themselves are).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

# name -> its values from the most restrictive to the least: on equal times the earlier one wins
RESTRICTIVE: dict[str, tuple] = {"forkable": (False, None, True)}


def merge_setting(name: str, mine: Any, mine_at: Optional[float], theirs: Any, theirs_at: Optional[float],
                  ) -> tuple[Any, Optional[float]]:
    """One setting of two copies merged: (value, when set)."""
    a, b = mine_at or 0.0, theirs_at or 0.0
    if a != b:
        return (mine, mine_at) if a > b else (theirs, theirs_at)
    order = RESTRICTIVE[name]
    return (mine, mine_at) if order.index(mine) <= order.index(theirs) else (theirs, theirs_at)


def merge_settings(mine: Mapping[str, Any], mine_at: Mapping[str, float], theirs: Mapping[str, Any],
                   theirs_at: Mapping[str, float]) -> tuple[dict[str, Any], dict[str, float]]:
    """Every setting of two copies merged: (values, times; a setting never stamped has no time)."""
    values, times = {}, {}
    for name in RESTRICTIVE:
        v, t = merge_setting(name, mine.get(name), mine_at.get(name), theirs.get(name), theirs_at.get(name))
        values[name] = v
        if t is not None:
            times[name] = t
    return values, times


def check_settings_at(at: Any) -> None:
    """Raise ValueError unless `at` is a well-formed settings_at (a known name -> a finite time)."""
    if not isinstance(at, dict) or not all(
            k in RESTRICTIVE and not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
            for k, v in at.items()):
        raise ValueError("malformed settings_at")
