"""End to end, features used together: forks, branches, erasure, pins, hot and disk budgets, slow
disks and SIGKILL restarts on real `vllm-mlx serve --continuous-batching --cache-backend persist_q4`
subprocesses (micro local llama), driven by the official openai client. Each test is a scenario a
user runs, most of them a defect found where features meet (each test's docstring names it).

Tolerances:
- replies: greedy decoding with one BLAS thread per server (BATCH_INVARIANT_ENV), so a reused 4-bit
  prefix gives exactly the cold prefill's tokens (tests/test_pool.py: 0.0 logit difference on
  single-threaded BLAS); replies are compared as equal text.
- reuse: a turn's whole previous prompt is a prefix of its next prompt, so the next turn's
  cached_tokens must be >= the previous turn's prompt_tokens (exact; at least one token is always
  left to prefill).
- /health: every poll answers 200 within HEALTH_LIMIT_S = 1 s, polled every 0.1 s from a thread
  for the whole scenario (paused only while the test itself restarts the server).
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import openai
import pytest

from vllm_mlx_persist.tools.reliability.server_kit import BATCH_INVARIANT_ENV, user_text
from vllm_mlx_persist.tools.serving import Server

MAX_TOKENS = 8
BLOCK = 32
# Matching by text off: replies are compared with a cold agent on the same re-rendered messages,
# i.e. the same prompt tokens (see tests/test_e2e_server.py).
# key_format q4: auto's choice here, without calibrating (tests/test_e2e_server.py says why).
OPTIONS = {"block_size": BLOCK, "hot_mb": 64, "match_text": False, "key_format": "q4"}
REQUEST_TIMEOUT_S = 30.0  # a micro-model turn takes well under a second; past this it is a hang
HEALTH_LIMIT_S = 1.0
HUNG_S = 15.0  # where a scenario goes on after a hung request: shorter, the answer itself takes < 1 s
TINY_HOT_MB = 0.002  # 2 kB: less than one 32-token block of the micro llama (5 kB), so every lookup
# and every commit runs the hot budget's eviction loop
DOC = [{"role": "system", "content": "shared document: " + user_text("doc", 9, 60)}]


@dataclass
class Reply:
    text: str
    cached: int
    prompt: int


def ask(server: Server, messages: list[dict], agent: Optional[str] = None, fork_from: Optional[str] = None,
        timeout: float = REQUEST_TIMEOUT_S) -> Reply:
    """One greedy chat completion; any failure (HTTP error, time-out) is an AssertionError."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0, timeout=timeout)
    meta = {k: v for k, v in (("agent_id", agent), ("fork_from", fork_from)) if v is not None}
    try:
        r = client.chat.completions.create(model=server.model, messages=messages, max_tokens=MAX_TOKENS,
                                           temperature=0.0, **({"metadata": meta} if meta else {}))
    except openai.APIError as e:
        raise AssertionError(f"request of agent {agent!r} (fork_from {fork_from!r}) failed: {e!r}\n"
                             f"{log_tail(server)}") from None
    details = r.usage.prompt_tokens_details
    return Reply(r.choices[0].message.content or "", (details.cached_tokens if details else 0) or 0,
                 r.usage.prompt_tokens)


def log_tail(server: Server, n: int = 12) -> str:
    """The server log's last lines, without the health watch's polls."""
    lines = [line for line in server.log_tail(400).splitlines() if "GET /health" not in line]
    return "\n".join(lines[-n:])


def admin(server: Server, method: str, path: str) -> tuple[int, dict]:
    req = urllib.request.Request(server.url + path, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def listed(server: Server) -> set[str]:
    """Every agent id GET /v1/agents lists (all pages)."""
    ids: set[str] = set()
    after = ""
    while True:
        page = admin(server, "GET", "/v1/agents?limit=1000" + (f"&after={after}" if after else ""))[1]
        ids |= {a["id"] for a in page["data"]}
        if not page["has_more"]:
            return ids
        after = page["last_id"]


def cache_stats(server: Server) -> dict:
    return server.get_json("/v1/status").get("cache") or {}


def erased_in_log(server: Server, why: str = "disk budget") -> list[str]:
    """Agents the server's log says were erased for `why` (the persister logs every erasure)."""
    text = server.log_path.read_text(errors="replace")
    return re.findall(rf"erased agent '([^']+)' \({re.escape(why)}\)", text)


def files_naming(root: Path, agent_id: str) -> list[str]:
    """Files under `root` holding the agent's id as a JSON string, each with the start of its text."""
    needle = f'"{agent_id}"'.encode()
    return [f"{p.relative_to(root)}: {p.read_bytes()[:240]!r}" for p in root.rglob("*")
            if p.is_file() and needle in p.read_bytes()]


def manifests_of(root: Path, agent_id: str) -> list[str]:
    """Manifests (of any model under `root`) whose agent is `agent_id`."""
    out = []
    for p in root.glob("*/agents/*.json"):
        try:
            if json.loads(p.read_bytes()).get("namespace") == agent_id:
                out.append(str(p.relative_to(root)))
        except ValueError:
            pass
    return out


def then(messages: list[dict], reply: Reply, user: str) -> list[dict]:
    """The conversation continued: the reply, then a new user message."""
    return messages + [{"role": "assistant", "content": reply.text}, {"role": "user", "content": user}]


class HealthWatch:
    """Polls GET /health from a thread for a whole scenario; every answer must be a 200 within
    `limit_s`. `paused()` covers the windows where the test itself has the server down."""

    def __init__(self, server: Server, limit_s: float = HEALTH_LIMIT_S, every_s: float = 0.1):
        self.server, self.limit_s, self.every_s = server, limit_s, every_s
        self.polls, self.worst_s = 0, 0.0
        self.late: list[str] = []  # what went wrong, with the time into the scenario
        self._pause = threading.Event()
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="health-watch", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            if self._pause.is_set():
                continue
            url = self.server.url + "/health"
            t = time.monotonic()
            try:
                with urllib.request.urlopen(url, timeout=self.limit_s) as r:
                    ok = r.status == 200
                    r.read()
                problem = None if ok else f"status {r.status}"
            except Exception as e:  # a time-out or a refused connection
                problem = repr(e)[:120]
            dt = time.monotonic() - t
            if self._pause.is_set():  # the test took the server down meanwhile
                continue
            self.polls += 1
            self.worst_s = max(self.worst_s, dt)
            if problem is None and dt > self.limit_s:
                problem = f"answered in {dt:.2f} s"
            if problem is not None:
                self.late.append(f"t={t - self._t0:.1f}s: {problem}")

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._pause.set()
        try:
            yield
        finally:
            self._pause.clear()

    def __enter__(self) -> "HealthWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(self.limit_s + 5)

    def check(self) -> None:
        assert self.polls > 0, "the health watch never polled"
        assert not self.late, (f"/health missed its {self.limit_s} s bound {len(self.late)} time(s) of "
                               f"{self.polls}: {self.late[:5]}")


@contextlib.contextmanager
def checked(watch: HealthWatch) -> Iterator[None]:
    """Check the health watch after the scenario, also when the scenario failed (both then show)."""
    try:
        yield
    finally:
        watch.check()


@contextlib.contextmanager
def serving(server: Server) -> Iterator[Server]:
    """Start `server`; always SIGKILL it at the end (a hung server ignores SIGTERM)."""
    server.start()
    try:
        yield server
    finally:
        server.stop(signal.SIGKILL)


def restart(server: Server, watch: Optional[HealthWatch] = None, **options) -> None:
    """SIGKILL the server and start it again on the same root (options replaced by `options`)."""
    ctx = watch.paused() if watch is not None else contextlib.nullcontext()
    with ctx:
        server.stop(signal.SIGKILL)
        server.options = {**server.options, **options}
        server.start()


@pytest.fixture
def llama(model_dir) -> Path:
    return model_dir("llama", "micro", 0)


def new_server(model: Path, tmp_path: Path, name: str = "srv", env: Optional[dict] = None, **options) -> Server:
    root = tmp_path / f"{name}-root"
    return Server(model, tmp_path / f"{name}-home", options={**OPTIONS, "cache_dir": str(root), **options},
                  env={**BATCH_INVARIANT_ENV, **(env or {})})


# ---------------------------------------------------------------------------------------------
# forks under a tight hot budget, across a restart


def test_fork_with_history_restart_and_hot_budget_never_hangs(llama, tmp_path):
    srv = new_server(llama, tmp_path)
    with serving(srv), HealthWatch(srv) as watch, checked(watch):
        parent_msgs = DOC + [{"role": "user", "content": user_text("parent", 0)}]
        parent = ask(srv, parent_msgs, "parent")
        child_msgs = DOC + [{"role": "user", "content": user_text("child", 0)}]
        child = None
        for turn in range(1, 5):  # the child's own history: four turns after its fork
            child = ask(srv, child_msgs, "child", fork_from="parent")
            assert turn == 1 or child.cached > 0
            child_msgs = then(child_msgs, child, user_text("child", turn))
        restart(srv, watch, hot_mb=TINY_HOT_MB)  # everything cold, every request runs the budget loop
        # The child names its parent again: a retry of its first task (a new branch), its history,
        # and the parent's own next turn in between. A hung request does not stop the scenario: the
        # next one shows whether the server still admits requests, and the watch whether it answers.
        failed: list[str] = []

        def attempt(what: str, messages: list[dict], agent: str, fork_from: Optional[str] = None) -> Optional[Reply]:
            try:
                return ask(srv, messages, agent, fork_from, timeout=HUNG_S)
            except AssertionError as e:
                failed.append(f"{what}: {str(e).splitlines()[0]}")
                return None

        retry = attempt("retry", DOC + [{"role": "user", "content": user_text("child", 7)}], "child", "parent")
        after = attempt("parent", then(parent_msgs, parent, user_text("parent", 1)), "parent")
        again = attempt("child", child_msgs, "child", "parent")
        assert not failed, failed
        assert retry.cached > 0 and after.cached >= parent.prompt and again.cached >= child.prompt
        cold = ask(srv, child_msgs, "child-cold")
        assert cold.cached == 0 and cold.text == again.text


def test_fork_child_first_request_with_cold_parent_and_full_hot_tier(llama, tmp_path):
    srv = new_server(llama, tmp_path)
    with serving(srv):
        parent_msgs = DOC + [{"role": "user", "content": user_text("parent", 0)}]
        ask(srv, parent_msgs, "parent")
        # A sibling forked while memory is roomy: what a fork of this document reuses.
        roomy = ask(srv, DOC + [{"role": "user", "content": user_text("child-a", 0)}], "child-a", fork_from="parent")
        assert roomy.cached > 0
        for k in range(3):  # other agents, so the hot tier has more than the parent to give up
            ask(srv, [{"role": "user", "content": user_text(f"other{k}", 0, 80)}], f"other{k}")
        restart(srv, hot_mb=TINY_HOT_MB)  # the parent is cold
        first = ask(srv, DOC + [{"role": "user", "content": user_text("child-b", 0)}], "child-b", fork_from="parent")
        # Both children share the same prefix with the parent (the document, up to "child-" vs
        # "parent"): the same tokens come from the parent whether its blocks were hot or on disk.
        assert first.cached == roomy.cached > 0, (first, roomy)
        cold = ask(srv, DOC + [{"role": "user", "content": user_text("child-b", 0)}], "child-b-cold")
        assert cold.text == first.text


# ---------------------------------------------------------------------------------------------
# disk budget against queued saves


def test_disk_budget_never_deletes_blocks_a_queued_manifest_names(llama, tmp_path):
    slow = tmp_path / "slow-fsync"  # while it exists, every fsync of the store sleeps 0.25 s
    srv = new_server(llama, tmp_path, env={"VLLM_MLX_PERSIST_FAULT": f"sleep=0.25:fsync@{slow}"})
    with serving(srv):
        acked: dict[str, tuple[list[dict], Reply]] = {}  # agent -> (messages, reply) of its last turn
        parent_msgs = DOC + [{"role": "user", "content": user_text("parent", 0)}]
        acked["parent"] = (parent_msgs, ask(srv, parent_msgs, "parent"))
        workers = {}
        for k in range(3):
            msgs = [{"role": "user", "content": user_text(f"x{k}", 0, 60)}]
            r = ask(srv, msgs, f"x{k}")
            acked[f"x{k}"] = (msgs, r)
            workers[f"x{k}"] = then(msgs, r, user_text(f"x{k}", 1, 200))  # a long next turn: many blocks
        used = cache_stats(srv)["disk_bytes"]
        # Room for what is there and a little more: the next long turn forces an erasure, and the
        # least recently used agent, the parent, is the budget's victim.
        restart(srv, disk_mb=(used + 16384) / 2**20, durable_writes=True)
        slow.touch()
        out: dict[str, Reply] = {}
        t = threading.Thread(target=lambda: out.setdefault("x0", ask(srv, workers["x0"], "x0")))
        t.start()
        deadline = time.time() + REQUEST_TIMEOUT_S
        while cache_stats(srv).get("write_queue_bytes", 0) == 0 and time.time() < deadline:
            time.sleep(0.02)  # x0's save is being written (slowly) before the child commits
        child_msgs = DOC + [{"role": "user", "content": user_text("child", 0)}]
        child = ask(srv, child_msgs, "child", fork_from="parent")
        t.join(REQUEST_TIMEOUT_S)
        assert "x0" in out
        assert child.cached > 0  # the fork read the parent's blocks before the budget erased it
        acked["child"] = (child_msgs, child)
        acked["x0"] = (workers["x0"], out["x0"])
        slow.unlink()
        erasures = cache_stats(srv)["budget_erasures"]
        assert erasures > 0 and "parent" in erased_in_log(srv)  # the scenario did erase the parent
        restart(srv)
        on_disk = listed(srv)
        budget_erased = set(erased_in_log(srv))
        lost = []
        for agent, (msgs, reply) in acked.items():
            if agent not in on_disk:
                assert agent in budget_erased, f"{agent} is gone but no erasure says so"
                continue
            nxt = ask(srv, then(msgs, reply, "and then?"), agent)
            if nxt.cached < reply.prompt:
                lost.append(f"{agent}: cached {nxt.cached} < {reply.prompt} of its acknowledged turn")
        assert not lost, lost


def test_turn_acknowledged_while_another_agent_evicts_it_is_reused(llama, tmp_path):
    slow = tmp_path / "slow-fsync"  # the turn's save takes a second or two: still queued when beta comes
    srv = new_server(llama, tmp_path, env={"VLLM_MLX_PERSIST_FAULT": f"sleep=0.2:fsync@{slow}"}, hot_mb=TINY_HOT_MB)
    with serving(srv):
        msgs = [{"role": "user", "content": user_text("alpha", 0, 60)}]
        first = ask(srv, msgs, "alpha")
        msgs = then(msgs, first, user_text("alpha", 1, 60))
        slow.touch()
        out: dict[str, Reply] = {}
        t = threading.Thread(target=lambda: out.setdefault("alpha", ask(srv, msgs, "alpha")))
        t.start()
        deadline = time.time() + REQUEST_TIMEOUT_S
        while cache_stats(srv).get("write_queue_bytes", 0) == 0 and time.time() < deadline:
            time.sleep(0.02)
        ask(srv, [{"role": "user", "content": user_text("beta", 0, 60)}], "beta")  # the hot budget evicts alpha
        t.join(REQUEST_TIMEOUT_S)
        slow.unlink()
        second = out["alpha"]  # acknowledged: with durable_writes, on disk before this answer
        nxt = ask(srv, then(msgs, second, "go on"), "alpha")
        assert nxt.cached >= second.prompt, (nxt, second, cache_stats(srv).get("unsaved_blocks_dropped"))


# ---------------------------------------------------------------------------------------------
# erasure


def test_erasure_holds_across_a_sigkill_even_with_a_turn_being_written(llama, tmp_path):
    """DELETE while the agent's turn is written to a slow disk, then SIGKILL: the agent reuses
    nothing, no manifest of it is left, and its fork child (with which it shares blocks) keeps its
    own turns. (Files naming it at all: test_erasing_a_fork_parent_leaves_no_file_naming_it.)"""
    slow = tmp_path / "slow-fsync"
    srv = new_server(llama, tmp_path, env={"VLLM_MLX_PERSIST_FAULT": f"sleep=0.2:fsync@{slow}"})
    root = Path(srv.options["cache_dir"])
    with serving(srv):
        msgs = DOC + [{"role": "user", "content": user_text("eraseme", 0)}]
        first = ask(srv, msgs, "eraseme")
        child_msgs = DOC + [{"role": "user", "content": user_text("kid", 0)}]
        kid = ask(srv, child_msgs, "kid", fork_from="eraseme")
        assert kid.cached > 0
        slow.touch()
        out: dict[str, Reply] = {}
        second = then(msgs, first, user_text("eraseme", 1, 200))
        t = threading.Thread(target=lambda: out.setdefault("r", ask(srv, second, "eraseme")))
        t.start()
        deadline = time.time() + REQUEST_TIMEOUT_S
        while cache_stats(srv).get("write_queue_bytes", 0) == 0 and time.time() < deadline:
            time.sleep(0.02)
        assert admin(srv, "DELETE", "/v1/agents/eraseme") == (200, {"id": "eraseme", "deleted": True})
        t.join(REQUEST_TIMEOUT_S)
        assert "r" in out  # the request in flight still answers
        slow.unlink()
        assert not manifests_of(root, "eraseme")
        restart(srv)
        assert "eraseme" not in listed(srv) and admin(srv, "GET", "/v1/agents/eraseme")[0] == 404
        assert not manifests_of(root, "eraseme")
        again = ask(srv, second, "eraseme")
        assert again.cached == 0
        nxt = ask(srv, then(child_msgs, kid, "go on"), "kid")
        assert nxt.cached >= kid.prompt


def test_erasing_a_fork_parent_leaves_only_its_childs_link_to_it(llama, tmp_path):
    """DELETE of a fork parent: its manifest and the blocks only it named are gone; the one file that
    still names it is the child's manifest, whose branch links record the parent's id as the seed of
    the shared blocks' ids (docs/operations.md: the shared prefix stays as the child's until the child
    is erased), and the child keeps working."""
    srv = new_server(llama, tmp_path)
    root = Path(srv.options["cache_dir"])
    with serving(srv):
        ask(srv, DOC + [{"role": "user", "content": user_text("mother", 0)}], "mother")
        kid_msgs = DOC + [{"role": "user", "content": user_text("kid", 0)}]
        kid = ask(srv, kid_msgs, "kid", fork_from="mother")
        assert kid.cached > 0
        assert admin(srv, "DELETE", "/v1/agents/mother")[0] == 200
        assert not manifests_of(root, "mother")
        left = files_naming(root, "mother")
        assert [f.split(":")[0] for f in left] == [f.split(":")[0] for f in files_naming(root, "kid")], left
        nxt = ask(srv, then(kid_msgs, kid, "go on"), "kid")
        assert nxt.cached >= kid.prompt


def test_erasure_through_one_model_removes_the_agent_under_every_model(model_dir, tmp_path):
    a_model, b_model = model_dir("llama", "micro", 0), model_dir("llama", "micro", 1)
    root = tmp_path / "shared-root"  # one cache root, one subdirectory per model fingerprint
    a = Server(a_model, tmp_path / "a-home", options={**OPTIONS, "cache_dir": str(root)}, env=BATCH_INVARIANT_ENV)
    b = Server(b_model, tmp_path / "b-home", options={**OPTIONS, "cache_dir": str(root)}, env=BATCH_INVARIANT_ENV)
    msgs = [{"role": "user", "content": user_text("both", 0)}]
    with serving(a):  # one server per root: A, then B
        on_a = ask(a, msgs, "both")
        ask(a, then(msgs, on_a, user_text("both", 1)), "both")
    with serving(b):
        ask(b, msgs, "both")
        assert len({f.split("/")[0] for f in files_naming(root, "both")}) == 2  # a manifest per model
        assert admin(b, "DELETE", "/v1/agents/both")[0] == 200
        left = files_naming(root, "both")
        assert not left, f"files still naming the erased agent: {left}"
    with serving(a):
        assert "both" not in listed(a)
        assert ask(a, then(msgs, on_a, user_text("both", 1)), "both").cached == 0


# ---------------------------------------------------------------------------------------------
# pins against the disk budget


def _fill_until_erasures(srv: Server, n: int, prefix: str, words: int = 60) -> None:
    for k in range(n):
        ask(srv, [{"role": "user", "content": user_text(f"{prefix}{k}", 0, words)}], f"{prefix}{k}")


def test_pinned_agent_outlives_unpinned_ones_under_the_disk_budget(llama, tmp_path):
    srv = new_server(llama, tmp_path)
    with serving(srv):
        msgs = DOC + [{"role": "user", "content": user_text("keeper", 0)}]
        keeper = ask(srv, msgs, "keeper")
        assert admin(srv, "PUT", "/v1/agents/keeper/pin") == (200, {"id": "keeper", "pinned": True})
        one = admin(srv, "GET", "/v1/agents/keeper")[1]["bytes_disk"]
        # room for the pinned agent and about two more: every further agent erases an older one, and
        # the pinned agent is the least recently used of all
        restart(srv, disk_mb=one * 3.2 / 2**20)
        _fill_until_erasures(srv, 8, "filler")
        # the pinned agent is the least recently used: without its pin it would have gone first
        assert cache_stats(srv)["budget_erasures"] >= 2
        assert "keeper" not in erased_in_log(srv)
        restart(srv)
        assert admin(srv, "GET", "/v1/agents/keeper")[1]["pinned"] is True
        nxt = ask(srv, then(msgs, keeper, "and then?"), "keeper")
        assert nxt.cached >= keeper.prompt


def test_pinned_agent_is_never_erased_by_the_disk_budget(llama, tmp_path):
    """An operator lowers disk_mb below what a pinned agent holds: the pin still holds (the budget
    erases every unpinned agent and stays over it), across a restart and further turns."""
    srv = new_server(llama, tmp_path)
    with serving(srv):
        msgs = DOC + [{"role": "user", "content": user_text("keeper", 0)}]
        keeper = ask(srv, msgs, "keeper")
        assert admin(srv, "PUT", "/v1/agents/keeper/pin")[0] == 200
        one = admin(srv, "GET", "/v1/agents/keeper")[1]["bytes_disk"]
        restart(srv, disk_mb=one * 0.5 / 2**20)
        _fill_until_erasures(srv, 2, "other")
        assert cache_stats(srv)["budget_erasures"] >= 1  # the budget did act
        assert "keeper" not in erased_in_log(srv), "the disk budget erased the pinned agent"
        assert "keeper" in listed(srv)
        restart(srv)
        nxt = ask(srv, then(msgs, keeper, "and then?"), "keeper")
        assert nxt.cached >= keeper.prompt


# ---------------------------------------------------------------------------------------------
# /health while the disk is slow


def test_health_answers_while_a_large_turn_is_written_slowly_and_another_agent_is_read(llama, tmp_path):
    slow_write, slow_read = tmp_path / "slow-fsync", tmp_path / "slow-read"
    fault = f"sleep=0.1:fsync@{slow_write};sleep=0.1:read@{slow_read}"
    srv = new_server(llama, tmp_path, env={"VLLM_MLX_PERSIST_FAULT": fault})
    with serving(srv), HealthWatch(srv) as watch, checked(watch):
        reader_msgs = [{"role": "user", "content": user_text("reader", 0, 120)}]
        reader = None
        for turn in range(1, 4):  # a few hundred tokens: a dozen blocks to read back
            reader = ask(srv, reader_msgs, "reader")
            reader_msgs = then(reader_msgs, reader, user_text("reader", turn, 120))
        restart(srv, watch)  # the reader is on disk only
        slow_write.touch()
        slow_read.touch()
        big_msgs = [{"role": "user", "content": " ".join(user_text(f"big{k}", k, 100) for k in range(5))}]
        out: dict[str, Reply] = {}
        t0 = time.monotonic()
        t = threading.Thread(target=lambda: out.setdefault("big", ask(srv, big_msgs, "big", timeout=120)))
        t.start()
        deadline, queued = time.time() + 120, 0
        while not queued and time.time() < deadline:  # until the big turn's blocks are being written
            queued = cache_stats(srv).get("write_queue_bytes", 0)
            time.sleep(0 if queued else 0.02)
        assert queued, "the big turn's blocks were never seen queued for writing"
        got = ask(srv, reader_msgs, "reader", timeout=120)
        t.join(120)
        took = time.monotonic() - t0
        assert "big" in out and out["big"].prompt > 1000
        assert got.cached >= reader.prompt
        assert took > 2.0, f"the slow disk did not slow anything ({took:.1f} s): the fault was not applied"
        slow_write.unlink()
        slow_read.unlink()
        nxt = ask(srv, then(big_msgs, out["big"], "and?"), "big")
        assert nxt.cached >= out["big"].prompt  # the slowly written turn is durable and reused
