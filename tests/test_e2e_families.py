"""End to end per model family on the real `vllm-mlx serve --cache-backend persist_q4`: sliding
window (gemma3_text), sliding window + sinks + MoE (gpt_oss), linear-attention and convolution
hybrids (qwen3_next, lfm2), latent MLA (deepseek_v3). Micro random float32 models (hidden 128, 2
heads over 1 K/V head).

Per family, one server: a reference agent's turns, then the same conversation as another agent with
the server SIGKILLed between its turns:
* a second turn reuses the first (cached tokens in usage): attention models at least the whole
  previous prompt; recurrent hybrids at least the previous prompt but its last token (their state
  checkpoint is where the prefill ended);
* the killed-and-restarted server answers every turn exactly as the reference, with the same
  cached counts;
* three agents sent together (batched) answer exactly as each sent alone.

Batched against alone per family, together and staggered, compared with vllm-mlx's own cache and
down to the stored 4-bit K/V: tests/test_e2e_batch_invariance.py.
"""

from __future__ import annotations

import signal
import threading

import pytest

from vllm_mlx_persist.tools.models.build import build_model_dir
from vllm_mlx_persist.tools.serving import Server

from test_e2e_server import OPTIONS, Chat

ARCHS = ["gemma3_text", "gpt_oss", "qwen3_next", "lfm2", "deepseek_v3", "deepseek_v32"]
HYBRIDS = {"qwen3_next", "lfm2"}


def _alone_and_batched(srv: Server) -> tuple[list, list]:
    msgs = [[{"role": "user", "content": f"question {i}: " + "what does the cache keep " * (3 + 4 * i)}]
            for i in range(3)]
    alone = [Chat(f"solo-{i}").send(srv, m)[0] for i, m in enumerate(msgs)]
    batched = [None] * 3

    def run(i):
        batched[i] = Chat(f"group-{i}").send(srv, msgs[i])[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return alone, batched


def _killed_between_turns_answers_as(reference: Chat, srv: Server) -> None:
    """Alice's conversation again, as another agent, on `srv` SIGKILLed between its turns: the same
    replies and cached counts as `reference` (whose turns all ran before the first kill, on a server
    never killed until then; agents never share a cache, so its blocks serve nothing here)."""
    chat = Chat("alice-killed", text_of=reference.text_of)
    chat.turn(srv, 0)
    srv.restart(signal.SIGKILL)
    chat.turn(srv, 1)
    srv.restart(signal.SIGKILL)
    chat.turn(srv, 2)
    assert chat.outputs == reference.outputs, srv.log_tail()
    assert chat.cached == reference.cached, srv.log_tail()


@pytest.mark.parametrize("arch", ARCHS)
def test_family_end_to_end(arch, tmp_path):
    model = build_model_dir(tmp_path / "model", arch=arch, size="micro")
    slack = 1 if arch in HYBRIDS else 0

    reference = Chat("alice")
    with Server(model, tmp_path / "home", options=OPTIONS) as srv:
        for turn in range(3):
            reference.turn(srv, turn)
        alone, batched = _alone_and_batched(srv)
        log = srv.log_tail()
        assert reference.cached[0] == 0
        for t in (1, 2):
            assert reference.prompt_tokens[t - 1] - slack <= reference.cached[t] < reference.prompt_tokens[t], (
                reference.cached, reference.prompt_tokens, log)
        assert batched == alone, log

        _killed_between_turns_answers_as(reference, srv)


def test_a_long_gemma_agent_holds_its_window_and_resumes_after_sigkill(tmp_path):
    """As a user would: a gemma3_text agent grown far past its sliding window (128 tokens) holds about
    global layer x tokens + sliding layer x window in memory (GET /v1/agents/ID's bytes_hot, within
    1.15x of that bound, the issue's target), and after a SIGKILL restart its next turn reuses the
    whole previous prompt."""
    import json
    import urllib.request

    model = build_model_dir(tmp_path / "model", arch="gemma3_text", size="micro")
    chat = Chat("long")
    srv = Server(model, tmp_path / "home", options=OPTIONS).start()
    try:
        for turn in range(8):
            chat.turn(srv, turn)
        assert all(c >= p for c, p in zip(chat.cached[1:], chat.prompt_tokens)), (chat.cached, chat.prompt_tokens)
        with urllib.request.urlopen(srv.url + "/v1/agents/long", timeout=30) as r:
            info = json.loads(r.read())
        n = info["tokens"]
        assert n > 6 * 128
        per = 2 * 2 * (64 // 2 + 2 * 4)  # 4-bit K+V of one token in one layer: 2 KV heads x 64 dims, f32 scales
        bound = per * (n + 128)  # one global layer x tokens + one sliding layer x window
        assert info["bytes_hot"] <= 1.15 * bound, (info, bound)
        srv.restart(signal.SIGKILL)
        chat.turn(srv, 8)
        assert chat.cached[-1] >= chat.prompt_tokens[-2], (chat.cached, chat.prompt_tokens, srv.log_tail())
    finally:
        srv.stop()


def test_mla_latents_packed_in_8_bits_resume_exactly_after_sigkill(tmp_path):
    """`latent_bits: 8` (issue #24 item 5): an MLA model's blocks hold its latents in 8 bits. A second
    turn reuses the first; a server SIGKILLed between turns answers exactly as one never killed
    (hot and reloaded blocks are the same packed bytes), and the agent costs fewer bytes than with
    latents in the model's dtype."""
    model = build_model_dir(tmp_path / "model", arch="deepseek_v3", size="micro")
    packed = {**OPTIONS, "latent_bits": 8}
    reference, plain = Chat("alice"), Chat("alice")
    with Server(model, tmp_path / "plain", options=OPTIONS) as srv:
        for turn in range(3):
            plain.turn(srv, turn)
        plain_bytes = srv.get_json("/v1/agents/alice")["bytes_hot"]
    with Server(model, tmp_path / "home", options=packed) as srv:
        for turn in range(3):
            reference.turn(srv, turn)
        packed_bytes = srv.get_json("/v1/agents/alice")["bytes_hot"]
        assert reference.cached[0] == 0 and all(
            reference.prompt_tokens[t - 1] <= reference.cached[t] < reference.prompt_tokens[t] for t in (1, 2))
        assert packed_bytes < 0.5 * plain_bytes, (packed_bytes, plain_bytes)

        _killed_between_turns_answers_as(reference, srv)


def test_latent_bits_is_checked(tmp_path):
    from vllm_mlx_persist.options import parse_options

    assert parse_options({"latent_bits": 4})["latent_bits"] == 4
    for bad in (3, True, "8"):
        with pytest.raises(ValueError, match="latent_bits"):
            parse_options({"latent_bits": bad})
