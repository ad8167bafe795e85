"""Each patch of the vllm-mlx series on its own, as its pull request would be tested: a copy of the
installed vllm_mlx, reverted to pristine, carrying only that patch (and the seam, for the patches
that build on it), served through a real `vllm-mlx serve` on a tiny model. The backend is
tests/seam_recorder.py, a small real prefix cache (mlx-lm's KVCache) that logs every call the seam
makes, a pluggy plugin implementing every hook the series defines; the 0002 tests need no backend. The
server sees no other plugin (persist_q4, installed in this environment, is hidden from it).

persist_q4 through the whole series is tested by tests/test_e2e_*.py.
"""

from __future__ import annotations

import http.client
import json
import shutil
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator, Optional

import anthropic
import openai
import pytest

from vllm_mlx_persist.tools.serving import Server
from vllm_mlx_persist.tools.upstream.copies import make_tree

RECORDER = Path(__file__).with_name("seam_recorder.py")
# Imported first by the server's Python (it is first on PYTHONPATH): hides the plugins that other
# installed distributions register (persist_q4), so that the server sees the recorder's hooks only.
SITECUSTOMIZE = """\
import importlib.metadata as metadata

_distributions = metadata.distributions


def _without_other_plugins(**kwargs):
    return [d for d in _distributions(**kwargs) if d.metadata["Name"] == "seam-recorder"
            or not any(ep.group == "vllm_mlx.plugins" for ep in d.entry_points)]


metadata.distributions = _without_other_plugins
"""
WORDS = ("a returning agent reads what it read before from the cache and only prefills the new part "
         "of its conversation while the server keeps serving every other agent ").split()


def text(seed: int, n: int = 40) -> str:
    return " ".join(WORDS[(seed * 5 + i) % len(WORDS)] for i in range(n))


_SITES: dict[tuple, Path] = {}  # (numbers, plugins) -> its site, made once per run


def make_site(tmp_path: Path, numbers: tuple[str, ...], plugins: Optional[dict[str, str]] = None) -> Path:
    """A folder to put first on PYTHONPATH: vllm_mlx with only the patches `numbers` of the series
    (in series order; each hunk's exact context is matched where it is, since the patches between
    are absent), the recorder plugin with its entry point, and `plugins` ({module name: source}),
    more plugin modules registered next to it. Made once per run for each (numbers, plugins), left
    unchanged by the servers: tests that share one also share its fork server (tools/serving/forkserver.py),
    whose key is the servers' import-time environment, PYTHONPATH included."""
    key = (numbers, tuple(sorted((plugins or {}).items())))
    if key not in _SITES:
        _SITES[key] = _make_site(tmp_path, numbers, plugins)
    return _SITES[key]


def _make_site(tmp_path: Path, numbers: tuple[str, ...], plugins: Optional[dict[str, str]]) -> Path:
    site = make_tree(tmp_path / "site", numbers)
    shutil.copy(RECORDER, site / RECORDER.name)
    modules = {"recorder": RECORDER.stem}
    for module, source in (plugins or {}).items():
        (site / f"{module}.py").write_text(source)
        modules[module] = module
    info = site / "seam_recorder-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: seam-recorder\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(
        "[vllm_mlx.plugins]\n" + "".join(f"{name} = {module}\n" for name, module in modules.items()))
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return site


class Served:
    """A server running the copy in `site`, the recorder's log and the clients."""

    def __init__(self, srv: Server, log: Path):
        self.srv, self.log = srv, log

    @property
    def openai(self) -> openai.OpenAI:  # the port is known once the server started
        return openai.OpenAI(base_url=self.srv.url + "/v1", api_key="test", max_retries=0, timeout=120)

    def events(self, since: int = 0) -> list[dict]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()][since:]

    def chat(self, messages: list[dict], max_tokens: int = 8, **kw: Any):
        return self.openai.chat.completions.create(model=self.srv.model, messages=messages, max_tokens=max_tokens,
                                                   temperature=0.0, **kw)

    def post(self, path: str, body: dict, headers: Optional[dict] = None) -> tuple[int, dict]:
        req = urllib.request.Request(self.srv.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")


def serve(tmp_path: Path, model: Path, numbers: tuple[str, ...], *, backend: Optional[str] = "recorder",
          options: Optional[dict] = None, extra_args: tuple[str, ...] = (),
          plugins: Optional[dict[str, str]] = None) -> Served:
    site = make_site(tmp_path, numbers, plugins)
    srv = Server(model, tmp_path / "home", backend=backend, options=options, extra_args=extra_args,
                 env={"PYTHONPATH": str(site)})
    return Served(srv, tmp_path / "home" / "seam.jsonl")  # where the recorder writes


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from vllm_mlx_persist.tools.models.build import build_model_dir

    return build_model_dir(tmp_path_factory.mktemp("models") / "llama", arch="llama", size="tiny", seed=0)


@pytest.fixture
def started(request) -> Iterator[list[Served]]:
    """Servers a test starts are stopped after it."""
    servers: list[Served] = []
    yield servers
    for s in servers:
        s.srv.stop()


def start(started: list[Served], served: Served) -> Served:
    started.append(served)
    served.srv.start()
    return served


def wait_for(cond, what: str, timeout: float = 60.0) -> None:
    """Poll `cond` until true; the deadline only turns a hang into a failure."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)


def by_rid(events: list[dict]) -> dict[str, list[str]]:
    calls: dict[str, list[str]] = {}
    for e in events:
        if "rid" in e and e["event"] != "ready_done":
            calls.setdefault(e["rid"], []).append(e["event"])
    return calls


def one(events: list[dict], event: str, rid: str) -> dict:
    found = [e for e in events if e["event"] == event and e.get("rid") == rid]
    assert len(found) == 1, (event, rid, found)
    return found[0]


# --- 0001: the cache-backend seam alone ---------------------------------------------------------


@pytest.fixture(scope="module")
def seam(model, tmp_path_factory) -> Iterator[Served]:
    served = serve(tmp_path_factory.mktemp("seam"), model, ("0001",))
    with served.srv:
        yield served


def test_seam_calls_the_backend_where_the_builtin_caches_are(seam):
    """A miss gets a fresh cache from the backend; a later turn gets its prefix back (and answers as
    a cold prefill does); each request is stored as prompt + output and finished exactly once; the
    MLX calls run on one worker thread, `ready` on another (the event loop)."""
    imported = seam.events()[0]
    site = make_site(seam.log.parent, ("0001",))  # the one this server runs
    assert imported["event"] == "imported" and imported["vllm_mlx"] == str(site / "vllm_mlx" / "__init__.py"), imported
    assert [e["event"] for e in seam.events()][1:3] == ["created", "load"]

    mark = len(seam.events())
    first = [{"role": "user", "content": text(1)}]
    a = seam.chat(first)
    second = first + [{"role": "assistant", "content": a.choices[0].message.content},
                      {"role": "user", "content": text(2)}]
    b = seam.chat(second)
    events = seam.events(mark)
    fetches = [e for e in events if e["event"] == "fetch"]
    assert len(fetches) == 2, events
    rid_a, rid_b = fetches[0]["rid"], fetches[1]["rid"]
    calls = by_rid(events)
    assert calls[rid_a] == ["ready", "fetch", "make_prompt_cache", "store", "finished"], calls
    assert calls[rid_b] == ["ready", "fetch", "store", "finished"], calls  # the hit's cache, no fresh one
    store_a = one(events, "store", rid_a)
    assert store_a["tokens"] == store_a["prompt"] + a.usage.completion_tokens
    assert store_a["prompt"] == a.usage.prompt_tokens == fetches[0]["prompt"]
    assert fetches[0]["hit"] == 0 and store_a["prompt"] - 1 <= fetches[1]["hit"] < fetches[1]["prompt"], fetches
    assert one(events, "finished", rid_b)["aborted"] is False

    worker = {e["thread"] for e in events if e["event"] in ("fetch", "make_prompt_cache", "store", "finished")}
    assert len(worker) == 1, events
    assert {e["thread"] for e in events if e["event"] == "ready"}.isdisjoint(worker)

    # the reused prefix answers as a cold prefill of the same prompt does
    mark = len(seam.events())
    req = urllib.request.Request(seam.srv.url + "/v1/cache", method="DELETE")
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
    cold = seam.chat(second)
    events = seam.events(mark)
    assert events[0]["event"] == "clear", events
    assert [e["hit"] for e in events if e["event"] == "fetch"] == [0]
    assert cold.choices[0].message.content == b.choices[0].message.content


def test_seam_abort_finishes_exactly_once(seam):
    """A client that hangs up mid-stream: the request is aborted and the backend told once."""
    mark = len(seam.events())
    host, port = seam.srv.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": seam.srv.model, "messages": [{"role": "user", "content": text(3)}], "max_tokens": 2000,
            "temperature": 0.0, "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data:")
    conn.sock.shutdown(2)
    conn.close()
    wait_for(lambda: any(e["event"] == "finished" for e in seam.events(mark)), "the abort's finished")
    (fetch,) = [e for e in seam.events(mark) if e["event"] == "fetch"]
    # A later request through the same worker, finished: a second call for the aborted one (a later
    # scheduler step's) would have come before it.
    seam.chat([{"role": "user", "content": text(7)}])
    wait_for(lambda: any(e["event"] == "finished" and e.get("rid") != fetch["rid"] for e in seam.events(mark)),
             "the next request's finished")
    events = seam.events(mark)
    later = [e for e in events if e["event"] == "fetch" and e["rid"] != fetch["rid"]]
    assert len(later) == 1 and one(events, "finished", later[0]["rid"])["aborted"] is False, events
    finished = one(events, "finished", fetch["rid"])
    assert finished["aborted"] is True, events
    assert not any(e["event"] == "store" and e.get("rid") == fetch["rid"] for e in events), events


def test_seam_saves_then_closes_at_shutdown(seam):
    """Every fetched request was finished exactly once; on SIGTERM the backend saves, then is
    closed, off the worker thread."""
    seam.srv.stop(signal.SIGTERM)
    events = seam.events()
    for rid, calls in by_rid(events).items():
        if "fetch" in calls:
            assert calls.count("finished") == 1, (rid, calls)
    names = [e["event"] for e in events]
    assert names[-2:] == ["save", "close"], names[-5:]
    worker = {e["thread"] for e in events if e["event"] == "fetch"}
    assert events[-1]["thread"] not in worker


def test_seam_holds_a_response_until_its_store_is_durable(tmp_path, model, started):
    """`ready` gates admission and a `store` future holds the final output (streamed or not)."""
    s = start(started, serve(tmp_path, model, ("0001",), options={"ready_delay_s": 0.7, "durable_delay_s": 1.5}))
    t0 = time.monotonic()
    r = s.chat([{"role": "user", "content": text(4)}])
    t1 = time.monotonic()
    events = s.events()
    (fetch,) = [e for e in events if e["event"] == "fetch"]
    rid = fetch["rid"]
    assert one(events, "ready", rid)["t"] < one(events, "ready_done", rid)["t"] <= fetch["t"]
    assert one(events, "store", rid)["t"] < one(events, "durable", rid)["t"] <= t1
    assert t1 - t0 >= 0.7 + 1.5 and r.choices[0].message.content is not None

    mark = len(events)
    stream = s.chat([{"role": "user", "content": text(5)}], stream=True)
    chunks = list(stream)
    t_end = time.monotonic()
    assert chunks and chunks[-1].choices[0].finish_reason is not None
    (fetch,) = [e for e in s.events(mark) if e["event"] == "fetch"]
    assert one(s.events(mark), "durable", fetch["rid"])["t"] <= t_end


def test_seam_timeouts_bound_ready_and_the_durable_hold(tmp_path, model, started):
    s = start(started, serve(tmp_path, model, ("0001",), options={
        "ready_delay_s": 60, "ready_timeout_s": 0.3, "durable_delay_s": 60, "durable_timeout_s": 0.3}))
    t0 = time.monotonic()
    s.chat([{"role": "user", "content": text(6)}])
    assert time.monotonic() - t0 < 30
    names = [e["event"] for e in s.events()]
    assert "fetch" in names and "store" in names and "ready_done" not in names and "durable" not in names
    log = s.srv.log_tail(400)
    assert "[cache_backend] ready:" in log and "[cache_backend] durable:" in log, log


@pytest.mark.parametrize("backend, options, message", [
    ("recorder", {"refuse": "the recorder refuses this model"}, "the recorder refuses this model"),
    ("recorder_incomplete", None, "Cache backend 'recorder_incomplete' lacks durable_timeout_s, ready"),
    # only the recorder's backends are registered: persist_q4's plugin is hidden (SITECUSTOMIZE)
    ("no_such_backend", None, "unknown --cache-backend 'no_such_backend'\n"
                              "Registered cache backends: recorder, recorder_incomplete"),
])
def test_seam_refusals_stop_the_server_at_startup(tmp_path, model, backend, options, message):
    s = serve(tmp_path, model, ("0001",), backend=backend, options=options)
    with pytest.raises(RuntimeError, match="server exited") as e:
        s.srv.start(timeout=120)
    assert message in str(e.value), str(e.value)
    assert "Uvicorn running" not in str(e.value)


MISSPELLED = """\
import pluggy


@pluggy.HookimplMarker("vllm_mlx")
def vllm_mlx_cache_backends(name):  # the hookspec takes no argument
    return {}
"""


def test_seam_refuses_a_plugin_that_does_not_match_its_hookspec(tmp_path, model):
    """pluggy checks each hook implementation against its spec as the plugin is loaded."""
    s = serve(tmp_path, model, ("0001",), plugins={"seam_misspelled": MISSPELLED})
    with pytest.raises(RuntimeError, match="server exited") as e:
        s.srv.start(timeout=120)
    assert "PluginValidationError: Plugin 'seam_misspelled' for hook 'vllm_mlx_cache_backends'" in str(e.value)
    assert "Loading model" not in str(e.value)


def test_seam_without_cache_backend_loads_no_plugin(tmp_path, model, started):
    s = start(started, serve(tmp_path, model, ("0001",), backend=None))
    assert s.chat([{"role": "user", "content": text(7)}]).choices[0].message.content is not None
    assert not s.log.exists(), s.events()  # the recorder module was never imported
    assert "cache_backend" not in s.srv.get_json("/health")


# --- 0002: cached-token usage alone, with vllm-mlx's built-in prefix cache ----------------------


def test_usage_reports_cached_tokens_of_the_builtin_cache(tmp_path, model, started):
    s = start(started, serve(tmp_path, model, ("0002",), backend=None))
    assert not (make_site(tmp_path, ("0002",)) / "vllm_mlx" / "cache_backend.py").exists()
    # vllm-mlx keeps entries of at least 128 tokens (MemoryCacheConfig.min_prefix_tokens)
    messages = [{"role": "user", "content": text(8, 80)}]
    a = s.chat(messages)
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    messages += [{"role": "assistant", "content": a.choices[0].message.content},
                 {"role": "user", "content": text(9)}]
    b = s.chat(messages)
    assert 0 < b.usage.prompt_tokens_details.cached_tokens < b.usage.prompt_tokens, b.usage

    # streamed, with stream_options.include_usage
    messages += [{"role": "assistant", "content": b.choices[0].message.content},
                 {"role": "user", "content": text(10)}]
    chunks = list(s.chat(messages, stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens, usage

    # Anthropic: input_tokens + cache_read_input_tokens is the whole prompt
    client = anthropic.Anthropic(base_url=s.srv.url, api_key="test", max_retries=0, timeout=120)
    messages += [{"role": "assistant", "content": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)},
                 {"role": "user", "content": text(11)}]
    m = client.messages.create(model=s.srv.model, messages=messages, max_tokens=8, extra_body={"temperature": 0.0})
    assert m.usage.cache_read_input_tokens > 0 and m.usage.input_tokens > 0, m.usage
    messages += [{"role": "assistant", "content": m.content[0].text if m.content else ""},
                 {"role": "user", "content": text(12)}]
    with client.messages.stream(model=s.srv.model, messages=messages, max_tokens=8,
                                extra_body={"temperature": 0.0}) as stream:
        final = stream.get_final_message()
    assert final.usage.cache_read_input_tokens > 0 and final.usage.input_tokens > 0, final.usage

    # completions and the Responses API
    prompt = text(13, 80)
    first = s.openai.completions.create(model=s.srv.model, prompt=prompt, max_tokens=4, temperature=0.0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = s.openai.completions.create(model=s.srv.model, prompt=prompt + " " + text(14), max_tokens=4,
                                        temperature=0.0)
    assert 0 < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens, again.usage
    r1 = s.openai.responses.create(model=s.srv.model, input=text(15, 80), max_output_tokens=4, temperature=0.0)
    assert r1.usage.input_tokens_details.cached_tokens == 0
    r2 = s.openai.responses.create(model=s.srv.model, input=[
        {"role": "user", "content": text(15, 80)}, {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": text(16)}], max_output_tokens=4, temperature=0.0)
    assert 0 < r2.usage.input_tokens_details.cached_tokens < r2.usage.input_tokens, r2.usage


# --- 0003: the cache namespace, on the seam -----------------------------------------------------


def test_namespace_reaches_the_backend_from_every_route(tmp_path, model, started):
    s = start(started, serve(tmp_path, model, ("0001", "0003")))
    msgs = [{"role": "user", "content": text(17)}]
    expected: list[tuple[str, Optional[str]]] = []

    s.chat(msgs, extra_headers={"X-Test-Namespace": "alice"})
    expected.append(("/v1/chat/completions", "alice"))
    list(s.chat(msgs, stream=True, extra_headers={"X-Test-Namespace": "alice-stream"}))
    expected.append(("/v1/chat/completions", "alice-stream"))
    s.chat(msgs, extra_body={"prompt_cache_key": "bob"})  # the resolver abstains: prompt_cache_key
    expected.append(("/v1/chat/completions", "bob"))
    s.chat(msgs)
    expected.append(("/v1/chat/completions", None))
    s.openai.completions.create(model=s.srv.model, prompt=text(18), max_tokens=4,
                                extra_headers={"X-Test-Namespace": "carol"})
    expected.append(("/v1/completions", "carol"))
    s.openai.responses.create(model=s.srv.model, input=text(19), max_output_tokens=4,
                              extra_body={"prompt_cache_key": "dave"})
    expected.append(("/v1/responses", "dave"))
    client = anthropic.Anthropic(base_url=s.srv.url, api_key="test", max_retries=0, timeout=120)
    client.messages.create(model=s.srv.model, messages=msgs, max_tokens=4,
                           extra_headers={"X-Test-Namespace": "erin"})
    expected.append(("/v1/messages", "erin"))

    fetched = [e["ns"] for e in s.events() if e["event"] == "fetch"]
    assert fetched == [ns for _, ns in expected], fetched
    resolved = [(e["endpoint"], e["ns"]) for e in s.events() if e["event"] == "namespace"]
    assert resolved == [(ep, ns) for ep, ns in expected if ns not in ("bob", "dave", None)], resolved

    # the resolver's ValueError is a 400 and its PermissionError a 403 in each API's error shape, and
    # nothing is queued
    mark = len(s.events())
    code, body = s.post("/v1/chat/completions", {"model": s.srv.model, "messages": msgs, "max_tokens": 4},
                        {"X-Test-Namespace": "bad"})
    assert code == 400 and body["error"]["type"] == "BadRequestError" and "refuses" in body["error"]["message"]
    code, body = s.post("/v1/messages", {"model": s.srv.model, "messages": msgs, "max_tokens": 4},
                        {"X-Test-Namespace": "bad"})
    assert code == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    code, body = s.post("/v1/completions", {"model": s.srv.model, "prompt": text(18), "max_tokens": 4},
                        {"X-Test-Namespace": "secret"})
    assert code == 403 and body["error"]["type"] == "PermissionDeniedError" and "forbids" in body["error"]["message"]
    code, body = s.post("/v1/messages", {"model": s.srv.model, "messages": msgs, "max_tokens": 4},
                        {"X-Test-Namespace": "secret"})
    assert code == 403 and body["error"]["type"] == "permission_error", body
    assert not [e for e in s.events(mark) if e["event"] == "fetch"]


# --- 0004 and 0005, each on the seam ------------------------------------------------------------


def test_health_shows_the_backend_health(tmp_path, model, started):
    s = start(started, serve(tmp_path, model, ("0001", "0004")))
    assert s.srv.get_json("/health")["cache_backend"] == {"backend": "recorder", "entries": 0}
    s.chat([{"role": "user", "content": text(20)}])
    health = s.srv.get_json("/health")
    assert health["cache_backend"] == {"backend": "recorder", "entries": 1} and health["status"] == "healthy"


def test_backend_routes_are_mounted_behind_the_api_key(tmp_path, model, started):
    s = start(started, serve(tmp_path, model, ("0001", "0005"), extra_args=("--api-key", "sesame")))

    def get(path: str, key: Optional[str]) -> int:
        req = urllib.request.Request(s.srv.url + path, headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    assert get("/v1/recorder", "sesame") == 200
    assert get("/v1/recorder", None) == 401 and get("/v1/recorder", "wrong") == 401
    assert get("/v1/nothing-here", "sesame") == 404


# --- 0006, alone on pristine vllm-mlx ----------------------------------------------------------

RACE_PROBE = """
import sys, threading, time
from collections import deque
from types import SimpleNamespace
from vllm_mlx.scheduler import Scheduler
sys.setswitchinterval(1e-6)  # switch threads as often as possible: the race shows within milliseconds
s = Scheduler.__new__(Scheduler)
req = lambda i: SimpleNamespace(request_id=str(i), arrival_time=0.0, num_prompt_tokens=1, max_tokens=1,
                                cache_hit_type=None, cached_tokens=0)
s.waiting, s.running = deque(req(i) for i in range(64)), {}
stop = False
def churn():  # the engine's worker thread queueing and starting requests
    i = 0
    while not stop:
        s.waiting.append(req(i)); s.waiting.popleft(); i += 1
t = threading.Thread(target=churn); t.start()
errors, deadline = 0, time.monotonic() + 1.0
while time.monotonic() < deadline:  # the event loop serving /health meanwhile
    try:
        s.get_running_requests_info()
    except RuntimeError:
        errors += 1
stop = True; t.join()
print(errors)
"""


def test_status_reads_copies_of_the_queues_while_the_engine_steps(tmp_path):
    """/health's request listing (Scheduler.get_running_requests_info) while another thread queues
    requests: pristine vllm-mlx raises "deque mutated during iteration" (a /health 500 seen by the
    interactions campaign), 0006 alone never does."""
    import os
    import subprocess
    import sys

    errors = {}
    for name, numbers in (("pristine", ()), ("0006", ("0006",))):
        tree = make_tree(tmp_path / name, numbers)
        r = subprocess.run([sys.executable, "-c", RACE_PROBE], env={**os.environ, "PYTHONPATH": str(tree)},
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        errors[name] = int(r.stdout.split()[-1])
    assert errors["pristine"] > 0 and errors["0006"] == 0, errors
