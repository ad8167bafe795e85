"""End to end: the real patched vllm-mlx server with --cache-backend persist_q4, driven by the
official openai and anthropic clients.

Tolerance: greedy decoding; hot and reloaded-from-disk caches hold the same bits, so their outputs
must be identical. Cold prefill vs reuse of a 4-bit cache is equal up to float rounding in the
attention (tests/test_q4cache.py bounds the logit difference); on these models the greedy tokens
are identical and we assert that.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import anthropic
import openai
import pytest

from vllm_mlx_persist.disk_format import MODEL_DIR_RE
from vllm_mlx_persist.tools.serving import Server
from vllm_mlx_persist.tools.models.build import build_model_dir

MAX_TOKENS = 12
# Small blocks: a few turns span many blocks. Matching by text is off here: these tests compare an
# agent's output with a cold agent on the same re-rendered messages, i.e. the same prompt tokens;
# with it on, an agent is served as the tokens it generated (equal to a cold run on *those*:
# tests/test_e2e_sharing.py).
# key_format q4 is what `auto` chooses on these tiny models and the micro ones (their server logs say so): pinned, a fresh
# server skips the calibration (1.5 s of CPU each on mlx-cpu's own BLAS). `auto` at start-up is
# tested end to end by test_key_formats.py and test_e2e_families.py.
OPTIONS = {"block_size": 32, "hot_mb": 64, "match_text": False, "key_format": "q4"}
WORDS = ("the cache keeps what the agent has read so that a returning agent only "
         "prefills what is new while every other agent keeps its own memory ").split()


def user_text(agent: str, turn: int) -> str:
    body = " ".join(WORDS[(turn * 7 + i) % len(WORDS)] for i in range(60 + 10 * turn))
    return f"{agent} turn {turn}: {body}"


class Chat:
    """One agent's conversation, replayed turn by turn through one API."""

    def __init__(self, agent: str | None, api: str = "openai", id_via: str = "metadata", text_of: str | None = None):
        self.agent, self.api, self.id_via = agent, api, id_via
        self.text_of = text_of or agent or "anon"  # whose conversation it sends (another agent's, replayed)
        self.messages: list[dict] = []
        self.outputs: list[str] = []
        self.cached: list[int] = []
        self.prompt_tokens: list[int] = []

    def turn(self, server: Server, turn: int) -> str:
        self.messages.append({"role": "user", "content": user_text(self.text_of, turn)})
        text, cached, prompt = self.send(server, self.messages)
        self.messages.append({"role": "assistant", "content": text})
        self.outputs.append(text)
        self.cached.append(cached)
        self.prompt_tokens.append(prompt)
        return text

    def send(self, server: Server, messages: list[dict]) -> tuple[str, int, int]:
        kw: dict = {}
        if self.api == "openai":
            if self.agent is not None and self.id_via == "metadata":
                kw["metadata"] = {"agent_id": self.agent}
            elif self.agent is not None and self.id_via == "prompt_cache_key":
                kw["extra_body"] = {"prompt_cache_key": self.agent}
            elif self.agent is not None:
                kw["extra_headers"] = {"X-Agent-ID": self.agent}
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0, timeout=300)
            r = client.chat.completions.create(model=server.model, messages=messages, max_tokens=MAX_TOKENS,
                                               temperature=0.0, **kw)
            details = r.usage.prompt_tokens_details
            return r.choices[0].message.content, (details.cached_tokens if details else 0) or 0, r.usage.prompt_tokens
        if self.agent is not None and self.id_via == "metadata":
            kw["extra_body"] = {"metadata": {"agent_id": self.agent}}
        elif self.agent is not None:
            kw["extra_headers"] = {"X-Agent-ID": self.agent}
        client = anthropic.Anthropic(base_url=server.url, api_key="test", max_retries=0, timeout=300)
        kw.setdefault("extra_body", {})["temperature"] = 0.0  # this SDK version refuses the keyword
        r = client.messages.create(model=server.model, messages=messages, max_tokens=MAX_TOKENS, **kw)
        cached = r.usage.cache_read_input_tokens or 0
        # Anthropic's convention: input_tokens excludes the tokens read from the cache.
        return r.content[0].text if r.content else "", cached, r.usage.input_tokens + cached


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": build_model_dir(root / "llama", arch="llama", size="tiny", seed=0),
        "other": build_model_dir(root / "other", arch="llama", size="tiny", seed=1),
    }


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    with Server(models["llama"], tmp_path_factory.mktemp("home"), options=OPTIONS) as s:
        yield s


def test_two_agents_concurrent_turns_reuse_their_own_cache(server):
    alice = Chat("alice", api="openai", id_via="metadata")
    bob = Chat("bob", api="anthropic", id_via="header")
    for turn in range(3):
        threads = [threading.Thread(target=c.turn, args=(server, turn)) for c in (alice, bob)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert len(alice.outputs) == len(bob.outputs) == turn + 1, server.log_tail()
    for chat in (alice, bob):
        assert chat.cached[0] == 0
        for t in (1, 2):
            # the whole previous prompt is a prefix of this one; at least all of it is reused,
            # and at least one token is always left to prefill
            assert chat.prompt_tokens[t - 1] <= chat.cached[t] < chat.prompt_tokens[t], (chat.agent, chat.cached)

    # Cold (a new agent) on alice's turn-3 context gives alice's hot output.
    cold = Chat("dave").send(server, alice.messages[:-1])
    assert cold[1] == 0 and cold[0] == alice.outputs[2]

    stats = server.get_json("/v1/cache/stats")
    assert "persist_q4" in str(stats), stats


def test_agents_never_see_each_others_cache(server):
    alice = Chat("alice-iso")
    alice.turn(server, 0)
    alice.turn(server, 1)
    assert alice.cached[1] > 0
    # Identical prompts from another agent, from the anonymous namespace, via another id source.
    for other in (Chat("mallory"), Chat("mallory2", api="anthropic", id_via="metadata"), Chat(None)):
        text, cached, _ = other.send(server, alice.messages[:-1])
        assert cached == 0, other.agent
        assert text == alice.outputs[1]
    # The same agent through prompt_cache_key, and through the header, is the same namespace.
    _, cached, _ = Chat("alice-iso", id_via="prompt_cache_key").send(server, alice.messages[:-1])
    assert cached > 0
    _, cached, _ = Chat("alice-iso", id_via="header").send(server, alice.messages[:-1])
    assert cached > 0


def test_anonymous_requests_reuse_by_prefix(server):
    anon = Chat(None)
    anon.turn(server, 5)
    anon.turn(server, 6)
    # Turn 1 may share the chat template's first tokens with earlier anonymous requests, no more.
    assert anon.cached[0] < 8 and anon.cached[1] >= anon.prompt_tokens[0]


@pytest.mark.parametrize("bad", ["../../etc/passwd", "a b", "x" * 129, "", "é"])
def test_bad_agent_id_is_400_and_server_keeps_serving(server, bad):
    messages = [{"role": "user", "content": "hello"}]
    with pytest.raises(openai.BadRequestError) as e:
        Chat(bad).send(server, messages)
    assert "agent id" in str(e.value)
    with pytest.raises(anthropic.BadRequestError):
        Chat(bad, api="anthropic", id_via="metadata").send(server, messages)
    if bad.isascii() and bad:  # header values must be ASCII for the HTTP client itself
        with pytest.raises(openai.BadRequestError):
            Chat(bad, id_via="header").send(server, messages)
    text, _, _ = Chat("good").send(server, messages)
    assert isinstance(text, str)


def _block_files(home: Path) -> list[Path]:
    return sorted((home / ".cache" / "vllm-mlx-persist").glob("*/blocks/*/*.safetensors"))


def test_restarts_reload_and_match_a_server_never_restarted(models, tmp_path):
    # The reference: alice's turns before any restart. Then the same conversation as another agent
    # (agents never share a cache), with the server restarted between its turns.
    home = tmp_path / "home"
    reference, chat = Chat("alice"), Chat("alice-restarted", text_of="alice")
    srv = Server(models["llama"], home, options=OPTIONS).start()
    try:
        for turn in range(3):
            reference.turn(srv, turn)
        assert reference.cached[0] == 0 and all(c > 0 for c in reference.cached[1:])
        chat.turn(srv, 0)
        srv.restart(signal.SIGTERM)
        chat.turn(srv, 1)
        srv.restart(signal.SIGKILL)  # killed right after the response completed
        chat.turn(srv, 2)
        assert chat.outputs == reference.outputs, srv.log_tail()
        assert chat.cached == reference.cached, srv.log_tail()
        assert chat.cached[1] >= chat.prompt_tokens[0] and chat.cached[2] >= chat.prompt_tokens[1]

        # A corrupted block: detected, set aside, answered correctly from a cold prefill.
        srv.stop(signal.SIGTERM)
        files = _block_files(home)
        assert files, "no block files were written"
        first = files[0]
        raw = bytearray(first.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        first.write_bytes(bytes(raw))
        for f in files[1:]:  # truncate the rest: every block of the chain is now bad
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        srv.start()
        text, cached, _ = chat.send(srv, reference.messages[:-1])
        assert cached == 0 and text == reference.outputs[2]
        quarantined = list((home / ".cache" / "vllm-mlx-persist").glob("*/quarantine/*"))
        assert quarantined, "bad files were not set aside"
        # ... and the server keeps serving and caching that agent.
        text2, cached2, _ = chat.send(srv, reference.messages[:-1])
        assert cached2 > 0 and text2 == text
    finally:
        srv.stop()


def test_cache_from_another_model_is_never_served(models, tmp_path):
    home = tmp_path / "home"
    chat = Chat("alice")
    with Server(models["llama"], home, options=OPTIONS) as s:
        chat.turn(s, 0)
        chat.turn(s, 1)
    cache_root = home / ".cache" / "vllm-mlx-persist"
    (llama_dir,) = _model_dirs(cache_root)

    other = Server(models["other"], home, options=OPTIONS).start()
    try:
        text, cached, _ = chat.send(other, chat.messages[:-1])
        assert cached == 0
        other.stop()
        # Plant the first model's agent manifests and blocks in the other model's directory.
        (other_dir,) = [p for p in _model_dirs(cache_root) if p != llama_dir]
        for src in llama_dir.rglob("*"):
            if src.is_file() and src.parent.name != "tmp" and src.name != "model.json":
                dst = other_dir / src.relative_to(llama_dir)
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes(src.read_bytes())
        other.start()
        text2, cached2, _ = chat.send(other, chat.messages[:-1])
        assert cached2 == 0 and text2 == text
    finally:
        other.stop()


def test_unsupported_model_is_refused_at_startup(tmp_path):
    """gemma2 computes attention scores itself (no shared SDPA): refused, naming type and reason."""
    from mlx_lm.utils import _get_classes

    from vllm_mlx_persist.tools.models.build import _draw_weights, model_config, train_tokenizer, write_model_files

    config = {**model_config("llama", "tiny"), "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"],
              "query_pre_attn_scalar": 64}
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.load_weights(list(_draw_weights(model, "gemma2", 0).items()))
    (tmp_path / "gemma2").mkdir()
    write_model_files(tmp_path / "gemma2", model, config, train_tokenizer(config["vocab_size"]), {})
    srv = Server(tmp_path / "gemma2", tmp_path / "home")
    with pytest.raises(RuntimeError) as e:
        srv.start(timeout=120)
    assert "gemma2" in str(e.value) + srv.log_tail() and "computes the scores itself" in str(e.value) + srv.log_tail()


def test_a_key_format_the_model_cannot_take_stops_the_server(tmp_path):
    """issue #50: `key_format: k6v4c` on a model with attention sinks (gpt_oss) started a server that
    stored plain q4 after a logged traceback. It now exits non-zero at start-up with one line naming
    the layer and the property, and writes no cache."""
    model = build_model_dir(tmp_path / "gpt_oss", arch="gpt_oss", size="tiny")
    srv = Server(model, tmp_path / "home", options={**OPTIONS, "key_format": "k6v4c"})
    with pytest.raises(RuntimeError, match=r"server exited with [1-9]") as e:
        srv.start(timeout=120)
    line = "persist_q4 key_format k6v4c cannot be served on this model: layer 0: its attention takes sinks"
    log = str(e.value) + srv.log_tail()
    assert line in log and "keys stored as q4" not in log
    assert not list((tmp_path / "home").rglob("*.safetensors"))


def test_streaming_paths_carry_the_agent_and_report_cached_tokens(server):
    chat = Chat("streamer")
    chat.turn(server, 0)
    messages = chat.messages + [{"role": "user", "content": user_text("streamer", 1)}]

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0, timeout=300)
    stream = client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Agent-ID": "streamer"})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage][-1]
    assert usage.prompt_tokens_details.cached_tokens >= chat.prompt_tokens[0]
    assert text == Chat("streamer-ref").send(server, messages)[0]  # streamed == non-streamed, cold

    aclient = anthropic.Anthropic(base_url=server.url, api_key="test", max_retries=0, timeout=300)
    with aclient.messages.stream(model=server.model, messages=messages, max_tokens=MAX_TOKENS,
                                 extra_body={"temperature": 0.0, "metadata": {"agent_id": "streamer"}}) as s:
        atext = "".join(s.text_stream)
        final = s.get_final_message()
    assert final.usage.cache_read_input_tokens >= chat.prompt_tokens[0]
    # The same messages: Anthropic splits OpenAI's prompt_tokens into uncached + cache reads.
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == usage.prompt_tokens
    assert final.usage.input_tokens < usage.prompt_tokens
    assert atext.strip() == text.strip()


def test_second_server_on_the_same_cache_dir_is_refused(server, models):
    """A second server on a cache directory in use exits at start-up, naming the holder; the
    first keeps serving."""
    second = Server(models["llama"], server.home, options=OPTIONS)
    with pytest.raises(RuntimeError, match="in use by another server"):
        second.start(timeout=120)
    assert second.proc is None or second.proc.poll() is not None
    chat = Chat("after-refusal")
    chat.turn(server, 0)
    assert chat.outputs[0]


def test_responses_api_carries_the_agent_and_reports_cached_tokens(server):
    """/v1/responses: metadata.agent_id and prompt_cache_key name the agent, streamed and not;
    input_tokens_details.cached_tokens reports reuse; output equals chat completions; bad id 400."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="test", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": user_text("resp", 0)}]
    r1 = client.responses.create(model=server.model, input=messages, max_output_tokens=MAX_TOKENS,
                                 temperature=0.0, metadata={"agent_id": "resp-agent"})
    assert r1.usage.input_tokens_details.cached_tokens == 0
    assert r1.output_text == Chat("resp-ref").send(server, messages)[0]
    messages += [{"role": "assistant", "content": r1.output_text},
                 {"role": "user", "content": user_text("resp", 1)}]
    r2 = client.responses.create(model=server.model, input=messages, max_output_tokens=MAX_TOKENS,
                                 temperature=0.0, extra_body={"prompt_cache_key": "resp-agent"})
    assert r1.usage.input_tokens <= r2.usage.input_tokens_details.cached_tokens < r2.usage.input_tokens
    # Streamed, same agent, same messages: all but the last token reused; another agent: nothing.
    with client.responses.stream(model=server.model, input=messages, max_output_tokens=MAX_TOKENS,
                                 temperature=0.0, metadata={"agent_id": "resp-agent"}) as s:
        final = s.get_final_response()
    assert final.usage.input_tokens_details.cached_tokens == r2.usage.input_tokens - 1
    assert final.output_text == r2.output_text
    other = client.responses.create(model=server.model, input=messages, max_output_tokens=MAX_TOKENS,
                                    temperature=0.0, metadata={"agent_id": "resp-other"})
    assert other.usage.input_tokens_details.cached_tokens == 0 and other.output_text == r2.output_text
    with pytest.raises(openai.BadRequestError, match="agent"):
        client.responses.create(model=server.model, input=messages, max_output_tokens=MAX_TOKENS,
                                metadata={"agent_id": "../etc"})


def _model_dirs(root: Path) -> list[Path]:
    """The model directories of a cache root, whatever their model.json holds (not key-formats/)."""
    return [p for p in root.iterdir() if p.is_dir() and MODEL_DIR_RE.fullmatch(p.name)]


def _model_cache_dir(home: Path) -> Path:
    (d,) = _model_dirs(home / ".cache" / "vllm-mlx-persist")
    return d


def _damage_model_json(model_dir: Path, how: str) -> None:
    path = model_dir / "model.json"
    info = json.loads(path.read_text())
    path.unlink()
    if how == "invalid_json":
        path.write_text("{trunc")
    elif how == "zero_length":
        path.write_bytes(b"")
    elif how == "directory":
        path.mkdir()
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "deep_json":
        path.write_bytes(b"[" * 100_000)
    elif how == "other_fingerprint":
        path.write_text(json.dumps({**info, "fingerprint": info["fingerprint"][:32] + "0" * 32}))
    elif how == "other_format_version":
        path.write_text(json.dumps({**info, "format_version": info["format_version"] + 1}))


MODEL_DIR_DAMAGE = ["invalid_json", "zero_length", "directory", "fifo", "deep_json", "other_fingerprint",
                    "other_format_version"]
# Through a real server: one damage that makes model.json unreadable (a FIFO: opening it must not
# block) and one that names another model. Every damage raises a StoreError from DiskStore, the one
# error the backend turns into "disk tier disabled": test_every_model_json_damage_is_a_store_error.
SERVED_DAMAGE = ["fifo", "other_fingerprint"]


@pytest.mark.parametrize("how", MODEL_DIR_DAMAGE)
def test_every_model_json_damage_is_a_store_error(tmp_path, how):
    """Each way model.json can be damaged makes DiskStore refuse the directory with a StoreError (what
    the backend catches to serve from memory) and leaves the file as it was, for the operator."""
    from vllm_mlx_persist.disk_format import FORMAT_VERSION
    from vllm_mlx_persist.store import DiskStore, StoreError

    fmt = {"format_version": FORMAT_VERSION, "bits": 4, "group_size": 64, "block_size": 16}
    fp = "ab" * 32
    store = DiskStore(tmp_path, fp, {"model_type": "llama", "n_layers": 2}, fmt)
    _damage_model_json(store.dir, how)
    before = os.stat(store.dir / "model.json", follow_symlinks=False)
    with pytest.raises(StoreError):
        DiskStore(tmp_path, fp, {"model_type": "llama", "n_layers": 2}, fmt)
    after = os.stat(store.dir / "model.json", follow_symlinks=False)
    assert (after.st_mode, after.st_size, after.st_ino) == (before.st_mode, before.st_size, before.st_ino)


def test_unusable_model_directory_serves_from_memory_and_says_so(models, tmp_path):
    """When the model's directory under the cache root cannot be opened, every request still
    succeeds (never "ready but every request 500"), agents are cached in memory, and /v1/status
    says the disk tier is off and why; the directory is left as it was for the operator."""
    home = tmp_path / "home"
    reference = Chat("alice")
    srv = Server(models["llama"], home, options=OPTIONS).start()
    try:
        reference.turn(srv, 0)
        reference.turn(srv, 1)
        srv.stop()
        model_dir = _model_cache_dir(home)
        pristine = (model_dir / "model.json").read_bytes()
        for how in SERVED_DAMAGE:
            _damage_model_json(model_dir, how)
            srv.start()
            health = srv.get_json("/health")
            assert health["status"] == "healthy"  # it serves...
            assert health["cache_backend"]["disk_tier"] == "disabled", (how, health)  # ...without its disk tier
            assert health["cache_backend"]["disk_error"] == srv.get_json("/v1/status")["cache"]["disk_error"]
            chat = Chat(f"agent-{how.replace('_', '-')}")
            chat.turn(srv, 0)
            chat.turn(srv, 1)
            assert chat.cached[1] >= chat.prompt_tokens[0], how  # the in-memory tier works
            cold = Chat("cold").send(srv, chat.messages[:-1])
            assert cold[1] == 0 and cold[0] == chat.outputs[1], (how, srv.log_tail())
            assert Chat(None).send(srv, reference.messages[:1])[0] == reference.outputs[0]  # anonymous too
            cache = srv.get_json("/v1/status")["cache"]
            assert cache["disk_tier"] == "disabled", (how, cache)
            assert any(w in cache["disk_error"] for w in ("model.json", "another model", "format version")), cache
            assert "disk tier DISABLED" in srv.log_tail(400), how
            srv.stop()
            path = model_dir / "model.json"
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
            else:
                path.unlink()
            path.write_bytes(pristine)
        srv.start()  # repaired: the disk tier is back, with alice's turns from before
        assert srv.get_json("/v1/status")["cache"]["disk_tier"] == "on"
        assert srv.get_json("/health")["cache_backend"] == {"backend": "persist_q4", "disk_tier": "on"}
        _, cached, _ = reference.send(srv, reference.messages[:-1])
        assert cached >= reference.prompt_tokens[0]
    finally:
        srv.stop()


@pytest.mark.parametrize("case", ["lock_is_directory", "root_is_file"])
def test_unusable_cache_root_is_refused_in_one_line(models, tmp_path, case):
    root = tmp_path / "root"
    if case == "root_is_file":
        root.write_text("x")
    else:
        (root / ".lock").mkdir(parents=True)
    srv = Server(models["llama"], tmp_path / "home", options={**OPTIONS, "cache_dir": str(root)})
    with pytest.raises(RuntimeError, match="exited with 3"):
        srv.start(timeout=120)
    log = srv.log_tail(400)
    assert "Traceback" not in log, log
    (line,) = [l for l in log.splitlines() if "persist_q4: " in l and "ERROR" in l]
    assert str(root) in line and ("is not a directory" in line or ".lock: Is a directory" in line), line


def _stat(stats, key):
    if isinstance(stats, dict):
        if key in stats:
            return stats[key]
        for v in stats.values():
            found = _stat(v, key)
            if found is not None:
                return found
    return None


def test_float_decode_mirror_replies_equal_quantized_decode(models, tmp_path):
    """Four agents batched together, two turns each, greedy: a server whose batched decode runs on
    the float decode mirror (decode_float_mb 256) gives the same replies as one on the 4-bit
    matmuls (decode_float_mb 0), the second turns starting from the floats the first ones carried. The two attend over the same 4-bit K/V values; the logits differ
    by float rounding only (~5e-6 of their std, tests/test_q4cache.py), far below the top-2 gap of
    these greedy choices, so the replies are asserted equal. The mirror bytes go back to 0."""
    agents = ["m-alice", "m-bob", "m-carol", "m-dave"]
    replies, stats = {}, {}
    for mb in (0, 256):
        with Server(models["llama"], tmp_path / f"home{mb}", options={**OPTIONS, "decode_float_mb": mb}) as srv:
            chats = [Chat(a, api="openai" if i % 2 == 0 else "anthropic") for i, a in enumerate(agents)]
            warm_builds = _stat(srv.get_json("/v1/cache/stats"), "decode_float_builds")
            for turn in range(2):
                threads = [threading.Thread(target=c.turn, args=(srv, turn)) for c in chats]
                [t.start() for t in threads]
                [t.join() for t in threads]
                assert all(len(c.outputs) == turn + 1 for c in chats), srv.log_tail()
            replies[mb] = [c.outputs for c in chats]
            assert all(c.cached[1] > 0 for c in chats)
            for _ in range(50):  # the finished batch's caches are freed right after its last step
                stats[mb] = srv.get_json("/v1/cache/stats")
                if _stat(stats[mb], "decode_float_bytes") == 0:
                    break
                threading.Event().wait(0.1)
            stats[mb]["warm_builds"] = warm_builds
    assert replies[256] == replies[0]
    assert len({tuple(r) for r in replies[0]}) > 1  # not degenerate
    assert _stat(stats[0], "decode_float_budget_bytes") == 0 and _stat(stats[0], "decode_float_builds") == 0
    assert _stat(stats[256], "decode_float_budget_bytes") == 256 * 2**20
    # the requests' batches decoded on mirrors (beyond the warm-up's), none refused by the budget
    assert _stat(stats[256], "decode_float_builds") > stats[256]["warm_builds"] > 0
    assert _stat(stats[256], "decode_float_refused") == 0
    assert _stat(stats[0], "decode_float_bytes") == _stat(stats[256], "decode_float_bytes") == 0
    # the second turns started their mirrors from the floats the first turns carried (carry_float_mb
    # "auto"), in the server as in tests/test_hotturn.py; without a mirror there is nothing to carry
    assert _stat(stats[256], "carry_float_kept") > 0 and _stat(stats[256], "carry_float_used") > 0
    assert _stat(stats[256], "decode_float_from_carry") > 0
    assert _stat(stats[0], "carry_float_kept") == 0 and _stat(stats[0], "carry_float_bytes") == 0


@pytest.mark.parametrize("key", ["decode_float_mb", "carry_float_mb"])
def test_decode_float_option_is_checked(key):
    from vllm_mlx_persist.options import parse_options

    assert parse_options({})[key] == "auto"
    assert parse_options({key: 0})[key] == 0.0
    assert parse_options({key: "512"})[key] == 512.0
    for bad in (-1, "fast", True, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=key):
            parse_options({key: bad})


def test_k8v4_keys_through_a_server_and_a_restart(models, tmp_path):
    """key_format k8v4 (issue #33) end to end: an agent's second turn reuses its first, a cold agent
    on the same messages gets the same answer, a restarted server reads the 8-bit-key blocks back
    from disk and answers the same again; /v1/status shows the format, the start-up log names it."""
    opts = {**OPTIONS, "key_format": "k8v4"}
    alice = Chat("alice-k8")
    with Server(models["llama"], tmp_path / "home", options=opts) as s:
        alice.turn(s, 0)
        alice.turn(s, 1)
        assert alice.prompt_tokens[0] <= alice.cached[1] < alice.prompt_tokens[1]
        cold = Chat("dave-k8").send(s, alice.messages[:-1])
        assert cold[1] == 0 and cold[0] == alice.outputs[1]
        assert s.get_json("/v1/status")["cache"]["key_format"]["chosen"] == "k8v4"
        assert "key format k8v4" in s.log_tail(400)
        s.restart()
        again = Chat("alice-k8").send(s, alice.messages[:-1])
        assert again[1] >= alice.prompt_tokens[0] and again[0] == alice.outputs[1]
