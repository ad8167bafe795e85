"""Future combinators for the seam's `ready(request)`: wait for several reads, or at most so long.

`when_all` and `with_deadline` build `concurrent.futures.Future`s that are done when others are
(done callbacks, so no thread waits); the engine awaits the result on its event loop. Stateless;
callbacks run on whichever thread completes a future (the reader and fleet threads, the loop's timer).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, InvalidStateError
from typing import Any, Callable, Optional


def when_all(futures: list[Future], then: Optional[Callable[[], Optional[Future]]] = None) -> Optional[Future]:
    """A future done once every one of `futures` is done (whatever their outcome) and then the one
    `then()` returns, if any; None when there is nothing left to wait for."""
    pending = [f for f in futures if not f.done()]
    if not pending:
        return then() if then is not None else None
    out: Future = Future()
    left, lock = [len(pending)], threading.Lock()

    def finish(_: Any = None) -> None:
        _resolve(out)

    def one(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        try:
            nxt = then() if then is not None else None
        except Exception:  # readiness is a hint: never an error
            nxt = None
        if nxt is None:
            finish()
        else:
            nxt.add_done_callback(finish)

    for f in pending:
        f.add_done_callback(one)
    return out


def with_deadline(future: Optional[Future], seconds: float) -> Optional[Future]:
    """A future done when `future` is, or `seconds` from now, whichever comes first: a timer of the
    running event loop (ready() is called on it), so no thread waits. Without a loop: `future`."""
    if future is None:
        return None
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return future
    out: Future = Future()
    future.add_done_callback(lambda _: _resolve(out))
    loop.call_later(seconds, _resolve, out)
    return out


def _resolve(future: Future) -> None:
    try:
        future.set_result(None)
    except InvalidStateError:  # the other of two callers got there first
        pass
