"""Admission waits for disk reads off the worker (seam: `ready` awaited in EngineCore.add_request).

A returning agent whose blocks are still being read from a slow disk must not stall other agents'
decoding: the engine admits its request once the reads are done, and the worker's lookup then finds
them read. Real server, tiny model; the slow disk is the store's fault hook (a sleep before each
block read while a switch file exists)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import openai
import pytest

from vllm_mlx_persist.tools.models import build_model_dir
from vllm_mlx_persist.tools.serving import Server

READ_SLEEP_S = 1.0  # per block read, while the switch exists
BLOCK = 32


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("models") / "llama", arch="llama", size="tiny", seed=0)


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0, timeout=300)


def _history(n_words: int) -> list[dict]:
    words = " ".join(f"w{i % 97}" for i in range(n_words))
    return [{"role": "user", "content": f"remember these notes: {words}"}]


def test_a_returning_agent_on_a_slow_disk_does_not_stall_the_others(model, tmp_path):
    switch = tmp_path / "slow-disk"
    opts = {"cache_dir": str(tmp_path / "cache"), "block_size": BLOCK, "match_text": False,
            "key_format": "q4"}  # what auto chooses on this model, without calibrating
    env = {"VLLM_MLX_PERSIST_FAULT": f"sleep={READ_SLEEP_S}:read@{switch}"}
    long_msgs = _history(300)
    with Server(model, tmp_path / "home", options=opts, env=env) as server:
        first = _client(server).chat.completions.create(
            model=server.model, messages=long_msgs, max_tokens=4, temperature=0.0,
            extra_headers={"X-Agent-ID": "returning"})
        long_msgs = long_msgs + [{"role": "assistant", "content": first.choices[0].message.content},
                                 {"role": "user", "content": "and now?"}]
        n_blocks = first.usage.prompt_tokens // BLOCK
        assert n_blocks >= 8
        switch.touch()  # from the restart on, every block read takes READ_SLEEP_S
        server.stop()
        server.start()  # the hot-set restore starts reading the agent's blocks, slowly

        gaps: list[float] = []
        stop = threading.Event()
        streaming = threading.Event()

        def other_agent() -> None:
            client, turn = _client(server), 0
            while not stop.is_set():
                stream = client.chat.completions.create(
                    model=server.model, messages=[{"role": "user", "content": f"count {turn}"}], max_tokens=64,
                    temperature=0.0, stream=True, extra_headers={"X-Agent-ID": "other"})
                last = None
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta and chunk.choices[0].delta.content:
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
                        streaming.set()
                turn += 1

        t = threading.Thread(target=other_agent, daemon=True)
        t.start()
        assert streaming.wait(60)
        t0 = time.perf_counter()
        r = _client(server).chat.completions.create(
            model=server.model, messages=long_msgs, max_tokens=4, temperature=0.0,
            extra_headers={"X-Agent-ID": "returning"})
        waited = time.perf_counter() - t0
        stop.set()
        t.join(120)
        switch.unlink()
        log = server.log_path.read_text(errors="replace")

    # the returning agent was served from its blocks on disk, after waiting for the slow reads ...
    assert (r.usage.prompt_tokens_details.cached_tokens or 0) >= (n_blocks - 1) * BLOCK, r.usage
    assert "HIT disk" in log or "HIT hot" in log
    assert waited >= 2 * READ_SLEEP_S
    # ... while the other agent kept decoding: no gap near the reads' duration (several seconds
    # without the seam, when the worker's lookup waited for them)
    assert gaps and max(gaps) < 2 * READ_SLEEP_S, (max(gaps), waited)
