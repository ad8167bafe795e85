"""An agent's replicated settings and how two copies of them merge (docs/fleet.md, "The merge rules").

A setting is a value of the agent's record that an admin sets: `forkable` (may other agents fork it;
None leaves it to the server's fork_policy) and `pinned` (exempt from hot eviction, the disk budget and
the TTL, on every server). Each copy of the record carries, beside the values, when each was last set
(`settings_at`: name -> the setter's clock, seconds). Two copies merge per setting: the one set later
wins; on equal times (a setting never stamped counts as set at 0) the value listed first in
`RESTRICTIVE` wins: a refusal over no decision over a grant, so a refusal is never lost to a copy that
merely did not know of it; a pin over none, so nothing is erased for a tie. A pin set before pins were
stamped (`LOCAL_UNTIL_SET`) stays the server's own until someone sets it again: it was that server's
space decision. Pure; any thread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

# name -> its values from the most restrictive to the least: on equal times the earlier one wins
RESTRICTIVE: dict[str, tuple] = {"forkable": (False, None, True), "pinned": (True, False)}
LOCAL_UNTIL_SET = frozenset({"pinned"})  # unstamped on both sides: each copy keeps its own
DEFAULTS = {"forkable": None, "pinned": False}


def values_of(record: Any) -> dict[str, Any]:
    """The settings of a record (an Agent, a Manifest, a chain.Copy, a RemoteManifest)."""
    out = {}
    for name, default in DEFAULTS.items():
        v = getattr(record, name, default)
        out[name] = default if v is None else v
    return out


def merge_records_settings(mine: Any, theirs: Any) -> tuple[dict[str, Any], dict[str, float]]:
    """`merge_settings` of two records' settings and their `settings_at`."""
    return merge_settings(values_of(mine), getattr(mine, "settings_at", None) or {},
                          values_of(theirs), getattr(theirs, "settings_at", None) or {})


def merge_setting(name: str, mine: Any, mine_at: Optional[float], theirs: Any, theirs_at: Optional[float],
                  ) -> tuple[Any, Optional[float]]:
    """One setting of two copies merged: (value, when set)."""
    a, b = mine_at or 0.0, theirs_at or 0.0
    if name in LOCAL_UNTIL_SET and mine_at is None and theirs_at is None:
        return mine, None
    if a != b:
        return (mine, mine_at) if a > b else (theirs, theirs_at)
    order = RESTRICTIVE[name]
    return (mine, mine_at) if order.index(mine) <= order.index(theirs) else (theirs, theirs_at)


def differ(values: Mapping[str, Any], times: Mapping[str, float], other: Any) -> bool:
    """Whether merged settings (`values`, `times`) say more than the record `other` holds, a local-only
    setting never stamped aside (it does not travel: record_settings.LOCAL_UNTIL_SET)."""
    theirs, theirs_at = values_of(other), getattr(other, "settings_at", None) or {}
    return any((name not in LOCAL_UNTIL_SET or name in times)
               and (values[name] != theirs[name] or times.get(name) != theirs_at.get(name)) for name in RESTRICTIVE)


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


@dataclass(frozen=True)
class RemoteSettings:
    """An agent's settings as the fleet (Redis) holds them, read for an answer that cannot wait for a
    sync (a fork's admission): `forkable` and `settings_at` as in a record. `replaces`: the local
    record is of a past that an erasure ended (a tombstone, or a history of a newer era, that this
    server has not acted on yet): it does not count, only these settings do (none: an unknown agent)."""

    forkable: Optional[bool] = None
    settings_at: Mapping[str, float] = field(default_factory=dict)
    replaces: bool = False

    def merged_forkable(self, local: Any) -> Optional[bool]:
        """The fork setting merged with the local record `local` (None: unknown here) by the merge rule."""
        if local is None or self.replaces:
            return self.forkable
        at = getattr(local, "settings_at", None) or {}
        return merge_setting("forkable", getattr(local, "forkable", None), at.get("forkable"),
                             self.forkable, self.settings_at.get("forkable"))[0]
