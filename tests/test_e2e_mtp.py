"""End to end: `--enable-mtp` on a recurrent hybrid (qwen3_next with an MTP head) through a real server.

What this stack does, seen here: vllm-mlx 0.6.0 injects the MTP head (its patches/qwen3_next_mtp.py)
and validates it, but does not install MTP in the continuous-batching scheduler on mlx-lm 0.31.3
("[MTP] disabled: mlx-lm BatchGenerator lacks the _step hook"), so generation runs one token per
step. The checkpoints StateCache gives under MTP's verify/reject are tested in-process with the
same cache calls (tests/test_mtp_recurrent.py). This test holds the server's side: with the flag on,
turns are reused as without it and every reply equals the reply of a server without MTP, also
after a restart; if a later vllm-mlx does run MTP here, wrongly placed recurrent checkpoints would
change the replies of reused turns.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest

from test_e2e_server import OPTIONS, Chat
from vllm_mlx_persist.tools.models.build import build_model_dir
from vllm_mlx_persist.tools.serving import Server


def add_mtp_head(path: Path, seed: int = 0) -> None:
    """Give a qwen3_next model directory an MTP head: `num_nextn_predict_layers` in its config and
    `model-mtp.safetensors` with every parameter of the module vllm-mlx builds, drawn from `seed`."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model
    from vllm_mlx.patches.qwen3_next_mtp import inject_mtp_support

    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    mx.save_safetensors(str(path / "model-mtp.safetensors"), {"mtp.norm.weight": mx.ones((config["hidden_size"],))})
    model, _ = load_model(path, strict=False)  # as the server does once the strict load fails on mtp.*
    assert inject_mtp_support(model, path, config)  # vllm-mlx's own module: the names always match
    rng = np.random.default_rng(seed)
    weights = {}
    for name, p in sorted(tree_flatten(model.mtp.parameters())):
        if name.endswith("norm.weight"):
            a = np.ones(p.shape, np.float32)
        else:
            std = 1.0 / p.shape[-1] ** 0.5 if p.ndim >= 2 else 0.02
            a = rng.standard_normal(p.shape, dtype=np.float32) * np.float32(std)
        weights["mtp." + name] = mx.array(a)
    mx.save_safetensors(str(path / "model-mtp.safetensors"), weights)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = build_model_dir(tmp_path_factory.mktemp("models") / "qwen3_next-mtp", arch="qwen3_next", size="tiny")
    add_mtp_head(path)
    return path


def test_enable_mtp_on_a_hybrid_serves_and_reuses_like_without(model_dir, tmp_path):
    reference = Chat("alice")
    with Server(model_dir, tmp_path / "ref", options=OPTIONS) as ref:
        for turn in range(3):
            reference.turn(ref, turn)
    chat = Chat("alice")
    srv = Server(model_dir, tmp_path / "mtp", options=OPTIONS, extra_args=("--enable-mtp",)).start()
    try:
        chat.turn(srv, 0)
        chat.turn(srv, 1)
        srv.restart(signal.SIGKILL)
        chat.turn(srv, 2)
        log = srv.log_path.read_text(errors="replace")
        assert "[MTP] Model validated" in log, srv.log_tail()  # the head is there and vllm-mlx took it
        assert chat.outputs == reference.outputs, srv.log_tail()
        assert chat.cached == reference.cached and chat.cached[1] > 0 and chat.cached[2] > 0, (
            chat.cached, reference.cached)
    finally:
        srv.stop()
