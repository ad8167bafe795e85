"""Apply, check and revert the plugin seam patches on an installed package, without `patch`/`git`.

A patch is a unified diff whose paths are relative to site-packages (`a/vllm_mlx/scheduler.py`),
shipped with a `.sha256` manifest giving, for every file it touches, the sha256 of the pristine and
of the patched file (`-` when the file does not exist). The manifest makes the state exact: every
file pristine, every file patched, a mix of the two (an interrupted run, or a reinstall that put
the pristine files back next to our new ones: both are finished by apply or revert), or anything
else, which is refused without touching a file. Hunks must match their context exactly, at the
line the diff names: no fuzz, no offsets.

Maintainers regenerate a manifest after editing a patch with
`python -m vllm_mlx_persist.patcher record PATCH PRISTINE_SITE_PACKAGES`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

ABSENT = "-"


@dataclass(frozen=True)
class PatchSpec:
    """One patch file and the distribution it applies to."""

    dist: str  # distribution name, e.g. "vllm-mlx"
    package: str  # top-level import package, e.g. "vllm_mlx"
    version: str  # the only version the patch applies to
    file: str  # patch file name inside the patches directory
    title: str  # what the patch does, for messages


VLLM_MLX = PatchSpec(
    dist="vllm-mlx",
    package="vllm_mlx",
    version="0.6.0",
    file="vllm-mlx-0.6.0-cache-backend.patch",
    title="cache-backend seam",
)
PATCHES: tuple[PatchSpec, ...] = (VLLM_MLX,)


class PatchError(Exception):
    """The patch cannot be applied, checked or reverted; the message says why."""


# ---------------------------------------------------------------------------------------------
# Unified diffs


@dataclass
class Hunk:
    old_start: int  # 1-based; for an empty side, the line after which the hunk goes
    new_start: int
    old: list[str]  # lines with their line endings
    new: list[str]


@dataclass
class FileDiff:
    path: str  # relative to the site-packages root
    old_exists: bool
    new_exists: bool
    hunks: list[Hunk]


def _lines(text: str) -> list[str]:
    """Split on "\n" only, keeping it (str.splitlines also splits on \f, \x1c, ...)."""
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _strip_path(header: str) -> Optional[str]:
    """`a/vllm_mlx/x.py\t2024-...` -> `vllm_mlx/x.py`; `/dev/null` -> None."""
    path = header.split("\t")[0].strip()
    if path == "/dev/null":
        return None
    return path.split("/", 1)[1] if path.startswith(("a/", "b/")) else path


def parse_unified_diff(text: str) -> list[FileDiff]:
    """Parse a (git-style or `diff -ruN`) unified diff into per-file hunks."""
    lines = _lines(text)
    files: list[FileDiff] = []
    i = 0
    while i < len(lines):
        if not (lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")):
            i += 1
            continue
        old_path, new_path = _strip_path(lines[i][4:]), _strip_path(lines[i + 1][4:])
        path = new_path or old_path
        if path is None:
            raise PatchError(f"diff line {i + 1}: both sides are /dev/null")
        fd = FileDiff(path, old_path is not None, new_path is not None, [])
        i += 2
        while i < len(lines) and lines[i].startswith("@@"):
            m = _HUNK_RE.match(lines[i])
            if not m:
                raise PatchError(f"diff line {i + 1}: bad hunk header {lines[i]!r}")
            old_len = int(m.group(2)) if m.group(2) is not None else 1
            new_len = int(m.group(4)) if m.group(4) is not None else 1
            hunk = Hunk(int(m.group(1)), int(m.group(3)), [], [])
            i += 1
            n_old = n_new = 0
            while i < len(lines) and (n_old < old_len or n_new < new_len):
                line = lines[i]
                tag, body = line[:1], line[1:]
                if tag == " ":
                    hunk.old.append(body)
                    hunk.new.append(body)
                    n_old += 1
                    n_new += 1
                elif tag == "-":
                    hunk.old.append(body)
                    n_old += 1
                elif tag == "+":
                    hunk.new.append(body)
                    n_new += 1
                elif line.startswith("\\"):
                    pass
                else:
                    raise PatchError(f"diff line {i + 1}: unexpected {line!r} inside a hunk")
                i += 1
                # "\ No newline at end of file" applies to the line just read
                if i < len(lines) and lines[i].startswith("\\"):
                    if tag in " -":
                        hunk.old[-1] = hunk.old[-1].rstrip("\n")
                    if tag in " +":
                        hunk.new[-1] = hunk.new[-1].rstrip("\n")
                    i += 1
            if n_old != old_len or n_new != new_len:
                raise PatchError(f"diff ends inside a hunk of {path}")
            fd.hunks.append(hunk)
        files.append(fd)
    if not files:
        raise PatchError("no file diffs found")
    return files


def apply_hunks(text: Optional[str], fd: FileDiff, reverse: bool = False) -> Optional[str]:
    """Apply one file's hunks (or undo them); None means the file does not exist."""
    exists_before = fd.new_exists if reverse else fd.old_exists
    exists_after = fd.old_exists if reverse else fd.new_exists
    if (text is not None) != exists_before:
        raise PatchError(f"{fd.path}: expected the file to {'exist' if exists_before else 'be absent'}")
    src = _lines(text) if text is not None else []
    out: list[str] = []
    pos = 0  # next unconsumed source line (0-based)
    for h in fd.hunks:
        before, after = (h.new, h.old) if reverse else (h.old, h.new)
        start = h.new_start if reverse else h.old_start
        start = start - 1 if before else start  # an empty side names the line it follows
        if start < pos or src[start : start + len(before)] != before:
            raise PatchError(f"{fd.path}: hunk at line {start + 1} does not match the file")
        out += src[pos:start] + after
        pos = start + len(before)
    out += src[pos:]
    return "".join(out) if exists_after else None


# ---------------------------------------------------------------------------------------------
# Locating things


def patches_dir() -> Path:
    """`vllm_mlx_persist/patches` in a wheel, the repository's `patches/` in an editable install."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "patches", here.parent / "patches"):
        if candidate.is_dir():
            return candidate
    raise PatchError(f"no patches directory next to {here}")


def find_root(spec: PatchSpec) -> Path:
    """The site-packages directory holding `spec.package`, found without importing it."""
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise PatchError(f"{spec.dist} is not installed ({spec.package} not found)")
    return Path(list(found.submodule_search_locations)[0]).parent


def installed_version(spec: PatchSpec, root: Path) -> Optional[str]:
    """The version of `spec.dist` installed under `root`, from its metadata or `__version__`."""
    for dist in importlib.metadata.distributions(path=[str(root)]):
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name == spec.dist:
            return dist.version
    init = root / spec.package / "__init__.py"
    if init.is_file():
        m = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", init.read_text(), re.M)
        if m:
            return m.group(1)
    return None


def parse_manifest(text: str) -> dict[str, tuple[str, str]]:
    """`{path: (pristine_sha256, patched_sha256)}` from a `.sha256` manifest."""
    out: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            path, pristine, patched = line.split()
            out[path] = (pristine, patched)
    return out


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else ABSENT


def _text_sha256(text: Optional[str]) -> str:
    return ABSENT if text is None else hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# Writing


def _write_atomic(path: Path, text: Optional[str]) -> None:
    if text is None:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _drop_bytecode(path: Path) -> None:
    """Remove `__pycache__/<module>.*.pyc` of a touched module, stale either way."""
    cache = path.parent / "__pycache__"
    if path.suffix == ".py" and cache.is_dir():
        for pyc in cache.glob(f"{path.stem}.*.pyc"):
            pyc.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# The three actions


@dataclass
class Patch:
    name: str
    diffs: list[FileDiff]
    manifest: dict[str, tuple[str, str]]

    @classmethod
    def load(cls, name: str, patch_text: str, manifest_text: str) -> "Patch":
        diffs = parse_unified_diff(patch_text)
        manifest = parse_manifest(manifest_text)
        if sorted(manifest) != sorted(fd.path for fd in diffs):
            raise PatchError(f"{name}: the .sha256 manifest does not list the files the patch touches")
        return cls(name, diffs, manifest)


def _state(root: Path, manifest: dict[str, tuple[str, str]]) -> dict[str, str]:
    """Per file: "pristine", "patched" or "modified"."""
    states = {}
    for rel, (pristine, patched) in manifest.items():
        h = sha256(root / rel)
        states[rel] = "patched" if h == patched else "pristine" if h == pristine else "modified"
    return states


def _transform(root: Path, patch: Patch, rels: Sequence[str], reverse: bool) -> dict[str, Optional[str]]:
    """New contents of `rels`, computed in memory and checked against the manifest."""
    out: dict[str, Optional[str]] = {}
    by_path = {fd.path: fd for fd in patch.diffs}
    for rel in rels:
        path = root / rel
        text = path.read_bytes().decode("utf-8") if path.exists() else None
        new = apply_hunks(text, by_path[rel], reverse=reverse)
        want = patch.manifest[rel][0 if reverse else 1]
        if _text_sha256(new) != want:
            raise PatchError(f"{rel}: {'reverting' if reverse else 'applying'} gives an unexpected file")
        out[rel] = new
    return out


def _record_paths(spec: PatchSpec, root: Path) -> tuple[Path, Path]:
    """Where apply keeps a copy of what it applied, so a later version can undo it."""
    stem = spec.file.removesuffix(".patch")
    return root / spec.package / f".applied-{stem}.patch", root / spec.package / f".applied-{stem}.sha256"


def _applied_record(spec: PatchSpec, root: Path) -> Optional[Patch]:
    patch_file, sums_file = _record_paths(spec, root)
    if not (patch_file.is_file() and sums_file.is_file()):
        return None
    return Patch.load(patch_file.name, patch_file.read_bytes().decode("utf-8"), sums_file.read_text())


def _write(root: Path, texts: dict[str, Optional[str]]) -> None:
    for rel, text in texts.items():
        _write_atomic(root / rel, text)
        _drop_bytecode(root / rel)


def run_one(spec: PatchSpec, action: str, root: Path) -> int:
    patch_path = patches_dir() / spec.file
    name = f"{spec.dist} {spec.title}"
    version = installed_version(spec, root)
    if version != spec.version:
        raise PatchError(
            f"{spec.dist} {version or '(unknown version)'} found in {root}; this patch is for "
            f"{spec.dist} {spec.version} only (pip install --no-deps {spec.dist}=={spec.version})"
        )
    patch_text = patch_path.read_bytes().decode("utf-8")
    sums_text = patch_path.with_suffix(".sha256").read_text()
    patch = Patch.load(patch_path.name, patch_text, sums_text)
    record_patch, record_sums = _record_paths(spec, root)

    states = _state(root, patch.manifest)
    if "modified" in states.values():
        # Perhaps an earlier version of this patch: undo it with the copy kept when it was applied.
        old = _applied_record(spec, root)
        if old is not None and "modified" not in _state(root, old.manifest).values():
            if action == "check":
                print(f"not applied: an older version of the {name} is applied to {root}; "
                      f"run `vllm-mlx-persist patch` to update it")
                return 1
            rels = [rel for rel, st in _state(root, old.manifest).items() if st == "patched"]
            _write(root, _transform(root, old, rels, reverse=True))
            record_patch.unlink(missing_ok=True)
            record_sums.unlink(missing_ok=True)
            print(f"reverted an older version of the {name} in {root}")
            states = _state(root, patch.manifest)
    modified = sorted(rel for rel, st in states.items() if st == "modified")
    if modified:
        msg = (
            f"{name}: {', '.join(modified)} in {root} match(es) neither the pristine nor the patched "
            f"{spec.dist} {spec.version}; reinstall it (pip install --force-reinstall --no-deps "
            f"{spec.dist}=={spec.version}) and apply again. Nothing was changed."
        )
        if action == "check":
            print(f"not applied: {msg}")
            return 1
        raise PatchError(msg)

    pristine = sorted(rel for rel, st in states.items() if st == "pristine")
    patched = sorted(rel for rel, st in states.items() if st == "patched")
    if action == "check":
        # dry runs: the patch must also revert cleanly if applied, and apply cleanly if not
        if not pristine:
            _transform(root, patch, patched, reverse=True)
            print(f"applied: {name} is applied to {root}")
            return 0
        _transform(root, patch, pristine, reverse=False)
        partly = " (partially: run `vllm-mlx-persist patch` to finish)" if patched else ""
        print(f"not applied: {name} is not applied to {root}{partly}")
        return 1

    if action == "apply":
        if pristine:
            _write(root, _transform(root, patch, pristine, reverse=False))
        _write_atomic(record_patch, patch_text)
        _write_atomic(record_sums, sums_text)
        done = f"applied to {root} ({len(pristine)} files)" if pristine else f"already applied to {root}"
    else:
        if patched:
            _write(root, _transform(root, patch, patched, reverse=True))
        record_patch.unlink(missing_ok=True)
        record_sums.unlink(missing_ok=True)
        done = f"reverted in {root} ({len(patched)} files)" if patched else f"already absent from {root}"
    print(f"{name} {done}")
    return 0


def run(action: str, target: Path | None = None, *, specs: Sequence[PatchSpec] = PATCHES) -> int:
    """`apply`, `check` or `revert` the patches on `target` (a site-packages directory; default:
    where the patched packages are installed). Returns a process exit code."""
    if action not in ("apply", "check", "revert"):
        raise ValueError(f"unknown action {action!r}")
    rc = 0
    for spec in specs:
        try:
            root = Path(target) if target is not None else find_root(spec)
            rc = max(rc, run_one(spec, action, root))
        except PatchError as e:
            print(f"error: {e}", file=sys.stderr)
            rc = 2
    return rc


def record(patch_path: Path, pristine_root: Path) -> None:
    """Write `patch_path`'s `.sha256` manifest from a pristine tree (maintainers only)."""
    diffs = parse_unified_diff(patch_path.read_bytes().decode("utf-8"))
    lines = ["# path  pristine-sha256  patched-sha256  ('-' = file absent)"]
    for fd in diffs:
        path = pristine_root / fd.path
        text = path.read_bytes().decode("utf-8") if path.exists() else None
        new = apply_hunks(text, fd)
        if apply_hunks(new, fd, reverse=True) != text:
            raise PatchError(f"{fd.path}: the patch does not revert to the pristine file")
        lines.append(f"{fd.path} {_text_sha256(text)} {_text_sha256(new)}")
    patch_path.with_suffix(".sha256").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "record":
        record(Path(sys.argv[2]), Path(sys.argv[3]))
    elif len(sys.argv) == 2 and sys.argv[1] in ("apply", "check", "revert"):
        sys.exit(run(sys.argv[1]))
    else:
        sys.exit("usage: python -m vllm_mlx_persist.patcher apply|check|revert|record PATCH PRISTINE_ROOT")
