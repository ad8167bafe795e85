"""End to end per model family on the real `vllm-mlx serve --cache-backend persist_q4`: sliding
window (gemma3_text), sliding window + sinks + MoE (gpt_oss), linear-attention and convolution
hybrids (qwen3_next, lfm2), latent MLA (deepseek_v3). Tiny random float32 models.

Per family, one reference server and one that is SIGKILLed between turns:
* a second turn reuses the first (cached tokens in usage): attention models at least the whole
  previous prompt; recurrent hybrids at least the previous prompt but its last token (their state
  checkpoint is where the prefill ended);
* the killed-and-restarted server answers every turn exactly as the reference, with the same
  cached counts;
* three agents sent together (batched) answer exactly as each sent alone.
"""

from __future__ import annotations

import signal
import threading

import pytest

from vllm_mlx_persist.tools.models import build_model_dir
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


@pytest.mark.parametrize("arch", ARCHS)
def test_family_end_to_end(arch, tmp_path):
    model = build_model_dir(tmp_path / "model", arch=arch, size="tiny")
    slack = 1 if arch in HYBRIDS else 0

    reference = Chat("alice")
    with Server(model, tmp_path / "ref", options=OPTIONS) as ref:
        for turn in range(3):
            reference.turn(ref, turn)
        alone, batched = _alone_and_batched(ref)
        log = ref.log_tail()
    assert reference.cached[0] == 0
    for t in (1, 2):
        assert reference.prompt_tokens[t - 1] - slack <= reference.cached[t] < reference.prompt_tokens[t], (
            reference.cached, reference.prompt_tokens, log)
    assert batched == alone, log

    chat = Chat("alice")
    srv = Server(model, tmp_path / "home", options=OPTIONS).start()
    try:
        chat.turn(srv, 0)
        srv.restart(signal.SIGKILL)
        chat.turn(srv, 1)
        srv.restart(signal.SIGKILL)
        chat.turn(srv, 2)
        assert chat.outputs == reference.outputs, srv.log_tail()
        assert chat.cached == reference.cached, srv.log_tail()
    finally:
        srv.stop()
