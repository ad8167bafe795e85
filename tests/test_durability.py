"""Durability without stalling the batch: the worker hands a turn to the persister and goes on; the
patched engine holds the request's final output until the turn is durable (at most the backend's
durable_timeout_s). Real scheduler, real backend and store, a slow or hung writer injected into the
store's block writes."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from test_pool import tokens


def make_scheduler(model_dir, cache_dir, **options):
    from mlx_lm import load
    from vllm_mlx.engine_core import EngineCore  # noqa: F401  (slow first import: not inside a timing)
    from vllm_mlx.scheduler import Scheduler, SchedulerConfig

    model, tokenizer = load(str(model_dir))
    config = SchedulerConfig(cache_backend="persist_q4",
                             cache_backend_options={"cache_dir": str(cache_dir), "block_size": 16, **options})
    sched = Scheduler(model, tokenizer, config)
    sched.cache_backend.load()
    return sched


def run_to_finish(sched, request_id: str, prompt: list[int]):
    from vllm_mlx.request import Request, SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0)
    sched.add_request(Request(request_id, prompt, params, prompt_token_ids=prompt, cache_namespace="agent"))
    while True:
        for out in sched.step().outputs:
            if out.request_id == request_id and out.finished:
                return out


class GatedWrites:
    """Block writes wait for `gate` (a slow or hung disk)."""

    def __init__(self, store):
        self.gate, self._write = threading.Event(), store.write_block
        store.write_block = self

    def __call__(self, block):
        self.gate.wait(30)
        return self._write(block)


HANG_S = 30.0  # a deadline that only turns a hang into a failure


def deliver(backend, out, meanwhile=None) -> tuple[list, float]:
    """Run the engine's delivery of a finished output; returns (what the client got, seconds).
    `meanwhile(task, got)`: a coroutine run on the same event loop once the delivery has started."""
    from vllm_mlx.engine_core import EngineCore  # imported by make_scheduler's caller already

    got = []
    collector = SimpleNamespace(put=lambda o, notify=True: got.append(o))
    engine = SimpleNamespace(scheduler=SimpleNamespace(cache_backend=backend))

    async def run() -> None:
        task = asyncio.ensure_future(EngineCore._deliver_when_durable(engine, out, collector, None))
        if meanwhile is not None:
            await meanwhile(task, got)
        await asyncio.wait_for(task, HANG_S)

    t = time.perf_counter()
    asyncio.run(run())
    return got, time.perf_counter() - t


def test_final_output_waits_for_the_turn_to_be_durable(tiny_llama_dir, tmp_path):
    sched = make_scheduler(tiny_llama_dir, tmp_path)
    backend = sched.cache_backend
    writes = GatedWrites(backend.pool.store)
    out = run_to_finish(sched, "r1", tokens(40))  # the batch went on while the write waits
    assert out.durable is not None and not out.durable.done()
    assert not list(tmp_path.glob("*/agents/*.json"))

    async def held(task, got) -> None:
        for _ in range(50):  # the event loop's turns: a delivery that did not wait would have ended in these
            await asyncio.sleep(0)
        assert not task.done() and got == [] and not out.durable.done()  # held while the write is
        writes.gate.set()  # the disk answers: the turn becomes durable, and only then is it delivered

    got, _ = deliver(backend, out, held)
    assert got == [out]
    assert out.durable is None  # cleared once delivered
    assert list(tmp_path.glob("*/agents/*.json")) and len(list(tmp_path.glob("*/blocks/*/*"))) == 3
    sched.close_cache_backend()


def test_a_hung_writer_does_not_hang_the_request(tiny_llama_dir, tmp_path):
    sched = make_scheduler(tiny_llama_dir, tmp_path, write_timeout_s=1.0)
    backend = sched.cache_backend
    writes = GatedWrites(backend.pool.store)
    out = run_to_finish(sched, "r1", tokens(40))
    durable = out.durable
    got, waited = deliver(backend, out)  # the writer is hung for good: a delivery that waited for it never ends
    assert got == [out] and waited >= 0.9 and not durable.done()  # delivered by durable_timeout_s, not never
    out2 = run_to_finish(sched, "r2", tokens(40) + [9, 9])  # the server keeps serving
    assert out2.finished
    writes.gate.set()
    backend.save()
    sched.close_cache_backend()


@pytest.mark.parametrize("durable_writes", [False])
def test_without_durable_writes_nothing_is_held(tiny_llama_dir, tmp_path, durable_writes):
    sched = make_scheduler(tiny_llama_dir, tmp_path, durable_writes=durable_writes)
    out = run_to_finish(sched, "r1", tokens(40))
    assert out.durable is None
    sched.close_cache_backend()
