"""The patcher: apply/check/revert the vllm-mlx seam on a copy of the installed package, and the
pure-Python unified-diff applier on a toy package (new files, versions of a patch, edge cases)."""

from __future__ import annotations

import difflib
import hashlib
import py_compile
import shutil
from pathlib import Path

import pytest

from vllm_mlx_persist import patcher

SPEC = patcher.VLLM_MLX
ABSENT = patcher.ABSENT


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else ABSENT


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def manifest() -> dict[str, tuple[str, str]]:
    sums = patcher.patches_dir() / SPEC.file.replace(".patch", ".sha256")
    return patcher.parse_manifest(sums.read_text())


@pytest.fixture
def site(tmp_path) -> Path:
    """A pristine copy of the installed vllm_mlx (+ dist-info) in a fake site-packages."""
    root = patcher.find_root(SPEC)
    dst = tmp_path / "site-packages"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(root / SPEC.package, dst / SPEC.package, ignore=ignore)
    for info in root.glob("vllm_mlx-*.dist-info"):
        shutil.copytree(info, dst / info.name)
    # the installed copy may already be patched (./dev applies it): revert the copy first
    assert patcher.run("revert", dst, specs=[SPEC]) == 0
    return dst


def run(action: str, root: Path, capsys) -> tuple[int, str]:
    rc = patcher.run(action, root, specs=[SPEC])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_apply_check_revert_roundtrip(site, manifest, capsys):
    capsys.readouterr()
    assert {rel: sha(site / rel) for rel in manifest} == {rel: p for rel, (p, _) in manifest.items()}
    assert run("check", site, capsys) == (1, f"not applied: vllm-mlx cache-backend seam is not applied to {site}\n")

    pyc = site / "vllm_mlx" / "__pycache__" / "scheduler.cpython-311.pyc"
    pyc.parent.mkdir(exist_ok=True)
    pyc.write_bytes(b"stale")
    rc, out = run("apply", site, capsys)
    assert rc == 0 and "applied to" in out, out
    assert not pyc.exists()
    assert {rel: sha(site / rel) for rel in manifest} == {rel: q for rel, (_, q) in manifest.items()}
    for rel in manifest:
        py_compile.compile(str(site / rel), cfile=str(site / "compiled.pyc"), doraise=True)

    rc, out = run("check", site, capsys)
    assert rc == 0 and out.startswith("applied:") and out.count("\n") == 1, out
    rc, out = run("apply", site, capsys)
    assert rc == 0 and "already applied" in out, out

    rc, out = run("revert", site, capsys)
    assert rc == 0 and "reverted in" in out, out
    rc, out = run("check", site, capsys)
    assert rc == 1 and out.startswith("not applied:"), out
    assert {rel: sha(site / rel) for rel in manifest} == {rel: p for rel, (p, _) in manifest.items()}
    assert not list((site / "vllm_mlx").glob(".applied-*")), "the copy of the applied patch was left behind"
    rc, out = run("revert", site, capsys)
    assert rc == 0 and "already absent" in out, out


@pytest.mark.parametrize("start", ["pristine", "patched"])
def test_hand_edited_file_is_refused_untouched(site, start, capsys):
    if start == "patched":
        assert patcher.run("apply", site, specs=[SPEC]) == 0
    server = site / "vllm_mlx" / "server.py"
    server.write_text(server.read_text() + "# local edit\n")
    before = snapshot(site)
    for action in ("apply", "revert"):
        rc, out = run(action, site, capsys)
        assert rc != 0 and "vllm_mlx/server.py" in out and "Nothing was changed" in out, out
    rc, out = run("check", site, capsys)
    assert rc == 1 and out.startswith("not applied:") and "vllm_mlx/server.py" in out, out
    assert snapshot(site) == before


def test_interrupted_or_reinstalled_tree_is_finished(site, manifest, capsys):
    pristine_scheduler = (site / "vllm_mlx" / "scheduler.py").read_bytes()
    assert patcher.run("apply", site, specs=[SPEC]) == 0
    (site / "vllm_mlx" / "scheduler.py").write_bytes(pristine_scheduler)  # like a pip reinstall
    rc, out = run("check", site, capsys)
    assert rc == 1 and "partially" in out, out
    rc, out = run("apply", site, capsys)
    assert rc == 0 and "(1 files)" in out, out
    assert run("check", site, capsys)[0] == 0


def test_wrong_version_is_refused(site, capsys):
    for meta in site.glob("vllm_mlx-*.dist-info/METADATA"):
        meta.write_text(meta.read_text().replace("Version: 0.6.0", "Version: 0.5.1"))
    before = snapshot(site)
    rc, out = run("apply", site, capsys)
    assert rc != 0 and "0.5.1" in out and "0.6.0" in out, out
    assert snapshot(site) == before


def test_version_from_init_without_metadata(site, capsys):
    for info in site.glob("vllm_mlx-*.dist-info"):
        shutil.rmtree(info)
    assert run("apply", site, capsys)[0] == 0
    init = site / "vllm_mlx" / "__init__.py"
    init.write_text(init.read_text().replace('__version__ = "0.6.0"', '__version__ = "0.7.0"'))
    rc, out = run("check", site, capsys)
    assert rc == 2 and "0.7.0" in out and "0.6.0" in out, out


# --- the applier itself, on a toy package -----------------------------------------------------

TOY = patcher.PatchSpec(dist="toypkg", package="toypkg", version="1.0", file="toy-1.0.patch", title="toy seam")


def udiff(rel: str, old: str | None, new: str | None) -> str:
    a = "/dev/null" if old is None else f"a/{rel}"
    b = "/dev/null" if new is None else f"b/{rel}"
    lines = difflib.unified_diff(
        (old or "").splitlines(keepends=True), (new or "").splitlines(keepends=True), a, b
    )
    out = "".join(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in lines)
    return f"diff --git a/{rel} b/{rel}\n" + out


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """A toy site-packages with `toypkg` 1.0, a patches dir, and a writer for patch versions."""
    site = tmp_path / "site"
    (site / "toypkg").mkdir(parents=True)
    pristine = {
        "toypkg/__init__.py": '__version__ = "1.0"\n',
        "toypkg/core.py": "".join(f"line {i}\n" for i in range(40)) + "last line, no newline",
    }
    for rel, text in pristine.items():
        (site / rel).write_text(text)
    pristine_copy = tmp_path / "pristine"
    shutil.copytree(site, pristine_copy)
    patches = tmp_path / "patches"
    patches.mkdir()
    monkeypatch.setattr(patcher, "patches_dir", lambda: patches)

    def write_patch(core: str, new_module: str | None) -> None:
        text = udiff("toypkg/core.py", pristine["toypkg/core.py"], core)
        if new_module is not None:
            text += udiff("toypkg/plugins.py", None, new_module)
        (patches / TOY.file).write_text(text)
        patcher.record(patches / TOY.file, pristine_copy)

    return site, pristine, write_patch


def test_toy_new_files_no_newline_and_upgrade(toy, capsys):
    site, pristine, write_patch = toy
    core = pristine["toypkg/core.py"]
    v1 = core.replace("line 3\n", "line 3\nadded in v1\n").replace("no newline", "no newline!")
    write_patch(v1, "HOOKS = 1\n")
    assert patcher.run("apply", site, specs=[TOY]) == 0
    assert (site / "toypkg/core.py").read_text() == v1
    assert (site / "toypkg/plugins.py").read_text() == "HOOKS = 1\n"

    # a newer version of the patch: the copy kept at apply time undoes v1 first
    v2 = core.replace("line 30\n", "changed in v2\n")
    write_patch(v2, "HOOKS = 2\n")
    capsys.readouterr()
    assert patcher.run("check", site, specs=[TOY]) == 1
    assert "older version" in capsys.readouterr().out
    assert patcher.run("apply", site, specs=[TOY]) == 0
    assert (site / "toypkg/core.py").read_text() == v2
    assert (site / "toypkg/plugins.py").read_text() == "HOOKS = 2\n"
    assert patcher.run("check", site, specs=[TOY]) == 0

    assert patcher.run("revert", site, specs=[TOY]) == 0
    assert (site / "toypkg/core.py").read_text() == core
    assert not (site / "toypkg/plugins.py").exists()
    assert sorted(p.name for p in (site / "toypkg").iterdir()) == ["__init__.py", "core.py"]


def test_toy_context_must_match_exactly(toy):
    site, pristine, write_patch = toy
    write_patch(pristine["toypkg/core.py"].replace("line 20\n", "LINE 20\n"), None)
    fd = patcher.parse_unified_diff((patcher.patches_dir() / TOY.file).read_text())[0]
    shifted = "extra first line\n" + pristine["toypkg/core.py"]
    with pytest.raises(patcher.PatchError, match="does not match"):
        patcher.apply_hunks(shifted, fd)  # same context one line lower: no offsets, no fuzz
    with pytest.raises(patcher.PatchError, match="does not match"):
        patcher.apply_hunks(pristine["toypkg/core.py"].replace("line 18\n", "line 18 \n"), fd)
    assert patcher.apply_hunks(pristine["toypkg/core.py"], fd).count("LINE 20\n") == 1
