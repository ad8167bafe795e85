"""How many times each token of a spliced history had its keys rotated (issue #21): pure, no state.

A splice moves a stored run's keys by Δ (dequantize, rotate, requantize: each time adds 4-bit error),
so `kv_edit.max_rotations` caps the rotations any token may have had. Counts are kept per token, as
`Segments`: sorted, disjoint (start, end, count) token ranges with count >= 1; a token in none has
count 0 (prefilled, never moved). A branch records its segments (chain.Branch.rotations, the manifest's
`rotations`); a spliced history's namespace generation is the highest count it holds.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

Segments = tuple[tuple[int, int, int], ...]


def normalize(segments: Iterable[tuple[int, int, int]]) -> Segments:
    """Sorted segments, empty and zero-count ones dropped, touching equal counts joined. The input
    must not overlap."""
    out: list[tuple[int, int, int]] = []
    for s, e, c in sorted(segments):
        if e <= s or c <= 0:
            continue
        if out and out[-1][1] == s and out[-1][2] == c:
            out[-1] = (out[-1][0], e, c)
        else:
            out.append((s, e, c))
    return tuple(out)


def clip(segments: Segments, end: int) -> Segments:
    """The counts of tokens [0, end)."""
    return tuple((s, min(e, end), c) for s, e, c in segments if s < end)


def counts(segments: Segments, start: int, end: int) -> list[int]:
    """The count of each token in [start, end)."""
    out = [0] * max(0, end - start)
    for s, e, c in segments:
        for t in range(max(s, start), min(e, end)):
            out[t - start] = c
    return out


def peak(segments: Segments) -> int:
    """The highest count (0: nothing was ever rotated)."""
    return max((c for _, _, c in segments), default=0)


def moved(segments: Segments, src: int, n: int, at: int, delta: int) -> Segments:
    """The counts of stored tokens [src, src+n) once moved to [at, at+n): one more rotation each,
    unless Δ = 0 (nothing is requantized then)."""
    bump = 1 if delta else 0
    cs = counts(segments, src, src + n)
    return normalize((at + i, at + i + 1, c + bump) for i, c in enumerate(cs))


def pieces(segments: Segments, src: int, n: int, cap: int, min_run: int) -> list[tuple[int, int]]:
    """(offset, length) of the stretches of stored tokens [src, src+n) that may be rotated once more
    (count < cap), at least `min_run` long; the rest is re-prefilled."""
    out, begin = [], None
    for i, c in enumerate(counts(segments, src, src + n) + [cap]):
        if c < cap and begin is None:
            begin = i
        elif c >= cap and begin is not None:
            if i - begin >= min_run:
                out.append((begin, i - begin))
            begin = None
    return out


def encode(segments: Segments) -> list[list[int]]:
    """The manifest's form: [[start, end, count], ...]."""
    return [[s, e, c] for s, e, c in segments]


def decode(value: Any) -> Segments:
    """Segments from the manifest's form (checked by disk_format.check_branches)."""
    return tuple((int(s), int(e), int(c)) for s, e, c in value)


def legacy(generation: int, first_spliced: Optional[int], n_tokens: int) -> Segments:
    """Counts of a spliced branch that records none (written before they were kept): every token from
    its first spliced block on counted at the namespace's generation, as that version assumed."""
    if not generation or first_spliced is None or first_spliced >= n_tokens:
        return ()
    return ((first_spliced, n_tokens, generation),)


def split_run(segments: Segments, src: int, n: int, cap: int, min_run: int,
              ) -> tuple[list[tuple[int, int]], int]:
    """`pieces` and the number of the run's tokens they leave out (those that reached `cap`, and
    stretches between them shorter than `min_run`)."""
    got = pieces(segments, src, n, cap, min_run)
    return got, n - sum(k for _, k in got)
