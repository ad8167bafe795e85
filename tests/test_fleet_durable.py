"""The fleet's outbox keeps every acknowledged removal and setting, and only those, within its bound
(fleet/outbox.py, fleet/sync.py): settings durable like forgets, a file that cannot be removed still
counted, a restart that records nothing Redis already has, and an erasure sent again after its
tombstone that leaves a history begun on that tombstone alone. Real Redis, real pools, crashes as
fleet_pools.crash makes them."""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path

import pytest

pytest.importorskip("redis", reason='the fleet extra is not installed: pip install -e ".[fleet]"')

from fleet_pools import (PARTITIONED, chain, crash, fleet, fp, held, manifest, model,  # noqa: E402,F401
                         put_history, redis_server, settle, wait_for)


def test_an_outbox_file_that_cannot_be_removed_stays_counted(tmp_path, monkeypatch):
    """An entry whose file's unlink fails (EACCES) is still pending: it counts toward the bound, and
    the next done removes it."""
    from vllm_mlx_persist.fleet import outbox as ob

    box = ob.Outbox(tmp_path / "outbox", bound=2)
    box.add("a", "e1")
    box.add("b", "e2")
    real = Path.unlink

    def refuse(self, *args, **kw):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "unlink", refuse)
    with contextlib.suppress(OSError):  # the writer's callback logs what it raises, and goes on
        box.done("a", "e1")
    files = list(box.dir.glob("*.json"))
    assert len(box) == len(files) == 2 and box.full(), "the count disagrees with the files"
    monkeypatch.setattr(Path, "unlink", real)
    box.done("a", "e1")
    assert len(box) == len(list(box.dir.glob("*.json"))) == 1 and not box.full()


def test_a_publish_past_the_bound_is_refused_unless_it_supersedes_one(tmp_path):
    """add_forget refuses a new agent's entry at the bound (nothing grows the outbox past it); a later
    publish of an agent already pending replaces its entry and is taken."""
    from vllm_mlx_persist.fleet import outbox as ob

    box = ob.Outbox(tmp_path / "outbox", bound=2)
    box.add("a", "e1")
    box.add_forget("b", 1.0)
    with pytest.raises(ob.OutboxFull):
        box.add_forget("c", 1.0)
    box.add_forget("b", 2.0)
    assert len(box) == len(list(box.dir.glob("*.json"))) == 2 and box.forgets() == {"b": 2.0}
