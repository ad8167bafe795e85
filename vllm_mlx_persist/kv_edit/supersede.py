"""Which stored history a `forget` edit supersedes (span directives, issue #21). Pure functions.

A lookup walks the branch that best matches the edited prompt and stops where they differ. The
edit point e is where the prompt and that branch's tokens first disagree (or where the prompt ends
inside the branch: a truncation). When the branch goes on past e, everything it holds from e on
is content the client removed; the block holding token e is the first to hold any of it. Block
ids are chained, so every branch naming that block holds the same tokens up to its end, the start
of the removed content included: those are the branches a forget drops. Branches the prompt
matches exactly as far (a tie: the lookup cannot tell which one the client edited) go the same way.
Blocks before the edit point keep their ids and stay.
"""

from __future__ import annotations

from typing import Collection, Optional, Sequence

from ..chain import Branch, lcp


def edit_point(used_tokens: Sequence[Sequence[int]], prompt: Sequence[int]) -> int:
    """Where `prompt` first differs from the blocks a lookup walked (their whole token runs, in
    order), or ends inside them."""
    start = 0
    for tokens in used_tokens:
        k = lcp(tokens, prompt[start:start + len(tokens)])
        if k < len(tokens):
            return start + k
        start += len(tokens)
    return start


def superseded_block(branch: Branch, point: int, block_size: int) -> Optional[str]:
    """The first block of `branch` holding content past `point`, or None when the branch ends at or
    before it (the prompt extends the branch: nothing is superseded)."""
    if point >= branch.n_tokens:
        return None
    return branch.block_ids[point // block_size]


def surviving(branches: Sequence[Branch], block_ids: Collection[str]) -> list[Branch]:
    """`branches` without those naming any of `block_ids` (in order)."""
    return [br for br in branches if not any(b in block_ids for b in br.block_ids)]
