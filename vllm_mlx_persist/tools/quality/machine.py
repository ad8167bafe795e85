"""What a measurement ran on, recorded in the reports of `vllm-mlx-persist quality` and `splice-drift`,
and the OpenBLAS their float32 runs want preloaded."""

from __future__ import annotations

import os
import platform
from typing import Any

from ..serving import cpu_name

OPENBLAS = f"/usr/lib/{platform.machine()}-linux-gnu/openblas-pthread/libblas.so.3"


def machine_info() -> dict[str, Any]:
    """The system, CPU, Python, mlx and mlx-lm versions, device, and whether OpenBLAS is preloaded."""
    import mlx.core as mx
    import mlx_lm

    return {
        "system": f"{platform.system()} {platform.machine()}",
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "device": str(mx.default_device().type).removeprefix("DeviceType."),
        "openblas_preloaded": "openblas" in os.environ.get("LD_PRELOAD", ""),
    }
