"""Admission waits for disk reads off the worker (seam: `ready` awaited in EngineCore.add_request).

A returning agent whose blocks are still being read from a slow disk must not stall other agents'
decoding: the engine admits its request once the reads are done, and the worker's lookup then finds
them read. Real server, tiny model; the stuck disk is the store's fault hook (block reads wait while
a switch file exists): the other agent is seen decoding while the returning agent's reads are held,
for as long as the test likes, and the returning agent is served from its blocks once they are let go."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import openai
import pytest

from vllm_mlx_persist.tools.models.build import build_model_dir
from vllm_mlx_persist.tools.serving import Server

BLOCK = 32
HANG_S = 120.0  # deadlines that only turn a hang into a failure


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("models") / "llama", arch="llama", size="tiny", seed=0)


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0, timeout=300)


def _history(n_words: int) -> list[dict]:
    words = " ".join(f"w{i % 97}" for i in range(n_words))
    return [{"role": "user", "content": f"remember these notes: {words}"}]


def wait_for(cond, what: str, timeout: float = HANG_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.02)


def test_a_returning_agent_on_a_slow_disk_does_not_stall_the_others(model, tmp_path):
    switch = tmp_path / "stuck-disk"
    # key_format: what auto chooses on this model, without calibrating. No hot-set restore: the
    # returning agent's blocks are read by its own arrival (the restore's giving way to requests is
    # tests/test_lifecycle.py's), and the manifests are read at start-up, before the disk is stuck.
    opts = {"cache_dir": str(tmp_path / "cache"), "block_size": BLOCK, "match_text": False,
            "key_format": "q4", "restore": False}
    env = {"VLLM_MLX_PERSIST_FAULT": f"hold:read@{switch}"}
    long_msgs = _history(300)
    with Server(model, tmp_path / "home", options=opts, env=env) as server:
        first = _client(server).chat.completions.create(
            model=server.model, messages=long_msgs, max_tokens=4, temperature=0.0,
            extra_headers={"X-Agent-ID": "returning"})
        long_msgs = long_msgs + [{"role": "assistant", "content": first.choices[0].message.content},
                                 {"role": "user", "content": "and now?"}]
        n_blocks = first.usage.prompt_tokens // BLOCK
        assert n_blocks >= 8
        server.stop()
        server.start()  # the agent's blocks are on disk only
        switch.touch()  # from now on, every block read waits until the switch is removed

        chunks = [0]  # the other agent's streamed content chunks
        stop = threading.Event()
        streaming = threading.Event()

        def other_agent() -> None:
            client, turn = _client(server), 0
            while not stop.is_set():
                stream = client.chat.completions.create(
                    model=server.model, messages=[{"role": "user", "content": f"count {turn}"}], max_tokens=64,
                    temperature=0.0, stream=True, extra_headers={"X-Agent-ID": "other"})
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta and chunk.choices[0].delta.content:
                        chunks[0] += 1
                        streaming.set()
                turn += 1

        t = threading.Thread(target=other_agent, daemon=True)
        t.start()
        assert streaming.wait(60)
        replies: list = []
        returning = threading.Thread(target=lambda: replies.append(_client(server).chat.completions.create(
            model=server.model, messages=long_msgs, max_tokens=4, temperature=0.0,
            extra_headers={"X-Agent-ID": "returning"})), daemon=True)
        returning.start()
        # it arrived: its blocks' read-ahead started, and waits on the stuck disk like the restore's reads
        wait_for(lambda: server.get_json("/v1/status")["cache"]["prefetch_pending"] > 0, "the returning agent's read-ahead")
        seen = chunks[0]
        # ... while the other agent goes on decoding (a worker waiting for those reads would stop it)
        wait_for(lambda: chunks[0] >= seen + 32, "the other agent's decoding while the reads are held")
        assert returning.is_alive() and not replies  # not served before its blocks are read
        switch.unlink()
        returning.join(HANG_S)
        stop.set()
        t.join(HANG_S)
        log = server.log_path.read_text(errors="replace")

    # the returning agent was served from its blocks on disk, once they were read
    assert replies, "the returning agent got no reply"
    r = replies[0]
    assert (r.usage.prompt_tokens_details.cached_tokens or 0) >= (n_blocks - 1) * BLOCK, r.usage
    assert "HIT disk" in log or "HIT hot" in log
