"""Which BLAS this process multiplies float32 matrices with: mlx-cpu's own, or a preloaded OpenBLAS and
the kernel set it picked for this CPU (docs/design.md, "Batch invariance": the kernel decides whether a
row of a matrix product rounds the same whatever the number of rows)."""

from __future__ import annotations

import ctypes
import os
import platform


def row_products(x, w):
    """`x @ w.T` one row of x at a time: each row's product is then the same BLAS call whatever the
    number of rows (the tests' `row_by_row`, blas_bench's --rows)."""
    import mlx.core as mx

    flat = x.reshape(-1, x.shape[-1])
    out = mx.concatenate([flat[i : i + 1] @ w.T for i in range(flat.shape[0])], axis=0)
    return out.reshape(*x.shape[:-1], w.shape[0])


def row_linear(layer, x):
    """`nn.Linear.__call__` through `row_products`."""
    y = row_products(x, layer["weight"])
    return y + layer["bias"] if "bias" in layer else y


def kernel() -> str:
    """'OpenBLAS <version> <core>' (the core OpenBLAS picked at load, or `OPENBLAS_CORETYPE`'s) when
    OpenBLAS is in the process, else 'mlx' (mlx-cpu's bundled BLAS)."""
    try:
        me = ctypes.CDLL(None)
        core, config = me.openblas_get_corename, me.openblas_get_config
    except (AttributeError, OSError):
        return "mlx"
    core.restype = config.restype = ctypes.c_char_p
    version = next((w for w in config().decode().split()[1:2]), "?")
    return f"OpenBLAS {version} {core().decode()}"


def describe() -> str:
    """The kernel and the settings that chose it, for a log or a report header."""
    name = kernel()
    if name == "mlx":
        return "mlx-cpu's own BLAS (no OpenBLAS loaded)"
    pinned = os.environ.get("OPENBLAS_CORETYPE")
    threads = os.environ.get("OPENBLAS_NUM_THREADS")
    extra = [f"OPENBLAS_CORETYPE={pinned}"] if pinned else []
    extra += [f"OPENBLAS_NUM_THREADS={threads}"] if threads else []
    return name + (f" ({', '.join(extra)})" if extra else "")


# OpenBLAS 0.3.21's DYNAMIC_ARCH x86-64 kernel sets (`OPENBLAS_CORETYPE` names) and the CPU flags
# (/proc/cpuinfo) their code needs: a kernel set the CPU cannot run dies on an illegal instruction
# (Opteron's, 3DNow!, did on this AMD EPYC, which has none).
X86_KERNELS = {
    "Prescott": {"pni"}, "Core2": {"ssse3"}, "Penryn": {"sse4_1"}, "Dunnington": {"sse4_1"},
    "Nehalem": {"sse4_2"}, "Atom": {"ssse3"}, "Opteron": {"sse2", "3dnowext"}, "Barcelona": {"pni", "sse4a"},
    "Bobcat": {"pni", "sse4a"}, "Sandybridge": {"avx"}, "Bulldozer": {"avx", "fma4"},
    "Piledriver": {"avx", "fma4", "fma"}, "Steamroller": {"avx", "fma4", "fma"}, "Excavator": {"avx2", "fma4", "fma"},
    "Haswell": {"avx2", "fma"}, "Zen": {"avx2", "fma"},
    "SkylakeX": {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"},
    "Cooperlake": {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16"},
}
# Those `./dev test-kernels` runs by default: one per distinct sgemm kernel family (SSE, AVX,
# AVX2 with Haswell's and Zen's blocking, AVX-512); KERNELS=all runs every one the CPU can.
DEFAULT_KERNELS = ("Haswell", "SkylakeX", "Zen", "Sandybridge", "Nehalem")


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def runnable_kernels(wanted: str = "default") -> list[str]:
    """The OpenBLAS kernel sets to test on this CPU: `wanted` is 'default', 'all' or a comma-separated
    list of names; a name the CPU cannot run is left out. On a CPU other than x86-64: ['auto'], the
    kernel set OpenBLAS picks (these names are x86-64's)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ["auto"]
    flags = cpu_flags()
    names = list(X86_KERNELS) if wanted == "all" else list(DEFAULT_KERNELS) if wanted == "default" else [
        n.strip() for n in wanted.split(",") if n.strip()]
    unknown = [n for n in names if n not in X86_KERNELS]
    if unknown:
        raise SystemExit(f"unknown OpenBLAS kernel set(s) {unknown}; known: {', '.join(X86_KERNELS)}")
    return [n for n in names if X86_KERNELS[n] <= flags]


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["kernels"]:
        print(" ".join(runnable_kernels(sys.argv[2] if len(sys.argv) > 2 else "default")))
    else:
        import mlx.core  # noqa: F401

        print(describe())
