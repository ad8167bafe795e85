"""Held-out text of several kinds for `quality --model DIR --text KIND` (issue #50, item 3).

Every kind is read from files that ship with CPython itself (no download, no data set), in a pinned
order, and none of them is the text auto calibrates or measures on (`key_calibration.CALIBRATION_TEXT`,
`MEASURE_TEXT`; `overlap` checks it):

- topics: CPython's language reference topics (`pydoc_data.topics`), the text measured before
  `--text` existed (English prose with grammar and code), the default;
- prose: IDLE's user guide (`idlelib/help.html`, its main section stripped of markup); where a
  Python ships without idlelib (Debian's python3 puts it in another package) CPython's `LICENSE.txt`
  (the software's history and its licenses); the report names the file read and its sha256;
- code: stdlib Python source, `CODE_FILES` in order (a missing file is skipped and named);
- chat: a multi-turn transcript of questions about the language answered from the reference
  topics (`CHAT_TOPICS`), rendered with the model's chat template when it has one, else as a
  plain "User:"/"Assistant:" transcript (a base model).

Files differ between Python versions, so a report carries the text's sha256 and its sources.
"""

from __future__ import annotations

import hashlib
import json
import re
import sysconfig
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Sequence

import numpy as np

TEXT_KINDS = ("topics", "prose", "code", "chat")
DEFAULT_KIND = "topics"
PROSE_FILES = ("idlelib/help.html", "LICENSE.txt")  # the first present is read
CODE_FILES = ("textwrap.py", "shlex.py", "queue.py", "sched.py", "graphlib.py", "fnmatch.py", "getopt.py",
              "string.py")
# The reference topics the chat transcript asks about, in order (sorted: every topic present).
CHAT_TOPICS = ("if", "while", "for", "try", "with", "function", "class", "assert", "pass", "del", "return",
               "yield", "raise", "break", "continue", "import", "global", "nonlocal", "lambda", "assignment",
               "augassign", "booleans", "comparisons", "calls", "slicings", "truth", "exceptions", "naming",
               "dict", "lists", "strings", "integers", "floating", "context-managers", "execmodel")


class HeldOutError(ValueError):
    """No file of a text kind could be read."""


@dataclass
class HeldOut:
    """One held-out text as the model reads it: its token ids (no BOS: `windows` adds one per window
    where the tokenizer starts sequences with it), where it came from, and what it hashes to."""

    kind: str
    description: str
    ids: list[int]
    sha256: str
    sources: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {"kind": self.kind, "description": self.description, "tokens": len(self.ids),
                "sha256": self.sha256, "sources": self.sources, "notes": self.notes}


def stdlib_dir() -> Path:
    """Where this Python's standard library lives (its .py files and data)."""
    return Path(sysconfig.get_paths()["stdlib"])


def topics_text() -> str:
    """CPython's language reference topics, in sorted order (what `quality --model` always read)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


class _HelpHTML(HTMLParser):
    """The main section of Sphinx's help.html as plain paragraphs (IDLE's own help.py reads the
    same section: from <section id="idle"> to the <div class="clearer">), header links dropped."""

    BLOCKS = {"p", "li", "dt", "dd", "h1", "h2", "h3", "pre", "tr"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.show = False
        self.pre = False
        self.link = False
        self.out: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "section" and a.get("id") == "idle":
            self.show = True
        elif tag == "div" and a.get("class") == "clearer":
            self.show = False
        elif tag == "a" and a.get("class") == "headerlink":
            self.link = True
        if tag == "pre":
            self.pre = True
        if tag in self.BLOCKS:
            self.out.append("\n\n")

    def handle_endtag(self, tag: str) -> None:
        if tag == "a":
            self.link = False
        elif tag == "pre":
            self.pre = False

    def handle_data(self, data: str) -> None:
        if self.show and not self.link:
            self.out.append(data if self.pre else re.sub(r"\s+", " ", data))


def help_html_text(html: str) -> str:
    p = _HelpHTML()
    p.feed(html)
    paras = [re.sub(r"[ \t]+\n", "\n", s).strip("\n").rstrip() for s in "".join(p.out).split("\n\n")]
    return "\n\n".join(s.strip() if "\n" not in s else s for s in paras if s.strip())


def prose_text(root: Path | None = None) -> tuple[str, list[str], list[str]]:
    """(text, sources, notes): the first of PROSE_FILES this Python has, as plain text."""
    root = stdlib_dir() if root is None else root
    notes = []
    for name in PROSE_FILES:
        path = root / name
        try:
            raw = path.read_text(encoding="utf-8")
        except OSError:
            notes.append(f"{name} not found under {root}")
            continue
        text = help_html_text(raw) if name.endswith(".html") else raw
        if text.strip():
            return text, [name], notes
        notes.append(f"{name} holds no text")
    raise HeldOutError(f"no prose file found under {root}: {', '.join(PROSE_FILES)}")


def code_text(root: Path | None = None) -> tuple[str, list[str], list[str]]:
    """(text, sources, notes): CODE_FILES' source in order, each file as it is; missing ones named."""
    root = stdlib_dir() if root is None else root
    parts, sources, notes = [], [], []
    for name in CODE_FILES:
        try:
            parts.append((root / name).read_text(encoding="utf-8"))
            sources.append(name)
        except OSError:
            notes.append(f"{name} not found under {root}: skipped")
    if not parts:
        raise HeldOutError(f"no stdlib source found under {root}: {', '.join(CODE_FILES)}")
    return "\n\n".join(parts), sources, notes


def _title_and_paragraphs(topic: str) -> tuple[str, list[str]]:
    """A reference topic's title and its prose paragraphs (grammar, code and lists left out)."""
    lines = topic.split("\n")
    title = lines[0].strip()
    paras = []
    for block in "\n".join(lines[2:]).split("\n\n"):
        b = block.strip("\n")
        if not b.strip() or b.startswith(" ") or b.lstrip()[:1] in "*-0123456789" or "::=" in b:
            continue
        paras.append(" ".join(b.split()))
    return title, paras


def chat_messages(topics: dict[str, str] | None = None) -> list[dict[str, str]]:
    """A multi-turn conversation: per CHAT_TOPICS topic, a user's question made from its title and
    an assistant's answer, the topic's first prose paragraphs (up to ~600 characters); a
    follow-up question where the topic has more."""
    if topics is None:
        from pydoc_data.topics import topics
    msgs = []
    for key in CHAT_TOPICS:
        if key not in topics:
            continue
        title, paras = _title_and_paragraphs(topics[key])
        if not paras:
            continue
        subject = title[0].lower() + title[1:] if title[:2] != title[:2].upper() else title
        answer, rest = paras[0], paras[1:]
        while rest and len(answer) < 600:
            answer += " " + rest.pop(0)
        msgs += [{"role": "user", "content": f"Can you explain {subject} in Python?"},
                 {"role": "assistant", "content": answer}]
        if rest:
            msgs += [{"role": "user", "content": "Tell me more about that."},
                     {"role": "assistant", "content": " ".join(rest[:2])}]
    return msgs


def plain_transcript(msgs: Sequence[dict[str, str]]) -> str:
    return "\n\n".join(f"{'User' if m['role'] == 'user' else 'Assistant'}: {m['content']}" for m in msgs)


def _ids(x: Any) -> list[int]:
    return [int(t) for t in getattr(x, "ids", x)]


def bos_id(tokenizer: Any, model_dir: str | Path | None = None) -> int | None:
    """The BOS id when the tokenizer starts every sequence with it, or the model's
    tokenizer_config.json says to (`add_bos_token`: Gemma 3 needs it, and a tokenizer may not
    apply it), else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = _ids(tokenizer.encode("Hello"))
    if ids and ids[0] == bos:
        return int(bos)
    if model_dir is not None:
        try:
            config = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            config = {}
        if config.get("add_bos_token") is True:
            return int(bos)
    return None


def _strip_bos(ids: list[int], bos: int | None) -> list[int]:
    return ids[1:] if bos is not None and ids[:1] == [bos] else ids


def load(kind: str, tokenizer: Any, model_dir: str | Path | None = None) -> HeldOut:
    """The held-out text `kind` (TEXT_KINDS) in `tokenizer`'s ids, a leading BOS left off."""
    if kind not in TEXT_KINDS:
        raise HeldOutError(f"unknown text kind {kind!r} (one of {', '.join(TEXT_KINDS)})")
    bos = bos_id(tokenizer, model_dir)
    notes: list[str] = []
    if kind == "topics":
        text, sources = topics_text(), ["pydoc_data/topics.py"]
        desc = "pydoc_data.topics (CPython language reference), sorted topics"
    elif kind == "prose":
        text, sources, notes = prose_text()
        desc = ("IDLE's user guide (idlelib/help.html, markup stripped)" if sources[0].endswith(".html")
                else f"CPython's {sources[0]} (history and licenses)")
    elif kind == "code":
        text, sources, notes = code_text()
        desc = f"stdlib Python source ({', '.join(sources)})"
    else:
        msgs = chat_messages()
        sources = ["pydoc_data/topics.py"]
        template = getattr(tokenizer, "chat_template", None)
        if template:
            ids = _ids(tokenizer.apply_chat_template(msgs, tokenize=True))
            text = tokenizer.apply_chat_template(msgs, tokenize=False)
            desc = f"a {len(msgs)}-message chat about the reference topics, in the model's chat template"
        else:
            text = plain_transcript(msgs)
            ids = _ids(tokenizer.encode(text))
            desc = f"a {len(msgs)}-message chat about the reference topics, as a plain User:/Assistant: transcript"
            notes.append("the model has no chat template")
        return HeldOut(kind, desc, _strip_bos(ids, bos), hashlib.sha256(text.encode()).hexdigest(), sources, notes)
    ids = _strip_bos(_ids(tokenizer.encode(text)), bos)
    return HeldOut(kind, desc, ids, hashlib.sha256(text.encode()).hexdigest(), sources, notes)


def windows(ids: Sequence[int], n: int, window: int, skip: int = 0, bos: int | None = None) -> np.ndarray:
    """Up to `n` consecutive windows of `window` tokens from ids[skip:], (n', window); with `bos`,
    each window is BOS and then window - 1 tokens (every window is a sequence of its own)."""
    body = window - (bos is not None)
    rest = np.asarray(ids[skip:], dtype=np.int64)
    m = min(n, len(rest) // body)
    if m < 1:
        raise HeldOutError(f"the text has {len(rest)} tokens after skipping {skip}: too few for a window of {window}")
    w = rest[: m * body].reshape(m, body)
    return np.concatenate([np.full((m, 1), bos, dtype=np.int64), w], axis=1) if bos is not None else w


def overlap(text: str, others: Sequence[str], n: int = 8) -> list[str]:
    """The runs of `n` words `text` shares with any of `others` (a held-out text shares none with
    what calibration reads)."""
    def grams(s: str) -> set[tuple[str, ...]]:
        w = re.findall(r"\w+", s.lower())
        return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}

    seen = set().union(*(grams(o) for o in others))
    return sorted(" ".join(g) for g in grams(text) & seen)


def raw_text(kind: str) -> str:
    """The text of `kind` before tokenizing (chat: the plain transcript), for `overlap`."""
    if kind == "topics":
        return topics_text()
    if kind == "prose":
        return prose_text()[0]
    if kind == "code":
        return code_text()[0]
    return plain_transcript(chat_messages())
