"""The start-up warm-up (PersistQ4Backend.warm_up) runs once on a real server, before any request,
and caches nothing: no block, no hot bytes, no file."""

from __future__ import annotations

from pathlib import Path

import pytest

import openai

from vllm_mlx_persist.tools.models.build import build_model_dir
from vllm_mlx_persist.tools.serving import Server


def _find(obj, key):
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        for v in obj.values():
            found = _find(v, key)
            if found is not None:
                return found
    return None


def test_warmup_runs_at_startup_and_caches_nothing(tmp_path: Path):
    model = build_model_dir(tmp_path / "model", arch="llama", size="tiny", seed=0)
    home = tmp_path / "home"
    with Server(model, home, options={"block_size": 32, "hot_mb": 1}) as srv:
        stats = srv.get_json("/v1/cache/stats")
        assert _find(stats, "warmup_runs") == 1, stats
        assert _find(stats, "warmup_error") is None, stats
        assert _find(stats, "warmup_tokens") > 0, stats
        for key in ("blocks", "hot_bytes", "agents"):  # within hot_mb: it kept nothing
            assert _find(stats, key) == 0, (key, stats)
        assert "warm-up ran the 4-bit prefill and batched decode paths" in srv.log_tail(200)
        assert not list((home / ".cache" / "vllm-mlx-persist").glob("*/blocks/**/*.safetensors"))

        # and the server serves and caches normally afterwards
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        r = client.chat.completions.create(model=srv.model, max_tokens=4, temperature=0,
                                           messages=[{"role": "user", "content": "hello there " * 20}],
                                           extra_body={"metadata": {"agent_id": "alice"}})
        assert r.choices[0].message.content is not None
        stats = srv.get_json("/v1/cache/stats")
        assert _find(stats, "agents") == 1 and _find(stats, "blocks") > 0, stats
        assert _find(stats, "warmup_runs") == 1, stats


def test_warmup_option_is_checked():
    from vllm_mlx_persist.options import parse_options

    assert parse_options({})["warmup"] is True
    assert parse_options({"warmup": False})["warmup"] is False
    with pytest.raises(ValueError, match="warmup"):
        parse_options({"warmup": "yes"})
