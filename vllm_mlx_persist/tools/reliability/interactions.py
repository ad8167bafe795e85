"""`vllm-mlx-persist reliability --campaigns interactions`: every feature at once on one real server
under tight hot and disk budgets and a short TTL: turns, concurrent agents, forks, concurrent branches,
erasures and reused erased ids, pins, isolation probes, anonymous requests, SIGKILLs (between steps,
mid-request, at a write step). Every answer equals a never-killed reference server's; every
acknowledged turn (and a fork parent's) is reused unless the server's log records an erasure of the
agent; erased agents never come back; /health answers within 1 s; memory and disk within their bounds.
What the campaign knows of its conversations and requests: interaction_model.py.
"""

from __future__ import annotations

import http.client
import json
import random
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from ...faults import ENV as FAULT_ENV
from ..serving import RssSampler, Server
from .interaction_model import (DISK_BYTES_PER_TOKEN, HEALTH_LIMIT_S, I_ACTIVE, I_COVER, I_DISK_MB, I_DOCS, I_HOT_MB,
                                I_MAX_TURNS, I_OPS, I_OPTIONS, I_PROGRESS_STEPS, I_TIMEOUT_S, I_TTL_HOURS, Abort,
                                ErasureLog, IConv, ISpec, exception_since, manifests_of)
from .server_kit import (BATCH_INVARIANT_ENV, OPTIONS, OVERHEAD_MB, TINY_KV_BYTES_PER_TOKEN, HttpError, chat, request,
                         shared, status, tree_bytes)


class _Interactions:
    """The interactions campaign's state: one server under test SIGKILLed at random moments, the
    conversations it acknowledged, the agents erased and pinned, and the watchers (health, memory, disk)."""

    def __init__(self, seed: int, work: Path):
        self.sh = shared(work)
        self.model = str(self.sh.model)
        self.seed, self.rng = seed, random.Random(seed)
        self.root = work / "interactions-root"
        self.srv = Server(self.sh.model, work / "interactions-home", options={**I_OPTIONS, "cache_dir": str(self.root)},
                          env=BATCH_INVARIANT_ENV)
        self.elog = ErasureLog(self.srv.log_path)
        self.convs: dict[str, IConv] = {}
        self.erased: dict[str, list[dict]] = {}  # agents we erased and have not used since: their history
        self.pinned: set[str] = set()
        self.failures: list[dict] = []
        self.steps: list[str] = []
        self.step = 0
        self.next_id = 0
        self.fault_kill = False  # this lifetime was started with kill@N (it may die by itself)
        self.killing = False  # the campaign is killing the server now
        self.inflight_tokens = 0  # tokens of the turns the current step has in flight
        self.max_footprint = 0
        self.max_seq = 1024  # tokens of the longest sequence (prompt + reply) seen, at least a full turn
        self.seen_events = 0
        self.rss = RssSampler(interval=0.5)
        self.rss_baseline = 0
        self.st: dict[str, Any] = {
            "ops": {}, "lifetimes": {}, "answers": 0, "replies_compared": 0, "turns_checked": 0,
            "turns_checked_across_a_restart": 0, "losses_excused_by_erasure": 0, "fork_first_checked": 0,
            "erasures_requested": 0, "erased_revisited": 0, "probes": 0, "pins": 0, "unpins": 0,
            "requests_killed_in_flight": 0, "write_point_kills": 0, "killed_during_start": 0, "longest_history_turns": 0,
            "cold_replies_equal_to_cold_reference": 0,
            "health_polls": 0, "health_worst_s": 0.0, "health_late": 0,
            "hot_bytes_peak": 0, "hot_bound_at_peak": 0, "hot_over": 0,
            "disk_peak_bytes": 0, "disk_bound_at_peak": 0, "disk_over": 0}
        self.restarted: set[str] = set()  # agents whose next turn is the first since a restart
        self.pending_restart: Optional[str] = None
        self.op = ""  # the step's op as chosen (the step list gets what it did, once done)
        self.ended = ""  # how the last lifetime ended
        self._pause = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()

    # ---- bookkeeping --------------------------------------------------------------------------

    def fail(self, kind: str, problem: str, **extra: Any) -> None:
        self.failures.append({"kind": kind, "seed": self.seed, "step": self.step, "op": self.op,
                              "problem": problem[:600], **extra, "steps": self.steps[-10:]})

    def count(self, key: str, sub: Optional[str] = None) -> None:
        if sub is None:
            self.st[key] += 1
        else:
            self.st[key][sub] = self.st[key].get(sub, 0) + 1

    def refresh_log(self) -> int:
        """Read new erasures; a pinned agent erased by the budget or the TTL is a failure."""
        n = self.elog.refresh()
        for agent, why in self.elog.events[self.seen_events:]:
            if why != "request" and agent in self.pinned:
                self.fail("pinned-erased", f"pinned agent {agent} erased ({why})", agent=agent)
                self.pinned.discard(agent)
        self.seen_events = n
        return n

    def pinned_tokens(self) -> int:
        """(any thread) Tokens the pinned agents may hold; list() copies under the GIL, so the main
        thread's changes cannot break the iteration."""
        return sum(c.footprint() for c in map(self.convs.get, list(self.pinned)) if c is not None)

    # ---- the server ---------------------------------------------------------------------------

    def start(self, kill_at: Optional[int] = None) -> bool:
        """Start a lifetime (with kill@N: the server SIGKILLs itself before its Nth write step)."""
        self.srv.extra_env = {**BATCH_INVARIANT_ENV, **({FAULT_ENV: f"kill@{kill_at}"} if kill_at else {})}
        try:
            self.srv.start()
        except RuntimeError as e:
            if not kill_at:
                self.fail("start-failed", f"the server did not start: {str(e)[-400:]}")
                raise Abort() from None
            self.count("killed_during_start")  # it reached its kill point while starting: start plain
            return self.start(None)
        self.fault_kill = bool(kill_at)
        self.killing = False
        if self.rss.pid is None:
            self.rss.start(self.srv.pid)
        else:
            self.rss.watch(self.srv.pid)
        self._pause.clear()
        self.after_start()
        return True

    def restart(self, mode: str, kill_at: Optional[int] = None) -> bool:
        self._pause.set()
        self.killing = True
        if self.srv.proc is not None and self.srv.proc.poll() is None:
            self.srv.stop(signal.SIGKILL)
        else:
            self.srv.stop()
        self.count("lifetimes", mode)
        self.restarted = set(self.convs)
        self.ended = mode
        return self.start(kill_at)

    def alive(self) -> bool:
        return self.srv.proc is not None and self.srv.proc.poll() is None

    def listed(self) -> Optional[set[str]]:
        ids: set[str] = set()
        after = ""
        while True:
            code, raw = request(self.srv.url, "/v1/agents?limit=1000" + (f"&after={after}" if after else ""), b"",
                                method="GET", timeout=I_TIMEOUT_S)
            if code != 200:
                self.fail("admin", f"GET /v1/agents answered {code}")
                return None
            page = json.loads(raw)
            ids |= {a["id"] for a in page["data"]}
            if not page["has_more"]:
                return ids
            after = page["last_id"]

    def after_start(self) -> None:
        """Right after a start: erased agents are not back; every acknowledged agent is there or an
        erasure the log records removed it."""
        try:
            on_disk = self.listed()
        except (OSError, ValueError) as e:
            self.fail("admin", f"GET /v1/agents after a start: {e!r}")
            return
        self.refresh_log()
        if on_disk is None:
            return
        for agent in self.erased:
            if agent in on_disk:
                self.fail("came-back", f"erased agent {agent} is listed again after a restart", agent=agent)
        for c in self.convs.values():
            if c.last_prompt and c.agent not in on_disk:
                if not self.elog.since(c.agent, c.acks[-1][1]):
                    # After a hang the persister may have deleted the agent and then waited forever for
                    # the pool's lock (its erasure callback) before logging it: named apart.
                    self.fail("vanished" + (":after-a-hang" if self.ended == "after-hung" else ""),
                              f"{c.agent} (acknowledged turn of {c.last_prompt} tokens) is not listed after the "
                              f"restart (the last lifetime ended: {self.ended}) and no erasure of it was logged",
                              agent=c.agent)
                c.forget()

    # ---- watchers -----------------------------------------------------------------------------

    def watch(self) -> None:
        """(thread) /health every 0.2 s within HEALTH_LIMIT_S; the pool's hot bytes and the root's
        disk bytes every second against their bounds. Paused while the campaign restarts the server."""
        try:
            self._watch()
        except Exception as e:  # the watcher must not stop silently: its silence would read as health
            with self._lock:
                self._late.append((self.step, f"the health watcher failed: {e!r}"[:200]))

    def _watch(self) -> None:
        i = 0
        while not self._stop.wait(0.2):
            if self._pause.is_set() or not self.alive():
                continue
            url, step, proc = self.srv.url, self.step, self.srv.proc
            t = time.monotonic()
            try:
                code, _ = request(url, "/health", b"", method="GET", timeout=HEALTH_LIMIT_S)
                problem = None if code == 200 else f"answered {code}"
            except Exception as e:
                problem = repr(e)[:100]
            dt = time.monotonic() - t

            def ended() -> bool:  # the lifetime polled is over (a kill; the next one may be up already)
                return self.srv.proc is not proc or proc.poll() is not None

            if problem is not None and not self._pause.is_set():
                # a reset while a kill takes it down is not a health failure: give its death up to 2 s
                # to show (a loaded machine, a fork server reporting the exit)
                for _ in range(10):
                    if ended():
                        break
                    time.sleep(0.2)
            if self._pause.is_set() or ended():
                continue
            with self._lock:
                self.st["health_polls"] += 1
                self.st["health_worst_s"] = round(max(self.st["health_worst_s"], dt), 3)
                if problem is None and dt > HEALTH_LIMIT_S:
                    problem = f"answered in {dt:.2f} s"
                if problem is not None:
                    self.st["health_late"] += 1
                    self._late.append((step, problem))
            i += 1
            if i % 4 == 0:
                self.sample_bounds(url, step)

    def sample_bounds(self, url: str, step: int) -> None:
        try:
            code, raw = request(url, "/v1/status", b"", method="GET", timeout=2.0)
            cache = json.loads(raw).get("cache") or {} if code == 200 else {}
        except Exception:
            cache = {}
        with self._lock:
            pinned = self.pinned_tokens()
            if cache.get("hot_budget_bytes") is not None:
                hot = cache.get("hot_bytes", 0)
                # the largest agent's last sequences: before any turn is acknowledged, the one in flight
                footprint = max(self.max_footprint, self.max_seq)
                bound = cache["hot_budget_bytes"] + (footprint + pinned) * TINY_KV_BYTES_PER_TOKEN + (64 << 10)
                if hot > self.st["hot_bytes_peak"]:
                    self.st["hot_bytes_peak"], self.st["hot_bound_at_peak"] = hot, bound
                if hot > bound:
                    self.st["hot_over"] += 1
                    self._over.append((step, f"hot_bytes {hot} over hot_mb + one agent + pinned = {bound}"))
            # a save's budget check runs before its turn is acknowledged, so the disk passes disk_mb by
            # the turns being written; pinned agents are never erased; model.json, the lock, manifests'
            # estimate: 64 kB
            disk = tree_bytes(self.root)
            bound = int(I_DISK_MB * 2**20) + (self.inflight_tokens + pinned) * DISK_BYTES_PER_TOKEN + (64 << 10)
            if disk > self.st["disk_peak_bytes"]:
                self.st["disk_peak_bytes"], self.st["disk_bound_at_peak"] = disk, bound
            if disk > bound:
                self.st["disk_over"] += 1
                self._over.append((step, f"disk {disk} bytes over disk_mb + agents in flight + pinned = {bound}"))

    def drain_watch(self) -> None:
        """Turn what the watcher saw during the step into failures (one per kind and step)."""
        with self._lock:
            late, over = self._late, self._over
            self._late, self._over = [], []
        if late:
            self.fail("health", f"/health missed {HEALTH_LIMIT_S} s {len(late)} time(s) during step {late[0][0]}: "
                                f"{[p for _, p in late[:3]]}")
        for kind in ("hot_bytes", "disk"):
            mine = [p for _, p in over if p.startswith(kind)]
            if mine:
                self.fail("hot-over" if kind == "hot_bytes" else "disk-over", f"{mine[0]} ({len(mine)} sample(s))")

    # ---- requests -----------------------------------------------------------------------------

    def ask(self, spec: ISpec) -> None:
        """(any thread) Send one request; spec.result = ("ok", (text, cached, prompt)) or
        ("dead" | "hung" | "error", why)."""
        url, proc = self.srv.url, self.srv.proc
        try:
            spec.result = ("ok", chat(url, self.model, spec.messages, spec.agent, timeout=I_TIMEOUT_S,
                                      fork_from=spec.fork_from))
        except HttpError as e:  # it answered: alive
            spec.result = ("error", str(e))
        except (socket.timeout, TimeoutError) as e:
            dead = proc.poll() is not None
            spec.result = ("dead" if dead else "hung", f"no answer in {I_TIMEOUT_S} s ({e!r})")
        except (OSError, http.client.HTTPException) as e:  # refused, reset or cut short: dead, or dying
            try:
                proc.wait(2)
                spec.result = ("dead", repr(e))
            except subprocess.TimeoutExpired:
                spec.result = ("error", repr(e))
        except Exception as e:  # anything else is the request's failure, never the campaign's crash
            spec.result = ("error", repr(e))

    def run_specs(self, specs: list[ISpec], kill_after: Optional[float] = None) -> None:
        """Run the step's requests at once (SIGKILL the server `kill_after` s in), then check each; a
        restart they call for is left in `pending_restart` (after the step's turns are recorded)."""
        for sp in specs:
            try:
                sp.ref = self.sh.reply(sp.ref_key, sp.messages)
            except Exception as e:
                self.fail("reference", f"the reference server failed: {e}"[:400])
                return
        with self._lock:  # one turn per request in flight (at most the longest sequence seen)
            self.inflight_tokens = self.max_seq * len(specs)
        seq = self.refresh_log()
        log_pos = self.elog.pos
        for sp in specs:
            sp.sent_seq = seq
        threads = [threading.Thread(target=self.ask, args=(sp,), daemon=True) for sp in specs]
        for t in threads:
            t.start()
        killed = False
        if kill_after is not None:
            time.sleep(kill_after)
            self._pause.set()
            self.killing = killed = True
            self.srv.proc.send_signal(signal.SIGKILL)
        for t in threads:
            t.join(I_TIMEOUT_S + 10)
        self.refresh_log()
        recover = None
        for sp in specs:
            kind, what = sp.result
            if kind == "ok":
                self.check(sp, *what)
            elif kind == "dead":
                if killed or self.fault_kill:
                    self.count("requests_killed_in_flight")
                    recover = recover or ("write-point" if not killed else None)
                else:
                    self.fail("died", f"the server died under {sp.what} of {sp.agent}: {what}; "
                                      f"{self.srv.log_tail(8)[-600:]}", agent=sp.agent)
                    recover = "died"
            elif kind == "hung":
                self.fail("hung", f"{sp.what} of {sp.agent} (fork_from {sp.fork_from}) hung: {what}", agent=sp.agent)
                recover = "hung"
            else:
                code = re.match(r"HTTP (\d+)", what)
                server = exception_since(self.srv.log_path, log_pos)
                if not server and code:  # the traceback may be logged just after the response
                    time.sleep(0.3)
                    server = exception_since(self.srv.log_path, log_pos)
                self.fail(f"http-{code.group(1)}" if code else "request-error",
                          f"{sp.what} of {sp.agent} (fork_from {sp.fork_from}) failed: {what}{server}", agent=sp.agent)
        with self._lock:
            self.inflight_tokens = 0
        if killed:
            self.pending_restart = "kill-mid"
        elif recover == "write-point":
            self.count("write_point_kills")
            self.pending_restart = "write-point"
        elif recover is not None:
            self.pending_restart = f"after-{recover}"

    def check(self, sp: ISpec, text: str, cached: int, prompt: int) -> None:
        """One answer: the reference's reply, and the reuse its agent's acknowledged state promises."""
        self.st["answers"] += 1
        self.st["replies_compared"] += 1
        who = f"{sp.what} of {sp.agent}" + (f" (fork_from {sp.fork_from})" if sp.fork_from else "")
        if text != sp.ref:
            # A prefill without a cache and one over a cached prefix agree to float rounding, not bit
            # for bit (docs/design.md), and a random model's near-tied greedy choice can flip between
            # them: an answer computed without a cache must equal the reference's without one.
            cold = self.sh.cold(sp.messages) if cached == 0 else None
            if cold is not None and text == cold:
                self.st["cold_replies_equal_to_cold_reference"] += 1
            else:
                self.fail("reply-differs", f"{who}: reply {text!r} differs from the reference's {sp.ref!r} "
                                           f"(cached {cached} of {prompt})"
                          + (f" and from its reply without a cache {cold!r}" if cold is not None else ""),
                          agent=sp.agent)
        if cached >= prompt > 0:
            self.fail("cached-all", f"{who}: cached {cached} of a {prompt}-token prompt", agent=sp.agent)
        if sp.what in ("probe", "revisit"):
            if cached:
                kind = "isolation" if sp.what == "probe" else "came-back"
                self.fail(kind, f"{who}: a new or erased id was served {cached} cached tokens", agent=sp.agent)
            return
        if not sp.need:
            return
        self.st["turns_checked" if sp.k else "fork_first_checked"] += 1
        if sp.k and sp.agent in self.restarted:
            self.st["turns_checked_across_a_restart"] += 1
        if cached >= sp.need:
            return
        owner, seq = sp.excuse
        if self.elog.since(owner, seq):
            self.st["losses_excused_by_erasure"] += 1
            if owner == sp.agent and sp.conv is not None:
                sp.conv.forget()
            return
        stats = {}
        try:
            s = status(self.srv)
            stats = {k: s.get(k) for k in ("budget_erasures", "ttl_erasures", "unsaved_blocks_dropped",
                                           "evicted_agents", "bad_blocks", "saves_dropped")}
        except Exception:
            pass
        what = (f"its acknowledged turn {sp.k - 1}" if sp.k else f"the turn of {owner} it forked from")
        # The log says when the hot budget dropped a turn whose save was still queued (the same turn the
        # response then acknowledged as durable): named apart, it is a failure all the same.
        dropped = any(a == owner and at >= seq for a, at in self.elog.uncached)
        self.fail(("lost-turn" if sp.k else "fork-lost") + (":evicted-while-saving" if dropped else ""),
                  f"{who}: cached {cached} < {sp.need} tokens of {what}"
                  + (" (its first turn since a restart)" if sp.agent in self.restarted else "")
                  + f"; no erasure of {owner} logged; stats {stats}", agent=sp.agent)

    # ---- steps --------------------------------------------------------------------------------

    def new_conv(self, parent: Optional[IConv] = None) -> IConv:
        agent = f"i{self.next_id}"
        self.next_id += 1
        if parent is None:
            c = IConv(agent, [{"role": "system", "content": self.rng.choice(I_DOCS)}], agent)
        else:
            c = IConv(agent, list(parent.messages), parent.ref_key, parent.agent)
            if parent.last_prompt:
                c.from_parent = (parent.last_prompt, parent.agent, parent.acks[-1][1])
        self.convs[agent] = c
        return c

    def active(self) -> list[IConv]:
        return [c for c in self.convs.values() if c.history_turns < I_MAX_TURNS]

    def pick(self, with_history: bool = False, room: bool = False) -> Optional[IConv]:
        """A conversation at random: one with a turn of its own (`with_history`), or one that may take
        another turn (`room`, or neither)."""
        pool = [c for c in self.convs.values() if c.turns > 0] if with_history else self.active()
        if room:
            pool = [c for c in pool if c.history_turns < I_MAX_TURNS]
        return self.rng.choice(pool) if pool else None

    def pick_or_new(self) -> IConv:
        active = self.active()
        if len(active) < I_ACTIVE[0] or (len(active) < I_ACTIVE[1] and self.rng.random() < 0.15):
            return self.new_conv()
        return self.rng.choice(active)

    def turn_spec(self, c: IConv, what: str = "turn", k: Optional[int] = None, tag: str = "") -> ISpec:
        """A request of `c` after its first `k` turns (default: all of them: its next turn)."""
        k = c.turns if k is None else k
        return ISpec(what, c.agent, c.messages_at(k, tag), c.ref_key, c, c.parent, k)

    def finish_turns(self, specs: list[ISpec]) -> None:
        """Acknowledged turns move their conversations on (one per conversation)."""
        done: set[str] = set()
        for sp in specs:
            if sp.result[0] == "ok" and sp.conv is not None and sp.conv.agent not in done \
                    and self.convs.get(sp.conv.agent) is sp.conv:
                done.add(sp.conv.agent)
                sp.conv.complete(sp.k, sp.messages, sp.ref, sp.result[1][2], sp.sent_seq)
                self.restarted.discard(sp.conv.agent)
                self.st["longest_history_turns"] = max(self.st["longest_history_turns"], sp.conv.history_turns)
                with self._lock:
                    self.max_footprint = max(self.max_footprint, sp.conv.footprint())
                    self.max_seq = max(self.max_seq, sp.conv.seqs[-1])

    def do_step(self, op: str) -> str:
        """Run one step; returns its description for the step list."""
        rng = self.rng
        if op == "turn":
            c = self.pick_or_new()
            specs = [self.turn_spec(c)]
            self.run_specs(specs)
            self.finish_turns(specs)
            return f"turn {c.agent}" + (f"<-{c.parent}" if c.parent else "") + f" t{c.turns}"
        if op in ("concurrent", "kill-mid"):
            convs = list({id(c): c for c in (self.pick_or_new() for _ in range(rng.randint(2, 3)))}.values())
            specs = [self.turn_spec(c) for c in convs]
            kill_after = rng.uniform(0.0, 0.6) if op == "kill-mid" else None
            self.run_specs(specs, kill_after)
            self.finish_turns(specs)
            return f"{op} " + ",".join(sp.agent for sp in specs) + (f" kill@{kill_after:.2f}s" if kill_after else "")
        if op == "fork":
            parent = self.pick(with_history=True, room=True)  # the child's turns count its parent's
            if parent is None:
                return self.do_step("turn")
            child = self.new_conv(parent)
            specs = [self.turn_spec(child, "fork")]
            self.run_specs(specs)
            self.finish_turns(specs)
            return f"fork {child.agent}<-{parent.agent}"
        if op == "branch":
            c = self.pick(with_history=True)
            if c is None or c.history_turns >= I_MAX_TURNS:
                return self.do_step("turn")
            specs = [self.turn_spec(c, "branch", tag=f"-b{i}") for i in range(rng.randint(2, 3))]
            self.run_specs(specs)
            self.finish_turns(specs)  # the conversation goes on along the first branch answered
            return f"branch {c.agent} x{len(specs)}"
        if op == "rewind":  # an earlier message edited: a new branch from an earlier turn (a fork's own
            c = self.pick(with_history=True)  # first message: a branch that ties with its parent's)
            if c is None:
                return self.do_step("turn")
            k = 0 if c.parent and rng.random() < 0.5 else rng.randrange(c.turns)
            specs = [self.turn_spec(c, "rewind", k, tag=f"-r{self.step}")]
            self.run_specs(specs)
            self.finish_turns(specs)
            return f"rewind {c.agent} to turn {k}"
        if op == "erase":
            c = self.pick(with_history=True)
            if c is None:
                return self.do_step("turn")
            self.erase(c)
            return f"erase {c.agent}"
        if op == "revisit":
            if not self.erased:
                return self.do_step("fork")
            agent = rng.choice(sorted(self.erased))
            old = self.erased.pop(agent)[: 1 + 2 * (I_MAX_TURNS - 1)]  # its start, if long: the bound holds
            c = IConv(agent, old, f"revisit-{agent}")  # a new conversation of the same id
            self.convs[agent] = c
            specs = [self.turn_spec(c, "revisit")]
            self.run_specs(specs)
            self.finish_turns(specs)
            self.st["erased_revisited"] += 1
            return f"revisit {agent}"
        if op in ("pin", "unpin"):
            c = self.pick(with_history=True) if op == "pin" else \
                (self.convs.get(rng.choice(sorted(self.pinned))) if self.pinned else None)
            if c is None:
                return self.do_step("turn")
            self.pin(c, op == "pin")
            return f"{op} {c.agent}"
        if op == "probe":
            src = self.pick(with_history=True, room=True)  # the probe's turn counts the source's
            if src is None:
                return self.do_step("turn")
            probe = self.new_conv()
            probe.messages, probe.ref_key = list(src.messages), src.ref_key
            probe.base = len(probe.messages)
            specs = [self.turn_spec(probe, "probe")]
            self.run_specs(specs)
            self.finish_turns(specs)
            self.st["probes"] += 1
            return f"probe {probe.agent} on {src.agent}'s history"
        if op == "anonymous":
            src = self.pick(with_history=True)
            if src is None:
                return self.do_step("turn")
            self.run_specs([ISpec("anonymous", None, src.messages_at(src.turns, "-anon"), src.ref_key)])
            return f"anonymous on {src.agent}'s history"
        if op == "kill":
            self.restart("kill")
            return "kill"
        if op == "write-point":
            point = rng.randint(1, 60)
            self.restart("kill", kill_at=point)
            return f"write-point kill@{point} (restarted)"
        raise ValueError(op)

    def admin(self, what: str, agent: str, path: str, method: str) -> Optional[tuple[int, bytes]]:
        """An admin request (`what`, as failures name it) about `agent`: (status, body), or None when it
        hung (a restart follows) or failed to connect, either recorded as a failure."""
        try:
            return request(self.srv.url, path, b"", method=method, timeout=I_TIMEOUT_S)
        except (socket.timeout, TimeoutError):
            self.fail("hung", f"{what} did not answer in {I_TIMEOUT_S} s", agent=agent)
            self.pending_restart = "after-hung"
        except OSError as e:
            self.fail("admin", f"{what}: {e!r}", agent=agent)
        return None

    def erase(self, c: IConv) -> None:
        self.refresh_log()
        answer = self.admin(f"DELETE /v1/agents/{c.agent}", c.agent, f"/v1/agents/{c.agent}", "DELETE")
        if answer is None:
            return
        code, raw = answer
        self.refresh_log()
        if code == 404 and c.last_prompt and not self.elog.since(c.agent, c.acks[-1][1]):
            self.fail("admin", f"DELETE /v1/agents/{c.agent} answered 404 for an agent with an acknowledged turn "
                               "and no erasure logged", agent=c.agent)
        elif code not in (200, 404):
            self.fail("admin", f"DELETE /v1/agents/{c.agent} answered {code}: {raw[:200]!r}", agent=c.agent)
        if code == 200:
            self.st["erasures_requested"] += 1
            if request(self.srv.url, f"/v1/agents/{c.agent}", b"", method="GET", timeout=I_TIMEOUT_S)[0] != 404:
                self.fail("came-back", f"GET /v1/agents/{c.agent} right after its DELETE is not 404", agent=c.agent)
            left = manifests_of(self.root, c.agent)
            if left:
                self.fail("came-back", f"a manifest of {c.agent} is on disk after its DELETE: {left}", agent=c.agent)
        self.gone(c)

    def gone(self, c: IConv) -> None:
        """`c` was erased (or its DELETE found nothing): its history waits for a revisit."""
        del self.convs[c.agent]
        self.pinned.discard(c.agent)
        self.erased[c.agent] = c.messages

    def pin(self, c: IConv, on: bool) -> None:
        self.refresh_log()
        answer = self.admin(f"pin {c.agent}", c.agent, f"/v1/agents/{c.agent}/pin", "PUT" if on else "DELETE")
        if answer is None:
            return
        code = answer[0]
        if code == 200:
            (self.pinned.add if on else self.pinned.discard)(c.agent)
            self.count("pins" if on else "unpins")
        elif not (code == 404 and (not c.last_prompt or self.elog.since(c.agent, c.acks[-1][1]))):
            self.fail("admin", f"{'PUT' if on else 'DELETE'} /v1/agents/{c.agent}/pin answered {code}", agent=c.agent)

    def run(self, n_steps: int, progress: Optional[Callable[[dict], None]] = None,
            every: int = I_PROGRESS_STEPS) -> dict:
        """`n_steps` steps, then the final check; `progress` gets the figures so far every `every` steps
        (a partial result: no final check). Stopped by KeyboardInterrupt (SIGINT, or SIGTERM as
        `reliability` turns it into one), it returns the figures of the steps done, marked stopped."""
        self._late: list[tuple[int, str]] = []
        self._over: list[tuple[int, str]] = []
        watcher = threading.Thread(target=self.watch, name="interactions-watch", daemon=True)
        ops, weights = zip(*I_OPS)
        try:
            self.sh.ref  # the reference first: its start-up is not part of any lifetime
            self.start()
            watcher.start()
            for self.step in range(n_steps):
                if not self.alive():  # it killed itself at a write point between steps, or crashed
                    if self.fault_kill:
                        self.count("write_point_kills")
                        self.restart("write-point")
                    else:
                        self.fail("died", f"the server died between steps: {self.srv.log_tail(8)[-600:]}")
                        self.restart("after-died")
                missing = [k for k in I_COVER if k not in self.st["ops"]]
                if missing and n_steps - self.step <= len(missing):
                    self.op = op = missing[0]
                else:
                    self.op = op = self.rng.choices(ops, weights)[0]
                desc = self.do_step(op)
                self.count("ops", desc.split()[0])  # what it did (an op with nothing to act on falls back)
                self.steps.append(f"{self.step} {desc}")
                if self.pending_restart:
                    mode, self.pending_restart = self.pending_restart, None
                    self.restart(mode)
                self.refresh_log()
                self.drain_watch()
                if self.step == 4:
                    self.rss_baseline = self.rss.rss()
                if progress is not None and (self.step + 1) % every == 0 and self.step + 1 < n_steps:
                    progress(self.result(self.step + 1, stopped=True))
            # The last lifetime: a restart, then every conversation's next turn is checked.
            self.op = "final-check"
            self.restart("final-check")
            live = [c for c in self.convs.values() if c.last_prompt]
            for k in range(0, len(live), 3):
                specs = [self.turn_spec(c) for c in live[k:k + 3]]
                self.run_specs(specs)
                self.finish_turns(specs)
                if self.pending_restart:
                    mode, self.pending_restart = self.pending_restart, None
                    self.restart(mode)
            self.steps.append(f"{n_steps} final-check of {len(live)} agents")
            self.count("lifetimes", "end")
            self.refresh_log()
            self.drain_watch()
        except Abort:
            n_steps = self.step
        except KeyboardInterrupt:  # the steps done so far (a step cut short is not counted)
            return self.result(min(len(self.steps), n_steps), stopped=True)
        finally:
            self._stop.set()
            self.srv.stop(signal.SIGKILL)
            if self.rss.pid is not None:
                self.rss.stop()
        return self.result(n_steps)

    def result(self, n_steps: int, stopped: bool = False) -> dict:
        """The figures of the first `n_steps` steps; `stopped`: the run ends (or is looked at) before its
        final check, which is then not part of them (nothing is added to the failures themselves)."""
        failures = list(self.failures)
        bound = (self.rss_baseline or self.rss.peak) + int((I_HOT_MB + OVERHEAD_MB) * 2**20)
        if self.rss.peak > bound:
            failures.append({"kind": "rss-over", "seed": self.seed, "step": n_steps, "op": "", "steps": [],
                             "problem": f"RSS peak {self.rss.peak >> 20} MB over {bound >> 20} MB (post-warm-up "
                                        f"{self.rss_baseline >> 20} + hot_mb + {OVERHEAD_MB})"})
        if n_steps and not stopped and self.st["turns_checked_across_a_restart"] == 0:
            failures.append({"kind": "checked-nothing", "seed": self.seed, "step": n_steps, "op": "", "steps": [],
                             "problem": "no acknowledged turn was checked across a restart"})
        kinds: dict[str, dict] = {}
        for f in failures:
            k = kinds.setdefault(f["kind"], {"count": 0, "first_step": f["step"], "first": f})
            k["count"] += 1
        # the first failure of each kind first, so the report shows every kind
        firsts = [k["first"] for k in kinds.values()]
        cases = firsts + [f for f in failures if f not in firsts]
        budget = sum(1 for _, why in self.elog.events if why == "disk budget")
        ttl = sum(1 for _, why in self.elog.events if why == "ttl")
        return {"trials": n_steps, "failures": len(failures), "failure_cases": cases[:20], "seed": self.seed,
                "stopped_before_final_check": stopped,
                "failure_kinds": {k: {"count": v["count"], "first_step": v["first_step"]} for k, v in kinds.items()},
                **self.st, "budget_erasures_logged": budget, "ttl_erasures_logged": ttl,
                "agents": self.next_id, "hot_mb": I_HOT_MB, "disk_mb": I_DISK_MB, "ttl_hours": I_TTL_HOURS,
                "block_size": OPTIONS["block_size"], "rss_after_warmup_mb": round(self.rss_baseline / 2**20, 1),
                "rss_peak_mb": round(self.rss.peak / 2**20, 1), "rss_bound_mb": round(bound / 2**20, 1),
                "steps": self.steps[:3000]}


def interactions_campaign(trials: int, seed: int, work: Path, progress: Optional[Callable[[dict], None]] = None,
                          every: int = I_PROGRESS_STEPS) -> dict:
    """`trials` random steps mixing turns, forks, concurrent branches, erasures, pins, probes and SIGKILL
    restarts on one server under tight hot and disk budgets, every answer compared with a never-killed
    reference server; then one more restart and every conversation's next turn checked. `progress`
    gets the figures so far every `every` steps (a long run stopped keeps them)."""
    return _Interactions(seed, work).run(trials, progress, every)
