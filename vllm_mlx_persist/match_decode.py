"""Token ids -> text for matching by text: equal texts mean the model reads the same thing.

The pool serves a prompt as an agent's stored tokens when both decode to the same text (docs/design.md,
"Matching across re-tokenization"). A tokenizer's own `decode` is made for display and makes
different inputs look alike:

* `clean_up_tokenization_spaces` (set by every Llama 3.x config): `" ,"`, `" !"`, `" 's"` lose their
  space. transformers applies it in Python (to BPE models before 5.7, or when forced), and a
  WordPiece (or CTC) decoder has a `cleanup` of its own;
* bytes that are not UTF-8 decode to U+FFFD, the same as a real U+FFFD the client sent back;
* added and special tokens decode to their content, the same text as that content spelled in
  ordinary tokens, though the model reads a control token in one case and text in the other (and
  a ByteLevel decoder even turns a "Ġ" inside them into a space);
* SentencePiece-style decoders (Metaspace, Llama 2's Strip) drop the leading space of the first
  token, so "▁the" and "the" are alike at the start of what is decoded.

`MatchDecoder` decodes ordinary tokens with every clean-up off, each run after an anchor token (so
it reads as mid-sequence); renders each added token as a marker that no text can produce (NUL is
escaped in text); and makes a U+FFFD that is not at the very end unequal to anything (the text of
those bytes is unknown). A trailing U+FFFD stays: the next token may complete the character, and the
matcher never accepts a text that ends in one. Leading ones (the rest of a character cut where
decoding starts) are rendered by their token ids. Texts stay prefix-consistent as tokens are
appended, which the matcher's token-by-token search relies on.
"""

from __future__ import annotations

import itertools
import json
import logging
from typing import Any, Callable, Optional, Sequence

log = logging.getLogger("vllm_mlx_persist")

_ESC = "\x00"  # starts a marker; a NUL in decoded text is doubled
_FFFD = "\ufffd"
_ANCHORS = ("a", "x", "0", "the")


def _hf_tokenizer(tokenizer: Any) -> Any:
    """The transformers tokenizer (or tokenizers.Tokenizer) behind what vllm-mlx hands the backend."""
    try:
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        if isinstance(tokenizer, TokenizerWrapper):
            return tokenizer._tokenizer
    except ImportError:  # pragma: no cover - mlx-lm is a dependency of vllm-mlx
        pass
    if not hasattr(tokenizer, "backend_tokenizer") and hasattr(getattr(tokenizer, "tokenizer", None), "decode"):
        return tokenizer.tokenizer  # a processor (multimodal models)
    return tokenizer


def _clear_cleanup(node: Any) -> bool:
    """Set every `cleanup` in a decoder's JSON to false; whether there was one set."""
    found = False
    if isinstance(node, dict):
        if node.get("cleanup") is True:
            node["cleanup"], found = False, True
        for v in node.values():
            found = _clear_cleanup(v) or found
    elif isinstance(node, list):
        for v in node:
            found = _clear_cleanup(v) or found
    return found


def _raw_decoder(hf: Any) -> Callable[[list[int]], str]:
    """ids -> text with no clean-up and special tokens kept (the model's token texts, concatenated)."""
    from tokenizers import Tokenizer

    backend = hf if isinstance(hf, Tokenizer) else getattr(hf, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        decoder = backend.decoder
        if decoder is not None:
            state = json.loads(decoder.__getstate__())
            if _clear_cleanup(state):  # a private copy: the server's own decode stays as it is
                full = json.loads(backend.to_str())
                _clear_cleanup(full["decoder"])
                backend = Tokenizer.from_str(json.dumps(full))
        return lambda ids: backend.decode(ids, skip_special_tokens=False)
    return lambda ids: hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _added_ids(hf: Any) -> frozenset:
    table = getattr(hf, "added_tokens_decoder", None)
    if table is None and hasattr(hf, "get_added_tokens_decoder"):
        table = hf.get_added_tokens_decoder()
    return frozenset(int(i) for i in (table or {}))


class MatchDecoder:
    """Callable ids -> text, exact for matching (see the module docstring)."""

    def __init__(self, tokenizer: Any):
        hf = _hf_tokenizer(tokenizer)
        self._raw = _raw_decoder(hf)
        self._added = _added_ids(hf)
        self._nonce = itertools.count()
        self._anchor: Optional[int] = None
        self._anchor_text = ""
        encode = getattr(hf, "encode")
        for a in _ANCHORS:
            try:
                ids = encode(a, add_special_tokens=False)
            except Exception:  # noqa: BLE001 - any tokenizer oddity: try the next, or go without
                continue
            ids = getattr(ids, "ids", ids)
            if len(ids) != 1 or int(ids[0]) in self._added:
                continue
            text = self._raw([int(ids[0])])
            if text and self._raw([int(ids[0])] * 2).startswith(text):
                self._anchor, self._anchor_text = int(ids[0]), text
                break
        if self._anchor is None:
            log.warning("persist_q4: no anchor token for matching by text; a difference in the first "
                        "token of a decoded run may go unseen with this tokenizer's decoder")

    def __call__(self, ids: Sequence[int]) -> str:
        ids = [int(t) for t in ids]
        text = self._text(ids)
        if text.startswith(_FFFD) and len(text.rstrip(_FFFD)):
            # Bytes that continue a character begun before `ids` (the matcher decodes from a few
            # tokens before a difference, which may cut a character): rendered by their ids, so
            # they compare equal exactly when the tokens are the same.
            m = 1
            while m < len(ids) and self._text(ids[m:]).startswith(_FFFD):
                m += 1
            return f"{_ESC}#{','.join(map(str, ids[:m]))}{_ESC}" + self._seal(self._text(ids[m:]))
        return self._seal(text)

    def _text(self, ids: list[int]) -> str:
        """Ordinary runs and added-token markers, U+FFFD left as they are."""
        if not self._added.intersection(ids):
            text = self._run(ids)
        else:
            parts, run = [], []
            for t in ids:
                if t in self._added:
                    if run:
                        parts.append(self._run(run))
                        run = []
                    parts.append(f"{_ESC}{t}{_ESC}")
                else:
                    run.append(t)
            if run:
                parts.append(self._run(run))
            text = "".join(parts)
        return text

    def _run(self, ids: list[int]) -> str:
        """Text of ordinary tokens as read mid-sequence, NULs escaped."""
        if not ids:
            return ""
        if self._anchor is None:
            text = self._raw(ids)
        else:
            text = self._raw([self._anchor] + ids)
            if not text.startswith(self._anchor_text):
                return self._unique()
            text = text[len(self._anchor_text):]
        return text.replace(_ESC, _ESC + _ESC)

    def _seal(self, text: str) -> str:
        """Every U+FFFD before the trailing run becomes a marker equal to nothing else."""
        body = text.rstrip(_FFFD)
        if _FFFD not in body:
            return text
        return "".join(self._unique() if ch == _FFFD else ch for ch in body) + text[len(body):]

    def _unique(self) -> str:
        return f"{_ESC}?{next(self._nonce)}{_ESC}"
