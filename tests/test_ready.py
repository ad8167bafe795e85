"""The futures the engine awaits before admitting a request (backend.ready): done when every read
is, chained after a Redis sync, and never longer than the sync's deadline."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future

from vllm_mlx_persist.futures import when_all, with_deadline


def test_when_all_waits_for_every_future_then_the_next_stage():
    a, b, later = Future(), Future(), Future()
    stages = []
    out = when_all([a, b], then=lambda: stages.append("then") or later)
    assert out is not None and not out.done()
    a.set_result(1)
    assert not out.done() and stages == []
    b.set_exception(OSError("a failed read counts as done"))
    assert stages == ["then"] and not out.done()  # the next stage is evaluated once, after all
    later.set_result(None)
    assert out.done()


def test_when_all_of_nothing_pending_is_none_or_the_next_stage():
    done = Future()
    done.set_result(None)
    assert when_all([]) is None and when_all([done]) is None
    nxt = Future()
    assert when_all([done], then=lambda: nxt) is nxt
    assert when_all([Future()], then=lambda: (_ for _ in ()).throw(RuntimeError("bug"))) is not None


def test_with_deadline_resolves_at_the_deadline_on_the_event_loop():
    # wait_for's 30 s only turns a hang into a failure; the deadline is never early (a timer's lower bound)
    async def run() -> tuple[float, bool, bool]:
        never: Future = Future()
        t0 = time.perf_counter()
        out = with_deadline(never, 0.2)
        pending = not out.done()
        await asyncio.wait_for(asyncio.wrap_future(out), 30)
        return time.perf_counter() - t0, pending, never.done()

    waited, pending, inner_done = asyncio.run(run())
    assert pending and waited >= 0.15 and not inner_done

    async def early() -> None:  # done with its future, long before its deadline
        f: Future = Future()
        asyncio.get_running_loop().call_soon(f.set_result, None)
        await asyncio.wait_for(asyncio.wrap_future(with_deadline(f, 3600.0)), 30)

    asyncio.run(early())
    f: Future = Future()
    assert with_deadline(f, 1.0) is f  # no running loop: no timer, the future itself
    assert with_deadline(None, 1.0) is None
