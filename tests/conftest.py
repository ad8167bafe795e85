"""Shared fixtures: locally built models (once per session) and an isolated HOME for subprocesses."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest

from vllm_mlx_persist.tools.models import build_model_dir


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Callable[..., Path]:
    """Factory: `model_dir(arch="llama", size="tiny", seed=0)` -> a model dir, built once per session."""
    root = tmp_path_factory.mktemp("models")
    built: dict[tuple[str, str, int], Path] = {}

    def make(arch: str = "llama", size: str = "tiny", seed: int = 0) -> Path:
        key = (arch, size, seed)
        if key not in built:
            built[key] = build_model_dir(root / f"{arch}-{size}-{seed}", arch=arch, size=size, seed=seed)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_dir(model_dir) -> Path:
    return model_dir("llama", "tiny")


@pytest.fixture
def isolated_home(tmp_path) -> dict[str, str]:
    """Environment for a subprocess with HOME and XDG_CACHE_HOME inside this test's tmp dir."""
    home = tmp_path / "home"
    (home / ".cache").mkdir(parents=True, exist_ok=True)
    return dict(os.environ, HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"))


@pytest.fixture(params=["mirror_off", "mirror_on"])
def decode_mirror(request):
    """Run a test with batched decode on the 4-bit matmuls (budget 0), then on the float decode
    mirror (a 256 MB budget); the process default ("auto") is restored after."""
    from vllm_mlx_persist.caches import floats

    floats.set_decode_float_budget(256 if request.param == "mirror_on" else 0)
    yield request.param == "mirror_on"
    floats.set_decode_float_budget("auto")


@pytest.fixture
def serving_backend(tmp_path, monkeypatch):
    """persist_q4 serving in this process, as vllm-mlx makes it: the plugin's factory builds a backend
    (tiny llama, cache under tmp_path) and registers it; no backend another test left open counts."""
    import weakref

    from vllm_mlx_persist import plugin
    from vllm_mlx_persist.tools.models import build_model

    monkeypatch.setattr(plugin, "_LIVE_BACKENDS", weakref.WeakSet())
    model, _ = build_model("llama", "tiny", seed=0)
    backend = plugin.create_backend(model=model, tokenizer=None, config=None, options={
        "cache_dir": str(tmp_path / "cache"), "warmup": False, "restore": False})
    yield backend
    backend.close()
