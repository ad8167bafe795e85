"""A finished turn becomes the agent's newest branch: plan, build, install.

Owns nothing. `plan` (the pool's lock held) decides which of the turn's blocks the agent or its fork
parent already holds and which are new; `build` (no lock) slices the new blocks out of the turn's
cache and converts what the disk needs to numpy, the MLX work; `install` (the lock held) names the
blocks, makes them hot and queues the save. If anything the plan relied on changed in between
(an erasure, a fleet sync, on other threads), `install` says so and the pool plans again.
Worker thread only (MLX).

Recurrent models: each branch keeps one recurrent-state checkpoint, its resume point (the state
where its last turn's prompt ended; see `Commit.build`). A turn's new blocks get only its own, and
the agent's unshared hot blocks on the turn's tokens drop the checkpoints no branch of it resumes
from any more, in memory and (rewritten) on disk: an agent holds at most one state per branch.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Optional

import mlx.core as mx

from .agents import Agents
from .blocks import Agent, Block, BlockState, BlockTable, Run
from .caches import ModelCodec
from .chain import Branch, Chains, Links, common, lcp, manifest_of
from .disk_format import BlockData
from .namespace import spliced_seed
from .persister import Persister
from .kv_edit.rotations import Segments, clip


@dataclass
class Step:
    start: int
    tokens: tuple[int, ...]
    block_id: str
    block: Optional[Block]
    what: str  # "new": sliced from the cache; "same": hot, re-pointed at the cache's bytes; "keep"
    layers: Optional[dict] = None  # "same", and "keep" when hot: the block's arrays at plan time
    shared: bool = False  # another agent names the block (its checkpoints are never dropped)


@dataclass
class Plan:
    agent: Agent
    tokens: list[int]
    links: Links
    ids: list[str]
    steps: list[Step]
    epoch: int  # the pool's epoch when planned (see BlockPool.epoch)
    old_hot: list[tuple[int, int, dict]] = field(default_factory=list)  # (start, tokens on the turn, arrays)
    unsaved: list[tuple[Block, dict]] = field(default_factory=list)  # an earlier failed turn's PENDING blocks
    # Hot blocks left alone in a run the "same" steps leave (another branch's): copied out, so the
    # old run's arrays (a whole earlier history) are freed instead of pinned by a few blocks.
    compact: list[tuple[Block, dict]] = field(default_factory=list)
    rotations: Segments = ()  # the turn's rotation counts (a spliced history's; kv_edit/rotations.py)
    generation: int = 0  # the turn's branch generation (0: honest; chain.Branch)
    # Recurrent models: (block id, position in it) of the resume points of the agent's branches that
    # stay beside the turn's (their checkpoints are kept).
    resume_keep: set = field(default_factory=set)
    asked: Optional[int] = None  # tokens of the turn the request sent (chain.Branch.prompt; None: unknown)


@dataclass
class Built:
    layers: dict[str, dict] = field(default_factory=dict)  # block id -> arrays ("new" and "same")
    run: Optional[Run] = None
    datas: dict[str, BlockData] = field(default_factory=dict)  # block id -> numpy copy for the disk
    compacted: dict[str, dict] = field(default_factory=dict)  # block id -> its arrays, out of its run
    # block id -> (its arrays at plan time, the names of the checkpoints it drops): hot blocks no
    # branch resumes from any more; rewritten on disk when in `datas`
    stripped: dict[str, tuple[dict, set]] = field(default_factory=dict)


class Commit:
    """Plans, builds and installs a turn's blocks (see the module docstring)."""

    def __init__(self, chains: Chains, table: BlockTable, agents: Agents, codec: ModelCodec,
                 persister: Optional[Persister], stats: dict, max_branches: int,
                 on_saved: Callable[[Agent, list[Block], dict, list[str], list[Branch]], Future]):
        self.chains, self.table, self.agents, self.codec = chains, table, agents, codec
        self.persister, self.stats, self.max_branches = persister, stats, max_branches
        self.block_size = chains.block_size
        self.on_saved = on_saved  # (agent, unsaved blocks, their numpy data, dead ids, branches before) -> future

    # ---- plan (lock held) -----------------------------------------------------------------------

    def plan(self, agent: Agent, tokens: list[int], fork_from: Optional[str], reused: int, epoch: int,
             rotations: Segments = (), generation: int = 0, asked: Optional[int] = None) -> Plan:
        """`reused`: the tokens the request's lookup took from this agent's blocks; the cache holds
        them bit for bit, so the blocks holding only those become views of it too. `rotations`,
        `generation`: a spliced history's (kv_edit; 0: an honest turn). `asked`: how many of
        `tokens` the request sent (its prompt as served; None: not known)."""
        links = self._links_for(agent, tokens, fork_from, generation)
        ids = self.chains.ids(links, tokens)
        steps = []
        # A block that is missing or only on disk (possibly unreadable) is rebuilt from the cache we
        # hold anyway; the writer skips files that are already valid. A block another agent names is
        # never rebuilt: shared blocks are never modified.
        for i, bid in enumerate(ids):
            start = i * self.block_size
            chunk = tuple(tokens[start : start + self.block_size])
            block = self.table.blocks.get(bid)
            others = self.table.refs.get(bid, 0) - (bid in agent.ids)
            if block is None or (block.layers is None and others <= 0):
                steps.append(Step(start, chunk, bid, block, "new"))
            elif block.layers is not None and others <= 0 and start + len(chunk) <= reused:
                steps.append(Step(start, chunk, bid, block, "same", block.layers))
            else:
                steps.append(Step(start, chunk, bid, block, "keep", block.layers, others > 0))
        plan = Plan(agent, tokens, links, ids, steps, epoch, rotations=clip(rotations, len(tokens)),
                    generation=generation, asked=asked)
        if self.codec.has_state:
            plan.old_hot = self._hot_prefixes(agent, tokens)
            plan.resume_keep = {r for br in agent.branches if self.stays(br, tokens, generation)
                                for r in [self._resume_point(br)] if r is not None}
        moving = {s.block_id for s in steps if s.what == "same"}
        runs = {id(s.block.run[0]): s.block.run[0] for s in steps if s.what == "same" and s.block.run is not None}
        plan.compact = [(b, b.layers) for r in runs.values() for b in r.members if b.block_id not in moving]
        planned = {s.block_id for s in steps if s.what == "new"}
        plan.unsaved = [(b, b.layers) for b in (self.table.blocks.get(x) for x in agent.ids)
                        if b is not None and b.state == BlockState.PENDING and b.layers is not None
                        and b.block_id not in planned]
        return plan

    def _links_for(self, agent: Agent, tokens: list[int], fork_from: Optional[str], generation: int = 0) -> Links:
        """How the chain of `tokens` is seeded: along the agent's branch sharing the most blocks
        with it, or the fork parent's if that shares more whole blocks; re-seeded with the agent's
        namespace where its own blocks begin, or for a spliced turn of `generation` g with
        `spliced_seed(agent, g)` where its spliced blocks begin. An honest turn only ever chains on
        honest branches; a spliced one on any of the agent's branches up to its generation."""
        best: Links = ()
        d = 0
        for br in agent.branches:
            if br.generation > generation or (generation == 0 and br.spliced):
                continue
            k = common(self.chains.ids(br.links, tokens), br.block_ids)
            if k > d:
                best, d = br.links, k
        parent = self.agents.get(fork_from) if fork_from and fork_from != agent.namespace else None
        if parent is not None and agent.persistent:
            full = len(tokens) // self.block_size
            for br in parent.honest:
                k = min(common(self.chains.ids(br.links, tokens), br.block_ids),
                        full, br.n_tokens // self.block_size)  # whole blocks only
                if k > d:
                    best, d = br.links, k
        seed = spliced_seed(agent.namespace, generation) if generation else agent.namespace
        links = tuple((i, ns) for i, ns in best if i < d)
        if not links or links[-1][1] != seed:
            links += ((d, seed),)
        return links

    def stays(self, branch: Branch, tokens: list[int], generation: int) -> bool:
        """Whether `branch` stays beside a turn of `tokens` (of branch generation `generation`)
        rather than being replaced by it: a turn replaces the branches it continues, of its own kind
        (spliced or honest); on a model with bounded sliding windows a shorter one stays, as a place
        to resume (its tail block holds the window before its end, which the grown tail no longer holds)."""
        return (branch.spliced != (generation > 0) or not self.chains.continues(branch, tokens)
                or (bool(self.codec.window_names()) and branch.n_tokens < len(tokens)))

    def _resume_point(self, branch: Branch) -> Optional[tuple[str, int]]:
        """(block id, position in it) of the last checkpoint at or before the branch's end among its
        hot blocks: where a prompt extending the branch resumes (None: none hot)."""
        best, at = None, -1
        for i, bid in enumerate(branch.block_ids):
            block = self.table.blocks.get(bid)
            if block is None or block.layers is None:
                continue
            for _, p in self.codec.checkpoint_slots(block.layers):
                if at < i * self.block_size + p <= branch.n_tokens:
                    best, at = (bid, p), i * self.block_size + p
        return best

    def _hot_prefixes(self, agent: Agent, tokens: list[int]) -> list[tuple[int, int, dict]]:
        """(start, how many of its tokens lie on `tokens`, arrays) of the agent's hot blocks along its
        branches, as far as each branch agrees (their recurrent-state checkpoints carry over)."""
        out = []
        for br in agent.branches:
            start = 0
            for bid in br.block_ids:
                block = self.table.blocks.get(bid)
                if block is None or block.layers is None:
                    break
                n = len(block.tokens)
                ok = lcp(block.tokens, tokens[start : start + n])
                out.append((start, ok, block.layers))
                if ok < n:
                    break
                start += n
        return out

    def limit(self, branches: list[Branch], limit: int,
              turn: Callable[[str], Optional[tuple]] = lambda bid: None) -> list[Branch]:
        """(lock held) `branches` (least recently used first, the turn's last) within `limit` of each
        kind (honest, spliced; `limit_branches`). Beyond it a branch whose whole prompt another kept
        branch holds goes first (`prompt_held`: its own tokens are only a reply as generated, which
        the client re-rendered and sent on: its follow-up is that other branch), the least recently
        used such; only then the least recently used. So concurrent turns of one agent keep each
        other, whatever order their commits and their follow-ups land in. The turn's never goes.
        `turn`: the tokens of the turn's blocks (not in the table yet) by id."""
        out = list(branches)
        while True:
            kinds = [k for k in (False, True) if sum(br.spliced == k for br in out) > limit]
            if not kinds:
                return out
            same = [i for i, br in enumerate(out) if br.spliced == kinds[0]]
            spare = [i for i in same if i != len(out) - 1
                     and any(self.prompt_held(out[i], out[j], turn) for j in same if j != i)]
            del out[(spare or same)[0]]

    def prompt_held(self, b: Branch, c: Branch, turn: Callable[[str], Optional[tuple]] = lambda bid: None) -> bool:
        """(lock held) Whether branch `c` holds every token of `b`'s last prompt (`Branch.prompt`):
        the same whole blocks, then the same tokens of the block it ends in (False when not known:
        no prompt recorded, or a block's tokens not in memory)."""
        p = b.prompt
        if not p or c.n_tokens < p:
            return False
        w, r = divmod(p, self.block_size)
        if c.block_ids[:w] != b.block_ids[:w]:
            return False
        if not r:
            return True
        if len(c.block_ids) <= w or len(b.block_ids) <= w:
            return False
        mine, theirs = (turn(x) or getattr(self.table.blocks.get(x), "tokens", ())
                        for x in (b.block_ids[w], c.block_ids[w]))
        return len(mine) >= r and len(theirs) >= r and tuple(mine[:r]) == tuple(theirs[:r])

    # ---- build (no lock) ------------------------------------------------------------------------

    def build(self, plan: Plan, cache: list) -> Built:
        """Slice the new blocks out of `cache` and make the disk's numpy copies: the MLX work.

        When every block can, the turn's blocks are views of the cache's arrays (one Run), so the
        next lookup takes them whole instead of concatenating; the Run's bytes are then exactly its
        members'. Otherwise (a fork's shared prefix) new blocks are copies."""
        n_valid = len(plan.tokens)
        checkpoints = self._resume(plan, cache) if self.codec.has_state else []
        built = Built()
        strip = self._stale_checkpoints(plan, checkpoints)
        if all(s.what != "keep" for s in plan.steps):
            arrays = self.codec.token_arrays(cache)
            windowed = self.codec.window_names()  # held from a later start, sliced per block instead
            built.run = Run({n: mx.contiguous(a[..., :n_valid, :]) for n, a in arrays.items() if n not in windowed}, [])
            built.run.floats = self.codec.carry(cache, n_valid)  # for the next turn (caches.floats.CarriedFloats)
        whole = built.run.arrays if built.run is not None else None
        for s in plan.steps:
            end = s.start + len(s.tokens)
            if s.what == "new":
                built.layers[s.block_id] = self.codec.slice(cache, s.start, end, checkpoints, whole)
            elif s.what == "same" and whole is not None:
                gone = strip.pop(s.block_id, set())
                built.layers[s.block_id] = {**{n: a for n, a in s.layers.items() if n not in whole and n not in gone},
                                            **{n: a[..., s.start : end, :] for n, a in whole.items()}}
                if gone:
                    built.stripped[s.block_id] = (s.layers, gone)
        if whole is not None:  # the "same" steps leave their runs: what stays behind is copied out
            for block, layers in plan.compact:
                gone = strip.get(block.block_id, set())
                built.compacted[block.block_id] = {n: mx.contiguous(a) for n, a in layers.items() if n not in gone}
        for s in plan.steps:
            if s.block_id in strip and s.block_id not in built.stripped:
                built.stripped[s.block_id] = (s.layers, strip[s.block_id])
        new = [built.layers[s.block_id] for s in plan.steps if s.what == "new"] + list(built.compacted.values())
        if new:
            mx.eval([a for layers in new for a in layers.values()])
        if self.persister is not None and plan.agent.persistent:
            for s in plan.steps:
                if s.what == "new":
                    built.datas[s.block_id] = _to_numpy(s.block_id, s.tokens, built.layers[s.block_id], self.codec)
            for block, layers in plan.unsaved:
                built.datas[block.block_id] = _to_numpy(block.block_id, block.tokens, layers, self.codec)
            for s in plan.steps:  # rewritten without the checkpoints they dropped
                if s.block_id in built.stripped:
                    layers = built.layers.get(s.block_id) or built.compacted.get(s.block_id) or {
                        n: a for n, a in s.layers.items() if n not in built.stripped[s.block_id][1]}
                    built.datas[s.block_id] = _to_numpy(s.block_id, s.tokens, layers, self.codec)
        return built

    def _resume(self, plan: Plan, cache: list) -> list:
        """The turn's resume point, as [(position, per-STATE-layer arrays)] (or []): the state where
        its prompt ended (the prefill snapshot at len(prompt) - 1), which every later prompt of the
        conversation passes through whether or not the reply comes back token for token (a resent
        prompt, a re-rendered reply or tool call, dropped reasoning); the final state when the cache
        has no snapshot; without either, the last old checkpoint on the turn's tokens."""
        live = self.codec.live_checkpoints(cache, len(plan.tokens))
        if live:
            return live[:1]
        return sorted(self._old_checkpoints(plan), key=lambda c: c[0])[-1:]

    def _stale_checkpoints(self, plan: Plan, resume: list) -> dict[str, set]:
        """Block id -> names of the checkpoints the turn's hot, unshared blocks drop: every one but
        the resume points of the branches that stay (`Plan.resume_keep`) and of the turn's branch
        (`resume`, when a new block takes it; else the last checkpoint at or before the turn's end
        that its blocks already hold)."""
        if not self.codec.has_state:
            return {}
        keep = set(plan.resume_keep)
        n, bs = len(plan.tokens), self.block_size
        at = resume[0][0] if resume else 0
        if at and plan.steps[(at - 1) // bs].what == "new":
            keep.add((plan.steps[(at - 1) // bs].block_id, at - (at - 1) // bs * bs))
        else:
            held = [(s.start + p, (s.block_id, p)) for s in plan.steps if s.what != "new" and s.layers is not None
                    for _, p in self.codec.checkpoint_slots(s.layers) if s.start + p <= n]
            if held:
                keep.add(max(held)[1])
        out = {}
        for s in plan.steps:
            if s.what != "new" and s.layers is not None and not s.shared:
                gone = set().union(*(self.codec.checkpoint_names(c) for c, p in self.codec.checkpoint_slots(s.layers)
                                     if (s.block_id, p) not in keep))
                if gone:
                    out[s.block_id] = gone
        return out

    def _old_checkpoints(self, plan: Plan) -> list:
        """Recurrent-state checkpoints in the agent's hot blocks that still lie on the turn's tokens
        (`_resume`'s fallback when the turn's cache gives none)."""
        out = []
        for start, ok, layers in plan.old_hot:
            out += [(p, s) for p, s in self.codec.block_checkpoints(layers, start) if p - start <= ok]
        return list({p: (p, s) for p, s in out}.values())

    # ---- install (lock held) --------------------------------------------------------------------

    def stale(self, plan: Plan, epoch: int) -> bool:
        """Whether something the plan relied on changed since (another thread erased or synced)."""
        if epoch == plan.epoch:
            return False
        for s in plan.steps:
            block = self.table.blocks.get(s.block_id)
            if s.what == "keep" and block is None:
                return True
            if s.what == "same" and (block is not s.block or block.layers is not s.layers):
                return True
        return plan.agent.persistent and self.agents.get(plan.agent.namespace) not in (None, plan.agent)

    def install(self, plan: Plan, built: Built,
                forget: Optional[Callable[[list[Branch]], list[Branch]]] = None) -> tuple[list[str], Optional[Future]]:
        """Name the turn's blocks as the agent's newest branch (branches it continues are replaced by
        it, `forget` filters the others: a forget edit's, and beyond `max_branches` the least recently
        used honest or spliced one goes), make the new ones hot and queue the save. Returns (dead
        block ids, the save's future or None)."""
        agent, tokens = plan.agent, plan.tokens
        before = list(agent.branches)
        if agent.persistent and self.agents.get(agent.namespace) is not agent:
            self.agents.add(agent)  # registered first, so the blocks it counts count it as hot
        elif not agent.persistent and agent.namespace not in self.agents.anonymous:
            self.agents.add(agent)
        limit = self.max_branches if agent.persistent else 1
        # A branch this turn continues is replaced by it (`stays`).
        kept = [br for br in agent.branches if self.stays(br, tokens, plan.generation)]
        if forget is not None:
            kept = forget(kept)
        kept.append(Branch(plan.ids, len(tokens), plan.links, self.agents.stamp(agent), plan.rotations,
                           plan.generation, prompt=plan.asked))
        turn = {s.block_id: s.tokens for s in plan.steps}
        limited = self.limit(kept, limit, turn.get)
        self.stats["branches_evicted"] += len(kept) - len(limited)
        kept = limited
        dead = self.table.name(agent, kept)
        run = built.run
        for s in plan.steps:
            layers = built.layers.get(s.block_id)
            block = self.table.blocks.get(s.block_id)
            if layers is None or block is None:
                continue
            if s.what == "same" and (block is not s.block or block.layers is not s.layers):
                continue  # changed meanwhile: it keeps what it has
            if s.what == "new":
                block.tokens = s.tokens
                block.state = BlockState.PENDING  # rewritten; the store skips a file already valid
            elif s.block_id in built.stripped and s.block_id in built.datas:
                block.state = BlockState.PENDING  # rewritten without the checkpoints it dropped
            self.table.set_layers(block, layers, agent, (run, s.start) if run is not None else None)
            if run is not None:
                run.members.append(block)
        for block, layers in plan.compact:
            copy = built.compacted.get(block.block_id)
            if copy is not None and self.table.blocks.get(block.block_id) is block and block.layers is layers:
                self.table.set_layers(block, copy, block.owner, None)
                if block.block_id in built.stripped and block.block_id in built.datas:
                    block.state = BlockState.PENDING
        for bid, (layers, names) in built.stripped.items():
            block = self.table.blocks.get(bid)
            if block is None or block.layers is not layers or bid in built.layers or bid in built.compacted:
                continue  # changed meanwhile, or already installed without them
            self.table.shed(block, names)
            if bid in built.datas:
                block.state = BlockState.PENDING
        self.agents.touch(agent)
        self.stats["tokens_stored"] += len(tokens)
        future = None
        if agent.persistent and self.persister is not None:
            # Every unsaved block the manifest will name, in any branch (a failed earlier turn's too):
            # the manifest is written only after all of them are durable.
            unsaved = [b for b in (self.table.blocks.get(x) for x in agent.ids)
                       if b is not None and b.state == BlockState.PENDING and b.layers is not None
                       and b.block_id in built.datas]
            future = self.on_saved(agent, unsaved, built.datas, dead, before)
        return dead, future


def _to_numpy(bid: str, tokens: tuple, layers: dict, codec: ModelCodec) -> BlockData:
    import numpy as np

    arrays, dtypes = codec.to_numpy(layers)
    return BlockData(bid, np.asarray(tokens, dtype=np.int32), arrays, dtypes)


__all__ = ["Commit", "Plan", "Built", "manifest_of"]
