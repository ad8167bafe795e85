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
    "fields, flags",
    [
        ({"use_paged_cache": True}, "--use-paged-cache"),
        ({"max_kv_size": 4096}, "--max-kv-size"),
        ({"enable_prefix_cache": False}, "--disable-prefix-cache"),
        ({"use_memory_aware_cache": False, "kv_cache_quantization": True},
         "--no-memory-aware-cache, --kv-cache-quantization"),
        ({"ssd_cache_dir": "/tmp/nowhere"}, "--ssd-cache-dir"),
    ],
)
def test_factory_refuses_the_cache_options_it_replaces(fields, flags):
    """The persist_q4 factory refuses vllm-mlx's own cache options, naming every one, before building
    anything (on vllm-mlx's real SchedulerConfig; the server below shows the CLI reaches it)."""
    from vllm_mlx.scheduler import SchedulerConfig

    from vllm_mlx_persist.plugin import create_backend

    with pytest.raises(ValueError, match=f"cannot be combined with {flags}:"):
        create_backend(model=None, tokenizer=None, config=SchedulerConfig(**fields), options={})


def test_the_server_stops_at_start_up_on_a_replaced_cache_option(tiny_llama_dir, isolated_home):
    cmd = [str(BIN / "vllm-mlx"), "serve", str(tiny_llama_dir), "--port", "1", "--continuous-batching",
           "--cache-backend", "persist_q4", "--no-memory-aware-cache", "--kv-cache-quantization"]
    r = subprocess.run(cmd, env=isolated_home, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "--cache-backend persist_q4 cannot be combined with --no-memory-aware-cache, --kv-cache-quantization:" in out, out
    assert "Uvicorn running" not in out and "Traceback" not in out, out  # one line (refusal.py)


def test_options_without_backend_refused(tmp_path):
    r = serve(tmp_path, "--continuous-batching", "--cache-backend-options", '{"hot_mb": 1}')
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "--cache-backend-options requires --cache-backend" in out, out


@pytest.mark.parametrize(
    "options, message",
    [
        ({"prefill_attention": "fp16"}, "prefill_attention must be one of"),
        ({"hot_gb": 1}, "unknown persist_q4 option(s) ['hot_gb']"),
        ({"bits": 7}, "bits must be one of"),
    ],
)
def test_bad_backend_options_refused(options, message):
    """Bad option values are refused with a message that names them (the servers below show that such
    a refusal stops vllm-mlx at start-up)."""
    from vllm_mlx_persist.options import parse_options

    with pytest.raises(ValueError) as e:
        parse_options(options)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "options, message",
    [
        ('{"hot_gb": 1}', "unknown persist_q4 option(s) ['hot_gb']"),  # persist_q4's factory
        ("{not json", "must be a valid JSON object"),  # the seam's CLI
    ],
)
def test_the_server_stops_at_start_up_on_bad_backend_options(tiny_llama_dir, isolated_home, options, message):
    cmd = [str(BIN / "vllm-mlx"), "serve", str(tiny_llama_dir), "--port", "1", "--continuous-batching",
           "--cache-backend", "persist_q4", "--cache-backend-options", options]
    r = subprocess.run(cmd, env=isolated_home, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert message in out, out
    assert "Uvicorn running" not in out, out
