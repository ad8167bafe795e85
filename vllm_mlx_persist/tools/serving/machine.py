"""What the host offers the servers: its CPU's name and Debian's OpenBLAS (preloaded into every
server on Linux: MLX's CPU backend is 15-35x faster with it). Used by `vllm-mlx-persist bench`,
`quality` and `reliability` and by the tests, through tools/serving."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Optional


def openblas_path() -> Optional[str]:
    """Debian's pthread OpenBLAS for this architecture, if installed (Linux only) and not turned off
    (VLLM_MLX_PERSIST_OPENBLAS=0, as ./dev honours it)."""
    if platform.system() != "Linux" or os.environ.get("VLLM_MLX_PERSIST_OPENBLAS", "1") == "0":
        return None
    path = f"/usr/lib/{platform.machine()}-linux-gnu/openblas-pthread/libblas.so.3"
    return path if os.path.exists(path) else None


def cpu_name() -> str:
    """The CPU's marketing name (from /proc/cpuinfo or sysctl), else the architecture."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if platform.system() == "Darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                  text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine()
