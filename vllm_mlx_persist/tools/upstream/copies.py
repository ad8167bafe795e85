"""What checking the seam against vllm-mlx's own tests needs from the pinned vllm-mlx: the test suite
its sdist ships (downloaded once with pip into a cache), the packages those tests import beyond a
text-serving install (the `dev` extra declares them; nothing is installed at run time), and copies
of the installed vllm_mlx, pristine or carrying patches of the series, to put first on PYTHONPATH.
The installed package is never modified."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Optional, Sequence

from ... import patcher

SPEC = patcher.VLLM_MLX
# Imported by vllm-mlx's tests but not by a text-serving install (import name: distribution), all in
# the `dev` extra of pyproject.toml. Not torch: the tests that need it fail on pristine vllm-mlx as well.
TEST_DEPS = {"anyio": "anyio", "pytz": "pytz", "tabulate": "tabulate", "pytest_asyncio": "pytest-asyncio"}


class Unavailable(RuntimeError):
    """The sdist could not be downloaded (no network or no index); the message says why."""


class MissingTestDeps(RuntimeError):
    """Packages vllm-mlx's tests import are not installed; the message says what to install."""


def default_cache_dir() -> Path:
    """Inside the virtual environment (one download per environment), else the user's cache."""
    if sys.prefix != sys.base_prefix and os.access(sys.prefix, os.W_OK):
        return Path(sys.prefix) / ".cache" / "vllm-mlx-persist"
    return Path.home() / ".cache" / "vllm-mlx-persist"


def _archive(folder: Path, spec: patcher.PatchSpec) -> Optional[Path]:
    names = {f"{n}-{spec.version}.tar.gz" for n in (spec.dist, spec.dist.replace("-", "_"))}
    found = [p for p in folder.glob("*.tar.gz") if p.name in names] if folder.is_dir() else []
    return found[0] if found else None


def fetch_tests(cache_dir: Path, spec: patcher.PatchSpec = SPEC) -> Path:
    """A folder holding the sdist's `tests/` and its `pyproject.toml` (vllm-mlx's pytest settings),
    unpacked once under `cache_dir`; the sdist is fetched with `pip download` the first time."""
    root = cache_dir / f"{spec.dist}-{spec.version}-tests"
    if (root / ".complete").exists():
        return root
    sdists = cache_dir / "sdist"
    archive = _archive(sdists, spec)
    if archive is None:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps",
               "--no-binary", ":all:", f"{spec.dist}=={spec.version}", "--dest", str(sdists)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        archive = _archive(sdists, spec)
        if archive is None:
            why = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
            raise Unavailable(f"could not download the {spec.dist} {spec.version} sdist with pip: {why}")
    shutil.rmtree(root, ignore_errors=True)  # an unpacking that did not finish
    partial = root.with_name(f"{root.name}.partial-{os.getpid()}")
    with tarfile.open(archive) as tar:
        members = []
        for m in tar.getmembers():
            rel = m.name.split("/", 1)[1] if "/" in m.name else ""
            wanted = rel == "pyproject.toml" or rel.startswith("tests/")
            if wanted and (m.isfile() or m.isdir()) and ".." not in rel.split("/"):
                m.name = rel
                members.append(m)
        if not any(m.name.startswith("tests/test_") for m in members):
            raise Unavailable(f"{archive} holds no tests/")
        try:
            tar.extractall(partial, members, filter="data")
        except TypeError:  # Python without extraction filters (3.10 before 3.10.12)
            tar.extractall(partial, members)
    (partial / ".complete").touch()
    try:
        partial.rename(root)
    except OSError:  # another process unpacked it first
        shutil.rmtree(partial, ignore_errors=True)
    return root


def missing_test_deps() -> list[str]:
    """The distributions of TEST_DEPS this interpreter cannot import."""
    importlib.invalidate_caches()
    return [dist for module, dist in TEST_DEPS.items() if importlib.util.find_spec(module) is None]


def require_test_deps() -> None:
    """Raise MissingTestDeps, naming what to install, if any of TEST_DEPS cannot be imported."""
    missing = missing_test_deps()
    if missing:
        raise MissingTestDeps(
            f"vllm-mlx's own tests import {', '.join(missing)}, not installed in {sys.prefix}: install the "
            f"`dev` extra (pip install -e \".[dev]\" in a checkout of vllm-mlx-persist) or "
            f"pip install {' '.join(missing)}")


def series_numbers() -> list[str]:
    """The patches of the series by number ("0001", ...), in series order."""
    return [p.name[:4] for p in patcher.read_series(patcher.patches_dir() / SPEC.path)]


# The patches a patch is stacked on (docs/upstream.md, "Needs"); the others apply to pristine 0.6.0.
NEEDS = {"0003": ("0001",), "0004": ("0001",), "0005": ("0001",)}


def each_patch() -> list[tuple[str, ...]]:
    """Every patch as its pull request stands: alone, or on the patches it needs."""
    return [(*NEEDS.get(n, ()), n) for n in series_numbers()]


def make_tree(dst: Path, numbers: Optional[Sequence[str]] = None) -> Path:
    """`dst/vllm_mlx`: a copy of the installed vllm_mlx, reverted to pristine, carrying the patches
    `numbers` of the series (None: all of them, as `vllm-mlx-persist patch` applies them). A patch
    without the ones before it is applied where its exact context is found (offsets, no fuzz), as
    tests/test_seam_series.py applies it. Returns `dst`, the folder to put on PYTHONPATH."""
    series = patcher.read_series(patcher.patches_dir() / SPEC.path)
    known = [p.name[:4] for p in series]
    unknown = sorted(set(numbers or ()) - set(known))
    if unknown:
        raise ValueError(f"no patch {', '.join(unknown)} in the series ({', '.join(known)})")
    chosen = [p for p in series if numbers is None or p.name[:4] in numbers]
    shutil.copytree(patcher.find_root(SPEC) / SPEC.package, dst / SPEC.package,
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = patcher.run("revert", dst, specs=[SPEC])  # the installed copy may carry the series
    if rc != 0:
        raise patcher.PatchError(f"cannot revert a copy of the installed {SPEC.dist}: {out.getvalue().strip()}")
    whole = len(chosen) == len(series)
    for patch in chosen:
        for fd in patch.diffs:
            path = dst / fd.path
            before = path.read_text(encoding="utf-8") if path.exists() else None
            patcher._write_atomic(path, patcher.apply_hunks(before, fd, offsets=not whole))
    return dst
