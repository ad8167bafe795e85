"""Chained block ids and branches: pure functions and values, no state, any thread.

A block's id is `sha256(previous id || its token ids)`, the chain seeded with the model's fingerprint
and the agent's namespace, so blocks never match across models or agents. A `Branch` is one
continuation of an agent's history: its block ids, how many tokens they hold, and its `links`, where
the chain is (re-)seeded with a namespace (a fork starts on its parent's chain and continues on its
own), and when it was last used. Manifests (disk_format.Manifest) carry branches in the schema of
docs/disk-format.md. Two servers' branches of one agent are merged by recency (`merge_branches`).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from .disk_format import BlockData, Manifest
from .kv_edit.rotations import Segments, clip, decode, encode

Links = tuple[tuple[int, str], ...]


@dataclass
class Branch:
    """One continuation of an agent's history: a chain of block ids.

    `links` says how the chain is seeded: ((0, ns),) is an agent's own chain, seeded with its
    namespace. A fork is ((0, parent), (k, child)): blocks 0..k-1 are the parent's (the same ids,
    shared by reference) and block k's link is re-seeded with the child's namespace, so what the
    child adds can never collide with what the parent or a sibling adds after the same prefix.
    `last_used`: when a turn committed it or a lookup served from it (the pool's clock, seconds);
    it orders two servers' branches when their histories are merged (`merge_branches`).
    `rotations`: how many times its tokens' keys were rotated by splices (kv_edit/rotations.py; a spliced
    history's only). `generation`: 0 for a history every token of which was prefilled; g >= 1 for
    a spliced history (span directives), g being the most times any of its tokens' keys were
    rotated. Only amortize requests of the agent are served from a spliced branch, and its blocks
    from the first splice on chain from `namespace.spliced_seed(agent, g)`, apart from any honest id.
    `made`: when a commit last wrote the branch's content (None: at `last_used`, as a commit sets
    both); a lookup serving from the branch moves `last_used` only, so a use never makes content
    removed by a forget newer than its removal (`written`; docs/fleet.md, "The merge rules").
    `prompt`: how many of its tokens its last turn's request sent (the rest is the reply as generated;
    None: not known, e.g. read back from a manifest); in memory only, for the commit's choice of
    which branch goes beyond the bound (commit.py).
    A branch is never changed in place: a changed branch (even only its `last_used`) is a new Branch.
    """

    block_ids: list[str]
    n_tokens: int
    links: Links
    last_used: float = 0.0
    rotations: Segments = ()
    generation: int = 0
    made: Optional[float] = None
    prompt: Optional[int] = None

    @property
    def spliced(self) -> bool:
        return self.generation > 0

    @property
    def written(self) -> float:
        """When a commit last wrote its content (what removal records compare; never a lookup's use)."""
        return self.last_used if self.made is None else self.made

    def used(self, at: float) -> "Branch":
        """This branch served a lookup at `at`: more recently used, its content no newer."""
        return replace(self, last_used=at, made=self.written)


@dataclass(frozen=True)
class Removal:
    """Content a forget edit removed from an agent's history, kept in the agent's record so that no
    older copy of it (another server's, or Redis's) is merged back: every branch used at or before
    `at` that names `block` (the first block holding removed content), or whose block `index`
    follows `prev` (None: the first block) and begins with `tail` (set when `block` was a partial
    tail: a copy that grew it has another id), holds removed content and goes. `at`: the remover's
    clock, so a turn that sends the content again after the forget (a client's new history) stays."""

    block: str
    index: int
    prev: Optional[str]
    tail: tuple[int, ...]
    at: float

    def removes(self, br: Branch, tokens_of: Callable[[str], Optional[Sequence[int]]]) -> bool:
        """Whether `br` holds this removal's content (`tokens_of`: a block's tokens, None when not at
        hand: then only the id tells)."""
        if br.written > self.at:  # written after the removal: sent again (a use is no new content)
            return False
        if self.block in br.block_ids:
            return True
        i = self.index
        if not self.tail or len(br.block_ids) <= i or (br.block_ids[i - 1] if i else None) != self.prev:
            return False
        tokens = tokens_of(br.block_ids[i])
        return tokens is not None and tuple(int(t) for t in tokens[: len(self.tail)]) == self.tail

    def to_json(self) -> dict:
        return {"block": self.block, "index": self.index, "prev": self.prev, "tail": list(self.tail), "at": self.at}

    @classmethod
    def from_json(cls, d: dict) -> "Removal":
        return cls(d["block"], int(d["index"]), d.get("prev"), tuple(int(t) for t in d.get("tail", [])), float(d["at"]))


def removal_of(branch: Branch, i: int, tokens: Sequence[int], block_size: int, at: float) -> Removal:
    """The removal record of `branch`'s content from its block `i` on (`tokens`: that block's)."""
    tail = tuple(int(t) for t in tokens) if len(tokens) < block_size else ()
    return Removal(branch.block_ids[i], i, branch.block_ids[i - 1] if i else None, tail, at)


def merge_removals(a: Sequence[Removal], b: Sequence[Removal], limit: int, since: float) -> tuple[Removal, ...]:
    """Two agents' removal records as one: one per block (the latest), none from before `since`
    (expired), at most `limit` (the newest)."""
    by_block: dict[str, Removal] = {}
    for r in [*a, *b]:
        if r.at >= since and (r.block not in by_block or by_block[r.block].at < r.at):
            by_block[r.block] = r
    return tuple(sorted(by_block.values(), key=lambda r: r.at)[-limit:]) if limit > 0 else ()


def bound_removals(removals: Sequence[Removal], limit: int, since: float, floor: float,
                   ) -> tuple[tuple[Removal, ...], float]:
    """Removal records bounded without forgetting what they remove: one per block (the latest), at
    most `limit` (the newest), none from before `since`; the time of the newest one dropped raises the
    record's `floor` (returned), which removes from every other copy what it wrote at or before it
    and this record does not hold (`above_floor`). Records at or below the floor are implied by it."""
    every = merge_removals(removals, (), len(removals) + 1, float("-inf"))  # one per block, oldest first
    kept = [r for r in every if r.at >= since]
    kept = kept[-limit:] if limit > 0 else []
    floor = max([floor] + [r.at for r in every if r not in kept])
    return tuple(r for r in kept if r.at > floor), floor


def above_floor(branches: Sequence[Branch], floor: float, held: Sequence[Branch]) -> list[Branch]:
    """`branches` without those written at or before `floor` that no branch of `held` (those of the
    copy or copies whose floor it is: their branches hold nothing removed before it) holds as a prefix."""
    if floor <= 0:
        return list(branches)
    clean = [tuple(h.block_ids) for h in held]
    return [br for br in branches if br.written > floor
            or any(c[:len(br.block_ids)] == tuple(br.block_ids) for c in clean)]


def merge_records(branches: Sequence[Branch], mine: "Copy", theirs: "Copy", limit: int, since: float,
                  tokens_of: Callable[[str], Optional[Sequence[int]]],
                  ) -> tuple[list[Branch], tuple[Removal, ...], float, float]:
    """Two copies' removals applied to their merged `branches` (docs/fleet.md, "The merge rules"):
    every removal record of either (removals win over older content), spliced branches used before
    either's `spliced_cleared`, and the higher floor (a branch written before it that the copy with
    that floor does not hold goes); then the records bounded (`bound_removals`). Returns (branches,
    removals, spliced_cleared, floor)."""
    union = merge_removals(mine.removals, theirs.removals, len(mine.removals) + len(theirs.removals) + 1,
                           float("-inf"))
    cleared = max(mine.spliced_cleared, theirs.spliced_cleared)
    floor = max(mine.removed_floor, theirs.removed_floor)
    held = [br for c in (mine, theirs) if c.removed_floor >= floor for br in c.branches]
    kept = above_floor(surviving_removals(branches, union, cleared, tokens_of), floor, held)
    removals, floor = bound_removals(union, limit, since, floor)
    return kept, removals, cleared, floor


@dataclass(frozen=True)
class Copy:
    """Another copy of an agent's record (the fleet's, in Redis) to merge with this server's: its
    branches (least recently used first), removal records, spliced_cleared and settings (with when
    each was set: record_settings.py)."""

    branches: tuple[Branch, ...]
    removals: tuple[Removal, ...] = ()
    spliced_cleared: float = 0.0
    forkable: Optional[bool] = None
    settings_at: Optional[dict] = None
    removed_floor: float = 0.0  # what removal records compacted away removed (chain.bound_removals)
    pinned: Optional[bool] = None


def surviving_removals(branches: Sequence[Branch], removals: Sequence[Removal], spliced_cleared: float,
                       tokens_of: Callable[[str], Optional[Sequence[int]]]) -> list[Branch]:
    """`branches` without those holding removed content (`removals`), nor spliced ones used at or
    before `spliced_cleared` (a forget drops every spliced history: they copy the agent's content)."""
    return [br for br in branches
            if not (br.spliced and br.written <= spliced_cleared)
            and not any(r.removes(br, tokens_of) for r in removals)]


def chain_seed(fingerprint: str, namespace: str) -> str:
    """First link of an agent's block chain: blocks never match across agents or models."""
    return hashlib.sha256(f"{fingerprint}\n{namespace}".encode()).hexdigest()


def link_id(prev: Optional[str], fingerprint: str, namespace: str) -> str:
    """The chain's link into `namespace`: its seed at the start, else the previous id re-seeded."""
    seed = chain_seed(fingerprint, namespace)
    if prev is None:
        return seed
    return hashlib.sha256(bytes.fromhex(prev) + bytes.fromhex(seed)).hexdigest()


def block_id(prev_id: str, tokens: Sequence[int]) -> str:
    h = hashlib.sha256(bytes.fromhex(prev_id))
    h.update(np.asarray(tokens, dtype=np.int32).tobytes())
    return h.hexdigest()


def chain_prev(prev: Optional[str], i: int, at: dict, fingerprint: str) -> Optional[str]:
    """The id block i of a branch chains from: block i-1's id (`prev`), re-seeded where one of the
    branch's links (`at`: dict(links)) begins."""
    return link_id(prev, fingerprint, at[i]) if i in at else prev


def cut_branch(branch: Branch, i: int, block_size: int) -> Branch:
    """`branch` without block i and the blocks after it (a spliced branch keeps its generation: its
    blocks before the cut may already be spliced ones)."""
    n = min(branch.n_tokens, i * block_size)
    return Branch(branch.block_ids[:i], n, tuple(l for l in branch.links if l[0] < i) or branch.links[:1],
                  branch.last_used, clip(branch.rotations, n), branch.generation, branch.made)


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if tuple(a[:n]) == tuple(b[:n]):
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def common(a: Sequence[str], b: Sequence[str]) -> int:
    """How many leading ids two chains share."""
    i, n = 0, min(len(a), len(b))
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Chains:
    """Block ids of one model (fingerprint) and block size."""

    def __init__(self, fingerprint: str, block_size: int):
        self.fingerprint = fingerprint
        self.block_size = block_size

    def ids(self, links: Links, tokens: Sequence[int]) -> list[str]:
        """The block ids `tokens` get on a chain seeded by `links` (see Branch)."""
        out: list[str] = []
        at = dict(links)
        prev: Optional[str] = None
        for i, start in enumerate(range(0, len(tokens), self.block_size)):
            prev = chain_prev(prev, i, at, self.fingerprint)
            bid = block_id(prev, tokens[start : start + self.block_size])
            out.append(bid)
            prev = bid
        return out

    def walk(self, branch: Branch) -> Iterator[tuple[int, str, str]]:
        """(index, block id, the id it chains from) for each block of `branch`."""
        at = dict(branch.links)
        prev: Optional[str] = None
        for i, bid in enumerate(branch.block_ids):
            prev = chain_prev(prev, i, at, self.fingerprint)
            yield i, bid, prev
            prev = bid

    def follows(self, prev: Optional[str], bid: str, tokens: Sequence[int]) -> bool:
        """Whether a block holding `tokens` is block `bid` of a chain continuing from `prev`: a block
        written for another model or agent, or one whose tokens were altered, never is, even when
        its file (or Redis value) is sound."""
        return prev is not None and 0 < len(tokens) <= self.block_size and block_id(prev, tokens) == bid

    def continues(self, branch: Branch, tokens: Sequence[int]) -> bool:
        """Whether `tokens` continue `branch` (the branch then adds nothing to them)."""
        return (branch.n_tokens <= len(tokens)
                and self.ids(branch.links, tokens[: branch.n_tokens]) == branch.block_ids)

    def prefix(self, branch: Branch, fetched: dict[str, BlockData], held: Callable[[str], bool]) -> tuple[int, bool]:
        """How many leading blocks of `branch` (e.g. one fetched from the fleet) can be used, and
        whether the first that cannot was refused (its tokens do not follow the chain) rather than
        missing. `fetched`: block id -> BlockData, checked here; `held(bid)`: blocks already on the
        local disk, checked when read, as every disk block is."""
        for i, bid, prev in self.walk(branch):
            data = fetched.get(bid)
            if data is not None:
                if not self.follows(prev, bid, data.tokens):
                    return i, True
            elif not held(bid):
                return i, False
        return len(branch.block_ids), False

    def grew(self, c: Branch, b: Branch, tokens_of: Callable[[str], Optional[Sequence[int]]]) -> bool:
        """Whether `c` names `b`'s whole blocks and then a block beginning with `b`'s partial tail
        (another server grew that tail), as far as `tokens_of` (block id -> its tokens, None when
        not at hand: no read) shows; False when it cannot tell."""
        w = len(b.block_ids) - 1
        tail = b.n_tokens - w * self.block_size
        if w < 0 or not 0 < tail < self.block_size or len(c.block_ids) <= w or c.block_ids[:w] != b.block_ids[:w]:
            return False
        tokens = tokens_of(c.block_ids[w])
        if tokens is None or len(tokens) < tail:
            return False
        prev = chain_prev(b.block_ids[w - 1] if w else None, w, dict(b.links), self.fingerprint)
        return block_id(prev, tokens[:tail]) == b.block_ids[w]


def holds(c: Branch, b: Branch, grew: Optional[Callable[[Branch, Branch], bool]] = None) -> bool:
    """Whether branch `c` serves everything `b` does (so `b` adds nothing beside it): `c` has at
    least `b`'s tokens and names all of `b`'s blocks, or all but a partial tail that `grew(c, b)`
    shows `c` extends. Whole blocks alone are not enough: a branch shorter than one block would be
    'continued' by any longer branch."""
    if c.n_tokens < b.n_tokens:
        return False
    return c.block_ids[: len(b.block_ids)] == b.block_ids or (grew is not None and grew(c, b))


def merge_branches(mine: Sequence[Branch], theirs: Sequence[Branch], limit: int,
                   grew: Optional[Callable[[Branch, Branch], bool]] = None, continued: bool = True) -> list[Branch]:
    """Two lists of one agent's branches (e.g. this server's and another's, each least recently
    used first) as one, least recently used first: a branch that another holds (`holds`) goes, and
    the most recently used of those holding it counts as used when either was (as a lookup served
    from it would have been); of the rest the `limit` most recently used are kept, whichever list
    they came from. On equal `last_used` a branch of `theirs` counts as the more recent.
    `continued=False`: only a branch another equals goes (a model with bounded sliding windows
    keeps a continued branch as a place to resume, as its commits do). Honest and spliced branches
    are kept apart: neither ever holds the other, and `limit` bounds each (`limit_branches`). Pure."""
    def held(c: Branch, b: Branch) -> bool:
        if c.spliced != b.spliced:
            return False
        return holds(c, b, grew) if continued else (c.block_ids == b.block_ids and c.n_tokens == b.n_tokens)

    every = sorted([*mine, *theirs], key=lambda br: br.last_used)  # stable: ties keep mine first
    gone = [False] * len(every)
    for i, b in enumerate(every):  # least recent first: of two that hold each other, the older goes
        holders = [j for j, c in enumerate(every) if j != i and not gone[j] and held(c, b)]
        if not holders:
            continue
        gone[i] = True
        j = max(holders, key=lambda j: (every[j].last_used, j))
        if every[j].last_used < b.last_used:
            every[j] = every[j].used(b.last_used)
    kept = sorted((br for br, g in zip(every, gone) if not g), key=lambda br: br.last_used)
    return limit_branches(kept, limit)


def limit_branches(branches: Sequence[Branch], limit: int) -> list[Branch]:
    """The `limit` most recently used honest branches and the `limit` most recently used spliced ones
    (`branches` least recently used first; their order kept)."""
    honest = [i for i, br in enumerate(branches) if not br.spliced][-limit:] if limit > 0 else []
    spliced = [i for i, br in enumerate(branches) if br.spliced][-limit:] if limit > 0 else []
    keep = set(honest) | set(spliced)
    return [br for i, br in enumerate(branches) if i in keep]


def same_branches(a: Sequence[Branch], b: Sequence[Branch]) -> bool:
    """Whether two branch lists are equal, in order, last uses included."""
    return [(br.block_ids, br.n_tokens, br.links, br.last_used, br.rotations, br.generation, br.written)
            for br in a] == [(br.block_ids, br.n_tokens, br.links, br.last_used, br.rotations, br.generation,
                              br.written) for br in b]


def branches_of(m: Manifest) -> list[Branch]:
    """A manifest's branches, least recently used first (one plain chain when it lists none; none for
    a record that kept only removal records). A branch without `last_used` (a plain manifest's, or
    one written before it existed) counts as used when the manifest was written."""
    listed = m.branches if m.branches is not None else [{"block_ids": m.block_ids, "n_tokens": m.n_tokens}]
    return [branch_of(b, m.namespace, m.updated_at) for b in listed]


def branch_of(entry: dict, namespace: str, updated_at: float) -> Branch:
    """A Branch from a manifest's branch entry (disk or Redis; checked by disk_format.check_branches)."""
    return Branch(list(entry["block_ids"]), entry["n_tokens"],
                  tuple((int(i), ns) for i, ns in entry.get("links") or [(0, namespace)]),
                  float(entry.get("last_used", updated_at)), decode(entry.get("rotations", [])),
                  int(entry.get("generation", 0)),
                  None if entry.get("made") is None else float(entry["made"]))


def removals_of(m: Manifest) -> tuple[Removal, ...]:
    """A manifest's removal records (disk or Redis; checked by disk_format.check_removals)."""
    return tuple(Removal.from_json(r) for r in m.removals or ())


def manifest_of(namespace: str, branches: list[Branch], pinned: bool, now: Optional[float] = None, *,
                removals: Sequence[Removal] = (), spliced_cleared: float = 0.0,
                forkable: Optional[bool] = None, settings_at: Optional[dict] = None,
                removed_floor: float = 0.0) -> Manifest:
    """An agent's manifest: every block it names (newest branch first), its branches when they are
    more than one plain chain (so manifests of agents that never fork or branch read as before; such
    a branch's last use is then read back as `now`), and the record's other fields when set."""
    ids = list(dict.fromkeys(b for br in reversed(branches) for b in br.block_ids))
    plain = (len(branches) == 1 and branches[0].links == ((0, namespace),) and not branches[0].rotations
             and not branches[0].spliced and branches[0].written == branches[0].last_used)
    listed = None if plain else [
        {"block_ids": list(br.block_ids), "n_tokens": br.n_tokens, "links": [list(l) for l in br.links],
         "last_used": float(br.last_used), **({"rotations": encode(br.rotations)} if br.rotations else {}),
         **({"generation": br.generation} if br.generation else {}),
         **({"made": float(br.made)} if br.made is not None and br.made != br.last_used else {})}
        for br in branches]
    return Manifest(namespace, ids, branches[-1].n_tokens if branches else 0,
                    time.time() if now is None else now, pinned, branches=listed,
                    removals=[r.to_json() for r in removals] or None,
                    spliced_cleared=spliced_cleared or None, forkable=forkable,
                    settings_at=dict(settings_at) if settings_at else None, removed_floor=removed_floor or None)
