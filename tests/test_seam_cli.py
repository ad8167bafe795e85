"""`vllm-mlx serve --cache-backend ...` refuses bad combinations: what the seam cannot serve before
loading any model, what persist_q4's factory refuses (the built-in cache options it replaces, bad
options) at start-up, before serving.

Assumes the seam is applied to the installed vllm-mlx (`vllm-mlx-persist patch`, done by ./dev).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module", autouse=True)
def seam_applied():
    r = subprocess.run([str(BIN / "vllm-mlx-persist"), "patch", "--check"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"the vllm-mlx seam is not applied; run `vllm-mlx-persist patch` first:\n{r.stdout}{r.stderr}")


def serve(tmp_path: Path, *args: str, model: bool = True) -> subprocess.CompletedProcess:
    home = tmp_path / "home"
    (home / ".cache").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"))
    model_dir = tmp_path / "no-model-needed"  # validation must fail before anything is loaded
    model_dir.mkdir(exist_ok=True)
    cmd = [str(BIN / "vllm-mlx"), "serve", *([str(model_dir)] if model else []), "--port", "1", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_unknown_backend_lists_registered_ones(tmp_path):
    r = serve(tmp_path, "--continuous-batching", "--cache-backend", "no_such_backend")
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "no_such_backend" in out and "persist_q4" in out, out
    assert "Loading model" not in out, out


@pytest.mark.parametrize(
    "args, message",
    [
        ((), "--cache-backend requires --continuous-batching"),
        (("--continuous-batching", "--mllm"), "--cache-backend does not support --mllm"),
        (("--continuous-batching", "--models-config", "models.yaml"), "--cache-backend does not support --models-config"),
    ],
)
def test_paths_the_seam_does_not_serve_are_refused_before_loading(tmp_path, args, message):
    r = serve(tmp_path, "--cache-backend", "persist_q4", *args, model="--models-config" not in args)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert message in out, out
    assert "Loading model" not in out, out


@pytest.mark.parametrize(
    "args, flags",
    [
        (("--use-paged-cache",), "--use-paged-cache"),
        (("--max-kv-size", "4096"), "--max-kv-size"),
        (("--disable-prefix-cache",), "--disable-prefix-cache"),
        (("--no-memory-aware-cache", "--kv-cache-quantization"), "--no-memory-aware-cache, --kv-cache-quantization"),
        (("--ssd-cache-dir", "/tmp/nowhere"), "--ssd-cache-dir"),
    ],
)
def test_factory_refuses_the_cache_options_it_replaces(tiny_llama_dir, isolated_home, args, flags):
    """The persist_q4 factory (not vllm-mlx's CLI) refuses them, at start-up, naming every one."""
    cmd = [str(BIN / "vllm-mlx"), "serve", str(tiny_llama_dir), "--port", "1", "--continuous-batching",
           "--cache-backend", "persist_q4", *args]
    r = subprocess.run(cmd, env=isolated_home, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert f"--cache-backend persist_q4 cannot be combined with {flags}:" in out, out
    assert "Uvicorn running" not in out, out


def test_options_without_backend_refused(tmp_path):
    r = serve(tmp_path, "--continuous-batching", "--cache-backend-options", '{"hot_mb": 1}')
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "--cache-backend-options requires --cache-backend" in out, out


@pytest.mark.parametrize(
    "options, message",
    [
        ('{"prefill_attention": "fp16"}', "prefill_attention must be one of"),
        ('{"hot_gb": 1}', "unknown persist_q4 option(s) ['hot_gb']"),
        ('{"bits": 7}', "bits must be one of"),
        ("{not json", "must be a valid JSON object"),
    ],
)
def test_bad_backend_options_refused(tiny_llama_dir, isolated_home, options, message):
    """Bad option values stop the server at start-up with a message that names them."""
    cmd = [str(BIN / "vllm-mlx"), "serve", str(tiny_llama_dir), "--port", "1", "--continuous-batching",
           "--cache-backend", "persist_q4", "--cache-backend-options", options]
    r = subprocess.run(cmd, env=isolated_home, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert message in out, out
    assert "Uvicorn running" not in out, out
