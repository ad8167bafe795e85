"""Apply, check and revert the plugin seam patches on an installed package, without `patch`/`git`.

A patch is a unified diff whose paths are relative to site-packages (`a/vllm_mlx/scheduler.py`),
shipped with a `.sha256` manifest giving, for every file it touches, the sha256 of the file before
and after it (`-` when the file does not exist). A series is a folder of such patches applied in
the order its `series` file lists, each on top of the ones before it. The manifests chain every
touched file through its states (pristine, after the first patch touching it, ...), which makes
the state exact: every file pristine, every file fully patched, files in between (an interrupted
run, or a reinstall that put the pristine files back next to our new ones: both are finished by
apply or revert), or anything else, which is refused without touching a file. Hunks must match
their context exactly, at the line the diff names: no fuzz, no offsets.

Apply keeps a copy of the series it applied next to the package, so that a later version of the
series (or a user's `--revert` after upgrading) can undo exactly what was applied.

Maintainers regenerate the manifests after editing a patch with
`python -m vllm_mlx_persist.patcher record patches/vllm-mlx-0.6.0 PRISTINE_SITE_PACKAGES`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
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
    """A series of patches (or one patch) and the distribution it applies to."""

    dist: str  # distribution name, e.g. "vllm-mlx"
    package: str  # top-level import package, e.g. "vllm_mlx"
    version: str  # the only version the series applies to
    path: str  # under the patches directory: a folder with a `series` file, or one .patch file
    title: str  # what the series does, for messages


VLLM_MLX = PatchSpec(
    dist="vllm-mlx",
    package="vllm_mlx",
    version="0.6.0",
    path="vllm-mlx-0.6.0",
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
    added: int = 0  # "+" lines
    removed: int = 0  # "-" lines


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
                    fd.removed += 1
                elif tag == "+":
                    hunk.new.append(body)
                    n_new += 1
                    fd.added += 1
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


def apply_hunks(
    text: Optional[str], fd: FileDiff, reverse: bool = False, offsets: bool = False
) -> Optional[str]:
    """Apply one file's hunks (or undo them); None means the file does not exist.

    Context must match exactly at the line each hunk names. `offsets` lets a hunk match its exact
    context elsewhere (the nearest place, as `patch` does), to check that one patch of a series
    applies without the others; applying the series never uses it."""
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
            found = _nearest_match(src, before, start, pos) if offsets and before else None
            if found is None:
                raise PatchError(f"{fd.path}: hunk at line {start + 1} does not match the file")
            start = found
        out += src[pos:start] + after
        pos = start + len(before)
    out += src[pos:]
    return "".join(out) if exists_after else None


def _nearest_match(src: list[str], lines: list[str], start: int, lo: int) -> Optional[int]:
    """The index >= lo nearest to `start` where `lines` occur in `src`, if any."""
    hits = [k for k in range(lo, len(src) - len(lines) + 1) if src[k : k + len(lines)] == lines]
    return min(hits, key=lambda k: abs(k - start)) if hits else None


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
# Patches, series and the states of their files


@dataclass
class Patch:
    name: str
    text: str  # the diff as shipped
    sums: str  # its .sha256 manifest as shipped
    diffs: list[FileDiff]
    manifest: dict[str, tuple[str, str]]

    @classmethod
    def load(cls, name: str, text: str, sums: str) -> "Patch":
        diffs = parse_unified_diff(text)
        manifest = parse_manifest(sums)
        if sorted(manifest) != sorted(fd.path for fd in diffs):
            raise PatchError(f"{name}: the .sha256 manifest does not list the files the patch touches")
        return cls(name, text, sums, diffs, manifest)

    @classmethod
    def read(cls, path: Path) -> "Patch":
        return cls.load(path.name, path.read_bytes().decode("utf-8"), path.with_suffix(".sha256").read_text())


def series_files(path: Path) -> list[Path]:
    """The patch files of a series folder in the order of its `series` file, or `[path]`."""
    if not path.is_dir():
        return [path]
    names = [line.strip() for line in (path / "series").read_text().splitlines()]
    return [path / name for name in names if name and not name.startswith("#")]


def read_series(path: Path) -> list[Patch]:
    return [Patch.read(p) for p in series_files(path)]


@dataclass
class Chain:
    """One file through a series: `hashes[0]` before the first patch touching it, `hashes[k]` after
    the k-th; `diffs[k]` takes it from state k to k + 1."""

    hashes: list[str]
    diffs: list[FileDiff]


def chains(series: Sequence[Patch]) -> dict[str, Chain]:
    out: dict[str, Chain] = {}
    for patch in series:
        for fd in patch.diffs:
            before, after = patch.manifest[fd.path]
            chain = out.setdefault(fd.path, Chain([before], []))
            if chain.hashes[-1] != before:
                raise PatchError(f"{patch.name}: {fd.path} does not start where the series leaves it")
            chain.hashes.append(after)
            chain.diffs.append(fd)
    return out


def _states(root: Path, files: dict[str, Chain]) -> dict[str, Optional[int]]:
    """Per file: the index of its state in its chain, or None (matches none: modified)."""
    states: dict[str, Optional[int]] = {}
    for rel, chain in files.items():
        h = sha256(root / rel)
        states[rel] = chain.hashes.index(h) if h in chain.hashes else None
    return states


def _move(root: Path, rel: str, chain: Chain, start: int, end: int) -> Optional[str]:
    """The file `rel` taken from state `start` to state `end`, in memory, each step checked."""
    path = root / rel
    text = path.read_bytes().decode("utf-8") if path.exists() else None
    step = 1 if end > start else -1
    for k in range(start, end, step):
        fd, want = (chain.diffs[k], chain.hashes[k + 1]) if step > 0 else (chain.diffs[k - 1], chain.hashes[k - 1])
        text = apply_hunks(text, fd, reverse=step < 0)
        if _text_sha256(text) != want:
            raise PatchError(f"{rel}: {'applying' if step > 0 else 'reverting'} gives an unexpected file")
    return text


def _plan(root: Path, files: dict[str, Chain], states: dict[str, Optional[int]], back: bool) -> dict[str, Optional[str]]:
    """New contents of every file not yet fully patched (or, `back`, not yet pristine)."""
    out: dict[str, Optional[str]] = {}
    for rel, chain in files.items():
        state, target = states[rel], 0 if back else len(chain.diffs)
        assert state is not None
        if state != target:
            out[rel] = _move(root, rel, chain, state, target)
    return out


def _write(root: Path, texts: dict[str, Optional[str]]) -> None:
    for rel, text in texts.items():
        _write_atomic(root / rel, text)
        _drop_bytecode(root / rel)


# ---------------------------------------------------------------------------------------------
# What apply keeps: a copy of the series it applied


def _record_path(spec: PatchSpec, root: Path) -> Path:
    return root / spec.package / f".applied-{spec.dist}-{spec.version}.json"


def _recorded(spec: PatchSpec, root: Path) -> list[list[Patch]]:
    """The series recorded as applied: ours, and any `.applied-NAME.patch|.sha256` pair that
    vllm-mlx-persist kept when it shipped a single patch."""
    out: list[list[Patch]] = []
    record = _record_path(spec, root)
    if record.is_file():
        try:
            data = json.loads(record.read_text())
            out.append([Patch.load(p["name"], p["patch"], p["sha256"]) for p in data["series"]])
        except (ValueError, KeyError, TypeError) as e:
            raise PatchError(f"{record} is unreadable ({e}); delete it and run again") from None
    for legacy in sorted((root / spec.package).glob(".applied-*.patch")):
        sums = legacy.with_suffix(".sha256")
        if sums.is_file():
            out.append([Patch.load(legacy.name, legacy.read_bytes().decode("utf-8"), sums.read_text())])
    return out


def _forget(spec: PatchSpec, root: Path) -> None:
    _record_path(spec, root).unlink(missing_ok=True)
    for legacy in (root / spec.package).glob(".applied-*.patch"):
        legacy.unlink(missing_ok=True)
        legacy.with_suffix(".sha256").unlink(missing_ok=True)


def _keep(spec: PatchSpec, root: Path, series: Sequence[Patch]) -> None:
    data = {"series": [{"name": p.name, "patch": p.text, "sha256": p.sums} for p in series]}
    _forget(spec, root)
    _write_atomic(_record_path(spec, root), json.dumps(data, indent=1) + "\n")


def _same(a: Sequence[Patch], b: Sequence[Patch]) -> bool:
    return [(p.name, p.text, p.sums) for p in a] == [(p.name, p.text, p.sums) for p in b]


# ---------------------------------------------------------------------------------------------
# The actions


def run_one(spec: PatchSpec, action: str, root: Path) -> int:
    name = f"{spec.dist} {spec.title}"
    version = installed_version(spec, root)
    if version != spec.version:
        raise PatchError(
            f"{spec.dist} {version or '(unknown version)'} found in {root}; this patch is for "
            f"{spec.dist} {spec.version} only (pip install --no-deps {spec.dist}=={spec.version})"
        )
    series = read_series(patches_dir() / spec.path)
    files = chains(series)

    # An older version applied (known from the copy apply kept): undo it first, if every file it
    # touched is in one of its states.
    older = [s for s in _recorded(spec, root) if not _same(s, series)]
    for old in older:
        old_files = chains(old)
        old_states = _states(root, old_files)
        if None in old_states.values() or not any(old_states.values()):
            continue
        if action == "check":
            print(f"not applied: an older version of the {name} is applied to {root}; "
                  f"run `vllm-mlx-persist patch` to update it")
            return 1
        _write(root, _plan(root, old_files, old_states, back=True))
        _forget(spec, root)
        print(f"reverted an older version of the {name} in {root}")
        break

    states = _states(root, files)
    modified = sorted(rel for rel, st in states.items() if st is None)
    if modified:
        msg = (
            f"{name}: {', '.join(modified)} in {root} match(es) no state of the series for "
            f"{spec.dist} {spec.version}; reinstall it (pip install --force-reinstall --no-deps "
            f"{spec.dist}=={spec.version}) and apply again. Nothing was changed."
        )
        if action == "check":
            print(f"not applied: {msg}")
            return 1
        raise PatchError(msg)

    done = [rel for rel, chain in files.items() if states[rel] == len(chain.diffs)]
    untouched = [rel for rel in files if states[rel] == 0]
    if action == "check":
        # dry runs: the series must also revert cleanly if applied, and apply cleanly if not
        if len(done) == len(files):
            _plan(root, files, states, back=True)
            print(f"applied: {name} is applied to {root}")
            return 0
        _plan(root, files, states, back=False)
        partly = " (partially: run `vllm-mlx-persist patch` to finish)" if len(untouched) < len(files) else ""
        print(f"not applied: {name} is not applied to {root}{partly}")
        return 1

    if action == "apply":
        todo = _plan(root, files, states, back=False)
        _write(root, todo)
        _keep(spec, root, series)
        n = f"{len(series)} patches" if len(series) > 1 else "1 patch"
        result = f"applied to {root} ({n}, {len(todo)} files)" if todo else f"already applied to {root}"
    else:
        todo = _plan(root, files, states, back=True)
        _write(root, todo)
        _forget(spec, root)
        result = f"reverted in {root} ({len(todo)} files)" if todo else f"already absent from {root}"
    print(f"{name} {result}")
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


def stat(specs: Sequence[PatchSpec] = PATCHES) -> int:
    """Print each patch of the series with the files it touches and its added/removed lines."""
    for spec in specs:
        series = read_series(patches_dir() / spec.path)
        print(f"{spec.dist} {spec.version} {spec.title} ({patches_dir() / spec.path}):")
        total_added = total_removed = 0
        for patch in series:
            added = sum(fd.added for fd in patch.diffs)
            removed = sum(fd.removed for fd in patch.diffs)
            total_added, total_removed = total_added + added, total_removed + removed
            print(f"  {patch.name:<44} {len(patch.diffs):>2} files  +{added:<4} -{removed}")
        files = len({fd.path for patch in series for fd in patch.diffs})
        print(f"  {'total':<44} {files:>2} files  +{total_added:<4} -{total_removed}")
    return 0


def record(path: Path, pristine_root: Path) -> None:
    """Write the `.sha256` manifests of a patch or series from a pristine tree (maintainers only)."""
    texts: dict[str, Optional[str]] = {}
    for patch_path in series_files(path):
        lines = ["# path  before-sha256  after-sha256  ('-' = file absent)"]
        for fd in parse_unified_diff(patch_path.read_bytes().decode("utf-8")):
            if fd.path not in texts:
                p = pristine_root / fd.path
                texts[fd.path] = p.read_bytes().decode("utf-8") if p.exists() else None
            before = texts[fd.path]
            after = apply_hunks(before, fd)
            if apply_hunks(after, fd, reverse=True) != before:
                raise PatchError(f"{patch_path.name}: {fd.path} does not revert to what it was")
            lines.append(f"{fd.path} {_text_sha256(before)} {_text_sha256(after)}")
            texts[fd.path] = after
        patch_path.with_suffix(".sha256").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "record":
        record(Path(sys.argv[2]), Path(sys.argv[3]))
    elif len(sys.argv) == 2 and sys.argv[1] in ("apply", "check", "revert"):
        sys.exit(run(sys.argv[1]))
    elif len(sys.argv) == 2 and sys.argv[1] == "stat":
        sys.exit(stat())
    else:
        sys.exit("usage: python -m vllm_mlx_persist.patcher apply|check|revert|stat|record PATH PRISTINE_ROOT")
