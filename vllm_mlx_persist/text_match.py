"""Matching across re-tokenization: where a stored token run and a prompt decode to the same text again.

Pure (the decode function is the tokenizer's); the pool's lookup calls it on the worker thread.
"""

from __future__ import annotations

from typing import Callable, Optional

TEXT_MATCH_WINDOW = 256  # tokens past a mismatch searched for the same text
TEXT_MATCH_MAX_REALIGN = 4  # mismatches matched by text per lookup, at most
TEXT_MATCH_CONTEXT = 8  # tokens decoded before the mismatch, so both sides decode in the same context


def align(stored: list[int], prompt: list[int], k: int,
          decode: Callable[[list[int]], str]) -> Optional[tuple[int, int]]:
    """Where `stored` and `prompt` (equal before `k`, different at `k`) decode to the same text
    again: (i, j) with decode(stored[:k+i]) == decode(prompt[:k+j]), or None.

    Preferred: the first such point where the tokens agree again (the walk then goes on); else the
    furthest one into `stored` (the stored run is used up to there). Both texts are grown token by
    token, the shorter first, and the search stops as soon as one is no longer a prefix of the
    other, so a real difference costs a couple of decodes. Decoding starts a few tokens before `k`,
    so both sides see the same left context (leading-space rules); a text ending in an incomplete
    character (U+FFFD) never counts as equal.
    """
    c = max(0, k - TEXT_MATCH_CONTEXT)
    max_i = min(TEXT_MATCH_WINDOW, len(stored) - k)
    max_j = min(TEXT_MATCH_WINDOW, len(prompt) - k - 1)  # the prompt's last token is never matched
    i = j = 1
    if max_i < 1 or max_j < 1:
        return None
    ts, tp = decode(stored[c : k + i]), decode(prompt[c : k + j])
    furthest = None
    while True:
        if ts == tp and not ts.endswith("\ufffd"):
            if k + i < len(stored) and stored[k + i] == prompt[k + j]:
                return i, j
            furthest = (i, j)
            if i == max_i or j == max_j:
                return furthest
            i, j = i + 1, j + 1
            ts, tp = decode(stored[c : k + i]), decode(prompt[c : k + j])
            continue
        short, long_ = (ts, tp) if len(ts) <= len(tp) else (tp, ts)
        if not long_.startswith(short.rstrip("\ufffd")):
            return furthest  # the texts differ for good
        if len(ts) <= len(tp) and i < max_i:
            i += 1
            ts = decode(stored[c : k + i])
        elif len(tp) < len(ts) and j < max_j:
            j += 1
            tp = decode(prompt[c : k + j])
        else:
            return furthest
