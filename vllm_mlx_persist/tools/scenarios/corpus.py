"""Deterministic English text built from local files: the docstrings of CPython standard library
modules (present wherever Python is), so scenarios need no hub and no network.

The same module and word count give the same text on one Python version; the standard library's
docstrings change a little between versions, so the exact text (and token counts) may too.
"""

from __future__ import annotations

import ast
import functools
import sysconfig
from pathlib import Path


class CorpusError(ValueError):
    """A text that cannot be built (unknown module, no docstrings)."""


def module_path(module: str) -> Path:
    """Source file of a pure-Python standard library module or package, e.g. "json.decoder"."""
    if not module or not all(part.isidentifier() for part in module.split(".")):
        raise CorpusError(f"not a module name: {module!r}")
    root = Path(sysconfig.get_paths()["stdlib"])
    base = root.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    raise CorpusError(f"standard library module {module!r} has no Python source under {root}")


@functools.lru_cache(maxsize=64)
def docstring_words(module: str) -> tuple[str, ...]:
    """Words of every docstring in `module`'s source (module, classes, functions), in file order."""
    tree = ast.parse(module_path(module).read_text(encoding="utf-8", errors="replace"))
    nodes = [tree] + [n for n in ast.walk(tree)
                      if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    words: list[str] = []
    for node in nodes:
        doc = ast.get_docstring(node, clean=True)
        if doc:
            words.extend(doc.split())
    if not words:
        raise CorpusError(f"standard library module {module!r} has no docstrings")
    return tuple(words)


def document(modules: list[str], words: int) -> str:
    """`words` words from the docstrings of `modules` (concatenated, repeated if too short)."""
    if words < 1:
        raise CorpusError(f"a document needs at least one word, got {words}")
    pool: list[str] = []
    for m in modules:
        pool.extend(docstring_words(m))
    out = [pool[i % len(pool)] for i in range(words)]
    # A paragraph break every 60 words keeps the text readable in transcripts.
    return "\n\n".join(" ".join(out[i:i + 60]) for i in range(0, len(out), 60))
