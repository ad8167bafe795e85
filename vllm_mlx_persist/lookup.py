"""The lookup: the longest reusable prefix of a prompt among an agent's branches (and its fork parent's).

Owns nothing. It reads the block table in short steps under the pool's lock, and waits for disk
reads, checks what it read and imports it into MLX with the lock released, so an erasure, a
read-ahead or a stats call on another thread never waits behind a disk. Every block it uses is held
by reference (`Used.layers`) from the moment it is found, so nothing evicted meanwhile can take a
block away from the cache it builds. Worker thread only (it does MLX work).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from .agents import Agents
from .blocks import Agent, Block, BlockState, BlockTable, Run
from .caches import ModelCodec
from .caches.codec import WIN_FROM
from .chain import Branch, Chains, common, lcp
from .disk_format import BlockData
from .reads import Reads, read_result
from .text_match import TEXT_MATCH_MAX_REALIGN, TEXT_MATCH_WINDOW, align

log = logging.getLogger("vllm_mlx_persist.pool")


@dataclass
class Match:
    """What a lookup found: the cache, the tokens it covers, where from, and (when the prompt was
    matched by text across a re-tokenization) the prompt as the tokens the cache holds."""

    cache: Optional[list]
    num_tokens: int
    tier: str
    prompt: Optional[list[int]] = None  # replacement prompt tokens, or None when unchanged
    forked: bool = False  # the prefix came from the fork parent
    superseded: int = 0  # with a forget edit: the agent's branches the turn's commit drops
    stored: Optional[list[int]] = None  # with an amortize edit: the best own branch's tokens
    source: Optional[tuple] = None  # with an amortize edit: (agent, branch) the stored tokens are from


@dataclass
class Got:
    """A block a lookup holds: its arrays (held here, whatever happens to the block meanwhile)."""

    block: Block
    layers: dict
    tokens: tuple[int, ...]
    run: Optional[tuple[Run, int]]
    read: bool  # read from disk by this lookup


@dataclass
class Found:
    """The best candidate: whose branch, the blocks used (with how many tokens of each), whether any
    came from disk, and the replacement prompt when matched by text."""

    src: Agent
    branch: Branch
    used: list[tuple[Got, int]]
    from_disk: bool
    prompt: Optional[list[int]] = None
    ties: list["Found"] = field(default_factory=list)  # other walked branches matching as far

    @property
    def n(self) -> int:
        return sum(n for _, n in self.used)


class Lookup:
    """Finds, reads and holds the blocks of a prompt's longest reusable prefix."""

    def __init__(self, lock: threading.RLock, chains: Chains, table: BlockTable, agents: Agents,
                 reads: Optional[Reads], codec: ModelCodec, stats: dict, read_timeout_s: float,
                 decode: Optional[Callable[[list[int]], str]], quarantine: Callable[[str, str], None]):
        self.lock, self.chains, self.table, self.agents, self.reads = lock, chains, table, agents, reads
        self.codec, self.stats, self.read_timeout_s, self.decode = codec, stats, read_timeout_s, decode
        self.quarantine = quarantine  # (block id, reason): move a file aside, on the writer
        self.block_size = chains.block_size

    def best(self, candidates: list[tuple[Agent, Branch]], prompt: list[int]) -> Optional[Found]:
        """The candidate giving the longest prefix (own branches first, most recent first).

        Candidates are ranked by how many whole blocks match by id (hashing the prompt, no reads);
        only the best-ranked ones are walked (and read, if cold), the partial block deciding. Tied
        ones may differ after a re-tokenized stretch: each is matched by text too (with a decode
        function), and the longest wins."""
        if not candidates:
            return None
        ids_by_links: dict = {}
        ranked = []
        for src, br in candidates:
            if br.links not in ids_by_links:
                ids_by_links[br.links] = self.chains.ids(br.links, prompt)
            ranked.append((common(ids_by_links[br.links], br.block_ids), src, br))
        top = max(k for k, _, _ in ranked)
        walked = []
        for k, src, br in ranked:
            if k == top:
                used, from_disk = self.walk(src, br, prompt, len(prompt) - 1)
                walked.append(Found(src, br, used, from_disk))
        most = max(f.n for f in walked)
        best, reach = None, -1
        for found in (f for f in walked if f.n == most):
            if self.decode is not None:
                found = self.match_text(found, prompt)
            if best is not None and found.n < best.n:
                continue
            # Bounded sliding windows: tied branches differ in where their windows are held (a
            # turn end kept as a branch still holds the window its grown continuation lost);
            # recurrent models: in where their checkpoints are (each branch keeps its own resume point).
            self.fill_windows(found)
            r = self.codec.reach([(got.layers, n) for got, n in found.used])
            if best is None or found.n > best.n or r > reach:
                best, reach = found, r
            if reach == best.n:
                break
        best.ties = [f for f in walked if f is not best and f.n == best.n]
        if reach < best.n:  # a shorter branch may end where its window (checkpoint) is held (an earlier turn's end)
            for k, src, br in ranked:
                if k < top:
                    used, from_disk = self.walk(src, br, prompt, len(prompt) - 1)
                    other = Found(src, br, used, from_disk)
                    self.fill_windows(other)
                    r = self.codec.reach([(got.layers, n) for got, n in other.used])
                    if r > reach:
                        best, reach = other, r
        return best

    def fill_windows(self, found: Found) -> None:
        """Bounded sliding-window layers: the blocks of the window before the match whose sliding
        arrays memory no longer holds (only branch ends' windows stay hot: BlockPool._trim_windows)
        are read back from disk for this request, so a turn rewound to an older turn's end reuses
        as much hot as after a reload. The table is not changed."""
        names = self.codec.window_names()
        if not names or self.reads is None or not found.used:
            return
        w, p = max(self.codec.windows.values()), found.n
        need, at = [], 0
        for i, (got, n) in enumerate(found.used):
            if at + n > p - w and self.codec.window_from(got.layers) > max(0, p - w - at) and not got.read:
                need.append(i)
            at += n
        reads = [(i, self.reads.take(found.used[i][0].block.block_id)[0]) for i in need]
        for i, future in reads:
            got, n = found.used[i]
            data, _ = read_result(future, self.read_timeout_s)
            if data is None or not self._valid(data) or tuple(int(t) for t in data.tokens) != got.tokens:
                continue  # this request resumes earlier (codec.window_reach)
            disk = self.codec.from_numpy({k: a for k, a in data.arrays.items() if k in names or k == WIN_FROM},
                                         data.dtypes)
            layers = {k: a for k, a in got.layers.items() if k not in names and k != WIN_FROM}
            found.used[i] = (Got(got.block, {**layers, **disk}, got.tokens, got.run, True), n)
            found.from_disk = True

    def walk(self, src: Agent, branch: Branch, prompt: Sequence[int], limit: int,
             ) -> tuple[list[tuple[Got, int]], bool]:
        """Walk `branch` (of agent `src`) against `prompt`, using at most `limit` tokens: the blocks
        used with how many tokens of each, and whether any was read from disk."""
        steps = list(self.chains.walk(branch))
        used: list[tuple[Got, int]] = []
        covered, from_disk, i = 0, False, 0
        while i < len(steps) and covered < limit:
            need = -(-(limit - covered) // self.block_size)
            segment, ended = self.fetch(src, steps[i : i + need])
            for got in segment:
                from_disk = from_disk or got.read
                n = min(lcp(got.tokens, prompt[covered : covered + len(got.tokens)]), limit - covered)
                if n <= 0:
                    return used, from_disk
                used.append((got, n))
                covered += n
                if n < len(got.tokens):
                    return used, from_disk
            if ended:
                break  # a block that could not be had: the branch ends there for now
            i += len(segment)
        return used, from_disk

    # ---- reading blocks -------------------------------------------------------------------------

    def fetch(self, src: Agent, steps: list[tuple[int, str, str]]) -> tuple[list[Got], bool]:
        """The first blocks of `steps` (consecutive, from chains.walk), in order, and whether the
        next one cannot be had (gone, unreadable, off the chain). Cold ones are read (at most the
        read-ahead budget's bytes per call, at least one block), checked and imported into MLX
        without the lock, then installed in the table counted by `src`."""
        plan: list[tuple[str, str, Block, Optional[Got], object]] = []
        ended = False
        with self.lock:
            cold_bytes = 0
            for _, bid, prev in steps:
                block = self.table.blocks.get(bid)
                if block is None:
                    ended = True
                    break
                if block.layers is not None:
                    plan.append((bid, prev, block, Got(block, block.layers, block.tokens, block.run, False), None))
                    continue
                if self.reads is None:
                    ended = True
                    break
                size = self.reads.size_of(bid)
                if plan and cold_bytes + size > self.reads.budget:
                    break
                cold_bytes += size
                plan.append((bid, prev, block, None, self.reads.take(bid)[0]))
        out: list[Got] = []
        run: list[tuple[Block, BlockData]] = []
        failed: Optional[tuple[str, str, bool]] = None  # (block id, why, refused: off its chain)
        for bid, prev, block, got, future in plan:
            if got is None:
                data, why = read_result(future, self.read_timeout_s)
                if why == "timeout":
                    self.stats["read_timeouts"] += 1
                    log.warning("reading block %s took over %.0f s; served as a miss", bid[:16], self.read_timeout_s)
                if data is not None and not self._valid(data):
                    data, why = None, "not this model's block layout"
                if data is None:
                    failed = (bid, why or "unreadable", False)
                    break
                tokens = tuple(int(t) for t in data.tokens)
            else:
                tokens = got.tokens
            # The id chain is seeded with this model and agent: a block written for another model or
            # agent, or one whose tokens were altered, cannot match even if its file is sound.
            if not self.chains.follows(prev, bid, tokens):
                failed = (bid, "its tokens do not follow the agent's chain", True)
                break
            if got is None:
                run.append((block, data))
            else:
                out.extend(self._convert(run))
                run = []
                out.append(got)
        out.extend(self._convert(run))
        with self.lock:
            for got in out:
                self._install(src, got)
            if failed is not None:
                self._failed(src, *failed)
        return out, ended or failed is not None

    def _convert(self, run: list[tuple[Block, BlockData]]) -> list[Got]:
        """Consecutive blocks read from disk into MLX: one import per token array for the whole run
        (codec.from_numpy_run), each block holding views of it. No lock: MLX work."""
        if not run:
            return []
        layers, whole = self.codec.from_numpy_run([(d.arrays, d.dtypes) for _, d in run])
        together, start, out = Run(whole, []), 0, []
        for (block, data), arrays in zip(run, layers):
            out.append(Got(block, arrays, tuple(int(t) for t in data.tokens), (together, start), True))
            start += len(data.tokens)
        return out

    def _install(self, src: Agent, got: Got) -> None:
        """(lock held) A block this lookup read becomes hot, counted by `src` when it still names it
        (else an orphan); one found hot and counted by nobody is counted by `src` from now on. A block
        erased meanwhile is not brought back: the lookup just uses what it holds."""
        block = got.block
        if self.table.blocks.get(block.block_id) is not block:
            return
        if not got.read:
            if block.owner is None and src.listed:
                self.table.adopt(src, block)
            return
        if block.layers is not None:  # read again while hot (another request brought it in meanwhile)
            return
        block.tokens = got.tokens
        owner = src if src.listed else None
        self.table.set_layers(block, got.layers, owner, got.run)
        if got.run is not None:
            got.run[0].members.append(block)
        block.state = BlockState.DURABLE
        self.stats["blocks_loaded"] += 1
        self.stats["bytes_loaded"] += block.nbytes

    def _failed(self, src: Agent, bid: str, why: str, refused: bool) -> None:
        """(lock held) A block that cannot be used: cut where it stands, re-cached from there on the
        next turn instead of tripping over it forever."""
        self.stats["bad_blocks"] += why != "timeout"
        if not refused:
            if why != "timeout":  # unreadable: no agent can use it
                self.agents.cut_everywhere(bid)
            return
        self.agents.cut(src, bid)  # off the chain for this agent; the block may be another's, and sound
        if bid not in self.table.refs:  # nobody names it now: moved aside, on the writer (before any rewrite)
            self.quarantine(bid, why)

    def _valid(self, data: BlockData) -> bool:
        n = len(data.tokens)
        return 0 < n <= self.block_size and self.codec.valid(data.arrays, n)

    # ---- matching across re-tokenization --------------------------------------------------------

    def match_text(self, found: Found, prompt: list[int]) -> Found:
        """Go on past token mismatches that decode to the same text (a reply re-tokenized).

        The replacement prompt is the branch's stored tokens up to the realigned point followed by
        the rest of the prompt, so the request is then served, exactly, as a prompt of the tokens
        the cache holds."""
        for _ in range(TEXT_MATCH_MAX_REALIGN):
            k = found.n
            if k >= len(prompt) - 1 or k >= found.branch.n_tokens:
                break  # the prompt is used up to its last token, or the branch is
            stored, disk = self.stored_tokens(found.src, found.branch, k + TEXT_MATCH_WINDOW)
            found.from_disk = found.from_disk or disk
            if len(stored) <= k or prompt[k] == stored[k]:
                break  # the walk stopped for another reason (the limit, a checkpoint)
            pair = align(stored, prompt, k, self.decode)
            if pair is None:
                break
            i, j = pair
            new_prompt = stored[: k + i] + prompt[k + j :]
            used, disk = self.walk(found.src, found.branch, new_prompt, len(new_prompt) - 1)
            if sum(n for _, n in used) <= k:
                break
            self.stats["text_matches"] += 1
            self.stats["tokens_matched_by_text"] += i
            found = Found(found.src, found.branch, used, found.from_disk or disk, new_prompt)
            prompt = new_prompt
        return found

    def stored_tokens(self, src: Agent, branch: Branch, upto: int) -> tuple[list[int], bool]:
        """The branch's stored tokens up to about `upto` (blocks read as needed)."""
        out: list[int] = []
        from_disk = False
        steps = list(self.chains.walk(branch))
        i = 0
        while i < len(steps) and len(out) < upto:
            need = -(-(upto - len(out)) // self.block_size)
            segment, ended = self.fetch(src, steps[i : i + need])
            for got in segment:
                out.extend(got.tokens)
                from_disk = from_disk or got.read
            if ended:
                break
            i += len(segment)
        return out, from_disk


def whole_run(used: list[tuple[Got, int]]) -> Optional[Run]:
    """The run when the used blocks are, in order, the start of one run (Block.run), else None."""
    first = used[0][0].run
    if first is None or first[1] != 0:
        return None
    start = 0
    for got, _ in used:
        if got.run is None or got.run[0] is not first[0] or got.run[1] != start:
            return None
        start += len(got.tokens)
    return first[0]
