"""`vllm-mlx-persist bench` installs nothing at run time: without matplotlib its plots fail with an
error naming the extra to install."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vllm_mlx_persist.tools.bench import plots as bench_plots


def test_missing_matplotlib_names_the_extra_and_installs_nothing(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError

    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"ran a subprocess: {args}")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    monkeypatch.setattr(subprocess, "Popen", no_subprocess)
    with pytest.raises(ImportError) as e:
        bench_plots.write_plots({"sections": {}}, tmp_path)
    assert 'pip install "vllm-mlx-persist[bench]"' in str(e.value) and "--no-plots" in str(e.value)
